"""The generated Triton HyTopK kernel against the CPU reference.

Two kinds of tests:

* ``@pytest.mark.interpret``: CPU tensors under ``TRITON_INTERPRET=1``, small shapes only
  (the interpreter runs each program step in Python).
* ``@pytest.mark.gpu``: CUDA at realistic shapes; skipped cleanly without a GPU.

Triton decides interpreted vs compiled when ``@triton.jit`` decorates a function
(``triton/runtime/jit.py`` reads ``knobs.runtime.interpret`` in the decorator). Our
generated kernel is decorated late (when ``load_kernel`` imports it), but triton's own
``@jit`` library (tl.zeros, tl.sum, tl.sort ...) is decorated when triton is first
imported, so one process is either interpreted or compiled throughout. Hence this module
sets ``TRITON_INTERPRET=1`` *before anything imports triton* when there is no GPU; on a GPU
machine run ``pytest -m gpu`` for the compiled tests and ``TRITON_INTERPRET=1 pytest -m
interpret`` for the interpreter tests (each set skips itself in the other mode).

Exactness (docs/contract.md, "Exact top-k"): on exactly representable inputs (small integers), indices and
values must equal a stable (value desc, index asc) sort of the reference scores; on random
floats, a threshold check against a float64 reference with the documented tolerance.
Every random case prints its seed.
"""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (see above)

from hyscale_compile.lowerings import mask_kinds
from hyscale_compile.lowerings import reference as ref
from hyscale_compile.lowerings import triton_codegen as cg
from hyscale_compile.lowerings.spec import (MaskTerm, ScoreSpec, SpecError, add_limit, dtype_of, finite_range_term,
                                            kernel_plan, skippable_mask_terms, tensor_mask_term)
from hyscale_compile.lowerings import triton_hytopk
from hyscale_compile.lowerings.triton_hytopk import HyTopKConfig, hytopk_triton
from hyscale_compile.lowerings.score_bound import score_bound_flag
from hyscale_compile.testing import assert_selection_equal
from tests.contract import fresh_seed

DSA = ScoreSpec(
    name="dsa",
    epilogue=(("relu",),),
    reduce="weighted_sum",
    post=(("mask", 0),),
    masks=(MaskTerm(kind="range", hi=0),),
)


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hyscale_kernels"))


def _triton_interpreted() -> bool:
    return cg._interpreting() and cg.triton_imported_interpreted()


@pytest.fixture
def interpret(monkeypatch, kernel_cache):
    if not _triton_interpreted():
        pytest.skip("triton runs compiled in this process: run with TRITON_INTERPRET=1 set before triton is imported")
    monkeypatch.setenv("HYSCALE_KERNEL_CACHE", kernel_cache)
    return torch.device("cpu")


@pytest.fixture
def cuda(monkeypatch, kernel_cache):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if cg._interpreting() or cg.triton_imported_interpreted():
        pytest.skip("triton runs interpreted in this process (TRITON_INTERPRET=1)")
    monkeypatch.setenv("HYSCALE_KERNEL_CACHE", kernel_cache)
    return torch.device("cuda")


def _gen(seed: int):
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def causal_hi(B, S, T, device="cpu"):
    """hi[b, s] = s + 1 + (T - S): the last S queries of a T-key causal layout."""
    return (torch.arange(S, device=device) + 1 + (T - S)).view(1, S).expand(B, S).contiguous()


def int_operands(g, B, S, T, H, Hk, D, dtype, lo=-3, hi=4, w_hi=3, kb=None):
    """Small-integer operands: every product and partial sum is exact in fp32."""
    q = torch.randint(lo, hi, (B, S, H, D), generator=g).to(dtype)
    k = torch.randint(lo, hi, (kb or B, T, Hk, D), generator=g).to(dtype)
    w = torch.randint(-w_hi, w_hi + 1, (B, S, H), generator=g).to(dtype)
    return q, k, w


# ------------------------------------------------------------------------------------
# float64 reference and the contract checks
# ------------------------------------------------------------------------------------
def scores64(q, k, w, masks, spec):
    """[B, S, T] float64 scores and the per-entry error scale sum_h |w_h| |c| sum_d |q k|."""
    B, S, H, D = q.shape
    T, Hk = k.shape[1], k.shape[2]
    kk = k.double().expand(B, T, Hk, D).repeat_interleave(H // Hk, dim=2)
    x = torch.einsum("bshd,bthd->bsht", q.double(), kk)
    ax = torch.einsum("bshd,bthd->bsht", q.double().abs(), kk.abs())
    for step in spec.epilogue:
        x = ref._apply_elementwise(x, step)  # float64 in, float64 out (round steps included)
        if step[0] == "mul":
            ax = ax * abs(step[1])
        elif step[0] == "div":
            ax = ax / abs(step[1])
    if spec.reduce == "weighted_sum":
        y = torch.einsum("bsh,bsht->bst", w.double(), x)
        ay = torch.einsum("bsh,bsht->bst", w.double().abs(), ax)
    elif spec.reduce == "sum":
        y, ay = x.sum(2), ax.sum(2)
    else:
        y, ay = x[:, :, 0], ax[:, :, 0]
    for step in spec.post:
        if step[0] == "mask":
            y = ref._apply_mask(y, spec.masks[step[1]], masks, 0, B, 0, S, 0, T, B, S, T)
        else:
            y = ref._apply_elementwise(y, step)
            if step[0] == "mul":
                ay = ay * abs(step[1])
            elif step[0] == "div":
                ay = ay / abs(step[1])
    return y, ay


def check_sorted_contract(vals, idx):
    """(value desc, index asc) order, distinct indices per row; NaN first (above +inf, as
    torch.sort orders it), NaNs tied with each other."""
    v, i = vals.double(), idx.long()
    assert (i.sort(-1).values.diff(dim=-1) > 0).all(), "duplicate indices in a row"
    nan = torch.isnan(v)
    assert (nan[..., 1:] <= nan[..., :-1]).all(), "NaN after a number"
    v = torch.where(nan, math.inf, v)
    dv = v[..., 1:] - v[..., :-1]
    both_inf = torch.isinf(v[..., 1:]) & (v[..., 1:] == v[..., :-1])
    assert ((dv <= 0) | both_inf).all(), "values not descending"
    tie = (v[..., 1:] == v[..., :-1]) & (nan[..., 1:] == nan[..., :-1])
    assert (~tie | (i[..., 1:] > i[..., :-1])).all(), "ties not in ascending index order"


def check_threshold(vals, idx, s64, scale, D, H, u):
    """docs/contract.md: min selected >= max unselected - tol; selected values equal the
    float64 reference within tol; infinite entries exactly; -inf ties to smaller index."""
    vals, idx = vals.double().cpu(), idx.long().cpu()
    s64, scale = s64.cpu(), scale.cpu()
    tol = (D + H + 2) * u * scale.amax(-1, keepdim=True)  # [B, S, 1]
    ref_sel = torch.gather(s64, -1, idx)
    fin = torch.isfinite(ref_sel)
    assert torch.equal(torch.isfinite(vals), fin), "finite/infinite pattern differs"
    assert (vals[~fin] == ref_sel[~fin]).all(), "infinite values differ"
    assert ((vals - ref_sel).abs() <= tol)[fin].all(), "selected values off by more than tol"
    chosen = torch.zeros_like(s64, dtype=torch.bool).scatter_(-1, idx, True)
    min_sel = ref_sel.amin(-1)
    max_uns = torch.where(chosen, -math.inf, s64).amax(-1)
    ok = (min_sel >= max_uns - tol[..., 0]) | (max_uns == -math.inf)
    bad = (~ok).nonzero()
    assert ok.all(), f"threshold violated at rows {bad[:5].tolist()}"
    # rows whose selection ends in -inf: those are the smallest -inf indices
    T = s64.shape[-1]
    t = torch.arange(T).expand_as(s64)
    sel_ninf = torch.where(chosen & (s64 == -math.inf), t, -1).amax(-1)
    uns_ninf = torch.where(~chosen & (s64 == -math.inf), t, T).amin(-1)
    assert (sel_ninf < uns_ninf).all(), "-inf fillers are not the smallest masked indices"


def check_exact(q, k, w, masks, topk, spec, vals, idx):
    """Exactly representable inputs: equal to the stable sort of the reference scores,
    and to reference.streaming_topk, bit for bit (+0.0 == -0.0)."""
    dense = ref.dense_scores(q.cpu(), k.cpu(), None if w is None else w.cpu(), [m.cpu() for m in masks], spec)
    rv, ri = ref.stable_topk(dense, topk)
    assert torch.equal(idx.long().cpu(), ri), _first_diff(idx.cpu(), ri)
    rv = rv.to(vals.dtype)
    same = (vals.cpu() == rv) | (torch.isnan(vals.cpu()) & torch.isnan(rv))
    assert same.all(), _first_diff(vals.cpu(), rv)
    sv, si = ref.streaming_topk(q.cpu(), k.cpu(), None if w is None else w.cpu(), [m.cpu() for m in masks],
                                topk, spec, return_values=True)
    assert torch.equal(idx.cpu(), si)
    assert ((vals.cpu() == sv) | (torch.isnan(sv) & torch.isnan(vals.cpu()))).all()


def _first_diff(a, b):
    d = (a.long() != b.long()) if not a.dtype.is_floating_point else (a != b)
    pos = d.nonzero()
    if len(pos) == 0:
        return "equal"
    r = tuple(pos[0, :-1].tolist())
    return f"first difference in row {r}: got {a[r][:12].tolist()} expected {b[r][:12].tolist()}"


def assert_same_bits(outs):
    """(values, indices) of one input under several launch configurations: bit-identical."""
    v0, i0 = outs[0]
    for v, i in outs[1:]:
        assert torch.equal(v.view(torch.int32), v0.view(torch.int32)) and torch.equal(i, i0)


def run_exact(q, k, w, masks, topk, spec, config=None):
    vals, idx = hytopk_triton(q, k, w, masks, topk, spec, return_values=True, config=config)
    assert idx.dtype == torch.int32 and tuple(idx.shape) == (q.shape[0], q.shape[1], topk)
    assert vals.dtype == dtype_of(spec.score_dtype)
    check_sorted_contract(vals.cpu(), idx.cpu())
    check_exact(q, k, w, masks, topk, spec, vals, idx)
    idx_only = hytopk_triton(q, k, w, masks, topk, spec, config=config)
    assert torch.equal(idx_only, idx)
    return vals, idx


# ------------------------------------------------------------------------------------
# interpreter tests
# ------------------------------------------------------------------------------------
@pytest.mark.interpret
@pytest.mark.parametrize("dtype,seed", [(torch.float32, 11), (torch.float16, 12), (torch.float32, 13)])
def test_random_threshold(interpret, dtype, seed):
    g = _gen(seed)
    B, S, T, H, D, topk = 1, 20, 96, 4, 24, 40  # D and k not powers of two
    q = torch.randn(B, S, H, D, generator=g).to(dtype)
    k = torch.randn(B, T, 1, D, generator=g).to(dtype)
    w = torch.randn(B, S, H, generator=g)
    spec = ScoreSpec(epilogue=(("relu",), ("mul", 0.0883883)), post=DSA.post, masks=DSA.masks)
    masks = [causal_hi(B, S, T)]
    vals, idx = hytopk_triton(q, k, w, masks, topk, spec, return_values=True)
    check_sorted_contract(vals, idx)
    s64, scale = scores64(q, k, w, masks, spec)
    check_threshold(vals, idx, s64, scale, D, H, 2.0**-24)


@pytest.mark.interpret
@pytest.mark.parametrize("shape,w_dtype", [((1, 1, 4), torch.float32), ((1, 6, 4), torch.bfloat16),
                                           ((2, 1, 4), torch.float32)])
def test_stride0_weights_read_in_place(interpret, shape, w_dtype):
    """Weights that broadcast over rows reach the op as an expand (rewrite._weights_per_row:
    stride 0, no copy), of any float dtype: exact, and the same bits as the same weights
    materialized; a folded epilogue scale (weight_scale) too."""
    g = _gen(51 + shape[1] + shape[0])
    B, S, T, H, D, topk = 2, 6, 48, 4, 16, 9
    q, k, _ = int_operands(g, B, S, T, H, 1, D, torch.float32)
    w = torch.randint(-2, 3, shape, generator=g).to(w_dtype).expand(B, S, H)
    assert 0 in w.stride()
    spec = ScoreSpec(epilogue=(("relu",), ("mul", 0.5)), post=DSA.post, masks=DSA.masks)
    masks = [causal_hi(B, S, T)]
    vals, idx = run_exact(q, k, w, masks, topk, spec)
    v2, i2 = hytopk_triton(q, k, w.contiguous(), masks, topk, spec, return_values=True)
    assert torch.equal(i2, idx) and torch.equal(v2.view(torch.int32), vals.view(torch.int32))


@pytest.mark.interpret
def test_bf16_integer_operands_exact(interpret):
    g = _gen(21)
    B, S, T, H, D, topk = 1, 18, 80, 4, 32, 24
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.bfloat16)
    run_exact(q, k, w, [causal_hi(B, S, T)], topk, DSA)


@pytest.mark.interpret
@pytest.mark.parametrize("reduce", ["weighted_sum", "sum"])
def test_relu_zero_ties_exact(interpret, reduce):
    # Mostly negative logits: ReLU makes many exact 0.0 (and -0.0 * w) scores to tie.
    g = _gen(31 if reduce == "sum" else 32)
    B, S, T, H, D, topk = 1, 17, 64, 2, 16, 37
    q = torch.randint(-3, 2, (B, S, H, D), generator=g).float()  # mostly negative logits
    k = torch.randint(0, 4, (B, T, 1, D), generator=g).float()
    w = torch.randint(-2, 3, (B, S, H), generator=g).float()
    spec = ScoreSpec(epilogue=(("relu",),), reduce=reduce, post=DSA.post, masks=DSA.masks)
    vals, _ = run_exact(q, k, None if reduce == "sum" else w, [causal_hi(B, S, T)], topk, spec)
    assert (vals == 0).sum() > 50, "the case should be tie-heavy"


@pytest.mark.interpret
def test_rows_with_fewer_than_k_valid_keys(interpret):
    g = _gen(41)
    B, S, T, H, D, topk = 1, 40, 40, 2, 16, 20
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.float16)
    vals, idx = run_exact(q, k, w, [causal_hi(B, S, T)], topk, DSA)
    # row s has s+1 valid keys; the rest are the smallest masked indices, ascending, at -inf
    for s in (0, 5, 18):
        tail = idx[0, s, s + 1:]
        assert tail.tolist() == list(range(s + 1, topk))
        assert torch.isneginf(vals[0, s, s + 1:]).all()
    assert torch.isfinite(vals[0, 19:]).all()


