"""The op's CPU implementation (lowerings/reference.py) against the contract (docs/contract.md)."""
import math

import pytest
import torch

import hyscale_compile  # noqa: F401  registers torch.ops.hyscale
from hyscale_compile.lowerings.reference import dense_scores, streaming_topk
from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec, SpecError
from tests.contract import assert_stable_topk, check_selection, fresh_seed, reference_f64, tolerance

CAUSAL = MaskTerm("range", hi=0)
DSA = ScoreSpec(epilogue=(("relu",), ("mul", 0.125)), post=(("mask", 0),), masks=(CAUSAL,))


def causal_hi(B, S, T):
    return (torch.arange(S) + 1 + (T - S)).view(1, S).expand(B, S)


def make(seed, B=2, S=24, T=40, H=4, D=16, Hk=1, dtype=torch.float32, ints=False):
    g = torch.Generator().manual_seed(seed)
    if ints:  # exactly representable: every score is an exact small integer in fp32
        q = torch.randint(-2, 3, (B, S, H, D), generator=g).to(dtype)
        k = torch.randint(-2, 3, (B, T, Hk, D), generator=g).to(dtype)
        w = torch.randint(-2, 3, (B, S, H), generator=g).float()
    else:
        q = torch.randn(B, S, H, D, generator=g).to(dtype)
        k = torch.randn(B, T, Hk, D, generator=g).to(dtype)
        w = torch.randn(B, S, H, generator=g)
    return q, k, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("topk", [1, 7, 16, 40])
def test_threshold_contract_random(dtype, topk):
    seed = fresh_seed(f"random {dtype} k={topk}")
    q, k, w = make(seed, dtype=dtype)
    hi = causal_hi(2, 24, 40)
    vals, idx = streaming_topk(q, k, w, [hi], topk, DSA, return_values=True, chunk_bytes=4 * 4 * 256 * 5)
    ref = reference_f64(q, k, w, [hi], DSA)
    check_selection(idx, ref, tolerance(q, k, w, DSA), topk, vals)
    assert idx.dtype == torch.int32 and vals.dtype == torch.float32


@pytest.mark.parametrize("spec", [
    DSA,
    ScoreSpec(reduce="sum", post=(("div", 11.0), ("mask", 0)), masks=(CAUSAL,)),  # GLM-like, no relu, QSA-like sum
    ScoreSpec(epilogue=(("mul", 0.5), ("relu",)), post=(("mask", 0),), masks=(MaskTerm("range", lo=0, hi=1, mode="add", value=-math.inf),)),
])
def test_ties_match_stable_order_exactly(spec):
    """Integer inputs: ReLU's exact-zero ties and duplicated keys resolve to the smaller key."""
    seed = fresh_seed("ties")
    q, k, w = make(seed, ints=True)
    k[:, 5:9] = k[:, 1:2]  # duplicated keys
    if spec.reduce == "sum":
        w = None
    B, S, T = 2, 24, 40
    if len(spec.masks) and spec.masks[0].lo is not None:
        lo = torch.randint(0, 10, (B, S))
        masks = [lo, causal_hi(B, S, T)]
    else:
        masks = [causal_hi(B, S, T)]
    for topk in (3, 16, 33):
        vals, idx = streaming_topk(q, k, w, masks, topk, spec, return_values=True, chunk_bytes=4 * 4 * 256 * 3)
        assert_stable_topk(idx, dense_scores(q, k, w, masks, spec), topk, vals)


def test_signed_zero_ties_one_value():
    # -0.0 and +0.0 tie (value desc, index asc): the CPU path (streaming_topk, in chunks of keys
    # small enough that the tied zeros straddle chunks and merges), the table selection
    # (table_topk) and the stable reference all take the zeros of the smallest indices,
    # whatever their sign. The scores: a zero head times -1 (-0.0), plus a table of -0.0, +0.0
    # and a few positive values
    from hyscale_compile.lowerings.reference import stable_topk, table_topk

    g = torch.Generator().manual_seed(fresh_seed("signed zero ties"))
    S, T, topk = 3, 600, 64
    sign = torch.where(torch.rand(1, S, T, generator=g) < 0.5, -0.0, 0.0)
    table = torch.where(torch.rand(1, S, T, generator=g) < 0.03, torch.rand(1, S, T, generator=g) + 0.5, sign)
    spec = ScoreSpec(reduce="none", post=(("mul", -1.0), ("mask", 0)), masks=(MaskTerm(kind="add", operand=0),))
    q, k = torch.zeros(1, S, 1, 16), torch.zeros(1, T, 1, 16)
    scores = dense_scores(q, k, None, [table], spec)
    zeros = scores == 0
    neg = torch.signbit(scores)
    assert bool((zeros & neg).sum(-1).min() > 100) and bool((zeros & ~neg).sum(-1).min() > 100)
    npos = (scores > 0).sum(-1, keepdim=True)
    assert bool((npos < topk).all())
    # the expected rows: the positive keys by value, then the first zeros by index
    nth_zero = torch.where(zeros, zeros.long().cumsum(-1) - 1, T)
    want = [sorted(torch.nonzero((scores[0, s] > 0) | (nth_zero[0, s] < topk - npos[0, s])).flatten().tolist())
            for s in range(S)]
    for name, idx in (("streaming_topk", streaming_topk(q, k, None, [table], topk, spec, chunk_bytes=4096)),
                      ("table_topk", table_topk(scores, topk)), ("stable_topk", stable_topk(scores, topk)[1])):
        got = [sorted(idx[0, s].tolist()) for s in range(S)]
        assert got == want, name


