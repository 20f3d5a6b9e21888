"""HyTopK at the DSA shape against its baselines, side by side, on one GPU.

    python benchmarks/bench_hytopk.py --sizes 8192,32768,131072 [--million] [--out DIR]
    python benchmarks/bench_hytopk.py --sizes 32768,131072 --rows hytopk,score+topk --inputs iid

DSA shape: H=64 indexer heads, D=128, k=2048, bf16 q/k upcast to fp32 in the graph, per-query
head weights (fp32), ReLU, weighted head sum, causal, batch 1. Rows of the table:

* floor          causal score FLOPs H*D*2*S*(S+1)/2 at the bf16 matmul rate measured here
                 (torch.matmul 8192^3 on random bf16 data, median of do_bench).
* eager          the HF-style graph (``hf_indexer``: matmul(q.float(), k.float()^T) * scale,
                 relu, weighted head sum, additive causal mask, topk) chunked over queries.
* compile        default ``torch.compile`` of the same chunk function (same loop).
  At S >= --extrapolate-from (default 131072) these two are timed on --sample-chunks chunks
  and scaled to all chunks (their cost per chunk does not depend on its position): the
  table marks them "est".
* score+topk     a fused Triton score kernel (keys as the rows of the dot, causal tiles
                 skipped) writing fp32 scores per query chunk, then torch.topk per chunk.
* hytopk         torch.ops.hyscale.hytopk with the DSA spec (the generated kernel).
* hytopk:unsorted  the same with sorted=False, what the rewrite passes for topk(sorted=False)
                 (DeepSeek's own V3.2/V4 inference code): the same set, no final sort.
* score+topk:unsorted  score+topk with torch.topk(sorted=False), its counterpart.
* hyscale-compile  torch.compile(hf_indexer, backend="hyscale") on the whole sequence: the
                 rewrite is what runs (the counter of generated-kernel launches is printed).
* hyscale-compile:mask  the same indexer with HF's consumer, ``ones(bool).scatter(-1,
                 idx.long(), False)``, returning that mask: nothing reads the top-k's order, so
                 the rewrite drops the sort (passes/order.py). iid, S <= 32K (the mask is S^2
                 bytes). hyscale-compile:mask:sorted  the same with options
                 {"hyscale.elide_sort": False}: the difference is the sort.
* hyscale-compile:mask-input  the same with the causal mask a model input (HF's runtime
                 ``attention_mask`` [1, 1, S, S], additive finfo.min): the op reads the tensor,
                 and each row's visible key range is read off it before the launch
                 (lowerings/triton_mask_ranges.py). iid, S <= 32K.

Inputs (both reported): "iid" (q, k ~ N(0,1) bf16, w ~ N(0,1)/8) and "struct": keys with
locality and clusters (32 cluster centres; the key sequence is cut into segments of 64-512
positions, each drawn from one centre, plus a slowly drifting AR(1) component and noise),
queries that favour a few clusters (each query block of 256 draws 3 favourite centres; every
head mixes them with random weights plus noise), w ~ N(0,1)/8. See ``make_inputs``.

Columns: median time (triton.testing.do_bench), peak extra memory (max_memory_allocated
minus what was allocated before the call), ratio to the floor, and "exact": a threshold
check on sampled rows against float64 scores (docs/contract.md, "Exact top-k": tol = (D+H+2) u
sum_h|w_h| sum_d|q k|).
Progress goes to stderr; full logs and a JSON land in --out (default $OUT).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Run from a checkout without installing: the repository root makes `hyscale_compile` (and,
# through its __init__, hyscale_compile.lowerings / .passes) importable.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

H, D, TOPK = 64, 128, 2048
# every row name --rows / --skip understand (floor is always printed)
ROWS = ("hytopk", "hytopk:unsorted", "score+topk", "score+topk:unsorted", "eager", "compile",
        "hyscale-compile", "hyscale-compile:mask", "hyscale-compile:mask:sorted", "hyscale-compile:mask-input")
SCALE = D**-0.5


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------
def make_inputs(S: int, kind: str, seed: int, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    if kind == "iid":
        q = torch.randn(1, S, H, D, device=device, generator=g).to(torch.bfloat16)
        k = torch.randn(1, S, D, device=device, generator=g).to(torch.bfloat16)
    else:
        C = 32
        centres = torch.randn(C, D, device=device, generator=g) * 1.5
        # key segments of 64..512 positions, each from one cluster
        seg_len = torch.randint(64, 513, (S // 64 + 2,), device=device, generator=g)
        seg_of = torch.repeat_interleave(torch.arange(len(seg_len), device=device), seg_len)[:S]
        seg_cluster = torch.randint(0, C, (len(seg_len),), device=device, generator=g)
        cl = seg_cluster[seg_of]
        # slowly drifting component: AR(1) with coefficient 0.999, sampled every 256 keys
        n_anchor = S // 256 + 2
        steps = torch.randn(n_anchor, D, device=device, generator=g) * 0.045
        drift = torch.cumsum(steps, 0)
        drift = drift.repeat_interleave(256, 0)[:S]
        k = centres[cl] + drift + 0.5 * torch.randn(S, D, device=device, generator=g)
        k = k.unsqueeze(0).to(torch.bfloat16)
        nb = S // 256 + 1
        fav = torch.randint(0, C, (nb, 3), device=device, generator=g)  # 3 favourite clusters
        mix = torch.randn(nb, H, 3, device=device, generator=g).abs()
        qb = torch.einsum("bhc,bcd->bhd", mix, centres[fav])  # [nb, H, D]
        q = qb.repeat_interleave(256, 0)[:S] + 0.7 * torch.randn(S, H, D, device=device, generator=g)
        q = q.unsqueeze(0).to(torch.bfloat16)
    w = torch.randn(1, S, H, device=device, generator=g) / 8.0
    return q, k, w


# ------------------------------------------------------------------------------------------
# the HF-style graph (eager / torch.compile / backend="hyscale")
# ------------------------------------------------------------------------------------------
def hf_indexer(q, k, w, qpos, scale: float = SCALE, topk: int = TOPK):
    """q [B,c,H,D] bf16, k [B,T,D] bf16, w [B,c,H] fp32, qpos [c] int64 query positions."""
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale
    scores = F.relu(scores)  # [B, c, H, T]
    index_scores = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)  # [B, c, T]
    kpos = torch.arange(k.shape[1], device=k.device)
    mask = torch.where(kpos[None, :] <= qpos[:, None], 0.0, torch.finfo(torch.float32).min)
    index_scores = index_scores + mask
    return index_scores.topk(topk, dim=-1).indices


def hf_indexer_mask(q, k, w, qpos, topk: int = TOPK):
    """hf_indexer with HF's consumer: the bool mask of the keys each query drops."""
    idx = hf_indexer(q, k, w, qpos, topk=topk)
    return torch.ones(q.shape[0], q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).scatter(-1, idx, False)


