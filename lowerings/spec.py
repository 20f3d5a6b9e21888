"""The score description: what a rewritten selection computes, as data.

A ``ScoreSpec`` is the contract between the matcher (``hyscale_compile.passes``),
which extracts it from a graph, and the op (``hyscale_compile.lowerings``), whose
CPU path interprets it and whose Triton path is generated from it. It travels
inside the graph as the op's ``spec`` string argument, so golden graphs show it.

Canonical operands (all views of what the graph already had; strides are free):

    q      [B, S, H, D]   queries, one row per (b, s), H indexer heads
    k      [B, T, Hk, D]  keys; Hk == 1 (MQA, DSA) or Hk == H / G (GQA)
    w      [B, S, H]      per-head weights, only for ``reduce == "weighted_sum"`` (weights
                          shared across rows come as a stride-0 expand)
    masks  list of tensors referenced by ``MaskTerm.operand`` / ``lo`` / ``hi``

The score of key t for row (b, s) is, step by step and in this order:

    x_h   = sum_d q[b,s,h,d] * k[b,t,h//G,d]        fp32 accumulation
    x_h   = round(x_h, logit_dtype)                  when the contraction ran in bf16/fp16
    x_h   = epilogue(x_h)                            per head: mul / relu / round ...
    y     = reduce_h(x_h)                            weighted_sum | sum | none (H == 1)
    y     = post(y)                                  mul / add / round / mask terms, in order
    idx   = top-k of y over t, ties to the smaller t, masked slots as the graph gives them

Every ``round`` step rounds an fp32 value to the named dtype and back, which
reproduces a graph that computed that step in bf16/fp16 (docs/contract.md, dtype rule 2).
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import List, Optional, Sequence

import torch

SPEC_VERSION = 1

_FLOAT_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
_DTYPE_NAMES = {v: k for k, v in _FLOAT_DTYPES.items()}

# max(x, 0) written as clamp_min(x, 0) or maximum(x, 0): the same values, but autograd
# passes the gradient at x == 0 (clamp_min: all of it, maximum: half), relu does not.
RELU_SPELLINGS = ("clamp_min", "maximum")

# Elementwise steps allowed in ``epilogue`` and ``post``: name -> number of scalar args.
ELEMENTWISE_OPS = {
    "mul": 1,  # x * c
    "add": 1,  # x + c
    "div": 1,  # x / c (kept apart from mul: x / c != x * (1 / c) in floating point)
    "relu": 0,  # max(x, 0); ("relu", "clamp_min"|"maximum") when the graph spelled it so
    "round": 1,  # round to dtype name and back to fp32
    "neg": 0,
    "sigmoid": 0,
    # x * operands[j] / x / operands[j]: a 0-d tensor the graph computes at run time (a scale
    # that depends on a dynamic shape). ``resolve_operands`` turns them into constants
    # before the op computes, so implementations only ever see mul/div.
    "mul_operand": 1,
    "div_operand": 1,
    # a registered score mod (``mods.py``, ``hyscale_compile.register_score_mod``): its key
    # ``name@digest`` (what the matcher writes) or, in a spec written by hand, its name
    "mod": 1,
}
REDUCTIONS = ("weighted_sum", "sum", "none")
# (the mask kinds: ``mask_kinds.KINDS``, one class each)


class SpecError(ValueError):
    """A score description that is malformed or that the op cannot honour."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise SpecError(f"unsupported score dtype {dtype}") from None


def dtype_of(name: str) -> torch.dtype:
    try:
        return _FLOAT_DTYPES[name]
    except KeyError:
        raise SpecError(f"unknown dtype name {name!r}; expected one of {sorted(_FLOAT_DTYPES)}") from None


