"""The sparse attention's CPU path and oracle: the ``AttentionSpec`` in plain PyTorch.

Each chunk of query rows gathers its k selected keys and values, scores them with the
spec's steps and masks (each mask kind's reference piece, ``mask_kinds``, at the gathered
key indices), and runs the softmax over the k slots. Memory is O(rows x k + one chunk of
gathered keys): no [S, T] tensor. ``dtype=torch.float64`` gives the float64 reference the
tests compare to. The backward is ``attention_backward``; chunk sizes
(``attention_backward.chunk_rows``) depend only on the shapes and the device type.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .attention_backward import chunk_rows
from .attention_spec import AttentionSpec
from .mask_kinds import check_mask_operands, mask_kinds
from .reference import _apply_elementwise
from .spec import SpecError, dtype_of

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check_mask_operands(masks, spec: AttentionSpec, B: int, S: int, T: int, device) -> None:
    """Each operand as its mask terms read it (the selection's rules, each kind's in
    ``mask_kinds.check_mask_operands``), on q's device (a scale's 0-d operand may live on
    the host)."""
    for i, t in enumerate(masks):
        if not isinstance(t, torch.Tensor):
            raise SpecError(f"mask operand {i} is a {type(t).__name__}, not a tensor")
    check_mask_operands(spec.masks, masks, B, S, T, device)


def check_attention_operands(q, k, v, idx, masks, spec: AttentionSpec) -> None:
    """Shapes, dtypes and devices the op needs, with an error that names the operand. On
    the CPU (where it costs no device sync) also that every index is in [0, T)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise SpecError(f"q, k and v must be 4-d [B,S,H,D], [B,T,Hk,D], [B,T,Hk,Dv]; got {tuple(q.shape)}, "
                        f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, S, H, D = q.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise SpecError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share B, T and Hk with q {tuple(q.shape)}")
    if k.shape[3] != D:
        raise SpecError(f"k's head dim {k.shape[3]} differs from q's {D}")
    T, Hk = k.shape[1], k.shape[2]
    if Hk < 1 or H % Hk:
        raise SpecError(f"{H} query heads cannot share {Hk} key heads (H % Hk must be 0)")
    if idx.dim() != 3 or tuple(idx.shape[:2]) != (B, S):
        raise SpecError(f"idx must be [B, S, k] = [{B}, {S}, k]; got {tuple(idx.shape)}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise SpecError(f"idx has dtype {idx.dtype}; expected int32 or int64")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _FLOATS:
            raise SpecError(f"{name} has dtype {t.dtype}; expected float32, bfloat16 or float16")
    for name, t in (("k", k), ("v", v), ("idx", idx)):
        if t.device != q.device:
            raise SpecError(f"{name} is on {t.device}, q on {q.device}")
    if idx.shape[-1] > T:
        raise SpecError(f"idx selects {idx.shape[-1]} keys per row from T={T} (at most T distinct keys)")
    spec.validate(num_mask_operands=len(masks))
    _check_mask_operands(masks, spec, B, S, T, q.device)
    if idx.device.type == "cpu" and idx.numel() and not isinstance(idx, torch._subclasses.FakeTensor):
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= T:
            raise SpecError(f"idx holds key {lo if lo < 0 else hi}, outside [0, T={T})")


def gather_heads(x: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x[b] [T, Hk, D] at ``keys`` [n, K], head-major: [Hk, n, K, D] in ``dtype``. Gathered
    from the head-major view, so the result is already laid out for one batched matmul
    per key head (no transposing copy of the gathered keys), and cast after the gather
    (only the k keys are converted)."""
    return x.transpose(0, 1)[:, keys].to(dtype)


def heads_to_rows(x: torch.Tensor, H: int) -> torch.Tensor:
    """[Hk, n, G, K] (one matmul per key head) -> [H, n, K] (head h = hk * G + g)."""
    Hk, n, G, K = x.shape
    return x.permute(0, 2, 1, 3).reshape(H, n, K)


def rows_to_heads(x: torch.Tensor, Hk: int) -> torch.Tensor:
    """[H, n, K] -> [Hk, n, G, K], the inverse of ``heads_to_rows``."""
    H, n, K = x.shape
    return x.view(Hk, H // Hk, n, K).permute(0, 2, 1, 3)


def score_slots(q, k, idx, masks, spec: AttentionSpec, b, s0, s1, dtype):
    """The per-head logits x and masked scores y, both [H, n, K], of rows (b, s0:s1) at
    their selected keys: every post step's input and the last output (for the backward),
    the gathered keys [Hk, n, K, D] in ``dtype`` and their int64 indices [1, n, K] (the
    masks broadcast over the heads)."""
    B, S, H, D = q.shape
    T, Hk = k.shape[1], k.shape[2]
    G = H // Hk
    keys = idx[b, s0:s1].long()
    n, K = keys.shape
    qh = q[b, s0:s1].to(dtype).view(n, Hk, G, D).permute(1, 0, 2, 3)  # [Hk, n, G, D]
    kb = gather_heads(k[b], keys, dtype)
    x = heads_to_rows(torch.matmul(qh, kb.transpose(-1, -2)), H)
    mkeys = keys.unsqueeze(0)
    kinds = mask_kinds(spec.masks)
    outs = [x]
    for st in spec.post:
        if st[0] == "mask":
            outs.append(kinds[st[1]].reference(outs[-1], masks, b, b + 1, s0, s1, 0, T, B, S, T, keys=mkeys))
        else:
            outs.append(_apply_elementwise(outs[-1], st))
    return outs, kb, mkeys


def attention_forward(q, k, v, idx, masks: Sequence[torch.Tensor], spec: AttentionSpec,
                      return_probs: bool = False, dtype: torch.dtype = torch.float32):
    """(out [B,S,H,Dv] in ``spec.out_dtype`` (``dtype`` when float64), lse [B,S,H] fp32,
    probs [B,S,K] fp32 = sum_h P, or an empty tensor unless ``return_probs``)."""
    B, S, H, _ = q.shape
    Hk, Dv, K = k.shape[2], v.shape[3], idx.shape[-1]
    out_dtype = dtype if dtype == torch.float64 else dtype_of(spec.out_dtype)
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    out = q.new_empty((B, S, H, Dv), dtype=out_dtype)
    lse = q.new_empty((B, S, H), dtype=stat)
    probs = q.new_empty((B, S, K) if return_probs else (0,), dtype=stat)
    zero = spec.empty_row == "zero"
    if K == 0:  # no slot: every row is hidden, as a dense row of -inf
        out.fill_(0.0 if zero else float("nan")), lse.fill_(float("-inf"))
        return out, lse, probs
    step = chunk_rows(q.device, S, K, H, Hk, q.shape[3], Dv, len(spec.post))
    for b in range(B):
        for s0 in range(0, S, step):
            s1 = min(S, s0 + step)
            outs, kb, mkeys = score_slots(q, k, idx, masks, spec, b, s0, s1, dtype)
            del kb
            y, keys, n = outs[-1], mkeys[0], s1 - s0
            del outs
            m0 = y.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m0), m0, torch.zeros_like(m0))  # all -inf: lse -inf, P NaN
            e = torch.exp(y - m)
            l = e.sum(-1, keepdim=True)
            p = e / l
            if zero:  # a row whose every slot is -inf: P 0 (the safe softmax), so out 0
                p = torch.where(m0 == float("-inf"), 0.0, p)
            vb = gather_heads(v[b], keys, dtype)  # [Hk, n, K, Dv]
            o = torch.matmul(rows_to_heads(p, Hk), vb).permute(1, 0, 2, 3).reshape(n, H, Dv)
            out[b, s0:s1] = o.to(out_dtype)
            lse[b, s0:s1] = (m + torch.log(l)).squeeze(-1).transpose(0, 1).to(stat)
            if return_probs:
                probs[b, s0:s1] = p.sum(0).to(stat)
    return out, lse, probs
