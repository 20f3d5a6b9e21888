"""The sparse attention's backward on Triton: dQ, and dK / dV reduced per key without atomics.

``attention_backward_triton(grad_out, q, k, v, idx, masks, delta, lse, spec)`` gives what
``attention_backward.attention_backward`` gives (its docstring has the math), from two
generated kernels and the key-major segment sum, per chunk of query rows:

1. ``attn_bwd_rows``, one program per query row (b, s) and BLOCK_H heads of one kv head
   (MQA: up to 64 of the row's heads are the dots' M dimension over one gathered key tile;
   per head / GQA: the kv head's G heads, padded to 16), the forward's tiling (dQ' here, or
   at the latent's widths by ``attn_bwd_dq`` from the stored dS', a GEMM over the slots
   with the keys gathered again: ``default_config``):
       delta = sum_d dO * O (fp32, the operand: ``attention_delta``); fp32 operands: sum_j P' dP / sum_j P'
       for each block of BLOCK_N slots:
           y  = post(q . k[t]^T)        the forward's generated ``_post`` (masks identical)
           P' = exp(y - lse)            0 for a head with lse = -inf (no visible slot)
           dP = dO . v[t]^T;  dS' = P' (dP - delta), then the post steps' derivatives
           dQ' += dS' . k[t];           P', dS' stored to the chunk's [n, H, K] buffers
       l = sum_j P';  dQ = dQ' / l     (stored once), 1 / l stored per head
   Launch options (``BackwardConfig``, for benchmarks): dO straight to the dP dot's shared
   operand (``do_smem``), the keys gathered to registers a tile ahead (``prefetch_keys``),
   the scores' dots in the other order (``db_first``), or the scores and dP as loops over
   feature chunks of q, dO and the keys, none resident (``inner_k``: BLOCK_H = 128 fits).
   ``P' / l`` is the softmax renormalized over the slots, exactly as the forward's e / sum e:
   where a finite fill hides every slot (y = finfo.min), fp32 lse = m + log(l) rounds log(l)
   away and exp(y - lse) is 1 per slot; the correction is a per-head factor, so it applies
   after the loop (to dQ) and in kernel 2 (to P', dS'). delta from O rather than from the
   P . dP sum: that would need every slot's dP before the first dS, a second pass over the
   keys (the FlashAttention kernels use sum dO * O for the same reason); O is the op's output
   in ``out_dtype``, so delta carries its rounding. The caller computes it
   (``attention_delta``, or the pass's graph ops): the op never reads O, which a compiled
   backward frees before the op's buffers exist. With fp32 operands and IEEE dots
   (``EXACT_DELTA``) the kernel makes that pass (``_bwd_delta``: the keys' and values'
   gathers and two of the loop's three dots again, no stores): O comes from the forward's P,
   whose low bits differ from P' (another dot order, exp(y - lse) against the forward's
   shift), and dS = P' (dP - delta) with such a delta errs by P' * sum_j (P_j - P'_j) dP_j,
   over fp32's numerics rule on some inputs (gk 4.94e-7 where 4.87e-7 is allowed); with
   16-bit operands (P and dS rounded to them) or TF32 dots that term is far below their eps,
   and those builds are the one-pass kernel unchanged.
2. ``attn_bwd_keys``, one program per (row, kv head, BLOCK_N slots, BLOCK_F features): the
   per-slot key-side contributions as a GEMM over the kv head's G query heads,
       C_k[slot] = sum_h dS[h, slot] q[h]     C_v[slot] = sum_h P[h, slot] dO[h]
   written to a [Hk, n, K, F] fp32 chunk buffer (or, ``atomic=True``, added straight into
   dK / dV with fp32 ``tl.atomic_add``: the opt-in variant, not bitwise reproducible).
   Where v is a view of k (the latent) and the caller folds (``fold_v``), one launch gives
   C_k + C_v (the values' part added onto the keys' in the same fp32 accumulator at the
   first Dv features): one [Hk, n, K, D] buffer, not D + Dv wide. Where a chunk's
   contributions would pass ``DEFAULT_KEYS_BYTES`` (3.8 GiB at the HF V3.2 latent, H = 16:
   864 rows x 2048 slots x 576 fp32), kernel 2 and the segment sum run in passes over
   feature slices of whole feature blocks (``keys_feature_width``), through one buffer of
   the slice's width: the same tiles, the same bits. The programs of one
   (row, slot block) run next to each other (``f_first``), so the weight tile the feature
   blocks share is read from memory once.
3. ``attention_backward``'s segment sum: each key's contributions added in (row, slot) order
   onto its running fp32 value, one program per key; chunks run in row order, so the sums
   are the same whatever the chunking (a test checks it). Folded: one sum, not two.

Deterministic: no atomics (default), every program writes its own outputs, configurations
are functions of the shapes and dtypes (``default_config``). The dots take the operands'
16-bit dtype (P and dS rounded to it, as FlashAttention does) with fp32 accumulation; fp32
operands stay fp32 (``spec.fp32_precision``). Post steps with a derivative here: mul, add,
div, neg, roundings (HF's bf16 eager scores) and every mask term; a spec with another step
(relu, sigmoid, registered mods) runs the PyTorch path (``unsupported``; explain says so).

The op's CUDA path runs this; ``HYSCALE_ATTN_BWD=pytorch`` runs the chunked PyTorch path
instead (A/B), ``=atomic`` the atomic variant (``attention_backward.backward_mode``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, Optional, Sequence

import torch

from .attention_spec import AttentionSpec
from .config_text import parse_fields
from .mask_kinds import kind_of
from .spec import SpecError
from .triton_attention import (_indent, _mask_args_def, _mask_launch_args, _mask_params, _next_pow2,
                               _render_row_bounds, check_attention_operands, form_of, reads_v_from_k,
                               render_kernel_source, split_head_dim)
from .triton_codegen import _interpreting, _lit, _mod_bodies, _round_expr, check_interpreter_mode, import_source

BWD_TEMPLATE_VERSION = 1

_FN_CACHE: Dict[tuple, object] = {}
_LINEAR_STEPS = ("mul", "add", "div", "neg")
SMEM_BYTES = 227 * 1024  # the most shared memory a block may use on an H100 / H200


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Launch parameters of the two kernels; ``default_config`` picks them from the shapes
    and dtypes alone, so a shape always runs the same arithmetic in the same order."""

    block_h: int  # kernel 1: query heads per program (the dots' M, >= 16)
    block_n: int  # kernel 1: slots per tile
    num_warps: int
    num_stages: int
    keys_block_g: int  # kernel 2: heads per step of the reduction (>= 16)
    keys_block_n: int  # kernel 2: slots per program
    keys_block_f: int  # kernel 2: features per program
    keys_num_warps: int = 4
    keys_num_stages: int = 2
    # dQ in kernel 1 (its accumulator in registers for the whole slot loop), or by
    # ``attn_bwd_dq`` from the stored dS (the latent's [64, 576] fp32 accumulator next to the
    # resident q and dO tiles would spill)
    fused_dq: bool = True
    dq_block_n: int = 64  # attn_bwd_dq: slots per step
    dq_block_f: int = 64  # attn_bwd_dq: features per program
    # attn_bwd_keys / attn_bwd_dq: the programs of one weight tile (a row's [G, slots] dS' and
    # P', read by every feature block) launched next to each other, so the feature blocks
    # after the first read it from L2; else feature-block-major (each block streams the
    # chunk's whole [n, H, K] buffers again from memory). The same arithmetic either way
    f_first: bool = True
    # the segment sum: one program per run of a key (``run_starts``), not per sorted position
    runs_grid: bool = True
    # kernel 1: each tile's key indices loaded one iteration ahead (a loop-carried value), so
    # the gather's addresses do not wait on a load issued in the same iteration
    prefetch_idx: bool = False
    # kernel 1 (16-bit operands): dO loaded straight to the dP dot's shared-memory operand,
    # not masked and converted in registers first (a register operand is read back from
    # shared memory every tile; at 4 warps it spills). A dead head's dO may then be NaN: its
    # P' is 0, and dS' = 0 where P' is 0, so nothing of it is stored
    do_smem: bool = False
    # kernel 1: each tile's keys gathered to registers one iteration ahead (the indices two
    # ahead), for num_stages = 1: the gather's latency then overlaps the tile before's dots
    prefetch_keys: bool = False
    # kernel 1: the scores' DB-wide dot first, the DA-wide one accumulating onto it
    # (``_bwd_scores_of``): at 8 warps the large dot then splits its slots between the
    # warpgroups; another order of the fp32 sum, so other low bits than the default's
    db_first: bool = False
    # kernel 1: the scores and dP of a slot tile as loops over ``block_d``-wide feature
    # chunks of q, dO and the gathered keys (``_bwd_scores_dp_chunked``), none resident: a
    # pipelined GEMM in little shared memory, so BLOCK_H = 128 fits (each warpgroup its own
    # 64 heads, the row's keys gathered once). Where v is a view of k, 16-bit operands, dQ
    # apart (``fused_dq`` off)
    inner_k: bool = False
    block_d: int = 64


