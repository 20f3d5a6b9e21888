"""The sparse backward: top-k values that carry gradient get it at the k selected keys.

In a joint graph autograd has already written the original selection's backward: the
top-k's backward scatters the values' gradient into a dense [B, S, T] table and runs it
back through the score arithmetic (per operand, a contraction as large as the score GEMM,
plus the saved or rebuilt score table). Once ``rewrite.py`` has put the selection op in
the forward, this pass replaces that region with one ``hyscale.hytopk_values_backward``
call that works at the k selected keys per query (``lowerings/backward.py``).

Finding the region: autograd stamps every backward node with the ``seq_nr`` of the
forward op it differentiates. The region R is the backward nodes whose ``seq_nr`` is that
of a forward node of the site (the nodes from the operands q, k, w to the top-k). R must
take exactly one gradient from outside (the values' gradient) and hand out at most one
gradient per operand; each exit is matched to its operand through the forward op that
shares its ``seq_nr``. Anything else keeps the dense backward and the diagnostics say why:
a gradient that also reaches a mask or a scale, a loss that also reads the dense scores,
an operand whose gradient leaves the region twice (q and k the same tensor).
"""
from __future__ import annotations

import operator
from typing import Dict, List, Set

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .canonicalize import SiteMatch, is_backward_node, val
from .layout import inverse_permutation
from .rewrite import Applied, Emitter
from .score_mods import MOD_NODES

aten = torch.ops.aten


class KeepDense(Exception):
    """The dense backward stays; the message says why (for the diagnostics)."""


def rewrite_backward(graph: fx.Graph, m: SiteMatch, applied: Applied) -> str:
    """Replace the dense backward of a rewritten site whose values carry gradient.

    Returns "" when no gradient reaches the selection, "sparse" when the backward was
    rewritten, and "dense: <reason>" when it was left as it was."""
    try:
        return _rewrite(graph, m, applied)
    except KeepDense as e:
        return f"dense: {e}"


def backward_region(graph: fx.Graph, site) -> tuple:
    """(the forward nodes of ``site`` by ``seq_nr``, the backward nodes autograd stamped with
    one of those ``seq_nr``s, in graph order): the backward that differentiates the site."""
    seqs: Dict[int, List[fx.Node]] = {}
    for n in site:
        sn = n.meta.get("seq_nr")
        if sn is not None:
            seqs.setdefault(sn, []).append(n)
    return seqs, [n for n in graph.nodes if is_backward_node(n) and n.meta.get("seq_nr") in seqs]


def _rewrite(graph: fx.Graph, m: SiteMatch, applied: Applied) -> str:
    sources: Dict[str, fx.Node] = {"q": m.q.node, "k": m.k.node}
    if m.w is not None:
        sources["w"] = m.w.node
    seqs, region = backward_region(graph, _site_nodes(m.topk, set(sources.values())))
    if not region:
        return ""
    rset = set(region)
    if applied.values_out is None:
        raise KeepDense("the score arithmetic gets a gradient, but not through the top-k values")

    grads_in = {a for r in region for a in r.all_input_nodes if a not in rset and is_backward_node(a)}
    if len(grads_in) != 1:
        names = ", ".join(sorted(a.name for a in grads_in))
        raise KeepDense(f"the scores get gradient from more than the top-k values ({names})")
    g_in = grads_in.pop()
    if not _same_shape(g_in, applied.values_out):
        raise KeepDense(f"the gradient entering the score backward ({g_in.name}) is not shaped like the top-k values")
    # ... and it must enter through the top-k's own backward (with k == T a gradient of
    # the dense scores has the values' shape too, but arrives in key order elsewhere)
    tk_seq = m.topk.meta.get("seq_nr")
    if tk_seq is None or any(u.meta.get("seq_nr") != tk_seq for u in g_in.users if u in rset):
        raise KeepDense(f"the gradient entering the score backward ({g_in.name}) is not the top-k values' gradient")

    # each exit of the region is the gradient of one operand
    by_source: Dict[str, fx.Node] = {}
    for e in region:
        if all(u in rset for u in e.users):
            continue
        owners = {
            role
            for f in seqs.get(e.meta.get("seq_nr"), ())
            for role, x in sources.items()
            if x in f.all_input_nodes and _same_shape(e, x)
        }
        if len(owners) != 1:
            raise KeepDense(f"cannot tell which operand the gradient {e.name} belongs to "
                            f"(it may reach a mask, a scale or an operand used twice)")
        role = owners.pop()
        if role in by_source:
            raise KeepDense(f"operand {role} gets its gradient from two places in the score backward")
        by_source[role] = e

    # insert after the gradient and after everything of the forward the op reads (the
    # gradient may be a tangent placeholder, which comes before the whole forward)
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max((g_in, applied.values_out, applied.idx, applied.call), key=lambda n: order[n])
    em = Emitter(graph, last.next)
    try:
        g = _invert_views(em, g_in, applied.values_out, applied.values)  # -> [B, S, k]
        needs = [role in by_source for role in ("q", "k", "w")]
        call = em.call(
            torch.ops.hyscale.hytopk_values_backward.default,
            [g, applied.q, applied.k, applied.w, applied.masks, applied.idx, applied.call.args[5], *needs],
        )
        replace = {}
        for i, role in enumerate(("q", "k", "w")):
            if role in by_source:
                gi = em.call(operator.getitem, [call, i])
                canonical = {"q": applied.q, "k": applied.k, "w": applied.w}[role]
                replace[by_source[role]] = _invert_views(em, gi, canonical, sources[role])
    except Exception:
        em.rollback()
        raise
    for e, new in replace.items():
        e.replace_all_uses_with(new, delete_user_cb=lambda u: u not in rset)
    return "sparse"


