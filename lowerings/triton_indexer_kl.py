"""The indexer's dense KL loss on Triton, streamed over key tiles: no [S, T] table.

Semantics, operands and layouts: ``indexer_kl_reference`` (its docstring gives the math).
Tiles are BLOCK_M query rows by BLOCK_N keys; with ``causal`` (S == T) a query tile visits
the key tiles up to its diagonal only, a key tile the query tiles from its diagonal on.

Forward (``indexer_kl_triton_forward``):

    _attn_lse_kernel   (only when the caller has no lse) one program per (query tile, head):
                       the attention's log-sum-exp over the visible keys, online (flash-style)
    _kl_fwd_kernel     one program per query tile; per key tile it scores the indexer
                       (I = sum_j w_j relu(qi_j . ki), Hi dots) and the target
                       (P = sum_h exp(scale q_h . k - lse_h), H dots), and accumulates online
                       per row: sum P, sum P log P, sum P (I - m) and the indexer's running
                       max m and sum of exp(I - m). At the end
                           row = E / Z - log Z - X / Z + log L     (tgt = P / Z, Z = sum P,
                                                                   lse_I = m + log L)
                       which is sum_t tgt_t (log tgt_t - I_t + lse_I). It writes the row
                       losses and (m, L, Z) per row for the backward; the loss is their
                       sum in a fixed order. L (and the lse pass's sum) is carried across
                       key tiles in float64, each tile's fp32 sum added and the rescale
                       exp(m_old - m_new) in float64: a few float64 operations per row and
                       key tile, none per key. In fp32 each rescale's rounding stayed in L
                       (10 ulps over 16 tiles), a rounding common to the row's softmax,
                       which the gradients see at the scale of p, not of dI (Z, a plain
                       sum, stays fp32: a float64 Z doubled the fp32 config's spills)

Backward (``indexer_kl_triton_backward``), over chunks of ``chunk_rows`` query rows, in order:

    _kl_dI_kernel      one program per visible (key tile, query tile) of the chunk:
                       dI = g (exp(I - m_I) / l_I - P / Z), both scores again, into a
                       [B, chunk, T] fp32 workspace (the one buffer that grows with T: a chunk
                       of rows, never all S)
    _kl_dq_kernel      one program per (dq_heads indexer heads j, query tile): over the key
                       tiles, a = qi_j . ki again, dw_j += sum_t dI relu(a),
                       dqi_j += (dI w_j [a > 0]) ki; each program owns its rows' dqi_j and dw_j:
                       written once
    _kl_dk_kernel      one program per (key tile, group of Hi / dk_head_split heads): over the
                       chunk's query tiles and the group's heads (dk_heads at a time),
                       dki += (dI w_j [a > 0])^T qi_j, into the group's fp32 [B, T, Di] partial
                       sum, which the next chunk's launch continues (read, add, write by the
                       tile's own program); the groups' sums are added in a fixed order at the end

Stacked heads (dq_heads, dk_heads > 1): the gradients' dots take G heads' rows of one query
tile at once, [G * BM, Di] against the key tile, so the key tile and the dI tile are read
once for G heads. It also sizes the dots for Triton's layout: a dot whose result feeds
another dot (a -> da -> dqi) is spread over all warps' rows, which at 8 warps is 128 rows;
a 64-row tile there is computed twice, once per warp group.

Why a workspace: dqi needs, per query row, Hi accumulators of Di (64 x 128 floats per row
at the DSA shape), too many for one program's registers next to the dI tile, and dI needs
every head of both scores; so dI is computed once per chunk and read by one program per
indexer head (the heads of a query tile run together and share the lines in L2).

Deterministic: no atomics, every program writes only its own outputs, the order of every
fp32 sum is fixed by the shapes and the launch configuration (``default_config``, chosen
from shapes and dtypes only), so two calls give the same bits on the same GPU and software.

GEMM work per visible (query, key) pair, in multiply-adds: forward Hi Di + H D (+ H D for
the lse pass when no lse is given); backward Hi Di + H D (dI: both scores again), 2 Hi Di
(dq: a again, dqi), 2 Hi Di (dk: a again, dki). Against the floors (one attention score
GEMM, one indexer score GEMM, the two gradient GEMMs dqi and dki) that is 3 recomputed
score GEMMs of the indexer and 1-2 of the attention. Two of the recomputes (a in the dq and
dk kernels, after dI) cannot go without a table: dI needs every head's a before any head's
gradient, and a per (query, key, head) is an [S, T, Hi] table; so the backward's GEMMs are
at least 4 Hi Di + H D per pair (2.2x the backward's floor at the DSA shape).

dtypes: fp32, bf16 or fp16 operands, fp32 accumulation; fp32 dots run in IEEE precision
(no TF32); the backward's dI w [a > 0] enters its dot in the indexer's dtype.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .indexer_kl_reference import attention_stats, check_operands, check_stats
from .spec import SpecError


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class IndexerKLConfig:
    block_m: int = 64
    block_n: int = 64
    block_d: int = 64  # the attention's head dim runs in chunks of this many columns
    num_warps: int = 4
    num_stages: int = 2
    chunk_rows: int = 2048  # query rows per backward chunk (a multiple of block_m)
    dk_head_split: int = 4  # the key gradient's programs per key tile (head groups; 1 when it does not divide Hi)
    dk_block_n: int = 64  # the key gradient's key tile (its [block, Di] accumulator stays in registers)
    # tuning of the dots' shapes (they change the fp32 sums' order, not what is summed):
    dq_heads: int = 1  # indexer heads stacked along the rows of the query gradient's dots (a power of two)
    dq_block_m: int = 0  # the query gradient's query tile (0: block_m)
    dq_block_n: int = 0  # the query gradient's key tile (0: block_n)
    dk_heads: int = 1  # indexer heads stacked along the key gradient's reduction (a power of two)
    dk_trans: int = 0  # 1: the key gradient key-major (``_kl_dk_kernel``'s TRANS)
    lse_block_m: int = 0  # the attention lse pass's query tile (0: block_m)
    lse_num_warps: int = 0  # its warps (0: num_warps)
    # pipeline stages of single loops (0: the kernel's num_stages): 2 stages prefetch one
    # iteration ahead, issued at the end of the previous one, so a head's L2 latency is
    # mostly exposed
    head_stages: int = 0  # the forward and dI kernels' index head loop (one qi_j tile a stage)
    attn_stages: int = 0  # their attention head loop (the head's q and k chunks a stage)
    grad_stages: int = 0  # the dq kernel's key loop and the dk kernel's head loop


def default_config(q: torch.Tensor, qi: torch.Tensor, T: int, interpret: Optional[bool] = None) -> IndexerKLConfig:
    """From shapes and dtypes only (never by timing), so a shape always runs the same sums."""
    if interpret is None:
        interpret = q.device.type != "cuda"
    D, Di = q.shape[3], qi.shape[3]
    B = q.shape[0]
    if interpret:
        bd = min(64, max(16, _next_pow2(D)))
        # (the key gradient's tile differs from the others' on purpose: they need not agree)
        return IndexerKLConfig(block_m=16, block_n=16, block_d=bd, num_warps=1, num_stages=1, chunk_rows=32,
                               dk_head_split=2, dk_block_n=32)

    def rows(bm: int) -> int:  # a 256 MiB dI workspace
        return max(bm, min(4096, ((1 << 28) // max(1, B * T * 4)) // bm * bm))

    bd = min(64, max(16, _next_pow2(D)))
    if q.dtype == torch.float32 or qi.dtype == torch.float32:
        # IEEE fp32 dots run on the FMA units: smaller tiles keep them out of local memory
        return IndexerKLConfig(block_m=32, block_n=32, block_d=bd, num_warps=4, num_stages=2, chunk_rows=rows(32),
                               dk_block_n=32)
    # (compiled for sm_90 at the DSA shape: no spills, wgmma; 128 keys per tile halve the
    # re-reads of the Hi query heads per tile. The gradients' dots, whose results feed a
    # second dot, are laid out over all 8 warps' rows, so they get 128 rows: two heads
    # stacked in the query gradient, 128 keys in the key-major key gradient (8 head groups
    # keep a chunk's launch at 128 programs or more); the lse pass at 128 rows reads each
    # key tile for twice the rows; deeper pipelines where shared memory allows: the index
    # head loop's 4 stages fit in the attention loop's 2, the gradients' 3 stages take
    # 144 KB (dq) and 80 KB (dk))
    if _next_pow2(Di) >= 128:
        return IndexerKLConfig(block_m=64, block_n=128, block_d=bd, num_warps=8, num_stages=2, chunk_rows=rows(64),
                               dq_heads=2, dq_block_n=64, dk_trans=1, dk_block_n=128, dk_head_split=8,
                               lse_block_m=128, head_stages=4, grad_stages=3)
    return IndexerKLConfig(block_m=64, block_n=128, block_d=bd, num_warps=4, num_stages=2, chunk_rows=rows(64))


@triton.jit
def _rescaled_sum(l_i, m_i, m_safe, x):
    # the row's float64 running sum of exp(x - m) re-centred from max m_i on m_safe, plus this
    # key tile's fp32 sum (the module docstring: why float64)
    return l_i * tl.exp(m_i.to(tl.float64) - m_safe.to(tl.float64)) + tl.sum(tl.exp(x - m_safe[:, None]), 1).to(
        tl.float64)


@triton.jit
def _attn_scores(q_base, k_base, offs_m, m_ok, offs_n, n_ok, scale,
                 Q_STRIDE: tl.constexpr, K_STRIDE: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr):
    # each head-dim chunk's dot is scaled, then added: not one dot chain, which Triton lays
    # out over all warps' rows ([num_warps, 1]) because its result feeds another dot; at 8
    # warps and 64 rows that computes the tile twice, once per warp group (Triton folds
    # ``acc + dot`` back into a chain, not ``acc + dot * scale``)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for d0 in tl.static_range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        d_ok = offs_d < D
        a = tl.load(q_base + offs_m[:, None] * Q_STRIDE + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :],
                    other=0.0)
        b = tl.load(k_base + offs_n[:, None] * K_STRIDE + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0)
        acc += tl.dot(a, tl.trans(b), input_precision="ieee") * scale
    return acc


@triton.jit
def _target_tile(q_base, k_base, st_base, offs_m, m_ok, offs_n, n_ok, vis, scale,
                 H: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr):
    """sum_h exp(scale q_h . k_t - m_h) / l_h at the visible keys, 0 elsewhere."""
    P = tl.zeros((BM, BN), dtype=tl.float32)
    for h in tl.range(0, H, num_stages=STAGES):
        s = _attn_scores(q_base + h * D, k_base + (h // (H // HK)) * D, offs_m, m_ok, offs_n, n_ok, scale,
                         H * D, HK * D, D, BD, BM, BN)
        m_h = tl.load(st_base + offs_m * (2 * H) + 2 * h, mask=m_ok, other=0.0)
        inv_l = 1.0 / tl.load(st_base + offs_m * (2 * H) + 2 * h + 1, mask=m_ok, other=1.0)
        P += tl.where(vis, tl.exp(s - m_h[:, None]) * inv_l[:, None], 0.0)
    return P


@triton.jit
def _index_tile(qi_base, w_base, ki_tile, offs_m, m_ok, offs_di, di_ok,
                HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr):
    """sum_j w_j relu(qi_j . ki_t) (fp32)."""
    I = tl.zeros((BM, BN), dtype=tl.float32)
    for j in tl.range(0, HI, num_stages=STAGES):
        qj = tl.load(qi_base + offs_m[:, None] * (HI * DI) + j * DI + offs_di[None, :],
                     mask=m_ok[:, None] & di_ok[None, :], other=0.0)
        a = tl.dot(qj, tl.trans(ki_tile), input_precision="ieee")
        wj = tl.load(w_base + offs_m * HI + j, mask=m_ok, other=0.0).to(tl.float32)
        I += wj[:, None] * tl.maximum(a, 0.0)
    return I


@triton.jit
def _attn_lse_kernel(q_ptr, k_ptr, st_ptr, S, T, scale,
                     H: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest causal rows first
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    offs_m = pid_m * BM + tl.arange(0, BM)
    m_ok = offs_m < S
    q_base = q_ptr + b * S * H * D + h * D
    k_base = k_ptr + b * T * HK * D + (h // (H // HK)) * D
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float64)  # across key tiles in float64 (per row: no per-key cost)
    n_end = T
    if CAUSAL:
        n_end = tl.minimum(T, (pid_m + 1) * BM)
    for n0 in range(0, n_end, BN):
        offs_n = n0 + tl.arange(0, BN)
        n_ok = offs_n < T
        vis = m_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= offs_m[:, None])
        s = _attn_scores(q_base, k_base, offs_m, m_ok, offs_n, n_ok, scale, H * D, HK * D, D, BD, BM, BN)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = _rescaled_sum(l_i, m_i, m_safe, s)
        m_i = m_new
    tl.store(st_ptr + b * S * H * 2 + offs_m * (2 * H) + 2 * h, m_i, mask=m_ok)
    tl.store(st_ptr + b * S * H * 2 + offs_m * (2 * H) + 2 * h + 1, l_i.to(tl.float32), mask=m_ok)


@triton.jit
def _kl_fwd_kernel(q_ptr, k_ptr, qi_ptr, ki_ptr, w_ptr, st_ptr, row_ptr, rs_ptr, S, T, scale,
                   H: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr,
                   CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDI: tl.constexpr,
                   STAGES: tl.constexpr, ASTAGES: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest causal rows first
    b = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    m_ok = offs_m < S
    offs_di = tl.arange(0, BDI)
    di_ok = offs_di < DI
    q_base = q_ptr + b * S * H * D
    k_base = k_ptr + b * T * HK * D
    qi_base = qi_ptr + b * S * HI * DI
    ki_base = ki_ptr + b * T * DI
    w_base = w_ptr + b * S * HI
    st_base = st_ptr + b * S * H * 2
    m_i = tl.full((BM,), float("-inf"), tl.float32)  # the indexer's running max
    l_i = tl.zeros((BM,), dtype=tl.float64)  # sum exp(I - m), across key tiles in float64
    z_i = tl.zeros((BM,), dtype=tl.float32)  # sum P
    e_i = tl.zeros((BM,), dtype=tl.float32)  # sum P log P
    x_i = tl.zeros((BM,), dtype=tl.float32)  # sum P (I - m)
    n_end = T
    if CAUSAL:
        n_end = tl.minimum(T, (pid_m + 1) * BM)
    for n0 in range(0, n_end, BN):
        offs_n = n0 + tl.arange(0, BN)
        n_ok = offs_n < T
        vis = m_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= offs_m[:, None])
        # the target first: its head loop then runs without the index tile live (fewer registers)
        P = _target_tile(q_base, k_base, st_base, offs_m, m_ok, offs_n, n_ok, vis, scale, H, HK, D, BD, BM, BN,
                         ASTAGES)
        ki_tile = tl.load(ki_base + offs_n[:, None] * DI + offs_di[None, :], mask=n_ok[:, None] & di_ok[None, :],
                          other=0.0)
        I = _index_tile(qi_base, w_base, ki_tile, offs_m, m_ok, offs_di, di_ok, HI, DI, BM, BN, STAGES)
        I = tl.where(vis, I, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(I, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        m_old = tl.where(m_i == float("-inf"), m_safe, m_i)
        # re-centre the running sums on the new max (z_i is 0 while m_i is -inf)
        x_i = x_i + z_i * (m_old - m_safe)
        l_i = _rescaled_sum(l_i, m_i, m_safe, I)
        z_i += tl.sum(P, 1)
        e_i += tl.sum(tl.where(P > 0.0, P * tl.log(P), 0.0), 1)
        x_i += tl.sum(tl.where(vis, P * (I - m_safe[:, None]), 0.0), 1)
        m_i = m_new
    l32 = l_i.to(tl.float32)
    row = (e_i - x_i) / z_i - tl.log(z_i) + tl.log(l32)
    tl.store(row_ptr + b * S + offs_m, row, mask=m_ok)
    tl.store(rs_ptr + b * S * 3 + offs_m * 3, m_i, mask=m_ok)
    tl.store(rs_ptr + b * S * 3 + offs_m * 3 + 1, l32, mask=m_ok)
    tl.store(rs_ptr + b * S * 3 + offs_m * 3 + 2, z_i, mask=m_ok)


@triton.jit
def _kl_dI_kernel(q_ptr, k_ptr, qi_ptr, ki_ptr, w_ptr, st_ptr, rs_ptr, g_ptr, dI_ptr, r0, S, T, scale,
                  CHUNK: tl.constexpr, H: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HI: tl.constexpr,
                  DI: tl.constexpr, CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                  BDI: tl.constexpr, STAGES: tl.constexpr, ASTAGES: tl.constexpr):
    # one (key tile, query tile) per program: the tiles of dI are independent given the row
    # statistics, so the grid covers the chunk's whole [rows, T] strip at once
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    n0 = pid_n * BN
    live = n0 < T
    if CAUSAL:
        live = n0 <= r0 + pid_m * BM + BM - 1
    if live:
        offs_m = r0 + pid_m * BM + tl.arange(0, BM)
        m_ok = offs_m < S
        offs_di = tl.arange(0, BDI)
        di_ok = offs_di < DI
        offs_n = n0 + tl.arange(0, BN)
        n_ok = offs_n < T
        vis = m_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            vis = vis & (offs_n[None, :] <= offs_m[:, None])
        g = tl.load(g_ptr)
        m_i = tl.load(rs_ptr + b * S * 3 + offs_m * 3, mask=m_ok, other=0.0)
        inv_l = 1.0 / tl.load(rs_ptr + b * S * 3 + offs_m * 3 + 1, mask=m_ok, other=1.0)
        inv_z = 1.0 / tl.load(rs_ptr + b * S * 3 + offs_m * 3 + 2, mask=m_ok, other=1.0)
        ki_tile = tl.load(ki_ptr + b * T * DI + offs_n[:, None] * DI + offs_di[None, :],
                          mask=n_ok[:, None] & di_ok[None, :], other=0.0)
        I = _index_tile(qi_ptr + b * S * HI * DI, w_ptr + b * S * HI, ki_tile, offs_m, m_ok, offs_di, di_ok, HI, DI,
                        BM, BN, STAGES)
        P = _target_tile(q_ptr + b * S * H * D, k_ptr + b * T * HK * D, st_ptr + b * S * H * 2, offs_m, m_ok,
                         offs_n, n_ok, vis, scale, H, HK, D, BD, BM, BN, ASTAGES)
        dI = tl.where(vis, g * (tl.exp(I - m_i[:, None]) * inv_l[:, None] - P * inv_z[:, None]), 0.0)
        tl.store(dI_ptr + b * CHUNK * T + (offs_m - r0)[:, None] * T + offs_n[None, :], dI,
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _kl_dq_kernel(qi_ptr, ki_ptr, w_ptr, dI_ptr, dqi_ptr, dw_ptr, r0, r1, S, T,
                  CHUNK: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr, CAUSAL: tl.constexpr, G: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BDI: tl.constexpr, STAGES: tl.constexpr):
    # the dots' rows are G heads x BM query rows (row r: head pid_g * G + r // BM, query
    # r % BM): one key tile and one dI tile serve G heads, and the dots are G times taller.
    # the workspace is 0 wherever the dI kernel did not write, so dI loads need only the
    # bounds (vector loads; the causal mask per element splits them into 4-byte copies)
    pid_g = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_r = tl.arange(0, G * BM)
    j = pid_g * G + offs_r // BM
    offs_m = r0 + pid_m * BM + offs_r % BM
    m_ok = offs_m < r1
    offs_di = tl.arange(0, BDI)
    di_ok = offs_di < DI
    qi_base = qi_ptr + b * S * HI * DI
    ki_base = ki_ptr + b * T * DI
    qj = tl.load(qi_base + offs_m[:, None] * (HI * DI) + j[:, None] * DI + offs_di[None, :],
                 mask=m_ok[:, None] & di_ok[None, :], other=0.0)
    wj = tl.load(w_ptr + b * S * HI + offs_m * HI + j, mask=m_ok, other=0.0).to(tl.float32)
    dI_base = dI_ptr + b * CHUNK * T + (offs_m - r0)[:, None] * T
    dq = tl.zeros((G * BM, BDI), dtype=tl.float32)
    dw = tl.zeros((G * BM,), dtype=tl.float32)
    n_end = T
    if CAUSAL:
        n_end = tl.minimum(T, r0 + (pid_m + 1) * BM)
    for n0 in tl.range(0, n_end, BN, num_stages=STAGES):
        offs_n = n0 + tl.arange(0, BN)
        n_ok = offs_n < T
        ki_tile = tl.load(ki_base + offs_n[:, None] * DI + offs_di[None, :], mask=n_ok[:, None] & di_ok[None, :],
                          other=0.0)
        dI = tl.load(dI_base + offs_n[None, :], mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        a = tl.dot(qj, tl.trans(ki_tile), input_precision="ieee")
        dw += tl.sum(dI * tl.maximum(a, 0.0), 1)
        da = tl.where(a > 0.0, dI * wj[:, None], 0.0)
        dq = tl.dot(da.to(ki_tile.dtype), ki_tile, acc=dq, input_precision="ieee")
    tl.store(dqi_ptr + b * S * HI * DI + offs_m[:, None] * (HI * DI) + j[:, None] * DI + offs_di[None, :],
             dq.to(dqi_ptr.dtype.element_ty), mask=m_ok[:, None] & di_ok[None, :])
    tl.store(dw_ptr + b * S * HI + offs_m * HI + j, dw.to(dw_ptr.dtype.element_ty), mask=m_ok)


@triton.jit
def _kl_dk_kernel(qi_ptr, ki_ptr, w_ptr, dI_ptr, dki_ptr, r0, r1, S, T, B,
                  CHUNK: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr, HSPLIT: tl.constexpr, CAUSAL: tl.constexpr,
                  G: tl.constexpr, TRANS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BDI: tl.constexpr, STAGES: tl.constexpr):
    # heads in HSPLIT groups, each with its own partial sum (dki_ptr [HSPLIT, B, T, Di]),
    # summed in a fixed order afterwards: more programs where a chunk sees few key tiles.
    # The dots' rows are G heads x BM query rows (row r: head offset r // BM, query r % BM),
    # so the key gradient's dot reduces over G * BM (head, query) pairs at once.
    # TRANS: key-major, as flash attention's dK: a^T = ki . qi_j^T is [BN, G * BM], and
    # da^T enters the dki dot from registers (no transpose of da through shared memory)
    pid_n = tl.program_id(0)
    grp = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < T
    offs_di = tl.arange(0, BDI)
    di_ok = offs_di < DI
    offs_r = tl.arange(0, G * BM)
    qi_base = qi_ptr + b * S * HI * DI
    w_base = w_ptr + b * S * HI
    ki_tile = tl.load(ki_ptr + b * T * DI + offs_n[:, None] * DI + offs_di[None, :],
                      mask=n_ok[:, None] & di_ok[None, :], other=0.0)
    dk_ptrs = dki_ptr + (grp * B + b) * T * DI + offs_n[:, None] * DI + offs_di[None, :]
    dk_mask = n_ok[:, None] & di_ok[None, :]
    dk = tl.load(dk_ptrs, mask=dk_mask, other=0.0)
    m_start = r0
    if CAUSAL:
        # the chunk's first query tile that sees this key tile (tiles are BM-aligned from r0)
        m_start = tl.maximum(r0, r0 + ((pid_n * BN - r0) // BM) * BM)
    for m0 in range(m_start, r1, BM):
        offs_m = m0 + offs_r % BM
        m_ok = offs_m < r1
        # (bounds masks only: the workspace is 0 past the diagonal, as in _kl_dq_kernel)
        if TRANS:
            dI_ptrs = dI_ptr + b * CHUNK * T + (offs_m - r0)[None, :] * T + offs_n[:, None]
            dI = tl.load(dI_ptrs, mask=n_ok[:, None] & m_ok[None, :], other=0.0)
        else:
            dI_ptrs = dI_ptr + b * CHUNK * T + (offs_m - r0)[:, None] * T + offs_n[None, :]
            dI = tl.load(dI_ptrs, mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        for jj in tl.range(0, HI // HSPLIT // G, num_stages=STAGES):
            j = grp * (HI // HSPLIT) + jj * G + offs_r // BM
            qj = tl.load(qi_base + offs_m[:, None] * (HI * DI) + j[:, None] * DI + offs_di[None, :],
                         mask=m_ok[:, None] & di_ok[None, :], other=0.0)
            wj = tl.load(w_base + offs_m * HI + j, mask=m_ok, other=0.0).to(tl.float32)
            if TRANS:
                a_t = tl.dot(ki_tile, tl.trans(qj), input_precision="ieee")
                da_t = tl.where(a_t > 0.0, dI * wj[None, :], 0.0)
                dk = tl.dot(da_t.to(qj.dtype), qj, acc=dk, input_precision="ieee")
            else:
                a = tl.dot(qj, tl.trans(ki_tile), input_precision="ieee")
                da = tl.where(a > 0.0, dI * wj[:, None], 0.0)
                dk = tl.dot(tl.trans(da.to(qj.dtype)), qj, acc=dk, input_precision="ieee")
    tl.store(dk_ptrs, dk, mask=dk_mask)


# Set by ``benchmarks/bench_indexer_kl.py --inspect`` (no GPU): the launches compile for the
# current target (``warmup``) and append (kernel name, compiled kernel) here instead of running.
_WARMUP: Optional[list] = None


def _launch(kernel, grid, *args, **kwargs):
    if _WARMUP is not None:
        _WARMUP.append((kernel.fn.__name__, kernel.warmup(*args, grid=grid, **kwargs)))
        return
    kernel[grid](*args, **kwargs)


def _prepare(q, k, qi, ki, w, lse, causal):
    check_operands(q, k, qi, ki, w, lse, causal)
    if _next_pow2(qi.shape[3]) > 256:
        raise SpecError(f"dense_indexer_kl: the Triton kernels take an indexer head dim up to 256, got {qi.shape[3]}")
    from .triton_codegen import check_interpreter_mode

    interp = check_interpreter_mode()
    if q.device.type != "cuda" and not interp and _WARMUP is None:
        raise SpecError(f"dense_indexer_kl: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), q is on "
                        f"{q.device}")
    return [t.contiguous() for t in (q, k, qi, ki, w)], interp


def _resolve(cfg: Optional[IndexerKLConfig], q, qi, T, interp) -> IndexerKLConfig:
    cfg = cfg or default_config(q, qi, T, interpret=interp)
    if cfg.chunk_rows % cfg.block_m:
        raise SpecError(f"IndexerKLConfig: chunk_rows {cfg.chunk_rows} is not a multiple of block_m {cfg.block_m}")
    for name in ("block_m", "block_n", "dk_block_n", "dq_heads", "dk_heads"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise SpecError(f"IndexerKLConfig: {name} must be a power of two, got {v}")
    for name in ("dq_block_m", "dq_block_n", "lse_block_m"):
        v = getattr(cfg, name)
        if v < 0 or v & (v - 1):
            raise SpecError(f"IndexerKLConfig: {name} must be 0 (the default tile) or a power of two, got {v}")
    return cfg


def attention_stats_triton(q, k, scale: float, causal: bool, cfg: Optional[IndexerKLConfig] = None) -> torch.Tensor:
    """The attention's softmax statistics over each row's visible keys, [B, S, H, 2] fp32:
    the max m and the sum l of exp(s - m) (lse = m + log l)."""
    B, S, H, D = q.shape
    T, HK = k.shape[1], k.shape[2]
    cfg = cfg or default_config(q, q, T)
    stats = torch.empty((B, S, H, 2), dtype=torch.float32, device=q.device)
    bm = cfg.lse_block_m or cfg.block_m
    _launch(_attn_lse_kernel, (triton.cdiv(S, bm), B * H),
            q.contiguous(), k.contiguous(), stats, S, T, float(scale), H=H, HK=HK, D=D, CAUSAL=bool(causal),
            BM=bm, BN=cfg.block_n, BD=cfg.block_d,
            num_warps=cfg.lse_num_warps or cfg.num_warps,
            num_stages=cfg.num_stages)
    return stats


def indexer_kl_triton_forward(q, k, qi, ki, w, lse: Optional[torch.Tensor], scale: float, causal: bool,
                              loss_coeff: float, cfg: Optional[IndexerKLConfig] = None
                              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss 0-d fp32, the attention's (m, l) [B,S,H,2] used, the rows' (m_I, l_I, Z) [B,S,3])
    (``indexer_kl_reference.indexer_kl_forward``'s statistics)."""
    (q, k, qi, ki, w), interp = _prepare(q, k, qi, ki, w, lse, causal)
    B, S, H, D = q.shape
    T, HK = k.shape[1], k.shape[2]
    HI, DI = qi.shape[2], qi.shape[3]
    cfg = _resolve(cfg, q, qi, T, interp)
    stats = attention_stats_triton(q, k, scale, causal, cfg) if lse is None else attention_stats(lse)
    rows = torch.empty((B, S), dtype=torch.float32, device=q.device)
    row_stats = torch.empty((B, S, 3), dtype=torch.float32, device=q.device)
    _launch(_kl_fwd_kernel, (triton.cdiv(S, cfg.block_m), B),
            q, k, qi, ki, w, stats, rows, row_stats, S, T, float(scale), H=H, HK=HK, D=D, HI=HI, DI=DI,
            CAUSAL=bool(causal), BM=cfg.block_m, BN=cfg.block_n, BD=cfg.block_d, BDI=max(16, _next_pow2(DI)),
            STAGES=cfg.head_stages or None, ASTAGES=cfg.attn_stages or None,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    loss = (rows.double().sum() * (loss_coeff / (B * S))).float()  # one rounding (the reference's comment)
    return loss, stats, row_stats


def indexer_kl_triton_backward(grad, q, k, qi, ki, w, stats, row_stats, scale: float, causal: bool, loss_coeff: float,
                               cfg: Optional[IndexerKLConfig] = None):
    """(grad qi, grad ki, grad w) in the operands' dtypes, from the forward's statistics."""
    (q, k, qi, ki, w), interp = _prepare(q, k, qi, ki, w, None, causal)
    check_stats(q, stats, row_stats)
    B, S, H, D = q.shape
    T, HK = k.shape[1], k.shape[2]
    HI, DI = qi.shape[2], qi.shape[3]
    cfg = _resolve(cfg, q, qi, T, interp)
    BDI = max(16, _next_pow2(DI))
    g = (grad.detach().to(device=q.device, dtype=torch.float64) * (loss_coeff / (B * S))).float().reshape(())
    stats, row_stats = stats.contiguous(), row_stats.contiguous()
    chunk = min(cfg.chunk_rows, triton.cdiv(S, cfg.block_m) * cfg.block_m)
    # zeroed: what the dI kernel leaves unwritten (key tiles past a query tile's diagonal) it
    # leaves unwritten in every later chunk too (their diagonals lie further right), so it stays 0
    dI = torch.zeros((B, chunk, T), dtype=torch.float32, device=q.device)
    dqi = torch.empty_like(qi)
    dw = torch.empty_like(w)
    hsplit = cfg.dk_head_split if HI % cfg.dk_head_split == 0 else 1
    # head stacks that do not divide the heads (or a split's share) fall back to one head
    dq_g = cfg.dq_heads if HI % cfg.dq_heads == 0 else 1
    dk_g = cfg.dk_heads if (HI // hsplit) % cfg.dk_heads == 0 else 1
    dki = torch.zeros((hsplit, B, T, DI), dtype=torch.float32, device=q.device)
    meta = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    for r0 in range(0, S, chunk):
        r1 = min(S, r0 + chunk)
        tiles = triton.cdiv(r1 - r0, cfg.block_m)
        n_tiles = triton.cdiv(min(T, r1) if causal else T, cfg.block_n)
        _launch(_kl_dI_kernel, (n_tiles, tiles, B),
                q, k, qi, ki, w, stats, row_stats, g, dI, r0, S, T, float(scale), CHUNK=chunk, H=H, HK=HK, D=D, HI=HI,
                DI=DI, CAUSAL=bool(causal), BM=cfg.block_m, BN=cfg.block_n, BD=cfg.block_d, BDI=BDI,
                STAGES=cfg.head_stages or None, ASTAGES=cfg.attn_stages or None, **meta)
        dq_bm = cfg.dq_block_m or cfg.block_m
        _launch(_kl_dq_kernel, (HI // dq_g, triton.cdiv(r1 - r0, dq_bm), B),
                qi, ki, w, dI, dqi, dw, r0, r1, S, T, CHUNK=chunk, HI=HI, DI=DI, CAUSAL=bool(causal), G=dq_g,
                BM=dq_bm, BN=cfg.dq_block_n or cfg.block_n, BDI=BDI,
                STAGES=cfg.grad_stages or None, **meta)
        _launch(_kl_dk_kernel, (triton.cdiv(min(T, r1) if causal else T, cfg.dk_block_n), hsplit, B),
                qi, ki, w, dI, dki, r0, r1, S, T, B, CHUNK=chunk, HI=HI, DI=DI, HSPLIT=hsplit, CAUSAL=bool(causal),
                G=dk_g, TRANS=bool(cfg.dk_trans), BM=cfg.block_m, BN=cfg.dk_block_n,
                BDI=BDI, STAGES=cfg.grad_stages or None, **meta)
    dk = dki[0]
    for i in range(1, hsplit):  # the groups' partial sums in a fixed order
        dk = dk + dki[i]
    return dqi, dk.to(ki.dtype), dw
