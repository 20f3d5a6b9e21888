"""Generate the HyTopK Triton kernel from a ``ScoreSpec``.

``render_kernel_source(spec, num_masks)`` returns the Python source of one
``@triton.jit`` kernel specialized to the score description: the per-head epilogue,
the head reduction, the post steps and every mask term are inlined as straight-line
Triton code; mask operands become pointer + stride arguments.

``load_kernel(spec, num_masks)`` writes that source to ``$HYSCALE_KERNEL_CACHE``
(default ``~/.cache/hyscale_compile/kernels``) under a name derived from a hash of
the source, and imports it: ``triton.jit`` reads the function's source with
``inspect`` and refuses functions built with ``exec``, so a real file is required.

What is generated, and what is fixed text
-----------------------------------------
The generated file holds only what the spec decides: the entry kernel (its mask
arguments, row bounds and skippable key ranges, the fillers' value), ``_score_tile``
(the head weighting and the post steps and masks) and ``_epilogue``. The selection
machinery every spec shares (the ordered int64 keys, the lane sub-buffers, the
compactions, the fillers, the final sort) is imported from ``triton_lib`` and
``triton_keys``, so two generated kernels differ only where their specs do. A change to
those modules needs no new file: the generated module imports them, and Triton's own
cache key covers the source of every function a kernel calls. See docs/kernel.md for the
algorithm and why it was chosen.

Whether Triton runs a kernel compiled or interpreted (``TRITON_INTERPRET=1``) is
decided when ``@triton.jit`` decorates the function, i.e. when the generated module is
imported; ``load_kernel`` therefore keys its in-process cache on that mode too.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import tempfile
import threading
from typing import Dict, List, Optional, Tuple

from .mask_kinds import mask_kinds
from .mask_kinds import row_load as _row_load
from .mask_kinds import triton_literal as _lit
from .spec import KernelPlan, ScoreSpec, SpecError, kernel_plan

_MODULE_CACHE: Dict[Tuple[str, bool], object] = {}
_KERNEL_FN_CACHE: Dict[tuple, object] = {}
_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------
# spec -> Triton expressions
# ---------------------------------------------------------------------------------------
def _round_expr(var: str, dtype: str) -> str:
    if dtype in ("float32", "float64"):
        return var  # fp32 -> fp32 / fp64 -> fp32 round trips are the identity
    if dtype == "bfloat16":
        # Bit-exact round-to-nearest-even; works in the interpreter, which has no bf16 math.
        return f"_round_bf16({var})"
    if dtype == "float16":
        return f"{var}.to(tl.float16).to(tl.float32)"
    raise SpecError(f"cannot round to {dtype!r}")


def _elementwise_lines(var: str, step, fast_relu: bool = False) -> List[str]:
    op = step[0]
    if op == "mul":
        return [f"{var} = {var} * {_lit(step[1])}"]
    if op == "add":
        return [f"{var} = {var} + {_lit(step[1])}"]
    if op == "div":
        # IEEE round-to-nearest, as torch divides (Triton's `/` on fp32 is the approximate div.full)
        return [f"{var} = tl.div_rn({var}, {_lit(step[1])})"]
    if op == "relu":
        if fast_relu:
            # one NaN-propagating max (max.NaN.f32) instead of a compare and a select; it may
            # differ from torch only in the sign of a zero, which no later step can see
            # (``_zero_sign_blind``) and _pack erases
            return [f"{var} = tl.maximum({var}, 0.0, propagate_nan=tl.PropagateNan.ALL)"]
        # where(x < 0) rather than maximum: keeps NaN a NaN, as torch.relu does.
        return [f"{var} = tl.where({var} < 0.0, 0.0, {var})"]
    if op == "neg":
        return [f"{var} = -{var}"]
    if op == "sigmoid":
        return [f"{var} = tl.sigmoid({var})"]
    if op == "round":
        return [f"{var} = {_round_expr(var, step[1])}"]
    if op == "mod":
        from . import mods

        return [f"# registered score mod {step[1]!r}"] + mods.get(step[1]).triton(
            var, f"{var}_{mods.name_of(step[1])}", interpret=_interpreting())
    raise SpecError(f"unknown elementwise step {step!r}")


def mask_pieces(spec: ScoreSpec) -> list:
    """The kernel pieces of each of the spec's mask terms, in ``spec.masks`` order (their
    kinds' objects, ``mask_kinds``)."""
    return mask_kinds(spec.masks)


