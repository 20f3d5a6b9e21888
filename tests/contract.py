"""The exactness contract (docs/contract.md) as reusable checks (the selection checks
themselves are the public ``hyscale_compile.testing.assert_selection_equal``; here: seeds and
tolerances)."""
from __future__ import annotations

import os
import random
from typing import Optional

import torch

from hyscale_compile.lowerings.reference import dense_scores
from hyscale_compile.lowerings.spec import ScoreSpec
from hyscale_compile.testing import assert_selection_equal


def fresh_seed(label: str) -> int:
    """A new seed per case (printed, so a failure can be replayed with HYSCALE_SEED)."""
    seed = int(os.environ.get("HYSCALE_SEED", random.SystemRandom().randrange(1 << 30)))
    print(f"[seed] {label}: HYSCALE_SEED={seed}")
    return seed


def input_and_param_grads(fn, x0, module):
    """Gradients of ``fn(x)`` (its sum of squares; a 0-d output itself) with respect to a
    fresh copy of ``x0`` and to ``module``'s parameters (None where one gets none); the
    parameters' gradients are zeroed afterwards, so eager and compiled runs can alternate."""
    x = x0.clone().requires_grad_(True)
    out = fn(x)
    (out.pow(2).sum() if out.dim() else out).backward()
    grads = [x.grad] + [None if p.grad is None else p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    return grads


def reference_f64(q, k, w, masks, spec: ScoreSpec) -> torch.Tensor:
    """The scores in float64 along the spec's own dtype path (round steps included)."""
    return dense_scores(q, k, w, masks, spec, dtype=torch.float64)


def tolerance(q, k, w, spec: ScoreSpec) -> torch.Tensor:
    """Per-row tol = (D + H + 2) * u * max_t sum_h |c w_h| sum_d |q_hd k_d|, c the product of
    the spec's constant multipliers; u = 2^-24, or 2^-8 when a step rounds to bf16/fp16."""
    B, S, H, D = q.shape
    c = 1.0
    for step in tuple(spec.epilogue) + tuple(spec.post):
        if step[0] == "mul":
            c *= abs(step[1])
        elif step[0] == "div":
            c /= abs(step[1])
    rounds = [s for s in tuple(spec.epilogue) + tuple(spec.post) if s[0] == "round"] + (
        [1] if spec.logit_dtype != "float32" else []
    )
    u = 2.0**-8 if rounds or spec.score_dtype != "float32" else 2.0**-24
    G = H // k.shape[2]
    qa = q.double().abs()
    ka = k.double().abs().repeat_interleave(G, dim=2)  # [B,T,H,D]
    dots = torch.einsum("bshd,bthd->bsht", qa, ka.expand(B, *ka.shape[1:]))
    wa = w.double().abs() if w is not None else torch.ones(B, S, H, dtype=torch.float64)
    mag = (dots * wa.unsqueeze(-1)).sum(2) * c  # [B,S,T]
    return (D + H + 2) * u * mag.amax(-1) + 1e-30


def check_selection(idx: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor, k: int, values: Optional[torch.Tensor] = None,
                    sorted: bool = True):
    """Against the float64 reference ``ref``: per row, the selected scores are the top-k's
    as a multiset within the row's ``tol``; masked slots (-inf) hold the smallest-index -inf
    keys (in ascending order when ``sorted``); values equal the reference at the selected
    keys within tol."""
    assert idx.shape == (*ref.shape[:-1], k), (idx.shape, (*ref.shape[:-1], k))
    assert_selection_equal(idx, ref, values=values, atol=tol, rtol=0.0, sorted=sorted)


def assert_stable_topk(idx: torch.Tensor, scores32: torch.Tensor, k: int, values: Optional[torch.Tensor] = None):
    """On exactly representable inputs the order is fully determined: (value desc, index asc)."""
    assert idx.shape[-1] == k, (idx.shape, k)
    assert_selection_equal(idx, scores32, values=values, atol=0.0, rtol=0.0)
