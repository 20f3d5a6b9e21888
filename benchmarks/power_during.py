"""SM clock and board power while a HyTopK configuration runs back to back (one GPU).

    python benchmarks/power_during.py [--seq 131072] [--seconds 4] [--configs "default;score_only=1"]

Why: a change can save SM cycles (the section profile says so) and still not save time,
if the card is at its power limit and lowers its clock for the work that remains
(docs/kernel-design.md, v15). For each configuration (``HyTopKConfig`` fields over the
default, as in ``sweep_hytopk_config.py``) and for a bf16 8192^3 matmul as the reference,
this runs calls back to back for ``--seconds`` while ``nvidia-smi`` samples the SM clock
and the power draw every 100 ms, and prints per run: ms per call (CUDA events over the
whole run), median SM clock, median power, and SM cycles per call (ms x clock). DSA
shape and iid inputs of ``bench_hytopk.py``. Prints a table last.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def sampled_run(fn, seconds: float):
    """(ms per call, median SM MHz, median W, samples) over back-to-back calls of fn."""
    fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    calls, total = 0, 0.0
    while total < seconds * 1e3:
        fn()
        calls += 1
        if calls in (1, 2, 4) or calls % 8 == 0:  # keep the queue short, check the time now and then
            e.record()
            torch.cuda.synchronize()
            total = s.elapsed_time(e)
    e.record()
    torch.cuda.synchronize()
    total = s.elapsed_time(e)
    smi.terminate()
    out, _ = smi.communicate(timeout=10)
    mhz, watts = [], []
    for line in out.splitlines():
        try:
            a, b = (float(x) for x in line.split(","))
        except ValueError:
            continue
        mhz.append(a)
        watts.append(b)
    med = (lambda xs: statistics.median(xs) if xs else float("nan"))
    return total / calls, med(mhz), med(watts), len(mhz)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--configs", default="default;score_only=1")
    a = ap.parse_args(argv)
    if a.seq < 2 or a.seconds <= 0:
        ap.error("--seq must be >= 2 and --seconds > 0")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    import bench_hytopk as bh
    from sweep_hytopk_config import default_fields, parse_fields
    from hyscale_compile.lowerings import triton_hytopk as th

    S = a.seq
    q, k, w = bh.make_inputs(S, "iid", seed=0)
    hi = (torch.arange(S, device="cuda") + 1).view(1, S)
    spec = bh.dsa_spec()
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    runs = [("matmul bf16 8192^3", lambda: x @ x)]
    for c in (c.strip() for c in a.configs.split(";") if c.strip()):
        fields = {} if c == "default" else parse_fields(c)
        cfg = th.HyTopKConfig(**{**default_fields(S), **fields})
        runs.append((c, lambda cfg=cfg: th.hytopk_triton(q, k.unsqueeze(2), w, [hi], bh.TOPK, spec, config=cfg)))
    rows = []
    for name, fn in runs:
        ms, mhz, watts, n = sampled_run(fn, a.seconds)
        rows.append((name, ms, mhz, watts, n))
        bh.log(name, ms, mhz, watts, n)
    print(f"\nS={S} (DSA shape, iid), {a.seconds:g} s per run; {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| run | ms / call | SM clock MHz (median) | power W (median) | Gcycles / call | samples |")
    print("|---|---|---|---|---|---|")
    for name, ms, mhz, watts, n in rows:
        print(f"| {name} | {ms:.2f} | {mhz:.0f} | {watts:.0f} | {ms * mhz / 1e6:.3f} | {n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
