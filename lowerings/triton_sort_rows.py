"""Sort rows of (value, index) pairs in place, in (value desc, index asc) order: HyTopK's
final order, as a kernel of its own.

HyTopK's fused kernel can sort each row's k keys at the end of its row block, but there two
programs of 255 registers share an SM, and the sort's shuffles and barriers stall with
little else to issue. ``sort="after"`` has the fused kernel write each row unsorted (indices
into the output, fp32 values beside them) and this kernel sort the rows, one row per
program at the occupancy its own registers allow (docs/kernel-design.md, v17).

``sort_rows_reference`` is the same order in PyTorch (tests).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_keys import EMPTY, _pack, _score_bits, _sort_desc, _unpack_index, _unpack_value



@triton.jit
def _sort_rows_kernel(IDX, VAL, FLAG, K: tl.constexpr, K_P2: tl.constexpr, R: tl.constexpr,
                      WRITE_VALUES: tl.constexpr, MODE: tl.constexpr, LOG_P2: tl.constexpr):
    # One row of K (index, value) pairs as the fused kernel's keys (triton_keys), sorted
    # descending: (value desc, index asc), NaN above +inf, -0.0 tied with +0.0.
    # MODE 0: the int64 network on the packed keys. MODE 1: a 32-bit network (below),
    # values always written; a row it cannot finish is flagged in FLAG. MODE 2: MODE 0 on
    # the flagged rows only.
    row = tl.program_id(0).to(tl.int64)
    if MODE == 2:
        if tl.load(FLAG + row) == 0:
            return
    offs = tl.arange(0, K_P2)
    ok = offs < K
    base = row * K
    idx = tl.load(IDX + base + offs, mask=ok, other=0)
    y = tl.load(VAL + base + offs, mask=ok, other=0.0)
    keys = tl.where(ok, _pack(y, idx), EMPTY)
    if MODE != 1:
        keys = _sort_desc(keys, K_P2, R)
        tl.store(IDX + base + offs, _unpack_index(keys).to(IDX.dtype.element_ty), mask=ok)
        if WRITE_VALUES:
            tl.store(VAL + base + offs, _unpack_value(keys), mask=ok)
    else:
        # 32-bit keys: (the score bits above the row's smallest, shifted right until they
        # fit 32 - LOG_P2 bits, plus 1) << LOG_P2 | the key's position. Keys whose shifted
        # scores differ (different "groups") come out in their true order; the keys of one
        # group come out adjacent, in position order. The row is written in that order
        # (indices and values, gathered by position), then read back one key ahead: two
        # neighbours out of order are a group of two, and swap; a group of three or more
        # (exact ties: ReLU zeros, -inf fillers; or a crowd of near-equal scores) leaves the
        # row to MODE 2. No tl.gather: it cost ~2 ms of 12 at 131,072 rows (v18).
        B: tl.constexpr = 32 - LOG_P2
        u = _score_bits(keys)  # (the keys' low words are dead past here)
        umin = tl.min(tl.where(ok, u, 4294967295), axis=0)
        span = tl.max(u, axis=0) - umin
        s = tl.zeros([], dtype=tl.uint32)
        for _ in tl.static_range(33 - B):  # the smallest s with span >> s < 2 ** (B - 1)
            s = tl.where((span >> (B - 1 + s)) != 0, s + 1, s)
        grp = tl.where(ok, ((u - umin) >> s) + 1, 0)  # 1 .. 2 ** (B - 1); padding 0, last
        k32 = _sort_desc((grp << LOG_P2) | offs.to(tl.uint32), K_P2, R)
        src = (k32 & (K_P2 - 1)).to(tl.int32)
        # (a key's value as the int64 network writes it: -0.0 as +0.0, one NaN)
        key = _pack(tl.load(VAL + base + src, mask=ok), tl.load(IDX + base + src, mask=ok))
        tl.debug_barrier()  # every thread has read the row before any thread overwrites it
        tl.store(IDX + base + offs, _unpack_index(key).to(IDX.dtype.element_ty), mask=ok)
        tl.store(VAL + base + offs, _unpack_value(key), mask=ok)
        tl.debug_barrier()  # the row is written: read it one and two keys ahead
        ok1 = offs + 1 < K
        ok2 = offs + 2 < K
        key1 = tl.where(ok1, _pack(tl.load(VAL + base + offs + 1, mask=ok1), tl.load(IDX + base + offs + 1, mask=ok1)),
                        EMPTY)
        g0 = k32 >> LOG_P2
        g1 = tl.where(ok1, ((_score_bits(key1) - umin) >> s) + 1, 0)
        u2 = _score_bits(_pack(tl.load(VAL + base + offs + 2, mask=ok2), offs))  # (any index)
        g2 = tl.where(ok2, ((u2 - umin) >> s) + 1, 0)
        swap = ok1 & (key1 > key)  # (only within a group: groups are in order)
        if tl.max(((g0 == g1) & (g1 == g2) & ok2).to(tl.int32), axis=0) > 0:
            tl.store(FLAG + row, 1)  # a group of three or more: the int64 network sorts the row
        elif tl.max(swap.to(tl.int32), axis=0) > 0:
            tl.debug_barrier()  # every thread has read its neighbours
            tl.store(IDX + base + offs, _unpack_index(key1).to(IDX.dtype.element_ty), mask=swap)
            tl.store(IDX + base + offs + 1, _unpack_index(key).to(IDX.dtype.element_ty), mask=swap)
            tl.store(VAL + base + offs, _unpack_value(key1), mask=swap)
            tl.store(VAL + base + offs + 1, _unpack_value(key), mask=swap)


def sort_rows_(idx: torch.Tensor, vals: torch.Tensor, write_values: bool = True, *,
               network: Optional[str] = None, num_warps: Optional[int] = None,
               maxnreg: Optional[int] = None) -> None:
    """Sort each row (last dim) of ``idx`` (int32/int64, entries in [0, 2^32)) and its fp32
    ``vals`` in place by (value desc, index asc); -0.0 ties +0.0 and NaN sorts first.
    ``write_values=False``: ``vals`` is a workspace (its order afterwards unspecified). Both contiguous, one
    shape, on one device (CUDA, or CPU under TRITON_INTERPRET=1). ``network``: "int64"
    (the bitonic network on the packed keys) or "trunc32" (on 32-bit keys, with a repair;
    _sort_rows_kernel's MODE 1); None: the default. Same result either way. ``num_warps``
    and ``maxnreg`` (benchmarks): None, the measured defaults."""
    network = network or "int64"
    if network not in ("int64", "trunc32"):
        raise ValueError(f"sort_rows_: network={network!r}; expected 'int64' or 'trunc32'")
    if idx.shape != vals.shape:
        raise ValueError(f"sort_rows_: idx {tuple(idx.shape)} and vals {tuple(vals.shape)} differ in shape")
    if idx.dtype not in (torch.int32, torch.int64) or vals.dtype != torch.float32:
        raise ValueError(f"sort_rows_: expected int32/int64 indices and fp32 values, got {idx.dtype}, {vals.dtype}")
    if not (idx.is_contiguous() and vals.is_contiguous()) or idx.device != vals.device:
        raise ValueError("sort_rows_: idx and vals must be contiguous and on one device")
    k = idx.shape[-1] if idx.dim() else 0
    rows = idx.numel() // k if k else 0
    if rows == 0:
        return
    k_p2 = triton.next_power_of_2(k)
    interpret = idx.device.type != "cuda"
    # 2 warps, the network's low 3 bits in registers: 8.5 ms for 131,072 rows of 2,048
    # against 11.4 with 4 warps and 10.7 with 1 (H200; benchmarks/calibrate_sort.py)
    if num_warps is None:
        num_warps = 1 if interpret or k_p2 < 256 else 2
    R = max(1, k_p2 // (128 * num_warps))
    launch = {} if interpret else dict(num_warps=num_warps)
    if maxnreg and not interpret:
        launch["maxnreg"] = maxnreg
    with torch.cuda.device(idx.device) if idx.device.type == "cuda" else contextlib.nullcontext():
        log_p2 = k_p2.bit_length() - 1
        if network == "int64":
            _sort_rows_kernel[(rows,)](idx, vals, idx, k, k_p2, R, write_values, 0, log_p2, **launch)
        else:
            flag = torch.zeros(rows, dtype=torch.int32, device=idx.device)
            for mode in (1, 2):
                _sort_rows_kernel[(rows,)](idx, vals, flag, k, k_p2, R, write_values, mode, log_p2, **launch)


def sort_rows_reference(idx: torch.Tensor, vals: torch.Tensor):
    """(values, indices) of each row in (value desc, index asc) order, -0.0 tied with +0.0,
    NaN first: two stable sorts."""
    v = torch.where(vals == 0, torch.zeros_like(vals), vals)
    v = torch.where(torch.isnan(v), torch.full_like(v, float("inf")), v)  # keys only
    o1 = idx.argsort(dim=-1, stable=True)
    nan_first = torch.isnan(vals).gather(-1, o1)
    v1 = v.gather(-1, o1)
    # NaN above +inf: sort by (isnan desc, value desc), both stable over index asc
    o2 = v1.argsort(dim=-1, descending=True, stable=True)
    o3 = nan_first.gather(-1, o2).to(torch.int8).argsort(dim=-1, descending=True, stable=True)
    order = o1.gather(-1, o2.gather(-1, o3))
    return vals.gather(-1, order), idx.gather(-1, order)
