"""The sparse attention's backward on a GPU: ms and TFLOP/s of each implementation, measured
in the same call on the same inputs: the Triton kernels, deterministic (the default) and
with fp32 atomics (opt-in), and the chunked PyTorch path (lowerings/attention_backward.py).

    python benchmarks/bench_attention_backward.py [--quick] [--long] [--seqs 8192,32768]
        [--shapes mqa128,mqa16,per_head] [--impls deterministic,atomic,pytorch] [--profile]

An implementation is ``mode[:nofold][@field=value+field=value]``: ``:nofold`` reduces the
keys' and the values' contributions apart where v is a view of k (the default folds them
into one, as the op does: ``attention_backward(fold_v=True)``); ``@...`` sets
``HYSCALE_ATTN_BWD_CONFIG`` (``BackwardConfig`` fields) for that implementation only, so
configurations are compared in the same call, e.g.
``--impls deterministic,deterministic@prefetch_idx=0,atomic``. ``--profile``: one more call
of each under torch.profiler, the GPU kernel time summed per kernel (rows, dq, keys, the
segment sum, the key-major sort, other) with each kernel's rate.

FLOPs: 2 H k (2 d_v + 3 d_qk) per query. "det / atomic rate": the deterministic kernel's
throughput over the atomic one's (target >= 0.7 at mqa128, S = 32K).

Shapes (k = 2048 selected keys per row, bf16 operands, causal range mask, T = S):
  per_head  H = 16 heads, each with its own keys: d_qk 192, d_v 128 (HF DeepSeek-V3.2 MLA)
  mqa16     the absorbed MQA form: H = 16 heads over one latent, d_qk 576, v = k[..., :512]
  mqa128    the same with H = 128
Selection: row s picks k distinct keys spread over [0, s] with a random offset, in a
random order (rows s < k pick keys 0..k-1, the ones past s hidden by the causal mask).

Expected for the chunked PyTorch path (fp32 after the exact upcast): per head the
backward is memory-bound (about ten passes over S k Hk D fp32 gathered keys, values and
their per-slot gradients: ~30 TB at S = 128K, so ~10 s on an H200; a quarter of that
at 32K); the MQA form is five fp32 GEMMs of 2 S k H 576 FLOPs (~200 TFLOP at
H = 128, S = 128K: a few seconds at fp32 rates). The Triton kernels: bf16 tensor-core dots
(fp32 accumulation) and an fp32 buffer of per-slot key gradients, S k Hk (d_qk + d_v) x 4
bytes written and read once by the segment sum (292 GB at mqa128, 32K), S k Hk d_qk x 4 where
v is a view of k and the two are folded (155 GB). Columns: median ms
over --reps calls (CUDA events) after one warm-up, peak extra GiB, and whether two calls
gave the same bits.
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
    "mqa128_own_v": (128, 1, 576, 512, False),
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


def flops(shape: str, S: int, K: int) -> float:
    """The backward's FLOPs: 2 H k (2 d_v + 3 d_qk) per query (QK^T, dP, dQ, dK over d_qk;
    dV and dP over d_v)."""
    H, _, Dq, Dv, _ = SHAPES[shape]
    return 2.0 * H * K * (2 * Dv + 3 * Dq) * S


def parse_impl(text: str):
    """(mode, fold_v, HYSCALE_ATTN_BWD_CONFIG text) of ``mode[:nofold][@f=v+f=v]``."""
    head, _, cfg = text.partition("@")
    mode, _, flag = head.partition(":")
    if mode not in ("deterministic", "atomic", "pytorch") or flag not in ("", "nofold"):
        raise SystemExit(f"--impls: {text!r} is not mode[:nofold][@field=value+...] with mode deterministic, "
                         "atomic or pytorch")
    return mode, flag != "nofold", cfg.replace("+", ",")


BUCKETS = (("rows", "attn_bwd_rows"), ("dq", "attn_bwd_dq"), ("keys", "attn_bwd_keys"),
           ("segsum", "_segment_sum_kernel"), ("segsum", "_segment_runs_kernel"), ("sort", "sort"),
           ("sort", "radix"))
SPLIT = ("rows", "dq", "keys", "segsum", "sort", "other")


def kernel_split(fn) -> dict:
    """{bucket: (GPU ms, launches)} of one call of ``fn`` under torch.profiler: kernel times
    summed by name (attn_bwd_rows / attn_bwd_dq / attn_bwd_keys / the segment sum / the
    key-major sort and its searchsorted / everything else: the run starts' scan, zero fills,
    casts, copies)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    split = {b: [0.0, 0] for b in SPLIT}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        bucket = next((b for b, key in BUCKETS if key.lower() in name), "other")
        split[bucket][0] += e.time_range.elapsed_us() / 1e3  # (a kernel event's span is its run)
        split[bucket][1] += 1
    return split


