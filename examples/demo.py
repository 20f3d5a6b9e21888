"""hyscale_compile demo: eager vs ``torch.compile`` vs ``torch.compile(backend="hyscale")``.

Run ``python examples/demo.py`` (``--help`` for the flags). It

1. builds the small DeepSeek-Sparse-Attention LM of ``examples/dsa_model.py`` (plain PyTorch,
   nothing hyscale-specific in it) at a size where the lightning indexer's score table matters;
2. prints ``hyscale_compile.explain(model, input_ids)``: which top-k sites the backend rewrote
   into ``torch.ops.hyscale.hytopk`` and, for any it left alone, why;
3. runs the model eagerly, with default ``torch.compile`` (Inductor) and with
   ``backend="hyscale"``, and checks that hyscale's logits equal eager's;
4. measures compile time, the median forward time and the peak extra memory of each;
5. prints a table.

On a CPU it runs in float32 at S=4096 (about 2-3 minutes on 2 cores); ``--quick`` is a tiny
smoke run (under a minute). On a CUDA machine it runs "the real thing": S=32768, bf16 weights
(the indexer upcasts to fp32 before its contraction, as the HF code does), CUDA-event timing and
``torch.cuda.max_memory_allocated``.

Each variant runs in a fresh process (multiprocessing "spawn"), so one variant's compiled code,
caches and allocator state never leak into another's numbers, and a variant that runs out of
memory cannot take the demo down with it.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dsa_model import DSAConfig, make_model  # noqa: E402

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # plain prints instead
    _tqdm = None

SEED = 0
MiB = 1 << 20


# --------------------------------------------------------------------------------------------
# sizes
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    device: str
    seq: int
    dtype: torch.dtype
    cfg: DSAConfig
    runs: int  # timed forwards per variant (after warm-up)
    variants: List[str]
    isolate: bool  # each variant in a fresh process with cold compile caches (all but --quick)


def model_config(seq: int, device: str, quick: bool) -> DSAConfig:
    if quick:  # tiny: for smoke tests
        return DSAConfig(vocab=256, dim=64, layers=1, heads=4, index_heads=4, index_head_dim=16,
                         index_topk=32, max_seq=seq, q_lora_rank=32, mlp_hidden=128)
    if device == "cuda":  # k=2048 as DeepSeek-V3.2; indexer heads kept so eager still fits at 32K
        return DSAConfig(vocab=1024, dim=256, layers=2, heads=4, index_heads=8, index_head_dim=64,
                         index_topk=2048, max_seq=seq, q_lora_rank=128, mlp_hidden=512)
    # CPU: one layer, 16 indexer heads of dim 32, k=512, 2 attention heads. At S=4096 the
    # indexer (its per-head [S, H, T] logits: 1 GiB, and the [S, T] table) is most of eager's
    # time and memory; the model's own attention is dense (HF eager form: [heads, S, S] scores),
    # so few attention heads keep it from hiding the indexer's memory.
    return DSAConfig(vocab=256, dim=64, layers=1, heads=2, index_heads=16, index_head_dim=32,
                     index_topk=512, max_seq=seq, q_lora_rank=32, mlp_hidden=128)


def parse_args(argv=None) -> Plan:
    p = argparse.ArgumentParser(
        description="Eager vs torch.compile vs torch.compile(backend='hyscale') on a small DSA model.")
    p.add_argument("--seq", type=str, default=None,
                   help="sequence length (default: 4096 on CPU, 32768 on CUDA, 256 with --quick)")
    p.add_argument("--device", type=str, default="auto",
                   help="auto (CUDA when available, else CPU), cpu, or cuda")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests (under a minute on a CPU)")
    p.add_argument("--no-inductor", action="store_true", help="skip the default torch.compile (Inductor) variant")
    p.add_argument("--runs", type=str, default=None, help="timed forwards per variant after warm-up (default 3; 5 on CUDA)")
    a = p.parse_args(argv)

    dev = a.device.strip().lower()
    if dev not in ("auto", "cpu", "cuda"):
        p.error(f"--device must be one of auto, cpu, cuda; got {a.device!r}")
    if dev == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda was asked for, but torch.cuda.is_available() is False on this machine "
                f"(torch {torch.__version__}); use --device cpu")
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"

    def positive_int(name, text, lo):
        try:
            v = int(text)
        except ValueError:
            p.error(f"{name} must be an integer, got {text!r}")
        if v < lo:
            p.error(f"{name} must be at least {lo}, got {v}")
        return v

    if a.seq is None:
        seq = 256 if a.quick else (32768 if dev == "cuda" else 4096)
    else:
        seq = positive_int("--seq", a.seq, 2)
    runs = positive_int("--runs", a.runs, 1) if a.runs is not None else (2 if a.quick else (5 if dev == "cuda" else 3))
    cfg = model_config(seq, dev, a.quick)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    variants = ["eager"] + ([] if a.no_inductor else ["inductor"]) + ["hyscale"]
    return Plan(device=dev, seq=seq, dtype=dtype, cfg=cfg, runs=runs, variants=variants, isolate=not a.quick)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def say(msg: str = "") -> None:
    print(msg, flush=True)


def progress(it, desc: str):
    if _tqdm is not None and sys.stdout.isatty():  # a bar in a terminal; plain lines in a log
        return _tqdm(it, desc=desc, leave=False, file=sys.stdout, dynamic_ncols=True)
    return it


def build(plan: Plan):
    """The model and its input, identical in every process (seeded, built on the CPU)."""
    torch.manual_seed(SEED)
    model = make_model(plan.cfg).eval()
    ids = torch.randint(0, plan.cfg.vocab, (1, plan.seq), generator=torch.Generator().manual_seed(SEED + 1))
    if plan.device == "cuda":
        model = model.to(device="cuda", dtype=plan.dtype)
        ids = ids.cuda()
    return model, ids


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# Peak memory on the CPU, measured honestly.
#
# ru_maxrss is a process-lifetime high-water mark (it would include compilation and warm-up)
# and glibc keeps freed heap pages, so "RSS after minus RSS before" misses memory a forward
# reuses. So, right before the measured forward: (1) gc + malloc_trim(0) hands every free heap
# page back to the kernel, so the forward must fault in every byte it touches; (2) writing "5"
# to /proc/self/clear_refs resets the kernel's peak-RSS counter (VmHWM) to the current RSS
# (Linux >= 4.0); (3) after the forward, VmHWM - VmRSS(before) is the peak extra resident
# memory of that one forward (its outputs included). Where clear_refs is not writable we
# fall back to sampling VmRSS every 0.5 ms in a thread (a lower bound on the true peak).
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_peak_extra(fn):
    """(result, peak extra MiB, method) of one call of ``fn``."""
    _trim()
    if _reset_hwm():
        before = _status_kib("VmRSS")
        out = fn()
        return out, (_status_kib("VmHWM") - before) / 1024, "VmHWM reset via clear_refs"
    import threading

    before, peak, done = _status_kib("VmRSS"), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _status_kib("VmRSS"))
            time.sleep(0.0005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out = fn()
    done.set()
    th.join()
    peak[0] = max(peak[0], _status_kib("VmRSS"))
    return out, (peak[0] - before) / 1024, "sampled VmRSS (lower bound)"


def timed(fn, device: str) -> float:
    """Wall time of one call in ms (CUDA events on a GPU)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


