"""Where the HyTopK kernel's time goes, by section: the SM cycle counter read around each
part of a row block (``HyTopKConfig(profile=True)``), summed over programs.

    python benchmarks/profile_sections.py --seqs 32768,131072 [--inputs iid,struct] [--configs "default;low_water=16"]

Sections: the scored-tile loops (scoring + append), the compactions inside the loop, the
final compactions, the filler tiles, and the sort + write; "rest" is the whole row block
minus those (scheduling, loop restarts' bookkeeping). Counts: rows compacted inside the
loop, per row; inner-loop runs per row block; and the tile loop's cycles per scored tile.
A compaction (in the loop, and the final one) is split into loading the row's buffer, the
threshold search, and the cumsum + store, in kcycles per compaction.
``--configs`` items are ``HyTopKConfig`` fields over the default (``score_only=1`` times
the loop without selection). Shape and inputs are ``bench_hytopk.py``'s (H=64, D=128,
k=2048, causal, bf16). The timer reads add a little work: compare shares and cycles, take
times from ``bench_hytopk.py``. Prints a table last.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_hytopk as bh  # noqa: E402
from sweep_hytopk_config import default_fields, parse_fields  # noqa: E402

SECTIONS = ("tile loop", "in-loop compactions", "final compactions", "fillers", "sort + write")


def profile(S: int, inputs: str, config: str):
    """Per-slot totals over programs (see _prof_add in the generated kernel), rows per block."""
    from hyscale_compile.lowerings import triton_hytopk as th

    q, k, w = bh.make_inputs(S, inputs, seed=0)
    hi = (torch.arange(S, device="cuda") + 1).view(1, S)
    fields = parse_fields(config) if config and config != "default" else {}
    cfg = th.HyTopKConfig(**{**default_fields(S), **fields}, profile=True)
    th.hytopk_triton(q, k.unsqueeze(2), w, [hi], bh.TOPK, bh.dsa_spec(), config=cfg)  # compile
    prof = th.hytopk_triton(q, k.unsqueeze(2), w, [hi], bh.TOPK, bh.dsa_spec(), config=cfg)
    torch.cuda.synchronize()
    return prof.sum(0).tolist(), th._block_m(cfg, bh.H, False), cfg.block_n


def _compaction(slots):
    """kcycles per compaction (count, load, of it keys in, search, store) and passes per search,
    from _compact_row's / _compact_lanes' eight profile slots"""
    n = max(slots[6], 1)
    load, search, store, keys_in, passes, lanes = slots[:6]
    return [lanes / n / 1e3, load / n / 1e3, keys_in / n / 1e3, search / n / 1e3, store / n / 1e3, passes / n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="32768")
    ap.add_argument("--inputs", default="iid")
    ap.add_argument("--configs", default="default", help='";"-separated HyTopKConfig field lists, e.g. "default;low_water=16"')
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the section timers read the SM cycle counter)")
    rows = []
    for S in (int(x) for x in args.seqs.split(",")):
        for inputs in args.inputs.split(","):
            for config in (c.strip() for c in args.configs.split(";") if c.strip()):
                tot, block_m, block_n = profile(S, inputs, config)
                block = tot[5]
                rest = block - sum(tot[:5])
                blocks = -(-S // block_m)
                tiles = sum(-(-(min(S, r0 + block_m)) // block_n) for r0 in range(0, S, block_m))  # causal
                shares = [100.0 * x / block for x in tot[:5]] + [100.0 * rest / block]
                # one compaction (per row), in kcycles: the key count (lanes), the load (until
                # the row's max is known; of it, until the last key is in), the search, the
                # cumsum + store; and the search's one-bit passes
                inl, fin = (_compaction(tot[b:b + 8]) for b in (16, 24))
                rows.append((S, inputs, config, shares, tot[6] / S, tot[7] / blocks, block / blocks, tot[0] / tiles,
                             inl, fin))
                bh.log(S, inputs, config, tot)
    print(f"\nHyTopK sections ({torch.cuda.get_device_name()}, torch {torch.__version__}): % of row-block cycles")
    print("| S | inputs | config | " + " | ".join(SECTIONS) + " | rest | compactions / row | inner loops / block "
          "| kcycles / block | loop cycles / tile | in-loop compaction kcycles: count / load (keys in) / search / store, "
          "passes | final compaction, the same |")
    print("|---" * (len(SECTIONS) + 11) + "|")
    for S, inputs, config, shares, comp, loops, cyc, per_tile, inl, fin in rows:
        print(f"| {S} | {inputs} | {config} | " + " | ".join(f"{x:.1f}" for x in shares)
              + f" | {comp:.2f} | {loops:.1f} | {cyc / 1e3:.0f} | {per_tile:.0f} | "
              + " | ".join(_fmt(c) for c in (inl, fin)) + " |")
    return 0


def _fmt(c):
    lanes, load, keys_in, search, store, passes = c
    return f"{lanes:.1f} / {load:.1f} ({keys_in:.1f}) / {search:.1f} / {store:.1f}, {passes:.1f}"


if __name__ == "__main__":
    sys.exit(main())
