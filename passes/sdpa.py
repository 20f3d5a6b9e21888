"""sdpa's spellings of an attention, for the attention pass (``passes/attention.py``).

**The safe softmax.** sdpa's math path (what a CPU trace of ``F.scaled_dot_product_attention``
holds) ends its softmax with ``aten._safe_softmax``, decomposed: a row whose every score is
``-inf`` gives 0 instead of NaN::

    p = div(exp(sub(x, amax(x))), sum(...))
    empty = logical_not(any(logical_not(eq(x, -inf)), dim, keepdim))   # or all(eq(x, -inf), ...)
    out = where(empty, 0, p)

``safe_softmax_output`` recognises that tail; the pass then runs the op with
``empty_row="zero"`` (``attention_spec``), which gives such a row exactly that.
"""
from __future__ import annotations

import math
import operator
from typing import List, Optional, Tuple

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims


_NOTS = (aten.logical_not.default, aten.bitwise_not.default)  # (the same on bool)


def _is_zero(a) -> bool:
    """A constant 0: a number, ``scalar_tensor(0)`` or ``full(shape, 0)``."""
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return a == 0
    if not isinstance(a, fx.Node) or a.op != "call_function":
        return False
    if a.target is aten.scalar_tensor.default:
        return a.args[0] == 0
    if a.target in (aten.full.default, aten.zeros_like.default, aten.zeros.default):
        return a.target is not aten.full.default or a.args[1] == 0
    return False


def _reduces(n: fx.Node, target, dim: int, ndim: int) -> bool:
    """``n`` is ``target(x, dim, keepdim=True)`` over the one dim ``dim``."""
    if n.target is not target:
        return False
    d = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    if isinstance(d, (list, tuple)):
        if len(d) != 1:
            return False
        d = d[0]
    return isinstance(d, int) and d % ndim == dim and bool(keep)


def safe_softmax_output(eq: fx.Node, div: fx.Node, dim: int, ndim: int,
                        users) -> Optional[Tuple[fx.Node, List[fx.Node]]]:
    """(the ``where`` that gives 0 at the rows of ``div`` whose every input is -inf, the tail's
    nodes), when ``eq`` (a reader of the softmax input) starts such a tail, else None.
    ``users(n)``: ``n``'s readers in the forward."""
    if eq.target is not aten.eq.Scalar or eq.args[1] != -math.inf:
        return None
    nodes = [eq]
    (u,) = users(eq) if len(users(eq)) == 1 else (None,)
    if u is not None and _reduces(u, aten.all.dim, dim, ndim):  # all(eq(x, -inf))
        empty = u
        nodes.append(u)
    elif u is not None and u.target in _NOTS:  # not(any(not(eq(x, -inf))))
        a = users(u)
        if len(a) != 1 or not _reduces(a[0], aten.any.dim, dim, ndim):
            return None
        n2 = users(a[0])
        if len(n2) != 1 or n2[0].target not in _NOTS:
            return None
        empty = n2[0]
        nodes += [u, a[0], empty]
    else:
        return None
    w = users(empty)
    if len(w) != 1 or users(div) != w:
        return None
    w = w[0]
    if w.target is not aten.where.self or w.args[0] is not empty or w.args[2] is not div or not _is_zero(w.args[1]):
        return None
    return w, nodes + [w]


