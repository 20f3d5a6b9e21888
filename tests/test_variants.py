"""Beyond DSA (tests/models/variant_forms.py: NSA, MoBA, InfLLM-v2, Qwen QSA, DeepSeek-V4
CSA, as their public implementations write them): every selection becomes a
``torch.ops.hyscale`` call (the fused op where the score fits a ScoreSpec, else
``topk_table`` over the table the graph materializes, passes/table_select.py), and outputs
equal eager run with a stable (value desc, index asc) top-k, the tie rule the rewrite
follows (docs/contract.md, "Equality with eager")."""
import contextlib

import pytest
import torch

import hyscale_compile
from hyscale_compile.lowerings.reference import table_topk
from hyscale_compile.testing import graph_text
from tests.contract import fresh_seed, input_and_param_grads
from tests.test_canonicalize import assert_same_outputs, compiled
from tests.models.variant_forms import VARIANT_FORMS

# where each family lands today: fused into the generated kernel, or selected from the table
FUSED = {"qsa_vectorized", "v4_csa_compressed", "moba_efficient_dim0"}
TABLE = {"nsa_compression_naive", "nsa_diff_topk_lucidrains", "moba_naive", "infllm_v2_naive"}
NOT_SEEN = {"qsa_per_query_loop"}  # Dynamo skips the frame (graph break on nonzero): nothing to rewrite


@contextlib.contextmanager
def stable_topk_in_eager():
    """torch.topk with the rewrite's tie rule, for the eager reference of tie-prone forms."""
    orig_fn, orig_method = torch.topk, torch.Tensor.topk

    def topk(x, k, dim=-1, largest=True, sorted=True, **kw):
        if not largest or "out" in kw:
            return orig_fn(x, k, dim=dim, largest=largest, sorted=sorted, **kw)
        idx = table_topk(x.movedim(dim, -1).contiguous(), k).long().movedim(-1, dim)
        return torch.return_types.topk((torch.gather(x, dim, idx), idx))

    torch.topk = topk
    torch.Tensor.topk = lambda self, *a, **kw: topk(self, *a, **kw)
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = orig_fn, orig_method


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def test_every_form_is_classified():
    assert set(VARIANT_FORMS) == FUSED | TABLE | NOT_SEEN


@pytest.mark.parametrize("name", sorted(VARIANT_FORMS))
def test_variant_selections_become_hyscale_calls_and_equal_eager(name):
    case = VARIANT_FORMS[name](fresh_seed(name) % 1000)
    with torch.no_grad():
        report = hyscale_compile.explain(case.fn, *case.args)
        if name in NOT_SEEN:
            assert not report.sites and report.skipped_frames, str(report)
            assert "per-query loop" in str(report)
        else:
            assert len(report.rewritten) == case.num_selections and not report.left_alone, str(report)
            for site in report.rewritten:
                if name in FUSED:
                    assert site.variant != "table", site.line()
                else:
                    assert site.variant == "table" and "not fused because" in site.line(), site.line()
        cap = []
        torch._dynamo.reset()
        out = torch.compile(case.fn, backend="hyscale_debug", options={"hyscale.capture": cap})(*case.args)
        graphs = "\n".join(graph_text(g.graph) for k, g in cap if k in ("inference", "forward"))
        if name not in NOT_SEEN:
            assert "aten.topk" not in graphs and "hyscale." in graphs
        # always against the tie rule: "unique" forms have no tie at the k boundary, but
        # exact-zero ReLU ties inside the selected set still decide the order of a
        # sorted result (QSA's block order feeds its block -> token expansion)
        with stable_topk_in_eager():
            ref = case.fn(*case.args)
    assert_same_outputs(out, ref)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_table_selection_gradients_and_replay(checkpointed):
    """NSA's differentiable straight-through gate (lucidrains): the values come from a
    gather of the table, so gradients equal eager; the int32 indices are saved, so the
    backward never sorts again, under activation checkpointing too."""
    from torch.utils.checkpoint import checkpoint

    case = VARIANT_FORMS["nsa_diff_topk_lucidrains"](fresh_seed("nsa_grad") % 1000)
    model, (x0,) = case.fn, case.args
    run = (lambda x: checkpoint(model, x, use_reentrant=False)) if checkpointed else model

    def grads(fn):
        return input_and_param_grads(fn, x0, model)

    with stable_topk_in_eager():
        want = grads(run)
    cap = []
    torch._dynamo.reset()
    got = grads(torch.compile(run, backend="hyscale_debug", options={"hyscale.capture": cap}))
    fw = graph_text(next(g for k, g in cap if k == "forward").graph)
    bw = graph_text(next(g for k, g in cap if k == "backward").graph)
    assert "hyscale.topk_table" in fw
    assert "hyscale.topk_table" not in bw and "aten.sort" not in bw and "aten.topk" not in bw
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-5 * max(1.0, b.abs().max().item()), rtol=1e-5)


