"""The matcher: from an ``aten.topk`` back to a score description.

This is a canonicalizer, not a list of spellings. From each top-k it walks back through
the ops that produced its input until it reaches one contraction (``bmm``/``mm``: einsum,
matmul and ``@`` all decompose to these), tracking for every dim which logical axis it
holds (``layout.py``). Along the way each op becomes a step of a ``ScoreSpec``: pointwise
math with constants (scale, ReLU, casts) before or after a head reduction, the head
reduction itself (``mul`` by weights + ``sum``, a plain ``sum``, or a weights ``bmm``),
and mask terms (``+ mask``, ``masked_fill``/``where`` with a constant). Mask conditions
built from index comparisons (``arange(T) > arange(S)[:, None]``, ``triu``, per-row
thresholds from ``position_ids``, ``[ks, ke)`` windows) become per-row key ranges, which
a kernel can skip; any other mask stays a tensor operand.

The result is validated: the top-k axis must be the key axis of the contraction, and the
key operand must come from activations (a MoE router's or a sampler's top-k over the rows
of a parameter, buffer, global or closure-captured tensor is not a selection: docs/contract.md,
'What counts as a selection'; ``GraphFacts``).
Anything unsupported raises ``Unsupported(reason)``; the site is then left exactly as
it was and the reason goes to the diagnostics.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx

from ..lowerings.mods import name_of as mod_name
from ..lowerings.spec import MaskTerm, ScoreSpec, dtype_name
from . import layout as L
from .layout import Atom, Layout, Unsupported
from .score_mods import MOD_NODES

aten = torch.ops.aten
prims = torch.ops.prims

CONTRACTIONS = {aten.bmm.default, aten.mm.default}
BIASED = {aten.addmm.default, aten.baddbmm.default}  # linear layers with a bias

# Ops that move axes around without touching values.
_VIEWS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.expand.default,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.contiguous.default,
}
_CASTS = {prims.convert_element_type.default, aten._to_copy.default}
_FLOAT_RANK = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}

_CMP = {
    aten.ge.Tensor: "ge", aten.ge.Scalar: "ge",
    aten.gt.Tensor: "gt", aten.gt.Scalar: "gt",
    aten.le.Tensor: "le", aten.le.Scalar: "le",
    aten.lt.Tensor: "lt", aten.lt.Scalar: "lt",
}
_FLIP = {"ge": "le", "le": "ge", "gt": "lt", "lt": "gt"}
_NOT = {aten.bitwise_not.default, aten.logical_not.default}
_AND = {aten.bitwise_and.Tensor, aten.logical_and.default, aten.__and__.Tensor}
_OR = {aten.bitwise_or.Tensor, aten.logical_or.default, aten.__or__.Tensor}


def val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def is_backward_node(n: fx.Node) -> bool:
    """True for nodes autograd wrote into a joint graph's backward (tangents included)."""
    tag = n.meta.get("partitioner_tag")
    if tag is not None:
        return tag in ("is_backward", "must_be_in_backward")
    if n.op == "placeholder":
        return n.name.startswith("tangents")
    return bool(n.meta.get("autograd_backward"))


def _feeds_only_backward(n: fx.Node) -> bool:
    """True when ``n`` is a backward node or a forward node (a saved alias) read only by
    backward nodes: it is the backward's business, not another forward consumer."""
    seen, stack = set(), [n]
    while stack:
        x = stack.pop()
        if x in seen or is_backward_node(x):
            continue
        seen.add(x)
        if x.op == "output" or not x.users:
            return False
        stack.extend(x.users)
    return True


def shape_of(n) -> Tuple:
    v = val(n)
    if not isinstance(v, torch.Tensor):
        raise Unsupported(f"no tensor metadata on {n}")
    return tuple(v.shape)


def dtype_of_node(n) -> torch.dtype:
    return val(n).dtype


def cast_dtype(n: fx.Node) -> Optional[torch.dtype]:
    if n.target is prims.convert_element_type.default:
        return n.args[1]
    if n.target is aten._to_copy.default:
        return n.kwargs.get("dtype")
    return None


# --------------------------------------------------------------------------------------
# Plans: what the rewrite will build, in terms of source nodes and logical axes.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class OperandPlan:
    """A canonical operand built from ``node`` (whose dims carry ``layout``) by
    views/permutes only; ``groups`` is filled in once the axes' roles are known."""

    node: fx.Node
    layout: Layout
    groups: Optional[List[List[str]]] = None


@dataclasses.dataclass
class Bound:
    """An integer per-row bound: const + sum(coef * row operand)."""

    const: int = 0
    terms: List[Tuple[int, OperandPlan]] = dataclasses.field(default_factory=list)

    def scaled(self, c: int) -> "Bound":
        return Bound(self.const * c, [(k * c, p) for k, p in self.terms])

    def plus(self, other: "Bound") -> "Bound":
        return Bound(self.const + other.const, self.terms + other.terms)


@dataclasses.dataclass
class SearchBound:
    """A per-row bound read off a non-decreasing key row: ``searchsorted(sorted[b], values[b, s],
    right)``, the first key t whose ``sorted[b, t]`` is >= (right: >) the row's value. It stands
    in a ``Bound``'s terms like an operand (coef * it): the rewrite emits the search."""

    sorted: OperandPlan  # [batch, key]
    values: OperandPlan  # per row
    right: bool


@dataclasses.dataclass
class KeyAffine:
    """a * t + bound, t the key index."""

    a: int
    b: Bound


@dataclasses.dataclass
class Pred:
    """A set of key indices per row. kind="hidden": {t < max(los)} U {t >= min(his)};
    kind="range": {max(los) <= t < min(his)}. A single half-line is both."""

    kind: str
    los: List[Bound]
    his: List[Bound]

    def single(self) -> bool:
        return len(self.los) + len(self.his) == 1

    def as_kind(self, kind: str) -> "Pred":
        """The same set in the other form (only a single half-line has both):
        {t >= X} is hidden-form his=[X] and range-form los=[X]."""
        if kind == self.kind:
            return self
        if not self.single():
            raise Unsupported("mask condition is not a key range")
        return Pred(kind, list(self.his), list(self.los))

    def complement(self) -> "Pred":
        # not({t < lo} U {t >= hi}) = {lo <= t < hi}: same bounds, the other kind
        return Pred("range" if self.kind == "hidden" else "hidden", list(self.los), list(self.his))


@dataclasses.dataclass
class MaskPlan:
    term: MaskTerm  # operand indices refer to SiteMatch.mask_operands
    operands: List[Any]  # OperandPlan (tensor) or ("bound", [Bound...], "max"|"min")


@dataclasses.dataclass
class SiteMatch:
    topk: fx.Node
    spec: ScoreSpec
    q: OperandPlan
    k: OperandPlan
    w: Optional[OperandPlan]
    mask_operands: List[Any]
    score_layout: Layout  # layout of the top-k input
    topk_dim: int
    k_arg: Any
    values_used: bool
    roles: Dict[str, List[str]]  # B, S, H(k then g), D, T label lists
    other_consumers: List[str]
    sizes: Dict[str, Any]
    sorted: bool = True  # the top-k's own flag: False lets the op skip its final sort
    sort_elided: str = ""  # sorted=True, but nothing reads the order (order.py): the uses
    # the key-side operand is a graph input not known to be constant (an argument): its
    # source name, for the diagnostics (a weight passed as an argument looks the same)
    key_argument: Optional[str] = None


# --------------------------------------------------------------------------------------
# Walking and analysing
# --------------------------------------------------------------------------------------


# Graph inputs that are not activations (docs/contract.md, 'What counts as a selection'):
# what each kind is, for the diagnostics. The backend classifies Dynamo's source of each input.
CONSTANT_KINDS = {"parameter": "a parameter or buffer", "global": "a global tensor",
                  "closure": "a closure-captured tensor"}


