"""lowerings/triton_sort_rows.py: rows of (index, value) pairs sorted in place by (value
desc, index asc), against two stable torch sorts. Interpreter tests (small rows) and one
GPU test at the DSA row length. The four networks (``network="tl.sort"``, ``"minmax"``,
triton_keys._sort_desc_minmax, ``"transpose"``, triton_keys._sort_desc_transpose, and
``"f64"``, _sort_desc_f64) are checked; minmax, transpose and f64 also on raw int64 keys
against torch.sort, with each of their steps left out in turn, and the transpose
network's plan of moves on its own."""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from hyscale_compile.lowerings import triton_codegen as cg
from hyscale_compile.lowerings.triton_keys import (EMPTY, PAD_F64, _sort_desc_f64, _sort_desc_minmax,
                                                   _sort_desc_transpose, _transpose_plan)
from hyscale_compile.lowerings.triton_sort_rows import sort_rows_, sort_rows_reference

EMPTY_KEY = EMPTY.value
PAD_KEY = PAD_F64.value


def _interpreting():
    if not (cg._interpreting() and cg.triton_imported_interpreted()):
        pytest.skip("triton runs compiled in this process")


@triton.jit
def _network_kernel(X, Y, K: tl.constexpr, N: tl.constexpr, R: tl.constexpr, REG_BITS: tl.constexpr,
                    SKIP: tl.constexpr, NETWORK: tl.constexpr, ROWS: tl.constexpr = 1):
    # ROWS rows of K int64 keys, each padded with EMPTY (PAD_F64 for network 3) to N, sorted
    # descending by the minmax (1), the transpose (2) or the f64 (3) network; ROWS > 1 (one
    # network call over all of them) for transpose and f64
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    offs = tl.arange(0, N)[None, :]
    if NETWORK == 3:
        x = tl.reshape(tl.load(X + r * K + offs, mask=offs < K, other=PAD_F64), [ROWS * N])
        y = _sort_desc_f64(x, N, R, REG_BITS, SKIP, ROWS)
    else:
        x = tl.reshape(tl.load(X + r * K + offs, mask=offs < K, other=EMPTY), [ROWS * N])
        if NETWORK == 2:
            y = _sort_desc_transpose(x, N, R, REG_BITS, SKIP, False, ROWS)
        else:
            y = _sort_desc_minmax(x, N, R, REG_BITS, SKIP)
    tl.store(Y + r * N + offs, tl.reshape(y, [ROWS, N]))


def _int64_keys(seed, rows, k):
    # keys from a small pool (many ties), EMPTY fillers, the extremes, and wide random keys
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([EMPTY_KEY, 2**63 - 1, -1, 0, 1, 5, 1 << 32, (1 << 32) - 1, -(1 << 40)])
    pick = torch.randint(0, 3 * pool.numel(), (rows, k), generator=g)
    wide = torch.randint(-2**62, 2**62, (rows, k), generator=g) * 2 + torch.randint(0, 2, (rows, k), generator=g)
    keys = torch.where(pick < pool.numel(), pool[pick.clamp(max=pool.numel() - 1)], wide)
    small = torch.randint(-3, 4, (rows, k), generator=g)
    return torch.where(pick >= 2 * pool.numel(), small, keys)


def _f64_keys(seed, rows, k):
    # keys as _pack_f64 makes them (bit 62 | 52 low bits: the bits of doubles in [2, 4)):
    # many ties, the extremes, neighbours one apart, wide random keys
    g = torch.Generator().manual_seed(seed)
    top = (1 << 52) - 1
    pool = torch.tensor([1, top, top - 1, 1 << 20, (1 << 20) - 1, 1 << 51, (1 << 51) - 1, 5, 6])
    pick = torch.randint(0, 3 * pool.numel(), (rows, k), generator=g)
    wide = torch.randint(1, 1 << 52, (rows, k), generator=g)
    keys = torch.where(pick < pool.numel(), pool[pick.clamp(max=pool.numel() - 1)], wide)
    return PAD_KEY | keys


def _keys_for(network, seed, rows, k):
    return _f64_keys(seed, rows, k) if network == 3 else _int64_keys(seed, rows, k)


