"""The sparse attention's forward (``hyscale::sparse_attention`` on CUDA: the Triton kernel of
``lowerings/triton_attention.py``) against the dense peers that apply the index mask.

    python benchmarks/bench_sparse_attention.py              # S = 8K / 32K / 128K, both selections
    python benchmarks/bench_sparse_attention.py --quick      # S = 8K, random selection, fewer reps
    python benchmarks/bench_sparse_attention.py --shapes mla128 --seqs 32768 --peers none
    python benchmarks/bench_sparse_attention.py --inspect    # no GPU: compile for sm_90, ptxas report
    python benchmarks/bench_sparse_attention.py --shapes mla128 --seqs 32768 --peers none \
        --config "default;block_n=32,num_stages=4,prefetch_idx=1"   # launch configurations side by side

Shapes (batch 1, causal prefill S = T, k = 2048 selected keys per row, bf16):
  mla128  absorbed MLA, MQA over a latent: H = 128, d_qk 576, d_v 512, v = k[..., :512]
  mla16   the same with H = 16
  hf      HF DeepseekV32Attention's per-head form: H = Hk = 16, d_qk 192, d_v 128
Selections: "random" (k distinct causal picks per row), "structured" (64 sinks, the last
512 positions, the rest scattered) and "shared" (each 64 consecutive rows pick from the same
random scores: high reuse of keys across rows, to size what reuse can give), built in row chunks from random scores by topk (no [S, T]
tensor on our side); rows with fewer than k visible keys pick hidden ones, which the causal
range hides. FLOPs are counted as public kernels count them: 2 H k (d_qk + d_v) per query.

Peers, each on the same q, k, v: sdpa with the dense bool index mask [1, 1, S, T] (the
backend that ran is printed: the first of flash / efficient / cudnn / math that accepts
it), FlexAttention with the index mask as mask_mod (dynamo reset per shape), and sdpa
is_causal without the index mask. "unsupported" / "OOM" where a peer cannot run a shape.
The bf16 matmul rate (8192^3, do_bench) is measured in the same run; a table is printed
last, progress lines as it goes.

``--config``: ``AttentionConfig`` fields over each shape's ``default_config``, one
configuration as ``field=value,...`` and several separated by ``;`` ("default": none
changed); each runs the kernel directly on the same inputs (a configuration that fails to
compile or launch, e.g. for lack of shared memory, is reported and skipped). With
``--inspect`` the same configurations are compiled for sm_90 at every inspected shape.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hyscale_compile.lowerings.config_text import config_name, parse_config_list  # noqa: E402

SHAPES = {  # name: (H, Hk, d_qk, d_v, v is a view of k)
    "mla128": (128, 1, 576, 512, True),
    "mla16": (16, 1, 576, 512, True),
    "hf": (16, 16, 192, 128, False),
}
TOPK = 2048
SINKS, WINDOW = 64, 512
SHARED = 64  # rows per group of the "shared" selection
SELECTIONS = ("random", "structured", "shared")


def parse_configs(text: str) -> list:
    """'default;block_n=32,prefetch_idx=1' -> [{}, {'block_n': 32, 'prefetch_idx': True}]."""
    from hyscale_compile.lowerings.triton_attention import AttentionConfig

    return parse_config_list(text, AttentionConfig)


def flops(S: int, H: int, dqk: int, dv: int, k: int = TOPK) -> float:
    return 2.0 * H * k * (dqk + dv) * S


def spec_json(dqk: int) -> str:
    from hyscale_compile.lowerings.attention_spec import AttentionSpec
    from hyscale_compile.lowerings.spec import MaskTerm

    return AttentionSpec(name="bench", post=(("mul", dqk ** -0.5), ("mask", 0)),
                         masks=(MaskTerm(kind="range", hi=0),), out_dtype="bfloat16").to_json()


def make_selection(S: int, kind: str, device, k: int = TOPK, chunk: int = 1024, seed: int = 0) -> torch.Tensor:
    """idx [1, S, k] int32: per row, the top-k of random scores over the causal keys (hidden
    keys at -inf fill rows with fewer than k visible ones); "structured" lifts the sinks and
    the recent window above every random score; "shared" gives each group of SHARED
    consecutive rows the same scores, so neighbouring rows select the same keys (apart from
    the causal bound): the upper end of key reuse across rows."""
    g = torch.Generator(device=device).manual_seed(seed)
    idx = torch.empty(1, S, k, dtype=torch.int32, device=device)
    t = torch.arange(S, device=device)
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        rows = t[s0:s1, None]
        if kind == "shared":  # one random score row per SHARED consecutive rows: neighbours pick alike
            n = -(-(s1 - s0) // SHARED)
            sc = torch.rand(n, S, generator=g, device=device).repeat_interleave(SHARED, 0)[:s1 - s0]
        else:
            sc = torch.rand(s1 - s0, S, generator=g, device=device)
        if kind == "structured":
            sc = torch.where((t[None, :] < SINKS) | (t[None, :] > rows - WINDOW), sc + 2.0, sc)
        sc = sc.masked_fill(t[None, :] > rows, float("-inf"))
        idx[0, s0:s1] = sc.topk(min(k, S), dim=-1).indices.to(torch.int32)
    return idx


def dense_index_mask(idx: torch.Tensor, S: int) -> torch.Tensor:
    """[1, 1, S, T] bool, True where the key is selected and causal (what the models build)."""
    m = torch.zeros(1, S, S, dtype=torch.bool, device=idx.device)
    m.scatter_(-1, idx.long(), True)
    return m.tril_().unsqueeze(1)


def bench(fn, quick: bool) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100, return_mode="median")


def matmul_rate(quick: bool) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / (bench(lambda: a @ b, quick) * 1e-3)


def _peer(fn, quick):
    """(ms, note) for a peer: 'OOM' or 'unsupported' (the error's first words) when it fails."""
    try:
        ms = bench(fn, quick)
        return ms, ""
    except torch.OutOfMemoryError:
        return None, "OOM"
    except Exception as e:  # a backend that rejects the shape
        return None, "unsupported (" + (str(e).splitlines() or [type(e).__name__])[0][:60] + ")"
    finally:
        torch.cuda.empty_cache()


def sdpa_peer(q, k, v, mask, causal, quick):
    """(ms, backend or failure): the first sdpa backend that runs the call."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = k.shape[1] != q.shape[1]
    last = "unsupported"
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
        try:
            run()
            torch.cuda.synchronize()
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            last = "OOM"
            continue
        except RuntimeError:
            continue
        ms, note = _peer(run, quick)
        return ms, note or backend.name.lower()
    return None, last


def flex_peer(q, k, v, mask, quick):
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()  # one compile per shape, none carried over
    S = q.shape[2]
    m = mask[0, 0]

    def mask_mod(b, h, qi, ki):
        return m[qi, ki]

    try:
        bm = create_block_mask(mask_mod, 1, None, S, S, device="cuda")
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, "OOM"
    except Exception as e:
        return None, "unsupported (" + (str(e).splitlines() or [type(e).__name__])[0][:60] + ")"
    fa = torch.compile(flex_attention)
    gqa = k.shape[1] != q.shape[1]
    return _peer(lambda: fa(q, k, v, block_mask=bm, enable_gqa=gqa), quick)


def _operands(name: str, S: int):
    """(q, k, v, hi) of a shape at S on the GPU: bf16, seed 1, v a view of k where the shape
    says so, hi the causal range's bound."""
    H, Hk, dqk, dv, v_of_k = SHAPES[name]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(1, S, H, dqk, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, S, Hk, dqk, device=dev, dtype=torch.bfloat16, generator=g)
    v = k[..., :dv] if v_of_k else torch.randn(1, S, Hk, dv, device=dev, dtype=torch.bfloat16, generator=g)
    return q, k, v, torch.arange(1, S + 1, device=dev).view(1, S)


def _row(name, S, sel, config="", ms=math.nan, tflops=math.nan) -> dict:
    """A table row; the peers' and the probs path's cells are filled in later where run."""
    return {"shape": name, "S": S, "sel": sel, "config": config, "ms": ms, "tflops": tflops,
            "sdpa_mask": "-", "flex": "-", "sdpa_causal": "-", "probs_ms": math.nan}


def run_shape(name, S, selections, peers, quick, rate, rows, configs=None, probs=False):
    H, Hk, dqk, dv, v_of_k = SHAPES[name]
    dev = torch.device("cuda")
    try:
        q, k, v, hi = _operands(name, S)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        print(f"[{name} S={S}] skipped: the operands do not fit", flush=True)
        return
    spec = spec_json(dqk)
    fl = flops(S, H, dqk, dv)
    causal = None
    for sel in selections:
        idx = make_selection(S, sel, dev)
        first = None  # the first configuration's output: each later one is compared with it
        for fields in configs or [None]:
            label = "" if fields is None else " " + config_name(fields)
            if fields is not None:
                from hyscale_compile.lowerings.attention_spec import AttentionSpec
                from hyscale_compile.lowerings.triton_attention import default_config, sparse_attention_triton

                cfg = dataclasses.replace(default_config(H, Hk, dqk, dv, v_from_k=v_of_k), **fields)
                parsed = AttentionSpec.from_json(spec)
                def fn(cfg=cfg, parsed=parsed, with_probs=False):
                    return sparse_attention_triton(q, k, v, idx, [hi], parsed, return_probs=with_probs, config=cfg)
            else:
                def fn(with_probs=False):
                    return torch.ops.hyscale.sparse_attention(q, k, v, idx, [hi], spec, with_probs)
            try:
                out = fn()[0]
                ms = bench(fn, quick)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # a configuration that does not compile or launch (shared memory)
                print(f"[{name} S={S} {sel}{label}] failed: {(str(e).splitlines() or [type(e).__name__])[0][:120]}",
                      flush=True)
                rows.append(_row(name, S, sel, label.strip()))
                continue
            tf = fl / (ms * 1e-3) / 1e12
            if first is None:
                first, diff = out, ""
            else:  # the same math in another order: a few bf16 ulps, never more
                rel = ((out.float() - first.float()).abs().max() / first.float().abs().max()).item()
                diff = f"; max |out - first config's| / max |first's| = {rel:.1e}"
            del out
            print(f"[{name} S={S} {sel}{label}] hyscale {ms:.3f} ms, {tf:.1f} TFLOP/s "
                  f"({100 * tf * 1e12 / rate:.0f}% of matmul){diff}", flush=True)
            rows.append(_row(name, S, sel, label.strip(), ms, tf))
            if probs:  # the return_probs path: the forward writing its statistics, then attn_probs
                rows[-1]["probs_ms"] = bench(lambda: fn(with_probs=True), quick)
                print(f"[{name} S={S} {sel}{label}] with probs {rows[-1]['probs_ms']:.3f} ms", flush=True)
        row = rows[-1]
        if peers:
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, S, D] views
            try:
                mask = dense_index_mask(idx, S)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                mask = None
            for key, fn in (("sdpa_mask", lambda: sdpa_peer(qt, kt, vt, mask, False, quick)),
                            ("flex", lambda: flex_peer(qt, kt, vt, mask, quick))):
                if key not in peers:
                    continue
                pm, note = fn() if mask is not None else (None, "OOM (the mask)")
                row[key] = (f"{pm:.3f} ms" if pm is not None else "") + (f" [{note}]" if note else "")
                print(f"[{name} S={S} {sel}] {key}: {row[key]}", flush=True)
            del mask
            torch.cuda.empty_cache()
            if "sdpa_causal" in peers:
                if causal is None:
                    pm, note = sdpa_peer(qt, kt, vt, None, True, quick)
                    causal = (f"{pm:.3f} ms" if pm is not None else "") + (f" [{note}]" if note else "")
                    print(f"[{name} S={S}] sdpa causal (no index mask): {causal}", flush=True)
                row["sdpa_causal"] = causal
        del idx, first
        torch.cuda.empty_cache()