def test_rows_with_fewer_valid_keys_than_k():
    seed = fresh_seed("short rows")
    q, k, w = make(seed, S=8, T=8)
    hi = causal_hi(2, 8, 8)
    vals, idx = streaming_topk(q, k, w, [hi], 6, DSA, return_values=True)
    for s in range(8):
        n = min(6, s + 1)
        masked = idx[:, s, n:]
        assert torch.equal(masked.long(), torch.arange(s + 1, s + 1 + 6 - n).expand_as(masked)), (s, idx[:, s])
        assert bool((vals[:, s, n:] == -math.inf).all())
    check_selection(idx, reference_f64(q, k, w, [hi], DSA), tolerance(q, k, w, DSA), 6, vals)


def test_tensor_masks_and_finite_additive():
    """Runtime masks: bool fill, finfo.min additive (masked slots keep s + min exactly)."""
    seed = fresh_seed("tensor masks")
    q, k, w = make(seed, S=12, T=20)
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(2, 1, 20, generator=g) > 0.3
    addm = torch.where(torch.rand(2, 12, 20, generator=g) > 0.5, torch.finfo(torch.float32).min, 0.0)
    spec = ScoreSpec(epilogue=(("relu",),), post=(("mask", 0), ("mask", 1)),
                     masks=(MaskTerm("fill", operand=0, where=False, value=-math.inf), MaskTerm("add", operand=1)))
    vals, idx = streaming_topk(q, k, w, [keep, addm], 15, spec, return_values=True)
    ref = reference_f64(q, k, w, [keep, addm], spec)
    check_selection(idx, ref, tolerance(q, k, w, spec), 15, vals)
    # the fp32 values are exactly what the fp32 arithmetic gives, finite-min slots included
    dense = dense_scores(q, k, w, [keep, addm], spec)
    assert torch.equal(vals, torch.gather(dense, -1, idx.long()))


def test_gqa_and_bf16_logits():
    seed = fresh_seed("gqa")
    q, k, w = make(seed, H=8, Hk=2, dtype=torch.bfloat16)
    spec = ScoreSpec(logit_dtype="bfloat16", epilogue=(("relu",), ("round", "bfloat16")), post=(("mask", 0),), masks=(CAUSAL,))
    hi = causal_hi(2, 24, 40)
    idx = streaming_topk(q, k, w, [hi], 9, spec)
    check_selection(idx, reference_f64(q, k, w, [hi], spec), tolerance(q, k, w, spec), 9)


