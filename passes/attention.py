"""The attention pass: the dense attention that applies a selection's index mask becomes
one ``hyscale.sparse_attention`` call over the k selected keys of each row.

Runs after the selection pass, in the same joint/forward graph. For every selection (a
``hyscale.hytopk`` / ``hytopk_values`` / ``topk_table`` node, or an ``aten.topk`` left in
the graph: a top-k's indices are distinct within a row) it follows the indices forward:

1. **The index mask.** A ``scatter`` of a constant into a constant-filled tensor
   (``full``/``ones``/``zeros``/``new_ones`` decompose to ``aten.full``) at the indices,
   along the last dim, is a tensor that holds one constant at the selected keys and
   another at every other key. The pass evaluates each op downstream of it (views, casts,
   ``~``, ``&``, ``|``, ``masked_fill``, ``where``, ``+``) *twice, symbolically*: at the
   selected keys, where the index mask is a constant and the op reduces to a tensor the
   graph already has (``attention_mask & ~index_mask`` is ``attention_mask`` there,
   ``full(-inf).scatter_(idx, 0) + mask`` is ``mask``), and at the other keys, where it
   must be a constant that hides the key (``-inf`` added, ``False`` kept, a fill of
   ``-inf``). An op that would expose an unselected key stops the walk. Indices that
   reach a scatter only through something else (V4's remapping ``where``s, a view of
   another shape) are not followed, and the scatter is reported dense with the reason. A
   reducing scatter of a constant, whole or in row chunks (Megatron's), is first folded into
   the one scatter it equals (``passes/index_mask.py``).
2. **The application.** The op where that tensor meets the scores (an ``add``, a
   ``masked_fill``/``where`` of the scores) must lie on the chain from a score contraction
   (``bmm``/``mm``: einsum and matmul decompose to it) to a softmax (decomposed:
   ``amax``, ``sub``, ``exp``, ``sum``, ``div``; or Megatron's ``masked_softmax`` over
   ``isfinite`` of the index mask, ``passes/masked_softmax.py``), whose output reaches, through views and
   casts only, the contraction with the values. The chain is analysed by the selection's
   own canonicalizer (``canonicalize.SiteAnalysis``: logical axes through views, scale
   steps, mask terms; position masks become ranges) with the index mask replaced by its
   value at the selected keys.
3. **The rewrite.** q [B,S,H,Dqk], k [B,T,Hk,Dqk], v [B,T,Hk,Dv] are views of the graph's
   tensors; the op's output is laid out as the value contraction's was and replaces it.
   In a joint graph the region's backward (the nodes sharing ``seq_nr`` with its forward
   nodes, and those between them that no forward node names: the backward of an in-place
   op on a view) becomes one ``sparse_attention_backward`` call; where it is not of the expected
   shape the whole site stays dense.

Why the result is the original's: at an unselected key the original's logit is ``-inf``
(or hidden by a ``False`` keep mask, which sdpa and the graphs spell as ``-inf``), so its
softmax weight is exactly 0 and its value is never read; at a selected key the logit is
the score with the remaining masks, which is what the op computes. A row whose selected
keys are all hidden is NaN in both (0 in both under sdpa's safe softmax, which the op then
runs as ``empty_row="zero"``; fused sdpa nodes are first written out as their math by
``passes/sdpa.py``). An index mask that hides with a finite value
(``finfo.min``, HF's eager attention) keeps the op's plain mode where ``visible_rows.prove``
shows that every row keeps a visible selected key; elsewhere (the mask a graph input: a
per-layer compile, a padding mask) the op runs with ``empty_row="dense"``, which recomputes
per call, over every key, the rows that may have none (a row without one averages every
key in the original); a fused sdpa kernel's site stays dense there. Left dense too, each
with its reason: dropout with p > 0 (a random op after the softmax), attention weights
read elsewhere (``output_attentions``), anything else the walk does not recognize.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..lowerings import attention_ops  # noqa: F401  (registers torch.ops.hyscale.sparse_attention)
from ..lowerings.attention_reference import check_attention_operands
from ..lowerings.attention_spec import AttentionSpec, form_of
from ..lowerings.spec import SpecError, dtype_name
from . import index_mask
from . import layout as L
from . import masked_softmax, mla, sdpa, visible_rows
from .diagnostics import AttentionRecord
from .canonicalize import (CONTRACTIONS, _AND, _CASTS, _FLOAT_RANK, _NOT, _OR, _VIEWS, GraphFacts, OperandPlan,
                           SiteAnalysis, Unsupported, analyse_operand, cast_dtype, dtype_of_node, is_backward_node,
                           place_mask_operands, propagate_view, shape_of, unify_dims, val, _feeds_only_backward)
from .partition import tag_attention
from .rewrite import Emitter

aten = torch.ops.aten
prims = torch.ops.prims

_RANDOM = {aten.bernoulli.default, aten.bernoulli.p, aten.rand.default, aten.rand_like.default,
           aten.native_dropout.default, aten.randn.default}
# views of the indices that keep them the indices (the same shape is the same tensor)
_INDEX_VIEWS = (aten.clone.default, aten.alias.default, aten.view.default, aten.reshape.default,
                aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim)
_SCATTERS = {aten.scatter.value, aten.scatter.src, aten.scatter.reduce, aten.scatter.value_reduce,
             aten.scatter_add.default, aten.scatter_reduce.two}
_SHAPE_QUERIES = {aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default}


def selection_indices(graph: fx.Graph) -> List[fx.Node]:
    """The index outputs of every selection in ``graph`` ([..., k], distinct per row)."""
    hy = torch.ops.hyscale
    out = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in (hy.hytopk.default, hy.topk_table.default):
            out.append(n)
        elif n.target in (hy.hytopk_values.default, aten.topk.default):
            out.extend(u for u in n.users if u.target is operator.getitem and u.args[1] == 1)
    return out


# ------------------------------------------------------------------------------------------
# The index mask, evaluated at the selected keys ("sel") and at the others ("uns")
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Masked:
    """A tensor downstream of an index mask. ``sel``: its value at the selected keys, a
    Python constant or a node that does not depend on the index mask. ``uns``: its value at
    the other keys, a constant (``-inf``, ``False``, ...)."""

    sel: Any
    uns: Any
    scatter: fx.Node


def _is_const(x) -> bool:
    return not isinstance(x, fx.Node)


class _Reject(Exception):
    """The site stays dense; the message is the reason."""


class MaskWalk:
    """Follows the index masks built from one selection's indices to their applications."""

    def __init__(self, facts: GraphFacts, em: Emitter):
        self.facts = facts
        self.em = em
        self.values: Dict[fx.Node, Masked] = {}

    def scatters(self, idx: fx.Node) -> List[fx.Node]:
        """The scatter nodes that write a constant at ``idx`` (through integer casts)."""
        out, stack = [], [idx]
        while stack:
            n = stack.pop()
            for u in n.users:
                if u.target in _CASTS and not dtype_of_node(u).is_floating_point and dtype_of_node(u) != torch.bool:
                    stack.append(u)
                elif u.target in _INDEX_VIEWS:
                    stack.append(u)  # (views keep the row-major order: the same shape is the same tensor)
                elif u.target in (aten.scatter.value, aten.scatter.src) and len(u.args) > 2 and u.args[2] is n:
                    ns, xs = shape_of(n), shape_of(idx)
                    if len(ns) == len(xs) and all(statically_known_true(a == b) for a, b in zip(ns, xs)):
                        out.append(u)
        return out

    def unfollowed(self, idx: fx.Node, followed: List[fx.Node]) -> List[Tuple[fx.Node, str]]:
        """The scatters at integer tensors computed elementwise from ``idx`` (same non-unit shape:
        one row per row of the indices) that ``scatters`` does not return, each with the reason
        the pass does not follow it: an index mask built from a selection is reported, never
        missed silently. (A router's top-k reaches no scatter this way: its indices are
        flattened or gathered with.)"""
        out: List[Tuple[fx.Node, str]] = []
        seen = set(followed)
        # (node, the remapping ops on its path, each with the input it reads the indices from,
        #  the node's non-unit shape, the row slice of the indices it holds: (dim, start, end) or None)
        stack: List[Tuple[fx.Node, Tuple[Tuple[fx.Node, fx.Node], ...], list, Any]] = \
            [(idx, (), _non_unit(shape_of(idx)), None)]
        while stack:
            n, path, real, rows = stack.pop()
            for u in n.users:
                if u in seen or u.op != "call_function" or is_backward_node(u):
                    continue
                if u.target in _SCATTERS and len(u.args) > 2 and u.args[2] is n:
                    seen.add(u)
                    out.append((u, self._why_not_followed(u, n, idx, path, rows)))
                    continue
                v = val(u)
                if not isinstance(v, torch.Tensor) or v.dtype.is_floating_point or v.dtype.is_complex or \
                        v.dtype == torch.bool:
                    continue
                sliced = _row_slice(u, n) if rows is None else None
                if sliced is not None:  # a chunk of the rows (a mask scattered in row chunks)
                    seen.add(u)
                    stack.append((u, path, _non_unit(v.shape), sliced))
                    continue
                shape = _non_unit(v.shape)
                if len(shape) != len(real) or not all(statically_known_true(a == b) for a, b in zip(shape, real)):
                    continue
                seen.add(u)
                same = u.target in _INDEX_VIEWS or u.target in _CASTS or _clamps_below_zero(self.facts, u, n)
                stack.append((u, path if same else path + ((u, n),), real, rows))
        return out

    def _why_not_followed(self, sc: fx.Node, at: fx.Node, idx: fx.Node,
                          path: Tuple[Tuple[fx.Node, fx.Node], ...], rows: Any = None) -> str:
        if path:
            steps = " -> ".join(f"{p.name} = {self._describe(p, prev, 'idx' if j == 0 else '.')}"
                                for j, (p, prev) in enumerate(path))
            why = (f"the indices are remapped by {steps} before the scatter {sc.name}: not a top-k's distinct "
                   "positions (a remapped row may repeat a position or leave the key range; the pass follows a "
                   "selection's indices only through casts and views)")
        elif sc.target in (aten.scatter.value, aten.scatter.src):
            why = (f"the index mask {sc.name} is scattered at a view of the indices shaped "
                   f"{list(shape_of(at))}, not as the indices {list(shape_of(idx))}: the pass follows an index "
                   "mask [B, S, T] scattered at the indices themselves")
        elif sc.target in (aten.scatter_reduce.two, aten.scatter.reduce, aten.scatter.value_reduce,
                           aten.scatter_add.default):
            red = sc.args[4] if len(sc.args) > 4 else sc.kwargs.get("reduce", "sum")
            src = sc.args[3]
            base = at.args[0] if _clamps_below_zero(self.facts, at, at.args[0]) else at  # (src may read either)
            what = self._describe(src, base, "idx") if isinstance(src, fx.Node) else repr(src)
            if isinstance(src, fx.Node) and self.facts.constant(src) is not None:
                what = repr(self.facts.constant(src))
            why = (f"the index mask {sc.name} is a {sc.target._opname} ({red!r}) of {what} at the indices, which "
                   "the pass does not follow: it follows a scatter of a constant (no reduction)")
        else:
            why = f"the indices reach {sc.name} ({sc.target}), which the pass does not follow as an index mask"
        if rows is not None:
            d, lo, hi = rows
            why += (f"; it scatters rows {lo}:{hi} (dim {d}) of the indices into a slice of the mask: a row chunk of a "
                    "mask built chunk by chunk")
        cat = self._cat_after(sc)
        if cat is not None:
            why += f"; the scattered mask is then concatenated ({cat.name}) onto another mask"
        return why

    def _describe(self, n: fx.Node, prev: fx.Node, name: str, depth: int = 1) -> str:
        """``n`` as an expression of ``prev`` (written ``name``)."""
        def arg(a):
            if a is prev:
                return name
            if isinstance(a, fx.Node):
                c = self.facts.constant(a)
                if c is not None:
                    return repr(c)
                if depth > 0 and a.op == "call_function" and prev in a.args:
                    return self._describe(a, prev, name, depth - 1)
                return a.name
            return repr(a)
        op = n.target._opname if isinstance(n.target, torch._ops.OpOverload) else str(n.target)
        return f"{op}({', '.join(arg(a) for a in n.args)})"

    @staticmethod
    def _cat_after(sc: fx.Node, hops: int = 4) -> Optional[fx.Node]:
        """A ``cat`` that the scattered mask reaches through a few views or slices, if any."""
        n = sc
        for _ in range(hops):
            us = [u for u in n.users if not is_backward_node(u)]
            if len(us) != 1:
                return None
            if us[0].target is aten.cat.default:
                return us[0]
            if us[0].target not in _VIEWS and us[0].target not in (aten.slice.Tensor, aten.unsqueeze.default,
                                                                   aten.expand.default):
                return None
            n = us[0]
        return None

    def start(self, sc: fx.Node) -> Masked:
        base, dim, index, value = sc.args[:4]
        while base.target in (aten.alias.default, aten.clone.default, aten.detach.default):
            base = base.args[0]  # (checkpointed regions alias every tensor)
        fill = self.facts.constant(base) if base.target is aten.full.default else None
        if base.target is aten.full.default and base.kwargs.get("dtype") is torch.bool:
            fill = bool(base.args[1])
        if fill is None:
            raise _Reject(f"the index mask {sc.name} scatters into a tensor that is not constant-filled")
        v = value if sc.target is aten.scatter.value else (
            self.facts.constant(value) if value.target is aten.full.default else None)
        if v is None:
            raise _Reject(f"the index mask {sc.name} scatters a value that is not a constant")
        if base.kwargs.get("dtype") is torch.bool:
            v = bool(v)
        bs, xs = shape_of(base), shape_of(index)
        if dim % len(bs) != len(bs) - 1 or len(bs) != len(xs) or len(bs) != 3:
            raise _Reject(f"the index mask {sc.name} is not [B, S, T] scattered along its last dim")
        if not all(statically_known_true(a == b) for a, b in zip(bs[:-1], xs[:-1])):
            raise _Reject(f"the index mask {sc.name} does not have one row per row of the indices")
        if kwargs_reduce(sc):
            raise _Reject(f"the index mask {sc.name} scatters with a reduction")
        m = Masked(sel=v, uns=fill, scatter=sc)
        self.values[sc] = m
        return m

    def emit_like(self, n: fx.Node, replace: Dict[int, Any]) -> Any:
        """``n`` with some args replaced, inserted just before ``n`` (its other args exist there)."""
        args = list(n.args)
        for i, a in replace.items():
            args[i] = a
        return self.at(n, n.target, args, dict(n.kwargs))

    def at(self, anchor: fx.Node, target, args, kwargs=None) -> fx.Node:
        self.em.anchor = anchor
        return self.em.call(target, args, kwargs)

    def full(self, sel: Any, like: fx.Node, anchor: fx.Node) -> Any:
        """``sel`` (a node broadcastable to ``like``) expanded to ``like``'s shape (a view), so
        that the views that follow apply to it as they did to the index mask."""
        if _is_const(sel):
            return sel
        ss, ls = shape_of(sel), shape_of(like)
        if len(ss) == len(ls) and all(statically_known_true(a == b) for a, b in zip(ss, ls)):
            return sel
        for _ in range(len(ls) - len(ss)):
            sel = self.at(anchor, aten.unsqueeze.default, [sel, 0])
        sizes = [int(s) if isinstance(s, int) or s.node.is_constant() else self.at(anchor, aten.sym_size.int, [like, d])
                 for d, s in enumerate(ls)]
        return self.at(anchor, aten.expand.default, [sel, sizes])

    def step(self, n: fx.Node) -> Optional[Masked]:
        """The value of ``n`` (an op with a masked input) at both kinds of key, or None when
        ``n`` applies the mask to something that is not mask-building (the caller checks)."""
        t = n.target
        ins = [i for i, a in enumerate(n.args) if isinstance(a, fx.Node) and a in self.values]
        if len(ins) != 1:
            raise _Reject(f"{n.name} combines two index masks")
        i = ins[0]
        x = self.values[n.args[i]]
        x = Masked(self.full(x.sel, n.args[i], n), x.uns, x.scatter)
        f = self.facts
        if t in (aten.permute.default, aten.transpose.int, aten.t.default):
            raise _Reject(f"the index mask is permuted ({n.name}): its rows would not be the indices' rows")
        if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            real_in = [d for d in shape_of(n.args[0]) if not statically_known_true(d == 1)]
            real_out = [d for d in shape_of(n) if not statically_known_true(d == 1)]
            if len(real_in) != len(real_out) or not all(statically_known_true(a == b) for a, b in zip(real_in, real_out)):
                raise _Reject(f"the index mask is regrouped by a view ({n.name})")
        if t in _VIEWS or t in _CASTS:
            dt = dtype_of_node(n)
            if (dt == torch.bool) != isinstance(x.uns, bool):
                raise _Reject(f"the index mask is cast between bool and a number ({n.name})")
            sel = x.sel if _is_const(x.sel) else self.emit_like(n, {0: x.sel})
            return Masked(sel, x.uns, x.scatter)
        if t in _NOT:
            sel = (not x.sel) if _is_const(x.sel) else self.em.call(aten.logical_not.default, [x.sel])
            return Masked(sel, not x.uns, x.scatter)
        if t in _AND or t in _OR:
            o = n.args[1 - i]
            is_and = t in _AND
            if x.uns is not (not is_and):  # x & True, x | False: the other operand decides
                raise _Reject(f"{n.name} lets the other operand decide at the unselected keys")
            if _is_const(x.sel):
                sel = self.full(o, n, n) if x.sel is is_and else x.sel
            else:
                sel = self.emit_like(n, {i: x.sel})
            return Masked(sel, x.uns, x.scatter)
        if t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
            c = f.constant(n.args[2])
            if c is None:
                raise _Reject(f"{n.name} fills with a value that is not a constant")
            if i == 1:  # masked_fill(o, index_mask, c)
                if x.uns is not True:
                    raise _Reject(f"{n.name} keeps its input at the unselected keys")
                sel = (c if x.sel else self.full(n.args[0], n, n)) if _is_const(x.sel) else self.emit_like(n, {1: x.sel})
                return Masked(sel, float(c), x.scatter)
            if x.uns != -math.inf or c != -math.inf:
                raise _Reject(f"{n.name} fills a finite value into the index mask")
            sel = self.emit_like(n, {0: x.sel}) if not _is_const(x.sel) else None
            if sel is None:
                raise _Reject(f"{n.name} fills a constant index mask")
            return Masked(sel, x.uns, x.scatter)
        if t is aten.where.self and i == 0:
            a, b = n.args[1], n.args[2]
            ca, cb = f.constant(a), f.constant(b)
            uns = ca if x.uns else cb
            if uns is None:
                raise _Reject(f"{n.name} selects a non-constant at the unselected keys")
            if _is_const(x.sel):
                sel = (ca if ca is not None else self.full(a, n, n)) if x.sel else (
                    cb if cb is not None else self.full(b, n, n))
            else:
                sel = self.emit_like(n, {0: x.sel})
            return Masked(sel, float(uns), x.scatter)
        if t is aten.where.self and i in (1, 2):  # masked_fill(index_mask, cond, c) decomposes so
            c = f.constant(n.args[3 - i])
            if x.uns != -math.inf or c != -math.inf or n.args[0] in self.values:
                raise _Reject(f"{n.name} selects a finite value into the index mask")
            sel = x.sel
            if _is_const(sel):  # where(cond, -inf, 0): a tensor the selection's range analysis reads
                sel = self.at(n, aten.scalar_tensor.default, [sel], {"dtype": dtype_of_node(n)})
            return Masked(self.emit_like(n, {i: sel}), x.uns, x.scatter)
        if t in (aten.add.Tensor,) and n.kwargs.get("alpha", 1) == 1:
            o = n.args[1 - i]
            if isinstance(x.uns, bool):
                raise _Reject(f"{n.name} adds a bool index mask")
            if x.uns != -math.inf:
                return None  # a finite hiding value: only the application may use it (it is rejected there)
            if _is_const(x.sel):
                if x.sel != 0:
                    raise _Reject(f"the index mask holds {x.sel} at the selected keys")
                sel = self.full(o, n, n) if isinstance(o, fx.Node) else float(o)
            else:
                sel = self.emit_like(n, {i: x.sel})
            return Masked(sel, x.uns, x.scatter)
        return None


