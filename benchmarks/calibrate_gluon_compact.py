"""How short can a compaction be? HyTopK's compaction in Triton against the same algorithm in
Gluon with a layout chosen for it (one GPU; ``--compile-only`` anywhere).

    python benchmarks/calibrate_gluon_compact.py [--rows-per-program 16] [--valid 3900]
    python benchmarks/calibrate_gluon_compact.py --compile-only   # sm_90 builds: registers, SASS

A compaction (docs/kernel-design.md) takes one row's candidate buffer (CAP = 4,096 packed
int64 keys in global scratch, ``valid`` of them), finds a threshold keeping between k and
k + slack of them (a one-bit-per-pass count search from the highest bit where the scores
differ), and moves the kept keys to the buffer's front. In the fused kernel it costs ~16
kcycles at 32K (v19's profile: load 2.7, search 7.6, store 5.0), and Triton's blocked
layout (each thread 2 consecutive keys, 16 times over) makes the store's ``tl.cumsum`` 16
warp-wide scans per thread; v12 could not get Triton to keep a layout that scans in
registers. Gluon states the layout: here each thread holds 32 consecutive keys, so the
scan is one running count in registers, one warp scan of the 32 per-thread totals and
one exchange across the 4 warps.

Both kernels compact ``rows-per-program`` buffers per program, in place, one after the
other (no scoring around them), with 264 programs (two per SM, as the fused kernel) and
132 (one per SM). The Triton kernel calls the fused kernel's own ``_compact_row`` (the
generated module's). Also (``--rows-together``) the same algorithm over R rows at once, so
that each search pass counts R rows in one reduction (``2r``: only the score bits live
through the search, each row's keys read again for its store, which avoids spills).
Caveats: at the default 16 rows per program the buffers (138 MB at 264 programs) exceed
the L2, so part of each load comes from HBM, unlike the fused kernel's 35 MB of scratch;
at 4 rows per program (35 MB) one launch's fixed cost dominates the 4 compactions. Rows: distinct scores (a kept top-k tail: |N(0,1)| + 1.5) with random
key indices. Each compacted row is checked: the kept count m in [k, k + slack], and the
front m keys are the row's m best. Prints a table last: ms per call, kcycles per
compaction per program (time x 1,980 MHz / compactions per program).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from gluon_common import _add, _highest_bit  # noqa: E402

CAP, TOPK, SLACK, WARPS = 4096, 2048, 128, 4
EMPTY = tl.constexpr(-9223372036854775807)


def _compact_row_fn():
    """The fused kernel's _compact_row (the generated module at the DSA spec)."""
    from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec
    from hyscale_compile.lowerings.triton_codegen import load_kernel

    spec = ScoreSpec(name="dsa", epilogue=(("mul", 128 ** -0.5), ("relu",)), reduce="weighted_sum",
                     post=(("mask", 0),), masks=(MaskTerm(kind="range", hi=0),))
    return load_kernel(spec, 1).fn.__globals__["_compact_row"]


@triton.jit
def _triton_harness(WORK, M, n, NB: tl.constexpr, TOPK_: tl.constexpr, CAP_: tl.constexpr, SLACK_: tl.constexpr,
                    compact_row: tl.constexpr):
    pid = tl.program_id(0)
    for i in range(NB):
        row = WORK + (pid * NB + i).to(tl.int64) * CAP_
        m, _ = compact_row(row, tl.arange(0, CAP_) < n, n, TOPK_, CAP_, SLACK_)
        tl.store(M + pid * NB + i, m)
        tl.debug_barrier()


@triton.jit
def _mm_combine(lo0, hi0, lo1, hi1):
    return tl.minimum(lo0, lo1), tl.maximum(hi0, hi1)