def _mask_args(spec: ScoreSpec, plan: KernelPlan) -> List[str]:
    """Kernel arguments for the mask terms: one pointer + strides per (term, role)."""
    args = [a for piece in mask_pieces(spec) for a in piece.args()]
    if plan.skip_flag:
        # int32 [1]: 1 when the launch's bound proves the hidden value (plan.finite_range),
        # or the operands reaching -inf hidden keys finite (plan.guard); never both
        args.append("SKIPF")
    tmt = plan.tensor_mask
    if tmt is not None:  # each row's visible key range of the mask tensor (triton_mask_ranges)
        args += ["RLO", "stride_rlo_b", "stride_rlo_s", "RHI", "stride_rhi_b", "stride_rhi_s"]
        # and its first run of neutral keys, where the tile loop does not read the tensor
        args += ["NLO", "stride_nlo_b", "stride_nlo_s", "NHI", "stride_nhi_b", "stride_nhi_s"]
        if mask_pieces(spec)[tmt[0]].adds_to_score:
            args.append("FILLV")  # the additive tensor's hidden value (its smallest)
        if tmt[1]:
            args.append("SKIPF")  # the bound's verdict
    return args


def _filler(spec: ScoreSpec, plan: KernelPlan) -> tuple:
    """(value literal, packed high word) of the keys that skipped tiles stand for: -inf, or
    the finite value of ``plan.finite_range``. The high word is ``_pack``'s, in Python."""
    tmt = plan.tensor_mask
    if tmt is not None and mask_pieces(spec)[tmt[0]].adds_to_score:
        return "fill_v", "fill_hi"  # an additive mask tensor's smallest value, loaded per launch
    fin = plan.finite_range
    if tmt is not None:
        value = spec.masks[tmt[0]].value  # a bool mask tensor's fill value
    elif fin is not None:
        value = fin[1]
    else:
        return '(-float("inf"))', "NEG_INF_HI"
    if value == -math.inf:
        return '(-float("inf"))', "NEG_INF_HI"
    import numpy as np

    if not math.isfinite(value):
        raise SpecError(f"a hidden value of {value}: tiles hiding it cannot be skipped")
    v = np.float32(value) + np.float32(0.0)  # (-0.0 -> +0.0, as _pack does)
    b = int(np.array(v, dtype=np.float32).view(np.int32))
    b ^= (b >> 31) & 0x7FFFFFFF
    return _lit(float(v)), str(b)


def _score_mask_args(spec: ScoreSpec) -> List[str]:
    """The subset of ``_mask_args`` that ``_score_tile`` reads (add/fill tables; range
    bounds reach it already loaded, one value per row)."""
    return [a for piece in mask_pieces(spec) for a in piece.tile_args()]


def weight_scale(spec: ScoreSpec):
    """The positive constant c folded into the head weights, or None.

    For an epilogue that is exactly ``mul c`` and ``relu`` (either order, c finite and > 0)
    under a weighted head sum, ``relu(x * c) * w == relu(x) * (c * w)`` up to the order of the
    two roundings of the product, i.e. fp32 reassociation (docs/contract.md, "Exact along
    the graph's own dtype path"). The launcher then passes ``w * c`` and the kernel skips one
    multiply per (key, head) element."""
    if spec.reduce != "weighted_sum" or len(spec.epilogue) != 2:
        return None
    ops = [st[0] for st in spec.epilogue]
    if sorted(ops) != ["mul", "relu"]:
        return None
    c = float(next(st for st in spec.epilogue if st[0] == "mul")[1])
    return c if math.isfinite(c) and c > 0 else None


def _zero_sign_blind(steps) -> bool:
    """Whether no step in ``steps`` (run after a ReLU) can turn +0 and -0 into values that
    differ by more than the sign of a zero. Registered mods are arbitrary functions (1/x)."""
    return all(st[0] != "mod" for st in steps)


def _render_epilogue(spec: ScoreSpec) -> str:
    lines = ["@triton.jit", "def _epilogue(x):", "    # spec.epilogue, applied to every head's fp32 logit"]
    if spec.logit_dtype != "float32":
        lines.append(f"    # the contraction ran in {spec.logit_dtype}: round each logit first (dtype rule 2)")
        lines.append(f"    x = {_round_expr('x', spec.logit_dtype)}")
    folded = weight_scale(spec)
    for i, step in enumerate(spec.epilogue):
        if folded is not None and step[0] == "mul":
            lines.append(f"    # mul {folded!r}: folded into the head weights (triton_codegen.weight_scale)")
            continue
        fast = _zero_sign_blind(tuple(spec.epilogue[i + 1:]) + tuple(spec.post))
        lines += ["    " + ln for ln in _elementwise_lines("x", step, fast_relu=fast)]
    lines.append("    return x")
    return "\n".join(lines)


def _render_row_bounds(spec: ScoreSpec) -> str:
    """Per-row lo/hi bounds of range terms, loaded once per row block."""
    return "\n".join(ln for piece in mask_pieces(spec) for ln in piece.row_loads())


def _row_bound_args(spec: ScoreSpec, plan: KernelPlan) -> str:
    """The per-row bounds ``_score_tile`` takes, loaded once per row block (``_render_row_bounds``)."""
    names = [n for piece in mask_pieces(spec) for n in piece.row_values()]
    tmt = plan.tensor_mask
    if tmt is not None:
        names += [f"mlo{tmt[0]}", f"mhi{tmt[0]}"]
    return "".join(f"{n}, " for n in names)


