"""The HF DeepSeek-V3.2 model of issue 28 end to end, with the sparse attention over the
selection on and off: a no_grad prefill or one training step (forward + backward).

Model: ``DeepseekV32ForCausalLM`` (transformers 5.24), 2 layers, hidden 2048, 16 MLA heads (qk
192 = 128 + 64 rope, v 128, kv_lora 512, q_lora 768), indexer 64 heads x 128, index_topk 2048,
sdpa attention, bf16, batch 1, random weights (the config of ``e2e_hf_step.py``, which measured
the issue's table). Method as there: compile, one warm-up call, the median of 3 timed calls
(CUDA events), peak memory above what was allocated before the timed calls, then one call under
``torch.profiler`` whose kernels are summed by name into attention / selection / GEMMs /
scatter-gather / other (``bucket``). ``attn op calls`` counts ``hyscale::sparse_attention`` calls
per step: 0 means the dense attention ran (the rewrite off, or not matched).

``--indexer-loss sparse`` (train mode) also trains the indexers with the sparse-stage KL loss
(DeepSeek-V3.2 section 2.1), written beside the HF model as a user would: the recipe of
``tests/models/hf_indexer_loss.py`` (``attach_indexer_losses``: each layer's loss, the
recipe's selection as the attention's); the step's loss is the LM loss plus the layers'
losses. ``indexer loss`` says what the compiler did with them: ``sparse R/N`` for R of the N
losses found rewritten to the k selected slots (``[indexer loss: sparse]`` in ``explain``),
``DENSE`` when none was (then the loss ran over [S, T] tables). The rewritten loss's target is
a ``hyscale::sparse_attention`` call with probs, counted in ``attn op calls``.

One row is one process (the CUDA caching allocator and Dynamo caches start clean)::

    python benchmarks/bench_attention_step.py --seq 32768 --mode prefill --sparse on --append rows.jsonl

prints progress, appends the row to ``rows.jsonl`` and prints every row of that file as a table.
``--sweep`` runs each (S, mode, on/off) row of ``--seqs``/``--modes`` as its own subprocess
(``--row-timeout`` each) and prints the table last. ``--tiny`` is a CPU-sized model (hidden 64,
S 64, k 8; the debug backend unless ``--backend`` says otherwise) to check the script anywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's hyscale_compile, not an older installed copy

COLUMNS = ("S", "mode", "sparse", "indexer loss", "backend", "step ms", "peak GiB", "first s", "attn op calls", "attention ms",
           "selection ms", "gemm ms", "scatter/gather ms", "other ms", "note")


def config_kwargs(seq: int, heads: int, tiny: bool, attn: str = "sdpa") -> dict:
    if tiny:
        return dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                    n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                    q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                    index_n_heads=16, index_head_dim=16, index_topk=8, max_position_embeddings=seq + 16,
                    attn_implementation=attn, initializer_range=0.1)
    return dict(vocab_size=4096, hidden_size=2048, intermediate_size=4096, moe_intermediate_size=512,
                num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads, n_routed_experts=8,
                n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                q_lora_rank=768, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                index_n_heads=64, index_head_dim=128, index_topk=2048, max_position_embeddings=seq + 16,
                attn_implementation=attn, initializer_range=0.02)


def build(seq: int, heads: int, tiny: bool, device: str, attn: str = "sdpa", model: str = "deepseek_v32"):
    import torch
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    if model == "glm_moe_dsa":  # the same dimensions in GLM-5's classes (its eager index mask is -inf)
        from transformers import GlmMoeDsaConfig as Config, GlmMoeDsaForCausalLM as Model

        cfg = Config(**config_kwargs(seq, heads, tiny, attn), indexer_types=["full", "full"])
    else:
        from transformers import DeepseekV32Config as Config, DeepseekV32ForCausalLM as Model

        cfg = Config(**config_kwargs(seq, heads, tiny, attn))
    DeepseekV32ForCausalLM = Model  # noqa: N806
    dtype = torch.float32 if tiny and device == "cpu" else torch.bfloat16
    return DeepseekV32ForCausalLM(cfg).to(device, dtype).train(), cfg.vocab_size


def step_fn(model, mode: str, indexer_losses=None):
    """The step; ``indexer_losses``: the list ``attach_indexer_losses`` returned, whose losses
    (appended by the forward) join the LM loss."""
    import torch

    def step(ids):
        if mode == "prefill":
            with torch.no_grad():
                return model(ids, use_cache=False).logits[:, -1]
        out = model(ids, labels=ids, use_cache=False)
        loss = out.loss
        if indexer_losses is not None:
            loss = loss + sum(indexer_losses)
            indexer_losses.clear()
        loss.backward()
        return loss.detach()
    return step


def indexer_loss_state(records) -> str:
    """The row's ``indexer loss``: what the compiler did with the losses it found (records of
    ``passes/indexer_loss.loss_records``, one per loss and graph)."""
    if not records:
        return "DENSE (no loss found)"
    done = sum(r.rewritten for r in records)
    if not done:
        return f"DENSE 0/{len(records)}: {records[0].reason}"
    return f"sparse {done}/{len(records)}" + ("" if all(r.backward == "sparse" for r in records if r.rewritten)
                                              else " (backward dense)")


def bucket(name: str) -> str:
    """A kernel (or, on the CPU, an op) by name. The sparse attention's own kernels count as
    attention, before the selection's hyscale kernels are matched."""
    n = name.lower()
    if "sparse_attention" in n or "sparse_attn" in n or n.startswith("attn_") or "_segment_" in n:
        return "attention"  # the op's generated kernels: attn_fwd, attn_probs, attn_bwd_*, the key sums
    if any(s in n for s in ("hytopk", "sort_rows", "mask_ranges", "score_bound", "topk_table")):
        return "selection"
    if "topk" in n or "sort" in n or "radix" in n:
        return "selection"
    if any(s in n for s in ("flash", "fmha", "attention", "efficient", "cutlass_mem", "softmax")):
        return "attention"
    if any(s in n for s in ("gemm", "sm90", "cutlass", "matmul", "bmm", "nvjet", "addmm", "aten::mm")):
        return "gemm"
    if any(s in n for s in ("scatter", "index", "gather")):
        return "scatter/gather"
    return "other"