@triton.jit
def _compact_rows(rows_ptr, n, R: tl.constexpr, TOPK_: tl.constexpr, CAP_: tl.constexpr, SLACK_: tl.constexpr,
                  RELOAD: tl.constexpr):
    # _compact_row's algorithm for R rows at once ([R, CAP]): each pass counts every row's
    # keys above its own candidate in one reduction, so R rows share each pass's latency
    # (distinct scores assumed: no tie tail). Returns the kept counts [R].
    offs = tl.arange(0, CAP_)
    rr = tl.arange(0, R)
    valid = (offs < n)[None, :] & (rr >= 0)[:, None]
    ptrs = rows_ptr + rr.to(tl.int64)[:, None] * CAP_ + offs[None, :]
    keys = tl.load(ptrs, mask=valid, other=EMPTY)
    u = tl.where(valid, ((keys >> 32).to(tl.int32) ^ -2147483648).to(tl.uint32, bitcast=True), 0)
    umin, umax = tl.reduce((tl.where(valid, u, 4294967295), u), 1, _mm_combine)
    x = umin ^ umax
    hb = tl.zeros([R], dtype=tl.int32)
    for i in tl.static_range(5):
        big = x >= (1 << (16 >> i))
        x = tl.where(big, x >> (16 >> i), x)
        hb += tl.where(big, 16 >> i, 0)
    hbu = hb.to(tl.uint32)
    bit = tl.where(umin == umax, 0, tl.full([R], 1, tl.uint32) << hbu)
    prefix = tl.where(umin == umax, umin, ((umin >> hbu) >> 1) << 1 << hbu)
    n_ge = tl.zeros([R], dtype=tl.int32) + n
    active = (bit > 0) & (n_ge > TOPK_ + SLACK_)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        c = prefix | bit
        n_c = tl.sum((u >= c[:, None]).to(tl.int32), axis=1)
        up = active & (n_c >= TOPK_)
        prefix = tl.where(up, c, prefix)
        n_ge = tl.where(up, n_c, n_ge)
        bit = tl.where(active, bit >> 1, bit)
        active = (bit > 0) & (n_ge > TOPK_ + SLACK_)
    kth = (prefix ^ 2147483648).to(tl.int32, bitcast=True).to(tl.int64) << 32
    if RELOAD:
        # only the score bits live through the search; each row's keys are read again for
        # its store, one row at a time (volatile: not merged with the first load)
        tl.debug_barrier()
        for r in tl.static_range(R):
            kr = tl.load(rows_ptr + r * CAP_ + offs, mask=offs < n, other=EMPTY, volatile=True)
            keep1 = (offs < n) & (kr >= tl.sum(tl.where(rr == r, kth, 0), axis=0))
            k1 = keep1.to(tl.int32)
            pos1 = tl.cumsum(k1, axis=0) - k1
            tl.debug_barrier()
            tl.store(rows_ptr + r * CAP_ + pos1, kr, mask=keep1)
    else:
        keep = valid & (keys >= kth[:, None])
        k32 = keep.to(tl.int32)
        pos = tl.cumsum(k32, axis=1) - k32
        tl.debug_barrier()
        tl.store(rows_ptr + rr.to(tl.int64)[:, None] * CAP_ + pos, keys, mask=keep)
    return n_ge


@triton.jit
def _triton_rows_harness(WORK, M, n, NB: tl.constexpr, R: tl.constexpr, TOPK_: tl.constexpr, CAP_: tl.constexpr,
                         SLACK_: tl.constexpr, RELOAD: tl.constexpr):
    pid = tl.program_id(0)
    for i in range(0, NB, R):
        m = _compact_rows(WORK + (pid * NB + i).to(tl.int64) * CAP_, n, R, TOPK_, CAP_, SLACK_, RELOAD)
        tl.store(M + pid * NB + i + tl.arange(0, R), m)
        tl.debug_barrier()


@gluon.jit
def _min_max_combine(lo0, hi0, lo1, hi1):
    return gl.minimum(lo0, lo1), gl.maximum(hi0, hi1)


