"""Helpers for tests: ``assert_selection_equal`` (is a top-k selection the one the op's
contract gives? the check to use instead of ``torch.equal`` against eager), ``stable_topk``
(the reference it compares against), a normalized, version-stable graph text
(``graph_text``), a seeded shuffle of the op's unsorted results (``shuffled_unsorted``), and
for the sparse attention: the numerics rule (``assert_consumer_close``) and a search for
[S, T]-sized tensors in compiled graphs (``square_tensors``)."""
from __future__ import annotations

import contextlib
import math
import operator
from typing import Dict, List, Optional, Tuple

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


def consumer_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| over ``ref``'s finite entries, in float64 (0 where both are
    all zero, inf where ``x`` is not finite where ``ref`` is, or differs from an all-zero
    ``ref``). Entries where ``ref`` is NaN or infinite must hold the same in ``x``."""
    if not isinstance(x, torch.Tensor) or not isinstance(ref, torch.Tensor):
        raise TypeError(f"consumer_error: expected tensors, got {_describe(x)} and {_describe(ref)}")
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"consumer_error: shapes differ: {tuple(x.shape)} against the reference's {tuple(ref.shape)}")
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    fin = torch.isfinite(ref)
    special_ok = ((x == ref) | (torch.isnan(x) & torch.isnan(ref)))[~fin]
    if not bool(special_ok.all()) or not bool(torch.isfinite(x[fin]).all()):
        return math.inf
    if not bool(fin.any()):
        return 0.0
    diff = float((x[fin] - ref[fin]).abs().max())
    scale = float(ref[fin].abs().max())
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def assert_consumer_close(out: torch.Tensor, orig: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                          what: str = "output") -> Tuple[float, float]:
    """The numerics rule for a rewritten consumer (docs/contract.md): ``err(out) <= 2 err(orig) + 2 eps(dtype)``,
    where ``err(x) = max |x - ref| / max |ref|`` (``consumer_error``).

    ``out``: what the rewritten graph gave; ``orig``: what the original graph gives at the
    same device and dtype (the default backend, or eager); ``ref``: the same computation in
    float64 at the same selection; ``dtype``: the computation's dtype (its ``eps`` is the
    floor). Returns ``(err(out), err(orig))``; raises AssertionError naming ``what``."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"assert_consumer_close: dtype must be a floating-point torch.dtype, got {dtype!r}")
    e_out, e_orig = consumer_error(out, ref), consumer_error(orig, ref)
    bound = 2 * e_orig + 2 * torch.finfo(dtype).eps
    if not e_out <= bound:
        raise AssertionError(f"assert_consumer_close: {what}: err {e_out:.3g} > 2 * err(orig) {e_orig:.3g} "
                             f"+ 2 * eps({_SHORT.get(dtype, dtype)}) = {bound:.3g}")
    return e_out, e_orig


def _seq_degree(shape, seq_sizes) -> int:
    """How many sequence-length factors the tensor's element count has. All dims concrete:
    each equal to a sequence size counts one. Some symbolic: the concrete ones are not the
    sequence (dynamic shapes made it a symbol), and the product of the symbolic dims counts
    by how it grows when every symbol whose value is a sequence size is scaled by 16 (16:
    one factor, 256: two), so a flattened [B*S, T] counts two as [B, S, T] does."""
    import sympy

    syms = [d.node for d in shape if isinstance(d, torch.SymInt)]
    degree = 0 if syms else sum(1 for d in shape if int(d) in seq_sizes)
    if syms:
        env = syms[0].shape_env
        expr = sympy.Integer(1)
        for nd in syms:
            expr = expr * nd.expr
        hints = getattr(env, "backed_var_to_val", None)  # var_to_val before torch 2.13
        hints = env.var_to_val if hints is None else hints
        values = {s: int(hints[s]) for s in expr.free_symbols if s in hints}
        seq = {s for s, v in values.items() if v in seq_sizes}
        if seq:
            base = float(expr.xreplace({s: sympy.Integer(v) for s, v in values.items()}))
            grown = float(expr.xreplace({s: sympy.Integer(v * 16 if s in seq else v) for s, v in values.items()}))
            if base > 0:
                degree += int(round(math.log(grown / base, 16)))
    return degree


def square_tensors(graphs, seq_sizes) -> List[str]:
    """Every tensor in ``graphs`` with two or more sequence-length dimensions (an [S, T] mask,
    a score table), as ``"<graph>: <node> <dtype>[shape] = <op>"`` lines; empty when none.

    ``graphs``: a GraphModule, an ``fx.Graph``, or a list of them or of ``(label, graph)``
    pairs (what ``options={"hyscale.capture": [...]}`` collects; its text entries are
    skipped). Node values (``meta["val"]``, each element of a tuple), which include the
    forward's saved tensors (its extra outputs, the backward's inputs), and a GraphModule's
    buffers and constant attributes are searched. ``seq_sizes``: the sequence lengths the
    model ran with (ints); under ``dynamic=True`` a symbolic dim counts where its symbol's
    value is one of them, so pick lengths no other dim of the model has."""
    seq_sizes = {int(s) for s in (seq_sizes if isinstance(seq_sizes, (list, tuple, set)) else [seq_sizes])}
    if isinstance(graphs, (fx.GraphModule, fx.Graph)):
        graphs = [graphs]
    found: List[str] = []
    for i, item in enumerate(graphs):
        label, g = item if isinstance(item, tuple) else (f"graph{i}", item)
        if isinstance(g, str):
            continue
        if not isinstance(g, (fx.GraphModule, fx.Graph)):
            raise TypeError(f"square_tensors: expected GraphModules or fx.Graphs, got {type(g).__name__}")
        graph = g.graph if isinstance(g, fx.GraphModule) else g
        for n in graph.nodes:
            v = n.meta.get("val")
            for t in (v if isinstance(v, (tuple, list)) else [v]):
                if isinstance(t, torch.Tensor) and _seq_degree(t.shape, seq_sizes) >= 2:
                    tgt = _target_name(n.target) if n.op == "call_function" else n.op
                    found.append(f"{label}: {n.name} {_meta_of(t)} = {tgt}")
        if isinstance(g, fx.GraphModule):
            named = dict(g.named_buffers())
            named.update({k: t for k, t in vars(g).items() if isinstance(t, torch.Tensor)})
            for name, t in named.items():
                if _seq_degree(t.shape, seq_sizes) >= 2:
                    found.append(f"{label}: {name} {_meta_of(t)} = buffer")
    return found


def _meta_of(t: torch.Tensor) -> str:
    return f"{_SHORT.get(t.dtype, str(t.dtype))}{list(t.shape)}"