def _options(sparse: bool):
    """The backend's options for the rewrite on/off, and a note when this build has no such
    option (then the rewrite's state is whatever the build does: see attn op calls)."""
    from hyscale_compile.options import HYSCALE_OPTIONS

    if "sparse_attention" in HYSCALE_OPTIONS:
        return {"hyscale.sparse_attention": sparse}, ""
    return {}, "no hyscale.sparse_attention option in this build"


def run_row(args) -> dict:
    import torch
    import hyscale_compile  # noqa: F401  (registers the backends and ops)
    from hyscale_compile.lowerings import attention_ops

    device = "cuda" if torch.cuda.is_available() and not (args.tiny and args.cpu) else "cpu"
    backend = args.backend or ("hyscale" if device == "cuda" else "hyscale_debug")
    sparse = args.sparse == "on"
    row = {"S": args.seq, "mode": args.mode, "sparse": args.sparse, "indexer loss": args.indexer_loss,
           "backend": f"{backend}/{args.attn}/{args.model}"}
    options, note = _options(sparse)
    row["note"] = note

    def progress(msg):
        loss = "" if args.indexer_loss == "none" else f" indexer-loss={args.indexer_loss}"
        print(f"[{args.mode} S={args.seq} sparse={args.sparse}{loss}] {msg}", flush=True)

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch._dynamo.reset()
    t0 = time.time()
    model, vocab = build(args.seq, args.heads, args.tiny, device, args.attn, args.model)
    if args.mode == "prefill":
        model.eval()
    indexer_losses = None
    if args.indexer_loss == "sparse":
        from tests.models.hf_indexer_loss import attach_indexer_losses

        indexer_losses = attach_indexer_losses(model)
    ids = torch.randint(0, vocab, (1, args.seq), device=device, generator=None)
    progress(f"built in {time.time() - t0:.1f} s on {device}")
    compiled = torch.compile(step_fn(model, args.mode, indexer_losses), backend=backend, options=options)
    try:
        from hyscale_compile.passes import diagnostics
        from hyscale_compile.passes.indexer_loss import loss_records

        diagnostics.clear()
        t0 = time.time()
        compiled(ids)
        sync()
        row["first s"] = round(time.time() - t0, 1)
        progress(f"compiled and ran once in {row['first s']} s")
        if indexer_losses is not None:
            recs = loss_records()
            row["indexer loss"] = indexer_loss_state(recs)
            for r in recs:
                progress(r.line()[:240])
        times = []
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        calls0 = attention_ops.CALLS["sparse_attention"]
        for _ in range(args.iters):
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                compiled(ids)
                e.record()
                sync()
                times.append(s.elapsed_time(e))
            else:
                t = time.perf_counter()
                compiled(ids)
                times.append((time.perf_counter() - t) * 1e3)
        row["attn op calls"] = (attention_ops.CALLS["sparse_attention"] - calls0) // args.iters
        row["step ms"] = round(statistics.median(times), 1)
        row["peak GiB"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2) if device == "cuda" else ""
        progress(f"step {row['step ms']} ms, peak {row['peak GiB']} GiB, attn op calls {row['attn op calls']}")
        if args.mem_breakdown and device == "cuda":
            # one more step with the allocator's history on: what is live at its peak
            model.zero_grad(set_to_none=True)
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
            compiled(ids)
            sync()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            rows_at_peak = peak_breakdown(snap, args.mem_breakdown)
            progress(f"peak of that step {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated in all; "
                     f"the {len(rows_at_peak)} largest live at the peak:")
            for size, at in rows_at_peak:
                print(f"    {size / 2**30:8.3f} GiB  {at}", flush=True)
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
        model.zero_grad(set_to_none=True)
        with profile(activities=acts) as p:
            compiled(ids)
            sync()
        split, kernels = {}, []
        for ev in p.key_averages():
            if device == "cuda":
                t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            else:
                t = ev.self_cpu_time_total
            if t:
                split[bucket(ev.key)] = split.get(bucket(ev.key), 0.0) + t / 1000.0
                kernels.append((t / 1000.0, ev.count, ev.key))
        for t, n, key in sorted(kernels, reverse=True)[: getattr(args, "top", 0)]:
            progress(f"kernel {t:9.2f} ms x{n:<4d} [{bucket(key)}] {key[:100]}")
        for b in ("attention", "selection", "gemm", "scatter/gather", "other"):
            row[f"{b} ms"] = round(split.get(b, 0.0), 1)
        progress("profiled: " + ", ".join(f"{b} {v:.1f} ms" for b, v in sorted(split.items(), key=lambda kv: -kv[1])))
    except torch.OutOfMemoryError:
        row["step ms"] = "OOM"
        progress("out of memory")
    return row


