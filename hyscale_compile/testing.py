"""Helpers for tests: ``assert_selection_equal`` (is a top-k selection the one the op's
contract gives? the check to use instead of ``torch.equal`` against eager), ``stable_topk``
(the reference it compares against), a normalized, version-stable graph text
(``graph_text``), and a seeded shuffle of the op's unsorted results (``shuffled_unsorted``)."""
from __future__ import annotations

import contextlib
import math
import operator
from typing import Dict, Optional

import torch
import torch.fx as fx

_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
          torch.int64: "i64", torch.int32: "i32", torch.bool: "b8"}
_DROP_KW = {"device", "pin_memory", "layout", "requires_grad", "memory_format"}


def _target_name(t) -> str:
    if t is operator.getitem:
        return "getitem"
    if isinstance(t, torch._ops.OpOverload):
        ns, name = t.namespace, t._schema.name.split("::")[-1]
        return f"{ns}.{name}" + ("" if t._overloadname == "default" else f".{t._overloadname}")
    return getattr(t, "__name__", str(t))


def _meta(n: fx.Node) -> str:
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor):
        return f"{_SHORT.get(v.dtype, str(v.dtype))}{list(v.shape)}"
    if isinstance(v, (tuple, list)) and all(isinstance(x, torch.Tensor) for x in v):
        return "(" + ", ".join(f"{_SHORT.get(x.dtype, str(x.dtype))}{list(x.shape)}" for x in v) + ")"
    return ""


def graph_text(graph: fx.Graph) -> str:
    """One line per node, names replaced by position (v0, v1, ...), comments dropped,
    devices dropped: what stays is the ops, their constants, dtypes and shapes."""
    names: Dict[fx.Node, str] = {}
    lines = []
    ni = 0
    for n in graph.nodes:
        if n.op == "placeholder":
            names[n] = f"in{len([x for x in names if x.op == 'placeholder'])}"
            lines.append(f"{names[n]}: {_meta(n)}")
            continue
        if n.op == "output":
            lines.append("return " + _fmt(n.args[0], names))
            continue
        names[n] = f"v{ni}"
        ni += 1
        args = ", ".join([_fmt(a, names) for a in n.args] + [
            f"{k}={_fmt(v, names)}" for k, v in n.kwargs.items() if k not in _DROP_KW
        ])
        tgt = _target_name(n.target) if n.op == "call_function" else f"{n.op}:{n.target}"
        lines.append(f"{names[n]}: {_meta(n)} = {tgt}({args})")
    return "\n".join(lines)


def _fmt(a, names) -> str:
    if isinstance(a, fx.Node):
        return names.get(a, a.name)
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt(x, names) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, torch.dtype):
        return _SHORT.get(a, str(a))
    if isinstance(a, float):
        return repr(a)
    return str(a)


@contextlib.contextmanager
def shuffled_unsorted(seed: int = 0):
    """Inside: the CPU implementation of ``torch.ops.hyscale.hytopk*`` returns each row of
    a ``sorted=False`` call in a random order (seeded; the same set, values still paired
    with their indices). ``sorted=False`` allows any order; tests use this to check that
    a rewrite that dropped the sort (``passes/order.py``) still gives the same outputs."""
    if not isinstance(seed, int):
        raise TypeError(f"shuffled_unsorted: seed must be an int, got {type(seed).__name__}")
    from hyscale_compile.lowerings import ops

    before = ops.UNSORTED_SHUFFLE["seed"]
    ops.UNSORTED_SHUFFLE["seed"] = seed
    try:
        yield
    finally:
        ops.UNSORTED_SHUFFLE["seed"] = before


# torch.testing.assert_close's defaults for the scores' dtype: (rtol, atol)
_TOLERANCES = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
               torch.float64: (1e-7, 1e-7)}


def stable_topk(scores: torch.Tensor, k: int):
    """(values, indices) of the top-k over the last dim by the op's rule: value descending,
    ties to the smaller index (NaN above everything, as ``torch.topk``)."""
    from hyscale_compile.lowerings.reference import stable_topk as _stable

    return _stable(scores, k)


def _same(a: torch.Tensor, b: torch.Tensor, tol) -> torch.Tensor:
    """Elementwise: equal where either is infinite or NaN (NaN == NaN), within ``tol`` elsewhere."""
    special = ~torch.isfinite(a) | ~torch.isfinite(b)
    exact = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return torch.where(special, exact, (a - b).abs() <= tol)


