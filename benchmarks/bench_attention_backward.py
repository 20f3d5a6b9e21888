"""The sparse attention op's reference path on a GPU: ms per call of the forward
(``hyscale::sparse_attention``) and of the deterministic backward
(``hyscale::sparse_attention_backward``, lowerings/attention_backward.py).

    python benchmarks/bench_attention_backward.py [--seqs 8192,32768,131072] [--shapes per_head,mqa16,mqa128]

Shapes (k = 2048 selected keys per row, bf16 operands, causal range mask, T = S):
  per_head  H = 16 heads, each with its own keys: d_qk 192, d_v 128 (HF DeepSeek-V3.2 MLA)
  mqa16     the absorbed MQA form: H = 16 heads over one latent, d_qk 576, v = k[..., :512]
  mqa128    the same with H = 128
Selection: row s picks k distinct keys spread over [0, s] with a random offset, in a
random order (rows s < k pick keys 0..k-1, the ones past s hidden by the causal mask).

Expected from the arithmetic (fp32 after the exact upcast, chunked): per head the
backward is memory-bound (about ten passes over S k Hk D fp32 gathered keys, values and
their per-slot gradients: ~30 TB at S = 128K, so ~10 s on an H200; a quarter of that
at 32K); the MQA form is five fp32 GEMMs of 2 S k H 576 FLOPs (~200 TFLOP at
H = 128, S = 128K: a few seconds at fp32 rates). Columns: median ms over --reps calls
(CUDA events) after one warm-up, peak extra GiB, and whether two backward calls gave
the same bits.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPES = {  # name: (H, Hk, d_qk, d_v, v is a view of k)
    "per_head": (16, 16, 192, 128, False),
    "mqa16": (16, 1, 576, 512, True),
    "mqa128": (128, 1, 576, 512, True),
}


def selection(S: int, K: int, device) -> torch.Tensor:
    """[1, S, K] distinct keys per row, spread over [0, s] (no [S, T] temporary)."""
    s = torch.arange(S, device=device).view(S, 1)
    j = torch.arange(K, device=device).view(1, K)
    u = torch.rand(S, 1, device=device)
    spread = torch.floor((j + u) * (s + 1) / K).long().clamp_max(s)
    idx = torch.where(s + 1 >= K, spread, j.expand(S, K))
    order = torch.rand(S, K, device=device).argsort(-1)
    return idx.gather(-1, order).unsqueeze(0)


def timed(fn, reps: int):
    times = []
    out = None
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), out


def run(shape: str, S: int, K: int, reps: int):
    from hyscale_compile.lowerings.attention_spec import AttentionSpec
    from hyscale_compile.lowerings.spec import MaskTerm

    H, Hk, Dq, Dv, view = SHAPES[shape]
    dev, bf16 = "cuda", torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(1, S, H, Dq, device=dev, dtype=bf16)
    k = torch.randn(1, S, Hk, Dq, device=dev, dtype=bf16)
    v = k[..., :Dv] if view else torch.randn(1, S, Hk, Dv, device=dev, dtype=bf16)
    idx = selection(S, K, dev)
    hi = (torch.arange(S, device=dev) + 1).view(1, S)
    spec = AttentionSpec(name="bench", post=(("mul", Dq ** -0.5), ("mask", 0)),
                         masks=(MaskTerm(kind="range", hi=0),), out_dtype="bfloat16").to_json()
    fwd = lambda: torch.ops.hyscale.sparse_attention(q, k, v, idx, [hi], spec)  # noqa: E731
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, lse, _ = fwd()
    torch.cuda.synchronize()
    fwd_ms, _ = timed(fwd, reps)
    fwd_peak = torch.cuda.max_memory_allocated() - base
    go = torch.randn_like(out)
    bwd = lambda: torch.ops.hyscale.sparse_attention_backward(go, q, k, v, idx, [hi], out, lse, spec,  # noqa: E731
                                                              True, True, True)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    first = bwd()
    torch.cuda.synchronize()
    bwd_ms, again = timed(bwd, reps)
    bwd_peak = torch.cuda.max_memory_allocated() - base
    same = all(torch.equal(a, b) for a, b in zip(first, again))
    return fwd_ms, fwd_peak, bwd_ms, bwd_peak, same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="8192,32768,131072")
    ap.add_argument("--shapes", default="per_head,mqa16,mqa128")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    import hyscale_compile  # noqa: F401  registers the ops

    rows = []
    for shape in args.shapes.split(","):
        for S in [int(s) for s in args.seqs.split(",")]:
            try:
                fwd_ms, fwd_peak, bwd_ms, bwd_peak, same = run(shape, S, args.topk, args.reps)
                row = (shape, S, f"{fwd_ms:.1f}", f"{fwd_peak / 2**30:.2f}", f"{bwd_ms:.1f}",
                       f"{bwd_peak / 2**30:.2f}", "yes" if same else "NO")
            except torch.OutOfMemoryError:
                row = (shape, S, "-", "-", "-", "-", "out of memory")
            torch.cuda.empty_cache()
            rows.append(row)
            print(*row, file=sys.stderr, flush=True)
    print(f"\nsparse attention reference path, k={args.topk}, bf16 operands, causal; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | S | forward ms | fwd peak GiB | backward ms | bwd peak GiB | backward bitwise repeatable |")
    print("|---|---|---|---|---|---|---|")
    for shape, S, *rest in rows:
        print(f"| {shape} | {S:,} | " + " | ".join(rest) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
