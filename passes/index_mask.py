"""Index masks built by a reducing scatter, in row chunks, folded into the one scatter of a
constant that the attention pass (``passes/attention.py``) follows.

Megatron-Core's ``scatter_topk_into_index_mask`` (``dsa_masking.py``) builds its [B, S, T]
index mask a chunk of rows at a time (256 in the source), in place::

    index_mask = full((b, sq, skv), -inf)
    for s0 in range(0, sq, chunk):
        idx = topk_indices[:, s0:s1]
        src = where(idx >= 0, 0, -inf)                 # Megatron pads invalid slots with -1
        index_mask[:, s0:s1].scatter_reduce_(-1, idx.clamp_min(0), src, "amax", include_self=True)

Functionalized, each chunk is ``slice`` -> ``scatter_reduce.two`` -> ``slice_scatter`` into the
previous chunk's result (with one chunk the slices are no-op views, i.e. aliases). ``fold``
recognises such a chain and points its result's readers at one
``scatter.value(full, -1, idx, v)`` over every row; ``Folded.undo`` points them back (the
chain is still in the graph), so a consumer left dense keeps the graph's own build.

Why it is the same tensor, for a selection's indices (each in [0, T), distinct within a row):

* ``clamp_min(idx, c)`` with c <= 0 is ``idx`` itself, and ``idx >= c`` (c <= 0) or ``idx > c``
  (c < 0) holds at every slot, so ``where(idx >= 0, a, b)`` is the constant ``a`` at every
  slot. A -1 slot (Megatron's padding of invalid picks) cannot occur: the indices reach the
  scatter from the top-k through casts, views and row slices only. (Were one there, clamped
  to 0 with src -inf, ``amax`` with ``include_self`` would leave key 0 as it is, harmless for
  the mask; but the sparse op could not read such indices. Indices a ``where`` remaps to -1
  are not a top-k's and the attention pass reports them dense.)
* every slot's src is that one constant c, so ``amax`` (``amin``) with ``include_self``
  leaves max(fill, c) (min) at each selected key, however often it is picked; without
  ``include_self`` it leaves c; every other key keeps the fill.
* the chunks' row ranges follow one another from 0 to S: each row is scattered once, into
  rows that still hold the fill.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .canonicalize import _CASTS, GraphFacts, dtype_of_node, is_backward_node, shape_of

aten = torch.ops.aten

_REDUCERS = {"amax": max, "amin": min}
# views of the indices that keep them the indices (the same shape is the same tensor)
_SAME = (aten.clone.default, aten.alias.default, aten.view.default, aten.reshape.default,
         aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim)


@dataclasses.dataclass
class Folded:
    scatter: fx.Node  # the scatter of a constant that now stands for the chain's result
    end: fx.Node  # the chain's result
    chunks: List[fx.Node]  # the chain's scatter_reduce nodes, in row order
    reduce: str
    src: str  # the scattered value as the graph spells it

    def describe(self) -> str:
        n = len(self.chunks)
        rows = f"{n} row chunks" if n > 1 else "one chunk"
        return (f"index mask built in {rows} ({', '.join(c.name for c in self.chunks)}: scatter_reduce "
                f"({self.reduce!r}) of {self.src}), folded into one scatter of "
                f"{self.scatter.args[3]}")

    def undo(self, graph: fx.Graph) -> None:
        """Point the readers back at the chain's own result and drop the scatter."""
        self.scatter.replace_all_uses_with(self.end)
        graph.erase_node(self.scatter)


def _strip_alias(n: Any) -> Any:
    while isinstance(n, fx.Node) and n.target is aten.alias.default:
        n = n.args[0]
    return n


def _arg(n: fx.Node, i: int, name: str, default=None):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _rows_slice(n: Any, nd: int) -> Optional[Tuple[fx.Node, Any, Any]]:
    """(sliced tensor, start, end) when ``n`` is a step-1 slice along dim 1 (the rows), else None."""
    if not isinstance(n, fx.Node) or n.target is not aten.slice.Tensor:
        return None
    if _arg(n, 1, "dim", 0) % nd != 1 or _arg(n, 4, "step", 1) != 1:
        return None
    num = lambda x: x.meta.get("val") if isinstance(x, fx.Node) else x  # noqa: E731  (a SymInt under dynamic)
    rows = shape_of(n.args[0])[1]
    end = num(_arg(n, 3, "end", None))
    return n.args[0], num(_arg(n, 2, "start", 0)), rows if end is None else end


