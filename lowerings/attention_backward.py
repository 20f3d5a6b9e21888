"""The sparse attention's backward: gradients at the k selected keys, bitwise reproducible.

For one chunk of query rows it gathers the rows' k keys and values at the forward's saved
indices (nothing re-selects, no index mask is built), recomputes the probabilities over the
k slots with the forward's arithmetic (the rows' empty ones, lse -inf, from the saved
log-sum-exp), runs the softmax's and the post steps' derivatives, and gives

    gq[b, s]          = sum_j dy[h, j] k[t_j]                 (per row: no reduction across rows)
    gk[b, t]         += sum over (s, j) with idx[b, s, j] = t of dy[h, s, j] q[b, s]
    gv[b, t]         += sum over the same (s, j) of P[h, s, j] dO[b, s]

The key side sums contributions of many rows into one key. ``index_add_`` on CUDA does
that with floating-point atomics, whose order (so whose low bits) changes between runs.
Here every key's contributions are added in one fixed order, (row, slot) ascending, onto
the key's running value:

* CUDA: a key-major inversion of the chunk's indices (a stable sort of the flattened
  (row, slot) -> key) and ``_segment_sum_kernel``, where one program owns one key (per
  key head and feature block) and adds its contributions in sorted order: no atomics,
  each output written by one program. (Not ``torch.use_deterministic_algorithms``: that
  is process-wide state, which an op must not set behind the user's back.)
* CPU: ``index_add_``, whose CPU kernel loops over the index in order, one slice add per
  entry: the same order (``tests/test_attention_op.py`` checks the two agree bit for bit).

On CUDA the op runs the Triton kernels of ``triton_attention_backward`` (the same math,
the same key-major reduction) for every spec they differentiate; this chunked PyTorch path
is the CPU's, the oracle, and the CUDA fallback. ``HYSCALE_ATTN_BWD`` (``backward_mode``)
picks on CUDA: ``deterministic`` (default, the kernels), ``atomic`` (the kernels with fp32
atomics for dK / dV: faster, not bitwise reproducible; opt-in only) or ``pytorch`` (this path,
for A/B runs; ``HYSCALE_KERNEL=reference`` also selects it).

Chunks follow each other in row order, so the whole sum is sequential in (row, slot) order
whatever the chunking. Chunk sizes are a function of the shapes and the device type only
(``DEFAULT_CHUNK_BYTES``), so the matmuls see the same problem sizes on every run (cuBLAS
gives the same bits for the same problem on the same GPU model); everything else is
elementwise or a fixed-shape reduction.
Memory: O(rows per chunk x k x Hk x D) plus the fp32 [B, T, Hk, D] key gradients; no
[S, T] tensor.

This runs inside a custom op, below autograd, so the chain rule is written out. Each post
step's derivative is the one autograd gives the original graph's op
(``backward._step_grad`` / ``_mask_grad``): a fill passes no gradient to the slots it
hides. The softmax's ``delta`` is sum_j P dP / sum_j P, from the fp32 probabilities (not the
rounded output), in two steps (see the loop: dP - delta cancels where one slot holds most of
P). A row whose every slot is hidden (lse -inf; out NaN, or 0 under ``empty_row="zero"``)
passes no gradient at all, as the safe softmax's ``where`` passes none to such a row.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from .attention_spec import AttentionSpec
from .backward import _post_backward
from .spec import SpecError

# Bytes of per-chunk temporaries (gathered keys and values, their gradients, the per-head
# logits): cache-sized on the CPU; on a GPU large, so each chunk's few dozen launches do
# enough work to hide their overhead (S = 128K is thousands of chunks at this size).
DEFAULT_CHUNK_BYTES = {"cpu": 64 << 20, "cuda": 2 << 30}
if "HYSCALE_ATTN_CHUNK_BYTES" in os.environ:
    DEFAULT_CHUNK_BYTES = {d: int(os.environ["HYSCALE_ATTN_CHUNK_BYTES"]) for d in DEFAULT_CHUNK_BYTES}

_BLOCK_F = 1024  # at most this many features per program of the segment sum
# Contributions a program loads at once: a key's run is a chain of dependent adds, so one
# load per step would leave each step waiting a full memory latency; UNROLL independent
# loads are issued together, then added one after another in order.
_UNROLL = 8


@triton.jit
def _run_sum(SRC, ORDER, OUT, key, i, end, offs, ok, h, N, F, HK, UNROLL: tl.constexpr,
             GATHER: tl.constexpr = True):
    # the run [i, end) of sorted positions: its rows of SRC[h], in sorted order, added onto
    # OUT[key, h]. GATHER: sorted position p is row ORDER[p] of SRC; otherwise SRC is already
    # in sorted order (``key_runs``' dest layout) and the run is one contiguous read
    dst = OUT + (key.to(tl.int64) * HK + h) * F + offs
    src = SRC + h * N * F + offs
    acc = tl.load(dst, mask=ok, other=0.0)
    for p0 in range(i.to(tl.int64), end, UNROLL):
        for u in tl.static_range(UNROLL):
            live = p0 + u < end
            if GATHER:
                r = tl.load(ORDER + p0 + u, mask=live, other=0).to(tl.int64)
            else:
                r = p0 + u
            x = tl.load(src + r * F, mask=ok & live, other=0.0)
            # past the run's end: no add at all (acc + 0.0 would turn a -0.0 into +0.0)
            acc = tl.where(live, acc + x, acc)
    tl.store(dst, acc, mask=ok)


@triton.jit
def _segment_sum_kernel(SRC, ORDER, SKEYS, END, OUT, N, F, HK, BLOCK_F: tl.constexpr, UNROLL: tl.constexpr):
    # Program (i, f, h): sorted position i, features [f * BLOCK_F, ...) of key head h. Only
    # the first position of each key's run works: it adds the run's rows of SRC[h], in
    # sorted order, onto OUT[key, h] and stores it. One program per key, head and feature
    # block, so no atomics.
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    h = tl.program_id(2).to(tl.int64)
    ok = offs < F
    key = tl.load(SKEYS + i)
    prev = tl.load(SKEYS + tl.maximum(i - 1, 0))
    if (i == 0) | (prev != key):
        _run_sum(SRC, ORDER, OUT, key, i, tl.load(END + i), offs, ok, h, N, F, HK, UNROLL)


@triton.jit
def _segment_runs_kernel(SRC, ORDER, SKEYS, END, STARTS, NRUNS, OUT, N, F, HK, BLOCK_F: tl.constexpr,
                         UNROLL: tl.constexpr):
    # _segment_sum_kernel with program j on the j-th run (STARTS[j], its first sorted
    # position): a grid of at most the key count, not one program per position of which
    # all but each run's first would exit at once
    j = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    h = tl.program_id(2).to(tl.int64)
    ok = offs < F
    if j < tl.load(NRUNS):
        i = tl.load(STARTS + j)
        _run_sum(SRC, ORDER, OUT, tl.load(SKEYS + i), i, tl.load(END + i), offs, ok, h, N, F, HK, UNROLL)


@triton.jit
def _sorted_runs_kernel(SRC, SKEYS, BOUNDS, OUT, N, F, HK, BLOCK_F: tl.constexpr, UNROLL: tl.constexpr):
    # Program (j, f, h): the j-th run of sorted keys, positions [BOUNDS[j], BOUNDS[j + 1]), whose
    # rows of SRC[h] are already in sorted order (``key_runs``' dest layout): _run_sum over
    # the contiguous run. No program past the last run does anything.
    j = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    h = tl.program_id(2).to(tl.int64)
    ok = offs < F
    i = tl.load(BOUNDS + j)
    end = tl.load(BOUNDS + j + 1)
    if i < end:
        _run_sum(SRC, SKEYS, OUT, tl.load(SKEYS + i), i, end, offs, ok, h, N, F, HK, UNROLL, False)


def key_order(keys: torch.Tensor, bound: int = None):
    """The key-major inversion of flattened (row, slot) -> key indices ``keys`` [N]:
    (sorted keys, order: sorted position -> (row, slot) position, end: each sorted
    position's one-past-its-run). A stable sort, so a key's contributions stay in (row,
    slot) order; deterministic on CUDA (a stable sort's result is unique). ``bound``: the
    keys are in [0, bound); below 2^31 they are sorted as int32 (half the radix passes,
    the same permutation)."""
    if bound is not None and bound <= 2 ** 31 - 1 and keys.dtype == torch.int64:
        keys = keys.int()
    skeys, order = torch.sort(keys, stable=True)
    end = torch.searchsorted(skeys, skeys, right=True)
    return skeys, order, end


def run_starts(skeys: torch.Tensor, most: int):
    """(starts, nruns) of sorted keys ``skeys`` [N] with at most ``most`` distinct values:
    starts[j] the first sorted position of the j-th run (N from nruns on), nruns a 1-element
    device tensor; no host synchronization."""
    N = skeys.numel()
    first = torch.ones(N, dtype=torch.bool, device=skeys.device)
    torch.ne(skeys[1:], skeys[:-1], out=first[1:])
    run = torch.cumsum(first, 0) - 1  # each sorted position's run, non-decreasing
    starts = torch.searchsorted(run, torch.arange(min(most, N), device=skeys.device))
    return starts, run[-1:] + 1


def key_runs(keys: torch.Tensor, bound: int):
    """The key-sorted layout of flattened (row, slot) -> key indices ``keys`` [N] in [0, bound):
    (sorted keys, dest: each (row, slot) position's sorted position (the inverse of
    ``key_order``'s stable order), bounds [min(bound, N) + 1]: bounds[j] the first sorted
    position of the j-th run of equal keys, N past the last run). A producer that writes
    position i's row at dest[i] lets ``sorted_segment_sum_`` read each key's run contiguously,
    in the order ``segment_sum_`` gathers it. No host synchronization."""
    skeys, order = torch.sort(keys.int() if bound <= 2 ** 31 - 1 else keys, stable=True)
    N = keys.numel()
    itype = torch.int32 if N <= 2 ** 31 - 1 else torch.int64
    dest = torch.empty(N, dtype=itype, device=keys.device)
    dest.scatter_(0, order, torch.arange(N, dtype=itype, device=keys.device))
    first = torch.ones(N, dtype=torch.bool, device=keys.device)
    torch.ne(skeys[1:], skeys[:-1], out=first[1:])
    run = torch.cumsum(first, 0) - 1  # each sorted position's run, non-decreasing
    bounds = torch.searchsorted(run, torch.arange(min(bound, N) + 1, device=keys.device))
    return skeys, dest, bounds


def sorted_segment_sum_(out: torch.Tensor, skeys: torch.Tensor, bounds: torch.Tensor, src: torch.Tensor,
                        unroll: int = 16) -> torch.Tensor:
    """``segment_sum_`` over contributions already in key-sorted order: out[skeys[p], h] +=
    src[h, p] for p = 0, 1, ... (``key_runs``' skeys and bounds; src [Hk, N, F] fp32, row i of
    the unsorted layout at dest[i]). The same additions in the same order as ``segment_sum_``
    of the unsorted rows, so the same bits; each key's run is one contiguous read."""
    Hk, N, F = src.shape
    if N == 0 or F == 0 or Hk == 0:
        return out
    assert out.is_contiguous() and out.dtype == torch.float32 and tuple(out.shape[1:]) == (Hk, F)
    assert src.is_contiguous() and skeys.numel() == N
    block = min(_BLOCK_F, triton.next_power_of_2(F))
    _sorted_runs_kernel[(bounds.numel() - 1, triton.cdiv(F, block), Hk)](src, skeys, bounds, out, N, F, Hk,
                                                                       BLOCK_F=block, UNROLL=unroll)
    return out


def segment_sum_(out: torch.Tensor, keys: torch.Tensor, src: torch.Tensor, use_kernel: bool = None) -> torch.Tensor:
    """out[keys[i], h] += src[h, i] for i = 0, 1, ... in that order, for each head h: fp32
    ``out`` [T, Hk, F] (contiguous), int64 ``keys`` [N], fp32 ``src`` [Hk, N, F] (the
    head-major per-slot gradients); [T, F] and [N, F] for one head. ``use_kernel``: the
    Triton segment sum (default: on CUDA; tests also run it on the CPU under
    TRITON_INTERPRET=1)."""
    if out.dim() == 2:
        out3, src = out.unsqueeze(1), src.unsqueeze(0)
    else:
        out3 = out
    Hk, N, F = src.shape
    if use_kernel is None:
        use_kernel = out.device.type == "cuda"
    if not use_kernel:  # one index_add_ over every head's features (a strided one is slower)
        out3.view(out3.shape[0], Hk * F).index_add_(0, keys, src.permute(1, 0, 2).reshape(N, Hk * F))
        return out
    if N == 0 or F == 0 or Hk == 0:
        return out
    assert out3.is_contiguous() and out3.dtype == torch.float32 and tuple(out3.shape[1:]) == (Hk, F)
    src = src.contiguous()
    skeys, order, end = key_order(keys)
    block = min(_BLOCK_F, triton.next_power_of_2(F))
    _segment_sum_kernel[(N, triton.cdiv(F, block), Hk)](src, order, skeys, end, out3, N, F, Hk, BLOCK_F=block,
                                                         UNROLL=_UNROLL)
    return out


def chunk_rows(device: torch.device, S: int, K: int, H: int, Hk: int, D: int, Dv: int, n_post: int,
               chunk_bytes: int = None) -> int:
    """Query rows per chunk: the gathered keys and values and their gradients (fp32) and
    a handful of [H, K] per-head temporaries per row, within the device's budget."""
    if chunk_bytes is None:
        chunk_bytes = DEFAULT_CHUNK_BYTES.get(device.type, DEFAULT_CHUNK_BYTES["cpu"])
    per_row = 4 * max(1, K) * (2 * Hk * (D + Dv) + H * (n_post + 6))
    return max(1, min(max(S, 1), chunk_bytes // per_row))


def _softmax(y: torch.Tensor) -> torch.Tensor:
    """The forward's softmax over the k slots, op for op (so the same bits as its P). Not
    exp(y - lse): where a finite fill hides every slot (y = finfo.min + x), the fp32 lse
    rounds log(k) away (finfo.min + log k == finfo.min) and exp(y - lse) would be 1 per slot."""
    m = y.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(y - m)
    return e / e.sum(-1, keepdim=True)


def check_backward_operands(grad_out, q, k, v, idx, delta, lse) -> None:
    B, S, H, _ = q.shape
    Dv = v.shape[3]
    for name, t, shape in (("grad_out", grad_out, (B, S, H, Dv)), ("delta", delta, (B, S, H)),
                           ("lse", lse, (B, S, H))):
        if tuple(t.shape) != shape:
            raise SpecError(f"sparse_attention_backward: {name} has shape {tuple(t.shape)}; expected {shape}")
        if t.device != q.device:
            raise SpecError(f"sparse_attention_backward: {name} is on {t.device}, q on {q.device}")
    if not grad_out.is_floating_point():
        raise SpecError(f"sparse_attention_backward: grad_out has dtype {grad_out.dtype}; expected a float dtype")
    if delta.dtype != torch.float32:
        raise SpecError(f"sparse_attention_backward: delta has dtype {delta.dtype}; expected torch.float32 "
                        "(attention_delta(grad_out, out, lse))")


DELTA_CHUNK_BYTES = 256 << 20  # the fp32 product's rows per step of the eager attention_delta


def attention_delta(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The softmax backward's correction term the backward op takes, fp32 [B, S, H]:
    sum_d dO * O over the value features, each factor taken to fp32 from its own dtype, and
    0 for a head with no visible slot (lse -inf, where O is NaN or 0). The op takes it
    rather than O so that a compiled backward computes it first (the pass emits these ops
    in the graph, where Inductor fuses them into one reduction) and O, which nothing later
    reads, is freed before the op's buffers are allocated. Here (eager callers) in row
    chunks of ``DELTA_CHUNK_BYTES``: no fp32 copy of O."""
    B, S, H, Dv = out.shape
    delta = torch.empty((B, S, H), dtype=torch.float32, device=out.device)
    step = max(1, DELTA_CHUNK_BYTES // max(1, B * H * Dv * 4))
    for s0 in range(0, S, step):
        s1 = min(S, s0 + step)
        d = (grad_out[:, s0:s1].to(torch.float32) * out[:, s0:s1].to(torch.float32)).sum(-1)
        delta[:, s0:s1] = torch.where(lse[:, s0:s1] > -float("inf"), d, 0.0)
    return delta


def v_is_view_of_k(k: torch.Tensor, v: torch.Tensor) -> bool:
    """v is k's first Dv columns: the same storage, offset, strides and dtype (the MLA
    latent's value view, v = k[..., :Dv]), so every gradient of v lands on rows of k."""
    return (v.dtype == k.dtype and v.device == k.device and v.data_ptr() == k.data_ptr()
            and v.stride() == k.stride() and v.shape[:3] == k.shape[:3] and v.shape[3] <= k.shape[3])


BACKWARD_MODES = ("deterministic", "atomic", "pytorch")


def backward_mode(mode: str = None, spec: AttentionSpec = None) -> str:
    """The CUDA backward to run: ``mode``, else ``HYSCALE_ATTN_BWD`` (a run-time override, for
    A/B runs), else the spec's ``backward`` (``hyscale.attention_backward``), else "deterministic"."""
    mode = mode or os.environ.get("HYSCALE_ATTN_BWD") or (spec.backward if spec is not None else "deterministic")
    if mode not in BACKWARD_MODES:
        raise SpecError(f"sparse attention backward mode {mode!r} (HYSCALE_ATTN_BWD); expected one of "
                        f"{', '.join(BACKWARD_MODES)}")
    return mode


def _softmax_grad(p: torch.Tensor, dp: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """The softmax's backward, dy = P (dP - delta), delta = sum_j P dP / sum_j P (over sum_j P,
    so the rounding of the forward's sum, common to the row's P, cancels); rows not ``live``
    give 0. In two steps: dP - c with c that sum, then delta the same sum of the shifted dP,
    which corrects c's rounding. In one step, where one slot holds most of P, dP - delta
    cancels and delta's rounding at |dP|'s scale went into every dy of the row (gq / gk 4-5
    eps off where the dense original erred 1); shifted, each rounding is at the scale of
    dP - delta, dy's own."""
    psum = torch.where(live, p.sum(-1, keepdim=True), 1.0)
    dp = dp - (p * dp).sum(-1, keepdim=True) / psum
    delta = (p * dp).sum(-1, keepdim=True) / psum
    return torch.where(p > 0, p * (dp - delta), 0.0)


def attention_backward(grad_out, q, k, v, idx, masks, delta, lse, spec: AttentionSpec, needs=(True, True, True),
                       chunk_bytes: int = None, mode: str = None, fold_v: bool = False):
    """(gq, gk, gv) in the operands' dtypes; an input that needs no gradient gets an empty
    tensor. ``delta``: ``attention_delta(grad_out, out, lse)``. On CUDA the Triton kernels
    unless ``backward_mode(mode)`` is "pytorch" or the spec has a step they do not
    differentiate; this path does not read ``delta`` (its delta comes from the fp32
    probabilities, more exactly than from the rounded output).

    ``fold_v``, where v is a view of k's first Dv columns (``v_is_view_of_k``) and both
    gradients are asked: gk is the shared storage's whole gradient, k's part plus v's on its
    first Dv columns (added in fp32, rounded once), and gv is zeros, so gk + [gv, 0] (what
    autograd of the view, or the MLA pass, adds) is that gradient. The kernels then reduce
    one contribution per slot instead of two (C_k + C_v per slot, then the (row, slot)
    ordered sum); this path adds the two fp32 sums at the end."""
    from .attention_reference import heads_to_rows, gather_heads, rows_to_heads, score_slots

    if spec.empty_row == "dense":
        return dense_rows_backward(
            lambda lse_, spec_: attention_backward(grad_out, q, k, v, idx, masks, delta, lse_, spec_, needs, chunk_bytes,
                                                   mode, fold_v), grad_out, q, k, v, idx, masks, lse, spec, needs, fold_v)
    if q.device.type == "cuda" and os.environ.get("HYSCALE_KERNEL", "triton") != "reference":
        how = backward_mode(mode, spec)
        if how != "pytorch":
            from .triton_attention_backward import attention_backward_triton, unsupported

            if unsupported(spec) is None:
                return attention_backward_triton(grad_out, q, k, v, idx, masks, delta, lse, spec, needs,
                                                 atomic=how == "atomic", chunk_bytes=chunk_bytes, fold_v=fold_v)

    B, S, H, D = q.shape
    T, Hk, Dv, K = k.shape[1], k.shape[2], v.shape[3], idx.shape[-1]
    G = H // Hk
    f32 = torch.float32
    sspec = spec.as_score_spec()
    gq = torch.zeros(q.shape, dtype=f32, device=q.device) if needs[0] else None
    gk = torch.zeros(k.shape, dtype=f32, device=k.device) if needs[1] else None
    gv = torch.zeros(v.shape, dtype=f32, device=v.device) if needs[2] else None
    step = chunk_rows(q.device, S, K, H, Hk, D, Dv, len(sspec.post), chunk_bytes)
    if K and any(needs):
        for b in range(B):
            for s0 in range(0, S, step):
                s1 = min(S, s0 + step)
                n = s1 - s0
                outs, kb, mkeys = score_slots(q, k, idx, masks, spec, b, s0, s1, f32)
                keys = mkeys[0]  # [n, K]
                # rows with a visible slot (the forward's lse); the others pass nothing
                live = lse[b, s0:s1].transpose(0, 1).unsqueeze(-1) > -float("inf")  # [H, n, 1]
                p = torch.where(live, _softmax(outs[-1]), 0.0)  # [H, n, K]
                vb = gather_heads(v[b], keys, f32)  # [Hk, n, K, Dv]
                go = grad_out[b, s0:s1].to(f32)
                go = torch.where(live.squeeze(-1).transpose(0, 1).unsqueeze(-1), go, 0.0)
                goh = go.view(n, Hk, G, Dv).permute(1, 0, 2, 3)  # [Hk, n, G, Dv]
                # dP = dO . v
                dp = heads_to_rows(torch.matmul(goh, vb.transpose(-1, -2)), H)
                del vb
                g = _softmax_grad(p, dp, live)
                del dp
                g = _post_backward(g, sspec, masks, outs, b, b + 1, s0, s1, mkeys, B, S, T)
                del outs
                gx = rows_to_heads(g, Hk)  # [Hk, n, G, K]
                flat = keys.reshape(-1)
                if needs[0]:
                    gq[b, s0:s1] = torch.matmul(gx, kb).permute(1, 0, 2, 3).reshape(n, H, D)
                del kb
                if needs[1]:
                    qh = q[b, s0:s1].to(f32).view(n, Hk, G, D).permute(1, 0, 2, 3)
                    gks = torch.matmul(gx.transpose(-1, -2), qh)  # [Hk, n, K, D]
                    segment_sum_(gk[b], flat, gks.view(Hk, n * K, D))
                    del gks
                if needs[2]:
                    gvb = torch.matmul(rows_to_heads(p, Hk).transpose(-1, -2), goh)  # [Hk, n, K, Dv]
                    segment_sum_(gv[b], flat, gvb.view(Hk, n * K, Dv))
                    del gvb
    if fold_v and needs[1] and needs[2] and v_is_view_of_k(k, v):
        gk[..., :Dv] += gv
        gv = torch.zeros_like(gv)
    # a fresh empty tensor per output: outputs of a custom op may not alias each other
    return (gq.to(q.dtype) if needs[0] else q.new_empty(0),
            gk.to(k.dtype) if needs[1] else k.new_empty(0), gv.to(v.dtype) if needs[2] else v.new_empty(0))


def sparse_part(spec: AttentionSpec) -> AttentionSpec:
    """The spec the sparse kernels run for an ``empty_row="dense"`` site (rows they see as
    empty are recomputed anyway)."""
    return dataclasses.replace(spec, empty_row="nan", dense_fill=())


def dense_rows_backward(sparse, grad_out, q, k, v, idx, masks, lse, spec: AttentionSpec, needs=(True, True, True),
                        fold_v: bool = False):
    """``empty_row="dense"``'s backward: ``sparse(lse, spec)`` (the sparse backward, the
    Triton kernels on CUDA) with the flagged (row, head)s' lse set to -inf, so they pass
    nothing there, plus those heads' gradients of the original, recomputed over all T keys
    (``attention_reference.dense_rows_forward`` says which heads, and why lse <= fill / 4
    finds every one the forward recomputed). The softmax's and the post steps' derivatives
    are written out as in the sparse path, at every key: at a selected key through every
    step, at an unselected one through the "round" steps after the index mask, the fill's
    add (which passes the gradient on unchanged, as autograd of the original's add does),
    and the steps before it; no gradient to the fill. A head whose every key is -inf passes
    nothing (as an empty row of the sparse op). The key side is a dense [T, Hk, D]
    accumulation by matmul, block after block in row order: no atomics, the same bits on
    every run. gq of a flagged head is the dense one outright (the sparse one is 0 there);
    gk and gv add the two fp32 sums, rounded once more to the operands' dtype."""
    from .attention_reference import dense_blocks, dense_chunk_rows, dense_logits, flagged_rows, heads_to_rows, \
        rows_to_heads

    flag = flagged_rows(lse, spec, backward=True)
    gq, gk, gv = sparse(lse.masked_fill(flag, float("-inf")), sparse_part(spec))
    B, S, H, D = q.shape
    T, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hk
    blocks = dense_blocks(flag, dense_chunk_rows(q, k, v, spec)) if any(needs) and B * S * H and T else []
    if not blocks:
        return gq, gk, gv
    f32 = torch.float32
    fill, at, replaces = spec.dense_fill
    sspec = spec.as_score_spec()
    gq_d = torch.zeros(q.shape, dtype=f32, device=q.device) if needs[0] else None
    gk_d = torch.zeros(k.shape, dtype=f32, device=k.device) if needs[1] else None
    gv_d = torch.zeros(v.shape, dtype=f32, device=v.device) if needs[2] else None
    for b, s0, s1 in blocks:
        n = s1 - s0
        y, outs, sel, mkeys = dense_logits(q, k, idx, masks, spec, b, s0, s1, f32)
        live = (flag[b, s0:s1] & (lse[b, s0:s1] > -float("inf"))).transpose(0, 1).unsqueeze(-1)  # [H, n, 1]
        p = torch.where(live, _softmax(y), 0.0)  # [H, n, T]
        del y
        go = torch.where(live.squeeze(-1).transpose(0, 1).unsqueeze(-1), grad_out[b, s0:s1].to(f32), 0.0)
        goh = go.view(n, Hk, G, Dv).permute(1, 0, 2, 3)  # [Hk, n, G, Dv]
        vt = v[b].transpose(0, 1).to(f32)  # [Hk, T, Dv]
        dp = heads_to_rows(torch.matmul(goh, vt.transpose(-1, -2).unsqueeze(1)), H)
        g = _softmax_grad(p, dp, live)
        del dp
        # the mask step the fill takes the place of at the unselected keys: there the add of
        # the fill passes the gradient on unchanged
        g = _post_backward(g, sspec, masks, outs, b, b + 1, s0, s1, mkeys, B, S, T,
                           passthrough=(at, sel) if replaces else None)
        del outs
        gx = rows_to_heads(g, Hk)  # [Hk, n, G, T]
        if needs[0]:
            kt = k[b].transpose(0, 1).to(f32)  # [Hk, T, D]
            gq_d[b, s0:s1] = torch.matmul(gx, kt.unsqueeze(1)).permute(1, 0, 2, 3).reshape(n, H, D)
        if needs[1]:
            qh = q[b, s0:s1].to(f32).view(n, Hk, G, D).permute(1, 0, 2, 3).reshape(Hk, n * G, D)
            gk_d[b] += torch.matmul(gx.permute(0, 3, 1, 2).reshape(Hk, T, n * G), qh).transpose(0, 1)
        if needs[2]:
            ph = rows_to_heads(p, Hk).permute(0, 3, 1, 2).reshape(Hk, T, n * G)
            gv_d[b] += torch.matmul(ph, goh.reshape(Hk, n * G, Dv)).transpose(0, 1)
    if fold_v and needs[1] and needs[2] and v_is_view_of_k(k, v):
        gk_d[..., :Dv] += gv_d
        gv_d.zero_()
    if needs[0]:
        gq = torch.where(flag.unsqueeze(-1), gq_d.to(q.dtype), gq)
    if needs[1]:
        gk = (gk.to(f32) + gk_d).to(k.dtype)
    if needs[2]:
        gv = (gv.to(f32) + gv_d).to(v.dtype)
    return gq, gk, gv
