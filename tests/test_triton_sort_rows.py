"""lowerings/triton_sort_rows.py: rows of (index, value) pairs sorted in place by (value
desc, index asc), against two stable torch sorts. Interpreter tests (small rows) and one
GPU test at the DSA row length."""
from __future__ import annotations

import math

import pytest
import torch

from hyscale_compile.lowerings import triton_codegen as cg
from hyscale_compile.lowerings.triton_sort_rows import sort_rows_, sort_rows_reference


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


@pytest.mark.gpu
def test_gpu_sort_rows_dsa_length():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    idx0, vals0 = _rows(311, 64, 2048, torch.int32, "cuda")
    idx, vals = idx0.clone(), vals0.clone()
    sort_rows_(idx, vals)
    _check(idx.cpu(), vals.cpu(), idx0.cpu(), vals0.cpu())