# ------------------------------------------------------------------------------------------
# The fused sdpa nodes
# ------------------------------------------------------------------------------------------
# A CUDA trace keeps sdpa as the fused kernel its dispatcher picked, with the index mask as
# the kernel's additive bias. ``lower_fused`` writes each such node that carries a mask out as
# the math it computes (score contraction, scale, bias, causal range, softmax, value
# contraction: the forms the pass reads) beside it and points the output's readers at that;
# ``finish`` keeps the math where the attention pass rewrote it (the fused node is then
# dead) and puts the fused node back everywhere else, so a site the pass leaves alone runs
# the kernel it had.
#
# What each kernel gives a row whose every key is hidden (the op's ``empty_row``):
# * efficient attention: 0 (its epilogue divides by 1 where the softmax sum is 0, "fully
#   masked out rows" set to 0; torch >= 2.5, mem_eff_attention/epilogue_rescale_output.h);
# * the CPU flash kernel and the math composite: 0 (``_safe_softmax``; the CPU kernel checked
#   in tests/test_attention_pass.py);
# * cuDNN: no one value. sdpa hands it a bool mask as ``convert_boolean_attn_mask_cudnn``'s
#   bias, a finite -65504 at the hidden keys (torch 2.10/2.11; the graph holds the ``where``,
#   so the pass reads the value there), which gives a fully masked row a mean over the keys
#   (probed on an H200, torch 2.11, bf16: 1.20 for a random row), and 0 under a -inf float
#   mask. So the node is written out with a plain softmax and rewritten only where
#   ``visible_rows.prove`` shows that no row is fully masked (``ROWS_PROOF``): then there is
#   no empty row and the op's rows are cuDNN's. It is the dispatcher's pick for HF V3.2 sdpa
#   in bf16 on an H200. A bool ``attn_bias`` (cuDNN adds it as 0/1) and a debug mask keep it fused;
# * the out-of-tree "overrideable" backends: not established here, so those nodes stay fused,
#   with the reason in explain.
# (``_scaled_dot_product_flash_attention`` takes no mask, so no index mask reaches it.)
FUSED = {
    aten._scaled_dot_product_efficient_attention.default: ("efficient attention", "attn_bias", "zero"),
    aten._scaled_dot_product_flash_attention_for_cpu.default: ("the CPU flash attention", "attn_mask", "zero"),
    aten._scaled_dot_product_attention_math.default: ("the math sdpa", "attn_mask", "zero"),
    aten._scaled_dot_product_cudnn_attention.default: ("cuDNN attention", "attn_bias", None),
    aten._scaled_dot_product_fused_attention_overrideable.default: ("the overrideable fused attention",
                                                                    "attn_bias", None),
}
_META = "hyscale_sdpa"  # node.meta key: "lowered", or the reason the node stays fused
# the kernels rewritten only where no row is proven fully masked; node.meta key on the
# written-out math's mask application: the kernel's name
ROWS_PROOF = {aten._scaled_dot_product_cudnn_attention.default}
_ROWS = "hyscale_sdpa_rows_proof"

# Each fused node's backward (autograd's formula for it, one node in a joint graph) takes the
# forward's query, key and value (and efficient attention's bias) as arguments of those names,
# and returns their gradients as its outputs in that order. q and k often have one shape
# (S == T), so only the position tells the gradient of q from that of k.
BACKWARD = {
    aten._scaled_dot_product_efficient_attention_backward.default: ("query", "key", "value", "attn_bias"),
    aten._scaled_dot_product_cudnn_attention_backward.default: ("query", "key", "value"),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: ("query", "key", "value"),
}


def call_args(n: fx.Node) -> dict:
    """``n``'s arguments by schema name, defaults filled in."""
    out = {}
    for i, a in enumerate(n.target._schema.arguments):
        if i < len(n.args):
            out[a.name] = n.args[i]
        elif a.name in n.kwargs:
            out[a.name] = n.kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def gradient_operand(e: fx.Node) -> Optional[fx.Node]:
    """The forward operand whose gradient ``e`` is, when ``e`` is an output of a fused node's
    backward (``BACKWARD``); else None."""
    if e.op != "call_function" or e.target is not operator.getitem:
        return None
    bw, i = e.args
    if not isinstance(bw, fx.Node) or bw.target not in BACKWARD or not isinstance(i, int) or \
            not 0 <= i < len(BACKWARD[bw.target]):
        return None
    op = call_args(bw)[BACKWARD[bw.target][i]]
    return op if isinstance(op, fx.Node) else None


def rows_proof_needed(app: fx.Node) -> Optional[str]:
    """The kernel's name when ``app`` applies a lowered fused node's mask and that kernel's
    rows equal the op's only where no row is fully masked (``ROWS_PROOF``); else None."""
    return app.meta.get(_ROWS)