class GraphFacts:
    """Per-graph facts the analysis needs, computed once.

    ``sources``: placeholder name -> (kind, Dynamo source name) for the graph inputs the
    backend could classify; a kind in ``CONSTANT_KINDS`` makes the input constant. Inputs
    of other kinds (the compiled function's arguments, sources not recognized) count as
    activations. A constant buffer the graph writes before reading it is read back through
    the functionalized write (``slice_scatter``, ``index_put``, ``copy``), whose written
    value is then part of the dataflow: a KV cache filled from activations is an activation."""

    def __init__(self, graph: fx.Graph, param_placeholders: Set[str] = frozenset(),
                 sources: Optional[Dict[str, Tuple[str, str]]] = None):
        self.graph = graph
        self.sources = dict(sources or {})
        self.sources.update({p: ("parameter", "") for p in param_placeholders})
        self.params = {p for p, (kind, _) in self.sources.items() if kind in CONSTANT_KINDS}
        self.dep: Set[fx.Node] = set()  # nodes downstream of a contraction
        for n in graph.nodes:
            if n.op != "call_function":
                continue
            if n.target in CONTRACTIONS or n.target in BIASED or any(a in self.dep for a in n.all_input_nodes):
                self.dep.add(n)

    def constant(self, n) -> Optional[float]:
        """The value of a Python number or a constant-filled tensor node, else None."""
        if isinstance(n, bool):
            return None
        if isinstance(n, (int, float)):
            return n
        if not isinstance(n, fx.Node):
            return None
        if n.target in (aten.scalar_tensor.default, aten.full.default):
            v = n.args[0] if n.target is aten.scalar_tensor.default else n.args[1]
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                return None
            dt = n.kwargs.get("dtype")
            # the value the tensor holds: a bf16 full(0.1) holds 0.1 rounded to bf16
            return float(torch.tensor(v, dtype=dt).item()) if dt is not None and dt.is_floating_point else v
        if n.target in _VIEWS or n.target in _CASTS:
            inner = self.constant(n.args[0])
            if inner is None:
                return None
            dt = cast_dtype(n)
            return float(torch.tensor(inner).to(dt).item()) if dt is not None and dt.is_floating_point else inner
        if n.op == "get_attr":
            t = getattr(n.graph.owning_module, n.target, None)
            if isinstance(t, torch.Tensor) and t.numel() == 1:
                return t.item()
        return None

    def bool_constant(self, n) -> Optional[bool]:
        """The value of a bool tensor filled with one constant (``full(True)``), else None."""
        while isinstance(n, fx.Node) and (n.target in _VIEWS or n.target in (aten.expand.default, aten.clone.default)):
            n = n.args[0]
        if isinstance(n, fx.Node) and n.target is aten.full.default and n.kwargs.get("dtype") is torch.bool:
            v = n.args[1]
            return bool(v) if isinstance(v, (bool, int)) else None
        return None

    def is_constant_input(self, n) -> bool:
        """A graph input (or attribute) that is a parameter, buffer, global or closure cell."""
        return isinstance(n, fx.Node) and (n.op == "get_attr" or (n.op == "placeholder" and n.name in self.params))

    def describe_input(self, n: fx.Node) -> str:
        """'a global tensor (G['W'])', 'a parameter or buffer', ...: what the input is."""
        if n.op == "get_attr":
            return f"a constant tensor of the graph ({n.target})"
        kind, name = self.sources.get(n.name, ("input", ""))
        what = CONSTANT_KINDS.get(kind, "a graph input")
        return f"{what} ({name})" if name else what

    def argument_input(self, n) -> Optional[str]:
        """The source name of the graph input ``n`` is (through views and casts) when that
        input is not known to be constant: an argument of the compiled function, which may
        be keys or a weight (the graph cannot tell); else None."""
        src, _ = walk_views(n)
        if isinstance(src, fx.Node) and src.op == "placeholder" and src.name not in self.params:
            return self.sources.get(src.name, ("input", ""))[1] or src.name
        return None

    def constant_origin(self, n: fx.Node) -> Optional[str]:
        """None when ``n`` depends on an activation (a graph input that is not constant);
        else what it comes from ('a global tensor (G['W'])', 'constants', ...)."""
        seen, stack, found = set(), [n], set()
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            if x.op == "placeholder":
                v = x.meta.get("val")
                if v is not None and not isinstance(v, torch.Tensor):
                    continue  # a SymInt input is a size, not a value the operand is computed from
                if x.name not in self.params:
                    return None
                found.add(self.describe_input(x))
                continue
            if x.op == "get_attr":
                found.add(self.describe_input(x))
            stack.extend(x.all_input_nodes)
        if not found:
            return "constants"
        shown = sorted(found)
        return ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")

    def from_activations(self, n: fx.Node) -> bool:
        """Does ``n`` depend on a graph input that is not a parameter, buffer, global or
        closure-captured tensor?"""
        return self.constant_origin(n) is None


def walk_views(n: fx.Node) -> Tuple[fx.Node, List[fx.Node]]:
    """Walk back through views and widening casts: (source, the ops from source to n)."""
    ops = []
    cur = n
    while isinstance(cur, fx.Node) and cur.op == "call_function":
        if cur.target in _VIEWS:
            pass
        elif cur.target in _CASTS:
            dt, src_dt = cast_dtype(cur), dtype_of_node(cur.args[0])
            if dt is None or _FLOAT_RANK.get(dt, 0) < _FLOAT_RANK.get(src_dt, 9):
                break  # a narrowing cast changes values: it is the source
            if cur.target is aten._to_copy.default and set(cur.kwargs) - {"dtype", "layout", "device"}:
                break
        else:
            break
        ops.append(cur)
        cur = cur.args[0]
    ops.reverse()
    return cur, ops


def _sizes(arg) -> List[Any]:
    """A size list whose entries may be SymInt-producing nodes -> ints / SymInts."""
    return [a.meta["val"] if isinstance(a, fx.Node) else a for a in arg]


def propagate_view(lay: Layout, n: fx.Node) -> Layout:
    """Layout of ``n``'s output given its first arg's layout (n is in _VIEWS or _CASTS)."""
    t = n.target
    if t in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return L.view(lay, _sizes(n.args[1]))
    if t is aten.permute.default:
        return L.permute(lay, n.args[1])
    if t is aten.transpose.int:
        d0, d1 = n.args[1] % len(lay), n.args[2] % len(lay)
        perm = list(range(len(lay)))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return L.permute(lay, perm)
    if t is aten.t.default:
        return L.permute(lay, [1, 0]) if len(lay) == 2 else lay
    if t is aten.unsqueeze.default:
        return L.unsqueeze(lay, n.args[1])
    if t is aten.squeeze.default:
        return L.squeeze(lay, None, shape_of(n.args[0]))
    if t is aten.squeeze.dim:
        return L.squeeze(lay, [n.args[1]], shape_of(n.args[0]))
    if t is aten.squeeze.dims:
        return L.squeeze(lay, n.args[1], shape_of(n.args[0]))
    if t is aten.expand.default:
        return L.expand(lay, _sizes(n.args[1]))
    return lay  # clone / alias / detach / casts


def layout_through(src: fx.Node, ops: Sequence[fx.Node], prefix: str) -> Tuple[Layout, Layout]:
    """(source layout, layout after ops) with fresh atoms on the source."""
    lay0 = L.source_layout(shape_of(src), prefix)
    lay = lay0
    for op in ops:
        lay = propagate_view(lay, op)
    # a view may have split a source atom: re-express the source layout in split atoms
    return _resplit(lay0, lay), lay


def _resplit(src: Layout, derived: Layout) -> Layout:
    # a view splits an atom in two (``a/0`` outer, ``a/1`` inner) and may split a piece again
    # ([B*S*H] -> [B, S, H] gives a/0, a/1/0, a/1/1): every level links to its parent
    split: Dict[str, Dict[str, Atom]] = {}
    for d in derived:
        for a in d:
            while "/" in a.label:
                base = a.label.rsplit("/", 1)[0]
                kids = split.setdefault(base, {})
                if a.label in kids:
                    break
                kids[a.label] = a
                a = Atom(base, None, a.bcast)  # an inner level: only its leaves are kept
    if not split:
        return src
    out = []
    for d in src:
        nd = []
        for a in d:
            nd.extend(_leaves(a.label, split) if a.label in split else [a])
        out.append(tuple(nd))
    return out


def _leaves(label, split):
    out = []
    for lab in sorted(split[label], key=lambda x: int(x.rsplit("/", 1)[1])):  # outer piece first
        out.extend(_leaves(lab, split) if lab in split else [split[label][lab]])
    return out


class Unifier:
    """Renames labels so that axes shared by two operands get one name."""

    def __init__(self):
        self.parent: Dict[str, str] = {}

    def find(self, x: str) -> str:
        while x in self.parent:
            x = self.parent[x]
        return x

    def union(self, a: str, b: str):
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[b] = a

    def apply(self, lay: Layout) -> Layout:
        return [tuple(Atom(self.find(a.label), a.size, a.bcast) for a in d) for d in lay]


