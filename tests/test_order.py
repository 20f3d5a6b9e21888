"""passes/order.py: the rewrite drops topk(sorted=True)'s sort only where nothing reads the
order, and the outputs stay the same bits.

The CPU op returns sorted=False rows in a seeded random order inside
``hyscale_compile.testing.shuffled_unsorted``, so an order-dependent use of an unsorted
result shows up as different outputs (the first test checks that it does)."""
import math

import pytest
import torch
import torch.nn.functional as F

import hyscale_compile
from hyscale_compile.testing import shuffled_unsorted
from tests.contract import fresh_seed
from tests.models.dsa_forms import FORMS

K = 4


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _run(fn, args, elide=True, grad=False):
    torch._dynamo.reset()
    # (the dense index-mask consumers are what these forms check: the sparse attention that
    # replaces them reads the indices in the selection's own deterministic order, and its sums
    # follow that order, which a shuffle changes; tests/test_attention_pass.py covers it)
    compiled = torch.compile(fn, backend="hyscale_debug", options={"hyscale.elide_sort": elide,
                                                                   "hyscale.sparse_attention": False})
    if not grad:
        with torch.no_grad():
            return _as_tuple(compiled(*args)), None
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
              for a in args]
    params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    for p in params:
        p.grad = None
    out = _as_tuple(compiled(*leaves))
    loss = sum((o.float() * torch.linspace(0.5, 1.5, o.numel()).view(o.shape)).sum() for o in out
               if o.is_floating_point())
    loss.backward()
    grads = [a.grad for a in leaves if isinstance(a, torch.Tensor) and a.grad is not None]
    return out, grads + [p.grad.clone() for p in params if p.grad is not None]


def _same_bits(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(-1).view(torch.uint8) if x.is_floating_point() else x,
                           y.view(-1).view(torch.uint8) if y.is_floating_point() else y)


def _inputs(seed, B=2, S=10, H=3, D=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, H, D, generator=g), torch.randn(B, S, D, generator=g), torch.randn(B, S, H, generator=g).abs()


def _scores(q, k, w):
    s = (torch.einsum("bshd,btd->bsht", q, k).relu() * w[..., None]).sum(2)
    S, T = s.shape[-2:]
    return s.masked_fill(torch.ones(S, T, dtype=torch.bool).triu(1), -math.inf)


def _site(fn, args):
    with torch.no_grad():
        report = hyscale_compile.explain(fn, *args)
    assert len(report.rewritten) == 1, str(report)
    return report.rewritten[0]


# ---- uses that never read the order -----------------------------------------------------

def _bool_scatter(q, k, w):  # HF: ones(bool).scatter(-1, idx.long(), False), masked_fill
    s = _scores(q, k, w)
    idx = s.topk(K, dim=-1).indices.int()
    drop = torch.ones_like(s, dtype=torch.bool).scatter(-1, idx.long(), False)
    return s.detach().masked_fill(drop, -1e4).softmax(-1)


def _inf_scatter_minus_one(q, k, w):  # reference: -1 for masked picks, a safe slot, full(-inf).scatter_
    s = _scores(q, k, w)
    vals, idx = s.topk(K, dim=-1)
    idx = torch.where(vals == -math.inf, torch.full_like(idx, -1), idx)
    T = s.shape[-1]
    safe = torch.where(idx >= 0, idx, torch.full_like(idx, T))
    bias = torch.full((*s.shape[:-1], T + 1), -math.inf).scatter_(-1, safe, 0.0)
    return bias[..., :T] + s.detach()


def _src_scatter_and_int_reductions(q, k, w):  # scatter of a constant tensor; integer max / count
    s = _scores(q, k, w)
    idx = s.topk(K, dim=-1)[1]
    keep = torch.zeros_like(s).scatter(-1, idx, torch.ones_like(idx, dtype=s.dtype))
    last = idx.amax(-1)  # the latest key picked, per query
    early = (idx < 3).sum(-1)
    return keep, last, early, idx.sort(dim=-1).values


