"""Score mods: elementwise functions of the score that users register.

``hyscale_compile.register_score_mod(name, fn)`` (the public face, in
``hyscale_compile/registry.py``) lands here. From one PyTorch function of a tensor, e.g.
``lambda x: 30.0 * torch.tanh(x / 30.0)``, this module derives everything the backend
needs, the way FlexAttention derives a kernel from a ``score_mod``:

* ``graph``: ``fn`` traced to aten with Inductor's decompositions (``fwd_only``): the exact
  op sequence the joint graph holds, which ``passes/score_mods.py`` looks for;
* ``triton_lines``: the same ops as Triton statements, spliced into the generated kernel's
  epilogue (``triton_codegen``);
* ``grad_graph``: ``(x, g) -> g * fn'(x)`` traced through autograd, which the sparse
  backward (``backward.py``) calls: it runs below autograd, so it needs the derivative as a
  plain graph;
* ``fn`` itself is the CPU reference (``reference._apply_elementwise``).

A compiled graph names a mod by its content, ``name@digest`` (``key``), not by its name:
the digest hashes the traced forward, its Triton text and the traced derivative.
Every mod registered in this process stays in an append-only store under its key, so
replacing or unregistering a name changes only what later compiles match; graphs
compiled before keep computing the function they were compiled from. A bare name (a
spec written by hand) means the current registration.

Registration validates all of it up front (an op the kernel cannot generate, a function
that is not elementwise, captures a tensor or depends on the input's shape, a Triton
translation that disagrees with ``fn``), so a bad registration fails there, not as a
wrong result at run time. Transcendental functions in the kernel (``tl.exp``,
libdevice ``tanh`` ...) agree with PyTorch's to a few ulps, not bit for bit: the threshold
check's tolerance covers that for mods whose derivative is bounded by ~1 near the scores.
"""
from __future__ import annotations

import dataclasses
import hashlib
import keyword
import math
import re
import threading
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims


class ScoreModError(ValueError):
    """A registration the backend cannot honour; the message names the problem."""


@dataclasses.dataclass(frozen=True)
class ScoreMod:
    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    graph: fx.GraphModule
    grad_graph: fx.GraphModule
    triton_lines: Tuple[str, ...]  # statements computing ``out`` from ``x`` (fp32)
    interp_lines: Tuple[str, ...]  # the same without libdevice (the interpreter lacks it)
    keeps_neg_inf: bool  # fn(-inf) == -inf: a -inf mask before it may still skip tiles

    def source(self) -> str:
        """What defines the mod's arithmetic: forward, kernel text, derivative."""
        return "\n".join([self.graph.code, *self.triton_lines, *self.interp_lines, self.grad_graph.code,
                          f"keeps_neg_inf={self.keeps_neg_inf}"])

    @property
    def key(self) -> str:
        """``name@digest``: how a spec (and so a compiled graph) names this mod. The same
        function registered under the same name in another process gets the same key."""
        return f"{self.name}@{hashlib.sha256(self.source().encode()).hexdigest()[:16]}"

    def triton(self, var: str, tag: str, interpret: bool = False) -> List[str]:
        """The Triton statements applying the mod to ``var`` in place (temporaries get ``tag``)."""
        out = []
        for ln in self.interp_lines if interpret else self.triton_lines:
            ln = re.sub(r"\bt(\d+)\b", lambda m: f"_{tag}_t{m.group(1)}", ln)
            ln = re.sub(r"\bx\b", var, ln)
            out.append(ln.replace("out =", f"{var} =", 1) if ln.startswith("out =") else ln)
        return out


_lock = threading.Lock()
_MODS: Dict[str, ScoreMod] = {}  # name -> current registration: what later compiles match
_STORE: Dict[str, ScoreMod] = {}  # key -> every mod registered in this process (append-only)

# Names the spec already uses for its own steps.
RESERVED = {"mul", "add", "div", "relu", "round", "neg", "sigmoid", "mul_operand", "div_operand", "mask", "mod"}


def name_of(ref: str) -> str:
    """The registered name in a spec's reference (``name@digest`` or a bare name)."""
    return ref.split("@", 1)[0]


def get(ref: str) -> ScoreMod:
    """The mod a spec refers to: by key (``name@digest``, what the matcher writes) the one
    compiled with, whatever is registered now; by bare name the current registration."""
    if "@" in ref:
        mod = _STORE.get(ref)
        if mod is None:
            name = name_of(ref)
            now = "registered with a different function" if name in _MODS else "not registered"
            raise ScoreModError(
                f"score mod {name!r} ({ref}): this graph was compiled with a registration not present in this "
                f"process ({name!r} is {now} here); register the same function under {name!r} before "
                "loading it, or recompile"
            )
        return mod
    mod = _MODS.get(ref)
    if mod is None:
        raise ScoreModError(
            f"unknown score mod {ref!r}: register it with hyscale_compile.register_score_mod "
            f"before running a graph that uses it (registered: {sorted(_MODS) or 'none'})"
        )
    return mod