def unify_dims(u: Unifier, da, db, what: str) -> Tuple:
    """Unify two dims that a contraction pairs; returns the merged dim's atoms
    (a broadcast atom on one side takes the real atom of the other)."""
    ra = [a for a in da if not L.is_one(a.size)]
    rb = [a for a in db if not L.is_one(a.size)]
    if len(ra) != len(rb) or not all(L.same_size(x.size, y.size) for x, y in zip(ra, rb)):
        if len(ra) == 0 and len(rb) == 0:
            return ()
        raise Unsupported(f"{what} axes of the contraction group differently: {ra} vs {rb}")
    out = []
    for x, y in zip(ra, rb):
        if x.bcast and y.bcast:
            raise Unsupported("both contraction operands are broadcast along one axis")
        if x.bcast:
            out.append(y)
        elif y.bcast:
            out.append(x)
        else:
            u.union(x.label, y.label)
            out.append(x)
    return tuple(out)


@dataclasses.dataclass
class Side:
    src: fx.Node
    src_layout: Layout
    layout: Layout  # at the contraction
    upcast_from: Optional[torch.dtype]


def analyse_operand(n: fx.Node, prefix: str) -> Side:
    if dtype_of_node(n) not in (torch.float32, torch.bfloat16, torch.float16):
        raise Unsupported(f"the contraction runs in {dtype_of_node(n)} (the op computes in fp32 at most)")
    src, ops = walk_views(n)
    src_lay, lay = layout_through(src, ops, prefix)
    up = None
    src_dt = dtype_of_node(src)
    if src_dt in (torch.bfloat16, torch.float16) and dtype_of_node(n) == torch.float32:
        up = src_dt
    return Side(src, src_lay, lay, up)


def _scalar_step(facts: GraphFacts, n: fx.Node, chain_idx: int) -> Optional[tuple]:
    """Pointwise op of the score with a constant -> spec step, else None."""
    t = n.target
    other = n.args[1 - chain_idx] if len(n.args) > 1 else None
    c = facts.constant(other) if other is not None else None
    if t in (aten.mul.Tensor, aten.mul.Scalar) and c is not None:
        return ("mul", c)
    if t in (aten.div.Tensor, aten.div.Scalar) and c is not None and chain_idx == 0:
        return ("div", c)
    if t in (aten.add.Tensor, aten.add.Scalar) and c is not None and n.kwargs.get("alpha", 1) == 1:
        return ("add", c)
    if t in (aten.sub.Tensor, aten.sub.Scalar) and c is not None and chain_idx == 0 and n.kwargs.get("alpha", 1) == 1:
        return ("add", -c)  # x - c == x + (-c) exactly
    if t is aten.relu.default:
        return ("relu",)
    if t in (aten.clamp_min.default,) and facts.constant(n.args[1]) == 0:
        return ("relu", "clamp_min")  # same values; its own derivative at 0 (sparse backward)
    if t is aten.maximum.default and c == 0:
        return ("relu", "maximum")
    if t is aten.neg.default:
        return ("neg",)
    if t is aten.sigmoid.default:
        return ("sigmoid",)
    if t is torch.ops.hyscale.score_mod.default:
        return ("mod", n.args[1])
    return None


