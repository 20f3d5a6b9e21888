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


def official_v32_scaled(qi, ki, w, q, kk, v, scale, k: int = 4):
    """``official_v32`` with its softmax scale a 0-d tensor (a learned temperature, or D ** -0.5
    of a dynamic head dim): the op's spec takes it as a ``mul_operand`` step, read at each call."""
    return official_v32_scaled_attention(indexer(qi, ki, w, k), q, kk, v, scale)


def official_v32_scaled_attention(idx, q, kk, v, scale):
    bsz, seqlen = q.shape[0], q.shape[1]
    mask = causal(seqlen, seqlen, q.device).to(q.dtype)
    scores = torch.einsum("bshd,bthd->bsht", q, kk) * scale
    index_mask = torch.full((bsz, seqlen, seqlen), NEG_INF, device=q.device, dtype=q.dtype).scatter_(-1, idx, 0)
    index_mask += mask
    scores += index_mask.unsqueeze(2)
    return torch.einsum("bsht,bthd->bshd", scores.softmax(dim=-1), v)


def _indexer_inputs(g, B, S, Hi, Di):
    """Indexer queries and keys whose ReLU'd scores are positive (almost surely distinct): no
    exact-zero ties at the k-th key, so the selection is unique and eager's top-k picks the
    op's keys (the tests compare with eager)."""
    qi = torch.randn(B, S, Hi, Di, generator=g) + 1.5
    ki = torch.rand(B, S, Di, generator=g) + 0.1
    return qi, ki


def make_inputs(seed: int = 0, B: int = 2, S: int = 16, H: int = 4, D: int = 16, Dv: int = 8, Hi: int = 4,
                Di: int = 16, dtype=torch.float32, requires_grad: bool = False):
    """(qi, ki, w, q, k, v): indexer queries/keys/weights and per-head attention q, k, v."""
    g = torch.Generator().manual_seed(seed)
    qi, ki = _indexer_inputs(g, B, S, Hi, Di)
    w = torch.randn(B, S, Hi, generator=g).abs() * Hi ** -0.5
    q = torch.randn(B, S, H, D, generator=g).to(dtype)
    kk = torch.randn(B, S, H, D, generator=g).to(dtype)
    v = torch.randn(B, S, H, Dv, generator=g).to(dtype)
    for t in (q, kk, v):
        t.requires_grad_(requires_grad)
    return qi, ki, w, q, kk, v


def hf_causal_mask(B: int, S: int, dtype=torch.float32) -> torch.Tensor:
    """HF's eager 4-d causal mask: 0 where visible, ``finfo(dtype).min`` above the diagonal."""
    m = torch.full((S, S), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return m[None, None].expand(B, 1, S, S)


def hf_bool_causal_mask(B: int, S: int) -> torch.Tensor:
    """HF's sdpa 4-d bool mask: True where visible."""
    return torch.ones(S, S, dtype=torch.bool).tril()[None, None].expand(B, 1, S, S)


def _hf_eager_attention(q, k, v, attention_mask, scaling, dropout=0.0, training=False):
    """transformers' ``eager_attention_forward`` (no GQA repeat: K/V have every head)."""
    attn_weights = torch.matmul(q, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : k.shape[-2]]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # (the tests' float64 reference)
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=acc).to(q.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=training)
    attn_output = torch.matmul(attn_weights, v)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


def glm5_eager(qi, ki, w, q, kk, v, mask, k: int = 4):
    """HF ``GlmMoeDsaAttention`` (eager): ``index_mask = full((B,S,T), -inf, dtype=q.dtype)
    .scatter_(-1, topk_indices, 0.0)``, ``.unsqueeze(1) + causal_mask`` (HF's finfo.min
    float mask), then ``eager_attention_forward``. q, k, v: [B, S, H, D] (transposed here as
    the model does)."""
    return glm5_eager_attention(indexer(qi, ki, w, k), q, kk, v, mask)


def glm5_eager_attention(idx, q, kk, v, mask):
    B, S = q.shape[0], q.shape[1]
    q, kk, v = q.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2)
    index_mask = torch.full((B, S, kk.shape[2]), NEG_INF, dtype=q.dtype, device=q.device)
    index_mask.scatter_(-1, idx, 0.0)
    combined = index_mask.unsqueeze(1) + mask.to(q.dtype)
    return _hf_eager_attention(q, kk, v, combined, q.shape[-1] ** -0.5)[0]


