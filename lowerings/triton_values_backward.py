"""A fused Triton kernel for the per-row part of ``hytopk_values``'s sparse backward.

One program per (query row, key head): it gathers the row's k keys block by block, rebuilds
the per-head logits (the spec's logit rounding and epilogue steps, generated from the spec
like the forward kernel), runs the steps' derivatives in reverse and gives

    gq[s, h]       = sum_j gx[h, j] k[t_j]        (accumulated over slot blocks, in order)
    gw[s, h]       = sum_j x[h, j] gy[j]
    C[hk, (s, j)]  = sum_h gx[h, j] q[s, h]       (the per-slot key contributions)

where gy is d loss / d (reduced score), from the post steps' derivatives (computed on the
[rows, k] gradient in PyTorch: they act on the reduced score, so they are cheap). Row (s, j)
of C is stored at ``dest[s k + j]``, its key-sorted position (``attention_backward.key_runs``),
and the key gradient is then ``attention_backward.sorted_segment_sum_`` over C: each key's
run read contiguously, in (row, slot) order. Nothing reduces across rows inside the kernel, so
the results do not depend on the chunking.

Covered specs (``supported``): epilogue steps mul / add / div / relu (all spellings) / neg /
sigmoid / round, any logit dtype, and post steps whose derivative does not read the score
(masks, mul, add, div, neg). Others (registered mods, a relu after the head reduction) keep
the PyTorch path. The matmuls have fp32 accuracy: IEEE fp32 dots (not TF32), or with bf16 q
and k, a bf16 logit dot (exact products) and gradient dots over an exact three-part bf16
split of the fp32 gradient (the forward kernel's scheme), on the tensor cores.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
import triton

from .config_text import parse_fields
from .spec import ScoreSpec
from .triton_codegen import _interpreting, _lit, _round_expr, import_source

_EPILOGUE_OPS = ("mul", "add", "div", "relu", "neg", "sigmoid", "round")
_POST_OPS = ("mask", "mul", "add", "div", "neg")  # derivatives that do not read the score


def supported(spec: ScoreSpec) -> bool:
    return (all(st[0] in _EPILOGUE_OPS for st in spec.epilogue) and all(st[0] in _POST_OPS for st in spec.post))


def _forward_line(i: int, step) -> str:
    """x{i+1} = step(x{i}), with torch's arithmetic (what ``reference._apply_elementwise`` does)."""
    a, b = f"x{i}", f"x{i + 1}"
    op = step[0]
    if op == "mul":
        return f"{b} = {a} * {_lit(step[1])}"
    if op == "add":
        return f"{b} = {a} + {_lit(step[1])}"
    if op == "div":
        return f"{b} = tl.div_rn({a}, {_lit(step[1])})"
    if op == "relu":  # NaN stays NaN, as torch.relu / clamp_min / maximum give
        return f"{b} = tl.where({a} < 0.0, 0.0, {a})"
    if op == "neg":
        return f"{b} = -{a}"
    if op == "sigmoid":
        return f"{b} = tl.sigmoid({a})"
    if op == "round":
        return f"{b} = {_round_expr(a, step[1])}"
    raise AssertionError(step)


def _backward_line(i: int, step) -> str:
    """gx = d loss / d x{i} from gx = d loss / d x{i+1} (``backward._step_grad``'s rules)."""
    x, y = f"x{i}", f"x{i + 1}"
    op = step[0]
    if op == "mul":
        return f"gx = gx * {_lit(step[1])}"
    if op == "add":
        return "gx = gx"
    if op == "div":
        return f"gx = tl.div_rn(gx, {_lit(step[1])})"
    if op == "relu":
        spelling = step[1] if len(step) > 1 else "relu"
        if spelling == "clamp_min":
            return f"gx = tl.where({x} >= 0.0, gx, 0.0)"
        if spelling == "maximum":
            return f"gx = tl.where({x} > 0.0, gx, tl.where({x} == 0.0, gx * 0.5, 0.0))"
        return f"gx = tl.where({x} > 0.0, gx, 0.0)"
    if op == "neg":
        return "gx = -gx"
    if op == "sigmoid":
        return f"gx = gx * {y} * (1.0 - {y})"
    if op == "round":
        return f"gx = {_round_expr('gx', step[1])}"
    raise AssertionError(step)