class SiteAnalysis:
    def __init__(self, facts: GraphFacts, topk: fx.Node, chain):
        self.facts = facts
        self.topk = topk
        self.chain = chain
        self.u = Unifier()
        self.scalar_operands: List[OperandPlan] = []  # 0-d run-time scales (``*_operand`` steps)
        self.key_argument: Optional[str] = None  # check_selection: the key-side graph input, when unclassified

    # ---- entry -------------------------------------------------------------------------
    def run(self) -> SiteMatch:
        tk = self.topk
        x = tk.args[0]
        args = list(tk.args) + [None] * (5 - len(tk.args))
        kk = args[1]
        dim = tk.kwargs.get("dim", args[2] if args[2] is not None else -1)
        largest = tk.kwargs.get("largest", args[3] if args[3] is not None else True)
        if not largest:
            raise Unsupported("largest=False: a selection keeps the highest scores")
        self.sorted = bool(tk.kwargs.get("sorted", args[4] if args[4] is not None else True))
        y_shape = shape_of(x)
        if len(y_shape) == 0:
            raise Unsupported("top-k of a 0-d tensor")
        dim = dim % len(y_shape)

        chain = self.chain
        qk = chain[0][0]
        in_chain = {n for n, _ in chain}
        # a registered mod's stand-in replaced these nodes: they die with the rewrite
        replaced = {r for n, _ in chain for r in n.meta.get(MOD_NODES, ())}
        self.other_consumers = sorted(
            {_opname(c) for n, _ in chain for c in n.users
             if c not in in_chain and c is not tk and c not in replaced and not _feeds_only_backward(c)}
        )
        a, b = qk.args[0], qk.args[1]
        sa, sb = analyse_operand(a, "a"), analyse_operand(b, "b")
        out_lay = self.contraction_layout(qk, sa, sb)

        # Phase 1: layouts along the chain; Phase 2 (below) turns ops into steps.
        lays = [out_lay]
        for n, ci in chain[1:]:
            lays.append(self.propagate(n, ci, lays[-1]))
        y_lay = self.u.apply(lays[-1])
        if len(y_lay) != len(y_shape):
            raise Unsupported("internal: score layout rank mismatch")
        key_atoms = [at for at in y_lay[dim] if not at.bcast]
        if not key_atoms:
            raise Unsupported(f"the top-k dim {dim} is not an axis of the contraction")
        key_labels = {at.label for at in key_atoms}

        la = set(L.labels(self.u.apply(sa.layout)))
        lb = set(L.labels(self.u.apply(sb.layout)))
        if key_labels <= lb - la:
            qs, ks = sa, sb
        elif key_labels <= la - lb:
            qs, ks = sb, sa
        else:
            raise Unsupported(
                f"the top-k runs over dim {dim}, which is not the key axis of the contraction "
                "(it is shared by both operands or contracted)"
            )
        self.check_selection(ks, qs, key_labels)
        steps, w_plan, reduced, mask_plans = self.collect_steps(chain, lays, key_labels)
        return self.assemble(
            tk, qs, ks, y_lay, dim, kk, key_atoms, steps, w_plan, reduced, mask_plans, qk
        )

    # ---- the chain from contraction to top-k ---------------------------------------------
    def contraction_layout(self, qk, sa: Side, sb: Side) -> Layout:
        la, lb = sa.layout, sb.layout
        if qk.target is aten.bmm.default:
            if len(la) != 3 or len(lb) != 3:
                raise Unsupported("bmm operands are not 3-d")
            n = unify_dims(self.u, la[0], lb[0], "batch")
            unify_dims(self.u, la[2], lb[1], "contracted")
            self.contracted = [at for at in la[2]]
            return [n, la[1], lb[2]]
        if len(la) != 2 or len(lb) != 2:
            raise Unsupported("mm operands are not 2-d")
        unify_dims(self.u, la[1], lb[0], "contracted")
        self.contracted = [at for at in la[1]]
        return [la[0], lb[1]]

    def propagate(self, n: fx.Node, ci: int, lay: Layout) -> Layout:
        t = n.target
        if t in _VIEWS or t in _CASTS:
            return propagate_view(lay, n)
        if t in (aten.sum.dim_IntList, aten.sum.default):
            dims = n.args[1] if len(n.args) > 1 and n.args[1] is not None else list(range(len(lay)))
            dims = [d % len(lay) for d in dims]
            keep = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 else False)
            return [() if i in dims else d for i, d in enumerate(lay)] if keep else [
                d for i, d in enumerate(lay) if i not in dims
            ]
        if t is aten.bmm.default:
            return self.weights_bmm_layout(n, ci, lay)
        if t in CONTRACTIONS:
            raise Unsupported("a second contraction (mm) between the scores and the top-k")
        # pointwise ops: the output has the broadcast shape; the score keeps its atoms
        out_shape = shape_of(n)
        if len(out_shape) != len(lay) or not all(
            L.same_size(s, L.dim_size(d)) or not d for s, d in zip(out_shape, lay)
        ):
            raise Unsupported(f"{_opname(n)} broadcasts the scores to a new shape {out_shape}")
        return lay

    def weights_bmm_layout(self, n: fx.Node, ci: int, lay: Layout) -> Layout:
        """HF's head sum as a matmul: bmm(w [n,1,h], s [n,h,t]) or bmm(s [n,t,h], w [n,h,1])."""
        wnode = n.args[1 - ci]
        side = analyse_operand(wnode, "w")
        wl = side.layout
        if len(wl) != 3:
            raise Unsupported("weights bmm operand is not 3-d")
        nb = unify_dims(self.u, lay[0], wl[0], "batch")
        if ci == 1:  # s is [n, h, t]; w is [n, m, h]
            if wl[1]:
                raise Unsupported("weights matmul with more than one output row")
            unify_dims(self.u, wl[2], lay[1], "head")
            self.wbmm = (side, lay[1])
            return [nb, (), lay[2]]
        if wl[2]:
            raise Unsupported("weights matmul with more than one output column")
        unify_dims(self.u, lay[2], wl[1], "head")
        self.wbmm = (side, lay[2])
        return [nb, lay[1], ()]

    # ---- selection criterion -------------------------------------------------------------
    def check_selection(self, ks: Side, qs: Side, key_labels):
        facts = self.facts
        q_src = qs.src
        if facts.is_constant_input(q_src):
            raise Unsupported(f"a contraction with {facts.describe_input(q_src)} (a linear layer), not a score contraction")
        # the keys may be a linear map of another tensor (``k @ H``, ``E @ H``): the key axis
        # must come from activations, whatever the matrix is (a global is a graph input too)
        src = self.key_carrier(ks, key_labels)
        if facts.is_constant_input(src):
            raise Unsupported(
                f"not a selection: the key-side operand of the contraction is {facts.describe_input(src)} "
                "(a router or sampler top-k, not sparse attention)"
            )
        if src.op == "call_function" and facts.constant(src) is not None:
            raise Unsupported("not a selection: the key-side operand is a constant")
        origin = facts.constant_origin(src)
        if origin is not None:
            raise Unsupported(
                f"not a selection: the key-side operand of the contraction comes only from {origin} "
                "(a router or sampler top-k, not sparse attention)"
            )
        self.key_argument = facts.argument_input(src)

    def key_carrier(self, ks: Side, key_labels) -> fx.Node:
        """The tensor the key axis comes from, through views and linear maps of the keys."""
        lay = self.u.apply(ks.src_layout)
        d = next((i for i, dim in enumerate(lay) if any(a.label in key_labels for a in dim)), None)
        return ks.src if d is None else axis_source(ks.src, d)

    # ---- phase 2: steps --------------------------------------------------------------------
    def collect_steps(self, chain, lays, key_labels):
        facts = self.facts
        steps: List[tuple] = []
        w_plan = None
        reduced: Optional[List[str]] = None
        pending_w = None
        mask_plans: List[MaskPlan] = []
        red_at = [i for i, (n, _) in enumerate(chain) if i > 0 and n.target in (aten.sum.dim_IntList, aten.sum.default, aten.bmm.default)]
        out_dtype = dtype_of_node(chain[0][0])
        if out_dtype != torch.float32:
            steps.append(("round", dtype_name(out_dtype)))
        for i, (n, ci) in enumerate(chain[1:], start=1):
            if val(n) is not None and getattr(val(n), "dtype", None) == torch.float64:
                raise Unsupported("the scores are computed in float64 (the op computes in fp32)")
            lay_in = self.u.apply(lays[i - 1])
            t = n.target
            if t in _VIEWS:
                continue
            if t in _CASTS:
                dt = cast_dtype(n)
                if dt is None or not dt.is_floating_point:
                    raise Unsupported(f"the scores are cast to {dt}")
                if _FLOAT_RANK[dt] < _FLOAT_RANK[dtype_of_node(n.args[0])]:
                    steps.append(("round", dtype_name(dt)))
                continue
            if pending_w is not None and t not in (aten.sum.dim_IntList,):
                # (e * w) * c == (e * c) * w up to fp32 reassociation: a constant scale
                # between the weighting and the head sum moves into the epilogue
                step = _scalar_step(facts, n, ci) or self.runtime_scalar(n, ci)
                if step is not None and step[0] in ("mul", "div", "mul_operand", "div_operand") and dtype_of_node(n) == torch.float32:
                    steps.append(step)
                    continue
                raise Unsupported(f"weights multiply not followed by a head sum (found {_opname(n)})")
            if t in (aten.sum.dim_IntList, aten.sum.default) or t is aten.bmm.default:
                if reduced is not None:
                    raise Unsupported("two reductions between the contraction and the top-k")
                if t is aten.bmm.default:
                    side, hdim = self.wbmm
                    reduced = [a.label for a in hdim]
                    w_plan = OperandPlan(side.src, self.u.apply(side.src_layout))
                else:
                    dims = n.args[1] if len(n.args) > 1 and n.args[1] is not None else range(len(lay_in))
                    reduced = [a.label for d in dims for a in lay_in[d % len(lay_in)] if not a.bcast]
                    if any(a.bcast for d in dims for a in lay_in[d % len(lay_in)]):
                        raise Unsupported("sum over a broadcast axis")
                    if pending_w is not None:
                        w_plan = pending_w
                        pending_w = None
                if set(reduced) & key_labels:
                    raise Unsupported("the scores are summed over the key axis")
                steps.append(("__reduce__",))
                if dtype_of_node(n) != torch.float32:
                    steps.append(("round", dtype_name(dtype_of_node(n))))
                continue
            step = _scalar_step(facts, n, ci) or self.runtime_scalar(n, ci)
            other = n.args[1 - ci] if len(n.args) > 1 and ci in (0, 1) else None
            if step is None and (
                isinstance(val(other), (torch.SymFloat, torch.SymInt))
                or (isinstance(val(other), torch.Tensor) and val(other).dim() == 0)
            ):
                raise Unsupported(
                    f"the scores are combined ({_opname(n)}) with a run-time scalar ({val(other)}) in a way "
                    "the spec cannot carry (only * and / by a 0-d tensor are supported)"
                )
            if step is not None and step[0] == "mod" and dtype_of_node(n) != torch.float32:
                raise Unsupported(f"the registered score mod {mod_name(step[1])!r} runs on {dtype_of_node(n)} scores "
                                  "(the graph rounds after each of its ops; the kernel computes it in float32)")
            if step is not None:
                steps.append(step)
                if dtype_of_node(n) != torch.float32 and step[0] != "relu":
                    steps.append(("round", dtype_name(dtype_of_node(n))))
                continue
            # tensor operands: weights (before the head sum) or masks (after it)
            if t is aten.mul.Tensor and reduced is None:
                other = n.args[1 - ci]
                if dtype_of_node(n) != torch.float32:
                    raise Unsupported("head weighting in reduced precision (per-product rounding)")
                wl = L.broadcast_align(shape_of(other), lay_in)
                if set(L.labels(wl)) & key_labels:
                    raise Unsupported("the scores are multiplied by a tensor that varies along the keys")
                pending_w = OperandPlan(other, wl)
                continue
            mp = self.mask_step(n, ci, lay_in, key_labels, per_head=bool(red_at) and i < red_at[0])
            if mp is None:
                raise Unsupported(f"unsupported op between the contraction and the top-k: {_opname(n)}")
            steps.append(("mask", len(mask_plans)))
            mask_plans.append(mp)
        if pending_w is not None:
            raise Unsupported("the scores are multiplied by a tensor but never summed over heads")
        return steps, w_plan, reduced, mask_plans

    def runtime_scalar(self, n, ci) -> Optional[tuple]:
        """``s * c`` / ``s / c`` with ``c`` a 0-d tensor the graph computes (e.g. ``D ** -0.5``
        with a dynamic head dim): the tensor becomes an operand, read at run time."""
        if n.target not in (aten.mul.Tensor, aten.div.Tensor) or ci not in (0, 1):
            return None
        if n.target is aten.div.Tensor and ci != 0:
            return None
        other = n.args[1 - ci]
        v = val(other)
        if not (isinstance(other, fx.Node) and isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()):
            return None
        if other in self.facts.dep:
            return None
        self.scalar_operands.append(OperandPlan(other, [], []))
        op = "mul_operand" if n.target is aten.mul.Tensor else "div_operand"
        return (op, len(self.scalar_operands) - 1)

    def mask_step(self, n, ci, lay, key_labels, per_head: bool) -> Optional[MaskPlan]:
        facts = self.facts
        t = n.target
        where_true = None
        if t is aten.where.self and ci in (1, 2):
            cond, other = n.args[0], n.args[3 - ci]
            fill = facts.constant(other)
            if fill is None or cond in facts.dep:
                return None
            where_true = ci == 2  # where(cond, fill, s): hidden where cond is true
        elif t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor) and ci == 0:
            cond, fill = n.args[1], facts.constant(n.args[2])
            if fill is None or cond in facts.dep:
                return None
            where_true = True
        elif t is aten.add.Tensor and n.kwargs.get("alpha", 1) == 1:
            m = n.args[1 - ci]
            if not isinstance(m, fx.Node) or m in facts.dep:
                return None
            self._check_mask_site(per_head)
            rng = self.additive_range(m, lay, key_labels)
            if rng is not None:
                return rng
            if dtype_of_node(n) != torch.float32 and dtype_of_node(m) != dtype_of_node(n):
                raise Unsupported("additive mask in reduced precision")
            return MaskPlan(MaskTerm("add", operand=0), [OperandPlan(m, L.broadcast_align(shape_of(m), lay))])
        else:
            return None
        self._check_mask_site(per_head)
        if not isinstance(fill, float):
            fill = float(fill)
        cl = L.broadcast_align(shape_of(cond), lay)
        try:
            pred = self.predicate(cond, cl, key_labels)
            if not where_true:
                pred = pred.complement()
            return self.range_plan(pred, "fill", fill)
        except Unsupported:
            pass
        # a tensor mask: strip a logical not into the term's polarity
        operand, polarity = cond, where_true
        while operand.target in _NOT:
            operand, polarity = operand.args[0], not polarity
        if dtype_of_node(operand) != torch.bool:
            raise Unsupported("masked_fill/where condition is not a bool tensor")
        ol = L.broadcast_align(shape_of(operand), lay)
        return MaskPlan(MaskTerm("fill", operand=0, where=polarity, value=fill), [OperandPlan(operand, ol)])

    @staticmethod
    def _check_mask_site(per_head: bool):
        if per_head:
            raise Unsupported("a mask applied per head, before the head reduction")

    def additive_range(self, m, lay, key_labels) -> Optional[MaskPlan]:
        """``s + where(cond, c, 0)`` (e.g. ``full(-inf).triu(1)``) -> a range term."""
        cur = m
        ml = L.broadcast_align(shape_of(m), lay)
        # walk views of the mask, keeping its layout aligned with the score's
        ops = []
        while cur.target in _VIEWS or cur.target in _CASTS:
            ops.append(cur)
            cur = cur.args[0]
        if cur.target is not aten.where.self or cur.args[0] in self.facts.dep:
            return None
        c_true, c_false = self.facts.constant(cur.args[1]), self.facts.constant(cur.args[2])
        if c_true is None or c_false is None or (c_true != 0 and c_false != 0):
            return None
        try:
            inner = self.back_layout(cur, ops, ml)
            cl = L.broadcast_align(shape_of(cur.args[0]), inner)
            pred = self.predicate(cur.args[0], cl, key_labels)
            if c_false != 0:  # where(keep, 0, c): the hidden keys are where cond is false
                pred, c_true = pred.complement(), c_false
            return self.range_plan(pred, "add", float(c_true))
        except Unsupported:
            return None

    def back_layout(self, base, ops, lay_top) -> Layout:
        """Layout of ``base`` given the layout after applying view ``ops`` (outermost first)."""
        lay = lay_top
        for op in ops:
            src_shape = shape_of(op.args[0])
            t = op.target
            if t is aten.unsqueeze.default:
                d = op.args[1] % len(lay)
                lay = lay[:d] + lay[d + 1 :]
            elif t is aten.expand.default or t in _CASTS or t in (aten.clone.default, aten.alias.default):
                lay = L.broadcast_align(src_shape, lay) if t is aten.expand.default else lay
            elif t is aten.permute.default:
                inv = [0] * len(op.args[1])
                for i, p in enumerate(op.args[1]):
                    inv[p % len(inv)] = i
                lay = L.permute(lay, inv)
            elif t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.squeeze.dim,
                       aten.squeeze.default, aten.squeeze.dims):
                # only unit dims added or removed: non-unit dims keep their order
                real = [d for d, sz in zip(lay, shape_of(op)) if not L.is_one(sz)]
                if len(real) != sum(1 for sz in src_shape if not L.is_one(sz)):
                    raise Unsupported(f"mask built through a regrouping {_opname(op)}")
                it = iter(real)
                lay = [() if L.is_one(sz) else next(it) for sz in src_shape]
            else:
                raise Unsupported(f"mask built through {_opname(op)}")
        return lay

    # ---- index predicates ------------------------------------------------------------------
    def predicate(self, n, lay, key_labels) -> Pred:
        t = n.target if isinstance(n, fx.Node) else None
        if t in _CMP:
            op = _CMP[t]
            lhs = self.affine(n.args[0], lay, key_labels)
            rhs = self.affine(n.args[1], lay, key_labels)
            a = lhs.a - rhs.a
            rest = lhs.b.plus(rhs.b.scaled(-1))  # cond: a*t + rest (op) 0
            if a == -1:
                a, rest, op = 1, rest.scaled(-1), _FLIP[op]
            if a != 1:
                raise Unsupported("mask compares a multiple of the key index")
            x = rest.scaled(-1)  # cond: t (op) x
            one = Bound(1)
            if op == "ge":
                return Pred("hidden", [], [x])
            if op == "gt":
                return Pred("hidden", [], [x.plus(one)])
            if op == "lt":
                return Pred("hidden", [x], [])
            return Pred("hidden", [x.plus(one)], [])
        if t is aten.eq.Tensor:
            return self.document_range(n, lay, key_labels)
        if t in _NOT:
            return self.predicate(n.args[0], lay, key_labels).complement()
        if t in _AND or t in _OR:
            # tril / triu of a bool tensor decompose to ``cond & full(True)``: x & True and
            # x | False are x
            for a, b in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
                if self.facts.bool_constant(a) is (t in _AND):
                    return self.predicate(b, L.broadcast_align(shape_of(b), lay), key_labels)
            p1 = self.predicate(n.args[0], L.broadcast_align(shape_of(n.args[0]), lay), key_labels)
            p2 = self.predicate(n.args[1], L.broadcast_align(shape_of(n.args[1]), lay), key_labels)
            want = "range" if t in _AND else "hidden"
            p1, p2 = p1.as_kind(want), p2.as_kind(want)
            return Pred(want, p1.los + p2.los, p1.his + p2.his)
        if isinstance(n, fx.Node) and (n.target in _VIEWS or n.target in _CASTS):
            return self.predicate(n.args[0], self.back_layout(n.args[0], [n], lay), key_labels)
        raise Unsupported("mask condition is not an index comparison")

    def document_range(self, n, lay, key_labels) -> Pred:
        """``doc[b, q] == doc[b, t]`` with ``doc`` non-decreasing along its key dim (a cumsum of
        flags: HF's packed-sequence ids) -> the keys of the row's document, one run of equal ids
        per row: [searchsorted(doc[b], v), searchsorted(doc[b], v, right)), v = doc[b, q].

        Proof: doc[b] is sorted, so {t : doc[b, t] == v} is the contiguous run of v, which
        starts at the first t with doc[b, t] >= v and ends before the first t with
        doc[b, t] > v (empty when v does not occur). Nothing is assumed about v."""
        sides = []
        for a in n.args:
            if not (isinstance(a, fx.Node) and a.target is aten.index.Tensor and len(a.args[1]) == 2
                    and all(isinstance(i, fx.Node) for i in a.args[1])):
                raise Unsupported("mask compares for equality something other than a lookup in one id row")
            sides.append(a)
        keyed = [bool(set(L.labels(L.broadcast_align(shape_of(a), lay))) & key_labels) for a in sides]
        if sorted(keyed) != [False, True]:
            raise Unsupported("mask equality is not between a row's id and a key's id")
        at_key, at_row = (sides[0], sides[1]) if keyed[0] else (sides[1], sides[0])
        doc, (rows, keys) = at_key.args[0], at_key.args[1]
        if at_row.args[0] is not doc or at_row.args[1][0] is not rows:
            raise Unsupported("mask equality looks up two different id rows")
        if len(shape_of(doc)) != 2 or not _non_decreasing(doc):
            raise Unsupported("mask equality over ids not proven non-decreasing along the keys")
        key = self.affine(keys, self._arg_layout(keys, lay), key_labels)
        if key.a != 1 or key.b.const != 0 or key.b.terms:
            raise Unsupported("mask equality looks up ids at a shifted key index")
        # doc's dims: the rows its batch index picks, then the keys
        if _iota_source(rows, shape_of(doc)[0]) is None:
            raise Unsupported("mask equality picks id rows by something other than the batch index")
        row_dims = [d for d in L.broadcast_align(shape_of(rows), lay) if d]
        key_dims = [d for d in L.broadcast_align(shape_of(keys), lay) if d]
        if not row_dims and L.is_one(shape_of(doc)[0]):
            # batch 1 (HF detects packed sequences only then): the id row's unit batch dim
            # carries no axis, like every unit dim of a layout
            row_dims = [()]
        if len(row_dims) != 1 or len(key_dims) != 1 or not L.same_size(L.dim_size(key_dims[0]), shape_of(doc)[1]):
            raise Unsupported("mask equality over an id row that is not [batch, keys]")
        doc_plan = OperandPlan(doc, [row_dims[0], key_dims[0]])
        v_plan = OperandPlan(at_row, L.broadcast_align(shape_of(at_row), lay))
        lo = Bound(0, [(1, SearchBound(doc_plan, v_plan, False))])
        hi = Bound(0, [(1, SearchBound(doc_plan, v_plan, True))])
        return Pred("range", [lo], [hi])

    def affine(self, n, lay, key_labels) -> KeyAffine:
        c = self.facts.constant(n)
        if c is not None:
            if not isinstance(c, int):
                raise Unsupported("mask compares against a non-integer constant")
            return KeyAffine(0, Bound(c))
        if not isinstance(n, fx.Node):
            raise Unsupported("mask operand is not a tensor")
        lay = L.broadcast_align(shape_of(n), lay)  # its unit dims carry no axis
        if not (set(L.labels(lay)) & key_labels):
            if dtype_of_node(n).is_floating_point or dtype_of_node(n) == torch.bool:
                raise Unsupported("mask bound is not an integer tensor")
            while n.op == "call_function" and n.target is aten.unsqueeze.default:
                lay, n = self.back_layout(n.args[0], [n], lay), n.args[0]  # the tensor itself
            return KeyAffine(0, Bound(0, [(1, OperandPlan(n, lay))]))
        t = n.target
        if t is prims.iota.default:
            start, step = n.kwargs.get("start", 0), n.kwargs.get("step", 1)
            dimlabels = [a.label for a in lay[0]]
            if set(dimlabels) != key_labels or not isinstance(start, int) or step != 1:
                raise Unsupported("mask iota is not the key index")
            return KeyAffine(1, Bound(start))
        if t in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar):
            if n.kwargs.get("alpha", 1) != 1:
                raise Unsupported("mask arithmetic with alpha")
            l = self.affine(n.args[0], self._arg_layout(n.args[0], lay), key_labels)
            r = self.affine(n.args[1], self._arg_layout(n.args[1], lay), key_labels)
            sgn = 1 if t in (aten.add.Tensor, aten.add.Scalar) else -1
            return KeyAffine(l.a + sgn * r.a, l.b.plus(r.b.scaled(sgn)))
        if t is aten.index.Tensor:
            # X[rows, j] where every row of X is j + c (an expanded arange: HF's cache positions)
            src, idxs = n.args[0], n.args[1]
            c = _arange_offset(src)
            if c is None or not idxs or any(not isinstance(i, fx.Node) for i in idxs) or len(idxs) != len(shape_of(src)):
                raise Unsupported("mask index lookup in a tensor that is not an arange")
            inner = self.affine(idxs[-1], self._arg_layout(idxs[-1], lay), key_labels)
            return KeyAffine(inner.a, inner.b.plus(Bound(c)))
        if t in (aten.unsqueeze.default, aten.expand.default) or t in _CASTS or t in (
            aten.clone.default, aten.alias.default, aten.permute.default, aten.view.default,
            aten.reshape.default, aten._unsafe_view.default,
        ):
            if t in _CASTS and dtype_of_node(n).is_floating_point:
                raise Unsupported("mask index cast to float")
            return self.affine(n.args[0], self.back_layout(n.args[0], [n], lay), key_labels)
        raise Unsupported(f"mask index arithmetic {_opname(n)}")

    def _arg_layout(self, a, lay):
        return L.broadcast_align(shape_of(a), lay) if isinstance(a, fx.Node) else lay

    def range_plan(self, pred: Pred, mode: str, value: float) -> MaskPlan:
        """``pred`` is the set of hidden keys."""
        pred = pred.as_kind("hidden")
        ops: List[Any] = []
        lo = hi = None
        if pred.los:
            lo = len(ops)
            ops.append(("bound", pred.los, "max"))
        if pred.his:
            hi = len(ops)
            ops.append(("bound", pred.his, "min"))
        return MaskPlan(MaskTerm("range", lo=lo, hi=hi, mode=mode, value=value), ops)

    # ---- assemble ----------------------------------------------------------------------------
    def assemble(self, tk, qs, ks, y_lay, dim, kk, key_atoms, steps, w_plan, reduced, mask_plans, qk):
        u = self.u
        q_lab = L.labels(u.apply(qs.layout))
        k_lab = L.labels(u.apply(ks.layout))
        contracted = {u.find(a.label) for a in self.contracted}
        key_labels = [a.label for a in key_atoms]
        reduced = [u.find(r) for r in (reduced or [])]
        shared = [l for l in q_lab if l in k_lab and l not in contracted]
        q_only = [l for l in q_lab if l not in k_lab and l not in contracted]
        k_only = [l for l in k_lab if l not in q_lab and l not in contracted]
        if set(k_only) != set(key_labels):
            raise Unsupported("the key operand has an axis that is neither batch nor key")
        y_labels = L.labels(y_lay)
        order = {l: i for i, l in enumerate(y_labels)}
        B = sorted([l for l in shared if l not in reduced], key=lambda l: order.get(l, 1 << 30))
        S = sorted([l for l in q_only if l not in reduced], key=lambda l: order.get(l, 1 << 30))
        Hk = [l for l in shared if l in reduced]
        G = [l for l in q_only if l in reduced]
        D = [u.find(a.label) for a in self.contracted]
        if set(reduced) - set(Hk) - set(G):
            raise Unsupported("the head reduction sums over an axis that is not a query head")
        if set(y_labels) != set(B) | set(S) | set(key_labels):
            raise Unsupported(f"the top-k input has axes {y_labels} beyond batch, query and key")
        roles = {"B": B, "S": S, "H": Hk + G, "Hk": Hk, "D": D, "T": key_labels}

        spec_epi, spec_post, reduce = [], [], "none"
        if reduced is not None and (Hk or G):
            reduce = "weighted_sum" if w_plan is not None else "sum"
        target = spec_epi if reduce != "none" else spec_post
        for s in steps:
            if s[0] == "__reduce__":
                target = spec_post
            else:
                target.append(s)
        if reduce == "none" and any(s[0] == "__reduce__" for s in steps):
            # a sum over unit axes: nothing was reduced
            pass
        mask_terms, mask_operands = [], []
        for i, mp in enumerate(mask_plans):
            remap = {}
            for j, op in enumerate(mp.operands):
                remap[j] = len(mask_operands)
                mask_operands.append(op)
            term = mp.term
            term = dataclasses.replace(
                term,
                operand=None if term.operand is None else remap[term.operand],
                lo=None if term.lo is None else remap[term.lo],
                hi=None if term.hi is None else remap[term.hi],
            )
            mask_terms.append(term)
        base = len(mask_operands)
        mask_operands.extend(self.scalar_operands)

        def remap(steps):
            return [(st[0], st[1] + base) if st[0].endswith("_operand") else st for st in steps]

        spec_epi, spec_post = remap(spec_epi), remap(spec_post)
        score_dtype = dtype_name(dtype_of_node(tk.args[0]))
        logit_dtype = "float32"
        if spec_epi and spec_epi[0][0] == "round" and reduce != "none":
            logit_dtype = spec_epi.pop(0)[1]
        elif spec_post and spec_post[0][0] == "round" and reduce == "none":
            logit_dtype = spec_post.pop(0)[1]
        precision = "ieee"
        if qs.upcast_from is None and dtype_of_node(qs.src) == torch.float32:
            if torch.get_float32_matmul_precision() != "highest":
                precision = "tf32"
        spec = ScoreSpec(
            name=variant_name(reduce, spec_epi + spec_post, G, Hk),
            logit_dtype=logit_dtype,
            epilogue=tuple(spec_epi),
            reduce=reduce,
            post=tuple(spec_post),
            masks=tuple(mask_terms),
            score_dtype=score_dtype,
            fp32_precision=precision,
        ).validate(num_mask_operands=len(mask_operands))

        q_plan = OperandPlan(qs.src, u.apply(qs.src_layout), [B, S, Hk + G, D])
        k_plan = OperandPlan(ks.src, u.apply(ks.src_layout), [B, key_labels, Hk, D])
        if reduce == "weighted_sum":
            w_plan.layout = u.apply(w_plan.layout)
            w_plan.groups = [B, S, Hk + G]
            extra = set(L.labels(w_plan.layout)) - set(B) - set(S) - set(Hk) - set(G)
            if extra:
                raise Unsupported("the head weights vary along an axis that is not batch/query/head")
        else:
            w_plan = None
        place_mask_operands(u, mask_operands, B, S, key_labels)
        users = {gi.args[1]: gi for gi in tk.users if gi.target is operator.getitem}
        values_used = 0 in users and len(users[0].users) > 0
        if any(u_.target is not operator.getitem for u_ in tk.users):
            raise Unsupported("top-k result used as a tuple")
        sizes = {
            "B": _prod(a.size for l in B for a in _atoms(y_lay, l)),
            "S": _prod(a.size for l in S for a in _atoms(y_lay, l)),
            "H": _prod(a.size for l in Hk + G for a in _atoms(q_plan.layout, l)),
            "D": _prod(a.size for l in D for a in _atoms(q_plan.layout, l)),
            "T": _prod(a.size for a in key_atoms),
        }
        return SiteMatch(
            topk=tk, spec=spec, q=q_plan, k=k_plan, w=w_plan, mask_operands=mask_operands,
            score_layout=y_lay, topk_dim=dim, k_arg=kk, values_used=values_used, roles=roles,
            other_consumers=self.other_consumers, sizes=sizes, sorted=self.sorted,
            key_argument=self.key_argument,
        )


