"""Rewrite each matched selection into one ``torch.ops.hyscale`` call.

For a ``SiteMatch`` (``canonicalize.py``) this builds the canonical operands with views
and permutes of tensors the graph already has (q [B,S,H,D], k [B,T,Hk,D], w [B,S,H],
masks [B,S,T] or per-row bounds [B,S]; weights that broadcast over rows are expanded, a
stride-0 view), checks them with the op's own operand checks, calls the op, casts the int32
indices to the int64 that ``aten.topk`` gave, and lays them out the way the top-k's
consumers expect. The score subgraph is then dead unless something else reads it, and DCE
removes it.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..lowerings import ops as hy_ops  # noqa: F401  (registers torch.ops.hyscale)
from ..lowerings.reference import check_operands
from ..lowerings.spec import SpecError
from . import layout as L
from torch.utils.checkpoint import CheckpointPolicy

from .partition import tag_saved
from .canonicalize import Bound, OperandPlan, SearchBound, SiteMatch, Unsupported, shape_of, val

aten = torch.ops.aten
prims = torch.ops.prims


class Emitter:
    """Inserts nodes before ``anchor`` with fake-tensor metadata; can roll back."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node):
        self.graph = graph
        self.anchor = anchor
        self.created: List[fx.Node] = []
        vals = [n.meta.get("val") for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        self.fake_mode = detect_fake_mode(vals)
        self.sizes: Dict[str, Tuple[fx.Node, int]] = {}  # atom label -> (node, dim)
        # symbols already bound to a node (SymInt placeholders, sym_size calls) before anchor
        self.symbols: Dict[Any, fx.Node] = {}
        for n in graph.nodes:
            if n is anchor:
                break
            v = n.meta.get("val")
            if isinstance(v, torch.SymInt) and v.node.expr.is_Symbol:
                self.symbols.setdefault(v.node.expr, n)

    def call(self, target, args, kwargs=None) -> fx.Node:
        kwargs = kwargs or {}
        with self.graph.inserting_before(self.anchor):
            n = self.graph.call_function(target, tuple(args), kwargs)
        self.created.append(n)
        fa = fx.node.map_arg(args, lambda a: a.meta["val"])
        fk = fx.node.map_arg(kwargs, lambda a: a.meta["val"])
        if self.fake_mode is not None:
            with self.fake_mode:
                n.meta["val"] = target(*fa, **fk)
        else:
            n.meta["val"] = target(*fa, **fk)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "partitioner_tag", "autograd_backward"):
            if key in self.anchor.meta:
                n.meta[key] = self.anchor.meta[key]
        return n

    def rollback(self):
        for n in reversed(self.created):
            if not n.users:
                self.graph.erase_node(n)
        self.created.clear()

    # -- sizes --------------------------------------------------------------------------
    def size_arg(self, atoms: List[L.Atom]):
        """An FX argument for the product of atom sizes (an int when static)."""
        out: Any = 1
        for a in atoms:
            s = a.size
            if isinstance(s, int) or (hasattr(s, "node") and s.node.is_constant()):
                s = int(s)
            elif a.label in self.sizes:
                node, d = self.sizes[a.label]
                s = self.call(aten.sym_size.int, [node, d])
            else:
                s = self.symbolic(s)
            out = s if (isinstance(out, int) and out == 1) else (
                out * s if isinstance(out, int) and isinstance(s, int) else self.call(operator.mul, [out, s])
            )
        return out

    def symbolic(self, s) -> Any:
        """An FX value for SymInt ``s`` built from bound symbols: c * s0 * s1 ..."""
        expr = s.node.expr
        factors = expr.args if expr.is_Mul else (expr,)
        out: Any = 1
        for f in factors:
            if f.is_Integer:
                term: Any = int(f)
            elif f in self.symbols:
                term = self.symbols[f]
            else:
                raise Unsupported(f"dynamic size {expr} is not a product of graph symbols")
            if isinstance(out, int) and out == 1:
                out = term
            elif isinstance(out, int) and isinstance(term, int):
                out = out * term
            else:
                out = self.call(operator.mul, [out, term])
        return out

    def register(self, node: fx.Node, atoms_per_dim: List[Optional[L.Atom]]):
        for d, a in enumerate(atoms_per_dim):
            if a is not None and a.label not in self.sizes:
                self.sizes[a.label] = (node, d)

    # -- operands -------------------------------------------------------------------------
    def operand(self, plan: OperandPlan) -> fx.Node:
        """View/permute ``plan.node`` into the canonical groups (missing axes -> size 1)."""
        x = plan.node
        lay = plan.layout
        shape = shape_of(x)
        if len(lay) != len(shape) or not all(L.same_size(L.dim_size(d), s) for d, s in zip(lay, shape)):
            raise Unsupported(f"internal: the layout {lay} does not cover operand {x.name} of shape {tuple(shape)}")
        # 1. one tensor dim per atom
        flat: List[Optional[L.Atom]] = []
        for d in lay:
            flat.extend(d if d else [None])
        if len(flat) != len(lay):
            x = self.call(aten.view.default, [x, [1 if a is None else self.size_arg([a]) for a in flat]])
        self.register(x, flat)
        # 2. permute atoms into group order; everything left over must be a unit dim
        pos = {a.label: i for i, a in enumerate(flat) if a is not None}
        perm, group_atoms = [], []
        for g in plan.groups:
            present = [l for l in g if l in pos]
            perm.extend(pos[l] for l in present)
            group_atoms.append([flat[pos[l]] for l in present])
        used = set(perm)
        for i, a in enumerate(flat):
            if i not in used:
                if a is not None:
                    raise Unsupported(f"operand axis {a} has no role")
                perm.append(i)
        if perm != list(range(len(flat))):
            x = self.call(aten.permute.default, [x, perm])
        permuted = [flat[i] for i in perm]
        self.register(x, permuted)
        # 3. merge each group into one dim
        target = []
        for g, atoms in zip(plan.groups, group_atoms):
            if len(atoms) < len([l for l in g]) and atoms:
                # partially present group: broadcast the missing axes, then merge (copies)
                raise Unsupported("operand lacks some axes of a merged group")
            target.append(atoms)
        simple = all(len(a) <= 1 for a in target)
        if simple:
            # unsqueeze absent groups / squeeze trailing units: no sizes needed
            ndims = sum(len(a) for a in target)
            extra = len(permuted) - ndims
            for _ in range(extra):
                x = self.call(aten.squeeze.dim, [x, -1])
            for gi, atoms in enumerate(target):
                if not atoms:
                    x = self.call(aten.unsqueeze.default, [x, gi])
            return x
        sizes = [1 if not atoms else self.size_arg(atoms) for atoms in target]
        return self.call(aten.reshape.default, [x, sizes])

    def search(self, plan: SearchBound) -> fx.Node:
        """``searchsorted`` of each row's value in its batch's sorted key row: [B, S]."""
        doc = self.operand(plan.sorted)  # [B, T]
        v = self.operand(plan.values)  # [B or 1, S or 1]
        v = self.call(aten.expand.default, [v, [self.size_arg(plan.sorted.layout[0]), -1]])
        return self.call(aten.searchsorted.Tensor, [doc, self.call(aten.contiguous.default, [v])],
                         {"right": plan.right})

    def bound(self, bounds: List[Bound], agg: str) -> fx.Node:
        nodes = []
        for b in bounds:
            acc: Optional[fx.Node] = None
            for coef, plan in b.terms:
                t = self.search(plan) if isinstance(plan, SearchBound) else self.operand(plan)
                if val(t).dtype != torch.int64:
                    t = self.call(prims.convert_element_type.default, [t, torch.int64])
                if coef != 1:
                    t = self.call(aten.mul.Tensor, [t, coef])
                acc = t if acc is None else self.call(aten.add.Tensor, [acc, t])
            if acc is None:
                dev = val(self.anchor.args[0]).device
                acc = self.call(
                    aten.full.default, [[1, 1], b.const], {"dtype": torch.int64, "device": dev, "pin_memory": False}
                )
            elif b.const:
                acc = self.call(aten.add.Tensor, [acc, b.const])
            nodes.append(acc)
        out = nodes[0]
        for n in nodes[1:]:
            out = self.call(aten.maximum.default if agg == "max" else aten.minimum.default, [out, n])
        return out