def rows_proven(kernel: str, shown: str) -> str:
    return f"{kernel.split()[0]}: no fully masked row, proven: {shown}"


def rows_not_proven(kernel: str, why: str) -> str:
    return (f"{kernel}: what it gives a fully masked row (a mean over the keys under a bool mask's finite "
            f"fill, 0 under -inf) is no empty_row of the op, and no such row is proven not to occur ({why}); "
            "the fused node stays")


def is_lowered(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in FUSED and n.meta.get(_META) == "lowered"


def feeds_only_lowered(n: fx.Node) -> bool:
    """Whether ``n`` is read only by lowered fused nodes (through the bias's pad, slice and
    expand): the math written beside them reads the index mask instead."""
    us = [u for u in n.users if not _is_bwd(u)]
    return bool(us) and all(is_lowered(u) or (u.target in (aten.constant_pad_nd.default, aten.slice.Tensor,
                                                            aten.expand.default) and feeds_only_lowered(u))
                            for u in us)


def dense_reason(n: fx.Node) -> str:
    """Why the fused node ``n``, which applies an index mask, was left as it is."""
    return n.meta.get(_META) or f"the index mask is applied by {n.target} (fused sdpa), which the rewrite does not read"


class Lowered:
    def __init__(self, fused: fx.Node, out: fx.Node, pv: fx.Node, readers: List[fx.Node], nodes: List[fx.Node]):
        self.fused, self.out, self.pv, self.readers, self.nodes = fused, out, pv, readers, nodes


def _unpadded(bias: fx.Node) -> fx.Node:
    """The bias before sdpa's preprocessing for efficient attention, which the add
    broadcasts the same: an ``expand`` to [B, H, S, T], and the padding of a misaligned bias
    that is sliced off again (``slice(constant_pad_nd(x, [0, p]), -1, 0, T)`` is ``x``)."""
    while bias.target is aten.expand.default and isinstance(bias.args[0], fx.Node):
        bias = bias.args[0]
    if bias.target is aten.slice.Tensor and isinstance(bias.args[0], fx.Node) and \
            bias.args[0].target is aten.constant_pad_nd.default:
        pad, x = bias.args[0], bias.args[0].args[0]
        dim = bias.args[1] if len(bias.args) > 1 else 0
        start = bias.args[2] if len(bias.args) > 2 else 0
        end = bias.args[3] if len(bias.args) > 3 else None
        nd = len(x.meta["val"].shape)
        widths = list(pad.args[1])
        if dim % nd == nd - 1 and start == 0 and end == x.meta["val"].shape[-1] and len(widths) == 2 and \
                widths[0] == 0 and (len(bias.args) < 5 or bias.args[4] == 1):
            return x
    return bias


def _why_not(n: fx.Node, a: dict) -> Optional[str]:
    what, _, empty = FUSED[n.target]
    if not isinstance(a["dropout_p"], (int, float)) or a["dropout_p"] != 0:
        return f"dropout with p > 0 in the fused sdpa ({what}, dropout_p={a['dropout_p']})"
    if n.target in ROWS_PROOF:
        bias = a[FUSED[n.target][1]]
        if isinstance(bias, fx.Node) and bias.meta["val"].dtype == torch.bool:
            return f"{what}: a bool attn_bias (the kernel adds it as 0/1, not as a mask); the fused node stays"
        if a.get("return_debug_mask"):
            return f"{what}: its debug attention mask is asked for; the fused node stays"
    elif empty is None:
        return (f"{what}: what it gives a row whose every key is hidden (NaN or 0) is not established, so the op's "
                "empty_row cannot be chosen; the fused node stays")
    q, k, v = (a[x].meta.get("val") for x in ("query", "key", "value"))
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in (q, k, v)):
        return f"{what}: q, k and v are not 4-d [B, H, S, D]"
    if any(not isinstance(s, int) for t in (q, k, v) for s in t.shape):
        return f"{what}: dynamic shapes (the fused node is lowered for static shapes only)"
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        return f"{what}: {q.shape[1]} query heads over {k.shape[1]} key heads"
    return None