_TEMPLATE = '''
import triton
import triton.language as tl



@triton.jit
def _round_bf16(x):
    # fp32 -> bf16 -> fp32 with round-to-nearest-even, on the bits (NaN stays NaN), as the
    # forward kernel rounds (it also works in the interpreter, which has no bf16 math)
    u = x.to(tl.uint32, bitcast=True)
    u = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
    return tl.where(x != x, x, u.to(tl.float32, bitcast=True))


@triton.jit
def _split3(x):
    # fp32 x = hi + mid + lo exactly, three values each exact in bf16
    hi = _round_bf16(x)
    r = x - hi
    mid = _round_bf16(r)
    return hi, mid, _round_bf16(r - mid)


@triton.jit
def _dot_split(a, b16, b, SPLIT: tl.constexpr, INTERP: tl.constexpr):
    # a [M, K] fp32 @ b [K, N]. SPLIT (b holds bf16 values, b16 in bf16): a = hi + mid + lo
    # exactly, three bf16 parts, so three tensor-core dots of exact products give an fp32
    # dot's accuracy (the forward kernel's split); the interpreter, which has no bf16 dot,
    # runs the same parts in fp32 dots. Otherwise one IEEE fp32 dot.
    if SPLIT:
        hi, mid, lo = _split3(a)
        if INTERP:
            out = tl.dot(hi, b, input_precision="ieee") + (tl.dot(mid, b, input_precision="ieee")
                                                          + tl.dot(lo, b, input_precision="ieee"))
        else:
            out = tl.dot(hi.to(tl.bfloat16), b16) + (tl.dot(mid.to(tl.bfloat16), b16)
                                                     + tl.dot(lo.to(tl.bfloat16), b16))
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@triton.jit
def _split_dot(a16, a, b, SPLIT: tl.constexpr, INTERP: tl.constexpr):
    # a [M, K] @ b [K, N] fp32, _dot_split with the split operand on the right (a holds bf16
    # values, a16 in bf16): the key contributions as [D, slots], so that the dot's M is the
    # head dim (a wgmma) rather than the slot block
    if SPLIT:
        hi, mid, lo = _split3(b)
        if INTERP:
            out = tl.dot(a, hi, input_precision="ieee") + (tl.dot(a, mid, input_precision="ieee")
                                                          + tl.dot(a, lo, input_precision="ieee"))
        else:
            out = tl.dot(a16, hi.to(tl.bfloat16)) + (tl.dot(a16, mid.to(tl.bfloat16))
                                                     + tl.dot(a16, lo.to(tl.bfloat16)))
    else:
        out = tl.dot(a, b, input_precision="ieee")
    return out


@triton.jit
def values_backward_kernel(Q, K, W, GY, IDX, DEST, GQ, GW, C, NS, N, G, D, HK,
                           sq_s, sq_h, sk_t, sk_h, sw_s, sg_s, si_s,
                           HAS_W: tl.constexpr, HAS_DEST: tl.constexpr, NEED_Q: tl.constexpr, NEED_K: tl.constexpr, NEED_W: tl.constexpr,
                           SPLIT: tl.constexpr, INTERP: tl.constexpr, TC16: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                           C_T: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mg = offs_g < G
    md = offs_d < D
    heads = hk * G + offs_g
    q16 = tl.load(Q + r * sq_s + heads[:, None] * sq_h + offs_d[None, :], mask=mg[:, None] & md[None, :], other=0.0)
    qd = q16.to(tl.float32)
    if HAS_W:
        w = tl.load(W + r * sw_s + heads, mask=mg, other=0.0).to(tl.float32)
    gq = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    gw = tl.zeros([BLOCK_G], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mn = offs_n < N
        key = tl.load(IDX + r * si_s + offs_n, mask=mn, other=0).to(tl.int64)
        k16 = tl.load(K + key[:, None] * sk_t + hk * sk_h + offs_d[None, :], mask=mn[:, None] & md[None, :],
                      other=0.0)
        kt = k16.to(tl.float32)  # [BLOCK_N, BLOCK_D]
        gy = tl.load(GY + r * sg_s + offs_n, mask=mn, other=0.0)
        if TC16:  # bf16 operands, compiled: exact products on the tensor cores, fp32 sums
            x0 = tl.dot(q16, tl.trans(k16))
        else:
            x0 = tl.dot(qd, tl.trans(kt), input_precision="ieee")  # [BLOCK_G, BLOCK_N] logits
{FORWARD}
        live = mg[:, None] & mn[None, :]
        if HAS_W:
            gw += tl.sum(tl.where(live, {LAST} * gy[None, :], 0.0), 1)
            gx = w[:, None] * gy[None, :]
        else:
            gx = tl.broadcast_to(gy[None, :], [BLOCK_G, BLOCK_N])
{BACKWARD}
        gx = tl.where(live, gx, 0.0)
        if NEED_Q:
            gq += _dot_split(gx, k16, kt, SPLIT, INTERP)
        if NEED_K:
            if HAS_DEST:  # slot (r, j)'s row at its key-sorted position: the key sum then streams
                pos = tl.load(DEST + r * N + offs_n, mask=mn, other=0).to(tl.int64)
            else:
                pos = r * N + offs_n
            if C_T:  # [BLOCK_D, BLOCK_N]
                c = _split_dot(tl.trans(q16), tl.trans(qd), gx, SPLIT, INTERP)
                dst = C + (hk * NS * N + pos)[None, :] * D + offs_d[:, None]
                tl.store(dst, c, mask=md[:, None] & mn[None, :])
            else:  # [BLOCK_N, BLOCK_D]
                c = _dot_split(tl.trans(gx), q16, qd, SPLIT, INTERP)
                dst = C + (hk * NS * N + pos)[:, None] * D + offs_d[None, :]
                tl.store(dst, c, mask=mn[:, None] & md[None, :])
    if NEED_Q:
        tl.store(GQ + (r * G * HK + heads)[:, None] * D + offs_d[None, :], gq, mask=mg[:, None] & md[None, :])
    if NEED_W:
        tl.store(GW + r * G * HK + heads, gw, mask=mg)
'''


