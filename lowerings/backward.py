"""The sparse backward of ``hytopk_values``: gradients at the k selected keys only.

The forward returned ``values[b, s, j] = score(q[b, s], k[b, idx[b, s, j]])``. Its
gradient reaches q, k and the head weights only through those k keys per query, so the
backward gathers them, rebuilds the k scores with the forward's arithmetic (the spec's
steps, in the forward's order) and runs each step's derivative in reverse:

    gq[b, s]          = sum_j g[b, s, j] * d score(q[b, s], k[idx[b, s, j]]) / dq
    gw[b, s]          = (the same, d/dw)
    gk[idx[b, s, j]] += g[b, s, j] * d score / dk         (an index_add over selected keys)

Memory is O(rows x k x heads x D) for one chunk of query rows; nothing of size
queries x keys is ever built. Each step's derivative is the one autograd gives the
original graph's op (so gradients equal the original's wherever the selection is):
relu passes gradient where its input is > 0; a rounding cast rounds the gradient to its
dtype (the backward of ``.to(bf16).to(fp32)``); masked slots follow the original mask form:
a fill (``masked_fill`` / ``where``) passes no gradient to the hidden score, an additive
mask does (docs/contract.md, "Values and gradients").

This runs inside a custom op's implementation, below autograd, so the chain rule is
written out here rather than taken from ``torch.autograd``. Precision: fp32 arithmetic
(bf16/fp16 operands upcast exactly), gradients cast to the operand dtypes, as the
original graph's upcast backward does.

Determinism: the key gradient sums each key's contributions in (row, slot) order onto its
running value, chunk after chunk in row order, so the sum's order (and its bits) depends on
neither the run nor the chunk size. On CUDA that is ``attention_backward.segment_sum_`` (a
stable sort of the chunk's keys and a Triton segment sum, one program per key, no atomics:
``index_add_`` there adds with atomics in a varying order); on the CPU ``index_add_``, whose
loop follows the same order.

``triton_values_backward`` fuses the per-row part (gather, rebuilt steps, derivatives, gq,
gw and the per-slot key contributions) into one Triton kernel for the specs it covers; on
CUDA it is the default (``HYSCALE_BWD_FUSED=0`` keeps the chunked PyTorch row part)
(docs/performance.md, "Sparse backward"). It writes each slot's key contribution at its
key-sorted position (``attention_backward.key_runs``, sorted before the kernel), so that
the key sum (``sorted_segment_sum_``) reads each key's run contiguously instead of gathering
it row by row: the same additions in the same order, so the same bits as the gathered sum.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import torch

from .mask_kinds import kind_of
from .reference import _apply_elementwise, _apply_mask, check_operands
from .spec import ScoreSpec, SpecError, dtype_of

# Bytes of fp32 gathered keys and per-head logits one chunk of rows may hold: small on the
# CPU (cache-sized), 1 GiB on a GPU, where each chunk is a handful of kernel launches and
# small chunks would leave the time to launch overhead.
DEFAULT_CHUNK_BYTES = {"cpu": 64 << 20, "cuda": 1 << 30}
if "HYSCALE_BWD_CHUNK_BYTES" in os.environ:
    DEFAULT_CHUNK_BYTES = {d: int(os.environ["HYSCALE_BWD_CHUNK_BYTES"]) for d in DEFAULT_CHUNK_BYTES}


def _steps_forward(x: torch.Tensor, steps) -> List[torch.Tensor]:
    """Apply elementwise ``steps``; returns [input, after step 0, after step 1, ...]."""
    outs = [x]
    for st in steps:
        outs.append(_apply_elementwise(outs[-1], st))
    return outs


def _step_grad(g: torch.Tensor, step, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d loss / d x from d loss / d y for one elementwise step y = step(x)."""
    op = step[0]
    if op == "mul":
        return g * step[1]
    if op == "add":
        return g
    if op == "div":
        return g / step[1]
    if op == "relu":
        spelling = step[1] if len(step) > 1 else "relu"
        if spelling == "clamp_min":  # autograd: gradient where x >= min
            return torch.where(x >= 0, g, 0.0)
        if spelling == "maximum":  # autograd: a tie splits the gradient in half
            return torch.where(x > 0, g, torch.where(x == 0, g * 0.5, 0.0))
        return torch.where(x > 0, g, 0.0)  # aten's threshold_backward: no gradient at 0
    if op == "neg":
        return -g
    if op == "sigmoid":
        return g * y * (1 - y)
    if op == "round":
        return g.to(dtype_of(step[1])).to(g.dtype)
    if op == "mod":
        from . import mods

        return mods.grad(step[1], x, g)
    raise SpecError(f"no derivative for step {step!r}")


def _steps_backward(g: torch.Tensor, steps, outs: List[torch.Tensor]) -> torch.Tensor:
    for i in reversed(range(len(steps))):
        g = _step_grad(g, steps[i], outs[i], outs[i + 1])
    return g