def smem_estimate(cfg: BackwardConfig, Dqk: int, Dv: int, elem_bytes: int) -> tuple:
    """Shared-memory bytes (kernel 1, kernel 2) the configuration asks for, counted as the
    dots' operand tiles: kernel 1 keeps q [BLOCK_H, DA + DB] and dO [BLOCK_H, Dv] on chip for
    the whole slot loop and stages each gathered key tile [BLOCK_N, DA + DB] (and a separate
    value tile unless v is a view of k, counted here) num_stages deep, plus the [BLOCK_H,
    BLOCK_N] dS operand; kernel 2 stages a [BLOCK_G, BLOCK_N] weight tile and a [BLOCK_G,
    BLOCK_F] operand tile. With ``inner_k`` kernel 1 holds no q or dO: it stages [BLOCK_H,
    BLOCK_D] chunks of both and a [BLOCK_N, BLOCK_D] key chunk, num_stages deep (the sm_90
    builds at 128 and 64 heads report exactly those stages: 122,880 and 98,304 bytes)."""
    da, db = split_head_dim(Dqk)
    dv = max(16, _next_pow2(Dv))
    if cfg.inner_k:
        k1 = elem_bytes * (cfg.num_stages * cfg.block_d * (2 * cfg.block_h + cfg.block_n) + cfg.block_h * cfg.block_n)
    else:
        k1 = elem_bytes * (cfg.block_h * (da + db) + cfg.block_h * dv + cfg.num_stages * cfg.block_n * (da + db)
                           + cfg.block_h * cfg.block_n)
    k2 = elem_bytes * cfg.keys_num_stages * (cfg.keys_block_g * cfg.keys_block_n + cfg.keys_block_g * cfg.keys_block_f)
    return k1, k2


def default_config(H: int, Hk: int, Dqk: int, Dv: int, interpret: bool = False,
                   elem_bytes: int = 2, v_from_k: bool = True, same_dtype: bool = True) -> BackwardConfig:
    """The fixed configuration of a shape and operand width (``HYSCALE_ATTN_BWD_CONFIG``,
    e.g. "num_warps=8,block_n=16", overrides fields: benchmarks only).

    Shared memory (sm_90, 227 KiB per block; ``smem_estimate``), at the absorbed MQA shape
    (Dqk = 576 = 512 + 64, Dv = 512, bf16): kernel 1 with BLOCK_H = 64 keeps q 64 x 576 x 2 =
    72 KiB and dO 64 x 512 x 2 = 64 KiB resident, and two stages of 32 gathered keys 2 x 32 x
    576 x 2 = 72 KiB: 212 KiB with the dS tile (4 KiB; the offline sm_90 build reports
    216 KiB). A 128-head q tile alone would be 144 KiB, so H = 128 runs as two head blocks per
    row (each gathers the row's keys; the second finds them in L2). Registers: q and dO are
    also held in registers (136 per thread over 8 warps), so a [64, 576] fp32 dQ accumulator
    (144 more) does not fit: dQ is ``attn_bwd_dq``'s, and kernel 1 runs 16 warps (128
    registers, no spills; at 8 warps it spills 168 bytes). H = 16 (BLOCK_H = 16) keeps dQ in
    kernel 1 at 8 warps and 64 slots a tile (255 registers, 113 KiB; 32 slots with v its own
    tensor or mixed dtypes). Kernel 2 (128 slots x 64 features, 64 heads
    per step): 2 x (64 x 128 + 64 x 64) x 2 = 48 KiB (32 KiB built). fp32 operands at the
    latent's widths: 16 heads x 16 slots, as the forward, 8 warps, dQ apart (106 KiB; 516
    bytes of spills remain). Per head (Dqk 192, Dv 128): 16 x
    256 + 16 x 128 + 2 x 64 x 256 halves = 76 KiB (55 KiB built, 210 registers)
    (``bench_attention_backward.py --inspect`` prints the build's numbers). With v its own
    tensor (``v_from_k`` False) kernel 1 gathers [block_n, 512] values beside the keys: at
    BLOCK_H = 64, 16 slots per tile (208 KiB built; 32 need 280 KiB). At 64 or more heads
    over the latent, with v a view of it and one operand dtype (``same_dtype``), kernel 1
    instead streams q, dO and the keys in 64-wide feature chunks (``inner_k``; at 128 heads
    one program a row, 8 warps, 3 stages: 252 registers, no spills, 120 KiB built)."""
    G = H // Hk
    block_h = max(16, min(64, _next_pow2(G)))
    keys_g = max(16, min(64, _next_pow2(G)))
    wide = max(Dqk, Dv) * elem_bytes > 512
    if interpret:
        cfg = BackwardConfig(block_h, 16, 4, 1, keys_g, 16, 16, 4, 1, dq_block_n=16, dq_block_f=16)
    elif elem_bytes > 2 and max(Dqk, Dv) > 256:
        # (q, dO and O fp32 [16, 512] tiles: 8 warps and dQ apart, else the build spills heavily)
        cfg = BackwardConfig(16, 16, 8, 2, keys_g, 64, 64, 4, 2, fused_dq=False)
    elif form_of(H, Hk) == "mqa" and wide and block_h >= 64 and v_from_k and same_dtype:
        # kernel 1's scores and dP as pipelined loops over 64-wide feature chunks (inner_k):
        # nothing of q or dO resident, so 128 heads fit in one program (keys gathered once a
        # row). H200, S = 32K, H = 128, one call: 342.0 ms against 565.5 for the resident
        # tiles (kernel 1 91.0 against 308.5 ms); 64 heads x 4 warps x 4 stages took 344.1
        big = G >= 128
        cfg = BackwardConfig(128 if big else 64, 64, 8 if big else 4, 3 if big else 4, keys_g, 128, 64, 4, 2,
                             fused_dq=False, inner_k=True)
    elif form_of(H, Hk) == "mqa" and wide:
        big = block_h >= 64
        # below 64 heads, 32 slots leave half of the 8 warps repeating the others' [16, 32]
        # score and dP tiles; 64 slots cover them: H200, S = 32K, H = 16, kernel 1 33.7 against
        # 53.5 ms, the backward 138.0 against 157.4 (255 registers, no spills, 113 KiB built)
        block_n = 16 if big and not v_from_k else 64 if not big and v_from_k and same_dtype else 32
        cfg = BackwardConfig(block_h, block_n, 16 if big else 8, 2, keys_g, 128, 64, 4, 2, fused_dq=not big)
    elif form_of(H, Hk) == "mqa":
        cfg = BackwardConfig(block_h, 64, 8 if block_h >= 64 else 4, 2, keys_g, 128, 64, 4, 2)
    else:
        cfg = BackwardConfig(block_h, 32 if wide or elem_bytes > 2 else 64, 4, 2, keys_g, 128, 64, 4, 2)
    return _config_override(cfg)