@pytest.mark.interpret
def test_sliding_window_and_tile_skipping(interpret):
    # lo and hi bounds: with 16-key tiles whole tiles are hidden for a row block on both
    # sides, so the skip paths (all -inf tiles and skipped tiles) run.
    g = _gen(51)
    B, S, T, H, D, topk = 1, 48, 96, 2, 16, 12
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.float32)
    s = torch.arange(S) + (T - S)
    lo = (s - 20).clamp(min=0).view(1, S)
    hi = (s + 1).view(1, S)
    spec = ScoreSpec(epilogue=(("relu",), ("mul", 0.5)), post=(("mask", 0),),
                     masks=(MaskTerm(kind="range", lo=0, hi=1),))
    assert skippable_mask_terms(spec) == [0]
    run_exact(q, k, w, [lo, hi], topk, spec, config=HyTopKConfig(block_m=16, block_n=16))
    # a window narrower than k: rows hold fewer than k visible keys
    lo2 = (s - 5).clamp(min=0).view(1, S)
    run_exact(q, k, w, [lo2, hi], topk, spec, config=HyTopKConfig(block_m=16, block_n=16))


@pytest.mark.interpret
def test_additive_and_fill_masks(interpret):
    g = _gen(61)
    B, S, T, H, D, topk = 2, 12, 64, 2, 16, 20
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.float32)
    add32 = torch.where(torch.rand(B, S, T, generator=g) < 0.3, torch.finfo(torch.float32).min, 0.0)
    add32[:, :, 5] = -math.inf
    add32[:, 7, 3:] = torch.finfo(torch.float32).min  # row 7: only 3 keys without finfo.min
    add16 = torch.randint(-2, 3, (1, S, T), generator=g).to(torch.float16)  # broadcast over batch
    addbf = torch.randint(-2, 3, (T,), generator=g).to(torch.bfloat16)  # broadcast over rows
    fill = torch.rand(B, 1, T, generator=g) < 0.2
    keep = torch.rand(S, T, generator=g) < 0.9
    keep[3] = False  # one row with every key masked by the where=False fill
    spec = ScoreSpec(
        epilogue=(("relu",),),
        post=(("mul", 2.0), ("mask", 0), ("mask", 1), ("mask", 2), ("mask", 3), ("mask", 4)),
        masks=(
            MaskTerm(kind="add", operand=0),
            MaskTerm(kind="add", operand=1),
            MaskTerm(kind="add", operand=2),
            MaskTerm(kind="fill", operand=3, where=True, value=-math.inf),
            MaskTerm(kind="fill", operand=4, where=False, value=-1000.0),
        ),
    )
    vals, idx = run_exact(q, k, w, [add32, add16, addbf, fill, keep], topk, spec)
    assert (vals == -1000.0).any() and (vals[:, 7] < -1e38).any() and torch.isfinite(vals[:, 7]).all()


FINFO_MIN = torch.finfo(torch.float32).min


@pytest.mark.interpret
@pytest.mark.parametrize("mode,value,skips", [("add", FINFO_MIN, True), ("fill", FINFO_MIN, True),
                                              ("add", -1e9, False)])
def test_finite_hidden_value_skips_like_inf(interpret, mode, value, skips):
    # HF hides keys with finfo.min (s + where(causal, 0, min), or a masked_fill). Hidden
    # tiles are skipped as -inf ones are, and rows with fewer than k visible keys end with
    # fillers of exactly that value: the bits of the reference, fillers included. An add of
    # -1e9 is exact only for |s| < 16 (add_limit), which these scores exceed: no skipping.
    # (A fill of another finite value takes the finfo.min fill's path; its bound, -value / 2,
    # is test_finite_range_term_rules'.)
    g = _gen(67)
    B, S, T, H, D, topk = 2, 48, 48, 2, 16, 20
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.float32)
    spec = ScoreSpec(epilogue=(("relu",),), reduce="weighted_sum", post=(("mask", 0),),
                     masks=(MaskTerm(kind="range", hi=0, mode=mode, value=value),))
    assert finite_range_term(spec) == (0, value, add_limit(value) if mode == "add" else -value / 2)
    assert "key_hi = tl.minimum(key_hi, tl.where(" in cg.render_kernel_source(spec, 1)
    assert triton_hytopk.hidden_value_flag(spec, q, k, w).tolist() == [int(skips)]
    vals, idx = run_exact(q, k, w, [causal_hi(B, S, T)], topk, spec, config=HyTopKConfig(block_m=16, block_n=16))
    for s in (0, 7, 18):  # s + 1 visible keys, then the smallest hidden ones at the hidden value
        if mode == "fill" or skips:
            assert idx[0, s, s + 1:].tolist() == list(range(s + 1, topk))
            assert (vals[0, s, s + 1:] == torch.tensor(value, dtype=torch.float32)).all()


def _scaled_int_operands(seed, power):
    """(B, S, T, topk, q, k, w): small-integer operands with q and k scaled by 2**power
    (exact), for scores large enough that a finite hidden value stops being safe."""
    B, S, T, H, D, topk = 1, 32, 48, 2, 16, 24
    q, k, w = int_operands(_gen(seed), B, S, T, H, 1, D, torch.float32)
    return B, S, T, topk, q * 2.0**power, k * 2.0**power, w


@pytest.mark.interpret
def test_finite_add_mask_with_huge_scores_is_not_skipped(interpret):
    # Scores near 1e37: s + finfo.min is no longer finfo.min (it is -inf below, larger
    # above), so the launch's bound must refuse the skip and the kernel score every key.
    B, S, T, topk, q, k, w = _scaled_int_operands(68, 60)
    spec = ScoreSpec(epilogue=(("relu",),), reduce="weighted_sum", post=(("mask", 0),),
                     masks=(MaskTerm(kind="range", hi=0, mode="add", value=FINFO_MIN),))
    assert triton_hytopk.hidden_value_flag(spec, q, k, w).tolist() == [0]
    vals, _ = run_exact(q, k, w, [causal_hi(B, S, S)], topk, spec, config=HyTopKConfig(block_m=16, block_n=16))
    hidden = vals[0, :topk - 1][vals[0, :topk - 1] < -1e38]
    assert torch.isneginf(hidden).any() and (hidden != FINFO_MIN).any()  # the huge scores really moved them


@pytest.mark.interpret
def test_finite_fill_below_visible_scores_is_not_skipped(interpret):
    # masked_fill(hidden, -1e9) with visible scores far below -1e9 (signed weights, large
    # operands): hidden keys beat visible ones, so keys past a row's range must compete;
    # the bound (|s| < 1e9) refuses the skip, and the answer takes hidden keys of any index.
    B, S, T, topk, q, k, w = _scaled_int_operands(69, 20)
    spec = ScoreSpec(reduce="weighted_sum", post=(("mask", 0),),
                     masks=(MaskTerm(kind="range", hi=0, mode="fill", value=-1e9),))
    assert triton_hytopk.hidden_value_flag(spec, q, k, w).tolist() == [0]
    _, idx = run_exact(q, k, w, [causal_hi(B, S, S)], topk, spec, config=HyTopKConfig(block_m=16, block_n=16))
    assert (idx[0, topk:] >= topk).any()  # rows past k: some picks lie past their own hi


def _refused_case(name):
    """Inputs where skipping hidden tiles would be wrong."""
    B, S, T = 1, 16, 48
    hi = (torch.arange(S) + 1).view(1, S)
    fmin_add = (MaskTerm(kind="range", hi=0, mode="add", value=FINFO_MIN),)
    if name == "folded_weight_scale":  # the launch folds mul 1/16 into w: the bound must not count it twice
        q, k, w = torch.full((B, S, 2, 16), 3.0), torch.full((B, T, 1, 16), 3.0), torch.full((B, S, 2), 3.0)
        k[:, :16] = 1.0  # keys 16..: score 54, and fl(54 - 1e9) != -1e9
        spec = ScoreSpec(epilogue=(("relu",), ("mul", 0.0625)), reduce="weighted_sum", post=(("mask", 0),),
                         masks=(MaskTerm(kind="range", hi=0, mode="add", value=-1e9),))
        return q, k, w, [hi], spec
    q, k = torch.ones(B, S, 1, 2), torch.ones(B, T, 1, 2)
    if name == "sigmoid_of_nan":  # inf * 0 logits: NaN through the sigmoid, NaN + finfo.min ranks first
        q[..., 0] = math.inf
        k[:, 32:, 0, 0] = 0.0
        return q, k, None, [hi], ScoreSpec(epilogue=(("sigmoid",),), reduce="sum", post=(("mask", 0),), masks=fmin_add)
    if name in ("fp16_round", "fp16_logits"):  # logits past fp16's range round to inf
        k[:, 32:, 0, 0] = 65536.0
        if name == "fp16_round":
            return q, k, None, [hi], ScoreSpec(epilogue=(("round", "float16"),), reduce="sum", post=(("mask", 0),),
                                               masks=fmin_add)
        return q, k, None, [hi], ScoreSpec(logit_dtype="float16", reduce="sum", post=(("mask", 0),), masks=fmin_add)
    raise ValueError(name)


@pytest.mark.interpret
@pytest.mark.parametrize("name", ["folded_weight_scale", "sigmoid_of_nan", "fp16_round", "fp16_logits"])
def test_finite_skip_refused_where_unsound(interpret, name):
    q, k, w, masks, spec = _refused_case(name)
    assert triton_hytopk.hidden_value_flag(spec, q, k, w).tolist() == [0]
    run_exact(q, k, w, masks, 8, spec, config=HyTopKConfig(block_m=16, block_n=16))


def _checked_mask_ranges(spec, m, q, k, w):
    """``mask_key_ranges`` for the spec's mask tensor ``m``, its visible ranges and first
    neutral runs checked against the torch references (which take the tensor's minimum
    first)."""
    from hyscale_compile.lowerings import triton_mask_ranges as tmr

    term = spec.masks[tensor_mask_term(spec)[0]]
    r = tmr.mask_key_ranges(spec, m, lambda **lim: score_bound_flag(spec, q, k, w, **lim))
    add = term.kind == "add"
    lo_ref, hi_ref = tmr.visible_ranges_reference(m, add, term.where, r.hidden)
    assert torch.equal(r.lo, lo_ref) and torch.equal(r.hi, hi_ref)
    nlo_ref, nhi_ref = tmr.neutral_runs_reference(m, add, term.where)
    assert torch.equal(r.nlo, nlo_ref) and torch.equal(r.nhi, nhi_ref)
    return r


@pytest.mark.interpret
@pytest.mark.parametrize("form", ["add_fp32_finfo", "add_bf16_finfo", "add_ninf", "fill_bool_ninf", "fill_bool_finite",
                                  "fill_bool_keep"])
def test_mask_tensor_key_ranges(interpret, form):
    # A mask tensor (HF's runtime attention_mask: causal + left padding, here also a hole
    # inside some rows): each row's visible key range is read off it before the launch and
    # the tiles outside are skipped, fillers of the hidden value; bits equal the reference.
    g = _gen(70)
    B, S, T, H, D, topk = 2, 48, 48, 2, 16, 20
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.float32)
    t, s_ = torch.arange(T), torch.arange(S)
    visible = (t[None, None, :] <= s_[None, :, None]) & (t[None, None, :] >= torch.tensor([0, 5])[:, None, None])
    visible[:, 30, 10:14] = False  # a hole inside a row's range: still applied per key
    visible[1, :5] = False  # padded query rows: nothing visible
    if form.startswith("add"):
        hidden = {"add_fp32_finfo": FINFO_MIN, "add_bf16_finfo": torch.finfo(torch.bfloat16).min,
                  "add_ninf": -math.inf}[form]
        dtype = torch.bfloat16 if "bf16" in form else torch.float32
        mask = torch.where(visible, 0.0, hidden).to(dtype)
        mask[:, :, 40] = torch.where(visible[:, :, 40], -2.0, hidden).to(dtype)  # other visible values
        spec = ScoreSpec(epilogue=(("relu",),), reduce="weighted_sum", post=(("mask", 0),),
                         masks=(MaskTerm(kind="add", operand=0),))
    else:
        # fill_bool_keep: HF's polarity, masked_fill(~keep, -inf): hidden where the bool is 0
        value = -1e4 if form == "fill_bool_finite" else -math.inf
        where = form != "fill_bool_keep"
        mask = ~visible if where else visible
        spec = ScoreSpec(epilogue=(("relu",),), reduce="weighted_sum", post=(("mask", 0),),
                         masks=(MaskTerm(kind="fill", operand=0, where=where, value=value),))
    tm = tensor_mask_term(spec)
    assert tm == (0, form not in ("fill_bool_ninf", "fill_bool_keep"))
    m = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    r = _checked_mask_ranges(spec, m, q, k, w)
    assert r.lo[1, 2].item() == T and r.hi[1, 2].item() == 0  # a padded row: empty
    # the first neutral run, where the kernel does not read the tensor: it ends at the
    # hole in row 30 and, for an additive mask, at the -2.0 of key 40
    assert (r.nlo[0, 30].item(), r.nhi[0, 30].item()) == (0, 10)
    assert (r.nlo[1, 45].item(), r.nhi[1, 45].item()) == (5, 40 if form.startswith("add") else 46)
    if tm[1]:
        assert r.flag.tolist() == [1]
    vals, idx = run_exact(q, k, w, [mask], topk, spec, config=HyTopKConfig(block_m=16, block_n=16))
    # padded rows: every key hidden, the k smallest indices at the hidden value
    assert idx[1, 2].tolist() == list(range(topk))
    if form.startswith("add"):
        assert (vals[1, 2] == mask[1, 2, :topk].float()).all()


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_key_ranges_one_scan(interpret, monkeypatch, dtype):
    # The pass reads an additive tensor once: each row's minimum and the keys that differ
    # from it, scanned in blocks (here of 16 keys, so a row's minimum can drop in a later
    # block), then the rows' minima give the hidden value. Ranges and neutral runs equal
    # the torch references, which take the tensor's minimum first.
    from hyscale_compile.lowerings import triton_mask_ranges as tmr

    monkeypatch.setattr(tmr, "_BLOCK", 16)
    g = _gen(72)
    B, S, T = 2, 7, 70
    m = torch.where(torch.rand(B, S, T, generator=g) < 0.3, FINFO_MIN, 0.0)
    m[0, 0] = 0.0                      # nothing hidden
    m[0, 1, :40] = -1.0                # the row's own minimum is not the tensor's: all visible
    m[0, 2] = 0.0
    m[0, 2, 50] = FINFO_MIN            # the minimum drops in a late block
    m[0, 3] = FINFO_MIN                # everything hidden
    m[0, 4, :20] = math.inf            # +inf, then the minimum
    m[1, 5, 33:] = -2.0                # a neutral run ended by another visible value
    m = m.to(dtype)
    spec = ScoreSpec(epilogue=(("relu",),), reduce="weighted_sum", post=(("mask", 0),),
                     masks=(MaskTerm(kind="add", operand=0),))
    q, k, w = int_operands(g, B, S, T, 2, 1, 16, torch.float32)
    r = _checked_mask_ranges(spec, m, q, k, w)
    assert r.hidden.tolist() == [m.float().amin().item()]
    assert (r.lo[0, 2].item(), r.hi[0, 2].item()) == (0, T) and (r.lo[0, 3].item(), r.hi[0, 3].item()) == (T, 0)
    # a NaN anywhere: the hidden value is NaN, every row all visible, and no skip
    m[1, 6, 3] = math.nan
    r = _checked_mask_ranges(spec, m, q, k, w)
    assert math.isnan(r.hidden.item()) and r.flag.tolist() == [0]
    assert (r.lo == 0).all() and (r.hi == T).all()