def test_deterministic_across_chunkings():
    seed = fresh_seed("chunking")
    q, k, w = make(seed, ints=True, T=300)
    hi = causal_hi(2, 24, 300)
    outs = [streaming_topk(q, k, w, [hi], 20, DSA, chunk_bytes=cb) for cb in (4 * 4 * 256, 1 << 20, 1 << 26)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_op_dispatch_and_bad_input():
    q, k, w = make(0)
    hi = causal_hi(2, 24, 40)
    idx = torch.ops.hyscale.hytopk(q, k, w, [hi], 5, DSA.to_json())
    assert idx.shape == (2, 24, 5) and idx.dtype == torch.int32
    with pytest.raises(SpecError, match="k=41"):
        torch.ops.hyscale.hytopk(q, k, w, [hi], 41, DSA.to_json())
    with pytest.raises(SpecError, match="weighted_sum needs w"):
        torch.ops.hyscale.hytopk(q, k, None, [hi], 5, DSA.to_json())
    with pytest.raises(SpecError, match="not valid JSON"):
        torch.ops.hyscale.hytopk(q, k, w, [hi], 5, "{nope")
    with pytest.raises(SpecError, match="mask operand 0 out of range"):
        torch.ops.hyscale.hytopk(q, k, w, [], 5, DSA.to_json())


def test_operand_dtypes_checked():
    """float64 and integer operands raise instead of being computed in fp32; the dtype
    pairs the matcher emits (fp32/bf16/fp16 each side, QSA's bf16 queries x fp32 keys) run."""
    q, k, w = make(0)
    hi = causal_hi(2, 24, 40)
    spec = DSA.to_json()
    for args, match in [
        ((q.double(), k, w), "q has dtype torch.float64"),
        ((q, k.double(), w), "k has dtype torch.float64"),
        ((q, k, w.double()), "w has dtype torch.float64"),
        ((q.long(), k.long(), w), "q has dtype torch.int64"),
        ((q, k.to(torch.int32), w), "k has dtype torch.int32"),
        ((q, k, w.to(torch.int32)), "w has dtype torch.int32"),
    ]:
        with pytest.raises(SpecError, match=match) as info:
            torch.ops.hyscale.hytopk(*args, [hi], 5, spec)
        assert "float32, bfloat16 or float16" in str(info.value)
    ref = streaming_topk(q, k, w, [hi], 5, DSA)
    for qd, kd in [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.float32, torch.float16)]:
        qq, kk = q.to(qd), k.to(kd)
        idx = torch.ops.hyscale.hytopk(qq, kk, w, [hi], 5, spec)
        table = reference_f64(qq, kk, w, [hi], DSA)
        check_selection(idx, table, tolerance(qq, kk, w, DSA), 5)
    assert ref.dtype == torch.int32


def test_mask_operand_shapes_named():
    """A mask operand that does not broadcast to what its term needs is named, with the shape."""
    q, k, w = make(0)  # B=2, S=24, T=40
    with pytest.raises(SpecError, match=r"mask operand 0 \(the range term's hi bound\) has shape \(2, 5\); "
                                        r"it must broadcast to \[B, S\] = \(2, 24\)"):
        torch.ops.hyscale.hytopk(q, k, w, [causal_hi(2, 5, 40)], 5, DSA.to_json())
    add = ScoreSpec(post=(("mask", 0),), masks=(MaskTerm("add", operand=0),))
    with pytest.raises(SpecError, match=r"mask operand 0 \(an additive mask\) has shape \(2, 24, 39\); "
                                        r"it must broadcast to \[B, S, T\] = \(2, 24, 40\)"):
        torch.ops.hyscale.hytopk(q, k, w, [torch.zeros(2, 24, 39)], 5, add.to_json())
    fill = ScoreSpec(post=(("mask", 0),), masks=(MaskTerm("fill", operand=0),))
    with pytest.raises(SpecError, match=r"mask operand 0 \(a fill mask\) has shape \(3, 1, 40\)"):
        torch.ops.hyscale.hytopk(q, k, w, [torch.zeros(3, 1, 40, dtype=torch.bool)], 5, fill.to_json())
    # broadcastable shapes are fine
    torch.ops.hyscale.hytopk(q, k, w, [torch.zeros(1, 40)], 5, add.to_json())
    torch.ops.hyscale.hytopk(q, k, w, [causal_hi(2, 24, 40)[:1]], 5, DSA.to_json())


_BITS_PROGRAM = """
import hashlib, torch, hyscale_compile
from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec
g = torch.Generator().manual_seed(SEED)
q = torch.randn(2, 40, 4, 16, generator=g); k = torch.randn(2, 300, 1, 16, generator=g); w = torch.randn(2, 40, 4, generator=g)
hi = (torch.arange(40) + 261).view(1, 40)
spec = ScoreSpec(epilogue=(("relu",), ("mul", 0.125)), post=(("mask", 0),), masks=(MaskTerm("range", hi=0),))
v, i = torch.ops.hyscale.hytopk_values(q, k, w, [hi], 33, spec.to_json())
print(hashlib.sha256(v.numpy().tobytes() + i.numpy().tobytes()).hexdigest())
"""


def test_bitwise_identical_across_processes():
    import subprocess
    import sys

    seed = fresh_seed("bits")
    code = _BITS_PROGRAM.replace("SEED", str(seed))
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120) for _ in range(2)]
    assert all(o.returncode == 0 for o in outs), outs[0].stderr[-2000:]
    assert outs[0].stdout.strip() == outs[1].stdout.strip() != ""


