"""Context parallelism by all-gather, on ``torch.distributed`` (docs/distributed.md).

Each rank keeps a chunk of the queries (``contiguous``: rank r holds chunk r of W;
``zigzag``: chunks r and 2W-1-r of 2W, which balances causal work) and all-gathers the
keys the selection and the attention need, inside the compiled graph, with the functional
collective that carries gradients (``all_gather_tensor_autograd``): its backward
reduce-scatters the keys' gradient back to the rank that computed them. After the gather
the keys are in global position order whatever the layout, so a causal mask written with
the query rows' global positions (``causal_mask``) is a range per row and the op's tie rule
(the smaller key index) picks the same keys as one process.

No communication of our own: the gather is torch's; this module only says which rows a
rank holds and puts the gathered keys back in position order.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

__all__ = ["LAYOUTS", "context_parallel_positions", "shard_sequence", "context_parallel_gather", "causal_mask",
           "GatherKeysCache"]

LAYOUTS = ("contiguous", "zigzag")


def _group_size_rank(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("hyscale_compile.distributed: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group)


def _check_layout(layout: str) -> int:
    """Chunks per rank for ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"hyscale_compile.distributed: layout must be one of {LAYOUTS}, got {layout!r}")
    return 1 if layout == "contiguous" else 2


def _chunk_order(world: int, rank: int, layout: str) -> List[int]:
    """The global chunks rank ``rank`` holds, in the order it holds them."""
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def _chunk_len(seq_len: int, world: int, per_rank: int) -> int:
    n = world * per_rank
    if seq_len % n:
        raise ValueError(f"hyscale_compile.distributed: sequence length {seq_len} is not a multiple of "
                         f"{n} ({world} ranks x {per_rank} chunk(s) each)")
    return seq_len // n


def context_parallel_positions(seq_len: int, group=None, layout: str = "contiguous",
                               device: Optional[torch.device] = None) -> torch.Tensor:
    """The global positions (int64 ``[seq_len / W]``) of the query rows this rank holds, for
    a sequence of ``seq_len`` tokens split over the ``group``'s W ranks."""
    per_rank = _check_layout(layout)
    group, world, rank = _group_size_rank(group)
    c = _chunk_len(seq_len, world, per_rank)
    return torch.cat([torch.arange(j * c, (j + 1) * c, device=device) for j in _chunk_order(world, rank, layout)])


def shard_sequence(x: torch.Tensor, group=None, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """This rank's rows of the full-sequence tensor ``x`` along ``dim`` (the input ids, the
    labels), in the order ``context_parallel_positions`` gives."""
    per_rank = _check_layout(layout)
    group, world, rank = _group_size_rank(group)
    c = _chunk_len(x.shape[dim], world, per_rank)
    return torch.cat([x.narrow(dim, j * c, c) for j in _chunk_order(world, rank, layout)], dim)


def context_parallel_gather(x: torch.Tensor, group=None, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """All-gather every rank's rows of ``x`` along ``dim`` and return them in global position
    order: ``[..., seq_len, ...]``. Differentiable: the backward reduce-scatters.

    Call it inside the compiled model on the keys (the indexer's keys, the attention's K/V);
    the query side stays local."""
    from torch.distributed import _functional_collectives as fc

    per_rank = _check_layout(layout)
    group, world, _ = _group_size_rank(group)
    dim = dim % x.dim()
    if x.shape[dim] % per_rank:
        raise ValueError(f"hyscale_compile.distributed: a zigzag chunk holds two halves, but dim {dim} "
                         f"has odd length {x.shape[dim]}")
    # all_gather_single_autograd is the newer name of the same op; the older one warns in eager
    gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    # gathered along dim 0 (the collective's own layout), then one split-and-cat puts every
    # rank's chunks in global order along ``dim``
    g = gather(x.contiguous(), 0, group)
    ranks = g.chunk(world, 0)
    if per_rank == 1:
        return torch.cat(ranks, dim)
    halves = [r.chunk(2, dim) for r in ranks]
    pieces = [None] * (2 * world)
    for r in range(world):
        for slot, j in enumerate(_chunk_order(world, r, layout)):
            pieces[j] = halves[r][slot]
    return torch.cat(pieces, dim)


def causal_mask(positions: torch.Tensor, seq_len: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive ``[len(positions), seq_len]`` causal mask for query rows at global
    ``positions`` over keys in position order: 0 where key <= position, ``finfo.min``
    elsewhere (the HF eager form; each row's visible keys are one range)."""
    keys = torch.arange(seq_len, device=positions.device)
    return torch.where(keys[None, :] <= positions[:, None], 0.0, torch.finfo(dtype).min).to(dtype)


class GatherKeysCache:
    """Stands in for the ``cache`` of a Hugging Face DSA model (DeepSeek-V3.2, GLM-5) during
    a context-parallel forward: the two cache calls its attention makes on the keys,
    ``update_indexer(k [B, s, D])`` and ``update(k_pass, k_rot [B, 1, s, *])``, return the
    keys of the whole sequence, all-gathered in position order. No key is stored: pass
    ``use_cache=False`` with it, the global ``position_ids`` and a ready ``[B, 1, s, T]``
    mask (docs/distributed.md)."""

    def __init__(self, group=None, layout: str = "contiguous"):
        _check_layout(layout)
        self.group, self.layout = group, layout

    def update_indexer(self, k, layer_idx, *args, **kwargs):
        return context_parallel_gather(k, self.group, self.layout, dim=1)

    def update(self, k_pass, k_rot, layer_idx, *args, **kwargs):
        return (context_parallel_gather(k_pass, self.group, self.layout, dim=2),
                context_parallel_gather(k_rot, self.group, self.layout, dim=2))
