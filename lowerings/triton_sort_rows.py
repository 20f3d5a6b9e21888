"""Sort rows of (value, index) pairs in place, in (value desc, index asc) order: HyTopK's
final order, as a kernel of its own.

HyTopK's fused kernel can sort each row's k keys at the end of its row block, but there two
programs of 255 registers share an SM, and the sort's shuffles and barriers stall with
little else to issue. ``sort="after"`` has the fused kernel write each row unsorted (indices
into the output, fp32 values beside them) and this kernel sort the rows, one row per
program at the occupancy its own registers allow (docs/kernel.md, "The final sort").

``sort_rows_reference`` is the same order in PyTorch (tests).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_keys import (EMPTY, INDEX_BITS_F64, PAD_F64, _pack, _pack_f64, _reg_bits, _sort_desc_by, _sort_desc_f64,
                          _unpack_index, _unpack_index_f64, _unpack_value, _unpack_value_f64)


@triton.jit(do_not_specialize=["n_rows"])  # (one build for any number of rows)
def _sort_rows_kernel(IDX, VAL, n_rows, K: tl.constexpr, K_P2: tl.constexpr, R: tl.constexpr,
                      WRITE_VALUES: tl.constexpr, NETWORK: tl.constexpr, ROWS: tl.constexpr = 1):
    # ROWS rows of K (index, value) pairs as the fused kernel's keys (triton_keys), each
    # sorted descending: (value desc, index asc), NaN above +inf, -0.0 tied with +0.0.
    # ROWS > 1 only for the transpose and f64 networks (sort_rows_ checks).
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    i = tl.arange(0, K_P2)[None, :]
    ok = i < K
    if ROWS > 1:
        ok = ok & (r < n_rows)
    idx = tl.reshape(tl.load(IDX + r * K + i, mask=ok, other=0), [ROWS * K_P2])
    y = tl.reshape(tl.load(VAL + r * K + i, mask=ok, other=0.0), [ROWS * K_P2])
    ok = tl.reshape(ok, [ROWS * K_P2])
    if NETWORK == 3:
        # the f64 network (indices < 2^20: sort_rows_ checks the caller's bound)
        keys = _sort_desc_f64(tl.where(ok, _pack_f64(y, idx), PAD_F64), K_P2, R, _reg_bits(K_P2, R), -1, ROWS)
        out_idx = _unpack_index_f64(keys)
        out_val = _unpack_value_f64(keys)
    else:
        keys = _sort_desc_by(tl.where(ok, _pack(y, idx), EMPTY), K_P2, R, NETWORK, ROWS)
        out_idx = _unpack_index(keys)
        out_val = _unpack_value(keys)
    # sorted: row-major [ROWS, K_P2], each row's first K the answer
    ok = tl.reshape(ok, [ROWS, K_P2])
    tl.store(IDX + r * K + i, tl.reshape(out_idx, [ROWS, K_P2]).to(IDX.dtype.element_ty), mask=ok)
    if WRITE_VALUES:
        tl.store(VAL + r * K + i, tl.reshape(out_val, [ROWS, K_P2]), mask=ok)


NETWORKS = {"tl.sort": 0, "minmax": 1, "transpose": 2, "f64": 3}


def sort_rows_(idx: torch.Tensor, vals: torch.Tensor, write_values: bool = True, *,
               num_warps: Optional[int] = None, network: Optional[str] = None,
               index_bound: Optional[int] = None, rows_per_program: Optional[int] = None) -> None:
    """Sort each row (last dim) of ``idx`` (int32/int64, entries in [0, 2^32)) and its fp32
    ``vals`` in place by (value desc, index asc); -0.0 ties +0.0 and NaN sorts first.
    ``write_values=False`` leaves ``vals`` unsorted (a workspace). Both contiguous, one
    shape, on one device (CUDA, or CPU under TRITON_INTERPRET=1). ``num_warps`` and
    ``rows_per_program`` (benchmarks): None, the measured default; each program sorts
    ``rows_per_program`` rows (a power of two; more than one only for the "transpose" and
    "f64" networks) with ``num_warps`` warps in all. Defaults: at 2,048 keys 4 warps per
    row, and 2 rows per program for "f64" (when there are several rows and ``num_warps`` is
    not given; 8 warps in all), else 1 row; below 2,048 keys 2 warps (under the interpreter
    1). ``network``: "tl.sort" (triton's bitonic
    sort, per element at every step), "minmax" (triton_keys._sort_desc_minmax: the
    same network, its in-register steps once per pair) or "transpose"
    (triton_keys._sort_desc_transpose: every step once per pair, the keys moved through
    shared memory instead of shuffled) or "f64" (triton_keys._sort_desc_f64: the transpose
    network on keys whose bits are also ordered doubles in [2, 4), each pair compared by one
    FP64 compare instead of two integer ones and its second key found by two exact FP64
    adds instead of two selects; only for indices below 2^20, which the caller
    vouches for with ``index_bound``, an exclusive bound on the entries of ``idx``); all
    give the same order. None: at 2,048 keys (padded: 1,025-2,048) "f64" where
    ``index_bound`` <= 2^20, else "transpose", both with 4 warps per row; below, "minmax"
    with 2.
    H200, 2,048 keys: 131,072 rows minmax 6.80 ms at 2 warps (9.84 at 4), transpose 4.61 at
    2 and 4.45 at 4, f64 3.74 and 3.68; 32,768 rows 1.73 (2.48), 1.17 and 1.12, 0.95 and
    0.93. So the default at 2,048 keys is "f64" with 4 warps per row where ``index_bound``
    allows it, else "transpose".
    Two rows per program: the warps of one row each ran on their own scheduler at their own
    place in the straight-line code, so every instruction fetch missed (31% of stall
    samples); two rows put two warps in step on each scheduler: f64, 4 warps per row, 32,768
    rows 0.923 -> 0.879 ms, 131,072 rows 3.665 -> 3.477 (4 rows per program: 1.174 / 4.611,
    one program of 16 warps per SM)."""
    if idx.shape != vals.shape:
        raise ValueError(f"sort_rows_: idx {tuple(idx.shape)} and vals {tuple(vals.shape)} differ in shape")
    if idx.dtype not in (torch.int32, torch.int64) or vals.dtype != torch.float32:
        raise ValueError(f"sort_rows_: expected int32/int64 indices and fp32 values, got {idx.dtype}, {vals.dtype}")
    if not (idx.is_contiguous() and vals.is_contiguous()) or idx.device != vals.device:
        raise ValueError("sort_rows_: idx and vals must be contiguous and on one device")
    k = idx.shape[-1] if idx.dim() else 0
    rows = idx.numel() // k if k else 0
    interpret = idx.device.type != "cuda"
    network, num_warps, rows_per_program = sort_rows_launch(k, rows, network, index_bound, num_warps,
                                                            rows_per_program, interpret)
    if rows == 0:
        return
    k_p2 = triton.next_power_of_2(k)
    R = max(1, k_p2 // (128 * (num_warps // rows_per_program)))
    launch = {} if interpret else dict(num_warps=num_warps)
    grid = (triton.cdiv(rows, rows_per_program),)
    with torch.cuda.device(idx.device) if idx.device.type == "cuda" else contextlib.nullcontext():
        _sort_rows_kernel[grid](idx, vals, rows, k, k_p2, R, write_values, NETWORKS[network], rows_per_program,
                                **launch)


def sort_rows_launch(k: int, rows: int, network: Optional[str], index_bound: Optional[int],
                     num_warps: Optional[int], rows_per_program: Optional[int], interpret: bool):
    """``sort_rows_``'s checks of its launch arguments and its defaults for them, for rows of
    ``k`` keys: (network, num_warps, rows_per_program). Raises ValueError naming the bad
    argument (hytopk_triton calls this before its fused kernel runs)."""
    if network is not None and network not in NETWORKS:
        raise ValueError(f"sort_rows_: network={network!r}; expected one of {sorted(NETWORKS)}")
    if index_bound is not None and (isinstance(index_bound, bool) or not isinstance(index_bound, int)
                                    or index_bound < 0):
        raise ValueError(f"sort_rows_: index_bound={index_bound!r}; expected a non-negative int")
    f64_ok = index_bound is not None and index_bound <= 1 << INDEX_BITS_F64.value
    if network == "f64" and not f64_ok:
        raise ValueError(f"sort_rows_: network='f64' packs indices in {INDEX_BITS_F64.value} bits, so it needs "
                         f"index_bound (an exclusive bound on idx's entries) <= {1 << INDEX_BITS_F64.value}; "
                         f"got index_bound={index_bound!r}")
    for name, v in (("rows_per_program", rows_per_program), ("num_warps", num_warps)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1)):
            raise ValueError(f"sort_rows_: {name}={v!r}; expected a power of two >= 1")
    k_p2 = triton.next_power_of_2(max(k, 1))
    # measured at 2,048 keys (docstring); other lengths keep the network measured before
    # (minmax: 2 warps, the network's low 5 bits in registers)
    wide = k_p2 == 2048
    chosen = network is None
    if chosen:
        network = ("f64" if f64_ok else "transpose") if wide else "minmax"
    if rows_per_program is None:
        # (a caller's num_warps alone keeps its old meaning: the warps of one row)
        rows_per_program = 2 if wide and network == "f64" and rows > 1 and num_warps is None else 1
    elif rows_per_program > 1 and network not in ("transpose", "f64"):
        why = f" (the default network for {k} keys)" if chosen else ""
        raise ValueError(f"sort_rows_: rows_per_program={rows_per_program} needs network 'transpose' or 'f64', "
                         f"got {network!r}{why}")
    if num_warps is None:
        per_row = 1 if interpret or k_p2 < 256 else 4 if wide and network in ("transpose", "f64") else 2
        num_warps = per_row * rows_per_program
    elif num_warps < rows_per_program:
        raise ValueError(f"sort_rows_: num_warps={num_warps!r}; expected a power of two >= rows_per_program "
                         f"({rows_per_program})")
    return network, num_warps, rows_per_program


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
