"""Megatron-Core's ``masked_softmax`` (``dsa_masking.py``), for the attention pass
(``passes/attention.py``): a softmax over the entries a bool ``valid`` mask keeps, 0 elsewhere
and 0 in a row with none::

    f = masked_fill(x, ~valid, finfo.min)
    m = where(any(valid, dim, keepdim), max(f, dim, keepdim).values, 0)
    e = masked_fill(exp(f - m), ~valid, 0)
    out = masked_fill(e / sum(e, dim, keepdim).clamp_min(eps), ~valid, 0)

``_unfused_absorbed_dsa_fn`` calls it with ``x = scores + M`` and ``valid = isfinite(M)``, M
the index mask (``-inf`` at the unselected keys, the row mask at the selected ones).

**Why it is the op with** ``empty_row="zero"``: where every finite value of M is one the
logit may carry (M is -inf or finite: the attention pass checks that its terms are ranges or
fills that hide with -inf, so M is 0 or -inf) and the scores are finite, ``valid`` is exactly
``x != -inf``: the masked_fill with finfo.min changes no kept entry, the row max over ``f`` is
the max over the kept entries (each finite, so >= finfo.min), the kept entry at the max gives
exp(0) = 1, so the sum is >= 1 and the clamp to eps <= 1 changes nothing, and the zero fills
hit only the entries at -inf, to which the op gives P = 0 too. That is the softmax over the
entries not at -inf, and no gradient reaches an entry the fills zero, as in the op. A
row with no kept entry gets m = 0, every e zeroed, sum 0 clamped to eps: 0 everywhere, which
is ``empty_row="zero"``. The recognizer only reads the graph's shape; the conditions on M are
the caller's (``valid_mask_of``, the mask-term check in ``passes/attention.py``).
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch
import torch.fx as fx

from .sdpa import _NOTS, _is_zero, _reduces

aten = torch.ops.aten
prims = torch.ops.prims

_AND_LIKE = (aten.mul.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default)


def isfinite_input(n) -> Optional[fx.Node]:
    """``x`` when ``n`` is ``isfinite(x)``: the op itself, or its CompositeImplicit decomposition
    ``(x == x) * (abs(x) != inf)`` (either operand order, ``*`` or ``&``)."""
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return None
    if n.target in (aten.isfinite.default, prims.isfinite.default):
        return n.args[0]
    if n.target not in _AND_LIKE or len(n.args) != 2:
        return None
    for a, b in (n.args, n.args[::-1]):
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            return None
        if a.target is aten.eq.Tensor and a.args[0] is a.args[1] and b.target is aten.ne.Scalar and \
                b.args[1] == math.inf and isinstance(b.args[0], fx.Node) and b.args[0].target is aten.abs.default \
                and b.args[0].args[0] is a.args[0]:
            return a.args[0]
    return None


def reads_for_isfinite(u: fx.Node, n: fx.Node) -> bool:
    """``u`` reads ``n`` only as a step of ``isfinite(n)`` (its ``eq``/``abs``/``ne`` nodes, or the op)."""
    if isfinite_input(u) is n:
        return True
    if u.target is aten.abs.default and u.args[0] is n:
        nes = list(u.users)
        return bool(nes) and all(v.target is aten.ne.Scalar and v.args[1] == math.inf and v.users and
                                 all(isfinite_input(w) is n for w in v.users) for v in nes)
    if u.target is aten.eq.Tensor and u.args[0] is n and u.args[1] is n:
        return bool(u.users) and all(isfinite_input(w) is n for w in u.users)
    return False


def _not_of(n) -> Optional[fx.Node]:
    return n.args[0] if isinstance(n, fx.Node) and n.target in _NOTS else None


def _zero_fill(n: fx.Node, valid: fx.Node, x: fx.Node, const) -> bool:
    """``n`` is ``masked_fill(x, ~valid, c)`` (decomposed ``where(~valid, c, x)``), ``c`` as ``const`` checks."""
    if n.target is aten.where.self:
        return n.args[2] is x and _not_of(n.args[0]) is valid and const(n.args[1])
    if n.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        return n.args[0] is x and _not_of(n.args[1]) is valid and const(n.args[2])
    return False


def recognise(x: fx.Node, constant: Callable, users: Callable
              ) -> Optional[Tuple[int, fx.Node, List[fx.Node], fx.Node]]:
    """(dim, output, nodes, valid) of the ``masked_softmax`` that ``x`` feeds, else None.
    ``constant(n)``: a node's constant value or None; ``users(n)``: its readers in the forward."""
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.is_floating_point():
        return None
    lowest = torch.finfo(val.dtype).min
    nd = val.dim()
    us = users(x)
    if len(us) != 1:
        return None
    f = us[0]
    if f.target is aten.where.self:
        valid = _not_of(f.args[0])
    elif f.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        valid = _not_of(f.args[1])
    else:
        return None
    if valid is None or not _zero_fill(f, valid, x, lambda c: constant(c) == lowest):
        return None
    fu = users(f)
    mx = [u for u in fu if u.target in (aten.max.dim, aten.amax.default)]
    sub = [u for u in fu if u.target is aten.sub.Tensor]
    if len(fu) != 2 or len(mx) != 1 or len(sub) != 1:
        return None
    mx, sub = mx[0], sub[0]
    dim = mx.args[1][0] if isinstance(mx.args[1], (list, tuple)) and len(mx.args[1]) == 1 else mx.args[1]
    if not isinstance(dim, int):
        return None
    dim %= nd
    if not _reduces(mx, mx.target, dim, nd):
        return None
    nodes = [f, mx]
    m = mx
    if mx.target is aten.max.dim:  # (values, indices): only the values read
        gs = users(mx)
        if len(gs) != 1 or gs[0].args[1] != 0:
            return None
        m = gs[0]
        nodes.append(m)
    # the row max, 0 in a row with no valid entry: where(any(valid), m, 0)
    (g,) = users(m) if len(users(m)) == 1 else (None,)
    if g is None or g.target is not aten.where.self or g.args[1] is not m or not _is_zero(g.args[2]):
        return None
    anyv = g.args[0]
    if not (isinstance(anyv, fx.Node) and _reduces(anyv, aten.any.dim, dim, nd) and anyv.args[0] is valid):
        return None
    nodes += [anyv, g]
    if tuple(sub.args) != (f, g) or len(users(sub)) != 1 or users(g) != [sub]:
        return None
    ex = users(sub)[0]
    if ex.target is not aten.exp.default or len(users(ex)) != 1:
        return None
    e2 = users(ex)[0]
    if not _zero_fill(e2, valid, ex, lambda c: _is_zero(c) or constant(c) == 0):
        return None
    eu = users(e2)
    sm = [u for u in eu if u.target is aten.sum.dim_IntList]
    dv = [u for u in eu if u.target is aten.div.Tensor]
    if len(eu) != 2 or len(sm) != 1 or len(dv) != 1 or not _reduces(sm[0], aten.sum.dim_IntList, dim, nd):
        return None
    sm, dv = sm[0], dv[0]
    (cl,) = users(sm) if len(users(sm)) == 1 else (None,)
    eps = constant(cl.args[1]) if cl is not None and cl.target is aten.clamp_min.default else None
    if eps is None or not 0 < eps <= 1 or tuple(dv.args) != (e2, cl) or users(cl) != [dv]:
        return None  # (the clamp is a no-op only where the sum is >= 1 or 0)
    (out,) = users(dv) if len(users(dv)) == 1 else (None,)
    if out is None or not _zero_fill(out, valid, dv, lambda c: _is_zero(c) or constant(c) == 0):
        return None
    nodes += [sub, ex, e2, sm, cl, dv, out]
    for n in nodes:  # the negations of valid that the fills read
        for a in n.args:
            if _not_of(a) is valid:
                nodes.append(a)
    return dim, out, nodes, valid