@dataclasses.dataclass(frozen=True)
class MaskTerm:
    """One mask step, applied to the reduced score in ``post`` order. What the op does with
    a term of each kind (reference, skip rule, kernel pieces, operand checks) is that
    kind's class in ``mask_kinds``.

    kind="add":   y = y + masks[operand]                 (any float tensor, bcast to [B,S,T])
    kind="fill":  y = where(masks[operand] == where, value, y)   (bool tensor, bcast to [B,S,T])
    kind="range": key t is *hidden* unless lo[b,s] <= t < hi[b,s]; hidden keys get
                  ``value`` (mode="fill") or ``y + value`` (mode="add").  lo/hi are operand
                  indices of int64 tensors broadcastable to [B, S], or None for 0 / T.
                  Only this kind lets a kernel skip key tiles: when the hidden value is
                  -inf and no later post step can change -inf (``skippable_mask_terms``),
                  or when every hidden key provably holds one finite value
                  (``finite_range_term``: HF's ``finfo.min`` masks).
    """

    kind: str
    operand: Optional[int] = None
    where: bool = True
    value: float = -math.inf
    lo: Optional[int] = None
    hi: Optional[int] = None
    mode: str = "fill"

    def to_json(self):
        return _kind(self).to_json()

    @staticmethod
    def from_json(d) -> "MaskTerm":
        return MaskTerm(**d)

    @property
    def operands(self) -> tuple:
        return tuple(i for i in (self.operand, self.lo, self.hi) if i is not None)