def render_source(spec: ScoreSpec) -> str:
    steps = list(spec.epilogue)
    if spec.logit_dtype != "float32":
        steps = [("round", spec.logit_dtype)] + steps
    fwd = [_forward_line(i, st) for i, st in enumerate(steps)]
    bwd = [_backward_line(i, steps[i]) for i in reversed(range(len(steps)))]
    ind = lambda lines: "\n".join("        " + ln for ln in lines) or "        pass"  # noqa: E731
    return (_TEMPLATE.replace("{FORWARD}", ind(fwd)).replace("{BACKWARD}", ind(bwd))
            .replace("{LAST}", f"x{len(steps)}"))


def load_kernel(spec: ScoreSpec):
    return import_source(render_source(spec)).values_backward_kernel


@dataclasses.dataclass(frozen=True)
class ValuesBackwardConfig:
    """The row kernel's launch. q and gq are [BLOCK_G, BLOCK_D] tiles, each step a
    [BLOCK_G, block_n] one and a few [block_n, BLOCK_D] ones."""

    block_n: int = 64  # slots a step
    num_warps: int = 4
    num_stages: Optional[int] = None  # Triton's default
    # The key contributions as q^T gx ([D, slots]: the dot's M is D) instead of gx^T q (M =
    # block_n: at 32, below a wgmma's 64, so mma.sync). At 64 x 128 all seven dots are then
    # wgmma (sm_90 build: 247 registers, no spills, 49.5 KB shared against 252 and 57.7 KB).
    # The same parts and products; the dot instruction may round the fp32 sums differently.
    c_trans: bool = False


def default_config(G: int, D: int) -> ValuesBackwardConfig:
    """At G query heads per key head and head dim D: once q's tile is large (64 x 128 heads),
    8 warps, 32 slots a step, 2 stages and the q^T gx contributions (H200, S = 32K, k = 2,048,
    one call: 82.7 ms against 90.4 with mma.sync contributions and Triton's default stages;
    64 slots were faster, 76.8 ms, but spill 236 B in the sm_90 build: docs/performance.md).
    ``HYSCALE_VALUES_BWD_CONFIG`` ("block_n=64,num_stages=2,c_trans=1", ``config_text``
    syntax) overrides fields, for sweeps."""
    bg = max(16, triton.next_power_of_2(G))
    bd = max(16, triton.next_power_of_2(D))
    cfg = ValuesBackwardConfig(block_n=32, num_warps=8, num_stages=2, c_trans=True) if bg * bd >= 4096 \
        else ValuesBackwardConfig()
    text = os.environ.get("HYSCALE_VALUES_BWD_CONFIG", "")
    return dataclasses.replace(cfg, **parse_fields(text, ValuesBackwardConfig)) if text else cfg


