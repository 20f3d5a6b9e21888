"""Each row's visible key range, read off a mask tensor before the HyTopK launch.

A mask that reaches the op as a tensor (HF's runtime ``attention_mask``, Megatron's mask
argument) hides keys the kernel can only see by reading the tensor, so without ranges it
scores every key of every row. For a spec whose only mask step is such a tensor
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

from .mask_kinds import kind_of
from .spec import ScoreSpec, SpecError, tensor_mask_term


@triton.jit
def _visible_range_kernel(M, stride_b, stride_s, stride_t, RLO, RHI, NLO, NHI, RMIN, S, T,
                          ADD: tl.constexpr, WHERE: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row (b, s), scanned BLOCK keys at a time, in one read of the row:
    # - fill (bool) masks: the first and last visible key;
    # - additive masks: the row's minimum (NaN if it holds one) and the first and last key
    #   that differ from it (mask_key_ranges turns them into the visible range once the
    #   tensor's minimum, the hidden value, is known, so no second pass reads the row);
    # - both: the row's first run of neutral keys [nlo, nhi) (an additive 0, a fill's
    #   visible polarity), where the HyTopK kernel need not read the mask.
    row = tl.program_id(0)
    b = row // S
    s = row - b * S
    base = M + b.to(tl.int64) * stride_b + s.to(tl.int64) * stride_s
    first = tl.zeros([], dtype=tl.int32) + T
    last = tl.zeros([], dtype=tl.int32) - 1
    nlo = tl.zeros([], dtype=tl.int32) + T
    nhi = tl.zeros([], dtype=tl.int32) + T
    run_min = tl.zeros([], dtype=tl.float32) + float("inf")
    nan = tl.zeros([], dtype=tl.int32)
    for t0 in range(0, T, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        ok = t < T
        x = tl.load(base + t.to(tl.int64) * stride_t, mask=ok, other=0)
        if ADD:
            xf = x.to(tl.float32)
            nan = tl.maximum(nan, tl.max((ok & (xf != xf)).to(tl.int32), axis=0))
            new_min = tl.minimum(run_min, tl.min(tl.where(ok & (xf == xf), xf, float("inf")), axis=0))
            # keys that differ from the running minimum (NaN does); when the minimum drops,
            # every earlier key differs from it
            ne = ok & (xf != new_min)
            b_first = tl.min(tl.where(ne, t, T), axis=0)
            b_last = tl.max(tl.where(ne, t, -1), axis=0)
            dropped = new_min < run_min
            first = tl.where(dropped, tl.where(t0 > 0, 0, b_first), tl.minimum(first, b_first))
            last = tl.where(dropped, tl.maximum(t0 - 1, b_last), tl.maximum(last, b_last))
            run_min = new_min
            neutral = ok & (xf == 0.0)  # y + 0.0 is y (+-0 aside, which _pack erases)
        else:
            vis = ok & ((x != 0) != WHERE)  # fill: hidden where the bool equals WHERE
            first = tl.minimum(first, tl.min(tl.where(vis, t, T), axis=0))
            last = tl.maximum(last, tl.max(tl.where(vis, t, -1), axis=0))
            neutral = vis
        # the run starts at the first neutral key and ends at the first key after it that
        # is not neutral; blocks come in key order, so once it has ended it stays
        nlo = tl.minimum(nlo, tl.min(tl.where(neutral, t, T), axis=0))
        end = tl.min(tl.where(ok & ~neutral & (t > nlo), t, T), axis=0)
        nhi = tl.where(nhi < T, nhi, end)
    tl.store(RLO + row, first)
    tl.store(RHI + row, last + 1)
    tl.store(NLO + row, nlo)
    tl.store(NHI + row, tl.maximum(nhi, nlo))
    if ADD:
        tl.store(RMIN + row, tl.where(nan != 0, float("nan"), run_min))


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
    nhi: torch.Tensor  # kernel skips reading the mask


def mask_key_ranges(spec: ScoreSpec, m: torch.Tensor, bound_flag: Callable[..., torch.Tensor],
                    term_of_plan: Optional[tuple] = None) -> MaskRanges:
    """Each row's visible key range of the spec's mask tensor ``m`` (a [B, S, T] view, bool
    masks as uint8), its hidden value, and whether the kernel may skip outside the ranges.
    ``bound_flag(limit=... | hidden=...)``: the launch's ``score_bound.score_bound_flag``
    for its operands; ``term_of_plan``: the spec's ``KernelPlan.tensor_mask``, where the
    caller has it."""
    j, needs_bound = tensor_mask_term(spec) if term_of_plan is None else term_of_plan
    term = spec.masks[j]
    B, S, T = m.shape
    add = kind_of(term).adds_to_score  # an additive tensor's hidden value is its smallest, read here
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