def test_routers_are_not_table_selected():
    """A top-k over a linear layer's output (MoE router) is not a score table."""
    from tests.models.dsa_forms import FORMS

    case = FORMS["moe_router_sigmoid"](fresh_seed("router") % 1000)
    with torch.no_grad():
        report = hyscale_compile.explain(case.fn, *case.args)
    assert not report.rewritten and len(report.left_alone) == case.num_other_topk, str(report)


def test_biased_router_after_attention_is_not_table_selected():
    """A router that is a biased linear layer (addmm) over hidden states that went through
    attention (an activation x activation bmm upstream) is still a router."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.router = torch.nn.Linear(32, 96), torch.nn.Linear(32, 8, bias=True)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1)
            h = x + torch.softmax(q @ k.transpose(-1, -2) / 32**0.5, -1) @ v
            return torch.topk(self.router(h).softmax(-1), 2, dim=-1)

    with torch.no_grad():
        report = hyscale_compile.explain(Block(), torch.randn(2, 6, 32))
    assert not report.rewritten and len(report.left_alone) == 1, str(report)


def test_table_topk_rejects_bad_input():
    from hyscale_compile.lowerings.spec import SpecError

    with pytest.raises(SpecError, match="floating point"):
        table_topk(torch.arange(10), 3)
    with pytest.raises(SpecError, match=r"k=11 must be in \[0, 10\]"):
        table_topk(torch.randn(2, 10), 11)
    x = torch.tensor([[1.0, 3.0, 3.0, float("nan"), -1.0]])
    assert table_topk(x, 3).tolist() == [[3, 1, 2]]  # NaN first (as torch.topk), ties by index


def _to(x, device):
    if isinstance(x, torch.nn.Module):
        return x.to(device)
    return x.to(device) if isinstance(x, torch.Tensor) else x


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FUSED | TABLE))
def test_gpu_variant_equals_eager(name):
    """The same forms on CUDA: the generated kernel (fused) or topk_table on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    case = VARIANT_FORMS[name](fresh_seed("gpu_" + name) % 1000)
    fn = _to(case.fn, "cuda") if isinstance(case.fn, torch.nn.Module) else case.fn
    args = [_to(a, "cuda") for a in case.args]
    with torch.no_grad():
        torch._dynamo.reset()
        out = torch.compile(fn, backend="hyscale_debug")(*args)
        with stable_topk_in_eager():
            ref = fn(*args)
    for a, b in zip(_as_tuple(out), _as_tuple(ref)):
        assert a.device.type == "cuda" and a.shape == b.shape and a.dtype == b.dtype
        if a.is_floating_point():
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        else:
            assert torch.equal(a, b)


# Routers and samplers over tensors that are not graph arguments: a module-level global, a
# closure-captured tensor (Dynamo's grapharg sources, carried to the joint graph's inputs)
ROUTER_W = torch.randn(16, 8, generator=torch.Generator().manual_seed(7))
VOCAB_E = torch.randn(50, 16, generator=torch.Generator().manual_seed(8))


def _softmax_router_over_global(x):
    return torch.topk(torch.softmax(x @ ROUTER_W, -1), 2)


def _sigmoid_router_over_global(x):
    return torch.topk(torch.sigmoid(x @ ROUTER_W), 2)


def _vocab_topk_over_global(h):
    return torch.topk(h @ VOCAB_E.t(), 5)


def _softmax_router_over_closure():
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(9))

    def router(x):
        return torch.topk(torch.softmax(x @ w, -1), 2)

    return router


@pytest.mark.parametrize("name, kind", [("softmax_global", "global"), ("sigmoid_global", "global"),
                                        ("vocab_global", "global"), ("softmax_closure", "closure")])
