"""``torch.ops.hyscale``: the sparse attention over a selection.

    hyscale::sparse_attention(q, k, v, idx, masks, spec, return_probs=False)
        -> (out [B,S,H,Dv], lse [B,S,H] fp32, probs [B,S,k] fp32 or empty)
    hyscale::sparse_attention_backward(grad_out, q, k, v, idx, masks, delta, lse, spec,
                                       needs_q, needs_k, needs_v) -> (gq, gk, gv)

``spec`` is a JSON ``AttentionSpec`` (``attention_spec.py``, which also gives the operand
layouts). ``probs`` is the head-summed probability at each selected slot (the indexer's
loss reads it). ``sparse_attention`` is differentiable in q, k and v
(``register_autograd``); in a joint graph the pass inserts the backward op itself, with
the forward's saved indices and log-sum-exp. ``delta`` [B,S,H] fp32 is the softmax
backward's sum_d dO * O (``attention_backward.attention_delta``; the pass emits it as graph
ops): the backward takes it instead of the output, so the output is freed before the
backward's buffers are allocated.

Implementations: CPU -> ``attention_reference`` (chunked, no [S, T] tensor); CUDA -> the
forward kernel of ``triton_attention`` (``HYSCALE_KERNEL=reference``: the reference). The
backward is ``attention_backward`` on both: bitwise reproducible (no floating-point
atomics). Where v is a view of k's first columns (the MLA latent, v = k[..., :Dv]) the
backward's gk is the shared storage's whole gradient and its gv zeros (``fold_v`` of
``attention_backward``; one key-side reduction instead of two): gk + [gv, 0], what autograd
of the view adds, is the storage's gradient (a hook on the view v itself sees zeros).
``lse`` and ``probs`` are not differentiable (``mark_non_differentiable``): a loss that reads
them (the indexer's KL reads ``probs`` as its target) gets no gradient through them.

``empty_row="dense"`` (a finite index fill with no compile-time row proof): both ops
recompute the rows without a visible selected key over every key around the sparse path
(``attention_reference.dense_rows_forward``, ``attention_backward.dense_rows_backward``).

Bad operands (shapes, dtypes, devices, masks that do not broadcast, indices outside
[0, T) on the CPU, a spec that does not parse) raise ``SpecError`` naming the problem,
and the fakes run the same checks, so a compile sees them before a run would.
"""
from __future__ import annotations

import functools
import os
from typing import List, Tuple

import torch
from torch import Tensor

from . import attention_backward as bwd
from . import attention_reference as ref
from .attention_spec import AttentionSpec
from .spec import dtype_of

LIB = "hyscale"

CALLS = {"sparse_attention": 0, "sparse_attention_backward": 0}


@functools.lru_cache(maxsize=256)
def parse_attention_spec(spec: str) -> AttentionSpec:
    return AttentionSpec.from_json(spec)


def _validated(spec: str, masks) -> AttentionSpec:
    """The spec checked against its operands, its 0-d run-time scales left unread (a fake
    cannot read a value: the checks need only shapes and dtypes)."""
    return parse_attention_spec(spec).validate(num_mask_operands=len(masks))


def _parsed(spec: str, masks) -> AttentionSpec:
    return parse_attention_spec(spec).validate(num_mask_operands=len(masks)).resolve_operands(masks)


@torch.library.custom_op(f"{LIB}::sparse_attention", mutates_args=())
def sparse_attention(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, masks: List[Tensor], spec: str,
                     return_probs: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    CALLS["sparse_attention"] += 1
    parsed = _parsed(spec, masks)
    if q.device.type == "cuda" and os.environ.get("HYSCALE_KERNEL", "triton") != "reference":
        from .triton_attention import sparse_attention_triton

        # (it checks the operands itself, as it is called directly too)
        return sparse_attention_triton(q, k, v, idx, list(masks), parsed, return_probs=return_probs)
    ref.check_attention_operands(q, k, v, idx, masks, parsed)
    return ref.attention_forward(q, k, v, idx, list(masks), parsed, return_probs=return_probs)


@sparse_attention.register_fake
def _(q, k, v, idx, masks, spec, return_probs=False):
    ref.check_attention_operands(q, k, v, idx, masks, _validated(spec, masks))
    B, S, H = q.shape[0], q.shape[1], q.shape[2]
    out_dtype = dtype_of(parse_attention_spec(spec).out_dtype)
    probs_shape = (B, S, idx.shape[-1]) if return_probs else (0,)
    return (q.new_empty((B, S, H, v.shape[3]), dtype=out_dtype), q.new_empty((B, S, H), dtype=torch.float32),
            q.new_empty(probs_shape, dtype=torch.float32))


@torch.library.custom_op(f"{LIB}::sparse_attention_backward", mutates_args=())
def sparse_attention_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, idx: Tensor, masks: List[Tensor], delta: Tensor, lse: Tensor,
    spec: str, needs_q: bool, needs_k: bool, needs_v: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    CALLS["sparse_attention_backward"] += 1
    parsed = _parsed(spec, masks)
    ref.check_attention_operands(q, k, v, idx, masks, parsed)
    bwd.check_backward_operands(grad_out, q, k, v, idx, delta, lse)
    # v a view of k (the MLA latent): gk carries both gradients and gv is zeros; its callers
    # (autograd of the view, the MLA pass's d latent = gk[..., :Dv] + gv) add the two
    return bwd.attention_backward(grad_out, q, k, v, idx, list(masks), delta, lse, parsed, (needs_q, needs_k, needs_v),
                                  fold_v=True)


@sparse_attention_backward.register_fake
def _(grad_out, q, k, v, idx, masks, delta, lse, spec, needs_q, needs_k, needs_v):
    ref.check_attention_operands(q, k, v, idx, masks, _validated(spec, masks))
    bwd.check_backward_operands(grad_out, q, k, v, idx, delta, lse)
    return (q.new_empty(q.shape if needs_q else (0,)), k.new_empty(k.shape if needs_k else (0,)),
            v.new_empty(v.shape if needs_v else (0,)))


def _setup_context(ctx, inputs, output):
    q, k, v, idx, masks, spec = inputs[:6]
    ctx.spec, ctx.n_masks = spec, len(masks)
    ctx.save_for_backward(q, k, v, idx, output[0], output[1], *masks)
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx, grad_out, grad_lse, grad_probs):
    q, k, v, idx, out, lse, *masks = ctx.saved_tensors
    nq, nk, nv = ctx.needs_input_grad[:3]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    delta = bwd.attention_delta(grad_out, out, lse)
    gq, gk, gv = torch.ops.hyscale.sparse_attention_backward(grad_out, q, k, v, idx, masks, delta, lse, ctx.spec,
                                                            nq, nk, nv)
    # lse and probs are marked non-differentiable: grad_lse and grad_probs are zeros
    rest = len(ctx.needs_input_grad) - 5
    return (gq if nq else None), (gk if nk else None), (gv if nv else None), None, [None] * ctx.n_masks, \
        *([None] * rest)


sparse_attention.register_autograd(_backward, setup_context=_setup_context)

ATTENTION_OPS = (torch.ops.hyscale.sparse_attention.default, torch.ops.hyscale.sparse_attention_backward.default)
