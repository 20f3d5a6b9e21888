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

``attach_indexer_losses(model)`` wires it into a ``DeepseekV32ForCausalLM`` (every layer's
loss, and the recipe's selection as the attention's): the training step adds the list it
returns to the LM loss.
"""
from __future__ import annotations

import torch


def causal_mask(S: int, T: int, device=None) -> torch.Tensor:
    """[S, T] additive: 0 where key t <= query s (the last S of T positions), -inf after."""
    return torch.triu(torch.full((S, T), float("-inf"), device=device), diagonal=T - S + 1)


def index_scores(indexer, hidden_states, q_resid, position_embeddings, mask, dtype=torch.float32):
    """``DeepseekV32Indexer.forward``'s scores [B, S, T] (mask added), with autograd; ``dtype``:
    what the forward's fp32 casts cast to (float64 for a reference from a float64 indexer)."""
    up = (lambda t: t.float()) if dtype == torch.float32 else (lambda t: t.to(dtype))
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
    scores = torch.relu(torch.einsum("bshd,btd->bsht", up(q), up(k)) * indexer.softmax_scale)
    weights = up(indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)))
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


def _hand_over_inputs(hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None,
                      **kwargs):
    """The HF indexer's forward, replaced: select nothing and hand its inputs on (as the
    "indices" HF passes to the attention function), where the layer's loss selects."""
    if cache is not None:
        raise ValueError("attach_indexer_losses: call the model with use_cache=False (the recipe has no key cache)")
    return hidden_states, q_resid, position_embeddings


def _attention_with_loss(module, query, key, value, attention_mask, scaling, dropout=0.0, indices=None, **kwargs):
    """The attention function of an ``attach_indexer_losses`` model: the layer's loss and its
    selection from the indexer's inputs (``indices``: what its replaced forward handed on)
    and this call's query and key, then the base implementation's attention under that
    selection (with ``DeepseekV32Attention.forward``'s own index mask for eager and sdpa)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import eager_attention_forward

    base, losses = module._indexer_loss_base, module._indexer_losses
    hs, qr, pe = indices
    loss, idx = sparse_indexer_loss(module.indexer, hs, qr, pe, query, key, scaling)
    losses.append(loss)
    B, S, T = idx.shape[0], idx.shape[1], key.shape[2]
    hide = idx.new_ones((B, S, T), dtype=torch.bool).scatter(-1, idx, False).unsqueeze(1)  # True: not selected
    if attention_mask.dtype == torch.bool:
        attention_mask = attention_mask & ~hide
    else:
        attention_mask = attention_mask.masked_fill(hide, torch.finfo(query.dtype).min)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(base, eager_attention_forward)
    return attend(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def attach_indexer_losses(model) -> list:
    """Train ``model``'s indexers (a ``DeepseekV32ForCausalLM``, attn_implementation "eager" or
    "sdpa") with the sparse-stage loss: every layer's indexer hands its inputs on instead of
    selecting, and the attention (registered as ``"<base>_indexer_loss"`` with HF's
    ``AttentionInterface``, the base's mask function) computes the layer's loss and selection
    with ``sparse_indexer_loss`` and attends to that selection. Returns the list each forward
    appends the layers' losses to, in layer order: the step adds them to the LM loss and
    clears it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    from transformers import DeepseekV32ForCausalLM

    if not isinstance(model, DeepseekV32ForCausalLM):
        raise TypeError(f"attach_indexer_losses: a DeepseekV32ForCausalLM, not {type(model).__name__}")
    base = model.config._attn_implementation
    if base not in ("eager", "sdpa"):
        raise ValueError(f"attach_indexer_losses: attn_implementation must be 'eager' or 'sdpa', not {base!r}")
    layers = [layer.self_attn for layer in model.model.layers if getattr(layer.self_attn, "indexer", None) is not None]
    if not layers:
        raise ValueError("attach_indexer_losses: the model has no indexer")
    name = f"{base}_indexer_loss"
    AttentionInterface.register(name, _attention_with_loss)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    losses = []
    for att in layers:
        att.indexer.forward = _hand_over_inputs
        att._indexer_loss_base, att._indexer_losses = base, losses
    model.set_attn_implementation(name)
    return losses
