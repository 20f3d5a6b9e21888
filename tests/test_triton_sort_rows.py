"""lowerings/triton_sort_rows.py: rows of (index, value) pairs sorted in place by (value
desc, index asc), against two stable torch sorts. Interpreter tests (small rows) and one
GPU test at the DSA row length. Both networks (``network="tl.sort"`` and ``"minmax"``,
triton_keys._sort_desc_minmax) are checked; the minmax network also on raw int64 keys
against torch.sort, with each of its steps left out in turn."""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from hyscale_compile.lowerings import triton_codegen as cg
from hyscale_compile.lowerings.triton_keys import EMPTY, _sort_desc_minmax
from hyscale_compile.lowerings.triton_sort_rows import sort_rows_, sort_rows_reference

EMPTY_KEY = EMPTY.value


def _interpreting():
    if not (cg._interpreting() and cg.triton_imported_interpreted()):
        pytest.skip("triton runs compiled in this process")


@triton.jit
def _minmax_kernel(X, Y, K: tl.constexpr, N: tl.constexpr, R: tl.constexpr, REG_BITS: tl.constexpr,
                   SKIP: tl.constexpr):
    # one row of K int64 keys, padded with EMPTY to N, sorted descending by the minmax network
    offs = tl.arange(0, N)
    x = tl.load(X + tl.program_id(0) * K + offs, mask=offs < K, other=EMPTY)
    tl.store(Y + tl.program_id(0) * N + offs, _sort_desc_minmax(x, N, R, REG_BITS, SKIP))


def _int64_keys(seed, rows, k):
    # keys from a small pool (many ties), EMPTY fillers, the extremes, and wide random keys
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([EMPTY_KEY, 2**63 - 1, -1, 0, 1, 5, 1 << 32, (1 << 32) - 1, -(1 << 40)])
    pick = torch.randint(0, 3 * pool.numel(), (rows, k), generator=g)
    wide = torch.randint(-2**62, 2**62, (rows, k), generator=g) * 2 + torch.randint(0, 2, (rows, k), generator=g)
    keys = torch.where(pick < pool.numel(), pool[pick.clamp(max=pool.numel() - 1)], wide)
    small = torch.randint(-3, 4, (rows, k), generator=g)
    return torch.where(pick >= 2 * pool.numel(), small, keys)


def _minmax_sort(keys, n, R, reg_bits, skip=-1):
    rows, k = keys.shape
    out = torch.empty(rows, n, dtype=torch.int64)
    _minmax_kernel[(rows,)](keys, out, k, n, R, reg_bits, skip)
    return out


def _want(keys, n):
    pad = torch.full((keys.shape[0], n - keys.shape[1]), EMPTY_KEY, dtype=torch.int64)
    return torch.sort(torch.cat([keys, pad], dim=1), dim=1, descending=True).values


def _rows(seed, rows, k, idx_dtype, device="cpu"):
    print(f"seed={seed}")
    g = torch.Generator().manual_seed(seed)
    # small integers and their negatives, zeros of both signs, infinities, NaN: many ties
    vals = torch.randint(-3, 4, (rows, k), generator=g).float()
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 0.5])
    pick = torch.randint(0, 12, (rows, k), generator=g)
    vals = torch.where(pick < special.numel(), special[pick.clamp(max=special.numel() - 1)], vals)
    idx = torch.stack([torch.randperm(4 * k, generator=g)[:k] for _ in range(rows)]).to(idx_dtype)
    return idx.to(device), vals.to(device)


def _check(idx, vals, idx0, vals0):
    want_v, want_i = sort_rows_reference(idx0, vals0)
    assert torch.equal(idx, want_i), "indices not in (value desc, index asc) order"
    nan = torch.isnan(want_v)
    assert torch.equal(torch.isnan(vals), nan)
    assert torch.equal(vals[~nan], want_v[~nan])  # (-0.0 == +0.0)
    assert not torch.signbit(vals[vals == 0]).any(), "-0.0 written back (the fused kernel writes +0.0)"


def test_reference_order():
    # the reference itself, on a row whose order is known: NaN first, -0.0 tied with +0.0
    idx = torch.tensor([[5, 1, 4, 2, 3, 0]])
    vals = torch.tensor([[0.0, 2.0, math.nan, -0.0, 2.0, -math.inf]])
    v, i = sort_rows_reference(idx, vals)
    assert i.tolist() == [[4, 1, 3, 2, 5, 0]]
    assert math.isnan(v[0, 0]) and v[0, 1:].tolist() == [2.0, 2.0, -0.0, 0.0, -math.inf]