@pytest.mark.interpret
@pytest.mark.parametrize("kind", ["add", "fill"])
def test_mask_key_ranges_random_rows(interpret, monkeypatch, kind):
    # The scan reads each row in blocks (16 keys here; T = 53, so the last block is short):
    # rows drawn from a few values, so that a row's minimum, its neutral run and the key that
    # ends it fall anywhere in any block, and some rows have their own minimum above the
    # tensor's. Ranges, hidden value and neutral runs equal the torch references, whatever
    # the scan's loop (docs/history.md, "Mask tensors").
    from hyscale_compile.lowerings import triton_mask_ranges as tmr

    monkeypatch.setattr(tmr, "_BLOCK", 16)
    g = _gen(74 if kind == "add" else 75)
    B, S, T = 2, 12, 53
    q, k, w = int_operands(g, B, S, T, 2, 1, 16, torch.float32)
    if kind == "add":
        pool = torch.tensor([0.0, 0.0, 0.0, -1.0, FINFO_MIN, -math.inf, math.inf, 2.0])
        probs = torch.rand(B, S, 1, generator=g)  # rows from mostly 0 to mostly hidden
        pick = torch.randint(0, pool.numel(), (B, S, T), generator=g)
        m = torch.where(torch.rand(B, S, T, generator=g) < probs, pool[pick], 0.0)
        m[0, 0] = 0.0
        m[0, 1] = -1.0  # a row whose minimum is above the tensor's
        m[0, 2, 37] = -math.inf  # a late minimum
        m[1, 3] = torch.where(torch.arange(T) < 20, 0.0, -1.0)  # a run longer than a block
        m[1, 4] = -math.inf
        m[1, 4, 5] = 0.0  # the one visible key, before the row's minimum
        spec = ScoreSpec(epilogue=(("relu",),), reduce="weighted_sum", post=(("mask", 0),),
                         masks=(MaskTerm(kind="add", operand=0),))
    else:
        m = (torch.rand(B, S, T, generator=g) < torch.rand(B, S, 1, generator=g)).to(torch.uint8)
        m[0, 0] = 0
        m[0, 1] = 1
        m[1, 3] = (torch.arange(T) >= 20).to(torch.uint8)  # a run longer than a block
        spec = ScoreSpec(epilogue=(("relu",),), reduce="weighted_sum", post=(("mask", 0),),
                         masks=(MaskTerm(kind="fill", operand=0, where=True, value=-math.inf),))
    r = _checked_mask_ranges(spec, m, q, k, w)
    if kind == "add":
        assert r.hidden.tolist() == [-math.inf]
        assert (r.lo[0, 1].item(), r.hi[0, 1].item()) == (0, T)
        assert (r.lo[1, 4].item(), r.hi[1, 4].item()) == (5, 6)
    # (the draw covers runs that end at another position of a block than they start)
    assert ((r.nhi - r.nlo) > 1).any() and ((r.nlo % 16) != (r.nhi % 16)).any()
    assert (r.nlo[1, 3].item(), r.nhi[1, 3].item()) == (0, 20)  # (a run longer than a block)
    if kind == "fill":
        assert r.nlo[0, 1].item() == T  # (all hidden: nothing neutral)


def _nonfinite_kernel_case(form, where, sign):
    """One row block (16 rows), 16-key tiles, keys [32, 48) visible to every row: tiles
    [0, 32) and [48, 64) would be skipped. A NaN (or the mask's own NaN) goes where eager
    carries it into hidden scores: k at hidden key 5, all of q's or w's row 3, or the
    additive mask tensor at hidden key 55."""
    g = _gen(73)
    B, S, T, H, D = 1, 16, 64, 2, 16
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.float32)
    lo, hi = torch.full((B, S), 32), torch.full((B, S), 48)
    visible = (torch.arange(T) >= 32) & (torch.arange(T) < 48)
    if form in ("inf_add", "finfo_add"):
        value = -math.inf if form == "inf_add" else FINFO_MIN
        masks = [lo, hi]
        terms = (MaskTerm(kind="range", lo=0, hi=1, mode="add", value=value),)
    elif form == "tensor_add":
        masks = [torch.where(visible, 0.0, FINFO_MIN).expand(B, S, T).clone()]
        terms = (MaskTerm(kind="add", operand=0),)
    else:  # fill_then_tensor: a -inf fill, then an additive tensor (-inf + NaN is NaN)
        masks = [lo, hi, torch.zeros(B, S, T)]
        terms = (MaskTerm(kind="range", lo=0, hi=1), MaskTerm(kind="add", operand=2))
    spec = ScoreSpec(epilogue=(("relu",),), reduce="weighted_sum",
                     post=tuple(("mask", j) for j in range(len(terms))), masks=terms)
    bad = sign * math.nan
    if where == "k":
        k[0, 5, 0, 7] = bad
    elif where == "q":
        q[0, 3, 1, 2] = bad
    elif where == "w":
        w[0, 3, 0] = bad
    elif where == "mask":
        masks[-1][0, :, 55] = bad
    return q, k, w, masks, spec


@pytest.mark.interpret
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("form,where", [("inf_add", "q"), ("inf_add", "k"), ("inf_add", "w"),
                                        ("finfo_add", "q"), ("finfo_add", "k"), ("finfo_add", "w"),
                                        ("tensor_add", "k"), ("tensor_add", "mask"), ("fill_then_tensor", "mask")])
def test_nonfinite_operand_in_skipped_tile_selected_like_eager(interpret, form, where, sign):
    # s + where(hidden, -inf, 0) is NaN where s is, and torch.topk ranks NaN (either sign)
    # above everything: eager selects those hidden keys, so their tiles may be skipped only
    # once the operands reaching them are proven finite (else every tile is scored)
    q, k, w, masks, spec = _nonfinite_kernel_case(form, where, sign)
    topk = 4
    vals, idx = hytopk_triton(q, k, w, masks, topk, spec, return_values=True,
                              config=HyTopKConfig(block_m=16, block_n=16))
    check_exact(q, k, w, masks, topk, spec, vals, idx)
    if where == "k" and form != "tensor_add":
        assert (idx[0, :, 0] == 5).all() and vals[0, :, 0].isnan().all()
    if where == "mask":
        assert (idx[0, :, 0] == 55).all()
    if where in ("q", "w"):
        assert idx[0, 3].tolist() == [0, 1, 2, 3]


@pytest.mark.interpret
def test_finite_flag_on_device_and_host(interpret):
    # finite_guard's proof: 1 (skip) for finite operands, 0 for NaN of either sign, inf, or
    # scores that could overflow, from the device kernel (no host sync) and the CPU path's
    # host check alike; a fill overwrites a NaN score, so only the later tensor counts there
    from hyscale_compile.lowerings import score_bound as sb

    def flags(form, where=None, value=None):
        q, k, w, masks, spec = _nonfinite_kernel_case(form, None, 1)
        if where is not None:
            {"q": q, "k": k, "w": w, "mask": masks[-1]}[where].view(-1)[17] = value
        assert "tl.load(SKIPF) != 0" in cg.render_kernel_source(spec, len(masks))
        dev = sb.finite_flag(spec, q, k, w, masks).tolist()
        assert dev == [int(sb.finite_holds(spec, q, k, w, masks))]
        return dev[0]

    assert flags("inf_add") == 1
    for where in ("q", "k", "w"):
        for value in (math.nan, -math.nan, math.inf, -math.inf):
            assert flags("inf_add", where, value) == 0, (where, value)
    assert flags("inf_add", "q", 1e37) == 0  # D max|q| max|k| H max|w| overflows fp32
    assert flags("fill_then_tensor") == flags("fill_then_tensor", "q", math.nan) == 1
    assert flags("fill_then_tensor", "mask", -math.inf) == 1  # -inf + -inf is -inf
    for value in (math.nan, -math.nan, math.inf):
        assert flags("fill_then_tensor", "mask", value) == 0, value


def test_finite_guard_rules():
    import hyscale_compile
    from hyscale_compile.lowerings.spec import finite_guard, tile_skipping

    add = MaskTerm(kind="range", hi=0, mode="add", value=-math.inf)
    fill = MaskTerm(kind="range", hi=0)

    def spec(post, masks, epilogue=(("relu",),)):
        return ScoreSpec(epilogue=epilogue, post=post, masks=masks)

    # masked_fill / where overwrite the score: no check
    assert finite_guard(spec((("mul", 2.0), ("mask", 0)), (fill,))) is None
    # s + where(hidden, -inf, 0): the scores before the term must be finite
    g = finite_guard(spec((("mul", 2.0), ("mask", 0), ("mul", 0.5)), (add,)))
    assert (g.terms, g.bounds, g.tensors) == ((0,), ((("mul", 2.0),),), ())
    assert "proves the operands" in tile_skipping(spec((("mask", 0),), (add,)))
    # an additive tensor after a -inf term: its values (-inf + NaN, -inf + inf)
    g = finite_guard(spec((("mask", 0), ("mask", 1)), (fill, MaskTerm(kind="add", operand=1))))
    assert (g.terms, g.bounds, g.tensors) == ((0,), (), (1,))
    # two additive -inf ranges: the second's bound leaves the first out (-inf stays -inf)
    two = spec((("mask", 0), ("mul", 3.0), ("mask", 1)), (add, MaskTerm(kind="range", lo=1, mode="add")))
    g = finite_guard(two)
    assert skippable_mask_terms(two) == [0, 1] and g.bounds == ((), (("mul", 3.0),))
    # nothing bounds a registered mod's output or a mask tensor's values: never skipped
    assert skippable_mask_terms(spec((("mask", 1), ("mask", 0)), (add, MaskTerm(kind="add", operand=1)))) == []
    hyscale_compile.register_score_mod("recip_nan_test", lambda s: 1.0 / s)
    try:
        modded = spec((("mask", 0),), (add,), epilogue=(("mod", "recip_nan_test"),))
        assert skippable_mask_terms(modded) == [] and finite_guard(modded) is None
        assert skippable_mask_terms(dataclasses.replace(modded, masks=(fill,))) == [0]
    finally:
        hyscale_compile.unregister_score_mod("recip_nan_test")


@pytest.mark.interpret
def test_mask_tensor_with_huge_scores_is_not_skipped(interpret):
    # an additive finfo.min tensor with scores near 1e37: the bound refuses the skip
    B, S, T, topk, q, k, w = _scaled_int_operands(71, 60)
    mask = torch.where(torch.arange(T)[None, :] <= torch.arange(S)[:, None] + (T - S), 0.0, FINFO_MIN)[None]
    spec = ScoreSpec(epilogue=(("relu",),), reduce="weighted_sum", post=(("mask", 0),),
                     masks=(MaskTerm(kind="add", operand=0),))
    r = _checked_mask_ranges(spec, mask, q, k, w)
    assert r.flag.tolist() == [0]
    run_exact(q, k, w, [mask], topk, spec, config=HyTopKConfig(block_m=16, block_n=16))


@pytest.mark.interpret
def test_hidden_value_flag_bound(interpret):
    spec = ScoreSpec(epilogue=(("mul", 0.5), ("relu",)), reduce="weighted_sum", post=(("mul", 2.0), ("mask", 0)),
                     masks=(MaskTerm(kind="range", hi=0, mode="add", value=-1e9),))
    q, k, w = torch.full((1, 3, 4, 8), 0.5), torch.full((1, 5, 1, 8), 0.25), torch.full((1, 3, 4), 0.5)
    # |s| <= 8 * 0.5 * 0.25 * 1.01 * 0.5 * 4 * 0.5 * 2 = 2.02 < 16
    assert triton_hytopk.hidden_value_flag(spec, q, k, w).tolist() == [1]
    assert triton_hytopk.hidden_value_flag(spec, q * 8, k, w).tolist() == [0]  # 16.16
    for bad in (math.nan, math.inf):
        q2 = q.clone()
        q2[0, 1, 2, 3] = bad
        assert triton_hytopk.hidden_value_flag(spec, q2, k, w).tolist() == [0]


def test_finite_range_term_rules():
    def spec(post, masks, epilogue=(("relu",),), score_dtype="float32"):
        return ScoreSpec(epilogue=epilogue, post=post, masks=masks, score_dtype=score_dtype)

    add = MaskTerm(kind="range", hi=0, mode="add", value=FINFO_MIN)
    fill = MaskTerm(kind="range", hi=0, mode="fill", value=-1e4)
    assert finite_range_term(spec((("mask", 0),), (add,))) == (0, FINFO_MIN, add_limit(FINFO_MIN))
    assert finite_range_term(spec((("mul", 2.0), ("mask", 0)), (fill,))) == (0, -1e4, 5e3)
    assert finite_range_term(spec((("mask", 0),), (MaskTerm(kind="range", hi=0, value=5.0),))) is None  # v >= 0
    assert finite_range_term(spec((("mask", 0),), (MaskTerm(kind="range", hi=0, mode="add", value=1.0),))) is None
    assert finite_range_term(spec((("mask", 0),), (add,), epilogue=(("mod", "softcap"),))) is None  # no bound
    assert finite_range_term(spec((("mask", 0), ("mul", 2.0)), (add,))) is None  # not the last step
    assert finite_range_term(spec((("mask", 0), ("mask", 1)), (add, fill))) is None  # two mask steps
    assert finite_range_term(spec((("mask", 0),), (add,), score_dtype="bfloat16")) is None
    assert finite_range_term(spec((("mask", 0),), (MaskTerm(kind="range", hi=0),))) is None  # -inf: the old rule
    assert finite_range_term(spec((("mask", 0),), (MaskTerm(kind="range", mode="add", value=-1.0),))) is None