@gluon.jit
def _gluon_compact(row, n, TOPK_: gl.constexpr, CAP_: gl.constexpr, SLACK_: gl.constexpr, L: gl.constexpr):
    # _compact_row's algorithm (load, one-bit count search with slack, scan, store in place)
    # in layout L; distinct scores assumed (the harness's rows), so no tie tail.
    offs = gl.arange(0, CAP_, layout=L)
    valid = offs < n
    keys = gl.load(row + offs, mask=valid, other=EMPTY)
    u = ((keys >> 32).to(gl.int32) ^ -2147483648).to(gl.uint32, bitcast=True)
    u = gl.where(valid, u, 0)
    umin, umax = gl.reduce((gl.where(valid, u, 4294967295), u), 0, _min_max_combine)
    hbu = _highest_bit(umin ^ umax).to(gl.uint32)
    bit = gl.where(umin == umax, 0, gl.full([], 1, gl.uint32) << hbu)
    prefix = gl.where(umin == umax, umin, ((umin >> hbu) >> 1) << 1 << hbu)
    n_ge = n
    while (bit > 0) & (n_ge > TOPK_ + SLACK_):
        c = prefix | bit
        n_c = gl.sum((u >= c).to(gl.int32), axis=0)
        prefix = gl.where(n_c >= TOPK_, c, prefix)
        n_ge = gl.where(n_c >= TOPK_, n_c, n_ge)
        bit = bit >> 1
    kth = (prefix ^ 2147483648).to(gl.int32, bitcast=True).to(gl.int64) << 32
    keep = valid & (keys >= kth)
    k32 = keep.to(gl.int32)
    pos = gl.associative_scan(k32, 0, _add) - k32
    gl.thread_barrier()  # every thread has read the row before any thread overwrites it
    gl.store(row + pos, keys, mask=keep)
    return n_ge


