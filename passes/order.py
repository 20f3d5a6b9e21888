"""Whether anything reads the order of a top-k's outputs along k.

``topk(sorted=True)`` promises (value desc, index asc) order, and the fused kernel pays
for it with a sort of every row (DSA shape, H200: ~1.4 ms of 19.7 at 32K keys, ~8 ms of
272 at 128K; docs/performance.md). Most models never look at that order: they scatter
the indices into a mask (DeepSeek's ``full(-inf).scatter_(-1, idx, 0)``, HF's
``ones(bool).scatter(-1, idx, False)``). ``order_unread`` proves that per site, so the
rewrite can pass ``sorted=False`` without changing a single output bit.

Every row (one position of the other axes) of the top-k's outputs may come back in its own
order. The proof follows every use of the outputs, and for each tensor it reaches records
its *row map*: for each axis, whether it is the k axis, an axis of the top-k's output
(with the offset and stride a slice gave it), an axis the order does not vary along (a
broadcast, a new unit axis), or unknown; plus the positions fixed by ``select`` /
``squeeze``. A tensor with a row map holds, in each of its rows, one row of the top-k's
outputs in that row's order. Ops that keep that true pass the question on: pointwise ops
whose top-k-derived operands have the same row map (so that each row is combined with
itself), casts, views that keep the k axis whole, unsqueeze / expand / permute / select /
slice / squeeze, a gather at the indices, reductions over axes the order does not vary
along. The question ends at uses whose result cannot depend on the order: a scatter of a
constant (or of values paired with indices that cannot repeat), a scatter_reduce "amax" /
"amin" of constants without -0.0 or NaN (Megatron's row-chunked index mask), integer max / min / sum /
any / all over k, the values of a sort of the indices, the indices operand of
``hyscale.sparse_attention`` (which reads each row as a set of keys, in any deterministic
order: passes/attention.py keeps the selection unsorted behind it). Anything else (a graph output, a
float reduction over k, a seeded random op, the backward) reads the order, and the sort
stays. tests/test_order.py checks the outputs' bits against shuffled unsorted rows.
"""
from __future__ import annotations

import collections
import math
import operator
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .canonicalize import is_backward_node, val

aten = torch.ops.aten
prims = torch.ops.prims

# same elements, same axes
_SAME_AXES = {
    aten._to_copy.default, aten.clone.default, aten.alias.default, aten.detach.default,
    aten.lift_fresh_copy.default, prims.convert_element_type.default, aten.contiguous.default,
}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_CONSTANT_FILLS = {
    aten.full.default, aten.full_like.default, aten.ones.default, aten.ones_like.default,
    aten.zeros.default, aten.zeros_like.default, aten.scalar_tensor.default,
}
_SHAPE_ONLY = {  # read the input's shape (and dtype), never its data
    aten.full_like.default, aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default,
    aten.new_full.default, aten.new_ones.default, aten.new_zeros.default, aten.new_empty.default,
    aten.sym_size.int, aten.sym_numel.default,
}
_MAXMIN = {aten.amax.default, aten.amin.default}
_MAXMIN_DIM = {aten.max.dim, aten.min.dim}
_SUMS = {aten.sum.dim_IntList, aten.sum.default, aten.any.dim, aten.any.dims, aten.any.default,
         aten.all.dim, aten.all.default}
_SORTS = {aten.sort.default, aten.sort.stable}
# index dtypes a cast keeps distinct (the top-k's indices fit int32: T < 2**31 for the op)
_WIDE_INTS = (torch.int32, torch.int64)

def _sparse_attention():
    from ..lowerings import attention_ops  # noqa: F401  (registers the op)

    return torch.ops.hyscale.sparse_attention.default


K_AXIS = "k"
FREE = None  # an axis the order does not vary along


class _Unknown:
    """An axis whose rows cannot be matched with anything (each instance equals only itself)."""

    def __repr__(self):
        return "?"


class _OrderRead(Exception):
    """A use reads the order (its message names the op)."""


class _Defer(Exception):
    """A use has another operand derived from the top-k whose row map is not known yet."""


def _name(n: fx.Node) -> str:
    if n.op == "output":
        return "the graph output"
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}" + (
            "" if t._overloadname == "default" else f".{t._overloadname}")
    return getattr(t, "__name__", str(t))