def _mask_grad(g, term, masks, b0, b1, s0, s1, keys, B, S, T) -> torch.Tensor:
    """Gradient through one mask term: fills stop it at hidden slots, additions pass it."""
    if kind_of(term).adds_to_score:
        return g
    # the fill's hidden slots: apply the term to zeros and see which slots changed
    probe = _apply_mask(torch.zeros_like(g), term, masks, b0, b1, s0, s1, 0, T, B, S, T, keys=keys)
    if term.value == 0:  # a fill with 0 leaves zeros alone: apply it to ones instead
        probe = _apply_mask(torch.ones_like(g), term, masks, b0, b1, s0, s1, 0, T, B, S, T, keys=keys) - 1
    return torch.where(probe != 0, 0.0, g)


def _post_backward(g, spec, masks, post_in, b0, b1, s0, s1, keys, B, S, T, passthrough=None) -> torch.Tensor:
    """Gradient through ``spec``'s post steps in reverse (``post_in``: each step's input, then
    the last output). ``passthrough`` (i, where): at mask step i the slots where ``where`` is
    False take g unchanged (an add of the index fill stands in for that term there)."""
    for i in reversed(range(len(spec.post))):
        st = spec.post[i]
        if st[0] == "mask":
            gm = _mask_grad(g, spec.masks[st[1]], masks, b0, b1, s0, s1, keys, B, S, T)
            g = torch.where(passthrough[1], gm, g) if passthrough is not None and passthrough[0] == i else gm
        else:
            g = _step_grad(g, st, post_in[i], post_in[i + 1])
    return g


def rows_backward(g, q, ksel, w, masks, spec: ScoreSpec, keys, b0, b1, s0, s1, shape):
    """Gradients for rows [b0,b1) x [s0,s1) at the gathered keys.

    g [nb, ns, n] d loss / d values; q [nb, ns, H, D], ksel [nb, ns, n, Hk, D],
    w [nb, ns, H] or None, all fp32; keys [nb, ns, n] int64. -> (gq, gksel, gw)"""
    B, S, H, D, T, Hk = shape
    G = H // Hk
    nb, ns, n = keys.shape
    # forward, keeping what the derivatives need
    kt = ksel.permute(0, 1, 3, 4, 2)  # [nb, ns, Hk, D, n]
    x0 = torch.matmul(q.view(nb, ns, Hk, G, D), kt).reshape(nb, ns, H, n)
    x1 = x0
    if spec.logit_dtype != "float32":
        x1 = x0.to(dtype_of(spec.logit_dtype)).to(x0.dtype)
    ep = _steps_forward(x1, spec.epilogue)
    x = ep[-1]
    # post steps act on the reduced score; masks only need to know which slots they hide
    post_in = []
    if spec.reduce == "weighted_sum":
        y = torch.matmul(w.unsqueeze(-2), x).squeeze(-2)
    elif spec.reduce == "sum":
        y = x.sum(dim=2)
    else:
        y = x[:, :, 0]
    for st in spec.post:
        post_in.append(y)
        if st[0] != "mask":
            y = _apply_elementwise(y, st)
        else:
            y = _apply_mask(y, spec.masks[st[1]], masks, b0, b1, s0, s1, 0, T, B, S, T, keys=keys)
    post_in.append(y)
    # backward
    g = _post_backward(g, spec, masks, post_in, b0, b1, s0, s1, keys, B, S, T)
    gw = None
    if spec.reduce == "weighted_sum":
        gw = torch.matmul(x, g.unsqueeze(-1)).squeeze(-1)  # [nb, ns, H]
        gx = w.unsqueeze(-1) * g.unsqueeze(-2)  # [nb, ns, H, n]
    elif spec.reduce == "sum":
        gx = g.unsqueeze(-2).expand(nb, ns, H, n)
    else:
        gx = g.unsqueeze(-2)
    gx = _steps_backward(gx, spec.epilogue, ep)
    if spec.logit_dtype != "float32":
        gx = gx.to(dtype_of(spec.logit_dtype)).to(gx.dtype)
    gx = gx.reshape(nb, ns, Hk, G, n)
    gq = torch.matmul(gx, ksel.permute(0, 1, 3, 2, 4)).reshape(nb, ns, H, D)  # [.., Hk, G, n] @ [.., Hk, n, D]
    gks = torch.matmul(gx.transpose(-1, -2), q.view(nb, ns, Hk, G, D))  # [nb, ns, Hk, n, D]
    return gq, gks.permute(0, 1, 3, 2, 4), gw


