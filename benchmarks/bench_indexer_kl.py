"""The indexer's dense KL loss (DSA warm-up), streamed: time against its GEMM floors (one GPU).

    python benchmarks/bench_indexer_kl.py [--seqs 8192,16384,32768] [--quick] [--out DIR]
    python benchmarks/bench_indexer_kl.py --quick        # S = 4096, 8192, fewer repeats
    python benchmarks/bench_indexer_kl.py --inspect      # no GPU: compile for sm_90, ptxas' report
    python benchmarks/bench_indexer_kl.py --seqs 32768 --config "default;dq_heads=2,dk_heads=2"
                                                         # launch configurations side by side

Shape (issue 30, the 16-head model): attention H=16 heads of D=192 (q [1,S,16,192], k per
head), indexer Hi=64 heads of Di=128 (qi [1,S,64,128], ki [1,S,128], w [1,S,64]), bf16,
causal, batch 1; ``hyscale_compile.losses.dense_indexer_kl``.

Rows per S: ``fwd`` (the loss, computing the attention's lse itself), ``fwd, lse given``
(the caller passes the attention's lse, as a flash-attention forward returns it), and
``fwd+bwd`` (the loss and its gradients to qi, ki, w; lse computed). Median of CUDA-event
timings after a warm-up. Floors, at the same-run bf16 matmul rate
(``bench_hytopk.matmul_rate()``, 8192^3), with P = S (S + 1) / 2 visible pairs:

    attention score GEMM    2 H D P        (q . k over the causal half)
    indexer score GEMM      2 Hi Di P      (qi_j . ki, every indexer head)
    dqi GEMM                2 Hi Di P      (backward: (dI w [a > 0]) . ki)
    dki GEMM                2 Hi Di P      (backward: (dI w [a > 0])^T . qi)

fwd's floor is the first two, fwd+bwd's all four; "x floor" is the time over the floor's
time (target <= 1.5). "kernel GEMMs" is the multiply-add work the kernels actually run
(scores recomputed: see lowerings/triton_indexer_kl.py), as a multiple of the floor. Peak
memory is the most allocated beyond the inputs during the call. ``bitwise`` says whether
two backward calls gave identical gradients. At S <= --dense-max the dense original
(Megatron-Core's loss, fp32 tables, eager) runs too where it fits in memory: its time and
the relative difference of the losses.

``--config``: ``IndexerKLConfig`` fields over each shape's ``default_config``, one
configuration as ``field=value,...`` and several separated by ``;`` ("default": none
changed). Each runs the kernels directly on the same inputs, rows labelled with the
configuration, and reports the GPU time of each kernel in one fwd+bwd call (torch.profiler:
"kernels" column, ms and launches) and the largest difference of the loss and gradients from
the first configuration's (relative to the first's largest magnitude). With ``--inspect``
the same configurations are compiled for sm_90.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from hyscale_compile.lowerings.config_text import config_name, parse_config_list  # noqa: E402


def megatron_dense_kl(q, k, qi, ki, w, scale):
    """Megatron-Core's indexer scores + ``compute_dsa_indexer_loss`` (dense, causal, fp32 tables)."""
    B, S, H, D = q.shape
    index_scores = (torch.einsum("bshd,btd->bsht", qi.float(), ki.float()).relu() * w.float().unsqueeze(-1)).sum(2)
    mask = torch.triu(torch.full((S, S), float("-inf"), device=q.device), diagonal=1)
    index_scores = index_scores + mask
    att = torch.bmm(q.permute(0, 2, 1, 3).reshape(B * H, S, D).float(),
                    k.permute(0, 2, 3, 1).reshape(B * H, D, S).float()) * scale
    att = torch.softmax(att.reshape(B, H, S, S) + mask, dim=-1).sum(1)
    att = att / att.sum(-1, keepdim=True)
    ind = torch.softmax(index_scores, dim=-1)
    return (att * (torch.log(att + 1e-10) - torch.log(ind + 1e-10))).sum(-1).mean()


