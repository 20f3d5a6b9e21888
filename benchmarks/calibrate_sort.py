"""What sorting each row's k selected keys costs in a kernel of its own (one GPU).

    python benchmarks/calibrate_sort.py [--rows 32768,131072] [--k 2048]
    python benchmarks/calibrate_sort.py --modes lib --warps 1,2,4   # tl.sort vs minmax network
    python benchmarks/calibrate_sort.py --modes lib --networks minmax,transpose --warps 2   # v27 A/B
    python benchmarks/calibrate_sort.py --modes lib --networks transpose,f64 --warps 2,4   # v28 A/B
    python benchmarks/calibrate_sort.py --modes lib --networks f64 --warps 4 --lib-rows 1,2,4   # v30: rows per program

HyTopK sorts each row's k keys at the end of its row block, inside the fused kernel, where
two programs of 255 registers share an SM and the sort's shuffles and barriers wait with
nothing else to issue but the other program's tiles. This measures the alternative: the
fused kernel leaves each row's k keys unsorted, and a second kernel, one row per program at
whatever occupancy its registers allow, sorts them. Rows are random packed keys as HyTopK
builds them ((order-kept fp32 score bits) << 32 | (2^32 - 1 - index)); per config:

* packed   the row's int64 keys in (k x 8 bytes), int32 indices out (the fused kernel would
           write its packed keys to a workspace of rows x k x 8 bytes)
* split    int32 indices and fp32 scores in (the fused kernel would write the indices into
           the output and the scores into a workspace of rows x k x 4 bytes), packed here;
           the sorted indices written over the unsorted ones
* copy     the packed form's traffic without the sort (the memory floor of a second pass)
* packed, n rows/program  (``--rows-per-program 2,4``) one ``tl.sort`` over [n, k]
* lib      the library's kernel (``lowerings/triton_sort_rows``), split form (``--lib-rows``:
           its rows per program, ``--warps`` then the warps of each row), once per
           network in ``--networks`` (default "tl.sort" and "minmax",
           triton_keys._sort_desc_minmax; also "transpose", _sort_desc_transpose, the
           library's default at 2,048 keys since session 16), on the
           same rows: the A/B of the networks (``--modes lib`` times only these and the
           32-bit bound)
* 32-bit network + gather only  the network on 32-bit keys ((shifted score) << log2(k) |
           position) and one gather by position: not exact (keys whose shifted scores are
           equal stay in position order), a bound on what a 32-bit network could save;
           docs/kernel-design.md v18 has the two exact versions measured (commits 1d679a0,
           fca8564)

Two kinds of rows (``--data``): "tail" (|N(0,1)| + 1.5: distinct positive scores over two
binades, like a row's top-k of real scores) and "relu" (N(0,1) ReLU'd: half the row tied at 0).

plus ``torch.sort`` of the packed keys for context. Every sorted row is checked against
``torch.sort``. Prints a table last.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_hytopk as bh  # noqa: E402

from hyscale_compile.lowerings import triton_sort_rows as lib  # noqa: E402
from hyscale_compile.lowerings.triton_keys import (  # noqa: E402
    EMPTY, _pack, _score_bits, _sort_desc, _unpack_index)


@triton.jit
def _sort_rows_kernel(KEYS, OUT_IDX, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, ROWS: tl.constexpr):
    # the packed form, ROWS rows per program: one tl.sort over [ROWS, TOPK_P2] (the same
    # network, ROWS independent compare-exchanges per step)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, TOPK_P2)
    ok = (offs < TOPK)[None, :]
    keys = tl.load(KEYS + r[:, None] * TOPK + offs[None, :], mask=ok, other=EMPTY)
    keys = tl.sort(keys, dim=1, descending=True)
    tl.store(OUT_IDX + r[:, None] * TOPK + offs[None, :], _unpack_index(keys).to(tl.int32), mask=ok)


@triton.jit
def _sort_kernel(KEYS, IDX, VAL, OUT_IDX, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, R: tl.constexpr,
                 MODE: tl.constexpr):
    # MODE 0 packed, 1 split, 2 copy (see the module docstring)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, TOPK_P2)
    ok = offs < TOPK
    if MODE == 1:
        idx = tl.load(IDX + row * TOPK + offs, mask=ok, other=0)
        y = tl.load(VAL + row * TOPK + offs, mask=ok, other=0.0)
        b = y.to(tl.int32, bitcast=True)
        b = b ^ ((b >> 31) & 0x7FFFFFFF)
        keys = (b.to(tl.int64) << 32) | (4294967295 - idx.to(tl.int64))
        keys = tl.where(ok, keys, EMPTY)
    else:
        keys = tl.load(KEYS + row * TOPK + offs, mask=ok, other=EMPTY)
    if MODE != 2:
        keys = _sort_desc(keys, TOPK_P2, R)  # (the low network bits in registers)
    tl.store(OUT_IDX + row * TOPK + offs, _unpack_index(keys).to(tl.int32), mask=ok)


@triton.jit
def _trunc32_bare_kernel(IDX, VAL, OUT_IDX, K: tl.constexpr, K_P2: tl.constexpr, R: tl.constexpr,
                         LOG_P2: tl.constexpr):
    # a 32-bit network and the gather by position, nothing else: a bound (its order is
    # wrong wherever two keys share a shifted score)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, K_P2)
    ok = offs < K
    idx = tl.load(IDX + row * K + offs, mask=ok, other=0)
    y = tl.load(VAL + row * K + offs, mask=ok, other=0.0)
    u = _score_bits(_pack(y, idx))
    umin = tl.min(tl.where(ok, u, 4294967295), axis=0)
    span = tl.max(u, axis=0) - umin
    s = tl.zeros([], dtype=tl.uint32)
    for _ in tl.static_range(1 + LOG_P2):
        s = tl.where((span >> (31 - LOG_P2 + s)) != 0, s + 1, s)
    grp = tl.where(ok, ((u - umin) >> s) + 1, 0)
    k32 = _sort_desc((grp << LOG_P2) | offs.to(tl.uint32), K_P2, R)
    src = (k32 & (K_P2 - 1)).to(tl.int32)
    out = tl.load(IDX + row * K + src, mask=ok)
    tl.store(OUT_IDX + row * K + offs, out, mask=ok)


def make_rows(rows: int, k: int, seed: int, data: str = "relu"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    val = torch.randn(rows, k, device="cuda", generator=g)
    val = val.relu_() if data == "relu" else val.abs_() + 1.5  # relu: many exact ties
    idx = torch.randint(0, 1 << 20, (rows, k), device="cuda", generator=g, dtype=torch.int32)
    b = val.view(torch.int32)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    keys = (b.to(torch.int64) << 32) | (4294967295 - idx.to(torch.int64))
    return keys, idx, val


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32768,131072")
    ap.add_argument("--k", type=int, default=bh.TOPK)
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--rows-per-program", default="1", help="also sort 2, 4, ... rows per program (packed form)")
    ap.add_argument("--lib-rows", default="1",
                    help="lib: rows per program of sort_rows_ (comma-separated; --warps then counts warps per row; "
                         "more than 1: transpose and f64 only)")
    ap.add_argument("--data", default="tail,relu")
    ap.add_argument("--modes", default="packed,split,copy,lib", help="which forms to time")
    ap.add_argument("--networks", default="tl.sort,minmax",
                    help=f"lib: sort_rows_'s networks to time, of {list(lib.NETWORKS)}")
    ap.add_argument("--maxnreg", default="",
                    help="lib: also time each network and warp count with ptxas capped at these registers "
                         "per thread (comma-separated; more programs per SM; the launch sort_rows_ makes, "
                         "plus maxnreg)")
    args = ap.parse_args(argv)
    modes = set(args.modes.split(","))
    bad = [n for n in args.networks.split(",") if n not in lib.NETWORKS]
    if bad:  # (before any device time is spent)
        ap.error(f"--networks: {bad} not in {list(lib.NETWORKS)}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    k = args.k
    k_p2 = 1 << (k - 1).bit_length()
    table = []
    for rows, data in [(int(x), d) for x in args.rows.split(",") for d in args.data.split(",")]:
        keys, idx, val = make_rows(rows, k, seed=rows, data=data)
        want = (4294967295 - (torch.sort(keys, dim=-1, descending=True).values & 4294967295)).to(torch.int32)
        for mode, mname in ((0, "packed"), (1, "split"), (2, "copy")):
            if mname not in modes:
                continue
            for nw in [int(x) for x in args.warps.split(",")]:
                for R in sorted({1, max(1, k_p2 // (128 * nw))}):
                    if mode == 2 and R > 1:
                        continue
                    out = torch.empty(rows, k, dtype=torch.int32, device="cuda")
                    src = idx.clone()  # split mode writes over its input
                    o = src if mode == 1 else out

                    def fn():
                        if mode == 1:
                            o.copy_(idx)  # (the timing includes this copy: noted in the table)
                        _sort_kernel[(rows,)](keys, o, val, o, k, k_p2, R, mode, num_warps=nw)
                        return o
                    try:
                        ms, _, res, _ = bh.measure(fn)
                    except Exception as e:  # noqa: BLE001 (a config that does not compile is a row)
                        table.append((rows, data, mname, nw, R, None, f"failed: {type(e).__name__}: {str(e)[:80]}"))
                        continue
                    ok = "-" if mode == 2 else ("yes" if torch.equal(res, want) else "NO")
                    table.append((rows, data, mname, nw, R, ms, ok))
                    bh.log(rows, data, mname, nw, R, ms, ok)
        if "lib" in modes:
            for nw, rpp in [(int(x), int(r)) for x in args.warps.split(",") for r in args.lib_rows.split(",")]:
                R = max(1, k_p2 // (128 * nw))
                src = idx.clone()
                bound = int(idx.max()) + 1  # (the f64 network's index check)
                for network in args.networks.split(","):
                    if rpp > 1 and network not in ("transpose", "f64"):
                        continue
                    form = "" if rpp == 1 else f", {rpp} rows/program"

                    def fn_lib():
                        src.copy_(idx)  # in place: the timing includes this copy, as split's
                        lib.sort_rows_(src, val, write_values=False, num_warps=nw * rpp, network=network,
                                       index_bound=bound, rows_per_program=rpp)
                        return src
                    ms, _, res, _ = bh.measure(fn_lib)
                    ok = "yes" if torch.equal(res, want) else "NO"
                    table.append((rows, data, f"lib (triton_sort_rows, network={network}{form})", nw, R, ms, ok))
                    bh.log(rows, data, "lib", network, nw, rpp, R, ms, ok)
                    for cap in [int(x) for x in args.maxnreg.split(",") if x]:
                        def fn_cap():  # (sort_rows_'s launch, plus maxnreg)
                            src.copy_(idx)
                            lib._sort_rows_kernel[(triton.cdiv(rows, rpp),)](
                                src, val, rows, k, k_p2, R, False, lib.NETWORKS[network], rpp, num_warps=nw * rpp,
                                maxnreg=cap)
                            return src
                        ms, _, res, _ = bh.measure(fn_cap)
                        ok = "yes" if torch.equal(res, want) else "NO"
                        table.append((rows, data, f"lib (network={network}{form}, maxnreg={cap})", nw, R, ms, ok))
                        bh.log(rows, data, "lib", network, nw, rpp, R, cap, ms, ok)
                if rpp > 1:
                    continue
                out = torch.empty_like(idx)
                ms, _, _, _ = bh.measure(lambda: _trunc32_bare_kernel[(rows,)](
                    idx, val, out, k, k_p2, R, k_p2.bit_length() - 1, num_warps=nw))
                table.append((rows, data, "32-bit network + gather only (a bound, not exact)", nw, R, ms, "-"))
        for rpp in [int(x) for x in args.rows_per_program.split(",") if x and int(x) > 1]:
            for nw in [int(x) for x in args.warps.split(",")]:
                out = torch.empty(rows, k, dtype=torch.int32, device="cuda")

                def fn_rows():
                    _sort_rows_kernel[(rows // rpp,)](keys, out, k, k_p2, rpp, num_warps=nw)
                try:
                    ms, _, _, _ = bh.measure(fn_rows)
                except Exception as e:  # noqa: BLE001
                    table.append((rows, data, f"packed, {rpp} rows/program", nw, 1, None,
                                  f"failed: {type(e).__name__}"))
                    continue
                ok = "yes" if torch.equal(out, want) else "NO"
                table.append((rows, data, f"packed, {rpp} rows/program", nw, 1, ms, ok))
                bh.log(rows, rpp, nw, ms, ok)
        cp = torch.empty_like(idx)
        ms_copy, _, _, _ = bh.measure(lambda: cp.copy_(idx))
        table.append((rows, data, "(idx copy alone, in split's and lib's time)", "-", "-", ms_copy, "-"))
        ms, _, _, _ = bh.measure(lambda: torch.sort(keys, dim=-1, descending=True))
        table.append((rows, data, "torch.sort (int64 keys)", "-", "-", ms, "-"))
        del keys, idx, val, want
        torch.cuda.empty_cache()
    print(f"\nk={k} ({torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__})")
    print("| rows | data | form | warps | R | ms | = torch.sort |")
    print("|---|---|---|---|---|---|---|")
    for rows, data, mname, nw, R, ms, ok in table:
        print(f"| {rows} | {data} | {mname} | {nw} | {R} | {'-' if ms is None else f'{ms:.3f}'} | {ok} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
