"""The indexer's dense KL loss (DSA's warm-up stage) in chunked PyTorch: the CPU path and oracle.

Operands (B batch, S queries, T keys; causal needs S == T, prefill):

    q    [B, S, H, D]    the main attention's queries (no gradient: detached, as in the paper)
    k    [B, T, Hk, D]   its keys, Hk == H or H % Hk == 0 (GQA); no gradient
    qi   [B, S, Hi, Di]  the indexer's per-head queries
    ki   [B, T, Di]      the indexer's keys, shared by its heads
    w    [B, S, Hi]      the indexer's head weights (as the indexer applies them: Megatron's
                         ``weights_proj(x) * Hi**-0.5 * Di**-0.5``)
    lse  [B, S, H] fp32  optional: the attention's log-sum-exp over each row's visible keys
                         (natural log of sum_t exp(scale * q_h . k_t)); computed when absent

For each row (b, s), with V the visible keys (t <= s when causal, all T otherwise):

    P_t   = sum_h exp(scale * q_h . k_t - lse_h)        t in V (0 elsewhere)
    tgt_t = P_t / sum_t P_t                              L1-normalised (sum_t P_t = H when each
                                                         head's lse is exact)
    I_t   = sum_j w_j relu(qi_j . ki_t)                  -inf outside V
    lp_t  = I_t - logsumexp_V(I)
    row   = sum_t tgt_t (log tgt_t - lp_t)               0 log 0 := 0
    loss  = loss_coeff * mean_{b,s} row                  (Megatron: kl.sum(-1).mean() * coeff)

Megatron-Core (``compute_dsa_indexer_loss``) writes ``tgt * (log(tgt + 1e-10) - log(p + 1e-10))``;
this is the exact KL (no 1e-10 offsets): the two differ by O(1e-10 / p) per key, which is
below fp32 rounding unless the indexer gives a visible key a probability under ~1e-3.

Gradient (to qi, ki, w only): with g = grad * loss_coeff / (B * S),
dI_t = g * (softmax_V(I)_t - tgt_t), then through relu, w, qi and ki.

Chunks of query rows: memory O(rows x T x max(H, Hi)) per chunk, never an [S, T] tensor for
all rows. The chunk size depends only on the shapes, and the key gradient accumulates over
chunks in a fixed order, so results are bitwise reproducible on a device.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .spec import SpecError

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
CHUNK_ELEMENTS = 1 << 22


def check_operands(q, k, qi, ki, w, lse: Optional[Tensor], causal: bool) -> None:
    """Shapes, dtypes and devices of the operands; SpecError naming the problem."""
    named = dict(q=q, k=k, qi=qi, ki=ki, w=w) if lse is None else dict(q=q, k=k, qi=qi, ki=ki, w=w, lse=lse)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise SpecError(f"dense_indexer_kl: {name} is a {type(t).__name__}, not a tensor")
    for name, want in (("q", "[B, S, H, D]"), ("k", "[B, T, Hk, D]"), ("qi", "[B, S, Hi, Di]"), ("ki", "[B, T, Di]"),
                       ("w", "[B, S, Hi]")):
        t = named[name]
        if t.dim() != want.count(",") + 1:
            raise SpecError(f"dense_indexer_kl: {name} must be {want}, got shape {tuple(t.shape)}")
    B, S, H, D = q.shape
    T, Hk = k.shape[1], k.shape[2]
    Hi, Di = qi.shape[2], qi.shape[3]
    if min(B, S, H, D, T, Hi, Di) < 1 or Hk < 1:
        raise SpecError(f"dense_indexer_kl: empty operand: q {tuple(q.shape)}, k {tuple(k.shape)}, qi {tuple(qi.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise SpecError(f"dense_indexer_kl: k {tuple(k.shape)} does not match q {tuple(q.shape)} (want [{B}, T, Hk, {D}])")
    if H % Hk:
        raise SpecError(f"dense_indexer_kl: k has {Hk} heads, which does not divide q's {H}")
    if tuple(qi.shape[:2]) != (B, S):
        raise SpecError(f"dense_indexer_kl: qi {tuple(qi.shape)} does not match q's batch and rows ({B}, {S})")
    if tuple(ki.shape) != (B, T, Di):
        raise SpecError(f"dense_indexer_kl: ki {tuple(ki.shape)} must be [B, T, Di] = [{B}, {T}, {Di}]")
    if tuple(w.shape) != (B, S, Hi):
        raise SpecError(f"dense_indexer_kl: w {tuple(w.shape)} must be [B, S, Hi] = [{B}, {S}, {Hi}]")
    if lse is not None and tuple(lse.shape) != (B, S, H):
        raise SpecError(f"dense_indexer_kl: lse {tuple(lse.shape)} must be [B, S, H] = [{B}, {S}, {H}]")
    if causal and S != T:
        raise SpecError(f"dense_indexer_kl: causal needs S == T (prefill), got S={S}, T={T}")
    for name, t in named.items():
        if t.dtype not in _FLOATS:
            raise SpecError(f"dense_indexer_kl: {name} has dtype {t.dtype}; expected float32, bfloat16 or float16")
    if lse is not None and lse.dtype != torch.float32:
        raise SpecError(f"dense_indexer_kl: lse has dtype {lse.dtype}; expected float32")
    if q.dtype != k.dtype:
        raise SpecError(f"dense_indexer_kl: q is {q.dtype} but k is {k.dtype}")
    if qi.dtype != ki.dtype:
        raise SpecError(f"dense_indexer_kl: qi is {qi.dtype} but ki is {ki.dtype}")
    for name, t in named.items():
        if t.device != q.device:
            raise SpecError(f"dense_indexer_kl: {name} is on {t.device}, q on {q.device}")


def check_stats(q, stats, row_stats) -> None:
    """The forward's statistics, as the backward reads them."""
    B, S, H = q.shape[:3]
    for name, t, shape in (("stats", stats, (B, S, H, 2)), ("row_stats", row_stats, (B, S, 3))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != torch.float32:
            raise SpecError(f"dense_indexer_kl_backward: {name} must be a float32 tensor of shape {list(shape)}, got "
                            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                            f"{' ' + str(t.dtype) if isinstance(t, torch.Tensor) else ''}")
        if t.device != q.device:
            raise SpecError(f"dense_indexer_kl_backward: {name} is on {t.device}, q on {q.device}")


def chunk_rows(B: int, S: int, T: int, heads: int) -> int:
    return max(1, min(S, CHUNK_ELEMENTS // max(1, B * T * heads)))


def _visible(r0: int, r1: int, T: int, causal: bool, device) -> Tensor:
    rows = torch.arange(r0, r1, device=device)
    cols = torch.arange(T, device=device)
    if causal:
        return cols[None, :] <= rows[:, None]
    return torch.ones(r1 - r0, T, dtype=torch.bool, device=device)


def attention_stats(lse: Tensor) -> Tensor:
    """A caller's lse as the (max, sum) pairs [B,S,H,2] the loss reads: (lse, 1)."""
    return torch.stack([lse.float(), torch.ones_like(lse, dtype=torch.float32)], -1)


def _chunk(q, k, qi, ki, w, stats, r0, r1, scale, causal, dtype):
    """(target [B,C,T], index scores [B,C,T] (-inf hidden), relu's argument [B,C,Hi,T],
    the chunk's attention stats [B,C,H,2], the target's mass before normalising Z [B,C]).

    ``stats`` [B,S,H,2]: each head's softmax as (m, l), p = exp(s - m) / l, or None (computed):
    not exp(s - lse), whose rounding of lse = m + log l is |lse| ulps in every p."""
    B, S, H, D = q.shape
    T, Hk = k.shape[1], k.shape[2]
    G = H // Hk
    vis = _visible(r0, r1, T, causal, q.device)
    qc = q[:, r0:r1].to(dtype).reshape(B, r1 - r0, Hk, G, D)
    s = torch.einsum("bckgd,btkd->bkgct", qc, k.to(dtype)).reshape(B, H, r1 - r0, T) * scale
    s = s.masked_fill(~vis, -math.inf)
    if stats is None:
        m = s.amax(-1)  # every row sees a key: finite
        l = torch.exp(s - m.unsqueeze(-1)).sum(-1)
    else:
        m, l = (stats[:, r0:r1, :, i].to(dtype).transpose(1, 2) for i in (0, 1))
    P = (torch.exp(s - m.unsqueeze(-1)) / l.unsqueeze(-1)).sum(1)  # [B,C,T], hidden keys exp(-inf) = 0
    # Z in float64, rounded once: its rounding is common to the row's target (see the backward)
    z = P.sum(-1, dtype=torch.float64).to(dtype)
    target = P / z.unsqueeze(-1)
    a = torch.einsum("bcjd,btd->bcjt", qi[:, r0:r1].to(dtype), ki.to(dtype))
    I = (w[:, r0:r1].to(dtype).unsqueeze(-1) * a.clamp_min(0)).sum(2).masked_fill(~vis, -math.inf)
    return target, I, a, torch.stack([m, l], -1).transpose(1, 2), z


def indexer_kl_forward(q, k, qi, ki, w, lse: Optional[Tensor], scale: float, causal: bool, loss_coeff: float,
                       dtype=torch.float32, return_stats: bool = False):
    """The loss (0-d, in ``dtype``: float64 for an oracle); with ``return_stats`` (loss fp32,
    the attention's (m, l) [B,S,H,2] used, the rows' (m_I, l_I, Z) [B,S,3]): the indexer's
    max and sum of exp(I - m_I) over the visible keys, and the target's mass."""
    B, S, H, D = q.shape
    T = k.shape[1]
    stats = None if lse is None else attention_stats(lse)
    rows, att, row_stats = [], [], []
    step = chunk_rows(B, S, T, max(H, qi.shape[2]))
    for r0 in range(0, S, step):
        r1 = min(S, r0 + step)
        target, I, _, stats_c, z = _chunk(q, k, qi, ki, w, stats, r0, r1, scale, causal, dtype)
        m_i = I.amax(-1, keepdim=True)
        l_i = torch.exp(I - m_i).sum(-1, keepdim=True)
        lp = I - m_i - torch.log(l_i)
        kl = torch.where(target > 0, target * (torch.log(target) - lp), torch.zeros((), dtype=dtype, device=q.device))
        rows.append(kl.sum(-1))
        att.append(stats_c)
        row_stats.append(torch.stack([m_i.squeeze(-1), l_i.squeeze(-1), z], -1))
    # the rows' sum and its scaling in float64, rounded once ([B, S] values: no cost): with
    # loss_coeff / (B S) rounded to fp32 the loss erred 0.76 eps on average where the original's
    # mean erred 0.55; so 0.49
    loss = (torch.cat(rows, 1).double().sum() * (loss_coeff / (B * S))).to(dtype)
    if not return_stats:
        return loss
    return loss.float(), torch.cat(att, 1).float(), torch.cat(row_stats, 1).float()


def indexer_kl_backward(grad: Tensor, q, k, qi, ki, w, stats: Tensor, scale: float, causal: bool, loss_coeff: float,
                        dtype=torch.float32) -> Tuple[Tensor, Tensor, Tensor]:
    """(grad qi, grad ki, grad w) in the operands' dtypes; ``stats`` the forward's attention
    (m, l) [B,S,H,2]."""
    B, S, H, D = q.shape
    T = k.shape[1]
    g = (grad.double() * (loss_coeff / (B * S))).to(dtype)  # one rounding, as the forward's
    gqi = torch.empty(qi.shape, dtype=dtype, device=q.device)
    gw = torch.empty(w.shape, dtype=dtype, device=q.device)
    gki = torch.zeros(ki.shape, dtype=dtype, device=q.device)
    step = chunk_rows(B, S, T, max(H, qi.shape[2]))
    kd = ki.to(dtype)
    for r0 in range(0, S, step):
        r1 = min(S, r0 + step)
        target, I, a, _, _ = _chunk(q, k, qi, ki, w, stats, r0, r1, scale, causal, dtype)
        p = torch.softmax(I, dim=-1)
        dI = g * (p - target)  # [B,C,T]; hidden keys: 0 - 0
        # in two steps: sum_t dI is 0 exactly, so its value, in float64, is the roundings
        # common to the row's p (softmax's fp32 normaliser) less the target's; taken off along
        # p, what is left is proportional to dI. In one step that rounding reached the
        # gradients at the scale of sum_t p relu(a), not of dI (grad w 4.5 eps off where
        # the original erred 0.76)
        dI = dI - dI.sum(-1, keepdim=True, dtype=torch.float64).to(dtype) * p
        gw[:, r0:r1] = torch.einsum("bct,bcjt->bcj", dI, a.clamp_min(0))
        da = dI.unsqueeze(2) * w[:, r0:r1].to(dtype).unsqueeze(-1) * (a > 0)
        gqi[:, r0:r1] = torch.einsum("bcjt,btd->bcjd", da, kd)
        gki += torch.einsum("bcjt,bcjd->btd", da, qi[:, r0:r1].to(dtype))
    return gqi.to(qi.dtype), gki.to(ki.dtype), gw.to(w.dtype)
