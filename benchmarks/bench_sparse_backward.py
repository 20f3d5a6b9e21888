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

A second table times ``values_backward`` alone at the same shapes (bf16 q/k, fp32 w, the
causal fill, the forward's own indices) with the key gradient accumulated two ways:
``index_add`` (CUDA atomics, the former path) and ``segment_sum`` (a stable sort and
attention_backward's segment sum) after the chunked PyTorch row part, and the fused per-row
Triton kernel (``triton_values_backward``, the CUDA default) before the segment sum. The step
table runs the op's default; ``HYSCALE_BWD_FUSED=0`` runs it with the PyTorch row part. "bitwise repeat" says whether
``--repeats`` calls gave identical gk; "max |diff|" is the largest gk difference between the
two ways, relative to max |gk|.

    python benchmarks/bench_sparse_backward.py --seqs 32768 --variants none --op-heads 16,64 --op-dims 64,128

``--ways fused --profile`` times the fused path alone and prints its GPU time per kernel (one
call under torch.profiler); ``--inspect "default;c_trans=1"`` (no GPU) compiles the fused row
kernel for sm_90 under those ``HYSCALE_VALUES_BWD_CONFIG`` values and prints registers, spills
and shared memory.
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


def op_rows(S, H, D, topk, repeats, ways=("index_add", "segment_sum", "fused"), profile=False):
    """values_backward alone, index_add_ against the segment sum and the fused kernel (those of ``ways``):
    [(way, ms, bitwise repeat, rel diff to the first way timed)]; ``profile``: the fused call's kernels."""
    import functools

    from hyscale_compile.lowerings import backward as bwd
    from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec

    torch.manual_seed(0)
    spec = ScoreSpec(epilogue=(("relu",), ("mul", D**-0.5)), post=(("mask", 0),),
                     masks=(MaskTerm(kind="range", hi=0, mode="fill"),))
    q = torch.randn(1, S, H, D, device="cuda").bfloat16()
    k = torch.randn(1, S, 1, D, device="cuda").bfloat16()
    w = torch.rand(1, S, H, device="cuda") / H
    hi = (torch.arange(S, device="cuda") + 1).view(1, S)
    vals, idx = torch.ops.hyscale.hytopk_values(q, k, w, [hi], topk, spec.to_json())
    g = torch.randn(1, S, topk, device="cuda").masked_fill(vals == float("-inf"), 0)
    del vals
    out, ref = [], None
    orig = bwd._add_key_grads
    try:
        for key, way, use_kernel, fused in (("index_add", "index_add", False, False),
                                            ("segment_sum", "segment_sum", True, False),
                                            ("fused", "fused kernel + segment_sum", True, True)):
            if key not in ways:
                continue
            bwd._add_key_grads = functools.partial(orig, use_kernel=use_kernel)
            run = lambda: bwd.values_backward(g, q, k, w, [hi], idx, spec, fused=fused)[1]  # noqa: E731
            ms, _ = measure(run, reps=repeats)
            gks = [run().float() for _ in range(repeats)]
            same = all(torch.equal(gks[0], x) for x in gks[1:])
            if ref is None:
                ref = gks[0]
            diff = ((gks[0] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            out.append((way, ms, same, diff))
            if profile and fused:
                profile_kernels(run, f"S={S} H={H} D={D} k={topk} {way}")
            del gks
            torch.cuda.empty_cache()
    finally:
        bwd._add_key_grads = orig
    return out


def profile_kernels(fn, what):
    """One call of ``fn`` under torch.profiler: GPU time per kernel name, largest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", None)
        if us is None:
            us = getattr(ev, "self_cuda_time_total", 0)
        if us > 0:
            rows.append((us / 1e3, ev.count, ev.key))
    rows.sort(reverse=True)
    print(f"\nper kernel, one call ({what}); total {sum(r[0] for r in rows):.1f} ms")
    print("| kernel | ms | launches |")
    print("|---|---|---|")
    for ms, count, name in rows[:12]:
        print(f"| {name[:90]} | {ms:.2f} | {count} |")
    return rows


def inspect_sm90(configs, H=64, D=128, topk=2048, dump=None) -> int:
    """No GPU needed: compile the fused row kernel for sm_90 at the op table's spec (bf16 q/k,
    H heads over one key head, D, ``topk``) under each ``HYSCALE_VALUES_BWD_CONFIG`` value of
    ``configs`` (";"-separated; "default": none) and print ptxas' registers and spills,
    Triton's shared memory and whether the dots are wgmma."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("--inspect compiles for the GPU: unset TRITON_INTERPRET")
    import triton
    from triton.runtime import driver

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from inspect_hytopk import _Sm90, ptxas_report
    from hyscale_compile.lowerings import triton_values_backward as tvb
    from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec

    driver.set_active(_Sm90())
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    spec = ScoreSpec(epilogue=(("relu",), ("mul", D**-0.5)), post=(("mask", 0),),
                     masks=(MaskTerm(kind="range", hi=0, mode="fill"),))
    ns, T = 64, 4096
    q, k = torch.empty(ns, H, D, dtype=torch.bfloat16), torch.empty(T, 1, D, dtype=torch.bfloat16)
    w, gy, keys = torch.empty(ns, H), torch.empty(ns, topk), torch.zeros(ns, topk, dtype=torch.int64)
    dest = torch.zeros(ns * topk, dtype=torch.int32)
    for cfg in configs.split(";"):
        os.environ["HYSCALE_VALUES_BWD_CONFIG"] = "" if cfg == "default" else cfg
        for d in (None, dest):
            ck = tvb.rows_backward_fused(gy, q, k, w, keys, spec, (True, True, True), dest=d,
                                         _launcher=lambda kern, args, kw: kern.warmup(*args, grid=(1,), **kw))
            rep = ptxas_report(ck.asm["ptx"], bindir)
            print(f"inspect kernel=values_backward_kernel H={H} D={D} config={cfg} dest={d is not None} "
                  f"regs={rep.get('regs', 0)} spill={rep.get('spill_st', 0) + rep.get('spill_ld', 0)} "
                  f"smem={ck.metadata.shared} wgmma={int('wgmma.mma_async' in ck.asm['ptx'])}", flush=True)
            if dump:
                os.makedirs(dump, exist_ok=True)
                for ext in ("ttgir", "ptx"):
                    with open(os.path.join(dump, f"values_bwd.{cfg}.{int(d is not None)}.{ext}"), "w") as f:
                        f.write(ck.asm[ext])
    # the key sum over the sorted layout (attention_backward.sorted_segment_sum_'s launch)
    from hyscale_compile.lowerings import attention_backward as ab

    N, src = ns * topk, torch.empty(1, ns * topk, D)
    ck = ab._sorted_runs_kernel.warmup(src, torch.empty(N, dtype=torch.int32), torch.empty(T + 1, dtype=torch.int64),
                                       torch.empty(T, 1, D), N, D, 1, BLOCK_F=min(ab._BLOCK_F, D), UNROLL=16, grid=(1,))
    rep = ptxas_report(ck.asm["ptx"], bindir)
    print(f"inspect kernel=_sorted_runs_kernel D={D} regs={rep.get('regs', 0)} "
          f"spill={rep.get('spill_st', 0) + rep.get('spill_ld', 0)} smem={ck.metadata.shared}", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="8192,16384,32768")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64, help="indexer head dim")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--variants", default="inductor,hyscale", help="step variants ('none': skip the step table)")
    ap.add_argument("--op-heads", default="16", help="indexer heads for the values_backward table ('' skips it)")
    ap.add_argument("--op-dims", default="64", help="indexer head dims for the values_backward table")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ways", default="index_add,segment_sum,fused",
                    help="the values_backward table's key-gradient ways (index_add, segment_sum, fused)")
    ap.add_argument("--profile", action="store_true", help="also one fused call under torch.profiler: GPU time "
                    "per kernel")
    ap.add_argument("--inspect", default=None, metavar="CONFIGS",
                    help="no GPU: compile the fused row kernel for sm_90 under these HYSCALE_VALUES_BWD_CONFIG "
                         "values (';'-separated, 'default') and report registers, spills, shared memory")
    ap.add_argument("--dump", default=None, help="with --inspect: write the kernel's TTGIR and PTX to this folder")
    args = ap.parse_args(argv)
    if args.inspect is not None:
        return inspect_sm90(args.inspect, dump=args.dump)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    from hyscale_compile.lowerings import ops as hy_ops

    rows = []
    variants = [v for v in args.variants.split(",") if v and v != "none"]
    for S in [int(s) for s in args.seqs.split(",")] if variants else []:
        torch.manual_seed(0)
        model = KLIndexer(512, args.heads, args.dim, args.topk).cuda().bfloat16()
        x = torch.randn(1, S, 512, device="cuda", dtype=torch.bfloat16)
        target = torch.softmax(torch.randn(1, S, args.topk, device="cuda"), -1)
        for variant in variants:
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
    op = []
    for S in [int(s) for s in args.seqs.split(",")]:
        for H in [int(h) for h in args.op_heads.split(",") if h]:
            for D in [int(d) for d in args.op_dims.split(",") if d]:
                for way, ms, same, diff in op_rows(S, H, D, args.topk, args.repeats, args.ways.split(","),
                                                   args.profile):
                    op.append((S, H, D, way, ms, same, diff))
                    print(S, H, D, way, ms, same, diff, file=sys.stderr, flush=True)
    if op:
        print(f"\nhytopk_values_backward alone (gk accumulation), k={args.topk}, bf16 q/k, causal; "
              f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        print("| S | H x D | gk accumulation | ms | bitwise repeat | max abs gk diff / max abs gk |")
        print("|---|---|---|---|---|---|")
        for S, H, D, way, ms, same, diff in op:
            print(f"| {S:,} | {H} x {D} | {way} | {ms:.1f} | {'yes' if same else 'no'} | {diff:.1e} |")
    if not rows:
        return 0
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
