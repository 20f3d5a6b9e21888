"""Graph-diff golden tests of the attention pass: the inference graph after the pass for the
official V3.2 form (per head), Megatron's absorbed MQA (the simple spelling and the source's
``_unfused_absorbed_dsa_fn``) and HF V3.2 eager's finfo.min index mask over its in-graph causal
mask (normalized by
``hyscale_compile.testing.graph_text``). Regenerate with
``EXPECTTEST_ACCEPT=1 pytest tests/test_golden_attention.py``."""
import expecttest
import torch

import hyscale_compile  # noqa: F401
from hyscale_compile.testing import graph_text
from tests.models import attention_forms as af


def after(fn, *args):
    torch._dynamo.reset()
    cap = []
    with torch.no_grad():
        torch.compile(fn, backend="hyscale_debug", fullgraph=True, options={"hyscale.capture": cap})(*args)
    return graph_text(next(g for k, g in cap if k == "inference").graph)


class TestGoldenAttention(expecttest.TestCase):
    def test_official_v32(self):
        self.assertExpectedInline(after(af.official_v32, *af.make_inputs(0, B=1, S=8, H=2, D=8, Dv=4, Hi=2, Di=8)),
                                  """\
in0: f32[1, 8, 2, 8]
in1: f32[1, 8, 8]
in2: f32[1, 8, 2]
in3: f32[1, 8, 2, 8]
in4: f32[1, 8, 2, 8]
in5: f32[1, 8, 2, 4]
v0: f32[1, 8, 2, 1] = aten.unsqueeze(in2, -1)
v1: i64[8] = prims.iota(8, start=0, step=1, dtype=i64)
v2: f32[8, 2, 8, 1] = aten.permute(in0, [1, 2, 3, 0])
v3: f32[8, 2, 8] = aten.squeeze.dim(v2, -1)
v4: f32[1, 8, 2, 8] = aten.unsqueeze(v3, 0)
v5: f32[8, 8, 1] = aten.permute(in1, [1, 2, 0])
v6: f32[8, 8] = aten.squeeze.dim(v5, -1)
v7: f32[1, 8, 8] = aten.unsqueeze(v6, 0)
v8: f32[1, 8, 1, 8] = aten.unsqueeze(v7, 2)
v9: f32[8, 2, 1, 1] = aten.permute(v0, [1, 2, 0, 3])
v10: f32[8, 2, 1] = aten.squeeze.dim(v9, -1)
v11: f32[8, 2] = aten.squeeze.dim(v10, -1)
v12: f32[1, 8, 2] = aten.unsqueeze(v11, 0)
v13: i64[1, 8] = aten.unsqueeze(v1, 0)
v14: i64[1, 8] = aten.add.Tensor(v13, 1)
v15: i32[1, 8, 4] = hyscale.hytopk(v4, v8, v12, [v14], 4, {"v":1,"name":"dsa","logit_dtype":"float32","epilogue":[["relu"]],"reduce":"weighted_sum","post":[["mask",0]],"masks":[{"kind":"range","lo":null,"hi":0,"mode":"add","value":-Infinity}],"score_dtype":"float32","fp32_precision":"ieee"}, False)
v16: i64[8] = prims.iota(8, start=0, step=1, dtype=i64)
v17: f32[8, 2, 8, 1] = aten.permute(in3, [1, 2, 3, 0])
v18: f32[8, 2, 8] = aten.squeeze.dim(v17, -1)
v19: f32[1, 8, 2, 8] = aten.unsqueeze(v18, 0)
v20: f32[8, 2, 8, 1] = aten.permute(in4, [1, 2, 3, 0])
v21: f32[8, 2, 8] = aten.squeeze.dim(v20, -1)
v22: f32[1, 8, 2, 8] = aten.unsqueeze(v21, 0)
v23: f32[8, 2, 4, 1] = aten.permute(in5, [1, 2, 3, 0])
v24: f32[8, 2, 4] = aten.squeeze.dim(v23, -1)
v25: f32[1, 8, 2, 4] = aten.unsqueeze(v24, 0)
v26: i64[1, 8] = aten.unsqueeze(v16, 0)
v27: i64[1, 8] = aten.add.Tensor(v26, 1)
v28: (f32[1, 8, 2, 4], f32[1, 8, 2], f32[0]) = hyscale.sparse_attention(v19, v22, v25, v15, [v27], {"v":1,"name":"attention","post":[["mul",0.3535533905932738],["mask",0]],"masks":[{"kind":"range","lo":null,"hi":0,"mode":"add","value":-Infinity}],"out_dtype":"float32","fp32_precision":"ieee"})
v29: f32[1, 8, 2, 4] = getitem(v28, 0)
v30: f32[8, 2, 4] = aten.reshape(v29, [8, 2, 4])
v31: f32[2, 8, 4] = aten.permute(v30, [1, 0, 2])
v32: f32[2, 8, 1, 1, 4] = aten.view(v31, [2, 8, 1, 1, 4])
v33: f32[1, 8, 2, 4, 1] = aten.permute(v32, [3, 1, 0, 4, 2])
v34: f32[1, 8, 2, 4] = aten.view(v33, [1, 8, 2, 4])
return (v34,)""")

    def test_megatron_absorbed(self):
        self.assertExpectedInline(after(af.megatron_absorbed, *af.make_mqa_inputs(0, B=1, S=8, H=2, D=12, Hi=2, Di=8)),
                                  """\
in0: f32[1, 8, 2, 8]
in1: f32[1, 8, 8]
in2: f32[1, 8, 2]
in3: f32[8, 1, 2, 12]
in4: f32[8, 1, 1, 12]
v0: f32[1, 8, 2, 1] = aten.unsqueeze(in2, -1)
v1: i64[8] = prims.iota(8, start=0, step=1, dtype=i64)
v2: f32[8, 2, 8, 1] = aten.permute(in0, [1, 2, 3, 0])
v3: f32[8, 2, 8] = aten.squeeze.dim(v2, -1)
v4: f32[1, 8, 2, 8] = aten.unsqueeze(v3, 0)
v5: f32[8, 8, 1] = aten.permute(in1, [1, 2, 0])
v6: f32[8, 8] = aten.squeeze.dim(v5, -1)
v7: f32[1, 8, 8] = aten.unsqueeze(v6, 0)
v8: f32[1, 8, 1, 8] = aten.unsqueeze(v7, 2)
v9: f32[8, 2, 1, 1] = aten.permute(v0, [1, 2, 0, 3])
v10: f32[8, 2, 1] = aten.squeeze.dim(v9, -1)
v11: f32[8, 2] = aten.squeeze.dim(v10, -1)
v12: f32[1, 8, 2] = aten.unsqueeze(v11, 0)
v13: i64[1, 8] = aten.unsqueeze(v1, 0)
v14: i64[1, 8] = aten.add.Tensor(v13, 1)
v15: i32[1, 8, 4] = hyscale.hytopk(v4, v8, v12, [v14], 4, {"v":1,"name":"dsa","logit_dtype":"float32","epilogue":[["relu"]],"reduce":"weighted_sum","post":[["mask",0]],"masks":[{"kind":"range","lo":null,"hi":0,"mode":"add","value":-Infinity}],"score_dtype":"float32","fp32_precision":"ieee"}, False)
v16: i64[8] = prims.iota(8, start=0, step=1, dtype=i64)
v17: f32[8, 1, 1, 8] = aten.slice.Tensor(in4, 3, 0, 8)
v18: f32[8, 2, 12, 1] = aten.permute(in3, [0, 2, 3, 1])
v19: f32[8, 2, 12] = aten.squeeze.dim(v18, -1)
v20: f32[1, 8, 2, 12] = aten.unsqueeze(v19, 0)
v21: f32[8, 12, 1, 1] = aten.permute(in4, [0, 3, 1, 2])
v22: f32[8, 12, 1] = aten.squeeze.dim(v21, -1)
v23: f32[8, 12] = aten.squeeze.dim(v22, -1)
v24: f32[1, 8, 12] = aten.unsqueeze(v23, 0)
v25: f32[1, 8, 1, 12] = aten.unsqueeze(v24, 2)
v26: f32[8, 8, 1, 1] = aten.permute(v17, [0, 3, 1, 2])
v27: f32[8, 8, 1] = aten.squeeze.dim(v26, -1)
v28: f32[8, 8] = aten.squeeze.dim(v27, -1)
v29: f32[1, 8, 8] = aten.unsqueeze(v28, 0)
v30: f32[1, 8, 1, 8] = aten.unsqueeze(v29, 2)
v31: i64[1, 8] = aten.unsqueeze(v16, 0)
v32: i64[1, 8] = aten.add.Tensor(v31, 1)
v33: (f32[1, 8, 2, 8], f32[1, 8, 2], f32[0]) = hyscale.sparse_attention(v20, v25, v30, v15, [v32], {"v":1,"name":"attention","post":[["mul",0.28867513459481287],["mask",0]],"masks":[{"kind":"range","lo":null,"hi":0,"mode":"add","value":-Infinity}],"out_dtype":"float32","fp32_precision":"ieee"})
v34: f32[1, 8, 2, 8] = getitem(v33, 0)
v35: f32[8, 2, 8] = aten.reshape(v34, [8, 2, 8])
v36: f32[2, 8, 8] = aten.permute(v35, [1, 0, 2])
v37: f32[1, 2, 8, 8] = aten.view(v36, [1, 2, 8, 8])
v38: f32[8, 1, 2, 8] = aten.permute(v37, [2, 0, 1, 3])
return (v38,)""")

    def test_hf_v32_eager_finfo_min(self):
        """HF V3.2 eager's finfo.min index mask over its in-graph causal mask, which the
        indexer adds too (passes/visible_rows.py): the op reads the causal range (add
        finfo.min) the selection reads, and no index mask is left."""
        self.assertExpectedInline(after(af.hf_v32_eager_in_graph_mask,
                                        *af.make_inputs(0, B=1, S=8, H=2, D=8, Dv=4, Hi=2, Di=8)), """\
in0: f32[1, 8, 2, 8]
in1: f32[1, 8, 2, 8]
in2: f32[1, 8, 8]
in3: f32[1, 8, 2]
in4: f32[1, 8, 2, 8]
in5: f32[1, 8, 2, 4]
v0: i64[8] = prims.iota(8, start=0, step=1, dtype=i64)
v1: f32[1, 8, 2, 1] = aten.unsqueeze(in3, -1)
v2: f32[8, 2, 8, 1] = aten.permute(in1, [1, 2, 3, 0])
v3: f32[8, 2, 8] = aten.squeeze.dim(v2, -1)
v4: f32[1, 8, 2, 8] = aten.unsqueeze(v3, 0)
v5: f32[8, 8, 1] = aten.permute(in2, [1, 2, 0])
v6: f32[8, 8] = aten.squeeze.dim(v5, -1)
v7: f32[1, 8, 8] = aten.unsqueeze(v6, 0)
v8: f32[1, 8, 1, 8] = aten.unsqueeze(v7, 2)
v9: f32[8, 2, 1, 1] = aten.permute(v1, [1, 2, 0, 3])
v10: f32[8, 2, 1] = aten.squeeze.dim(v9, -1)
v11: f32[8, 2] = aten.squeeze.dim(v10, -1)
v12: f32[1, 8, 2] = aten.unsqueeze(v11, 0)
v13: i64[1, 8] = aten.unsqueeze(v0, 0)
v14: i64[1, 8] = aten.add.Tensor(v13, 1)
v15: i32[1, 8, 4] = hyscale.hytopk(v4, v8, v12, [v14], 4, {"v":1,"name":"dsa","logit_dtype":"float32","epilogue":[["relu"]],"reduce":"weighted_sum","post":[["mask",0]],"masks":[{"kind":"range","lo":null,"hi":0,"mode":"add","value":-3.4028234663852886e+38}],"score_dtype":"float32","fp32_precision":"ieee"}, False)
v16: f32[8, 2, 8, 1] = aten.permute(in0, [1, 2, 3, 0])
v17: f32[8, 2, 8] = aten.squeeze.dim(v16, -1)
v18: f32[1, 8, 2, 8] = aten.unsqueeze(v17, 0)
v19: f32[8, 2, 8, 1] = aten.permute(in4, [1, 2, 3, 0])
v20: f32[8, 2, 8] = aten.squeeze.dim(v19, -1)
v21: f32[1, 8, 2, 8] = aten.unsqueeze(v20, 0)
v22: f32[8, 2, 4, 1] = aten.permute(in5, [1, 2, 3, 0])
v23: f32[8, 2, 4] = aten.squeeze.dim(v22, -1)
v24: f32[1, 8, 2, 4] = aten.unsqueeze(v23, 0)
v25: i64[1, 8] = aten.unsqueeze(v0, 0)
v26: i64[1, 8] = aten.add.Tensor(v25, 1)
v27: (f32[1, 8, 2, 4], f32[1, 8, 2], f32[0]) = hyscale.sparse_attention(v18, v21, v24, v15, [v26], {"v":1,"name":"attention","post":[["mul",0.3535533905932738],["mask",0]],"masks":[{"kind":"range","lo":null,"hi":0,"mode":"add","value":-3.4028234663852886e+38}],"out_dtype":"float32","fp32_precision":"ieee"})
v28: f32[1, 8, 2, 4] = getitem(v27, 0)
v29: f32[8, 2, 4] = aten.reshape(v28, [8, 2, 4])
v30: f32[2, 8, 4] = aten.permute(v29, [1, 0, 2])
v31: f32[1, 2, 8, 4] = aten.view(v30, [1, 2, 8, 4])
v32: f32[1, 8, 2, 4] = aten.permute(v31, [0, 2, 1, 3])
v33: f32[1, 8, 2, 4] = aten.clone(v32)
return (v33,)""")

    def test_megatron_unfused_absorbed_dsa_fn(self):
        """``_unfused_absorbed_dsa_fn`` as its source writes it (tests/models/megatron_dsa.py),
        its index mask scattered in two row chunks: one op, MQA over the latent, the causal row
        mask as a range, empty_row="zero" (its masked_softmax); no chunk, scatter_reduce or
        isfinite is left."""
        import functools

        from tests.models import megatron_dsa as M

        qi, ki, q, lat, w = (t.detach() for t in M.absorbed_site_inputs(0, S=8, NP=2, DI=4))
        fn = functools.partial(M.megatron_absorbed_site, seq_chunk_size=4)
        self.assertExpectedInline(after(fn, qi, ki, q, lat, w), """\
in0: f32[1, 8, 4]
in1: f32[1, 8, 4]
in2: f32[8, 1, 2, 12]
in3: f32[8, 1, 1, 12]
in4: f32[2, 6, 8]
v0: i64[8] = prims.iota(8, start=0, step=1, dtype=i64)
v1: f32[8, 4, 1] = aten.permute(in1, [1, 2, 0])
v2: f32[8, 4] = aten.squeeze.dim(v1, -1)
v3: f32[1, 8, 4] = aten.unsqueeze(v2, 0)
v4: f32[1, 8, 1, 4] = aten.unsqueeze(v3, 2)
v5: f32[8, 4, 1] = aten.permute(in0, [1, 2, 0])
v6: f32[8, 4] = aten.squeeze.dim(v5, -1)
v7: f32[1, 8, 4] = aten.unsqueeze(v6, 0)
v8: f32[1, 8, 1, 4] = aten.unsqueeze(v7, 2)
v9: i64[1, 8] = aten.unsqueeze(v0, 0)
v10: i64[1, 8] = aten.add.Tensor(v9, 1)
v11: i32[1, 8, 4] = hyscale.hytopk(v4, v8, None, [v10], 4, {"v":1,"name":"single-head","logit_dtype":"float32","epilogue":[],"reduce":"none","post":[["mask",0]],"masks":[{"kind":"range","lo":null,"hi":0,"mode":"add","value":-Infinity}],"score_dtype":"float32","fp32_precision":"ieee"}, False)
v12: i64[8] = prims.iota(8, start=0, step=1, dtype=i64)
v13: f32[8, 1, 1, 8] = aten.slice.Tensor(in3, 3, 0, 8)
v14: f32[8, 2, 12, 1] = aten.permute(in2, [0, 2, 3, 1])
v15: f32[8, 2, 12] = aten.squeeze.dim(v14, -1)
v16: f32[1, 8, 2, 12] = aten.unsqueeze(v15, 0)
v17: f32[8, 12, 1, 1] = aten.permute(in3, [0, 3, 1, 2])
v18: f32[8, 12, 1] = aten.squeeze.dim(v17, -1)
v19: f32[8, 12] = aten.squeeze.dim(v18, -1)
v20: f32[1, 8, 12] = aten.unsqueeze(v19, 0)
v21: f32[1, 8, 1, 12] = aten.unsqueeze(v20, 2)
v22: f32[8, 8, 1, 1] = aten.permute(v13, [0, 3, 1, 2])
v23: f32[8, 8, 1] = aten.squeeze.dim(v22, -1)
v24: f32[8, 8] = aten.squeeze.dim(v23, -1)
v25: f32[1, 8, 8] = aten.unsqueeze(v24, 0)
v26: f32[1, 8, 1, 8] = aten.unsqueeze(v25, 2)
v27: i64[1, 8] = aten.unsqueeze(v12, 0)
v28: i64[1, 8] = aten.add.Tensor(v27, 1)
v29: (f32[1, 8, 2, 8], f32[1, 8, 2], f32[0]) = hyscale.sparse_attention(v16, v21, v26, v11, [v28], {"v":1,"name":"attention","post":[["mul",0.28867513459481287],["mask",0]],"masks":[{"kind":"range","lo":null,"hi":0,"mode":"add","value":-Infinity}],"out_dtype":"float32","fp32_precision":"ieee","empty_row":"zero"})
v30: f32[1, 8, 2, 8] = getitem(v29, 0)
v31: f32[8, 2, 8] = aten.reshape(v30, [8, 2, 8])
v32: f32[2, 8, 8] = aten.permute(v31, [1, 0, 2])
v33: f32[1, 2, 8, 8] = aten.view(v32, [1, 2, 8, 8])
v34: f32[8, 1, 2, 8] = aten.permute(v33, [2, 0, 1, 3])
v35: f32[8, 1, 2, 8] = aten.clone(v34)
v36: f32[8, 1, 2, 8, 1] = aten.unsqueeze(v35, 4)
v37: f32[8, 1, 2, 1, 8] = aten.permute(v36, [0, 1, 2, 4, 3])
v38: f32[2, 6, 8, 1] = aten.unsqueeze(in4, 3)
v39: f32[2, 6, 8, 1, 1] = aten.unsqueeze(v38, 4)
v40: f32[1, 1, 2, 6, 8] = aten.permute(v39, [3, 4, 0, 1, 2])
v41: f32[2, 8, 8, 1, 1] = aten.permute(v37, [2, 0, 4, 1, 3])
v42: f32[2, 8, 8] = aten.view(v41, [2, 8, 8])
v43: f32[2, 8, 1, 6, 1] = aten.permute(v40, [2, 4, 1, 3, 0])
v44: f32[2, 8, 6] = aten.view(v43, [2, 8, 6])
v45: f32[2, 8, 6] = aten.bmm(v42, v44)
v46: f32[2, 8, 1, 1, 6] = aten.view(v45, [2, 8, 1, 1, 6])
v47: f32[8, 1, 2, 6, 1] = aten.permute(v46, [1, 3, 0, 4, 2])
v48: f32[8, 1, 2, 6] = aten.view(v47, [8, 1, 2, 6])
v49: f32[8, 1, 2, 6] = aten.clone(v48)
v50: f32[8, 1, 12] = aten.view(v49, [8, 1, -1])
return (v50,)""")
