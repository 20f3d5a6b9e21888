"""Mask kinds: each ``MaskTerm`` kind as one class that carries everything the op does with it.

A ``MaskTerm`` (``spec.py``) is data; its kind's class here is what every consumer of a
term asks instead of branching on ``term.kind``. One instance per (term index j, term),
made by ``kind_of`` / ``mask_kinds``, answers:

- its operands: which it reads, the shape each must broadcast to and its dtype rule
  (``check_mask_operands``, shared by the selection's and the attention's checks);
- its reference piece: the term applied to fp32 scores of a block of rows, at dense key
  positions [t0, t1) or at gathered key indices ``keys=`` (``reference``: the selection's
  CPU path and oracle, the sparse backward and the attention reference all call it);
- its skip rule: whether it keeps -inf at -inf, hides keys by position with -inf or one
  finite value, or reduces to per-row key ranges read off its tensor (``spec.kernel_plan``
  combines these into a ``KernelPlan``);
- its kernel pieces, for two kernel families: the tile kernels over keys x rows
  (``args``, ``row_loads``, ``apply_lines``, ...: the HyTopK kernel, ``triton_codegen``) and
  the kernels over one row's gathered slots (``slot_params``, ``slot_row_loads``,
  ``slot_lines``: the sparse attention, ``triton_attention``). Each takes the consumer's
  index expressions, so a further kernel family asks a term for its lines rather than
  re-deriving them;
- its launch arguments: broadcast views of its operands, in the order ``args`` declares
  them (``mask_launch_args``, called by both launchers).

So a new kind is one class registered in ``KINDS`` (plus the matcher that emits it and a
golden test; docs/architecture.md, "Adding a mask form"). Why one object per kind: the
next kernel family that consumes the selection reads its masks through this interface,
and a kind whose rules live in one place cannot drift between the reference, the skip
rules and the kernels.
"""
from __future__ import annotations

import abc
import math
from typing import Dict, List, Optional, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .spec import MaskTerm, SpecError, add_limit

# additive mask dtypes a kernel loads and upcasts exactly to fp32
_FLOAT_TABLES = (torch.float32, torch.bfloat16, torch.float16)


def triton_literal(v) -> str:
    """A float literal Triton understands (inf/nan are spelled through float())."""
    v = float(v)
    if math.isnan(v):
        return 'float("nan")'
    if math.isinf(v):
        return 'float("inf")' if v > 0 else '(-float("inf"))'
    return repr(v)


def row_load(var: str, ptr: str, stride: str, other: str) -> str:
    """``var`` = the block's rows of a per-row [B, S] operand ``ptr`` (strides
    ``{stride}_b``, ``{stride}_s``), int64, ``other`` for padding rows."""
    return (f"{var} = tl.load({ptr} + b64 * {stride}_b + rows64 * {stride}_s, "
            f"mask=row_ok, other={other}).to(tl.int64)")


def broadcasts(shape, target) -> bool:
    """``shape`` broadcasts to ``target``: on symbolic sizes only where the shape environment
    proves it for every size (no guard is added)."""
    if len(shape) > len(target):
        return False
    return all(statically_known_true(s == 1) or statically_known_true(s == t)
               for s, t in zip(reversed(tuple(shape)), reversed(tuple(target))))


