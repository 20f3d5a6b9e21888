"""Simulate the HyTopK tile loop's candidate-buffer policy on iid scores (CPU, numpy): how
many compactions a row needs and how many keys they load, for the buffer layouts of
docs/kernel-design.md (v10).

    python benchmarks/simulate_compactions.py [--seqs 32768,131072] [--rows 48] [--seed 0]

Model: a causal row sees n keys (n uniform in [1, S)), in tiles of 64; the key at offset j
of a tile goes to lane j. A key is appended when it is above the row's threshold. An inner
loop runs as many tiles as the fullest lane has free slots; after it, a row whose fullest
lane has fewer than low_water free slots is compacted to its best k + slack keys, which
sets its threshold (slack 128: the kernel's 2 x BLOCK_N). The per-row counts of the kernel's profile (`profile_sections.py`,
slot 6) are the measured counterpart. Not modelled: the 4 rows of a block sharing inner
loops (sync_water), ties, masked keys.
"""
from __future__ import annotations

import argparse

import numpy as np

LAYOUTS = {
    # name: (lane slots, kept keys in their own area)
    "v9: kept keys back into the lanes (CAP 4096)": (64, False),
    "v10: kept area + lanes of 64 slots": (64, True),
    "kept area + lanes of 32 slots": (32, True),
    "lanes of 128 slots (CAP 8192)": (128, False),
}


def simulate_row(scores, k, subcap, kept_area, block_n=64, low_water=8, slack=128):
    """(compactions inside the loop, keys they loaded, keys left for the final compaction)"""
    ntiles = -(-len(scores) // block_n)
    lanes = np.zeros(block_n, int)
    thr = -np.inf
    kept = np.empty(0, np.float32)  # the kept area (kept_area) or nothing
    new = []                        # keys appended to the lanes since the last compaction
    compactions = loaded = 0
    t = 0
    while t < ntiles:
        stop = min(ntiles, t + subcap - lanes.max())
        seg = scores[t * block_n: stop * block_n]
        taken = np.nonzero(seg > thr)[0]
        np.add.at(lanes, taken % block_n, 1)
        new.append(seg[taken])
        t = stop
        if t < ntiles and lanes.max() > subcap - low_water:
            keys = np.concatenate([kept] + new)
            compactions += 1
            loaded += len(keys)
            if len(keys) > k:
                # the best k + slack (the kernel's search may stop with up to k + slack kept;
                # this keeps exactly that many, its worst case for room)
                m = min(len(keys), k + slack)
                keys = np.partition(keys, len(keys) - m)[len(keys) - m:]
                thr = keys.min()
            if kept_area:
                kept, new = keys, []
                lanes[:] = 0
            else:
                kept, new = np.empty(0, np.float32), [keys]
                lanes[:] = len(keys) // block_n
                lanes[: len(keys) % block_n] += 1
    return compactions, loaded, len(kept) + sum(len(x) for x in new)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="32768,131072")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.rows < 1 or a.topk < 1:
        ap.error("--rows and --topk must be >= 1")
    try:
        seqs = [int(x) for x in a.seqs.split(",") if x]
    except ValueError:
        ap.error(f"--seqs must be comma-separated integers, got {a.seqs!r}")
    if not seqs or min(seqs) < 2:
        ap.error("--seqs: every S must be >= 2")
    rng = np.random.default_rng(a.seed)
    print("| S | layout | compactions / row | keys loaded / row | keys at the final compaction |")
    print("|---|---|---|---|---|")
    for S in seqs:
        ns = rng.integers(1, S, a.rows)
        for name, (subcap, kept_area) in LAYOUTS.items():
            r = np.array([simulate_row(rng.standard_normal(int(n)).astype(np.float32), a.topk, subcap, kept_area)
                          for n in ns])
            print(f"| {S} | {name} | {r[:, 0].mean():.2f} | {r[:, 1].mean():,.0f} | {r[:, 2].mean():,.0f} |")


if __name__ == "__main__":
    main()