def _values_scattered_with_indices(q, k, w):  # a sparse copy of the selected scores
    s = _scores(q, k, w)
    vals, idx = s.topk(K, dim=-1)
    return torch.zeros_like(s).scatter(-1, idx, vals.clamp(min=-1e4)), (vals > 0).sum(-1)


def _chunked_amax_scatter(q, k, w):  # Megatron's absorbed form: its index mask built per row chunk
    s = _scores(q, k, w)
    idx = s.topk(K, dim=-1).indices
    mask = torch.full_like(s, -math.inf)
    for s0 in range(0, s.shape[1], 4):
        i = idx[:, s0:s0 + 4]
        mask[:, s0:s0 + 4].scatter_reduce_(-1, i.clamp_min(0), torch.where(i >= 0, 0.0, -math.inf), "amax",
                                           include_self=True)
    return s.detach() + mask


@pytest.mark.parametrize("fn", [_bool_scatter, _inf_scatter_minus_one, _src_scatter_and_int_reductions,
                                _values_scattered_with_indices, _chunked_amax_scatter])
def test_order_unread_drops_the_sort_and_keeps_the_bits(fn):
    seed = fresh_seed(fn.__name__)
    args = _inputs(seed)
    site = _site(fn, args)
    assert not site.sorted and site.sort_elided, site.line()
    assert "(unsorted: nothing reads the order" in site.line()
    kept, _ = _run(fn, args, elide=False)
    with shuffled_unsorted(seed):
        dropped, _ = _run(fn, args)
    _same_bits(dropped, kept)


# ---- uses that read it -------------------------------------------------------------------

def _returned(q, k, w):
    return _scores(q, k, w).topk(K, dim=-1).indices


def _gather_then_softmax_sum(q, k, w):  # attention over the picks: a float sum in pick order
    s = _scores(q, k, w)
    idx = s.topk(K, dim=-1).indices
    return (s.gather(-1, idx).clamp(min=-1e4).softmax(-1) * idx.float()).sum(-1)


def _float_sum_of_values(q, k, w):
    return _scores(q, k, w).topk(K, dim=-1).values.clamp(min=-1e4).sum(-1)


def _float_max_of_values(q, k, w):  # +0.0 / -0.0 ties: whichever comes first
    return _scores(q, k, w).topk(K, dim=-1).values.amax(-1)


def _argmax_position(q, k, w):
    return _scores(q, k, w).topk(K, dim=-1).indices.max(-1).indices


def _scatter_values_repeated_indices(q, k, w):  # clamped indices repeat: the last write wins
    s = _scores(q, k, w)
    vals, idx = s.topk(K, dim=-1)
    return torch.zeros_like(s).scatter(-1, idx.clamp(max=2), vals.clamp(min=-1e4))


def _plus_position(q, k, w):  # an operand that varies along k
    idx = _scores(q, k, w).topk(K, dim=-1).indices
    return (idx * torch.arange(K)).sum(-1)


def _cumsum(q, k, w):
    return _scores(q, k, w).topk(K, dim=-1).indices.cumsum(-1).amax(-1)


def _flattened_k(q, k, w):  # a view that merges k with the query axis
    idx = _scores(q, k, w).topk(K, dim=-1).indices
    return idx.reshape(idx.shape[0], -1).amax(-1)


# These read the order through the other axes: each row comes back in its own order, so ops
# that move rows against each other read it.
def _same_picks_as_previous_query(q, k, w):
    i = _scores(q, k, w).topk(K, dim=-1).indices
    return (i[:, 1:] == i[:, :-1]).all(-1)


def _two_selected_rows(q, k, w):
    i = _scores(q, k, w).topk(K, dim=-1).indices
    return (i[0] * 100 + i[1]).amax(-1)


def _row_broadcast(q, k, w):
    i = _scores(q, k, w).topk(K, dim=-1).indices
    return (i * 100 + i[:, :1]).amax(-1)


def _reduce_over_queries_first(q, k, w):
    return _scores(q, k, w).topk(K, dim=-1).indices.amax(1).sum(-1)


