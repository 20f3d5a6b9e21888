"""The bf16 matmul rate behind the floor, in a burst and sustained (one GPU).

    python benchmarks/matmul_rate.py [--seconds 0.3,1,4] [--n 8192]

`bench_hytopk.py` takes its floor from `matmul_rate()`: `triton.testing.do_bench` of an
8192^3 bf16 matmul (0.5 s of calls with gaps between them). A HyTopK call at 128K keeps the
tensor cores busy for ~0.3 s and at 1M for ~27 s; under a sustained load the card may hold
lower clocks (power), so the same FLOPs take longer than the burst rate says. This prints
the burst rate as the benchmark measures it, then the rate of back-to-back matmuls for each
duration (CUDA events around the whole run), with the SM clock `nvidia-smi` reports right
after each run (when it is available).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def sm_clock_mhz() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else "n/a"
    except (OSError, subprocess.TimeoutExpired):
        return "n/a"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", default="0.3,1,4", help="durations of the sustained runs (comma-separated seconds)")
    ap.add_argument("--n", type=int, default=8192)
    a = ap.parse_args(argv)
    try:
        durations = [float(x) for x in a.seconds.split(",") if x]
    except ValueError:
        ap.error(f"--seconds must be comma-separated numbers, got {a.seconds!r}")
    if not durations or min(durations) <= 0 or a.n < 256:
        ap.error("--seconds must be positive durations and --n >= 256")
    if not torch.cuda.is_available():
        sys.exit("matmul_rate.py needs a CUDA GPU")
    import bench_hytopk as bh

    n = a.n
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    flop = 2 * n**3
    ms1 = triton.testing.do_bench(lambda: x @ y, warmup=25, rep=100, return_mode="median")
    # as the floor measures it: bench_hytopk.matmul_rate() at 8192^3, the same method otherwise
    burst = bh.matmul_rate() if n == 8192 else flop / (ms1 * 1e-3)
    lines = [f"# matmul_rate: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 {n}^3",
             "| run | TFLOP/s | SM clock, power after |", "|---|---|---|"]
    what = "bench_hytopk.matmul_rate()" if n == 8192 else "do_bench"
    lines.append(f"| {what} (do_bench, median) | {burst / 1e12:.0f} | {sm_clock_mhz()} |")
    for sec in durations:
        reps = max(1, int(sec * 1e3 / ms1))
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        for _ in range(reps):
            x @ y
        e.record()
        torch.cuda.synchronize()
        ms = s.elapsed_time(e)
        lines.append(f"| {reps} back-to-back ({ms / 1e3:.2f} s) | {flop * reps / (ms * 1e-3) / 1e12:.0f} | "
                     f"{sm_clock_mhz()} |")
        print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
