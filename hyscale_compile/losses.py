"""Losses that train a learned sparse attention's indexer (DeepSeek-V3.2's DSA recipe,
Megatron-Core's ``compute_dsa_indexer_loss``; docs/indexer_loss.md).

    dense_indexer_kl(q, k, qi, ki, w, *, scale=None, causal=True, lse=None, loss_coeff=1.0)
    sparse_indexer_kl(probs, index_scores, *, eps=1e-10, reduction="mean")
    indexer_kl_reference(query, key, index_scores, idx, softmax_scale, mask=None, ...)

``dense_indexer_kl`` is the dense warm-up loss: KL(target || softmax(index scores)) over all
visible keys, target the main attention's probabilities summed over its heads and
L1-normalised, averaged over the (batch, query) rows (``dsa_indexer_use_sparse_loss=False``),
streamed: no [S, T] table on either path.

``sparse_indexer_kl`` is the sparse-stage loss written at the k selected slots: no [S, T]
tensor. ``indexer_kl_reference`` is its dense original (the same formula over every key,
with the index mask) in any dtype: float64 for tests.

Megatron writes the sparse stage's per-entry term as ``target * (log(target + 1e-10) -
log(p + 1e-10))``, not ``xlogy``/``kl_div``: at a key outside the selected set, and at a
selected slot that is masked (a row with fewer than k valid keys: P = 0, index score -inf),
``target = p = 0`` and the term is ``0 * (log(1e-10) - log(1e-10)) = 0``, its gradient
``-0 / 1e-10 = 0``. ``sparse_indexer_kl`` and its reference use the same term, so masked
slots give exactly what the original gives.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .lowerings import indexer_kl_ops as _indexer_kl_ops  # noqa: F401  registers torch.ops.hyscale.dense_indexer_kl
from .lowerings import indexer_kl_reference as _reference

__all__ = ["dense_indexer_kl", "sparse_indexer_kl", "indexer_kl_reference"]

EPS = 1e-10  # Megatron's: log(x + 1e-10)


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


def _check(name: str, t, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != dims or not t.is_floating_point():
        raise ValueError(f"{name} must be a {dims}-d floating-point tensor; got {t.dtype}{list(t.shape)}")


def sparse_indexer_kl(probs: torch.Tensor, index_scores: torch.Tensor, *, eps: float = EPS,
                      reduction: str = "mean") -> torch.Tensor:
    """The sparse-stage indexer loss over the k selected slots of each query row.

    ``probs`` [B, S, k]: the main attention's probabilities summed over heads at each
    selected slot (``torch.ops.hyscale.sparse_attention(..., return_probs=True)[2]``, fp32;
    0 at a masked slot). It is the target: detached here, L1-normalised over the slots.
    ``index_scores`` [B, S, k]: the indexer's scores at the same slots (the selection's values,
    ``hytopk_values``; ``-inf`` at a masked slot); the gradient flows into them only.
    Returns ``sum_j target_j * (log(target_j + eps) - log(softmax(index_scores)_j + eps))`` per
    row, [B, S] fp32 (``reduction="none"``), or its mean over rows, a 0-d fp32 tensor
    (``"mean"``: Megatron's ``kl_div``, before its ``loss_coeff``). Both softmaxes are fp32."""
    _check("probs", probs, 3)
    _check("index_scores", index_scores, 3)
    if tuple(probs.shape) != tuple(index_scores.shape):
        raise ValueError(f"probs {list(probs.shape)} and index_scores {list(index_scores.shape)} must both be "
                         "[B, S, k] at the same slots")
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    target = probs.detach().float()
    target = target / target.sum(-1, keepdim=True)
    p = torch.softmax(index_scores.float(), dim=-1)
    kl = (target * (torch.log(target + eps) - torch.log(p + eps))).sum(-1)
    return kl.mean() if reduction == "mean" else kl


def indexer_kl_reference(query: torch.Tensor, key: torch.Tensor, index_scores: torch.Tensor, idx: torch.Tensor,
                         softmax_scale: float, mask: Optional[torch.Tensor] = None, *, eps: float = EPS,
                         dtype: torch.dtype = torch.float64, reduction: str = "mean") -> torch.Tensor:
    """Megatron's sparse-stage loss, dense, in ``dtype`` (float64: the tests' reference).

    ``query`` [B, S, H, D], ``key`` [B, T, H, D] (the attention's, detached here),
    ``index_scores`` [B, S, T] (the indexer's table; gradient flows into it), ``idx`` [B, S, k]
    the selected keys, ``mask`` an additive [S, T] or [B, S, T] mask (``-inf`` hides; Megatron's
    causal ``triu(-inf, 1)``), added to both tables as Megatron does for the attention (its
    indexer scores carry it already: pass them with it). Two [S, T] tables: tests only."""
    q = query.detach().to(dtype).transpose(1, 2)  # [B, H, S, D]
    k = key.detach().to(dtype).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-1, -2)) * softmax_scale  # [B, H, S, T]
    index_mask = torch.full(index_scores.shape, float("-inf"), dtype=dtype,
                            device=index_scores.device).scatter(-1, idx.long(), 0.0)
    if mask is not None:
        scores = scores + (mask.to(dtype) if mask.dim() == 2 else mask.to(dtype).unsqueeze(1))
    scores = scores + index_mask.unsqueeze(1)
    target = torch.softmax(scores, -1).sum(1)
    target = target / target.sum(-1, keepdim=True)
    p = torch.softmax(index_scores.to(dtype) + index_mask, -1)
    kl = (target * (torch.log(target + eps) - torch.log(p + eps))).sum(-1)
    return kl.mean() if reduction == "mean" else kl