def _row_slice(u: fx.Node, n: fx.Node) -> Optional[Tuple[int, Any, Any]]:
    """(dim, start, end) where ``u`` is a step-1 slice of the indices ``n`` along a row dim (not
    the last, the k picks), else None."""
    if u.target is not aten.slice.Tensor or u.args[0] is not n:
        return None
    nd = len(shape_of(n))
    d = (u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", 0)) % nd
    step = u.args[4] if len(u.args) > 4 else u.kwargs.get("step", 1)
    if d == nd - 1 or step != 1:
        return None
    lo = u.args[2] if len(u.args) > 2 else u.kwargs.get("start", 0)
    hi = u.args[3] if len(u.args) > 3 else u.kwargs.get("end", None)
    return d, lo, hi


def _clamps_below_zero(facts: GraphFacts, u: fx.Node, n: fx.Node) -> bool:
    """``u`` is ``clamp_min(n, c)`` / ``clamp(n, c, None)`` with ``c <= 0``: the identity on a
    selection's indices (each in [0, T))."""
    if u.args[0] is not n:
        return False
    if u.target is aten.clamp_min.default:
        c = u.args[1]
    elif u.target is aten.clamp.default and (len(u.args) < 3 or u.args[2] is None) and not u.kwargs.get("max"):
        c = u.args[1] if len(u.args) > 1 else u.kwargs.get("min")
    else:
        return False
    c = facts.constant(c) if isinstance(c, fx.Node) else c
    return isinstance(c, (int, float)) and not isinstance(c, bool) and c <= 0


def _non_unit(shape) -> list:
    return [d for d in shape if not statically_known_true(d == 1)]


def kwargs_reduce(sc: fx.Node) -> bool:
    return sc.kwargs.get("reduce") is not None or len(sc.args) > 4


# ------------------------------------------------------------------------------------------
# The region: score contraction -> steps -> softmax -> value contraction
# ------------------------------------------------------------------------------------------


def _seeded(n: fx.Node) -> bool:
    t = n.target
    return t in _RANDOM or (isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags)


def _random_input(n: fx.Node, depth: int = 6) -> bool:
    """Whether ``n`` is computed from a random op within a few steps (a dropout mask)."""
    if _seeded(n):
        return True
    return depth > 0 and any(_random_input(a, depth - 1) for a in n.all_input_nodes)


def _forward_users(n: fx.Node) -> List[fx.Node]:
    """``n``'s readers in the forward (a joint graph's saved aliases and backward nodes aside)."""
    return [u for u in n.users if not _feeds_only_backward(u)]


def _softmax_of(x: fx.Node) -> Optional[Tuple[int, fx.Node, List[fx.Node]]]:
    """(dim, output, nodes) of the softmax that ``x`` feeds (decomposed: amax, sub, exp,
    sum, div; or sdpa's safe softmax, whose output is then the ``where`` that gives 0 at the
    rows with every key hidden: ``sdpa.safe_softmax_output``), else None."""
    am = [u for u in _forward_users(x) if u.target is aten.amax.default]
    eq = [u for u in _forward_users(x) if u.target is aten.eq.Scalar]
    if len(am) != 1 or len(eq) > 1 or len(_forward_users(x)) != 2 + len(eq):
        return None
    am = am[0]
    dims = am.args[1]
    if len(dims) != 1 or not (am.args[2] if len(am.args) > 2 else am.kwargs.get("keepdim", False)):
        return None
    d = dims[0] % len(shape_of(x))
    sub = [u for u in _forward_users(x) if u.target is aten.sub.Tensor]
    if len(sub) != 1 or tuple(sub[0].args) != (x, am) or _forward_users(am) != [sub[0]] or len(_forward_users(sub[0])) != 1:
        return None
    ex = _forward_users(sub[0])[0]
    if ex.target is not aten.exp.default or len(_forward_users(ex)) != 2:
        return None
    sm = [u for u in _forward_users(ex) if u.target is aten.sum.dim_IntList]
    dv = [u for u in _forward_users(ex) if u.target is aten.div.Tensor]
    if len(sm) != 1 or len(dv) != 1 or [s % len(shape_of(x)) for s in sm[0].args[1]] != [d]:
        return None
    if tuple(dv[0].args) != (ex, sm[0]) or _forward_users(sm[0]) != [dv[0]]:
        return None
    if eq:
        safe = sdpa.safe_softmax_output(eq[0], dv[0], d, len(shape_of(x)), _forward_users)
        return None if safe is None else (d, safe[0], [am, sub[0], ex, sm[0], dv[0], *safe[1]])
    return d, dv[0], [am, sub[0], ex, sm[0], dv[0]]


_MASK_VIEWS = (aten.unsqueeze.default, aten.expand.default, aten.view.default, aten.reshape.default,
               aten.alias.default, aten.clone.default)


def _view_chain(n: Any) -> Tuple[Any, List[tuple]]:
    """(the tensor under ``n``'s views, the views but expands as (op, args))."""
    ops = []
    while isinstance(n, fx.Node) and n.target in _MASK_VIEWS:
        if n.target is not aten.expand.default:
            ops.append((n.target, tuple(n.args[1:])))
        n = n.args[0]
    return n, ops


def _check_masked_softmax(facts: GraphFacts, valid: fx.Node, x: fx.Node, app: fx.Node, app_arg: int,
                          masked: Masked) -> None:
    """A masked_softmax over ``x`` is the op's softmax (``empty_row="zero"``) where its ``valid`` is
    ``isfinite(M)`` of the index mask M the scores were given, laid out as that M, and M hides with
    -inf (``passes/masked_softmax.py``; the caller checks M's terms after the analysis)."""
    vroot, vops = _view_chain(valid)
    mroot, mops = _view_chain(app.args[app_arg])
    src = masked_softmax.isfinite_input(vroot)
    if src is None or _view_chain(src)[0] is not mroot or vops != mops or shape_of(valid) != shape_of(x):
        raise _Reject(f"a masked_softmax whose valid mask ({valid.name}) is not isfinite of the index mask its "
                      "logits were given: the pass cannot tell which keys it keeps")
    if masked.uns != -math.inf:
        raise _Reject(f"a masked_softmax over isfinite(index mask) where the index mask hides with {masked.uns}, "
                      "not -inf")


def _chain_back(facts: GraphFacts, x: fx.Node, app: fx.Node, app_arg: int) -> List[Tuple[fx.Node, Optional[int]]]:
    """[(contraction, None), (op, index of the chain's arg), ..., (x, i)]: the single path from
    a score contraction to ``x`` (at ``app`` the chain is the argument other than the mask)."""
    out: List[Tuple[fx.Node, Optional[int]]] = []
    cur = x
    for _ in range(64):
        if cur.target in CONTRACTIONS:
            out.append((cur, None))
            out.reverse()
            return out
        if cur.op != "call_function":
            raise _Reject(f"the scores do not come from a contraction (reached {cur.name})")
        if cur is app:
            ci = 1 - app_arg if app.target is aten.add.Tensor else 0
        elif cur.target in _VIEWS or cur.target in _CASTS:
            ci = 0
        else:
            cands = [i for i, a in enumerate(cur.args) if isinstance(a, fx.Node) and a in facts.dep]
            if len(cands) != 1:
                raise _Reject(f"the scores pass through {cur.name} ({cur.target}), which the rewrite does not "
                              "follow")
            ci = cands[0]
        out.append((cur, ci))
        cur = cur.args[ci]
    raise _Reject("the score chain is too long")


@dataclasses.dataclass
class Region:
    selection: fx.Node  # the selection's index node
    masked: Masked
    app: fx.Node  # where the index mask meets the scores
    app_arg: int
    chain: List[Tuple[fx.Node, Optional[int]]]
    softmax: Tuple[int, fx.Node, List[fx.Node]]
    post: List[fx.Node]  # softmax output -> the value contraction's operand (views, casts)
    pv: fx.Node  # the value contraction
    empty_row: str = "nan"  # what the softmax gives a row with every key hidden (AttentionSpec.empty_row)
    valid: Optional[fx.Node] = None  # a masked_softmax's valid mask (isfinite of the index mask)


def find_region(facts: GraphFacts, sel_idx: fx.Node, app: fx.Node, app_arg: int, masked: Masked) -> Region:
    # from the application forward to the softmax: single-use pointwise ops of the scores
    cur = app
    valid = None
    for _ in range(32):
        sm = _softmax_of(cur)
        if sm is not None:
            break
        msm = masked_softmax.recognise(cur, facts.constant, _forward_users)
        if msm is not None:  # Megatron's masked_softmax: the op with empty_row="zero" where valid is isfinite(M)
            sm, valid = msm[:3], msm[3]
            _check_masked_softmax(facts, valid, cur, app, app_arg, masked)
            break
        if any(u.target in (aten._softmax.default, aten._safe_softmax.default) for u in cur.users):
            raise _Reject("an undecomposed softmax (the pass expects the decomposed form)")
        readers = _forward_users(cur)
        if any(u.target is aten.eq.Scalar and u.args[1] == -math.inf for u in readers):
            raise _Reject("a test of the scores for -inf that is not a safe softmax the pass recognises "
                          "(eq(-inf) -> all, or not -> any -> not, -> where(0, softmax))")
        if len(readers) != 1:
            raise _Reject(f"the masked scores ({cur.name}) are read by more than the softmax "
                          f"({', '.join(u.name for u in readers)})")
        cur = readers[0]
    else:
        raise _Reject("no softmax after the index mask is applied")
    dim, p, _ = sm
    # (a safe softmax ends in its where, a masked_softmax in its zero fill)
    empty_row = "zero" if p.target in (aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor) else "nan"
    chain = _chain_back(facts, cur, app, app_arg)
    if app not in [n for n, _ in chain]:
        raise _Reject("the index mask is not applied on the chain from the score contraction to the softmax")
    if valid is not None:
        for n, _ in chain[1:]:  # valid reads M only: no other mask may hide a key it keeps
            tensors = [a for a in n.all_input_nodes if not (isinstance(val(a), torch.Tensor) and val(a).dim() == 0)]
            if n is not app and n.target not in _VIEWS and n.target not in _CASTS and len(tensors) != 1:
                raise _Reject(f"masked_softmax over isfinite(index mask) with another tensor ({n.name}) combined "
                              "into its logits: a key that tensor hides would still count as valid")
    for n, _ in chain[1:]:
        readers = _forward_users(n)
        if n is not cur and len(readers) != 1:
            raise _Reject(f"the scores ({n.name}) are read by more than the attention "
                          f"(attention weights used elsewhere: {', '.join(u.name for u in readers)})")
    # softmax output -> value contraction
    post, cur2 = [], p
    while True:
        us = _forward_users(cur2)
        if any(_seeded(u) or any(_random_input(a) for a in u.all_input_nodes if a is not cur2) for u in us):
            raise _Reject("dropout with p > 0 on the attention weights (a random op after the softmax)")
        if len(us) != 1:
            raise _Reject(f"the attention weights are used elsewhere ({', '.join(u.name for u in us)}): "
                          "output_attentions or another reader of the probabilities")
        u = us[0]
        if u.target in CONTRACTIONS:
            if u.args[0] is not cur2:
                raise _Reject("the attention weights are the right operand of the value contraction")
            return Region(sel_idx, masked, app, app_arg, chain, sm, post, u, empty_row, valid)
        if u.target in _VIEWS or u.target in _CASTS:
            if u.target in _CASTS and not dtype_of_node(u).is_floating_point:
                raise _Reject(f"the attention weights are cast to {dtype_of_node(u)}")
            post.append(u)
            cur2 = u
            continue
        if u.target in (aten.mul.Tensor, aten.div.Tensor) and facts.constant(u.args[1]) == 1:
            post.append(u)  # dropout(p=0) in training mode decomposes to x * 1.0
            cur2 = u
            continue
        raise _Reject(f"the attention weights pass through {u.name} ({u.target}) before the value contraction")


# ------------------------------------------------------------------------------------------
# Analysis (the selection's canonicalizer on the score chain) and the rewrite
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class AttentionMatch:
    region: Region
    spec: AttentionSpec
    q: OperandPlan
    k: OperandPlan
    v: OperandPlan
    mask_operands: List[Any]
    out_layout: L.Layout  # the value contraction's output
    roles: Dict[str, List[str]]
    sizes: Dict[str, Any]
    form: str


def analyse(facts: GraphFacts, em: Emitter, r: Region) -> AttentionMatch:
    an = SiteAnalysis(facts, None, r.chain)
    m = r.masked
    # the chain with the index mask replaced by its value at the selected keys
    chain = []
    before_app = None
    for n, ci in r.chain:
        if n is r.app:
            before_app = len(chain) - 1
            if _is_const(m.sel):
                neutral = (m.sel == 0) if n.target is aten.add.Tensor else (m.sel is False)
                if not neutral:
                    raise _Reject(f"the index mask holds {m.sel} at the selected keys")
                continue
            args = list(n.args)
            args[r.app_arg] = m.sel
            n = em.call(n.target, args, dict(n.kwargs))
        chain.append((n, ci))
    qk = chain[0][0]
    if qk.target is not aten.bmm.default:
        raise _Reject("the score contraction is not batched (mm)")
    sa, sb = analyse_operand(qk.args[0], "a"), analyse_operand(qk.args[1], "b")
    lays = [an.contraction_layout(qk, sa, sb)]
    for n, ci in chain[1:]:
        lays.append(an.propagate(n, ci, lays[-1]))
    u = an.u
    y_lay = u.apply(lays[-1])
    dim = r.softmax[0]
    key_atoms = [a for a in y_lay[dim] if not a.bcast]
    key_labels = {a.label for a in key_atoms}
    la, lb = set(L.labels(u.apply(sa.layout))), set(L.labels(u.apply(sb.layout)))
    if not key_atoms or not key_labels <= lb - la:
        raise _Reject("the softmax does not run over the key axis of the score contraction "
                      "(keys as the right operand)")
    qs, ks = sa, sb
    steps, _w, reduced, mask_plans = an.collect_steps(chain, lays, key_labels)
    if reduced is not None or any(s[0] == "__reduce__" for s in steps):
        raise _Reject("the scores are reduced over an axis before the softmax")

    # the value contraction: P [n, s, t] @ V [n, t, dv]
    lay_p = y_lay
    for n in r.post:
        lay_p = propagate_view(lay_p, n)
    vs = analyse_operand(r.pv.args[1], "v")
    if len(lay_p) != 3 or len(vs.layout) != 3:
        raise _Reject("the value contraction's operands are not 3-d")
    nb = unify_dims(u, lay_p[0], vs.layout[0], "batch")
    unify_dims(u, lay_p[2], vs.layout[1], "key")
    out_layout = [nb, lay_p[1], vs.layout[2]]
    lay_p = u.apply(lay_p)
    if {a.label for a in lay_p[2] if not a.bcast} != {u.find(x) for x in key_labels}:
        raise _Reject("the value contraction does not run over the softmax's key axis")

    q_lab = L.labels(u.apply(qs.layout))
    k_lab = L.labels(u.apply(ks.layout))
    v_lab = L.labels(u.apply(vs.layout))
    contracted = {u.find(a.label) for a in an.contracted}
    T = [u.find(a.label) for a in key_atoms]
    # the index mask's axes: batch, query and key (it is broadcast over the heads)
    mlab, morder = _mask_labels(r, u.apply(lays[before_app]))
    shared = [x for x in q_lab if x in k_lab and x not in contracted]
    q_only = [x for x in q_lab if x not in k_lab and x not in contracted]
    y_labels = L.labels(y_lay)
    order = {x: i for i, x in enumerate(y_labels)}
    B = sorted([x for x in shared if x in mlab], key=lambda x: order.get(x, 1 << 30))
    Hk = [x for x in shared if x not in mlab]
    S = [x for x in q_only if x in mlab]
    G = [x for x in q_only if x not in mlab]
    D = sorted(contracted, key=lambda x: q_lab.index(x) if x in q_lab else 1 << 30)
    Dv = [x for x in v_lab if x not in T and x not in B and x not in Hk]
    if not S:
        raise _Reject("one query row per sequence (decode over a KV cache): not rewritten, the attention stays "
                      "dense")
    if len(S) != 1 or len(B) > 1 or not Dv:
        raise _Reject(f"the attention's axes are not batch, query, heads and keys (batch {B}, query {S})")
    want = [x for x in B + S + T if x in morder]
    if [u.find(x) for x in morder] != want:
        raise _Reject(f"the index mask's axes are not (batch, query, key) in the indices' order")
    if set(y_labels) - set(B) - set(S) - set(Hk) - set(G) - set(T):
        raise _Reject("the scores have an axis that is neither batch, query, head nor key")
    if set(v_lab) - set(B) - set(Hk) - set(T) - set(Dv):
        raise _Reject("the values have an axis that is neither batch, key head, key nor value dim")

    spec_post = list(steps)
    mask_terms, mask_operands = [], []
    for mp in mask_plans:
        remap = {}
        for j, op in enumerate(mp.operands):
            remap[j] = len(mask_operands)
            mask_operands.append(op)
        t = mp.term
        mask_terms.append(dataclasses.replace(
            t, operand=None if t.operand is None else remap[t.operand], lo=None if t.lo is None else remap[t.lo],
            hi=None if t.hi is None else remap[t.hi]))
    base = len(mask_operands)
    mask_operands.extend(an.scalar_operands)
    spec_post = [(s[0], s[1] + base) if s[0].endswith("_operand") else s for s in spec_post]
    place_mask_operands(u, mask_operands, B, S, T)
    precision = "ieee"
    if qs.upcast_from is None and dtype_of_node(qs.src) == torch.float32 and \
            torch.get_float32_matmul_precision() != "highest":
        precision = "tf32"
    out_dtype = dtype_of_node(r.pv)
    spec = AttentionSpec(name="attention", post=tuple(spec_post), masks=tuple(mask_terms),
                         out_dtype=dtype_name(out_dtype), fp32_precision=precision, empty_row=r.empty_row)
    try:
        spec.validate(num_mask_operands=len(mask_operands))
    except SpecError as e:
        raise _Reject(f"the attention's score steps do not form a valid spec: {e}") from None

    def atoms_size(labels, lay):
        out = 1
        for x in labels:
            for d in lay:
                for a in d:
                    if a.label == x:
                        out = out * a.size
        return out

    ql = u.apply(qs.src_layout)
    kl = u.apply(ks.src_layout)
    sizes = {"B": atoms_size(B, ql), "S": atoms_size(S, ql), "H": atoms_size(Hk + G, ql),
             "Hk": atoms_size(Hk, kl), "T": atoms_size(T, kl), "Dqk": atoms_size(D, ql),
             "Dv": atoms_size(Dv, u.apply(vs.src_layout))}
    return AttentionMatch(
        region=r, spec=spec,
        q=OperandPlan(qs.src, ql, [B, S, Hk + G, D]),
        k=OperandPlan(ks.src, kl, [B, T, Hk, D]),
        v=OperandPlan(vs.src, u.apply(vs.src_layout), [B, T, Hk, Dv]),
        mask_operands=mask_operands, out_layout=u.apply(out_layout),
        roles={"B": B, "S": S, "H": Hk + G, "Hk": Hk, "D": D, "T": T, "Dv": Dv}, sizes=sizes,
        form=_form(sizes))


def _form(sizes) -> str:
    """The kernel form, by ``form_of`` on the static head counts; with a dynamic H, "mqa"
    where one key head serves every head (Hk == 1)."""
    H, Hk = sizes["H"], sizes["Hk"]
    if not isinstance(Hk, int):
        return "per_head"
    if not isinstance(H, int):
        return "mqa" if Hk == 1 else "per_head"
    try:
        return form_of(H, Hk)
    except SpecError:
        return "per_head"


def _mask_labels(r: Region, lay_in: L.Layout):
    """The logical axes the index mask varies along where it meets the scores (laid out as
    ``lay_in``): batch, query and key (as a set and in its dims' order); the heads are the
    axes it is broadcast over."""
    x = r.app.args[r.app_arg]
    while isinstance(x, fx.Node) and x.target is aten.expand.default:
        x = x.args[0]
    ml = L.broadcast_align(shape_of(x), lay_in)
    order = [a.label for d in ml for a in d if not a.bcast]
    return set(order), order


def _to_layout(em: Emitter, x: fx.Node, groups: List[List[str]], lay: L.Layout, like: fx.Node) -> fx.Node:
    """The canonical ``x`` (one dim per group of labels) laid out as ``lay`` (``like``'s)."""
    atoms = {a.label: a for d in lay for a in d}
    flat = [l for g in groups for l in g]
    if any(l not in atoms for l in flat):
        raise _Reject("internal: the output layout lacks an axis of the canonical output")
    sizes = [em.size_arg([atoms[l]]) for l in flat]
    if len(flat) != len(groups) or any(len(g) != 1 for g in groups):
        x = em.call(aten.reshape.default, [x, sizes])
    want = [a.label for d in lay for a in d]
    perm = [flat.index(l) for l in want]
    if perm != list(range(len(perm))):
        x = em.call(aten.permute.default, [x, perm])
    target = [1 if not d else em.size_arg(list(d)) for d in lay]
    cur = shape_of(x)
    if len(cur) == len(target) and all(statically_known_true(a == b) for a, b in zip(cur, val(like).shape)):
        return x
    return em.call(aten.reshape.default, [x, target])


@dataclasses.dataclass
class AppliedAttention:
    call: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    idx: fx.Node
    masks: List[fx.Node]
    out: fx.Node  # canonical [B, S, H, Dv]
    lse: fx.Node
    replaced: fx.Node  # the value contraction's replacement
    absorbed: Any = None  # the MLA form (passes/mla.py), when it runs


def apply(em: Emitter, m: AttentionMatch, replay: bool = True, absorb: bool = True) -> AppliedAttention:
    r = m.region
    q, k, v = em.operand(m.q), em.operand(m.k), em.operand(m.v)
    try:  # MLA: MQA over the shared latent, the up-projections absorbed (passes/mla.py)
        absorbed = mla.absorb(em, q, k, v) if m.form == "per_head" and absorb else None
    except Unsupported as e:
        absorbed = None
        m.sizes["latent"] = str(e)
    if absorbed is not None:
        q, k, v, m.form = absorbed.q, absorbed.k, absorbed.v, mla.FORM
        m.sizes.update(absorbed.record())
    masks = [em.operand(op) if isinstance(op, OperandPlan) else em.bound(op[1], op[2]) for op in m.mask_operands]
    idx = r.selection
    if len(shape_of(idx)) != 3:
        raise _Reject("the indices are not [B, S, k]")
    bq = shape_of(q)
    if not all(statically_known_true(a == b) for a, b in zip(shape_of(idx)[:2], bq[:2])):
        raise _Reject("the indices' rows are not the attention's (batch, query) rows")
    try:
        check_attention_operands(val(q), val(k), val(v), val(idx), [val(x) for x in masks], m.spec)
    except SpecError as e:
        raise _Reject(f"the op would reject the operands the rewrite builds: {e}") from None
    call = em.call(torch.ops.hyscale.sparse_attention.default, [q, k, v, idx, masks, m.spec.to_json()])
    out = em.call(operator.getitem, [call, 0])
    lse = em.call(operator.getitem, [call, 1])
    if replay:
        tag_attention(call)
    roles = m.roles
    if absorbed is not None:
        out = absorbed.output(em, out)
    new = _to_layout(em, out, [roles["B"], roles["S"], roles["H"], roles["Dv"]], m.out_layout, r.pv)
    if val(new).dtype != val(r.pv).dtype:
        new = em.call(prims.convert_element_type.default, [new, val(r.pv).dtype])
    return AppliedAttention(call, q, k, v, idx, masks, out, lse, new, absorbed)


# ------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------


def _applications(walk: MaskWalk, sc: fx.Node) -> List[Tuple[fx.Node, int, Masked]]:
    """Walk forward from the scatter; returns (application node, masked arg, value)."""
    out = []
    stack = [sc]
    seen = set()
    while stack:
        n = stack.pop()
        for u in list(n.users):
            if u in seen:
                continue
            seen.add(u)
            if is_backward_node(u) or u.target in _SHAPE_QUERIES or sdpa.is_lowered(u) or sdpa.feeds_only_lowered(u):
                continue  # (a lowered fused sdpa: its math, written beside it, reads the index mask)
            if masked_softmax.reads_for_isfinite(u, n):
                continue  # (a masked_softmax's valid mask: find_region checks it where the mask meets the scores)
            i = next((j for j, a in enumerate(u.args) if a is n), -1)
            if i < 0:  # read as a keyword argument (a fused sdpa's attn_mask): an application the walk stops at
                out.append((u, i, walk.values[n]))
                continue
            m = None if _scores_side(walk.facts, u, i) else walk.step(u)
            if m is None:
                out.append((u, i, walk.values[n]))
                continue
            walk.values[u] = m
            stack.append(u)
    return out


def _scores_side(facts: GraphFacts, n: fx.Node, i: int) -> bool:
    """Whether ``n`` combines the index mask (arg ``i``) with scores (an operand downstream of a
    contraction): then it applies the mask rather than building it."""
    if n.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self):
        others = [a for j, a in enumerate(n.args) if j != i and isinstance(a, fx.Node)]
    elif n.target is aten.add.Tensor:
        others = [n.args[1 - i]]
    else:
        return False
    return any(isinstance(a, fx.Node) and a in facts.dep for a in others)