def interleaved(name: str, S: int, reps: int) -> None:
    """The default forward at ``name``, S (random picks) and the bf16 matmul rate measured in
    turn ``reps`` times in this process: under load the card settles at a lower matmul rate
    (power) than the first, cold measurement, while the forward's time holds; prints each
    pair and the medians."""
    import statistics

    H, _, dqk, dv, _ = SHAPES[name]
    q, k, v, hi = _operands(name, S)
    idx = make_selection(S, "random", q.device)
    spec = spec_json(dqk)
    fn = lambda: torch.ops.hyscale.sparse_attention(q, k, v, idx, [hi], spec)  # noqa: E731
    fn()
    fl = flops(S, H, dqk, dv)
    rates, times = [], []
    for i in range(reps):
        rates.append(matmul_rate(False))
        times.append(bench(fn, False))
        tf = fl / (times[-1] * 1e-3)
        print(f"[{name} S={S} interleaved #{i}] matmul {rates[-1] / 1e12:.0f} TFLOP/s, hyscale {times[-1]:.3f} ms, "
              f"{tf / 1e12:.1f} TFLOP/s ({100 * tf / rates[-1]:.1f}% of this matmul)", flush=True)
    mr, mt = statistics.median(rates), statistics.median(times)
    print(f"[{name} S={S} interleaved] medians: matmul {mr / 1e12:.0f} TFLOP/s ({min(rates) / 1e12:.0f}-"
          f"{max(rates) / 1e12:.0f}), hyscale {mt:.3f} ms ({min(times):.3f}-{max(times):.3f}), "
          f"{100 * fl / (mt * 1e-3) / mr:.1f}% of the median matmul rate", flush=True)


