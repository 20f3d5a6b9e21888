"""Does selection overlapped with scoring pay? A warp-specialized HyTopK at the DSA shape
(Gluon, one Hopper GPU; ``--compile-only`` builds for sm_90 anywhere).

    python benchmarks/calibrate_gluon_ws.py [--seq 32768,131072] [--inputs iid,struct] [--selectors 1,1:bits,2]
    python benchmarks/calibrate_gluon_ws.py --compile-only --selectors 1,2    # registers, spills, SASS
    WS_WIN=8192 python benchmarks/calibrate_gluon_ws.py ...                  # bigger halves (see WIN)
    WS_NH=4 python benchmarks/calibrate_gluon_ws.py --selectors 1:p [--power 3]  # v22's sampled estimate

(WS_NH: halves in the ring, 2 by default; WS_Z, WS_ESLK: the estimate's z and search slack;
--power: each unsorted row also back to back under nvidia-smi, for its SM clock and power.)

The structural step of docs/kernel-design.md ("Where things stand after session 11"): in the
generated Triton kernel each program scores, then stops scoring to compact its candidate
buffers. Here one program per SM has warp groups with different jobs (``gl.warp_specialize``;
docs/kernel-design.md, v21, has the measurements):

* the scorer (4 warps, the default partition): TMA key tiles in a 3-stage ring, one wgmma
  per tile (64 keys x 256 columns = 4 query rows x 64 heads, in the Triton kernel's column
  order so that the head sum stays inside each thread), ReLU, weights, head sum, causal mask,
  packed int64 keys, and the threshold filter; a taken key is appended to its (row, lane)
  slot of the current *half* of the row's buffer (64 lanes x SUBH slots, in global scratch).
  When a lane could overflow (or the block ends) it hands the half over (an mbarrier) and
  goes on with the other half;
* the selector (4 warps, a worker partition; or two, one per row pair): for each half handed
  over, each row's kept keys (<= k + slack) and the half's keys are one window of WIN slots
  ([WIN / 64 slot rows, 64 lanes]); a count search finds a threshold that keeps k .. k +
  slack of them (exactly k for the block's last half): one bit per pass (the Triton kernel's
  ``_kth_largest``) or v19's bracketing (regula falsi in value space, or in score-bits space);
  the kept keys go back to the kept area (or, at the end, are written out as indices and
  fp32 values), and the new thresholds are published with the half's release. With two
  selectors (144 registers each) the search holds only the keys' high words and the keys are
  read again for the stores, a chunk at a time.

The scorer reads a threshold only after an mbarrier wait that orders it (the release of the
half it is about to fill), so it filters with a threshold at most one handoff old; a stale
threshold only takes more keys. Exactness is the Triton kernel's argument unchanged: a key
is dropped only when k kept keys beat it.

``:p`` (v22, docs/kernel-design.md): a sampled threshold estimate. The scorer scores every
P-th key of the *next* block (a second TMA descriptor with a row stride of P keys) into a
sample area and hands it over as a half of its own; the selector finds each row's j-th best
sampled key (j = ceil(e + z sqrt(e)), e = k m / n) and publishes it; the scorer waits for it
(an mbarrier the selector arrives on after each sample) before it starts that block, whose
keys then all come in index order and are taken only when they score >= the estimate. So
every kept key scores >= it, and a row is exact iff k keys arrived: the selector checks
that at the block's last half and flags the block otherwise; the host redoes flagged blocks
without the estimate (a second launch over a block list). Blocks alternate long and short
(the heaviest and lightest left), so that an SM's selector catches up on a short block's
selection while its scorer is in a long one.

Output: indices (int32) and values unsorted, then the library's ``sort_rows_``. Checked with
bench_hytopk's float64 threshold check on sampled rows, and against the library op's
selection (the fraction of rows with the same set). Prints a table last, then a profile of a
PROFILE build (cycles the scorer waits for a free half, the selector's busy cycles, halves per
block, the selector's load / search / store kcycles per row compaction, passes per search).
Batch 1, causal, S a multiple of 4 and >= k; no masks beyond causal; not a library kernel.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from gluon_common import _add, _highest_bit  # noqa: E402

C = gl.constexpr
H, D, BM, BN = C(64), C(128), C(4), C(64)
NC = C(BM * H)                   # dot columns: 4 query rows x 64 heads
TOPK, SLACK = C(2048), C(128)
KBASE = C(TOPK + SLACK)          # kept slots per row
# a compaction's window: the kept slots + one half (WS_WIN=8192: halves of 94 slots per
# lane, fewer and longer compactions, the keys read again for the stores)
WIN = C(int(os.environ.get("WS_WIN", "4096")))
KROWS = C(KBASE // BN)           # slot rows of the kept area (34)
SUBH = C((WIN - KBASE) // BN)    # slots per lane in a half (30 at WIN = 4096)
# halves in the ring between the scorer and the selector (v22's samples take a half of their
# own at each block's start: measured with WS_NH=4; the default 2 is v21's)
NH = C(int(os.environ.get("WS_NH", "2")))
ROWSTRIDE = C(max(2 * WIN, KBASE + NH * SUBH * BN))  # per row: [kept KBASE][half 0][half 1]...
CH_ROWS = C(32)                  # slot rows per chunk of the stores when the keys are read again
STAGES = C(3)
# v22 (docs/kernel-design.md): the sampled estimate. A block whose first row has at least
# SAMPLE_MIN keys gets one: every P-th key scored one block ahead, the estimate the sample's
# j-th best with j = ceil(e + ZEST sqrt(e)), e = k m / n, found within ESLK keys
ZEST = C(float(os.environ.get("WS_Z", "3.5")))
ESLK = C(int(os.environ.get("WS_ESLK", "16")))
SAMPLE_MIN = C(3 * 2048)
EMPTY = C(-9223372036854775807)
# registers per thread at launch (one program per SM): 8 warps x 32 x 256 with one selector,
# 12 x 32 x 168 with two; then setmaxnreg moves them between the partitions
MAXNREG = {1: 256, 2: 168}
# per selector thread (the scorer gets the rest); (2, True): weights in shared memory, the
# selectors' keys in registers
SEL_REGS = {(1, False): 248, (2, False): 144, (1, True): 248, (2, True): int(os.environ.get("WS_SEL_REGS", "168"))}


# ------------------------------------------------------------------------------------------
# keys (triton_keys' functions; Gluon cannot call triton.jit functions)
# ------------------------------------------------------------------------------------------
@gluon.jit
def _pack(y, keys):
    y = gl.where(y == 0.0, 0.0, y)
    y = gl.where(y != y, float("nan"), y)
    b = y.to(gl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    return (b.to(gl.int64) << 32) | (4294967295 - keys.to(gl.int64))


@gluon.jit
def _unpack_value(p):
    hi = (p >> 32).to(gl.int32)
    b = hi ^ ((hi >> 31) & 0x7FFFFFFF)
    return b.to(gl.float32, bitcast=True)


@gluon.jit
def _clock():
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _opaque_zero():
    # 0, unknown to the compiler: offsets derived from it are computed where they are used
    # instead of being hoisted out of the selector's loop (32 registers each per thread)
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _block_of(BLOCKS, num_blocks, j, LIST: gl.constexpr, MIX: gl.constexpr):
    # row block of the j-th claim: heaviest first, or (a redo) from a list. MIX (v22): the
    # heaviest and the lightest blocks left, alternately. A block's selection costs about the
    # same whatever its length (a sample, a final compaction, one or two in-loop ones), its
    # scoring grows with it: short blocks are selector-bound, long ones leave the selector
    # idle. Alternating them lets the selector catch up on a short block while the scorer is
    # in a long one, instead of the short ones making a selector-bound tail.
    if LIST:
        mb = gl.load(BLOCKS + j)
    else:
        mb = num_blocks - 1 - j
        if MIX:
            mb = gl.where(j % 2 == 0, num_blocks - 1 - j // 2, j // 2)
    return mb


@gluon.jit
def _sample_tiles(r0, P):
    # sample tiles of the block whose first row is r0: every P-th key up to its last row
    return ((r0 + BM - 1) // P + 1 + BN - 1) // BN


@gluon.jit
def _clock_after(x):
    # the cycle counter once x (int64 scalar) is known
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,l", [x], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _prof_add(PROF, slot: gl.constexpr, delta, PROFILE: gl.constexpr):
    # PROFILE: per-program counters (one thread's load and store: the value is uniform)
    if PROFILE:
        p = PROF + gl.program_id(0) * 16 + slot
        gl.store(p, gl.load(p) + delta)


@gluon.jit
def _sum2(x):
    return gl.sum(gl.sum(x, axis=1), axis=0)


@gluon.jit
def _as_hi(u):
    # score bits (u space, uint32 or int64 holding one) -> the signed high word of the keys
    # with those bits: the window's counts compare hi >= _as_hi(c)
    return (u.to(gl.uint32) ^ 2147483648).to(gl.int32, bitcast=True)


@gluon.jit
def _u_value(u):
    # score bits (uint32 scalar, u = hi ^ 0x80000000) -> the fp32 score they encode
    h = _as_hi(u)
    return (h ^ ((h >> 31) & 0x7FFFFFFF)).to(gl.float32, bitcast=True)


@gluon.jit
def _value_u(y):
    # fp32 scalar -> its score bits as int64 (_u_value's inverse)
    b = y.to(gl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    return (b ^ -2147483648).to(gl.uint32, bitcast=True).to(gl.int64)


@gluon.jit
def _bracket_search(hi, umin, umax, n, KEEP, SLK: gl.constexpr, USPACE: gl.constexpr):
    # v19's search (docs/kernel-design.md; triton_codegen at commit 0569e64): [lo, hi_u)
    # holds the answer, #{u >= lo} = n_lo >= KEEP > #{u >= hi_u}; each pass counts above the
    # score value that a line through the bracket's ends puts in the middle of the wanted
    # counts (regula falsi in value space, Illinois-weighted), or the bracket's midpoint in
    # bits after two passes that did not halve it. USPACE: the line in score-bits space
    # instead (fp32 bits are close to a log scale: robust to a long upper tail). Returns
    # (lo as uint32, n_lo).
    lo = umin.to(gl.int64)
    hu = umax.to(gl.int64) + 1
    n_lo = n
    t = KEEP + SLK * 0.5 + 0.5
    f_lo = n_lo.to(gl.float32) - t
    f_hi = gl.zeros([], dtype=gl.float32) - t
    side = gl.zeros([], dtype=gl.int32)
    slow = gl.zeros([], dtype=gl.int32)
    passes = gl.zeros([], dtype=gl.int32)
    while (n_lo > KEEP + SLK) & (hu - lo > 1):
        passes += 1
        w = hu - lo
        if USPACE:
            c = lo + ((f_lo / (f_lo - f_hi)) * (w - 1).to(gl.float32)).to(gl.int64)
            c = gl.where(slow >= 2, lo + w // 2, c)
        else:
            v_lo = _u_value(lo.to(gl.uint32))
            v_hi = _u_value((hu - 1).to(gl.uint32))
            v = v_lo + (f_lo / (f_lo - f_hi)) * (v_hi - v_lo)
            c = gl.where((slow >= 2) | (v != v) | (gl.abs(v) == float("inf")), lo + w // 2, _value_u(v))
        c = gl.minimum(gl.maximum(c, lo + 1), hu - 1)
        n_c = _sum2((hi >= _as_hi(c)).to(gl.int32))
        up = n_c >= KEEP
        f_c = n_c.to(gl.float32) - t
        f_hi = gl.where(up & (side == 1), f_hi * 0.5, gl.where(up, f_hi, f_c))
        f_lo = gl.where(up, f_c, gl.where(side == 2, f_lo * 0.5, f_lo))
        lo = gl.where(up, c, lo)
        n_lo = gl.where(up, n_c, n_lo)
        hu = gl.where(up, hu, c)
        side = gl.where(up, 1, 2)
        slow = gl.where((hu - lo) * 2 > w, slow + 1, 0)
    return lo.to(gl.uint32), n_lo, passes


@gluon.jit
def _two_search(hi, umin, umax, n, KEEP, SLK: gl.constexpr, v0, dens):
    # Two guesses per pass, counted in one reduction (two counts <= 4,096 packed in an int32):
    # the line through the bracket's ends at two count targets inside [KEEP, KEEP + SLK]
    # (SLK > 0), or straddling KEEP by a margin that shrinks with the bracket (SLK = 0, the
    # exact search); a pass that did not halve the bracket puts the second guess at its
    # midpoint in bits. The first pass takes its guesses from the row's previous compaction
    # when there was one (v0: the score where that search ended, dens: keys per unit score
    # there; the window's n keys are taken to be all above v0). A CPU replay on real DSA
    # scores (benchmarks/simulate_ws_search.py) gave 2.5 / 4.5 passes in-loop / final on iid
    # inputs and 3.1 / 4.6 on structured ones, against 4.2 / 6.9 and 6.1 / 8.9 for v19's
    # search. Returns (lo, n_lo, passes, hi, n_hi): the final bracket [lo, hi).
    lo = umin.to(gl.int64)
    hu = umax.to(gl.int64) + 1
    n_lo = n
    n_hi = gl.zeros([], dtype=gl.int32)
    passes = gl.zeros([], dtype=gl.int32)
    slow = gl.zeros([], dtype=gl.int32)
    while (n_lo > KEEP + SLK) & (hu - lo > 1):
        passes += 1
        w = hu - lo
        if SLK == 0:
            m = gl.maximum((n_lo - n_hi).to(gl.float32) * 0.0625, 1.0)
            t1 = KEEP + 0.5 + m
            t2 = KEEP + 0.5 - m
        else:
            t1 = gl.zeros([], dtype=gl.float32) + (KEEP + 0.25 * SLK)
            t2 = gl.zeros([], dtype=gl.float32) + (KEEP + 0.75 * SLK)
        v_lo = _u_value(lo.to(gl.uint32))
        v_hi = _u_value((hu - 1).to(gl.uint32))
        span = gl.maximum(n_lo - n_hi, 1).to(gl.float32)
        warm = (passes == 1) & (dens > 0.0)
        g1 = gl.where(warm, v0 + (n.to(gl.float32) - t1) / dens, v_lo + (n_lo.to(gl.float32) - t1) / span * (v_hi - v_lo))
        g2 = gl.where(warm, v0 + (n.to(gl.float32) - t2) / dens, v_lo + (n_lo.to(gl.float32) - t2) / span * (v_hi - v_lo))
        c1 = gl.where((g1 != g1) | (gl.abs(g1) == float("inf")), lo + w // 2, _value_u(g1))
        c2 = gl.where((g2 != g2) | (gl.abs(g2) == float("inf")) | (slow >= 1), lo + w // 2, _value_u(g2))
        c1 = gl.minimum(gl.maximum(c1, lo + 1), hu - 1)
        c2 = gl.minimum(gl.maximum(c2, lo + 1), hu - 1)
        both = _sum2((hi >= _as_hi(c1)).to(gl.int32) + ((hi >= _as_hi(c2)).to(gl.int32) << 16))
        n1 = both & 65535
        n2 = both >> 16
        up = (n1 >= KEEP) & (c1 > lo)
        dn = (n1 < KEEP) & (c1 < hu)
        lo = gl.where(up, c1, lo)
        n_lo = gl.where(up, n1, n_lo)
        hu = gl.where(dn, c1, hu)
        n_hi = gl.where(dn, n1, n_hi)
        up = (n2 >= KEEP) & (c2 > lo)
        dn = (n2 < KEEP) & (c2 < hu)
        lo = gl.where(up, c2, lo)
        n_lo = gl.where(up, n2, n_lo)
        hu = gl.where(dn, c2, hu)
        n_hi = gl.where(dn, n2, n_hi)
        slow = gl.where((hu - lo) * 2 > w, slow + 1, 0)
    return lo.to(gl.uint32), n_lo, passes, hu, n_hi


@gluon.jit
def _kth_largest(SCR, win, hi, n, KEEP, SLK: gl.constexpr, SEARCH: gl.constexpr, v0, dens):
    # triton_codegen._kth_largest over a [rows, lanes] window: a key kth with
    # KEEP <= #{valid keys >= kth} <= KEEP + SLK (exactly KEEP when SLK = 0), n > KEEP
    # distinct valid keys; returns (kth, count). The search counts on the keys' high words
    # (hi, signed int32: the same order as the unsigned score bits u = hi ^ 0x80000000),
    # so only the high words are held (the selector's registers are few); empty slots
    # (hi = INT32_MIN) never count. The whole keys are read only for a tie (win: the
    # window's description, _window's arguments, so that no addresses stay live).
    valid = hi != -2147483648  # (no real key has this high word: it would be a negative NaN)
    smin = gl.min(gl.min(gl.where(valid, hi, 2147483647), axis=1), axis=0)
    smax = gl.max(gl.max(hi, axis=1), axis=0)
    umin = (smin ^ -2147483648).to(gl.uint32, bitcast=True)
    umax = (smax ^ -2147483648).to(gl.uint32, bitcast=True)
    hu = umax.to(gl.int64) + 1
    n_hi = gl.zeros([], dtype=gl.int32)
    if SEARCH == 3:
        prefix, n_ge, passes, hu, n_hi = _two_search(hi, umin, umax, n, KEEP, SLK, v0, dens)
    elif SEARCH > 0:
        prefix, n_ge, passes = _bracket_search(hi, umin, umax, n, KEEP, SLK, SEARCH == 2)
    else:
        hbu = _highest_bit(umin ^ umax).to(gl.uint32)
        bit = gl.where(umin == umax, 0, gl.full([], 1, gl.uint32) << hbu)
        prefix = gl.where(umin == umax, umin, ((umin >> hbu) >> 1) << 1 << hbu)
        n_ge = n
        passes = gl.zeros([], dtype=gl.int32)
        while (bit > 0) & (n_ge > KEEP + SLK):
            passes += 1
            n_c = _sum2((hi >= _as_hi(prefix | bit)).to(gl.int32))
            prefix = gl.where(n_c >= KEEP, prefix | bit, prefix)
            n_ge = gl.where(n_c >= KEEP, n_c, n_ge)
            bit = bit >> 1
    ps = _as_hi(prefix)
    kth = ps.to(gl.int64) << 32
    if n_ge > KEEP + SLK:
        # the boundary score is shared by more keys than may be kept: by index (low words)
        eq = valid & (hi == ps)
        srow, lane, m_r, lc, h, base = win
        eq_unused, addr = _window(srow, lane, m_r, lc, h, base)
        keys = gl.load(SCR + addr, mask=eq, other=EMPTY)
        n_eq = _sum2(gl.where(eq, 1, 0))
        need = KEEP - (n_ge - n_eq)
        kth = gl.min(gl.min(gl.where(eq, keys, 9223372036854775807), axis=1), axis=0)
        if n_eq > need:
            low = keys & 4294967295
            lp = gl.zeros([], dtype=gl.int64)
            lstep = gl.zeros([], dtype=gl.int64) + 2147483648
            for _ in range(32):
                cand = lp + lstep
                cc = _sum2(gl.where(eq & (low >= cand), 1, 0))
                lp = gl.where(cc >= need, cand, lp)
                lstep = lstep // 2
            kth = gl.max(gl.max(gl.where(eq & (low == lp), keys, EMPTY), axis=1), axis=0)
        n_ge = gl.zeros([], dtype=gl.int32) + KEEP
    # (the final bracket's density of keys per unit score: the next search's first guess)
    v_a = _u_value(prefix)
    v_b = _u_value((hu - 1).to(gl.uint32))
    dens_out = gl.where(v_b > v_a, (n_ge - n_hi).to(gl.float32) / (v_b - v_a), 0.0)
    return kth, n_ge, passes, v_a, dens_out


@gluon.jit
def _window(srow, lane, m_r, lc, h, base):
    # which slots of slot rows srow hold keys, and where they are (see _selector)
    offs2 = srow[:, None] * BN + lane[None, :]
    is_kept = (srow < KROWS)[:, None]
    valid = gl.where(is_kept, offs2 < m_r, (srow[:, None] - KROWS) < lc[None, :])
    return valid, base + offs2 + gl.where(is_kept, 0, h * (SUBH * BN))


@gluon.jit
def _emit(keys, keep, pos, fin, SCR, base, OUT_I, OUT_V, row):
    # kept keys to their positions: the output row (the block's last half) or the kept area
    if fin != 0:
        gl.store(OUT_I + row + pos, (4294967295 - (keys & 4294967295)).to(gl.int32), mask=keep)
        gl.store(OUT_V + row + pos, _unpack_value(keys), mask=keep)
    else:
        gl.thread_barrier()  # the slots overwritten here are read (by every thread)
        gl.store(SCR + base + pos, keys, mask=keep)


@gluon.jit
def _positions(keep):
    # distinct dense output positions of the kept keys of a [rows, lanes] window: the rows'
    # exclusive prefix (across warps) plus the exclusive prefix within each row (in a warp)
    k32 = keep.to(gl.int32)
    in_row = gl.associative_scan(k32, 1, _add)
    row_tot = gl.sum(k32, axis=1)
    # (a scan needs a blocked layout: the [rows] totals go through one, one per thread)
    flat = gl.convert_layout(row_tot, gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    row_start = gl.convert_layout(gl.associative_scan(flat, 0, _add) - flat, row_tot.type.layout)
    return row_start[:, None] + in_row - k32, gl.sum(flat, axis=0)


# ------------------------------------------------------------------------------------------
# the selector: compacts the halves the scorer hands over
# ------------------------------------------------------------------------------------------
@gluon.jit
def _selector(SCR, SCR32, LC, META, THR, THRJ, OUT_I, OUT_V, PROF, full_bar, empty_bar, num_blocks, R0: gl.constexpr,
              NR: gl.constexpr, RELOAD: gl.constexpr, SEARCH: gl.constexpr, PROFILE: gl.constexpr, SAMP, EST, FAIL,
              BLOCKS, P, PRESAMPLE: gl.constexpr, LIST: gl.constexpr, est_bar):
    # Rows R0 .. R0 + NR - 1 of each block (with two selectors side by side, one per row pair).
    # PROF slots (+8 for R0 = 2): 2 cycles waiting for a half, 3 cycles compacting, 4 halves,
    # 5 searches, 10 cycles on samples.
    # fin (META): 0 an in-loop half, 1 the block's last half, 2 a sample of block j (v22:
    # each row's estimate to EST; nothing kept).
    # A row's window is [WIN // BN slot rows, BN lanes]: slot rows < KROWS are the kept area
    # (slot s * BN + lane), the others the half's lanes (the scorer's layout).
    L2: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [4, 1], [1, 0])
    R_L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    pid = gl.program_id(0)
    srow0 = gl.arange(0, WIN // BN, layout=gl.SliceLayout(1, L2))
    lane = gl.arange(0, BN, layout=gl.SliceLayout(0, L2))
    srow_c0 = gl.arange(0, CH_ROWS, layout=gl.SliceLayout(1, L2))
    rr = gl.arange(0, BM, layout=R_L)
    mvec = gl.zeros([BM], gl.int32, R_L)             # kept keys per row
    tvec = gl.full([BM], EMPTY, gl.int64, R_L)       # the rows' thresholds (published)
    pvvec = gl.zeros([BM], gl.float32, R_L)          # the rows' last search: score and density
    pdvec = gl.zeros([BM], gl.float32, R_L)          # (0: none yet in this block)
    n = 0
    go = True
    while go:
        h = n % NH
        if PROFILE:
            c0 = _clock()
        mbarrier.wait(full_bar.index(h), (n // NH) & 1)
        if PROFILE:
            c1 = _clock()
            _prof_add(PROF, 2 + 4 * R0, c1 - c0, PROFILE)
        j = gl.load(META + (pid * NH + h) * 2)
        fin = gl.load(META + (pid * NH + h) * 2 + 1)
        main_half = j >= 0
        if PRESAMPLE:
            main_half = main_half & (fin != 2)
            if (j >= 0) & (fin == 2):
                # a sample (v22): the rows' estimates; the kept areas and thresholds of the block
                # in progress are untouched
                mb = _block_of(BLOCKS, num_blocks, j, LIST, PRESAMPLE)
                nst = _sample_tiles(mb * BM, P)
                for r in gl.static_range(R0, R0 + NR):
                    row = mb * BM + r
                    m_real = row // P + 1
                    e = TOPK * m_real.to(gl.float32) / (row + 1).to(gl.float32)
                    jj = gl.ceil(e + ZEST * gl.sqrt(e)).to(gl.int32)
                    if m_real >= 2 * jj:
                        base = (pid * BM + r) * WIN
                        z = _opaque_zero()
                        srow = srow0 + z
                        m_s = gl.minimum(nst, KROWS) * BN
                        lc = gl.load(LC + ((pid * NH + h) * BM + r) * BN + lane)
                        valid, addr = _window(srow, lane, m_s, lc, 0, base)
                        keys = gl.load(SAMP + addr, mask=valid, other=EMPTY)
                        hi = (keys >> 32).to(gl.int32)
                        kth, _, npass, _, _ = _kth_largest(SAMP, (srow, lane, m_s, lc, 0, base), hi, nst * BN, jj, ESLK,
                                                           SEARCH, 0.0, 0.0)
                        # the threshold that takes scores >= the estimate: the score just below it
                        # (below +0.0 that is -1.4e-45, not -0.0, which the filter's <= equates with 0)
                        ev = _unpack_value(kth)
                        ub = _value_u(ev) - 1 - (ev == 0.0).to(gl.int64)
                        gl.store(EST + row, _as_hi(ub).to(gl.int64) << 32)
                gl.store(THRJ + pid * NH + h, -2)  # (no thresholds for the scorer in this release)
                gl.thread_barrier()
                mbarrier.arrive(empty_bar.index(h), count=1)
                mbarrier.arrive(est_bar, count=1)  # (the scorer waits on it before using the estimate)
                if PROFILE:
                    _prof_add(PROF, 10, _clock() - c1, PROFILE)
        if main_half:
            mb = _block_of(BLOCKS, num_blocks, j, LIST, PRESAMPLE)
            for r in gl.static_range(R0, R0 + NR):
                base = (pid * BM + r) * ROWSTRIDE
                # (the window's offsets, through an opaque zero, are computed here rather
                # than hoisted out of the loop: 32-64 registers per thread each)
                z = _opaque_zero()
                srow = srow0 + z
                srow_c = srow_c0 + z
                m_r = gl.sum(gl.where(rr == r, mvec, 0), axis=0)
                lc = gl.load(LC + ((pid * NH + h) * BM + r) * BN + lane)
                ntot = m_r + gl.sum(lc, axis=0)
                if PROFILE:
                    c_r0 = _clock()
                valid, addr = _window(srow, lane, m_r, lc, h, base)
                if RELOAD:
                    # the search holds the high words only (SCR32: the scratch as int32,
                    # little-endian; empty slots INT32_MIN); the whole keys are read again for
                    # the stores, half a window at a time (two selectors' registers are few)
                    hi = gl.load(SCR32 + addr * 2 + 1, mask=valid, other=-2147483648)
                else:
                    keys = gl.load(SCR + addr, mask=valid, other=EMPTY)
                    hi = (keys >> 32).to(gl.int32)
                win = (srow, lane, m_r, lc, h, base)
                if PROFILE:
                    c_r1 = _clock_after(gl.max(gl.max(hi, axis=1), axis=0).to(gl.int64))
                kth = gl.zeros([], dtype=gl.int64) + EMPTY
                npass = gl.zeros([], dtype=gl.int32)
                pv0 = gl.sum(gl.where(rr == r, pvvec, 0.0), axis=0)
                pdn = gl.sum(gl.where(rr == r, pdvec, 0.0), axis=0)
                if PRESAMPLE:
                    if fin != 0:
                        # v22's check: every key of the row's buffers scored >= its estimate, so
                        # the row is exact iff k of them arrived (else its block is redone)
                        if (gl.load(EST + mb * BM + r) != EMPTY) & (ntot < TOPK):
                            gl.store(FAIL + mb, 1)
                if fin != 0:
                    if ntot > TOPK:
                        kth, _, npass, _, _ = _kth_largest(SCR, win, hi, ntot, TOPK, 0, SEARCH, pv0, pdn)
                elif ntot > KBASE:
                    kth, _, npass, nv0, ndn = _kth_largest(SCR, win, hi, ntot, TOPK, SLACK, SEARCH, pv0, pdn)
                    pvvec = gl.where(rr == r, nv0, pvvec)
                    pdvec = gl.where(rr == r, ndn, pdvec)
                    _prof_add(PROF, 5 + 4 * R0, 1, PROFILE)
                if PROFILE:
                    c_r2 = _clock_after(kth)
                row = (mb * BM + r).to(gl.int64) * TOPK
                if RELOAD:
                    done = gl.zeros([], dtype=gl.int32)
                    for c in gl.static_range(WIN // BN // CH_ROWS):
                        # slot rows [c * 32, c * 32 + 32): a chunk's kept keys go to slots
                        # below the end of the rows read so far (it read its own before the
                        # barrier in _emit)
                        v_c, a_c = _window(srow_c + c * CH_ROWS, lane, m_r, lc, h, base)
                        keys = gl.load(SCR + a_c, mask=v_c, other=EMPTY)
                        keep = v_c & (keys >= kth)
                        pos, n_c = _positions(keep)
                        _emit(keys, keep, pos + done, fin, SCR, base, OUT_I, OUT_V, row)
                        done = done + n_c
                else:
                    keep = valid & (keys >= kth)
                    pos, done = _positions(keep)
                    _emit(keys, keep, pos, fin, SCR, base, OUT_I, OUT_V, row)
                if PROFILE and R0 == 0:
                    gl.thread_barrier()
                    c_r3 = _clock()
                    _prof_add(PROF, 7, c_r1 - c_r0, PROFILE)
                    _prof_add(PROF, 8, c_r2 - c_r1, PROFILE)
                    _prof_add(PROF, 9, c_r3 - c_r2, PROFILE)
                    _prof_add(PROF, 14, npass.to(gl.int64), PROFILE)
                    _prof_add(PROF, 15, 1, PROFILE)
                if fin != 0:
                    mvec = gl.where(rr == r, 0, mvec)
                    tvec = gl.where(rr == r, EMPTY, tvec)
                    pdvec = gl.where(rr == r, 0.0, pdvec)
                else:
                    mvec = gl.where(rr == r, done, mvec)
                    tvec = gl.where(rr == r, gl.maximum(tvec, kth), tvec)
            gl.store(THR + (pid * NH + h) * BM + rr, tvec, mask=(rr >= R0) & (rr < R0 + NR))
            gl.store(THRJ + pid * NH + h, j)
            gl.thread_barrier()  # the kept areas and thresholds written before the half is released
            mbarrier.arrive(empty_bar.index(h), count=1)
            if PROFILE:
                _prof_add(PROF, 3 + 4 * R0, _clock() - c1, PROFILE)
                _prof_add(PROF, 4 + 4 * R0, 1, PROFILE)
        go = j >= 0
        n += 1


# ------------------------------------------------------------------------------------------
# the scorer
# ------------------------------------------------------------------------------------------
@gluon.jit
def _issue_tile(k_desc, k_smem, ready, g, t, pred):
    s = g % STAGES
    mbarrier.expect(ready.index(s), k_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [t * BN, 0], ready.index(s), k_smem.index(s), pred=pred)


@gluon.jit
def _reduced(v):
    # [BN, NC] -> [BN, BM]: the head sum's reduction (columns (row m, head i) at
    # ((i // 2) * BM + m) * 2 + i % 2), used for the scores and, with max, for their offsets
    return gl.sum(gl.sum(gl.reshape(v, [BN, NC // (2 * BM), BM, 2]), axis=1), axis=2)


@gluon.jit
def _reduced_max(v):
    return gl.max(gl.max(gl.reshape(v, [BN, NC // (2 * BM), BM, 2]), axis=1), axis=2)


@gluon.jit
def _handoff(LC, META, THR, THRJ, PROF, full_bar, empty_bar, pid, cnt, lc_off, n_hand, j, fin, thr_off,
             PROFILE: gl.constexpr):
    # hand the current half over; wait until the other half is free; its release's thresholds
    h = n_hand % NH
    gl.store(LC + (pid * NH + h) * (BM * BN) + lc_off, cnt)
    gl.store(META + (pid * NH + h) * 2, j)
    gl.store(META + (pid * NH + h) * 2 + 1, fin)
    gl.thread_barrier()
    mbarrier.arrive(full_bar.index(h), count=1)
    n_hand += 1
    h2 = n_hand % NH
    if PROFILE:
        c0 = _clock()
    mbarrier.wait(empty_bar.index(h2), ((n_hand // NH) & 1) ^ 1)
    if PROFILE:
        _prof_add(PROF, 0, _clock() - c0, PROFILE)
    rj = gl.load(THRJ + pid * NH + h2)
    t64 = gl.load(THR + (pid * NH + h2) * BM + thr_off)
    return n_hand, rj, t64


@gluon.jit
def _load_block(Q, W, q_smem, w_smem, row0, W_SMEM: gl.constexpr):
    # a block's queries into shared memory (in the dot's column order) and its head weights
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NC, 16])
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    cols = gl.arange(0, NC, layout=gl.SliceLayout(0, acc_l))
    qc = gl.arange(0, NC, layout=gl.SliceLayout(1, ql))
    qd = gl.arange(0, D, layout=gl.SliceLayout(0, ql))
    q_m = (qc // 2) % BM
    q_i = (qc // (2 * BM)) * 2 + qc % 2
    qv = gl.load(Q + ((row0 + q_m)[:, None] * H + q_i[:, None]).to(gl.int64) * D + qd[None, :])
    q_smem.store(qv)
    gl.thread_barrier()
    fence_async_shared()
    wv = gl.load(W + (row0 + (cols // 2) % BM).to(gl.int64) * H + (cols // (2 * BM)) * 2 + cols % 2)
    if W_SMEM:
        w_smem.store(wv)
        gl.thread_barrier()
    return wv


@gluon.jit
def _tile_scores(k_smem, q_smem, w_smem, wv, s, zero, W_SMEM: gl.constexpr):
    # one key tile's [BN keys, BM rows] scores: the dot, ReLU, weights, head sum
    col_l: gl.constexpr = gl.SliceLayout(0, gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                        instr_shape=[16, NC, 16]))
    acc = warpgroup_mma(k_smem.index(s), q_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    if W_SMEM:
        wt = w_smem.load(col_l)
        y = _reduced(gl.maximum(acc, 0.0) * wt[None, :])
    else:
        y = _reduced(gl.maximum(acc, 0.0) * wv[None, :])
    return y


@gluon.jit
def _score_sample(Q, W, ks_desc, SAMP, LC, META, THR, THRJ, PROF, q_smem, k_smem, w_smem, ready, full_bar,
                  empty_bar, pid, g, n_hand, jn, r0n, P, zero, key_off, row_off, lc_off, samp_base,
                  W_SMEM: gl.constexpr, PROFILE: gl.constexpr):
    # v22: block jn's sample (every P-th key: a descriptor with a row stride of P keys), each
    # row's keys to its sample area, handed over as a half of kind 2
    nst = _sample_tiles(r0n, P)
    for i in gl.static_range(STAGES):
        _issue_tile(ks_desc, k_smem, ready, g + i, i, i < nst)
    wn = _load_block(Q, W, q_smem, w_smem, r0n, W_SMEM)
    for st in range(nst):
        s = (g + st) % STAGES
        mbarrier.wait(ready.index(s), ((g + st) // STAGES) & 1)
        y = _tile_scores(k_smem, q_smem, w_smem, wn, s, zero, W_SMEM)
        _issue_tile(ks_desc, k_smem, ready, g + st + STAGES, st + STAGES, st + STAGES < nst)
        keys = (st * BN + key_off) * P
        y = gl.where(keys <= r0n + row_off, y, float("-inf"))
        gl.store(SAMP + (samp_base + st * BN), _pack(y, keys))
    g += nst
    n_hand, rj, t64 = _handoff(LC, META, THR, THRJ, PROF, full_bar, empty_bar, pid,
                               gl.zeros_like(key_off) + gl.maximum(nst - KROWS, 0), lc_off, n_hand, jn, 2, row_off,
                               PROFILE)
    return g, n_hand


@gluon.jit
def _scorer(Q, W, k_desc, SCR, LC, META, THR, THRJ, COUNTER, PROF, q_smem, k_smem, w_smem, ready, full_bar,
            empty_bar, num_blocks, W_SMEM: gl.constexpr, PROFILE: gl.constexpr, ks_desc, SAMP, EST, BLOCKS, P,
            PRESAMPLE: gl.constexpr, LIST: gl.constexpr, est_bar):
    # W_SMEM: the head weights read from shared memory at every tile instead of held in
    # registers (64 per thread), which leaves the registers to two selectors
    # PROF slots: 0 cycles waiting for a free half, 1 cycles in all, 6 tiles, 12 cycles waiting for
    # an estimate (v22)
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NC, 16])
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    key_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    pid = gl.program_id(0)
    cols = gl.arange(0, NC, layout=col_l)
    col_m = (cols // 2) % BM
    zero = gl.zeros([BN, NC], gl.float32, acc_l)
    izero = gl.zeros([BN, NC], gl.int32, acc_l)
    # the (key offset, row) of each element of a reduced [BN, BM] tile, in its own layout
    key_off = _reduced_max(izero + gl.arange(0, BN, layout=key_l)[:, None])
    row_off = _reduced_max(izero + col_m[None, :])
    lc_off = row_off * BN + key_off
    slot_base = row_off * ROWSTRIDE + KBASE + key_off + pid * (BM * ROWSTRIDE)
    samp_base = (pid * BM + row_off) * WIN + key_off
    g = 0
    n_hand = 0
    if PROFILE:
        c_all = _clock()
    j = gl.atomic_add(COUNTER, 1)
    had_est = 0
    ns = 0  # samples handed over
    if PRESAMPLE:
        # the first block's sample (the next blocks' samples are scored one block ahead)
        r0f = _block_of(BLOCKS, num_blocks, gl.minimum(j, num_blocks - 1), LIST, PRESAMPLE) * BM
        if (j < num_blocks) & (r0f + 1 >= SAMPLE_MIN):
            g, n_hand = _score_sample(Q, W, ks_desc, SAMP, LC, META, THR, THRJ, PROF, q_smem, k_smem, w_smem,
                                      ready, full_bar, empty_bar, pid, g, n_hand, j, r0f, P, zero, key_off,
                                      row_off, lc_off, samp_base, W_SMEM, PROFILE)
            ns = 1
            had_est = 1
    while j < num_blocks:
        mb = _block_of(BLOCKS, num_blocks, j, LIST, PRESAMPLE)
        row0 = mb * BM
        if PRESAMPLE:
            if had_est != 0:
                # this block's estimate (sample ns - 1) is searched: its EST is written, and its
                # sample area may be written again (the selector arrives on est_bar after each
                # sample, in order; no later sample is handed over yet, so the phase cannot
                # have run two ahead of this wait)
                if PROFILE:
                    c0 = _clock()
                mbarrier.wait(est_bar, (ns - 1) & 1)
                if PROFILE:
                    _prof_add(PROF, 12, _clock() - c0, PROFILE)
            # v22: the next block's sample, scored now so that its estimate is searched while
            # this block is scored (every P-th key: a descriptor with a row stride of P keys)
            jn = gl.atomic_add(COUNTER, 1)
            # (no sample in a redo: LIST is off here; jn past the end is never loaded)
            r0n = _block_of(BLOCKS, num_blocks, gl.minimum(jn, num_blocks - 1), LIST, PRESAMPLE) * BM
            has_next = ((jn < num_blocks) & (r0n + 1 >= SAMPLE_MIN)).to(gl.int32)
            if has_next != 0:
                g, n_hand = _score_sample(Q, W, ks_desc, SAMP, LC, META, THR, THRJ, PROF, q_smem, k_smem, w_smem,
                                          ready, full_bar, empty_bar, pid, g, n_hand, jn, r0n, P, zero, key_off,
                                          row_off, lc_off, samp_base, W_SMEM, PROFILE)
                ns += 1
        n_tiles = gl.cdiv(gl.maximum(row0 + BM, TOPK), BN)
        for i in gl.static_range(STAGES):
            _issue_tile(k_desc, k_smem, ready, g + i, i, i < n_tiles)
        wv = _load_block(Q, W, q_smem, w_smem, row0, W_SMEM)
        last = row0 + row_off                                  # causal: key t <= row
        cnt = gl.zeros_like(key_off)
        thr_v = gl.full(key_off.shape, float("nan"), gl.float32, key_off.type.layout)
        if PRESAMPLE:
            if had_est != 0:
                # the estimate (v22), searched while the previous block was scored
                e64 = gl.load(EST + row0 + row_off)
                thr_v = gl.where(e64 != EMPTY, _unpack_value(e64), thr_v)
        t = 0
        while t < n_tiles:
            space = SUBH - gl.max(gl.max(cnt, axis=1), axis=0)
            if space == 0:
                n_hand, rj, t64 = _handoff(LC, META, THR, THRJ, PROF, full_bar, empty_bar, pid, cnt, lc_off,
                                           n_hand, j, 0, row_off, PROFILE)
                cnt = gl.zeros_like(key_off)
                t_new = _unpack_value(t64)
                thr_v = gl.where((rj == j) & (t64 != EMPTY), gl.where(thr_v != thr_v, t_new, gl.maximum(thr_v, t_new)),
                                 thr_v)
                space = SUBH
            t_stop = gl.minimum(n_tiles, t + space)
            half_off = (n_hand % NH) * (SUBH * BN)
            for tt in range(t, t_stop):
                s = (g + tt) % STAGES
                mbarrier.wait(ready.index(s), ((g + tt) // STAGES) & 1)
                y = _tile_scores(k_smem, q_smem, w_smem, wv, s, zero, W_SMEM)
                _issue_tile(k_desc, k_smem, ready, g + tt + STAGES, tt + STAGES, tt + STAGES < n_tiles)
                keys = tt * BN + key_off
                y = gl.where(keys <= last, y, float("-inf"))
                take = ~(y <= thr_v)
                gl.store(SCR + (slot_base + half_off + cnt * BN), _pack(y, keys), mask=take)
                cnt += take.to(gl.int32)
            t = t_stop
        n_hand, rj, t64 = _handoff(LC, META, THR, THRJ, PROF, full_bar, empty_bar, pid, cnt, lc_off, n_hand, j, 1,
                                   row_off, PROFILE)
        g += n_tiles
        _prof_add(PROF, 6, n_tiles, PROFILE)
        if PRESAMPLE:
            j = jn
            had_est = has_next
        else:
            j = gl.atomic_add(COUNTER, 1)
    # tell the selector to stop (the half is free: _handoff waited for it)
    h = n_hand % NH
    gl.store(META + (pid * NH + h) * 2, -1)
    gl.thread_barrier()
    mbarrier.arrive(full_bar.index(h), count=1)
    if PROFILE:
        _prof_add(PROF, 1, _clock() - c_all, PROFILE)


@gluon.jit
def _ws_kernel(Q, W, k_desc, SCR, SCR32, LC, META, THR, THRJ, COUNTER, OUT_I, OUT_V, PROF, num_blocks,
               SEL_REGS: gl.constexpr, NSEL: gl.constexpr, SEARCH: gl.constexpr, W_SMEM: gl.constexpr,
               PROFILE: gl.constexpr, ks_desc, SAMP, EST, FAIL, BLOCKS, P, PRESAMPLE: gl.constexpr, LIST: gl.constexpr):
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NC, D], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [NC, D], q_layout)
    w_smem = gl.allocate_shared_memory(gl.float32, [NC], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    full_bar = gl.allocate_shared_memory(gl.int64, [NH, 1], mbarrier.MBarrierLayout())
    empty_bar = gl.allocate_shared_memory(gl.int64, [NH, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    est_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(est_bar, count=1)
    for i in gl.static_range(NH):
        mbarrier.init(full_bar.index(i), count=1)
        mbarrier.init(empty_bar.index(i), count=NSEL)  # every selector releases
    if NSEL == 1:
        gl.warp_specialize([
            (_scorer, (Q, W, k_desc, SCR, LC, META, THR, THRJ, COUNTER, PROF, q_smem, k_smem, w_smem, ready,
                       full_bar, empty_bar, num_blocks, W_SMEM, PROFILE, ks_desc, SAMP, EST, BLOCKS, P, PRESAMPLE,
                       LIST, est_bar)),
            (_selector, (SCR, SCR32, LC, META, THR, THRJ, OUT_I, OUT_V, PROF, full_bar, empty_bar, num_blocks, 0, BM,
                         WIN > 4096, SEARCH, PROFILE, SAMP, EST, FAIL, BLOCKS, P, PRESAMPLE, LIST, est_bar)),
        ], [4], [SEL_REGS])
    else:
        gl.warp_specialize([
            (_scorer, (Q, W, k_desc, SCR, LC, META, THR, THRJ, COUNTER, PROF, q_smem, k_smem, w_smem, ready,
                       full_bar, empty_bar, num_blocks, W_SMEM, PROFILE, ks_desc, SAMP, EST, BLOCKS, P, PRESAMPLE,
                       LIST, est_bar)),
            (_selector, (SCR, SCR32, LC, META, THR, THRJ, OUT_I, OUT_V, PROF, full_bar, empty_bar, num_blocks, 0, 2,
                         not W_SMEM, SEARCH, PROFILE, SAMP, EST, FAIL, BLOCKS, P, PRESAMPLE, LIST, est_bar)),
            (_selector, (SCR, SCR32, LC, META, THR, THRJ, OUT_I, OUT_V, PROF, full_bar, empty_bar, num_blocks, 2, 2,
                         not W_SMEM, SEARCH, PROFILE, SAMP, EST, FAIL, BLOCKS, P, PRESAMPLE, LIST, est_bar)),
        ], [4, 4], [SEL_REGS, SEL_REGS])


# ------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------
def _k_descriptor(k2):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    shape = [int(BN), int(D)]
    layout = gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)
    return TensorDescriptor.from_tensor(k2, shape, layout)


class Workspace:
    def __init__(self, nprog: int, device):
        self.nprog = nprog
        self.scr = torch.empty(nprog * int(BM * ROWSTRIDE), dtype=torch.int64, device=device)
        self.lc = torch.zeros(nprog * int(NH) * int(BM * BN), dtype=torch.int32, device=device)
        self.meta = torch.zeros(nprog * int(NH) * 2, dtype=torch.int32, device=device)
        self.thr = torch.zeros(nprog * int(NH) * int(BM), dtype=torch.int64, device=device)
        self.thrj = torch.full((nprog * int(NH),), -1, dtype=torch.int32, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.prof = torch.zeros(nprog * 16, dtype=torch.int64, device=device)
        # v22: the rows' samples, their estimates and the blocks that failed the check
        self.samp = torch.empty(nprog * int(BM * WIN), dtype=torch.int64, device=device)
        self.est = torch.empty(0, dtype=torch.int64, device=device)
        self.fail = torch.empty(0, dtype=torch.int32, device=device)
        self.redone = 0  # blocks redone (without the estimate) since the workspace was made


def sample_stride(S: int) -> int:
    # every P-th key: at most 4,096 sample keys per row (one window)
    P = 32
    while -(-S // P) > 4096:
        P *= 2
    return P


def _kernel_args(q2, k2, w2, out_i, out_v, ws, nsel, search, w_smem, profile, presample, blocks=None):
    # _ws_kernel's arguments: every row block, or (a redo) those of the int32 list blocks
    S = q2.shape[0]
    P = sample_stride(S)
    num_blocks = S // int(BM) if blocks is None else blocks.numel()
    return (q2, w2, _k_descriptor(k2), ws.scr, ws.scr.view(torch.int32), ws.lc, ws.meta, ws.thr, ws.thrj, ws.counter,
            out_i, out_v, ws.prof, num_blocks, SEL_REGS[(nsel, w_smem)], nsel, search, w_smem, profile,
            _k_descriptor(k2[::P]), ws.samp, ws.est, ws.fail, ws.counter if blocks is None else blocks, P, presample,
            blocks is not None)


def _launch(q2, k2, w2, out_i, out_v, ws, nsel, search, w_smem, profile, presample, blocks=None):
    ws.counter.zero_()
    ws.thrj.fill_(-1)
    _ws_kernel[(ws.nprog,)](*_kernel_args(q2, k2, w2, out_i, out_v, ws, nsel, search, w_smem, profile, presample, blocks),
                            num_warps=4, maxnreg=MAXNREG[nsel])


def ws_topk(q2, k2, w2, out_i, out_v, ws: Workspace, nsel: int = 1, search: int = 1, w_smem: bool = False,
            profile: bool = False, presample: bool = False):
    """q2 [S, H, D] bf16, k2 [S, D] bf16, w2 [S, H] fp32 (scale folded in): the causal top-k
    indices and values of every row, unsorted, into out_i / out_v [S, TOPK]. presample: v22's
    sampled estimate (one selector); blocks failing its check are redone without it (a host
    sync per call to find them; counted in ws.redone)."""
    S = q2.shape[0]
    assert S % int(BM) == 0 and S >= int(TOPK) and tuple(q2.shape[1:]) == (int(H), int(D)) and tuple(k2.shape) == (S, int(D))
    assert not presample or nsel == 1, "the sampled estimate is built for one selector"
    if profile:
        ws.prof.zero_()
    if presample:
        if ws.est.numel() != S:
            ws.est = torch.empty(S, dtype=torch.int64, device=q2.device)
            ws.fail = torch.empty(S // int(BM), dtype=torch.int32, device=q2.device)
        ws.est.fill_(int(EMPTY))
        ws.fail.zero_()
    _launch(q2, k2, w2, out_i, out_v, ws, nsel, search, w_smem, profile, presample)
    if presample:
        bad = torch.nonzero(ws.fail).flatten()
        if bad.numel():
            ws.redone += bad.numel()
            _launch(q2, k2, w2, out_i, out_v, ws, nsel, search, w_smem, profile, False,
                    blocks=bad.flip(0).to(torch.int32).contiguous())


def compile_only(nsel, w_smem=False, search=1, presample=False) -> int:
    from triton.runtime import driver

    from inspect_hytopk import _Sm90, ptxas_report, sass_counts

    S = 4096
    driver.set_active(_Sm90())
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    q2 = torch.empty(S, int(H), int(D), dtype=torch.bfloat16)
    k2 = torch.empty(S, int(D), dtype=torch.bfloat16)
    w2 = torch.empty(S, int(H))
    ws = Workspace(1, "cpu")
    oi = torch.empty(S, int(TOPK), dtype=torch.int32)
    ov = torch.empty(S, int(TOPK))
    ck = _ws_kernel.warmup(*_kernel_args(q2, k2, w2, oi, ov, ws, nsel, search, w_smem, bool(os.environ.get("WS_PROFILE")),
                                         presample), num_warps=4, maxnreg=MAXNREG[nsel], grid=(1,))
    rep = ptxas_report(ck.asm["ptx"], bindir)
    sass = sass_counts(ck.asm["cubin"], bindir)[0]
    print(f"ws kernel, {nsel} selector(s){', weights in shared memory' if w_smem else ''}"
          f"{'' if search == 1 else f', search mode {search}'}{', sampled estimate' if presample else ''}: {rep}, "
          f"sass {sass}, shared {ck.metadata.shared} B")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "ws_kernel.ptx"), "w") as f:
        f.write(ck.asm["ptx"])
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", default="32768")
    ap.add_argument("--inputs", default="iid,struct")
    ap.add_argument("--selectors", default="1",
                    help="variants: selector partitions 1 (4 rows each) or 2 (2 rows each); the threshold search "
                         "':value' (default: bracketing, the line in value space), ':bits' (one bit per pass) or ':u' "
                         "(bracketing, the line in score-bits space) or ':two' (two guesses per pass, warm-started); "
                         "':w' the scorer's weights in shared memory; ':p' v22's sampled estimate (one selector); "
                         "e.g. 1,1:p,1:bits,1:two,2")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--no-library", action="store_true", help="skip the library rows (their numbers are known)")
    ap.add_argument("--power", type=float, default=0.0,
                    help="also run each unsorted row back to back for this many seconds while nvidia-smi samples "
                         "the SM clock and the power (power_during.py): is the kernel at the card's power limit?")
    ap.add_argument("--out", default=os.environ.get("OUT", "calib_out"))
    args = ap.parse_args(argv)
    modes = {"bits": 0, "value": 1, "u": 2, "two": 3}
    nsels = []
    for v in args.selectors.split(","):
        parts = v.split(":")
        if parts[0] not in ("1", "2") or any(x not in (*modes, "w", "p") for x in parts[1:]) or (
                "p" in parts[1:] and parts[0] != "1"):
            ap.error(f"--selectors {v!r}: 1 or 2 partitions, then optionally :bits / :value / :u / :two, :w and "
                     f"(one partition only) :p")
        nsels.append((int(parts[0]), modes[next((x for x in parts[1:] if x in modes), "value")], "w" in parts[1:],
                      "p" in parts[1:]))
    if args.compile_only:
        return max(compile_only(n, wsm, br, ps) for n, br, wsm, ps in nsels)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("calibrate_gluon_ws.py needs a Hopper GPU (sm_90); use --compile-only elsewhere")
    import bench_hytopk as bh
    import hyscale_compile  # noqa: F401
    from hyscale_compile.lowerings.triton_sort_rows import sort_rows_

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ws = Workspace(sms, dev)
    rate = bh.matmul_rate()
    spec_json = bh.dsa_spec().to_json()
    os.makedirs(args.out, exist_ok=True)
    lines = [f"# calibrate_gluon_ws: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
             f"{triton.__version__}, bf16 matmul {rate / 1e12:.0f} TFLOP/s",
             "| S | inputs | row | ms | x floor | exact (sampled rows) | same sets as the library |",
             "|---|---|---|---|---|---|---|"]
    prof_lines = []
    power_lines = []
    for S in [int(s) for s in args.seq.split(",")]:
        floor = int(H * D) * 2 * S * (S + 1) / 2 / rate * 1e3
        for inp in args.inputs.split(","):
            q, k, w = bh.make_inputs(S, inp, seed=11)
            hi = torch.arange(1, S + 1, device=dev).view(1, S)
            q2, k2 = q[0].contiguous(), k[0].contiguous()
            w2 = (w[0].float() * bh.SCALE).contiguous()
            oi = torch.empty(S, int(TOPK), dtype=torch.int32, device=dev)
            ov = torch.empty(S, int(TOPK), dtype=torch.float32, device=dev)

            def ws_unsorted(nsel, br, wsm, ps):
                ws_topk(q2, k2, w2, oi, ov, ws, nsel, br, wsm, presample=ps)
                return oi

            def ws_sorted(nsel, br, wsm, ps):
                ws_topk(q2, k2, w2, oi, ov, ws, nsel, br, wsm, presample=ps)
                sort_rows_(oi, ov, write_values=False)
                return oi

            rows = bh.sample_rows(S)
            ref = bh.hytopk_op(q, k, w, hi, spec_json, True)
            variants = []
            for n, br, wsm, ps in nsels:
                tag = f"ws{int(WIN) // 1024}K, {n} selector(s), search {['bits', 'value', 'u', 'two'][br]}"
                tag += ", weights in smem" if wsm else ""
                tag += f", sampled estimate (z={ZEST.value})" if ps else ""
                variants += [(f"{tag}, unsorted", lambda n=n, br=br, wsm=wsm, ps=ps: ws_unsorted(n, br, wsm, ps)),
                             (f"{tag}, + sort_rows_", lambda n=n, br=br, wsm=wsm, ps=ps: ws_sorted(n, br, wsm, ps))]
            if not args.no_library:
                variants = [("library hytopk", lambda: bh.hytopk_op(q, k, w, hi, spec_json, True)),
                            ("library hytopk:unsorted", lambda: bh.hytopk_op(q, k, w, hi, spec_json, False))] + variants
            for name, fn in variants:
                try:
                    redone0 = ws.redone
                    ms, _, out, _ = bh.measure(fn, 5)
                    if ws.redone > redone0:
                        name += f" ({ws.redone - redone0} blocks redone in all calls)"
                    out = out.view(1, S, int(TOPK))
                    exact = bh.check_rows(out, q, k, w, rows)
                    a = out[0].long().sort(dim=1).values
                    b = ref[0].long().sort(dim=1).values
                    same = (a == b).all(dim=1).float().mean().item()
                    lines.append(f"| {S} | {inp} | {name} | {ms:.2f} | {ms / floor:.2f} | {exact} | {same:.4f} |")
                except Exception as e:  # report and go on
                    lines.append(f"| {S} | {inp} | {name} | failed: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:120]} | | | |")
                print(lines[-1], file=sys.stderr, flush=True)
            if args.power > 0:
                from power_during import sampled_run

                for name, fn in variants:
                    if "unsorted" in name:
                        # (with :p every call syncs with the host to look for flagged blocks,
                        # so "back to back" includes those short gaps)
                        try:
                            ms, mhz, watts, ns = sampled_run(fn, args.power)
                        except Exception as e:  # report and go on
                            power_lines.append(f"| {S} | {inp} | {name} | failed: {type(e).__name__} | | | | |")
                            continue
                        power_lines.append(f"| {S} | {inp} | {name} | {ms:.2f} | {mhz:.0f} | {watts:.0f} | "
                                           f"{ms * mhz / 1e3:.1f} | {ns} |")
                        print(power_lines[-1], file=sys.stderr, flush=True)
            for n, br, wsm, ps in nsels:
                ws_topk(q2, k2, w2, oi, ov, ws, n, br, wsm, profile=True, presample=ps)
                torch.cuda.synchronize()
                pr = ws.prof.view(-1, 16).double().sum(0).tolist()
                # the busier selector (with the estimate: slot 10 holds the samples' cycles)
                busy = pr[3] + pr[10] if ps else max(pr[3], pr[11])
                waits = f"{100 * pr[0] / pr[1]:.1f}%" + (f" + {100 * pr[12] / pr[1]:.1f}% for estimates" if ps else "")
                prof_lines.append(f"| {S} | {inp} | {n}, {['bits', 'value', 'u', 'two'][br]}, {int(WIN) // 1024}K{', w smem' if wsm else ''}{', sampled' if ps else ''} | {waits} | {100 * busy / pr[1]:.1f}% | "
                                  f"{pr[4] / (S // 4):.2f} | {(pr[5] + pr[13]) / S:.2f} | "
                                  f"{busy / max(pr[4], 1) / 1e3:.1f} | {pr[1] / max(pr[6], 1):.0f} | "
                                  f"{pr[7] / max(pr[15], 1) / 1e3:.1f} / {pr[8] / max(pr[15], 1) / 1e3:.1f} / "
                                  f"{pr[9] / max(pr[15], 1) / 1e3:.1f} | {pr[14] / max(pr[5] + pr[13] + S, 1):.1f} |")
                print(prof_lines[-1], file=sys.stderr, flush=True)
    lines += ["", "Profile (PROFILE build, one call; cycles summed over programs): scorer waiting for a free half, "
              "the busier selector's busy cycles (both as % of the scorer's cycles), halves per row block, "
              "searching compactions per row, that selector's kcycles per half, scorer cycles per tile; the first "
              "selector's kcycles per row compaction in load / search / positions and stores, and search passes per "
              "searching compaction (in-loop and final)",
              "| S | inputs | selectors | scorer waits | selector busy | halves / block | searches / row | "
              "kcycles / half | cycles / tile | load / search / store | passes |", "|---|---|---|---|---|---|---|---|---|---|---|"] + prof_lines
    if power_lines:
        lines += ["", f"Back to back for {args.power:g} s (nvidia-smi every 100 ms; medians): ms per call, SM clock, "
                  "board power, SM Mcycles per call",
                  "| S | inputs | row | ms | SM MHz | W | Mcycles | samples |", "|---|---|---|---|---|---|---|---|"] + power_lines
    table = "\n".join(lines)
    with open(os.path.join(args.out, "calibrate_gluon_ws.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
