"""Forward + backward of an indexer trained with a KL loss over its selected set (DSA's
sparse-stage indexer loss), default ``torch.compile`` against ``backend="hyscale"``.

    python benchmarks/bench_sparse_backward.py --seqs 8192,16384,32768 [--heads 16 --dim 64 --topk 2048]

The layer: q = wq(x) [S, H, D], k = wk(x) [S, D], w = ww(x) [S, H] (bf16 weights, scores
upcast to fp32 as HF writes them), ``relu(q.k) * D^-0.5`` weighted-summed over heads,
causal, ``topk``; loss = KL(target || log_softmax(values)) with a fixed target per row.
With ``backend="hyscale"`` the forward is the fused selection and the backward is
``hytopk_values_backward`` at the k selected keys; default compile builds the [S, H, S]
logits and their gradient. Columns: median step time (forward + backward, CUDA events),
peak extra memory, whether the compiled backward held the sparse op. A variant that runs
out of memory says so.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class KLIndexer(nn.Module):
    def __init__(self, dim, heads, head_dim, topk):
        super().__init__()
        self.h, self.d, self.topk = heads, head_dim, topk
        self.wq, self.wk, self.ww = nn.Linear(dim, heads * head_dim), nn.Linear(dim, head_dim), nn.Linear(dim, heads)

    def forward(self, x, target):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.h, self.d)
        k = self.wk(x)
        w = self.ww(x).float()
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1))  # [b,s,h,t]
        scores = F.relu(scores) * self.d**-0.5
        scores = (scores * w.unsqueeze(-1)).sum(2)
        pos = torch.arange(s, device=x.device)
        scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        vals, idx = scores.topk(self.topk, dim=-1)
        logp = torch.log_softmax(vals, -1).clamp_min(-1e4)  # rows with < k keys: -inf slots
        return (target * (target.clamp_min(1e-12).log() - logp)).sum(-1).mean()


def step_fn(model):
    def step(x, target):
        loss = model(x, target)
        loss.backward()
        return loss.detach()
    return step


def measure(fn, reps=3):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()  # compile + warm-up
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times), peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="8192,16384,32768")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64, help="indexer head dim")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--variants", default="inductor,hyscale")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    from hyscale_compile.lowerings import ops as hy_ops

    rows = []
    for S in [int(s) for s in args.seqs.split(",")]:
        torch.manual_seed(0)
        model = KLIndexer(512, args.heads, args.dim, args.topk).cuda().bfloat16()
        x = torch.randn(1, S, 512, device="cuda", dtype=torch.bfloat16)
        target = torch.softmax(torch.randn(1, S, args.topk, device="cuda"), -1)
        for variant in args.variants.split(","):
            torch._dynamo.reset()
            model.zero_grad(set_to_none=True)
            backend = "inductor" if variant == "inductor" else "hyscale"
            compiled = torch.compile(step_fn(model), backend=backend)
            before = dict(hy_ops.CALLS)
            try:
                ms, peak = measure(lambda: compiled(x, target))
                note = ""
            except torch.OutOfMemoryError:
                ms, peak, note = None, None, "out of memory"
            torch.cuda.empty_cache()
            calls = hy_ops.CALLS["hytopk"] - before["hytopk"]
            rows.append((S, variant, ms, peak, calls, note))
            print(S, variant, ms, peak, calls, note, file=sys.stderr, flush=True)
    print(f"\nKL-trained indexer, H={args.heads}, D={args.dim}, k={args.topk}, bf16 weights, fp32 scores, causal; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| S | variant | step ms (fwd+bwd) | peak extra GiB | selection calls | note |")
    print("|---|---|---|---|---|---|")
    for S, variant, ms, peak, calls, note in rows:
        fmt = (lambda v, f: "-" if v is None else f.format(v))
        print(f"| {S:,} | {variant} | {fmt(ms, '{:.1f}')} | {fmt(None if peak is None else peak / 2**30, '{:.2f}')} | "
              f"{calls} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