@dataclasses.dataclass(frozen=True)
class ScoreSpec:
    """See the module docstring. ``name`` is the variant that produced it (for diagnostics)."""

    name: str = "dsa"
    logit_dtype: str = "float32"
    epilogue: tuple = ()
    reduce: str = "weighted_sum"
    post: tuple = ()  # elementwise steps and ("mask", i) steps, i indexing ``masks``
    masks: tuple = ()  # MaskTerm
    score_dtype: str = "float32"
    # Dot precision for fp32 operands: "ieee" or "tf32" (docs/contract.md, dtype rule 3).
    fp32_precision: str = "ieee"

    # -- serialization -------------------------------------------------------------------
    def to_json(self) -> str:
        d = {
            "v": SPEC_VERSION,
            "name": self.name,
            "logit_dtype": self.logit_dtype,
            "epilogue": [list(s) for s in self.epilogue],
            "reduce": self.reduce,
            "post": [list(s) for s in self.post],
            "masks": [m.to_json() for m in self.masks],
            "score_dtype": self.score_dtype,
            "fp32_precision": self.fp32_precision,
        }
        return json.dumps(d, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "ScoreSpec":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(f"spec is not valid JSON: {e}") from None
        if d.pop("v", None) != SPEC_VERSION:
            raise SpecError(f"spec version mismatch (expected {SPEC_VERSION}): {text[:80]}")
        spec = ScoreSpec(
            name=d["name"],
            logit_dtype=d["logit_dtype"],
            epilogue=tuple(tuple(s) for s in d["epilogue"]),
            reduce=d["reduce"],
            post=tuple(tuple(s) for s in d["post"]),
            masks=tuple(MaskTerm.from_json(m) for m in d["masks"]),
            score_dtype=d["score_dtype"],
            fp32_precision=d.get("fp32_precision", "ieee"),
        )
        spec.validate()
        return spec

    # -- validation ----------------------------------------------------------------------
    def validate(self, num_mask_operands: Optional[int] = None) -> "ScoreSpec":
        dtype_of(self.logit_dtype)
        dtype_of(self.score_dtype)
        if self.reduce not in REDUCTIONS:
            raise SpecError(f"reduce={self.reduce!r}; expected one of {REDUCTIONS}")
        if self.fp32_precision not in ("ieee", "tf32"):
            raise SpecError(f"fp32_precision={self.fp32_precision!r}; expected 'ieee' or 'tf32'")
        for where, steps in (("epilogue", self.epilogue), ("post", self.post)):
            for step in steps:
                if not step:
                    raise SpecError(f"empty step in {where}")
                op, args = step[0], step[1:]
                if op == "mask" and where == "post":
                    if len(args) != 1 or not (0 <= args[0] < len(self.masks)):
                        raise SpecError(f"post step {step!r} names no mask term")
                    continue
                if op not in ELEMENTWISE_OPS:
                    raise SpecError(f"unknown {where} step {op!r}; known: {sorted(ELEMENTWISE_OPS)}")
                if op == "relu" and len(args) == 1:
                    # the same forward; which op the graph spelled decides the derivative at 0
                    if args[0] not in RELU_SPELLINGS:
                        raise SpecError(f"{where} step {step!r}: relu spelling must be one of {RELU_SPELLINGS}")
                    continue
                if len(args) != ELEMENTWISE_OPS[op]:
                    raise SpecError(f"{where} step {step!r} takes {ELEMENTWISE_OPS[op]} argument(s)")
                if op == "round":
                    dtype_of(args[0])
                elif op == "mod":
                    from . import mods

                    if not isinstance(args[0], str):
                        raise SpecError(f"{where} step {step!r}: a score mod is named by a string")
                    mods.get(args[0])  # raises, naming the registration that is missing
                elif op in ("mul_operand", "div_operand"):
                    if not isinstance(args[0], int) or (num_mask_operands is not None and not 0 <= args[0] < num_mask_operands):
                        raise SpecError(f"{where} step {step!r} names no operand")
                elif args and not isinstance(args[0], (int, float)):
                    raise SpecError(f"{where} step {step!r}: argument must be a number")
        used = [s[1] for s in self.post if s[0] == "mask"]
        if sorted(used) != list(range(len(self.masks))):
            raise SpecError("every mask term must be applied exactly once in post")
        for m in self.masks:
            _kind(m).validate()  # (an unknown kind raises, naming the known ones)
            if num_mask_operands is not None:
                for i in m.operands:
                    if not (0 <= i < num_mask_operands):
                        raise SpecError(f"mask operand {i} out of range ({num_mask_operands} given)")
        return self

    # -- helpers -------------------------------------------------------------------------
    def resolve_operands(self, operands) -> "ScoreSpec":
        """The same spec with every ``*_operand`` step replaced by the constant its 0-d
        operand holds now (one host read per such operand)."""
        if not any(st[0].endswith("_operand") for st in tuple(self.epilogue) + tuple(self.post)):
            return self

        def fix(steps):
            out = []
            for st in steps:
                if st[0] in ("mul_operand", "div_operand"):
                    t = operands[st[1]]
                    if t.numel() != 1:
                        raise SpecError(f"step {st!r}: operand has shape {tuple(t.shape)}, expected a scalar")
                    if t.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                        raise SpecError(f"step {st!r}: its 0-d operand is read on the host at each call, which a "
                                        "CUDA graph capture cannot do (compiled with CUDA graphs, the backend "
                                        "selects such sites from the score table instead)")
                    # the graph multiplies an fp32 tensor by this scalar in fp32
                    out.append((st[0][:3], float(t.to(torch.float32).item())))
                else:
                    out.append(st)
            return tuple(out)

        return dataclasses.replace(self, epilogue=fix(self.epilogue), post=fix(self.post))

    def mask_terms_in_order(self) -> Sequence[MaskTerm]:
        return [self.masks[s[1]] for s in self.post if s[0] == "mask"]

    def skippable_ranges(self) -> Sequence[MaskTerm]:
        """Range terms whose hidden keys end up -inf whatever the score: tiles fully outside
        them can be skipped without computing anything (docs/contract.md, 'Skipping hidden
        keys': only a tile whose every key is proven hidden)."""
        return [self.masks[j] for j in skippable_mask_terms(self)]

    def describe(self) -> str:
        """One line for diagnostics: 'relu∘mul(0.125) -> weighted_sum -> +mask[0]'."""
        parts = []
        if self.logit_dtype != "float32":
            parts.append(f"logits:{self.logit_dtype}")
        parts.append(",".join(_fmt_step(s) for s in self.epilogue) or "id")
        parts.append(self.reduce)
        for s in self.post:
            if s[0] == "mask":
                m = self.masks[s[1]]
                parts.append(f"mask:{m.kind}")
            else:
                parts.append(_fmt_step(s))
        return " -> ".join(parts)


def _kind(term: MaskTerm):
    """The term's kind object (``mask_kinds``: its reference, skip rule and kernel pieces)."""
    from .mask_kinds import kind_of  # (mask_kinds imports this module)

    return kind_of(term)


def _fmt_step(step) -> str:
    op, *args = step
    if op == "mod":  # the name, without the content digest
        from .mods import name_of

        args = [name_of(args[0])]
    return f"{op}({', '.join(repr(a) for a in args)})" if args else op


def _preserves_neg_inf(step, spec: ScoreSpec) -> bool:
    """True when a post step maps -inf to -inf whatever the operands hold (finite or -inf
    additive masks, fills that write -inf)."""
    op = step[0]
    if op in ("mul", "div"):
        return step[1] > 0
    if op == "add":
        return step[1] != math.inf and not math.isnan(step[1])
    if op == "round":
        return True
    if op in ("relu", "neg", "sigmoid"):
        return False
    if op == "mod":
        from . import mods

        return mods.get(step[1]).keeps_neg_inf
    if op == "mask":
        return _kind(spec.masks[step[1]]).keeps_neg_inf()
    return False


def skippable_mask_terms(spec: ScoreSpec) -> List[int]:
    """Indices (into ``spec.masks``) of range terms that prove hidden keys score exactly -inf.

    Stricter than ``ScoreSpec.skippable_ranges``: the hidden value must be -inf *and* every
    post step after the term must keep -inf at -inf (a later ``neg``, ``relu``,
    ``sigmoid``, ``mul`` by a non-positive constant or a non -inf fill would change what a
    hidden slot holds, so a tile could not be skipped without computing it). Some of them
    hold -inf only while the operands are finite (``finite_guard``); a term whose guard no
    bound can decide is left out.
    """
    return list(_skip_terms(spec)[0])


@dataclasses.dataclass(frozen=True)
class FiniteGuard:
    """What a launch proves, per call, before it skips the hidden tiles of the -inf range
    terms ``terms`` (``finite_guard``); where the proof fails it skips none of them.

    bounds:  post-step tuples: every score is finite before a term that adds its -inf
             (``score_bound.score_bound_flag(post_steps=...)``: the operands finite and no
             step overflowing).
    tensors: operand indices of additive mask tensors applied after such a term: each must
             hold no NaN and no +inf (-inf + either is NaN).
    """

    terms: tuple
    bounds: tuple
    tensors: tuple


def finite_guard(spec: ScoreSpec) -> Optional[FiniteGuard]:
    """The checks that skipping the spec's -inf range terms waits for, or None when their
    hidden keys are -inf whatever the operands hold.

    A hidden key of a term with mode "fill" (masked_fill / where: the value overwrites the
    score) is -inf; with mode "add" (``s + full(-inf).triu(1)``, the additive form) it is the
    value of the arithmetic, s + (-inf), which is NaN where s is NaN or +inf (a NaN or inf
    operand, inf * 0, inf - inf, an overflow), and torch.topk ranks NaN, of either sign,
    above every other score: eager selects that key. Either way a later additive mask
    tensor adds its own value to the -inf. So the launch proves the scores before each
    "add" term finite and the later tensors free of NaN and +inf, on the device.
    """
    return _skip_terms(spec)[1]


def _skip_terms(spec: ScoreSpec) -> tuple:
    """(skippable -inf range terms, their ``FiniteGuard`` or None). (Not cached: a mod's
    ``keeps_neg_inf`` may change when it is registered again.)"""
    neg_inf = _neg_inf_terms(spec)
    terms, guarded, bounds, tensors = [], [], [], set()
    for pos, step in enumerate(spec.post):
        if step[0] != "mask" or step[1] not in neg_inf:
            continue
        j = step[1]
        later = [i for s in spec.post[pos + 1:] if s[0] == "mask" for i in _kind(spec.masks[s[1]]).added_operands()]
        adds = _kind(spec.masks[j]).adds_to_score
        if adds:
            steps = _bounded_steps_before(spec, pos, neg_inf)
            if steps is None:
                continue  # nothing bounds the scores it adds -inf to: its tiles are scored
            bounds.append(steps)
        terms.append(j)
        if adds or later:
            guarded.append(j)
            tensors.update(later)
    guard = FiniteGuard(tuple(guarded), tuple(dict.fromkeys(bounds)), tuple(sorted(tensors))) if guarded else None
    return tuple(terms), guard


def _bounded_steps_before(spec: ScoreSpec, pos: int, neg_inf) -> Optional[tuple]:
    """The post steps before position ``pos`` for a bound on the scores there, or None when
    a step's effect on the bound is unknown (a registered mod, a mask tensor, a finite
    range term), or the epilogue has one. Earlier -inf range terms (``neg_inf``) and ranges
    that hide nothing are left out: they keep a score or make it -inf, which every step
    after them keeps."""
    if any(s[0] not in _BOUNDED_STEPS for s in spec.epilogue):
        return None
    out = []
    for s in spec.post[:pos]:
        if s[0] == "mask":
            if s[1] in neg_inf or _kind(spec.masks[s[1]]).hides_nothing():
                continue
            return None
        if s[0] not in _BOUNDED_STEPS:
            return None
        out.append(tuple(s))
    return tuple(out)


def _neg_inf_terms(spec: ScoreSpec) -> List[int]:
    """Terms hiding keys by position with -inf (``MaskKind.skips_neg_inf``: range terms)
    with every later post step keeping -inf."""
    out = []
    for pos, step in enumerate(spec.post):
        if step[0] != "mask" or not _kind(spec.masks[step[1]]).skips_neg_inf():
            continue
        if all(_preserves_neg_inf(s, spec) for s in spec.post[pos + 1:]):
            out.append(step[1])
    return out


# epilogue / post steps whose effect on a bound of |x| is known (``finite_range_term``;
# the launch's ``hidden_value_flag`` applies them)
_BOUNDED_STEPS = ("mul", "div", "add", "relu", "neg", "sigmoid", "round")


def _sole_last_mask(spec: ScoreSpec) -> Optional[int]:
    """The mask index of the spec's last post step when it is the only mask step and the
    scores are fp32 (what hidden-tile skipping by a finite value or a mask tensor needs)."""
    mask_steps = [i for i, s in enumerate(spec.post) if s[0] == "mask"]
    if spec.score_dtype != "float32" or mask_steps != [len(spec.post) - 1]:
        return None
    return spec.post[-1][1]


def finite_range_term(spec: ScoreSpec) -> Optional[tuple]:
    """(j, v, limit) for a range term ``spec.masks[j]`` whose hidden keys hold one finite
    value v below every visible score, once the launch has checked that every score's
    magnitude is below ``limit`` (``triton_hytopk.hidden_value_flag``); a kernel may then
    skip their tiles as it skips -inf ones (fillers of value v where a row needs them).
    Else None.

    The term must be the spec's only mask step and its last post step, with fp32 scores,
    and every epilogue and earlier post step one whose effect on the bound is known (no
    registered mods), and v < 0. mode "fill": hidden keys are v, below every visible score
    while |s| < |v| / 2 (half: slack for the bound's rounding). mode "add": a hidden key is
    fl(s + v), which is v (and below every visible s) only while |s| < ``add_limit(v)``.
    """
    return _finite_range_term(spec, skippable_mask_terms(spec))


def _finite_range_term(spec: ScoreSpec, skippable) -> Optional[tuple]:
    """``finite_range_term``, given the spec's ``skippable_mask_terms``."""
    j = _sole_last_mask(spec)
    if j is None or skippable:
        return None
    skip = _kind(spec.masks[j]).finite_skip()  # (v, limit), v < 0 finite, or None
    if skip is None:
        return None
    if any(s[0] not in _BOUNDED_STEPS for s in (*spec.epilogue, *spec.post[:-1])):
        return None
    return (j, *skip)


def add_limit(v: float) -> float:
    """A bound L such that fl32(s + v) == v for every fp32 s with |s| < L: a quarter of the
    fp32 spacing just below |v| (the smaller of the two spacings around v)."""
    import numpy as np

    a = np.float32(abs(v))
    return float(a - np.nextafter(a, np.float32(0))) / 4


def tensor_mask_term(spec: ScoreSpec) -> Optional[tuple]:
    """(j, needs_bound) for a mask *tensor* term ``spec.masks[j]`` (kind "add" or "fill")
    whose rows a launch may reduce to a visible key range, so that a kernel can skip the
    keys outside it (``triton_mask_ranges.mask_key_ranges``), or None.

    Same shape rules as ``finite_range_term`` (the spec's only mask step and its last post
    step, fp32 scores, no range term). "fill" with -inf: keys outside a row's range are
    -inf. "fill" with a finite v < 0: they are v, below every visible score once a bound on
    |s| (``needs_bound``) says |s| < |v| / 2. "add": they hold fl(s + v_h), v_h being the
    tensor's smallest value, which is v_h (and below every visible score) only while |s| <
    ``add_limit(v_h)``.
    """
    j = _sole_last_mask(spec)
    if j is None or any(_kind(t).positional for t in spec.masks):
        return None
    needs_bound = _kind(spec.masks[j]).table_ranges()
    if needs_bound is None:
        return None
    if needs_bound and any(s[0] not in _BOUNDED_STEPS for s in (*spec.epilogue, *spec.post[:-1])):
        return None
    return j, needs_bound


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """What a kernel and its launch need to know of a spec's masks, derived once per call
    (``kernel_plan``) and handed to the code generator, the launch, the score bound and the
    reference, so that none of them asks the spec again.

    skippable:    -inf range terms whose hidden tiles may be skipped (``skippable_mask_terms``)
    guard:        what skipping some of them waits for per call, or None (``finite_guard``)
    finite_range: (j, v, limit) of a range term hiding one finite value v (``finite_range_term``)
    tensor_mask:  (j, needs_bound) of a mask tensor reduced to row ranges (``tensor_mask_term``)
    """

    skippable: tuple
    guard: Optional[FiniteGuard]
    finite_range: Optional[tuple]
    tensor_mask: Optional[tuple]

    @property
    def skip_flag(self) -> bool:
        """Whether the kernel reads a per-call verdict (SKIPF) before it skips range tiles:
        the bound behind ``finite_range``, or ``guard``'s checks (never both)."""
        return self.finite_range is not None or self.guard is not None

    def guarded(self, j: int) -> bool:
        """Whether skipping term j's tiles waits for ``guard``'s checks."""
        return self.guard is not None and j in self.guard.terms


def kernel_plan(spec: ScoreSpec) -> KernelPlan:
    """The spec's ``KernelPlan``. (Not cached across calls: a mod's ``keeps_neg_inf`` may
    change when it is registered again.)"""
    terms, guard = _skip_terms(spec)
    return KernelPlan(tuple(terms), guard, _finite_range_term(spec, terms), tensor_mask_term(spec))


def tile_skipping(spec: ScoreSpec) -> str:
    """How a kernel for ``spec`` treats key tiles a mask hides (for the diagnostics)."""
    if finite_guard(spec) is not None:
        return "hidden key tiles skipped once the launch proves the operands that reach them finite (per call)"
    if skippable_mask_terms(spec):
        return "hidden key tiles skipped"
    if finite_range_term(spec) is not None:
        return "hidden key tiles skipped while a per-call bound on the scores holds"
    if tensor_mask_term(spec) is not None:
        return "key tiles outside each row's visible range skipped (read off the mask tensor per call)"
    if spec.masks:
        return "every key tile scored: the mask cannot prove a tile hidden"
    return ""