def kernel_rates(shape: str, S: int, K: int, fold: bool, split: dict) -> dict:
    """Each kernel's rate from its time: TFLOP/s of the dots (rows: q k^T and dO v^T, plus dQ
    when no attn_bwd_dq ran; dq: dS k; keys: dS^T q and P^T dO), GB/s of the segment sum's
    reads of the fp32 per-slot contributions (as many bytes as kernel 2 wrote)."""
    H, Hk, Dq, Dv, view = SHAPES[shape]
    rows_f = 2.0 * H * K * S * (Dq + Dv + (0 if split["dq"][1] else Dq))
    work = {"rows": (rows_f, "TFLOP/s"), "dq": (2.0 * H * K * S * Dq, "TFLOP/s"),
            "keys": (2.0 * H * K * S * (Dq + Dv), "TFLOP/s"),
            "segsum": (4.0 * S * K * Hk * (Dq if fold and view else Dq + Dv), "GB/s")}
    out = {}
    for b, (amount, unit) in work.items():
        ms = split[b][0]
        if ms > 0:
            out[b] = f"{amount / ms / (1e9 if unit == 'TFLOP/s' else 1e6):.0f} {unit}"
    return out


def run(shape: str, S: int, K: int, reps: int, impls, profile: bool = False):
    """{impl: (ms, peak bytes, bitwise repeatable, kernel split or None)} of the backward,
    each impl in this call on the same inputs, and the forward's (ms, peak)."""
    from hyscale_compile.lowerings.attention_backward import attention_backward, attention_delta
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
    parsed = AttentionSpec(name="bench", post=(("mul", Dq ** -0.5), ("mask", 0)),
                           masks=(MaskTerm(kind="range", hi=0),), out_dtype="bfloat16")
    spec = parsed.to_json()
    fwd = lambda: torch.ops.hyscale.sparse_attention(q, k, v, idx, [hi], spec)  # noqa: E731
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, lse, _ = fwd()
    torch.cuda.synchronize()
    fwd_ms, _ = timed(fwd, reps)
    fwd_peak = torch.cuda.max_memory_allocated() - base
    go = torch.randn_like(out)
    res = {}
    saved_cfg = os.environ.get("HYSCALE_ATTN_BWD_CONFIG")
    for impl in impls:
        mode, fold, cfg = parse_impl(impl)
        # (delta timed with the backward: the kernels used to compute it themselves)
        bwd = lambda: attention_backward(go, q, k, v, idx, [hi], attention_delta(go, out, lse), lse,  # noqa: E731
                                         parsed, mode=mode, fold_v=fold)
        if cfg:
            os.environ["HYSCALE_ATTN_BWD_CONFIG"] = cfg
        try:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            first = bwd()
            torch.cuda.synchronize()
            ms, again = timed(bwd, reps)
            peak = torch.cuda.max_memory_allocated() - base
            same = all(torch.equal(a, b) for a, b in zip(first, again))
            del first, again
            split = kernel_split(bwd) if profile else None
            res[impl] = (ms, peak, same, split)
        except torch.OutOfMemoryError:
            res[impl] = None
        finally:
            if saved_cfg is None:
                os.environ.pop("HYSCALE_ATTN_BWD_CONFIG", None)
            else:
                os.environ["HYSCALE_ATTN_BWD_CONFIG"] = saved_cfg
        torch.cuda.empty_cache()
    return fwd_ms, fwd_peak, res