@pytest.mark.interpret
def test_reduce_none_and_fp16_logits(interpret):
    # H == 1 with reduce 'none'; the contraction ran in fp16 (logits rounded, rule 2).
    g = _gen(71)
    B, S, T, D, topk = 2, 10, 50, 48, 9
    q, k, _ = int_operands(g, B, S, T, 1, 1, D, torch.float16, lo=-8, hi=9)
    spec = ScoreSpec(logit_dtype="float16", reduce="none", post=(("mul", 0.25),))
    run_exact(q, k, None, [], topk, spec)


@pytest.mark.interpret
def test_round_and_elementwise_steps_exact(interpret):
    # Integer logits large enough that the bf16/fp16 round steps really round.
    g = _gen(81)
    B, S, T, H, D, topk = 1, 16, 64, 2, 40, 16
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.float32, lo=-9, hi=10)
    spec = ScoreSpec(
        logit_dtype="bfloat16",
        epilogue=(("mul", 0.5), ("round", "float16"), ("add", 1.0), ("relu",)),
        reduce="weighted_sum",
        post=(("mul", 3.0), ("round", "float16"), ("neg",), ("add", 7.0), ("mask", 0), ("round", "bfloat16")),
        masks=(MaskTerm(kind="range", hi=0, mode="add", value=-4096.0),),
        score_dtype="bfloat16",
    )
    vals, _ = run_exact(q, k, w, [causal_hi(B, S, T)], topk, spec)
    assert vals.dtype == torch.bfloat16


@pytest.mark.interpret
def test_div_steps_round_like_torch(interpret):
    """x / c is IEEE division in torch; the kernel must not use an approximate divide:
    dividing by 3 and by sqrt(128) rounds, and the result must equal the reference bit for bit."""
    g = _gen(83)
    B, S, T, H, D, topk = 1, 16, 64, 2, 24, 12
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.float32, lo=-9, hi=10)
    spec = ScoreSpec(epilogue=(("div", 3.0), ("relu",)), reduce="weighted_sum",
                     post=(("div", math.sqrt(128.0)), ("mask", 0)), masks=(MaskTerm(kind="range", hi=0),))
    run_exact(q, k, w, [causal_hi(B, S, T)], topk, spec)


@pytest.mark.interpret
def test_sigmoid_threshold(interpret):
    g = _gen(91)
    B, S, T, H, D, topk = 1, 16, 64, 4, 16, 10
    q = torch.randn(B, S, H, D, generator=g)
    k = torch.randn(B, T, 1, D, generator=g)
    spec = ScoreSpec(epilogue=(("mul", 0.25), ("sigmoid",)), reduce="sum")
    vals, idx = hytopk_triton(q, k, None, [], topk, spec, return_values=True)
    check_sorted_contract(vals, idx)
    s64, _ = scores64(q, k, None, [], spec)
    # sigmoid is 1/4-Lipschitz and its fp32 evaluation adds a few ulps per head
    scale = torch.full_like(s64, float(H))
    check_threshold(vals, idx, s64, scale, D, H, 2.0**-22)


@pytest.mark.interpret
def test_post_step_after_mask_disables_skipping(interpret):
    # neg after a -inf range fill turns hidden keys into +inf: they must win, so no tile
    # may be skipped (and the kernel's skip rule must not treat the term as skippable).
    g = _gen(101)
    B, S, T, H, D, topk = 1, 16, 64, 2, 16, 8
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.float32)
    spec = ScoreSpec(epilogue=(("relu",),), post=(("mask", 0), ("neg",)), masks=DSA.masks)
    assert skippable_mask_terms(spec) == []
    run_exact(q, k, w, [causal_hi(B, S, 40)], topk, spec, config=HyTopKConfig(block_m=16, block_n=16))


@pytest.mark.interpret
def test_gqa_and_batch_broadcast_keys(interpret):
    g = _gen(111)
    B, S, T, H, D, topk = 2, 9, 48, 4, 16, 11
    q, k, w = int_operands(g, B, S, T, H, 2, D, torch.float16, kb=1)  # Hk=2, k.shape[0]=1
    assert k.shape[0] == 1
    run_exact(q, k, w, [causal_hi(B, S, T)], topk, DSA)
    # Hk == H, and non-contiguous q (a transposed view)
    q2 = torch.randint(-3, 4, (B, H, S, D), generator=g).to(torch.float16).transpose(1, 2)
    k2 = torch.randint(-3, 4, (B, T, H, D), generator=g).to(torch.float16)
    run_exact(q2, k2, w, [causal_hi(B, S, T)], topk, DSA)


@pytest.mark.interpret
def test_many_merges_increasing_scores(interpret):
    # Scores that grow with the key index: every key beats the running threshold, so the
    # candidate buffer overflows and merges on almost every tile.
    B, S, T, H, D, topk = 1, 16, 128, 1, 16, 5
    q = torch.ones(B, S, H, D)
    k = torch.arange(T, dtype=torch.float32).view(1, T, 1, 1).expand(1, T, 1, D).contiguous()
    k[:, ::7] = 0.0  # and some ties
    spec = ScoreSpec(reduce="sum")
    run_exact(q, k, None, [], topk, spec, config=HyTopKConfig(block_m=16, block_n=16))


@pytest.mark.interpret
@pytest.mark.parametrize("topk", [1, 48])
def test_k_extremes(interpret, topk):
    g = _gen(121 + topk)
    B, S, T, H, D = 1, 8, 48, 2, 16
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.float32)
    run_exact(q, k, w, [causal_hi(B, S, T)], topk, DSA)


@pytest.mark.interpret
def test_launch_parameters_do_not_change_bits(interpret):
    # Dyadic inputs (multiples of 1/8, |x| < 4): every sum is exact, so the scores cannot
    # depend on the dot's summation order (the interpreter's numpy matmul picks one by
    # matrix shape); what is compared is the selection machinery under different tilings,
    # programs and merge sorts.
    g = _gen(131)
    B, S, T, H, D, topk = 1, 20, 64, 2, 24, 6
    q = torch.randint(-24, 25, (B, S, H, D), generator=g) / 8.0
    k = torch.randint(-24, 25, (B, T, 1, D), generator=g) / 8.0
    w = torch.randint(-8, 9, (B, S, H), generator=g) / 8.0
    masks = [causal_hi(B, S, T)]
    outs = []
    for cfg in (
        HyTopKConfig(block_m=16, block_n=32),
        HyTopKConfig(block_m=32, block_n=16, num_programs=1),
        HyTopKConfig(block_m=16, block_n=64, num_programs=2, sort="bitonic"),
    ):
        v, i = hytopk_triton(q, k, w, masks, topk, DSA, return_values=True, config=cfg)
        outs.append((v, i))
    assert_same_bits(outs)
    check_exact(q, k, w, masks, topk, DSA, outs[0][0], outs[0][1])


@pytest.mark.interpret
def test_bitonic_sort_with_register_bits_low(interpret):
    # The final sort moves its low network bits into registers (_sort_desc: the keys viewed
    # as [R, TOPK_P2 / R] and transposed, R = 4 here for k = 300): same order as the rank
    # sort, ties included (small integers: many equal scores, broken by index).
    g = _gen(181)
    B, S, T, H, D, topk = 1, 3, 700, 2, 16, 300
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.float32, lo=-2, hi=3, w_hi=2)
    # the bitonic sort (the minmax network, which pairs its in-register steps) against the
    # rank sort
    outs = [run_exact(q, k, w, [], topk, ScoreSpec(epilogue=(("relu",),), reduce="weighted_sum"),
                      config=HyTopKConfig(block_m=4, block_n=32, sort=sort))
            for sort in ("rank", "bitonic")]
    assert_same_bits(outs)
    assert (outs[0][0][0, :, 1:] == outs[0][0][0, :, :-1]).any(), "the case should have ties"


@pytest.mark.interpret
def test_unsorted_same_set(interpret):
    # sorted=False (topk's sorted=False: sort="none") skips the final sort: each row is the
    # sorted launch's set, values paired with their indices, in the same order on every call.
    # Ties (small integers) and a causal range with rows short of k keys (-inf fillers),
    # with compactions inside the tile loop (T = 700 keys, cap 1024 for k = 300).
    g = _gen(187)
    B, S, T, H, D, topk = 1, 5, 700, 2, 16, 300
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.float32, lo=-2, hi=3, w_hi=2)
    spec = ScoreSpec(epilogue=(("relu",),), reduce="weighted_sum", post=DSA.post, masks=DSA.masks)
    hi = torch.tensor([[3, 200, 301, 650, 700]])
    cfg = HyTopKConfig(block_m=4, block_n=32)
    vs, is_ = run_exact(q, k, w, [hi], topk, spec, config=cfg)
    vu, iu = hytopk_triton(q, k, w, [hi], topk, spec, return_values=True, sorted=False, config=cfg)
    order = iu.sort(-1)
    assert torch.equal(order.values, is_.sort(-1).values), "not the sorted launch's set"
    assert torch.equal(vu.gather(-1, order.indices), vs.gather(-1, is_.sort(-1).indices)), "values not paired"
    assert not torch.equal(iu, is_), "the case should leave some row out of order"
    # sort="none" is what sorted=False launches; the indices-only call agrees, and so does a
    # second call, bit for bit
    iu2 = hytopk_triton(q, k, w, [hi], topk, spec, config=dataclasses.replace(cfg, sort="none"))
    assert torch.equal(iu2, iu)
    vu3, iu3 = hytopk_triton(q, k, w, [hi], topk, spec, return_values=True, sorted=False, config=cfg)
    assert torch.equal(iu3, iu) and torch.equal(vu3.view(torch.int32), vu.view(torch.int32))


def _after_case(seed):
    """6 rows of small-integer scores (ties), k = 300 of T = 700, rows' causal ends from 3 to
    700 (some rows short of k keys): the generator (for more operands), the operands, and T, H,
    D, k."""
    g = _gen(seed)
    B, S, T, H, D, topk = 1, 6, 700, 2, 16, 300
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.float32, lo=-2, hi=3, w_hi=2)
    hi = torch.tensor([[3, 200, 301, 650, 700, 20]])
    return g, q, k, w, hi, T, H, D, topk


@pytest.mark.interpret
def test_sort_after_same_bits(interpret, monkeypatch):
    # sort="after": the fused kernel writes rows unsorted with their fp32 values and
    # triton_sort_rows sorts them; bit for bit the rank sort's answer, in one launch and in
    # row chunks (the values workspace held to 4 rows: 2 launches for 6 rows), with values
    # and without, fp32 and bf16 scores (bf16: the values copied out chunk by chunk).
    g, q, k, w, hi, T, H, D, topk = _after_case(191)
    cfg = HyTopKConfig(block_m=4, block_n=32)
    after = dataclasses.replace(cfg, sort="after")
    chunked = 4 * topk * 4
    for score_dtype, budgets in (("float32", (1 << 30, chunked)), ("bfloat16", (chunked,))):
        spec = ScoreSpec(epilogue=(("relu",),), reduce="weighted_sum", post=DSA.post, masks=DSA.masks,
                         score_dtype=score_dtype)
        want = run_exact(q, k, w, [hi], topk, spec, config=cfg)
        for budget in budgets:
            monkeypatch.setattr(triton_hytopk, "_AFTER_BUDGET", budget)
            got = hytopk_triton(q, k, w, [hi], topk, spec, return_values=True, config=after)
            assert_same_bits([want, got])
            if score_dtype == "float32":  # indices only: the values live in the workspace
                assert torch.equal(hytopk_triton(q, k, w, [hi], topk, spec, config=after), want[1]), budget
    # several batches over the budget: the fused sort instead (same answer; 5 rows, so that
    # row chunks of several batches, which are not contiguous, would be needed otherwise)
    monkeypatch.setattr(triton_hytopk, "_AFTER_BUDGET", topk * 4)
    q2, k2, w2 = int_operands(g, 2, 5, T, H, 1, D, torch.float32, lo=-2, hi=3, w_hi=2)
    hi2 = torch.tensor([[301, 650, 3, 700, 5], [700, 20, 699, 1, 400]])
    want = hytopk_triton(q2, k2, w2, [hi2], topk, DSA, return_values=True, config=cfg)
    got = hytopk_triton(q2, k2, w2, [hi2], topk, DSA, config=after)
    assert torch.equal(got, want[1])
    # and without a sort
    got = hytopk_triton(q2, k2, w2, [hi2], topk, DSA, sorted=False, config=after)
    assert torch.equal(got.sort(-1).values, want[1].sort(-1).values)


@pytest.mark.interpret
def test_sort_after_chunks(interpret, monkeypatch):
    # sort="after" over the workspace: full chunks of the rows whose values fit, the rest
    # first (under a causal mask the lightest rows), and the fused
    # kernel's scratch counted in the bound; the same bits however the rows are cut
    _, q, k, w, hi, _, _, _, topk = _after_case(193)
    cfg = HyTopKConfig(block_m=4, block_n=32, sort="after")
    want = hytopk_triton(q, k, w, [hi], topk, DSA, config=cfg)
    launches = []
    real = triton_hytopk.load_kernel

    def spy_load(*a, **kw):
        kern = real(*a, **kw)

        class Spy:
            def __getitem__(self, grid):
                def run(*args, **launch):
                    launches.append(args[-4])  # (the launch's rows)
                    return kern[grid](*args, **launch)
                return run
        return Spy()
    monkeypatch.setattr(triton_hytopk, "load_kernel", spy_load)
    for after, work, rows in (((1 << 30), (1 << 30), [6]), (4 * topk * 4, 1 << 30, [2, 4])):
        monkeypatch.setattr(triton_hytopk, "_AFTER_BUDGET", after)
        monkeypatch.setattr(triton_hytopk, "_WORKSPACE_BUDGET", work)
        launches.clear()
        assert torch.equal(hytopk_triton(q, k, w, [hi], topk, DSA, config=cfg), want)
        assert launches == rows, (after, work, launches)
    # the scratch counts: 2-row blocks, 3 programs x 2 rows x cap (1,024 slots for k = 300) x 8
    # bytes beside the values; a byte short of 4 rows' values leaves chunks of 2 rows
    cfg2 = dataclasses.replace(cfg, block_m=2)
    monkeypatch.setattr(triton_hytopk, "_AFTER_BUDGET", 1 << 30)
    scratch = 3 * 2 * 1024 * 8
    for work, rows in ((scratch + 4 * topk * 4, [2, 4]), (scratch + 4 * topk * 4 - 1, [2, 2, 2])):
        monkeypatch.setattr(triton_hytopk, "_WORKSPACE_BUDGET", work)
        launches.clear()
        assert torch.equal(hytopk_triton(q, k, w, [hi], topk, DSA, config=cfg2), want)
        assert launches == rows, (work, launches)