def _narrow_lines(lo, hi, ok: str = "") -> List[str]:
    """key_lo / key_hi narrowed by per-row bounds ``lo`` / ``hi`` (variable names, or None)
    over the block's rows; with ``ok`` (a scalar condition), only where it holds.
    Padding rows contribute nothing: their lo is taken as T, their hi as 0."""
    lines = []
    for var, bound, red, other, widest, pick in (("key_lo", lo, "tl.min", "T", "0", "tl.maximum"),
                                                 ("key_hi", hi, "tl.max", "0", "T", "tl.minimum")):
        if bound is None:
            continue
        val = f"{red}(tl.where(row_ok, {bound}, {other}), axis=0)"
        if ok:
            val = f"tl.where({ok}, {val}, {widest})"
        lines.append(f"{var} = {pick}({var}, {val})")
    return lines


def _render_skip_bounds(spec: ScoreSpec, plan: KernelPlan) -> str:
    """Block-level facts from the skippable range terms.

    key_lo: every key t < key_lo is hidden (-inf, or the finite value of
    ``plan.finite_range``) for every row of the block;
    key_hi: every key t >= key_hi is hidden for every row of the block.
    """
    pieces = mask_pieces(spec)
    lines = ["key_lo = tl.zeros([], dtype=tl.int64)", "key_hi = tl.zeros([], dtype=tl.int64) + T"]
    for j in plan.skippable:
        # a term of plan.guard (s + -inf is NaN where s is NaN or +inf, and NaN ranks
        # first): its tiles are skipped only where SKIPF proves the operands finite
        ok = "(tl.load(SKIPF) != 0)" if plan.guarded(j) else ""
        lines += _narrow_lines(*pieces[j].bound_vars(), ok)
    tmt = plan.tensor_mask
    if tmt is not None:
        # a mask tensor: each row's visible key range, read off the tensor before the launch
        # (triton_mask_ranges); outside it every key holds the hidden value fill_v (the fill
        # value, or the additive tensor's smallest value when SKIPF's bound proves fl(s + v)
        # == v). Inside, the tensor still applies per key.
        lines.append(_row_load("rlo", "RLO", "stride_rlo", "T"))
        lines.append(_row_load("rhi", "RHI", "stride_rhi", "0"))
        lines += _narrow_lines("rlo", "rhi", "(tl.load(SKIPF) != 0)" if tmt[1] else "")
        if pieces[tmt[0]].adds_to_score:
            lines.append("fill_v = tl.load(FILLV)")
            lines.append("fill_hi = _pack(fill_v, tl.zeros([], dtype=tl.int64)) >> 32")
    fin = plan.finite_range
    if fin is not None:
        # hidden keys all hold one finite value below every visible score (a fill, or
        # an add: fl(s + v) == v) when the run-time bound on |score|, SKIPF, says so:
        # skipped like -inf ones, fillers of value v
        lines += _narrow_lines(*pieces[fin[0]].bound_vars(), "(tl.load(SKIPF) != 0)")
    # the per-element compares in the tile loop use the key type (int32 when T allows);
    # clamping to [0, T] keeps every compare with a key in [0, T) the same
    for piece in pieces:
        lines += piece.key_clamp_lines()
    if tmt is not None:
        # the mask tensor's first neutral run (triton_mask_ranges) every row of the block
        # shares, where the tile loop does not read it; scalars, because per-row vectors held
        # through the tile loop spilled
        j = tmt[0]
        lines.append(_row_load(f"nlo{j}", "NLO", "stride_nlo", "0"))
        lines.append(_row_load(f"nhi{j}", "NHI", "stride_nhi", "0"))
        lines.append(f"mlo{j} = _as_key(tl.max(tl.where(row_ok, nlo{j}, 0), axis=0), T, IDX32)")
        lines.append(f"mhi{j} = _as_key(tl.min(tl.where(row_ok, nhi{j}, T), axis=0), T, IDX32)")
    return "\n".join(lines)


def _render_post(spec: ScoreSpec, plan: KernelPlan) -> str:
    """Post steps on the reduced [BLOCK_N, BLOCK_M] score ``y`` (keys x rows; inlined in _score_tile)."""
    lines = []
    tmt = plan.tensor_mask
    pieces = mask_pieces(spec)
    for i, step in enumerate(spec.post):
        if step[0] != "mask":
            lines += _elementwise_lines("y", step, fast_relu=_zero_sign_blind(spec.post[i + 1:]))
            continue
        j = step[1]
        lines += pieces[j].apply_lines(neutral_run=tmt is not None and tmt[0] == j)
    return "\n".join(lines)