def rewrite_attention(graph: fx.Graph, facts_sources, graph_kind: str, replay: bool = True,
                      enabled: bool = True, off_reason: str = "hyscale.sparse_attention=False") -> List[AttentionRecord]:
    """Rewrite every attention that applies a selection's index mask; one record per consumer."""
    records: List[AttentionRecord] = []
    lowered = sdpa.lower_fused(graph, Emitter)  # fused sdpa nodes written out as their math
    try:
        _rewrite_all(graph, facts_sources, graph_kind, replay, enabled, off_reason, records)
    finally:
        sdpa.finish(graph, lowered)
    return records


def _rewrite_all(graph, facts_sources, graph_kind, replay, enabled, off_reason, records) -> None:
    facts = GraphFacts(graph, sources=facts_sources)
    for sel in selection_indices(graph):
        # a reducing scatter built in row chunks (Megatron's), read as the one scatter it is
        folded = {f.scatter: f for f in index_mask.fold(graph, facts, sel, Emitter)}
        walk = MaskWalk(facts, Emitter(graph, sel))
        scs = walk.scatters(sel)
        for sc, why in walk.unfollowed(sel, scs + [c for f in folded.values() for c in f.chunks]):
            records.append(AttentionRecord(sel.name, sc.name, False, why))
        for sc in scs:
            built = folded[sc].describe() if sc in folded else ""
            try:
                walk.start(sc)
                apps = _applications(walk, sc)
            except _Reject as e:
                records.append(AttentionRecord(sel.name, sc.name, False, str(e), index_mask=built))
                continue
            if not apps:
                records.append(AttentionRecord(sel.name, sc.name, False, "the index mask reaches no attention",
                                               index_mask=built))
            for app, i, masked in apps:
                rec = _rewrite_one(graph, facts, sel, app, i, masked, graph_kind, replay, enabled, off_reason)
                rec.index_mask = built
                records.append(rec)
        walk.em.rollback()  # the walk's nodes that no rewrite reads
        for f in folded.values():  # a consumer left dense reads the graph's own build again
            f.undo(graph)


