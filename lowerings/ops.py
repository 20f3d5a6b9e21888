"""``torch.ops.hyscale``: the selection op family.

One op family, parameterized by the score description (``spec``, a JSON ``ScoreSpec``):

    hyscale::hytopk(q, k, w, masks, topk, spec, sorted=True) -> Tensor            indices [B,S,k]
    hyscale::hytopk_values(q, k, w, masks, topk, spec, sorted=True) -> (values, indices)
    hyscale::hytopk_values_backward(grad, q, k, w, masks, idx, spec, needs_q, needs_k, needs_w)
        -> (gq, gk, gw)     gradients computed at the k selected keys only (``backward.py``)

Indices are int32 (int64 when the key axis has 2**31 or more entries); the rewrite casts
them for consumers that expected ``aten.topk``'s int64. The values variant exists for
graphs that read the top-k values: they come from the same selection, so they are
bit-identical to what it compared. Both return (value desc, index asc) order, or with
``sorted=False`` (the matched ``topk``'s own) the same set in an order fixed by the launch
(the GPU kernel then skips its sort; the CPU reference returns the sorted order).
``hytopk_values`` is differentiable in q, k and w (``register_autograd``); the joint-graph
pass inserts ``hytopk_values_backward`` itself (``passes/sparse_backward.py``).

Implementations: CPU -> ``reference.streaming_topk`` (chunked, exact); CUDA -> the Triton
kernel generated from the spec (``triton_hytopk``), or the reference when
``HYSCALE_KERNEL=reference``.
"""
from __future__ import annotations

import functools
import os
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import reference
from .spec import ScoreSpec, dtype_of

LIB = "hyscale"


@functools.lru_cache(maxsize=256)
def parse_spec(spec: str) -> ScoreSpec:
    return ScoreSpec.from_json(spec)


# Calls of the op's implementation in this process (benchmarks count selections per step).
# A replayed CUDA graph launches the op's kernels without calling it: not counted.
CALLS = {"hytopk": 0, "topk_table": 0}


def _impl(q, k, w, masks, topk, spec, return_values, sorted):
    CALLS["hytopk"] += 1
    parsed = parse_spec(spec).validate(num_mask_operands=len(masks)).resolve_operands(masks)
    if q.device.type == "cuda" and os.environ.get("HYSCALE_KERNEL", "triton") != "reference":
        from .triton_hytopk import hytopk_triton

        return hytopk_triton(q, k, w, list(masks), topk, parsed, return_values=return_values, sorted=sorted)
    # (sorted=False allows any order: the reference's sorted one is one of them)
    out = reference.streaming_topk(q, k, w, list(masks), topk, parsed, return_values=return_values)
    if not sorted and UNSORTED_SHUFFLE["seed"] is not None:
        out = _shuffle_rows(out, UNSORTED_SHUFFLE["seed"])
    return out


# Tests (``hyscale_compile.testing.shuffled_unsorted``): the reference implementation
# returns sorted=False rows in a random order of each row's own, so that a test sees what
# an order-dependent use of an unsorted result would do (the GPU kernel's order is fixed
# by its launch, the reference's would otherwise be the sorted one).
UNSORTED_SHUFFLE = {"seed": None}


def _shuffle_rows(out, seed: int):
    idx = out[1] if isinstance(out, tuple) else out
    g = torch.Generator().manual_seed(seed)
    perm = torch.rand(idx.shape, generator=g).argsort(dim=-1).to(idx.device)
    if isinstance(out, tuple):
        return out[0].gather(-1, perm), idx.gather(-1, perm)
    return idx.gather(-1, perm)


@torch.library.custom_op(f"{LIB}::hytopk", mutates_args=())
def hytopk(q: Tensor, k: Tensor, w: Optional[Tensor], masks: List[Tensor], topk: int, spec: str,
           sorted: bool = True) -> Tensor:
    return _impl(q, k, w, masks, topk, spec, False, sorted)


@hytopk.register_fake
def _(q, k, w, masks, topk, spec, sorted=True):
    B, S = q.shape[0], q.shape[1]
    return q.new_empty((B, S, topk), dtype=reference.index_dtype(k.shape[1]))