def lower_fused(graph: fx.Graph, Emitter) -> List[Lowered]:
    """Write every fused sdpa node that takes a mask out as its math (see above); a node that
    stays fused gets its reason in ``meta``."""
    out = []
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in FUSED:
            continue
        a = call_args(n)
        bias = a[FUSED[n.target][1]]
        if not isinstance(bias, fx.Node):
            continue
        why = _why_not(n, a)
        readers = [u for u in n.users if u.target is operator.getitem and u.args[1] == 0]
        fwd = [r for r in readers for u in r.users if not _is_bwd(u)]
        if why is not None:
            n.meta[_META] = why
            continue
        if not fwd:
            continue
        em = Emitter(graph, n)
        try:
            res, pv = _emit_math(em, a, _unpadded(bias), FUSED[n.target][2],
                                 FUSED[n.target][0] if n.target in ROWS_PROOF else None)
            res = like_strides(em, res, readers[0].meta.get("val") if readers else None)
        except Exception as e:  # (nothing reads the new nodes yet: the node stays as it was)
            em.rollback()
            n.meta[_META] = f"{FUSED[n.target][0]}: its math could not be written out ({type(e).__name__}: {e})"
            continue
        seq = n.meta.get("seq_nr")
        for m in em.created:
            if seq is not None:
                m.meta["seq_nr"] = seq
        for r in readers:
            for u in list(r.users):
                if not _is_bwd(u):
                    u.replace_input_with(r, res)
        n.meta[_META] = "lowered"
        out.append(Lowered(n, res, pv, readers, list(em.created)))
    return out


def like_strides(em, out: fx.Node, like) -> fx.Node:
    """``out`` laid out in memory as ``like`` (the fused kernel's output), when that is not
    contiguous: the graph's views of the output were traced on its strides (the CPU flash
    kernel returns [B, H, S, D] over a [B, S, H, D] buffer, and the model's
    ``transpose(1, 2).reshape(...)`` became a plain view of it)."""
    if not isinstance(like, torch.Tensor) or like.is_contiguous():
        return out
    st = like.stride()
    if not all(isinstance(x, int) for x in st):
        return out
    order = sorted(range(like.dim()), key=lambda d: (-st[d], d))  # the buffer's dims, outermost first
    inv = [order.index(d) for d in range(like.dim())]
    x = em.call(aten.clone.default, [em.call(aten.permute.default, [out, order])],
                {"memory_format": torch.contiguous_format})
    return em.call(aten.permute.default, [x, inv])


def _is_bwd(u: fx.Node) -> bool:
    from .canonicalize import _feeds_only_backward, is_backward_node

    return is_backward_node(u) or _feeds_only_backward(u)


