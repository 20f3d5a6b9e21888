"""Graph-diff golden tests: the FX graph each DSA-family spelling gives before the
selection pass and after it (normalized by ``hyscale_compile.testing.graph_text``).
Regenerate with ``EXPECTTEST_ACCEPT=1 pytest tests/test_golden_graphs.py``."""
import expecttest
import torch
import torch.nn.functional as F

import hyscale_compile  # noqa: F401
from hyscale_compile.testing import graph_text

B, S, T, H, D, K = 2, 8, 8, 4, 16, 4


def graphs(fn, *args):
    torch._dynamo.reset()
    cap = []
    with torch.no_grad():
        torch.compile(fn, backend="hyscale_debug", fullgraph=True, options={"hyscale.capture": cap})(*args)
    before = next(t for k, t in cap if k == "inference:before")
    after = graph_text(next(g for k, g in cap if k == "inference").graph)
    return f"BEFORE\n{before}\nAFTER\n{after}"


def official_v4(q, k, w):
    s = torch.einsum("bshd,btd->bsht", q, k)
    s = (s.relu_() * w.unsqueeze(-1)).sum(dim=2)
    s = s + torch.full((s.size(1), s.size(2)), float("-inf")).triu_(1)
    return s.topk(min(K, s.size(-1)), dim=-1, sorted=False)[1]


def hf_dsv32(q, k, w, mask):
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * D**-0.5
    scores = F.relu(scores)
    index_scores = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)
    index_scores = index_scores.masked_fill(~mask, float("-inf"))
    return index_scores.topk(min(K, T), dim=-1).indices.to(torch.int32)


def megatron(q, k, w, mask):
    s = torch.einsum("sbhd,tbd->sbht", q.float(), k.float())
    s = torch.relu(s)
    s = (s * w.unsqueeze(-1)).sum(dim=2).transpose(0, 1)
    s = s + mask
    vals, idx = s.topk(K, dim=-1)
    return idx.masked_fill(vals == float("-inf"), -1)


def kernel_test(q, kv, w, ks, ke):
    s = torch.einsum("mhd,nd->hmn", q, kv).relu()
    s = (s * w.unsqueeze(-1).transpose(0, 1)).sum(dim=0)
    n = torch.arange(kv.shape[0])
    in_range = (n[None, :] >= ks[:, None]) & (n[None, :] < ke[:, None])
    return s.masked_fill(~in_range, float("-inf")).topk(K, dim=-1).indices


def hf_dsv4_threshold(q, kc, w, position_ids, ratio=2):
    scores = torch.matmul(q.float(), kc.transpose(-1, -2).float().unsqueeze(1))
    scores = F.relu(scores) * D**-0.5
    scores = (scores * w.unsqueeze(-1)).sum(dim=2)
    thr = (position_ids + 1) // ratio
    future = torch.arange(kc.shape[1]) >= thr.unsqueeze(-1)
    scores = scores.masked_fill(future, float("-inf"))
    idx = scores.topk(K, dim=-1).indices
    return torch.where(idx >= thr.unsqueeze(-1), -1, idx)