def _network_sort(keys, n, R, reg_bits, skip=-1, network=1, rows_per_program=1):
    rows, k = keys.shape
    assert rows % rows_per_program == 0
    out = torch.empty(rows, n, dtype=torch.int64)
    _network_kernel[(rows // rows_per_program,)](keys, out, k, n, R, reg_bits, skip, network, rows_per_program)
    return out


def _want(keys, n, network=1):
    pad = torch.full((keys.shape[0], n - keys.shape[1]), PAD_KEY if network == 3 else EMPTY_KEY, dtype=torch.int64)
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
    # the f64 network holds 20 index bits: the caller must bound the indices
    with pytest.raises(ValueError, match="needs index_bound .* <= 1048576; got index_bound=None"):
        sort_rows_(idx, vals, network="f64")
    with pytest.raises(ValueError, match="got index_bound=1048577"):
        sort_rows_(idx, vals, network="f64", index_bound=(1 << 20) + 1)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match=f"index_bound={bad!r}; expected a non-negative int"):
            sort_rows_(idx, vals, index_bound=bad)


class _NetworkSpy:
    # stands in for _sort_rows_kernel: records the NETWORK each launch takes, then launches
    def __init__(self, kernel):
        self.kernel, self.networks, self.rows = kernel, [], []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.networks.append(args[7])
            self.rows.append(args[8])
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.mark.interpret
def test_sort_rows_default_network(monkeypatch):
    # the default's choice (sort_rows_ with network=None): f64 at 2,048 keys where the
    # caller bounds the indices by 2^20, transpose where it does not or the bound is larger,
    # minmax below 2,048 keys
    _interpreting()
    from hyscale_compile.lowerings import triton_sort_rows as tsr

    spy = _NetworkSpy(tsr._sort_rows_kernel)
    monkeypatch.setattr(tsr, "_sort_rows_kernel", spy)
    idx = torch.arange(2048, dtype=torch.int32).repeat(1, 1)
    vals = torch.zeros(1, 2048)
    for bound, want in ((1 << 20, "f64"), ((1 << 20) + 1, "transpose"), (None, "transpose"), (2048, "f64")):
        sort_rows_(idx.clone(), vals.clone(), index_bound=bound)
        assert spy.networks[-1] == tsr.NETWORKS[want], (bound, spy.networks)
        assert spy.rows[-1] == 1, spy.rows  # (one row: one per program)
    sort_rows_(idx[:, :512].contiguous(), vals[:, :512].contiguous(), index_bound=512)
    assert spy.networks[-1] == tsr.NETWORKS["minmax"]
    # two rows per program for f64 at 2,048 keys, one for the others
    for bound, rows in ((2048, 2), (None, 1)):
        sort_rows_(idx.repeat(3, 1), vals.repeat(3, 1), index_bound=bound)
        assert spy.rows[-1] == rows, (bound, spy.rows)
    # a caller's num_warps alone is one row's warps, as before rows per program existed
    sort_rows_(idx.repeat(3, 1), vals.repeat(3, 1), index_bound=2048, num_warps=1)
    assert spy.rows[-1] == 1, spy.rows


@pytest.mark.interpret
def test_sort_rows_f64_index_range():
    # the f64 network at the ends of its index range (0 and 2^20 - 1, ties between them),
    # int32 and int64 indices, values written or not: the reference order, transpose's bits
    _interpreting()
    k = 2048
    g = torch.Generator().manual_seed(2021)
    idx0 = torch.stack([torch.randperm(1 << 20, generator=g)[:k] for _ in range(2)]).to(torch.int32)
    idx0[:, :3] = torch.tensor([0, (1 << 20) - 1, (1 << 20) - 2], dtype=torch.int32)
    vals0 = torch.randint(-2, 3, (2, k), generator=g).float()  # (ties across the whole index range)
    vals0[:, :3] = torch.tensor([1.0, 1.0, 1.0])
    idx, vals = idx0.clone(), vals0.clone()
    sort_rows_(idx, vals, network="f64", index_bound=1 << 20, num_warps=4)
    _check(idx, vals, idx0, vals0)
    # the same with int64 indices, and with the values left as they were
    idx64, vals2 = idx0.long(), vals0.clone()
    sort_rows_(idx64, vals2, write_values=False, network="f64", index_bound=1 << 20, num_warps=4)
    assert torch.equal(idx64, idx.long()) and torch.equal(vals2.view(torch.int32), vals0.view(torch.int32))
    # and the transpose network's bits
    idx2, vals2 = idx0.clone(), vals0.clone()
    sort_rows_(idx2, vals2, network="transpose", num_warps=4)
    assert torch.equal(idx2, idx) and torch.equal(vals2.view(torch.int32), vals.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("network", ["tl.sort", "minmax", "transpose", "f64"])
def test_gpu_sort_rows_dsa_length(network):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    idx0, vals0 = _rows(311, 65, 2048, torch.int32, "cuda")  # (65: the last of 2 / 4 rows per program alone)
    for num_warps in (None, 1, 2, 4):
        idx, vals = idx0.clone(), vals0.clone()
        sort_rows_(idx, vals, num_warps=num_warps, network=network, index_bound=4 * 2048)
        _check(idx.cpu(), vals.cpu(), idx0.cpu(), vals0.cpu())
    if network in ("transpose", "f64"):  # several rows per program
        for rpp, num_warps in ((2, None), (2, 8), (4, 16), (4, 8)):
            idx, vals = idx0.clone(), vals0.clone()
            sort_rows_(idx, vals, num_warps=num_warps, network=network, index_bound=4 * 2048, rows_per_program=rpp)
            _check(idx.cpu(), vals.cpu(), idx0.cpu(), vals0.cpu())


def _replay_plan(log_n, reg_bits, log_rows=0):
    # the transpose plan's layouts step by step: (moves, per step (register bits, known));
    # with 2^log_rows rows, their bits (above the keys') stay in their warp slots
    w = min(max(1, reg_bits), log_n)
    log_m = log_n + log_rows
    regs, others, moves, seen = set(range(w)), list(range(w, log_m)), 0, []
    steps = [(st, st - 1 - i) for st in range(1, log_n + 1) for i in range(st)]
    for (st, j), (order, known) in zip(steps, _transpose_plan(log_n, reg_bits, log_rows)):
        if order:
            moves += 1
            assert sorted(order) == list(range(log_m)), order
            new_regs, new_others = set(order[:w]), list(order[w:])[::-1]
            # bits that stay outside the registers keep their lane / warp slot
            for k, b in enumerate(others):
                if b not in new_regs:
                    assert new_others[k] == b, (order, others)
            regs, others = new_regs, new_others
        assert j in regs, f"step (s={st}, j={j}) with bit {j} outside the registers {sorted(regs)}"
        assert others[len(others) - log_rows:] == list(range(log_n, log_m)), others  # rows: the top warp bits
        assert known == (st == log_n or st in regs)
        seen.append((frozenset(regs), known))
    return moves, seen


@pytest.mark.parametrize("log_n,reg_bits,moves", [
    (11, 5, 11),  # 2,048 keys, 2 warps: 11 moves for minmax's 21 steps across lanes / warps
    (11, 6, 8),   # 1 warp
    (11, 4, 14),  # 4 warps
    (6, 2, 9), (6, 3, 5), (6, 6, 0), (3, 1, 5), (1, 1, 0), (0, 0, 0),
])
def test_transpose_plan(log_n, reg_bits, moves):
    # every step's bit is a register bit when it runs, each move keeps the bits it does not
    # bring into registers where they were, "known" says whether bit s is a register bit, and
    # the number of moves (each a pass through shared memory) is the greedy optimum; with
    # several rows the same moves, the rows' bits never in registers
    assert _replay_plan(log_n, reg_bits)[0] == moves
    for log_rows in (1, 2):
        assert _replay_plan(log_n, reg_bits, log_rows)[0] == moves


def test_transpose_plan_fewest_moves():
    # no schedule of register windows needs fewer moves than the plan (exhaustive over
    # window choices for small networks: breadth-first over the windows after each move)
    import itertools
    for log_n, w in [(4, 1), (4, 2), (5, 2), (5, 3), (6, 3)]:
        steps = [st - 1 - i for st in range(1, log_n + 1) for i in range(st)]
        best, frontier = None, {(0, frozenset(range(w)))}  # (next step, window) after `moves` moves
        for moves in range(len(steps) + 1):
            nxt = set()
            for t, win in frontier:
                while t < len(steps) and steps[t] in win:
                    t += 1
                if t == len(steps):
                    best = moves
                    break
                nxt.update((t, frozenset(c)) for c in itertools.combinations(range(log_n), w) if steps[t] in c)
            if best is not None:
                break
            frontier = nxt
        assert _replay_plan(log_n, w)[0] == best, (log_n, w)


@pytest.mark.interpret
@pytest.mark.parametrize("network", [1, 2, 3])  # minmax, transpose, f64
@pytest.mark.parametrize("k,n,R,reg_bits", [
    (2048, 2048, 8, 5),   # the 2-warp launch: 5 register bits, 5 lane bits, 1 warp bit (transpose: 11 moves)
    (2048, 2048, 16, 6),  # 1 warp
    (1500, 2048, 4, 4),   # 4 warps, a row padded with EMPTY
    (45, 64, 1, 2),       # not a power of two; most steps per element (transpose: a move every few steps)
    (64, 64, 2, 3),
    (64, 64, 2, 6),       # every step in registers (no move)
    (64, 64, 1, 0),       # every step per element (transpose: a move before most steps)
    (1, 1, 1, 0),
    (3, 4, 1, 2),
])
def test_network_matches_torch_sort(network, k, n, R, reg_bits):
    _interpreting()
    keys = _keys_for(network, 400 + 300 * (network - 1) + k + reg_bits, 3, k)
    assert torch.equal(_network_sort(keys, n, R, reg_bits, -1, network=network), _want(keys, n, network))


@pytest.mark.interpret
@pytest.mark.parametrize("network,reg_bits", [(1, 2), (1, 6), (2, 2), (2, 3), (3, 2)])
def test_network_every_step_needed(network, reg_bits):
    # with any one compare-exchange of the 21 (n = 64) left out (a transpose network's moves
    # kept), some row comes out in the wrong order: the tests above would notice a step the
    # network skipped (network 1: minmax, 2: transpose, 3: f64)
    _interpreting()
    n = 64
    if network >= 2:
        assert _replay_plan(6, reg_bits)[0] > 0  # (moves happen: the test covers them)
    keys = _keys_for(network, (500 if network == 1 else 800 + 50 * network) + reg_bits, 6, n)
    want = _want(keys, n, network)
    assert torch.equal(_network_sort(keys, n, 2, reg_bits, -1, network=network), want)
    for step in range(6 * 7 // 2):
        got = _network_sort(keys, n, 2, reg_bits, step, network=network)
        assert not torch.equal(got, want), f"step {step} changed nothing"


@pytest.mark.interpret
@pytest.mark.parametrize("k,num_warps,network,other", [
    (k, w, net, other) for k, w in [(1, 1), (37, 1), (300, 2), (512, 4), (2048, 2)]
    for net, other in [("minmax", "tl.sort"), ("transpose", "minmax"), ("f64", "transpose")]
    # tl.sort (the slowest network under the interpreter) up to 300 keys, which sort in a
    # 512-key network as 512 keys do; at 512 and 2,048 keys minmax is transpose's other
    if not (other == "tl.sort" and k > 300)])
def test_sort_rows_network(network, other, k, num_warps):
    # the library kernel with each network: the reference order, bit-identical to another
    # network and to the default (f64 or transpose from 2,048 keys, minmax below; num_warps
    # sets the register bits the launch assumes)
    _interpreting()
    idx0, vals0 = _rows(600 + k, 2, k, torch.int32)
    idx, vals = idx0.clone(), vals0.clone()
    sort_rows_(idx, vals, num_warps=num_warps, network=network, index_bound=4 * k)
    _check(idx, vals, idx0, vals0)
    for kw in (dict(network=other, num_warps=num_warps), {}, dict(index_bound=4 * k)):
        idx2, vals2 = idx0.clone(), vals0.clone()
        sort_rows_(idx2, vals2, **kw)
        assert torch.equal(idx2, idx) and torch.equal(vals2.view(torch.int32), vals.view(torch.int32)), kw


@pytest.mark.interpret
@pytest.mark.parametrize("network", [2, 3])  # transpose, f64
@pytest.mark.parametrize("rows_per_program", [2, 4])
@pytest.mark.parametrize("k,n,R,reg_bits", [(2048, 2048, 4, 4), (1500, 2048, 8, 5), (45, 64, 1, 2), (64, 64, 1, 0)])
def test_network_several_rows(network, rows_per_program, k, n, R, reg_bits):
    # several rows in one network call: each row sorted on its own, as torch.sort does
    _interpreting()
    keys = _keys_for(network, 900 + 10 * network + rows_per_program + k, 8, k)
    got = _network_sort(keys, n, R, reg_bits, -1, network=network, rows_per_program=rows_per_program)
    assert torch.equal(got, _want(keys, n, network))


@pytest.mark.interpret
@pytest.mark.parametrize("network", [2, 3])
def test_network_several_rows_every_step_needed(network):
    # with two rows per call, leaving out any one of the 21 steps (n = 64) still shows
    _interpreting()
    n = 64
    keys = _keys_for(network, 950 + network, 6, n)
    want = _want(keys, n, network)
    assert torch.equal(_network_sort(keys, n, 2, 2, -1, network, 2), want)
    for step in range(6 * 7 // 2):
        assert not torch.equal(_network_sort(keys, n, 2, 2, step, network, 2), want), f"step {step} changed nothing"


@pytest.mark.interpret
@pytest.mark.parametrize("network", ["transpose", "f64"])
@pytest.mark.parametrize("k,rows_per_program,num_warps", [(2048, 2, 2), (2048, 4, 4), (300, 2, 4), (37, 4, 4)])
def test_sort_rows_several_rows_per_program(network, k, rows_per_program, num_warps):
    # sort_rows_ with several rows per program, the last program's rows partly past the end
    # (5 rows): the reference order, bit-identical to one row per program
    _interpreting()
    idx0, vals0 = _rows(1000 + k + rows_per_program, 5, k, torch.int32)
    idx, vals = idx0.clone(), vals0.clone()
    sort_rows_(idx, vals, network=network, index_bound=4 * k, num_warps=num_warps, rows_per_program=rows_per_program)
    _check(idx, vals, idx0, vals0)
    idx1, vals1 = idx0.clone(), vals0.clone()
    sort_rows_(idx1, vals1, network=network, index_bound=4 * k, num_warps=num_warps // rows_per_program,
               rows_per_program=1)
    assert torch.equal(idx1, idx) and torch.equal(vals1.view(torch.int32), vals.view(torch.int32))


def test_sort_rows_rows_per_program_bad_input():
    idx, vals = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4)
    for bad in (0, 3, True, 2.0):
        with pytest.raises(ValueError, match=f"rows_per_program={bad!r}; expected a power of two"):
            sort_rows_(idx, vals, rows_per_program=bad)
    with pytest.raises(ValueError, match="rows_per_program=2 needs network 'transpose' or 'f64', got 'minmax'"):
        sort_rows_(idx, vals, network="minmax", rows_per_program=2)
    with pytest.raises(ValueError, match=r"num_warps=2; expected a power of two >= rows_per_program \(4\)"):
        sort_rows_(idx, vals, network="transpose", num_warps=2, rows_per_program=4)
    # checked on empty input too; a default network named as such
    with pytest.raises(ValueError, match="rows_per_program=3; expected a power of two"):
        sort_rows_(idx[:0], vals[:0], rows_per_program=3)
    with pytest.raises(ValueError, match=r"got 'minmax' \(the default network for 4 keys\)"):
        sort_rows_(idx, vals, rows_per_program=2)


@pytest.mark.parametrize("k,rows,bound,warps,rpp,interpret,want", [
    # the compiled launch's defaults: at 2,048 keys f64 where the bound allows it, 4 warps per
    # row and two rows per program when there are several rows; transpose, one row, otherwise
    (2048, 3, 1 << 20, None, None, False, ("f64", 8, 2)),
    (2048, 1, 2048, None, None, False, ("f64", 4, 1)),
    (2048, 3, None, None, None, False, ("transpose", 4, 1)),
    (1500, 3, (1 << 20) + 1, None, None, False, ("transpose", 4, 1)),
    # below 2,048 keys minmax at 2 warps, and 1 below 256 keys
    (512, 3, 512, None, None, False, ("minmax", 2, 1)),
    (100, 3, None, None, None, False, ("minmax", 1, 1)),
    # a caller's num_warps alone: one row per program, its warps kept
    (2048, 3, 2048, 2, None, False, ("f64", 2, 1)),
    # rows per program given: that many rows' warps; the interpreter takes one warp per row
    (2048, 8, None, None, 4, False, ("transpose", 16, 4)),
    (2048, 3, 2048, None, None, True, ("f64", 2, 2)),
    (300, 3, None, None, None, True, ("minmax", 1, 1)),
])
def test_sort_rows_launch_defaults(k, rows, bound, warps, rpp, interpret, want):
    # sort_rows_'s launch choice on its own (the GPU's warps, which interpreter launches ignore)
    from hyscale_compile.lowerings.triton_sort_rows import sort_rows_launch

    assert sort_rows_launch(k, rows, None, bound, warps, rpp, interpret) == want
    # a network named by the caller is kept, with the same warps and rows
    assert sort_rows_launch(k, rows, want[0], bound, warps, rpp, interpret) == want
