"""Does selection overlapped with scoring pay? A warp-specialized HyTopK at the DSA shape
(Gluon, one Hopper GPU; ``--compile-only`` builds for sm_90 anywhere).

    python benchmarks/calibrate_gluon_ws.py [--seq 32768,131072] [--inputs iid,struct] [--selectors 1,1:bits,2]
    python benchmarks/calibrate_gluon_ws.py --compile-only --selectors 1,2    # registers, spills, SASS
    WS_WIN=8192 python benchmarks/calibrate_gluon_ws.py ...                  # bigger halves (see WIN)

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
ROWSTRIDE = C(2 * WIN)           # per row: [kept KBASE][half 0][half 1]
CH_ROWS = C(32)                  # slot rows per chunk of the stores when the keys are read again
STAGES = C(3)
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
def _bracket_search(hi, umin, umax, n, KEEP: gl.constexpr, SLK: gl.constexpr, USPACE: gl.constexpr):
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
def _two_search(hi, umin, umax, n, KEEP: gl.constexpr, SLK: gl.constexpr, v0, dens):
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
def _kth_largest(SCR, win, hi, n, KEEP: gl.constexpr, SLK: gl.constexpr, SEARCH: gl.constexpr, v0, dens):
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
              NR: gl.constexpr, RELOAD: gl.constexpr, SEARCH: gl.constexpr, PROFILE: gl.constexpr):
    # Rows R0 .. R0 + NR - 1 of each block (with two selectors side by side, one per row pair).
    # PROF slots (+8 for R0 = 2): 2 cycles waiting for a half, 3 cycles compacting, 4 halves,
    # 5 searches.
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
        h = n % 2
        if PROFILE:
            c0 = _clock()
        mbarrier.wait(full_bar.index(h), (n // 2) & 1)
        if PROFILE:
            c1 = _clock()
            _prof_add(PROF, 2 + 4 * R0, c1 - c0, PROFILE)
        j = gl.load(META + (pid * 2 + h) * 2)
        fin = gl.load(META + (pid * 2 + h) * 2 + 1)
        if j >= 0:
            mb = num_blocks - 1 - j
            for r in gl.static_range(R0, R0 + NR):
                base = (pid * BM + r) * ROWSTRIDE
                # (the window's offsets, through an opaque zero, are computed here rather
                # than hoisted out of the loop: 32-64 registers per thread each)
                z = _opaque_zero()
                srow = srow0 + z
                srow_c = srow_c0 + z
                m_r = gl.sum(gl.where(rr == r, mvec, 0), axis=0)
                lc = gl.load(LC + ((pid * 2 + h) * BM + r) * BN + lane)
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
            gl.store(THR + (pid * 2 + h) * BM + rr, tvec, mask=(rr >= R0) & (rr < R0 + NR))
            gl.store(THRJ + pid * 2 + h, j)
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
    h = n_hand % 2
    gl.store(LC + (pid * 2 + h) * (BM * BN) + lc_off, cnt)
    gl.store(META + (pid * 2 + h) * 2, j)
    gl.store(META + (pid * 2 + h) * 2 + 1, fin)
    gl.thread_barrier()
    mbarrier.arrive(full_bar.index(h), count=1)
    n_hand += 1
    h2 = n_hand % 2
    if PROFILE:
        c0 = _clock()
    mbarrier.wait(empty_bar.index(h2), ((n_hand // 2) & 1) ^ 1)
    if PROFILE:
        _prof_add(PROF, 0, _clock() - c0, PROFILE)
    rj = gl.load(THRJ + pid * 2 + h2)
    t64 = gl.load(THR + (pid * 2 + h2) * BM + thr_off)
    return n_hand, rj, t64


@gluon.jit
def _scorer(Q, W, k_desc, SCR, LC, META, THR, THRJ, COUNTER, PROF, q_smem, k_smem, w_smem, ready, full_bar,
            empty_bar, num_blocks, W_SMEM: gl.constexpr, PROFILE: gl.constexpr):
    # W_SMEM: the head weights read from shared memory at every tile instead of held in
    # registers (64 per thread), which leaves the registers to two selectors
    # PROF slots: 0 cycles waiting for a free half, 1 cycles in all, 6 tiles
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NC, 16])
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    key_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    pid = gl.program_id(0)
    cols = gl.arange(0, NC, layout=col_l)
    col_m = (cols // 2) % BM
    col_i = (cols // (2 * BM)) * 2 + cols % 2
    qc = gl.arange(0, NC, layout=gl.SliceLayout(1, ql))
    qd = gl.arange(0, D, layout=gl.SliceLayout(0, ql))
    q_m = (qc // 2) % BM
    q_i = (qc // (2 * BM)) * 2 + qc % 2
    zero = gl.zeros([BN, NC], gl.float32, acc_l)
    izero = gl.zeros([BN, NC], gl.int32, acc_l)
    # the (key offset, row) of each element of a reduced [BN, BM] tile, in its own layout
    key_off = _reduced_max(izero + gl.arange(0, BN, layout=key_l)[:, None])
    row_off = _reduced_max(izero + col_m[None, :])
    lc_off = row_off * BN + key_off
    slot_base = row_off * ROWSTRIDE + KBASE + key_off + pid * (BM * ROWSTRIDE)
    g = 0
    n_hand = 0
    if PROFILE:
        c_all = _clock()
    j = gl.atomic_add(COUNTER, 1)
    while j < num_blocks:
        mb = num_blocks - 1 - j
        row0 = mb * BM
        n_tiles = gl.cdiv(gl.maximum(row0 + BM, TOPK), BN)
        for i in gl.static_range(STAGES):
            _issue_tile(k_desc, k_smem, ready, g + i, i, i < n_tiles)
        qv = gl.load(Q + ((row0 + q_m)[:, None] * H + q_i[:, None]).to(gl.int64) * D + qd[None, :])
        q_smem.store(qv)
        gl.thread_barrier()
        fence_async_shared()
        wv = gl.load(W + (row0 + col_m).to(gl.int64) * H + col_i)
        if W_SMEM:
            w_smem.store(wv)
            gl.thread_barrier()
        last = row0 + row_off                                  # causal: key t <= row
        cnt = gl.zeros_like(key_off)
        thr_v = gl.full(key_off.shape, float("nan"), gl.float32, key_off.type.layout)
        t = 0
        while t < n_tiles:
            space = SUBH - gl.max(gl.max(cnt, axis=1), axis=0)
            if space == 0:
                n_hand, rj, t64 = _handoff(LC, META, THR, THRJ, PROF, full_bar, empty_bar, pid, cnt, lc_off,
                                           n_hand, j, 0, row_off, PROFILE)
                cnt = gl.zeros_like(key_off)
                thr_v = gl.where((rj == j) & (t64 != EMPTY), _unpack_value(t64), thr_v)
                space = SUBH
            t_stop = gl.minimum(n_tiles, t + space)
            half_off = (n_hand % 2) * (SUBH * BN)
            for tt in range(t, t_stop):
                s = (g + tt) % STAGES
                mbarrier.wait(ready.index(s), ((g + tt) // STAGES) & 1)
                acc = warpgroup_mma(k_smem.index(s), q_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
                _issue_tile(k_desc, k_smem, ready, g + tt + STAGES, tt + STAGES, tt + STAGES < n_tiles)
                if W_SMEM:
                    wt = w_smem.load(col_l)
                    y = _reduced(gl.maximum(acc, 0.0) * wt[None, :])
                else:
                    y = _reduced(gl.maximum(acc, 0.0) * wv[None, :])
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
        j = gl.atomic_add(COUNTER, 1)
    # tell the selector to stop (the half is free: _handoff waited for it)
    h = n_hand % 2
    gl.store(META + (pid * 2 + h) * 2, -1)
    gl.thread_barrier()
    mbarrier.arrive(full_bar.index(h), count=1)
    if PROFILE:
        _prof_add(PROF, 1, _clock() - c_all, PROFILE)


@gluon.jit
def _ws_kernel(Q, W, k_desc, SCR, SCR32, LC, META, THR, THRJ, COUNTER, OUT_I, OUT_V, PROF, num_blocks,
               SEL_REGS: gl.constexpr, NSEL: gl.constexpr, SEARCH: gl.constexpr, W_SMEM: gl.constexpr,
               PROFILE: gl.constexpr):
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NC, D], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [NC, D], q_layout)
    w_smem = gl.allocate_shared_memory(gl.float32, [NC], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    full_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(full_bar.index(i), count=1)
        mbarrier.init(empty_bar.index(i), count=NSEL)  # every selector releases
    if NSEL == 1:
        gl.warp_specialize([
            (_scorer, (Q, W, k_desc, SCR, LC, META, THR, THRJ, COUNTER, PROF, q_smem, k_smem, w_smem, ready,
                       full_bar, empty_bar, num_blocks, W_SMEM, PROFILE)),
            (_selector, (SCR, SCR32, LC, META, THR, THRJ, OUT_I, OUT_V, PROF, full_bar, empty_bar, num_blocks, 0, BM,
                         WIN > 4096, SEARCH, PROFILE)),
        ], [4], [SEL_REGS])
    else:
        gl.warp_specialize([
            (_scorer, (Q, W, k_desc, SCR, LC, META, THR, THRJ, COUNTER, PROF, q_smem, k_smem, w_smem, ready,
                       full_bar, empty_bar, num_blocks, W_SMEM, PROFILE)),
            (_selector, (SCR, SCR32, LC, META, THR, THRJ, OUT_I, OUT_V, PROF, full_bar, empty_bar, num_blocks, 0, 2,
                         not W_SMEM, SEARCH, PROFILE)),
            (_selector, (SCR, SCR32, LC, META, THR, THRJ, OUT_I, OUT_V, PROF, full_bar, empty_bar, num_blocks, 2, 2,
                         not W_SMEM, SEARCH, PROFILE)),
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
        self.lc = torch.zeros(nprog * 2 * int(BM * BN), dtype=torch.int32, device=device)
        self.meta = torch.zeros(nprog * 2 * 2, dtype=torch.int32, device=device)
        self.thr = torch.zeros(nprog * 2 * int(BM), dtype=torch.int64, device=device)
        self.thrj = torch.full((nprog * 2,), -1, dtype=torch.int32, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.prof = torch.zeros(nprog * 16, dtype=torch.int64, device=device)


def ws_topk(q2, k2, w2, out_i, out_v, ws: Workspace, nsel: int = 1, search: int = 1, w_smem: bool = False,
            profile: bool = False):
    """q2 [S, H, D] bf16, k2 [S, D] bf16, w2 [S, H] fp32 (scale folded in): the causal top-k
    indices and values of every row, unsorted, into out_i / out_v [S, TOPK]."""
    S = q2.shape[0]
    assert S % int(BM) == 0 and S >= int(TOPK) and tuple(q2.shape[1:]) == (int(H), int(D)) and tuple(k2.shape) == (S, int(D))
    ws.counter.zero_()
    ws.thrj.fill_(-1)
    if profile:
        ws.prof.zero_()
    return _ws_kernel[(ws.nprog,)](q2, w2, _k_descriptor(k2), ws.scr, ws.scr.view(torch.int32), ws.lc, ws.meta, ws.thr, ws.thrj, ws.counter,
                                   out_i, out_v, ws.prof, S // int(BM), SEL_REGS[(nsel, w_smem)], nsel, search, w_smem, profile,
                                   num_warps=4, maxnreg=MAXNREG[nsel])


def compile_only(nsel, w_smem=False, search=1) -> int:
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
    ck = _ws_kernel.warmup(q2, w2, _k_descriptor(k2), ws.scr, ws.scr.view(torch.int32), ws.lc, ws.meta, ws.thr, ws.thrj, ws.counter, oi, ov,
                           ws.prof, S // int(BM), SEL_REGS[(nsel, w_smem)], nsel, search, w_smem, bool(os.environ.get("WS_PROFILE")),
                           num_warps=4, maxnreg=MAXNREG[nsel], grid=(1,))
    rep = ptxas_report(ck.asm["ptx"], bindir)
    sass = sass_counts(ck.asm["cubin"], bindir)[0]
    print(f"ws kernel, {nsel} selector(s){', weights in shared memory' if w_smem else ''}"
          f"{'' if search == 1 else f', search mode {search}'}: {rep}, sass {sass}, shared {ck.metadata.shared} B")
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
                         "(bracketing, the line in score-bits space) or ':two' (two guesses per pass, warm-started); e.g. 1,1:bits,1:two,2")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--no-library", action="store_true", help="skip the library rows (their numbers are known)")
    ap.add_argument("--out", default=os.environ.get("OUT", "calib_out"))
    args = ap.parse_args(argv)
    modes = {"bits": 0, "value": 1, "u": 2, "two": 3}
    nsels = []
    for v in args.selectors.split(","):
        parts = v.split(":")
        if parts[0] not in ("1", "2") or any(x not in (*modes, "w") for x in parts[1:]):
            ap.error(f"--selectors {v!r}: 1 or 2 partitions, then optionally :bits / :value / :u / :two and :w")
        nsels.append((int(parts[0]), modes[next((x for x in parts[1:] if x in modes), "value")], "w" in parts[1:]))
    if args.compile_only:
        return max(compile_only(n, wsm, br) for n, br, wsm in nsels)
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
    for S in [int(s) for s in args.seq.split(",")]:
        floor = int(H * D) * 2 * S * (S + 1) / 2 / rate * 1e3
        for inp in args.inputs.split(","):
            q, k, w = bh.make_inputs(S, inp, seed=11)
            hi = torch.arange(1, S + 1, device=dev).view(1, S)
            q2, k2 = q[0].contiguous(), k[0].contiguous()
            w2 = (w[0].float() * bh.SCALE).contiguous()
            oi = torch.empty(S, int(TOPK), dtype=torch.int32, device=dev)
            ov = torch.empty(S, int(TOPK), dtype=torch.float32, device=dev)

            def ws_unsorted(nsel, br, wsm):
                ws_topk(q2, k2, w2, oi, ov, ws, nsel, br, wsm)
                return oi

            def ws_sorted(nsel, br, wsm):
                ws_topk(q2, k2, w2, oi, ov, ws, nsel, br, wsm)
                sort_rows_(oi, ov, write_values=False)
                return oi

            rows = bh.sample_rows(S)
            ref = bh.hytopk_op(q, k, w, hi, spec_json, True)
            variants = []
            for n, br, wsm in nsels:
                tag = f"ws{int(WIN) // 1024}K, {n} selector(s), search {['bits', 'value', 'u', 'two'][br]}"
                tag += ", weights in smem" if wsm else ""
                variants += [(f"{tag}, unsorted", lambda n=n, br=br, wsm=wsm: ws_unsorted(n, br, wsm)),
                             (f"{tag}, + sort_rows_", lambda n=n, br=br, wsm=wsm: ws_sorted(n, br, wsm))]
            if not args.no_library:
                variants = [("library hytopk", lambda: bh.hytopk_op(q, k, w, hi, spec_json, True)),
                            ("library hytopk:unsorted", lambda: bh.hytopk_op(q, k, w, hi, spec_json, False))] + variants
            for name, fn in variants:
                try:
                    ms, _, out, _ = bh.measure(fn, 5)
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
            for n, br, wsm in nsels:
                ws_topk(q2, k2, w2, oi, ov, ws, n, br, wsm, profile=True)
                torch.cuda.synchronize()
                pr = ws.prof.view(-1, 16).double().sum(0).tolist()
                busy = max(pr[3], pr[11])  # the busier selector
                prof_lines.append(f"| {S} | {inp} | {n}, {['bits', 'value', 'u', 'two'][br]}, {int(WIN) // 1024}K{', w smem' if wsm else ''} | {100 * pr[0] / pr[1]:.1f}% | {100 * busy / pr[1]:.1f}% | "
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
    table = "\n".join(lines)
    with open(os.path.join(args.out, "calibrate_gluon_ws.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
