"""One training step (forward + backward) of the example DSA LM with activation
checkpointing: default ``torch.compile`` against ``backend="hyscale"``, with and without
selection replay, on one GPU.

    python benchmarks/bench_train_step.py --seq 32768 [--out DIR]

Model: ``examples/dsa_model.py`` (bf16 weights, every block wrapped in
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``). Rows:

* inductor          default ``torch.compile``
* hyscale           ``backend="hyscale"``: the fused selection, its indices saved for the backward
* hyscale-noreplay  the same with ``options={"hyscale.replay": False}``: the backward runs the
                    selection op again, as the checkpoint asks. hyscale-noreplay minus hyscale
                    is what replay saves; inductor minus hyscale-noreplay is the fused selection.

Columns: median step time over --reps steps after warm-up (CUDA events), peak memory of a step
(``torch.cuda.max_memory_allocated`` minus what was allocated before), and the number of
selection-op calls in the step (forward + backward; ``lowerings.ops.CALLS``). A
variant that runs out of memory says so and the others still run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from hyscale_compile.lowerings import ops as hy_ops  # noqa: E402
from dsa_model import DSAConfig, make_model  # noqa: E402


class Ckpt(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, mask):
        return checkpoint(self.block, x, mask, use_reentrant=False)


def build(args) -> nn.Module:
    torch.manual_seed(0)
    cfg = DSAConfig(vocab=1024, dim=args.dim, layers=args.layers, heads=args.heads, index_heads=args.index_heads,
                    index_head_dim=args.index_head_dim, index_topk=args.topk, max_seq=args.seq,
                    q_lora_rank=args.dim // 2, mlp_hidden=2 * args.dim)
    model = make_model(cfg)
    model.blocks = nn.ModuleList(Ckpt(b) for b in model.blocks)
    return model.to(device=args.device, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32).train()


def run_variant(name, args, ids, targets):
    model = build(args)
    opts = {"hyscale.replay": False} if name == "hyscale-noreplay" else None
    backend = "inductor" if name == "inductor" else "hyscale"
    torch._dynamo.reset()
    step_model = torch.compile(model, backend=backend, options=opts)

    def step():
        logits = step_model(ids)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.time()
    step()
    sync()
    compile_s = time.time() - t0
    print(f"  [{name}] compile + first step {compile_s:.1f} s", file=sys.stderr, flush=True)
    for _ in range(args.warmup):
        step()
    sync()
    peak = float("nan")  # --device cpu (a logic check): no allocator statistics
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        sync()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    calls0 = hy_ops.CALLS["hytopk"]
    step()
    sync()
    launches = hy_ops.CALLS["hytopk"] - calls0
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return dict(name=name, compile_s=compile_s, ms=statistics.median(times), times=times, peak_gib=peak,
                selection_launches=launches)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--index-heads", type=int, default=16)
    p.add_argument("--index-head-dim", type=int, default=64)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", default="inductor,hyscale,hyscale-noreplay")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a tiny logic check only")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA device (use --device cpu for a logic check)")
    if args.topk > args.seq:
        p.error(f"--topk {args.topk} exceeds --seq {args.seq}")
    g = torch.Generator(device=args.device).manual_seed(0)
    ids = torch.randint(0, 1024, (1, args.seq), device=args.device, generator=g)
    targets = torch.randint(0, 1024, (1, args.seq), device=args.device, generator=g)
    rows = []
    for name in args.variants.split(","):
        print(f"[{name}] ...", file=sys.stderr, flush=True)
        try:
            rows.append(run_variant(name, args, ids, targets))
        except torch.OutOfMemoryError as e:
            rows.append(dict(name=name, error=f"out of memory: {str(e).splitlines()[0]}"))
        except Exception as e:  # report and go on: one variant's failure must not hide the others
            rows.append(dict(name=name, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    head = (f"device {dev}  torch {torch.__version__}  S={args.seq} layers={args.layers} "
            f"dim={args.dim} index H={args.index_heads} D={args.index_head_dim} k={args.topk} {'bf16' if args.device == 'cuda' else 'fp32'}, checkpointed blocks")
    lines = [head, f"{'variant':>18} {'step ms':>10} {'peak GiB':>9} {'selections/step':>16} {'compile s':>10}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:>18}  {r['error']}")
        else:
            lines.append(f"{r['name']:>18} {r['ms']:>10.1f} {r['peak_gib']:>9.2f} {r['selection_launches']:>16d} "
                         f"{r['compile_s']:>10.1f}")
    text = "\n".join(lines)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_train_step.json"), "w") as f:
        json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
