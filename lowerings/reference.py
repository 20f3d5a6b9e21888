"""The CPU implementation of the op, and the reference every kernel is tested against.

It interprets a ``ScoreSpec`` with plain PyTorch, streaming over key chunks and query
chunks, so memory is O(rows x k + one chunk) and the full query x key table is never
built. Selection is exact with the project's tie rule: value descending, then key index
ascending (a stable sort over candidates that arrive in ascending key order).
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .mask_kinds import check_mask_operands, kind_of
from .spec import MaskTerm, ScoreSpec, SpecError, dtype_of, kernel_plan

# Bytes of fp32 per-head logits one step may hold: rows x heads x keys x 4.
DEFAULT_CHUNK_BYTES = int(os.environ.get("HYSCALE_CPU_CHUNK_BYTES", 16 << 20))


def index_dtype(num_keys: int) -> torch.dtype:
    """int32 indices while every key index fits, else int64 (docs/contract.md, 'Values and gradients')."""
    return torch.int32 if num_keys < 2**31 else torch.int64


def _known(cond) -> bool:
    """``cond`` holds: a plain bool when the op runs; on the rewrite's fake operands (symbolic
    sizes) only where the shape environment proves it for every size the graph admits."""
    return statically_known_true(cond)


def check_operands(q, k, w, masks, topk, spec: ScoreSpec, dtypes: bool = True):
    """Shape/dtype checks shared by every implementation; returns (B, S, H, D, T, Hk).
    ``dtypes=False``: any float operands (the float64 oracle, ``dense_scores``).

    The rewrite runs them on the fake operands (``node.meta["val"]``) before it replaces a
    site (``passes/rewrite.py``), so a call it emits cannot fail them at run time: they read
    only shapes and dtypes, and compare sizes without guarding on symbolic ones."""
    if q.dim() != 4 or k.dim() != 4:
        raise SpecError(f"q must be [B,S,H,D] and k [B,T,Hk,D]; got {tuple(q.shape)} and {tuple(k.shape)}")
    B, S, H, D = q.shape
    Bk, T, Hk, Dk = k.shape
    if not (_known(Dk == D) and (_known(Bk == B) or _known(Bk == 1)) and _known(Hk > 0) and _known(H % Hk == 0)):
        raise SpecError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not contract (need same D, batch, H % Hk == 0)")
    if spec.reduce == "weighted_sum":
        if w is None or w.dim() != 3 or not all(_known(a == b) for a, b in zip(w.shape, (B, S, H))):
            raise SpecError(f"weighted_sum needs w of shape [B,S,H]={(B, S, H)} (weights that broadcast to it "
                            f"are passed expanded, a stride-0 view); got {None if w is None else tuple(w.shape)}")
    elif w is not None:
        raise SpecError(f"reduce={spec.reduce!r} takes no weights")
    if spec.reduce == "none" and not _known(H == 1):
        raise SpecError("reduce='none' needs H == 1 (fold heads into the batch)")
    # (a k out of range only where it provably is: the graph's own top-k checks it at run time)
    if _known(topk < 0) or _known(topk > T):
        raise SpecError(f"k={topk} must be in [0, T={T}]")
    spec.validate(num_mask_operands=len(masks))
    if dtypes:
        check_operand_dtypes(q, k, w)
    check_mask_operands(spec.masks, masks, B, S, T)  # each kind's shape and dtype rules
    # run-time scalars (``resolve_operands`` reads them; at run time they are constants already)
    for st in tuple(spec.epilogue) + tuple(spec.post):
        if st[0] in ("mul_operand", "div_operand"):
            m = masks[st[1]]
            if not (_known(m.numel() == 1) and m.is_floating_point()):
                raise SpecError(f"step {st!r}: operand has shape {tuple(m.shape)} and dtype {m.dtype}, "
                                "expected a floating-point scalar")
    return B, S, H, D, T, Hk


# The operand dtypes the spec's arithmetic describes (docs/contract.md, "Exact along the
# graph's own dtype path"): each of q, k and w fp32, or bf16/fp16 that the graph upcast
# exactly to fp32 before the contraction (any pair, QSA's bf16 queries x fp32 keys
# included). A float64 score path is selected from the table instead, never fused: the op
# would compute it in fp32.
OPERAND_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_operand_dtypes(q, k, w) -> None:
    for name, t in (("q", q), ("k", k), ("w", w)):
        if t is not None and t.dtype not in OPERAND_DTYPES:
            raise SpecError(f"{name} has dtype {t.dtype}; the op scores in fp32 from float32, bfloat16 or float16 "
                            "operands (float64 and integer operands are not part of any score description)")


def _apply_elementwise(x: torch.Tensor, step, inplace: bool = False) -> torch.Tensor:
    """One spec step. ``inplace``: ``x`` is a temporary the caller owns (no autograd):
    writing into it saves a fresh allocation per step, which on the CPU costs more than
    the arithmetic (page faults on a new multi-MiB buffer)."""
    op = step[0]
    if op == "mul":
        return x.mul_(step[1]) if inplace else x * step[1]
    if op == "add":
        return x.add_(step[1]) if inplace else x + step[1]
    if op == "div":
        return x.div_(step[1]) if inplace else x / step[1]
    if op == "relu":
        if len(step) > 1 and not inplace:  # the graph's own op, for its autograd at x == 0
            return torch.clamp_min(x, 0.0) if step[1] == "clamp_min" else torch.maximum(x, torch.zeros_like(x))
        return x.relu_() if inplace else torch.relu(x)
    if op == "neg":
        return x.neg_() if inplace else -x
    if op == "sigmoid":
        return x.sigmoid_() if inplace else torch.sigmoid(x)
    if op == "round":
        return x.to(dtype_of(step[1])).to(x.dtype)
    if op == "mod":
        from . import mods

        return mods.apply(step[1], x)
    raise SpecError(f"unknown step {step!r}")


def _apply_mask(y, term: MaskTerm, masks, b0, b1, s0, s1, t0, t1, B, S, T, keys=None):
    """y: [b1-b0, s1-s0, n] fp32 scores of keys [t0, t1), or of the key indices ``keys``
    ([b1-b0, s1-s0, n] int64) when given (the sparse backward scores selected keys): the
    term's kind's reference piece (``mask_kinds``)."""
    return kind_of(term).reference(y, masks, b0, b1, s0, s1, t0, t1, B, S, T, keys=keys)


def finish_scores(x, wb, spec: ScoreSpec, apply_mask) -> torch.Tensor:
    """Per-head logits x [nb, ns, H, n] -> scores [nb, ns, n]: logit rounding, epilogue,
    head reduction, post steps (``apply_mask(y, term)`` applies one mask term)."""
    dtype = x.dtype
    inplace = not (torch.is_grad_enabled() and x.requires_grad)  # x: the contraction's fresh output
    if spec.logit_dtype != "float32":
        x = x.to(dtype_of(spec.logit_dtype)).to(dtype)
    for step in spec.epilogue:
        x = _apply_elementwise(x, step, inplace)
    if spec.reduce == "weighted_sum":
        y = torch.matmul(wb.to(dtype).unsqueeze(-2), x).squeeze(-2)
    elif spec.reduce == "sum":
        y = x.sum(dim=2)
    else:
        y = x[:, :, 0]
    for step in spec.post:
        if step[0] == "mask":
            y = apply_mask(y, spec.masks[step[1]])
        else:
            y = _apply_elementwise(y, step)
    return y


def score_block(q, k, w, masks, spec: ScoreSpec, b0, b1, s0, s1, t0, t1, shape, dtype=torch.float32) -> torch.Tensor:
    """Scores for rows [b0,b1) x [s0,s1) and keys [t0,t1), as ``dtype`` [b, s, t].

    fp32 is the op's arithmetic (bf16/fp16 operands upcast exactly: dtype rule 1);
    tests pass float64 to get the reference the threshold check compares against."""
    B, S, H, D, T, Hk = shape
    G = H // Hk
    qb = q[b0:b1, s0:s1].to(dtype)
    kb = k[slice(b0, b1) if k.shape[0] == B else slice(None), t0:t1].to(dtype)
    if kb.shape[0] != qb.shape[0]:
        kb = kb.expand(qb.shape[0], *kb.shape[1:])
    nb, ns, nt = qb.shape[0], qb.shape[1], kb.shape[1]
    # [nb, Hk, ns*G, D] @ [nb, Hk, D, nt] -> [nb, Hk, ns*G, nt] -> [nb, ns, H, nt]
    qg = qb.view(nb, ns, Hk, G, D).permute(0, 2, 1, 3, 4).reshape(nb, Hk, ns * G, D)
    kg = kb.permute(0, 2, 3, 1)
    x = torch.matmul(qg, kg).view(nb, Hk, ns, G, nt).permute(0, 2, 1, 3, 4).reshape(nb, ns, H, nt)
    wb = w[b0:b1, s0:s1] if spec.reduce == "weighted_sum" else None
    return finish_scores(x, wb, spec, lambda y, term: _apply_mask(y, term, masks, b0, b1, s0, s1, t0, t1, B, S, T))


def _hidden_everywhere(spec: ScoreSpec, masks, b0, b1, s0, s1, t0, t1, B, S, terms, guard, proven) -> bool:
    """True when some -inf range term of ``terms`` (``skippable_mask_terms``) hides every key
    of [t0, t1) for every row (a term of ``guard``, the spec's ``finite_guard``, only while
    ``proven()``: its checks hold for this call)."""
    for j in terms:
        if guard is not None and j in guard.terms and not proven():
            continue
        if kind_of(spec.masks[j]).hides_block(masks, b0, b1, s0, s1, t0, t1, B, S):
            return True
    return False


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream: then no
    device value may be read on the host (the read fails the capture)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def streaming_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    w: Optional[torch.Tensor],
    masks: Sequence[torch.Tensor],
    topk: int,
    spec: ScoreSpec,
    return_values: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
):
    """Exact top-k of the described scores; returns idx [B,S,k] (and values)."""
    shape = check_operands(q, k, w, masks, topk, spec)
    B, S, H, D, T, Hk = shape
    device = q.device
    idx_out = torch.empty((B, S, topk), dtype=index_dtype(T), device=device)
    val_out = torch.empty((B, S, topk), dtype=dtype_of(spec.score_dtype), device=device) if return_values else None
    if topk == 0 or B == 0 or S == 0:
        return (val_out, idx_out) if return_values else idx_out
    # Key chunk of at least max(k, 256) keys keeps the merge cheap relative to the dot.
    tc = max(256, min(T, 1024))
    rows = max(1, chunk_bytes // (4 * H * tc))
    # the chunk skips below read device values on the host; they never change the result,
    # so a CUDA graph capture runs without them
    shortcuts = not _capturing(device)

    plan = kernel_plan(spec)  # once per call, not per chunk
    skip_terms, guard = plan.skippable, plan.guard
    proof = []

    def proven():
        # finite_guard's checks, once per call and only when a chunk could be skipped
        if not proof:
            from .score_bound import finite_holds

            proof.append(finite_holds(spec, q, k, w, masks, guard))
        return proof[0]

    for b in range(B):
        for s0 in range(0, S, rows):
            s1 = min(S, s0 + rows)
            # Running candidates per row, in ascending key order (so among equal scores
            # the earlier entry is the smaller key index): values, order keys, indices.
            vals = torch.empty((1, s1 - s0, 0), dtype=torch.float32, device=device)
            keys = torch.empty((1, s1 - s0, 0), dtype=torch.int64, device=device)
            inds = torch.empty((1, s1 - s0, 0), dtype=torch.int64, device=device)
            kth = None  # per-row k-th best order key once every row holds k candidates
            for t0 in range(0, T, tc):
                t1 = min(T, t0 + tc)
                if shortcuts and kth is not None and bool((vals > -math.inf).sum(-1).min() >= topk) and \
                        _hidden_everywhere(spec, masks, b, b + 1, s0, s1, t0, t1, B, S, skip_terms, guard,
                                           proven):
                    continue  # nothing in this chunk can reach any row's top-k
                y = score_block(q, k, w, masks, spec, b, b + 1, s0, s1, t0, t1, shape)
                yk = order_keys(y)
                if shortcuts and kth is not None and not bool((yk > kth).any()):
                    continue  # no candidate beats any row's current k-th (ties lose: larger index)
                t_idx = torch.arange(t0, t1, device=device).expand_as(y)
                vals, keys, inds = _merge(vals, keys, inds, y, yk, t_idx, topk)
                if keys.shape[-1] == topk:
                    kth = keys.amin(-1, keepdim=True)
            # (value desc, index asc): a stable sort of index-ascending candidates
            order = torch.sort(keys, dim=-1, descending=True, stable=True).indices
            idx_out[b, s0:s1] = torch.gather(inds, -1, order)[0].to(idx_out.dtype)
            if return_values:
                val_out[b, s0:s1] = torch.gather(vals, -1, order)[0].to(val_out.dtype)
    return (val_out, idx_out) if return_values else idx_out


def order_keys(y: torch.Tensor) -> torch.Tensor:
    """fp32 scores -> int64 keys in the same order as torch.sort's: -0.0 equals +0.0 and
    every NaN is above +inf (the kernel's ``_pack`` high word)."""
    y = torch.where(y == 0, 0.0, y).to(torch.float32)
    b = y.view(torch.int32).to(torch.int64)
    b = torch.where(b < 0, b ^ 0x7FFFFFFF, b)
    return torch.where(torch.isnan(y), 1 << 40, b)


def _merge(vals, keys, inds, y, yk, t_idx, topk):
    """The k best of (running candidates ++ a new chunk of later keys), in key order.

    Exact without sorting: the k-th largest order key comes from ``torch.topk`` (its value
    does not depend on how topk breaks ties); every candidate above it is kept, and of the
    candidates equal to it the earliest (smallest key index) fill the remaining slots."""
    cv = torch.cat([vals, y], dim=-1)
    ck = torch.cat([keys, yk], dim=-1)
    ci = torch.cat([inds, t_idx], dim=-1)
    if ck.shape[-1] <= topk:
        return cv, ck, ci
    kth = torch.topk(ck, topk, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above = ck > kth
    tied = ck == kth
    need = topk - above.sum(-1, keepdim=True)
    take = above | (tied & (tied.cumsum(-1) <= need))
    # compaction that keeps the order: taken entry j goes to slot (#taken before j)
    slot = torch.where(take, take.cumsum(-1) - 1, topk)
    shape = (*ck.shape[:-1], topk + 1)
    out = [torch.zeros(shape, dtype=x.dtype, device=x.device).scatter_(-1, slot, x)[..., :topk] for x in (cv, ck, ci)]
    return out[0], out[1], out[2]


def dense_scores(q, k, w, masks, spec: ScoreSpec, dtype=torch.float32) -> torch.Tensor:
    """The whole [B, S, T] table through the same arithmetic (tests and small shapes only)."""
    shape = check_operands(q, k, w, masks, 0, spec, dtypes=False)
    B, S, H, D, T, Hk = shape
    return score_block(q, k, w, masks, spec, 0, B, 0, S, 0, T, shape, dtype)


def table_topk(x: torch.Tensor, topk: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """Indices of the top-k along the last dim of a score table that already exists, by the
    tie rule (value desc, index asc; NaN above everything, as ``torch.topk``). Rows are
    sorted in chunks so the sort's workspace stays near ``chunk_bytes``."""
    if not x.is_floating_point():
        raise SpecError(f"table_topk: the scores must be floating point, got {x.dtype}")
    T = x.shape[-1] if x.dim() else 1
    if not 0 <= topk <= T:
        raise SpecError(f"table_topk: k={topk} must be in [0, {T}] (the size of the last dim)")
    rows = x.reshape(-1, T) if x.dim() else x.reshape(1, 1)
    out = torch.empty((rows.shape[0], topk), dtype=index_dtype(T), device=x.device)
    step = max(1, chunk_bytes // max(1, 16 * T))  # values + int64 indices, twice
    for r0 in range(0, rows.shape[0], step):
        part = rows[r0 : r0 + step]
        out[r0 : r0 + step] = torch.sort(part, dim=-1, descending=True, stable=True).indices[:, :topk].to(out.dtype)
    return out.view(*x.shape[:-1], topk) if x.dim() else out.view(topk)


def stable_topk(scores: torch.Tensor, topk: int):
    """(values, indices) by (value desc, index asc) over the last dim: the tie rule."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    return torch.gather(scores, -1, order), order