def _scatter_at_mixed_rows(q, k, w):
    s = _scores(q, k, w)
    i = s.topk(K, dim=-1).indices
    return torch.full_like(s[:, 1:], -1e4).scatter(-1, torch.maximum(i[:, 1:], i[:, :-1]), 0.0)


def _scatter_values_of_another_row(q, k, w):
    s = _scores(q, k, w)
    v, i = s.topk(K, dim=-1)
    return torch.zeros_like(s).scatter(-1, i, v[:1].expand_as(v).clamp(min=-1e4))


def _scatter_values_at_lossy_cast(q, k, w):  # bool cast: indices collide, the last write wins
    s = _scores(q, k, w)
    v, i = s.topk(K, dim=-1)
    return torch.zeros_like(s).scatter(-1, i.bool().long(), v.clamp(min=-1e4))


def _squeeze_of_a_long_axis(q, k, w):  # squeeze(1) of an axis longer than 1 does nothing
    s = _scores(q, k, w)
    i = s.topk(K, dim=-1).indices
    return torch.zeros(i.shape[0], s.shape[-1], K).scatter(1, i.squeeze(1), 1.0)


def _amax_scatter_of_signed_zeros(q, k, w):  # amax(+0.0, -0.0): whichever comes first
    s = _scores(q, k, w)
    i = s.topk(K, dim=-1).indices
    return torch.full_like(s, -1.0).scatter_reduce(-1, i % 3, torch.where(i % 2 == 0, 0.0, -0.0), "amax")


def _amax_scatter_of_varying_values(q, k, w):  # values not permuted with the indices
    s = _scores(q, k, w)
    i = s.topk(K, dim=-1).indices
    alternating = torch.where(torch.arange(K) % 2 == 0, 1.0, 2.0)
    return torch.zeros_like(s).scatter_reduce(-1, i, alternating.expand(i.shape).contiguous(), "amax")


def _sum_scatter_reduce(q, k, w):  # a float sum in pick order
    s = _scores(q, k, w)
    v, i = s.topk(K, dim=-1)
    return torch.zeros_like(s).scatter_reduce(-1, i % 3, v.clamp(min=-1e4), "sum")


def _int_sum_in_float(q, k, w):
    i = _scores(q, k, w).topk(K, dim=-1).indices
    return ((i + 1) * 16777217).sum(-1, dtype=torch.float32)


@pytest.mark.parametrize("fn", [_returned, _gather_then_softmax_sum, _float_sum_of_values, _float_max_of_values,
                                _argmax_position, _scatter_values_repeated_indices, _plus_position, _cumsum,
                                _flattened_k, _same_picks_as_previous_query, _two_selected_rows, _row_broadcast,
                                _reduce_over_queries_first, _scatter_at_mixed_rows, _scatter_values_of_another_row,
                                _scatter_values_at_lossy_cast, _squeeze_of_a_long_axis, _int_sum_in_float,
                                _amax_scatter_of_signed_zeros, _amax_scatter_of_varying_values, _sum_scatter_reduce])
def test_order_read_keeps_the_sort(fn):
    args = _inputs(fresh_seed(fn.__name__))
    site = _site(fn, args)
    assert site.sorted and not site.sort_elided, site.line()
    assert "(unsorted" not in site.line()