@pytest.mark.parametrize("grad", [False, True])
def test_routers_over_constant_tensors_are_left_alone(name, kind, grad):
    """docs/contract.md: a top-k whose key-side operand is not computed from activations is never
    rewritten; a global or closure-captured weight is as constant as a parameter."""
    fn = {"softmax_global": _softmax_router_over_global, "sigmoid_global": _sigmoid_router_over_global,
          "vocab_global": _vocab_topk_over_global, "softmax_closure": _softmax_router_over_closure()}[name]
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(fresh_seed(name) % 1000))
    with torch.set_grad_enabled(grad):
        report = hyscale_compile.explain(fn, x.requires_grad_(grad))
    assert not report.rewritten and len(report.left_alone) == 1, str(report)
    reason = report.left_alone[0].reason
    assert reason.startswith("not a selection") and kind in reason and "router or sampler" in reason, reason


class _CachedIndexer(torch.nn.Module):
    """An indexer whose keys live in a module buffer written in forward, then read back
    (DeepSeek's official ``self.k_cache[:bsz, start_pos:end_pos] = k`` ... ``[:bsz, :end_pos]``;
    ``index_put``: gpt-fast's ``k_out[:, input_pos] = k``): the keys are activations."""

    def __init__(self, index_put: bool):
        super().__init__()
        self.index_put = index_put
        self.wq, self.wk = torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(16, 8, bias=False)
        self.wh = torch.nn.Linear(16, 4, bias=False)
        self.register_buffer("k_cache", torch.zeros(2, 12, 8), persistent=False)

    def forward(self, x, start: int = 0):
        b, s, _ = x.shape
        q, k = self.wq(x).view(b, s, 4, 8), self.wk(x)
        end = start + s
        if self.index_put:
            self.k_cache[:, torch.arange(start, end)] = k
        else:
            self.k_cache[:b, start:end] = k
        keys = self.k_cache[:b, :end]
        scores = (torch.einsum("bshd,btd->bsht", q, keys).relu() * self.wh(x)[..., None]).sum(2)
        return scores.topk(3, dim=-1)[1]


@pytest.mark.parametrize("index_put", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_kv_cache_buffer_written_in_forward_stays_fused(index_put, grad):
    """A buffer the graph writes from activations before reading it is an activation."""
    torch.manual_seed(fresh_seed("kv_cache") % 1000)
    model, x = _CachedIndexer(index_put), torch.randn(2, 5, 16)
    with torch.set_grad_enabled(grad):
        report = hyscale_compile.explain(model, x, 2)
    assert len(report.rewritten) == 1 and report.rewritten[0].variant == "dsa", str(report)
    assert not report.rewritten[0].note, report.rewritten[0].line()
    with torch.no_grad():
        model.k_cache.zero_()
        out = compiled(model)(x, 2)
        cache = model.k_cache.clone()
        model.k_cache.zero_()
        with stable_topk_in_eager():
            ref = model(x, 2)
    assert torch.equal(out, ref) and torch.equal(cache, model.k_cache)


def test_router_weight_scaled_by_a_dynamic_size_is_left_alone():
    """Under dynamic shapes a size is a graph input of its own (a SymInt): it carries no
    values, so a weight scaled by one is still constant."""

    def router(x):
        return torch.topk(torch.sigmoid(x @ (ROUTER_W * x.shape[1])), 2)

    with torch.no_grad():
        report = hyscale_compile.explain(router, torch.randn(2, 4, 16), dynamic=True)
    assert not report.rewritten and len(report.left_alone) == 1, str(report)
    assert "comes only from a global tensor (G['ROUTER_W'])" in report.left_alone[0].reason, str(report)


def test_weight_passed_as_argument_cannot_be_told_from_keys():
    """A weight passed as an ordinary argument looks like keys passed as one: the site is
    rewritten (outputs stay equal), and explain says the graph could not tell."""
    x, w = torch.randn(2, 4, 16), torch.randn(16, 8)

    def router(x, w):
        return torch.topk(torch.sigmoid(x @ w), 2), torch.topk(torch.softmax(x @ w, -1), 2)

    with torch.no_grad():
        report = hyscale_compile.explain(router, x, w)
        out = report.output  # (explain's debug-backend run)
        ref = router(x, w)
    assert [s.variant for s in report.sites] == ["single-head", "table"], str(report)
    for s in report.sites:
        assert "cannot tell" in s.line() and "L['w']" in s.line(), s.line()
    for a, b in zip(out, ref):
        assert_same_outputs(a, b)
