"""The matcher (passes/canonicalize.py) over the zoo of DSA-family spellings.

Every selection becomes a ``torch.ops.hyscale`` call, every other top-k stays ``aten.topk``
with a reason, and outputs equal eager (docs/contract.md: on inputs whose selection is unique;
against a stable reference where ties are the point). Compiles go through the debug
backend (the same pass and partitioner, no Inductor codegen)."""
import math

import pytest
import torch
import torch.nn.functional as F

import hyscale_compile
from hyscale_compile.lowerings.reference import stable_topk
from hyscale_compile.testing import assert_selection_equal
from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec
from tests.contract import check_selection, fresh_seed, reference_f64, tolerance
from tests.models.dsa_forms import FORMS, hadamard, topk_inputs
from tests.test_order import order_free


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def assert_same_outputs(out, ref):
    for a, b in zip(_as_tuple(out), _as_tuple(ref)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.is_floating_point():
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(a, b)


def compiled(fn, **kw):
    torch._dynamo.reset()
    return torch.compile(fn, backend="hyscale_debug", **kw)


@pytest.mark.parametrize("name", sorted(FORMS))
def test_form_is_rewritten_and_matches_eager(name):
    case = FORMS[name](fresh_seed(name) % 1000)
    with torch.no_grad():
        # the selection's rewrite alone (exact: the output equals eager's); a rewritten
        # attention consumer follows its own numerics rule, tested in test_attention_*.py
        report = hyscale_compile.explain(case.fn, *case.args, options={"hyscale.sparse_attention": False})
        assert len(report.rewritten) == case.num_selections, str(report)
        assert len(report.left_alone) == case.num_other_topk, str(report)
        for site in report.left_alone:
            assert site.reason, site
        for site in report.rewritten:
            # the whole indexer became the op: no score table is left in the graph
            assert not site.table_consumers, site.line()
            assert site.sizes["H"] != 1 or "single-head" in site.variant, site.line()
            # topk's sorted flag reaches the op (sorted=False lets the kernel skip its sort),
            # and so does a sort nothing reads (passes/order.py; tests/test_order.py)
            assert bool(site.sort_elided) == ("sorted_false" not in case.tags and order_free(case)), site.line()
            assert site.sorted == ("sorted_false" not in case.tags and not site.sort_elided), site.line()
            assert ("(unsorted" in site.line()) == (not site.sorted), site.line()
        out = report.output  # (explain's compile is the debug backend's: no second compile)
        if case.unique:
            assert_same_outputs(out, case.fn(*case.args))
        else:
            (scores, k, dim), = topk_inputs(case)
            assert dim in (-1, scores.dim() - 1)
            assert torch.equal(_as_tuple(out)[0], stable_topk(scores, k)[1])


@pytest.mark.parametrize("name", ["hf_v32_grad_additive_finfo", "v4_official_einsum_triu", "glm5_norelu_signed_batched",
                                  "megatron_sbhd_values_minus_one", "hf_v4_position_ids_threshold"])
def test_training_graph_gradients_match_eager(name):
    """With grad enabled the pass runs on the joint graph; the selection is still rewritten
    and every gradient equals eager's."""
    case = FORMS[name](fresh_seed(name) % 1000)

    def leaves():
        return [a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in case.args]

    def loss(out):
        return sum((o.float() * torch.linspace(0.5, 1.5, o.numel()).view(o.shape)).sum()
                   for o in _as_tuple(out) if o.is_floating_point())

    ref_args, cmp_args = leaves(), leaves()
    loss(case.fn(*ref_args)).backward()
    params_ref = {n: p.grad.clone() for n, p in getattr(case.fn, "named_parameters", lambda: [])() if p.grad is not None}
    if hasattr(case.fn, "zero_grad"):
        case.fn.zero_grad()
    report = hyscale_compile.explain(case.fn, *cmp_args)
    assert len(report.rewritten) == case.num_selections, str(report)
    loss(report.output).backward()  # the backward of explain's debug-backend run
    for a, b in zip(cmp_args, ref_args):
        if isinstance(a, torch.Tensor) and a.requires_grad and b.grad is not None:
            close(a.grad, b.grad)
    for n, p in getattr(case.fn, "named_parameters", lambda: [])():
        if n in params_ref:
            close(p.grad, params_ref[n])


def close(a, b):
    """fp32: reassociation-level; bf16/fp16 leaves get their gradient rounded to 8/11 bits,
    so one-ulp flips are expected there (torch's default tolerances for those dtypes)."""
    if a.dtype in (torch.bfloat16, torch.float16):
        torch.testing.assert_close(a, b)
    else:
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["v4_official_einsum_triu", "megatron_sbhd_values_minus_one", "kernel_ref_mhd_nd_range"])
def test_dynamic_shapes(name):
    case = FORMS[name](fresh_seed(name) % 1000)
    with torch.no_grad():
        report = hyscale_compile.explain(case.fn, *case.args, dynamic=True)
        assert len(report.rewritten) == case.num_selections, str(report)
        assert_same_outputs(report.output, case.fn(*case.args))