def test_order_unread_names_the_op_that_reads():
    """The analysis says which use reads the order (what a user would look for)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from hyscale_compile.passes.order import order_unread

    def topk_of(fn):
        gm = make_fx(torch.func.functionalize(fn), tracing_mode="fake")(*_inputs(0))  # (as AOT sees it)
        tk, = [n for n in gm.graph.nodes if n.target is torch.ops.aten.topk.default]
        return tk

    for fn, reader in [(_returned, "the graph output"), (_float_sum_of_values, "aten.sum"),
                       (_argmax_position, "aten.max.dim's positions"), (_cumsum, "aten.cumsum"),
                       (_plus_position, "(with an operand that varies along k)"),
                       (_scatter_values_repeated_indices, "(of values that vary along k)"),
                       (_float_max_of_values, "(of floats over k"),
                       (_amax_scatter_of_signed_zeros, "(of values whose amax can depend on the order"),
                       (_amax_scatter_of_varying_values, "(of values that vary along k, not with the indices)"),
                       (_sum_scatter_reduce, "(reduce='sum')")]:
        unread, why = order_unread(topk_of(fn), 2)
        assert not unread and reader in why, (fn.__name__, why)
    assert order_unread(topk_of(_inf_scatter_minus_one), 2) == (True, "aten.scatter.value")
    assert order_unread(topk_of(_src_scatter_and_int_reductions), 2) == (
        True, "aten.amax, aten.scatter.src, aten.sort, aten.sum.dim_IntList")


def test_long_chains_do_not_crash():
    """A worklist, not recursion: 600 pointwise ops between the top-k and its scatter."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from hyscale_compile.passes.order import order_unread

    def fn(q, k, w):
        s = _scores(q, k, w)
        i = s.topk(K, dim=-1).indices
        for _ in range(600):
            i = i + 0
        return torch.zeros_like(s).scatter(-1, i, 1.0)

    gm = make_fx(torch.func.functionalize(fn), tracing_mode="fake")(*_inputs(0))
    tk, = [n for n in gm.graph.nodes if n.target is torch.ops.aten.topk.default]
    assert order_unread(tk, 2) == (True, "aten.scatter.value")


def test_shuffle_shows_an_order_read():
    """The shuffle is live: an unsorted result that is read in order comes out different, so
    the bit-equality above would catch a sort dropped where the order is read."""
    def fn(q, k, w):
        return _scores(q, k, w).topk(K, dim=-1, sorted=False).indices

    args = _inputs(fresh_seed("shuffle"), S=16)
    plain, _ = _run(fn, args)
    with shuffled_unsorted(1):
        shuffled, _ = _run(fn, args)
    assert not torch.equal(plain[0], shuffled[0])
    assert torch.equal(plain[0].sort(-1).values, shuffled[0].sort(-1).values)


def test_option_keeps_the_sort():
    from hyscale_compile.passes import diagnostics

    args = _inputs(0)
    diagnostics.clear()
    _run(_bool_scatter, args, elide=False)
    rec = diagnostics.records()[-1]
    assert rec.rewritten and rec.sorted and not rec.sort_elided, rec.line()
    # (a bad value for the option: test_backend.test_bad_options_name_the_problem)


def order_free(case) -> bool:
    """Zoo forms whose selected indices only reach a scatter into a mask (by their tags)."""
    tags = set(case.tags)
    return bool(tags & {"bool_scatter_consumer", "scatter_inf_consumer"}) and not tags & {
        "gather_consumer", "index_select_consumer", "values_used"}


@pytest.mark.parametrize("name", sorted(n for n in FORMS if order_free(FORMS[n](0))))
def test_forms_same_bits_with_the_sort_dropped(name):
    """Zoo forms that scatter the indices into a mask: the pass drops the sort (or the form
    asked for sorted=False), and shuffled unsorted results give the bits of sorted ones,
    forward and (where the form trains) gradients, in the graph the run compiled."""
    from hyscale_compile.passes import diagnostics

    case = FORMS[name](fresh_seed(name) % 1000)
    grad = "no_grad" not in case.tags and any(a.is_floating_point() for a in case.args if isinstance(a, torch.Tensor))
    diagnostics.clear()
    kept, gk = _run(case.fn, case.args, elide=False, grad=grad)
    assert all(r.sorted != ("sorted_false" in case.tags) for r in diagnostics.records() if r.rewritten)
    diagnostics.clear()
    with shuffled_unsorted(fresh_seed(name)):
        dropped, gd = _run(case.fn, case.args, grad=grad)
    recs = [r for r in diagnostics.records() if r.rewritten]
    assert len(recs) == case.num_selections, recs
    for r in recs:
        assert not r.sorted and (r.graph == "joint") == grad, r.line()
        assert bool(r.sort_elided) == ("sorted_false" not in case.tags), r.line()
    _same_bits(dropped, kept)
    if grad:
        _same_bits(gd, gk)
