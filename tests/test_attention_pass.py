"""The attention pass (passes/attention.py): the dense attention that applies a selection's
index mask becomes hyscale.sparse_attention over the k selected keys.

Numerics (docs/contract.md): the reference is the consumer evaluated in float64 at the op's
own indices (the selection's, recomputed in eager: the inputs' selections are unique); for
each output, err(op) <= 2 err(orig) + 2 eps(dtype), err = max |x - ref| / max |ref|, orig =
the original graph run in eager in the same dtype."""
import pytest
import torch

import hyscale_compile  # noqa: F401
from hyscale_compile.passes import diagnostics
from tests.contract import fresh_seed
from tests.models import attention_forms as af

OP = torch.ops.hyscale.sparse_attention.default
BWD = torch.ops.hyscale.sparse_attention_backward.default


def compiled(fn, options=None, dynamic=None):
    torch._dynamo.reset()
    diagnostics.clear()
    cap = []
    opts = {"hyscale.capture": cap, **(options or {})}
    return torch.compile(fn, backend="hyscale_debug", fullgraph=True, dynamic=dynamic, options=opts), cap


def targets(cap, kind):
    return [n.target for k, g in cap if k == kind for n in g.graph.nodes if n.op == "call_function"]


def err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def eps(dtype):
    return torch.finfo(dtype).eps / 2


def assert_numerics(out, orig, ref, dtype, what):
    e_op, e_orig = err(out, ref), err(orig, ref)
    assert e_op <= 2 * e_orig + 2 * eps(dtype), f"{what}: err(op) {e_op:.3g} > 2 err(orig) {e_orig:.3g} + 2 eps"


def attention_records():
    return diagnostics.attention_records()


@pytest.mark.parametrize("i", range(5))
def test_official_v32_inference(i):
    seed = fresh_seed(f"official_v32_inference[{i}]")
    args = af.make_inputs(seed)
    fn, cap = compiled(af.official_v32)
    with torch.no_grad():
        out = fn(*args)
        orig = af.official_v32(*args)
        qi, ki, w, q, k, v = args
        idx = af.indexer(qi, ki, w, 4)
        ref = af.official_v32_attention(idx, q.double(), k.double(), v.double())
    assert OP in targets(cap, "inference")
    assert aten_bmm_count(cap, "inference") == 0, "the dense score and value contractions must be gone"
    recs = attention_records()
    assert len(recs) == 1 and recs[0].rewritten and recs[0].form == "per_head", [r.line() for r in recs]
    assert_numerics(out, orig, ref, torch.float32, "out")


def aten_bmm_count(cap, kind):
    return sum(t is torch.ops.aten.bmm.default for t in targets(cap, kind))


def test_option_off_keeps_attention_dense():
    args = af.make_inputs(0)
    fn, cap = compiled(af.official_v32, {"hyscale.sparse_attention": False})
    with torch.no_grad():
        out = fn(*args)
        torch.testing.assert_close(out, af.official_v32(*args))
    assert OP not in targets(cap, "inference")
    assert torch.ops.hyscale.hytopk.default in targets(cap, "inference")  # the selection still fuses
    recs = attention_records()
    assert len(recs) == 1 and not recs[0].rewritten and "hyscale.sparse_attention=False" in recs[0].reason


def test_explain_reports_the_consumer_and_its_form():
    args = af.make_inputs(0)
    with torch.no_grad():
        rep = hyscale_compile.explain(af.official_v32, *args)
    text = str(rep)
    assert len(rep.attention) == 1 and rep.attention[0].rewritten
    assert "[attention: sparse]" in text and "form per_head" in text and "mul(0.25) -> mask:range -> softmax -> @v" in text
    assert "index order: any deterministic order" in text