@pytest.mark.interpret
@pytest.mark.parametrize("k,idx_dtype", [(1, torch.int32), (37, torch.int32), (300, torch.int64), (512, torch.int32)])
def test_sort_rows_matches_reference(k, idx_dtype):
    if not (cg._interpreting() and cg.triton_imported_interpreted()):
        pytest.skip("triton runs compiled in this process")
    idx0, vals0 = _rows(300 + k, 3, k, idx_dtype)
    idx, vals = idx0.clone(), vals0.clone()
    sort_rows_(idx, vals)
    _check(idx, vals, idx0, vals0)
    # write_values=False: the indices sorted, the values left as they were
    idx2, vals2 = idx0.clone(), vals0.clone()
    sort_rows_(idx2, vals2, write_values=False)
    assert torch.equal(idx2, idx) and torch.equal(vals2.view(torch.int32), vals0.view(torch.int32))


def test_sort_rows_bad_input():
    idx, vals = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="differ in shape"):
        sort_rows_(idx, vals[:, :3].contiguous())
    with pytest.raises(ValueError, match="fp32 values"):
        sort_rows_(idx, vals.double())
    with pytest.raises(ValueError, match="fp32 values"):
        sort_rows_(idx.float(), vals)
    with pytest.raises(ValueError, match="contiguous"):
        sort_rows_(torch.zeros(4, 2, dtype=torch.int32).t(), torch.zeros(4, 2).t())
    with pytest.raises(ValueError, match="num_warps=3"):
        sort_rows_(idx, vals, num_warps=3)
    with pytest.raises(ValueError, match="network='bitonic'"):
        sort_rows_(idx, vals, network="bitonic")


@pytest.mark.gpu
@pytest.mark.parametrize("network", ["tl.sort", "minmax"])
def test_gpu_sort_rows_dsa_length(network):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    idx0, vals0 = _rows(311, 64, 2048, torch.int32, "cuda")
    for num_warps in (None, 1, 4):
        idx, vals = idx0.clone(), vals0.clone()
        sort_rows_(idx, vals, num_warps=num_warps, network=network)
        _check(idx.cpu(), vals.cpu(), idx0.cpu(), vals0.cpu())


@pytest.mark.interpret
@pytest.mark.parametrize("k,n,R,reg_bits", [
    (2048, 2048, 8, 5),   # the 2-warp launch: 5 register bits, 5 lane bits, 1 warp bit
    (2048, 2048, 16, 6),  # 1 warp
    (1500, 2048, 4, 4),   # 4 warps, a row padded with EMPTY
    (45, 64, 1, 2),       # not a power of two; most steps per element
    (64, 64, 2, 6),       # every step in registers
    (64, 64, 1, 0),       # every step per element
    (1, 1, 1, 0),
    (3, 4, 1, 2),
])
def test_minmax_network_matches_torch_sort(k, n, R, reg_bits):
    _interpreting()
    keys = _int64_keys(400 + k + reg_bits, 3, k)
    assert torch.equal(_minmax_sort(keys, n, R, reg_bits), _want(keys, n))


@pytest.mark.interpret
@pytest.mark.parametrize("reg_bits", [2, 6])
def test_minmax_network_every_step_needed(reg_bits):
    # with any one step of the 21 (n = 64) left out, some row comes out in the wrong order:
    # the tests above would notice a step the network skipped
    _interpreting()
    n = 64
    keys = _int64_keys(500 + reg_bits, 6, n)
    want = _want(keys, n)
    assert torch.equal(_minmax_sort(keys, n, 2, reg_bits), want)
    for step in range(6 * 7 // 2):
        assert not torch.equal(_minmax_sort(keys, n, 2, reg_bits, skip=step), want), f"step {step} changed nothing"


@pytest.mark.interpret
@pytest.mark.parametrize("k,num_warps", [(1, 1), (37, 1), (300, 2), (512, 4), (2048, 2)])
def test_sort_rows_minmax_network(k, num_warps):
    # the library kernel with network="minmax" (the default): the reference order, and
    # bit-identical to tl.sort's network (num_warps sets the register bits the launch assumes)
    _interpreting()
    idx0, vals0 = _rows(600 + k, 2, k, torch.int32)
    idx, vals = idx0.clone(), vals0.clone()
    sort_rows_(idx, vals, num_warps=num_warps)
    _check(idx, vals, idx0, vals0)
    idx2, vals2 = idx0.clone(), vals0.clone()
    sort_rows_(idx2, vals2, network="tl.sort", num_warps=num_warps)
    assert torch.equal(idx2, idx) and torch.equal(vals2.view(torch.int32), vals.view(torch.int32))