def _render_reduce(spec: ScoreSpec) -> str:
    """Per-head weighting of the epilogue'd logits ``x`` [BLOCK_N, BLOCK_M * GP] (columns are
    (row, head-in-group) pairs); the head sum itself is ``_head_sum``."""
    if spec.reduce == "weighted_sum":
        # (unfused on FMA-unit dots, so that every lane's copy of a head sum is the same bits)
        return "x = _weigh(wv[None, :], x, UPCAST, TF32)"
    if spec.reduce == "sum":
        if spec.epilogue and spec.epilogue[-1][0] in ("mul", "mod"):
            # (the epilogue may end in a product: unfused on FMA-unit dots, as _weigh's)
            return "x = _unfused(x, UPCAST, TF32)  # reduce='sum': unweighted"
        return "pass  # reduce='sum': unweighted"
    return "pass  # reduce='none': H == 1"


def _score_call(spec: ScoreSpec, plan: KernelPlan, t: str, offs: str, keys: str, indent: int) -> str:
    """The kernel's ``y = _score_tile(...)`` for the tile at key ``t`` (its element offsets
    ``offs``, key positions ``keys``): the one call, made by the sample and the tile loop."""
    pad = " " * indent
    args = ("kt, qb0, wv0, Q, K, W, " + "".join(f"{a}, " for a in _score_mask_args(spec))
            + "stride_qh, stride_qd, stride_kt, stride_kh, stride_wh, " + _row_bound_args(spec, plan)
            + f"b64, rows64, row_ok, q_col_off, w_col_off, col_ok, k_base, {t}, {offs}, {keys}, key_ok, "
            + "offs_d, d_ok, T, HK, G, GP, BLOCK_M, BLOCK_N, UPCAST, TF32, REREAD_W")
    lines, line = [], ""
    for a in args.split(", "):
        if len(pad) + 4 + len(line) + len(a) + 2 > 118:
            lines.append(pad + "    " + line.rstrip())
            line = ""
        line += a + ", "
    lines.append(pad + "    " + line.rstrip().rstrip(","))
    return pad + "y = _score_tile(\n" + "\n".join(lines) + ")"


def _indent(text: str, n: int) -> str:
    pad = " " * n
    return "\n".join((pad + ln) if ln else ln for ln in text.splitlines())


def render_kernel_source(spec: ScoreSpec, num_masks: int, *, kernel_name: str = "hytopk_kernel",
                         plan: Optional[KernelPlan] = None) -> str:
    """Python source of a ``@triton.jit`` HyTopK kernel specialized to ``spec``.

    ``num_masks`` is the number of mask operand tensors the op receives (checked against
    the spec's references). ``plan``: the spec's ``kernel_plan`` where the caller has it
    already. The result depends only on these arguments, so its hash names the cache file.
    """
    spec.validate(num_mask_operands=num_masks)
    plan = kernel_plan(spec) if plan is None else plan
    mask_args = _mask_args(spec, plan)
    fill_v, fill_hi = _filler(spec, plan)
    subs = {
        "SPEC_JSON": spec.to_json(),
        "DESCRIBE": spec.describe(),
        "KERNEL_NAME": kernel_name,
        # registered score mods call libdevice (tanh, log1p, ...); the interpreter has none
        "LIBDEVICE": "" if _interpreting() else "from triton.language.extra import libdevice\n",
        "EPILOGUE_FN": _render_epilogue(spec),
        "MASK_ARGS_DEF": "".join(f"    {a},\n" for a in mask_args),
        "SCORE_MASK_ARGS": "".join(f"{a}, " for a in _score_mask_args(spec)),
        "ROW_BOUNDS": _indent(_render_row_bounds(spec), 8) or "        pass",
        "SKIP_BOUNDS": _indent(_render_skip_bounds(spec, plan), 8),
        "FILL_V": fill_v,
        "FILL_HI": fill_hi,
        "REDUCE": _indent(_render_reduce(spec), 8),
        "POST": _indent(_render_post(spec, plan), 4) or "    pass",
        "ROW_BOUND_ARGS_DEF": _row_bound_args(spec, plan),
        "SCORE_CALL_SAMPLE": _score_call(spec, plan, "t_s", "s_offs", "keys_s", 20),
        "SCORE_CALL_LOOP": _score_call(spec, plan, "tt", "k_offs", "keys", 16),
    }
    src = _KERNEL_TEMPLATE
    for key, val in subs.items():
        src = src.replace("{{" + key + "}}", val)
    assert "{{" not in src, "unfilled template slot"
    return "\n".join(ln.rstrip() for ln in src.split("\n"))


# ---------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------
def kernel_cache_dir() -> str:
    return os.environ.get("HYSCALE_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "hyscale_compile", "kernels"
    )