@gluon.jit
def _gluon_harness(WORK, M, n, NB: gl.constexpr, TOPK_: gl.constexpr, CAP_: gl.constexpr, SLACK_: gl.constexpr,
                   PER_THREAD: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([PER_THREAD], [32], [gl.num_warps()], [0])
    pid = gl.program_id(0)
    for i in range(NB):
        row = WORK + (pid * NB + i).to(gl.int64) * CAP_
        m = _gluon_compact(row, n, TOPK_, CAP_, SLACK_, L)
        gl.store(M + pid * NB + i, m)
        gl.thread_barrier()


def make_rows(rows: int, valid: int, seed: int, device) -> torch.Tensor:
    """[rows, CAP] packed keys: distinct positive scores (|N(0,1)| + 1.5, made distinct by
    adding each score's rank in ulps), distinct key indices (a random odd multiplier modulo
    2^20 per row), in random slots; slots past ``valid`` EMPTY."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    y = torch.randn(rows, valid, generator=g).abs() + 1.5
    bits, order = y.view(torch.int32).to(torch.int64).sort(dim=1)
    bits = bits + torch.arange(valid)                      # strictly increasing: distinct scores
    perm = torch.argsort(torch.rand(rows, valid, generator=g), dim=1)
    bits = bits.gather(1, perm)                            # back into random slots
    mult = torch.randint(0, 1 << 19, (rows, 1), generator=g) * 2 + 1
    idx = (torch.arange(valid) * mult + torch.randint(0, 1 << 20, (rows, 1), generator=g)) % (1 << 20)
    keys = (bits << 32) | (4294967295 - idx)  # positive scores: the order-kept bits are the bits
    out = torch.full((rows, CAP), EMPTY.value, dtype=torch.int64)
    out[:, :valid] = keys
    return out.to(device)


def check(before: torch.Tensor, after: torch.Tensor, m: torch.Tensor) -> bool:
    ok = bool(((m >= TOPK) & (m <= TOPK + SLACK)).all())
    want = before.sort(dim=1, descending=True).values
    for r in range(0, before.shape[0], max(1, before.shape[0] // 64)):
        mr = int(m[r])
        got = after[r, :mr].sort(descending=True).values
        ok &= torch.equal(got, want[r, :mr])
    return ok


def _time(fn, reps: int = 5) -> float:
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn(prepare=True)
        e0.record()
        fn(prepare=False)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    return sorted(ts)[len(ts) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows-per-program", type=int, default=16)
    ap.add_argument("--valid", type=int, default=3900, help="valid keys per buffer (the fused kernel compacts at ~3,900)")
    ap.add_argument("--per-thread", default="32,2", help="Gluon layouts: consecutive keys per thread")
    ap.add_argument("--rows-together", default="1,2r,4r",
                    help="Triton: rows compacted together (one reduction per pass); 'r': keys read again for the store")
    ap.add_argument("--compile-only", action="store_true", help="sm_90 builds without a GPU: registers and SASS")
    args = ap.parse_args(argv)
    compact_row = _compact_row_fn()
    per_thread = [int(x) for x in args.per_thread.split(",") if x]
    # "2" or "2r" (r: the keys read again for the store, only score bits live in the search)
    together = [(int(x.rstrip("r")), x.endswith("r")) for x in args.rows_together.split(",") if x]
    if any(r < 1 or r & (r - 1) or args.rows_per_program % r for r, _ in together):
        ap.error(f"--rows-together {args.rows_together}: powers of two dividing --rows-per-program")
    if args.compile_only:
        import inspect_hytopk as ih
        from triton.runtime import driver
        driver.set_active(ih._Sm90())
        bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        w = torch.empty(CAP, dtype=torch.int64)
        m = torch.empty(1, dtype=torch.int32)
        builds = [("triton _compact_row", _triton_harness.warmup(w, m, args.valid, 4, TOPK, CAP, SLACK, compact_row,
                                                                 grid=(1,), num_warps=WARPS))]
        for r, reload in together:
            builds.append((f"triton, {r} rows together{', reload' if reload else ''}", _triton_rows_harness.warmup(
                w, m, args.valid, 4, r, TOPK, CAP, SLACK, reload, grid=(1,), num_warps=WARPS)))
        for pt in per_thread:
            builds.append((f"gluon, {pt} keys per thread", _gluon_harness.warmup(
                w, m, args.valid, 4, TOPK, CAP, SLACK, pt, grid=(1,), num_warps=WARPS)))
        for name, ck in builds:
            rep = ih.ptxas_report(ck.asm["ptx"], bindir)
            sass = ih.sass_counts(ck.asm["cubin"], bindir)[0]
            print(f"{name:32s} regs {rep.get('regs')} spill {rep.get('spill_st')}/{rep.get('spill_ld')} "
                  f"sass {sass['sass']} bar {sass['bar']}")
        return 0
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (or --compile-only)")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for nprog in (2 * sms, sms):
        total = nprog * args.rows_per_program
        src = make_rows(total, args.valid, 0, dev)
        work = torch.empty_like(src)
        m = torch.empty(total, dtype=torch.int32, device=dev)
        variants = [("triton (the fused kernel's _compact_row)",
                     lambda: _triton_harness[(nprog,)](work, m, args.valid, args.rows_per_program, TOPK, CAP, SLACK,
                                                      compact_row, num_warps=WARPS))]
        for r, reload in together:
            variants.append((f"triton, {r} rows compacted together{', keys reloaded' if reload else ''}",
                             lambda r=r, reload=reload: _triton_rows_harness[(nprog,)](
                                 work, m, args.valid, args.rows_per_program, r, TOPK, CAP, SLACK, reload,
                                 num_warps=WARPS)))
        for pt in per_thread:
            variants.append((f"gluon, {pt} consecutive keys per thread",
                             lambda pt=pt: _gluon_harness[(nprog,)](work, m, args.valid, args.rows_per_program,
                                                                    TOPK, CAP, SLACK, pt, num_warps=WARPS)))
        for name, launch in variants:
            def fn(prepare, launch=launch):
                if prepare:
                    work.copy_(src)
                else:
                    launch()
            fn(True)
            launch()
            torch.cuda.synchronize()
            ok = check(src, work, m)
            ms = _time(fn)
            # kcycles per compaction per program (programs of an SM run side by side), at
            # 1,980 MHz (the H200's clock while the fused kernel runs at 32K, session 8)
            kcyc = ms * 1e-3 * 1.98e9 / args.rows_per_program / 1e3
            rows.append((nprog, name, ms, kcyc, ok))
            print(f"{nprog} programs, {name}: {ms:.3f} ms, {kcyc:.1f} kcycles per compaction, ok={ok}", file=sys.stderr)
    print(f"\nCompaction alone ({torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"CAP={CAP}, k={TOPK}, slack={SLACK}, {args.valid} valid keys, {args.rows_per_program} per program, 4 warps)")
    print("| programs | kernel | ms | kcycles per compaction (per program, at 1,980 MHz) | checked |")
    print("|---|---|---|---|---|")
    for nprog, name, ms, kcyc, ok in rows:
        print(f"| {nprog} | {name} | {ms:.3f} | {kcyc:.1f} | {'yes' if ok else 'NO'} |")
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
