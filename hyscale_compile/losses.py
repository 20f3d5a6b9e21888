"""Losses that train a learned sparse attention's indexer (DeepSeek-V3.2's DSA recipe).

    dense_indexer_kl(q, k, qi, ki, w, *, scale=None, causal=True, lse=None, loss_coeff=1.0)

The dense warm-up loss: KL(target || softmax(index scores)) over all visible keys, target
the main attention's probabilities summed over its heads and L1-normalised, averaged over
the (batch, query) rows (Megatron-Core's ``compute_dsa_indexer_loss`` with
``dsa_indexer_use_sparse_loss=False``), streamed: no [S, T] table on either path.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .lowerings import indexer_kl_ops as _indexer_kl_ops  # noqa: F401  registers torch.ops.hyscale.dense_indexer_kl
from .lowerings import indexer_kl_reference as _reference

__all__ = ["dense_indexer_kl"]


def dense_indexer_kl(q: Tensor, k: Tensor, qi: Tensor, ki: Tensor, w: Tensor, *, scale: Optional[float] = None,
                     causal: bool = True, lse: Optional[Tensor] = None, loss_coeff: float = 1.0) -> Tensor:
    """The indexer's dense KL loss (0-d, fp32), differentiable in ``qi``, ``ki`` and ``w`` only.

    q [B,S,H,D], k [B,T,Hk,D]: the main attention's queries and keys (H % Hk == 0); they get
    no gradient (the target is detached, as in the paper). qi [B,S,Hi,Di], ki [B,T,Di],
    w [B,S,Hi]: the indexer, index score I_t = sum_j w_j relu(qi_j . ki_t) (w as the indexer
    applies it: Megatron's ``weights_proj(x) * Hi**-0.5 * Di**-0.5``). ``scale``: the
    attention's softmax scale (default D**-0.5). ``causal``: key t visible to query s iff
    t <= s, which needs S == T (prefill); otherwise every key is visible. ``lse`` [B,S,H]
    fp32: the attention's own log-sum-exp over the visible keys when the caller has it (a
    flash-attention forward returns it), saving the kernels a pass. ``loss_coeff``: the
    loss coefficient (Megatron's ``dsa_indexer_loss_coeff``).

    The target is sum_h P_h / Z with Z = sum_t sum_h P_h: Z = H exactly when every head's
    probabilities sum to 1 (an exact lse), so this is the head sum L1-normalised by H.
    Exact KL, with 0 log 0 := 0 (Megatron adds 1e-10 inside both logs; the difference is
    O(1e-10 / p) per key). fp32, bf16 or fp16 operands, fp32 accumulation.
    """
    # checked here too, before the op's schema would turn a non-tensor into a TypeError
    _reference.check_operands(q, k, qi, ki, w, lse, causal)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    # the target is a constant of the loss (the paper's detach): no graph through q, k or lse
    q, k = (t.detach() if isinstance(t, Tensor) else t for t in (q, k))
    lse = lse.detach() if isinstance(lse, Tensor) else lse
    loss, _stats, _row_stats = torch.ops.hyscale.dense_indexer_kl(q, k, qi, ki, w, lse, float(scale), bool(causal),
                                                                  float(loss_coeff))
    return loss