def _check_capturable(m: AttentionMatch) -> None:
    """A site whose spec reads a 0-d operand on the host at each call (a run-time scale) stays
    dense where the graph will be captured as a CUDA graph on a GPU: the capture cannot read it
    (the selection's check, ``selection_pass``, does the same for the scores)."""
    from .selection_pass import _cudagraphs, _host_read_steps

    host = _host_read_steps(m.spec.as_score_spec())
    if host and _cudagraphs() and val(m.q.node).device.type == "cuda":
        raise _Reject(f"a 0-d tensor operand of the scores ({', '.join(host)}) is read on the host at each call, "
                      "which a CUDA graph (mode='reduce-overhead' or 'max-autotune') cannot capture")


def _rewrite_one(graph, facts, sel, app, i, masked, graph_kind, replay, enabled, off_reason) -> AttentionRecord:
    em = Emitter(graph, app)
    rec = AttentionRecord(sel.name, app.name, False)
    try:
        if app.target in sdpa.FUSED:
            raise _Reject(sdpa.dense_reason(app))
        if i < 0:
            raise _Reject(f"the index mask reaches {app.target} as a keyword argument, which the rewrite does not "
                          "handle")
        kernel = sdpa.rows_proof_needed(app)  # (cuDNN: rewritten only where no row is fully masked)
        finite = app.target is aten.add.Tensor and (masked.uns != -math.inf or kernel is not None)
        if app.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
            if i != 1 or masked.uns is not True or facts.constant(app.args[2]) != -math.inf:
                raise _Reject("the index mask is applied by a masked_fill that does not hide the unselected keys "
                              "with -inf")
        elif app.target is not aten.add.Tensor:
            raise _Reject(f"the index mask is applied by {app.target}, which the rewrite does not handle")
        r = find_region(facts, sel, app, i, masked)
        rec.consumer = r.pv.name
        m = analyse(facts, em, r)
        if r.valid is not None:
            _masked_softmax_terms(m)
            rec.sizes = {"softmax": "masked_softmax over isfinite(index mask)"}
        if finite:  # rewritten only where no row is left without a visible selected key
            try:
                rec.rows = visible_rows.prove(sel, masked.uns, r.chain, app, m.spec.masks, m.mask_operands,
                                              m.sizes["S"], m.sizes["T"])
                if kernel is not None:
                    rec.rows = sdpa.rows_proven(kernel, rec.rows)
            except visible_rows.NotProven as e:
                if kernel is not None:
                    raise _Reject(sdpa.rows_not_proven(kernel, str(e))) from None
                m.spec = _dense_rows_spec(m, r, masked, str(e))
                rec.rows = ("rows without a visible selected key are recomputed densely per call, as the original "
                            f"(not proven absent at compile time: {e})")
        rec.form, rec.spec, rec.sizes = m.form, m.spec.describe(), {**m.sizes, **rec.sizes}
        _check_capturable(m)
        if not enabled:
            em.rollback()
            rec.reason = f"{off_reason}; enabled, the pass would rewrite it (form {m.form})"
            return rec
        em2 = Emitter(graph, r.pv)
        before = set(graph.nodes)
        try:
            sizes0 = dict(m.sizes)
            applied = apply(em2, m, replay=replay)
            backward = ""
            if graph_kind == "joint" and applied.absorbed is not None:
                try:
                    backward = mla.rewrite_backward(graph, m, applied)
                except Unsupported as e:  # the absorbed backward does not fit: the attention runs per head
                    em2.rollback()
                    em2 = Emitter(graph, r.pv)
                    m.form, m.sizes = "per_head", {**sizes0, "latent": f"training graph: {e}"}
                    applied = apply(em2, m, replay=replay, absorb=False)
            rec.form, rec.sizes = m.form, {**m.sizes, **{k: v for k, v in rec.sizes.items() if k == "softmax"}}
            if graph_kind == "joint" and applied.absorbed is None:
                backward = rewrite_attention_backward(graph, m, applied)
        except BaseException:
            em2.rollback()
            _erase_new_nodes(graph, before)
            raise
        r.pv.replace_all_uses_with(applied.replaced)
        em.rollback()
        rec.rewritten, rec.backward = True, backward
        if backward == "sparse":
            from ..lowerings.triton_attention_backward import unsupported as triton_unsupported

            why = triton_unsupported(m.spec)
            rec.backward_impl = "on CUDA: Triton kernels" if why is None else f"on CUDA: chunked PyTorch, {why}"
        return rec
    except (_Reject, Unsupported) as e:
        em.rollback()
        rec.reason = str(e)
        return rec


