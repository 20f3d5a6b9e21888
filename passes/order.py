"""Whether anything reads the order of a top-k's outputs along k.

``topk(sorted=True)`` promises (value desc, index asc) order, and the fused kernel pays
for it with a sort of every row (DSA shape, H200: ~1.2 ms of 19.6 at 32K keys, ~7 ms of
274 at 128K; docs/performance.md). Most models never look at that order: they scatter
the indices into a mask (DeepSeek's ``full(-inf).scatter_(-1, idx, 0)``, HF's
``ones(bool).scatter(-1, idx, False)``). ``order_unread`` proves that per site, so the
rewrite can pass ``sorted=False`` without changing a single output bit.

The proof follows every use of the top-k's outputs. Ops that permute their result along
k exactly as their input was permuted (pointwise ops, casts, views that keep the k axis,
a gather at the indices) pass the question on to their own uses; it ends at uses whose
result does not depend on the order at all (a scatter of a constant, max / min over k, an
integer or boolean sum over k, a sort of the indices). Anything else (a graph output, a
float sum, a seeded random op, the backward) reads the order, and the sort stays.
"""
from __future__ import annotations

import math
import operator
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .canonicalize import is_backward_node, val

aten = torch.ops.aten
prims = torch.ops.prims

# same elements, same axes (the k axis stays where it is)
_SAME_AXES = {
    aten._to_copy.default, aten.clone.default, aten.alias.default, aten.detach.default,
    aten.lift_fresh_copy.default, prims.convert_element_type.default, aten.contiguous.default,
}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_CONSTANT_FILLS = {
    aten.full.default, aten.full_like.default, aten.ones.default, aten.ones_like.default,
    aten.zeros.default, aten.zeros_like.default, aten.scalar_tensor.default,
}
_MAXMIN = {aten.amax.default, aten.amin.default}
_MAXMIN_DIM = {aten.max.dim, aten.min.dim}
_SUMS = {aten.sum.dim_IntList, aten.sum.default, aten.any.dim, aten.any.dims, aten.any.default,
         aten.all.dim, aten.all.default}
_SORTS = {aten.sort.default, aten.sort.stable}


class _OrderRead(Exception):
    """A use reads the order (its message names the op)."""


def _name(n: fx.Node) -> str:
    if n.op == "output":
        return "the graph output"
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}" + (
            "" if t._overloadname == "default" else f".{t._overloadname}")
    return getattr(t, "__name__", str(t))


def _shape(x) -> Optional[Tuple]:
    v = val(x)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _eq(a, b) -> bool:
    return statically_known_true(a == b)


def _prod(xs) -> object:
    return math.prod(xs) if xs else 1


def _dims(arg, rank: int) -> List[int]:
    if arg is None:
        return list(range(rank))
    if isinstance(arg, int):
        arg = [arg]
    return sorted(d % rank for d in arg) if rank else []


def _is_constant_fill(n) -> bool:
    """A tensor with one value everywhere (so any permutation of it is itself)."""
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in (
            aten.expand.default, *_SAME_AXES, *_VIEWS):
        n = n.args[0]
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in _CONSTANT_FILLS


_SHAPE_ONLY = {  # read x's shape (and dtype), never its data
    aten.full_like.default, aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default,
    aten.new_full.default, aten.new_ones.default, aten.new_zeros.default, aten.new_empty.default,
    aten.sym_size.int, aten.sym_numel.default,
}


class _Defer(Exception):
    """The use has another operand derived from the top-k that is not placed yet."""