def place_mask_operands(u, mask_operands, B, S, T) -> None:
    """Give each mask operand its canonical groups once the axes' roles are known: tensors
    [B, S, T], per-row bounds [B, S] (a search bound's id rows [B, T]); 0-d scales keep
    none. Raises Unsupported for an operand that varies along an axis outside its groups."""
    for op in mask_operands:
        if isinstance(op, OperandPlan) and op.groups == []:
            continue  # a 0-d scale
        if isinstance(op, OperandPlan):
            op.layout = u.apply(op.layout)
            op.groups = [B, S, T]
            if set(L.labels(op.layout)) - set(B) - set(S) - set(T):
                raise Unsupported("a mask varies along a head axis")
            continue
        for bound in op[1]:
            for _, p in bound.terms:
                if isinstance(p, SearchBound):
                    p.sorted.layout = u.apply(p.sorted.layout)
                    p.sorted.groups = [B, T]
                    # (a unit batch dim carries no axis: batch 1)
                    lead = p.sorted.layout[0]
                    if (lead[0].label not in B) if lead else not L.is_one(shape_of(p.sorted.node)[0]):
                        raise Unsupported("a mask's id rows are not picked by the batch index")
                    p = p.values
                p.layout = u.apply(p.layout)
                p.groups = [B, S]
                if set(L.labels(p.layout)) - set(B) - set(S):
                    raise Unsupported("a per-row mask bound varies along a head axis")