def _same(a, b) -> bool:
    return a is b or statically_known_true(a == b)


def _clamp_floor(facts: GraphFacts, n: fx.Node) -> Optional[Tuple[fx.Node, Any]]:
    """``(x, c)`` when ``n`` is ``clamp_min(x, c)`` / ``clamp(x, c)`` with a constant c <= 0."""
    if n.target is aten.clamp_min.default:
        c = n.args[1]
    elif n.target is aten.clamp.default and _arg(n, 2, "max") is None:
        c = _arg(n, 1, "min")
    else:
        return None
    c = facts.constant(c) if isinstance(c, fx.Node) else c
    return (n.args[0], c) if isinstance(c, (int, float)) and not isinstance(c, bool) and c <= 0 else None


@dataclasses.dataclass
class _Chunk:
    sr: fx.Node  # the scatter_reduce
    cur: fx.Node  # the mask it scatters into (rows lo:hi of it)
    lo: Any
    hi: Any
    piece: fx.Node  # the whole indices its index slices
    nxt: fx.Node  # the mask with the chunk written
    value: Tuple[bool, float]  # (include_self, the constant src)
    src_text: str


def _index_tensors(sel: fx.Node) -> List[fx.Node]:
    """``sel`` and the nodes that are the same indices (integer casts and shape-keeping views)."""
    want = shape_of(sel)
    out, stack = [], [sel]
    while stack:
        n = stack.pop()
        out.append(n)
        for u in n.users:
            if is_backward_node(u):
                continue
            if u.target in _SAME or (u.target in _CASTS and not dtype_of_node(u).is_floating_point
                                     and dtype_of_node(u) != torch.bool):
                stack.append(u)
    return [n for n in out if len(shape_of(n)) == 3 and len(want) == 3
            and all(_same(a, b) for a, b in zip(shape_of(n), want))]


def _chunk(facts: GraphFacts, sr: fx.Node, whole: set) -> Optional[_Chunk]:
    """``sr`` (a ``scatter_reduce.two``) as one chunk of a row-chunked index mask, or None."""
    if _arg(sr, 1, "dim") % 3 != 2 or len(shape_of(sr)) != 3:
        return None
    reduce, include_self = _arg(sr, 4, "reduce"), _arg(sr, 5, "include_self", True)
    if reduce not in _REDUCERS:
        return None
    index, src = sr.args[2], sr.args[3]
    piece = _strip_alias(index)
    floor = _clamp_floor(facts, piece) if isinstance(piece, fx.Node) else None
    at = "the indices"
    if floor is not None:
        at = f"{piece.target._opname}(idx, {floor[1]})"
        piece = _strip_alias(floor[0])
    sl = _rows_slice(piece, 3)
    if sl is not None:
        ix, lo, hi = _strip_alias(sl[0]), sl[1], sl[2]
    else:
        ix, lo, hi = piece, 0, shape_of(piece)[1] if isinstance(piece, fx.Node) else None
    if ix not in whole:
        return None
    # the src: a constant, or where(indices >= c <= 0, a, b), which is a at every slot of a selection
    value = facts.constant(src)
    text = repr(value)
    if value is None and isinstance(src, fx.Node) and src.target is aten.where.self:
        cond, a, b = src.args
        cmp_in = _strip_alias(cond.args[0]) if isinstance(cond, fx.Node) and cond.args else None
        c = facts.constant(cond.args[1]) if isinstance(cond, fx.Node) and len(cond.args) > 1 else None
        csl = _rows_slice(cmp_in, 3)
        same_rows = cmp_in is piece or (csl is not None and sl is not None and _strip_alias(csl[0]) is ix
                                        and _same(csl[1], lo) and _same(csl[2], hi))
        always = c is not None and ((cond.target is aten.ge.Scalar and c <= 0) or
                                    (cond.target is aten.gt.Scalar and c < 0))
        if same_rows and always and facts.constant(a) is not None:
            value = facts.constant(a)
            other = facts.constant(b)
            op = ">=" if cond.target is aten.ge.Scalar else ">"
            text = f"where(idx {op} {c}, {value}, {other if other is not None else b.name})"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    # the tensor it scatters into: the mask's rows lo:hi, or the whole mask
    base = _strip_alias(sr.args[0])
    bsl = _rows_slice(base, 3)
    users = [u for u in sr.users if not is_backward_node(u)]
    if bsl is not None:
        cur = bsl[0]
        if not _same(bsl[1], lo) or not _same(bsl[2], hi):
            return None
        readers = users + [w for a in users if a.target is aten.alias.default for w in a.users]
        ends = [w for w in readers if w.target is aten.slice_scatter.default and w.args[0] is cur
                and _strip_alias(w.args[1]) is sr]
        num = lambda x: x.meta.get("val") if isinstance(x, fx.Node) else x  # noqa: E731
        if len(ends) != 1 or _arg(ends[0], 2, "dim", 0) % 3 != 1 or not _same(num(_arg(ends[0], 3, "start", 0)), lo) \
                or not _same(num(_arg(ends[0], 4, "end", None)) or shape_of(cur)[1], hi):
            return None
        nxt = ends[0]
    else:
        cur, nxt = base, sr
        if not _same(lo, 0) or not _same(hi, shape_of(base)[1]):
            return None
    if dtype_of_node(sr) not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return None
    return _Chunk(sr, cur, lo, hi, ix, nxt, (bool(include_self), value), f"{text} at {at}")


