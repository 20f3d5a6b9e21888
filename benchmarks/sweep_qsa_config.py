"""Launch-parameter sweep of the generated HyTopK kernel at the QSA selection shape (one GPU).

    python benchmarks/sweep_qsa_config.py [--seq 32768] [--keys fp32|bf16] [--configs "default;block_n=32"]

The call ``bench_variants.py`` makes for the last (heaviest) query chunk of a QSA sequence:
q [1, 4096, 4, 128] bf16, keys = the mean of 4 bf16 tokens, k = 512, block-causal (query s
sees blocks <= s // 4), and the spec the hyscale backend builds from
``bench_variants.qsa_select`` (``head-sum-relu``, captured from the backend's rewrite).
``--keys fp32`` (default): the means in fp32, as ``bench_variants`` writes them (bf16
queries x fp32 keys: the split dots). ``--keys bf16``: cast back to bf16, as the HF QSA
indexer does before its key norm (docs/research: ``mean_fp32(...).to(dtype)``), which takes
the native 16-bit path. Exactness: the threshold check against float64 scores of the same
keys on sampled rows, and the indices compared as sets with ``torch.topk`` of the graph's
fp32 scores on every row. For each
configuration (``HyTopKConfig`` fields over the launch's own default): ms of the whole
selection, whether the sampled rows pass the
threshold check, and whether the indices equal the first configuration's. Prints a table last.
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
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_hytopk as bh  # noqa: E402
import bench_variants as bv  # noqa: E402
from sweep_hytopk_config import parse_fields  # noqa: E402

# what the backend passes for bench_variants.qsa_select (captured from its rewrite)
QSA_SPEC = ('{"v":1,"name":"head-sum-relu","logit_dtype":"float32","epilogue":[["relu"]],"reduce":"sum",'
            '"post":[["div",11.313708498984761],["mask",0]],"masks":[{"kind":"range","lo":null,"hi":0,'
            '"mode":"fill","value":-Infinity}],"score_dtype":"float32","fp32_precision":"ieee"}')


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--configs", default="default")
    ap.add_argument("--keys", default="fp32", choices=("fp32", "bf16"))
    a = ap.parse_args(argv)
    if a.seq < bv.CHUNK or a.seq % bv.CHUNK:
        ap.error(f"--seq must be a positive multiple of {bv.CHUNK}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    from hyscale_compile.lowerings import triton_hytopk as th
    from hyscale_compile.lowerings.ops import parse_spec

    S = a.seq
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, S, bv.QH, bv.QD, device="cuda", generator=g).bfloat16()
    kraw = torch.randn(1, S, bv.QD, device="cuda", generator=g).bfloat16()
    s0 = S - bv.CHUNK
    qc = q[:, s0:]
    kbar = kraw.view(1, S // bv.QR, bv.QR, bv.QD).float().mean(2).unsqueeze(2)  # [1, N, 1, D]
    if a.keys == "bf16":
        kbar = kbar.to(torch.bfloat16)
    hi = ((torch.arange(s0, S, device="cuda") // bv.QR) + 1).view(1, -1)
    spec = parse_spec(QSA_SPEC)
    want = graph_topk(qc, kbar, hi)  # the graph's scores in fp32, eagerly
    names = [c.strip() for c in a.configs.split(";") if c.strip()]
    # the launch's own default for these operands
    N = S // bv.QR
    if a.keys == "fp32":
        base = th.default_config(bv.CHUNK, N, bv.QK, q.device, False, bv.QD, bv.QH, split=True)
    else:
        base = th.default_config(bv.CHUNK, N, bv.QK, q.device, True, bv.QD, bv.QH,
                                 tma=th.default_takes_tma(kbar, N, True))
    table, first_idx = [], None
    for name in names:
        fields = {} if name == "default" else parse_fields(name)
        cfg = dataclasses.replace(base, **fields)
        ms, _, idx, first_ms = bh.measure(lambda: th.hytopk_triton(qc, kbar, None, [hi], bv.QK, spec, config=cfg))
        first = first_ms / 1e3
        exact = check_rows(idx, qc, kbar, hi, [0, 1, 100, 2047, 4095])
        # the graph's own top-k has no tie rule: compared as sets (rows whose k-th place is
        # tied, e.g. by masked keys, could differ; none do at the default --seq)
        same_as_graph = float((torch.sort(idx.long(), -1).values == torch.sort(want, -1).values).all(-1).float().mean())
        if first_idx is None:
            first_idx = idx.clone()
        same = bool(torch.equal(idx, first_idx))
        table.append((name, ms, exact, same_as_graph, same, f"first call {first:.1f} s"))
        bh.log(*table[-1])
    print(f"\nQSA last chunk: S={S}, rows {s0}..{S - 1}, {S // bv.QR} key blocks ({a.keys}), k={bv.QK} "
          f"({torch.cuda.get_device_name()}, torch {torch.__version__}); x8 chunks ~ the whole sequence")
    print("| config | hytopk ms | sampled rows exact | rows = graph's set | bits = first | note |")
    print("|---|---|---|---|---|---|")
    for name, ms, exact, sg, same, note in table:
        print(f"| {name} | {ms:.3f} | {exact:.0%} | {sg:.1%} | {'yes' if same else 'NO'} | {note} |")
    return 0


def graph_scores(qc, kbar, hi):
    """[1, rows, N] fp32 scores as the graph computes them: relu(q . kbar) summed over heads,
    / sqrt(D), blocks past each row's bound at -inf."""
    s = torch.relu(torch.einsum("bshd,bnd->bsnh", qc.float(), kbar[:, :, 0].float())).sum(-1) / math.sqrt(bv.QD)
    blk = torch.arange(kbar.shape[1], device=qc.device)
    return s.masked_fill(blk[None, None, :] >= hi[..., None], float("-inf"))


def graph_topk(qc, kbar, hi):
    return graph_scores(qc, kbar, hi).topk(bv.QK, dim=-1).indices


def check_rows(idx, qc, kbar, hi, rows) -> float:
    """Share of the sampled rows whose selection passes the contract's threshold check
    (docs/contract.md, "Exact top-k") against float64 scores of the same keys."""
    kb = kbar[0, :, 0].double()
    ok = 0
    for r in rows:
        q64 = qc[0, r].double()
        s = torch.relu(q64 @ kb.T).sum(0) / math.sqrt(bv.QD)
        s[torch.arange(len(s), device=s.device) >= int(hi[0, r])] = -math.inf
        tol = (bv.QD + bv.QH + 2) * 2.0**-24 * (q64.abs() @ kb.abs().T).sum(0).max() / math.sqrt(bv.QD)
        sel = idx[0, r].long()
        chosen = torch.zeros_like(s, dtype=torch.bool)
        chosen[sel] = True
        ok += int(float(s[sel].min()) >= float(torch.where(chosen, -math.inf, s).max()) - float(tol))
    return ok / len(rows)


if __name__ == "__main__":
    sys.exit(main())