def _strip_index_views(n):
    while isinstance(n, fx.Node) and n.target in (aten.unsqueeze.default, aten.clone.default, aten.alias.default) \
            or (isinstance(n, fx.Node) and n.target in _CASTS and not dtype_of_node(n).is_floating_point):
        n = n.args[0]
    return n


def _iota_source(n, size) -> Optional[fx.Node]:
    """The ``iota(size)`` (start 0, step 1) that ``n`` is an unsqueezed view of, else None."""
    n = _strip_index_views(n)
    if (isinstance(n, fx.Node) and n.target is prims.iota.default and n.kwargs.get("start", 0) == 0
            and n.kwargs.get("step", 1) == 1 and L.same_size(shape_of(n)[0], size)):  # (its size arg may be a node)
        return n
    return None


def _arange_offset(n) -> Optional[int]:
    """c when ``n[..., j] == j + c`` for every j and every leading index (an arange, offset by
    a constant, unsqueezed in front and expanded along the leading dims), else None."""
    while isinstance(n, fx.Node):
        t = n.target
        if t is aten.expand.default:
            src = n.args[0]
            if not L.same_size(shape_of(src)[-1], shape_of(n)[-1]) or len(shape_of(src)) != len(shape_of(n)):
                return None  # an expand that broadcasts the last dim would repeat one value
            n = src
        elif t is aten.unsqueeze.default:
            d = n.args[1] % len(shape_of(n))
            if d == len(shape_of(n)) - 1:
                return None
            n = n.args[0]
        elif t in (aten.clone.default, aten.alias.default) or (t in _CASTS and not dtype_of_node(n).is_floating_point):
            n = n.args[0]
        elif t in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar) and n.kwargs.get("alpha", 1) == 1:
            a, b = n.args[0], n.args[1]
            if not (isinstance(b, int) and not isinstance(b, bool)):
                return None
            inner = _arange_offset(a)
            if inner is None:
                return None
            return inner + (b if t in (aten.add.Tensor, aten.add.Scalar) else -b)
        elif t is prims.iota.default:
            start, step = n.kwargs.get("start", 0), n.kwargs.get("step", 1)
            return start if isinstance(start, int) and step == 1 else None
        else:
            return None
    return None


