"""hyscale_compile.testing.assert_selection_equal: the check a user runs instead of
``torch.equal(compiled(x), eager(x))`` (docs/contract.md, "Equality with eager"), positive and
negative cases."""
import math
import re

import pytest
import torch
from torch._dynamo.utils import counters

import hyscale_compile  # noqa: F401
from hyscale_compile.testing import (assert_consumer_close, assert_selection_equal, consumer_error,
                                     square_tensors, stable_topk)
from tests.contract import fresh_seed

K = 6


def scores_of(q, k, w):
    """A DSA-style indexer's table: ReLU logits (exact-zero ties), a causal -inf fill (the
    first rows have fewer than K valid keys)."""
    s = (torch.einsum("bshd,btd->bsht", q, k).relu() * w.unsqueeze(-1)).sum(2)
    S, T = s.shape[-2:]
    hidden = torch.ones(S, T, dtype=torch.bool, device=s.device).triu(1)
    return s.masked_fill(hidden, -math.inf)


def indexer(q, k, w):
    return scores_of(q, k, w).topk(K, dim=-1)


def inputs(seed, S=16, H=2, D=8, ints=False):
    g = torch.Generator().manual_seed(seed)
    if ints:  # small integers: every score is exact in fp32, so ties are real ties
        q = torch.randint(-2, 3, (1, S, H, D), generator=g).float()
        k = torch.randint(-2, 3, (1, S, D), generator=g).float()
        w = torch.randint(1, 3, (1, S, H), generator=g).float()
    else:
        q, k = torch.randn(1, S, H, D, generator=g), torch.randn(1, S, D, generator=g)
        # negative queries for half the keys' products: many keys score exactly 0
        q = q - 0.8
        w = torch.rand(1, S, H, generator=g)
    return q, k, w


def test_compiled_indexer_passes_where_torch_topk_differs():
    """The user's check: the compiled indexer against its own eager table, in fp32 (within
    tolerance) and in float64, and exactly on integer inputs. torch.topk's own answer may
    differ (masked picks, ReLU ties); the helper says the compiled one is right."""
    seed = fresh_seed("compiled indexer")
    for ints in (False, True):
        q, k, w = inputs(seed, ints=ints)
        torch._dynamo.reset()
        before = counters["hyscale"]["rewritten"]
        with torch.no_grad():
            vals, idx = torch.compile(indexer, backend="hyscale_debug")(q, k, w)
        assert counters["hyscale"]["rewritten"] == before + 1  # the op's selection, not torch.topk's
        table = scores_of(q, k, w)
        assert bool((table == 0).sum(-1).max() > 1) and bool((table == -math.inf).any())  # ties and masked rows
        assert_selection_equal(idx, table, values=vals)
        assert_selection_equal(idx, scores_of(q.double(), k.double(), w.double()), values=vals)
        if ints:
            assert_selection_equal(idx, table, values=vals, rtol=0, atol=0)
    # eager's selection: the same scores as multisets, and where it differs from the stable
    # rule it is only in which tied or masked keys it took
    ev, ei = indexer(q, k, w)
    rv, ri = stable_topk(table, K)
    assert torch.equal(ev.sort(-1).values, rv.sort(-1).values)


def _case(seed):
    q, k, w = inputs(seed)
    table = scores_of(q, k, w)
    vals, idx = stable_topk(table, K)
    return table, vals, idx


def test_wrong_index_outside_tolerance_fails():
    seed = fresh_seed("wrong index")
    table, vals, idx = _case(seed)
    # a row with more than K valid keys whose K-th score beats its worst unselected key by
    # more than the tolerance (with 2 ReLU'd heads a row can end in a tie at 0: not that one)
    def gap(r):
        rest = [t for t in range(r + 1) if t not in idx[0, r].tolist()]
        worst = min(rest, key=lambda t: float(table[0, r, t]))
        return float(table[0, r, idx[0, r, -1]] - table[0, r, worst]), worst
    r = next((r for r in range(12, table.shape[1]) if gap(r)[0] > 1e-3), None)
    assert r is not None, "no row with a clear K-th score: the inputs changed"
    worst = gap(r)[1]
    bad = idx.clone()
    bad[0, r, -1] = worst
    with pytest.raises(AssertionError, match=rf"row \(0, {r}\): the selected scores .* are not the top-k scores"):
        assert_selection_equal(bad, table)
    # the same swap within the tolerance passes: a key tied with the K-th (or nearly)
    near = table.clone()
    near[0, r, worst] = table[0, r, idx[0, r, -1]] - 1e-7
    assert_selection_equal(bad, near, atol=1e-6, rtol=0)
    assert_selection_equal(idx, table)  # the unmodified selection passes