def glm5_index_cache(qi, ki, w, q, kk, v, mask, k: int = 4):
    """GLM-5's IndexCache: one selection's indices feed two layers' attention."""
    idx = indexer(qi, ki, w, k)
    h = glm5_eager_attention(idx, q, kk, v, mask)
    return glm5_eager_attention(idx, q * 0.5, kk, h.reshape(v.shape[:3] + (-1,))[..., : v.shape[-1]] + v, mask)


def hf_v32_eager(qi, ki, w, q, kk, v, mask, k: int = 4, dropout: float = 0.0, training: bool = False,
                 output_attentions: bool = False):
    """HF ``DeepseekV32Attention`` (eager): ``index_mask = idx.new_ones((B,S,T), bool)
    .scatter(-1, idx.long(), False).unsqueeze(1)``, ``attention_mask.masked_fill(index_mask,
    finfo.min)``, then ``eager_attention_forward``."""
    idx = indexer(qi, ki, w, k)
    B, S = q.shape[0], q.shape[1]
    q, kk, v = q.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2)
    index_mask = idx.new_ones((B, S, kk.shape[2]), dtype=torch.bool).scatter(-1, idx.long(), False).unsqueeze(1)
    attention_mask = mask.masked_fill(index_mask, torch.finfo(q.dtype).min)
    out, weights = _hf_eager_attention(q, kk, v, attention_mask, q.shape[-1] ** -0.5, dropout, training)
    return (out, weights) if output_attentions else out


def hf_v32_eager_inf(qi, ki, w, q, kk, v, mask, k: int = 4, dropout: float = 0.0, training: bool = False,
                     output_attentions: bool = False):
    """``hf_v32_eager`` with the index mask filled with -inf (the spelling the rewrite proves)."""
    idx = indexer(qi, ki, w, k)
    B, S = q.shape[0], q.shape[1]
    q, kk, v = q.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2)
    index_mask = idx.new_ones((B, S, kk.shape[2]), dtype=torch.bool).scatter(-1, idx.long(), False).unsqueeze(1)
    attention_mask = mask.masked_fill(index_mask, NEG_INF)
    out, weights = _hf_eager_attention(q, kk, v, attention_mask, q.shape[-1] ** -0.5, dropout, training)
    return (out, weights) if output_attentions else out


