"""A/B of the HyTopK kernel between two checkouts, in separate processes (one GPU).

    python3 benchmarks/ab_hytopk.py --old /path/to/old/checkout --new . [--reps 7] [--sizes 32768,131072]
    python3 benchmarks/ab_hytopk.py --old /path/to/old --new . --dry-run     # CPU: tiny shapes, the logic only

Each repetition runs one fresh process per checkout, alternating old, new, old, new, ...; the
process imports ``hyscale_compile`` from its checkout (and nothing else from it), builds the
DSA inputs of ``bench_hytopk.py`` (H=64, D=128, k=2048, causal, bf16, iid, the same seed for
both), and times ``torch.ops.hyscale.hytopk`` at each size: the median of CUDA-event timed
calls after two warm-up calls. Prints the per-repetition ms of both, their medians and the
ratio new / old per size (the acceptance bar of a refactor is a ratio <= 1.02).

``--dry-run`` runs the same alternation on the CPU (tiny shapes, the op's CPU reference
path, wall-clock timing): it checks the plumbing, not the speed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
_MARK = "AB_RESULT "


def child(root: str, sizes, dry: bool, calls: int) -> None:
    """In a fresh process: time the op of the checkout at ``root``; prints one JSON line."""
    root = os.path.abspath(root)
    sys.path.insert(0, root)
    import torch

    import hyscale_compile  # noqa: F401  (registers torch.ops.hyscale)
    from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec

    where = os.path.abspath(hyscale_compile.__file__)
    if not where.startswith(root + os.sep):
        raise SystemExit(f"ab_hytopk: hyscale_compile came from {where}, not from {root} (an installed copy first "
                         "on sys.path?)")
    sys.path.insert(1, HERE)  # (after the checkout: bench_hytopk's inputs, not its package)
    import bench_hytopk as bh

    H, D, topk, device = (4, 16, 8, "cpu") if dry else (bh.H, bh.D, bh.TOPK, "cuda")
    spec = ScoreSpec(name="dsa", epilogue=(("mul", D ** -0.5), ("relu",)), reduce="weighted_sum",
                     post=(("mask", 0),), masks=(MaskTerm(kind="range", hi=0),)).to_json()
    out = {"root": root, "ms": {}}
    for S in sizes:
        g = torch.Generator(device=device).manual_seed(1234 + S)
        q = torch.randn(1, S, H, D, device=device, generator=g).to(torch.bfloat16)
        k = torch.randn(1, S, 1, D, device=device, generator=g).to(torch.bfloat16)
        w = torch.randn(1, S, H, device=device, generator=g) / 8.0
        hi = (torch.arange(S, device=device) + 1).view(1, S)

        def call():
            return torch.ops.hyscale.hytopk(q, k, w, [hi], topk, spec, True)

        for _ in range(2):  # compile, then warm
            call()
        times = []
        for _ in range(calls):
            if dry:
                import time

                t = time.perf_counter()
                call()
                times.append((time.perf_counter() - t) * 1e3)
            else:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                s.record()
                call()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e))
        out["ms"][str(S)] = statistics.median(times)
        del q, k, w, hi
    print(_MARK + json.dumps(out), flush=True)


def run_one(root: str, sizes, dry: bool, calls: int, env: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", root, "--sizes", ",".join(map(str, sizes)),
           "--calls", str(calls)] + (["--dry-run"] if dry else [])
    p = subprocess.run(cmd, cwd=os.path.abspath(root), env=env, capture_output=True, text=True)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith(_MARK)), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"ab_hytopk: the run in {root} failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n"
                         f"{p.stderr[-4000:]}")
    return json.loads(line[len(_MARK):])["ms"]


def table(runs: dict, sizes) -> str:
    """The report: per size, each repetition's old and new ms, the medians, new / old."""
    lines = []
    for S in sizes:
        old = [r[str(S)] for r in runs["old"]]
        new = [r[str(S)] for r in runs["new"]]
        lines.append(f"S={S}")
        lines.append("| rep | old ms | new ms |")
        lines.append("|---|---|---|")
        lines += [f"| {i} | {a:.3f} | {b:.3f} |" for i, (a, b) in enumerate(zip(old, new))]
        mo, mn = statistics.median(old), statistics.median(new)
        lines.append(f"| median | {mo:.3f} | {mn:.3f} |")
        lines.append(f"new / old = {mn / mo:.4f}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="the baseline checkout (a repository root)")
    ap.add_argument("--new", default=".", help="the candidate checkout (default: .)")
    ap.add_argument("--reps", type=int, default=7, help="repetitions per checkout (default 7)")
    ap.add_argument("--sizes", default="32768,131072")
    ap.add_argument("--calls", type=int, default=0, help="timed calls per size and process (0: 10, or 5 past 64K)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (S=64,128), the op's reference path")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    if args.dry_run and args.sizes == ap.get_default("sizes"):
        sizes = [64, 128]
    calls = args.calls or (3 if args.dry_run else 5 if max(sizes) > 65536 else 10)
    if args.child:
        child(args.child, sizes, args.dry_run, calls)
        return 0
    if not args.old:
        ap.error("--old is required")
    roots = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    for name, r in roots.items():
        if not os.path.isfile(os.path.join(r, "hyscale_compile", "__init__.py")):
            ap.error(f"--{name} {r}: not a hyscale_compile checkout")
    env = dict(os.environ)
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    runs = {"old": [], "new": []}
    for i in range(args.reps):
        for name in ("old", "new"):
            # each checkout its own generated-kernel cache (Triton's own cache is keyed by source)
            env["HYSCALE_KERNEL_CACHE"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ab_hytopk_kernels_{name}")
            ms = run_one(roots[name], sizes, args.dry_run, calls, env)
            runs[name].append(ms)
            print(f"[ab] rep {i} {name}: " + ", ".join(f"S={s} {ms[str(s)]:.3f} ms" for s in sizes),
                  file=sys.stderr, flush=True)
    print(f"old: {roots['old']}\nnew: {roots['new']}\n{'dry run (CPU reference path)' if args.dry_run else ''}")
    print(table(runs, sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