@dataclasses.dataclass
class Applied:
    """What ``apply_match`` inserted (the sparse backward builds on it)."""

    call: fx.Node  # the selection op
    q: fx.Node  # canonical operands, views of m.q.node / m.k.node / m.w.node
    k: fx.Node
    w: Optional[fx.Node]
    masks: List[fx.Node]
    idx: fx.Node  # the op's int32 indices [B, S, k]
    values: Optional[fx.Node]  # the op's values [B, S, k] ...
    values_out: Optional[fx.Node]  # ... and as laid out for the top-k's consumers


def apply_match(graph: fx.Graph, m: SiteMatch, replay: bool = True) -> Applied:
    """Insert the op for ``m`` and reroute the top-k's consumers."""
    tk = m.topk
    em = Emitter(graph, tk)
    try:
        q = em.operand(m.q)
        k = em.operand(m.k)
        w = _weights_per_row(em, em.operand(m.w), q) if m.w is not None else None
        masks = []
        for op in m.mask_operands:
            if isinstance(op, OperandPlan):
                masks.append(em.operand(op))
            else:
                masks.append(em.bound(op[1], op[2]))
        _check_call(m, q, k, w, masks)
        spec = m.spec.to_json()
        # topk(sorted=False) passes its flag on (the op may then skip its sort); the default
        # is left out of the call
        args = [q, k, w, masks, m.k_arg, spec] + ([] if m.sorted else [False])
        if m.values_used:
            call = em.call(torch.ops.hyscale.hytopk_values.default, args)
            vals = em.call(operator.getitem, [call, 0])
            idx = em.call(operator.getitem, [call, 1])
        else:
            call = em.call(torch.ops.hyscale.hytopk.default, args)
            vals, idx = None, call
        idx64 = em.call(prims.convert_element_type.default, [idx, torch.int64])
        # the backward rebuilds the int64 view from the saved int32 indices (half the bytes)
        idx64.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        outs = {1: _to_score_layout(em, idx64, m)}
        if vals is not None:
            outs[0] = _to_score_layout(em, vals, m)
    except Exception:
        em.rollback()
        raise
    if replay:
        tag_saved(call)
    elif "recompute" in tk.meta:  # measurement only: recompute the selection as the policy said
        call.meta["recompute"] = tk.meta["recompute"]
        for u in call.users:
            u.meta["recompute"] = tk.meta["recompute"]
    for gi in list(tk.users):
        i = gi.args[1]
        if i in outs:
            gi.replace_all_uses_with(outs[i])
    return Applied(call=call, q=q, k=k, w=w, masks=masks, idx=idx, values=vals, values_out=outs.get(0))


