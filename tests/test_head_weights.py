"""Head weights that broadcast against the per-head scores [B, S, H, T] ([H], [1, 1, H],
[B, 1, H], [1, S, H], [B, S, 1]) fuse: the op gets them as a stride-0 expand to [B, S, H]
(no copy). And what the matcher emits, the op accepts: the rewrite runs the op's operand
checks on the fake operands before it replaces a site (``reference.check_operands``)."""
import re

import pytest
import torch
import torch.nn.functional as F

import hyscale_compile
from hyscale_compile.lowerings.reference import check_operands, stable_topk
from hyscale_compile.lowerings.spec import ScoreSpec
from hyscale_compile.testing import graph_text
from tests.contract import fresh_seed
from tests.models.dsa_forms import FORMS
from tests.models.variant_forms import VARIANT_FORMS
from tests.test_variants import FUSED as VARIANT_FUSED

B, S, T, H, D, K = 2, 8, 24, 4, 16, 5

SHAPES = {"h": (H,), "11h": (1, 1, H), "b1h": (B, 1, H), "1sh": (1, S, H), "bs1": (B, S, 1)}


def mul_sum_scores(q, k, w):
    """Official DeepSeek spelling: einsum, ReLU, ``* w[..., None]``, sum over heads."""
    s = torch.einsum("bshd,btd->bsht", q, k).relu()
    return (s * w.unsqueeze(-1)).sum(dim=2)


def matmul_scores(q, k, w):
    """HF spelling: the head sum as ``matmul(w.unsqueeze(-2), scores)``."""
    s = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)))  # [B, S, H, T]
    return torch.matmul(w.float().unsqueeze(-2), s).squeeze(-2)


SCORES = {"mul_sum": mul_sum_scores, "matmul": matmul_scores}


def _inputs(label, shape, w_dtype=torch.float32):
    g = torch.Generator().manual_seed(fresh_seed(label))
    q = torch.randn(B, S, H, D, generator=g)
    k = torch.randn(B, T, D, generator=g)
    w = (torch.rand(shape, generator=g) + 0.25).to(w_dtype)
    return q, k, w


def _check_fused(fn, args):
    with torch.no_grad():
        report = hyscale_compile.explain(fn, *args)
    assert len(report.rewritten) == 1 and not report.left_alone, str(report)
    site = report.rewritten[0]
    assert site.variant == "dsa" and "weighted_sum" in site.spec, site.line()
    return site


def _compiled(fn, **kw):
    torch._dynamo.reset()
    return torch.compile(fn, backend="hyscale_debug", **kw)


cases = [(form, shape) for form in SCORES for shape in SHAPES if (form, shape) != ("matmul", "bs1")]


@pytest.mark.parametrize("form,shape", cases)
def test_broadcast_head_weights_fuse_and_equal_a_stable_topk(form, shape):
    scores = SCORES[form]

    def fn(q, k, w):
        return scores(q, k, w).topk(K, dim=-1)

    args = _inputs(f"{form}_{shape}", SHAPES[shape])
    _check_fused(fn, args)
    cap = []
    with torch.no_grad():
        vals, idx = _compiled(fn, options={"hyscale.capture": cap})(*args)
        ref_vals, ref_idx = stable_topk(scores(*args), K)
    text = graph_text(next(g for kind, g in cap if kind == "inference").graph)
    assert "hyscale.hytopk_values" in text and "aten.topk" not in text, text
    # the weights reach the op as a view of the caller's tensor: an expand, no copy
    assert "aten.expand" in text and "clone" not in text and "aten.copy" not in text, text
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(vals, ref_vals, atol=1e-5, rtol=1e-5)


def test_weights_already_per_row_emit_no_expand():
    def fn(q, k, w):
        return mul_sum_scores(q, k, w).topk(K, dim=-1).indices

    args = _inputs("per_row", (B, S, H))
    cap = []
    with torch.no_grad():
        idx = _compiled(fn, options={"hyscale.capture": cap})(*args)
        assert torch.equal(idx, stable_topk(mul_sum_scores(*args), K)[1])
    text = graph_text(next(g for kind, g in cap if kind == "inference").graph)
    assert "hyscale.hytopk" in text and "aten.expand" not in text, text


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])
def test_broadcast_weights_of_another_dtype_than_the_queries(w_dtype):
    """fp32 scores times bf16/fp16 weights: the product upcasts the weights exactly; the
    op takes them as they are (a view) and upcasts them itself."""

    def fn(q, k, w):
        return mul_sum_scores(q, k, w).topk(K, dim=-1).indices

    args = _inputs(f"dtype_{w_dtype}", (1, S, H), w_dtype)
    _check_fused(fn, args)
    with torch.no_grad():
        assert torch.equal(_compiled(fn)(*args), stable_topk(mul_sum_scores(*args), K)[1])


