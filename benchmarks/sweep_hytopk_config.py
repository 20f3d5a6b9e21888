"""Launch-parameter sweep of the generated HyTopK kernel at the DSA shape (one GPU).

    python benchmarks/sweep_hytopk_config.py --seq 32768 [--configs default,w8,...] [--deadline 300]
    python benchmarks/sweep_hytopk_config.py --configs "default;num_stages=2,low_water=16"

For each ``HyTopKConfig`` in the list: the full kernel's median time, whether sampled rows pass the contract's threshold check (docs/contract.md, "Exact top-k"), and
whether the indices are bit-identical to the first config's (launch parameters must never
change the result). Shape and inputs
are ``bench_hytopk.py``'s (H=64, D=128, k=2048, causal, bf16, iid). Prints a table last;
configs past ``--deadline`` seconds are listed as skipped.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_hytopk as bh  # noqa: E402
from hyscale_compile.lowerings import config_text  # noqa: E402
from hyscale_compile.lowerings.triton_hytopk import HyTopKConfig  # noqa: E402

CONFIGS = {
    # name: HyTopKConfig kwargs (block_m None: 256 // heads-per-kv-head = 4 rows at H=64)
    "default": None,  # the launch's own default at the DSA shape (filled in by main)
    "w8": dict(block_n=64, num_warps=8, num_stages=2),
    "n128w8": dict(block_n=128, num_warps=8, num_stages=2),
    "m2s3": dict(block_m=2, block_n=64, num_warps=4, num_stages=3),
    "n32s3": dict(block_n=32, num_warps=4, num_stages=3),
    "m8w8": dict(block_m=8, block_n=64, num_warps=8, num_stages=2),
}


def default_fields(seq: int) -> dict:
    """The launch's own default at the DSA shape, as the config fields it sets (every field
    that differs from ``HyTopKConfig()``'s, so that an option the default turns on, such as
    the sampled estimate (``presample``), is in "default" too; a fixed list of fields would
    silently drop the next one)."""
    from hyscale_compile.lowerings.triton_hytopk import HyTopKConfig, default_config

    # the benchmark's keys ([1, S, 1, D] bf16, contiguous) take TMA key tiles
    d = default_config(seq, seq, bh.TOPK, torch.device("cuda"), True, bh.D, bh.H, tma=True)
    base = HyTopKConfig()
    return {f.name: getattr(d, f.name) for f in dataclasses.fields(d) if getattr(d, f.name) != getattr(base, f.name)}


def parse_fields(text: str) -> dict:
    """'num_stages=2,low_water=4,sort=after' -> {'num_stages': 2, 'low_water': 4, 'sort': 'after'}
    (``HyTopKConfig`` fields, typed by their annotations)."""
    return config_text.parse_fields(text, HyTopKConfig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--configs", default="default,w8,n128w8,m2s3")
    ap.add_argument("--deadline", type=float, default=1e9)
    ap.add_argument("--inputs", default="iid", choices=("iid", "struct"), help="bench_hytopk's input generators")
    args = ap.parse_args(argv)
    # named configs separated by ","; or, when any "=" appears, ";"-separated items that are
    # each a name or a comma-separated list of HyTopKConfig fields over the default
    # ("num_stages=2,low_water=16")
    CONFIGS["default"] = default_fields(args.seq)
    names = [c.strip() for c in args.configs.split(";" if "=" in args.configs else ",") if c.strip()]
    for c in names:
        if "=" in c:
            CONFIGS[c] = {**CONFIGS["default"], **parse_fields(c)}
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; known: {sorted(CONFIGS)}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    from hyscale_compile.lowerings import triton_hytopk as th

    t_start = time.time()
    S = args.seq
    q, k, w = bh.make_inputs(S, args.inputs, seed=0)
    hi = (torch.arange(S, device="cuda") + 1).view(1, S)
    spec = bh.dsa_spec()
    floor = bh.H * bh.D * 2 * S * (S + 1) / 2 / bh.matmul_rate() * 1e3
    rows = bh.sample_rows(S)
    ref_idx = None
    table = []
    for name in names:
        if time.time() - t_start > args.deadline:
            table.append((name, None, None, None, "SKIPPED (deadline)"))
            continue
        kw = CONFIGS[name]
        cfg = th.HyTopKConfig(**kw)
        t0 = time.time()
        ms, _, idx, _ = bh.measure(lambda: th.hytopk_triton(q, k.unsqueeze(2), w, [hi], bh.TOPK, spec, config=cfg))
        first = time.time() - t0
        redone = th.redone_blocks()  # (the last call's: presample's blocks scored twice)
        exact = bh.check_rows(idx, q, k, w, rows)
        same = None
        if ref_idx is None:  # the first config is the reference
            ref_idx = idx.clone()
        if ref_idx is not None:
            same = "yes" if torch.equal(idx, ref_idx) else "NO"
            if same == "NO" and cfg.sort == "none":  # unsorted rows: the same sets?
                same = "as sets" if torch.equal(idx.sort(-1).values, ref_idx.sort(-1).values) else "NO (sets)"
        table.append((name, ms, exact, same, f"{kw}; first call {first:.1f} s"
                      + (f"; {redone} blocks redone in the last call" if redone else "")))
        bh.log(name, ms, exact, same)
    print(f"\nS={S}, H={bh.H}, D={bh.D}, k={bh.TOPK}, causal, {args.inputs} bf16; floor {floor:.2f} ms "
          f"({torch.cuda.get_device_name()}, torch {torch.__version__})")
    print("| config | hytopk ms (x floor) | exact | bits = first config | parameters |")
    print("|---|---|---|---|---|")
    for name, ms, exact, same, note in table:
        if ms is None:
            print(f"| {name} | - | - | - | {note} |")
            continue
        print(f"| {name} | {ms:.2f} ({ms / floor:.2f}) | "
              f"{'yes' if exact else 'NO'} | {same or '-'} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