def _weights_per_row(em: Emitter, w: fx.Node, q: fx.Node) -> fx.Node:
    """Weights with unit batch, query or head axes (one vector [H] for every token, [1, S, H],
    [B, 1, H] ...) as the op's [B, S, H]: an expand, a stride-0 view of the same storage that
    both implementations read by strides. Weights already [B, S, H] are left as they are."""
    ws, qs = shape_of(w), shape_of(q)
    if len(ws) != 3:
        return w  # (_check_call names the problem)
    sizes: List[Any] = []
    for d in range(3):
        if statically_known_true(ws[d] == qs[d]):
            sizes.append(-1)
        elif statically_known_true(ws[d] == 1):
            s = qs[d]
            sizes.append(int(s) if isinstance(s, int) or s.node.is_constant() else em.call(aten.sym_size.int, [q, d]))
        else:
            return w
    if all(isinstance(s, int) and s == -1 for s in sizes):
        return w
    return em.call(aten.expand.default, [w, sizes])


def _check_call(m: SiteMatch, q: fx.Node, k: fx.Node, w: Optional[fx.Node], masks: List[fx.Node]) -> None:
    """The op's own operand checks, on the fake operands: a call the rewrite emits is one the
    op accepts, so a site is left alone here (with the reason) rather than failing at run time."""
    topk = val(m.k_arg) if isinstance(m.k_arg, fx.Node) else m.k_arg
    try:
        check_operands(val(q), val(k), None if w is None else val(w), [val(x) for x in masks], topk, m.spec)
    except SpecError as e:
        raise Unsupported(f"the op would reject the operands the rewrite builds: {e}") from None


def _to_score_layout(em: Emitter, x: fx.Node, m: SiteMatch) -> fx.Node:
    """[B, S, k] -> the layout of the original top-k output (key dim replaced by k)."""
    B, S = m.roles["B"], m.roles["S"]
    y = m.score_layout
    atoms = {a.label: a for d in y for a in d}
    b_atoms = [atoms[l] for l in B]
    s_atoms = [atoms[l] for l in S]
    # register sizes of single-atom dims of the original top-k input
    em.register(m.topk.args[0], [d[0] if len(d) == 1 else None for d in y])
    flat_sizes = None
    if len(b_atoms) != 1 or len(s_atoms) != 1:
        flat_sizes = [em.size_arg([a]) for a in b_atoms + s_atoms] + [m.k_arg]
        x = em.call(aten.view.default, [x, flat_sizes])
    order = [a.label for a in b_atoms + s_atoms] + ["__k__"]
    want = []
    for i, d in enumerate(y):
        if i == m.topk_dim:
            want.append("__k__")
        else:
            want.extend(a.label for a in d)
    perm = [order.index(l) for l in want]
    if perm != list(range(len(perm))):
        x = em.call(aten.permute.default, [x, perm])
    out_shape = shape_of(m.topk.args[0])
    cur_shape = tuple(val(x).shape)
    target = list(out_shape)
    target[m.topk_dim] = val(x).shape[want.index("__k__")]
    if len(cur_shape) == len(target) and all(statically_known_true(a == b) for a, b in zip(cur_shape, target)):
        return x
    # unit dims and merged dims of the original layout
    if all(len(d) <= 1 for d in y):
        for i, d in enumerate(y):
            if not d and i != m.topk_dim:
                x = em.call(aten.unsqueeze.default, [x, i])
        return x
    sizes = []
    for i, d in enumerate(y):
        sizes.append(m.k_arg if i == m.topk_dim else (1 if not d else em.size_arg(list(d))))
    return em.call(aten.reshape.default, [x, sizes])