def _compaction_case(seed):
    """k=20 over T=300 small-integer keys, weights >= 1: many compactions per row and
    exact-zero ReLU ties at the k-th score."""
    g = _gen(seed)
    B, S, T, H, D, topk = 1, 8, 300, 2, 16, 20
    q = torch.randint(-3, 2, (B, S, H, D), generator=g).float()
    k = torch.randint(0, 3, (B, T, 1, D), generator=g).float()
    w = torch.randint(1, 3, (B, S, H), generator=g).float()
    return q, k, w, topk, ScoreSpec(epilogue=(("relu",),), reduce="weighted_sum")


@pytest.mark.interpret
def test_compaction_with_boundary_ties(interpret):
    # Buffers much smaller than T (k=20, 16-key tiles: CAP=64), so rows are compacted many
    # times inside the scored-tile loop; exact-zero ReLU ties at the k-th score make the
    # threshold search resolve the boundary on the index bits too.
    q, k, w, topk, spec = _compaction_case(141)
    vals, _ = run_exact(q, k, w, [], topk, spec, config=HyTopKConfig(block_m=4, block_n=16))
    assert (vals == 0).any(), "the case should have zero ties inside the selection"


@pytest.mark.interpret
def test_buffer_policy_does_not_change_bits(interpret):
    # k=20, 16-key tiles: the default buffer is 16 lanes x 4 slots (CAP=64), so rows are
    # compacted many times inside the scored-tile loop. low_water (free slots per lane that
    # trigger a compaction, clamped to [1, 2] here) and a larger buffer (cap=128: 8 slots
    # per lane, clamp [1, 6]) change when and how often rows are compacted, never which keys survive. Zero ReLU ties
    # at the boundary exercise the index-word search. Same block shape, so the same
    # arithmetic: results must be bit-identical.
    q, k, w, topk, spec = _compaction_case(151)
    outs = []
    # Where the head weights live (reread_weights: every tile, or the whole row block)
    # changes registers, never arithmetic.
    for extra in (dict(low_water=1), dict(low_water=2), dict(cap=128, low_water=1), dict(cap=128, low_water=6),
                  dict(reread_weights=False)):
        v, i = run_exact(q, k, w, [], topk, spec, config=HyTopKConfig(block_m=4, block_n=16, **extra))
        outs.append((v, i))
    assert_same_bits(outs)


@pytest.mark.interpret
def test_presample_same_answer(interpret):
    # presample scores every P-th key of a block first, takes each row's estimate from
    # them, throws them away, and then appends only keys scoring >= it: the selection, ties
    # (small integers, ReLU zeros) and -inf fillers of the causal rows must be exactly those
    # without it. k=20, block_n=16: cap 64, so the stride is at least ceil(400 / 64) = 7;
    # blocks with >= 3k = 60 keys take a sample.
    g = _gen(171)
    B, S, T, H, D, topk = 1, 8, 400, 2, 16, 20
    spec = ScoreSpec(epilogue=(("relu",),), reduce="weighted_sum", post=DSA.post, masks=DSA.masks)
    masks = [causal_hi(B, S, T)]
    configs = [HyTopKConfig(block_m=4, block_n=16, presample=p, presample_z=z)
               for p, z in ((0, 3.5), (4, 3.5), (8, 1.0))]
    q, k, w = torch.randn(B, S, H, D, generator=g), torch.randn(B, T, 1, D, generator=g), torch.rand(B, S, H, generator=g)
    outs = []
    for c in configs:
        outs.append(hytopk_triton(q, k, w, masks, topk, spec, return_values=True, config=c))
        print(c.presample, c.presample_z, "blocks redone:", triton_hytopk.redone_blocks())
    s64, scale = scores64(q, k, w, masks, spec)
    for vals, idx in outs:
        check_sorted_contract(vals, idx)
        check_threshold(vals, idx, s64, scale, D, H, 2.0**-24)
    assert_same_bits(outs)
    # small integers (ties everywhere, many exact zeros after ReLU): equal to the stable
    # sort, bit for bit; an estimate of exactly 0 must still take the zeros
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.float32, lo=-2, hi=2)
    assert_same_bits([run_exact(q, k, w, masks, topk, spec, config=c) for c in configs])


@pytest.mark.interpret
def test_presample_redo_when_the_sample_misleads(interpret):
    # 15 hot keys (< k=20), all at sampled positions (stride max(4, ceil(704 / 64)) = 11:
    # keys 0, 11, 22, ...): every row's estimate (the 7th best sampled score) is a hot
    # score, so the main pass keeps fewer than k keys, the check fails, and the block runs
    # again without an estimate. The answer must be the one without presample.
    g = _gen(172)
    B, S, T, D, topk = 1, 8, 704, 16, 20
    q = torch.zeros(B, S, 1, D)
    q[..., 0] = 1.0
    k = torch.rand(B, T, 1, D, generator=g)
    hot = torch.arange(0, T, 11)[torch.randperm(64, generator=g)[:15]]
    k[0, hot, 0, 0] = 10.0 + torch.arange(15.0)
    spec = ScoreSpec(epilogue=(), reduce="sum")
    base = run_exact(q, k, None, [], topk, spec, config=HyTopKConfig(block_m=4, block_n=16))
    assert triton_hytopk.redone_blocks() == 0
    got = run_exact(q, k, None, [], topk, spec, config=HyTopKConfig(block_m=4, block_n=16, presample=4))
    assert triton_hytopk.redone_blocks() == 2  # both row blocks, once each
    assert_same_bits([base, got])
    assert set(hot.tolist()) <= set(got[1][0, 0].tolist())
    # ReLU zeros: 10 positive keys (< k), every other score exactly 0, so the estimate is
    # exactly 0 and the zeros must pass its filter (the float below +0.0 is -1.4e-45, not
    # -0.0, which compares equal to 0): no block redone, the same answer as without
    spec = ScoreSpec(epilogue=(("relu",),), reduce="sum")
    k = -torch.rand(B, T, 1, D, generator=g)
    pos = torch.randperm(T, generator=g)[:10]
    k[0, pos, 0, 0] = 1.0 + torch.arange(10.0)
    base = run_exact(q, k, None, [], topk, spec, config=HyTopKConfig(block_m=4, block_n=16))
    got = run_exact(q, k, None, [], topk, spec, config=HyTopKConfig(block_m=4, block_n=16, presample=4))
    assert triton_hytopk.redone_blocks() == 0
    assert_same_bits([base, got])


@pytest.mark.interpret
def test_presample_across_variants(interpret):
    # The sample goes through _score_tile like every tile: kv-head groups with keys
    # broadcast over the batch, a sliding window (range lo and hi: skipped tiles on both
    # sides), bf16 queries against fp32 keys (_dot_split3). Exact integers: each must equal
    # the stable sort, bit for bit, with the estimate on (stride >= 4, the cap's minimum).
    g = _gen(173)
    cfg = HyTopKConfig(block_m=4, block_n=16, presample=4)
    B, S, T, H, D = 2, 9, 300, 4, 16
    q, k, w = int_operands(g, B, S, T, H, 2, D, torch.float16, kb=1)  # Hk=2, k.shape[0]=1
    run_exact(q, k, w, [causal_hi(B, S, T)], 11, DSA, config=cfg)
    redone = [triton_hytopk.redone_blocks()]
    S = 48
    q, k, w = int_operands(g, 1, S, T, 2, 1, D, torch.float32)
    s = torch.arange(S) + (T - S)
    spec = ScoreSpec(epilogue=(("relu",), ("mul", 0.5)), post=(("mask", 0),),
                     masks=(MaskTerm(kind="range", lo=0, hi=1),))
    run_exact(q, k, w, [(s - 100).clamp(min=0).view(1, S), (s + 1).view(1, S)], 12, spec, config=cfg)
    redone.append(triton_hytopk.redone_blocks())
    q, k = _split_case(g)
    spec = ScoreSpec(epilogue=(("relu",),), reduce="sum", post=(("mask", 0),), masks=(MaskTerm(kind="range", hi=0),))
    run_exact(q, k, None, [causal_hi(1, 8, 300)], 20, spec, config=cfg)
    redone.append(triton_hytopk.redone_blocks())
    print("blocks redone:", redone)
    # (a wrong estimate would still be exact, through redone blocks; none is expected here:
    # an estimate forced to 3e38 redoes 6, 12 and 2 blocks, so the sample path runs in all
    # three)
    assert redone == [0, 0, 0]


@pytest.mark.interpret
def test_presample_rejects_bad_values(interpret):
    q, k, w, topk, spec = _compaction_case(152)
    for bad in (1, -2, 2.5, True):
        with pytest.raises(SpecError, match="presample="):
            hytopk_triton(q, k, w, [], topk, spec, config=HyTopKConfig(presample=bad))
    for bad in (-1.0, float("nan"), "3"):
        with pytest.raises(SpecError, match="presample_z="):
            hytopk_triton(q, k, w, [], topk, spec, config=HyTopKConfig(presample=2, presample_z=bad))


def _split_case(g, S=8, T=300, H=2, D=16):
    # bf16 queries, fp32 keys beyond bf16: integers below 2**17 (up to 17 significant bits:
    # hi, mid and sometimes lo), small-integer queries, so every product and sum is exact
    # (|score| <= 2 * 16 * 3 * 2**17 < 2**24) and the answer is the stable sort's, bit for bit
    q = torch.randint(-3, 4, (1, S, H, D), generator=g).to(torch.bfloat16)
    k = torch.randint(-2**17, 2**17, (1, T, 1, D), generator=g).float()
    return q, k


@pytest.mark.interpret
def test_split_dot_bf16_queries_fp32_keys(interpret):
    # bf16 q with fp32 k (QSA's pooled keys) takes _dot_split3 (UPCAST 3 under the
    # interpreter: the three parts in fp32 dots; on the GPU, bf16 dots: test_gpu_split_dot)
    g = _gen(181)
    q, k = _split_case(g)
    k[0, 7, 0, 3] = float("inf")        # a non-finite key stays whole in the top part
    spec = ScoreSpec(epilogue=(("relu",),), reduce="sum", post=(("mask", 0),),
                     masks=(MaskTerm(kind="range", hi=0),))
    masks = [causal_hi(1, 8, 300)]
    run_exact(q, k, None, masks, 20, spec)  # (key 7 scores +inf, -inf or NaN by the sign of q . e_3)
    # random fp32 keys: the threshold check against float64
    q = torch.randn(1, 8, 2, 16, generator=g).to(torch.bfloat16)
    k = torch.randn(1, 300, 1, 16, generator=g) * 3.0
    vals, idx = hytopk_triton(q, k, None, masks, 20, spec, return_values=True)
    check_sorted_contract(vals, idx)
    s64, scale = scores64(q, k, None, masks, spec)
    check_threshold(vals, idx, s64, scale, 16, 2, 2.0**-24)


