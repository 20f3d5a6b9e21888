"""A bound on every score's magnitude, computed on the device before a HyTopK launch.

A mask that hides keys with a finite value (HF's ``finfo.min``) lets the kernel skip the
hidden keys' tiles only when it is known that each hidden key holds exactly that value
and lies below every visible score, which depends on how large the scores can get
(``spec.finite_range_term``, ``spec.tensor_mask_term``). ``score_bound_flag`` decides that
per launch from the operands' largest magnitudes (three ``aminmax``) and the spec's steps,
folded on the host into a closed form (``_bound_program``) that one small kernel
evaluates: no host sync, a handful of launches. The same bound with no limit proves every
score finite, which skipping the tiles of an additive -inf mask needs (``finite_flag``,
``spec.finite_guard``).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .spec import FiniteGuard, ScoreSpec, SpecError, finite_guard


@triton.jit
def _bound_flag_kernel(QLO, QHI, KLO, KHI, WLO, WHI, HIDDEN, FLAG, coef, a, b, h, p_max, x_max, a2, b2, limit,
                       WEIGHTED: tl.constexpr, FROM_HIDDEN: tl.constexpr):
    # fp32 throughout: a bound that overflows is inf, and NaN compares false: no skip
    mq = tl.maximum(tl.abs(tl.load(QLO).to(tl.float32)), tl.abs(tl.load(QHI).to(tl.float32)))
    mk = tl.maximum(tl.abs(tl.load(KLO).to(tl.float32)), tl.abs(tl.load(KHI).to(tl.float32)))
    p = mq * mk * coef
    x = (a * p + b) * h
    if WEIGHTED:
        x = x * tl.maximum(tl.abs(tl.load(WLO).to(tl.float32)), tl.abs(tl.load(WHI).to(tl.float32)))
    ok = (p < p_max) & (x < x_max)
    lim = limit
    if FROM_HIDDEN:
        # fl(s + v) == v, below every visible score, for |s| < a quarter of the spacing just
        # below |v| (v finite), and for every finite s when v = -inf; v >= 0 or NaN: never
        v = tl.load(HIDDEN)
        av = tl.abs(v)
        below = (av.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
        lim = tl.where(v == float("-inf"), float("inf"), (av - below) * 0.25)
        ok = ok & (v < 0.0)
    ok = ok & (a2 * x + b2 < lim)
    tl.store(FLAG, ok.to(tl.int32))


_FP16_MAX = 65504.0
_BF16_SAFE = 3.38e38  # below bf16's largest finite (3.3895e38): a value past it may round to inf
_FP32_SAFE = 3.4e38


@functools.lru_cache(maxsize=256)
def _bound_program(spec: ScoreSpec, post_steps: Optional[tuple] = None) -> tuple:
    """The score bound of ``score_bound_flag`` in closed form, for the device kernel:
    (a, b, p_max, x_max, a2, b2). With p = D max|q| max|k| (1% over) and
    x = (a p + b) * H (max|w| for a weighted sum), every score before the spec's last post
    step (after ``post_steps`` instead, when given) is at most a2 x + b2, and no
    intermediate value leaves the range of the dtype that holds it while p < p_max and
    x < x_max. Every step maps a bound m >= 0 to an affine
    a m + b with a, b >= 0, or (sigmoid) to 1; caps: fp32 after every step, fp16 / bf16 at the
    logits and at ``round`` steps (whose rounding may also grow a value by 2^-8: x (1 + 2^-7))."""

    def chain(steps, cap_first):
        a, b, lim = 1.0, 0.0, [cap_first]  # m = a * in + b; lim: caps on `in`
        def cap(top):
            if a > 0:
                lim.append((top - b) / a)
            elif not b < top:
                lim.append(-math.inf)
        for st in steps:
            op = st[0]
            if op == "mul":
                a, b = a * abs(st[1]), b * abs(st[1])
            elif op == "div":
                if st[1] == 0:
                    lim.append(-math.inf)
                    continue
                a, b = a / abs(st[1]), b / abs(st[1])
            elif op == "add":
                b += abs(st[1])
            elif op == "sigmoid":
                cap(_FP32_SAFE)
                a, b = 0.0, 1.0
            elif op == "round":
                cap({"float16": _FP16_MAX, "bfloat16": _BF16_SAFE}.get(st[1], _FP32_SAFE))
                a, b = a * (1 + 2.0**-7), b * (1 + 2.0**-7)
            elif op not in ("relu", "neg"):
                raise SpecError(f"internal: no magnitude bound for step {st!r}")
            cap(_FP32_SAFE)
        return a, b, min(lim)

    first = {"float16": _FP16_MAX, "bfloat16": _BF16_SAFE}.get(spec.logit_dtype, _FP32_SAFE)
    a, b, p_max = chain(spec.epilogue, first)
    a2, b2, x_max = chain(spec.post[:-1] if post_steps is None else post_steps, _FP32_SAFE)
    return a, b, p_max, x_max, a2, b2


def score_bound_flag(spec: ScoreSpec, q: torch.Tensor, k: torch.Tensor, w: Optional[torch.Tensor], *,
                     limit: Optional[float] = None, hidden: Optional[torch.Tensor] = None,
                     post_steps: Optional[tuple] = None) -> torch.Tensor:
    """int32 [1] on q's device: 1 when a bound on every score before the spec's last post
    step (its mask) is below ``limit``, or, given ``hidden`` (fp32 [1], an additive mask
    tensor's hidden value v_h), below ``add_limit(v_h)`` with v_h < 0 (any finite score when
    v_h = -inf); 0 when it is not, or when some step could overflow, or the inputs hold NaN
    or inf. The bound (``_bound_program``): D max|q| max|k| (1% over: the fp32 accumulation
    and later relative roundings), then the epilogue, H max|w| (or H) for the head
    reduction, then the post steps. ``w``: the caller's weights (not the launch's, which may
    have an epilogue ``mul`` folded in). On the device, no host sync: three ``aminmax`` and
    one small kernel. ``post_steps``: the post steps the bound runs through instead of all
    but the last (``spec.FiniteGuard.bounds``)."""
    a, b, p_max, x_max, a2, b2 = _bound_program(spec, post_steps)
    H, D = q.shape[2], q.shape[3]
    flag = torch.empty(1, dtype=torch.int32, device=q.device)
    if q.numel() == 0 or k.numel() == 0:
        flag.fill_(0)
        return flag
    qlo, qhi = torch.aminmax(q)
    klo, khi = torch.aminmax(k)
    weighted = spec.reduce == "weighted_sum" and w is not None and w.numel() > 0
    wlo, whi = torch.aminmax(w) if weighted else (qlo, qhi)
    _bound_flag_kernel[(1,)](qlo, qhi, klo, khi, wlo, whi, hidden if hidden is not None else flag, flag,
                             float(D) * 1.01, a, b, float(H), p_max, x_max, a2, b2,
                             math.inf if limit is None else float(limit),
                             WEIGHTED=weighted, FROM_HIDDEN=hidden is not None)
    return flag


def score_bound_holds(spec: ScoreSpec, q: torch.Tensor, k: torch.Tensor, w: Optional[torch.Tensor], *,
                      post_steps: Optional[tuple] = None) -> bool:
    """``score_bound_flag``'s verdict without a limit (every score finite: no NaN or inf
    operand, no step overflowing), on the host: the CPU path's check. The same closed form
    as the kernel's, evaluated in float64."""
    a, b, p_max, x_max, a2, b2 = _bound_program(spec, post_steps)
    if q.numel() == 0 or k.numel() == 0:
        return False

    def mag(t):  # max |t|, NaN if t holds one (Python's max drops a NaN second argument)
        lo, hi = (float(v) for v in torch.aminmax(t))
        return math.nan if math.isnan(lo) or math.isnan(hi) else max(abs(lo), abs(hi))

    p = mag(q) * mag(k) * float(q.shape[3]) * 1.01
    x = (a * p + b) * float(q.shape[2])
    if spec.reduce == "weighted_sum" and w is not None and w.numel() > 0:
        x = x * mag(w)
    return bool(p < p_max and x < x_max and a2 * x + b2 < math.inf)