def test_broadcast_weights_dynamic_shapes():
    def fn(q, k, w):
        return mul_sum_scores(q, k, w).topk(K, dim=-1).indices

    args = _inputs("dynamic", (1, 1, H))
    with torch.no_grad():
        report = hyscale_compile.explain(fn, *args, dynamic=True)
        assert len(report.rewritten) == 1 and not report.left_alone, str(report)
        f = _compiled(fn, dynamic=True)
        assert torch.equal(f(*args), stable_topk(mul_sum_scores(*args), K)[1])
        q, k, w = _inputs("dynamic_2", (1, 1, H))
        q2, k2 = torch.cat([q, q[:, :3]], 1), torch.cat([k, k[:, :5]], 1)
        assert torch.equal(f(q2, k2, w), stable_topk(mul_sum_scores(q2, k2, w), K)[1])


@pytest.mark.parametrize("shape", ["h", "b1h"])
def test_broadcast_weights_training_gradients_equal_eager(shape):
    """With grad enabled (joint graph) the sparse backward hands the weights' gradient back
    through the expand: summed over the broadcast axes."""

    def fn(q, k, w):
        vals, idx = mul_sum_scores(q, k, w).topk(K, dim=-1)
        return vals, idx

    q0, k0, w0 = _inputs(f"train_{shape}", SHAPES[shape])

    def grads(f):
        leaves = [t.clone().requires_grad_(True) for t in (q0, k0, w0)]
        vals, idx = f(*leaves)
        (vals * torch.linspace(0.5, 1.5, vals.numel()).view(vals.shape)).sum().backward()
        return idx, [t.grad for t in leaves]

    ref_idx, ref = grads(fn)
    report = hyscale_compile.explain(fn, *[t.clone().requires_grad_(True) for t in (q0, k0, w0)])
    assert len(report.rewritten) == 1 and report.rewritten[0].backward == "sparse", str(report)
    idx, got = grads(_compiled(fn))
    assert torch.equal(idx, ref_idx)
    for a, b in zip(got, ref):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.inductor
def test_broadcast_weights_through_inductor():
    from torch._inductor.utils import run_and_get_code

    def fn(q, k, w):
        return mul_sum_scores(q, k, w).topk(K, dim=-1).indices

    args = _inputs("inductor", (H,))
    torch._dynamo.reset()
    with torch.no_grad():
        idx, code = run_and_get_code(torch.compile(fn, backend="hyscale"), *args)
        assert torch.equal(idx, stable_topk(mul_sum_scores(*args), K)[1])
    code = "\n".join(code)
    assert "torch.ops.hyscale.hytopk.default(" in code, code
    # the weights [H] go in as a view with strides (0, 0, 1): no copy
    assert re.search(rf"reinterpret_tensor\(arg\d+_1, \({B}, {S}, {H}\), \(0, 0, 1\)", code), code


# ---------------------------------------------------------------------------------------
# What the matcher emits, the op accepts


SELECTION_OPS = ("hytopk", "hytopk_values")


def _op_calls(graph):
    return [n for n in graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", "") == "hyscale"
            and n.target._schema.name.split("::")[-1] in SELECTION_OPS]


ZOO = {**{f"dsa:{n}": FORMS[n] for n in FORMS}, **{f"variant:{n}": VARIANT_FORMS[n] for n in VARIANT_FORMS}}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_emitted_call_passes_the_op_checks_at_build_time(name):
    """The op's own operand checks, run on the fake operands (node.meta["val"]) of every
    fused call the matcher put in the graph, raise nothing: no site can fail at run time
    for a shape or operand the matcher accepted."""
    case = ZOO[name](fresh_seed(name) % 1000)
    cap = []
    with torch.no_grad():
        _compiled(case.fn, options={"hyscale.capture": cap})(*case.args)
    calls = [n for kind, g in cap if kind in ("inference", "forward") for n in _op_calls(g.graph)]
    # (every DSA-zoo selection fuses; of the other variants, those test_variants.py lists)
    fused = name.startswith("dsa:") or name.split(":", 1)[1] in VARIANT_FUSED
    assert len(calls) == (case.num_selections if fused else 0), name
    for n in calls:
        q, k, w, masks, topk, spec = (a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in n.args[:6])
        masks = [m.meta["val"] for m in n.args[3]]
        check_operands(q, k, w, masks, topk, ScoreSpec.from_json(spec))


def test_a_call_the_op_would_reject_is_not_emitted(monkeypatch):
    """If the op's checks reject the operands the rewrite built, the site is not fused: the
    reason is in the diagnostics and the model computes what it did (the selection then
    comes from the score table, as for any other score the kernel does not cover)."""
    from hyscale_compile.lowerings.spec import SpecError
    from hyscale_compile.passes import rewrite

    def reject(*args, **kwargs):
        raise SpecError("rejected for the test")

    monkeypatch.setattr(rewrite, "check_operands", reject)

    def fn(q, k, w):
        return mul_sum_scores(q, k, w).topk(K, dim=-1).indices

    args = _inputs("rejected", (H,))
    with torch.no_grad():
        report = hyscale_compile.explain(fn, *args)
        assert len(report.sites) == 1 and report.sites[0].variant != "dsa", str(report)
        assert "the op would reject the operands the rewrite builds: rejected for the test" in str(report), str(report)
        cap = []
        idx = _compiled(fn, options={"hyscale.capture": cap})(*args)
    text = graph_text(next(g for kind, g in cap if kind == "inference").graph)
    assert "hyscale.hytopk" not in text and "aten.expand" not in text, text
    assert torch.equal(idx, stable_topk(mul_sum_scores(*args), K)[1])