def peak_breakdown(snapshot: dict, top: int = 25) -> list:
    """The ``top`` largest allocations live at the peak of a CUDA allocator trace
    (``torch.cuda.memory._snapshot()`` taken with history recorded), each as (bytes, where):
    where is the first Python frame of the allocation's stack in hyscale, Inductor's
    generated code or transformers (else its innermost frame)."""
    traces = [t for t in snapshot.get("device_traces", []) if t]
    if not traces:
        return []
    trace = max(traces, key=len)

    def replay(stop=None):
        live, cur, peak, at = {}, 0, 0, -1
        for i, ev in enumerate(trace):
            if stop is not None and i > stop:
                break
            if ev["action"] == "alloc":
                live[ev["addr"]] = ev
                cur += ev["size"]
            elif ev["action"] in ("free_requested", "free_completed") and ev["addr"] in live:
                cur -= live.pop(ev["addr"])["size"]
            if cur > peak:
                peak, at = cur, i
        return live, peak, at

    _, peak, at = replay()
    live, _, _ = replay(at)

    def where(ev):
        frames = ev.get("frames") or []
        for f in frames:
            name = f.get("filename", "")
            if any(x in name for x in ("hyscale", "torchinductor", "transformers", "bench_")):
                return f"{os.path.basename(name)}:{f.get('line')} {f.get('name')}"
        return f"{os.path.basename(frames[0]['filename'])}:{frames[0].get('line')} {frames[0].get('name')}" \
            if frames else "?"

    return [(ev["size"], where(ev)) for ev in sorted(live.values(), key=lambda e: -e["size"])[:top]]