def finite_flag(spec: ScoreSpec, q: torch.Tensor, k: torch.Tensor, w: Optional[torch.Tensor], masks,
                guard: Optional[FiniteGuard] = None) -> torch.Tensor:
    """int32 [1] on q's device: 1 when ``spec.finite_guard``'s checks hold (the hidden keys
    of its terms are then exactly -inf and their tiles may be skipped), else 0. On the
    device, no host sync (CUDA graphs capture it): one ``score_bound_flag`` per bound, an
    ``all`` per mask tensor. ``w``: the caller's weights; ``guard``: the spec's, where the
    caller's ``KernelPlan`` has it."""
    guard = finite_guard(spec) if guard is None else guard
    flag = None
    for steps in guard.bounds:
        f = score_bound_flag(spec, q, k, w, post_steps=steps)
        flag = f if flag is None else flag & f
    for i in guard.tensors:
        f = (masks[i] < math.inf).all().to(torch.int32).reshape(1)  # False for NaN and +inf
        flag = f if flag is None else flag & f
    return flag


def finite_holds(spec: ScoreSpec, q: torch.Tensor, k: torch.Tensor, w: Optional[torch.Tensor], masks,
                 guard: Optional[FiniteGuard] = None) -> bool:
    """``finite_flag`` on the host (the CPU path)."""
    guard = finite_guard(spec) if guard is None else guard
    return (all(score_bound_holds(spec, q, k, w, post_steps=steps) for steps in guard.bounds)
            and all(bool((masks[i] < math.inf).all()) for i in guard.tensors))