def _config_override(cfg: BackwardConfig) -> BackwardConfig:
    try:
        return dataclasses.replace(cfg, **parse_fields(os.environ.get("HYSCALE_ATTN_BWD_CONFIG", ""), BackwardConfig))
    except ValueError as e:
        raise SpecError(f"HYSCALE_ATTN_BWD_CONFIG: {e}") from None


# ---------------------------------------------------------------------------------------
# spec -> Triton source
# ---------------------------------------------------------------------------------------
def unsupported(spec: AttentionSpec) -> Optional[str]:
    """Why the kernels cannot differentiate ``spec`` (a post step without a derivative
    here), or None. A 0-d run-time factor (``mul_operand`` / ``div_operand``) is read at each
    call and is then the constant step (``resolve_operands``, before the launch)."""
    for step in spec.post:
        if step[0] not in ("mask", "round", "mul_operand", "div_operand") and step[0] not in _LINEAR_STEPS:
            return f"post step {step!r} has no derivative in the Triton backward"
    return None


def _render_post_grad(spec: AttentionSpec) -> list:
    """d loss / d x from d loss / d y (``g`` [BLOCK_H, BLOCK_N]) through the post steps in
    reverse, as ``backward._step_grad`` / ``_mask_grad``: a fill passes nothing to the slots
    it hides, an additive term passes everything."""
    lines = []
    for step in reversed(spec.post):
        op = step[0]
        if op == "mul":
            lines.append(f"g = g * {_lit(step[1])}")
        elif op == "div":
            lines.append(f"g = tl.div_rn(g, {_lit(step[1])})")
        elif op == "neg":
            lines.append("g = -g")
        elif op == "add":
            continue
        elif op == "round":
            # autograd's gradient of a cast: the incoming gradient in the cast's dtype (HF's
            # bf16 eager scores), as backward._step_grad gives it
            lines.append(f"g = {_round_expr('g', step[1])}")
        elif op == "mask":
            lines.extend(kind_of(spec.masks[step[1]], step[1]).slot_grad_lines())
        else:
            raise SpecError(f"post step {step!r} has no derivative in the Triton backward")
    return lines


def render_backward_source(spec: AttentionSpec, num_masks: int) -> str:
    """Python source of the forward's module (its ``_post``, ``_load_q``) followed by the
    backward kernels ``attn_bwd_rows`` and ``attn_bwd_keys``, specialized to ``spec``."""
    reason = unsupported(spec)
    if reason:
        raise SpecError(reason)
    subs = {
        "VERSION": str(BWD_TEMPLATE_VERSION),
        "PRECISION": "tf32" if spec.fp32_precision == "tf32" else "ieee",
        "POST_GRAD": _indent(_render_post_grad(spec), 4) or "    pass",
        "MASK_PARAMS": "".join(f"{a}, " for a in _mask_params(spec)),
        "MASK_ARGS_DEF": "".join(f"    {a},\n" for a in _mask_args_def(spec)),
        "ROW_BOUNDS": _indent(_render_row_bounds(spec), 4) or "    pass",
    }
    src = _TEMPLATE
    for key, val in subs.items():
        src = src.replace("{{" + key + "}}", val)
    assert "{{" not in src, "unfilled template slot"
    return render_kernel_source(spec, num_masks) + src


def load_backward_kernels(spec: AttentionSpec, num_masks: int):
    """(attn_bwd_rows, attn_bwd_keys, attn_bwd_dq) for ``spec``, cached per (spec, mods, interpreter mode)."""
    key = (spec.to_json(), num_masks, _interpreting(), _mod_bodies(spec.as_score_spec()))
    fns = _FN_CACHE.get(key)
    if fns is None:
        mod = import_source(render_backward_source(spec, num_masks))
        fns = _FN_CACHE[key] = (mod.attn_bwd_rows, mod.attn_bwd_keys, mod.attn_bwd_dq)
    return fns


