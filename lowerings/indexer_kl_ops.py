"""``torch.ops.hyscale``: the indexer's dense KL loss (DSA warm-up), streamed.

    hyscale::dense_indexer_kl(q, k, qi, ki, w, lse, scale, causal, loss_coeff)
        -> (loss [] fp32, stats [B,S,H,2] fp32, row_stats [B,S,3] fp32)
    hyscale::dense_indexer_kl_backward(grad, q, k, qi, ki, w, stats, row_stats, scale, causal, loss_coeff)
        -> (gqi, gki, gw)

Semantics and layouts: ``indexer_kl_reference``. ``lse`` (optional) is the attention's own
log-sum-exp. ``stats`` is each head's softmax as (max m, sum l of exp(s - m)), computed when
``lse`` is absent ((lse, 1) otherwise); ``row_stats`` is the indexer's (max, sum of exp) over
the visible keys and Z, the target's mass before normalising (sum_t P_t, H up to rounding):
the backward's statistics, kept as (m, l) rather than m + log l, whose rounding would cost
|lse| ulps in every probability. Only the loss is differentiable,
and only in qi, ki and w: q and k (the main attention's) get no gradient, as the paper
detaches them.

Implementations: CPU -> the chunked reference; CUDA -> ``triton_indexer_kl``
(``HYSCALE_KERNEL=reference``: the reference). Both backwards are bitwise reproducible (no
floating-point atomics). The fakes run the operand checks, so a compile sees bad operands.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import indexer_kl_reference as ref

LIB = "hyscale"


def _use_triton(q: Tensor) -> bool:
    return q.device.type == "cuda" and os.environ.get("HYSCALE_KERNEL", "triton") != "reference"


@torch.library.custom_op(f"{LIB}::dense_indexer_kl", mutates_args=())
def dense_indexer_kl(q: Tensor, k: Tensor, qi: Tensor, ki: Tensor, w: Tensor, lse: Optional[Tensor], scale: float,
                     causal: bool, loss_coeff: float) -> Tuple[Tensor, Tensor, Tensor]:
    if _use_triton(q):
        from .triton_indexer_kl import indexer_kl_triton_forward

        return indexer_kl_triton_forward(q, k, qi, ki, w, lse, scale, causal, loss_coeff)
    ref.check_operands(q, k, qi, ki, w, lse, causal)
    return ref.indexer_kl_forward(q, k, qi, ki, w, lse, scale, causal, loss_coeff, return_stats=True)


@dense_indexer_kl.register_fake
def _(q, k, qi, ki, w, lse, scale, causal, loss_coeff):
    ref.check_operands(q, k, qi, ki, w, lse, causal)
    B, S, H = q.shape[:3]
    f32 = dict(dtype=torch.float32)
    return q.new_empty((), **f32), q.new_empty((B, S, H, 2), **f32), q.new_empty((B, S, 3), **f32)


@torch.library.custom_op(f"{LIB}::dense_indexer_kl_backward", mutates_args=())
def dense_indexer_kl_backward(grad: Tensor, q: Tensor, k: Tensor, qi: Tensor, ki: Tensor, w: Tensor, stats: Tensor,
                              row_stats: Tensor, scale: float, causal: bool,
                              loss_coeff: float) -> Tuple[Tensor, Tensor, Tensor]:
    if _use_triton(q):
        from .triton_indexer_kl import indexer_kl_triton_backward

        return indexer_kl_triton_backward(grad, q, k, qi, ki, w, stats, row_stats, scale, causal, loss_coeff)
    ref.check_operands(q, k, qi, ki, w, None, causal)
    ref.check_stats(q, stats, row_stats)
    return ref.indexer_kl_backward(grad, q, k, qi, ki, w, stats, scale, causal, loss_coeff)


@dense_indexer_kl_backward.register_fake
def _(grad, q, k, qi, ki, w, stats, row_stats, scale, causal, loss_coeff):
    ref.check_operands(q, k, qi, ki, w, None, causal)
    ref.check_stats(q, stats, row_stats)
    return torch.empty_like(qi), torch.empty_like(ki), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    q, k, qi, ki, w, _lse, scale, causal, loss_coeff = inputs
    ctx.args = (scale, causal, loss_coeff)
    ctx.save_for_backward(q, k, qi, ki, w, output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx, grad_loss, _g_stats, _g_row_stats):
    q, k, qi, ki, w, stats, row_stats = ctx.saved_tensors
    need = ctx.needs_input_grad
    if grad_loss is None or not any(need[2:5]):
        return (None,) * 9
    gqi, gki, gw = torch.ops.hyscale.dense_indexer_kl_backward(grad_loss, q, k, qi, ki, w, stats, row_stats,
                                                                 *ctx.args)
    # q, k and the attention's lse are detached by definition: no gradient reaches them
    return (None, None, gqi if need[2] else None, gki if need[3] else None, gw if need[4] else None,
            None, None, None, None)


dense_indexer_kl.register_autograd(_backward, setup_context=_setup_context)

INDEXER_KL_OPS = (torch.ops.hyscale.dense_indexer_kl.default, torch.ops.hyscale.dense_indexer_kl_backward.default)