@torch.library.custom_op(f"{LIB}::hytopk_values", mutates_args=())
def hytopk_values(
    q: Tensor, k: Tensor, w: Optional[Tensor], masks: List[Tensor], topk: int, spec: str, sorted: bool = True
) -> Tuple[Tensor, Tensor]:
    return _impl(q, k, w, masks, topk, spec, True, sorted)


@hytopk_values.register_fake
def _(q, k, w, masks, topk, spec, sorted=True):
    B, S = q.shape[0], q.shape[1]
    vals = q.new_empty((B, S, topk), dtype=dtype_of(parse_spec(spec).score_dtype))
    return vals, q.new_empty((B, S, topk), dtype=reference.index_dtype(k.shape[1]))


@torch.library.custom_op(f"{LIB}::hytopk_values_backward", mutates_args=())
def hytopk_values_backward(
    grad: Tensor, q: Tensor, k: Tensor, w: Optional[Tensor], masks: List[Tensor], idx: Tensor, spec: str,
    needs_q: bool, needs_k: bool, needs_w: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    from .backward import values_backward

    parsed = parse_spec(spec).validate(num_mask_operands=len(masks)).resolve_operands(masks)
    return values_backward(grad, q, k, w, list(masks), idx, parsed, (needs_q, needs_k, needs_w))


@hytopk_values_backward.register_fake
def _(grad, q, k, w, masks, idx, spec, needs_q, needs_k, needs_w):
    empty = q.new_empty(0)
    return (
        q.new_empty(q.shape) if needs_q else empty,
        k.new_empty(k.shape) if needs_k else empty,
        w.new_empty(w.shape) if (needs_w and w is not None) else empty,
    )


def _values_setup_context(ctx, inputs, output):
    q, k, w, masks, topk, spec = inputs[:6]
    ctx.spec, ctx.n_masks, ctx.has_w = spec, len(masks), w is not None
    ctx.save_for_backward(q, k, w if w is not None else q.new_empty(0), output[1], *masks)


def _values_backward(ctx, grad_values, grad_indices):
    q, k, w, idx, *masks = ctx.saved_tensors
    w = w if ctx.has_w else None
    nq, nk, nw = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    gq, gk, gw = torch.ops.hyscale.hytopk_values_backward(grad_values, q, k, w, masks, idx, ctx.spec, nq, nk, nw)
    # one None per remaining argument as the op was called (topk, spec, and sorted when it
    # was passed): needs_input_grad has the call's structure here
    rest = len(ctx.needs_input_grad) - 4
    return ((gq if nq else None), (gk if nk else None), (gw if nw else None), [None] * ctx.n_masks,
            *([None] * rest))


hytopk_values.register_autograd(_values_backward, setup_context=_values_setup_context)

@torch.library.custom_op(f"{LIB}::topk_table", mutates_args=())
def topk_table(x: Tensor, topk: int) -> Tensor:
    """Top-k indices along the last dim of a score table the graph already materialized
    (variants the fused kernel does not cover: ``passes/table_select.py``), by the tie rule,
    as int32 (int64 past 2**31 keys). The values are a ``gather`` at these indices."""
    CALLS["topk_table"] += 1
    return reference.table_topk(x, topk)


@topk_table.register_fake
def _(x, topk):
    return x.new_empty((*x.shape[:-1], topk), dtype=reference.index_dtype(x.shape[-1]))


@torch.library.custom_op(f"{LIB}::score_mod", mutates_args=())
def score_mod(x: Tensor, name: str) -> Tensor:
    """A registered score mod (``mods.py``) as one node; ``name`` is its key
    (``name@digest``). Only the matcher creates it, and only while it analyses a site: it
    never stays in a compiled graph."""
    from . import mods

    return mods.apply(name, x).clone()


@score_mod.register_fake
def _(x, name):
    return torch.empty_like(x)


SELECTION_OPS = (torch.ops.hyscale.hytopk.default, torch.ops.hyscale.hytopk_values.default,
                 torch.ops.hyscale.topk_table.default)