def bcast_rows(t: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """A per-row operand (broadcastable to [B, S]) as [B, S, 1]."""
    return torch.broadcast_to(t, (B, S)).unsqueeze(-1)


def row_view(t: torch.Tensor, B: int, S: int, what: str) -> torch.Tensor:
    try:
        return torch.broadcast_to(t, (B, S))
    except RuntimeError:
        raise SpecError(f"{what} of shape {tuple(t.shape)} does not broadcast to [B, S] = {(B, S)}") from None


def table_view(t: torch.Tensor, B: int, S: int, T: int, what: str) -> torch.Tensor:
    try:
        return torch.broadcast_to(t, (B, S, T))
    except RuntimeError:
        raise SpecError(f"{what} of shape {tuple(t.shape)} does not broadcast to [B, S, T] = {(B, S, T)}") from None


class MaskKind(abc.ABC):
    """One mask term ``term`` (``spec.masks[j]``) of the kind ``name``; see the module docstring.
    The defaults are those of a term that cannot prove anything about hidden keys."""

    name: str = ""
    # the MaskTerm fields its JSON carries, in order (the spec's JSON names the kernel file)
    json_fields: tuple = ()
    # hides keys by their position, with per-row bounds (its tiles are skipped through
    # them, so no mask tensor of the spec is reduced to key ranges besides)
    positional: bool = False

    def __init__(self, j: int, term: MaskTerm):
        self.j, self.term = j, term

    # -- the term as data ----------------------------------------------------------------
    def to_json(self) -> dict:
        return {"kind": self.name, **{f: getattr(self.term, f) for f in self.json_fields}}

    def validate(self) -> None:
        """Raises ``SpecError`` when the term is malformed for its kind."""

    @abc.abstractmethod
    def operand_roles(self) -> List[tuple]:
        """(operand index, what it is) for each operand the term reads."""

    target_text = ""  # what each operand broadcasts to, for the messages

    @abc.abstractmethod
    def target(self, B: int, S: int, T: int) -> tuple:
        """The shape each of its operands must broadcast to."""

    @abc.abstractmethod
    def dtype_problem(self, t: torch.Tensor) -> Optional[str]:
        """What is wrong with operand ``t``'s dtype for this term ('expected ...'), or None."""

    operand_word = "operand"  # how the messages name one of its operands

    # -- the reference piece -------------------------------------------------------------
    @abc.abstractmethod
    def reference(self, y, masks, b0, b1, s0, s1, t0, t1, B, S, T, keys=None) -> torch.Tensor:
        """y: [b1-b0, s1-s0, n] fp32 scores of keys [t0, t1), or of the key indices ``keys``
        ([b1-b0, s1-s0, n] int64, or [1, n, K] under a leading head dim of y) when given;
        returns y with the term applied, as the graph computes it."""

    # -- the skip rule -------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def adds_to_score(self) -> bool:
        """Whether the term adds to the score (s + m) rather than overwriting hidden keys."""

    @abc.abstractmethod
    def keeps_neg_inf(self) -> bool:
        """Whether applying the term maps a -inf score to -inf whatever its operands hold."""

    def hides_nothing(self) -> bool:
        """Whether the term provably changes no score (a range with neither bound)."""
        return False

    def skips_neg_inf(self) -> bool:
        """Whether it hides keys by position with -inf: tiles outside every row's visible
        range may be skipped, if every later step keeps -inf (``spec.skippable_mask_terms``)."""
        return False

    def finite_skip(self) -> Optional[tuple]:
        """(v, limit): it hides keys by position with one finite value v below every visible
        score while every |score| < limit (``spec.finite_range_term``), or None."""
        return None

    def table_ranges(self) -> Optional[bool]:
        """For a mask tensor that a launch may reduce to per-row visible key ranges
        (``triton_mask_ranges``): whether skipping outside them needs a bound on the scores;
        None when it cannot be reduced so."""
        return None

    def added_operands(self) -> tuple:
        """Operands whose values it adds to the score (a NaN or +inf there turns -inf into NaN)."""
        return ()

    def hides_block(self, masks, b0, b1, s0, s1, t0, t1, B, S) -> bool:
        """Whether its operands prove that it hides every key of [t0, t1) for every row of
        the block (the reference's chunk skip; only asked of a term of ``skips_neg_inf``)."""
        return False

    # -- kernel pieces: a tile over keys x rows (HyTopK) -------------------------------------
    @abc.abstractmethod
    def args(self) -> List[str]:
        """Its kernel arguments: a pointer and strides per operand."""

    def tile_args(self) -> List[str]:
        """The subset of ``args`` the score tile reads itself."""
        return []

    def row_loads(self) -> List[str]:
        """Lines loading its per-row values once per row block."""
        return []

    def row_values(self) -> List[str]:
        """The names ``row_loads`` defines, which the score tile takes."""
        return []

    def bound_vars(self) -> tuple:
        """(lo, hi) variable names of its per-row key bounds (None where it has none)."""
        return None, None

    def key_clamp_lines(self) -> List[str]:
        """Lines clamping its per-row bounds to [0, T] in the key type."""
        return []

    @abc.abstractmethod
    def apply_lines(self, keys: str = "keys[:, None]", per_row: str = "[None, :]", ok: str = "ok",
                    neutral_run: bool = False) -> List[str]:
        """Lines applying the term to ``y`` at key positions ``keys``, a per-row value
        broadcasting as ``{value}{per_row}``, loads masked by ``ok``."""

    # -- kernel pieces: one row's gathered slots, broadcast over heads (sparse attention) --------
    def slot_params(self) -> List[str]:
        """The names a slot function takes for the term: tensors' pointers and strides, the
        row's loaded bounds."""
        return self.tile_args() + self.row_values()

    def slot_row_loads(self) -> List[str]:
        """Lines loading the row's (b, s) per-row values (int64 scalars)."""
        return []

    @abc.abstractmethod
    def slot_lines(self, keys: str = "t", ok: str = "slot_ok") -> List[str]:
        """Lines applying the term to ``y`` [heads, slots] at the slots' keys ``keys`` [slots]."""

    def slot_grad_lines(self, keys: str = "t", ok: str = "slot_ok") -> List[str]:
        """Lines taking the gradient ``g`` [heads, slots] of the term's output back to its
        input (the sparse attention's backward): an addition passes it, a fill passes nothing
        to the slots it overwrites."""
        return []

    # -- launch --------------------------------------------------------------------------
    @abc.abstractmethod
    def launch_args(self, masks, B, S, T, device, rows=slice(None), float_adds: bool = False) -> list:
        """Tensors and strides in ``args``' order, for query rows ``rows``: broadcast views,
        never copies. ``float_adds``: the kernel loads only fp32/bf16/fp16 additive masks."""


class TableMask(MaskKind):
    """A [B, S, T] mask tensor read per (row, key): kinds "add" and "fill"."""

    target_text = "[B, S, T]"

    def validate(self) -> None:
        if self.term.operand is None:
            raise SpecError(f"{self.name} mask needs an operand")

    def target(self, B, S, T) -> tuple:
        return (B, S, T)

    def reference(self, y, masks, b0, b1, s0, s1, t0, t1, B, S, T, keys=None):
        m = torch.broadcast_to(masks[self.term.operand], (B, S, T))[b0:b1, s0:s1]
        m = m[..., t0:t1] if keys is None else m.gather(-1, keys)
        return self.reference_apply(y, m)

    @abc.abstractmethod
    def reference_apply(self, y, m):
        """y with the term applied, given its tensor's values ``m`` at y's keys."""

    def args(self) -> List[str]:
        j = self.j
        return [f"M{j}", f"stride_m{j}_b", f"stride_m{j}_s", f"stride_m{j}_t"]

    def tile_args(self) -> List[str]:
        return self.args()  # read inside the score tile

    # the load's "other" where the kernel does not read the tensor: the neutral value
    neutral = "0"

    def apply_lines(self, keys: str = "keys[:, None]", per_row: str = "[None, :]", ok: str = "ok",
                    neutral_run: bool = False) -> List[str]:
        """``neutral_run``: the row block's first run of neutral keys [mlo, mhi)
        (triton_mask_ranges) is not read, where it changes nothing."""
        j = self.j
        lines, load_ok, other = [], ok, "0"
        if neutral_run:
            # not read on the row's first neutral run, where it would change nothing:
            # the load's "other" is the neutral value (an additive 0, a fill's visible side)
            lines.append(f"mread{j} = {ok} & (({keys} < mlo{j}) | ({keys} >= mhi{j}))")
            load_ok, other = f"mread{j}", self.neutral
        lines.append(
            f"m{j} = tl.load(M{j} + (b64 * stride_m{j}_b + rows64{per_row} * stride_m{j}_s "
            f"+ {keys}.to(tl.int64) * stride_m{j}_t), mask={load_ok}, other={other})"
        )
        return lines + [self.tile_apply_line()]

    @abc.abstractmethod
    def tile_apply_line(self) -> str:
        """The line applying the loaded ``m{j}`` [keys, rows] to ``y``."""

    def slot_lines(self, keys: str = "t", ok: str = "slot_ok") -> List[str]:
        j = self.j
        return [f"m{j} = tl.load(M{j} + b * stride_m{j}_b + s * stride_m{j}_s + {keys} * stride_m{j}_t, "
                f"mask={ok}, other=0)", self.slot_apply_line()]

    @abc.abstractmethod
    def slot_apply_line(self) -> str:
        """The line applying the loaded ``m{j}`` [slots] to ``y`` [heads, slots]."""

    def launch_args(self, masks, B, S, T, device, rows=slice(None), float_adds: bool = False) -> list:
        i = self.term.operand
        m = masks[i]
        if m.device != device:
            raise SpecError(f"mask operand {i} is on {m.device}, expected {device}")
        self.check_kernel_dtype(m, float_adds)
        v = table_view(m, B, S, T, f"mask operand {i}")[:, rows]
        if v.dtype == torch.bool:
            v = v.view(torch.uint8)  # same bytes; Triton's i1 pointers are awkward
        return [v, v.stride(0), v.stride(1), v.stride(2)]

    @abc.abstractmethod
    def check_kernel_dtype(self, m: torch.Tensor, float_adds: bool) -> None:
        """Raises where the kernel cannot load ``m`` as this term's tensor."""


class AddMask(TableMask):
    """kind="add": y = y + masks[operand] (any real tensor broadcasting to [B, S, T])."""

    name = "add"
    json_fields = ("operand",)

    def operand_roles(self):
        return [(self.term.operand, "an additive mask")]

    def dtype_problem(self, t):
        if t.dtype == torch.bool or t.is_complex():
            return "expected a real, non-bool dtype"
        return None

    def reference_apply(self, y, m):
        return y + m  # promotes like the graph's add: fp32 + bf16 -> fp32 (exact upcast)

    @property
    def adds_to_score(self) -> bool:
        return True

    def keeps_neg_inf(self) -> bool:
        return True  # -inf + finite (or -inf) stays -inf

    def table_ranges(self) -> Optional[bool]:
        # hidden keys hold fl(s + v_h), v_h the tensor's smallest value: v_h only under a bound
        return True

    def added_operands(self) -> tuple:
        return (self.term.operand,)

    def tile_apply_line(self) -> str:
        return f"y = y + m{self.j}.to(tl.float32)  # fp32 + bf16/fp16 mask: exact upcast, as torch promotes"

    def slot_apply_line(self) -> str:
        return f"y = y + m{self.j}.to(tl.float32)[None, :]  # fp32 + a 16-bit mask: exact upcast, as torch"

    def check_kernel_dtype(self, m, float_adds):
        i = self.term.operand
        if float_adds and m.dtype not in _FLOAT_TABLES:
            raise SpecError(f"additive mask operand {i} has dtype {m.dtype}; the kernel adds "
                            "fp32, bf16 or fp16 masks to its fp32 scores")
        if m.dtype == torch.float64:
            raise SpecError(f"additive mask operand {i} is float64: the Triton kernel scores in fp32 "
                            "(the graph would have promoted the scores to float64)")
        if m.dtype == torch.bool or m.is_complex():
            raise SpecError(f"additive mask operand {i} has dtype {m.dtype}")


class FillMask(TableMask):
    """kind="fill": y = where(masks[operand] == where, value, y) (a bool tensor broadcasting
    to [B, S, T])."""

    name = "fill"
    json_fields = ("operand", "where", "value")

    @property
    def neutral(self) -> str:
        return "0" if self.term.where else "1"

    def operand_roles(self):
        return [(self.term.operand, "a fill mask")]

    def dtype_problem(self, t):
        return None if t.dtype == torch.bool else "expected bool"

    def reference_apply(self, y, m):
        return y.masked_fill(m == self.term.where, self.term.value)

    @property
    def adds_to_score(self) -> bool:
        return False

    def keeps_neg_inf(self) -> bool:
        return self.term.value == -math.inf

    def table_ranges(self) -> Optional[bool]:
        v = self.term.value
        if v == -math.inf:
            return False  # keys outside a row's range are -inf
        # a finite v < 0: below every visible score while |s| < |v| / 2
        return True if math.isfinite(v) and v < 0 else None

    def _cond(self) -> str:
        return f"m{self.j} != 0" if self.term.where else f"m{self.j} == 0"

    def tile_apply_line(self) -> str:
        return f"y = tl.where({self._cond()}, {triton_literal(self.term.value)}, y)"

    def slot_apply_line(self) -> str:
        return f"y = tl.where(({self._cond()})[None, :], {triton_literal(self.term.value)}, y)"

    def slot_grad_lines(self, keys: str = "t", ok: str = "slot_ok") -> List[str]:
        load = TableMask.slot_lines(self, keys, ok)[0]  # the forward's load of m{j} at the slots
        return [load, f"g = tl.where(({self._cond()})[None, :], 0.0, g)"]

    def check_kernel_dtype(self, m, float_adds):
        if m.dtype != torch.bool:
            raise SpecError(f"fill mask operand {self.term.operand} must be bool, got {m.dtype}")


class RangeMask(MaskKind):
    """kind="range": key t is hidden unless lo[b, s] <= t < hi[b, s] (int tensors broadcasting
    to [B, S]; None for 0 / T); hidden keys get ``value`` (mode "fill") or ``y + value``
    (mode "add"). Bounds are loaded once per row block and compared with key positions."""

    name = "range"
    json_fields = ("lo", "hi", "mode", "value")
    positional = True
    target_text = "[B, S]"
    operand_word = "bound operand"

    def validate(self) -> None:
        if self.term.mode not in ("fill", "add"):
            raise SpecError(f"range mask mode {self.term.mode!r}")

    def operand_roles(self):
        return [(i, f"the range term's {role} bound") for role, i in (("lo", self.term.lo), ("hi", self.term.hi))
                if i is not None]

    def target(self, B, S, T) -> tuple:
        return (B, S)

    def dtype_problem(self, t):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            return "expected an integer dtype"
        return None

    def _hidden(self, y, t, masks, b0, b1, s0, s1, B, S):
        hidden = torch.zeros(y.shape, dtype=torch.bool, device=y.device)
        if self.term.lo is not None:
            hidden |= t < bcast_rows(masks[self.term.lo], B, S)[b0:b1, s0:s1]
        if self.term.hi is not None:
            hidden |= t >= bcast_rows(masks[self.term.hi], B, S)[b0:b1, s0:s1]
        return hidden

    def reference(self, y, masks, b0, b1, s0, s1, t0, t1, B, S, T, keys=None):
        t = torch.arange(t0, t1, device=y.device) if keys is None else keys
        hidden = self._hidden(y, t, masks, b0, b1, s0, s1, B, S)
        if self.term.mode == "fill":
            return y.masked_fill(hidden, self.term.value)
        return y + torch.where(hidden, self.term.value, 0.0)

    @property
    def adds_to_score(self) -> bool:
        return self.term.mode == "add"

    def keeps_neg_inf(self) -> bool:
        v = self.term.value
        if self.term.mode == "fill":
            return v == -math.inf
        return v != math.inf and not math.isnan(v)

    def hides_nothing(self) -> bool:
        return self.term.lo is None and self.term.hi is None

    def skips_neg_inf(self) -> bool:
        return self.term.value == -math.inf and not self.hides_nothing()

    def finite_skip(self) -> Optional[tuple]:
        v = self.term.value
        # (hidden keys must lie below every visible score: past a row's range they are
        # offered only as fillers, the smallest indices first)
        if not math.isfinite(v) or self.hides_nothing() or v >= 0:
            return None
        v = float(v)
        return (v, -v / 2) if self.term.mode == "fill" else (v, add_limit(v))

    def hides_block(self, masks, b0, b1, s0, s1, t0, t1, B, S) -> bool:
        hidden = torch.zeros((), dtype=torch.bool)
        if self.term.hi is not None:
            hidden = hidden | (bcast_rows(masks[self.term.hi], B, S)[b0:b1, s0:s1] <= t0).all()
        if self.term.lo is not None:
            hidden = hidden | (bcast_rows(masks[self.term.lo], B, S)[b0:b1, s0:s1] >= t1).all()
        return bool(hidden)

    def _bounds(self):
        return [(role, ptr, default) for role, ptr, default, bound in
                (("lo", f"LO{self.j}", "0", self.term.lo), ("hi", f"HI{self.j}", "T", self.term.hi))
                if bound is not None]

    def args(self) -> List[str]:
        j = self.j
        return [a for role, ptr, _ in self._bounds() for a in (ptr, f"stride_{role}{j}_b", f"stride_{role}{j}_s")]

    def row_loads(self) -> List[str]:
        return [row_load(f"{role}{self.j}", ptr, f"stride_{role}{self.j}", default)
                for role, ptr, default in self._bounds()]

    def row_values(self) -> List[str]:
        return [f"{role}{self.j}" for role, _, _ in self._bounds()]

    def bound_vars(self) -> tuple:
        j = self.j
        return (f"lo{j}" if self.term.lo is not None else None, f"hi{j}" if self.term.hi is not None else None)

    def key_clamp_lines(self) -> List[str]:
        return [f"{role}{self.j} = _as_key({role}{self.j}, T, IDX32)" for role, _, _ in self._bounds()]

    def _hidden_expr(self, keys: str, per_row: str) -> Optional[str]:
        j, parts = self.j, []
        if self.term.lo is not None:
            parts.append(f"({keys} < lo{j}{per_row})")
        if self.term.hi is not None:
            parts.append(f"({keys} >= hi{j}{per_row})")
        return " | ".join(parts) or None

    def apply_lines(self, keys: str = "keys[:, None]", per_row: str = "[None, :]", ok: str = "ok",
                    neutral_run: bool = False) -> List[str]:
        j, term = self.j, self.term
        hidden = self._hidden_expr(keys, per_row)
        if hidden is None:
            return []  # a range with neither bound hides nothing
        v = triton_literal(term.value)
        if term.mode == "fill":
            return [f"hidden{j} = {hidden}", f"y = tl.where(hidden{j}, {v}, y)"]
        return [f"hidden{j} = {hidden}", f"y = y + tl.where(hidden{j}, {v}, 0.0)"]

    def slot_row_loads(self) -> List[str]:
        j = self.j
        return [f"{role}{j} = tl.load({ptr} + b * stride_{role}{j}_b + s * stride_{role}{j}_s).to(tl.int64)"
                for role, ptr, _ in self._bounds()]

    def slot_lines(self, keys: str = "t", ok: str = "slot_ok") -> List[str]:
        j, term = self.j, self.term
        hidden = self._hidden_expr(keys, "")
        if hidden is None:
            return [f"# mask term {j}: a range with neither bound hides nothing"]
        v = triton_literal(term.value)
        if term.mode == "fill":
            return [f"hidden{j} = {hidden}", f"y = tl.where(hidden{j}[None, :], {v}, y)"]
        return [f"hidden{j} = {hidden}", f"y = y + tl.where(hidden{j}, {v}, 0.0)[None, :]"]

    def slot_grad_lines(self, keys: str = "t", ok: str = "slot_ok") -> List[str]:
        hidden = self._hidden_expr(keys, "")
        if self.term.mode != "fill" or hidden is None:
            return []
        return [f"g = tl.where(({hidden})[None, :], 0.0, g)"]

    def launch_args(self, masks, B, S, T, device, rows=slice(None), float_adds: bool = False) -> list:
        args = []
        for bound in (self.term.lo, self.term.hi):
            if bound is None:
                continue
            m = masks[bound]
            if m.device != device:
                raise SpecError(f"mask operand {bound} is on {m.device}, expected {device}")
            if m.dtype.is_floating_point or m.dtype == torch.bool or m.is_complex():
                raise SpecError(f"range bound operand {bound} must be an integer tensor, got {m.dtype}")
            v = row_view(m, B, S, f"range bound operand {bound}")[:, rows]
            args += [v, v.stride(0), v.stride(1)]
        return args


# every MaskTerm kind the spec accepts, by name
KINDS: Dict[str, type] = {cls.name: cls for cls in (AddMask, FillMask, RangeMask)}


def kind_of(term: MaskTerm, j: int = -1) -> MaskKind:
    """The kind object of ``term`` (``spec.masks[j]``)."""
    try:
        cls = KINDS[term.kind]
    except KeyError:
        raise SpecError(f"mask kind {term.kind!r}; expected one of {tuple(KINDS)}") from None
    return cls(j, term)


def mask_kinds(terms: Sequence[MaskTerm]) -> List[MaskKind]:
    """The kind objects of ``terms`` (a spec's ``masks``), in order."""
    return [kind_of(term, j) for j, term in enumerate(terms)]


def check_mask_operands(terms: Sequence[MaskTerm], masks, B, S, T, device=None) -> None:
    """Each operand as its term reads it: a shape that broadcasts to the term's target
    ([B, S, T] for a mask tensor, [B, S] for a range term's bounds), the kind's dtype and,
    given ``device``, that device. Reads only shapes and dtypes (the rewrite runs it on
    fake operands)."""
    kinds = mask_kinds(terms)
    for kind in kinds:
        target = kind.target(B, S, T)
        for i, what in kind.operand_roles():
            if not broadcasts(tuple(masks[i].shape), target):
                raise SpecError(f"mask operand {i} ({what}) has shape {tuple(masks[i].shape)}; it must broadcast "
                                f"to {kind.target_text} = {target}")
    for kind in kinds:
        for i, _ in kind.operand_roles():
            t, j = masks[i], kind.j
            if device is not None and t.device != device:
                raise SpecError(f"mask term {j} ({kind.name}): operand {i} is on {t.device}, q on {device}")
            problem = kind.dtype_problem(t)
            if problem is not None:
                raise SpecError(f"mask term {j} ({kind.name}): {kind.operand_word} {i} has dtype {t.dtype}; "
                                f"{problem}")


def mask_launch_args(terms: Sequence[MaskTerm], masks, B, S, T, device, rows=slice(None),
                     float_adds: bool = False) -> list:
    """Every term's ``launch_args``, in ``spec.masks`` order (the order a kernel declares
    ``args``)."""
    return [a for kind in mask_kinds(terms) for a in kind.launch_args(masks, B, S, T, device, rows, float_adds)]