def _shape(x) -> Tuple:
    v = val(x)
    if not isinstance(v, torch.Tensor):
        raise _OrderRead(f"{_name(x)} (no tensor metadata)")
    return tuple(v.shape)


def _eq(a, b) -> bool:
    return statically_known_true(a == b)


def _is_one(s) -> bool:
    return _eq(s, 1)


def _dims(arg, rank: int) -> List[int]:
    if arg is None or arg == [] or arg == ():
        return list(range(rank))
    if isinstance(arg, int):
        arg = [arg]
    return sorted(d % rank for d in arg) if rank else []


def _under_views(n):
    """The tensor under ``n``'s expands, casts and views (the same values, moved or repeated)."""
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in (
            aten.expand.default, *_SAME_AXES, *_VIEWS):
        n = n.args[0]
    return n


def _constant_value(n):
    """The one value of a constant (a Python number or a constant fill), else None."""
    if isinstance(n, (int, float, bool)):
        return n
    n = _under_views(n)
    if not (isinstance(n, fx.Node) and n.op == "call_function"):
        return None
    t = n.target
    if t in (aten.zeros.default, aten.zeros_like.default):
        return 0
    if t in (aten.ones.default, aten.ones_like.default):
        return 1
    if t is aten.scalar_tensor.default:
        return n.args[0]
    if t in (aten.full.default, aten.full_like.default):
        return n.args[1]
    return None


def _exact_extremes(src) -> bool:
    """Every value of ``src`` is one whose max / min against the others cannot depend on the
    order: an integer or bool tensor, or values drawn from float constants (a constant fill,
    or a ``where`` between two such) none of which is -0.0 or NaN."""
    v = val(src) if isinstance(src, fx.Node) else None
    if isinstance(v, torch.Tensor) and not v.dtype.is_floating_point and not v.dtype.is_complex:
        return True

    def exact(c) -> bool:
        c = _constant_value(c)
        return isinstance(c, (int, float, bool)) and not math.isnan(c) and not (c == 0 and math.copysign(1, c) < 0)
    src = _under_views(src)
    if isinstance(src, fx.Node) and src.op == "call_function" and src.target in (
            aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar):
        return exact(src.args[1]) and exact(src.args[2])
    return exact(src)


def _is_constant_fill(n) -> bool:
    """A tensor with one value everywhere (so any permutation of it is itself)."""
    n = _under_views(n)
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in _CONSTANT_FILLS


class RowMap:
    """Where each axis of a tensor comes from: K_AXIS; (d, start, step), the top-k output's
    axis d from ``start`` every ``step``; ("rep", d, i), the top-k output's row i of axis d
    repeated along this axis; FREE; or an _Unknown. ``fixed``: the top-k output's axes
    that a select or squeeze pinned, with their positions."""

    def __init__(self, axes: Sequence, fixed=frozenset()):
        self.axes = tuple(axes)
        self.fixed = frozenset(fixed)

    @property
    def k(self) -> int:
        return self.axes.index(K_AXIS)

    def same_rows(self, other: "RowMap") -> bool:
        return self.axes == other.axes and self.fixed == other.fixed

    def with_axes(self, axes, fixed=None) -> "RowMap":
        return RowMap(axes, self.fixed if fixed is None else fixed)


def _pin(entry, pos, fixed: set) -> None:
    """Record that an axis with row-map ``entry`` was reduced to its position ``pos``."""
    if isinstance(entry, tuple) and entry[0] != "rep" and isinstance(pos, int):
        fixed.add((entry[0], entry[1] + pos * entry[2]))
    elif isinstance(entry, tuple) and entry[0] == "rep":
        fixed.add((entry[1], entry[2]))
    elif entry is not FREE:
        fixed.add((_Unknown(), 0))  # matches nothing