def _one_hot_split_case(g, S=8, T=300, D=16):
    # one head, one nonzero query entry per row (+-1 or +-2): every score is one key entry
    # times it, exact in fp32 whatever the key's 24 significant bits, so all three parts of
    # _dot_split3 must be right to the last bit. Non-finite entries: a NaN key entry and an
    # inf key (NaN for every row: 0 * inf), an inf query entry in row 2 (+-inf, and NaN
    # where the key entry it meets is 0: key 13).
    d = torch.randint(0, D, (S,), generator=g)
    q = torch.zeros(1, S, 1, D)
    q[0, torch.arange(S), 0, d] = torch.tensor([1.0, -1.0, 2.0, -2.0] * (S // 4))
    q[0, 2, 0, d[2]] = float("inf")
    k = torch.randn(1, T, 1, D, generator=g)
    # a NaN with only low payload bits (cleared by truncation, it would read inf) where row
    # 0's query is 1: row 0 must score NaN there, the others NaN from 0 * NaN
    k[0, 5, 0, d[0]] = torch.tensor(0x7F800001, dtype=torch.int32).view(torch.float32)
    k[0, 9] = float("inf")
    k[0, 13, 0, d[2]] = 0.0
    return q.to(torch.bfloat16), k


@pytest.mark.interpret
def test_split_dot_full_mantissas_and_nonfinite(interpret):
    g = _gen(182)
    q, k = _one_hot_split_case(g)
    _, idx = run_exact(q, k, None, [], 20, ScoreSpec(epilogue=(), reduce="sum"))
    assert idx[0, :, :2].tolist() == [[5, 9]] * 8  # the NaN scores first, in index order


@pytest.mark.interpret
def test_large_buffer_threshold_counts(interpret):
    # A 32768-key buffer (cap=32768) with every key valid and above the thresholds: a
    # search that packs two counts per reduction as 16-bit fields wraps here and keeps the
    # first k keys instead of the best. Scores are the additive mask itself (one zero head):
    # t / 2**16, all in [0, 0.5), so the answer is the last k indices.
    T, topk = 32768, 5
    spec = ScoreSpec(reduce="none", post=(("mask", 0),), masks=(MaskTerm(kind="add", operand=0),))
    table = (torch.arange(T, dtype=torch.float32) / 65536).view(1, 1, T)
    q, k = torch.zeros(1, 1, 1, 16), torch.zeros(1, T, 1, 16)
    v, i = hytopk_triton(q, k, None, [table], topk, spec, return_values=True,
                         config=HyTopKConfig(block_m=1, block_n=32, cap=32768))
    assert i[0, 0].tolist() == list(range(T - 1, T - 1 - topk, -1))
    assert torch.equal(v[0, 0], table[0, 0, T - topk:].flip(0))


@pytest.mark.interpret
def test_tma_key_tiles_same_bits(interpret):
    # HyTopKConfig(tma=True): key tiles through a tensor descriptor over K as [batches x T, D]
    # (rows past a batch's T belong to the next batch or are zero-filled, and key_ok masks
    # them). Two batches with their own keys, a T that is not a multiple of the tile, and a
    # causal mask; the same block shape, so the same bits as the pointer loads.
    g = _gen(171)
    B, S, T, H, D, topk = 2, 12, 90, 2, 16, 7
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.float32)
    masks = [causal_hi(B, S, T)]
    outs = [run_exact(q, k, w, masks, topk, DSA, config=HyTopKConfig(block_n=32, tma=t)) for t in (False, True)]
    assert_same_bits(outs)
    # one key batch shared by both query batches (k.shape[0] == 1)
    outs = [run_exact(q, k[:1], w, masks, topk, DSA, config=HyTopKConfig(block_n=32, tma=t)) for t in (False, True)]
    assert_same_bits(outs)
    # keys broadcast along T (row stride 0) cannot be a descriptor: the pointer loads serve
    kx = k[:1, :1].expand(B, T, 1, D)
    assert triton_hytopk._key_descriptor(kx, B, T, 32, 16) == (None, 0)
    assert triton_hytopk._key_descriptor(k, B, T, 32, 16)[1] == T
    run_exact(q, kx, w, masks, topk, DSA, config=HyTopKConfig(block_n=32, tma=True))


class _FakeKern:
    """A stand-in for a Triton kernel: compiled shared memory per stage count (warmup), and
    launches that record their stage count or raise OutOfResources where listed."""

    def __init__(self, shared, out_of_resources=()):
        self.shared, self.oor, self.warmed, self.launched = shared, set(out_of_resources), [], []

    def warmup(self, *args, grid, num_stages, **launch):
        self.warmed.append(num_stages)
        return types.SimpleNamespace(metadata=types.SimpleNamespace(shared=self.shared[num_stages]))

    def __getitem__(self, grid):
        def run(*args, num_stages, **launch):
            if num_stages in self.oor:
                from triton.runtime.errors import OutOfResources

                raise OutOfResources(self.shared[num_stages], 232448, "shared memory")
            self.launched.append(num_stages)
        return run


def test_resident_stages_checks_the_compiled_kernel():
    # _launch_default's stage count comes from the compiled kernel's shared memory (Triton's
    # warmup), not only default_config's estimate: the most stages (up to the launch's) that
    # let the given programs per SM share its shared memory, each rounded up to 128 B with
    # the driver's reserved KiB.
    h200 = 233472  # 228 KiB

    def stages(shared, resident=2, per_sm=h200, asked=3):
        return triton_hytopk._resident_stages(_FakeKern(shared), 264, (), dict(num_stages=asked), resident, per_sm)

    dsa = {3: 114712, 2: 98320}  # the offline sm_90 build at the DSA shape
    kern = _FakeKern(dsa)
    assert triton_hytopk._resident_stages(kern, 264, (), dict(num_stages=3), 2, h200) == 3
    assert kern.warmed == [3]
    assert stages({3: 115712}) == 3  # the pointer-load build: exactly two programs' worth
    assert stages({3: 115713, 2: 99000}) == 2  # one byte more: past it
    # shared memory counts in 128 B units: 115,650 B takes 115,712
    assert stages({3: 115650, 2: 99000}, per_sm=2 * (115712 + 1024) - 2) == 2
    assert stages({3: 116736, 2: 100344}) == 2  # 2 KiB more scratch: two programs need 2 stages
    assert stages({3: 116736}, resident=1) == 3  # one program per SM fits 3
    assert stages(dsa, per_sm=210000) == 2  # the device's own figure, not the constant
    # no stage count >= 2 keeps two programs per SM (H=64, D=256: the launch planned one
    # per SM): the launch's own stage count, not 1
    assert stages({3: 230400, 2: 197632}) == 3
    kern = _FakeKern(dsa)  # a launch that asks for 2 never compiles 3
    assert triton_hytopk._resident_stages(kern, 264, (), dict(num_stages=2), 2, h200) == 2
    assert kern.warmed == [2]


def test_launch_default_caches_stages_per_residency(monkeypatch):
    props = types.SimpleNamespace(multi_processor_count=132, shared_memory_per_multiprocessor=233472)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(triton_hytopk, "_STAGES", {})
    launch, dkey = dict(num_stages=3, TOPK=2048), ("bf16", "bf16", "cuda:0")
    kern = _FakeKern({3: 116736, 2: 100344, 1: 84000})
    triton_hytopk._launch_default(kern, 200, (), launch, dkey, "cuda:0")  # ceil(200 / 132) = 2 per SM: 2 stages
    assert (kern.warmed, kern.launched) == ([3, 2], [2])
    triton_hytopk._launch_default(kern, 264, (), launch, dkey, "cuda:0")  # also 2 per SM, cached: no compile check
    assert (kern.warmed, kern.launched) == ([3, 2], [2, 2])
    triton_hytopk._launch_default(kern, 100, (), launch, dkey, "cuda:0")  # one per SM: its own entry
    assert (kern.warmed, kern.launched) == ([3, 2, 3], [2, 2, 3])
    # a launch that runs out of shared memory anyway steps down, and that count is kept
    kern = _FakeKern({3: 114712, 2: 98320, 1: 84000}, out_of_resources={3})
    monkeypatch.setattr(triton_hytopk, "_STAGES", {})
    triton_hytopk._launch_default(kern, 264, (), launch, dkey, "cuda:0")
    triton_hytopk._launch_default(kern, 264, (), launch, dkey, "cuda:0")
    assert (kern.warmed, kern.launched) == ([3], [2, 2])


def test_default_config_takes_tma_where_keys_allow():
    # The GPU default: TMA key tiles with held weights where k's layout allows a
    # descriptor, re-read weights otherwise; 3 key-tile stages either way at the DSA shape
    # (the estimate counts the driver's reserved KiB per block, not 2 KiB of scratch, which
    # would reject the third TMA stage; the compiled kernel is 114,712 B)
    cuda = torch.device("cuda")
    with_tma = triton_hytopk.default_config(32768, 32768, 2048, cuda, True, 128, 64, tma=True)
    without = triton_hytopk.default_config(32768, 32768, 2048, cuda, True, 128, 64, tma=False)
    assert (with_tma.tma, with_tma.reread_weights, with_tma.num_stages) == (True, False, 3)
    assert (without.tma, without.reread_weights, without.num_stages) == (False, None, 3)
    # the sampled estimate where it was measured (TMA key tiles at the DSA shape, up to
    # 128K keys; at 1M it lost)
    assert with_tma.presample == 128 and not without.presample
    assert not triton_hytopk.default_config(1 << 20, 1 << 20, 2048, cuda, True, 128, 64, tma=True).presample
    # only in the measured regime (64 heads per kv head, k <= 2048): elsewhere held weights
    # spilled more in offline builds, so those shapes keep the pointer loads
    for args in ((32768, 32768, 4096, cuda, True, 128, 64), (32768, 32768, 2048, cuda, True, 128, 8)):
        cfg = triton_hytopk.default_config(*args, tma=True)
        assert (cfg.tma, cfg.reread_weights, cfg.num_stages) == (False, None, 3), args
    B, T, D = 2, 100, 64
    k = torch.zeros(B, T, 1, D, dtype=torch.bfloat16)
    assert triton_hytopk._tma_applies(k, T, 64)
    assert triton_hytopk._tma_applies(k[:1], T, 64)  # one key batch for all
    assert triton_hytopk._tma_applies(k[..., :56], T, 64)  # a view: rows stay 128 B apart
    assert not triton_hytopk._tma_applies(torch.zeros(B, T, 1, 60, dtype=torch.bfloat16), T, 64)  # 120 B rows
    assert not triton_hytopk._tma_applies(k.transpose(1, 3).contiguous().transpose(1, 3), T, 64)
    assert not triton_hytopk._tma_applies(k[:, :1].expand(B, T, 1, D), T, 64)  # broadcast along T
    assert not triton_hytopk._tma_applies(torch.zeros(B, 2 * T, 1, D, dtype=torch.bfloat16)[:, :T], T, 64)  # gaps
    assert not triton_hytopk._tma_applies(k[:1], 2**31 - 2**21, 64)  # key positions + buffer past int32
    assert triton_hytopk._tma_applies(k[:1], 2**31 - 2**23, 64)


def _score_table_rows(g, T):
    """Rows of fp32 scores that stress the k-th search: its start at the highest bit where
    a row's smallest and largest score differ, and the tie and special-value paths."""
    rows = [
        torch.randn(T, generator=g),                                       # iid
        torch.full((T,), 1.5),                                             # all equal
        torch.randn(T, generator=g) * 2.0 ** torch.randint(-20, 21, (T,), generator=g).float(),  # wide, signs
        torch.where(torch.rand(T, generator=g) < 0.9, 0.0, torch.rand(T, generator=g)),  # zero ties
        1.0 + torch.randint(0, 8, (T,), generator=g).float() * 2.0 ** -23,  # low mantissa bits only
        -torch.arange(T, dtype=torch.float32),                             # descending, negative
        torch.where(torch.rand(T, generator=g) < 0.05, -0.0, 0.0),         # +0 and -0 only
        torch.randn(T, generator=g),                                       # specials, set below
    ]
    rows[7][::7] = math.inf
    rows[7][3::11] = -math.inf
    rows[7][5::13] = math.nan
    return torch.stack(rows)


@pytest.mark.interpret
@pytest.mark.parametrize("cap", [64, 128])
def test_threshold_search_on_special_scores(interpret, cap):
    # The scores are an additive table (one zero head), so each row's values are chosen
    # directly; k=20 over 300 keys in 16-key tiles compacts each row many times inside the
    # loop, exactly (cap=64: no room for slack) or with an early-exit lower bound (cap=128:
    # SLACK = 2 tiles). Exact against the stable sort, NaN above +inf.
    g = _gen(161 + cap)
    T, topk = 300, 20
    table = _score_table_rows(g, T).unsqueeze(0)
    S = table.shape[1]
    spec = ScoreSpec(reduce="none", post=(("mask", 0),), masks=(MaskTerm(kind="add", operand=0),))
    q, k = torch.zeros(1, S, 1, 16), torch.zeros(1, T, 1, 16)
    run_exact(q, k, None, [table], topk, spec, config=HyTopKConfig(block_m=4, block_n=16, cap=cap))


@pytest.mark.interpret
@pytest.mark.parametrize("sort", ["bitonic", "none"])
def test_signed_zero_ties_reach_the_keys(interpret, sort):
    # -0.0 and +0.0 are one value (torch.sort's order, the float64 stable reference's). In DSA's
    # own arithmetic a -0.0 never reaches the keys (the head sum starts from +0.0 and an
    # additive mask adds +0.0; Triton's negation is 0 - y), so here a post step makes them:
    # y = -0.0 (a zero head times -1), then a table of -0.0, +0.0 and some positive values,
    # added: the rows' zeros are a mix of both signs, and the k-th value is 0 with ties across
    # tiles and compactions (the GPU's fp32 tiles of 32 keys, compacted whenever a lane
    # fills). The selection must take the zeros of the smallest indices whatever their sign,
    # as the stable reference does
    g = _gen(171)
    S, T, topk = 3, 600, 64
    sign = torch.where(torch.rand(1, S, T, generator=g) < 0.5, -0.0, 0.0)
    table = torch.where(torch.rand(1, S, T, generator=g) < 0.03, torch.rand(1, S, T, generator=g) + 0.5, sign)
    table[..., 1] = 0.75  # (a mask tensor's first run of additive zeros is not read: keep it short)
    spec = ScoreSpec(reduce="none", post=(("mul", -1.0), ("mask", 0)), masks=(MaskTerm(kind="add", operand=0),))
    q, k = torch.zeros(1, S, 1, 16), torch.zeros(1, T, 1, 16)
    eager = torch.zeros(1, S, T) * -1.0 + table  # the scores as torch computes them
    zeros = eager == 0
    neg = torch.signbit(eager)
    assert bool((zeros & neg).sum(-1).min() > 100) and bool((zeros & ~neg).sum(-1).min() > 100)
    assert bool(((eager > 0).sum(-1) < topk).all()), "the k-th value of every row should be a zero"
    cfg = HyTopKConfig(block_n=32, block_m=4, low_water=1, sort=sort)
    vals, idx = hytopk_triton(q, k, None, [table], topk, spec, return_values=True, config=cfg, sorted=sort != "none")
    assert_selection_equal(idx, eager, values=vals, rtol=0, atol=0, sorted=sort != "none")


@pytest.mark.interpret
def test_buffer_config_errors(interpret):
    q, k, w, topk, spec = _compaction_case(152)
    with pytest.raises(SpecError, match="cap"):
        hytopk_triton(q, k, w, [], topk, spec, config=HyTopKConfig(block_m=4, block_n=16, cap=48))
    with pytest.raises(SpecError, match="reread_weights='tiles'"):
        hytopk_triton(q, k, w, [], topk, spec, config=HyTopKConfig(reread_weights="tiles"))


@pytest.mark.interpret
def test_padded_head_groups_and_block_m(interpret):
    # G = 3 heads per kv head (padded to 4 dot columns per row); several block_m values.
    # Dyadic inputs keep every sum exact, so the bits must not depend on block_m.
    g = _gen(151)
    B, S, T, H, Hk, D, topk = 1, 10, 80, 6, 2, 16, 9
    q = torch.randint(-16, 17, (B, S, H, D), generator=g) / 8.0
    k = torch.randint(-16, 17, (B, T, Hk, D), generator=g) / 8.0
    w = torch.randint(-8, 9, (B, S, H), generator=g) / 8.0
    spec = ScoreSpec(epilogue=(("add", 0.5), ("relu",)), reduce="weighted_sum", post=DSA.post, masks=DSA.masks)
    masks = [causal_hi(B, S, T)]
    outs = []
    for bm in (1, 4, 16):
        v, i = run_exact(q, k, w, masks, topk, spec, config=HyTopKConfig(block_m=bm, block_n=16))
        outs.append((v, i))
    assert_same_bits(outs)


@pytest.mark.interpret
def test_empty_and_errors(interpret, monkeypatch):
    q = torch.ones(1, 4, 2, 16)
    k = torch.ones(1, 8, 1, 16)
    w = torch.ones(1, 4, 2)
    hi = causal_hi(1, 4, 8)
    idx = hytopk_triton(q, k, w, [hi], 0, DSA)
    assert idx.shape == (1, 4, 0) and idx.dtype == torch.int32
    v, idx = hytopk_triton(q[:, :0], k, w[:, :0], [hi[:, :0]], 3, DSA, return_values=True)
    assert idx.shape == (1, 0, 3) and v.shape == (1, 0, 3)
    with pytest.raises(SpecError, match="k=9"):
        hytopk_triton(q, k, w, [hi], 9, DSA)
    spec = ScoreSpec(post=(("mask", 0),), masks=(MaskTerm(kind="add", operand=0),))
    with pytest.raises(SpecError, match="float64"):
        hytopk_triton(q, k, w, [torch.zeros(1, 4, 8, dtype=torch.float64)], 2, spec)
    with pytest.raises(SpecError, match="broadcast"):
        hytopk_triton(q, k, w, [torch.zeros(3, 8)], 2, spec)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SpecError, match="CUDA"):
        hytopk_triton(q, k, w, [hi], 2, DSA)


