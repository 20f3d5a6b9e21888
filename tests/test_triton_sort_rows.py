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


def _check_workspace(idx0, vals0, idx, vals, network):
    # write_values=False sorts the indices as write_values=True did (idx, vals); the values
    # are a workspace: the int64 network leaves them as they were, the 32-bit one reorders
    # them (rows it leaves to the int64 network stay in its own order)
    idx2, vals2 = idx0.clone(), vals0.clone()
    sort_rows_(idx2, vals2, write_values=False, network=network)
    assert torch.equal(idx2, idx)
    if network == "int64":
        assert torch.equal(vals2.view(torch.int32), vals0.view(torch.int32))
    else:  # the same values per row (as the kernel writes them: +0.0, one NaN)
        assert torch.equal(vals2.view(torch.int32).sort(-1).values, vals.view(torch.int32).sort(-1).values)


def test_reference_order():
    # the reference itself, on a row whose order is known: NaN first, -0.0 tied with +0.0
    idx = torch.tensor([[5, 1, 4, 2, 3, 0]])
    vals = torch.tensor([[0.0, 2.0, math.nan, -0.0, 2.0, -math.inf]])
    v, i = sort_rows_reference(idx, vals)
    assert i.tolist() == [[4, 1, 3, 2, 5, 0]]
    assert math.isnan(v[0, 0]) and v[0, 1:].tolist() == [2.0, 2.0, -0.0, 0.0, -math.inf]


def _pair_rows(seed, rows, k, idx_dtype, device="cpu", twins=4, triple=False):
    # distinct scores over ~40 binades, ``twins`` of them with a second score one ulp above:
    # the 32-bit network's shifted scores cannot tell a twin pair apart, so its repair must
    # order each pair (rows with more pairs than it repairs go to the int64 network);
    # ``triple``: one score has a second twin, two ulps above (a group of three: int64)
    print(f"seed={seed}")
    g = torch.Generator().manual_seed(seed)
    base = torch.exp(torch.empty(rows, k - twins).uniform_(-14, 14, generator=g))
    base = base * torch.where(torch.rand(rows, k - twins, generator=g) < 0.3, -1.0, 1.0)
    twin = torch.nextafter(base[:, :twins], torch.full_like(base[:, :twins], math.inf))
    vals = torch.cat([base, twin], 1)
    if triple:
        vals[:, twins] = torch.nextafter(twin[:, 0], torch.full_like(twin[:, 0], math.inf))  # (an untwinned one)
    vals = vals.gather(1, torch.stack([torch.randperm(k, generator=g) for _ in range(rows)])).contiguous()
    idx = torch.stack([torch.randperm(4 * k, generator=g)[:k] for _ in range(rows)]).to(idx_dtype)
    return idx.to(device), vals.to(device)


def _interpreting():
    if not (cg._interpreting() and cg.triton_imported_interpreted()):
        pytest.skip("triton runs compiled in this process")


@pytest.mark.interpret
@pytest.mark.parametrize("network", ["int64", "trunc32"])
@pytest.mark.parametrize("k,idx_dtype", [(1, torch.int32), (37, torch.int32), (300, torch.int64), (512, torch.int32)])
def test_sort_rows_matches_reference(k, idx_dtype, network):
    # many ties: the 32-bit network takes its int64 fallback on these rows
    _interpreting()
    idx0, vals0 = _rows(300 + k, 3, k, idx_dtype)
    idx, vals = idx0.clone(), vals0.clone()
    sort_rows_(idx, vals, network=network)
    _check(idx, vals, idx0, vals0)
    # write_values=False: the indices sorted, the values a workspace
    _check_workspace(idx0, vals0, idx, vals, network)


@pytest.mark.interpret
@pytest.mark.parametrize("k,twins,triple", [(64, 5, False), (300, 12, False), (300, 100, False), (64, 5, True)])
def test_sort_rows_trunc32_pairs(k, twins, triple):
    # the 32-bit network's repair: scores one ulp apart in pairs (a repair that did nothing
    # fails this test; an int64 network never taken fails the one above), and more pairs
    # than it repairs, or a group of three (the int64 network); values written back
    # sorted, or left in place
    _interpreting()
    idx0, vals0 = _pair_rows(400 + k + twins, 4, k, torch.int32, twins=twins, triple=triple)
    for network in ("trunc32", "int64"):
        idx, vals = idx0.clone(), vals0.clone()
        sort_rows_(idx, vals, network=network)
        _check(idx, vals, idx0, vals0)
        _check_workspace(idx0, vals0, idx, vals, network)


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
    with pytest.raises(ValueError, match="network='radix'"):
        sort_rows_(idx, vals, network="radix")


@pytest.mark.gpu
def test_gpu_sort_rows_dsa_length():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for rows in (_rows(311, 64, 2048, torch.int32, "cuda"), _pair_rows(312, 64, 2048, torch.int32, "cuda", twins=6),
                 _pair_rows(313, 64, 2048, torch.int32, "cuda", twins=40)):
        idx0, vals0 = rows
        for network in ("int64", "trunc32"):
            idx, vals = idx0.clone(), vals0.clone()
            sort_rows_(idx, vals, network=network)
            _check(idx.cpu(), vals.cpu(), idx0.cpu(), vals0.cpu())
