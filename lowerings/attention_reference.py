"""The sparse attention's CPU path and oracle: the ``AttentionSpec`` in plain PyTorch.

Each chunk of query rows gathers its k selected keys and values, scores them with the
spec's steps and masks (``reference._apply_mask`` at the gathered key indices), and runs
the softmax over the k slots. Memory is O(rows x k + one chunk of gathered keys): no
[S, T] tensor. ``dtype=torch.float64`` gives the float64 reference the tests compare to.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from .attention_spec import AttentionSpec
from .reference import _apply_elementwise, _apply_mask
from .spec import SpecError, dtype_of

CHUNK_ELEMENTS = 1 << 22  # gathered key elements per chunk (16 MiB of fp32)


def check_attention_operands(q, k, v, idx, masks, spec: AttentionSpec) -> None:
    """Shapes and dtypes the op needs, with an error that names the operand."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise SpecError(f"q, k and v must be 4-d [B,S,H,D], [B,T,Hk,D], [B,T,Hk,Dv]; got {tuple(q.shape)}, "
                        f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, S, H, D = q.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise SpecError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share B, T and Hk with q {tuple(q.shape)}")
    if k.shape[3] != D:
        raise SpecError(f"k's head dim {k.shape[3]} differs from q's {D}")
    Hk = k.shape[2]
    if Hk < 1 or H % Hk:
        raise SpecError(f"{H} query heads cannot share {Hk} key heads (H % Hk must be 0)")
    if idx.dim() != 3 or tuple(idx.shape[:2]) != (B, S):
        raise SpecError(f"idx must be [B, S, k] = [{B}, {S}, k]; got {tuple(idx.shape)}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise SpecError(f"idx has dtype {idx.dtype}; expected int32 or int64")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise SpecError(f"{name} has dtype {t.dtype}; expected float32, bfloat16 or float16")
    spec.validate(num_mask_operands=len(masks))


def _chunk_rows(S: int, K: int, width: int) -> int:
    return max(1, min(S, CHUNK_ELEMENTS // max(1, K * width)))


def _post_forward(y, spec: AttentionSpec, masks, b, s0, s1, keys, shape):
    """The spec's post steps on y [H, n, K] (a mask term per (b, s, t), broadcast over the
    heads); returns [input, after step 0, after step 1, ...] for the backward."""
    B, S, T = shape
    sspec = spec.as_score_spec()
    outs = [y]
    for st in sspec.post:
        if st[0] == "mask":
            y = _apply_mask(y, sspec.masks[st[1]], masks, b, b + 1, s0, s1, 0, T, B, S, T, keys=keys)
        else:
            y = _apply_elementwise(y, st)
        outs.append(y)
    return outs


def score_slots(q, k, idx, masks, spec: AttentionSpec, b, s0, s1, dtype):
    """The per-head logits x and masked scores y, both [H, n, K], of rows (b, s0:s1) at
    their selected keys, every post step's input (for the backward), the gathered keys
    [n, K, Hk, D] and their int64 indices as [1, n, K] (the mask terms broadcast over heads)."""
    B, S, H, D = q.shape
    T, Hk = k.shape[1], k.shape[2]
    G = H // Hk
    keys = idx[b, s0:s1].long()
    n, K = keys.shape
    qb = q[b, s0:s1].to(dtype).view(n, Hk, G, D)
    kb = k[b].to(dtype)[keys]  # [n, K, Hk, D]
    x = torch.einsum("nhgd,nkhd->hgnk", qb, kb).reshape(H, n, K)
    hkeys = keys.unsqueeze(0)  # [1, n, K]: the mask terms broadcast over the heads
    outs = _post_forward(x, spec, masks, b, s0, s1, hkeys, (B, S, T))
    return outs, kb, hkeys


def attention_forward(q, k, v, idx, masks: Sequence[torch.Tensor], spec: AttentionSpec,
                      return_probs: bool = False, dtype: torch.dtype = torch.float32):
    """(out [B,S,H,Dv] in ``spec.out_dtype`` (``dtype`` when float64), lse [B,S,H] fp32,
    probs [B,S,K] fp32 = sum_h P, or an empty tensor unless ``return_probs``)."""
    B, S, H, _ = q.shape
    Hk, Dv, K = k.shape[2], v.shape[3], idx.shape[-1]
    G = H // Hk
    out_dtype = dtype if dtype == torch.float64 else dtype_of(spec.out_dtype)
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    out = q.new_empty((B, S, H, Dv), dtype=out_dtype)
    lse = q.new_empty((B, S, H), dtype=stat)
    probs = q.new_empty((B, S, K) if return_probs else (0,), dtype=stat)
    step = _chunk_rows(S, K, Hk * max(k.shape[3], Dv) + H)
    for b in range(B):
        for s0 in range(0, S, step):
            s1 = min(S, s0 + step)
            outs, _, hkeys = score_slots(q, k, idx, masks, spec, b, s0, s1, dtype)
            y, keys, n = outs[-1], hkeys[0], s1 - s0
            m = y.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf: lse -inf, P NaN
            e = torch.exp(y - m)
            l = e.sum(-1, keepdim=True)
            p = e / l
            vb = v[b].to(dtype)[keys]  # [n, K, Hk, Dv]
            o = torch.einsum("hgnk,nkhd->nhgd", p.view(Hk, G, n, K), vb).reshape(n, H, Dv)
            out[b, s0:s1] = o.to(out_dtype)
            lse[b, s0:s1] = (m + torch.log(l)).squeeze(-1).transpose(0, 1).to(stat)
            if return_probs:
                probs[b, s0:s1] = p.sum(0).to(stat)
    return out, lse, probs


def attention_backward(grad_out, q, k, v, idx, masks, out, lse, spec: AttentionSpec, needs=(True, True, True)):
    """(gq, gk, gv) at the selected keys, chunk by chunk. The probabilities are rebuilt from
    the saved lse (nothing re-selects); each post step's derivative is the one autograd
    gives the original op (``backward._step_grad``, ``_mask_grad``: a fill passes no
    gradient to the slots it hides). This runs below autograd, inside a custom op, so the
    chain rule is written out. Key gradients are added into [B, T, Hk, D] by
    ``index_add_``: a fixed order on the CPU."""
    from .backward import _mask_grad, _step_grad

    B, S, H, D = q.shape
    T, Hk, Dv, K = k.shape[1], k.shape[2], v.shape[3], idx.shape[-1]
    G = H // Hk
    f32 = torch.float32
    sspec = spec.as_score_spec()
    gq = torch.zeros(q.shape, dtype=f32, device=q.device) if needs[0] else None
    gk = torch.zeros(k.shape, dtype=f32, device=k.device) if needs[1] else None
    gv = torch.zeros(v.shape, dtype=f32, device=v.device) if needs[2] else None
    step = _chunk_rows(S, K, Hk * max(D, Dv) + H)
    for b in range(B):
        for s0 in range(0, S, step):
            s1 = min(S, s0 + step)
            n = s1 - s0
            outs, kb, hkeys = score_slots(q, k, idx, masks, spec, b, s0, s1, f32)
            keys = hkeys[0]
            p = torch.exp(outs[-1] - lse[b, s0:s1].to(f32).transpose(0, 1).unsqueeze(-1))  # [H, n, K]
            p = torch.nan_to_num(p, nan=0.0)  # a row with no visible slot (-inf - -inf) passes nothing
            vb = v[b].to(f32)[keys]  # [n, K, Hk, Dv]
            go = grad_out[b, s0:s1].to(f32).view(n, Hk, G, Dv)
            # dP = dO . v;  dy = P (dP - delta), delta = dO . O (the softmax's backward)
            dp = torch.einsum("nhgd,nkhd->hgnk", go, vb).reshape(H, n, K)
            delta = (grad_out[b, s0:s1].to(f32) * out[b, s0:s1].to(f32)).sum(-1).transpose(0, 1).unsqueeze(-1)
            g = torch.where(p > 0, p * (dp - delta), 0.0)
            for i in reversed(range(len(sspec.post))):
                st = sspec.post[i]
                if st[0] == "mask":
                    g = _mask_grad(g, sspec.masks[st[1]], masks, b, b + 1, s0, s1, hkeys, B, S, T)
                else:
                    g = _step_grad(g, st, outs[i], outs[i + 1])
            gx = g.view(Hk, G, n, K)
            if needs[0]:
                gq[b, s0:s1] = torch.einsum("hgnk,nkhd->nhgd", gx, kb).reshape(n, H, D)
            if needs[1]:
                qb = q[b, s0:s1].to(f32).view(n, Hk, G, D)
                gks = torch.einsum("hgnk,nhgd->nkhd", gx, qb)
                gk[b].index_add_(0, keys.reshape(-1), gks.reshape(n * K, Hk, D))
            if needs[2]:
                gvb = torch.einsum("hgnk,nhgd->nkhd", p.view(Hk, G, n, K), go)
                gv[b].index_add_(0, keys.reshape(-1), gvb.reshape(n * K, Hk, Dv))
    empty = q.new_empty(0)
    return (gq.to(q.dtype) if needs[0] else empty, gk.to(k.dtype) if needs[1] else empty,
            gv.to(v.dtype) if needs[2] else empty)