# --------------------------------------------------------------------------------------------
# one variant, in its own process
# --------------------------------------------------------------------------------------------
def run_variant(variant: str, plan: Plan, out_path: Optional[str] = None) -> Dict[str, Any]:
    """Warm up (compile), measure one forward's peak memory, time ``plan.runs`` forwards."""
    with torch.no_grad():  # inference
        res = _run_variant(variant, plan)
    if out_path is not None:
        torch.save(res, out_path)
    return res


def _run_variant(variant: str, plan: Plan) -> Dict[str, Any]:
    tag = f"  [{variant}]"
    res: Dict[str, Any] = {"variant": variant, "status": "ok"}
    try:
        if variant == "hyscale":
            import hyscale_compile  # noqa: F401  registers backend="hyscale"
        say(f"{tag} building the model (seed {SEED})")
        model, ids = build(plan)
        fn = model if variant == "eager" else torch.compile(model, backend=variant)

        label = "first call (warm-up)" if variant == "eager" else "compiling + first call"
        say(f"{tag} {label} ...")
        t0 = time.perf_counter()
        fn(ids)
        sync(plan.device)
        first_s = time.perf_counter() - t0
        say(f"{tag} {label}: {first_s:.1f} s")

        say(f"{tag} measuring peak memory of one forward ...")
        if plan.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            logits = fn(ids)
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / MiB
            method = "torch.cuda.max_memory_allocated - allocated before"
        else:
            logits, peak, method = cpu_peak_extra(lambda: fn(ids))
        res.update(peak_mib=peak, mem_method=method)
        say(f"{tag} peak extra memory: {peak:,.0f} MiB ({method})")

        times = []
        for i in progress(range(plan.runs), desc=f"{tag} timed forwards"):
            times.append(timed(lambda: fn(ids), plan.device))
            if _tqdm is None or not sys.stdout.isatty():
                say(f"{tag} timed forward {i + 1}/{plan.runs}: {times[-1]:,.0f} ms")
        med = statistics.median(times)
        res.update(times_ms=times, median_ms=med, first_s=first_s,
                   compile_s=None if variant == "eager" else max(0.0, first_s - med / 1e3))
        say(f"{tag} forward median {med:,.1f} ms over {plan.runs} run(s): "
            + ", ".join(f"{t:,.0f}" for t in times) + " ms")
        res["logits"] = logits.detach().float().cpu()
    except Exception as e:  # recorded, reported in the table, never silently dropped
        oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()
        res.update(status="OOM" if oom else "error", error=f"{type(e).__name__}: {e}",
                   tb=traceback.format_exc())
        say(f"{tag} FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return res


def spawn_variant(variant: str, plan: Plan, tmp: str) -> Dict[str, Any]:
    path = os.path.join(tmp, f"{variant}.pt")
    # Compile times as on a fresh machine: each variant gets empty Inductor/Triton caches (the
    # child inherits the environment), so neither a previous run nor the other compiled variant
    # (they share most kernels) can warm them.
    for env in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        os.environ[env] = os.path.join(tmp, f"{variant}_{env.lower()}")
    proc = mp.get_context("spawn").Process(target=run_variant, args=(variant, plan, path))
    t0 = time.perf_counter()
    proc.start()
    proc.join()
    if proc.exitcode != 0 or not os.path.exists(path):
        why = "killed (out of memory?)" if proc.exitcode in (-9, 137) else f"exit code {proc.exitcode}"
        say(f"  [{variant}] process died: {why}")
        return {"variant": variant, "status": "OOM" if proc.exitcode in (-9, 137) else "error", "error": why}
    res = torch.load(path, weights_only=False)
    say(f"  [{variant}] done in {time.perf_counter() - t0:.1f} s (process start included)")
    return res


# --------------------------------------------------------------------------------------------
# equality
# --------------------------------------------------------------------------------------------
class StableTopK(torch.overrides.TorchFunctionMode):
    """``topk`` with the project's tie rule (value descending, then smaller index first)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            x, k = args[0], (args[1] if len(args) > 1 else kwargs["k"])
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
            order = torch.sort(x, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
            return torch.return_types.topk((torch.gather(x, dim, order), order))
        return func(*args, **kwargs)


def tolerances(plan: Plan) -> Dict[str, float]:
    # fp32: torch.testing's own float32 defaults. bf16 logits: eager, Inductor and hyscale
    # round bf16 intermediates at different places (each compile fuses the graph its own
    # way), so a logit near zero can carry one bf16 ulp of a large intermediate: compare
    # normwise, atol = rtol * the largest |logit| (a few bf16 ulps of the largest logit).
    return dict(rtol=1.3e-6, atol=1e-5) if plan.dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2, normwise=True)


def close(a, b, tol) -> Optional[str]:
    tol = dict(tol)
    if tol.pop("normwise", False):
        tol["atol"] = tol["atol"] * max(1.0, b.abs().max().item())
    try:
        torch.testing.assert_close(a, b, **tol)
        return None
    except AssertionError as e:
        return str(e).strip().splitlines()[0] + f" (max |diff| {(a - b).abs().max().item():.3g})"


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------
def environment(plan: Plan) -> str:
    import importlib.metadata as md

    def ver(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    if plan.device == "cuda":
        dev = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    else:
        cpu = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
        except (OSError, StopIteration):
            pass
        dev = f"CPU {cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"
    return (f"device: {dev}\npython {platform.python_version()}, torch {torch.__version__}, "
            f"triton {ver('triton')}, hyscale_compile {ver('hyscale_compile')}")


def main(argv=None) -> int:
    plan = parse_args(argv)
    cfg = plan.cfg
    t_start = time.perf_counter()
    say("=" * 78)
    say("hyscale_compile demo: exact top-k selection without the [S, T] score table")
    say("=" * 78)
    say(environment(plan))
    if plan.device == "cpu" and hasattr(os, "getloadavg"):
        load = os.getloadavg()[0]
        say(f"load average (1 min) before starting: {load:.2f} on {os.cpu_count()} cores"
            + (" -- other work is running; CPU timings will be noisy" if load > 0.5 * (os.cpu_count() or 1) else ""))
    H, T, S = cfg.index_heads, plan.seq, plan.seq
    say(f"model: DSA LM, {cfg.layers} layer(s), dim {cfg.dim}, {cfg.heads} attention heads; indexer "
        f"{H} heads x dim {cfg.index_head_dim}, top-k {min(cfg.index_topk, T)}; batch 1, S={S}, "
        f"{str(plan.dtype).replace('torch.', '')} weights, inference (no_grad)")
    say(f"eager materializes, per layer, the indexer's per-head logits [S, H, T] fp32 = "
        f"{S * H * T * 4 / MiB:,.0f} MiB and the score table [S, T] = {S * T * 4 / MiB:,.0f} MiB")

    say("\n[1/5] building the model and a random input ...")
    import hyscale_compile

    model, ids = build(plan)
    say(f"      {sum(p.numel() for p in model.parameters()):,} parameters, input_ids {tuple(ids.shape)}")

    say("\n[2/5] hyscale_compile.explain(model, input_ids) (hyscale pass, graphs run without Inductor) ...")
    t0 = time.perf_counter()
    with torch.no_grad():
        report = hyscale_compile.explain(model, ids)
    say(f"      ({time.perf_counter() - t0:.1f} s)")
    say(str(report))
    # What the demo expects: one site per layer, rewritten as the whole indexer (all S queries,
    # all H heads), so that neither the [S, H, T] logits nor the [S, T] table are built.
    for site in report.fused:
        sz = site.sizes
        if sz.get("S") != S or sz.get("H") != H or site.table_consumers:
            say(f"WARNING: site {site.node} was rewritten, but not as the whole indexer (expected S={S}, "
                f"H={H}; got {', '.join(f'{k}={v}' for k, v in sz.items())}): part of the score "
                f"computation still runs outside the op and its tables are still materialized.")
    if len(report.fused) < cfg.layers:
        say(f"WARNING: expected {cfg.layers} fused site(s), one per layer; got {len(report.fused)}")
    del model
    gc.collect()

    where = "in a fresh process with cold compile caches" if plan.isolate else "in this process (--quick)"
    say(f"\n[3/5] running each variant {where}: {', '.join(plan.variants)} "
        f"(warm-up, 1 forward for memory, {plan.runs} timed) ...")
    results: Dict[str, Dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="hyscale_demo_") as tmp:
        for v in plan.variants:
            say(f"\n  --- {v} " + ("(torch.compile, backend='inductor')" if v == "inductor" else
                                  "(torch.compile, backend='hyscale')" if v == "hyscale" else "(plain PyTorch)"))
            if plan.isolate:
                results[v] = spawn_variant(v, plan, tmp)
            else:  # --quick: no process start-up, compile caches shared (the speed is not the point)
                torch._dynamo.reset()
                results[v] = run_variant(v, plan)

    say("\n[4/5] checking outputs against eager ...")
    tol = tolerances(plan)
    atol = f"{tol['atol']} x max|eager logit|" if tol.get("normwise") else tol["atol"]
    say(f"      torch.testing.assert_close(logits, eager_logits, rtol={tol['rtol']}, atol={atol})")
    eager = results["eager"].get("logits")
    equal: Dict[str, str] = {}
    hyscale_ok = False
    if eager is None:
        for v in plan.variants:
            equal[v] = "n/a (eager failed)"
    else:
        equal["eager"] = "(reference)"
        stable = None
        for v in plan.variants[1:]:
            out = results[v].get("logits")
            if out is None:
                equal[v] = "n/a (failed)"
                continue
            err = close(out, eager, tol)
            if err is None:
                equal[v] = "yes"
                hyscale_ok |= v == "hyscale"
                say(f"      {v}: equal to eager")
                continue
            say(f"      {v}: differs from eager: {err}")
            if v == "hyscale":
                # torch.topk breaks ties in an unspecified order; hyscale breaks them by the smaller
                # key index (docs/contract.md, "Equality with eager"). Compare with eager run under that
                # rule: equal there means the two differ only in how ties were broken.
                say("      hyscale: re-running eager with a stable top-k (ties -> smaller key index) ...")
                if stable is None:
                    m, x = build(plan)
                    with torch.no_grad(), StableTopK():
                        stable = m(x).float().cpu()
                    del m
                    tie_note = close(eager, stable, tol)
                    say("      eager vs eager-with-stable-top-k: "
                        + ("equal (no tie changes the output)" if tie_note is None else f"differ: {tie_note}"))
                err2 = close(out, stable, tol)
                ind = results.get("inductor", {}).get("logits")
                err3 = close(out, ind, tol) if (ind is not None and plan.dtype != torch.float32) else "n/a"
                if err2 is None:
                    equal[v] = "yes (stable ties)"
                    hyscale_ok = True
                    say("      hyscale: equal to eager with the stable tie rule")
                elif err3 is None:
                    # low precision: default torch.compile rounds the model's bf16 math
                    # differently from eager; hyscale compiles everything but the selection
                    # exactly as it does, so that is the output the rewrite must not change
                    equal[v] = "= inductor"
                    hyscale_ok = True
                    say("      hyscale: equal to default torch.compile (which itself differs from eager "
                        "by bf16 rounding, see above)")
                else:
                    equal[v] = "NO"
                    say(f"      hyscale: differs from eager with the stable tie rule too: {err2}")
            else:
                equal[v] = f"no ({err.rsplit('(', 1)[-1].rstrip(')')})"

    say("\n[5/5] results")
    mem_methods = {r.get("mem_method") for r in results.values() if r.get("mem_method")}
    head = ["variant", "compile s", "forward ms (median)", "peak extra MiB", "equal to eager"]
    rows = []
    for v in plan.variants:
        r = results[v]
        if r.get("status") != "ok":
            rows.append([v, "-", r.get("status", "error"), "-", equal.get(v, "-")])
            if r.get("tb"):
                say(f"  {v} failed:\n{r['tb']}")
            continue
        rows.append([
            v,
            "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}",
            f"{r['median_ms']:,.1f}",
            f"{r['peak_mib']:,.0f}",
            equal.get(v, "-"),
        ])
    say(f"device={plan.device}, S={S}, {cfg.layers} layer(s), indexer H={H} D={cfg.index_head_dim} "
        f"k={min(cfg.index_topk, T)}, dtype={str(plan.dtype).replace('torch.', '')}, runs={plan.runs}; "
        f"memory: {'; '.join(sorted(mem_methods)) or '-'}; compile s = first call - median forward"
        + (", cold caches" if plan.isolate else ", caches shared (--quick)"))
    say(f"total demo time {time.perf_counter() - t_start:.0f} s\n")
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    fmt = " | ".join("{:<%d}" % w if i in (0, 4) else "{:>%d}" % w for i, w in enumerate(widths))
    say(fmt.format(*head))
    say("-+-".join("-" * w for w in widths))
    for r in rows:
        say(fmt.format(*r))
    return 0 if hyscale_ok else 1


if __name__ == "__main__":
    sys.exit(main())