def _masked_softmax_terms(m: AttentionMatch) -> None:
    """Under a masked_softmax over isfinite(M), M at the selected keys must be 0 or -inf (so that
    isfinite(M) keeps exactly the keys the op keeps): its terms are ranges and fills that hide
    with -inf. An additive tensor may hold +inf, NaN or a finite offset isfinite reads
    differently."""
    for t in m.spec.masks:
        if t.kind not in ("range", "fill") or t.value != -math.inf:
            what = "an additive tensor" if t.kind == "add" else f"a {t.kind} term hiding with {t.value}"
            raise _Reject(f"a masked_softmax over isfinite(index mask) whose index mask holds {what} at the "
                          "selected keys: isfinite may keep or drop keys the op does not (only ranges and fills "
                          "hiding with -inf are proven)")


def _dense_rows_spec(m: AttentionMatch, r: Region, masked: Masked, why: str) -> AttentionSpec:
    """The spec with ``empty_row="dense"``: the op recomputes, per call, the rows that keep
    no visible selected key over every key, with the index mask's finite fill where the
    original adds it (``AttentionSpec.dense_fill``). Raises ``_Reject`` where that run-time
    check's assumptions do not hold."""
    def dense(reason):
        return _Reject(f"the index mask hides the unselected keys with a finite value ({masked.uns}): a row with no "
                       "visible selected key would average every key in the original, no such row is proven not to "
                       f"occur ({why}), and the rows cannot be recomputed at run time: {reason}")

    fill = masked.uns
    if isinstance(fill, bool) or not (math.isfinite(fill) and fill <= visible_rows.HIDING):
        raise dense(f"the hiding value {fill} is not at most finfo(float16).min")
    if r.empty_row != "nan":
        raise dense("the softmax is a safe softmax")
    nodes = [n for n, _ in r.chain]
    after = nodes[nodes.index(r.app) + 1:]
    late = [n for n in after if n.target not in _VIEWS and n.target not in _CASTS]
    if late:  # (a softcap there would make the hidden logits ordinary numbers)
        raise dense(f"the scores pass through {late[0].name} after the index mask is added")
    # the "round" steps collect_steps records for the casts after the index mask's add
    trailing = sum(1 for n in after if n.target in _CASTS and cast_dtype(n) is not None
                   and _FLOAT_RANK.get(cast_dtype(n), 0) < _FLOAT_RANK.get(dtype_of_node(n.args[0]), 0))
    replaces = not _is_const(masked.sel)  # the add is the selected keys' mask term there
    at = len(m.spec.post) - trailing - int(replaces)
    spec = dataclasses.replace(m.spec, empty_row="dense", dense_fill=(float(fill), at, replaces))
    try:
        return spec.validate(num_mask_operands=len(m.mask_operands))
    except SpecError as e:
        raise dense(str(e)) from None