def pipeline_report(ttgir: str) -> dict:
    """What the TTGIR says of the loops' software pipelining: async copies to shared memory
    (cp.async: ``ttg.async_copy_global_to_local``, TMA: ``async_tma_copy``) and their waits,
    and the wgmma waits (asynchronous dots overlap the next loads only when pipelined)."""
    return {"async_copy": ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy"),
            "async_wait": ttgir.count("ttg.async_wait"), "wgmma_wait": ttgir.count("warp_group_dot_wait")}


def inspect_sm90(shapes, dump: str = None, fold: bool = True) -> int:
    """No GPU needed: compile the Triton backward's kernels for sm_90 (the default
    configurations, ``HYSCALE_ATTN_BWD_CONFIG`` applied) as the op launches them (``fold``: the
    values' part folded into the keys' launch where v is a view of k) and print ptxas'
    registers and spills, Triton's shared memory and the TTGIR's async copies (``dump``: the
    TTGIR and PTX written there)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("--inspect compiles for the GPU: unset TRITON_INTERPRET")
    import triton
    from triton.runtime import driver

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from inspect_hytopk import _Sm90, ptxas_report
    from hyscale_compile.lowerings.attention_spec import AttentionSpec
    from hyscale_compile.lowerings.spec import MaskTerm
    from hyscale_compile.lowerings.triton_attention_backward import attention_backward_triton, default_config

    driver.set_active(_Sm90())
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for shape in shapes:
        H, Hk, Dq, Dv, view = SHAPES[shape]
        S, T, K, bf16 = 64, 4096, 2048, torch.bfloat16
        q = torch.empty(1, S, H, Dq, dtype=bf16)
        k = torch.empty(1, T, Hk, Dq, dtype=bf16)
        v = k[..., :Dv] if view else torch.empty(1, T, Hk, Dv, dtype=bf16)
        idx = torch.zeros(1, S, K, dtype=torch.int64)  # (compiled, not run)
        hi = torch.arange(1, S + 1).view(1, S)
        go, lse, delta = torch.empty(1, S, H, Dv, dtype=bf16), torch.empty(1, S, H), torch.empty(1, S, H)
        spec = AttentionSpec(name="bench", post=(("mul", Dq ** -0.5), ("mask", 0)),
                             masks=(MaskTerm(kind="range", hi=0),), out_dtype="bfloat16")
        cfg = default_config(H, Hk, Dq, Dv, v_from_k=view)
        for atomic in (False, True):
            built = attention_backward_triton(go, q, k, v, idx, [hi], delta, lse, spec, atomic=atomic, fold_v=fold,
                                              _launcher=lambda kern, args, kw: (kern.__name__, kw.get("FOLD"),
                                                                                kern.warmup(*args, grid=(1,), **kw)))
            for i, (kname, folded, ck) in enumerate(built):
                if atomic and kname != "attn_bwd_keys":
                    continue
                if kname == "attn_bwd_keys":
                    kname += "(fold)" if folded else "(v)" if i == len(built) - 1 else ""
                rep = ptxas_report(ck.asm["ptx"], bindir)
                pipe = pipeline_report(ck.asm["ttgir"])
                print(f"inspect shape={shape} kernel={kname}{' atomic' if atomic else ''} {cfg} "
                      f"regs={rep.get('regs', 0)} spill={rep.get('spill_st', 0) + rep.get('spill_ld', 0)} "
                      f"smem={ck.metadata.shared} wgmma={int('wgmma.mma_async' in ck.asm['ptx'])} "
                      + " ".join(f"{a}={b}" for a, b in pipe.items()), flush=True)
                if dump:
                    os.makedirs(dump, exist_ok=True)
                    stem = os.path.join(dump, f"{shape}.{kname}{'.atomic' if atomic else ''}")
                    for ext in ("ttgir", "ptx"):
                        with open(f"{stem}.{ext}", "w") as f:
                            f.write(ck.asm[ext])
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="8192,32768")
    ap.add_argument("--shapes", default="mqa128,mqa16,per_head")
    ap.add_argument("--impls", default="deterministic,atomic,pytorch",
                    help="backwards to measure in the same call: deterministic and atomic (the Triton kernels, "
                         "lowerings/triton_attention_backward.py), pytorch (the chunked path)")
    ap.add_argument("--long", action="store_true", help="also S = 128K, for the Triton kernels only")
    ap.add_argument("--quick", action="store_true", help="S = 8K, H = 128 and 16, the Triton kernels, one rep")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="also one call of each under torch.profiler: GPU time "
                                                          "per kernel (rows, dq, keys, segment sum, sort, other)")
    ap.add_argument("--inspect", action="store_true", help="no GPU: compile the Triton kernels for sm_90 and report "
                                                          "registers, spills and shared memory")
    ap.add_argument("--dump", default=None, help="with --inspect: write each kernel's TTGIR and PTX to this folder")
    ap.add_argument("--no-fold", action="store_true", help="with --inspect: the keys' and values' launches apart "
                                                           "(as :nofold)")
    args = ap.parse_args(argv)
    if args.inspect:
        return inspect_sm90(args.shapes.split(","), args.dump, fold=not args.no_fold)
    if args.quick:
        args.seqs, args.shapes, args.impls, args.reps = "8192", "mqa128,mqa16", "deterministic,atomic", 1
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    import hyscale_compile  # noqa: F401  registers the ops

    impls = args.impls.split(",")
    for impl in impls:
        parse_impl(impl)
    seqs = [int(s) for s in args.seqs.split(",")] + ([131072] if args.long else [])
    rows, splits = [], []
    for shape in args.shapes.split(","):
        for S in seqs:
            use = [i for i in impls if S < 131072 or parse_impl(i)[0] != "pytorch"]
            try:
                fwd_ms, fwd_peak, res = run(shape, S, args.topk, args.reps, use, args.profile)
            except torch.OutOfMemoryError:
                fwd_ms, fwd_peak, res = None, None, {}
            torch.cuda.empty_cache()
            for impl in use:
                r = res.get(impl)
                if r is None:
                    row = (shape, S, impl, "-", "-", "-", "-", "out of memory")
                else:
                    ms, peak, same, split = r
                    ratio = ""
                    mode, fold, cfg = parse_impl(impl)
                    twin = res.get(impl.replace("deterministic", "atomic", 1)) or res.get(
                        "atomic" if fold else "atomic:nofold")
                    if mode == "deterministic" and twin:
                        ratio = f"{twin[0] / ms:.2f}"  # deterministic rate / the same form's atomic rate
                    if split is not None:
                        rates = kernel_rates(shape, S, args.topk, fold, split)
                        cells = [f"{split[b][0]:.1f}" + (f" ({rates[b]})" if b in rates else "") for b in SPLIT]
                        splits.append((shape, S, impl, *cells, f"{sum(v[0] for v in split.values()):.1f}"))
                        print("profile", shape, S, impl, " ".join(f"{b}={split[b][0]:.1f}ms/{split[b][1]}"
                                                                 for b in SPLIT), rates, file=sys.stderr, flush=True)
                    row = (shape, S, impl, f"{ms:.1f}", f"{flops(shape, S, args.topk) / ms / 1e9:.1f}",
                           f"{peak / 2**30:.2f}", ratio, "yes" if same else "NO")
                rows.append(row)
                print(*row, f"(forward {fwd_ms:.1f} ms)" if fwd_ms else "", file=sys.stderr, flush=True)
    print(f"\nsparse attention backward, k={args.topk}, bf16 operands, causal; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | S | backward | ms | TFLOP/s | peak GiB | det / atomic rate | bitwise repeatable |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, S, *rest in rows:
        print(f"| {shape} | {S:,} | " + " | ".join(rest) + " |")
    if splits:
        print("\nGPU ms per kernel, one call under torch.profiler (rate of each kernel in parentheses)")
        print("| shape | S | backward | " + " | ".join(SPLIT) + " | sum |")
        print("|---|---|---" + "|---" * (len(SPLIT) + 1) + "|")
        for shape, S, *rest in splits:
            print(f"| {shape} | {S:,} | " + " | ".join(rest) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
