"""Selection from a score table the graph already materializes.

Some selections cannot become the fused op (yet): NSA and InfLLM-v2 normalize each head
with a softmax over all keys, MoBA writes forced blocks with in-place slice assignments,
InfLLM-v2 max-pools compressed scores into blocks, and NSA and MoBA read the score table
again elsewhere (the compressed-attention output, ``gate >= thr``). The rule for such sites
(docs/contract.md, "Other consumers of the scores"): still replace the top-k, selecting from
the existing tensor under the same rules. This pass does that for every top-k the fused
analysis left alone whose scores come from a query-key contraction (two activations, not a
linear layer, so MoE routers and samplers stay ``aten.topk``):

    topk(x, k, dim)  ->  idx = hyscale.topk_table(x moved to [..., T], k)   (int32, saved)
                         values = aten.gather(x, dim, idx)                (if read)

The indices follow the tie rule (value desc, index asc), the values are the table's own
entries (bit-identical, differentiable as before), and the int32 indices are tagged as a
saved activation, so the backward never sorts again. Nothing is fused: the diagnostics
report the site as selected from the table, with the reason the fused op did not apply.
"""
from __future__ import annotations

import operator
from typing import List, Optional

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .canonicalize import BIASED, CONTRACTIONS, GraphFacts, _linear_layer, free_axes_from_activations, val, walk_views
from .layout import inverse_permutation
from .partition import tag_saved
from .rewrite import Emitter

aten = torch.ops.aten
prims = torch.ops.prims
MAX_DEPTH = 1024  # in-place fills unrolled by Dynamo (MoBA: 2 per block) make long paths


def _search_back(x: fx.Node, visit):
    """Depth-first over the call_function nodes ``x`` is computed from (bounded by
    MAX_DEPTH): ``visit(n)`` gives (found, stop); the first ``found`` that is not None is
    returned, and ``stop`` keeps the search from looking past ``n``."""
    seen, stack = set(), [(x, 0)]
    while stack:
        n, depth = stack.pop()
        if n in seen or depth > MAX_DEPTH or not isinstance(n, fx.Node) or n.op != "call_function":
            continue
        seen.add(n)
        found, stop = visit(n)
        if found is not None:
            return found
        if not stop:
            stack.extend((a, depth + 1) for a in n.all_input_nodes)
    return None


def score_contraction(facts: GraphFacts, x: fx.Node) -> Optional[fx.Node]:
    """A contraction of two activations that ``x`` is computed from, not looking past
    linear layers (their outputs are features, not scores); None when there is none."""

    def visit(n):
        if n.target in BIASED:
            return None, True  # a linear layer with a bias: its output is a feature, not a score
        if n.target in CONTRACTIONS:
            found = not _linear_layer(facts, n) and free_axes_from_activations(facts, n)
            return (n if found else None), True
        return None, False

    return _search_back(x, visit)


def linear_operand(facts: GraphFacts, x: fx.Node) -> Optional[str]:
    """What the constant operand is of a linear layer ``x`` is computed from ('a global
    tensor (G['W'])'), looking no further back than ``score_contraction``; None if none."""

    def visit(n):
        if n.target not in CONTRACTIONS and n.target not in BIASED:
            return None, False
        for a in (n.args[:2] if n.target in CONTRACTIONS else n.args[:3]):
            src, _ = walk_views(a)
            if facts.is_constant_input(src):
                return facts.describe_input(src), True
        return None, True

    return _search_back(x, visit)


def argument_operands(facts: GraphFacts, contraction: fx.Node) -> List[str]:
    """The contraction's operands that are graph inputs not known to be constant."""
    return [a for a in (facts.argument_input(x) for x in contraction.args[:2]) if a is not None]


def select_from_table(graph: fx.Graph, facts: GraphFacts, tk: fx.Node, replay: bool = True) -> Optional[fx.Node]:
    """Rewrite ``tk``, whose scores the caller found to come from a query-key contraction
    (``score_contraction``), into ``hyscale.topk_table``; returns the op node, or None
    (the site stays as it was)."""
    x = tk.args[0]
    v = val(x)
    if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.dim() == 0:
        return None
    args = list(tk.args) + [None] * (5 - len(tk.args))
    k = args[1]
    dim = tk.kwargs.get("dim", args[2] if args[2] is not None else -1) % v.dim()
    largest = tk.kwargs.get("largest", args[3] if args[3] is not None else True)
    if not largest or not isinstance(k, int) or any(u.target is not operator.getitem for u in tk.users):
        return None
    users = {gi.args[1]: gi for gi in tk.users}
    em = Emitter(graph, tk)
    try:
        last = v.dim() - 1
        perm = None
        xt = x
        if dim != last:
            perm = [d for d in range(v.dim()) if d != dim] + [dim]
            xt = em.call(aten.permute.default, [x, perm])
        call = em.call(torch.ops.hyscale.topk_table.default, [xt, k])
        idx = em.call(prims.convert_element_type.default, [call, torch.int64])
        idx.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE  # the backward keeps the int32
        if perm is not None:
            idx = em.call(aten.permute.default, [idx, inverse_permutation(perm)])
        outs = {1: idx}
        if 0 in users and users[0].users:
            outs[0] = em.call(aten.gather.default, [x, dim, idx])
    except Exception:
        em.rollback()
        raise
    if replay:
        tag_saved(call)
    for i, gi in users.items():
        if i in outs:
            gi.replace_all_uses_with(outs[i])
    return call