def hf_indexer_mask_input(q, k, w, attention_mask, topk: int = TOPK):
    """HF's form with the mask a model input (``attention_mask`` [B, 1, S, T], additive,
    finfo.min where hidden), and HF's consumer: the bool mask of the keys each query drops."""
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * SCALE
    index_scores = torch.matmul(w.unsqueeze(-2), F.relu(scores)).squeeze(-2) + attention_mask[:, 0]
    idx = index_scores.topk(topk, dim=-1).indices
    return torch.ones(q.shape[0], q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).scatter(-1, idx, False)


class MaskPicks:
    """``idx[0, s]`` for check_rows, read off a mask from hf_indexer_mask: the keys row s keeps."""

    def __init__(self, mask):
        self.mask = mask

    def __getitem__(self, key):
        b, s = key
        return (~self.mask[b, s]).nonzero().squeeze(-1)


def chunk_rows(S: int) -> int:
    # ~2 GiB of fp32 per-head logits per chunk
    return max(16, min(S, (2 << 30) // (4 * H * S)))


def run_chunked(fn, q, k, w, chunks=None):
    S = q.shape[1]
    c = chunk_rows(S)
    starts = list(range(0, S, c)) if chunks is None else chunks
    out = None
    for s0 in starts:
        s1 = min(S, s0 + c)
        qpos = torch.arange(s0, s1, device=q.device)
        out = fn(q[:, s0:s1], k, w[:, s0:s1], qpos)
    return out


def run_chunked_full(fn, q, k, w):
    S = q.shape[1]
    c = chunk_rows(S)
    idx = torch.empty(1, S, TOPK, dtype=torch.int64, device=q.device)
    for s0 in range(0, S, c):
        s1 = min(S, s0 + c)
        idx[:, s0:s1] = fn(q[:, s0:s1], k, w[:, s0:s1], torch.arange(s0, s1, device=q.device))
    return idx


# ------------------------------------------------------------------------------------------
# baseline: fused Triton score kernel writing fp32 scores per query chunk, then torch.topk
# ------------------------------------------------------------------------------------------
@triton.jit
def _score_kernel(Q, K, W, OUT, s_base, T_cols, stride_qs, stride_ws, stride_os,
                  H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # one program = BLOCK_M consecutive queries of the chunk, all key tiles up to T_cols
    pid = tl.program_id(0)
    offs_c = tl.arange(0, BLOCK_M * H)
    col_m = offs_c // H
    col_h = offs_c % H
    offs_d = tl.arange(0, D)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    rows = pid * BLOCK_M + offs_m                      # chunk-local rows
    pos = s_base + rows                                # absolute query positions
    col_rows = (pid * BLOCK_M + col_m).to(tl.int64)
    qb = tl.load(Q + col_rows[:, None] * stride_qs + col_h[:, None] * D + offs_d[None, :])
    wv = tl.load(W + col_rows * stride_ws + col_h)
    last = s_base + pid * BLOCK_M + BLOCK_M            # keys >= last are masked for every row
    t_mid = tl.minimum(((last + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, T_cols)
    for t0 in range(0, t_mid, BLOCK_N):                # scored tiles (a plain, pipelined loop)
        keys = t0 + offs_n
        kt = tl.load(K + keys[:, None].to(tl.int64) * D + offs_d[None, :], mask=keys[:, None] < T_cols, other=0.0)
        x = tl.dot(kt, tl.trans(qb), out_dtype=tl.float32) * 0.08838834764831845
        x = tl.where(x < 0.0, 0.0, x) * wv[None, :]
        y = tl.sum(tl.reshape(x, [BLOCK_N, BLOCK_M, H]), axis=2)
        y = tl.where(keys[:, None] <= pos[None, :], y, float("-inf"))
        tl.store(OUT + rows[None, :].to(tl.int64) * stride_os + keys[:, None], y, mask=keys[:, None] < T_cols)
    for t0 in range(t_mid, T_cols, BLOCK_N):           # fully masked tiles: -inf, no scoring
        keys = t0 + offs_n
        y = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32) - float("inf")
        tl.store(OUT + rows[None, :].to(tl.int64) * stride_os + keys[:, None], y, mask=keys[:, None] < T_cols)


def score_then_topk(q, k, w, chunk=None, sorted=True):
    S = q.shape[1]
    c = chunk or min(S, 4096)
    q2 = q[0].reshape(S, H * D)
    k2 = k[0]
    w2 = w[0]
    idx = torch.empty(1, S, TOPK, dtype=torch.int64, device=q.device)
    buf = torch.empty(c, S, dtype=torch.float32, device=q.device)
    for s0 in range(0, S, c):
        s1 = min(S, s0 + c)
        cols = max(s1, TOPK)
        out = buf[: s1 - s0, :cols]
        _score_kernel[((s1 - s0) // 4,)](q2[s0:s1], k2, w2[s0:s1], out, s0, cols, q2.stride(0), w2.stride(0),
                                         out.stride(0), H=H, D=D, BLOCK_M=4, BLOCK_N=64, num_warps=4, num_stages=3)
        idx[0, s0:s1] = torch.topk(out, TOPK, dim=-1, sorted=sorted).indices
    return idx


# ------------------------------------------------------------------------------------------
# HyTopK
# ------------------------------------------------------------------------------------------
def dsa_spec():
    from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec

    return ScoreSpec(name="dsa", epilogue=(("mul", SCALE), ("relu",)), reduce="weighted_sum",
                     post=(("mask", 0),), masks=(MaskTerm(kind="range", hi=0),))


def hytopk_op(q, k, w, hi, spec_json, sorted=True):
    return torch.ops.hyscale.hytopk(q, k.unsqueeze(2), w, [hi], TOPK, spec_json, sorted)


# ------------------------------------------------------------------------------------------
# exactness: threshold check on sampled rows against float64 scores
# ------------------------------------------------------------------------------------------
def sample_rows(S):
    rows = {0, 1, TOPK - 2, TOPK - 1, TOPK, TOPK + 1, S // 2, S - 2, S - 1}
    rows |= set(range(97, S, max(1, S // 8)))
    return sorted(r for r in rows if 0 <= r < S)


def check_rows(idx, q, k, w, rows):
    """True when every sampled row's selection passes the threshold check of docs/contract.md."""
    dev = q.device
    r = torch.tensor(rows, device=dev)
    qs = q[0, r].double()                      # [n, H, D]
    kk = k[0].double()                         # [T, D]
    ws = w[0, r].double()                      # [n, H]
    T = kk.shape[0]
    bad = 0
    for i, s in enumerate(rows):
        x = (qs[i] @ kk.T) * SCALE              # [H, T]
        ax = (qs[i].abs() @ kk.abs().T) * SCALE
        y = ws[i] @ torch.relu(x)
        ay = ws[i].abs() @ ax
        t = torch.arange(T, device=dev)
        y = torch.where(t <= s, y, -math.inf)
        tol = (D + H + 2) * 2.0**-24 * ay.max()
        sel = idx[0, s].long()
        if sel.unique().numel() != TOPK:
            bad += 1
            continue
        chosen = torch.zeros(T, dtype=torch.bool, device=dev)
        chosen[sel] = True
        ysel = y[sel]
        valid = int(min(s + 1, T))
        if valid >= TOPK:
            ok = bool(torch.isfinite(ysel).all()) and float(ysel.min()) >= float(torch.where(chosen, -math.inf, y).max()) - float(tol)
        else:
            ok = bool(chosen[:valid].all())
        bad += 0 if ok else 1
    return bad == 0


# ------------------------------------------------------------------------------------------
# timing / memory
# ------------------------------------------------------------------------------------------
def measure(fn, reps_hint=5, once=False):
    """(median ms, peak extra bytes, last output, first-call ms). The first call compiles and
    gives the peak memory. How the time is taken is decided by a second, warm call, so that
    a configuration is measured the same way whether or not its kernel was in the compile
    cache (until 2026-11-30 the first call decided: every freshly compiled row took the
    3-call path below, a cached one do_bench): over 150 ms, the median of 3 calls timed by
    CUDA events; else do_bench's median over ~reps_hint x the warm call's time."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    out = fn()  # also the warm-up (compiles)
    torch.cuda.synchronize()
    first = (time.perf_counter() - t) * 1e3
    peak = torch.cuda.max_memory_allocated() - base
    if once:  # the kernel is already compiled: the first call is the timing
        return first, peak, out, first
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    warm = (time.perf_counter() - t) * 1e3
    if warm > 150:
        # slow rows: CUDA events, median of 3 calls (do_bench would add 5 estimate calls)
        times = []
        for _ in range(3):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times), peak, out, first
    ms = triton.testing.do_bench(fn, warmup=max(25, warm), rep=max(100, warm * reps_hint), return_mode="median")
    return ms, peak, out, first


def matmul_rate():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    return 2 * 8192**3 / (ms * 1e-3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8192,32768,131072")
    ap.add_argument("--inputs", default="iid,struct")
    ap.add_argument("--million", action="store_true", help="also HyTopK alone at S=1M (iid)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--skip", default="", help="comma list of rows to skip: eager,compile,score+topk,hyscale-compile")
    ap.add_argument("--rows", default="", help="comma list of the only rows to run (default: all): " + ",".join(ROWS))
    ap.add_argument("--dry-run", action="store_true", help="parse the arguments, print the plan and exit (no GPU)")
    ap.add_argument("--extrapolate-from", type=int, default=131072)
    ap.add_argument("--sample-chunks", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds; later rows are skipped (and say so)")
    args = ap.parse_args()
    t_start = time.time()
    only = set(x for x in args.rows.split(",") if x)
    unknown = only - set(ROWS)
    if unknown:
        ap.error(f"--rows: unknown row(s) {sorted(unknown)}; known: {','.join(ROWS)}")
    skip = set(x for x in args.skip.split(",") if x)
    if only:
        skip |= set(ROWS) - only
    sizes = [int(x) for x in args.sizes.split(",") if x]
    if args.dry_run:
        print(f"sizes={sizes} inputs={args.inputs.split(',')} rows={[r for r in ROWS if r not in skip]} "
              f"million={args.million} out={args.out}")
        return

    def late(what):
        if time.time() - t_start > args.deadline:
            log(f"[bench] deadline: skipping {what}")
            results.append(dict(S=0, inputs="-", impl="SKIPPED", ms=None, peak_gib=None, ratio=None, floor_ms=None,
                                exact=None, note=f"deadline: {what}"))
            return True
        return False

    os.makedirs(args.out, exist_ok=True)
    import hyscale_compile  # noqa: F401  (registers torch.ops.hyscale and the backend)
    from hyscale_compile.lowerings import triton_hytopk as th

    dev = torch.cuda.get_device_properties(0)
    meta = dict(device=dev.name, sms=dev.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.utcnow().isoformat(timespec="seconds") + "Z", H=H, D=D, k=TOPK, batch=1)
    rate = matmul_rate()
    meta["bf16_matmul_tflops"] = rate / 1e12
    log(f"[bench] {meta}")
    spec = dsa_spec()
    spec_json = spec.to_json()
    results = []
    compiled_chunk = torch.compile(hf_indexer)

    def row(S, inp, name, ms, peak, exact, note=""):
        flops = H * D * 2 * S * (S + 1) / 2
        floor = flops / rate * 1e3
        rec = dict(S=S, inputs=inp, impl=name, ms=ms, peak_gib=None if peak is None else peak / 2**30,
                   ratio=None if ms is None else ms / floor, floor_ms=floor, exact=exact, note=note)
        results.append(rec)
        log(f"[bench] S={S} {inp} {name}: {rec}")
        with open(os.path.join(args.out, "bench_hytopk.json"), "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)

    for S in sizes:
        flops = H * D * 2 * S * (S + 1) / 2
        for inp in args.inputs.split(","):
            if late(f"S={S} {inp}"):
                continue
            log(f"[bench] S={S} inputs={inp}: generating")
            q, k, w = make_inputs(S, inp, seed=1000 + S % 997 + (0 if inp == "iid" else 1))
            hi = (torch.arange(S, device="cuda") + 1).view(1, S)
            rows = sample_rows(S)
            row(S, inp, "floor", flops / rate * 1e3, None, None)
            # HyTopK through the op
            if "hytopk" not in skip:
                ms, peak, idx, first = measure(lambda: hytopk_op(q, k, w, hi, spec_json), args.reps)
                row(S, inp, "hytopk", ms, peak, check_rows(idx, q, k, w, rows), f"first call {first:.0f} ms")
                del idx
            if "hytopk:unsorted" not in skip:
                ms, peak, idx, first = measure(lambda: hytopk_op(q, k, w, hi, spec_json, False), args.reps)
                row(S, inp, "hytopk:unsorted", ms, peak, check_rows(idx, q, k, w, rows), f"first call {first:.0f} ms")
                del idx
            if "score+topk" not in skip:
                ms, peak, idx, _ = measure(lambda: score_then_topk(q, k, w), args.reps)
                row(S, inp, "score+topk", ms, peak, check_rows(idx, q, k, w, rows))
                del idx
            if "score+topk:unsorted" not in skip:
                ms, peak, idx, _ = measure(lambda: score_then_topk(q, k, w, sorted=False), args.reps)
                row(S, inp, "score+topk:unsorted", ms, peak, check_rows(idx, q, k, w, rows))
                del idx
            big = S >= args.extrapolate_from
            c = chunk_rows(S)
            n_chunks = -(-S // c)
            for name, fn in (("eager", hf_indexer), ("compile", compiled_chunk)):
                if name in skip or late(f"S={S} {inp} {name}"):
                    continue
                if big:
                    picks = [int(i * c) for i in torch.linspace(0, n_chunks - 1, args.sample_chunks).round().tolist()]
                    ms, peak, _, _ = measure(lambda: run_chunked(fn, q, k, w, picks), 2)
                    row(S, inp, name, ms * n_chunks / len(picks), peak, None,
                        f"est: {len(picks)} of {n_chunks} chunks of {c} rows timed, scaled")
                else:
                    ms, peak, idx, _ = measure(lambda: run_chunked_full(fn, q, k, w), 2)
                    row(S, inp, name, ms, peak, check_rows(idx, q, k, w, rows), f"{n_chunks} chunks of {c} rows")
                    del idx
            if "hyscale-compile" not in skip and inp == "iid" and S == sizes[0]:
                calls = {"n": 0}
                orig = th.hytopk_triton

                def counting(*a, **kw):
                    calls["n"] += 1
                    return orig(*a, **kw)

                th.hytopk_triton = counting
                try:
                    torch._dynamo.reset()
                    hf_c = torch.compile(hf_indexer, backend="hyscale")
                    qpos = torch.arange(S, device="cuda")
                    ms, peak, idx, first = measure(lambda: hf_c(q, k, w, qpos), args.reps)
                    ok = check_rows(idx, q, k, w, rows)
                finally:
                    th.hytopk_triton = orig
                row(S, inp, "hyscale-compile", ms, peak, ok,
                    f"whole sequence, {calls['n']} generated-kernel launches; compile+first {first:.0f} ms")
                del idx
            # HF's consumer through the backend (iid, S <= 32K: the outputs are S^2 bytes)
            pos = torch.arange(S, device="cuda")
            finfo_mask = lambda: torch.where(pos[None, :] <= pos[:, None], 0.0,  # noqa: E731
                                             torch.finfo(torch.float32).min)[None, None]
            for name, fn, extra, opts in (
                    ("hyscale-compile:mask", hf_indexer_mask, lambda: pos, {"hyscale.elide_sort": True}),
                    ("hyscale-compile:mask:sorted", hf_indexer_mask, lambda: pos, {"hyscale.elide_sort": False}),
                    ("hyscale-compile:mask-input", hf_indexer_mask_input, finfo_mask, {})):
                if name in skip or inp != "iid" or S > 32768:
                    continue
                from hyscale_compile.passes import diagnostics

                torch._dynamo.reset()
                diagnostics.clear()
                arg = extra()
                compiled = torch.compile(fn, backend="hyscale", options=opts)
                ms, peak, mask, first = measure(lambda: compiled(q, k, w, arg), args.reps)
                sites = [r for r in diagnostics.records() if r.rewritten]
                how = ", ".join("sort dropped" if r.sort_elided else "sorted" if r.sorted else "unsorted" for r in sites)
                what = ("returns the [S, S] bool mask" if fn is hf_indexer_mask else
                        f"attention_mask a [1, 1, S, S] fp32 input ({arg.numel() * 4 / 2**30:.1f} GiB, not counted "
                        f"in the peak); {sites[0].spec if sites else ''}")
                row(S, inp, name, ms, peak, check_rows(MaskPicks(mask), q, k, w, rows),
                    f"whole sequence, {what}; {len(sites)} site(s): {how or 'none rewritten'}; "
                    f"compile+first {first:.0f} ms")
                del mask, arg
            del q, k, w
            torch.cuda.empty_cache()
    if args.million and not late("S=1M"):
        S = 1 << 20
        log(f"[bench] S={S}: generating")
        q, k, w = make_inputs(S, "iid", seed=77)
        hi = (torch.arange(S, device="cuda") + 1).view(1, S)
        # one untimed call first: at 1M the launch takes a configuration the smaller sizes did
        # not compile (the fused sort), whose compile (~10 s) must not be timed
        log(f"[bench] S={S}: warm call (compiles)")
        hytopk_op(q, k, w, hi, spec_json)
        ms, peak, idx, _ = measure(lambda: hytopk_op(q, k, w, hi, spec_json), once=True)
        row(S, "iid", "floor", H * D * 2 * S * (S + 1) / 2 / rate * 1e3, None, None)
        row(S, "iid", "hytopk", ms, peak, check_rows(idx, q, k, w, [0, 2047, 2048, 99999, S // 2, S - 1]),
            "one timed call")
        del q, k, w, idx

    # the short table, last
    lines = [f"device {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  "
             f"bf16 matmul {meta['bf16_matmul_tflops']:.0f} TFLOP/s  {meta['date']}",
             f"{'S':>8} {'inputs':>6} {'impl':>19} {'ms':>10} {'peak GiB':>9} {'x floor':>8} {'exact':>6}  note"]
    for r in results:
        ms = "-" if r["ms"] is None else f"{r['ms']:.2f}"
        pk = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        ra = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        ex = "-" if r["exact"] is None else ("yes" if r["exact"] else "NO")
        lines.append(f"{r['S']:>8} {r['inputs']:>6} {r['impl']:>19} {ms:>10} {pk:>9} {ra:>8} {ex:>6}  {r['note']}")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "bench_hytopk.txt"), "w") as f:
        f.write(table + "\n")
    print(table, flush=True)


if __name__ == "__main__":
    main()