def _first_dot_warps(ttgir: str) -> str:
    """warpsPerCTA of the first wgmma's result layout in the TTGIR (the score dot's), as
    'MxN' ('-' without wgmma): 8x1 at 64 heads and 8 warps means both warpgroups compute
    the whole score tile, 4x2 that each computes half of its slots."""
    import re

    dot = re.search(r"ttng\.warp_group_dot [^\n]*-> tensor<[^,]*, (#[\w]+)>", ttgir)
    if dot is None:
        return "-"
    lay = re.search(re.escape(dot.group(1)) + r" = [^\n]*warpsPerCTA = \[(\d+), (\d+)\]", ttgir)
    return f"{lay.group(1)}x{lay.group(2)}" if lay else "?"


def inspect_sm90(configs=None, shapes=None) -> int:
    """Compile for sm_90 on any machine and print ptxas' report, one line per kernel:
    'inspect shape=... kernel=... config=... block_n=... regs=... spill=... smem=... wgmma=0|1
    inflight=N qk_warps=MxN'. Without ``configs``: each shape's default forward as the benchmark launches
    it (kernel=fwd), and for the bf16 shapes also the return_probs path (kernel=fwd_stats:
    the forward writing its softmax statistics, at probs_block_n; kernel=probs). With
    ``configs`` (``parse_configs``): the same kernels for each configuration at every shape
    (the return_probs path at the configuration's own tile; ``shapes``: only these of the
    inspected shapes, e.g. ["mla128", "mla16"]).
    ``qk_warps``: the score dot's warp layout (``_first_dot_warps``).
    ``wgmma``: whether the PTX has a wgmma.mma_async instruction (the word alone also
    matches a source path in its .file lines). ``inflight`` is the largest ``num`` of an async_wait in the TTGIR: 0 where every gathered
    tile is waited for before the next one is issued, more where tiles stay in flight."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("--inspect compiles for the GPU: unset TRITON_INTERPRET")
    import re

    import triton
    from triton.runtime import driver

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from inspect_hytopk import _Sm90, ptxas_report
    from hyscale_compile.lowerings.attention_spec import AttentionSpec
    from hyscale_compile.lowerings.triton_attention import default_config, sparse_attention_triton

    driver.set_active(_Sm90())
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cases = [(n, *SHAPES[n], torch.bfloat16, True) for n in SHAPES]
    cases += [("gqa_fp32_tf32", 8, 2, 96, 64, False, torch.float32, False),
              ("gqa_fp16", 8, 2, 96, 64, False, torch.float16, False),
              ("mla128_fp32", 128, 1, 576, 512, True, torch.float32, False),
              # the latent's widths with v its own tensor (not a view of k): its tiles take more
              # shared memory than the view's
              ("mqa128_own_v", 128, 1, 576, 512, False, torch.bfloat16, True)]
    if shapes is not None:
        cases = [c for c in cases if c[0] in shapes]
    failed = 0
    for name, H, Hk, dqk, dv, v_of_k, dtype, probs in cases:
        S, T = 64, 4096
        q = torch.empty(1, S, H, dqk, dtype=dtype)
        k = torch.empty(1, T, Hk, dqk, dtype=dtype)
        v = k[..., :dv] if v_of_k else torch.empty(1, T, Hk, dv, dtype=dtype)
        idx = torch.zeros(1, S, TOPK, dtype=torch.int32)  # (compiled, not run: any valid keys)
        hi = torch.arange(1, S + 1).view(1, S)
        spec = AttentionSpec.from_json(spec_json(dqk))
        if dtype == torch.float32:
            spec = dataclasses.replace(spec, out_dtype="float32", fp32_precision="tf32")
        base = default_config(H, Hk, dqk, dv, elem_bytes=k.element_size(), v_from_k=v_of_k)
        # (label, config or None for the launcher's own choice, return_probs)
        if configs is None:
            runs = [("default", None, False)] + ([("default", None, True)] if probs else [])
        else:
            runs = [(config_name(f), dataclasses.replace(base, **f), with_probs) for f in configs
                    for with_probs in ((False, True) if probs else (False,))]
        for label, cfg, with_probs in runs:
            launches = []

            def launcher(kern, args, launch):
                launches.append(launch)
                return kern.warmup(*args, grid=(1,), **launch)

            try:
                res = sparse_attention_triton(q, k, v, idx, [hi], spec, return_probs=with_probs, config=cfg,
                                              _launcher=launcher)
            except Exception as e:  # e.g. more shared memory than the target has
                failed += 1
                print(f"inspect shape={name} kernel=fwd config={label} failed: "
                      f"{(str(e).splitlines() or [type(e).__name__])[0][:160]}", flush=True)
                continue
            kinds = ("fwd_stats", "probs") if with_probs else ("fwd",)
            for kname, ck, launch in zip(kinds, res if with_probs else (res,), launches):
                rep = ptxas_report(ck.asm["ptx"], bindir)
                spill = rep.get("spill_st", 0) + rep.get("spill_ld", 0)
                waits = [int(n) for n in re.findall(r"ttg\.async_wait[^{]*\{num = (\d+)", ck.asm["ttgir"])]
                qk_warps = _first_dot_warps(ck.asm["ttgir"])
                print(f"inspect shape={name} kernel={kname} config={label} dtype={str(dtype).split('.')[-1]} "
                      f"block_h={launch['BLOCK_H']} block_n={launch['BLOCK_N']} warps={launch['num_warps']} "
                      f"stages={launch['num_stages']} regs={rep.get('regs', 0)} spill={spill} "
                      f"smem={ck.metadata.shared} wgmma={int('wgmma.mma_async' in ck.asm['ptx'])} "
                      f"inflight={max(waits, default=0)} qk_warps={qk_warps}", flush=True)
    return 1 if failed and configs is None else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="S = 8K, the random selection, fewer repetitions")
    ap.add_argument("--shapes", default=None, help=f"comma list of {sorted(SHAPES)} (default: all; with "
                    "--inspect also gqa_fp32_tf32, gqa_fp16, mla128_fp32, mqa128_own_v)")
    ap.add_argument("--seqs", default=None, help="comma list of S (default 8192,32768,131072; --quick: 8192)")
    ap.add_argument("--selections", default=None, help="comma list of random,structured,shared")
    ap.add_argument("--peers", default="sdpa_mask,flex,sdpa_causal", help="comma list, or 'none'")
    ap.add_argument("--probs", action="store_true", help="also time each row's return_probs path")
    ap.add_argument("--interleave", type=int, default=0, metavar="N",
                    help="instead of the table: each shape's default forward (random picks) and the matmul "
                         "rate measured in turn N times, with medians")
    ap.add_argument("--inspect", action="store_true", help="no GPU: compile the kernels for sm_90 and report")
    ap.add_argument("--config", default=None,
                    help="AttentionConfig fields over each shape's default, e.g. block_n=32,num_stages=4,"
                         "prefetch_idx=1; several separated by ';' ('default': none changed); calls the "
                         "kernel directly instead of the op")
    a = ap.parse_args(argv)
    try:
        configs = parse_configs(a.config) if a.config is not None else None
    except ValueError as e:
        ap.error(f"--config: {e}")
    if a.inspect:
        return inspect_sm90(configs, None if a.shapes is None else [s for s in a.shapes.split(",") if s])
    shapes = [s for s in (a.shapes or ",".join(SHAPES)).split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"unknown shapes {bad}; known: {sorted(SHAPES)}")
    seqs = [int(x) for x in (a.seqs or ("8192" if a.quick else "8192,32768,131072")).split(",") if x]
    sels = [x for x in (a.selections or ("random" if a.quick else "random,structured")).split(",") if x]
    if any(s not in SELECTIONS for s in sels):
        ap.error(f"--selections: a comma list of {', '.join(SELECTIONS)}")
    peers = set() if a.peers == "none" else {p for p in a.peers.split(",") if p}
    if peers - {"sdpa_mask", "flex", "sdpa_causal"}:
        ap.error(f"unknown peers {sorted(peers - {'sdpa_mask', 'flex', 'sdpa_causal'})}")
    if not torch.cuda.is_available():
        sys.exit("bench_sparse_attention.py needs a CUDA GPU (--inspect runs without one)")
    import hyscale_compile.lowerings.attention_ops  # noqa: F401  (registers torch.ops.hyscale)

    if a.interleave:
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; k = {TOPK}, batch 1, causal", flush=True)
        for name in shapes:
            for S in seqs:
                interleaved(name, S, a.interleave)
        return 0
    rate = matmul_rate(a.quick)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 matmul {rate / 1e12:.0f} TFLOP/s; "
          f"k = {TOPK}, batch 1, causal", flush=True)
    rows = []
    for name in shapes:
        for S in seqs:
            try:
                run_shape(name, S, sels, peers, a.quick, rate, rows, configs, a.probs)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                print(f"[{name} S={S}] OOM", flush=True)
                rows.append(_row(name, S, "-"))
    cfg_col = configs is not None
    print(f"\n| shape | S | selection |{' config |' if cfg_col else ''} hyscale ms |{' with probs ms |' if a.probs else ''}"
          f" TFLOP/s | % matmul ({rate / 1e12:.0f}) | sdpa + index mask | FlexAttention | sdpa causal, no mask |")
    print("|---|---|---|" + ("---|" if cfg_col else "") + ("---|" if a.probs else "") + "---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['S']} | {r['sel']} |{' ' + r['config'] + ' |' if cfg_col else ''} "
              f"{r['ms']:.3f} |{' %.3f |' % r['probs_ms'] if a.probs else ''} {r['tflops']:.1f} | "
              f"{100 * r['tflops'] * 1e12 / rate:.0f}% | {r['sdpa_mask']} | {r['flex']} | {r['sdpa_causal']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
