"""Each row's visible key range, read off a mask tensor before the HyTopK launch.

A mask that reaches the op as a tensor (HF's runtime ``attention_mask``, Megatron's mask
argument) hides keys the kernel can only see by reading the tensor, so it used to score
every key of every row. For a spec whose only mask step is such a tensor
(``spec.tensor_mask_term``), this pass gives each row (b, s) the range [lo, hi) outside
which every key is hidden, with one hidden value for the whole tensor: the fill value of a
bool mask, or the smallest value v_h of an additive one (-inf, or the dtype's finfo.min).
The kernel then skips key tiles outside the rows' ranges exactly as it skips a range mask's
(tile skipping and fillers, ``triton_codegen``), and still applies the tensor per key inside
them, except on each row's first run of neutral keys (an additive 0, a bool mask's visible
polarity: HF's causal rows are one such run), where it does not read the tensor at all.
For an additive mask a hidden key scores fl(s + v_h), which is v_h only while |s| is
small enough; ``mask_key_ranges`` checks that bound on the device, and the kernel skips
nothing when it fails.

The pass reads the tensor once (each row's minimum, ranges and neutral run together), then
reduces the rows' minima to the hidden value: S x T elements, what the kernel itself would
read to apply it in full.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .spec import ScoreSpec, SpecError, tensor_mask_term


@triton.jit
def _visible_range_kernel(M, stride_b, stride_s, stride_t, RLO, RHI, NLO, NHI, RMIN, S, T,
                          ADD: tl.constexpr, WHERE: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row (b, s), in one read of the row, BLOCK keys at a time:
    # - fill (bool) masks: the first and last visible key;
    # - additive masks: the row's minimum (NaN if it holds one) and the first and last key
    #   that differ from it (mask_key_ranges turns them into the visible range once the
    #   tensor's minimum, the hidden value, is known);
    # - both: the row's first run of neutral keys [nlo, nhi) (an additive 0, a fill's
    #   visible polarity), where the HyTopK kernel need not read the mask (v26).
    # Each of the BLOCK lanes keeps its own state over its keys (p, p + BLOCK, ...), with no
    # reduction inside the loop (six per block before: the scan was ALU-bound at ~2.3 TB/s,
    # docs/kernel-design.md v29); the lanes are combined once at the end.
    row = tl.program_id(0)
    b = row // S
    s = row - b * S
    base = M + b.to(tl.int64) * stride_b + s.to(tl.int64) * stride_s
    p = tl.arange(0, BLOCK)
    big = tl.zeros([BLOCK], dtype=tl.int32) + T
    first = big                                      # per lane: first key that differs / is visible
    last = tl.zeros([BLOCK], dtype=tl.int32) - 1     # per lane: last such key
    nlo = big                                        # per lane: first neutral key
    after = big                                      # per lane: first non-neutral key after it
    lmin = tl.zeros([BLOCK], dtype=tl.float32) + float("inf")
    nan = tl.zeros([BLOCK], dtype=tl.int1)
    for t0 in range(0, T, BLOCK):
        t = t0 + p
        ok = t < T
        x = tl.load(base + t.to(tl.int64) * stride_t, mask=ok, other=0)
        if ADD:
            xf = x.to(tl.float32)
            nan = nan | (ok & (xf != xf))
            new_min = tl.where(ok & (xf < lmin), xf, lmin)  # (NaN never below)
            # keys that differ from the lane's running minimum (NaN does); when it drops,
            # every earlier key of the lane differs from it: first becomes the lane's
            # first key (p), last its previous key (t - BLOCK)
            dropped = new_min < lmin
            ne = ok & (xf != new_min)
            first = tl.where(dropped, tl.where(t0 > 0, p, big), tl.where(ne, tl.minimum(first, t), first))
            last = tl.where(dropped, tl.where(t0 > 0, t - BLOCK, -1), tl.where(ne, t, last))
            lmin = new_min
            neutral = ok & (xf == 0.0)  # y + 0.0 is y (+-0 aside, which _pack erases)
        else:
            vis = ok & ((x != 0) != WHERE)  # fill: hidden where the bool equals WHERE
            first = tl.where(vis, tl.minimum(first, t), first)
            last = tl.where(vis, t, last)
            neutral = vis
        after = tl.where((nlo < t) & (after == T) & ok & ~neutral, t, after)
        nlo = tl.where(neutral, tl.minimum(nlo, t), nlo)
    # the lanes combined. The run starts at the row's first neutral key r_lo; it ends at
    # the first key after r_lo that is not neutral: in each lane, its first key q past r_lo
    # where q comes before the lane's own first neutral key (so q is not neutral), else the
    # lane's first non-neutral key after that one
    r_lo = tl.min(nlo, axis=0)
    q = p + tl.maximum(r_lo - p + BLOCK, 0) // BLOCK * BLOCK  # (p > r_lo: p itself)
    cand = tl.where(q < nlo, q, after)
    r_hi = tl.min(tl.where(q < T, cand, T), axis=0)
    if ADD:
        r_min = tl.min(lmin, axis=0)
        # a lane whose minimum is above the row's differs from it at every key: its first
        # key and its last (lanes past T hold no key)
        lane_last = p + (T - 1 - p) // BLOCK * BLOCK
        above = (lmin > r_min) & (p < T)
        first = tl.where(above, p, first)
        last = tl.where(above, lane_last, last)
        tl.store(RMIN + row, tl.where(tl.max(nan.to(tl.int32), axis=0) != 0, float("nan"), r_min))
    tl.store(RLO + row, tl.min(first, axis=0))
    tl.store(RHI + row, tl.max(last, axis=0) + 1)
    tl.store(NLO + row, r_lo)
    tl.store(NHI + row, tl.maximum(r_hi, r_lo))


def visible_ranges_reference(m: torch.Tensor, add: bool, where: bool, vh: Optional[torch.Tensor]):
    """The same ranges with torch ops ([B, S, T] temporaries: tests only)."""
    B, S, T = m.shape
    vis = (m.float() != vh) if add else ((m != 0) != where)
    t = torch.arange(T, device=m.device)
    first = torch.where(vis, t, T).amin(-1).to(torch.int32)
    last = torch.where(vis, t, -1).amax(-1).to(torch.int32)
    return first, last + 1


def neutral_runs_reference(m: torch.Tensor, add: bool, where: bool):
    """Each row's first run of neutral keys [nlo, nhi) as the kernel finds it (tests only):
    nlo the first neutral key (T: none), nhi the first key after it that is not neutral."""
    B, S, T = m.shape
    neutral = (m.float() == 0) if add else ((m != 0) != where)
    t = torch.arange(T, device=m.device)
    nlo = torch.where(neutral, t, T).amin(-1)
    nhi = torch.where(~neutral & (t > nlo[..., None]), t, T).amin(-1)
    return nlo.to(torch.int32), nhi.to(torch.int32)


_BLOCK = 1024  # keys per step of the scan (tests make it small to cross blocks)


class MaskRanges(NamedTuple):
    """What ``mask_key_ranges`` reads off a mask tensor, for the kernel's ``RLO, RHI``
    (then ``FILLV``, ``SKIPF`` where the spec declares them)."""

    lo: torch.Tensor  # int32 [B, S]: each row's first visible key (T: none)
    hi: torch.Tensor  # int32 [B, S]: one past its last visible key (0: none)
    hidden: Optional[torch.Tensor]  # fp32 [1]: an additive mask's hidden value (its smallest)
    flag: Optional[torch.Tensor]  # int32 [1]: the bound's verdict, when the term needs one
    nlo: torch.Tensor  # int32 [B, S]: the row's first neutral run [nlo, nhi), where the
    nhi: torch.Tensor  # kernel skips reading the mask (v26)


def mask_key_ranges(spec: ScoreSpec, m: torch.Tensor, bound_flag: Callable[..., torch.Tensor]) -> MaskRanges:
    """Each row's visible key range of the spec's mask tensor ``m`` (a [B, S, T] view, bool
    masks as uint8), its hidden value, and whether the kernel may skip outside the ranges.
    ``bound_flag(limit=... | hidden=...)``: the launch's ``score_bound.score_bound_flag``
    for its operands."""
    j, needs_bound = tensor_mask_term(spec)
    term = spec.masks[j]
    B, S, T = m.shape
    add = term.kind == "add"
    rlo = torch.empty((B, S), dtype=torch.int32, device=m.device)
    rhi = torch.empty((B, S), dtype=torch.int32, device=m.device)
    nlo = torch.empty((B, S), dtype=torch.int32, device=m.device)
    nhi = torch.empty((B, S), dtype=torch.int32, device=m.device)
    if T >= 2**31 - 1:
        raise SpecError(f"T={T}: a mask tensor's key ranges are int32")
    vh = flag = None
    if B * S:
        rmin = torch.empty((B, S), dtype=torch.float32, device=m.device) if add else rlo
        _visible_range_kernel[(B * S,)](m, m.stride(0), m.stride(1), m.stride(2), rlo, rhi, nlo, nhi, rmin, S, T,
                                        ADD=add, WHERE=bool(term.where), BLOCK=_BLOCK)
    if add:
        # the hidden value: the tensor's smallest (-inf, finfo.min, ...; NaN if it holds
        # one). A row is hidden where it holds that value: rows whose own minimum is larger
        # (or NaN) hide nothing
        if m.numel():
            vh = rmin.amin().reshape(1)
            same = rmin == vh
            rlo = torch.where(same, rlo, 0)
            rhi = torch.where(same, rhi, T)
        else:
            vh = torch.full((1,), math.nan, device=m.device)
        flag = bound_flag(hidden=vh)
    elif needs_bound:  # a finite fill value v < 0: below every visible score while |s| < |v| / 2
        flag = bound_flag(limit=-term.value / 2)
    return MaskRanges(rlo, rhi, vh, flag, nlo, nhi)