def _add_key_grads(gk: torch.Tensor, keys: torch.Tensor, g_ks: torch.Tensor, use_kernel: Optional[bool] = None):
    """gk[keys[i]] += g_ks[i] in i = (row, slot) order: fp32 gk [T, Hk, D] (contiguous),
    keys [N], per-slot contributions g_ks [nb, ns, n, Hk, D] (N = nb * ns * n).
    ``use_kernel``: the Triton segment sum (default: on CUDA)."""
    if use_kernel is None:
        use_kernel = gk.device.type == "cuda"
    Hk, D = gk.shape[1], gk.shape[2]
    if not use_kernel:  # the CPU loop adds in index order
        gk.index_add_(0, keys, g_ks.reshape(-1, Hk, D))
        return gk
    from .attention_backward import segment_sum_  # (it imports this module)

    # head-major [Hk, N, D], the segment sum's layout: one copy, as the reshape above makes
    src = g_ks.permute(3, 0, 1, 2, 4).reshape(Hk, -1, D)
    return segment_sum_(gk, keys, src, use_kernel=True)


def values_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    w: Optional[torch.Tensor],
    masks: Sequence[torch.Tensor],
    idx: torch.Tensor,
    spec: ScoreSpec,
    needs: Tuple[bool, bool, bool] = (True, True, True),
    chunk_bytes: Optional[int] = None,
    fused: Optional[bool] = None,
):
    """(gq, gk, gw) for ``grad`` = d loss / d values [B, S, k]; an input that needs no
    gradient (``needs``) gets an empty tensor. ``fused``: the per-row part as one Triton
    kernel (``triton_values_backward``; default: on CUDA unless ``HYSCALE_BWD_FUSED=0``,
    where the spec is covered; tests run it on the CPU under TRITON_INTERPRET=1)."""
    topk = idx.shape[-1]
    shape = check_operands(q, k, w, masks, topk, spec)
    B, S, H, D, T, Hk = shape
    if tuple(grad.shape) != (B, S, topk) or tuple(idx.shape) != (B, S, topk):
        raise ValueError(f"grad {tuple(grad.shape)} and idx {tuple(idx.shape)} must both be [B,S,k]={(B, S, topk)}")
    need_q, need_k, need_w = needs[0], needs[1], needs[2] and w is not None
    f32 = torch.float32
    gq = torch.zeros(q.shape, dtype=f32, device=q.device) if need_q else None
    gk = torch.zeros(k.shape, dtype=f32, device=k.device) if need_k else None
    gw = torch.zeros(w.shape, dtype=f32, device=w.device) if need_w else None
    if chunk_bytes is None:
        chunk_bytes = DEFAULT_CHUNK_BYTES.get(q.device.type, DEFAULT_CHUNK_BYTES["cpu"])
    if fused is None:
        fused = q.device.type == "cuda" and os.environ.get("HYSCALE_BWD_FUSED", "1") != "0"
    if fused:
        from . import attention_backward as ab  # (it imports this module)
        from . import triton_values_backward as tvb

        fused = tvb.supported(spec)
    if topk > 0 and (need_q or need_k or need_w):
        per_row = 4 * topk * (2 * Hk * D + 4 * H)  # gathered keys + their grad, logits + temporaries
        if fused:  # the per-slot key contributions, [rows, k] temporaries and the key sort's
            per_row = topk * (4 * Hk * D + 64)
        rows = max(1, chunk_bytes // per_row)
        for b in range(B):
            kb = k[b if k.shape[0] == B else 0]  # [T, Hk, D]
            for s0 in range(0, S, rows):
                s1 = min(S, s0 + rows)
                keys = idx[b : b + 1, s0:s1].long()
                if fused:
                    gy = tvb.post_backward(grad[b : b + 1, s0:s1].to(f32), masks, spec, keys, b, b + 1, s0, s1,
                                           B, S, T)
                    if need_k:  # the kernel writes each slot's key row at its key-sorted position
                        skeys, dest, bounds = ab.key_runs(keys.flatten(), T)
                    g_q, contrib, g_w = tvb.rows_backward_fused(
                        gy[0], q[b, s0:s1], kb, w[b, s0:s1] if w is not None else None, keys[0], spec,
                        (need_q, need_k, need_w), dest=dest if need_k else None)
                    if need_q:
                        gq[b, s0:s1] = g_q
                    if need_k:
                        ab.sorted_segment_sum_(gk[b if k.shape[0] == B else 0], skeys, bounds, contrib)
                    if need_w:
                        gw[b, s0:s1] = g_w
                    continue
                qc = q[b : b + 1, s0:s1].to(f32)
                ks = kb[keys].to(f32)  # [1, ns, k, Hk, D]
                wc = w[b : b + 1, s0:s1].to(f32) if w is not None else None
                g_q, g_ks, g_w = rows_backward(grad[b : b + 1, s0:s1].to(f32), qc, ks, wc, masks, spec, keys,
                                               b, b + 1, s0, s1, shape)
                if need_q:
                    gq[b : b + 1, s0:s1] = g_q
                if need_k:
                    _add_key_grads(gk[b if k.shape[0] == B else 0], keys.flatten(), g_ks)
                if need_w:
                    gw[b : b + 1, s0:s1] = g_w
    empty = q.new_empty(0)
    return (
        gq.to(q.dtype) if gq is not None else empty,
        gk.to(k.dtype) if gk is not None else empty,
        gw.to(w.dtype) if gw is not None else empty,
    )