def _erase_new_nodes(graph: fx.Graph, before: set) -> None:
    """Undo a site's failed rewrite: erase every node created since ``before`` (what a second
    emitter, e.g. the backward's, added too), so that no half-built node is left out of
    order. Only possible while no earlier node reads one of them; else the graph is changed
    and the error goes on (the caller's internal-error path then reports it)."""
    new = [n for n in graph.nodes if n not in before]
    new_set = set(new)
    if any(u not in new_set for n in new for u in n.users):
        raise RuntimeError("the attention rewrite failed after rewiring the graph; it cannot be undone")
    while new:  # users first (a half-built node may stand before its own input)
        left = [n for n in new if n.users]
        for n in new:
            if not n.users:
                graph.erase_node(n)
        if len(left) == len(new):
            raise RuntimeError("the attention rewrite's new nodes read each other in a cycle")
        new = left


def rewrite_attention_backward(graph: fx.Graph, m: AttentionMatch, applied: AppliedAttention) -> str:
    """The region's backward as one ``sparse_attention_backward`` call ("sparse"), or "" when
    no gradient reaches it; raises ``_Reject`` (the whole site stays dense) otherwise.

    As in ``sparse_backward.py``: the region R is the backward nodes whose ``seq_nr`` is that
    of a forward node on a path from q, k or v to the value contraction, with the backward
    nodes between them that no forward node names (``_gap_nodes``). R must take exactly
    one gradient from outside (the output's, shaped like the value contraction) and hand
    out at most one gradient per operand, each matched to its operand through the forward
    op that shares its ``seq_nr``. Anything else (a gradient into a mask, a second reader of
    the scores' gradient, q and k one tensor) keeps the whole site dense."""
    from .sparse_backward import KeepDense, _invert_views, _same_shape, _site_nodes, backward_region, same_value

    r = m.region
    sources = {"q": m.q.node, "k": m.k.node, "v": m.v.node}
    site = _site_nodes(r.pv, set(sources.values())) - {u for u in r.pv.users if u.target is operator.getitem}
    seqs, region = backward_region(graph, site)
    if not region:
        return ""
    rset = set(region)
    for n in _gap_nodes(graph, rset, seqs):
        rset.add(n)
        region.append(n)
    grads_in = {a for x in region for a in x.all_input_nodes if a not in rset and is_backward_node(a)}
    if len(grads_in) != 1:
        raise _Reject(f"training graph: the attention's backward takes gradients from more than its output "
                      f"({', '.join(sorted(a.name for a in grads_in))}); the attention stays dense")
    g_in = grads_in.pop()
    g_like = _through_views(r.pv, g_in)
    if g_like is None:
        raise _Reject(f"training graph: the gradient entering the attention's backward ({g_in.name}) is not "
                      "shaped like its output; the attention stays dense")
    same = {role: same_value(x, site) for role, x in sources.items()}
    by_source: Dict[str, fx.Node] = {}
    for e in region:
        if all(u in rset for u in e.users):
            continue
        op = sdpa.gradient_operand(e)
        if op is not None:  # an output of a fused sdpa's backward: the gradient of the operand at its position
            owners = {role for role, x in sources.items() if op in same[role] and _same_shape(e, x)}
        else:
            owners = {role for f in seqs.get(e.meta.get("seq_nr"), ()) for role, x in sources.items()
                      if same[role] & set(f.all_input_nodes) and _same_shape(e, x)}
        if len(owners) != 1:
            raise _Reject(f"training graph: cannot tell which operand the gradient {e.name} of the attention "
                          "belongs to (a gradient into a mask or an operand used twice); the attention stays dense")
        role = owners.pop()
        if role in by_source:
            raise _Reject(f"training graph: operand {role} of the attention gets its gradient from two places; "
                          "the attention stays dense")
        by_source[role] = e
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max((g_in, applied.replaced, applied.out, applied.lse), key=lambda n: order[n])
    em = Emitter(graph, last.next)
    try:
        g = g_in
        if g_like is not r.pv:  # the gradient of a view of the value contraction (a lowered fused sdpa's output)
            g = em.call(aten.reshape.default, [g, list(val(r.pv).shape)])
        g = _invert_views(em, g, applied.replaced, applied.out)
        if val(g).dtype != val(applied.out).dtype:
            g = em.call(prims.convert_element_type.default, [g, val(applied.out).dtype])
        needs = [role in by_source for role in ("q", "k", "v")]
        delta = emit_delta(em, g, applied.out, applied.lse)
        call = em.call(BACKWARD, [g, applied.q, applied.k, applied.v, applied.idx, applied.masks, delta,
                                  applied.lse, m.spec.to_json(), *needs])
        replace = {}
        canonical = {"q": applied.q, "k": applied.k, "v": applied.v}
        for i, role in enumerate(("q", "k", "v")):
            if role in by_source:
                gi = em.call(operator.getitem, [call, i])
                gi = _invert_views(em, gi, canonical[role], sources[role])
                if sdpa.gradient_operand(by_source[role]) is not None:  # laid out as the fused backward's
                    gi = sdpa.like_strides(em, gi, val(by_source[role]))  # (the graph's views were traced on it)
                replace[by_source[role]] = gi
    except KeepDense as e:
        em.rollback()
        raise _Reject(f"training graph: {e}") from None
    except Exception:
        em.rollback()
        raise
    for e, new in replace.items():
        e.replace_all_uses_with(new, delete_user_cb=lambda u: u not in rset)
    return "sparse"