def key_of(name: str) -> str:
    """The key of ``name``'s current registration."""
    return get(name_of(name)).key


def registered() -> Dict[str, ScoreMod]:
    with _lock:
        return dict(_MODS)


def add(mod: ScoreMod) -> None:
    with _lock:
        _MODS[mod.name] = mod
        _STORE.setdefault(mod.key, mod)


def remove(name: str) -> None:
    """Forget the name (later compiles no longer match it); its mods stay in the store."""
    with _lock:
        if name not in _MODS:
            raise ScoreModError(f"no score mod named {name!r} is registered")
        del _MODS[name]


# ---------------------------------------------------------------------------------------
# Building a ScoreMod from a function

_UNARY = {
    aten.exp.default: "tl.exp({0})",
    aten.log.default: "tl.log({0})",
    aten.sqrt.default: "tl.sqrt({0})",
    aten.rsqrt.default: "tl.rsqrt({0})",
    aten.sigmoid.default: "tl.sigmoid({0})",
    aten.abs.default: "tl.abs({0})",
    aten.erf.default: "tl.erf({0})",
    aten.neg.default: "-{0}",
    aten.tanh.default: ("libdevice.tanh({0})", "(1.0 - tl.div_rn(2.0, tl.exp(2.0 * {0}) + 1.0))"),
    aten.log1p.default: ("libdevice.log1p({0})", "tl.log(1.0 + {0})"),
    aten.expm1.default: ("libdevice.expm1({0})", "(tl.exp({0}) - 1.0)"),
    aten.reciprocal.default: "tl.div_rn(1.0, {0})",
    aten.relu.default: "tl.where({0} < 0.0, 0.0, {0})",
    aten.bitwise_not.default: "~{0}",
    aten.logical_not.default: "~{0}",
}
_BINARY = {
    aten.mul.Tensor: "{0} * {1}", aten.mul.Scalar: "{0} * {1}",
    aten.div.Tensor: "tl.div_rn({0}, {1})", aten.div.Scalar: "tl.div_rn({0}, {1})",  # IEEE, as torch
    aten.add.Tensor: "{0} + {1}", aten.add.Scalar: "{0} + {1}",
    aten.sub.Tensor: "{0} - {1}", aten.sub.Scalar: "{0} - {1}",
    aten.maximum.default: "tl.maximum({0}, {1})", aten.minimum.default: "tl.minimum({0}, {1})",
    aten.clamp_min.default: "tl.maximum({0}, {1})", aten.clamp_max.default: "tl.minimum({0}, {1})",
    aten.gt.Scalar: "{0} > {1}", aten.gt.Tensor: "{0} > {1}",
    aten.ge.Scalar: "{0} >= {1}", aten.ge.Tensor: "{0} >= {1}",
    aten.lt.Scalar: "{0} < {1}", aten.lt.Tensor: "{0} < {1}",
    aten.le.Scalar: "{0} <= {1}", aten.le.Tensor: "{0} <= {1}",
    aten.eq.Scalar: "{0} == {1}", aten.eq.Tensor: "{0} == {1}",
    aten.ne.Scalar: "{0} != {1}", aten.ne.Tensor: "{0} != {1}",
    aten.logical_and.default: "{0} & {1}", aten.logical_or.default: "{0} | {1}",
}
_TERNARY = {aten.where.self: "tl.where({0}, {1}, {2})"}
SUPPORTED_OPS = sorted(str(o) for o in list(_UNARY) + list(_BINARY) + list(_TERNARY) + [aten.pow.Tensor_Scalar])


def _lit(v) -> str:
    from .triton_codegen import _lit as float_literal

    if isinstance(v, bool):
        return repr(v)
    if isinstance(v, (int, float)):
        return float_literal(v)
    raise ScoreModError(f"constant {v!r} of type {type(v).__name__} cannot appear in a score mod")


def _trace(name: str, fn, n: int) -> fx.GraphModule:
    from torch._inductor.pattern_matcher import fwd_only

    try:
        gm = fwd_only(fn, [torch.empty(n)])
    except Exception as e:
        raise ScoreModError(f"register_score_mod({name!r}): tracing fn on a float32 tensor failed: "
                            f"{type(e).__name__}: {e}") from None
    return gm


