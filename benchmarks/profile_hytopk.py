"""Where the HyTopK kernel spends its time, by source line: Nsight Compute's warp-stall
samples per SASS instruction, summed over the kernel source lines they come from.

On the GPU machine (ncu must be able to read the counters):

    python benchmarks/profile_hytopk.py --seq 32768 --out $OUT [--config "num_stages=2,low_water=16"]
    python benchmarks/profile_hytopk.py --target sort_rows --seq 32768 --out $OUT   # the rows' sort kernel

``--target sort_rows`` profiles the rows' sort kernel instead (``sort_rows_``'s default at
2,048 keys, ``--seq`` rows of ``calibrate_sort.py``'s "tail" data), adding the memory
workload tables: the network moves its keys through shared memory, so its bank conflicts
are part of its cost.

This runs ncu on itself (``--child``: one warm-up launch, then the profiled one), exports
the per-instruction source page as CSV, and prints the lines of the generated kernel that
hold the most stall samples, with the kernel-level stall reasons. Full CSVs land in --out.
Offline analysis of a saved CSV: ``--analyze FILE.csv``.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import re
import subprocess
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def child_sort_rows(rows: int, config: str) -> None:
    import torch

    import calibrate_sort as cs
    from hyscale_compile.lowerings.triton_sort_rows import sort_rows_
    from sweep_hytopk_config import parse_fields

    _, idx, val = cs.make_rows(rows, 2048, seed=rows, data="tail")
    kw = parse_fields(config) if config else {}  # sort_rows_'s keywords, e.g. "rows_per_program=2,num_warps=8"
    for _ in range(2):  # the first launch compiles; ncu skips it
        sort_rows_(idx.clone(), val, write_values=False, index_bound=int(idx.max()) + 1, **kw)
    torch.cuda.synchronize()


def child(seq: int, config: str) -> None:
    import torch

    import bench_hytopk as bh
    from hyscale_compile.lowerings import triton_hytopk as th
    from sweep_hytopk_config import parse_fields

    q, k, w = bh.make_inputs(seq, "iid", seed=0)
    hi = (torch.arange(seq, device="cuda") + 1).view(1, seq)
    cfg = th.HyTopKConfig(**parse_fields(config)) if config else None
    for _ in range(2):  # the first launch compiles; ncu skips it
        th.hytopk_triton(q, k.unsqueeze(2), w, [hi], bh.TOPK, bh.dsa_spec(), config=cfg)
    torch.cuda.synchronize()


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def analyze(text: str, top: int = 40) -> str:
    """Sum 'Warp Stall Sampling (All Samples)' per source line of the source-page CSV, with the
    kernel's stall reasons in all and each line's three largest."""
    rows = list(csv.reader(io.StringIO(text)))
    head_i = next(i for i, r in enumerate(rows) if any("Warp Stall Sampling" in c for c in r))
    head = rows[head_i]
    col = next(i for i, c in enumerate(head) if c.startswith("Warp Stall Sampling (All"))
    src_col = next((i for i, c in enumerate(head) if c in ("Source", "# Source")), None)
    reasons = [(i, c[len("stall_"):]) for i, c in enumerate(head) if c.startswith("stall_") and "Not Issued" not in c]
    per_line = defaultdict(float)
    per_reason = defaultdict(lambda: defaultdict(float))
    total = 0.0
    current = "?"
    for r in rows[head_i + 1:]:
        if len(r) <= col:
            continue
        # the source view interleaves source lines (file:line text) and their SASS
        line_id = r[0]
        samples = _num(r[col])
        text_cell = r[src_col] if src_col is not None and src_col < len(r) else ""
        if re.match(r"^\d+$", line_id) and text_cell and not re.match(r"^\s*[@A-Z]", text_cell):
            current = f"{line_id}: {text_cell.strip()[:90]}"
        per_line[current] += samples
        total += samples
        for i, name in reasons:
            if i < len(r):
                per_reason[current][name] += _num(r[i])
    out = [f"total stall samples: {total:.0f}"]
    if reasons:
        kernel = defaultdict(float)
        for d in per_reason.values():
            for name, v in d.items():
                kernel[name] += v
        n = max(sum(kernel.values()), 1)
        out.append("stall reasons: " + ", ".join(f"{name} {100 * v / n:.1f}%" for name, v in
                                                 sorted(kernel.items(), key=lambda kv: -kv[1]) if v))
    for key, val in sorted(per_line.items(), key=lambda kv: -kv[1])[:top]:
        d = per_reason.get(key, {})
        n = max(sum(d.values()), 1)
        why = ", ".join(f"{name} {100 * v / n:.0f}" for name, v in sorted(d.items(), key=lambda kv: -kv[1])[:3] if v)
        out.append(f"{100 * val / max(total, 1):6.2f}%  {key}" + (f"  [{why}]" if why else ""))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--config", default="", help="HyTopKConfig fields, e.g. 'num_stages=2,low_water=16' "
                    "(--target sort_rows: sort_rows_'s keywords, e.g. 'rows_per_program=2,num_warps=8')")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--analyze", default=None, help="a saved source-page CSV")
    ap.add_argument("--target", default="hytopk", choices=("hytopk", "sort_rows"),
                    help="the fused kernel, or the rows' sort kernel (--seq rows)")
    args = ap.parse_args()
    if args.child:
        if args.target == "sort_rows":
            child_sort_rows(args.seq, args.config)
        else:
            child(args.seq, args.config)
        return 0
    if args.analyze:
        with open(args.analyze) as f:
            print(analyze(f.read()))
        return 0
    os.makedirs(args.out, exist_ok=True)
    rep = os.path.join(args.out, args.target)
    kernel = "_sort_rows_kernel" if args.target == "sort_rows" else "hytopk_kernel"
    extra_sections = ["--section", "MemoryWorkloadAnalysis", "--section", "MemoryWorkloadAnalysis_Tables",
                      "--section", "ComputeWorkloadAnalysis", "--section", "InstructionStats", "--section",
                      "SchedulerStats"] if args.target == "sort_rows" else []
    cmd = ["ncu", "--clock-control", "none", "--kernel-name", kernel, "--launch-skip", "1",
           "--launch-count", "1", "--import-source", "yes", "--section", "SourceCounters", "--section",
           "WarpStateStats", "--section", "SpeedOfLight", "--section", "Occupancy", "--section", "LaunchStats",
           *extra_sections, "-f", "-o", rep, sys.executable, os.path.abspath(__file__), "--child", "--seq",
           str(args.seq), "--config", args.config, "--target", args.target]
    print(" ".join(cmd), file=sys.stderr)
    r = subprocess.run(cmd, capture_output=True, text=True)
    with open(os.path.join(args.out, "ncu.log"), "w") as f:
        f.write(r.stdout + r.stderr)
    if r.returncode != 0:
        print(r.stdout[-3000:] + r.stderr[-3000:])
        return r.returncode
    details = subprocess.run(["ncu", "--import", rep + ".ncu-rep", "--page", "details"], capture_output=True,
                             text=True)
    with open(os.path.join(args.out, "details.txt"), "w") as f:
        f.write(details.stdout + details.stderr)
    src = None
    for extra in (["--print-source", "cuda,sass"], ["--print-source", "sass"], []):
        res = subprocess.run(["ncu", "--import", rep + ".ncu-rep", "--page", "source", "--csv", *extra],
                             capture_output=True, text=True)
        name = "source_" + ("_".join(extra[1:]).replace(",", "_") or "default") + ".csv"
        with open(os.path.join(args.out, name), "w") as f:
            f.write(res.stdout + res.stderr)
        if res.returncode == 0 and src is None and "Warp Stall Sampling" in res.stdout:
            src = res.stdout
    keep = ("Duration", "Registers", "Achieved Occupancy", "Theoretical Occupancy", "Compute (SM) Throughput",
            "Memory Throughput", "Warp Cycles Per Issued", "Issue Slot", "Stall", "Block Limit", "Bank",
            "Shared")
    print("\n".join(ln for ln in details.stdout.splitlines() if any(k in ln for k in keep))[:4000])
    if src is not None:
        print(analyze(src))
    return 0


if __name__ == "__main__":
    sys.exit(main())
