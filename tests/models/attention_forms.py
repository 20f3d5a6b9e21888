"""Consumers of a selection: the attention that applies the selected indices as an index
mask, in the spellings of the public DSA code bases (docs/contract.md, "The selection's
consumers"; issue 28). Each form is a small function of (x-like) inputs whose selection is
a DSA indexer (einsum, ReLU, head weights, causal mask, top-k) that the selection pass fuses,
and whose index mask then feeds a dense attention the attention pass rewrites.

``indexer(qi, ki, w, k)`` -> int64 indices [B, S, k]; each form returns the attention output
(and, where the source returns them, the weights).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def causal(S: int, T: int, device=None) -> torch.Tensor:
    """The official code's ``mask``: ``full((S, T), -inf).triu_(1)``."""
    return torch.full((S, T), NEG_INF, device=device).triu_(1)


def indexer(qi: torch.Tensor, ki: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """The official V3.2 indexer's scores (fp32 einsum, ReLU, per-head weights, causal mask)
    and its top-k: [B, S, k] int64, distinct per row (a top-k's provenance)."""
    s = torch.einsum("bshd,btd->bsht", qi, ki).relu()
    s = (s * w.unsqueeze(-1)).sum(dim=2)
    s = s + causal(s.size(1), s.size(2), s.device)
    return s.topk(min(k, s.size(-1)), dim=-1)[1]


def official_v32(qi, ki, w, q, kk, v, k: int = 4):
    """DeepSeek's official V3.2 MLA prefill (inference/model.py): scores over every key in
    fp32, ``index_mask = full(-inf).scatter_(-1, idx, 0)``, ``index_mask += mask``,
    ``scores += index_mask.unsqueeze(2)``, fp32 softmax, einsum with v."""
    return official_v32_attention(indexer(qi, ki, w, k), q, kk, v)


def official_v32_attention(idx, q, kk, v):
    """The consumer of ``official_v32`` alone (the tests' float64 reference runs it at the
    op's own indices)."""
    bsz, seqlen = q.shape[0], q.shape[1]
    mask = causal(seqlen, seqlen, q.device).to(q.dtype if q.dtype == torch.float64 else torch.float32)
    scale = q.shape[-1] ** -0.5
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.einsum("bshd,bthd->bsht", q.to(acc), kk.to(acc)) * scale
    index_mask = torch.full((bsz, seqlen, seqlen), NEG_INF, device=q.device, dtype=mask.dtype).scatter_(-1, idx, 0)
    index_mask += mask
    scores += index_mask.unsqueeze(2)
    scores = scores.softmax(dim=-1, dtype=acc)
    return torch.einsum("bsht,bthd->bshd", scores.type_as(q), v)


def make_inputs(seed: int = 0, B: int = 2, S: int = 16, H: int = 4, D: int = 16, Dv: int = 8, Hi: int = 4,
                Di: int = 16, dtype=torch.float32, requires_grad: bool = False):
    """(qi, ki, w, q, k, v): indexer queries/keys/weights and per-head attention q, k, v."""
    g = torch.Generator().manual_seed(seed)
    qi = torch.randn(B, S, Hi, Di, generator=g)
    ki = torch.randn(B, S, Di, generator=g)
    w = torch.randn(B, S, Hi, generator=g).abs() * Hi ** -0.5
    q = torch.randn(B, S, H, D, generator=g).to(dtype)
    kk = torch.randn(B, S, H, D, generator=g).to(dtype)
    v = torch.randn(B, S, H, Dv, generator=g).to(dtype)
    for t in (q, kk, v):
        t.requires_grad_(requires_grad)
    return qi, ki, w, q, kk, v