def _not_elementwise(gm: fx.GraphModule) -> Optional[str]:
    """Why ``gm`` is not elementwise, naming the op, if one of its ops reduces or takes a dim."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        op = str(n.target.overloadpacket)
        if any(a.name in ("dim", "dims") for a in n.target._schema.arguments):
            return f"{op} takes a dim argument"
        out = n.meta.get("val")
        ins = [a.meta.get("val") for a in n.all_input_nodes]
        if isinstance(out, torch.Tensor) and any(isinstance(v, torch.Tensor) and v.numel() > out.numel() for v in ins):
            return f"{op} reduces its input"
    return None


def _check_elementwise(name: str, fn, gm: fx.GraphModule) -> None:
    reason = _not_elementwise(gm)
    if reason is None:
        return
    # name the op as the user wrote it (softmax, not the amax/sum it decomposes to)
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        reason = _not_elementwise(make_fx(fn)(torch.empty(16))) or reason
    except Exception:
        pass
    raise ScoreModError(f"register_score_mod({name!r}): the function is not elementwise ({reason}); "
                        "a score mod must map each score to a score")


def _pow(name, base: str, e) -> str:
    if e == 0.5:
        return f"tl.sqrt({base})"
    if isinstance(e, (int, float)) and float(e).is_integer() and 1 <= e <= 4:
        return "(" + " * ".join([base] * int(e)) + ")"
    raise ScoreModError(f"register_score_mod({name!r}): x ** {e!r}: only exponents 0.5, 1, 2, 3, 4 are generated")


def _translate(name: str, gm: fx.GraphModule, interpret: bool = False) -> Tuple[str, ...]:
    """The graph as Triton statements ``t<i> = ...``; the last one assigns ``out``.
    ``interpret``: spell libdevice functions with ``tl`` primitives (abs. error ~1 ulp of 1)."""
    names: Dict[fx.Node, str] = {}
    lines: List[str] = []
    out_node = None
    for i, n in enumerate(gm.graph.nodes):
        if n.op == "placeholder":
            names[n] = "x"
            continue
        if n.op == "output":
            (out_node,) = n.args[0] if isinstance(n.args[0], (tuple, list)) else (n.args[0],)
            continue
        if n.op == "get_attr":
            raise ScoreModError(f"register_score_mod({name!r}): fn captures a tensor ({n.target}); "
                                "use Python numbers for constants")
        t = n.target
        if t is prims.convert_element_type.default or t is aten._to_copy.default:
            dt = n.args[1] if len(n.args) > 1 else n.kwargs.get("dtype")
            if dt not in (torch.float32, torch.bool):
                raise ScoreModError(f"register_score_mod({name!r}): fn casts to {dt}; a mod computes in float32")
            names[n] = names[n.args[0]]
            continue
        if t in (aten.scalar_tensor.default,) or (t is aten.full.default and list(n.args[0]) == []):
            v = n.args[0] if t is aten.scalar_tensor.default else n.args[1]
            names[n] = _lit(v)
            continue
        if n.kwargs.get("alpha", 1) != 1:
            raise ScoreModError(f"register_score_mod({name!r}): {t} with alpha is not supported")
        args = [names[a] if isinstance(a, fx.Node) else _lit(a) for a in n.args]
        if t is aten.pow.Tensor_Scalar and len(args) == 2:
            expr = _pow(name, args[0], n.args[1])
        elif t in _UNARY and len(args) == 1:
            fmt = _UNARY[t]
            if isinstance(fmt, tuple):
                fmt = fmt[1] if interpret else fmt[0]
            expr = fmt.format(*args)
        elif t in _BINARY and len(args) == 2:
            expr = _BINARY[t].format(*args)
        elif t in _TERNARY and len(args) == 3:
            expr = _TERNARY[t].format(*args)
        else:
            raise ScoreModError(
                f"register_score_mod({name!r}): {t} is not an elementwise op the kernel can generate "
                f"(supported: {', '.join(SUPPORTED_OPS)})"
            )
        names[n] = f"t{i}"
        lines.append(f"t{i} = {expr}")
    if out_node is None or not isinstance(out_node, fx.Node) or names.get(out_node) is None:
        raise ScoreModError(f"register_score_mod({name!r}): fn must return one tensor computed from its input")
    lines.append(f"out = {names[out_node]}")
    return tuple(lines)


class _TorchTL:
    """``tl`` / ``libdevice`` as torch functions: evaluates the translation on the CPU."""

    div_rn = staticmethod(lambda a, b: torch.as_tensor(a, dtype=torch.float32) / b)
    exp, log, sqrt, rsqrt, sigmoid, abs, erf = (torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.sigmoid,
                                                 torch.abs, torch.erf)
    tanh, log1p, expm1 = torch.tanh, torch.log1p, torch.expm1

    @staticmethod
    def where(c, a, b):
        return torch.where(c, torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32))

    @staticmethod
    def maximum(a, b):
        return torch.maximum(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32))

    @staticmethod
    def minimum(a, b):
        return torch.minimum(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32))


def _eval_lines(lines, x: torch.Tensor) -> torch.Tensor:
    env = {"tl": _TorchTL, "libdevice": _TorchTL, "x": x, "float": float}
    for ln in lines:
        exec(ln, {"__builtins__": {}}, env)  # our own generated statements, not user text
    return torch.as_tensor(env["out"], dtype=torch.float32).expand_as(x)


def _probe_values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-3, -1e-3, 1.0, -1.0, 20.0, -20.0, 80.0, -80.0,
                            1e4, -1e4, 3e38, -3e38, math.inf, -math.inf])
    return torch.cat([special, torch.randn(256, generator=g) * 4, torch.randn(64, generator=g) * 100])


def build(name: str, fn: Callable) -> ScoreMod:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ScoreModError(f"register_score_mod: name must be a Python identifier, got {name!r}")
    if name in RESERVED:
        raise ScoreModError(f"register_score_mod: {name!r} is a built-in step name; pick another")
    if not callable(fn):
        raise ScoreModError(f"register_score_mod({name!r}): fn must be callable, got {type(fn).__name__}")
    gm = _trace(name, fn, 16)
    _check_elementwise(name, fn, gm)
    if _trace(name, fn, 7).code != gm.code:
        raise ScoreModError(f"register_score_mod({name!r}): fn depends on the input's shape; a mod must be elementwise")
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    if not ops:
        raise ScoreModError(f"register_score_mod({name!r}): fn computes nothing (the identity needs no registration)")
    lines = _translate(name, gm)
    interp_lines = _translate(name, gm, interpret=True)
    x = _probe_values()
    with torch.no_grad():
        want = fn(x.clone())
    if not isinstance(want, torch.Tensor) or want.shape != x.shape or want.dtype != torch.float32:
        raise ScoreModError(f"register_score_mod({name!r}): fn must map a float32 tensor to a float32 tensor of the "
                            f"same shape; got {getattr(want, 'dtype', type(want).__name__)} {tuple(getattr(want, 'shape', ()))}")
    perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))
    if not torch.equal(fn(x[perm].clone()), want[perm]) and not torch.allclose(fn(x[perm].clone()), want[perm], equal_nan=True):
        raise ScoreModError(f"register_score_mod({name!r}): fn is not elementwise (its output depends on other entries)")
    # the interpreter's spellings (1 - 2/(e^2x + 1) for tanh ...) are off by ~1 ulp of 1,
    # not of the result: a looser absolute tolerance there
    for ls, atol in ((lines, 1e-6), (interp_lines, 1e-4)):
        got = _eval_lines(ls, x.clone())
        if not torch.allclose(got, want, rtol=1e-5, atol=atol, equal_nan=True):
            bad = (got - want).abs().nan_to_num(nan=math.inf).argmax()
            raise ScoreModError(f"register_score_mod({name!r}): internal: the kernel translation disagrees with fn "
                                f"at x={x[bad].item()} ({got[bad].item()} vs {want[bad].item()}); please report")

    def vjp(xx, g):
        xx = xx.detach().requires_grad_(True)
        with torch.enable_grad():
            y = fn(xx)
        (gx,) = torch.autograd.grad(y, xx, g, allow_unused=True)
        return gx if gx is not None else torch.zeros_like(xx)

    from torch._inductor.pattern_matcher import fwd_only

    try:
        grad_gm = fwd_only(vjp, [torch.empty(16), torch.empty(16)])
        same = fwd_only(vjp, [torch.empty(7), torch.empty(7)]).code == grad_gm.code
    except Exception as e:
        raise ScoreModError(f"register_score_mod({name!r}): fn is not differentiable: {type(e).__name__}: {e}") from None
    if not same:
        raise ScoreModError(f"register_score_mod({name!r}): fn's derivative depends on the input's shape")
    with torch.no_grad():
        keeps = bool(fn(torch.tensor([-math.inf]))[0] == -math.inf)
    return ScoreMod(name=name, fn=fn, graph=gm, grad_graph=grad_gm, triton_lines=lines, interp_lines=interp_lines,
                    keeps_neg_inf=keeps)


def apply(ref: str, x: torch.Tensor) -> torch.Tensor:
    """The mod on a tensor of any float dtype (the reference; float64 in the tests)."""
    return get(ref).fn(x)


def grad(ref: str, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """g * fn'(x), from the traced derivative (callable below autograd)."""
    return get(ref).grad_graph(x, g)
