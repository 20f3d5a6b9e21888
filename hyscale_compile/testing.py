"""Helpers for tests of graph rewrites: a normalized, version-stable graph text, and a
seeded shuffle of the op's unsorted results (``shuffled_unsorted``)."""
from __future__ import annotations

import contextlib
import operator
from typing import Dict

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