def test_wrong_masked_slot_fails():
    """Row 1 has 2 valid keys: its other slots are masked keys 2, 3, 4, 5, with -inf."""
    seed = fresh_seed("masked slot")
    table, vals, idx = _case(seed)
    assert idx[0, 1, 2:].tolist() == [2, 3, 4, 5]
    bad = vals.clone()
    bad[0, 1, 3] = torch.finfo(torch.float32).min  # not what the arithmetic gives there
    with pytest.raises(AssertionError, match=r"row \(0, 1\): values .* differ from the scores at the indices"):
        assert_selection_equal(idx, table, values=bad)
    bad = vals.clone()
    bad[0, 1, 3] = 0.0
    with pytest.raises(AssertionError, match="differ from the scores"):
        assert_selection_equal(idx, table, values=bad)
    other = idx.clone()
    other[0, 1, 5] = 9  # another masked key, also -inf: not the smallest-index ones
    with pytest.raises(AssertionError, match=re.escape("masked slots hold keys [2, 3, 4, 9]")):
        assert_selection_equal(other, table)
    # a masked key while a valid one was left out
    other = idx.clone()
    other[0, 1, 1] = 9
    with pytest.raises(AssertionError, match="are not the top-k scores"):
        assert_selection_equal(other, table)


def test_exact_mode_checks_ties_and_order():
    seed = fresh_seed("exact ties")
    q, k, w = inputs(seed, ints=True)
    table = scores_of(q, k, w)
    vals, idx = stable_topk(table, K)
    # find a row whose K-th score ties with an unselected key
    for r in range(K, table.shape[1]):
        kth = table[0, r, idx[0, r, -1]]
        tied = [t for t in range(r + 1) if t not in idx[0, r].tolist() and table[0, r, t] == kth]
        if tied:
            break
    else:
        pytest.skip("no tie at the K-th place for this seed")
    swapped = idx.clone()
    swapped[0, r, -1] = tied[0]
    assert_selection_equal(swapped, table)  # tied: fine as a multiset
    with pytest.raises(AssertionError, match="differ from the stable .* top-k of exact scores"):
        assert_selection_equal(swapped, table, rtol=0, atol=0)
    # sorted=False: any order of the right set; sorted=True: descending
    perm = idx.flip(-1)
    assert_selection_equal(perm, table, values=vals.flip(-1), sorted=False)
    assert_selection_equal(perm, table, values=vals.flip(-1), sorted=False, rtol=0, atol=0)
    with pytest.raises(AssertionError):
        assert_selection_equal(perm, table, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="not in descending order"):
        assert_selection_equal(perm[:, K:], table[:, K:])


def test_per_row_tolerance_and_bad_arguments():
    table, vals, idx = _case(0)
    assert_selection_equal(idx, table, values=vals, atol=torch.full(table.shape[:-1], 1e-5), rtol=0)
    dup = idx.clone()
    dup[0, 10, 1] = dup[0, 10, 0]
    with pytest.raises(AssertionError, match=r"row \(0, 10\): a key selected twice"):
        assert_selection_equal(dup, table)
    with pytest.raises(AssertionError, match="outside"):
        assert_selection_equal(idx + 100, table)
    with pytest.raises(TypeError, match="indices must be an integer tensor"):
        assert_selection_equal(idx.float(), table)
    with pytest.raises(ValueError, match="agree in every dim"):
        assert_selection_equal(idx[:, :3], table)
    with pytest.raises(ValueError, match="per-row atol"):
        assert_selection_equal(idx, table, atol=torch.zeros(3))


def test_readme_quick_start_check_runs():
    """The README's quick-start check, as written (on the debug backend: no Inductor compile)."""
    import os

    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "assert_selection_equal" in b]
    assert 'backend="hyscale"' in block
    torch._dynamo.reset()
    before = counters["hyscale"]["rewritten"]
    exec(compile(block.replace('backend="hyscale"', 'backend="hyscale_debug"'), "README.md", "exec"), {})
    assert counters["hyscale"]["rewritten"] == before + 1


