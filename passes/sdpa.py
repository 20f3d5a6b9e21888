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
from typing import List, Optional, Tuple

import torch
import torch.fx as fx

aten = torch.ops.aten


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
    elif u is not None and u.target is aten.logical_not.default:  # not(any(not(eq(x, -inf))))
        a = users(u)
        if len(a) != 1 or not _reduces(a[0], aten.any.dim, dim, ndim):
            return None
        n2 = users(a[0])
        if len(n2) != 1 or n2[0].target is not aten.logical_not.default:
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