def _gap_nodes(graph: fx.Graph, rset: set, seqs: Dict[int, List[fx.Node]]) -> List[fx.Node]:
    """The backward nodes on a path from the region back into it that no forward node names
    by ``seq_nr``, in graph order. Two kinds: nodes a pass wrote without a ``seq_nr`` (a
    dynamic scale's product), and the backward of an in-place op on a view (Megatron's
    ``attention_scores += index_mask`` on a reshape of the scores): autograd numbers the
    view's and the in-place op's nodes (``CopySlices`` and the rebuilding of the base's
    gradient: ``new_empty_strided -> copy -> view -> clone -> copy -> view``), but
    functionalization leaves no forward node with those numbers. The caller's checks cover
    them as every region node: a gradient from outside that one reads is a second gradient
    in, and one read outside the region (the index mask's gradient, when the mask needs one)
    matches no operand, since no forward node shares its number; either keeps the site dense."""
    fwd = {n.meta.get("seq_nr") for n in graph.nodes if not is_backward_node(n)} - {None}
    lo, hi = min(seqs), max(seqs)

    def candidate(n: fx.Node) -> bool:
        if n.op != "call_function" or n in rset:
            return False
        sn = n.meta.get("seq_nr")
        if n.target is aten.add.Tensor and is_backward_node(n) and \
                all(a in rset or a in down for a in n.all_input_nodes):
            return True  # the engine's sum of two gradients of one forward tensor (it carries another's number)
        # (an orphan number inside the site's range: autograd numbers nodes in creation order)
        return sn is None or (is_backward_node(n) and sn not in fwd and lo < sn < hi)

    down, stack = set(), [u for r in rset for u in r.users]
    while stack:  # reached from the region through candidates
        n = stack.pop()
        if n in down or not candidate(n):
            continue
        down.add(n)
        stack.extend(n.users)
    gap: set = set()
    for n in reversed(list(graph.nodes)):  # ... that reach it again (users first)
        if n in down and any(u in rset or u in gap for u in n.users):
            gap.add(n)
    return [n for n in graph.nodes if n in gap]


