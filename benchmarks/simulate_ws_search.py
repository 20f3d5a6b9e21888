"""How many passes does a compaction's threshold search need, on real DSA scores? (CPU)

    python benchmarks/simulate_ws_search.py [--seq 32768] [--rows 12] [--inputs iid,struct]

A pass is one count of a row's window above a guess: in the warp-specialized calibration
(benchmarks/calibrate_gluon_ws.py, docs/kernel-design.md v21) each costs ~1.1-1.6 kcycles of
the selector, the bottleneck at 32K, and the bracketing search took 4.8 passes on iid inputs
but 8.4 on structured ones. This replays the calibration's buffer policy on the scores of
sampled causal rows (bench_hytopk's inputs, scores in float64 rounded to fp32): keys in
order, appended when above the row's threshold, 64 lanes of 30 slots per half, a compaction
of kept (<= k + 128) + half keys whenever a lane is full and at the row's end (exact k). Each
strategy searches the same windows; the table gives passes per searching compaction,
in-loop and final. Not modelled: the 4 rows of a block handing over together, and the
scorer's threshold being one handoff old (both change which windows occur, not the search).
Strategies (all return a threshold keeping k .. k + slack keys, exactly k at the end):

* bits     one bit per pass from the highest bit where the window's scores differ
* value    v19's bracketing: regula falsi in value space, Illinois, bisection fallback
* u        the same line in score-bits space (roughly log-value)
* warm     value bracketing whose first guess comes from the row's previous compaction:
           the score where the previous window's final bracket line puts the new target
* two      two guesses per pass (two counts packed in one reduction), line through the
           bracket at two targets inside [k, k + slack] (exact: straddling k)
* two-warm the same, its first pass from the previous compaction (calibrate_gluon_ws's
           ``:two``, measured in docs/kernel-design.md v21: fewer passes, not fewer cycles)

Default strategies: bits,value,u,warm,two,two-warm.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

K, SLACK, LANES, SUBH = 2048, 128, 64, 30


def to_u(y: np.ndarray) -> np.ndarray:
    """fp32 scores -> order-preserving uint32 score bits (as int64)"""
    b = y.astype(np.float32).view(np.int32).astype(np.int64)
    b = np.where(b < 0, b ^ 0x7FFFFFFF, b)
    return (b + (1 << 31)) & 0xFFFFFFFF


def u_value(u: int) -> float:
    b = (int(u) - (1 << 31))
    b = b ^ 0x7FFFFFFF if b < 0 else b
    return float(np.array([b], np.int32).view(np.float32)[0])


def value_u(v: float) -> int:
    b = int(np.array([v], np.float32).view(np.int32)[0])
    b = b ^ 0x7FFFFFFF if b < 0 else b
    return (b + (1 << 31)) & 0xFFFFFFFF


def count(u, c):
    return int((u >= c).sum())


def search_bits(u, keep_lo, keep_hi, state):
    umin, umax = int(u.min()), int(u.max())
    if umin == umax:
        return umin, 0
    hb = (umin ^ umax).bit_length() - 1
    bit = 1 << hb
    prefix = (umin >> (hb + 1)) << (hb + 1)
    n_ge, passes = len(u), 0
    while bit and n_ge > keep_hi:
        passes += 1
        c = prefix | bit
        n_c = count(u, c)
        if n_c >= keep_lo:
            prefix, n_ge = c, n_c
        bit >>= 1
    return prefix, passes


def search_bracket(u, keep_lo, keep_hi, state, space="value", first=None):
    lo, hi = int(u.min()), int(u.max()) + 1
    n_lo = len(u)
    t = keep_lo + (keep_hi - keep_lo) * 0.5 + 0.5
    f_lo, f_hi = n_lo - t, -t
    side = slow = passes = 0
    while n_lo > keep_hi and hi - lo > 1:
        passes += 1
        w = hi - lo
        if passes == 1 and first is not None:
            c = first
        elif space == "u":
            c = lo + int(f_lo / (f_lo - f_hi) * (w - 1))
        else:
            v_lo, v_hi = u_value(lo), u_value(hi - 1)
            v = v_lo + f_lo / (f_lo - f_hi) * (v_hi - v_lo)
            c = value_u(v) if np.isfinite(v) else lo + w // 2
        if slow >= 2:
            c = lo + w // 2
        c = min(max(c, lo + 1), hi - 1)
        n_c = count(u, c)
        up = n_c >= keep_lo
        f_c = n_c - t
        if up:
            f_hi = f_hi * 0.5 if side == 1 else f_hi
            f_lo, lo, n_lo, side = f_c, c, n_c, 1
        else:
            f_lo = f_lo * 0.5 if side == 2 else f_lo
            f_hi, hi, side = f_c, c, 2
        slow = slow + 1 if (hi - lo) * 2 > w else 0
    state["last"] = (lo, n_lo, hi, count(u, hi) if hi <= int(u.max()) else 0)
    return lo, passes


def search_warm(u, keep_lo, keep_hi, state):
    # first guess: the previous compaction's final bracket [lo, hi) gave a local density of
    # keys per unit score; the new window has n keys above the previous threshold, so the
    # target count is reached about (n - target) / density above it
    first = None
    if "last" in state:
        lo, n_lo, hi, n_hi = state["last"]
        v_lo, v_hi = u_value(lo), u_value(max(hi - 1, lo))
        dens = (n_lo - n_hi) / max(v_hi - v_lo, 1e-30)
        n_now = count(u, lo)
        t = keep_lo + (keep_hi - keep_lo) * 0.5
        if dens > 0 and n_now > t:
            first = value_u(v_lo + (n_now - t) / dens)
    return search_bracket(u, keep_lo, keep_hi, state, "value", first)


def search_two(u, keep_lo, keep_hi, state, warm=True):
    # two guesses per pass, counted in one reduction (two 16-bit counts packed in an int32):
    # the line through the bracket's ends (or, first, the warm model) at two count targets
    # inside [keep_lo, keep_hi] (in-loop), or straddling keep_lo by a margin (exact); a pass
    # that does not halve the bracket puts one guess at the bracket's midpoint in bits
    lo, hi = int(u.min()), int(u.max()) + 1
    n_lo, n_hi = len(u), 0
    exact = keep_lo == keep_hi
    passes = slow = 0
    model = None
    if warm and "last" in state:
        plo, pn_lo, phi, pn_hi = state["last"]
        v_lo, v_hi = u_value(plo), u_value(max(phi - 1, plo))
        dens = (pn_lo - pn_hi) / max(v_hi - v_lo, 1e-30)
        # the window's keys above the previous threshold, without a pass: all of them (the
        # kept keys are, and the half's were filtered by an equal or older threshold)
        n_now = len(u)
        if dens > 0 and n_now > keep_hi:
            model = (v_lo, n_now, dens)
    while n_lo > keep_hi and hi - lo > 1:
        passes += 1
        w = hi - lo
        if exact:
            m = max(1.0, (n_lo - n_hi) / 16)
            targets = (keep_lo + 0.5 + m, keep_lo + 0.5 - m)
        else:
            targets = (keep_lo + 0.25 * (keep_hi - keep_lo), keep_lo + 0.75 * (keep_hi - keep_lo))
        guesses = []
        for tg in targets:
            if model is not None and passes == 1:
                v0, n0, dens = model
                v = v0 + (n0 - tg) / dens
            else:
                v_lo, v_hi = u_value(lo), u_value(hi - 1)
                v = v_lo + (n_lo - tg) / max(n_lo - n_hi, 1e-30) * (v_hi - v_lo)
            guesses.append(value_u(v) if np.isfinite(v) else lo + w // 2)
        if slow >= 1:
            guesses[1] = lo + w // 2
        for c in guesses:
            c = min(max(c, lo + 1), hi - 1)
            n_c = count(u, c)
            if n_c >= keep_lo and c > lo:
                lo, n_lo = c, n_c
            elif n_c < keep_lo and c < hi:
                hi, n_hi = c, n_c
        slow = slow + 1 if (hi - lo) * 2 > w else 0
    state["last"] = (lo, n_lo, hi, n_hi)
    return lo, passes


STRATEGIES = {"bits": search_bits, "value": search_bracket,
              "u": lambda u, a, b, st: search_bracket(u, a, b, st, "u"), "warm": search_warm,
              "two": lambda u, a, b, st: search_two(u, a, b, st, False), "two-warm": search_two}


def replay_row(y: np.ndarray, strategies) -> dict:
    """passes per strategy (in-loop list, final list) for one row's scores y (fp32, in key order)"""
    u_all = to_u(y)
    out = {}
    for name in strategies:
        fn = STRATEGIES[name]
        state = {}
        kept = np.empty(0, np.int64)
        half = []
        lanes = np.zeros(LANES, int)
        thr = -1  # u threshold: keys with u > thr are taken
        inloop, final = [], []
        ntiles = -(-len(u_all) // LANES)
        t = 0
        while t < ntiles:
            stop = min(ntiles, t + SUBH - lanes.max())
            seg = u_all[t * LANES: stop * LANES]
            taken = np.nonzero(seg > thr)[0]
            np.add.at(lanes, taken % LANES, 1)
            half.append(seg[taken])
            t = stop
            last = t >= ntiles
            if lanes.max() >= SUBH or last:
                win = np.concatenate([kept] + half)
                if last:
                    if len(win) > K:
                        c, p = fn(win, K, K, state)
                        final.append(p)
                elif len(win) > K + SLACK:
                    c, p = fn(win, K, K + SLACK, state)
                    inloop.append(p)
                    thr = max(thr, c - 1)
                    win = win[win >= c]
                kept, half = win, []
                lanes[:] = 0
        out[name] = (inloop, final)
    return out


def row_scores(q, k, w, s, scale):
    qs = q[0, s].double()                         # [H, D]
    x = torch.relu((qs @ k[0, : s + 1].double().T) * scale)
    return (w[0, s].double() @ x).float().numpy()  # fp32 rounding of the float64 score


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--inputs", default="iid,struct")
    ap.add_argument("--strategies", default="bits,value,u,warm,two,two-warm")
    args = ap.parse_args(argv)
    import bench_hytopk as bh

    strategies = args.strategies.split(",")
    S = args.seq
    rows = np.linspace(S // 2, S - 1, args.rows).astype(int)
    print(f"# passes per searching compaction, {args.rows} rows in [{S // 2}, {S}), S={S}, k={K}, slack={SLACK}, "
          f"halves of {LANES} lanes x {SUBH}")
    print("| inputs | strategy | in-loop passes | final passes | searching compactions per row (in-loop) |")
    print("|---|---|---|---|---|")
    for inp in args.inputs.split(","):
        q, k, w = bh.make_inputs(S, inp, seed=11, device="cpu")
        agg = {n: ([], []) for n in strategies}
        for s in rows:
            y = row_scores(q, k, w, int(s), bh.SCALE)
            for n, (a, b) in replay_row(y, strategies).items():
                agg[n][0].extend(a)
                agg[n][1].extend(b)
            print(f"  row {s} done", file=sys.stderr, flush=True)
        for n in strategies:
            a, b = agg[n]
            print(f"| {inp} | {n} | {np.mean(a):.2f} | {np.mean(b):.2f} | {len(a) / len(rows):.2f} |")
        del q, k, w
    return 0


if __name__ == "__main__":
    sys.exit(main())