def hf_v32_sdpa(qi, ki, w, q, kk, v, bool_mask, k: int = 4):
    """HF ``DeepseekV32Attention`` (sdpa): ``attention_mask & ~index_mask`` (bool, True =
    visible) into ``F.scaled_dot_product_attention``."""
    idx = indexer(qi, ki, w, k)
    B, S = q.shape[0], q.shape[1]
    q, kk, v = q.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2)
    index_mask = idx.new_ones((B, S, kk.shape[2]), dtype=torch.bool).scatter(-1, idx.long(), False).unsqueeze(1)
    attention_mask = bool_mask & ~index_mask
    out = F.scaled_dot_product_attention(q, kk, v, attn_mask=attention_mask, scale=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


def megatron_absorbed(qi, ki, w, q, latent, k: int = 4, v_channels: int = 8):
    """Megatron-Core ``_unfused_absorbed_dsa_fn``: absorbed MQA over one latent head
    (sequence-first [s, b, 1, Dqk]; value = latent[..., :v_channels]), ``matmul(q.float(),
    k.float()) * scale`` [b, np, sq, skv], ``index_mask = full((b, sq, skv), -inf)``
    ``.scatter_(-1, topk, 0)``, the causal mask filled in, softmax in fp32, ``matmul`` with
    the value."""
    return megatron_absorbed_attention(indexer(qi, ki, w, k), q, latent, v_channels)


def megatron_absorbed_attention(idx, q, latent, v_channels: int = 8):
    sq, b, np_, hn = q.shape
    skv = latent.shape[0]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    query = q.permute(1, 2, 0, 3)  # [b, np, sq, hn]
    key = latent.permute(1, 2, 3, 0)  # [b, 1, hn, skv]
    scores = torch.matmul(query.to(acc), key.to(acc)) * hn ** -0.5
    index_mask = torch.full((b, sq, skv), NEG_INF, dtype=acc, device=q.device)
    index_mask.scatter_(-1, idx, 0)
    causal_mask = torch.triu(torch.ones(sq, skv, dtype=torch.bool, device=q.device), diagonal=1)
    index_mask = index_mask.masked_fill(causal_mask, NEG_INF)
    scores = scores + index_mask.unsqueeze(1)
    probs = torch.softmax(scores, dim=-1, dtype=acc)
    value = latent[..., :v_channels].permute(1, 2, 0, 3).to(acc)  # [b, 1, skv, v]
    out = torch.matmul(probs, value)  # [b, np, sq, v]
    return out.permute(2, 0, 1, 3)  # [sq, b, np, v]


def make_mqa_inputs(seed: int = 0, B: int = 2, S: int = 16, H: int = 4, D: int = 24, Hi: int = 4, Di: int = 16,
                    requires_grad: bool = False):
    """(qi, ki, w, q [S, B, H, D], latent [S, B, 1, D]) for ``megatron_absorbed``."""
    g = torch.Generator().manual_seed(seed)
    qi, ki = _indexer_inputs(g, B, S, Hi, Di)
    w = torch.randn(B, S, Hi, generator=g).abs() * Hi ** -0.5
    q = torch.randn(S, B, H, D, generator=g)
    lat = torch.randn(S, B, 1, D, generator=g)
    for t in (q, lat):
        t.requires_grad_(requires_grad)
    return qi, ki, w, q, lat


def offset_causal(S: int, T: int, device=None) -> torch.Tensor:
    """The official code's mask for a chunk of S queries at positions T - S .. T - 1 over T
    cached keys (chunked prefill; S = 1 is decode): ``full((S, T), -inf).triu_(T - S + 1)``."""
    return torch.full((S, T), NEG_INF, device=device).triu_(T - S + 1)


def official_v32_chunk(qi, ki, w, q, kk, v, k: int = 4):
    """``official_v32`` for the last S of T positions (a prefill chunk over a KV cache): the
    selection and the attention both under the offset causal mask."""
    S, T = q.shape[1], kk.shape[1]
    s = torch.einsum("bshd,btd->bsht", qi, ki).relu()
    s = (s * w.unsqueeze(-1)).sum(dim=2) + offset_causal(S, T, q.device)
    idx = s.topk(min(k, T), dim=-1)[1]
    return official_v32_chunk_attention(idx, q, kk, v)


def official_v32_chunk_attention(idx, q, kk, v):
    bsz, S, T = q.shape[0], q.shape[1], kk.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.einsum("bshd,bthd->bsht", q.to(acc), kk.to(acc)) * q.shape[-1] ** -0.5
    index_mask = torch.full((bsz, S, T), NEG_INF, device=q.device, dtype=acc).scatter_(-1, idx, 0)
    index_mask += offset_causal(S, T, q.device).to(acc)
    scores += index_mask.unsqueeze(2)
    return torch.einsum("bsht,bthd->bshd", scores.softmax(dim=-1, dtype=acc).type_as(q), v)


def finfo_causal(S: int, dtype=torch.float32) -> torch.Tensor:
    """HF's eager causal mask built in the graph: 0 on and below the diagonal, finfo.min above."""
    return torch.full((S, S), torch.finfo(dtype).min, dtype=dtype).triu(1)


def hf_v32_eager_in_graph_mask(qi, ki, w, q, kk, v, *keep, k: int = 4, selection_mask: bool = True):
    """HF V3.2 eager's ``masked_fill(ones(bool).scatter(idx, False), finfo.min)`` over an
    attention mask built in the graph (``finfo_causal``) that the indexer adds to its scores,
    as HF's adds ``attention_mask[:, 0]`` (the site passes/visible_rows.py proves).
    ``selection_mask=False``: the indexer without it. ``keep`` [B, T] (True = a real token):
    a padding condition in the attention's mask only, as HF's mask builder puts it there
    (the indexer then adds the causal mask alone)."""
    B, S = q.shape[0], q.shape[1]
    mask = finfo_causal(S)[None, None].expand(B, 1, S, S)
    if keep:
        visible = torch.ones(S, S, dtype=torch.bool).tril()[None, None] & keep[0][:, None, None, :]
        mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)
    s = (torch.einsum("bshd,btd->bsht", qi, ki).relu() * w.unsqueeze(-1)).sum(dim=2)
    if selection_mask:
        s = s + (finfo_causal(S)[None].expand(B, S, S) if keep else mask[:, 0])
    return hf_v32_eager_finfo_attention(s.topk(min(k, S), dim=-1)[1], q, kk, v, mask)


def hf_v32_eager_finfo_attention(idx, q, kk, v, mask):
    """The consumer of ``hf_v32_eager_in_graph_mask`` at given indices (mask [B, 1, S, T])."""
    B, S = q.shape[0], q.shape[1]
    q, kk, v = q.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2)
    index_mask = idx.new_ones((B, S, kk.shape[2]), dtype=torch.bool).scatter(-1, idx, False).unsqueeze(1)
    attention_mask = mask.masked_fill(index_mask, torch.finfo(mask.dtype).min)
    return _hf_eager_attention(q, kk, v, attention_mask, q.shape[-1] ** -0.5)[0]
