"""Whether every row of an attention keeps a visible selected key, so that an index mask
which hides the unselected keys with a *finite* value may be rewritten.

HF DeepSeek-V3.2 and GLM-5 (eager) spell the index mask
``attention_mask.masked_fill(ones(bool).scatter(idx, False), finfo.min)``. Over the k
selected keys, ``hyscale.sparse_attention`` is the dense original exactly on every row that
has a selected key the attention's other masks leave visible: there the row's maximum logit
L is such a key's ordinary logit, and an unselected key's logit ``s + finfo.min`` gives
``exp(s + finfo.min - L) == 0`` in fp32, as in the original. A row whose selected keys are
all hidden is different: the original is a uniform mean over every key (all T logits are
``finfo.min``, absorbed), the op a mean over its k slots. ``prove`` shows from the graph
that no such row occurs:

1. **The selection hides at least what the attention hides.** Every key-range half-line
   of the attention's mask terms (``{t < lo}``, ``{t >= hi}``, the canonical ranges of
   ``canonicalize``) is one of the selection's own, with a bound that is the same graph
   value at the same row (the same node read along the same batch and query axes; HF adds
   the attention's 4-d mask to the indexer's scores as ``attention_mask[:, 0]``, so both
   canonicalize to the same bounds). So a key the selection leaves visible is visible in
   the attention.
2. **The selection leaves a key visible in every row**: one key X(s) = s + c lies in every
   range of the selection and in [0, T) (the causal diagonal: a bound ``hi = q_pos + 1``
   with ``q_pos[b, s] = s`` an arange looked up at the query index, a packed-sequence
   bound ``searchsorted(doc[b], doc[b, s])``, which is <= s, and its right-side twin, which
   is >= s + 1, because ``doc`` is non-decreasing; constant bounds as they are).
3. **Hence the top-k selects one.** The selection hides with -inf or with a value of at most
   ``finfo(float16).min`` added to or put in place of the score, as its last step; k >= 1.
   A visible key's score beats every hidden one, so the row's top-1 is visible in the
   selection, hence (1) in the attention.

Assumptions, stated: the selection's scores are finite and far from the hiding value
(|s| < |finfo.min| / 2: a ReLU'd weighted dot product is), and the attention's logits
spread by less than |hidden value| - 104 within a row (so that ``exp`` of a hidden logit
minus the row maximum underflows to 0 in fp32, as it does in the original). A NaN or
infinite selection score voids (3): the top-k may then pick hidden keys (the selection's
output is then meaningless already). The attention's index-mask add must be its last
score step (views and casts aside): a later step (a softcap) would make the unselected
keys' logits ordinary numbers.

The same proof admits a fused cuDNN sdpa node (``sdpa.ROWS_PROOF``), whose fully masked row
is no ``empty_row`` of the op: HF's ``attention_mask & ~index_mask`` reaches it as sdpa's
additive bias, ``where(~mask, -65504, 0)`` (or a -inf bias), whose hidden keys are the
attention's own bool terms (ranges the selection shares, as above) and the unselected keys;
with -inf the exp of a hidden logit is 0 outright.

Anything else is not proven, with the reason: tensor masks (a padding mask, whose fully
padded rows have no visible key), a range the selection does not share, bounds that are
not positions or constants, a selection left as ``aten.topk`` or selected from a table (no
canonical mask recorded). The pass then rewrites the site with ``empty_row="dense"``, which
finds such rows at run time and recomputes them densely (``attention_reference.
dense_rows_forward``), and keeps a fused sdpa kernel's site dense.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..lowerings.spec import MaskTerm
from . import layout as L
from .canonicalize import (_CASTS, _VIEWS, Bound, OperandPlan, SearchBound, _arange_offset, _iota_source,
                           _non_decreasing, dtype_of_node, shape_of, val)

aten = torch.ops.aten
prims = torch.ops.prims

META = "hyscale_selection_masks"
# a hiding value at most this (every float dtype's finfo.min is) puts a hidden score below
# every visible one, under the stated assumption on the scores
HIDING = torch.finfo(torch.float16).min


class NotProven(Exception):
    """The message says which step of the proof fails."""


@dataclasses.dataclass
class SelectionMasks:
    """A fused selection's canonical mask (``canonicalize.SiteMatch``), recorded on its op
    node by the selection pass for this proof: the terms, their operands (with groups
    [B, S] / [B, T]), the post steps, k, T, and whether its rows are the indices' rows
    ((batch, query) in the indices' order)."""

    masks: Tuple[MaskTerm, ...]
    operands: List[Any]
    post: Tuple[tuple, ...]
    k: Any
    T: Any
    rows_ordered: bool

    @staticmethod
    def of(m) -> "SelectionMasks":
        T = m.roles["T"]
        rows = [x for x in L.labels(m.score_layout) if x not in T]
        ordered = len(T) == 1 and len(m.roles["S"]) == 1 and len(m.roles["B"]) <= 1 and \
            rows == m.roles["B"] + m.roles["S"]
        return SelectionMasks(tuple(m.spec.masks), list(m.mask_operands), tuple(m.spec.post), m.k_arg,
                              m.sizes["T"], ordered)


def record(call: fx.Node, m) -> None:
    call.meta[META] = SelectionMasks.of(m)


def forget(graph: fx.Graph) -> None:
    """Drop the records (they hold nodes; nothing after the passes reads them)."""
    for n in graph.nodes:
        n.meta.pop(META, None)


def selection_masks(idx: fx.Node) -> Optional[SelectionMasks]:
    """The record of the selection whose indices are ``idx`` (the op node or its getitem)."""
    n = idx.args[0] if idx.target is operator.getitem else idx
    return n.meta.get(META)


def _static(cond) -> bool:
    return bool(cond) if isinstance(cond, bool) else statically_known_true(cond)


# ------------------------------------------------------------------------------------------
# bound identity: the same graph value at the same row
# ------------------------------------------------------------------------------------------


def _roles(p: OperandPlan) -> tuple:
    """Per dim of ``p.node``: which canonical group (0: batch, 1: query / key) each axis is."""
    out = []
    for d in p.layout:
        out.append(tuple(next((i for i, g in enumerate(p.groups or []) if a.label in g), None)
                         for a in d if not a.bcast))
    return tuple(out)


def _plan_key(p) -> tuple:
    if isinstance(p, SearchBound):
        return ("search", _plan_key(p.sorted), _plan_key(p.values), p.right)
    return ("tensor", p.node, _roles(p))


def _bound_key(b: Bound) -> tuple:
    return (b.const, tuple(sorted(((c, _plan_key(p)) for c, p in b.terms), key=repr)))


# ------------------------------------------------------------------------------------------
# positions: a per-row tensor whose value at row (b, s) is s + c
# ------------------------------------------------------------------------------------------


def _arange_dim(n) -> Optional[Tuple[int, int]]:
    """(d, c) when ``n``'s value at any index i is i[d] + c (an integer arange offset by a
    constant, unsqueezed, expanded, or looked up at such an index), else None."""
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return None
    t = n.target
    if dtype_of_node(n).is_floating_point or dtype_of_node(n) == torch.bool:
        return None
    if t is prims.iota.default:
        start, step = n.kwargs.get("start", 0), n.kwargs.get("step", 1)
        return (0, start) if isinstance(start, int) and step == 1 else None
    if t in (aten.clone.default, aten.alias.default) or t in _CASTS:
        return _arange_dim(n.args[0])
    if t is aten.unsqueeze.default:
        r = _arange_dim(n.args[0])
        if r is None:
            return None
        d = n.args[1] % len(shape_of(n))
        return (r[0] + (1 if d <= r[0] else 0), r[1])
    if t is aten.expand.default:
        src = n.args[0]
        r = _arange_dim(src)
        if r is None:
            return None
        pad = len(shape_of(n)) - len(shape_of(src))
        if not L.same_size(shape_of(src)[r[0]], shape_of(n)[r[0] + pad]):
            return None  # the varying dim itself broadcast: one value repeated
        return (r[0] + pad, r[1])
    if t in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar) and n.kwargs.get("alpha", 1) == 1:
        b = n.args[1]
        if not (isinstance(b, int) and not isinstance(b, bool)):
            return None
        r = _arange_dim(n.args[0])
        return None if r is None else (r[0], r[1] + (b if t in (aten.add.Tensor, aten.add.Scalar) else -b))
    if t is aten.index.Tensor:
        # src[i0, ..., i_last] with every row of src an arange along its last dim (+ c0): the
        # value is i_last + c0, and i_last broadcasts (right-aligned) into the result
        src, idxs = n.args[0], n.args[1]
        c0 = _arange_offset(src)
        if c0 is None or len(idxs) != len(shape_of(src)) or not all(isinstance(i, fx.Node) for i in idxs):
            return None
        r = _arange_dim(idxs[-1])
        if r is None:
            return None
        pad = len(shape_of(n)) - len(shape_of(idxs[-1]))
        if not L.same_size(shape_of(idxs[-1])[r[0]], shape_of(n)[r[0] + pad]):
            return None
        return (r[0] + pad, r[1] + c0)
    return None