def rows_backward_fused(gy, q, kb, w, keys, spec: ScoreSpec, needs, dest=None, _launcher=None):
    """The per-row part for one chunk: gy [ns, n] (d loss / d reduced score, fp32), q [ns, H, D],
    kb [T, Hk, D] (the batch's keys, any float dtype), w [ns, H] or None, keys [ns, n].
    ``dest`` [ns * n] (int32 or int64): where slot (s, j)'s contribution row goes (a permutation
    of the slots, ``attention_backward.key_runs``' key-sorted positions); default (s, j)'s own.
    -> (gq [ns, H, D] fp32 or None, contributions [Hk, ns * n, D] fp32 or None, gw [ns, H] or None)"""
    ns, H, D = q.shape
    Hk = kb.shape[1]
    G, n = H // Hk, keys.shape[1]
    dev = q.device
    q = q.contiguous() if q.stride(-1) != 1 else q
    kb = kb if kb.stride(-1) == 1 else kb.contiguous()
    gy, keys = gy.contiguous(), keys.contiguous()
    w = w.contiguous() if w is not None else None
    if dest is not None and (dest.numel() != ns * n or not dest.is_contiguous()):
        raise ValueError(f"dest must be a contiguous [{ns * n}] permutation of the slots, got {tuple(dest.shape)}")
    need_q, need_k, need_w = needs[0], needs[1], needs[2] and w is not None
    gq = torch.empty(ns, H, D, dtype=torch.float32, device=dev) if need_q else gy
    gw = torch.empty(ns, H, dtype=torch.float32, device=dev) if need_w else gy
    contrib = torch.empty(Hk, ns * n, D, dtype=torch.float32, device=dev) if need_k else gy
    bg = max(16, triton.next_power_of_2(G))
    bd = max(16, triton.next_power_of_2(D))
    cfg = default_config(G, D)
    split, interp = q.dtype == torch.bfloat16 and kb.dtype == torch.bfloat16, _interpreting()
    launch = dict(HAS_W=spec.reduce == "weighted_sum", HAS_DEST=dest is not None, NEED_Q=need_q, NEED_K=need_k,
                  NEED_W=need_w, SPLIT=split, INTERP=interp, TC16=split and not interp,
                  BLOCK_G=bg, BLOCK_D=bd, BLOCK_N=cfg.block_n, C_T=cfg.c_trans, num_warps=cfg.num_warps)
    if cfg.num_stages is not None:
        launch["num_stages"] = cfg.num_stages
    args = (q, kb, w if w is not None else gy, gy, keys, dest if dest is not None else keys, gq, gw, contrib,
            ns, n, G, D, Hk, q.stride(0), q.stride(1), kb.stride(0), kb.stride(1),
            w.stride(0) if w is not None else 0, gy.stride(0), keys.stride(0))
    kern = load_kernel(spec)
    if _launcher is not None:  # (benchmarks: compile for another target without launching)
        return _launcher(kern, args, launch)
    kern[(ns, Hk)](*args, **launch)
    return (gq if need_q else None, contrib if need_k else None, gw if need_w else None)


def post_backward(g, masks, spec: ScoreSpec, keys, b0, b1, s0, s1, B, S, T) -> torch.Tensor:
    """d loss / d reduced score from d loss / d values, through ``spec.post`` (steps whose
    derivatives do not read the score: ``supported``)."""
    from .backward import _mask_grad, _step_grad

    for st in reversed(spec.post):
        if st[0] == "mask":
            g = _mask_grad(g, spec.masks[st[1]], masks, b0, b1, s0, s1, keys, B, S, T)
        else:
            g = _step_grad(g, st, g, g)
    return g