def fold(graph: fx.Graph, facts: GraphFacts, sel: fx.Node, emitter_cls) -> List[Folded]:
    """Fold every row-chunked (or whole) reducing scatter of a constant at ``sel``'s indices into
    one ``scatter.value``; see the module docstring for why the value is the same."""
    whole = set(_index_tensors(sel))
    chunks: List[_Chunk] = []
    seen: set = set()
    for n in list(whole):
        stack = [n]
        while stack:  # the index's readers: row slices, clamps and aliases, down to a scatter_reduce
            m = stack.pop()
            for u in m.users:
                if u in seen or is_backward_node(u):
                    continue
                seen.add(u)
                if u.target is aten.scatter_reduce.two and len(u.args) > 2 and _strip_alias(u.args[2]) is m:
                    c = _chunk(facts, u, whole)
                    if c is not None:
                        chunks.append(c)
                elif u.target in (aten.alias.default, aten.slice.Tensor) or (_clamp_floor(facts, u) or (None,))[0] is m:
                    stack.append(u)
    by_cur: Dict[fx.Node, List[_Chunk]] = {}
    for c in chunks:
        by_cur.setdefault(c.cur, []).append(c)
    out: List[Folded] = []
    for base in list(by_cur):
        if base.target is not aten.full.default:
            continue
        fill = facts.constant(base)
        if fill is None or math.isnan(fill) or not dtype_of_node(base).is_floating_point:
            continue
        bs = shape_of(base)
        chain, cur, lo = [], base, 0
        while cur in by_cur and len(by_cur[cur]) == 1:
            c = by_cur[cur][0]
            if not _same(c.lo, lo):
                break
            chain.append(c)
            lo, cur = c.hi, c.nxt
        if not chain or not _same(lo, bs[1]) or cur in by_cur:
            continue
        # one row per row of the indices, every chunk from the same indices
        ix = chain[0].piece
        if any(c.piece is not ix for c in chain) or not all(_same(a, b) for a, b in zip(bs[:2], shape_of(ix)[:2])):
            continue
        # the intermediate results feed only the next chunk (its slice and its slice_scatter)
        inner = [c.cur for c in chain[1:]]
        chain_nodes = {x for c in chain for x in (c.sr, c.nxt)} | {a for c in chain for a in c.sr.users}
        chain_nodes |= {u for x in [base, *inner] for u in x.users if u.target is aten.slice.Tensor and
                        any(_strip_alias(c.sr.args[0]) is u for c in chain)}
        if any(u not in chain_nodes for x in inner for u in x.users if not is_backward_node(u)):
            continue
        # the value each chunk leaves at a selected key: reduce(fill, c) with include_self, else c
        reduce = _arg(chain[0].sr, 4, "reduce")
        values = {_REDUCERS[reduce](fill, c.value[1]) if c.value[0] else c.value[1] for c in chain}
        if len(values) != 1 or any(_arg(c.sr, 4, "reduce") != reduce for c in chain):
            continue
        (v,) = values
        end = cur
        em = emitter_cls(graph, end.next)
        sc = em.call(aten.scatter.value, [base, 2, ix, float(v)])
        end.replace_all_uses_with(sc, delete_user_cb=lambda u: u is not sc)
        out.append(Folded(sc, end, [c.sr for c in chain], reduce, chain[0].src_text))
    return out