class _Walk:
    """Follows the uses of one top-k's outputs. ``axis[n]`` is n's k axis: n is the
    top-k's outputs' permutation applied along that axis (the same permutation for every
    node, since all derive from one top-k). ``distinct``: nodes whose entries along the
    axis are the top-k's own indices (distinct per row), only cast or viewed. ``reach``:
    every node the top-k's outputs reach (what depends on the order, or might)."""

    def __init__(self, topk: fx.Node):
        self.axis: Dict[fx.Node, int] = {}
        self.distinct: set = set()
        self.sinks: List[str] = []
        self.deferred: List[Tuple[fx.Node, fx.Node]] = []
        self.reach: set = set()
        stack = [topk]
        while stack:
            n = stack.pop()
            if n not in self.reach:
                self.reach.add(n)
                stack.extend(n.users)

    def add(self, n: fx.Node, axis: int, distinct: bool = False) -> None:
        if n in self.axis:
            if self.axis[n] != axis:
                raise _OrderRead(f"{_name(n)} (two k axes)")
            return
        self.axis[n] = axis
        if distinct:
            self.distinct.add(n)
        for u in list(n.users):
            try:
                self.use(n, u)
            except _Defer:
                self.deferred.append((n, u))

    def finish(self) -> None:
        """Retry the uses that waited for another operand, until none is left."""
        while self.deferred:
            todo, self.deferred = self.deferred, []
            for x, u in todo:
                try:
                    self.use(x, u)
                except _Defer:
                    self.deferred.append((x, u))
            if len(self.deferred) == len(todo):
                raise _OrderRead(f"{_name(todo[0][1])} (with an operand derived from the top-k in another way)")

    def placed(self, y: fx.Node, axis: int) -> bool:
        """True when y is permuted along ``axis`` like the outputs; False when it does not
        depend on them; _Defer while that is not known yet."""
        if y not in self.reach or _is_constant_fill(y):  # (full_like(idx, -1): shape only)
            return False
        if y in self.axis:
            if self.axis[y] != axis:
                raise _OrderRead(f"{_name(y)} (permuted along another axis)")
            return True
        raise _Defer()

    def aligned(self, x: fx.Node, out_rank: int) -> int:
        """x's k axis in a result of rank out_rank that broadcasts x from the right."""
        return self.axis[x] + out_rank - len(_shape(x))

    def use(self, x: fx.Node, u: fx.Node) -> None:
        if u.op != "call_function" or is_backward_node(u):
            raise _OrderRead("the backward" if u.op == "call_function" else _name(u))
        t, a = u.target, self.axis[x]
        xs, us = _shape(x), _shape(u)
        if t in _SHAPE_ONLY:
            return
        if t is operator.getitem:
            raise _OrderRead(_name(u))  # only multi-output ops handled below create these
        if t in _SAME_AXES:
            return self.add(u, a, x in self.distinct)
        if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags \
                and torch.Tag.nondeterministic_seeded not in t.tags and us is not None:
            # every other tensor operand is either permuted the same way (derived from
            # this top-k, same axis) or constant along the k axis (size 1 or absent there,
            # or one value everywhere)
            j = self.aligned(x, len(us))
            for y in u.all_input_nodes:
                ys = _shape(y)
                if y is x:
                    continue
                jy = j - (len(us) - len(ys)) if ys is not None else -1
                if not self.placed(y, jy) and jy >= 0 and not _eq(ys[jy], 1) and not _is_constant_fill(y):
                    raise _OrderRead(f"{_name(u)} (with an operand that varies along k)")
            return self.add(u, j)
        if t in _VIEWS:
            j = self._view_axis(xs, us, a)
            if j is None:
                raise _OrderRead(f"{_name(u)} (merges or splits the k axis)")
            return self.add(u, j, x in self.distinct)
        if t is aten.unsqueeze.default:
            d = u.args[1] % len(us)
            return self.add(u, a + (d <= a), x in self.distinct)
        if t is aten.expand.default:
            return self.add(u, self.aligned(x, len(us)))
        if t is aten.permute.default:
            return self.add(u, [p % len(xs) for p in u.args[1]].index(a), x in self.distinct)
        if t is aten.transpose.int:
            d0, d1 = u.args[1] % len(xs), u.args[2] % len(xs)
            return self.add(u, d1 if a == d0 else d0 if a == d1 else a, x in self.distinct)
        if t in (aten.squeeze.dim, aten.squeeze.dims, aten.select.int):
            ds = _dims(u.args[1], len(xs))
            if a in ds:
                raise _OrderRead(f"{_name(u)} (of the k axis)")
            return self.add(u, a - sum(d < a for d in ds))
        if t is aten.slice.Tensor:
            if (u.args[1] if len(u.args) > 1 else 0) % len(xs) == a:
                raise _OrderRead(f"{_name(u)} (of the k axis)")
            return self.add(u, a)
        if t is aten.gather.default and u.args[2] is x and u.args[0] not in self.reach:
            if u.args[1] % len(xs) != a:
                raise _OrderRead(f"{_name(u)} (along another axis)")
            return self.add(u, a)  # out[i] = src[idx[i]]: permuted with idx
        if t is aten.index_select.default and u.args[2] is x and len(xs) == 1 and u.args[0] not in self.reach:
            return self.add(u, u.args[1] % len(us))
        if t in (aten.scatter.value, aten.scatter.src):
            return self._scatter(x, u, a)
        if t in _MAXMIN or t in _SUMS:
            dim = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim")
            dims = _dims(dim if dim not in ([], ()) else None, len(xs))  # (dim=[]: all of them)
            keep = bool(u.args[2] if len(u.args) > 2 else u.kwargs.get("keepdim", False))
            if a not in dims:  # reduces other axes: still permuted along k
                return self.add(u, a if keep else a - sum(d < a for d in dims))
            return self._reduced(x, u)
        if t in _MAXMIN_DIM or t in _SORTS:
            if t is aten.sort.stable:
                dim = u.kwargs.get("dim", -1)
            else:
                dim = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", -1)
            if dim % len(xs) != a:
                raise _OrderRead(f"{_name(u)} (along another axis)")
            for g in u.users:  # the values only: the positions (argmax, sort's indices) read the order
                if g.target is not operator.getitem or (g.args[1] != 0 and g.users):
                    raise _OrderRead(f"{_name(u)}'s positions")
            return self._reduced(x, u)
        raise _OrderRead(_name(u))

    def _reduced(self, x: fx.Node, u: fx.Node) -> None:
        # over k: the result is the same for every order, except for floats: a sum rounds
        # in order, and max / min / sort return whichever of +0.0 and -0.0 came first
        if val(x).dtype.is_floating_point:
            raise _OrderRead(f"{_name(u)} (of floats over k: the result's bits can depend on the order)")
        self.sink(u)

    def sink(self, u: fx.Node) -> None:
        self.sinks.append(_name(u))

    def _scatter(self, x: fx.Node, u: fx.Node, a: int) -> None:
        # scatter(self, dim, index, value|src): out[..., index[i]] = src[i]. Permuting i
        # changes nothing when every src[i] is the same, or when src is permuted with the
        # index and the index has no repeats (else the last write would win). Reached
        # from the index or from src.
        self_, dim, index = u.args[0], u.args[1], u.args[2]
        src = u.args[3] if u.target is aten.scatter.src else None
        if self_ in self.reach or u.kwargs.get("reduce") is not None:
            raise _OrderRead(f"{_name(u)} (into a tensor derived from the top-k, or with reduce)")
        if x is not index and x is not src:
            raise _OrderRead(_name(u))
        if index not in self.axis:
            self.placed(index, a)  # (waits while the index is still to be placed)
            raise _OrderRead(f"{_name(u)} (at indices that do not come from the top-k)")
        if dim % len(_shape(u)) != self.axis[index]:
            raise _OrderRead(f"{_name(u)} (along another axis)")
        if src is not None and not _is_constant_fill(src):
            if index not in self.distinct or not self.placed(src, self.axis[index]):
                raise _OrderRead(f"{_name(u)} (of values that vary along k)")
        self.sink(u)

    @staticmethod
    def _view_axis(xs: Sequence, us: Sequence, a: int) -> Optional[int]:
        """Where a view puts x's k axis when it keeps it whole: the same size, with the
        same number of elements before and after it."""
        before, after = _prod(xs[:a]), _prod(xs[a + 1:])
        for j in range(len(us)):
            if _eq(us[j], xs[a]) and _eq(_prod(us[:j]), before) and _eq(_prod(us[j + 1:]), after):
                return j
        return None


def order_unread(topk: fx.Node, dim: int) -> Tuple[bool, str]:
    """(True, the ops where the outputs' uses end) when nothing reads the order of
    ``topk``'s outputs along ``dim``; else (False, the first op found that reads it)."""
    w = _Walk(topk)
    try:
        for g in topk.users:
            if g.op != "call_function" or g.target is not operator.getitem:
                raise _OrderRead(_name(g))
            w.add(g, dim, distinct=g.args[1] == 1)
        w.finish()
    except _OrderRead as e:
        return False, str(e)
    if not w.sinks:
        return False, "no use"  # (nothing to gain, and nothing proved)
    return True, ", ".join(sorted(set(w.sinks)))