def _site_nodes(topk: fx.Node, sources: Set[fx.Node]) -> Set[fx.Node]:
    """Forward nodes on a path from an operand source to the top-k (and its getitems)."""
    anc: Set[fx.Node] = set()
    stack = [topk]
    while stack:
        n = stack.pop()
        if n in anc or n in sources:
            continue
        anc.add(n)
        stack.extend(n.all_input_nodes)
    below: Set[fx.Node] = set()
    stack = [u for s in sources for u in s.users]
    while stack:
        n = stack.pop()
        if n in below or n not in anc:
            continue
        below.add(n)
        stack.extend(n.users)
    # a registered mod's stand-in: the original nodes it stands for are the site's too
    below |= {m for n in below for m in n.meta.get(MOD_NODES, ())}
    return below | {topk} | {u for u in topk.users if u.target is operator.getitem}


_IDENTITY = {torch.ops.aten.expand.default, torch.ops.aten.clone.default, torch.ops.aten.alias.default,
             torch.ops.aten.contiguous.default}


def same_value(x: fx.Node, site) -> Set[fx.Node]:
    """``x`` and the site's nodes that are ``x`` itself under another name: an expand to its
    own shape, a clone, an alias (``matmul`` emits ``expand(v, v.shape)`` and a clone before
    its ``bmm``). Their backward is the identity, so autograd records no node for them and
    the gradient of ``x`` carries the ``seq_nr`` of the op that reads the copy."""
    out, stack = {x}, [x]
    while stack:
        for u in stack.pop().users:
            if u in site and u not in out and u.target in _IDENTITY and _same_shape(u, x):
                out.add(u)
                stack.append(u)
    return out


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    va, vb = val(a), val(b)
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return False
    if va.dtype != vb.dtype or va.dim() != vb.dim():
        return False
    return all(statically_known_true(x == y) for x, y in zip(va.shape, vb.shape))


_VIEWS = {aten.view.default, aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim,
          aten.squeeze.default, aten._unsafe_view.default}


def _invert_views(em: Emitter, g: fx.Node, out: fx.Node, inp: fx.Node) -> fx.Node:
    """``g`` laid out like ``out`` -> laid out like ``inp``, where ``out`` is ``inp``
    through a chain of views and permutes (the chains ``rewrite.py`` emits)."""
    chain = []
    n = out
    while n is not inp:
        if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
            raise KeepDense(f"internal: {out.name} is not a view chain of {inp.name}")
        chain.append(n)
        n = n.args[0]
    for n in chain:
        p = n.args[0]
        if n.target is aten.permute.default:
            g = em.call(aten.permute.default, [g, inverse_permutation(list(n.args[1]))])
        elif n.target in _VIEWS:
            sizes = [int(s) if isinstance(s, int) or s.node.is_constant() else em.call(aten.sym_size.int, [p, d])
                     for d, s in enumerate(val(p).shape)]
            g = em.call(aten.reshape.default, [g, sizes])
        elif n.target is aten.expand.default:
            # weights expanded over unit axes (rewrite._weights_per_row): the gradient sums
            # over them, in fp32 as the original backward's reduction does
            dims = [d for d, (a, b) in enumerate(zip(val(p).shape, val(n).shape))
                    if statically_known_true(a == 1) and not statically_known_true(b == 1)]
            if dims:
                dt = val(g).dtype
                g = em.call(aten.sum.dim_IntList, [g, dims, True], {"dtype": torch.float32})
                if dt != torch.float32:
                    g = em.call(torch.ops.prims.convert_element_type.default, [g, dt])
        else:
            raise KeepDense(f"internal: cannot invert {n.target} in the operand layout")
    return g