def _non_decreasing(n) -> bool:
    """``n`` is provably non-decreasing along its last dim: a cumsum there of a bool tensor
    (or of a bool cast to an integer type), as HF's packed-sequence ids are."""
    if not (isinstance(n, fx.Node) and n.target is aten.cumsum.default):
        return False
    if n.args[1] % len(shape_of(n)) != len(shape_of(n)) - 1:
        return False
    x = n.args[0]
    while isinstance(x, fx.Node) and x.target in _CASTS and not dtype_of_node(x).is_floating_point:
        x = x.args[0]
    return isinstance(x, fx.Node) and dtype_of_node(x) == torch.bool


def variant_name(reduce: str, epilogue, G, Hk) -> str:
    """A family name for diagnostics: what the matched score looks like."""
    relu = any(s[0] == "relu" for s in epilogue)
    if reduce == "weighted_sum":
        name = "dsa" if relu else "dsa-norelu"  # GLM-5 as Megatron writes it: no ReLU
    elif reduce == "sum":
        name = "head-sum" + ("-relu" if relu else "")
    else:
        name = "single-head"
    mods = [mod_name(s[1]) for s in epilogue if s[0] == "mod"]
    return name + ("-gqa" if Hk and G else "") + "".join(f"+{m}" for m in mods)


def _atoms(lay, label):
    return [a for d in lay for a in d if a.label == label]


def _prod(xs):
    out = 1
    for x in xs:
        out = out * x
    return out


def _opname(n) -> str:
    if not isinstance(n, fx.Node):
        return repr(n)
    t = n.target
    return getattr(t, "__name__", None) or str(t) if n.op == "call_function" else n.op


def _collective(n: fx.Node) -> Optional[str]:
    """The torch.distributed collective whose result ``n`` is (its ``wait_tensor`` or the
    functional collective itself), as '_c10d_functional.all_reduce.default'; else None."""
    t = n.target
    if not isinstance(t, torch._ops.OpOverload) or t.namespace not in ("_c10d_functional", "c10d_functional"):
        return None
    if t._schema.name.split("::")[-1] == "wait_tensor" and isinstance(n.args[0], fx.Node):
        return _collective(n.args[0]) or _stop_name(n.args[0])
    return _stop_name(n)


def _stop_name(n: fx.Node) -> str:
    """An op where the walk along the top-k axis ended, as 'aten.exp.default'; 'placeholder'
    and the like for graph inputs."""
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[-1]}.{t._overloadname}"
    return _opname(n)


_POINTWISE = {
    aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.add.Tensor, aten.add.Scalar,
    aten.sub.Tensor, aten.sub.Scalar, aten.relu.default, aten.clamp_min.default, aten.maximum.default,
    aten.neg.default, aten.sigmoid.default, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
    torch.ops.hyscale.score_mod.default,  # a registered mod's stand-in (passes/score_mods.py)
}
_REDUCTIONS = {aten.sum.dim_IntList, aten.sum.default}
MAX_CHAIN = 64
MAX_CANDIDATES = 4


def _back_view_dim(n: fx.Node, d: int) -> Optional[int]:
    """The input dim of view-like ``n`` that its output dim ``d`` comes from (None: lost)."""
    out, inp = shape_of(n), shape_of(n.args[0])
    t = n.target
    if t is aten.permute.default:
        return n.args[1][d] % len(inp)
    if t is aten.transpose.int:
        d0, d1 = n.args[1] % len(out), n.args[2] % len(out)
        return d1 if d == d0 else d0 if d == d1 else d
    if t is aten.t.default:
        return 1 - d if len(out) == 2 else d
    if t is aten.unsqueeze.default:
        u = n.args[1] % len(out)
        return None if d == u else d - (d > u)
    if t is aten.expand.default:
        j = d - (len(out) - len(inp))
        return j if j >= 0 and L.same_size(inp[j], out[d]) else None
    if t in (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.default,
             aten.squeeze.dim, aten.squeeze.dims):
        pre = L._prod_sizes(out[:d])
        acc = 1
        for j, sz in enumerate(inp):
            if L.same_size(acc, pre) and L.same_size(sz, out[d]):
                return j
            acc = acc * sz
        return None
    return d  # clone / alias / casts