# ---------------------------------------------------------------------------------------
# launch
# ---------------------------------------------------------------------------------------
def backward_chunk_rows(device: torch.device, K: int, H: int, Hk: int, D: int, Dv: int, elem_bytes: int,
                        rows: int, chunk_bytes: int = None, fold: bool = False) -> int:
    """Query rows per chunk: the fp32 per-slot contributions [Hk, n, K, D + Dv] ([Hk, n, K, D]
    when ``fold``) and the P and dS buffers [n, H, K] (operand width) within the budget; a
    function of the shapes only.
    On a GPU 4 GiB (``HYSCALE_ATTN_CHUNK_BYTES`` overrides it): about 430 rows at the
    latent's H = 128, so kernel 1's 2 x 430 programs of one SM each are 6.5 waves on 132 SMs
    (2 GiB would leave a third of the last of 3.2 waves idle)."""
    from .attention_backward import DEFAULT_CHUNK_BYTES

    if chunk_bytes is None:
        chunk_bytes = DEFAULT_CHUNK_BYTES.get(device.type, DEFAULT_CHUNK_BYTES["cpu"])
        if device.type == "cuda" and "HYSCALE_ATTN_CHUNK_BYTES" not in os.environ:
            chunk_bytes = 4 << 30
    per_row = max(1, K) * (4 * Hk * (D + (0 if fold else Dv)) + 2 * H * elem_bytes + 16) + 4 * H
    step = max(1, min(max(rows, 1), chunk_bytes // per_row))
    # a multiple of 16 where it can be, so every chunk's first row R0 has the same
    # divisibility: Triton specializes integer arguments on it (one build, not two)
    return step - step % 16 if 16 <= step < rows else step


# Bytes of the key side's fp32 per-slot contributions buffer, [Hk, rows per chunk, K, width]:
# where a chunk's whole feature width would take more, the key-side reduction runs in
# passes over feature slices (``keys_feature_width``). Kernel 1's chunk of rows is
# ``backward_chunk_rows``'s either way.
DEFAULT_KEYS_BYTES = {"cuda": 1 << 30}
if "HYSCALE_ATTN_KEYS_BYTES" in os.environ:
    DEFAULT_KEYS_BYTES = {"cuda": int(os.environ["HYSCALE_ATTN_KEYS_BYTES"]),
                          "cpu": int(os.environ["HYSCALE_ATTN_KEYS_BYTES"])}


def keys_feature_width(device: torch.device, step: int, K: int, Hk: int, F: int, block_f: int,
                       keys_bytes: int = None) -> int:
    """Features per pass of the key-side reduction (kernel 2 and the segment sum) of an
    F-wide gradient: all F where its fp32 contributions [Hk, step, K, F] fit ``keys_bytes``
    (default ``DEFAULT_KEYS_BYTES``, on the CPU unbounded), else the fewest passes that fit,
    each a whole number of kernel 2's ``block_f`` feature blocks: every pass then computes
    the same tiles as one pass would, and each feature's sum is its own (row, slot) ordered
    sum, so the bits do not depend on the passes. At the latent's H = 16 (F = 576, 864 rows
    of K = 2048): 3.8 GiB in one pass, 1.27 GiB in three of 192.
    A function of the shapes and the device type only."""
    if keys_bytes is None:
        keys_bytes = DEFAULT_KEYS_BYTES.get(device.type)
    full = 4 * Hk * step * max(1, K) * F
    if keys_bytes is None or full <= keys_bytes or F <= block_f:
        return F
    tiles = -(-F // block_f)
    passes = min(tiles, -(-full // max(1, keys_bytes)))
    return -(-tiles // passes) * block_f


def attention_backward_triton(grad_out, q, k, v, idx, masks: Sequence[torch.Tensor], delta, lse, spec: AttentionSpec,
                              needs=(True, True, True), atomic: bool = False, chunk_bytes: int = None,
                              config: Optional[BackwardConfig] = None, fold_v: bool = False, keys_bytes: int = None,
                              _launcher=None):
    """(gq, gk, gv) in the operands' dtypes, as ``attention_backward.attention_backward``
    (an input that needs no gradient gets an empty tensor; ``fold_v`` as there: where v is a
    view of k's first columns, one [Hk, n, K, D] contribution per slot, C_k + C_v added in
    kernel 2, and one segment sum). CUDA tensors, or CPU tensors under TRITON_INTERPRET=1.
    ``atomic``: dK / dV by fp32 atomics (not reproducible). ``keys_bytes``: the key side's
    contributions buffer (``keys_feature_width``; the same bits whatever it is).
    ``_launcher(kernel, args, launch)`` replaces the launches of the first chunk and the
    call returns their results (an offline sm_90 build: ``bench_attention_backward --inspect``)."""
    from .attention_backward import (check_backward_operands, dense_rows_backward, key_order, run_starts,
                                     v_is_view_of_k)

    masks = list(masks)
    spec = spec.resolve_operands(masks)
    if spec.empty_row == "dense" and _launcher is None:  # the kernels' rows, then the flagged ones in PyTorch
        return dense_rows_backward(
            lambda lse_, spec_: attention_backward_triton(grad_out, q, k, v, idx, masks, delta, lse_, spec_, needs, atomic,
                                                          chunk_bytes, config, fold_v, keys_bytes),
            grad_out, q, k, v, idx, masks, lse, spec, needs, fold_v)
    interp = check_interpreter_mode()
    check_attention_operands(q, k, v, idx, masks, spec)
    check_backward_operands(grad_out, q, k, v, idx, delta, lse)
    reason = unsupported(spec)
    if reason:
        raise SpecError(reason)
    device = q.device
    if device.type != "cuda" and not interp and _launcher is None:
        raise SpecError(f"the Triton attention backward needs CUDA tensors (got {device}), or TRITON_INTERPRET=1")
    B, S, H, D = q.shape
    T, Hk, Dv, K = k.shape[1], k.shape[2], v.shape[3], idx.shape[-1]
    G = H // Hk
    f32 = torch.float32
    upcast = (len({q.dtype, k.dtype, v.dtype}) > 1
              or (interp and torch.bfloat16 in (q.dtype, k.dtype, v.dtype)))
    cd = f32 if upcast else q.dtype  # the dots' operand dtype
    esize = torch.tensor([], dtype=cd).element_size()
    da, db = split_head_dim(D)
    block_dv = max(16, _next_pow2(Dv))
    v_from_k = reads_v_from_k(k, v)
    cfg = config or default_config(H, Hk, D, Dv, interpret=interp, elem_bytes=max(k.element_size(), v.element_size()),
                                   v_from_k=v_from_k, same_dtype=not upcast)
    fold = fold_v and needs[1] and needs[2] and v_is_view_of_k(k, v)
    gq = torch.zeros(q.shape, dtype=q.dtype, device=device) if needs[0] else q.new_empty(0)
    rows = B * S
    step = backward_chunk_rows(device, K, H, Hk, D, Dv, esize, rows, chunk_bytes, fold=fold)
    # the fp32 key-side sums of each gradient, one per pass over a feature slice (first
    # feature, [B * T, Hk, width]; ``keys_feature_width``): one pass sums into the whole [B, T,
    # Hk, F] gradient; the atomic variant adds straight into it, in one pass
    sums = {}
    for part, F, wanted in (("k", D, needs[1]), ("v", Dv, needs[2] and not fold)):
        if wanted:
            w = F if atomic else keys_feature_width(device, step, K, Hk, F, cfg.keys_block_f, keys_bytes)
            sums[part] = [(f0, torch.zeros((B * T, Hk, min(w, F - f0)), dtype=f32, device=device))
                          for f0 in range(0, F, w)]

    def assembled(part, like):
        if len(sums[part]) == 1:
            return sums[part][0][1].view(like.shape).to(like.dtype)
        full = torch.empty(like.shape, dtype=like.dtype, device=device)
        for f0, a in sums[part]:
            full[..., f0:f0 + a.shape[-1]].copy_(a.view(*like.shape[:3], a.shape[-1]))
        return full

    def result():
        gv_out = torch.zeros(v.shape, dtype=v.dtype, device=device) if fold else (
            assembled("v", v) if needs[2] else v.new_empty(0))
        return gq, assembled("k", k) if needs[1] else k.new_empty(0), gv_out

    if K == 0 or B * S * H == 0 or not any(needs):
        return result()
    rows_fn, keys_fn, dq_fn = load_backward_kernels(spec, len(masks))
    fused_dq = cfg.fused_dq and needs[0]
    mask_args = _mask_launch_args(spec, masks, B, S, T, device)
    pbuf = torch.empty((step, H, K), dtype=cd, device=device)
    gbuf = torch.empty((step, H, K), dtype=cd, device=device)
    lbuf = torch.empty((step, H), dtype=f32, device=device)
    if not atomic:
        # one contributions buffer for every pass of both parts: a pass's segment sum has read
        # it before the next pass's kernel 2 writes it (stream order)
        width = max((a.shape[-1] for ps in sums.values() for _, a in ps), default=0)
        cbuf = torch.empty(Hk * step * K * width, dtype=f32, device=device)
        idx_flat = idx.reshape(rows, K)
    dq_arg = gq if needs[0] else q  # (not written without NEED_DQ)
    nblk = -(-G // cfg.block_h)
    prec_consts = dict(UPCAST=upcast)
    # fp32 operands with IEEE dots: delta from the slots' own P' and dP, a first pass over the
    # keys (see the module docstring); 16-bit operands and TF32 dots: the ``delta`` operand, one pass
    exact_delta = {q.dtype, k.dtype, v.dtype} == {f32} and spec.fp32_precision != "tf32"
    if cfg.inner_k and (fused_dq or exact_delta or not v_from_k):
        raise SpecError("the backward's inner_k configuration needs v a view of k's first columns, 16-bit or TF32 "
                        "operands and dQ apart (fused_dq off)")
    built = []

    def launch(fn, grid, args, kw):
        if _launcher is not None:
            built.append(_launcher(fn, args, kw))
        else:
            fn[grid](*args, **kw)

    for r0 in range(0, rows, step):
        n = min(rows, r0 + step) - r0
        launch(rows_fn, (n * Hk * nblk,), [
            q, k, v, idx, delta, grad_out, lse, dq_arg, pbuf, gbuf, lbuf, *mask_args,
            *q.stride(), *k.stride(), *v.stride(), *idx.stride(), *delta.stride(), *grad_out.stride(),
            *lse.stride(), *dq_arg.stride(), r0, S, G, Hk, K, D, Dv],
            dict(BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, DA=da, DB=db, DBQ=max(db, 16), BLOCK_DV=block_dv,
                 V_FROM_K=v_from_k, NEED_DQ=bool(fused_dq), PREFETCH_IDX=cfg.prefetch_idx,
                 EXACT_DELTA=exact_delta, DO_SMEM=cfg.do_smem and not upcast,
                 PREFETCH_KEYS=cfg.prefetch_keys, DB_FIRST=cfg.db_first, INNER_K=cfg.inner_k,
                 BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
                 num_stages=cfg.num_stages, **prec_consts))
        if needs[0] and not fused_dq:
            nf = -(-D // cfg.dq_block_f)
            launch(dq_fn, (n * Hk * nblk * nf,) if cfg.f_first else (n * Hk * nblk, nf), [
                gbuf, lbuf, k, idx, gq, *k.stride(), *idx.stride(), *gq.stride(), r0, S, G, Hk, K, D],
                dict(BLOCK_H=cfg.block_h, BLOCK_N=cfg.dq_block_n, BLOCK_F=cfg.dq_block_f, UPCAST=upcast,
                     F_FIRST=cfg.f_first, num_warps=4, num_stages=2))
        order = None
        if fold:  # the values' part rides in the keys' launch: one contribution per slot
            parts = (("k", gbuf, q, pbuf, grad_out, Dv),)
        else:
            parts = (("k", gbuf, q, gbuf, q, 0), ("v", pbuf, grad_out, pbuf, grad_out, 0))
        for part, src, x, src2, x2, F2 in parts:
            for f0, acc in sums.get(part, ()):
                # features [f0, f0 + F) of this part: x and x2 read from f0 on, the values'
                # part (fold) on the features below F2 of the whole
                F, F2p = acc.shape[-1], max(0, min(acc.shape[-1], F2 - f0))
                xs, x2s = x[..., f0:], (x2[..., f0:] if F2p else x2)
                grid = (n * Hk, -(-K // cfg.keys_block_n), -(-F // cfg.keys_block_f))
                if cfg.f_first:
                    grid = (grid[0] * grid[1] * grid[2],)
                if atomic:
                    dst = acc.view(B, T, Hk, F)
                    dst_strides = dst.stride()
                else:
                    dst = cbuf[:Hk * step * K * F].view(Hk, step, K, F)
                    # [Hk, n, K, F] read as (row, slot, head, feature) strides
                    dst_strides = (dst.stride(1), dst.stride(2), dst.stride(0), dst.stride(3))
                launch(keys_fn, grid, [src, lbuf, xs, src2, x2s, idx, dst, *xs.stride(), *x2s.stride(),
                                       *idx.stride(), *dst_strides, r0, S, G, Hk, K, F, F2p],
                       dict(BLOCK_G=cfg.keys_block_g, BLOCK_N=cfg.keys_block_n, BLOCK_F=cfg.keys_block_f,
                            ATOMIC=atomic, FOLD=fold, F_FIRST=cfg.f_first, num_warps=cfg.keys_num_warps,
                            num_stages=cfg.keys_num_stages))
                if not atomic and _launcher is None:
                    if order is None:
                        # keys of the flattened (b, t): a key belongs to one batch, so (row, slot)
                        # order is each key's order; one key-major inversion for every pass
                        bt = (torch.arange(r0, r0 + n, device=device) // S * T).view(n, 1)
                        order = key_order((idx_flat[r0:r0 + n].long() + bt).reshape(-1), bound=B * T)
                        runs = run_starts(order[0], B * T) if cfg.runs_grid else None
                    srcs = dst[:, :n].reshape(Hk, n * K, F)  # a view unless Hk > 1 in the last chunk
                    segment_sum_sorted_(acc, order, srcs, runs)
        if _launcher is not None:
            return built
    return result()


def segment_sum_sorted_(out: torch.Tensor, order, src: torch.Tensor, runs=None) -> None:
    """``attention_backward.segment_sum_`` with the key-major inversion ``order`` (its
    ``key_order``) computed once for the chunk's dK and dV parts; ``runs`` (``run_starts``):
    one program per run. The same additions in the same order either way."""
    from .attention_backward import _BLOCK_F, _UNROLL, _segment_runs_kernel, _segment_sum_kernel

    skeys, perm, end = order
    Hk, N, F = src.shape
    assert out.is_contiguous() and out.dtype == torch.float32 and tuple(out.shape[1:]) == (Hk, F)
    src = src.contiguous()
    block = min(_BLOCK_F, _next_pow2(F))
    if runs is None:
        _segment_sum_kernel[(N, -(-F // block), Hk)](src, perm, skeys, end, out, N, F, Hk, BLOCK_F=block,
                                                     UNROLL=_UNROLL)
        return
    starts, nruns = runs
    _segment_runs_kernel[(starts.numel(), -(-F // block), Hk)](src, perm, skeys, end, starts, nruns, out, N, F,
                                                                   Hk, BLOCK_F=block, UNROLL=_UNROLL)


# ---------------------------------------------------------------------------------------
# the template (appended to the forward's module: ``_post``, ``_load_q`` come from there)
# ---------------------------------------------------------------------------------------
_TEMPLATE = r'''

# ---- backward (hyscale_compile.lowerings.triton_attention_backward, template v{{VERSION}}) ----
@triton.jit
def _post_grad(g, t, slot_ok, b, s, {{MASK_PARAMS}}):
    # d loss / d (q . k) from d loss / d y through the post steps, in reverse
{{POST_GRAD}}
    return g


@triton.jit
def _bwd_gather(kbase, t, slot_ok, DQK, stride_kt, stride_kd, DA: tl.constexpr, DB: tl.constexpr,
                UPCAST: tl.constexpr):
    # the key tiles [BLOCK_N, DA] and [BLOCK_N, DB] of slots t (ka again where DB is 0)
    rows = kbase + t[:, None] * stride_kt
    offs_a = tl.arange(0, DA)
    ka = tl.load(rows + offs_a[None, :] * stride_kd, mask=slot_ok[:, None] & (offs_a < DQK)[None, :], other=0.0)
    if UPCAST:
        ka = ka.to(tl.float32)
    if DB > 0:
        offs_b = DA + tl.arange(0, DB)
        kb = tl.load(rows + offs_b[None, :] * stride_kd, mask=slot_ok[:, None] & (offs_b < DQK)[None, :], other=0.0)
        if UPCAST:
            kb = kb.to(tl.float32)
    else:
        kb = ka  # (unused)
    return ka, kb


@triton.jit
def _bwd_scores_of(qa, qb, ka, kb, t, slot_ok, b, s, {{MASK_PARAMS}}DB: tl.constexpr, DB_FIRST: tl.constexpr):
    # the forward's scores y [BLOCK_H, BLOCK_N] (-inf at padding slots) of gathered key tiles.
    # DB_FIRST: the DB chunk's dot first, the DA chunk's accumulating onto it (a dot whose
    # result feeds another dot gets all its warps along M, at BLOCK_H = 64 and 8 warps the
    # same product on both warpgroups: the small dot then, not the large one)
    if DB > 0 and DB_FIRST:
        x = tl.dot(qb, tl.trans(kb), input_precision="{{PRECISION}}", out_dtype=tl.float32)
        x = tl.dot(qa, tl.trans(ka), acc=x, input_precision="{{PRECISION}}", out_dtype=tl.float32)
    else:
        x = tl.dot(qa, tl.trans(ka), input_precision="{{PRECISION}}", out_dtype=tl.float32)
        if DB > 0:
            x = tl.dot(qb, tl.trans(kb), acc=x, input_precision="{{PRECISION}}", out_dtype=tl.float32)
    y = _post(x, t, slot_ok, b, s, {{MASK_PARAMS}})
    return tl.where(slot_ok[None, :], y, float("-inf"))


@triton.jit
def _bwd_scores(qa, qb, kbase, t, slot_ok, b, s, DQK, stride_kt, stride_kd, {{MASK_PARAMS}}
                BLOCK_N: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, UPCAST: tl.constexpr,
                DB_FIRST: tl.constexpr):
    # the forward's scores y [BLOCK_H, BLOCK_N] (-inf at padding slots) and the key tiles
    ka, kb = _bwd_gather(kbase, t, slot_ok, DQK, stride_kt, stride_kd, DA, DB, UPCAST)
    return _bwd_scores_of(qa, qb, ka, kb, t, slot_ok, b, s, {{MASK_PARAMS}}DB, DB_FIRST), ka, kb


@triton.jit
def _bwd_scores_dp_chunked(qbase, dobase, kbase, t, slot_ok, h_ok, b, s, DQK, DV, stride_qh, stride_qd,
                           stride_gh, stride_gd, stride_kt, stride_kd, {{MASK_PARAMS}}BLOCK_H: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    # the scores y and dP [BLOCK_H, BLOCK_N] of slots t (v the keys' first DV columns) as
    # loops over BLOCK_D-wide feature chunks: each step loads a q, a dO and a gathered key
    # chunk (q and dO from L2, not resident), so the loop pipelines within a slot tile in
    # little shared memory; dO unmasked (a dead head's P' is 0, and its dS' with it)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    rows = kbase + t[:, None] * stride_kt
    x = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    dp = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, DV, BLOCK_D):
        cols = d0 + offs_d
        kc = tl.load(rows + cols[None, :] * stride_kd, mask=slot_ok[:, None] & (cols < DQK)[None, :], other=0.0)
        qc = tl.load(qbase + offs_h[:, None] * stride_qh + cols[None, :] * stride_qd,
                     mask=h_ok[:, None] & (cols < DQK)[None, :], other=0.0)
        dc = tl.load(dobase + offs_h[:, None] * stride_gh + cols[None, :] * stride_gd,
                     mask=h_ok[:, None] & (cols < DV)[None, :], other=0.0)
        if UPCAST:
            kc = kc.to(tl.float32)
            qc = qc.to(tl.float32)
            dc = dc.to(tl.float32)
        x = tl.dot(qc, tl.trans(kc), acc=x, input_precision="{{PRECISION}}", out_dtype=tl.float32)
        dp = tl.dot(dc, tl.trans(kc), acc=dp, input_precision="{{PRECISION}}", out_dtype=tl.float32)
    for d0 in range(tl.cdiv(DV, BLOCK_D) * BLOCK_D, DQK, BLOCK_D):  # the keys' columns past v's
        cols = d0 + offs_d
        kc = tl.load(rows + cols[None, :] * stride_kd, mask=slot_ok[:, None] & (cols < DQK)[None, :], other=0.0)
        qc = tl.load(qbase + offs_h[:, None] * stride_qh + cols[None, :] * stride_qd,
                     mask=h_ok[:, None] & (cols < DQK)[None, :], other=0.0)
        if UPCAST:
            kc = kc.to(tl.float32)
            qc = qc.to(tl.float32)
        x = tl.dot(qc, tl.trans(kc), acc=x, input_precision="{{PRECISION}}", out_dtype=tl.float32)
    y = _post(x, t, slot_ok, b, s, {{MASK_PARAMS}})
    return tl.where(slot_ok[None, :], y, float("-inf")), dp


@triton.jit
def _bwd_dp(do_c, vbase, t, slot_ok, ka, DV, stride_vt, stride_vd, BLOCK_DV: tl.constexpr, V_FROM_K: tl.constexpr,
            UPCAST: tl.constexpr):
    # dP = dO . v[t]^T [BLOCK_H, BLOCK_N] for a tile of slots t (``ka``: its key tile)
    if V_FROM_K:
        vt = ka  # v is a view of k's first columns: the tile already on chip
    else:
        offs_dv = tl.arange(0, BLOCK_DV)
        vt = tl.load(vbase + t[:, None] * stride_vt + offs_dv[None, :] * stride_vd,
                     mask=slot_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
        if UPCAST:
            vt = vt.to(tl.float32)
    return tl.dot(do_c, tl.trans(vt), input_precision="{{PRECISION}}", out_dtype=tl.float32)


@triton.jit
def _bwd_delta(qa, qb, do_c, kbase, vbase, ibase, live, lse_use, b, s, DQK, DV, TOPK, stride_kt, stride_kd,
               stride_vt, stride_vd, stride_ij, {{MASK_PARAMS}}BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
               DA: tl.constexpr, DB: tl.constexpr, BLOCK_DV: tl.constexpr, V_FROM_K: tl.constexpr,
               UPCAST: tl.constexpr, DB_FIRST: tl.constexpr):
    # delta = sum_j P'_j dP_j / sum_j P'_j [BLOCK_H]: a pass over the slots with the main
    # loop's own P' and dP (the same tiles and ops, so the same bits)
    offs_n = tl.arange(0, BLOCK_N)
    num = tl.zeros([BLOCK_H], dtype=tl.float32)
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    for n0 in range(0, TOPK, BLOCK_N):
        slots = n0 + offs_n
        slot_ok = slots < TOPK
        t = tl.load(ibase + slots * stride_ij, mask=slot_ok, other=0).to(tl.int64)
        y, ka, kb = _bwd_scores(qa, qb, kbase, t, slot_ok, b, s, DQK, stride_kt, stride_kd, {{MASK_PARAMS}}
                                BLOCK_N, DA, DB, UPCAST, DB_FIRST)
        p = tl.where(live[:, None], tl.exp(y - lse_use[:, None]), 0.0)
        dp = _bwd_dp(do_c, vbase, t, slot_ok, ka, DV, stride_vt, stride_vd, BLOCK_DV, V_FROM_K, UPCAST)
        num += tl.sum(tl.where(p > 0.0, p * dp, 0.0), axis=1)
        den += tl.sum(p, axis=1)
    return tl.where(live, tl.div_rn(num, tl.where(live, den, 1.0)), 0.0)


@triton.jit
def attn_bwd_rows(
    Q, K, V, IDX, DELTA, DO, LSE, DQ, PB, GB, LB,
{{MASK_ARGS_DEF}}    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ib, stride_is, stride_ij,
    stride_eb, stride_es, stride_eh,
    stride_gb, stride_gs, stride_gh, stride_gd,
    stride_lb, stride_ls, stride_lh,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    R0, S, G, HK, TOPK, DQK, DV,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, DBQ: tl.constexpr,
    BLOCK_DV: tl.constexpr, V_FROM_K: tl.constexpr, UPCAST: tl.constexpr, NEED_DQ: tl.constexpr,
    PREFETCH_IDX: tl.constexpr, EXACT_DELTA: tl.constexpr, DO_SMEM: tl.constexpr, PREFETCH_KEYS: tl.constexpr,
    DB_FIRST: tl.constexpr, INNER_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # program: row R0 + lrow of the flattened (b, s), kv head hk, heads g0 .. g0 + BLOCK_H of
    # its G; writes dQ of those heads, P' and dS' [BLOCK_H, TOPK] to PB / GB (the chunk's
    # [n, HK * G, TOPK] buffers) and 1 / sum_j P' to LB [n, HK * G]
    nblk = tl.cdiv(G, BLOCK_H)
    pid = tl.program_id(0).to(tl.int64)
    lrow = pid // (HK * nblk)
    row = R0 + lrow
    b = row // S
    s = row % S
    hk = (pid % (HK * nblk)) // nblk
    g0 = ((pid % nblk) * BLOCK_H).to(tl.int32)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = g0 + offs_h < G
{{ROW_BOUNDS}}
    qa, qb = _load_q(Q, b, s, hk, g0, G, DQK, stride_qb, stride_qs, stride_qh, stride_qd, BLOCK_H, DA, DB, UPCAST)
    gbase = DO + b * stride_gb + s * stride_gs + (hk * G) * stride_gh
    do_ptr = tl.make_block_ptr(gbase, (G, DV), (stride_gh, stride_gd), (g0, 0), (BLOCK_H, BLOCK_DV), (1, 0))
    lse = tl.load(LSE + b * stride_lb + s * stride_ls + (hk * G + g0 + offs_h) * stride_lh, mask=h_ok,
                  other=float("-inf"))
    # a head with no visible slot (lse -inf, out NaN) passes nothing: its dO reads as 0
    # (DO_SMEM: unmasked, its P' and dS' are 0 whatever its dP)
    live = lse > float("-inf")
    lse_use = tl.where(live, lse, 0.0)
    if DO_SMEM:
        do_c = tl.load(do_ptr, boundary_check=(0, 1), padding_option="zero")
    else:
        do = tl.load(do_ptr, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        do_c = tl.where(live[:, None], do, 0.0).to(qa.dtype)
    if not EXACT_DELTA:
        delta = tl.load(DELTA + b * stride_eb + s * stride_es + (hk * G + g0 + offs_h) * stride_eh,
                        mask=h_ok & live, other=0.0)
    kbase = K + b * stride_kb + hk * stride_kh
    vbase = V + b * stride_vb + hk * stride_vh
    ibase = IDX + b * stride_ib + s * stride_is
    if EXACT_DELTA:  # (the module docstring: fp32 operands)
        delta = _bwd_delta(qa, qb, do_c, kbase, vbase, ibase, live, lse_use, b, s, DQK, DV, TOPK, stride_kt,
                           stride_kd, stride_vt, stride_vd, stride_ij, {{MASK_PARAMS}}BLOCK_H, BLOCK_N, DA, DB,
                           BLOCK_DV, V_FROM_K, UPCAST, DB_FIRST)
    pg = (lrow * (HK * G) + hk * G + g0 + offs_h) * TOPK
    qrow = Q + b * stride_qb + s * stride_qs + (hk * G + g0) * stride_qh
    dqa = tl.zeros([BLOCK_H, DA], dtype=tl.float32)
    dqb = tl.zeros([BLOCK_H, DBQ], dtype=tl.float32)
    lsum = tl.zeros([BLOCK_H], dtype=tl.float32)
    if PREFETCH_IDX or PREFETCH_KEYS:
        t_next = tl.load(ibase + offs_n * stride_ij, mask=offs_n < TOPK, other=0).to(tl.int64)
    if PREFETCH_KEYS:
        # the next tile's keys gathered to registers one iteration ahead (their loads in
        # flight through this tile's dots), the indices two ahead
        ka_next, kb_next = _bwd_gather(kbase, t_next, offs_n < TOPK, DQK, stride_kt, stride_kd, DA, DB, UPCAST)
        t_next = tl.load(ibase + (BLOCK_N + offs_n) * stride_ij, mask=BLOCK_N + offs_n < TOPK, other=0).to(tl.int64)
    for n0 in range(0, TOPK, BLOCK_N):
        slots = n0 + offs_n
        slot_ok = slots < TOPK
        if INNER_K:
            t = tl.load(ibase + slots * stride_ij, mask=slot_ok, other=0).to(tl.int64)
            y, dp = _bwd_scores_dp_chunked(qrow, gbase + g0 * stride_gh, kbase, t, slot_ok, h_ok, b, s, DQK, DV,
                                           stride_qh, stride_qd, stride_gh, stride_gd, stride_kt, stride_kd,
                                           {{MASK_PARAMS}}BLOCK_H, BLOCK_N, BLOCK_D, UPCAST)
        elif PREFETCH_KEYS:
            ka = ka_next
            kb = kb_next
            t = tl.load(ibase + slots * stride_ij, mask=slot_ok, other=0).to(tl.int64)
            ahead = slots + BLOCK_N
            ka_next, kb_next = _bwd_gather(kbase, t_next, ahead < TOPK, DQK, stride_kt, stride_kd, DA, DB, UPCAST)
            ahead2 = ahead + BLOCK_N
            t_next = tl.load(ibase + ahead2 * stride_ij, mask=ahead2 < TOPK, other=0).to(tl.int64)
            y = _bwd_scores_of(qa, qb, ka, kb, t, slot_ok, b, s, {{MASK_PARAMS}}DB, DB_FIRST)
        else:
            if PREFETCH_IDX:
                t = t_next
                ahead = slots + BLOCK_N
                t_next = tl.load(ibase + ahead * stride_ij, mask=ahead < TOPK, other=0).to(tl.int64)
            else:
                t = tl.load(ibase + slots * stride_ij, mask=slot_ok, other=0).to(tl.int64)
            y, ka, kb = _bwd_scores(qa, qb, kbase, t, slot_ok, b, s, DQK, stride_kt, stride_kd, {{MASK_PARAMS}}
                                    BLOCK_N, DA, DB, UPCAST, DB_FIRST)
        p = tl.where(live[:, None], tl.exp(y - lse_use[:, None]), 0.0)
        lsum += tl.sum(p, axis=1)
        if not INNER_K:
            dp = _bwd_dp(do_c, vbase, t, slot_ok, ka, DV, stride_vt, stride_vd, BLOCK_DV, V_FROM_K, UPCAST)
        g = tl.where(p > 0.0, p * (dp - delta[:, None]), 0.0)
        g = _post_grad(g, t, slot_ok, b, s, {{MASK_PARAMS}})
        ok = h_ok[:, None] & slot_ok[None, :]
        tl.store(PB + pg[:, None] + slots[None, :], p.to(PB.dtype.element_ty), mask=ok)
        tl.store(GB + pg[:, None] + slots[None, :], g.to(GB.dtype.element_ty), mask=ok)
        if NEED_DQ:
            gc = g.to(ka.dtype)
            dqa = tl.dot(gc, ka, acc=dqa, input_precision="{{PRECISION}}", out_dtype=tl.float32)
            if DB > 0:
                dqb = tl.dot(gc, kb, acc=dqb, input_precision="{{PRECISION}}", out_dtype=tl.float32)
    # 1 / l: the softmax's normalization over the slots (P = P' / l); 0 for a dead head
    inv = tl.where(live, tl.div_rn(tl.full([BLOCK_H], 1.0, tl.float32), tl.where(live, lsum, 1.0)), 0.0)
    tl.store(LB + lrow * (HK * G) + hk * G + g0 + offs_h, inv, mask=h_ok)
    if NEED_DQ:
        qbase = DQ + b * stride_dqb + s * stride_dqs + (hk * G) * stride_dqh
        tl.store(tl.make_block_ptr(qbase, (G, DQK), (stride_dqh, stride_dqd), (g0, 0), (BLOCK_H, DA), (1, 0)),
                 (dqa * inv[:, None]).to(DQ.dtype.element_ty), boundary_check=(0, 1))
        if DB > 0:
            tl.store(tl.make_block_ptr(qbase, (G, DQK), (stride_dqh, stride_dqd), (g0, DA), (BLOCK_H, DBQ), (1, 0)),
                     (dqb * inv[:, None]).to(DQ.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def attn_bwd_dq(
    GB, LB, K, IDX, DQ,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_ib, stride_is, stride_ij,
    stride_dqb, stride_dqs, stride_dqh, stride_dqd,
    R0, S, G, HK, TOPK, DQK,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, UPCAST: tl.constexpr,
    F_FIRST: tl.constexpr,
):
    # dQ[h, f] = (sum_j dS'[h, j] k[t_j, f]) / l[h] for BLOCK_H heads of kv head hk and
    # BLOCK_F features of one row, from the stored dS' (when kernel 1 does not accumulate it).
    # F_FIRST: a flat grid, the feature blocks of one (row, head block) next to each other
    nblk = tl.cdiv(G, BLOCK_H)
    if F_FIRST:
        flat = tl.program_id(0).to(tl.int64)
        nf = tl.cdiv(DQK, BLOCK_F)
        pid = flat // nf
        fb = flat % nf
    else:
        pid = tl.program_id(0).to(tl.int64)
        fb = tl.program_id(1)
    lrow = pid // (HK * nblk)
    row = R0 + lrow
    b = row // S
    s = row % S
    hk = (pid % (HK * nblk)) // nblk
    g0 = ((pid % nblk) * BLOCK_H).to(tl.int32)
    gs = g0 + tl.arange(0, BLOCK_H)
    g_ok = gs < G
    cols = fb * BLOCK_F + tl.arange(0, BLOCK_F)
    col_ok = cols < DQK
    offs_n = tl.arange(0, BLOCK_N)
    hrow = (lrow * (HK * G) + hk * G + gs) * TOPK
    kbase = K + b * stride_kb + hk * stride_kh
    ibase = IDX + b * stride_ib + s * stride_is
    acc = tl.zeros([BLOCK_H, BLOCK_F], dtype=tl.float32)
    for n0 in range(0, TOPK, BLOCK_N):
        slots = n0 + offs_n
        slot_ok = slots < TOPK
        t = tl.load(ibase + slots * stride_ij, mask=slot_ok, other=0).to(tl.int64)
        w = tl.load(GB + hrow[:, None] + slots[None, :], mask=g_ok[:, None] & slot_ok[None, :], other=0.0)
        kt = tl.load(kbase + t[:, None] * stride_kt + cols[None, :] * stride_kd,
                     mask=slot_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        acc = tl.dot(w.to(kt.dtype), kt, acc=acc, input_precision="{{PRECISION}}", out_dtype=tl.float32)
    inv = tl.load(LB + lrow * (HK * G) + hk * G + gs, mask=g_ok, other=0.0)
    dst = DQ + b * stride_dqb + s * stride_dqs + (hk * G + gs)[:, None] * stride_dqh + cols[None, :] * stride_dqd
    tl.store(dst, (acc * inv[:, None]).to(DQ.dtype.element_ty), mask=g_ok[:, None] & col_ok[None, :])


@triton.jit
def _keys_part(acc, SRC, LB, X, hbase, xbase, slots, slot_ok, cols, col_ok, G, TOPK, stride_xh, stride_xd,
               BLOCK_G: tl.constexpr):
    # acc += sum_h (SRC[h, slot] / l[h]) X[h, f] over the G heads, BLOCK_G at a time in order
    offs_g = tl.arange(0, BLOCK_G)
    for g0 in range(0, G, BLOCK_G):
        gs = g0 + offs_g
        g_ok = gs < G
        inv = tl.load(LB + hbase + gs, mask=g_ok, other=0.0)
        live = inv != 0.0
        w = tl.load(SRC + (hbase + gs)[:, None] * TOPK + slots[None, :], mask=g_ok[:, None] & slot_ok[None, :],
                    other=0.0)
        w = (w.to(tl.float32) * inv[:, None]).to(SRC.dtype.element_ty)
        # a dead head's dO may be NaN (its output is): 0 * NaN would reach every slot
        x = tl.load(xbase + gs[:, None] * stride_xh + cols[None, :] * stride_xd,
                    mask=(g_ok & live)[:, None] & col_ok[None, :], other=0.0).to(SRC.dtype.element_ty)
        acc = tl.dot(tl.trans(w), x, acc=acc, input_precision="{{PRECISION}}", out_dtype=tl.float32)
    return acc


@triton.jit
def attn_bwd_keys(
    SRC, LB, X, SRC2, X2, IDX, DST,
    stride_xb, stride_xs, stride_xh, stride_xd,
    stride_x2b, stride_x2s, stride_x2h, stride_x2d,
    stride_ib, stride_is, stride_ij,
    stride_d0, stride_d1, stride_d2, stride_d3,
    R0, S, G, HK, TOPK, F, F2,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr, ATOMIC: tl.constexpr,
    FOLD: tl.constexpr, F_FIRST: tl.constexpr,
):
    # C[slot, f] = sum_h (SRC[h, slot] / l[h]) X[h, f] over kv head hk's G heads, for
    # BLOCK_N slots and BLOCK_F features of one row: SRC = dS' with X = q (the keys' part),
    # or P' with X = dO (the values'). FOLD (v is a view of k's first F2 columns): the
    # keys' part, then the values' part added onto it in the same fp32 accumulator at the
    # features f < F2, one contribution per slot for the shared rows. Stored to the chunk
    # buffer at (row, slot, hk, f), or (ATOMIC) added to DST at (b, key, hk, f). F_FIRST: a
    # flat grid, feature block fastest, then slot block, then (row, hk)
    if F_FIRST:
        flat = tl.program_id(0).to(tl.int64)
        nf = tl.cdiv(F, BLOCK_F)
        nk = tl.cdiv(TOPK, BLOCK_N)
        fb = flat % nf
        kb = (flat // nf) % nk
        pid = flat // (nf * nk)
    else:
        pid = tl.program_id(0).to(tl.int64)
        kb = tl.program_id(1)
        fb = tl.program_id(2)
    lrow = pid // HK
    hk = pid % HK
    row = R0 + lrow
    b = row // S
    s = row % S
    slots = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    slot_ok = slots < TOPK
    f0 = fb * BLOCK_F
    cols = f0 + tl.arange(0, BLOCK_F)
    col_ok = cols < F
    hbase = lrow * (HK * G) + hk * G
    xbase = X + b * stride_xb + s * stride_xs + (hk * G) * stride_xh
    acc = tl.zeros([BLOCK_N, BLOCK_F], dtype=tl.float32)
    acc = _keys_part(acc, SRC, LB, X, hbase, xbase, slots, slot_ok, cols, col_ok, G, TOPK, stride_xh, stride_xd,
                     BLOCK_G)
    if FOLD:
        if f0 < F2:
            x2base = X2 + b * stride_x2b + s * stride_x2s + (hk * G) * stride_x2h
            acc = _keys_part(acc, SRC2, LB, X2, hbase, x2base, slots, slot_ok, cols, cols < F2, G, TOPK,
                             stride_x2h, stride_x2d, BLOCK_G)
    ok = slot_ok[:, None] & col_ok[None, :]
    if ATOMIC:
        t = tl.load(IDX + b * stride_ib + s * stride_is + slots * stride_ij, mask=slot_ok, other=0).to(tl.int64)
        dst = DST + b * stride_d0 + t[:, None] * stride_d1 + hk * stride_d2 + cols[None, :] * stride_d3
        tl.atomic_add(dst, acc, mask=ok, sem="relaxed")
    else:
        dst = DST + lrow * stride_d0 + slots[:, None] * stride_d1 + hk * stride_d2 + cols[None, :] * stride_d3
        tl.store(dst, acc, mask=ok)
'''