class _Walk:
    """Follows the uses of one top-k's outputs with a worklist. ``rows[n]``: n's row map.
    ``distinct``: nodes whose entries along k are the top-k's own indices (distinct in each
    row), cast only to wide integers or moved between axes. ``reach``: every node the
    outputs reach (what may depend on the order)."""

    def __init__(self, topk: fx.Node):
        self.rows: Dict[fx.Node, RowMap] = {}
        self.distinct: set = set()
        self.sinks: List[str] = []
        # (tensor, its use): inputs that may depend on the top-k only through order-free uses
        self.order_free_inputs: List[Tuple[fx.Node, fx.Node]] = []
        self.reach: set = set()
        self.work = collections.deque()
        stack = [topk]
        while stack:
            n = stack.pop()
            if n not in self.reach:
                self.reach.add(n)
                stack.extend(n.users)

    def add(self, n: fx.Node, rows: RowMap, distinct: bool = False) -> None:
        if n in self.rows:
            if not self.rows[n].same_rows(rows):
                raise _OrderRead(f"{_name(n)} (reached with two row maps)")
            return
        if len(rows.axes) != len(_shape(n)) or rows.axes.count(K_AXIS) != 1:
            raise _OrderRead(f"{_name(n)} (internal: row map of the wrong rank)")
        self.rows[n] = rows
        if distinct:
            self.distinct.add(n)
        self.work.extend((n, u) for u in n.users)

    def run(self) -> None:
        """Process every use; one that waits for another operand's row map goes back in the
        queue, until a whole round over the waiting ones makes no progress."""
        waiting: list = []
        progress = True
        while self.work or waiting:
            if not self.work:
                if not progress:
                    raise _OrderRead(f"{_name(waiting[0][1])} (an operand derived from the top-k another way)")
                self.work.extend(waiting)
                waiting, progress = [], False
            x, u = self.work.popleft()
            try:
                self.use(x, u)
                progress = True
            except _Defer:
                waiting.append((x, u))

    def rows_of(self, y: fx.Node) -> Optional[RowMap]:
        """y's row map; None when y does not depend on the top-k (or is one value
        everywhere); _Defer while y's is not known yet."""
        if y not in self.reach or _is_constant_fill(y):
            return None
        if y in self.rows:
            return self.rows[y]
        raise _Defer()

    # -- one use ---------------------------------------------------------------------------
    def use(self, x: fx.Node, u: fx.Node) -> None:
        if u.op != "call_function" or is_backward_node(u):
            raise _OrderRead("the backward" if u.op == "call_function" else _name(u))
        t, r = u.target, self.rows[x]
        a = r.k
        if t in _SHAPE_ONLY:
            return
        if t is operator.getitem:
            raise _OrderRead(_name(u))  # only the multi-output ops handled below make these
        xs = _shape(x)
        us = tuple(val(u).shape) if isinstance(val(u), torch.Tensor) else None  # (None: several outputs)
        dist = x in self.distinct
        if t in _SAME_AXES:
            keeps = dist and val(u).dtype in _WIDE_INTS and val(x).dtype in _WIDE_INTS
            return self.add(u, r, keeps)
        if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags \
                and torch.Tag.nondeterministic_seeded not in t.tags and us is not None:
            return self.add(u, self._pointwise(x, u, us))
        if t in _VIEWS:
            return self.add(u, self._view(r, xs, us), dist)
        if t is aten.unsqueeze.default:
            d = u.args[1] % len(us)
            return self.add(u, r.with_axes(r.axes[:d] + (FREE,) + r.axes[d:]), dist)
        if t is aten.expand.default:
            lead = len(us) - len(xs)
            axes = [FREE] * lead + [self._broadcast(e, xs[i], us[lead + i]) for i, e in enumerate(r.axes)]
            return self.add(u, r.with_axes(axes), dist)
        if t is aten.permute.default:
            perm = [p % len(xs) for p in u.args[1]]
            return self.add(u, r.with_axes([r.axes[p] for p in perm]), dist)
        if t is aten.transpose.int:
            d0, d1 = u.args[1] % len(xs), u.args[2] % len(xs)
            axes = list(r.axes)
            axes[d0], axes[d1] = axes[d1], axes[d0]
            return self.add(u, r.with_axes(axes), dist)
        if t in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
            ds = _dims(u.args[1] if len(u.args) > 1 else None, len(xs))
            ds = [d for d in ds if _is_one(xs[d])]  # (squeezing an axis longer than 1 does nothing)
            return self.add(u, self._drop(r, {d: 0 for d in ds}, "squeeze"), dist)
        if t is aten.select.int:
            d, i = u.args[1] % len(xs), u.args[2]
            if isinstance(i, int) and i < 0 and isinstance(xs[d], int):
                i += xs[d]
            return self.add(u, self._drop(r, {d: i}, "select"), dist)
        if t is aten.slice.Tensor:
            return self.add(u, self._slice(r, u, xs), dist)
        if t is aten.gather.default and u.args[2] is x and u.args[0] not in self.reach:
            if u.args[1] % len(xs) != a:
                raise _OrderRead(f"{_name(u)} (along another axis)")
            return self.add(u, r)  # out[..., i] = src[..., idx[..., i]]: permuted with idx
        if t is aten.index_select.default and u.args[2] is x and len(xs) == 1 and u.args[0] not in self.reach:
            d = u.args[1] % len(us)
            return self.add(u, r.with_axes([K_AXIS if i == d else FREE for i in range(len(us))]))
        if t in (aten.scatter.value, aten.scatter.src):
            return self._scatter(x, u)
        if t is aten.scatter_reduce.two:
            return self._scatter_extreme(x, u)
        if t is _sparse_attention():
            return self._attention_indices(x, u)
        if t in _MAXMIN or t in _SUMS:
            dim = u.args[1] if len(u.args) > 1 else u.kwargs.get("dim")
            if t in (aten.sum.default, aten.any.default, aten.all.default):
                dim = None
            dims = _dims(dim, len(xs))
            keep = bool(u.args[2] if len(u.args) > 2 else u.kwargs.get("keepdim", False))
            return self._reduce(x, u, r, dims, keep)
        if t in _MAXMIN_DIM or t in _SORTS:
            dim = u.kwargs.get("dim", -1) if t is aten.sort.stable else (
                u.args[1] if len(u.args) > 1 else u.kwargs.get("dim", -1))
            if dim % len(xs) != a:
                raise _OrderRead(f"{_name(u)} (along another axis)")
            for g in u.users:  # the values only: the positions (argmax, sort's indices) read the order
                if g.target is not operator.getitem or (g.args[1] != 0 and g.users):
                    raise _OrderRead(f"{_name(u)}'s positions")
            self._order_free_over_k(x, u)
            return None
        raise _OrderRead(_name(u))

    # -- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _broadcast(entry, size_in, size_out):
        """An axis of size ``size_in`` broadcast to ``size_out``."""
        if entry is K_AXIS or not _is_one(size_in) or _is_one(size_out):
            return entry
        if isinstance(entry, tuple) and entry[0] != "rep":
            return ("rep", entry[0], entry[1])  # one row, repeated
        return entry  # FREE, a repeat, or unknown

    def _pointwise(self, x: fx.Node, u: fx.Node, us) -> RowMap:
        # Every other tensor operand either depends on the top-k with the same row map
        # (each row combined with itself) or does not, and is then constant along k.
        out = None
        for y in u.all_input_nodes:
            ys = _shape(y)
            ry = self.rows_of(y) if y is not x else self.rows[x]
            lead = len(us) - len(ys)
            if ry is None:
                a = self.rows[x].k + len(us) - len(_shape(x)) - lead  # the k axis in y's axes
                if 0 <= a < len(ys) and not _is_one(ys[a]) and not _is_constant_fill(y):
                    raise _OrderRead(f"{_name(u)} (with an operand that varies along k)")
                continue
            axes = [FREE] * lead + [self._broadcast(e, ys[i], us[lead + i]) for i, e in enumerate(ry.axes)]
            ry = ry.with_axes(axes)
            if out is not None and not out.same_rows(ry):
                raise _OrderRead(f"{_name(u)} (combines different rows of the top-k)")
            out = ry
        return out

    def _view(self, r: RowMap, xs, us) -> RowMap:
        """A view that keeps the k axis whole, and every other axis longer than 1 in order,
        maps them across; one that merges or splits other axes leaves them unknown."""
        a = r.k
        before = math.prod(xs[:a]) if a else 1
        after = math.prod(xs[a + 1:]) if a + 1 < len(xs) else 1
        j = next((j for j in range(len(us)) if _eq(us[j], xs[a]) and _eq(math.prod(us[:j]) if j else 1, before)
                  and _eq(math.prod(us[j + 1:]) if j + 1 < len(us) else 1, after)), None)
        if j is None:
            raise _OrderRead("aten.view (merges or splits the k axis)")
        fixed = set(r.fixed)
        src = [i for i in range(len(xs)) if i != a and not _is_one(xs[i])]
        dst = [i for i in range(len(us)) if i != j and not _is_one(us[i])]
        axes: List = [FREE] * len(us)
        axes[j] = K_AXIS
        if len(src) == len(dst) and all(_eq(xs[s], us[d]) for s, d in zip(src, dst)) and \
                all((s < a) == (d < j) for s, d in zip(src, dst)):
            for s, d in zip(src, dst):
                axes[d] = r.axes[s]
            for i in range(len(xs)):  # unit axes dropped by the view: their one position
                if i != a and _is_one(xs[i]):
                    _pin(r.axes[i], 0, fixed)
        else:
            for d in dst:
                axes[d] = _Unknown()
        return r.with_axes(axes, fixed)

    @staticmethod
    def _drop(r: RowMap, pos: Dict[int, object], what: str) -> RowMap:
        if r.k in pos:
            raise _OrderRead(f"aten.{what} (of the k axis)")
        fixed = set(r.fixed)
        for d, p in pos.items():
            _pin(r.axes[d], p, fixed)
        return r.with_axes([e for i, e in enumerate(r.axes) if i not in pos], fixed)

    @staticmethod
    def _slice(r: RowMap, u: fx.Node, xs) -> RowMap:
        d = (u.args[1] if len(u.args) > 1 else 0) % len(xs)
        start = u.args[2] if len(u.args) > 2 else None
        end = u.args[3] if len(u.args) > 3 else None
        step = u.args[4] if len(u.args) > 4 else 1
        start = 0 if start is None else start
        if d == r.k:
            whole = start == 0 and step == 1 and (end is None or statically_known_true(xs[d] <= end))
            if not whole:
                raise _OrderRead("aten.slice (of the k axis)")
            return r
        axes = list(r.axes)
        e = axes[d]
        if isinstance(e, tuple) and e[0] != "rep" and isinstance(start, int) and start >= 0 and isinstance(step, int):
            axes[d] = (e[0], e[1] + start * e[2], e[2] * step)
        elif e is not FREE and not (isinstance(e, tuple) and e[0] == "rep"):
            axes[d] = _Unknown()
        return r.with_axes(axes)

    def _reduce(self, x: fx.Node, u: fx.Node, r: RowMap, dims: List[int], keep: bool) -> None:
        a = r.k
        if a in dims:  # over k (and maybe more): a function of the rows' multisets
            return self._order_free_over_k(x, u)
        for d in dims:  # across rows only: merges their different orders
            e = r.axes[d]
            if not (e is FREE or (isinstance(e, tuple) and e[0] == "rep")):
                raise _OrderRead(f"{_name(u)} (across rows of the top-k)")
        axes = [FREE if (i in dims and keep) else e for i, e in enumerate(r.axes) if keep or i not in dims]
        self.add(u, r.with_axes(axes))

    def _order_free_over_k(self, x: fx.Node, u: fx.Node) -> None:
        # over k: the result is the same for every order, except for floats: a sum rounds in
        # order, and max / min / sort return whichever of +0.0 and -0.0 came first
        out = val(u)
        out_dtypes = [o.dtype for o in out] if isinstance(out, (tuple, list)) else [out.dtype]
        if val(x).dtype.is_floating_point or any(d.is_floating_point for d in out_dtypes) or \
                u.kwargs.get("dtype") is not None and u.kwargs["dtype"].is_floating_point:
            raise _OrderRead(f"{_name(u)} (of floats over k: the result's bits can depend on the order)")
        self.sinks.append(_name(u))

    def _attention_indices(self, x: fx.Node, u: fx.Node) -> None:
        # hyscale.sparse_attention(q, k, v, idx, ...) reads each row of idx as a set of keys
        # (attention_spec.py: "in any order"): any deterministic order gives its result
        # within the contract's numerics, as the dense attention's key order does. Only as
        # the indices operand, with k the last axis and each row one row of the top-k's.
        r = self.rows[x]
        if u.args[3] is not x or any(a is x for a in u.args[:3]) or x not in self.distinct:
            raise _OrderRead(f"{_name(u)} (not as its distinct indices operand)")
        if r.k != len(r.axes) - 1 or r.fixed or r.axes[:-1] != tuple((d, 0, 1) for d in range(len(r.axes) - 1)):
            raise _OrderRead(f"{_name(u)} (indices whose rows are not the top-k's rows)")
        self.sinks.append(_name(u))

    def _scatter_extreme(self, x: fx.Node, u: fx.Node) -> None:
        # scatter_reduce(self, dim, index, src, "amax" | "amin"): out[..., t] = the extreme of
        # self's value and every src[i] with index[i] = t. The extreme of a multiset does not
        # depend on the order it is met in, repeats included (Megatron clamps its indices), except
        # between values that compare equal with other bits (+0.0 / -0.0, NaNs): so src takes
        # its values from constants that are neither (``_exact_extremes``), and where it varies
        # it is permuted with the index. ``self`` may come from the top-k through uses that are
        # themselves order-free (the previous row chunk's scatter): checked after the walk.
        self_, dim, index, src, reduce = u.args[:5]
        if reduce not in ("amax", "amin"):
            raise _OrderRead(f"{_name(u)} (reduce={reduce!r})")
        ri = self._scatter_rows(x, u, dim, index, src)
        if not _exact_extremes(src):
            raise _OrderRead(f"{_name(u)} (of values whose {reduce} can depend on the order: not constants "
                             "without -0.0 and NaN)")
        if not _is_constant_fill(src):
            rs = self.rows_of(src)
            if rs is None or not rs.same_rows(ri) or _shape(src) != _shape(index):
                raise _OrderRead(f"{_name(u)} (of values that vary along k, not with the indices)")
        if self_ in self.reach:
            self.order_free_inputs.append((self_, u))
        self.sinks.append(_name(u))

    def _scatter_rows(self, x: fx.Node, u: fx.Node, dim: int, index: fx.Node, src) -> RowMap:
        """The row map of a scatter's ``index``, reached as its index or its src, scattering
        along the top-k's k axis."""
        if x is not index and x is not src:
            raise _OrderRead(_name(u))
        ri = self.rows_of(index)
        if ri is None:
            raise _OrderRead(f"{_name(u)} (at indices that do not come from the top-k)")
        if dim % len(_shape(u)) != ri.k:
            raise _OrderRead(f"{_name(u)} (along another axis)")
        return ri

    def _scatter(self, x: fx.Node, u: fx.Node) -> None:
        # scatter(self, dim, index, value|src): out[..., index[i]] = src[i]. Permuting i
        # changes nothing when every src[i] is the same, or when src is permuted with the
        # index (same row map) and the index cannot repeat (else the last write would win).
        # Reached from the index or from src.
        self_, dim, index = u.args[0], u.args[1], u.args[2]
        src = u.args[3] if u.target is aten.scatter.src else None
        if self_ in self.reach or u.kwargs.get("reduce") is not None:
            raise _OrderRead(f"{_name(u)} (into a tensor derived from the top-k, or with reduce)")
        ri = self._scatter_rows(x, u, dim, index, src)
        if src is not None and not _is_constant_fill(src):
            rs = self.rows_of(src)
            if index not in self.distinct or rs is None or not rs.same_rows(ri) or _shape(src) != _shape(index):
                raise _OrderRead(f"{_name(u)} (of values that vary along k)")
        self.sinks.append(_name(u))


def order_unread(topk: fx.Node, dim: int) -> Tuple[bool, str]:
    """(True, the ops where the outputs' uses end) when nothing reads the order of
    ``topk``'s outputs along ``dim``; else (False, the first op found that reads it)."""
    w = _Walk(topk)
    try:
        shape = _shape(topk.args[0])
        identity = RowMap([K_AXIS if i == dim else (i, 0, 1) for i in range(len(shape))])
        for g in topk.users:
            if g.op != "call_function" or g.target is not operator.getitem:
                raise _OrderRead(_name(g))
            w.add(g, identity, distinct=g.args[1] == 1)
        w.run()
        # every use of a tensor holding the order was followed, so one reached from the top-k
        # without a row map depends on it only through order-free uses
        for x, u in w.order_free_inputs:
            if x in w.rows:
                raise _OrderRead(f"{_name(u)} (into a tensor that holds the top-k's order)")
    except _OrderRead as e:
        return False, str(e)
    if not w.sinks:
        return False, "no use"  # (nothing to gain, and nothing proved)
    return True, ", ".join(sorted(set(w.sinks)))