def test_codegen_relu_form_and_weight_fold():
    # A positive scale next to the ReLU moves into the head weights (the launcher passes
    # w * c); a negative one cannot (relu(-x) != -relu(x)), nor can a scale without weights.
    for epi in ((("mul", 0.125), ("relu",)), (("relu",), ("mul", 0.125))):
        spec = ScoreSpec(epilogue=epi, reduce="weighted_sum")
        assert cg.weight_scale(spec) == 0.125
        assert "x = x * 0.125" not in cg.render_kernel_source(spec, 0)
    for spec in (ScoreSpec(epilogue=(("mul", -0.125), ("relu",)), reduce="weighted_sum"),
                 ScoreSpec(epilogue=(("mul", 0.125), ("relu",)), reduce="sum"),
                 ScoreSpec(epilogue=(("mul", 0.125), ("relu",), ("add", 1.0)), reduce="weighted_sum")):
        assert cg.weight_scale(spec) is None
        assert "x = x * " in cg.render_kernel_source(spec, 0)
    # The one-instruction ReLU may give -0.0 where torch gives +0.0 (or the reverse): only
    # used where no later step can tell the two apart, i.e. not before a registered mod.
    assert not cg._zero_sign_blind((("mod", "softcap"),)) and cg._zero_sign_blind((("mul", 2.0), ("add", 1.0)))


@pytest.mark.interpret
def test_codegen_file_cache(interpret, kernel_cache):
    src = cg.render_kernel_source(DSA, 1)
    assert src == cg.render_kernel_source(DSA, 1), "rendering must be deterministic"
    assert "tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)" in src  # one-instruction ReLU
    assert "_weigh(wv[None, :], x, UPCAST, TF32)" in src and "hi0" in src
    assert "@triton.jit" in src and "hytopk_kernel" in src
    k1 = cg.load_kernel(DSA, 1)
    assert cg.load_kernel(DSA, 1) is k1
    path = cg.write_source(src)
    assert os.path.dirname(path) == kernel_cache and os.path.exists(path)
    assert open(path).read() == src
    other = ScoreSpec(epilogue=(("sigmoid",),), reduce="sum")
    src2 = cg.render_kernel_source(other, 0)
    assert "tl.sigmoid" in src2 and "_weigh(" not in src2.split("def _score_tile")[1]
    assert cg.write_source(src2) != path
    assert not [f for f in os.listdir(kernel_cache) if f.endswith(".tmp")]
    with pytest.raises(SpecError):
        cg.render_kernel_source(DSA, 0)  # the mask term names operand 0


def _changed_lines(a: str, b: str) -> set:
    """The stripped lines that differ between two sources (difflib), header comments aside."""
    import difflib

    diff = difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
    changed = {ln[1:].strip() for ln in diff if ln[:1] in "+-" and not ln.startswith(("+++", "---"))}
    return {ln for ln in changed if not ln.startswith(("# spec:", "# score:"))}


def _mask_term_lines(spec: ScoreSpec) -> set:
    """Every line the spec's mask terms render into the kernel: their arguments, row bounds,
    skip bounds and post-step lines."""
    plan = kernel_plan(spec)
    text = "\n".join([cg._render_row_bounds(spec), cg._render_skip_bounds(spec, plan), cg._render_post(spec, plan)])
    return {ln.strip() for ln in text.splitlines()} | {f"{a}," for a in cg._mask_args(spec, plan)}


def test_generated_kernels_differ_only_in_the_mask_term():
    # The generated file holds only what the spec decides: two DSA specs whose one mask term
    # differs (an additive -inf causal range, the same range as a -inf fill; the additive form
    # also waits for the finite check before skipping, SKIPF) differ in that term's lines and
    # nowhere else, and the default DSA kernel is a short file (the helpers are triton_lib's)
    fill = dataclasses.replace(DSA, epilogue=(("mul", 128 ** -0.5), ("relu",)))
    add = dataclasses.replace(fill, masks=(MaskTerm(kind="range", hi=0, mode="add"),))
    src_add, src_fill = cg.render_kernel_source(add, 1), cg.render_kernel_source(fill, 1)
    changed = _changed_lines(src_add, src_fill)
    assert 'y = y + tl.where(hidden0, (-float("inf")), 0.0)' in changed
    assert 'y = tl.where(hidden0, (-float("inf")), y)' in changed
    assert "SKIPF," in changed  # (the finite check's flag: the additive term's only)
    outside = changed - _mask_term_lines(add) - _mask_term_lines(fill)
    assert not outside, f"lines outside the mask term differ: {sorted(outside)}"
    # the same holds of a difference in the epilogue: only _epilogue's lines differ
    scaled = dataclasses.replace(add, epilogue=(("mul", 0.25), ("relu",)))
    changed = _changed_lines(src_add, cg.render_kernel_source(scaled, 1))
    assert changed and all("weight_scale" in ln or ln.startswith("# mul") for ln in changed), changed
    assert src_add.count("\n") < 300, src_add.count("\n")
    assert "def _compact_row" not in src_add and "def hytopk_kernel(" in src_add


def test_mask_pieces_for_another_kernel():
    # each MaskTerm kind's kernel pieces (its class in mask_kinds) take the consumer's
    # index expressions: a kernel over gathered key indices idx [rows, k] gets the same
    # term applied at idx, its per-row values broadcast along its own axis
    spec = ScoreSpec(post=(("mask", 0), ("mask", 1)), reduce="sum",
                     masks=(MaskTerm(kind="range", lo=0, hi=1, mode="add"), MaskTerm(kind="fill", operand=2)))
    rng, table = cg.mask_pieces(spec)
    assert type(rng) is mask_kinds.RangeMask and type(table) is mask_kinds.FillMask
    assert rng.apply_lines(keys="idx", per_row="[:, None]") == [
        "hidden0 = (idx < lo0[:, None]) | (idx >= hi0[:, None])",
        'y = y + tl.where(hidden0, (-float("inf")), 0.0)']
    got = table.apply_lines(keys="idx", per_row="[:, None]", ok="sel_ok")
    assert got[0] == ("m1 = tl.load(M1 + (b64 * stride_m1_b + rows64[:, None] * stride_m1_s + idx.to(tl.int64) "
                      "* stride_m1_t), mask=sel_ok, other=0)"), got
    assert got[1] == 'y = tl.where(m1 != 0, (-float("inf")), y)'
    assert rng.args() == ["LO0", "stride_lo0_b", "stride_lo0_s", "HI0", "stride_hi0_b", "stride_hi0_s"]
    assert rng.row_values() == ["lo0", "hi0"] and table.tile_args() == ["M1", "stride_m1_b", "stride_m1_s",
                                                                       "stride_m1_t"]


@pytest.mark.interpret
def test_interpreter_tests_in_a_fresh_process(tmp_path):
    """When another test module imported triton before this one could set
    TRITON_INTERPRET (a full-suite run on a CPU machine), the interpreter tests above
    skip themselves; run them here in a fresh process instead, so they never go silent."""
    if _triton_interpreted():
        pytest.skip("the interpreter tests ran in this process")
    if torch.cuda.is_available() and os.environ.get("HYSCALE_TEST_INTERPRET_ON_GPU_HOST") != "1":
        pytest.skip("GPU host: run `TRITON_INTERPRET=1 pytest -m interpret` for the interpreter tests")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-m", "interpret", "-q", "-p", "no:cacheprovider",
         "-k", "not fresh_process"],
        env=env, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]


# ------------------------------------------------------------------------------------
# GPU tests (run on an H200; skipped here)
# ------------------------------------------------------------------------------------
def _sampled_threshold(q, k, w, masks, topk, spec, vals, idx, rows, u):
    """Threshold check on a few rows, float64 on the GPU."""
    qs = q[:, rows]
    ws = None if w is None else w[:, rows]
    ms = []
    for m in masks:  # this helper only slices per-row range bounds
        ms.append(torch.broadcast_to(m, (q.shape[0], q.shape[1]))[:, rows])
    s64, scale = scores64(qs, k, ws, ms, spec)
    check_threshold(vals[:, rows], idx[:, rows], s64, scale, q.shape[-1], q.shape[2], u)


def _dsa_case(cuda, seed, S, H=64, D=128):
    """Random bf16 operands at the DSA shape (batch 1, one kv head, causal), its spec and mask."""
    torch.manual_seed(seed)
    print(f"seed={seed}")
    q = torch.randn(1, S, H, D, device=cuda, dtype=torch.bfloat16)
    k = torch.randn(1, S, 1, D, device=cuda, dtype=torch.bfloat16)
    w = torch.randn(1, S, H, device=cuda) * H**-0.5
    spec = ScoreSpec(epilogue=(("relu",), ("mul", D**-0.5)), post=DSA.post, masks=DSA.masks)
    return q, k, w, spec, [causal_hi(1, S, S, cuda)]


@pytest.mark.gpu
@pytest.mark.parametrize("sorted_", [True, False], ids=["sorted", "unsorted"])
def test_gpu_fp32_example_shape_selects_distinct_keys(cuda, sorted_):
    # examples/train_dsa.py at --seq 8192 on the H200 (fp32, 16 index heads x 16, k = 256,
    # batch 4, HF's additive causal mask, which canonicalizes to a range of hidden value
    # finfo.min): its same-weights check found, in 2 of 3.3M rows over 50 steps, a hyscale
    # selection holding one key twice. On the FMA-unit dots the head sum runs across 8 lanes,
    # each keeping a copy of the score that decides the key's append and its lane count; the
    # copies rounded differently where the first butterfly step was fused with a lane's own
    # product (test_kernel_compiles.py::test_fp32_head_sum_copies_agree_for_sm90), and copies
    # straddling a row's threshold leave a key in two slots. The interpreter keeps one copy, so
    # only the GPU can show it. Random inputs, and "clustered" ones (keys within ~2^-18 of one
    # key, so each row's scores crowd within a few ulps around its k-th and the copies'
    # roundings straddle the threshold often), -inf filled and finfo.min added: every row's
    # keys are distinct and in range, and the rows are the stable top-k of the float64 scores
    B, S, T, H, D, topk = 4, 8192, 8192, 16, 16, 256
    hi = causal_hi(B, S, T, cuda)
    fmin = float(torch.finfo(torch.float32).min)
    for i, (clustered, mode, value) in enumerate([(False, "fill", -math.inf), (True, "fill", -math.inf),
                                                  (True, "add", fmin)]):
        spec = ScoreSpec(name="dsa", epilogue=(("mul", 0.25), ("relu",)), reduce="weighted_sum",
                         post=(("mask", 0),), masks=(MaskTerm(kind="range", hi=0, mode=mode, value=value),))
        g = torch.Generator(device=cuda).manual_seed(fresh_seed(f"gpu fp32 example shape #{i}"))
        q = torch.randn(B, S, H, D, device=cuda, generator=g)
        k = torch.nn.functional.layer_norm(torch.randn(B, T, 1, D, device=cuda, generator=g), (D,))
        if clustered:
            k = k[:, :1] * (1 + 2.0 ** -18 * torch.randn(B, T, 1, D, device=cuda, generator=g))
        w = torch.randn(B, S, H, device=cuda, generator=g) * H ** -0.5
        idx = hytopk_triton(q, k, w, [hi], topk, spec, sorted=sorted_)
        srt = idx.long().sort(-1).values
        dup = (srt[..., 1:] == srt[..., :-1]).any(-1)
        assert not dup.any() and bool((srt >= 0).all()) and bool((srt < T).all()), \
            f"case {i}: rows with a key twice: {dup.nonzero()[:8].tolist()}"
        for b in range(B):
            s64 = ref.dense_scores(q[b:b + 1].double(), k[b:b + 1].double(), w[b:b + 1].double(), [hi[b:b + 1]],
                                   spec, dtype=torch.float64)
            assert_selection_equal(idx[b:b + 1].cpu(), s64.cpu(), atol=1e-5, sorted=sorted_)
            del s64


@pytest.mark.gpu
def test_gpu_dsa_shape_bf16(cuda, monkeypatch):
    monkeypatch.setattr(triton_hytopk, "_STAGES", {})  # (only this test's launches below)
    B, S, T, H, D, topk = 1, 4096, 4096, 64, 128, 2048
    q, k, w, spec, masks = _dsa_case(cuda, 1001, S)
    vals, idx = hytopk_triton(q, k, w, masks, topk, spec, return_values=True)
    torch.cuda.synchronize()
    assert idx.dtype == torch.int32 and idx.shape == (B, S, topk)
    check_sorted_contract(vals[:, ::64].cpu(), idx[:, ::64].cpu())
    rows = torch.tensor([0, 1, 100, 2046, 2047, 2048, 2049, 3000, 4094, 4095] + list(range(7, S, 509)), device=cuda)
    _sampled_threshold(q, k, w, masks, topk, spec, vals, idx, rows, 2.0**-24)
    # rows with fewer than k valid keys: fillers are the next indices, at -inf
    assert idx[0, 10, 11:].tolist() == list(range(11, topk))
    assert torch.isneginf(vals[0, 10, 11:]).all()
    # the same call again is bitwise identical
    v2, i2 = hytopk_triton(q, k, w, masks, topk, spec, return_values=True)
    assert torch.equal(i2, idx) and torch.equal(v2.view(torch.int32), vals.view(torch.int32))
    # so are the options that leave the arithmetic alone, and the pointer-load path with
    # re-read weights (the default here takes TMA key tiles and held weights)
    default = triton_hytopk.default_config(S, T, topk, q.device, True, D, H, tma=True)
    assert default.tma and default.reread_weights is False and default.num_stages == 3
    # the compiled kernel kept 3 stages with two programs per SM on this card
    used = [v for (_, items, _, _), v in triton_hytopk._STAGES.items()
            if dict(items).get("USE_TMA") and dict(items).get("TOPK") == topk]
    assert used and set(used) == {3}, triton_hytopk._STAGES
    # (the default sorts in a kernel of its own, "after"; the fused sort is one of the extras)
    for extra in (dict(num_stages=2),
                  dict(sort="bitonic"), dict(tma=False, num_stages=3, reread_weights=True), dict(sort="after")):
        cfg = dataclasses.replace(default, **extra)
        v3, i3 = hytopk_triton(q, k, w, masks, topk, spec, return_values=True, config=cfg)
        assert torch.equal(i3, idx) and torch.equal(v3.view(torch.int32), vals.view(torch.int32)), extra
    # sorted=False: the same sets, values paired with indices, in a repeatable order
    vu, iu = hytopk_triton(q, k, w, masks, topk, spec, return_values=True, sorted=False)
    order = iu.sort(-1)
    assert torch.equal(order.values, idx.sort(-1).values)
    assert torch.equal(vu.gather(-1, order.indices), vals.gather(-1, idx.sort(-1).indices))
    assert torch.equal(hytopk_triton(q, k, w, masks, topk, spec, sorted=False), iu)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 2048, 64), (2, 1, 64)])