def _key_inputs(n: fx.Node, d: int) -> List[Tuple[int, int]]:
    """(arg index, dim) of the inputs of ``n`` that carry its output dim ``d`` unbroadcast."""
    t = n.target
    if t in _VIEWS or t in _CASTS:
        j = _back_view_dim(n, d)
        return [] if j is None else [(0, j)]
    if t is aten.bmm.default:
        return {1: [(0, 1)], 2: [(1, 2)]}.get(d, [])
    if t is aten.mm.default:
        return [(0, 0)] if d == 0 else [(1, 1)]
    if t in _REDUCTIONS:
        nin = len(shape_of(n.args[0]))
        dims = sorted(x % nin for x in (n.args[1] if len(n.args) > 1 and n.args[1] is not None else range(nin)))
        keep = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 else False)
        if keep:
            return [] if d in dims else [(0, d)]
        kept = [j for j in range(nin) if j not in dims]
        return [(0, kept[d])]
    if t in _POINTWISE:
        out = shape_of(n)
        res = []
        for i, a in enumerate(n.args):
            if not isinstance(a, fx.Node) or not isinstance(val(a), torch.Tensor):
                continue
            sh = shape_of(a)
            j = d - (len(out) - len(sh))
            if j >= 0 and not L.is_one(sh[j]) and L.same_size(sh[j], out[d]):
                res.append((i, j))
        return res
    return []


def axis_source(n: fx.Node, d: int) -> fx.Node:
    """The tensor dim ``d`` of ``n`` comes from, through views, widening casts and linear maps
    (the rows of ``k`` for ``k @ H``); it stops where the axis cannot be followed."""
    while isinstance(n, fx.Node) and n.op == "call_function" and (
            n.target in CONTRACTIONS or n.target in _VIEWS or n.target in _CASTS):
        ins = _key_inputs(n, d)
        if len(ins) != 1:
            break
        (i, d), = ins
        n = n.args[i]
    return n


def free_axes_from_activations(facts: GraphFacts, n: fx.Node) -> bool:
    """Do both uncontracted axes of contraction ``n`` (its rows and columns) come from
    activations? ``x @ (E @ H).T`` over rotated expert embeddings does not: a router."""
    # (a constant input itself is not from activations: from_activations covers it)
    return all(facts.from_activations(axis_source(n, d)) for d in ((0, 1) if n.target is aten.mm.default else (1, 2)))


def candidate_chains(facts: GraphFacts, x: fx.Node, dim: int):
    """Chains [(node, chain arg)] from a contraction to ``x``, following the input that
    carries the top-k axis; nearest contraction first. A contraction whose key-carrying
    operand is itself a score (HF's head sum as a matmul) is both a candidate and a step."""
    out = []
    stops = []  # where the key axis could not be followed further (for the diagnostic)
    unknown = []  # ... at a float pointwise op the matcher does not know (a score mod?)

    def walk(node, d, suffix, depth):
        if len(out) >= MAX_CANDIDATES or depth > MAX_CHAIN or not isinstance(node, fx.Node):
            return
        if node.op != "call_function":
            stops.append(node.op)
            return
        if node.target in BIASED:
            out.append([(node, None)] + suffix)
            return
        ins = _key_inputs(node, d)
        if node.target in CONTRACTIONS:
            out.append([(node, None)] + suffix)
        elif not ins:
            known = any(node.target in ops for ops in (_VIEWS, _CASTS, _REDUCTIONS, _POINTWISE))
            coll = _collective(node)
            stops.append(f"{coll}!" if coll else _stop_name(node) + ("" if known else "*"))
            v = val(node)
            if (isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags
                    and isinstance(v, torch.Tensor) and v.is_floating_point()):
                unknown.append(_opname(node))
        # several carriers (score + mask): try the contraction-derived ones first
        ins.sort(key=lambda ij: node.args[ij[0]] not in facts.dep)
        for i, j in ins:
            walk(node.args[i], j, [(node, i)] + suffix, depth + 1)

    walk(x, dim, [], 0)
    # Deepest first: a contraction that is a step of a deeper candidate's chain (HF's
    # weights matmul over the scores) is tried after that candidate. Candidates deeper
    # than the score contraction (the key projection ``x @ Wk``) fail the selection check.
    steps = [{n for n, _ in c[1:]} for c in out]
    return sorted(out, key=lambda c: sum(c[0][0] in st for st in steps)), (stops, unknown)


def analyse_site(facts: GraphFacts, topk: fx.Node) -> SiteMatch:
    x = topk.args[0]
    rank = len(shape_of(x)) if isinstance(val(x), torch.Tensor) else 0
    if rank == 0:
        raise Unsupported("top-k of a 0-d tensor")
    args = list(topk.args) + [None] * (5 - len(topk.args))
    dim = topk.kwargs.get("dim", args[2] if args[2] is not None else -1) % rank
    chains, (stops, unknown) = candidate_chains(facts, x, dim)
    # A deeper contraction that reaches a later one as its plain operand, not through a head
    # reduction, is part of computing that operand (the keys' Hadamard rotation ``k @ H``):
    # the later contraction is the score, and the rotation stays as graph ops before the op.
    chains = [c for c in chains if all(_head_reduction(n, ci) for n, ci in c[1:] if n.target in CONTRACTIONS)]
    if not chains:
        hint = (f"; {', '.join(sorted(set(unknown)))}: elementwise, and not known to the matcher (if a "
                "contraction feeds it, teach it with hyscale_compile.register_score_mod)") if unknown else ""
        # ops where the walk ended (a contraction may lie beyond them), rather than inputs;
        # '*': an op the matcher does not know, else one that does not carry the axis
        ops = sorted({s for s in stops if s not in ("placeholder", "get_attr")})
        if ops:
            why = []
            colls = [s[:-1] for s in ops if s.endswith("!")]
            alien = [s[:-1] for s in ops if s.endswith("*")]
            known = [s for s in ops if not s.endswith(("*", "!"))]
            if colls:
                partial = any(c.split(".")[1].startswith(("all_reduce", "reduce_scatter")) for c in colls)
                why.append(f"{', '.join(colls)} (a collective: " + (
                    "the scores before it are this rank's partial sum, e.g. over its tensor-parallel heads, "
                    "and a partial sum is never fused)" if partial else "the top-k axis is not followed through it)"))
            if alien:
                why.append(f"{', '.join(alien)} (not a view, cast, pointwise step or contraction the matcher knows)")
            if known:
                why.append(f"{', '.join(known)} (which does not carry the top-k axis through: it merges, reduces or "
                           "broadcasts it)")
            raise Unsupported(f"the walk back from the top-k stopped at {' and at '.join(why)}", hint=hint)
        where = f" (followed the top-k axis back to {', '.join(sorted(set(stops)))})" if stops else ""
        raise Unsupported(f"no contraction (einsum/matmul/bmm) feeds the top-k scores{where}", hint=hint)
    # A contraction that is a step of a deeper candidate (HF's weights matmul over the
    # scores) is the head reduction, not the score: never try it on its own, or a failure
    # of the real score contraction would fall back to a rewrite that keeps the table.
    # Deeper candidates that are linear layers (a parameter operand) do not count.
    real = [c for c in chains if not _linear_layer(facts, c[0][0])]
    shadowed = {n for c in real for n, _ in c[1:]}
    first = None
    for chain in chains:
        if chain[0][0] in shadowed:
            continue
        try:
            if chain[0][0].target in BIASED:
                _biased(facts, chain[0][0])
            return SiteAnalysis(facts, topk, chain).run()
        except Unsupported as e:
            first = first or e
    raise first


def _head_reduction(n: fx.Node, ci: int) -> bool:
    """Can contraction ``n``, whose arg ``ci`` carries a deeper contraction's output, sum that
    output over heads? Only with one output row (column): HF's weights matmul
    ``bmm(w [n, 1, h], s [n, h, t])``."""
    other = shape_of(n.args[1 - ci])
    return len(other) >= 2 and L.is_one(other[-2] if ci == 1 else other[-1])


def _linear_layer(facts, n) -> bool:
    """A contraction with a parameter, buffer, global or closure-captured operand (an
    nn.Linear and friends)."""
    if n.target in BIASED:
        return True
    return any(facts.is_constant_input(walk_views(a)[0]) for a in n.args[:2])


def _biased(facts, n):
    src, _ = walk_views(n.args[2])
    if facts.is_constant_input(src):
        raise Unsupported(
            f"not a selection: the key-side operand of the contraction is {facts.describe_input(src)} "
            "(a router or sampler top-k, not sparse attention)"
        )
    raise Unsupported("the scores come from a contraction with an added bias (addmm/baddbmm)")