def assert_selection_equal(indices: torch.Tensor, scores: torch.Tensor, *, values: Optional[torch.Tensor] = None,
                           rtol: Optional[float] = None, atol=None, sorted: bool = True) -> None:
    """Check a top-k selection the way the op's contract defines equality.

    ``indices`` [..., k]: the selection under test (``torch.ops.hyscale.hytopk``'s, or a
    compiled model's top-k indices). ``scores`` [..., T]: the scores it selects from,
    computed by the original arithmetic (the eager model's table; float64 for a reference).
    ``values`` [..., k]: the top-k values returned with the indices, if any.

    ``torch.equal(compiled(x), eager(x))`` is the wrong check: ``torch.topk`` breaks ties
    (ReLU's exact zeros) and picks among masked keys in an unspecified order, while the op
    returns the smaller key index. This helper checks instead, per row:

    - the indices are distinct and in range;
    - with ``rtol=0, atol=0`` (scores that are the selection's own bits, e.g. exactly
      representable inputs): the indices equal the stable (value desc, index asc) top-k
      exactly (with ``sorted=False``: as a set);
    - otherwise: the scores at the indices match the stable top-k's scores as a multiset,
      within ``atol + rtol * |score|`` (infinite scores exactly); keys whose score is -inf
      (masked slots of a row with fewer than k valid keys) are the smallest-index ones;
      with ``sorted=True`` the selection is in descending order within that tolerance;
    - ``values`` equal ``scores`` at the indices, within the same tolerance (infinite and
      NaN entries exactly: a masked slot holds what the original arithmetic gives there).

    ``rtol``/``atol`` default to ``torch.testing.assert_close``'s for float32 (the op's
    arithmetic), or for the scores' or values' dtype where that is coarser (bf16, fp16);
    ``atol`` may be a tensor of per-row tolerances (shape ``indices.shape[:-1]``). Raises
    AssertionError naming the first row that differs."""
    if not isinstance(indices, torch.Tensor) or indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise TypeError(f"assert_selection_equal: indices must be an integer tensor, got {_describe(indices)}")
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
        raise TypeError(f"assert_selection_equal: scores must be a floating-point tensor, got {_describe(scores)}")
    if indices.dim() == 0 or tuple(indices.shape[:-1]) != tuple(scores.shape[:-1]):
        raise ValueError(f"assert_selection_equal: indices {tuple(indices.shape)} and scores {tuple(scores.shape)} "
                         "must agree in every dim but the last")
    k, T = indices.shape[-1], scores.shape[-1]
    if values is not None and tuple(values.shape) != tuple(indices.shape):
        raise ValueError(f"assert_selection_equal: values {tuple(values.shape)} must have the indices' shape "
                         f"{tuple(indices.shape)}")
    # the op computes in fp32 at best: a float64 table is compared at fp32's tolerance
    d_rtol, d_atol = max(_TOLERANCES.get(t, (0.0, 0.0)) for t in
                         (torch.float32, scores.dtype, getattr(values, "dtype", torch.float32)))
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    rows = indices.shape[:-1]
    idx = indices.reshape(-1, k).long().cpu()
    sc = scores.reshape(-1, T).double().cpu()
    R = idx.shape[0]
    atol_r = (atol.reshape(-1, 1).double().cpu() if isinstance(atol, torch.Tensor)
              else torch.full((R, 1), float(atol), dtype=torch.float64))
    if atol_r.shape[0] != R:
        raise ValueError(f"assert_selection_equal: a per-row atol must have shape {tuple(rows)}, got "
                         f"{tuple(atol.shape)}")

    def row(r: int):
        return tuple(int(i) for i in torch.unravel_index(torch.tensor(r), rows)) if rows else ()

    def fail(r: int, what: str):
        raise AssertionError(f"assert_selection_equal: row {row(r)}: {what}\n  indices: {idx[r].tolist()}\n"
                             f"  stable reference: {ref_i[r].tolist()}")

    ref_v, ref_i = stable_topk(sc, k)
    if R and k:
        if int(idx.min()) < 0 or int(idx.max()) >= T:
            r = int(((idx < 0) | (idx >= T)).any(-1).nonzero()[0])
            fail(r, f"an index outside [0, {T})")
        srt = idx.sort(-1).values
        dup = (srt[:, 1:] == srt[:, :-1]).any(-1)
        if bool(dup.any()):
            fail(int(dup.nonzero()[0]), "a key selected twice")
    chosen = sc.gather(-1, idx)
    exact = rtol == 0 and not bool((atol_r != 0).any())
    if exact:
        same = (idx == ref_i) if sorted else (idx.sort(-1).values == ref_i.sort(-1).values)
        bad = ~same.all(-1)
        if bool(bad.any()):
            fail(int(bad.nonzero()[0]), "indices differ from the stable (value desc, index asc) top-k "
                                        "of exact scores" + ("" if sorted else " (as sets)"))
    else:
        tol = atol_r + rtol * ref_v.abs()
        mine = chosen.sort(-1, descending=True).values
        bad = ~_same(mine, ref_v, tol).all(-1)
        if bool(bad.any()):
            r = int(bad.nonzero()[0])
            fail(r, f"the selected scores {mine[r].tolist()} are not the top-k scores {ref_v[r].tolist()} "
                    f"(per-row multisets, tolerance atol={float(atol_r[r])}, rtol={rtol})")
        for r in (chosen == -math.inf).any(-1).nonzero().flatten().tolist():
            masked = idx[r][chosen[r] == -math.inf]
            expect = (sc[r] == -math.inf).nonzero().flatten()[: masked.numel()]
            if not torch.equal(masked if sorted else masked.sort().values, expect):
                fail(r, f"masked slots hold keys {masked.tolist()}; the contract gives the smallest-index masked "
                        f"keys in ascending order, {expect.tolist()}")
        if sorted and k > 1:
            a, b = chosen[:, :-1], chosen[:, 1:]
            ok = (b <= a) | ((b - a) <= atol_r + rtol * a.abs()) | torch.isnan(a) | torch.isnan(b)
            bad = ~ok.all(-1)
            if bool(bad.any()):
                fail(int(bad.nonzero()[0]), f"not in descending order: scores {chosen[int(bad.nonzero()[0])].tolist()}")
    if values is not None:
        v = values.reshape(-1, k).cpu()
        if exact:
            same = (v == chosen.to(v.dtype)) | (torch.isnan(v) & torch.isnan(chosen))
        else:
            same = _same(v.double(), chosen, atol_r + rtol * chosen.abs())
        bad = ~same.all(-1)
        if bool(bad.any()):
            r = int(bad.nonzero()[0])
            fail(r, f"values {v[r].tolist()} differ from the scores at the indices {chosen[r].tolist()}")


def _describe(x) -> str:
    return f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