def _query_dim(p: OperandPlan) -> int:
    """The one dim of ``p.node`` that carries the query axis."""
    dims = [d for d, roles in enumerate(_roles(p)) if 1 in roles]
    if len(dims) != 1 or _roles(p)[dims[0]] != (1,):
        raise NotProven(f"the mask bound {p.node.name} does not vary along one query axis")
    return dims[0]


def _position(p: OperandPlan) -> int:
    """c when ``p``'s value at row (b, s) is s + c."""
    r = _arange_dim(p.node)
    if r is None or r[0] != _query_dim(p):
        raise NotProven(f"the mask bound {p.node.name} is not the query's position (an arange along the queries)")
    return r[1]


def _search_position(sb: SearchBound) -> int:
    """c when the search's value at row (b, s) is doc[b, s + c], ``doc`` its sorted row."""
    v, doc = sb.values.node, sb.sorted.node
    if not (v.target is aten.index.Tensor and v.args[0] is doc and len(v.args[1]) == 2
            and all(isinstance(i, fx.Node) for i in v.args[1])):
        raise NotProven(f"the document bound's value {v.name} is not its id row read at the query")
    if not _non_decreasing(doc) or _iota_source(v.args[1][0], shape_of(doc)[0]) is None:
        raise NotProven(f"the document ids {doc.name} are not proven sorted rows picked by the batch index")
    pos = v.args[1][1]
    r = _arange_dim(pos)
    pad = len(shape_of(v)) - len(shape_of(pos))
    if r is None or r[0] + pad != _query_dim(sb.values):
        raise NotProven(f"the document bound {v.name} does not read the ids at the query's position")
    return r[1]


