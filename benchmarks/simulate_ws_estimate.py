"""How much selection does a sampled threshold estimate save, and how often is it wrong? (CPU)

    python benchmarks/simulate_ws_estimate.py [--seq 32768] [--blocks 8] [--rows 300] [--z 2,3,3.5,4]

The question behind docs/kernel-design.md v22 (calibrate_gluon_ws.py ``--selectors 1:p``): a
row appends ~k (1 + ln(n/k)) keys when its threshold rises only with its own keys. With an
estimate taken first from a sample of the row's keys (every P-th key; the j-th best of the m
sampled, j = ceil(e + z sqrt(e)), e = k m / n its expected share of the row's k best), the
main pass takes only keys scoring >= the estimate, and the row is exact iff k keys did (else
its block is redone without it). Two tables, on bench_hytopk's inputs (scores in float64
rounded to fp32):

* **replay**: 4-row blocks (rows in [S/8, S)) through the calibration's buffer policy (64 lanes
  x 30 slots per half, handed over when a lane would overflow, kept k + 128 per compaction,
  the threshold current: the calibration's is one handoff older), without and with the
  estimate (z = the first of --z): halves per block, keys appended per row, in-loop searching
  compactions per row, rows failing;
* **failures**: random rows in [6144, S) per z: rows with an estimate, rows that would fail,
  and the keys >= the estimate per row (mean, min: above k is the margin).

The sample here starts at key 0 like the kernel's (keys 0, P, 2P, ...); the rows' estimates
need m >= 2 j sampled keys, as in the kernel.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

K, SLACK, LANES, SUBH = 2048, 128, 64, 30


def estimate_u(u_row: np.ndarray, P: int, z: float):
    """the u-space threshold (keys with u > it are taken) from every P-th key, or None"""
    samp = u_row[::P]
    m, n = len(samp), len(u_row)
    e = K * m / n
    j = math.ceil(e + z * math.sqrt(e))
    if m < 2 * j:
        return None
    return int(np.sort(samp)[::-1][j - 1]) - 1


def replay_block(ys, P: int, z: float | None):
    """(halves, keys appended per row, in-loop searches per row, rows failing) for 4 rows"""
    import simulate_ws_search as sw

    us = [sw.to_u(y) for y in ys]
    ntiles = -(-max(len(u) for u in us) // LANES)
    valid = [np.arange(ntiles * LANES) < len(u) for u in us]
    us = [np.concatenate([u, np.zeros(ntiles * LANES - len(u), np.int64)]) for u in us]
    thr = [-1] * len(ys)
    est = [None] * len(ys)
    if z is not None:
        for r, y in enumerate(ys):
            est[r] = estimate_u(us[r][: len(y)], P, z)
            if est[r] is not None:
                thr[r] = est[r]
    kept = [np.empty(0, np.int64) for _ in ys]
    half = [[] for _ in ys]
    cnt = np.zeros((len(ys), LANES), int)
    halves = appended = searches = 0

    def compact(final):
        nonlocal searches
        for r in range(len(ys)):
            win = np.concatenate([kept[r]] + half[r])
            if not final and len(win) > K + SLACK:
                c = np.sort(win)[::-1][K + SLACK - 1]
                win = win[win >= c]
                thr[r] = max(thr[r], c - 1)
                searches += 1
            kept[r], half[r] = win, []

    for t in range(ntiles):
        if (cnt + 1 > SUBH).any():
            halves += 1
            compact(False)
            cnt[:] = 0
        for r in range(len(ys)):
            seg = us[r][t * LANES:(t + 1) * LANES]
            tk = (seg > thr[r]) & valid[r][t * LANES:(t + 1) * LANES]
            half[r].append(seg[tk])
            cnt[r] += tk
            appended += int(tk.sum())
    halves += 1
    compact(True)
    fails = sum(1 for r in range(len(ys)) if est[r] is not None and len(kept[r]) < K)
    return halves, appended / len(ys), searches / len(ys), fails


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--inputs", default="iid,struct")
    ap.add_argument("--blocks", type=int, default=8, help="4-row blocks replayed per input")
    ap.add_argument("--rows", type=int, default=300, help="rows checked for failures per input")
    ap.add_argument("--z", default="3.5,2,3,4")
    ap.add_argument("--stride", type=int, default=0, help="P (default: calibrate_gluon_ws.sample_stride(S))")
    args = ap.parse_args(argv)
    import bench_hytopk as bh
    import calibrate_gluon_ws
    import simulate_ws_search as sw

    S = args.seq
    P = args.stride or calibrate_gluon_ws.sample_stride(S)
    zs = [float(x) for x in args.z.split(",")]
    rep = ["| inputs | halves / block | keys appended / row | in-loop searches / row | rows failing |",
           "|---|---|---|---|---|"]
    fail = ["| inputs | z | rows with an estimate | rows failing | keys >= estimate per row: mean (min) |",
            "|---|---|---|---|---|"]
    rng = np.random.default_rng(0)
    for inp in args.inputs.split(","):
        q, k, w = bh.make_inputs(S, inp, seed=11, device="cpu")
        base, pre = [], []
        for r0 in np.linspace(S // 8, S - 4, args.blocks).astype(int) // 4 * 4:
            ys = [sw.row_scores(q, k, w, int(r0 + i), bh.SCALE) for i in range(4)]
            base.append(replay_block(ys, P, None))
            pre.append(replay_block(ys, P, zs[0]))
            print(f"  {inp}: block at row {r0} done", file=sys.stderr, flush=True)
        b, p = np.array(base, float), np.array(pre, float)
        rep.append(f"| {inp} | {b[:, 0].mean():.2f} -> {p[:, 0].mean():.2f} | {b[:, 1].mean():,.0f} -> "
                   f"{p[:, 1].mean():,.0f} | {b[:, 2].mean():.2f} -> {p[:, 2].mean():.2f} | "
                   f"{int(p[:, 3].sum())} / {4 * args.blocks} |")
        stats = {z: [] for z in zs}
        for s in np.sort(rng.integers(min(6144, S - 1), S, args.rows)):
            y = sw.row_scores(q, k, w, int(s), bh.SCALE)
            u = sw.to_u(y)
            kth = np.sort(u)[::-1][K - 1]
            for z in zs:
                e = estimate_u(u, P, z)
                if e is not None:
                    stats[z].append((kth <= e, int((u > e).sum())))
        for z in zs:
            a = np.array(stats[z], float).reshape(-1, 2)
            if len(a):
                fail.append(f"| {inp} | {z:g} | {len(a)} | {int(a[:, 0].sum())} | {a[:, 1].mean():,.0f} "
                            f"({a[:, 1].min():,.0f}) |")
        del q, k, w
    print(f"# S={S}, k={K}, every {P}-th key sampled; replay: {args.blocks} blocks of 4 rows in [S/8, S), "
          f"z={zs[0]:g}, without -> with the estimate")
    print("\n".join(rep))
    print(f"\n# failures: {args.rows} random rows in [6144, S) per input")
    print("\n".join(fail))
    return 0


if __name__ == "__main__":
    sys.exit(main())