def _through_views(pv: fx.Node, g: fx.Node) -> Optional[fx.Node]:
    """``pv``, or the node its one forward reader chain of views and casts reaches, that is
    shaped like the gradient ``g`` (the views keep the row-major order, so ``g`` reshaped to
    ``pv``'s shape is ``pv``'s gradient); None if none is."""
    n = pv
    for _ in range(8):
        if _same_shape(n, g) or (val(n).shape == val(g).shape and n is not pv):
            return n
        us = _forward_users(n)
        if len(us) != 1 or (us[0].target not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
                            and us[0].target not in _CASTS):
            return None
        n = us[0]
    return None


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    from .sparse_backward import _same_shape as same

    return same(a, b)


BACKWARD = torch.ops.hyscale.sparse_attention_backward.default


def emit_delta(em: Emitter, g: fx.Node, out: fx.Node, lse: fx.Node) -> fx.Node:
    """``attention_backward.attention_delta`` as graph ops before the backward op: sum_d
    dO * O in fp32, 0 where lse is -inf. Inductor fuses them into one reduction (no fp32
    copy of O), and the op's output has no reader after it, so it is freed before the
    backward op allocates (at 128K tokens the MLA latent's output is 2 GiB a layer)."""
    f32 = torch.float32

    def up(x):
        return x if val(x).dtype == f32 else em.call(prims.convert_element_type.default, [x, f32])
    d = em.call(aten.sum.dim_IntList, [em.call(aten.mul.Tensor, [up(g), up(out)]), [-1]])
    return em.call(aten.where.ScalarOther, [em.call(aten.gt.Scalar, [lse, -math.inf]), d, 0.0])
