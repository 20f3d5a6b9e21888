"""The sparse attention's forward on Triton: each query row attends to its k selected keys.

``sparse_attention_triton(q, k, v, idx, masks, spec)`` has the semantics and outputs of
``attention_reference.attention_forward`` (``attention_spec``'s docstring gives the math).
It runs a kernel generated from the ``AttentionSpec``: the post steps (scale, registered
mods, roundings) and mask terms are inlined as straight-line Triton code, the rest is the
fixed template below, in the shape of Triton's fused-attention tutorial:

    for each program: one query row (b, s) and BLOCK_H heads of one kv head
        q tile [BLOCK_H, Dqk]                   (a block pointer; Dqk in two chunks)
        for each block of BLOCK_N slots:
            t = idx[b, s, slots]                 gathered key positions, any order
            y = post(q . k[b, t]^T)              [BLOCK_H, BLOCK_N], fp32 accumulation
            online softmax (running max, sum)    a slot at -inf contributes exactly 0
            acc += P . v[b, t]                   [BLOCK_H, Dv]
        out = acc / l (in spec.out_dtype), lse = m + log(l)

The two forms (``attention_spec.form_of``, a static rule on H and Hk) are one kernel with
different tilings: "mqa" (Hk == 1, the absorbed-MLA shape) puts up to 64 heads of a row in
the dot's M dimension, all sharing one gathered key tile; "per_head" gathers per kv head
and puts that head's G query heads (GQA; padded to 16 rows for the dot) in M. A Dqk that is
not a power of two runs as two chunks (576 = 512 + 64, 192 = 128 + 64; a short tail is
padded and masked); a value that is a view of the key (``k[..., :Dv]``, MQA over a latent)
is read from the key tile already loaded (``V_FROM_K``), never copied.

``probs`` (``return_probs``: sum over heads of P at each slot) needs each head's final
softmax statistics, so it is a second kernel over the slots, run after the first: it scores
the slots again (one more QK product) and sums exp(y - m) / l over the heads in a fixed
order, from the running max m and sum l the first kernel then also writes. (Not from the
saved lse = m + log(l): where every score is near ``finfo.min``, m + log(l) rounds to m in
fp32 and exp(y - lse) would be l times too large.)

Deterministic: no atomics; every program writes only its own outputs; the launch
configuration is a function of the shapes and dtypes (``default_config``, no autotuning),
so the bits are reproducible across processes on the same GPU and software.

Operands are the op's canonical views (strides are free). ``idx`` must hold positions in
[0, T) (a top-k's indices); nothing checks that on the device.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence

import torch

from .attention_reference import check_attention_operands
from .attention_spec import AttentionSpec, form_of
from .mask_kinds import mask_kinds, mask_launch_args
from .spec import SpecError, dtype_of
# Small, stable pieces of the selection kernel's code generation (docs/kernel.md): the
# elementwise step lines (registered score mods included), the interpreter mode checks, and
# the kernel cache's file writer.
from .triton_codegen import _elementwise_lines, _interpreting, _mod_bodies, check_interpreter_mode, import_source

TEMPLATE_VERSION = 4

_FN_CACHE: Dict[tuple, object] = {}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def split_head_dim(D: int) -> tuple:
    """(DA, DB): the power-of-two chunks the kernel covers a head dim of D with. DA is the
    largest power of two <= D (at least 16, tl.dot's minimum), DB the rest rounded up to a
    power of two (at least 16; 0 when DA covers D); padding columns are masked to 0."""
    da = max(16, 1 << (max(1, int(D)).bit_length() - 1))
    rest = D - da
    return da, (max(16, _next_pow2(rest)) if rest > 0 else 0)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters. ``default_config`` picks them from the shapes and dtypes alone (no
    autotuning, never by timing), so a shape always runs the same arithmetic in the same
    order. Only the order of fp32 additions depends on them (the online softmax's tiles, the
    dots' reductions)."""

    block_h: int  # query heads per program: the dots' M dimension (>= 16)
    block_n: int  # selected slots per tile (>= 16)
    num_warps: int = 4
    num_stages: int = 2
    probs_block_n: int = 0  # slots per tile of attn_probs (0: block_n); per-slot math, any tiling
    # Forward-loop options (default_config turns them on where they were measured faster):
    # the next tile's key positions loaded one iteration ahead (a loop-carried value), so the
    # gather's addresses do not come from a load in the same iteration: only then does Triton's
    # pipeliner give the key gather num_stages buffers (num_stages - 1 where the dots are not
    # wgmma) and keep tiles in flight at num_stages >= 3 (async_wait num > 0; without it, 3-4
    # stages add index buffers but the gather waits for each tile it issued at the start of
    # the next iteration; ``bench_sparse_attention.py --inspect`` reports it as inflight)
    prefetch_idx: bool = False
    # log2(e) folded into the last scale step (``log2_post``), exp2 in the loop: one multiply
    # per score less; ignored where the spec does not allow the fold (the loop then runs on
    # exp). On by default: H200, S = 32K, random picks, no probs: 74.0 against 81.0 ms at the
    # absorbed H = 128, 14.6 against 15.1 at H = 16 (docs/performance.md)
    exp2: bool = True
    # the score dot's result taken through a run-time branch that is always taken: Triton
    # then lays the score dot out as a lone dot (the slots split across the warpgroups)
    # instead of as a dot that feeds another (every warp on the heads: at 64 heads and 8
    # warps both warpgroups compute the whole [64, BLOCK_N] score tile); the softmax's row
    # reductions and P then cross the warpgroups through shared memory. Its sm_90 build at
    # H = 128 has no spills and needs 229.6 KiB of shared memory (without: 160 B spilled,
    # 221.4 KiB; ``bench_sparse_attention.py --inspect``); default_config turns it on there
    split_qk: bool = False


def reads_v_from_k(k: torch.Tensor, v: torch.Tensor) -> bool:
    """v's tile is the first block of k's (``V_FROM_K``): v = k[..., :Dv] with Dv the first
    block of ``split_head_dim(Dqk)`` (the latent's 512 of 576), so one gather serves both."""
    return (v.data_ptr() == k.data_ptr() and v.stride() == k.stride() and v.dtype == k.dtype
            and max(16, _next_pow2(v.shape[-1])) == split_head_dim(k.shape[-1])[0])


def default_config(H: int, Hk: int, Dqk: int, Dv: int, interpret: bool = False,
                   elem_bytes: int = 2, v_from_k: bool = True) -> AttentionConfig:
    """The fixed configuration of a shape and operand width (``elem_bytes``: 4 for fp32
    keys; ``v_from_k``: v is read from k's tile, as for a view of the latent); chosen so that
    the sm_90 build neither spills nor exceeds shared memory (``bench_sparse_attention.py
    --inspect``), not by timing."""
    G = H // Hk
    block_h = max(16, min(64, _next_pow2(G)))
    if interpret:
        return AttentionConfig(block_h=block_h, block_n=16, num_warps=4, num_stages=1)
    wide = max(Dqk, Dv) * elem_bytes > 512  # the absorbed latent (576 / 512 in bf16), or fp32: smaller tiles
    if elem_bytes > 2 and max(Dqk, Dv) > 256:
        # fp32 at the latent's widths: q and two key stages of [BLOCK_N, 576] fp32 would not
        # fit in shared memory with more heads or slots per tile
        return AttentionConfig(block_h=16, block_n=16, num_warps=4, num_stages=2)
    if form_of(H, Hk) == "mqa":
        # 64 slots per tile at the latent's widths too: 1.25x over 32 at H = 128 and 16 (H200,
        # S = 16K; docs/performance.md, "Sparse attention")
        # (attn_probs keeps 32: at 64 its sm_90 build spills)
        # (v its own tensor at the latent's widths and 64 heads per program: two stages of
        # [64, 576] keys and [64, 512] values need 352 KiB of shared memory; 32 slots fit)
        block_n = 32 if wide and not v_from_k and block_h >= 64 else 64
        # 64 heads of a row over a latent that is also the value: the score dot split across
        # the warpgroups and the next tile's key positions loaded ahead. H200, S = 32K, H = 128,
        # one call: 52.6 ms (47% of matmul) against 73.6 for neither, 58.5 for split_qk alone
        # (sm_90: no spills, 224 KiB). Not at H = 16 (its split_qk build spills)
        fast = wide and v_from_k and block_h >= 64
        return AttentionConfig(block_h=block_h, block_n=block_n, num_warps=8 if block_h >= 64 and wide else 4,
                               num_stages=2, probs_block_n=32 if wide else 0, prefetch_idx=fast, split_qk=fast)
    return AttentionConfig(block_h=block_h, block_n=32 if wide or elem_bytes > 2 else 64, num_warps=4, num_stages=2)


# ---------------------------------------------------------------------------------------
# spec -> Triton source
# ---------------------------------------------------------------------------------------
def _mask_params(spec: AttentionSpec) -> List[str]:
    """Names ``_post`` takes for the mask terms: a pointer and (b, s, t) strides per tensor
    term, the row's loaded bounds per range term (each kind's ``slot_params``)."""
    return [a for piece in mask_kinds(spec.masks) for a in piece.slot_params()]


def _mask_args_def(spec: AttentionSpec) -> List[str]:
    """Kernel arguments for the mask terms: tensors as in ``_mask_params``, range bounds as
    a pointer and (b, s) strides each."""
    return [a for piece in mask_kinds(spec.masks) for a in piece.args()]


def _render_row_bounds(spec: AttentionSpec) -> List[str]:
    """The row's range bounds, loaded once per program (int64 scalars)."""
    return [ln for piece in mask_kinds(spec.masks) for ln in piece.slot_row_loads()]


LOG2E = 1.4426950408889634


def _hides_with_neg_inf(term) -> bool:
    """A mask term whose only effect is -inf at hidden keys: it commutes with a positive scale
    of the scores (a table of additive values, or a finite fill such as finfo.min, does not)."""
    return term.kind in ("range", "fill") and term.value == float("-inf")


def log2_post(spec: AttentionSpec):
    """The post steps with log2(e) folded into the last scale step ("mul" / "div"), so the
    forward's softmax runs on exp2 without a multiply per score; None where that is not
    exact up to rounding: no scale step, a step after it other than a -inf-only mask term,
    or an additive / finite mask term anywhere (scaled by log2(e) > 1, a value near
    finfo.min would overflow to -inf, and a row of them would no longer be a mean). A
    scaled score beyond finfo.max / log2(e) (about 2.4e38) would also overflow (docs/contract.md,
    "The selection's consumers", Numerics); ``AttentionConfig(exp2=False)`` runs the loop on exp."""
    scales = [i for i, st in enumerate(spec.post) if st[0] in ("mul", "div")]
    if not scales:
        return None
    last = scales[-1]
    if not all(_hides_with_neg_inf(t) for t in spec.masks):
        return None
    if any(st[0] != "mask" for st in spec.post[last + 1:]):
        return None
    op, c = spec.post[last][0], float(spec.post[last][1])
    if not math.isfinite(c) or c == 0:
        return None
    folded = ("mul", c * LOG2E) if op == "mul" else ("div", c / LOG2E)
    return spec.post[:last] + (folded,) + spec.post[last + 1:]


def _render_post(spec: AttentionSpec, post=None) -> List[str]:
    """The post steps on y [BLOCK_H, BLOCK_N] (heads x slots) at the slots' keys t [BLOCK_N]
    (``post``: these steps instead of the spec's, e.g. ``log2_post``)."""
    lines = []
    pieces = mask_kinds(spec.masks)
    for step in (spec.post if post is None else post):
        if step[0] != "mask":
            lines += _elementwise_lines("y", step)
            continue
        lines += pieces[step[1]].slot_lines(keys="t", ok="slot_ok")
    return lines


def _indent(lines: Sequence[str], n: int) -> str:
    return "\n".join(" " * n + ln for ln in lines)


def render_kernel_source(spec: AttentionSpec, num_masks: int) -> str:
    """Python source of the two ``@triton.jit`` kernels (``attn_fwd``, ``attn_probs``)
    specialized to ``spec``; it depends only on the arguments and the interpreter mode."""
    spec.validate(num_mask_operands=num_masks)
    params = _mask_params(spec)
    interp = _interpreting()
    subs = {
        "VERSION": str(TEMPLATE_VERSION),
        "SPEC_JSON": spec.to_json(),
        "DESCRIBE": spec.describe(),
        # registered score mods call libdevice (tanh, log1p, ...); the interpreter has none
        "LIBDEVICE": "" if interp else "from triton.language.extra import libdevice  # noqa: F401\n",
        "PRECISION": "tf32" if spec.fp32_precision == "tf32" else "ieee",
        "POST": _indent(_render_post(spec), 4) or "    pass",
        "POST_LOG2": _indent(_render_post(spec, log2_post(spec) or spec.post), 4) or "    pass",
        "MASK_PARAMS": "".join(f"{a}, " for a in params),
        "MASK_ARGS_DEF": "".join(f"    {a},\n" for a in _mask_args_def(spec)),
        "ROW_BOUNDS": _indent(_render_row_bounds(spec), 4) or "    pass",
        # empty_row="zero": a head with no visible slot gives 0 (its lse stays -inf)
        "EMPTY_ROW_OUT": '    out = tl.where((l_i == 0.0)[:, None], 0.0, out)' if spec.empty_row == "zero" else "",
        "EMPTY_ROW_PROBS": '                p = tl.where((l == 0.0)[:, None], 0.0, p)' if spec.empty_row == "zero" else "",
    }
    src = _TEMPLATE
    for key, val in subs.items():
        src = src.replace("{{" + key + "}}", val)
    assert "{{" not in src, "unfilled template slot"
    return src


def load_kernels(spec: AttentionSpec, num_masks: int):
    """(attn_fwd, attn_probs) for ``spec``, imported from a file in the kernel cache (triton.jit
    reads a function's source with ``inspect``); cached per (spec, mods, interpreter mode)."""
    interp = _interpreting()
    key = (spec.to_json(), num_masks, interp, _mod_bodies(spec.as_score_spec()))
    fns = _FN_CACHE.get(key)
    if fns is not None:
        return fns
    mod = import_source(render_kernel_source(spec, num_masks))
    fns = _FN_CACHE[key] = (mod.attn_fwd, mod.attn_probs)
    return fns


# ---------------------------------------------------------------------------------------
# launch
# ---------------------------------------------------------------------------------------
def _mask_launch_args(spec: AttentionSpec, masks: Sequence[torch.Tensor], B: int, S: int, T: int, device) -> list:
    """Pointer/stride arguments in ``_mask_args_def``'s order: broadcast views, never copies
    (the kernel adds fp32, bf16 or fp16 masks)."""
    return mask_launch_args(spec.masks, masks, B, S, T, device, float_adds=True)


def sparse_attention_triton(q, k, v, idx, masks: Sequence[torch.Tensor], spec: AttentionSpec,
                            return_probs: bool = False, config: Optional[AttentionConfig] = None,
                            _launcher=None):
    """(out [B,S,H,Dv] in ``spec.out_dtype``, lse [B,S,H] fp32, probs [B,S,k] fp32 or an
    empty tensor), as ``attention_reference.attention_forward``. CUDA tensors, or CPU tensors
    under ``TRITON_INTERPRET=1``. ``_launcher(kernel, args, launch)`` replaces the launch
    (benchmarks/tests compile offline with it)."""
    masks = list(masks)
    spec = spec.resolve_operands(masks)
    if spec.empty_row == "dense":  # the kernel's rows, then the flagged ones recomputed in PyTorch
        from .attention_backward import sparse_part
        from .attention_reference import dense_rows_forward

        res = sparse_attention_triton(q, k, v, idx, masks, sparse_part(spec), return_probs, config, _launcher)
        return res if _launcher is not None else dense_rows_forward(q, k, v, idx, masks, spec, *res, return_probs)
    interp = check_interpreter_mode()
    check_attention_operands(q, k, v, idx, masks, spec)
    device = q.device
    if device.type != "cuda" and not interp and _launcher is None:
        raise SpecError(f"the Triton sparse attention needs CUDA tensors (got {device}), or TRITON_INTERPRET=1")
    for name, t in (("k", k), ("v", v), ("idx", idx)):
        if t.device != device:
            raise SpecError(f"{name} is on {t.device}, q on {device}")
    B, S, H, Dqk = q.shape
    T, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
    K = idx.shape[-1]
    G = H // Hk
    form_of(H, Hk)  # raises for H % Hk != 0
    da, db = split_head_dim(Dqk)
    block_dv = max(16, _next_pow2(Dv))
    v_from_k = reads_v_from_k(k, v)
    cfg = config or default_config(H, Hk, Dqk, Dv, interpret=interp, elem_bytes=max(k.element_size(), v.element_size()),
                                   v_from_k=v_from_k)
    if config is None and return_probs and cfg.probs_block_n:
        # with its softmax statistics written (WRITE_STATS) the forward at 64 slots per tile
        # needs more shared memory than an H200 has (352 KiB at H = 128): the probs path keeps
        # the tile it was verified with
        cfg = dataclasses.replace(cfg, block_n=cfg.probs_block_n, split_qk=False, prefetch_idx=False)
    if cfg.block_h < 16 or cfg.block_n < 16 or cfg.block_h & (cfg.block_h - 1) or cfg.block_n & (cfg.block_n - 1):
        raise SpecError(f"{cfg}: block_h and block_n must be powers of two >= 16 (tl.dot)")
    # the interpreter has no bf16 dot; mixed q/k dtypes meet in fp32
    upcast = q.dtype != k.dtype or (interp and torch.bfloat16 in (q.dtype, k.dtype, v.dtype))
    out = torch.empty((B, S, H, Dv), dtype=dtype_of(spec.out_dtype), device=device)
    lse = torch.empty((B, S, H), dtype=torch.float32, device=device)
    probs = torch.empty((B, S, K) if return_probs else (0,), dtype=torch.float32, device=device)
    if B * S * H == 0:
        return out, lse, probs
    fwd, probs_kernel = load_kernels(spec, len(masks))
    mask_args = _mask_launch_args(spec, masks, B, S, T, device)
    consts = dict(BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, DA=da, DB=db, UPCAST=upcast)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    # attn_probs stays at 2 stages or fewer: at 3-4 its sm_90 build needs more shared memory
    # than an H200 has at H = 128 (256-328 KiB at 32 slots per tile)
    plaunch = dict(launch, num_stages=min(cfg.num_stages, 2))
    # the softmax statistics attn_probs reads (lse's layout), only when probs are asked for
    stat_m, stat_l = (torch.empty_like(lse), torch.empty_like(lse)) if return_probs and K > 0 else (lse, lse)
    args = [q, k, v, idx, out, lse, stat_m, stat_l, *mask_args, *q.stride(), *k.stride(), *v.stride(), *idx.stride(),
            *out.stride(), *lse.stride(), S, G, Hk, K, Dqk, Dv]
    grid = (B * S * Hk * -(-G // cfg.block_h),)
    exp2 = cfg.exp2 and log2_post(spec) is not None
    fwd_launch = dict(consts, BLOCK_DV=block_dv, V_FROM_K=v_from_k, WRITE_STATS=return_probs and K > 0,
                      PREFETCH_IDX=cfg.prefetch_idx, EXP2=exp2, SPLIT_QK=cfg.split_qk, **launch)
    pconsts = dict(consts, BLOCK_N=cfg.probs_block_n or cfg.block_n, EXP2=exp2)
    pargs = [q, k, idx, stat_m, stat_l, probs, *mask_args, *q.stride(), *k.stride(), *idx.stride(), *lse.stride(),
             *probs.stride(), S, G, Hk, K, Dqk]
    if _launcher is not None:  # the forward's result, and with return_probs also the probs kernel's
        first = _launcher(fwd, args, fwd_launch)
        return (first, _launcher(probs_kernel, pargs, dict(pconsts, **plaunch))) if return_probs else first
    fwd[grid](*args, **fwd_launch)
    if return_probs and K > 0:
        probs_kernel[(B * S,)](*pargs, **pconsts, **plaunch)
    return out, lse, probs


# ---------------------------------------------------------------------------------------
# the template
# ---------------------------------------------------------------------------------------
# Slots are {{NAME}}; everything else is literal Triton code. Notation: a program owns one
# query row (b, s) and the BLOCK_H heads g0 .. g0 + BLOCK_H of kv head hk's G query heads;
# BLOCK_N slots per tile; the head dim as chunks DA (+ DB), the value dim padded to BLOCK_DV.
_TEMPLATE = r'''# Generated by hyscale_compile.lowerings.triton_attention (template v{{VERSION}}). Do not edit.
# spec: {{SPEC_JSON}}
# attention: {{DESCRIBE}}
import triton
import triton.language as tl
{{LIBDEVICE}}

@triton.jit
def _round_bf16(x):
    # fp32 -> bf16 -> fp32 with round-to-nearest-even, on the bits (NaN stays NaN); the
    # elementwise "round" step's helper, which also works in the interpreter
    u = x.to(tl.uint32, bitcast=True)
    u = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
    return tl.where(x != x, x, u.to(tl.float32, bitcast=True))


@triton.jit
def _post(y, t, slot_ok, b, s, {{MASK_PARAMS}}):
    # the spec's post steps on the logits y [BLOCK_H, BLOCK_N] (heads x slots) at the slots'
    # keys t [BLOCK_N] (int64) of row (b, s); the mask terms broadcast over the heads
{{POST}}
    return y


@triton.jit
def _post_log2(y, t, slot_ok, b, s, {{MASK_PARAMS}}):
    # the same steps with log2(e) folded into the last scale (log2_post): y * log2(e)
{{POST_LOG2}}
    return y


@triton.jit
def _load_q(Q, b, s, hk, g0, G, DQK, stride_qb, stride_qs, stride_qh, stride_qd,
            BLOCK_H: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, UPCAST: tl.constexpr):
    # The program's query heads as [BLOCK_H, DA] (and [BLOCK_H, DB]): block pointers over kv
    # head hk's G heads, so padding heads and columns load as 0.
    base = Q + b * stride_qb + s * stride_qs + (hk * G) * stride_qh
    qa = tl.load(tl.make_block_ptr(base, (G, DQK), (stride_qh, stride_qd), (g0, 0), (BLOCK_H, DA), (1, 0)),
                 boundary_check=(0, 1), padding_option="zero")
    if DB > 0:
        qb = tl.load(tl.make_block_ptr(base, (G, DQK), (stride_qh, stride_qd), (g0, DA), (BLOCK_H, DB), (1, 0)),
                     boundary_check=(0, 1), padding_option="zero")
    else:
        qb = qa  # (unused)
    if UPCAST:
        qa = qa.to(tl.float32)
        qb = qb.to(tl.float32)
    return qa, qb


@triton.jit
def _scores(qa, qb, kbase, t, slot_ok, b, s, DQK, stride_kt, stride_kd, {{MASK_PARAMS}}
            BLOCK_N: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, UPCAST: tl.constexpr,
            LOG2: tl.constexpr, SPLIT: tl.constexpr):
    # y [BLOCK_H, BLOCK_N]: the scores of the gathered keys (fp32 accumulation, post steps
    # applied, in log2 units with LOG2; -inf at padding slots); and the keys' first chunk ka
    # [BLOCK_N, DA], which is the value tile when v is a view of k
    rows = kbase + t[:, None] * stride_kt
    offs_a = tl.arange(0, DA)
    ka = tl.load(rows + offs_a[None, :] * stride_kd, mask=slot_ok[:, None] & (offs_a < DQK)[None, :], other=0.0)
    if UPCAST:
        ka = ka.to(tl.float32)
    x = tl.dot(qa, tl.trans(ka), input_precision="{{PRECISION}}", out_dtype=tl.float32)
    if DB > 0:
        offs_b = DA + tl.arange(0, DB)
        kb = tl.load(rows + offs_b[None, :] * stride_kd, mask=slot_ok[:, None] & (offs_b < DQK)[None, :], other=0.0)
        if UPCAST:
            kb = kb.to(tl.float32)
        if SPLIT:
            # a dot accumulating onto another's result is a chain too: two dots and a sum
            # (x - (0 - xb), which Triton does not fold back into the dot's accumulator)
            xb = tl.dot(qb, tl.trans(kb), input_precision="{{PRECISION}}", out_dtype=tl.float32)
            x = x - (0.0 - xb)
        else:
            x = tl.dot(qb, tl.trans(kb), acc=x, input_precision="{{PRECISION}}", out_dtype=tl.float32)
    if LOG2:
        y = _post_log2(x, t, slot_ok, b, s, {{MASK_PARAMS}})
    else:
        y = _post(x, t, slot_ok, b, s, {{MASK_PARAMS}})
    return tl.where(slot_ok[None, :], y, float("-inf")), ka


@triton.jit
def attn_fwd(
    Q, K, V, IDX, OUT, LSE, STAT_M, STAT_L,
{{MASK_ARGS_DEF}}    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ib, stride_is, stride_ij,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_ls, stride_lh,
    S, G, HK, TOPK, DQK, DV,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    BLOCK_DV: tl.constexpr, V_FROM_K: tl.constexpr, UPCAST: tl.constexpr, WRITE_STATS: tl.constexpr,
    PREFETCH_IDX: tl.constexpr, EXP2: tl.constexpr, SPLIT_QK: tl.constexpr,
):
    # a row's head blocks are consecutive programs (they gather the same key positions, so
    # they run together and share the lines in L2); a 1-d grid, as B x S exceeds grid dim 1
    nblk = tl.cdiv(G, BLOCK_H)
    pid = tl.program_id(0).to(tl.int64)
    row = pid // (HK * nblk)
    b = row // S
    s = row % S
    hk = (pid % (HK * nblk)) // nblk
    g0 = ((pid % nblk) * BLOCK_H).to(tl.int32)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
{{ROW_BOUNDS}}
    qa, qb = _load_q(Q, b, s, hk, g0, G, DQK, stride_qb, stride_qs, stride_qh, stride_qd, BLOCK_H, DA, DB, UPCAST)
    kbase = K + b * stride_kb + hk * stride_kh
    vbase = V + b * stride_vb + hk * stride_vh
    ibase = IDX + b * stride_ib + s * stride_is
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    if PREFETCH_IDX:
        # the first tile's key positions; each iteration then loads the next tile's, so the
        # gather's addresses are known an iteration before it is issued
        t_next = tl.load(ibase + offs_n * stride_ij, mask=offs_n < TOPK, other=0).to(tl.int64)
    for n0 in range(0, TOPK, BLOCK_N):
        slots = n0 + offs_n
        slot_ok = slots < TOPK
        if PREFETCH_IDX:
            t = t_next
            t_next = tl.load(ibase + (slots + BLOCK_N) * stride_ij, mask=slots + BLOCK_N < TOPK, other=0).to(tl.int64)
        else:
            t = tl.load(ibase + slots * stride_ij, mask=slot_ok, other=0).to(tl.int64)
        y, ka = _scores(qa, qb, kbase, t, slot_ok, b, s, DQK, stride_kt, stride_kd, {{MASK_PARAMS}}
                        BLOCK_N, DA, DB, UPCAST, EXP2, SPLIT_QK)
        # online softmax; a head whose slots are all -inf so far keeps m = -inf and takes
        # exp(y - 0) = 0 for them (no -inf - -inf). With EXP2, y and m are in log2 units.
        m_new = tl.maximum(m_i, tl.max(y, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        if EXP2:
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(y - m_use[:, None])
        else:
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(y - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_FROM_K:
            vt = ka  # v is a view of k's first columns: the tile already on chip
        else:
            vt = tl.load(vbase + t[:, None] * stride_vt + offs_dv[None, :] * stride_vd,
                         mask=slot_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
            if UPCAST:
                vt = vt.to(tl.float32)
        if SPLIT_QK:
            # DQK >= 1 always: the branch only ends the score dot's forward slice (P and
            # alpha reach the value dot through it)
            if DQK > 0:
                pv = p.to(vt.dtype)
                acc = acc * alpha[:, None]
            else:  # (never taken; P, not a constant tile, which would take shared memory of its own)
                pv = p.to(vt.dtype)
        else:
            pv = p.to(vt.dtype)
            acc = acc * alpha[:, None]
        acc = tl.dot(pv, vt, acc=acc, input_precision="{{PRECISION}}", out_dtype=tl.float32)
        m_i = m_new
    # a head with no visible slot: l = 0, so out = 0 / 0 = NaN and lse = -inf, as the reference
    out = acc / l_i[:, None]
{{EMPTY_ROW_OUT}}
    obase = OUT + b * stride_ob + s * stride_os + (hk * G) * stride_oh
    tl.store(tl.make_block_ptr(obase, (G, DV), (stride_oh, stride_od), (g0, 0), (BLOCK_H, BLOCK_DV), (1, 0)),
             out.to(OUT.dtype.element_ty), boundary_check=(0, 1))
    stat = b * stride_lb + s * stride_ls + (hk * G + g0 + offs_h) * stride_lh
    if WRITE_STATS:  # for attn_probs (STAT_M, STAT_L share LSE's layout), m in the loop's units:
        # l was summed against this m, and m converted back would be off by eps |m| (so would p)
        tl.store(STAT_M + stat, tl.where(m_i == float("-inf"), 0.0, m_i), mask=g0 + offs_h < G)
        tl.store(STAT_L + stat, l_i, mask=g0 + offs_h < G)
    if EXP2:
        m_i = m_i * 0.6931471805599453  # back to natural log: lse is in e units
    lse = m_i + tl.log(l_i)
    tl.store(LSE + stat, lse, mask=g0 + offs_h < G)


@triton.jit
def attn_probs(
    Q, K, IDX, STAT_M, STAT_L, PROBS,
{{MASK_ARGS_DEF}}    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_ib, stride_is, stride_ij,
    stride_lb, stride_ls, stride_lh,
    stride_pb, stride_ps, stride_pj,
    S, G, HK, TOPK, DQK,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, UPCAST: tl.constexpr,
    EXP2: tl.constexpr,
):
    # probs[b, s, j] = sum_h exp(y[h, j] - m[h]) / l[h] for one row per program, from attn_fwd's
    # statistics: the slots scored again (in the forward's units: log2 with EXP2), the heads
    # summed in a fixed order (kv head, then block)
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    s = row % S
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
{{ROW_BOUNDS}}
    ibase = IDX + b * stride_ib + s * stride_is
    for n0 in range(0, TOPK, BLOCK_N):
        slots = n0 + offs_n
        slot_ok = slots < TOPK
        t = tl.load(ibase + slots * stride_ij, mask=slot_ok, other=0).to(tl.int64)
        tot = tl.zeros([BLOCK_N], dtype=tl.float32)
        for hk in range(0, HK):
            hk64 = b * 0 + hk  # int64 offsets (b is int64; the loop variable is not)
            kbase = K + b * stride_kb + hk64 * stride_kh
            for g0 in range(0, G, BLOCK_H):
                qa, qb = _load_q(Q, b, s, hk64, g0, G, DQK, stride_qb, stride_qs, stride_qh, stride_qd,
                                 BLOCK_H, DA, DB, UPCAST)
                y, ka = _scores(qa, qb, kbase, t, slot_ok, b, s, DQK, stride_kt, stride_kd, {{MASK_PARAMS}}
                                BLOCK_N, DA, DB, UPCAST, EXP2, False)
                h_ok = g0 + offs_h < G
                stat = b * stride_lb + s * stride_ls + (hk64 * G + g0 + offs_h) * stride_lh
                m = tl.load(STAT_M + stat, mask=h_ok, other=0.0)
                l = tl.load(STAT_L + stat, mask=h_ok, other=1.0)
                # 0 / 0 = NaN for a head with no visible slot
                if EXP2:
                    p = tl.exp2(y - m[:, None]) / l[:, None]
                else:
                    p = tl.exp(y - m[:, None]) / l[:, None]
{{EMPTY_ROW_PROBS}}
                tot += tl.sum(tl.where(h_ok[:, None], p, 0.0), axis=0)
        tl.store(PROBS + b * stride_pb + s * stride_ps + slots * stride_pj, tot, mask=slot_ok)
'''
