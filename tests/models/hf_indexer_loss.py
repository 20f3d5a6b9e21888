"""Training a Hugging Face DeepSeek-V3.2 indexer: the paper's sparse-stage KL loss, written
in plain PyTorch beside the model (the recipe ``docs/indexer_loss.md`` gives).

HF's ``DeepseekV32Indexer.forward`` runs under ``@torch.no_grad()`` and returns only the
indices, so training the indexer means recomputing its scores with autograd
(``index_scores``: the same math, minus the decorator and the top-k, with the head-weighted
sum written as Megatron writes it, an einsum, then the weights and a sum over the heads: the
selection's sparse backward follows that form, not HF's ``matmul(weights.unsqueeze(-2),
scores)``, whose backward stays dense) and writing the loss
(``sparse_indexer_loss``): DeepSeek-V3.2 section 2.1, sparse stage, in Megatron-Core's
arithmetic (``log(x + 1e-10)``)::

    target = softmax(q k^T * scale + causal + index_mask).sum(heads), L1-normalised  (detached)
    loss   = mean_t sum_s target * (log(target + eps) - log(softmax(I + index_mask) + eps))

with the indexer's inputs detached (it learns only from this loss, the model only from the
LM loss). Written over [B, S, T] tables, as a user would; ``backend="hyscale"`` rewrites it
to the k selected slots (``passes/indexer_loss.py``).
"""
from __future__ import annotations

import torch


def causal_mask(S: int, T: int, device=None) -> torch.Tensor:
    """[S, T] additive: 0 where key t <= query s (the last S of T positions), -inf after."""
    return torch.triu(torch.full((S, T), float("-inf"), device=device), diagonal=T - S + 1)


def index_scores(indexer, hidden_states, q_resid, position_embeddings, mask):
    """``DeepseekV32Indexer.forward``'s scores [B, S, T] (mask added), with autograd."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    B, S, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(B, S, indexer.n_heads, indexer.head_dim)
    rd = indexer.qk_rope_head_dim
    q_rot, q_pass = torch.split(q, [rd, indexer.head_dim - rd], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rd, indexer.head_dim - rd], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = torch.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    weights = weights * indexer.n_heads ** -0.5
    return (scores * weights.unsqueeze(-1)).sum(2) + mask


def sparse_indexer_loss(indexer, hidden_states, q_resid, position_embeddings, query, key, scaling: float):
    """(loss, indices): the sparse-stage indexer loss of one layer and the indexer's selection.

    ``hidden_states`` [B, S, hidden], ``q_resid`` [B, S, q_lora_rank]: the indexer's inputs
    (detached here); ``query`` [B, H, S, D], ``key`` [B, H, T, D]: the attention's (detached
    here: the target trains nothing); ``scaling``: the attention's softmax scale."""
    hs, qr = hidden_states.detach(), q_resid.detach()
    S, T = hs.shape[1], key.shape[2]
    mask = causal_mask(S, T, hs.device)
    scores = index_scores(indexer, hs, qr, position_embeddings, mask)  # [B, S, T]
    idx = scores.topk(min(indexer.index_topk, T), dim=-1).indices
    index_mask = torch.full_like(scores, float("-inf")).scatter(-1, idx, 0.0)
    attn = torch.matmul(query.detach().float(), key.detach().float().transpose(-1, -2)) * scaling
    attn = attn + mask + index_mask.unsqueeze(1)  # [B, H, S, T]
    target = torch.softmax(attn, dim=-1).sum(1)
    target = target / target.sum(-1, keepdim=True)
    p = torch.softmax(scores + index_mask, dim=-1)
    # Megatron's offset, a literal: under dynamic=True Dynamo makes a float argument or global a graph
    # input, whose value the pass cannot read (the loss then stays dense)
    kl = target * (torch.log(target + 1e-10) - torch.log(p + 1e-10))
    return kl.sum(-1).mean(), idx
