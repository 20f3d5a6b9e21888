"""The indexer's sparse-stage KL loss, rewritten at the k selected slots.

DeepSeek-V3.2's sparse stage trains the indexer with ``sum_t KL(target_t || softmax(I_t))``
restricted to the selected set; Megatron-Core writes it (``compute_dsa_indexer_loss``,
``dsa_indexer_use_sparse_loss=True``) over two dense [B, S, T] tables::

    scores = bmm(query.float(), key.float()) * scale + causal + index_mask   # [b, np, sq, sk]
    target = softmax(scores).sum(heads); target = target / target.sum(-1, keepdim=True)
    p = softmax(index_scores + index_mask)                                      # [b, sq, sk]
    loss = (target * (log(target + eps) - log(p + eps))).sum(-1).mean() * coeff

with ``index_mask = full(-inf).scatter_(-1, topk_indices, 0)``. This pass runs before the
selection pass, on the graph that still has the ``aten.topk``. For each top-k it finds the
term above (``_KL``) and proves it reads only the selected slots: the index softmax's input
is the top-k's own input plus an index mask of its indices, and the target is a softmax
(over the key axis) of a score chain the attention pass's analysis accepts with that index
mask applied (``attention.analyse``: every unselected key gets ``-inf``), summed over the
axes the index mask is broadcast over (the heads) and L1-normalised over the keys. At an
unselected key both tables are then exactly 0, and the per-entry term (with ``eps > 0``) is
exactly 0: the sum over T is the sum over the k slots.

The rewrite (``hyscale_compile.losses.sparse_indexer_kl``'s arithmetic, in the graph):

* index side: the top-k's values (``getitem(topk, 0)``: the table at the indices, the
  selection pass then emits ``hytopk_values``) and ``_softmax`` over the slots;
* target: ``hyscale.sparse_attention(q, k, v[..., :1], idx, masks, spec, return_probs=True)``
  on the target chain's q and k (``probs`` is not differentiable: the target stays detached),
  normalised over the slots; keys that are MLA up-projections of a latent run over the latent,
  the key up-projection absorbed into the query (``mla.absorb`` with no value: the op's output
  is not read), as the attention pass does for the model's own attention;
* in a joint graph, the term's backward (the backward nodes sharing a ``seq_nr`` with the
  loss's forward) is replaced by its derivative at the slots, scattered into the table's
  gradient as the top-k's own backward would (stamped with its ``seq_nr``): the selection
  pass's sparse backward (``sparse_backward.py``) then replaces that and the indexer's score
  backward with ``hytopk_values_backward``. The region must take one gradient (the row sum's)
  and give one (the index table's): a target that is not detached keeps the site dense.

The loss's own gradient convention is left as it is: Megatron's ``DSAIndexerLossAutoScaler``
reads a class attribute in its backward, which Dynamo does not trace (a graph break), so the
loss is an output of the compiled graph and its gradient arrives as a tangent; a traced
scaler's gradient arrives the same way, through the row sum.

Left dense, with the reason in ``explain``: the dense warm-up (``dsa_indexer_use_sparse_loss=False``:
no index mask on either table), a per-entry term other than the one above (``xlogy``,
``kl_div``), ``eps <= 0`` (``0 * log 0``: NaN in the original), anything the walk does not
recognize.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..lowerings import attention_ops  # noqa: F401  (registers torch.ops.hyscale.sparse_attention)
from ..lowerings.attention_reference import check_attention_operands
from ..lowerings.spec import SpecError
from . import diagnostics, mla
from .attention import MaskWalk, Region, _applications, _chain_back, _forward_users, _Reject, _softmax_of, analyse
from .canonicalize import GraphFacts, OperandPlan, Unsupported, is_backward_node, shape_of, val
from .rewrite import Emitter

aten = torch.ops.aten


@dataclasses.dataclass
class LossRecord:
    """One indexer KL loss found beside a selection: rewritten at the k slots or left dense."""

    selection: str  # the top-k's index node
    site: str  # the row sum of the per-entry KL term
    rewritten: bool
    reason: str = ""
    sizes: Dict[str, Any] = dataclasses.field(default_factory=dict)
    backward: str = ""  # joint graphs: "sparse" (at the slots) or ""
    graph: str = ""

    def line(self) -> str:
        if self.rewritten:
            sz = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
            bw = "; backward: at the k slots" if self.backward == "sparse" else ""
            return (f"[indexer loss: sparse] {self.site} (indices of {self.selection}): KL over the k selected slots "
                    f"{sz} | target: hyscale.sparse_attention probs (detached), index: the selection's values{bw}")
        return f"[indexer loss: dense] {self.site} (indices of {self.selection}): {self.reason}"


def record_loss(rec: LossRecord) -> None:
    from torch._dynamo.utils import counters

    with diagnostics._lock:
        diagnostics._losses.append(rec)
    counters["hyscale"]["indexer_loss_sparse" if rec.rewritten else "indexer_loss_dense"] += 1
    diagnostics.log.info("hyscale: %s", rec.line())


def loss_records() -> List[LossRecord]:
    with diagnostics._lock:
        return list(diagnostics._losses)


# ------------------------------------------------------------------------------------------
# The per-entry term: target * (log(target + c1) - log(p + c2)), summed over the keys
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _KL:
    target: fx.Node  # L1-normalised head sum [B, S, T]
    p: fx.Node  # the index softmax [B, S, T]
    c1: Optional[float]  # None: not a constant (a 0-d graph input)
    c2: Optional[float]
    rowsum: fx.Node  # sum(term, [-1]) -> [B, S]
    nodes: List[fx.Node]  # a1, l1, a2, l2, d, term, rowsum
    mul_target_first: bool


def _only_user(n: fx.Node) -> Optional[fx.Node]:
    us = _forward_users(n)
    return us[0] if len(us) == 1 else None


def _const(facts: GraphFacts, x) -> Optional[float]:
    c = facts.constant(x) if isinstance(x, (fx.Node, int, float)) else None
    return None if c is None else float(c)


def _last_dim(n: fx.Node, dims) -> bool:
    nd = len(shape_of(n))
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] % nd == nd - 1


def _kl_of(facts: GraphFacts, p: fx.Node) -> Optional[_KL]:
    """The KL term that reads the index softmax ``p`` as its second distribution, or None."""
    a2 = _only_user(p)
    if a2 is None or a2.target is not aten.add.Tensor or a2.args[0] is not p:
        return None
    l2 = _only_user(a2)
    if l2 is None or l2.target is not aten.log.default:
        return None
    d = _only_user(l2)
    if d is None or d.target is not aten.sub.Tensor or d.args[1] is not l2 or d.kwargs.get("alpha", 1) != 1:
        return None
    l1 = d.args[0]
    if not isinstance(l1, fx.Node) or l1.target is not aten.log.default:
        return None
    a1 = l1.args[0]
    if a1.target is not aten.add.Tensor:
        return None
    t = a1.args[0]
    term = _only_user(d)
    if term is None or term.target is not aten.mul.Tensor or t not in term.args or d not in term.args:
        return None
    rowsum = _only_user(term)
    if rowsum is None or rowsum.target is not aten.sum.dim_IntList or not _last_dim(term, rowsum.args[1]) or \
            (len(rowsum.args) > 2 and rowsum.args[2]) or rowsum.kwargs.get("keepdim") or rowsum.kwargs.get("dtype"):
        return None
    if set(_forward_users(t)) != {a1, term} or _forward_users(l1) != [d]:
        return None
    return _KL(t, p, _const(facts, a1.args[1]), _const(facts, a2.args[1]), rowsum,
               [a1, l1, a2, l2, d, term, rowsum], term.args[0] is t)


def _softmax_nodes_of(x: fx.Node) -> List[fx.Node]:
    """The outputs of decomposed softmaxes (amax, sub, exp, sum, div) over ``x``'s last dim,
    whatever else reads ``x``."""
    out = []
    for am in _forward_users(x):
        if am.target is not aten.amax.default or not _last_dim(x, am.args[1]):
            continue
        for sub in _forward_users(am):
            if sub.target is aten.sub.Tensor and tuple(sub.args) == (x, am):
                ex = _only_user(sub)
                if ex is not None and ex.target is aten.exp.default:
                    dv = [u for u in _forward_users(ex) if u.target is aten.div.Tensor and u.args[0] is ex]
                    out.extend(dv)
    return out


# ------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------


def rewrite_indexer_losses(graph: fx.Graph, sources, graph_kind: str, sparse_attention: bool = True,
                           dry_run: bool = False) -> int:
    """Rewrite every sparse-stage indexer loss beside an ``aten.topk``; one record per loss
    found. Returns how many were rewritten. ``sparse_attention=False`` (the option) or
    ``dry_run`` (``hyscale.enable=False``): record what it would do, rewrite nothing."""
    enabled = sparse_attention and not dry_run
    off_reason = "hyscale.enable=False" if dry_run else "hyscale.sparse_attention=False"
    topks = [n for n in graph.nodes if n.op == "call_function" and n.target is aten.topk.default]
    if not topks:
        return 0
    try:
        recs = _rewrite_all(graph, topks, sources, graph_kind, enabled, off_reason)
    except Exception as e:  # a bug of ours must not break the user's compile: the loss stays dense
        diagnostics.log.warning("hyscale: internal error in the indexer-loss pass; loss left dense", exc_info=True)
        recs = [LossRecord("?", "?", False, f"internal error ({type(e).__name__}: {e}); please report")]
    for r in recs:
        r.graph = graph_kind
        record_loss(r)
    n = sum(r.rewritten for r in recs)
    if n:
        graph.eliminate_dead_code()  # so that the selection pass sees the table's remaining readers
    return n


def _rewrite_all(graph, topks, sources, graph_kind, enabled, off_reason) -> List[LossRecord]:
    recs: List[LossRecord] = []
    facts = GraphFacts(graph, sources=sources)
    for tk in topks:
        idxs = [u for u in tk.users if u.target is operator.getitem and u.args[1] == 1]
        if len(idxs) != 1:
            continue
        idx, x = idxs[0], tk.args[0]
        # the dense warm-up: the index softmax reads the table itself
        for p in _softmax_nodes_of(x):
            kl = _kl_of(facts, p)
            if kl is not None:
                recs.append(LossRecord(idx.name, kl.rowsum.name, False, "dense warm-up loss: no index mask"))
        walk = MaskWalk(facts, Emitter(graph, idx))
        apps = []
        for sc in walk.scatters(idx):
            try:
                walk.start(sc)
                apps.extend(_applications(walk, sc))
            except _Reject:
                continue
        for app, i, masked in apps:
            if app.target is not aten.add.Tensor or app.args[1 - i] is not x:
                continue
            p = _softmax_of(app)
            kl = _kl_of(facts, p[1]) if p is not None else None
            if kl is None:
                readers = ", ".join(u.name for u in _forward_users(app))
                recs.append(LossRecord(idx.name, app.name, False, f"the masked index scores are read by {readers}, "
                                       "not by a softmax and the KL term t * (log(t + eps) - log(p + eps)) summed "
                                       "over the keys (other spellings, xlogy or kl_div, are not rewritten)"))
                continue
            rec = LossRecord(idx.name, kl.rowsum.name, False)
            try:
                if masked.uns != -math.inf or masked.sel != 0:
                    raise _Reject("the index scores' mask is not 0 at the selected keys and -inf elsewhere")
                if p[0] != len(shape_of(app)) - 1:
                    raise _Reject("the index softmax does not run over the key axis")
                _rewrite_site(graph, facts, tk, idx, x, app, kl, apps, graph_kind, enabled, off_reason, rec)
            except (_Reject, Unsupported) as e:
                rec.reason = str(e)
            recs.append(rec)
        walk.em.rollback()
    return recs


def _target_region(facts: GraphFacts, kl: _KL, apps, em: Emitter):
    """The target's attention region: ``target = h / h.sum(-1, keepdim)``, ``h =
    softmax(chain).sum(heads)``, where the chain applies an index mask of the indices. Its
    value contraction is a stand-in built with ``em`` (the caller removes it)."""
    t = kl.target
    if t.target is not aten.div.Tensor or not isinstance(t.args[1], fx.Node):
        raise _Reject("the target is not L1-normalised as h / h.sum(-1, keepdim=True)")
    h, s = t.args
    if s.target is not aten.sum.dim_IntList or s.args[0] is not h or not _last_dim(h, s.args[1]) or \
            not (len(s.args) > 2 and s.args[2] or s.kwargs.get("keepdim")) or set(_forward_users(h)) != {s, t}:
        raise _Reject("the target is not L1-normalised as h / h.sum(-1, keepdim=True)")
    if h.target is not aten.sum.dim_IntList or (len(h.args) > 2 and h.args[2]) or h.kwargs.get("dtype"):
        raise _Reject("the target is not a sum of attention probabilities over the heads")
    p = h.args[0]
    if _forward_users(p) != [h]:
        raise _Reject("the target's attention probabilities are read elsewhere")
    ex = p.args[0] if p.target is aten.div.Tensor else None
    sub = ex.args[0] if isinstance(ex, fx.Node) and ex.target is aten.exp.default else None
    x = sub.args[0] if isinstance(sub, fx.Node) and sub.target is aten.sub.Tensor else None
    sm = _softmax_of(x) if isinstance(x, fx.Node) else None
    if sm is None or sm[1] is not p:
        raise _Reject("the target is not the head sum of a softmax")
    nd = len(shape_of(x))
    if sm[0] != nd - 1:
        raise _Reject("the target's softmax does not run over the last (key) axis")
    for app, i, masked in apps:
        if app.target not in (aten.add.Tensor, aten.masked_fill.Scalar, aten.masked_fill.Tensor):
            continue
        cur, ok = app, False
        for _ in range(32):  # the attention pass's walk from the application to the softmax
            if cur is x:
                ok = True
                break
            rd = _forward_users(cur)
            if len(rd) != 1:
                break
            cur = rd[0]
        if not ok:
            continue
        if app.target is aten.add.Tensor and masked.uns != -math.inf:
            raise _Reject(f"the target's index mask hides the unselected keys with a finite value ({masked.uns})")
        if app.target is not aten.add.Tensor and (i != 1 or masked.uns is not True or
                                                  facts.constant(app.args[2]) != -math.inf):
            raise _Reject("the target's index mask is a masked_fill that does not hide the unselected keys with -inf")
        chain = _chain_back(facts, x, app, i)
        if not _same_shape_dims(app, x):
            raise _Reject("the target's scores are regrouped between the index mask and the softmax")
        # the heads: the axes the index mask is broadcast over where it meets the scores
        mk = app.args[i]
        while isinstance(mk, fx.Node) and mk.target is aten.expand.default:
            mk = mk.args[0]
        ms, xs = list(shape_of(mk)), list(shape_of(x))
        ms = [1] * (nd - len(ms)) + ms
        bcast = [d for d in range(nd) if statically_known_true(ms[d] == 1) and not statically_known_true(xs[d] == 1)]
        summed = sorted(int(d) % nd for d in h.args[1])
        if any(not statically_known_true(ms[d] == 1) for d in summed) or set(bcast) - set(summed):
            raise _Reject("the target does not sum the attention probabilities over exactly the heads")
        # a value contraction for the attention analysis to read (removed again): P @ key
        qk = chain[0][0]
        sizes = [int(s) if isinstance(s, int) or s.node.is_constant() else em.call(aten.sym_size.int, [qk, d])
                 for d, s in enumerate(shape_of(qk))]
        pv_in = em.call(aten.reshape.default, [p, sizes])
        kv = em.call(aten.permute.default, [qk.args[1], [0, 2, 1]])
        pv = em.call(aten.bmm.default, [pv_in, kv])
        return Region(kl.target, masked, app, i, chain, sm, [pv_in], pv)
    raise _Reject("the target's scores are not hidden by an index mask of the same indices before its softmax")


def _same_shape_dims(a: fx.Node, b: fx.Node) -> bool:
    sa, sb = shape_of(a), shape_of(b)
    return len(sa) == len(sb) and all(statically_known_true(u == v) for u, v in zip(sa, sb))


def _rewrite_site(graph, facts, tk, idx, x, app_i, kl: _KL, apps, graph_kind, enabled, off_reason,
                  rec: LossRecord) -> None:
    index_sm = _softmax_of(app_i)[2]
    if kl.c1 is None or kl.c2 is None:
        raise _Reject("the KL term's log offsets are not constants (a float argument that dynamic=True made a "
                      "graph input?): the pass cannot prove the term is 0 at an unselected key")
    if not (kl.c1 > 0 and kl.c2 > 0 and math.isfinite(kl.c1) and math.isfinite(kl.c2)):
        raise _Reject(f"the KL term's log offsets ({kl.c1}, {kl.c2}) are not positive: 0 * log 0 at an "
                      "unselected key makes the original NaN")
    if len(shape_of(x)) != 3 or len(shape_of(idx)) != 3:
        raise _Reject("the index scores are not [B, S, T]")
    tk_dim = tk.args[2] if len(tk.args) > 2 else tk.kwargs.get("dim", -1)
    largest = tk.args[3] if len(tk.args) > 3 else tk.kwargs.get("largest", True)
    if tk_dim % 3 != 2 or not largest:
        raise _Reject("the top-k does not take the largest index scores along the key axis")
    tmp = Emitter(graph, kl.rowsum)
    em_a = Emitter(graph, kl.rowsum)
    try:
        region = _target_region(facts, kl, apps, tmp)
        m = analyse(facts, em_a, region)
    except BaseException:
        em_a.rollback()
        tmp.rollback()
        raise
    rec.sizes = {k: m.sizes[k] for k in ("B", "S", "H", "T")}
    rec.sizes["k"] = shape_of(idx)[-1]
    try:
        if not enabled:
            raise _Reject(f"{off_reason}; enabled, the pass would rewrite it")
        region_bw, g_in, g_out = [], None, None
        if graph_kind == "joint":
            region_bw, g_in, g_out = _backward_region(graph, kl, x, app_i, index_sm)
        em = Emitter(graph, kl.rowsum)
        fwd = _emit_forward(em, graph, tk, idx, m, kl, rec)
    finally:
        em_a.rollback()
        tmp.rollback()
    kl.rowsum.replace_all_uses_with(fwd["rowsum"])
    if region_bw:
        _emit_backward(graph, tk, idx, x, kl, fwd, region_bw, g_in, g_out)
        rec.backward = "sparse"
    rec.rewritten = True


def _emit_forward(em: Emitter, graph, tk, idx, m, kl: _KL, rec: LossRecord) -> Dict[str, fx.Node]:
    vals = next((u for u in tk.users if u.target is operator.getitem and u.args[1] == 0), None)
    if vals is None:
        with graph.inserting_after(idx):
            vals = graph.call_function(operator.getitem, (tk, 0))
        vals.meta = {k: v for k, v in idx.meta.items() if k != "val"}
        vals.meta["val"] = val(tk)[0]
    q, k = em.operand(m.q), em.operand(m.k)
    absorbed = None
    if m.form == "per_head":
        try:  # MLA: the scores over the shared latent, the key up-projection absorbed (passes/mla.py)
            lt = mla.find_latent(k, None, em.fake_mode)
            if val(k).dtype not in (torch.bfloat16, torch.float16):
                # the reassociated scores ((q W_kb) . latent) move the KL's value by up to ~3
                # eps(fp32) where the original's own error can be far below it
                raise Unsupported("fp32 keys: the absorbed scores' reassociation exceeds the numerics rule at the loss")
            absorbed = mla.absorb(em, q, k, None, latent=lt)
        except Unsupported as e:
            rec.sizes["latent"] = str(e)
    if absorbed is not None:
        q, k, v = absorbed.q, absorbed.k, absorbed.v
        rec.sizes["form"] = mla.FORM
        rec.sizes.update(absorbed.record())
    else:
        v = em.operand(m.v)  # (the stand-in value contraction's: the keys)
        rec.sizes["form"] = m.form
    v = em.call(aten.slice.Tensor, [v, 3, 0, 1])  # the op's output is not read: one value channel
    masks = [em.operand(op) if isinstance(op, OperandPlan) else em.bound(op[1], op[2]) for op in m.mask_operands]
    try:
        check_attention_operands(val(q), val(k), val(v), val(idx), [val(t) for t in masks], m.spec)
    except SpecError as e:
        em.rollback()
        raise _Reject(f"the op would reject the target's operands: {e}") from None
    call = em.call(torch.ops.hyscale.sparse_attention.default, [q, k, v, idx, masks, m.spec.to_json(), True])
    probs = em.call(operator.getitem, [call, 2])
    tsum = em.call(aten.sum.dim_IntList, [probs, [-1], True])
    target = em.call(aten.div.Tensor, [probs, tsum])
    vin = vals if val(vals).dtype == val(kl.p).dtype else em.call(
        torch.ops.prims.convert_element_type.default, [vals, val(kl.p).dtype])
    # the softmax as the graph spells it after decomposition (Inductor lowers no aten._softmax here)
    mx = em.call(aten.amax.default, [vin, [-1], True])
    ex = em.call(aten.exp.default, [em.call(aten.sub.Tensor, [vin, mx])])
    p = em.call(aten.div.Tensor, [ex, em.call(aten.sum.dim_IntList, [ex, [-1], True])])
    a1 = em.call(aten.add.Tensor, [target, kl.c1])
    l1 = em.call(aten.log.default, [a1])
    a2 = em.call(aten.add.Tensor, [p, kl.c2])
    l2 = em.call(aten.log.default, [a2])
    d = em.call(aten.sub.Tensor, [l1, l2])
    term = em.call(aten.mul.Tensor, [target, d] if kl.mul_target_first else [d, target])
    rowsum = em.call(aten.sum.dim_IntList, [term, [-1]])
    return {"vals": vals, "vin": vin, "target": target, "p": p, "a2": a2, "rowsum": rowsum}


def _backward_region(graph, kl: _KL, x: fx.Node, app_i: fx.Node, index_sm: List[fx.Node]):
    """(backward nodes of the loss, the gradient entering them (the row sum's), the one
    leaving them (the index table's)); empty when no gradient reaches the loss."""
    from .sparse_backward import _same_shape, backward_region

    # (the target's own nodes are left out: a node that gets no gradient carries the seq_nr
    # of the last one that did)
    index_side = (set(kl.nodes) - {kl.nodes[0], kl.nodes[1]}) | {app_i, *index_sm}
    _, bw = backward_region(graph, index_side)
    if not bw:
        return [], None, None
    rset = set(bw)
    grads_in = {a for n in bw for a in n.all_input_nodes if a not in rset and is_backward_node(a)}
    if len(grads_in) != 1 or not _same_shape(next(iter(grads_in)), kl.rowsum):
        raise _Reject("training graph: the loss's backward takes gradients from more than its row sum; the loss "
                      "stays dense")
    exits = [n for n in bw if any(u not in rset for u in n.users)]
    if len(exits) != 1 or not _same_shape(exits[0], x):
        raise _Reject("training graph: the loss's backward gives gradients to more than the index scores (a "
                      "target that is not detached would train the attention's q and k); the loss stays dense")
    return bw, grads_in.pop(), exits[0]


def _emit_backward(graph, tk, idx, x, kl: _KL, fwd, region_bw, g_in: fx.Node, g_out: fx.Node) -> None:
    """d(row sum)/d(index scores) at the slots, scattered into the table's gradient as the
    top-k's backward would be (the selection pass's sparse backward takes it from there)."""
    em = Emitter(graph, g_in.next)
    nodes = []

    def call(target, args, kw=None):
        n = em.call(target, args, kw)
        n.meta["autograd_backward"] = True
        n.meta.pop("seq_nr", None)
        nodes.append(n)
        return n

    g = call(aten.unsqueeze.default, [g_in, -1])
    g = call(aten.mul.Tensor, [g, fwd["target"]])
    g = call(aten.neg.default, [g])
    g = call(aten.div.Tensor, [g, fwd["a2"]])
    # the softmax's backward, decomposed: p * g - p * sum(p * g)
    pg = call(aten.mul.Tensor, [g, fwd["p"]])
    g = call(aten.sub.Tensor, [pg, call(aten.mul.Tensor, [fwd["p"], call(aten.sum.dim_IntList, [pg, [-1], True])])])
    if val(g).dtype != val(x).dtype:
        g = call(torch.ops.prims.convert_element_type.default, [g, val(x).dtype])
    zeros = call(aten.zeros_like.default, [x], {"memory_format": torch.contiguous_format})
    # (scatter_add: the indices are distinct within a row; a scatter of the indices would read
    # as an index mask to the attention pass)
    dense = call(aten.scatter_add.default, [zeros, -1, idx, g])
    for n in (zeros, dense):
        if tk.meta.get("seq_nr") is not None:
            n.meta["seq_nr"] = tk.meta["seq_nr"]  # the top-k's own backward, for sparse_backward.py
    if "partitioner_tag" in g_in.meta:
        for n in nodes:
            n.meta["partitioner_tag"] = g_in.meta["partitioner_tag"]
    rset = set(region_bw)
    g_out.replace_all_uses_with(dense, delete_user_cb=lambda u: u not in rset)