@pytest.mark.parametrize("name", ["hf_v4_position_ids_threshold", "hf_v32_nograd_bool_bf16"])
def test_dynamic_scale_becomes_a_runtime_operand(name):
    """dynamic=True makes the head dim symbolic too, so ``D ** -0.5`` is a 0-d tensor the
    graph computes: it becomes an operand of the op (``mul_operand``), read at run time."""
    case = FORMS[name](fresh_seed(name) % 1000)
    with torch.no_grad():
        report = hyscale_compile.explain(case.fn, *case.args, dynamic=True)
        (site,) = report.rewritten
        assert "mul_operand" in site.spec and site.variant == "dsa", site.line()
        assert_same_outputs(report.output, case.fn(*case.args))


# ---- spellings that neither the research notes nor the zoo write verbatim ----------------

def _at_operator(q, k, w):
    s = (q.float() @ k.float().transpose(-1, -2)[:, None]).clamp_min(0.0) * 0.125  # [B,S,H,T]
    s = torch.einsum("bsht,bsh->bst", s, w)
    causal = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril()
    s = torch.where(causal, s, float("-inf"))
    return torch.topk(s, 3, dim=2).indices.int()


def _explicit_bmm_sub_mask(q, k, w):
    B, S, H, D = q.shape
    s = torch.bmm(q.reshape(B, S * H, D), k.transpose(1, 2)).view(B, S, H, -1)
    s = F.relu(s, inplace=True).mul_(D**-0.5)
    s = (s * w[:, :, :, None]).sum(-2)
    qi = torch.arange(S)[:, None]
    ki = torch.arange(s.shape[-1])[None, :]
    s.masked_fill_(ki - qi > 0, -math.inf)
    return s.topk(4).indices


def _scale_after_weights(q, k, w):
    s = torch.einsum("bshd,btd->bsht", q, k).relu_() * w[..., None] * 16**-0.5  # scale after weighting
    s = s.sum(dim=2)
    s += torch.full((s.size(1), s.size(2)), float("-inf")).triu_(1)  # in-place additive mask
    return s.topk(5, dim=-1, sorted=False)[1]


@pytest.mark.parametrize("fn", [_at_operator, _explicit_bmm_sub_mask, _scale_after_weights])
def test_unlisted_spellings(fn):
    seed = fresh_seed(fn.__name__)
    g = torch.Generator().manual_seed(seed)
    q, k, w = torch.randn(2, 12, 4, 16, generator=g), torch.randn(2, 12, 16, generator=g), torch.randn(2, 12, 4, generator=g)
    with torch.no_grad():
        report = hyscale_compile.explain(fn, q, k, w)
        assert len(report.rewritten) == 1, str(report)
        out = compiled(fn)(q, k, w)
        (scores, kk, _), = spy_topk(fn, q, k, w)
    # ReLU zero ties and masked slots make indices tie-dependent: compare the selected
    # scores as multisets (docs/contract.md, "Equality with eager"), and the tie rule exactly
    ref = torch.gather(scores, -1, scores.topk(kk, dim=-1).indices).sort(-1).values
    got = torch.gather(scores, -1, out.long()).sort(-1).values
    assert torch.equal(got, ref)
    assert torch.equal(out.long().sort(-1).values, stable_topk(scores, kk)[1].sort(-1).values)