def test_gpu_stride0_weights_same_bits(cuda, shape):
    """Broadcast head weights as a stride-0 expand (what the rewrite passes): the same bits
    as the materialized weights, at a DSA-like shape, bf16 operands with fp32 weights."""
    B, S, H, D, topk = 2, 2048, 64, 128, 512
    g = _gen(1101 + shape[1])
    q = torch.randn(B, S, H, D, generator=g).to(cuda, torch.bfloat16)
    k = torch.randn(B, S, 1, D, generator=g).to(cuda, torch.bfloat16)
    w = (torch.randn(shape, generator=g) * H**-0.5).to(cuda).expand(B, S, H)
    spec = ScoreSpec(epilogue=(("relu",), ("mul", D**-0.5)), post=DSA.post, masks=DSA.masks)
    masks = [causal_hi(B, S, S, cuda)]
    vals, idx = hytopk_triton(q, k, w, masks, topk, spec, return_values=True)
    v2, i2 = hytopk_triton(q, k, w.contiguous(), masks, topk, spec, return_values=True)
    torch.cuda.synchronize()
    assert torch.equal(i2, idx) and torch.equal(v2.view(torch.int32), vals.view(torch.int32))
    check_sorted_contract(vals[:, ::256].cpu(), idx[:, ::256].cpu())


@pytest.mark.gpu
def test_gpu_finite_hidden_value_same_selection(cuda):
    # HF's causal masks hide keys with finfo.min, added (s + where(causal, 0, min)) or
    # filled. At the DSA shape the scores are far below add_limit(finfo.min), so hidden tiles
    # are skipped and every row selects exactly what the -inf mask selects: the same indices,
    # the same values at visible keys, finfo.min where the -inf mask gives -inf (the fillers
    # of rows with fewer than k visible keys)
    S, T, topk = 8192, 8192, 2048
    q, k, w, spec, masks = _dsa_case(cuda, 1003, S)
    v_inf, i_inf = hytopk_triton(q, k, w, masks, topk, spec, return_values=True)
    fmin = torch.finfo(torch.float32).min
    for mode in ("add", "fill"):
        hf = dataclasses.replace(spec, masks=(dataclasses.replace(spec.masks[0], mode=mode, value=fmin),))
        if mode == "add":
            assert triton_hytopk.hidden_value_flag(hf, q, k, w).tolist() == [1]
        v, i = hytopk_triton(q, k, w, masks, topk, hf, return_values=True)
        assert torch.equal(i, i_inf), mode
        assert torch.equal(v, torch.where(torch.isneginf(v_inf), fmin, v_inf)), mode
        assert (v[0, 10, 11:] == fmin).all()
    # the same masks as tensors (HF's runtime attention_mask; triton_mask_ranges gives each
    # row its visible range, and hidden tiles are skipped): additive finfo.min, bool -inf fill
    visible = torch.arange(T, device=cuda)[None, :] <= torch.arange(S, device=cuda)[:, None]
    for kind in ("add", "fill"):
        term = MaskTerm(kind="add", operand=0) if kind == "add" else MaskTerm(kind="fill", operand=0, value=-math.inf)
        mt = torch.where(visible, 0.0, fmin)[None] if kind == "add" else ~visible[None]
        ts = dataclasses.replace(spec, masks=(term,))
        v, i = hytopk_triton(q, k, w, [mt], topk, ts, return_values=True)
        assert torch.equal(i, i_inf), kind
        assert torch.equal(v, torch.where(torch.isneginf(v_inf), fmin, v_inf) if kind == "add" else v_inf), kind


@pytest.mark.gpu
def test_gpu_nonfinite_operand_in_skipped_tile(cuda):
    # DSA's additive causal mask (s + full(-inf).triu(1)): a NaN key hidden from a row is
    # NaN in eager, which torch.topk ranks first; a NaN in a row's q or w makes every key of
    # the row NaN (eager: keys 0..k-1). The launch proves the operands finite on the device
    # before it skips hidden tiles; here it must not skip, and every other row and value
    # stays bit for bit what the finite call gives
    S, topk = 4096, 2048
    q, k, w, spec, masks = _dsa_case(cuda, 1009, S)
    spec = dataclasses.replace(spec, masks=(dataclasses.replace(spec.masks[0], mode="add", value=-math.inf),))
    v0, i0 = hytopk_triton(q, k, w, masks, topk, spec, return_values=True)
    assert idx_fillers_ok(v0, i0)
    r = 100
    others = torch.arange(S, device=cuda) != r
    for sign in (1.0, -1.0):
        kn = k.clone()
        kn[0, S - 1, 0, 7] = sign * math.nan  # hidden from every row but the last
        v, i = hytopk_triton(q, kn, w, masks, topk, spec, return_values=True)
        assert (i[0, :-1, 0] == S - 1).all() and v[0, :-1, 0].isnan().all()
        assert torch.equal(i[0, :-1, 1:], i0[0, :-1, :-1])
        assert torch.equal(v[0, :-1, 1:].view(torch.int32), v0[0, :-1, :-1].view(torch.int32))
        for name in ("q", "w"):
            qn, wn = q.clone(), w.clone()
            if name == "q":
                qn[0, r, 5, 9] = sign * math.nan
            else:
                wn[0, r, 5] = sign * math.nan
            v, i = hytopk_triton(qn, k, wn, masks, topk, spec, return_values=True)
            assert i[0, r].tolist() == list(range(topk)) and v[0, r].isnan().all(), name
            assert torch.equal(i[0, others], i0[0, others]), name
            assert torch.equal(v[0, others].view(torch.int32), v0[0, others].view(torch.int32)), name


def idx_fillers_ok(vals, idx):
    """Rows with fewer than k visible keys (row s of a causal mask holds s + 1) end with the
    smallest hidden keys at -inf."""
    return idx[0, 10, 11:].tolist() == list(range(11, idx.shape[-1])) and bool(torch.isneginf(vals[0, 10, 11:]).all())


@pytest.mark.gpu
def test_gpu_presample_same_bits(cuda):
    # presample at the DSA shape (blocks with >= 3k = 6,144 keys take a sample): the
    # default (stride 128) gives the same bits as without it (presample=0), as
    # stride 32 does, and as an estimate so tight (stride 4, z=0) that blocks fail the
    # check and run again
    S, T, H, D, topk = 16384, 16384, 64, 128, 2048
    q, k, w, spec, masks = _dsa_case(cuda, 1005, S)
    vals, idx = hytopk_triton(q, k, w, masks, topk, spec, return_values=True)
    rows = torch.tensor([0, 2047, 6143, 6144, 8192, 16383] + list(range(11, S, 1021)), device=cuda)
    _sampled_threshold(q, k, w, masks, topk, spec, vals, idx, rows, 2.0**-24)
    default = triton_hytopk.default_config(S, T, topk, q.device, True, D, H, tma=True)
    redone = []
    # (the default takes presample=128; presample=0 is the kernel without an estimate)
    assert default.presample == 128
    for extra in (dict(presample=0), dict(presample=32), dict(presample=4, presample_z=0.0),
                  dict(presample=32, sort="bitonic")):
        cfg = dataclasses.replace(default, **extra)
        v3, i3 = hytopk_triton(q, k, w, masks, topk, spec, return_values=True, config=cfg)
        redone.append(triton_hytopk.redone_blocks())
        assert torch.equal(i3, idx) and torch.equal(v3.view(torch.int32), vals.view(torch.int32)), extra
    print("blocks redone:", redone)
    assert redone[2] > 0  # the tight estimate did fail somewhere: the redo path ran on the GPU


@pytest.mark.gpu
def test_gpu_split_dot(cuda):
    # bf16 queries, fp32 keys (QSA's pooled keys): three bf16 tensor-core dots per tile
    # (_dot_split3). Exact integers: bit for bit the stable sort; the QSA chunk shape
    # (4,096 rows, 8,192 keys, k=512, block-causal): the threshold check on sampled rows,
    # and the same bits again.
    g = _gen(1006)
    q, k = _split_case(g, S=64, T=2048)
    spec = ScoreSpec(epilogue=(("relu",),), reduce="sum", post=(("mask", 0),),
                     masks=(MaskTerm(kind="range", hi=0),))
    run_exact(q.to(cuda), k.to(cuda), None, [causal_hi(1, 64, 2048, cuda)], 100, spec)
    q, k = _one_hot_split_case(g, S=64, T=2048, D=128)
    run_exact(q.to(cuda), k.to(cuda), None, [], 100, ScoreSpec(epilogue=(), reduce="sum"))
    torch.manual_seed(1006)
    S, N, topk = 4096, 8192, 512
    q = torch.randn(1, S, 4, 128, device=cuda).to(torch.bfloat16)
    k = torch.randn(1, 4 * N, 128, device=cuda).to(torch.bfloat16).view(1, N, 4, 128).float().mean(2, keepdim=True)
    spec = ScoreSpec(epilogue=(("relu",),), reduce="sum", post=(("div", 128**0.5), ("mask", 0)),
                     masks=(MaskTerm(kind="range", hi=0),))
    masks = [((torch.arange(S, device=cuda) + 4 * N - S) // 4 + 1).view(1, S)]
    vals, idx = hytopk_triton(q, k, None, masks, topk, spec, return_values=True)
    rows = torch.tensor([0, 1, 2047, 4095] + list(range(5, S, 397)), device=cuda)
    _sampled_threshold(q, k, None, masks, topk, spec, vals, idx, rows, 2.0**-24)
    check_sorted_contract(vals[:, ::97].cpu(), idx[:, ::97].cpu())
    # keys with full fp32 significands (QSA's means have mostly 8-10 bits)
    kr = torch.randn(1, N, 1, 128, device=cuda)
    vr, ir = hytopk_triton(q, kr, None, masks, topk, spec, return_values=True)
    _sampled_threshold(q, kr, None, masks, topk, spec, vr, ir, rows, 2.0**-24)
    v2, i2 = hytopk_triton(q, k, None, masks, topk, spec, return_values=True)
    assert torch.equal(i2, idx) and torch.equal(v2.view(torch.int32), vals.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_gqa_k4096_threshold(cuda, dtype):
    torch.manual_seed(1002)
    print("seed=1002")
    B, S, T, H, Hk, D, topk = 2, 300, 6000, 16, 4, 96, 4096  # D, S, T not powers of two
    q = torch.randn(B, S, H, D, device=cuda).to(dtype)
    k = torch.randn(1, T, Hk, D, device=cuda).to(dtype)
    w = torch.randn(B, S, H, device=cuda)
    spec = ScoreSpec(epilogue=(("relu",),), post=DSA.post, masks=DSA.masks)
    masks = [causal_hi(B, S, T, cuda)]
    vals, idx = hytopk_triton(q, k, w, masks, topk, spec, return_values=True)
    check_sorted_contract(vals.cpu(), idx.cpu())
    rows = torch.tensor([0, 1, 150, 298, 299], device=cuda)
    _sampled_threshold(q, k, w, masks, topk, spec, vals, idx, rows, 2.0**-24)


@pytest.mark.gpu
def test_gpu_exact_integer_cases(cuda):
    g = _gen(1003)
    B, S, T, H, D, topk = 2, 200, 700, 8, 64, 257
    q, k, w = int_operands(g, B, S, T, H, 1, D, torch.bfloat16)
    hi = causal_hi(B, S, T)
    vals, idx = hytopk_triton(q.to(cuda), k.to(cuda), w.to(cuda), [hi.to(cuda)], topk, DSA, return_values=True)
    check_exact(q, k, w, [hi], topk, DSA, vals.cpu(), idx.cpu())
    # additive / fill masks and the sum reduction, fp16
    q, k, _ = int_operands(g, B, S, T, H, 1, D, torch.float16, lo=-4, hi=2)
    add = torch.where(torch.rand(B, S, T, generator=g) < 0.3, torch.finfo(torch.float32).min, 0.0)
    fill = torch.rand(1, S, T, generator=g) < 0.1
    spec = ScoreSpec(epilogue=(("relu",),), reduce="sum", post=(("mask", 0), ("mask", 1)),
                     masks=(MaskTerm(kind="add", operand=0), MaskTerm(kind="fill", operand=1)))
    vals, idx = hytopk_triton(q.to(cuda), k.to(cuda), None, [add.to(cuda), fill.to(cuda)], topk, spec,
                              return_values=True)
    check_exact(q, k, None, [add, fill], topk, spec, vals.cpu(), idx.cpu())


@pytest.mark.gpu
def test_gpu_bits_identical_across_processes(cuda, kernel_cache, tmp_path):
    script = textwrap.dedent("""
        import dataclasses, hashlib, torch
        from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec
        from hyscale_compile.lowerings import triton_hytopk
        from hyscale_compile.lowerings.triton_hytopk import hytopk_triton
        torch.manual_seed(7)
        # two batches at k = 2048: the default's TMA key tiles, sort kernel and sampled
        # estimate (rows past 3k = 6,144 keys take a sample) all run
        B, S, T, H, D, K = 2, 8192, 8192, 64, 128, 2048
        q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, T, 1, D, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(B, S, H, device="cuda")
        hi = (torch.arange(S, device="cuda") + 1).view(1, S)
        spec = ScoreSpec(epilogue=(("relu",),), post=(("mask", 0),), masks=(MaskTerm(kind="range", hi=0),))
        v, i = hytopk_triton(q, k, w, [hi], K, spec, return_values=True)
        cfg = triton_hytopk.default_config(S, T, K, q.device, True, D, H, tma=True)
        assert cfg.presample, cfg
        v0, i0 = hytopk_triton(q, k, w, [hi], K, spec, return_values=True, config=dataclasses.replace(cfg, presample=0))
        assert torch.equal(i0, i) and torch.equal(v0.view(torch.int32), v.view(torch.int32)), "presample changed bits"
        h = hashlib.sha256(v.view(torch.int32).cpu().numpy().tobytes() + i.cpu().numpy().tobytes())
        print("HASH", h.hexdigest())
    """)
    env = {k_: v_ for k_, v_ in os.environ.items() if k_ != "TRITON_INTERPRET"}
    env["HYSCALE_KERNEL_CACHE"] = kernel_cache
    # importable without an install too (hyscale_compile/__init__ maps lowerings/ and passes/)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    hashes = []
    for _ in range(2):
        # cwd outside the source tree: a bare `hyscale_compile/` dir on sys.path[0] would
        # shadow the installed package
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                             timeout=600, cwd=str(tmp_path))
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        hashes.append([ln for ln in out.stdout.splitlines() if ln.startswith("HASH")][0])
    assert hashes[0] == hashes[1]
