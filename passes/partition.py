"""Selection replay: the backward reuses the forward's indices, never selects again.

Two pieces, both the partitioner's own mechanisms:

* the rewrite tags every selection op it inserts (and, for the values variant, every
  getitem of it) ``CheckpointPolicy.MUST_SAVE`` (``tag_saved``), which the min-cut
  partitioner honours under ``torch.utils.checkpoint``, selective checkpointing (our tag
  replaces whatever the SAC policy said, MUST_RECOMPUTE included) and memory budgets in
  (0, 1);
* ``HyScalePartitioner`` wraps the partitioner for the one case that ignores MUST_SAVE:
  ``activation_memory_budget == 0`` returns early with "save only the inputs". When the
  joint graph holds a selection op, it runs the partitioner at a budget of
  ``REPLAY_BUDGET`` instead: the knapsack still recomputes everything it can, but saved
  tags are honoured. (Region budgets set with
  ``torch.autograd.graph.region_activation_memory_budget`` are not overridden.)
"""
from __future__ import annotations

import operator
import os
from typing import Optional

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy

REPLAY_BUDGET = 1e-6


def selection_ops():
    from ..lowerings.attention_ops import ATTENTION_OPS
    from ..lowerings.ops import SELECTION_OPS

    return SELECTION_OPS + ATTENTION_OPS[:1]  # the attention op reads saved indices too


def tag_saved(node: fx.Node) -> None:
    """MUST_SAVE on a selection op and on every getitem of it (a tag on the getitems
    alone is skipped by the partitioner; on the producer alone it cannot save a tuple)."""
    node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    for user in node.users:
        if user.target is operator.getitem:
            user.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def tag_attention(call: fx.Node) -> None:
    """The sparse attention's tags: the op and its outputs ``MUST_SAVE`` (its indices are the
    selection's, saved by ``tag_saved``), so that under any checkpoint policy the backward
    reads the saved indices and log-sum-exp and never selects again or rebuilds an index
    mask. The output is saved with them rather than following the policy: the partitioner
    cannot save a tuple, so a recomputed output would need the whole op again, which its
    MUST_SAVE forbids (the partition then fails)."""
    tag_saved(call)


def tag_recompute(node: fx.Node) -> None:
    """MUST_RECOMPUTE on a node a pass inserted whose output is cheap to rebuild in the
    backward and wide to keep (the MLA form's absorbed query). Under a memory budget below
    1 the knapsack chooses what to recompute itself and the tag is dropped
    (``HyScalePartitioner``): there, a graph whose only matmul is so tagged leaves the
    knapsack no candidate, and its shortcut then saves the attention op's output tuple
    (which AOTAutograd rejects)."""
    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    node.meta["hyscale_recompute"] = True


def _drop_recompute_tags(gm: fx.GraphModule) -> None:
    for m in gm.modules():
        if isinstance(m, fx.GraphModule):
            for n in m.graph.nodes:
                if n.meta.pop("hyscale_recompute", False) and n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE:
                    del n.meta["recompute"]


def has_selection(gm: fx.GraphModule) -> bool:
    """A selection op in ``gm`` or in any subgraph it calls (invoke_subgraph regions)."""
    ops = selection_ops()
    return any(
        n.op == "call_function" and n.target in ops
        for m in gm.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes
    )


def tag_selection_regions(gm: fx.GraphModule) -> None:
    """MUST_SAVE on forward ``invoke_subgraph`` calls (``nested_compile_region``) whose
    subgraph selects: a region is one op to the outer partitioner, so recomputing it in
    the backward would run its selection again. Its outputs are what the region's own
    partition chose to save (the int32 indices and little else under a budget of 0)."""
    from .canonicalize import is_backward_node

    hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    if hop is None:
        return
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not hop or is_backward_node(n):
            continue
        sub = n.args[0]
        mod = getattr(gm, sub.target, None) if isinstance(sub, fx.Node) and sub.op == "get_attr" else None
        if isinstance(mod, fx.GraphModule) and has_selection(mod):
            tag_saved(n)


class HyScalePartitioner(CustomPartitionerFn):
    def __init__(self, chained: Optional[CustomPartitionerFn] = None):
        self.chained = chained

    def __call__(self, gm, joint_inputs, **kwargs):
        from torch._functorch import config as fconfig
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        inner = self.chained if self.chained is not None else min_cut_rematerialization_partition
        tag_selection_regions(gm)
        budget = fconfig.activation_memory_budget
        for n in gm.graph.nodes:
            if isinstance(n.meta.get("memory_budget"), float):
                budget = n.meta["memory_budget"]
                break
        region = getattr(torch._functorch.partitioners, "_get_memory_budget_annotation", None)
        regions = [b for b in map(region, gm.graph.nodes) if b is not None] if region is not None else []
        if min([budget, *regions]) < 1:
            _drop_recompute_tags(gm)
        if budget == 0 and has_selection(gm):
            for n in gm.graph.nodes:
                if n.meta.get("memory_budget") == 0:
                    n.meta["memory_budget"] = REPLAY_BUDGET
            with fconfig.patch(activation_memory_budget=REPLAY_BUDGET):
                return inner(gm, joint_inputs, **kwargs)
        return inner(gm, joint_inputs, **kwargs)

    def uuid(self):
        extra = "" if self.chained is None else repr(self.chained.uuid())
        return get_hash_for_files((os.path.abspath(__file__),), extra)