def table(rows) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |")
    return "\n".join(lines)


def sweep(args) -> int:
    rows = []
    path = args.append or tempfile.mktemp(suffix=".jsonl", prefix="bench_attention_step_")
    for seq in map(int, args.seqs.split(",")):
        for mode in args.modes.split(","):
            for sparse in ("on", "off"):
                cmd = [sys.executable, os.path.abspath(__file__), "--seq", str(seq), "--mode", mode, "--sparse", sparse,
                       "--heads", str(args.heads), "--attn", args.attn, "--model", args.model, "--iters", str(args.iters), "--indexer-loss", args.indexer_loss, "--append", path, "--quiet-table"]
                cmd += ["--tiny"] * args.tiny + ["--cpu"] * args.cpu + (["--backend", args.backend] if args.backend else [])
                print("$", " ".join(cmd), flush=True)
                try:
                    rc = subprocess.run(cmd, timeout=args.row_timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
                if rc != 0:
                    rows.append({"S": seq, "mode": mode, "sparse": sparse, "indexer loss": args.indexer_loss,
                                 "step ms": f"failed ({rc})"})
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()] + rows
    print(table(rows))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="One row per process: --seq/--mode/--sparse; --sweep runs several.")
    ap.add_argument("--seq", type=int, default=None, help="sequence length S (default 16384; 64 with --tiny)")
    ap.add_argument("--mode", choices=("prefill", "train"), default="prefill",
                    help="prefill: a no_grad forward; train: one forward + backward")
    ap.add_argument("--sparse", choices=("on", "off"), default="on", help="hyscale.sparse_attention")
    ap.add_argument("--indexer-loss", choices=("none", "sparse"), default="none",
                    help="train mode: also train the indexers with the sparse-stage KL loss (the HF recipe)")
    ap.add_argument("--heads", type=int, default=16, help="MLA attention heads (DeepSeek-V3.2 has 128)")
    ap.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa",
                    help="the model's attn_implementation (the issue's table: sdpa)")
    ap.add_argument("--model", choices=("deepseek_v32", "glm_moe_dsa"), default="deepseek_v32",
                    help="the HF class (same dimensions; GLM-5's eager index mask is -inf, V3.2's finfo.min)")
    ap.add_argument("--iters", type=int, default=3, help="timed calls (the median is reported)")
    ap.add_argument("--top", type=int, default=0, help="also print the profiled call's N longest kernels")
    ap.add_argument("--backend", default=None, help="default: hyscale on CUDA, hyscale_debug on the CPU")
    ap.add_argument("--tiny", action="store_true", help="a CPU-sized model (hidden 64, k 8)")
    ap.add_argument("--cpu", action="store_true", help="with --tiny: run on the CPU even where CUDA is present")
    ap.add_argument("--mem-breakdown", type=int, default=0, metavar="N",
                    help="CUDA: after the timed calls, one more step with the allocator's history recorded; "
                         "print the N largest allocations live at its peak, with the code that made each")
    ap.add_argument("--append", default=None, help="append the row (JSON) to this file and print its table")
    ap.add_argument("--quiet-table", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sweep", action="store_true", help="run every (--seqs, --modes, on/off) row, one process each")
    ap.add_argument("--seqs", default="16384,32768,131072", help="with --sweep")
    ap.add_argument("--modes", default="prefill,train", help="with --sweep")
    ap.add_argument("--row-timeout", type=int, default=1200, help="with --sweep: seconds per row")
    args = ap.parse_args(argv)
    if args.indexer_loss != "none" and (args.mode != "train" and not args.sweep or args.sweep and "prefill" in args.modes):
        ap.error("--indexer-loss sparse trains the indexer: it needs --mode train (with --sweep, --modes train)")
    if args.indexer_loss != "none" and args.model != "deepseek_v32":
        ap.error("--indexer-loss sparse: the recipe is written for --model deepseek_v32")
    if args.sweep:
        return sweep(args)
    if args.seq is None:
        args.seq = 64 if args.tiny else 16384
    row = run_row(args)
    rows = [row]
    if args.append:
        with open(args.append, "a") as f:
            f.write(json.dumps(row) + "\n")
        with open(args.append) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    if not args.quiet_table:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