def _relation(b: Bound, side: str):
    """A bound as ("const", C) or ("pos", a): lo bounds are <= s + a, hi bounds >= s + a."""
    if not b.terms:
        return ("const", b.const)
    if len(b.terms) != 1 or b.terms[0][0] != 1:
        raise NotProven("a mask bound is not one position or constant")
    p = b.terms[0][1]
    if isinstance(p, SearchBound):
        c = _search_position(p)
        # doc non-decreasing and v = doc[b, s + c]: the first key >= v is at most s + c, the
        # first key > v at least s + c + 1
        if p.right != (side == "hi"):
            raise NotProven("a document bound searches on the side that does not contain the row's own key")
        return ("pos", c + b.const + (1 if p.right else 0))
    return ("pos", _position(p) + b.const)


def _some_key_visible(los: Sequence[Bound], his: Sequence[Bound], S, T) -> str:
    """Proves some key X in [0, T) with lo <= X < hi for every bound, in every row."""
    lo = [_relation(b, "lo") for b in los]
    hi = [_relation(b, "hi") for b in his]
    if not any(k == "pos" for k, _ in lo + hi):  # every row the same keys
        a = max([0] + [c for _, c in lo])
        ends = [T] + [c for _, c in hi]
        if all(_static(a < e) for e in ends):
            return f"keys {a}.. are visible in every row"
        raise NotProven("the selection's constant ranges leave no key visible")
    # X = s + c: c >= every lo offset (and >= 0), c + 1 <= every hi offset, S + c <= T
    c = max([0] + [x for _, x in lo])
    for k, x in hi:
        if k == "pos" and not x >= c + 1:
            raise NotProven(f"no key is proven visible: key s+{c} is cut off by a bound at s+{x}")
        if k == "const" and not _static(S + c <= x):
            raise NotProven(f"no key is proven visible: key s+{c} may lie beyond a bound at {x}")
    if not _static(S + c <= T):
        raise NotProven(f"no key is proven visible: key s+{c} may lie beyond the {T} keys")
    return f"key s+{c} is visible in every row" if c else "the diagonal key is visible in every row"


