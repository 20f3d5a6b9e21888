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
from .reference import _apply_elementwise, _capturing
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
        return dense_rows_forward(q, k, v, idx, masks, spec, out, lse, probs, return_probs, dtype)
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
    return dense_rows_forward(q, k, v, idx, masks, spec, out, lse, probs, return_probs, dtype)


# ------------------------------------------------------------------------------------------
# empty_row="dense": the rows without a visible selected key, recomputed over every key
# ------------------------------------------------------------------------------------------


def flagged_rows(lse: torch.Tensor, spec: AttentionSpec, backward: bool = False) -> torch.Tensor:
    """[B, S, H] bool: the (row, head)s ``dense_rows_forward`` recomputes (``backward``: the
    superset the backward recomputes, read from the forward's lse, see there)."""
    fill = spec.dense_fill[0]
    return ~(lse > (fill / 4 if backward else fill / 2))


def dense_blocks(flag: torch.Tensor, step: int):
    """The (b, s0, s1) row blocks of ``step`` rows (fixed: [i step, (i + 1) step)) holding a
    flagged (row, head), in (b, s0) order; one host synchronization. Inside a CUDA graph
    capture, which allows none, every block (its unflagged rows kept by the callers' where:
    the dense attention's cost, but the captured graph is right for any mask it replays)."""
    B, S, _ = flag.shape
    nb = -(-S // step)
    if _capturing(flag.device):
        return [(b, i * step, min(S, (i + 1) * step)) for b in range(B) for i in range(nb)]
    any_row = flag.any(-1)
    pad = nb * step - S
    if pad:
        any_row = torch.cat([any_row, any_row.new_zeros((B, pad))], 1)
    hit = any_row.view(B, nb, step).any(-1).nonzero().tolist()
    return [(b, i * step, min(S, (i + 1) * step)) for b, i in hit]


def dense_chunk_rows(q, k, v, spec: AttentionSpec) -> int:
    """Rows per dense block: ``chunk_rows`` with all T keys as the slots."""
    return chunk_rows(q.device, q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3],
                      len(spec.post) + 2)


def dense_logits(q, k, idx, masks, spec: AttentionSpec, b, s0, s1, dtype):
    """The original's logits of rows (b, s0:s1) at every key, [H, n, T]: the spec's at the
    selected keys, post[at + replaces:](post[:at](x) + fill) at the others (``dense_fill``).
    Also every post step's output at every key (for the backward) and the [n, T] selected
    keys."""
    B, S, T = q.shape[0], q.shape[1], k.shape[1]
    every = torch.arange(T, device=q.device).expand(B, S, T)
    outs, kb, mkeys = score_slots(q, k, every, masks, spec, b, s0, s1, dtype)
    del kb
    fill, at, replaces = spec.dense_fill
    sel = torch.zeros((s1 - s0, T), dtype=torch.bool, device=q.device)
    sel.scatter_(1, idx[b, s0:s1].long(), True)
    u = outs[at] + fill
    for st in spec.post[at + replaces:]:
        u = _apply_elementwise(u, st)
    return torch.where(sel, outs[-1], u), outs, sel, mkeys


def dense_rows_forward(q, k, v, idx, masks, spec: AttentionSpec, out, lse, probs, return_probs: bool = False,
                       dtype: torch.dtype = torch.float32):
    """``empty_row="dense"``: the (row, head)s that may differ from the original, recomputed
    as the original, over all T keys; ``out``, ``lse`` and ``probs`` updated in place and
    returned (any other ``empty_row``: returned as they are).

    Why a row that is not flagged is the original's. Assumption (the one the compile-time
    proof, ``passes/visible_rows.py``, makes too): every logit before the index mask's add
    (the scores with the steps and masks before it) is below |fill| / 2 - 128 (finfo.min
    fills: about 1.7e38; finfo(float16).min: 32624). At an unselected key the original's
    logit is then z + fill < fill / 2 - 128 (a later "round" keeps it there or makes it
    -inf). A row (b, s, h) is not flagged when its slot lse > fill / 2, so its best selected
    logit M >= lse - log k > fill / 2 - log k: every unselected key has
    exp(logit - M) < exp(-100) == 0 in fp32 (and in bf16 and fp16), the original's row
    maximum is M, and its softmax over T keys is the op's over the k slots, the unselected
    keys' weights exactly 0. A flagged row (lse <= fill / 2 or -inf: no selected key left
    visible, a padding row, or a row whose visible keys are all unselected) is computed here
    as the original: its T logits (``dense_logits``), the softmax in fp32 as the op's own
    (a row whose every key is -inf gives NaN, as the plain softmax), @ v. Only the flagged
    (row, head)s of ``out`` are written. ``lse`` of a flagged head is the log-sum-exp over
    all T keys (the original's), which is <= fill / 2 + log T <= fill / 4, so the backward's
    test (lse <= fill / 4, ``flagged_rows(backward=True)``) finds every flagged head (and
    perhaps a few unflagged ones, whose dense gradients are the sparse ones: their
    unselected weights are 0). ``probs`` of a row with a flagged head is the original's
    probability at each selected key, summed over the heads (for an unflagged head the same
    as the sparse one: its unselected weights are 0).

    Cost: the flagged rows are found per call (one host synchronization; inside a CUDA graph
    capture every block is computed instead, ``dense_blocks``); rows are taken in fixed blocks of ``dense_chunk_rows`` and
    each block holding a flagged row is computed densely, O(block x T) memory (the gathered
    keys of ``score_slots`` at every key) and O(block x T x D) work. Padding rows are
    contiguous, so a batch with P padded rows costs about P x T (rounded up to blocks) on
    top of the sparse op; rows scattered over every block would cost the dense attention."""
    if spec.empty_row != "dense":
        return out, lse, probs
    B, S, H, _ = q.shape
    T, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
    if B * S * H == 0 or T == 0:
        return out, lse, probs
    flag = flagged_rows(lse, spec)
    stat = lse.dtype
    for b, s0, s1 in dense_blocks(flag, dense_chunk_rows(q, k, v, spec)):
        y, outs, _sel, _ = dense_logits(q, k, idx, masks, spec, b, s0, s1, dtype)
        del outs
        n = s1 - s0
        m0 = y.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m0), m0, torch.zeros_like(m0))
        e = torch.exp(y - m)
        l = e.sum(-1, keepdim=True)
        p = e / l
        vt = v[b].transpose(0, 1).to(dtype)  # [Hk, T, Dv]
        o = torch.matmul(rows_to_heads(p, Hk), vt.unsqueeze(1)).permute(1, 0, 2, 3).reshape(n, H, Dv)
        f = flag[b, s0:s1]  # [n, H]
        out[b, s0:s1] = torch.where(f.unsqueeze(-1), o.to(out.dtype), out[b, s0:s1])
        lse[b, s0:s1] = torch.where(f, (m + torch.log(l)).squeeze(-1).transpose(0, 1).to(stat), lse[b, s0:s1])
        if return_probs and probs.numel():
            K = idx.shape[-1]
            at = p.gather(-1, idx[b, s0:s1].long().unsqueeze(0).expand(H, n, K)).sum(0).to(probs.dtype)
            probs[b, s0:s1] = torch.where(f.any(-1, keepdim=True), at, probs[b, s0:s1])
    return out, lse, probs