def test_runtime_scalar_operands():
    """``mul_operand``/``div_operand`` steps read a 0-d operand at run time and give the
    same bits as the constant they hold."""
    q, k, w = make(fresh_seed("operands"))
    hi = causal_hi(2, 24, 40)
    scale = torch.tensor(0.125)
    with_operand = ScoreSpec(epilogue=(("relu",), ("mul_operand", 1)), post=(("div_operand", 2), ("mask", 0)), masks=(CAUSAL,))
    constant = ScoreSpec(epilogue=(("relu",), ("mul", 0.125)), post=(("div", 3.0), ("mask", 0)), masks=(CAUSAL,))
    a = torch.ops.hyscale.hytopk_values(q, k, w, [hi, scale, torch.tensor(3.0)], 9, with_operand.to_json())
    b = torch.ops.hyscale.hytopk_values(q, k, w, [hi], 9, constant.to_json())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(SpecError, match="names no operand"):
        torch.ops.hyscale.hytopk(q, k, w, [hi], 9, with_operand.to_json())


# A non-finite operand that reaches a hidden key's score (NaN, or +inf: inf + -inf) makes
# it NaN in eager when the mask is additive (s + where(hidden, -inf, 0)), and torch.topk
# ranks NaN (either sign) above everything: the op may skip a hidden chunk only once the
# operands are proven finite. T > 1024: a second key chunk, hidden for every row.
_NAN_T, _NAN_HIDDEN = 1100, 1050
ADD_CAUSAL = ScoreSpec(epilogue=(("relu",), ("mul", 0.5)), post=(("mask", 0),),
                       masks=(MaskTerm("range", hi=0, mode="add", value=-math.inf),))
FILL_THEN_TENSOR = ScoreSpec(epilogue=(("relu",),), post=(("mask", 0), ("mask", 1)),
                             masks=(MaskTerm("range", hi=0), MaskTerm("add", operand=1)))


def _nonfinite_case(where, sign):
    q, k, w = make(fresh_seed(f"nonfinite {where} {sign}"), B=1, S=6, T=_NAN_T, H=2, D=8, ints=True)
    hi = torch.tensor([[990, 1000, 1010, 1020, 1023, 1001]])
    masks, spec = [hi], ADD_CAUSAL
    bad = sign * (math.inf if where.endswith("inf") else math.nan)
    if where == "k":
        k[0, _NAN_HIDDEN, 0, 3] = bad
    elif where == "k_inf":  # +inf at a hidden key: q > 0 there, w > 0, so y = +inf, then inf + -inf
        q[..., 3], w = 1.0, w.abs() + 1
        k[0, _NAN_HIDDEN, 0, 3] = bad
    elif where == "q":
        q[0, 2, 1, 5] = bad
    elif where == "w":
        w[0, 4, 0] = bad
    else:  # a later additive mask tensor: -inf + NaN (or + inf) is NaN
        m = torch.zeros(1, 6, _NAN_T)
        m[0, :, _NAN_HIDDEN] = bad
        masks, spec = [hi, m], FILL_THEN_TENSOR
    return q, k, w, masks, spec


def _assert_eager_selection(q, k, w, masks, spec, topk, chunk_bytes):
    vals, idx = streaming_topk(q, k, w, masks, topk, spec, return_values=True, chunk_bytes=chunk_bytes)
    rv, ri = dense_scores(q, k, w, masks, spec).sort(dim=-1, descending=True, stable=True)
    rv, ri = rv[..., :topk], ri[..., :topk]
    assert torch.equal(idx.long(), ri), (idx, ri)
    assert ((vals == rv) | (vals.isnan() & rv.isnan())).all(), (vals, rv)
    return idx


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("where", ["k", "k_inf", "q", "w", "mask_tensor"])
def test_nonfinite_operand_in_hidden_chunk_selected_like_eager(where, sign):
    q, k, w, masks, spec = _nonfinite_case(where, sign)
    # one row per chunk, and every row in one chunk: the same selection as the whole table's
    outs = [_assert_eager_selection(q, k, w, masks, spec, 4, cb) for cb in (4 * 2 * 1024, 1 << 26)]
    assert torch.equal(outs[0], outs[1])
    if where in ("k", "mask_tensor") or (where == "k_inf" and sign > 0):
        assert (outs[0][..., 0] == _NAN_HIDDEN).all()  # NaN in every row, ranked first


def test_finite_operands_still_skip_hidden_chunks(monkeypatch):
    from hyscale_compile.lowerings import reference

    scored = []
    real = reference.score_block
    monkeypatch.setattr(reference, "score_block", lambda *a, **kw: scored.append(a[9]) or real(*a, **kw))
    for nan in (True, False):
        q, k, w, masks, spec = _nonfinite_case("k", 1)
        if not nan:
            k[0, _NAN_HIDDEN, 0, 3] = 1.0
        scored.clear()
        streaming_topk(q, k, w, masks, 4, spec, chunk_bytes=1 << 26)
        assert scored == ([0, 1024] if nan else [0]), scored  # the key chunk [1024, 1100) hides 1050
        _assert_eager_selection(q, k, w, masks, spec, 4, 1 << 26)