def time_ms(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        if not cuda:  # the script's CPU smoke run (--device cpu)
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
            continue
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def peak_extra_mib(fn) -> float:
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def parse_configs(text: str) -> list:
    """'default;dq_heads=2,dk_block_n=128' -> [{}, {'dq_heads': 2, 'dk_block_n': 128}]."""
    from hyscale_compile.lowerings.triton_indexer_kl import IndexerKLConfig

    return parse_config_list(text, IndexerKLConfig)


def with_fields(cfg, fields: dict):
    import dataclasses

    cfg = dataclasses.replace(cfg, **fields)
    if "chunk_rows" not in fields:  # a changed block_m keeps the chunk a multiple of it
        cfg = dataclasses.replace(cfg, chunk_rows=max(cfg.block_m, cfg.chunk_rows // cfg.block_m * cfg.block_m))
    return cfg


def kernel_times(fn) -> str:
    """'name ms/launches' per CUDA kernel of one call of ``fn``, longest first (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        if us is None:
            us = getattr(ev, "cuda_time_total", 0.0)
        if us >= 100:  # kernels under 0.1 ms left out
            rows.append((us / 1e3, ev.key, ev.count))
    return "; ".join(f"{name} {ms:.2f}/{n}" for ms, name, n in sorted(rows, reverse=True))


def inspect_sm90(a) -> int:
    """Compile every kernel for sm_90 at the benchmark's shape on any machine (no GPU: Triton's
    ``warmup`` against a stand-in driver) and print ptxas' report, one line per kernel and
    configuration (``--config``; ``--dtypes``)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("--inspect compiles for the GPU: unset TRITON_INTERPRET")
    import triton
    from triton.runtime import driver

    from inspect_hytopk import _Sm90, ptxas_report
    from hyscale_compile.lowerings import triton_indexer_kl as tk

    driver.set_active(_Sm90())
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    H, D, Hi, Di, S = a.heads, a.dim, a.index_heads, a.index_dim, 4096
    configs = parse_configs(a.config) if a.config is not None else [{}]
    failed = 0
    for dtype in [getattr(torch, x) for x in a.dtypes.split(",") if x]:
        q = torch.empty(1, S, H, D, dtype=dtype)
        k = torch.empty(1, S, H, D, dtype=dtype)
        qi = torch.empty(1, S, Hi, Di, dtype=dtype)
        ki = torch.empty(1, S, Di, dtype=dtype)
        w = torch.empty(1, S, Hi, dtype=dtype)
        base = tk.default_config(q.to("meta"), qi.to("meta"), S, interpret=False)
        base = tk.IndexerKLConfig(**{**base.__dict__, **{f: v for f, v in (("block_m", a.block_m),
                                                                           ("block_n", a.block_n),
                                                                           ("num_warps", a.num_warps)) if v}})
        for fields in configs:
            cfg = with_fields(base, fields)
            tk._WARMUP = []
            try:
                _, stats, rows = tk.indexer_kl_triton_forward(q, k, qi, ki, w, None, D ** -0.5, True, 1.0, cfg=cfg)
                tk.indexer_kl_triton_backward(torch.ones(()), q, k, qi, ki, w, stats, rows, D ** -0.5, True, 1.0,
                                              cfg=cfg)
                compiled = tk._WARMUP
            except Exception as e:  # a configuration that does not compile (shared memory, a bad field)
                print(f"inspect config={config_name(fields)} dtype={str(dtype).split('.')[-1]} failed: "
                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
                failed += 1
                continue
            finally:
                tk._WARMUP = None
            seen = set()
            for name, ck in compiled:
                if name in seen:
                    continue
                seen.add(name)
                rep = ptxas_report(ck.asm["ptx"], bindir)
                spill = rep.get("spill_st", 0) + rep.get("spill_ld", 0)
                failed += spill > 0
                bm, bn = _tile(name, cfg)
                print(f"inspect config={config_name(fields)} kernel={name} dtype={str(dtype).split('.')[-1]} "
                      f"block_m={bm} block_n={bn} warps={ck.metadata.num_warps} stages={cfg.num_stages} "
                      f"regs={rep.get('regs', 0)} spill={spill} smem={ck.metadata.shared} "
                      f"wgmma={int('wgmma.mma_async' in ck.asm['ptx'])}", flush=True)
    return 0


def _tile(name, cfg):
    """(rows, keys) of a kernel's tile under ``cfg`` (rows: the dots' rows, heads stacked)."""
    if name == "_attn_lse_kernel":
        return cfg.lse_block_m or cfg.block_m, cfg.block_n
    if name == "_kl_dq_kernel":
        return f"{cfg.dq_heads}x{cfg.dq_block_m or cfg.block_m}", cfg.dq_block_n or cfg.block_n
    if name == "_kl_dk_kernel":
        return f"{cfg.dk_heads}x{cfg.block_m}", cfg.dk_block_n
    return cfg.block_m, cfg.block_n


def _calls(dense_indexer_kl, tk, cfg, q, k, qi, ki, w, leaves, scale, lse):
    """(fwd, fwd with lse, fwd+bwd -> (loss, grads)): through the public loss (``cfg`` None) or
    the kernels called directly with ``cfg``."""
    if cfg is None:
        def fwd():
            with torch.no_grad():
                return dense_indexer_kl(q, k, qi, ki, w, scale=scale)

        def fwd_lse():
            with torch.no_grad():
                return dense_indexer_kl(q, k, qi, ki, w, scale=scale, lse=lse)

        def step():
            for t in leaves:
                t.grad = None
            loss = dense_indexer_kl(q, k, *leaves, scale=scale)
            loss.backward()
            return loss.detach(), [t.grad.clone() for t in leaves]

        return fwd, fwd_lse, step

    def fwd():
        return tk.indexer_kl_triton_forward(q, k, qi, ki, w, None, scale, True, 1.0, cfg=cfg)[0]

    def fwd_lse():
        return tk.indexer_kl_triton_forward(q, k, qi, ki, w, lse, scale, True, 1.0, cfg=cfg)[0]

    def step():
        loss, st, rs = tk.indexer_kl_triton_forward(q, k, qi, ki, w, None, scale, True, 1.0, cfg=cfg)
        grads = tk.indexer_kl_triton_backward(torch.ones((), device=q.device), q, k, qi, ki, w, st, rs, scale, True,
                                              1.0, cfg=cfg)
        return loss, list(grads)

    return fwd, fwd_lse, step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="8192,16384,32768")
    ap.add_argument("--quick", action="store_true", help="S = 4096, 8192 and fewer repeats (a smoke run)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--index-heads", type=int, default=64)
    ap.add_argument("--index-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dense-max", type=int, default=8192, help="run the dense original up to this S")
    ap.add_argument("--block-m", type=int, default=0, help="override the launch config (0: default_config)")
    ap.add_argument("--block-n", type=int, default=0)
    ap.add_argument("--num-warps", type=int, default=0)
    ap.add_argument("--config", default=None, help='IndexerKLConfig fields, "default;f=v,f=v;..." (see above)')
    ap.add_argument("--dtypes", default="bfloat16,float32", help="--inspect: the operand dtypes compiled")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--inspect", action="store_true", help="no GPU: compile the kernels for sm_90 and report")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script under TRITON_INTERPRET=1 "
                    "(tiny --seqs and heads), no meaningful times")
    a = ap.parse_args(argv)
    try:
        configs = parse_configs(a.config) if a.config is not None else None
    except ValueError as e:
        ap.error(f"--config: {e}")
    if a.inspect:
        return inspect_sm90(a)
    dev = a.device
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_indexer_kl.py needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1)")
    seqs = [4096, 8192] if a.quick else [int(x) for x in a.seqs.split(",") if x]
    reps = 3 if a.quick else a.reps
    warmup = 1 if a.quick else 2

    import bench_hytopk as bh
    from hyscale_compile.losses import dense_indexer_kl
    from hyscale_compile.lowerings import triton_indexer_kl as tk

    if a.block_m or a.block_n or a.num_warps:
        base_cfg = tk.default_config

        def patched(q, qi, T, interpret=None):
            c = base_cfg(q, qi, T, interpret=interpret)
            bm = a.block_m or c.block_m
            return tk.IndexerKLConfig(**{**c.__dict__, "block_m": bm, "block_n": a.block_n or c.block_n,
                                         "num_warps": a.num_warps or c.num_warps,
                                         "chunk_rows": max(bm, c.chunk_rows // bm * bm)})

        tk.default_config = patched

    H, D, Hi, Di = a.heads, a.dim, a.index_heads, a.index_dim
    scale = D ** -0.5
    if dev == "cuda":
        rate = bh.matmul_rate()
    else:
        x = torch.randn(512, 512)
        rate = 2 * 512**3 / (time_ms(lambda: x @ x, 1, 3) * 1e-3)
    meta = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__,
                triton=__import__("triton").__version__, matmul_tflops=rate / 1e12, H=H, D=D, Hi=Hi, Di=Di,
                dtype="bfloat16" if dev == "cuda" else "float32")
    print(f"# bench_indexer_kl: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, bf16 matmul "
          f"{rate / 1e12:.0f} TFLOP/s; attention {H}x{D}, indexer {Hi}x{Di}, causal, B=1", flush=True)
    lines = ["| S | call | ms | floor ms | x floor | kernel GEMMs (x floor) | peak extra MiB | notes |",
             "|---|---|---|---|---|---|---|---|"]
    results = []
    for S in seqs:
        g = torch.Generator(device=dev).manual_seed(S)
        bf = dict(device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
        q = torch.randn(1, S, H, D, generator=g, **bf)
        k = torch.randn(1, S, H, D, generator=g, **bf)
        qi = torch.randn(1, S, Hi, Di, generator=g, **bf)
        ki = torch.randn(1, S, Di, generator=g, **bf)
        w = (torch.randn(1, S, Hi, generator=g, device=dev) * (Hi * Di) ** -0.5).to(bf["dtype"])
        P = S * (S + 1) / 2
        f_att, f_idx = 2 * H * D * P, 2 * Hi * Di * P
        floor_fwd = (f_att + f_idx) / rate * 1e3
        floor_all = (f_att + 3 * f_idx) / rate * 1e3
        run_fwd = (2 * f_att + f_idx) / (f_att + f_idx)
        run_lse = 1.0
        run_all = (3 * f_att + 6 * f_idx) / (f_att + 3 * f_idx)
        leaves = [t.clone().requires_grad_(True) for t in (qi, ki, w)]
        stats = tk.attention_stats_triton(q, k, scale, True)
        lse = stats[..., 0] + torch.log(stats[..., 1])
        rows = []
        first = None  # the first configuration's (loss, grads): each later one is compared with it
        for fields in configs or [None]:
            cfg = None if fields is None else with_fields(tk.default_config(q, qi, S), fields)
            label = "" if fields is None else f" [{config_name(fields)}]"
            fwd, fwd_lse, step = _calls(dense_indexer_kl, tk, cfg, q, k, qi, ki, w, leaves, scale, lse)
            try:
                ms = time_ms(fwd, warmup, reps)
                rows.append(("fwd" + label, ms, floor_fwd, run_fwd, peak_extra_mib(fwd), ""))
                ms = time_ms(fwd_lse, warmup, reps)
                rows.append(("fwd, lse given" + label, ms, floor_fwd, run_lse, peak_extra_mib(fwd_lse), ""))
                ms = time_ms(step, warmup, reps)
                mem = peak_extra_mib(step)
                loss, grads1 = step()
                _, grads2 = step()
            except Exception as e:  # a configuration that does not compile or launch (shared memory)
                if fields is None:
                    raise
                msg = str(e).splitlines()[0] if str(e) else ""
                rows.append(("fwd+bwd" + label, float("nan"), floor_all, run_all, float("nan"),
                             f"failed: {type(e).__name__}: {msg[:120]}"))
                continue
            same = all(torch.equal(x, y) for x, y in zip(grads1, grads2))
            note = f"bitwise {'yes' if same else 'NO'}"
            if fields is not None:
                outs = [loss.detach()] + grads1
                if first is None:
                    first = outs
                else:
                    rel = max(float((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30))
                              for x, y in zip(outs, first))
                    note += f"; max diff from the first config {rel:.1e}"
            if dev == "cuda":
                note += "; kernels " + kernel_times(step)
            rows.append(("fwd+bwd" + label, ms, floor_all, run_all, mem, note))
            if fields is None:
                last_loss = loss
        loss = last_loss if configs is None else first[0] if first is not None else torch.tensor(float("nan"))
        if S <= a.dense_max:
            try:
                dense = megatron_dense_kl(q, k, qi, ki, w, scale)
                dms = time_ms(lambda: megatron_dense_kl(q, k, qi, ki, w, scale), 1, max(1, reps // 2))
                rel = abs(float(loss.detach()) - float(dense.detach())) / abs(float(dense.detach()))
                rows.append(("dense original fwd", dms, floor_fwd, float("nan"),
                             peak_extra_mib(lambda: megatron_dense_kl(q, k, qi, ki, w, scale)),
                             f"loss rel diff {rel:.2e}"))
            except torch.OutOfMemoryError:
                rows.append(("dense original fwd", float("nan"), floor_fwd, float("nan"), float("nan"), "out of memory"))
            if dev == "cuda":
                torch.cuda.empty_cache()
        for name, ms, fl, run, mem, note in rows:
            lines.append(f"| {S} | {name} | {ms:.2f} | {fl:.2f} | {ms / fl:.2f} | "
                         f"{'' if run != run else f'{run:.2f}'} | {mem:.0f} | {note} |")
            print(lines[-1], file=sys.stderr, flush=True)
            results.append(dict(S=S, call=name, ms=ms, floor_ms=fl, x_floor=ms / fl, kernel_gemms_x_floor=run,
                                peak_extra_mib=mem, note=note))
        del q, k, qi, ki, w, leaves, stats, lse
        if dev == "cuda":
            torch.cuda.empty_cache()
    floors = ("floors: attention score 2 H D P, indexer score 2 Hi Di P, dqi 2 Hi Di P, dki 2 Hi Di P "
              "(P = S (S + 1) / 2); fwd = the first two, fwd+bwd = all four; target x floor <= 1.5")
    print("\n".join(lines + ["", floors]))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_indexer_kl.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
