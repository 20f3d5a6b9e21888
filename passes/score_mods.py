"""Find registered score mods on the way to a top-k and stand one node in for each.

A mod registered with ``hyscale_compile.register_score_mod`` is a small aten graph
(``lowerings/mods.py``). Before the canonicalizer runs, every place where that graph
computes a value that flows into a top-k's scores gets a ``hyscale.score_mod(x, key)``
node, and the consumers on the way to the top-k read it instead; the canonicalizer then
sees one pointwise step (``("mod", key)``). ``key`` (``name@digest``) names the mod's
content, so the compiled graph keeps computing it if the name is later re-registered.
After the rewrite, ``restore`` puts back the original value wherever a stand-in is still
used (a site that was left alone), so a graph we did not rewrite is exactly the graph we
were given.

The match is our own small structural one, not ``pattern_matcher.gen_pattern``: that
one ignores scalar constants (``30 * tanh(x / 30)`` would match ``50 * tanh(x / 50)``),
and for a mod the constants are the arithmetic.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.fx as fx

from ..lowerings import mods as hy_mods

MOD_NODES = "hyscale_mod_nodes"  # meta key on a stand-in: the graph nodes it replaces


def _same_const(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_const(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def match(pattern: fx.GraphModule, node: fx.Node) -> Optional[Tuple[fx.Node, List[fx.Node]]]:
    """(the input bound to the pattern's placeholder, the matched nodes) when ``node``
    computes the pattern's output; else None."""
    out = next(n for n in pattern.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    binding: Dict[fx.Node, fx.Node] = {}
    bound_x: List[fx.Node] = []

    def m(p, g) -> bool:
        if isinstance(p, fx.Node):
            if p.op == "placeholder":
                if not isinstance(g, fx.Node):
                    return False
                if bound_x and bound_x[0] is not g:
                    return False
                bound_x[:] = [g]
                return True
            if not isinstance(g, fx.Node) or g.op != "call_function" or g.target is not p.target:
                return False
            if p in binding:
                return binding[p] is g
            if len(p.args) != len(g.args) or set(p.kwargs) - {"dtype", "layout", "device", "pin_memory"} != set(
                g.kwargs
            ) - {"dtype", "layout", "device", "pin_memory"}:
                return False
            binding[p] = g
            return all(m(a, b) for a, b in zip(p.args, g.args)) and all(
                m(p.kwargs[k], g.kwargs.get(k)) for k in p.kwargs if k not in ("layout", "device", "pin_memory")
            )
        return _same_const(p, g)

    if not m(out, node) or not bound_x:
        return None
    return bound_x[0], list(binding.values())


def collapse(graph: fx.Graph, topks: List[fx.Node]) -> List[fx.Node]:
    """Insert a stand-in for every registered mod that feeds a top-k; returns them."""
    registered = hy_mods.registered()
    if not registered or not topks:
        return []
    feeds: Set[fx.Node] = set()
    stack = [t.args[0] for t in topks if isinstance(t.args[0], fx.Node)]
    while stack:
        n = stack.pop()
        if n in feeds:
            continue
        feeds.add(n)
        stack.extend(n.all_input_nodes)
    stand_ins: List[fx.Node] = []
    taken: Set[fx.Node] = set()
    # outermost first (reverse topological order), so a mod containing another wins
    for n in reversed([n for n in graph.nodes if n in feeds and n.op == "call_function"]):
        if n in taken:
            continue
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            continue
        for name, mod in sorted(registered.items()):
            hit = match(mod.graph, n)
            if hit is None:
                continue
            x, nodes = hit
            with graph.inserting_after(n):
                s = graph.call_function(torch.ops.hyscale.score_mod.default, (x, mod.key))
            s.meta = {k: n.meta[k] for k in ("val", "tensor_meta", "stack_trace", "nn_module_stack", "partitioner_tag")
                      if k in n.meta}
            s.meta[MOD_NODES] = nodes
            n.replace_all_uses_with(s, delete_user_cb=lambda u: u is not s and (u in feeds or u in topks))
            taken.update(nodes)
            stand_ins.append(s)
            break
    return stand_ins


def restore(graph: fx.Graph, stand_ins: List[fx.Node]) -> None:
    """Undo ``collapse`` wherever a stand-in is still read (the site was left alone)."""
    for s in stand_ins:
        if s.graph is not graph:
            continue
        original = s.meta[MOD_NODES][0]
        if s.users:
            s.replace_all_uses_with(original)
        graph.erase_node(s)
