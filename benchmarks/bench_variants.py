"""QSA and NSA selection shapes on one GPU: eager, default ``torch.compile`` and
``backend="hyscale"``, with the score-GEMM floor.

    python benchmarks/bench_variants.py --seqs 8192,32768 [--out DIR]

* QSA (Qwen QSA, vectorized form): 4 indexer heads x 128, keys mean-pooled per block of 4
  (fp32 mean), ``relu(q.kbar).sum(heads) / sqrt(128)``, block-causal, top-512 blocks of
  S/4. hyscale fuses it into the generated kernel (``head-sum-relu``).
* NSA (selection branch, fla ``naive_nsa_compression`` form at the paper's sizes): 64
  query heads in 4 GQA groups (16 per group), d=64, keys mean-pooled per 64-token block,
  ``softmax(q.k_cmp * scale)`` per head over the causal compressed keys, summed over each
  GQA group, current block forced to 1, top-16 blocks. The softmax keeps it out of the
  fused kernel: hyscale selects from the table the graph materializes (``topk_table``).

Each query chunk of 4096 rows is one call (the graph as written materializes
[chunk, heads, blocks] tables); times are the sum over chunks. Columns: median ms, peak
extra GiB, selection-op calls, and for QSA the fraction of sampled rows whose selection
matches a float64 reference (threshold check). Prints a table last.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_hytopk as bh  # noqa: E402  (measure, matmul_rate)

CHUNK = 4096


# ---- QSA -----------------------------------------------------------------------------
QH, QD, QR, QK = 4, 128, 4, 512


def qsa_select(q, kraw, s0: int):
    """q [1, c, 4, 128] bf16 (rows s0..s0+c), kraw [1, S, 128] bf16 -> block indices [1, c, 512]."""
    S = kraw.shape[1]
    kbar = kraw.view(1, S // QR, QR, QD).float().mean(2)  # [1, N, D]
    s = F.relu(torch.einsum("bshd,bnd->bsnh", q.float(), kbar)).sum(-1) / math.sqrt(QD)
    pos = torch.arange(s0, s0 + q.shape[1], device=q.device)
    blk = torch.arange(kbar.shape[1], device=q.device)
    s = s.masked_fill(blk[None, None, :] > (pos[None, :, None] // QR), float("-inf"))
    return s.topk(QK, dim=-1).indices


# ---- NSA -----------------------------------------------------------------------------
NH, NG, ND, NBS, NK = 64, 4, 64, 64, 16


def nsa_select(q, k, s0: int):
    """q [1, c, 64, 64] bf16, k [1, S, 4, 64] bf16 -> block indices [1, 4, c, 16]."""
    S = k.shape[1]
    C = S // NBS
    k_cmp = k.view(1, C, NBS, NG, ND).float().mean(2)  # [1, C, G, D]
    k_cmp = k_cmp.repeat_interleave(NH // NG, dim=2)  # [1, C, H, D]
    attn = torch.einsum("bqhd,bkhd->bhqk", q.float() * ND**-0.5, k_cmp)
    t = torch.arange(s0, s0 + q.shape[1], device=q.device)
    blk = torch.arange(C, device=q.device)
    causal = (blk[None, :] + 1) * NBS - 1 > t[:, None]  # block not yet complete
    attn = attn.masked_fill(causal, float("-inf")).softmax(-1).nan_to_num(0.0)
    local = blk[None, :] == (t[:, None] // NBS)
    sel = attn.masked_fill(local, 1.0).view(1, NG, NH // NG, q.shape[1], C).sum(2)
    return sel.topk(NK, -1)[1]


def run_chunks(fn, q, k):
    out = None
    for s0 in range(0, q.shape[1], CHUNK):
        out = fn(q[:, s0:s0 + CHUNK], k, s0)
    return out


def qsa_check(fn, q, kraw, rows):
    """Threshold check on sampled rows of the last chunk's output, in float64."""
    S = kraw.shape[1]
    s0 = ((S - 1) // CHUNK) * CHUNK
    idx = fn(q[:, s0:], kraw, s0)
    kbar = kraw.view(1, S // QR, QR, QD).double().mean(2)[0]
    ok = 0
    for r in rows:
        s = F.relu(q[0, s0 + r].double() @ kbar.T).sum(0) / math.sqrt(QD)  # [N]
        s[torch.arange(len(s), device=s.device) > (s0 + r) // QR] = -math.inf
        tol = (QD + QH + 2) * 2.0**-24 * (q[0, s0 + r].double().abs() @ kbar.abs().T).sum(0).max() / math.sqrt(QD)
        sel = idx[0, r].long()
        chosen = torch.zeros_like(s, dtype=torch.bool)
        chosen[sel] = True
        ok += int(float(s[sel].min()) >= float(torch.where(chosen, -math.inf, s).max()) - float(tol))
    return ok / len(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="8192,32768")
    ap.add_argument("--variants", default="eager,inductor,hyscale")
    ap.add_argument("--shapes", default="qsa,nsa")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    from hyscale_compile.lowerings import ops as hy_ops

    rate = bh.matmul_rate()
    rows = []
    for shape in args.shapes.split(","):
        for S in [int(s) for s in args.seqs.split(",")]:
            g = torch.Generator(device="cuda").manual_seed(0)
            if shape == "qsa":
                q = torch.randn(1, S, QH, QD, device="cuda", generator=g).bfloat16()
                k = torch.randn(1, S, QD, device="cuda", generator=g).bfloat16()
                fn, flops = qsa_select, QH * QD * 2 * S * (S // QR) / 2
            else:
                q = torch.randn(1, S, NH, ND, device="cuda", generator=g).bfloat16()
                k = torch.randn(1, S, NG, ND, device="cuda", generator=g).bfloat16()
                fn, flops = nsa_select, NH * ND * 2 * S * (S // NBS) / 2
            floor = flops / rate * 1e3
            for variant in args.variants.split(","):
                torch._dynamo.reset()
                f = fn if variant == "eager" else torch.compile(fn, backend=variant, dynamic=False)
                before = dict(hy_ops.CALLS)
                t0 = time.time()
                try:
                    ms, peak, _, first = bh.measure(lambda: run_chunks(f, q, k))
                    note = f"first call {time.time() - t0:.1f} s"
                except torch.OutOfMemoryError:
                    ms = peak = None
                    note = "out of memory"
                calls = sum(hy_ops.CALLS.values()) - sum(before.values())
                exact = qsa_check(f, q, k, [0, 1, 100, 2047, 4095]) if shape == "qsa" and ms is not None else None
                rows.append((shape, S, variant, floor, ms, peak, calls, exact, note))
                print(rows[-1], file=sys.stderr, flush=True)
                torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    print("| shape | S | variant | floor ms | ms (x floor) | peak extra GiB | hyscale op calls | exact rows | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape, S, variant, floor, ms, peak, calls, exact, note in rows:
        t = "-" if ms is None else f"{ms:.2f} ({ms / floor:.1f})"
        p = "-" if peak is None else f"{peak / 2**30:.2f}"
        e = "-" if exact is None else f"{exact:.0%}"
        print(f"| {shape} | {S:,} | {variant} | {floor:.2f} | {t} | {p} | {calls} | {e} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