# ------------------------------------------------------------------------------------------
# the proof
# ------------------------------------------------------------------------------------------


def _ranges(masks, operands, who: str) -> Tuple[List[Tuple[Bound, MaskTerm]], List[Tuple[Bound, MaskTerm]]]:
    los, his = [], []
    for t in masks:
        if t.kind != "range":
            raise NotProven(f"{who}'s mask term {t.kind} reads a tensor, whose hidden keys are not known "
                            "(a padding mask leaves fully padded rows without a visible key)")
        for i, out in ((t.lo, los), (t.hi, his)):
            if i is not None:
                out.extend((b, t) for b in operands[i][1])
    return los, his


def prove(idx: fx.Node, hidden: float, chain, app: fx.Node, attention_masks, attention_operands, S, T) -> str:
    """The proof above for one site; returns what it showed (for explain), else raises
    ``NotProven``. ``idx``: the selection's index node; ``hidden``: the index mask's value at
    the unselected keys; ``chain``: the score chain (contraction ... softmax input) and
    ``app`` the add on it that applies the index mask; ``attention_masks`` /
    ``attention_operands``: the attention's canonical mask terms and their operands, the
    index mask excluded; S, T: its query and key counts."""
    if not (hidden == -math.inf or (math.isfinite(hidden) and hidden <= HIDING)):
        raise NotProven(f"the hiding value {hidden} is neither -inf nor at most finfo(float16).min")
    nodes = [n for n, _ in chain]
    after = nodes[nodes.index(app) + 1:]
    if any(n.target not in _VIEWS and n.target not in _CASTS for n in after):
        raise NotProven(f"the scores pass through {after[0].name} after the index mask is added, which may turn "
                        "the hidden logits into ordinary ones")
    sel = selection_masks(idx)
    if sel is None:
        raise NotProven("the selection's mask is not known (only a fused selection records it)")
    if not sel.rows_ordered:
        raise NotProven("the selection's rows are not (batch, query) in the indices' order")
    if not _static(sel.T == T):
        raise NotProven("the selection scores another number of keys than the attention")
    k = val(sel.k) if isinstance(sel.k, fx.Node) else sel.k
    if not _static(k >= 1):
        raise NotProven("the selection's k is not proven >= 1")
    first = next((i for i, s in enumerate(sel.post) if s[0] == "mask"), len(sel.post))
    if any(s[0] not in ("mask", "round") for s in sel.post[first:]):
        raise NotProven("the selection's scores change after its mask (a hidden score may catch up)")
    for t in sel.masks:
        if t.kind == "range" and not (t.value == -math.inf or t.value <= HIDING):
            raise NotProven(f"the selection's range hides with {t.value}, which a visible score need not beat")
    # (2): a key the selection leaves visible in every row (every term a range)
    s_los, s_his = _ranges(sel.masks, sel.operands, "the selection")
    shown = _some_key_visible([b for b, _ in s_los], [b for b, _ in s_his], S, T)
    # (1): each of the attention's hidden half-lines is one of the selection's
    a_los, a_his = _ranges(attention_masks, attention_operands, "the attention")
    for side, mine, theirs in (("a lower", a_los, s_los), ("an upper", a_his, s_his)):
        keys = {_bound_key(b) for b, _ in theirs}
        for b, _ in mine:
            if _bound_key(b) not in keys:
                raise NotProven(f"the attention hides keys by {side} bound that the selection's mask does not "
                                "share, so its top-k may pick only keys the attention hides")
    return f"every row keeps a visible selected key ({shown}, in the selection's and the attention's masks)"