class TestGoldenGraphs(expecttest.TestCase):
    def test_official_v4_einsum(self):
        g = torch.Generator().manual_seed(0)
        args = (torch.randn(B, S, H, D, generator=g), torch.randn(B, T, D, generator=g), torch.randn(B, S, H, generator=g))
        self.assertExpectedInline(graphs(official_v4, *args), """\
BEFORE
in0: f32[2, 8, 4, 16]
in1: f32[2, 8, 16]
in2: f32[2, 8, 4]
v0: f32[2, 8, 4, 16, 1] = aten.unsqueeze(in0, 4)
v1: f32[2, 8, 4, 1, 16] = aten.permute(v0, [0, 1, 2, 4, 3])
v2: f32[2, 8, 16, 1] = aten.unsqueeze(in1, 3)
v3: f32[2, 8, 16, 1, 1] = aten.unsqueeze(v2, 4)
v4: f32[2, 1, 1, 8, 16] = aten.permute(v3, [0, 3, 4, 1, 2])
v5: f32[2, 8, 4, 16, 1] = aten.permute(v1, [0, 1, 2, 4, 3])
v6: f32[2, 32, 16] = aten.view(v5, [2, 32, 16])
v7: f32[2, 16, 8, 1, 1] = aten.permute(v4, [0, 4, 3, 1, 2])
v8: f32[2, 16, 8] = aten.view(v7, [2, 16, 8])
v9: f32[2, 32, 8] = aten.bmm(v6, v8)
v10: f32[2, 8, 4, 1, 8] = aten.view(v9, [2, 8, 4, 1, 8])
v11: f32[2, 8, 4, 8, 1] = aten.permute(v10, [0, 1, 2, 4, 3])
v12: f32[2, 8, 4, 8] = aten.view(v11, [2, 8, 4, 8])
v13: f32[2, 8, 4, 8] = aten.relu(v12)
v14: f32[2, 8, 4, 8, 1] = aten.view(v13, [2, 8, 4, 8, 1])
v15: f32[2, 8, 4, 1, 8] = aten.permute(v14, [0, 1, 2, 4, 3])
v16: f32[2, 32, 8] = aten.view(v15, [2, 32, 8])
v17: f32[2, 8, 4, 1, 8] = aten.view(v16, [2, 8, 4, 1, 8])
v18: f32[2, 8, 4, 8, 1] = aten.permute(v17, [0, 1, 2, 4, 3])
v19: f32[2, 8, 4, 8] = aten.view(v18, [2, 8, 4, 8])
v20: f32[2, 8, 4, 1] = aten.unsqueeze(in2, -1)
v21: f32[2, 8, 4, 8] = aten.mul.Tensor(v19, v20)
v22: f32[2, 8, 8] = aten.sum.dim_IntList(v21, [2])
v23: f32[8, 8] = aten.full([8, 8], -inf, dtype=f32)
v24: i64[8] = prims.iota(8, start=0, step=1, dtype=i64)
v25: i64[1, 8] = aten.unsqueeze(v24, -2)
v26: i64[8] = prims.iota(8, start=0, step=1, dtype=i64)
v27: i64[8, 1] = aten.unsqueeze(v26, -1)
v28: i64[8, 8] = aten.sub.Tensor(v25, v27)
v29: b8[8, 8] = aten.ge.Scalar(v28, 1)
v30: f32[] = aten.scalar_tensor(0, dtype=f32)
v31: f32[8, 8] = aten.where.self(v29, v23, v30)
v32: f32[2, 8, 8] = aten.add.Tensor(v22, v31)
v33: (f32[2, 8, 4], i64[2, 8, 4]) = aten.topk(v32, 4, -1, True, False)
v34: i64[2, 8, 4] = getitem(v33, 1)
return (v34,)
AFTER
in0: f32[2, 8, 4, 16]
in1: f32[2, 8, 16]
in2: f32[2, 8, 4]
v0: f32[2, 8, 4, 1] = aten.unsqueeze(in2, -1)
v1: i64[8] = prims.iota(8, start=0, step=1, dtype=i64)
v2: f32[2, 8, 1, 16] = aten.unsqueeze(in1, 2)
v3: f32[2, 8, 4] = aten.squeeze.dim(v0, -1)
v4: i64[1, 8] = aten.unsqueeze(v1, 0)
v5: i64[1, 8] = aten.add.Tensor(v4, 1)
v6: i32[2, 8, 4] = hyscale.hytopk(in0, v2, v3, [v5], 4, {"v":1,"name":"dsa","logit_dtype":"float32","epilogue":[["relu"]],"reduce":"weighted_sum","post":[["mask",0]],"masks":[{"kind":"range","lo":null,"hi":0,"mode":"add","value":-Infinity}],"score_dtype":"float32","fp32_precision":"ieee"}, False)
v7: i64[2, 8, 4] = prims.convert_element_type(v6, i64)
return (v7,)""")

    def test_hf_deepseek_v32(self):
        g = torch.Generator().manual_seed(0)
        args = (torch.randn(B, S, H, D, generator=g).bfloat16(), torch.randn(B, T, D, generator=g).bfloat16(),
                torch.randn(B, S, H, generator=g), torch.ones(S, T, dtype=torch.bool).tril())
        self.assertExpectedInline(graphs(hf_dsv32, *args), """\
BEFORE
in0: bf16[2, 8, 4, 16]
in1: bf16[2, 8, 16]
in2: f32[2, 8, 4]
in3: b8[8, 8]
v0: f32[2, 8, 4, 16] = prims.convert_element_type(in0, f32)
v1: bf16[2, 16, 8] = aten.permute(in1, [0, 2, 1])
v2: f32[2, 16, 8] = prims.convert_element_type(v1, f32)
v3: f32[2, 1, 16, 8] = aten.unsqueeze(v2, 1)
v4: f32[2, 8, 4, 16] = aten.expand(v0, [2, 8, 4, 16])
v5: f32[16, 4, 16] = aten.view(v4, [16, 4, 16])
v6: f32[2, 8, 16, 8] = aten.expand(v3, [2, 8, 16, 8])
v7: f32[2, 8, 16, 8] = aten.clone(v6)
v8: f32[16, 16, 8] = aten.view(v7, [16, 16, 8])
v9: f32[16, 4, 8] = aten.bmm(v5, v8)
v10: f32[2, 8, 4, 8] = aten.view(v9, [2, 8, 4, 8])
v11: f32[2, 8, 4, 8] = aten.mul.Tensor(v10, 0.25)
v12: f32[2, 8, 4, 8] = aten.relu(v11)
v13: f32[2, 8, 1, 4] = aten.unsqueeze(in2, -2)
v14: f32[2, 8, 1, 4] = aten.expand(v13, [2, 8, 1, 4])
v15: f32[16, 1, 4] = aten.view(v14, [16, 1, 4])
v16: f32[2, 8, 4, 8] = aten.expand(v12, [2, 8, 4, 8])
v17: f32[16, 4, 8] = aten.view(v16, [16, 4, 8])
v18: f32[16, 1, 8] = aten.bmm(v15, v17)
v19: f32[2, 8, 1, 8] = aten.view(v18, [2, 8, 1, 8])
v20: f32[2, 8, 8] = aten.squeeze.dim(v19, -2)
v21: b8[8, 8] = aten.bitwise_not(in3)
v22: f32[] = aten.scalar_tensor(-inf, dtype=f32)
v23: f32[2, 8, 8] = aten.where.self(v21, v22, v20)
v24: (f32[2, 8, 4], i64[2, 8, 4]) = aten.topk(v23, 4)
v25: i64[2, 8, 4] = getitem(v24, 1)
v26: i32[2, 8, 4] = prims.convert_element_type(v25, i32)
return (v26,)
AFTER
in0: bf16[2, 8, 4, 16]
in1: bf16[2, 8, 16]
in2: f32[2, 8, 4]
in3: b8[8, 8]
v0: bf16[2, 8, 1, 16] = aten.unsqueeze(in1, 2)
v1: b8[1, 8, 8] = aten.unsqueeze(in3, 0)
v2: i32[2, 8, 4] = hyscale.hytopk(in0, v0, in2, [v1], 4, {"v":1,"name":"dsa","logit_dtype":"float32","epilogue":[["mul",0.25],["relu"]],"reduce":"weighted_sum","post":[["mask",0]],"masks":[{"kind":"fill","operand":0,"where":false,"value":-Infinity}],"score_dtype":"float32","fp32_precision":"ieee"})
v3: i64[2, 8, 4] = prims.convert_element_type(v2, i64)
v4: i32[2, 8, 4] = prims.convert_element_type(v3, i32)
return (v4,)""")

    def test_megatron_sequence_first(self):
        g = torch.Generator().manual_seed(0)
        args = (torch.randn(S, B, H, D, generator=g).bfloat16(), torch.randn(T, B, D, generator=g).bfloat16(),
                torch.randn(S, B, H, generator=g), torch.full((S, T), float("-inf")).triu(1))
        self.assertExpectedInline(graphs(megatron, *args), """\
BEFORE
in0: bf16[8, 2, 4, 16]
in1: bf16[8, 2, 16]
in2: f32[8, 2, 4]
in3: f32[8, 8]
v0: f32[8, 2, 4, 16] = prims.convert_element_type(in0, f32)
v1: f32[8, 2, 16] = prims.convert_element_type(in1, f32)
v2: f32[8, 2, 4, 16, 1] = aten.unsqueeze(v0, 4)
v3: f32[8, 2, 4, 1, 16] = aten.permute(v2, [0, 1, 2, 4, 3])
v4: f32[8, 2, 16, 1] = aten.unsqueeze(v1, 3)
v5: f32[8, 2, 16, 1, 1] = aten.unsqueeze(v4, 4)
v6: f32[1, 2, 1, 8, 16] = aten.permute(v5, [3, 1, 4, 0, 2])
v7: f32[2, 8, 4, 16, 1] = aten.permute(v3, [1, 0, 2, 4, 3])
v8: f32[2, 8, 4, 16, 1] = aten.clone(v7)
v9: f32[2, 32, 16] = aten.view(v8, [2, 32, 16])
v10: f32[2, 16, 8, 1, 1] = aten.permute(v6, [1, 4, 3, 0, 2])
v11: f32[2, 16, 8] = aten.view(v10, [2, 16, 8])
v12: f32[2, 32, 8] = aten.bmm(v9, v11)
v13: f32[2, 8, 4, 1, 8] = aten.view(v12, [2, 8, 4, 1, 8])
v14: f32[8, 2, 4, 8, 1] = aten.permute(v13, [1, 0, 2, 4, 3])
v15: f32[8, 2, 4, 8] = aten.view(v14, [8, 2, 4, 8])
v16: f32[8, 2, 4, 8] = aten.relu(v15)
v17: f32[8, 2, 4, 1] = aten.unsqueeze(in2, -1)
v18: f32[8, 2, 4, 8] = aten.mul.Tensor(v16, v17)
v19: f32[8, 2, 8] = aten.sum.dim_IntList(v18, [2])
v20: f32[2, 8, 8] = aten.permute(v19, [1, 0, 2])
v21: f32[2, 8, 8] = aten.add.Tensor(v20, in3)
v22: (f32[2, 8, 4], i64[2, 8, 4]) = aten.topk(v21, 4)
v23: f32[2, 8, 4] = getitem(v22, 0)
v24: i64[2, 8, 4] = getitem(v22, 1)
v25: b8[2, 8, 4] = aten.eq.Scalar(v23, -inf)
v26: i64[] = aten.scalar_tensor(-1, dtype=i64)
v27: i64[2, 8, 4] = aten.where.self(v25, v26, v24)
return (v27,)
AFTER
in0: bf16[8, 2, 4, 16]
in1: bf16[8, 2, 16]
in2: f32[8, 2, 4]
in3: f32[8, 8]
v0: f32[8, 2, 4, 1] = aten.unsqueeze(in2, -1)
v1: bf16[2, 8, 4, 16] = aten.permute(in0, [1, 0, 2, 3])
v2: bf16[2, 8, 16] = aten.permute(in1, [1, 0, 2])
v3: bf16[2, 8, 1, 16] = aten.unsqueeze(v2, 2)
v4: f32[2, 8, 4, 1] = aten.permute(v0, [1, 0, 2, 3])
v5: f32[2, 8, 4] = aten.squeeze.dim(v4, -1)
v6: f32[1, 8, 8] = aten.unsqueeze(in3, 0)
v7: (f32[2, 8, 4], i32[2, 8, 4]) = hyscale.hytopk_values(v1, v3, v5, [v6], 4, {"v":1,"name":"dsa","logit_dtype":"float32","epilogue":[["relu"]],"reduce":"weighted_sum","post":[["mask",0]],"masks":[{"kind":"add","operand":0}],"score_dtype":"float32","fp32_precision":"ieee"})
v8: f32[2, 8, 4] = getitem(v7, 0)
v9: i32[2, 8, 4] = getitem(v7, 1)
v10: i64[2, 8, 4] = prims.convert_element_type(v9, i64)
v11: b8[2, 8, 4] = aten.eq.Scalar(v8, -inf)
v12: i64[] = aten.scalar_tensor(-1, dtype=i64)
v13: i64[2, 8, 4] = aten.where.self(v11, v12, v10)
return (v13,)""")

    def test_kernel_test_form_range_mask(self):
        g = torch.Generator().manual_seed(0)
        args = (torch.randn(S, H, D, generator=g), torch.randn(T, D, generator=g), torch.randn(S, H, generator=g),
                torch.tensor([0, 0, 1, 2, 3, 0, 0, 0]), torch.tensor([1, 2, 3, 4, 6, 7, 8, 8]))
        self.assertExpectedInline(graphs(kernel_test, *args), """\
BEFORE
in0: f32[8, 4, 16]
in1: f32[8, 16]
in2: f32[8, 4]
in3: i64[8]
in4: i64[8]
v0: f32[8, 4, 16, 1] = aten.unsqueeze(in0, 3)
v1: f32[4, 8, 1, 16] = aten.permute(v0, [1, 0, 3, 2])
v2: f32[8, 16, 1] = aten.unsqueeze(in1, 2)
v3: f32[8, 16, 1, 1] = aten.unsqueeze(v2, 3)
v4: f32[1, 1, 8, 16] = aten.permute(v3, [2, 3, 0, 1])
v5: f32[4, 8, 16, 1] = aten.permute(v1, [0, 1, 3, 2])
v6: f32[4, 8, 16, 1] = aten.clone(v5)
v7: f32[1, 32, 16] = aten.view(v6, [1, 32, 16])
v8: f32[16, 8, 1, 1] = aten.permute(v4, [3, 2, 0, 1])
v9: f32[1, 16, 8] = aten.view(v8, [1, 16, 8])
v10: f32[1, 32, 8] = aten.bmm(v7, v9)
v11: f32[4, 8, 1, 8] = aten.view(v10, [4, 8, 1, 8])
v12: f32[4, 8, 8, 1] = aten.permute(v11, [0, 1, 3, 2])
v13: f32[4, 8, 8] = aten.view(v12, [4, 8, 8])
v14: f32[4, 8, 8] = aten.relu(v13)
v15: f32[8, 4, 1] = aten.unsqueeze(in2, -1)
v16: f32[4, 8, 1] = aten.permute(v15, [1, 0, 2])
v17: f32[4, 8, 8] = aten.mul.Tensor(v14, v16)
v18: f32[8, 8] = aten.sum.dim_IntList(v17, [0])
v19: i64[8] = prims.iota(8, start=0, step=1, dtype=i64)
v20: i64[1, 8] = aten.unsqueeze(v19, 0)
v21: i64[8, 1] = aten.unsqueeze(in3, 1)
v22: b8[8, 8] = aten.ge.Tensor(v20, v21)
v23: i64[1, 8] = aten.unsqueeze(v19, 0)
v24: i64[8, 1] = aten.unsqueeze(in4, 1)
v25: b8[8, 8] = aten.lt.Tensor(v23, v24)
v26: b8[8, 8] = aten.bitwise_and.Tensor(v22, v25)
v27: b8[8, 8] = aten.bitwise_not(v26)
v28: f32[] = aten.scalar_tensor(-inf, dtype=f32)
v29: f32[8, 8] = aten.where.self(v27, v28, v18)
v30: (f32[8, 4], i64[8, 4]) = aten.topk(v29, 4)
v31: i64[8, 4] = getitem(v30, 1)
return (v31,)
AFTER
in0: f32[8, 4, 16]
in1: f32[8, 16]
in2: f32[8, 4]
in3: i64[8]
in4: i64[8]
v0: f32[8, 4, 1] = aten.unsqueeze(in2, -1)
v1: f32[4, 8, 1] = aten.permute(v0, [1, 0, 2])
v2: f32[1, 8, 4, 16] = aten.unsqueeze(in0, 0)
v3: f32[1, 8, 16] = aten.unsqueeze(in1, 0)
v4: f32[1, 8, 1, 16] = aten.unsqueeze(v3, 2)
v5: f32[8, 4, 1] = aten.permute(v1, [1, 0, 2])
v6: f32[8, 4] = aten.squeeze.dim(v5, -1)
v7: f32[1, 8, 4] = aten.unsqueeze(v6, 0)
v8: i64[1, 8] = aten.unsqueeze(in3, 0)
v9: i64[1, 8] = aten.unsqueeze(in4, 0)
v10: i32[1, 8, 4] = hyscale.hytopk(v2, v4, v7, [v8, v9], 4, {"v":1,"name":"dsa","logit_dtype":"float32","epilogue":[["relu"]],"reduce":"weighted_sum","post":[["mask",0]],"masks":[{"kind":"range","lo":0,"hi":1,"mode":"fill","value":-Infinity}],"score_dtype":"float32","fp32_precision":"ieee"})
v11: i64[1, 8, 4] = prims.convert_element_type(v10, i64)
v12: i64[8, 4] = aten.view(v11, [8, 4])
return (v12,)""")

    def test_hf_deepseek_v4_position_threshold(self):
        g = torch.Generator().manual_seed(0)
        args = (torch.randn(B, S, H, D, generator=g), torch.randn(B, T // 2, D, generator=g), torch.randn(B, S, H, generator=g),
                torch.arange(S).expand(B, S))
        self.assertExpectedInline(graphs(hf_dsv4_threshold, *args), """\
BEFORE
in0: f32[2, 8, 4, 16]
in1: f32[2, 4, 16]
in2: f32[2, 8, 4]
in3: i64[2, 8]
v0: f32[2, 16, 4] = aten.permute(in1, [0, 2, 1])
v1: f32[2, 1, 16, 4] = aten.unsqueeze(v0, 1)
v2: f32[2, 8, 4, 16] = aten.expand(in0, [2, 8, 4, 16])
v3: f32[16, 4, 16] = aten.view(v2, [16, 4, 16])
v4: f32[2, 8, 16, 4] = aten.expand(v1, [2, 8, 16, 4])
v5: f32[2, 8, 16, 4] = aten.clone(v4)
v6: f32[16, 16, 4] = aten.view(v5, [16, 16, 4])
v7: f32[16, 4, 4] = aten.bmm(v3, v6)
v8: f32[2, 8, 4, 4] = aten.view(v7, [2, 8, 4, 4])
v9: f32[2, 8, 4, 4] = aten.relu(v8)
v10: f32[2, 8, 4, 4] = aten.mul.Tensor(v9, 0.25)
v11: f32[2, 8, 4, 1] = aten.unsqueeze(in2, -1)
v12: f32[2, 8, 4, 4] = aten.mul.Tensor(v10, v11)
v13: f32[2, 8, 4] = aten.sum.dim_IntList(v12, [2])
v14: i64[2, 8] = aten.add.Tensor(in3, 1)
v15: i64[2, 8] = aten.div.Tensor_mode(v14, 2, rounding_mode=floor)
v16: i64[4] = prims.iota(4, start=0, step=1, dtype=i64)
v17: i64[2, 8, 1] = aten.unsqueeze(v15, -1)
v18: b8[2, 8, 4] = aten.ge.Tensor(v16, v17)
v19: f32[] = aten.scalar_tensor(-inf, dtype=f32)
v20: f32[2, 8, 4] = aten.where.self(v18, v19, v13)
v21: (f32[2, 8, 4], i64[2, 8, 4]) = aten.topk(v20, 4)
v22: i64[2, 8, 4] = getitem(v21, 1)
v23: i64[2, 8, 1] = aten.unsqueeze(v15, -1)
v24: b8[2, 8, 4] = aten.ge.Tensor(v22, v23)
v25: i64[] = aten.scalar_tensor(-1, dtype=i64)
v26: i64[2, 8, 4] = aten.where.self(v24, v25, v22)
return (v26,)
AFTER
in0: f32[2, 8, 4, 16]
in1: f32[2, 4, 16]
in2: f32[2, 8, 4]
in3: i64[2, 8]
v0: f32[2, 8, 4, 1] = aten.unsqueeze(in2, -1)
v1: i64[2, 8] = aten.add.Tensor(in3, 1)
v2: i64[2, 8] = aten.div.Tensor_mode(v1, 2, rounding_mode=floor)
v3: f32[2, 4, 1, 16] = aten.unsqueeze(in1, 2)
v4: f32[2, 8, 4] = aten.squeeze.dim(v0, -1)
v5: i32[2, 8, 4] = hyscale.hytopk(in0, v3, v4, [v2], 4, {"v":1,"name":"dsa","logit_dtype":"float32","epilogue":[["relu"],["mul",0.25]],"reduce":"weighted_sum","post":[["mask",0]],"masks":[{"kind":"range","lo":null,"hi":0,"mode":"fill","value":-Infinity}],"score_dtype":"float32","fp32_precision":"ieee"})
v6: i64[2, 8, 4] = prims.convert_element_type(v5, i64)
v7: i64[2, 8, 1] = aten.unsqueeze(v2, -1)
v8: b8[2, 8, 4] = aten.ge.Tensor(v6, v7)
v9: i64[] = aten.scalar_tensor(-1, dtype=i64)
v10: i64[2, 8, 4] = aten.where.self(v8, v9, v6)
return (v10,)""")


if __name__ == "__main__":
    import unittest

    unittest.main()