def _interpreting() -> bool:
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except Exception:  # older triton: the env var is the switch
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_imported_interpreted() -> bool:
    """Whether triton's own ``@jit`` library (tl.zeros, tl.sum, tl.sort, ...) was
    decorated for the interpreter. Triton 3.6 decorates it once, when triton is first
    imported, so TRITON_INTERPRET must already be set then; a kernel interpreted in a
    process that imported triton compiled (or the reverse) fails inside the launch."""
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(std.zeros, InterpretedFunction)


def check_interpreter_mode() -> bool:
    """The current mode (True: interpreted), after checking it matches how triton was
    imported; raises SpecError with the fix otherwise."""
    interp = _interpreting()
    if interp != triton_imported_interpreted():
        raise SpecError(
            "TRITON_INTERPRET is {} now but was {} when triton was first imported; triton 3.6 "
            "decorates its standard library at import, so set (or unset) TRITON_INTERPRET before "
            "anything imports triton".format("set" if interp else "unset", "unset" if interp else "set")
        )
    return interp


def write_source(src: str) -> str:
    """Write ``src`` to the cache directory (atomically) and return the file path."""
    digest = hashlib.sha256(src.encode()).hexdigest()[:32]
    directory = kernel_cache_dir()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"hytopk_{digest}.py")
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(prefix=".hytopk_", suffix=".py.tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(src)
            os.replace(tmp, path)  # atomic: concurrent writers produce identical bytes
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return path


def _mod_bodies(spec: ScoreSpec) -> tuple:
    """The generated lines of the registered score mods the spec calls. A spec naming a mod
    by bare name (written by hand) means the current registration, which re-registering
    changes, so they are part of ``load_kernel``'s key (a ``name@digest`` key is fixed)."""
    from . import mods

    used = [(st[1], mods.get(st[1])) for st in tuple(spec.epilogue) + tuple(spec.post) if st[0] == "mod"]
    return tuple((name, tuple(m.triton_lines), tuple(m.interp_lines)) for name, m in used)


def load_kernel(spec: ScoreSpec, num_masks: int, *, kernel_name: str = "hytopk_kernel",
                plan: Optional[KernelPlan] = None):
    """The generated kernel for ``spec`` (a JITFunction, or an InterpretedFunction under
    ``TRITON_INTERPRET=1``). Modules are cached per (source, interpret mode) in-process,
    and the lookup per (spec, mods, mode): rendering the source takes ~0.6 ms of host time,
    more than a whole 8K launch's GPU time once was."""
    interp = _interpreting()
    # the spec by its JSON: always hashable, keeps -0.0 apart from 0.0 (equal as floats,
    # rendered differently), and equal NaN constants give equal keys
    fast_key = (spec.to_json(), num_masks, kernel_name, interp, _mod_bodies(spec))
    fn = _KERNEL_FN_CACHE.get(fast_key)
    if fn is not None:
        return fn
    src = render_kernel_source(spec, num_masks, kernel_name=kernel_name, plan=plan)
    fn = _KERNEL_FN_CACHE[fast_key] = getattr(import_source(src), kernel_name)
    return fn


def import_source(src: str):
    """The module of generated Triton source ``src``, written to the kernel cache and imported
    (triton.jit reads a function's source with ``inspect``); one module per (source,
    interpreter mode) in this process, for every kernel family that generates code."""
    interp = _interpreting()
    key = (src, interp)
    with _LOCK:
        mod = _MODULE_CACHE.get(key)
        if mod is None:
            path = write_source(src)
            base = os.path.splitext(os.path.basename(path))[0]
            mod_name = f"hyscale_compile._generated.{base}{'_interp' if interp else ''}"
            mspec = importlib.util.spec_from_file_location(mod_name, path)
            mod = importlib.util.module_from_spec(mspec)
            sys.modules[mod_name] = mod  # triton resolves globals through the module
            try:
                mspec.loader.exec_module(mod)
            except BaseException:
                sys.modules.pop(mod_name, None)
                raise
            _MODULE_CACHE[key] = mod
    return mod


# ---------------------------------------------------------------------------------------
# the template
# ---------------------------------------------------------------------------------------
# Slots are {{NAME}}; everything else is literal Triton code. Notation:
#   BLOCK_M query rows of one batch per block, BLOCK_N keys per tile, BLOCK_D >= D (pow2),
#   TOPK = k, CAP = pow2 >= TOPK + BLOCK_N: the per-row candidate buffer in SCRATCH.
_KERNEL_TEMPLATE = r'''# Generated by hyscale_compile.lowerings.triton_codegen. Do not edit.
# spec: {{SPEC_JSON}}
# score: {{DESCRIBE}}
import triton
import triton.language as tl
{{LIBDEVICE}}
# The spec-independent helpers (triton_lib) and the ordered int64 keys (triton_keys): in this
# module's namespace, where Triton resolves the kernel's globals.
from hyscale_compile.lowerings.triton_keys import EMPTY, NEG_INF_HI, _pack, _unpack_value  # noqa: F401
from hyscale_compile.lowerings.triton_lib import (  # noqa: F401
    _append_lanes, _as_key, _col_row_head, _compact_all_rows, _compact_full_rows, _emit_rows, _fill_tiles,
    _head_logits, _head_sum, _load_k, _load_q, _round_bf16, _sample_estimate, _unfused, _weigh)


{{EPILOGUE_FN}}


@triton.jit
def _score_tile(
    kt0, qb0, wv0, Q, K, W, {{SCORE_MASK_ARGS}}
    stride_qh, stride_qd, stride_kt, stride_kh, stride_wh, {{ROW_BOUND_ARGS_DEF}}
    b64, rows64, row_ok, q_col_off, w_col_off, col_ok, k_base, t_tile, k_offs, keys, key_ok, offs_d, d_ok, T,
    HK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, TF32: tl.constexpr, REREAD_W: tl.constexpr,
):
    # Final scores y [BLOCK_N, BLOCK_M] (fp32, keys x rows) of one key tile against the
    # block's rows: each kv head's logits (_head_logits), the spec's epilogue and head
    # weighting, the head sum, then the spec's post steps and masks.
    PADDED: tl.constexpr = GP != G
    ok = key_ok[:, None] & row_ok[None, :]
    y = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for hk in range(HK):  # kv heads in a fixed order 0..HK-1
        x, wv = _head_logits(kt0, qb0, wv0, Q, K, W, stride_qh, stride_qd, stride_kt, stride_kh, stride_wh,
                             q_col_off, w_col_off, col_ok, k_base, t_tile, k_offs, key_ok, offs_d, d_ok, T, hk,
                             HK, G, UPCAST, TF32, REREAD_W)
        x = _epilogue(x)
{{REDUCE}}
        if PADDED:
            x = tl.where(col_ok[None, :], x, 0.0)  # padding heads add exactly nothing
        y = y + _head_sum(x, BLOCK_N, BLOCK_M, GP)  # 0.0 + s == s (+-0 aside)
{{POST}}
    return y


@triton.jit
def {{KERNEL_NAME}}(
    Q, K, W, SCRATCH, COUNTER, OUT_IDX, OUT_VAL, K_DESC, k_desc_rows,
{{MASK_ARGS_DEF}}    stride_qb, stride_qs, stride_qh, stride_qd,
    # the key strides within a batch are compile-time constants: a key tile's per-element
    # offsets then come from the thread index in a few instructions instead of occupying
    # registers across the tile loop (one compiled kernel per key layout)
    stride_kb, stride_kt: tl.constexpr, stride_kh: tl.constexpr, stride_kd: tl.constexpr,
    stride_wb, stride_ws, stride_wh,
    S, T, num_row_blocks, num_blocks,
    HK: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, CAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, TF32: tl.constexpr, RETURN_VALUES: tl.constexpr,
    SORT: tl.constexpr, LOW_WATER: tl.constexpr, SLACK: tl.constexpr,
    IDX32: tl.constexpr, SORT_R: tl.constexpr,
    REREAD_W: tl.constexpr, USE_TMA: tl.constexpr, PRESAMPLE: tl.constexpr, PRESAMPLE_J: tl.constexpr,
):
    # Persistent programs take row blocks from an atomic counter, heaviest first (the last
    # rows of a causal mask see the most keys), so SCRATCH holds P x BLOCK_M x CAP keys
    # whatever S is. Which program runs which block never changes the answer.
    SUBCAP: tl.constexpr = CAP // BLOCK_N  # slots per lane sub-buffer
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    # dot columns: (row m, head i) pairs, in _col_row_head's order
    offs_c = tl.arange(0, BLOCK_M * GP)
    col_m, col_i = _col_row_head(offs_c, BLOCK_M, GP)
    offs_d = tl.arange(0, BLOCK_D)
    if BLOCK_D == D:
        d_ok = tl.full([BLOCK_D], 1, tl.int1)  # a constant: the loads' masks fold away
    else:
        d_ok = offs_d < D
    k_offs = offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd  # a key tile's element offsets
    scr = SCRATCH + pid.to(tl.int64) * (BLOCK_M * CAP)
    scr_cols = scr + offs_m.to(tl.int64)[None, :] * CAP  # [1, BLOCK_M] row starts
    # this program's lane counts [BLOCK_N, BLOCK_M], written where compactions read them
    # (after the scheduler's counter at COUNTER[0])
    lane_cnt = COUNTER + 1 + pid * (BLOCK_M * BLOCK_N)
    # 32-bit offsets (computed where used: registers are scarce across the tile loop)
    lane_cnt_offs = offs_m[None, :] * BLOCK_N + offs_n[:, None]
    if PRESAMPLE > 0:
        # a block whose estimate failed its check runs again without one; COUNTER's last
        # slot counts them
        redo_cnt = COUNTER + 1 + tl.num_programs(0) * (BLOCK_M * BLOCK_N)
        retry = tl.zeros([], dtype=tl.int32)
    j = tl.atomic_add(COUNTER, 1)
    while j < num_blocks:
        nbatch = num_blocks // num_row_blocks
        b = j % nbatch
        mb = num_row_blocks - 1 - j // nbatch
        b64 = b.to(tl.int64)
        rows64 = mb.to(tl.int64) * BLOCK_M + offs_m
        row_ok = rows64 < S
        col_rows64 = mb.to(tl.int64) * BLOCK_M + col_m
        col_ok = (col_rows64 < S) & (col_i < G)
        q_col_off = b64 * stride_qb + col_rows64 * stride_qs + col_i * stride_qh
        w_col_off = b64 * stride_wb + col_rows64 * stride_ws + col_i * stride_wh
        k_base = b64 * stride_kb
{{ROW_BOUNDS}}
{{SKIP_BOUNDS}}
        # Keys >= key_hi are hidden (-inf, or the spec's one finite hidden value) for every
        # row; a row needs them only as fillers while it holds fewer than TOPK keys, and the
        # fillers are then the smallest such indices.
        t_end = tl.minimum(tl.maximum(key_hi, TOPK), T)
        # Tiles [v0, v1) may hold a visible key: they are scored. The others provably hold
        # the hidden value only: never scored, and visited at all only while some row would
        # take their best key (hidden value, t0), i.e. holds fewer than TOPK keys above it.
        v0 = tl.minimum((key_lo // BLOCK_N) * BLOCK_N, t_end)
        v1 = tl.maximum(tl.minimum(((key_hi + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, t_end), v0)
        if HK == 1:
            # the Q block and its head weights stay on chip for the whole row block
            qb0, wv0 = _load_q(Q, W, q_col_off, w_col_off, 0, col_ok, offs_d, d_ok,
                               stride_qh, stride_qd, stride_wh, G, UPCAST)
        else:
            qb0 = tl.zeros([BLOCK_M * GP, BLOCK_D], dtype=Q.dtype.element_ty)
            wv0 = tl.zeros([BLOCK_M * GP], dtype=tl.float32)
        # Running state of the scored tiles. A row's buffer is BLOCK_N lane sub-buffers of
        # SUBCAP slots: the key at offset j of a tile goes to lane j, slot cnt[j, row], so
        # each (lane, row) element of a tile finds its slot in its own thread: no atomics,
        # scans or barriers per tile. thr: the smallest key the row's last compaction kept,
        # with at least TOPK keys at or above it (the TOPK-th best, or a lower bound of it when
        # the search stopped early: _kth_largest's SLACK); thr_v: its value (NaN: no
        # compaction yet, take everything).
        cnt = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        thr = tl.zeros([BLOCK_M], dtype=tl.int64) + EMPTY
        thr_v = tl.zeros([BLOCK_M], dtype=tl.float32) + float("nan")
        # est_v: each row's sampled estimate (presample), the threshold while the row's own
        # compactions have set none; NaN (take everything) without one
        est_v = thr_v
        tl.debug_barrier()  # the previous block's last reads of SCRATCH are done
        if PRESAMPLE > 0:
            # The sampled estimate (docs/kernel.md, "Selecting"): a block with at least 3k
            # keys to score first scores every PRESAMPLE-th of them into its lanes, takes each
            # row's estimate from them (est_v: a value at or below the PRESAMPLE_J-th best
            # sampled score, NaN: none), and throws the sample away: the tile loop then runs
            # in key order as always, taking only keys above est_v. Every key a row keeps
            # then scores >= its estimate, so the row is exact iff it ends with TOPK keys
            # (checked after the final compaction; the block is redone without an estimate
            # otherwise).
            if (retry == 0) & (v1 - v0 >= 3 * TOPK):
                m_keys = (v1 - v0 + PRESAMPLE - 1) // PRESAMPLE
                if PRESAMPLE * stride_kt * BLOCK_N < 2147483648:  # (32-bit offsets: fewer registers)
                    s_offs = offs_n[:, None] * (PRESAMPLE * stride_kt) + offs_d[None, :] * stride_kd
                else:
                    s_offs = offs_n.to(tl.int64)[:, None] * (PRESAMPLE * stride_kt) + offs_d[None, :] * stride_kd
                for st in range(0, m_keys, BLOCK_N):
                    t_s = v0.to(tl.int64) + st * PRESAMPLE
                    keys_s = t_s + offs_n.to(tl.int64) * PRESAMPLE
                    key_ok = ((st + offs_n) < m_keys) & (keys_s < t_end)
                    if HK == 1:
                        kt = _load_k(K, k_base, 0, t_s, s_offs, key_ok, d_ok, stride_kt, stride_kh, UPCAST)
                    else:
                        kt = tl.zeros([BLOCK_N, BLOCK_D], dtype=K.dtype.element_ty)
{{SCORE_CALL_SAMPLE}}
                    # (masked keys are not sampled: m counts the row's visible ones)
                    take = key_ok[:, None] & row_ok[None, :] & (y != float("-inf"))
                    cnt = _append_lanes(scr, offs_m, offs_n, cnt, _pack(y, keys_s[:, None]), take, CAP, BLOCK_N)
                tl.store(lane_cnt + lane_cnt_offs, cnt)
                tl.debug_barrier()
                m_row = tl.sum(cnt, axis=0)
                for r in range(BLOCK_M):
                    if tl.sum(tl.where(offs_m == r, m_row, 0), axis=0) >= 2 * PRESAMPLE_J:
                        est_v = tl.where(offs_m == r, _sample_estimate(scr + r * CAP, lane_cnt + r * BLOCK_N,
                                                                       PRESAMPLE_J, CAP, BLOCK_N), est_v)
                tl.debug_barrier()  # the sample's reads are done before the tile loop overwrites it
                cnt = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
                thr_v = est_v
        # 1. scored tiles, in increasing key order. An inner loop runs only as many tiles as
        #    every lane can take (a tile adds at most one key per lane and row), so it holds
        #    no merge and no nested loop, and Triton software-pipelines its key-tile loads.
        #    Between inner loops, when some row's fullest lane has fewer than LOW_WATER free
        #    slots, every such row is compacted to its TOPK best (which raises its threshold).
        # the scored range in the key type (int32 when T allows: cheaper masks and packs)
        t_end_k = _as_key(t_end, T, IDX32)
        t0 = _as_key(v0, T, IDX32)
        v1_k = _as_key(v1, T, IDX32)
        while t0 < v1_k:
            space = SUBCAP - tl.max(tl.max(cnt, axis=0), axis=0)
            t_stop = tl.minimum(v1_k, t0 + space * BLOCK_N)
            for tt in range(t0, t_stop, BLOCK_N):
                keys = tt + offs_n
                key_ok = keys < t_end_k
                if USE_TMA:
                    # one bulk copy per tile (K as [batches x T, D]; rows past the copy's
                    # batch or past the tensor are masked by key_ok or zero-filled)
                    kt = K_DESC.load([b * k_desc_rows + tt, 0])
                    if UPCAST == 1:
                        kt = kt.to(tl.float32)
                elif HK == 1:
                    kt = _load_k(K, k_base, 0, tt, k_offs, key_ok, d_ok, stride_kt, stride_kh, UPCAST)
                else:
                    kt = tl.zeros([BLOCK_N, BLOCK_D], dtype=K.dtype.element_ty)
{{SCORE_CALL_LOOP}}
                # Keys come in increasing index order, so a key whose value equals the
                # threshold's loses the tie to it: keep y > thr_v, and NaN (which sorts
                # above +inf); a NaN threshold takes everything.
                take = (~(y <= thr_v[None, :])) & key_ok[:, None] & row_ok[None, :]
                cnt = _append_lanes(scr, offs_m, offs_n, cnt, _pack(y, keys[:, None]), take, CAP, BLOCK_N)
            t0 = t_stop
            if t0 < v1_k:
                cnt, thr, thr_v = _compact_full_rows(scr, lane_cnt, lane_cnt_offs, cnt, thr, thr_v, est_v, offs_m,
                                                     offs_n, TOPK, CAP, BLOCK_N, BLOCK_M, LOW_WATER, SLACK)
        # every row's lanes -> its best min(n, TOPK) keys, contiguous at [0, n)
        cnt1, thr = _compact_all_rows(scr, lane_cnt, lane_cnt_offs, cnt, thr, offs_m, TOPK, CAP, BLOCK_N, BLOCK_M)
        if PRESAMPLE > 0:
            # the check: a row with an estimate that ended with fewer than TOPK keys lost
            # keys below it; its block runs again without estimates
            retry = tl.max(((est_v == est_v) & (cnt1 < TOPK)).to(tl.int32), axis=0)
            go = retry == 0
        else:
            go = True
        if go:
            # 2. the hidden tiles, as fillers; 3. per row: compact, sort, write
            cnt1, thr = _fill_tiles({{FILL_V}}, {{FILL_HI}}, v0, v1, t_end, row_ok, cnt1, thr, scr, scr_cols, offs_m,
                                    offs_n, TOPK, CAP, BLOCK_M, BLOCK_N)
            _emit_rows(scr, cnt1, mb, b64, S, offs_m, OUT_IDX, OUT_VAL, TOPK, TOPK_P2, CAP, SORT, RETURN_VALUES,
                       SORT_R, BLOCK_M)
        if PRESAMPLE > 0:
            if retry == 0:
                j = tl.atomic_add(COUNTER, 1)
            else:
                tl.atomic_add(redo_cnt, 1)  # the same block again, without estimates
        else:
            j = tl.atomic_add(COUNTER, 1)
'''