def spy_topk(fn, *args):
    """(scores, k, dim) of every topk call ``fn`` makes in eager."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "__name__", "") == "topk":
                a = list(args) + [None] * 3
                seen.append((a[0].clone(), kwargs.get("k", a[1]), kwargs.get("dim", a[2] if a[2] is not None else -1)))
            return func(*args, **kwargs)

    with Spy():
        fn(*args)
    return seen


def test_key_projection_is_not_mistaken_for_the_score_contraction():
    """k = x @ Wk puts a deeper contraction on the key axis; HF's head sum is a matmul
    nearer the top-k. The score contraction between them is the one to rewrite."""

    def indexer(x, q, wk, w):
        k = x @ wk
        s = torch.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * 0.25)
        return torch.matmul(w.unsqueeze(-2), s).squeeze(-2).topk(8, dim=-1).indices

    g = torch.Generator().manual_seed(fresh_seed("k_from_linear"))
    args = (torch.randn(1, 32, 16, generator=g), torch.randn(1, 32, 4, 16, generator=g),
            torch.nn.Parameter(torch.randn(16, 16, generator=g)), torch.rand(1, 32, 4, generator=g))
    with torch.no_grad():
        report = hyscale_compile.explain(indexer, *args)
    (site,) = report.rewritten
    assert site.variant == "dsa" and site.sizes == {"B": 1, "S": 32, "H": 4, "D": 16, "T": 32}, site.line()
    assert not site.table_consumers


_H16 = hadamard(16)  # a module-level tensor: Dynamo lifts it to a graph input, not a parameter


class _RotatedIndexer(torch.nn.Module):
    """DSA scoring with DeepSeek's / Megatron's Hadamard rotation of q and k written as a plain
    matmul by a constant matrix (a global, one built in the graph, a buffer or a parameter)."""

    def __init__(self, source, sides, heads="mul_sum"):
        super().__init__()
        self.source, self.sides, self.heads = source, sides, heads
        self.register_buffer("h_buf", hadamard(16))
        self.h_par = torch.nn.Parameter(hadamard(16))

    def rotate(self, x):
        h = {"global": lambda: _H16, "in_graph": lambda: hadamard(x.shape[-1]), "buffer": lambda: self.h_buf,
             "parameter": lambda: self.h_par}[self.source]()
        return x @ h

    def forward(self, q, k, w):
        if "q" in self.sides:
            q = self.rotate(q)
        if "k" in self.sides:
            k = self.rotate(k)
        s = torch.einsum("bshd,btd->bsht", q, k).relu()
        if self.heads == "matmul":  # HF's head sum: a weights matmul with one output row
            s = torch.matmul(w.unsqueeze(-2), s).squeeze(-2)
        else:
            s = (s * w[..., None]).sum(2)
        S, T = s.shape[-2:]
        s = s.masked_fill(torch.arange(T)[None, :] > torch.arange(S)[:, None], float("-inf"))
        return s.topk(6, dim=-1)


# B=1: the key axis reaches the key rotation's matmul (a deeper contraction on the key axis);
# B=2: [B*S*H, D] rows of the query rotation split in two levels to [B, S, H]
@pytest.mark.parametrize("source, sides, B, heads", [
    ("global", "qk", 1, "mul_sum"), ("global", "qk", 2, "mul_sum"), ("in_graph", "qk", 1, "mul_sum"),
    ("buffer", "qk", 2, "mul_sum"), ("parameter", "qk", 1, "mul_sum"), ("global", "k", 1, "mul_sum"),
    ("in_graph", "k", 2, "mul_sum"), ("global", "q", 2, "mul_sum"), ("global", "k", 1, "matmul"),
    ("in_graph", "qk", 2, "matmul")])
def test_rotated_keys_are_part_of_the_score(source, sides, B, heads):
    """A linear map of the keys (or queries) by a constant matrix before the score contraction
    (the indexer's Hadamard rotation) is part of computing them, not a head-weights matmul: the
    site is fused, the rotation stays as graph ops before the op, and the op takes the rotated
    tensors."""
    S, H, D = 24, 4, 16
    g = torch.Generator().manual_seed(fresh_seed(f"rotated {source} {sides} B={B} {heads}"))
    q, k, w = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, D, generator=g), torch.randn(B, S, H, generator=g)
    model = _RotatedIndexer(source, sides, heads)
    with torch.no_grad():
        (site,) = hyscale_compile.explain(model, q, k, w).sites
        assert site.rewritten and site.variant == "dsa", site.line()
        assert site.sizes == {"B": B, "S": S, "H": H, "D": D, "T": S} and not site.table_consumers, site.line()
        vals, idx = compiled(model)(q, k, w)
        qr, kr = (q @ _H16 if "q" in sides else q), (k @ _H16 if "k" in sides else k)
    spec = ScoreSpec(epilogue=(("relu",),), post=(("mask", 0),), masks=(MaskTerm("range", hi=0),))
    hi = (torch.arange(S) + 1).expand(B, S)
    kr = kr[:, :, None]
    check_selection(idx, reference_f64(qr, kr, w, [hi], spec), tolerance(qr, kr, w, spec), 6, vals)


@pytest.mark.parametrize("source", ["global", "parameter"])
def test_rotated_router_stays_a_router(source):
    """A rotation of the expert embeddings (a parameter) by a constant matrix leaves them
    parameters: the key axis comes from a parameter, so the top-k is a router's (docs/contract.md,
    'What counts as a selection'), even where the matrix is a global, a graph input."""

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts, self.h = torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(hadamard(16))

        def forward(self, x):
            e = self.experts @ (_H16 if source == "global" else self.h)
            return (x @ e.t()).sigmoid().topk(2, dim=-1).indices

    with torch.no_grad():
        (site,) = hyscale_compile.explain(Router(), torch.randn(2, 10, 16)).sites
    assert not site.rewritten and "not a selection" in site.reason, site.line()


def test_pooled_keys_head_sum_and_dim0():
    """QSA-like: keys mean-pooled per block, relu(q.k) summed over heads / sqrt(d), a
    block-causal bound from position ids (``blk[None, None, :] > pos[..., None] // r``), and
    the same scores laid out [blocks, queries] with ``s[0].topk(dim=0)``."""
    B, S, H, D, r = 1, 64, 4, 32, 4

    def qsa(q, kraw, pos):
        kbar = kraw.view(B, S // r, r, D).float().mean(2)
        s = F.relu(torch.einsum("bshd,bnd->bsnh", q.float(), kbar)).sum(-1) / math.sqrt(D)
        blk = torch.arange(kbar.shape[1])
        s = s.masked_fill(blk[None, None, :] > (pos[..., None] // r), float("-inf"))
        return s.topk(8, dim=-1).indices

    def qsa_dim0(q, kraw, pos):
        kbar = kraw.view(B, S // r, r, D).float().mean(2)
        s = torch.einsum("bnd,bshd->bnsh", kbar, q.float()).relu().sum(-1) / math.sqrt(D)
        return s[0].topk(8, dim=0).indices

    g = torch.Generator().manual_seed(fresh_seed("qsa"))
    q, kraw, pos = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, D, generator=g), torch.arange(S)[None]
    for fn, mask in ((qsa, "mask:range"), (qsa_dim0, None)):
        with torch.no_grad():
            (site,) = hyscale_compile.explain(fn, q, kraw, pos).rewritten
            assert site.variant == "head-sum-relu" and site.sizes["T"] == S // r and site.sizes["H"] == H, site.line()
            assert mask is None or mask in site.spec
            out = compiled(fn)(q, kraw, pos)
            (scores, kk, dim), = spy_topk(fn, q, kraw, pos)
        # ReLU zero ties are possible with 4 heads: compare selected scores, then the tie rule
        got = torch.gather(scores, dim, out).sort(dim).values
        ref = torch.gather(scores, dim, scores.topk(kk, dim=dim).indices).sort(dim).values
        assert torch.equal(got, ref)


def test_near_misses_say_why():
    def smallest(q, k):
        return torch.einsum("bsd,btd->bst", q, k).topk(2, largest=False).indices

    def over_batch(q, k):  # the batch axis is shared by both operands: not a key axis
        return torch.einsum("bsd,btd->bst", q, k).topk(2, dim=0).indices

    def softmax_first(q, k):
        return torch.einsum("bsd,btd->bst", q, k).softmax(-1).topk(2).indices

    def in_float64(q, k):  # the op computes in fp32: rewriting would change the result
        return torch.einsum("bsd,btd->bst", q.double(), k.double()).topk(2).indices

    def upcast_scores(q, k):
        return torch.einsum("bsd,btd->bst", q, k).double().topk(2).indices

    q, k = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    # None: left alone; "table": not fused, selected from the table the graph materializes
    expect = {smallest: ("largest=False", None), over_batch: ("not the key axis", "table"),
              softmax_first: ("stopped at aten.exp.default", "table"), in_float64: ("float64", "table"),
              upcast_scores: ("float64", "table")}
    with torch.no_grad():
        for fn, (why, variant) in expect.items():
            report = hyscale_compile.explain(fn, q, k)
            (site,) = report.sites
            assert why in site.reason and (site.variant == "table") == (variant == "table"), str(report)
            assert site.rewritten == (variant is not None), str(report)


@pytest.mark.parametrize("name", ["glm5_norelu_signed_unbatched", "glm5_relu_scale_after_div", "ties_small_int_bf16",
                                  "bmm_heads_folded_clamp"])
def test_tril_triu_of_bool_ones_is_a_key_range(name):
    """``torch.ones(bool).tril()`` / ``.triu(1)`` decompose to ``index compare & full(True)``:
    still a key range (which the kernel can skip tile by tile), not a [S, T] mask operand."""
    case = FORMS[name](fresh_seed(name) % 1000)
    with torch.no_grad():
        report = hyscale_compile.explain(case.fn, *case.args)
    assert report.rewritten and all(s.spec.endswith("mask:range") for s in report.rewritten), str(report)
    assert all(s.line().endswith("; hidden key tiles skipped") for s in report.rewritten), str(report)


def _documents(q, k, w, flags):
    """A DSA score under causal & same-document masks, the document ids a cumsum of
    boundary flags (HF's packed-sequence ids), compared by lookups as HF's mask builder does."""
    B, S = flags.shape
    doc = flags.cumsum(-1)
    t = torch.arange(S)
    b = torch.arange(B)[:, None, None]
    same = doc[b, t[None, :, None]] == doc[b, t[None, None, :]]
    keep = (t[None, None, :] <= t[None, :, None]) & same
    s = torch.einsum("bshd,btd->bsth", q, k).relu().mul(w[:, :, None, :]).sum(-1)
    s = s + torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    return s.topk(5, dim=-1).indices


def test_document_ids_become_key_ranges():
    """``doc[b, q] == doc[b, t]`` over a non-decreasing id row is a key range per row (by
    ``searchsorted``): the op gets [B, S] bounds, never the [B, S, T] mask, and the selection
    keeps every row inside its own document (rows at a document's start have fewer than k
    visible keys: their masked slots are the smallest-index hidden keys, as the tie rule says)."""
    seed = fresh_seed("documents")
    g = torch.Generator().manual_seed(seed)
    B, S, H, D = 2, 24, 3, 8
    q, k, w = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, D, generator=g), torch.rand(B, S, H, generator=g)
    flags = torch.zeros(B, S, dtype=torch.bool)
    flags[0, [7, 15]] = True
    flags[1, 3] = True
    with torch.no_grad():
        report = hyscale_compile.explain(_documents, q, k, w, flags)
        assert len(report.rewritten) == 1 and report.rewritten[0].spec.endswith("mask:range"), str(report)
        out = compiled(_documents)(q, k, w, flags)
    s = torch.einsum("bshd,btd->bsth", q.double(), k.double()).relu().mul(w.double()[:, :, None, :]).sum(-1)
    doc = flags.cumsum(-1)
    t = torch.arange(S)
    keep = (t[None, None, :] <= t[None, :, None]) & (doc[:, :, None] == doc[:, None, :])
    assert_selection_equal(out, s.masked_fill(~keep, -math.inf), sorted=True)


@pytest.mark.parametrize("name,tiles", [
    ("hf_v32_grad_additive_finfo", "hidden key tiles skipped while a per-call bound on the scores holds"),
    ("hf_runtime_attention_mask_4d", "key tiles outside each row's visible range skipped"),
    ("v4_official_einsum_triu", "hidden key tiles skipped"),
])
def test_diagnostics_say_how_hidden_tiles_are_treated(name, tiles):
    case = FORMS[name](fresh_seed(name) % 1000)
    with torch.no_grad():
        report = hyscale_compile.explain(case.fn, *case.args)
    assert report.rewritten and all(tiles in s.line() for s in report.rewritten), str(report)


def test_mask_and_with_a_false_tensor_is_not_a_range():
    """``cond & full(False)`` hides every key: not the range of ``cond``; it stays a tensor mask."""
    def scores(q, k, w):
        s = (torch.einsum("bshd,btd->bsht", q, k).relu() * w[..., None]).sum(2)
        S, T = s.shape[-2:]
        keep = (torch.arange(T)[None, :] <= torch.arange(S)[:, None]) & torch.zeros(S, T, dtype=torch.bool)
        return s.masked_fill(~keep, -math.inf)

    def fn(q, k, w):
        return scores(q, k, w).topk(3, dim=-1).indices

    g = torch.Generator().manual_seed(fresh_seed("and_false"))
    args = torch.randn(1, 8, 2, 4, generator=g), torch.randn(1, 8, 4, generator=g), torch.randn(1, 8, 2, generator=g)
    with torch.no_grad():
        report = hyscale_compile.explain(fn, *args)
        assert len(report.rewritten) == 1 and report.rewritten[0].spec.endswith("mask:fill"), str(report)
        assert torch.equal(compiled(fn)(*args), stable_topk(scores(*args), 3)[1])  # every key hidden: 0, 1, 2
