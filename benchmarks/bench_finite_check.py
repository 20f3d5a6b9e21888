"""What proving the operands finite costs the op, at the DSA shape, on one GPU.

    python benchmarks/bench_finite_check.py [--sizes 32768] [--rounds 5]
    TRITON_INTERPRET=1 python benchmarks/bench_finite_check.py --smoke   (CPU: runs, times nothing useful)

DSA's reference code masks with an additive -inf (``index_score += full(-inf).triu(1)``):
the spec's range term has mode "add", whose hidden keys are s + (-inf), NaN where s is
NaN or +inf. The launch therefore proves every score finite on the device before it skips
hidden tiles (``score_bound.finite_flag``: aminmax of q, k and w, then the bound kernel).
Rows of the table, per S:

* check          ``finite_flag`` alone.
* op             the op's Triton path (``hytopk_triton``) with the additive-mask DSA spec,
                 the check included.
* op:unchecked   the same with ``triton_hytopk._CHECK_FINITE = False`` (the flag passed as 1
                 without computing it: the cost of the kernel before the check existed).

"delta" is op - op:unchecked (median of per-round medians, the two interleaved); "est" is
the bytes the check reads (q, k, w once) at 4.8 TB/s (H200 HBM3e).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from hyscale_compile.lowerings import score_bound, triton_hytopk
from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec

H, D, TOPK = 64, 128, 2048
HBM_BYTES_PER_S = 4.8e12


def dsa_add_spec(scale: float) -> ScoreSpec:
    return ScoreSpec(name="dsa", epilogue=(("mul", scale), ("relu",)), reduce="weighted_sum",
                     post=(("mask", 0),), masks=(MaskTerm(kind="range", hi=0, mode="add", value=-math.inf),))


def timer(fn, device):
    if device.type == "cuda":
        import triton

        return lambda: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    def cpu():
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="32768")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    global H, D, TOPK
    if args.smoke:
        device, sizes, H, D, TOPK, args.rounds = torch.device("cpu"), [64], 2, 16, 8, 1
    else:
        device, sizes = torch.device("cuda"), [int(s) for s in args.sizes.split(",")]
    spec = dsa_add_spec(D**-0.5)
    print(f"{'S':>7} {'row':<14} {'ms':>9} {'delta':>9} {'delta %':>8} {'est ms':>8}")
    for S in sizes:
        g = torch.Generator(device=device).manual_seed(S)
        q = torch.randn(1, S, H, D, device=device, generator=g).to(torch.bfloat16)
        k = torch.randn(1, S, 1, D, device=device, generator=g).to(torch.bfloat16)
        w = torch.randn(1, S, H, device=device, generator=g) / 8.0
        if args.smoke:
            q, k = q.float(), k.float()  # (the interpreter has no bf16 dot)
        hi = (torch.arange(S, device=device) + 1).view(1, S)
        topk = min(TOPK, S)

        def op():  # (what torch.ops.hyscale.hytopk runs on CUDA, called directly)
            return triton_hytopk.hytopk_triton(q, k, w, [hi], topk, spec)

        def check():
            return score_bound.finite_flag(spec, q, k, w, [hi])

        assert check().tolist() == [1], "the inputs are finite: the check must allow skipping"
        ref = op()
        t_check, t_on, t_off = [], [], []
        for _ in range(args.rounds):
            t_check.append(timer(check, device)())
            t_on.append(timer(op, device)())
            triton_hytopk._CHECK_FINITE = False
            try:
                off = op()
                t_off.append(timer(op, device)())
            finally:
                triton_hytopk._CHECK_FINITE = True
        assert torch.equal(off, ref), "bypassing the check changed the selection on finite inputs"
        est = sum(t.numel() * t.element_size() for t in (q, k, w)) / HBM_BYTES_PER_S * 1e3
        on, unchecked, chk = (statistics.median(t) for t in (t_on, t_off, t_check))
        print(f"{S:>7} {'check':<14} {chk:>9.3f} {'':>9} {100 * chk / unchecked:>7.2f}% {est:>8.3f}")
        print(f"{S:>7} {'op':<14} {on:>9.3f} {on - unchecked:>+9.3f} {100 * (on - unchecked) / unchecked:>+7.2f}% "
              f"{est:>8.3f}")
        print(f"{S:>7} {'op:unchecked':<14} {unchecked:>9.3f}")


if __name__ == "__main__":
    main()