def test_consumer_rule_bounds_by_the_original_error():
    """err(out) <= 2 err(orig) + 2 eps(dtype), err = max|x - ref| / max|ref|: an output as far
    from float64 as the original passes, one 3x as far fails, and eps is the floor."""
    g = torch.Generator().manual_seed(fresh_seed("consumer rule"))
    ref = torch.randn(4, 8, generator=g, dtype=torch.float64)
    scale = float(ref.abs().max())
    orig = ref + 1e-3 * scale
    assert abs(consumer_error(orig, ref) - 1e-3) < 1e-9
    assert assert_consumer_close(ref + 2e-3 * scale, orig, ref, torch.float32)[0] == pytest.approx(2e-3)
    with pytest.raises(AssertionError, match=r"grad q: err 0.003 > 2 \* err\(orig\) 0.001"):
        assert_consumer_close(ref + 3e-3 * scale, orig, ref, torch.float32, what="grad q")
    # an exact original: the floor is 2 eps of the dtype
    eps = torch.finfo(torch.bfloat16).eps
    assert_consumer_close(ref + 1.5 * eps * scale, ref, ref, torch.bfloat16)
    with pytest.raises(AssertionError):
        assert_consumer_close(ref + 3 * eps * scale, ref, ref, torch.bfloat16)


def test_consumer_error_special_values_and_bad_arguments():
    ref = torch.tensor([[1.0, -2.0], [float("nan"), float("nan")]], dtype=torch.float64)  # a row with no key: NaN
    assert consumer_error(ref.float(), ref) == 0.0
    assert consumer_error(torch.tensor([[1.0, -2.0], [0.0, float("nan")]]), ref) == math.inf
    assert consumer_error(torch.tensor([[float("inf"), -2.0], [float("nan")] * 2]), ref) == math.inf
    zero = torch.zeros(3, dtype=torch.float64)
    assert consumer_error(torch.zeros(3), zero) == 0.0 and consumer_error(torch.ones(3), zero) == math.inf
    with pytest.raises(ValueError, match="shapes differ"):
        consumer_error(torch.zeros(2), zero)
    with pytest.raises(TypeError, match="floating-point torch.dtype"):
        assert_consumer_close(zero, zero, zero, torch.int32)


def _dense_attention(q, k, v):
    """softmax(q k^T) v over [B, S, D]: its scores are [B, S, T]."""
    return torch.softmax(q @ k.transpose(1, 2) * 0.5, dim=-1) @ v


def _linear_only(q, k, v):
    return (q * k).sum(-1, keepdim=True) * v


@pytest.mark.parametrize("dynamic", [False, True])
def test_square_tensors_finds_the_score_table(dynamic):
    """The [B, S, T] scores of a dense attention are found in the forward graph (saved for the
    backward) and in the backward graph, static or under dynamic=True; a function of O(S)
    values has none. S = 24 is no other dim here."""
    B, S, D = 2, 24, 8
    q, k, v = (torch.randn(B, S, D, requires_grad=True) for _ in range(3))
    for fn, square in ((_dense_attention, True), (_linear_only, False)):
        cap = []
        torch._dynamo.reset()
        torch.compile(fn, backend="hyscale_debug", dynamic=dynamic, options={"hyscale.capture": cap})(q, k, v).sum().backward()
        kinds = {k for k, g in cap if not isinstance(g, str)}
        assert {"forward", "backward"} <= kinds
        found = square_tensors(cap, [S])
        if not square:
            assert found == [], found
            continue
        assert any(line.startswith("forward:") for line in found), found
        assert any(line.startswith("backward:") for line in found), found
        if not dynamic:
            assert any(f"f32[{B}, {S}, {S}]" in line for line in found), found


def test_square_tensors_counts_flattened_dims_and_buffers():
    """A [B*S, T] view counts as two sequence dims under dynamic shapes; a GraphModule's
    [S, S] buffer is found; bad arguments raise."""
    S = 24

    def flat(q, k):
        return (q.reshape(-1, q.shape[-1]) @ k[0].t()).relu().sum(-1)

    cap = []
    torch._dynamo.reset()
    torch.compile(flat, backend="hyscale_debug", dynamic=True, options={"hyscale.capture": cap})(
        torch.randn(2, S, 8), torch.randn(2, S, 8))
    assert any("mm" in line for line in square_tensors(cap, S)), square_tensors(cap, S)

    class WithMask(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mask", torch.ones(S, S).tril())

        def forward(self, x):
            return x @ self.mask

    gm = torch.fx.symbolic_trace(WithMask())
    assert square_tensors(gm, [S]) == [f"graph0: mask f32[{S}, {S}] = buffer"]
    assert square_tensors(gm, [S + 1]) == []
    with pytest.raises(TypeError, match="expected GraphModules"):
        square_tensors([1], [S])
