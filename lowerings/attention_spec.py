"""The attention description: what a rewritten consumer of a selection computes, as data.

An ``AttentionSpec`` is to the sparse-attention op what ``ScoreSpec`` is to the selection:
the matcher (``passes/attention.py``) extracts it from the region that applies an index
mask, and the op's CPU path interprets it and its Triton path is generated from it. It
travels in the graph as the op's ``spec`` string, so golden graphs show it.

Canonical operands (views of what the graph already had):

    q      [B, S, H, Dqk]   queries, H attention heads
    k      [B, T, Hk, Dqk]  keys; Hk == H (per head), Hk == 1 (MQA: one latent shared by
                            every head) or H % Hk == 0 (GQA)
    v      [B, T, Hk, Dv]   values (for MQA over a latent, often a view of k: k[..., :Dv])
    idx    [B, S, K]        the selected keys of each row, distinct within a row (a top-k's
                            provenance), int32 or int64, in any order; shared by the heads
    masks  the operands of the mask terms (``MaskTerm``, as in ``ScoreSpec``): tensors
           broadcastable to [B, S, T] (read only at the selected keys) or per-row bounds
           broadcastable to [B, S]

For each row (b, s), head h and slot j, with t = idx[b, s, j]:

    y[h, j] = post(sum_d q[b,s,h,d] * k[b,t,h//G,d])   fp32 accumulation; the post steps
                                                      (scale, registered mods, mask terms)
                                                      in order, masks broadcast over heads
    P[h, :] = softmax_j(y[h, :])                      fp32; a slot at -inf contributes 0
    out[b,s,h] = sum_j P[h, j] * v[b,t,h//G]          rounded once to ``out_dtype``
    lse[b,s,h] = log sum_j exp(y[h, j])               natural log, fp32; -inf for a row
                                                      whose every slot is -inf

A row whose every slot is -inf (no visible key) follows ``empty_row``: "nan" (the default:
out NaN, as a plain softmax over a row of -inf gives) or "zero" (out 0, probs 0, and no
gradient reaches its q, k or v: the safe softmax of sdpa's math path and the zero its fused
kernels give such a row). lse is -inf either way.

``empty_row="dense"`` is for an index mask that hides the unselected keys with a finite
``fill`` (finfo.min: HF V3.2 eager, GLM-5) where the pass cannot prove that every row keeps
a visible selected key. ``dense_fill = (fill, at, replaces)`` says where the original adds
the fill: an unselected key's logit is post[at + replaces:] (only "round" steps) applied to
post[:at](x) + fill (``replaces``: post[at] is the mask term the index mask is at the
selected keys, which the fill takes the place of). The op flags, per call, the (row, head)s
whose slot lse is <= fill / 2 (or -inf) and recomputes them densely over all T keys, as the
original; the exactness argument is ``attention_reference.dense_rows_forward``'s.

This equals the dense attention under the index mask (every unselected key at -inf or
``finfo.min``) whenever each row keeps at least one visible selected key: under ``-inf``
the original's hidden row is NaN too (0 under a safe softmax: ``empty_row="zero"``), under ``finfo.min`` it would average every key, so
the matcher rewrites such a site where it proves that no row is left empty, and elsewhere
with ``empty_row="dense"`` (docs/contract.md, "The selection's consumers").
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional

from .spec import MaskTerm, ScoreSpec, SpecError, dtype_of

ATTENTION_SPEC_VERSION = 1

FORMS = ("per_head", "mqa")

# what a row with no visible slot gives; the field is written only when it is not the
# default, so specs written before it existed parse (and serialize) unchanged
EMPTY_ROWS = ("nan", "zero", "dense")
# the CUDA backward's key-side reduction (``hyscale.attention_backward``): "deterministic" (a
# fixed-order segment sum, bitwise reproducible) or "atomic" (fp32 atomics, opt-in only);
# written only when not the default, as ``empty_row``
BACKWARDS = ("deterministic", "atomic")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """See the module docstring. ``name`` is the form the matcher found (diagnostics)."""

    name: str = "attention"
    post: tuple = ()  # elementwise steps and ("mask", i) steps on the per-head logit
    masks: tuple = ()  # MaskTerm
    out_dtype: str = "float32"
    # Dot precision for fp32 operands: "ieee" or "tf32" (docs/contract.md, dtype rule 3).
    fp32_precision: str = "ieee"
    empty_row: str = "nan"  # EMPTY_ROWS
    backward: str = "deterministic"  # BACKWARDS
    # empty_row="dense" only: (fill, at, replaces), see the module docstring
    dense_fill: tuple = ()

    def to_json(self) -> str:
        d = {
            "v": ATTENTION_SPEC_VERSION,
            "name": self.name,
            "post": [list(s) for s in self.post],
            "masks": [m.to_json() for m in self.masks],
            "out_dtype": self.out_dtype,
            "fp32_precision": self.fp32_precision,
        }
        if self.empty_row != "nan":
            d["empty_row"] = self.empty_row
        if self.backward != "deterministic":
            d["backward"] = self.backward
        if self.dense_fill:
            d["dense_fill"] = list(self.dense_fill)
        return json.dumps(d, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "AttentionSpec":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(f"attention spec is not valid JSON: {e}") from None
        if not isinstance(d, dict) or d.pop("v", None) != ATTENTION_SPEC_VERSION:
            raise SpecError(f"attention spec version mismatch (expected {ATTENTION_SPEC_VERSION}): {text[:80]}")
        fields = {"name", "post", "masks", "out_dtype", "fp32_precision", "empty_row", "backward", "dense_fill"}
        missing = sorted(fields - {"fp32_precision", "empty_row", "backward", "dense_fill"} - set(d))
        if missing:
            raise SpecError(f"attention spec is missing {', '.join(repr(m) for m in missing)}: {text[:80]}")
        if set(d) - fields:
            raise SpecError(f"attention spec has unknown field(s) {sorted(set(d) - fields)}: {text[:80]}")
        try:
            post = tuple(tuple(s) for s in d["post"])
        except TypeError:
            raise SpecError(f"attention spec's post must be a list of steps (lists): {d['post']!r}") from None
        masks = []
        for i, m in enumerate(d["masks"] if isinstance(d["masks"], list) else [d["masks"]]):
            try:
                masks.append(MaskTerm.from_json(m))
            except TypeError as e:
                raise SpecError(f"attention spec's mask term {i} ({m!r}) is not a MaskTerm: {e}") from None
        spec = AttentionSpec(name=d["name"], post=post, masks=tuple(masks), out_dtype=d["out_dtype"],
                             fp32_precision=d.get("fp32_precision", "ieee"), empty_row=d.get("empty_row", "nan"),
                             backward=d.get("backward", "deterministic"),
                             dense_fill=tuple(d["dense_fill"]) if isinstance(d.get("dense_fill"), list)
                             else d.get("dense_fill", ()))
        return spec.validate()

    def as_score_spec(self) -> ScoreSpec:
        """The per-head score path as a ``ScoreSpec`` with one head (``reduce="none"``): the
        selection's step and mask machinery (validation, the reference's ``finish_scores``
        and ``_apply_mask``, the kernel's step lines) applies to it unchanged."""
        return ScoreSpec(name=self.name, reduce="none", post=self.post, masks=self.masks,
                         fp32_precision=self.fp32_precision)

    def validate(self, num_mask_operands: Optional[int] = None) -> "AttentionSpec":
        dtype_of(self.out_dtype)
        if self.empty_row not in EMPTY_ROWS:
            raise SpecError(f"attention spec's empty_row is {self.empty_row!r}; expected one of {EMPTY_ROWS}")
        if self.backward not in BACKWARDS:
            raise SpecError(f"attention spec's backward is {self.backward!r}; expected one of {BACKWARDS}")
        self.as_score_spec().validate(num_mask_operands=num_mask_operands)
        self._validate_dense_fill()
        return self

    def _validate_dense_fill(self) -> None:
        f = self.dense_fill
        if self.empty_row != "dense":
            if f != ():
                raise SpecError(f"attention spec has dense_fill {f!r} but empty_row {self.empty_row!r} (only "
                                "empty_row='dense' reads it)")
            return
        if not isinstance(f, tuple) or len(f) != 3:
            raise SpecError(f"attention spec's empty_row='dense' needs dense_fill = [fill, at, replaces]; got {f!r}")
        fill, at, replaces = f
        if isinstance(fill, bool) or not isinstance(fill, (int, float)) or not math.isfinite(fill) or fill >= 0:
            raise SpecError(f"attention spec's dense_fill value {fill!r} is not a finite negative number")
        if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at <= len(self.post):
            raise SpecError(f"attention spec's dense_fill position {at!r} is not a step index in [0, "
                            f"{len(self.post)}]")
        if not isinstance(replaces, bool):
            raise SpecError(f"attention spec's dense_fill replaces flag {replaces!r} is not a bool")
        if replaces and (at == len(self.post) or self.post[at][0] != "mask"):
            raise SpecError(f"attention spec's dense_fill replaces step {at}, which is not a mask step")
        after = self.post[at + replaces:]
        if any(st[0] != "round" for st in after):
            raise SpecError(f"attention spec's dense_fill is followed by {after!r}: only 'round' steps may follow "
                            "the index mask (a later step could make the hidden logits ordinary)")

    def resolve_operands(self, operands) -> "AttentionSpec":
        """The same spec with each 0-d ``*_operand`` step replaced by its value now."""
        resolved = self.as_score_spec().resolve_operands(operands)
        return self if resolved.post == self.post else dataclasses.replace(self, post=resolved.post)

    def describe(self) -> str:
        """One line for diagnostics: 'mul(0.125) -> mask:range -> softmax -> @v' (with
        ``empty_row="zero"``: 'safe_softmax', a row with no visible key gives 0; "dense":
        'softmax(dense rows)', the rows without a visible selected key recomputed densely)."""
        steps = self.as_score_spec().describe().split(" -> ")[2:]  # drop the epilogue and reduce
        sm = {"zero": "safe_softmax", "dense": "softmax(dense rows)"}.get(self.empty_row, "softmax")
        return " -> ".join([*steps, sm, "@v"])


def form_of(H: int, Hk: int) -> str:
    """The kernel form for H query heads over Hk key heads: "mqa" when every head shares one
    key head (the heads are the rows of one tensor-core tile), else "per_head"."""
    if Hk < 1 or H % Hk != 0:
        raise SpecError(f"{H} query heads cannot share {Hk} key heads (H % Hk must be 0)")
    return "mqa" if Hk == 1 and H > 1 else "per_head"