def _emit_math(em, a: dict, bias: fx.Node, empty_row: Optional[str], kernel: Optional[str] = None):
    """sdpa's math at the fused node's operands: ([B, H, S, Dv] in q's dtype, the value
    contraction). Under GQA (H = Hk * G) the G query heads of a key head are rows of one
    contraction with it ([B * Hk, G * S, D] @ [B * Hk, D, T]): head h reads key head h // G,
    as enable_gqa's repeat_interleave does."""
    q, k, v = a["query"], a["key"], a["value"]
    qv, kv, vv = (x.meta["val"] for x in (q, k, v))
    B, H, S, D = qv.shape
    Hk, T, Dv = kv.shape[1], kv.shape[2], vv.shape[3]
    G = H // Hk
    f32, c, dev = torch.float32, em.call, qv.device
    lead = [B, Hk, G] if G > 1 else [B, H]  # the leading dims of every per-head tensor

    def flat(x, shape):  # [*lead, m, n] -> [B * Hk, G * m, n] (or [B * H, m, n]), fp32
        if x.meta["val"].dtype != f32:
            x = c(prims.convert_element_type.default, [x, f32])
        full = lead + shape if len(x.meta["val"].shape) == len(lead) + 2 else [B, Hk] + shape
        x = c(aten.clone.default, [c(aten.expand.default, [x, full])], {"memory_format": torch.contiguous_format})
        return c(aten.view.default, [x, [full[0] * full[1], math.prod(full[2:-1]), full[-1]]])

    q5 = c(aten.reshape.default, [q, lead + [S, D]]) if G > 1 else q
    scores = c(aten.bmm.default, [flat(q5, [S, D]), flat(c(aten.permute.default, [k, [0, 1, 3, 2]]), [D, T])])
    scores = c(aten.view.default, [scores, lead + [S, T]])
    scale = a["scale"] if a.get("scale") is not None else D ** -0.5
    scores = c(aten.mul.Tensor, [scores, float(scale)])
    if a.get("is_causal"):  # top-left: key t is hidden from query s where t > s
        iq = c(aten.unsqueeze.default, [c(prims.iota.default, [S], dict(start=0, step=1, dtype=torch.int64,
                                                                         device=dev, requires_grad=False)), -1])
        ik = c(aten.unsqueeze.default, [c(prims.iota.default, [T], dict(start=0, step=1, dtype=torch.int64,
                                                                         device=dev, requires_grad=False)), -2])
        hide = c(aten.ge.Scalar, [c(aten.sub.Tensor, [ik, iq]), 1])
        causal = c(aten.where.self, [hide, c(aten.full.default, [[S, T], -math.inf], dict(dtype=f32, device=dev)),
                                     c(aten.scalar_tensor.default, [0.0], dict(dtype=f32, device=dev))])
        scores = c(aten.add.Tensor, [scores, causal])
    bs = list(bias.meta["val"].shape)
    if G > 1 and len(bs) >= 3:  # its head dim (1 or H) split as (Hk, G)
        bias = c(aten.reshape.default, [bias, bs[:-3] + ([1, 1] if bs[-3] == 1 else [Hk, G]) + bs[-2:]])
    if bias.meta["val"].dtype == torch.bool:  # True: visible
        scores = c(aten.masked_fill.Scalar, [scores, c(aten.logical_not.default, [bias]), -math.inf])
    else:
        scores = c(aten.add.Tensor, [scores, bias])
    if kernel is not None:
        scores.meta[_ROWS] = kernel
    m = c(aten.amax.default, [scores, [-1], True])
    e = c(aten.exp.default, [c(aten.sub.Tensor, [scores, m])])
    p = c(aten.div.Tensor, [e, c(aten.sum.dim_IntList, [e, [-1], True])])
    if empty_row == "zero":
        empty = c(aten.logical_not.default, [c(aten.any.dim, [c(aten.logical_not.default, [
            c(aten.eq.Scalar, [scores, -math.inf])]), -1, True])])
        p = c(aten.where.self, [empty, c(aten.full.default, [lead + [S, T], 0], dict(dtype=f32, device=dev)), p])
    pv = c(aten.bmm.default, [c(aten.view.default, [p, [lead[0] * lead[1], math.prod(lead[2:]) * S, T]]),
                              flat(v, [T, Dv])])
    out = c(aten.view.default, [pv, lead + [S, Dv]])
    if G > 1:
        out = c(aten.view.default, [out, [B, H, S, Dv]])
    if qv.dtype != f32:
        out = c(prims.convert_element_type.default, [out, qv.dtype])
    return out, pv


def finish(graph: fx.Graph, lowered: List[Lowered]) -> None:
    """After the attention pass: where it rewrote the math the fused node is dead and goes;
    elsewhere the readers get the fused node's output back and the math goes."""
    for lw in lowered:
        rewritten = not lw.pv.users  # (the pass pointed the value contraction's readers at its op)
        if not rewritten:
            lw.out.replace_all_uses_with(lw.readers[0])
            lw.fused.meta.pop(_META, None)
        for n in reversed(lw.nodes):
            if not n.users:
                graph.erase_node(n)
        if not rewritten:
            continue
        for r in lw.readers:
            if not r.users:
                graph.erase_node(r)
        if all(u.target is operator.getitem and not u.users for u in lw.fused.users):
            for u in list(lw.fused.users):
                graph.erase_node(u)
            graph.erase_node(lw.fused)
