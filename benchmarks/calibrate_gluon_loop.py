"""Can one program's scoring loop keep the tensor cores busy? A Gluon calibration (one GPU).

    python benchmarks/calibrate_gluon_loop.py [--seq 32768] [--variants sync,pingpong,sync:1,pingpong:1]
    python benchmarks/calibrate_gluon_loop.py --compile-only   # sm_90 build on any machine

The question behind the structural next step of docs/kernel-design.md (v9, v10): HyTopK's
Triton tile loop waits for each tile's wgmma before its epilogue (Triton makes a dot
asynchronous only when its result feeds the next dot), so while one program of an SM
selects, the other scores alone, and its loop alone runs at 1.35x the floor (score-only,
one program per SM) against 1.06x with two. Gluon (triton.experimental.gluon) exposes
asynchronous wgmma and its wait explicitly. This script measures the DSA-shape scoring
loop written both ways, with nothing selected:

* sync      per key tile: two half dots (query rows 0-1 and 2-3, 64 heads each: 64 keys x
            128 columns, 64 accumulator registers per thread each), wait for both, then
            both halves' epilogues. The schedule of the Triton kernel.
* pingpong  the same dots and epilogues, software-pipelined within the program: while the
            tensor cores run one half, the warps do the other half's epilogue (wait with
            one wgmma group still in flight). The accumulators in registers are the same
            two halves, so registers do not grow.
* <name>:1  with one program per SM (shared memory padded so that a second does not fit):
            what one program reaches alone, which is what bounds the loop while the other
            program of the SM selects.

Shape: H=64, D=128, bf16, causal, 4 query rows x 64 keys per tile, 4 warps, TMA key tiles
in a 3-stage ring, one program per row block (heaviest first). The epilogue is ReLU, the
per-column weight, and one sum over a half's 128 columns (the work of the real head sum;
the two rows of a half are summed together, which changes nothing about the schedule), then
a running max per key lane. Each program writes its block's maxima; --check compares them
with a float64 evaluation of the same arithmetic on sampled blocks.

Prints a table last: median ms, ratio to the floor (causal score FLOPs at the bf16 matmul
rate measured here), registers and spills.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

H, D = 64, 128
BLOCK_M, BLOCK_N = 4, 64
HALF = BLOCK_M // 2 * H  # dot columns per half: 2 query rows x 64 heads
STAGES = 3
VARIANTS = ("sync", "pingpong")


@gluon.jit
def _issue_tile(k_desc, k_smem, ready, t, pred):
    # TMA: key tile t into stage t % STAGES, signalling that stage's barrier
    s = t % k_smem.shape[0]
    mbarrier.expect(ready.index(s), k_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [t * k_desc.block_type.shape[0], 0], ready.index(s), k_smem.index(s),
                                    pred=pred)


@gluon.jit
def _wait_tile(k_smem, ready, t, pred):
    s = t % k_smem.shape[0]
    mbarrier.wait(ready.index(s), (t // k_smem.shape[0]) & 1, pred=pred)


@gluon.jit
def _half_dot(k_smem, q_half, t, zero):
    # 64 keys x 128 columns, fp32 accumulation, asynchronous
    return warpgroup_mma(k_smem.index(t % k_smem.shape[0]), q_half.permute((1, 0)), zero, use_acc=False,
                         is_async=True)


@gluon.jit
def _epilogue(x, wv, keys, last_row, best):
    # relu, weights, sum over the half's columns; causal mask; running max per key lane
    y = gl.sum(gl.maximum(x, 0.0) * wv[None, :], axis=1)
    y = gl.where(keys <= last_row, y, float("-inf"))
    return gl.maximum(best, y)


@gluon.jit
def _calib_kernel(q_desc, k_desc, W, OUT, num_blocks, PINGPONG: gl.constexpr, PAD_ROWS: gl.constexpr):
    BN: gl.constexpr = k_desc.block_type.shape[0]
    DD: gl.constexpr = k_desc.block_type.shape[1]
    HC: gl.constexpr = q_desc.block_type.shape[0]  # columns per half
    NH: gl.constexpr = HC // 2                      # heads (2 query rows per half)
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HC, 16])
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    key_l: gl.constexpr = gl.SliceLayout(1, acc_l)

    pid = gl.program_id(0)
    mb = num_blocks - 1 - pid  # heaviest causal blocks first
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [3, BN, DD], k_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, HC, DD], q_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    if PAD_ROWS > 0:
        # shared memory that keeps a second program off the SM (PAD_ROWS x 128 bf16), touched once
        pad = gl.allocate_shared_memory(gl.bfloat16, [PAD_ROWS, DD], q_desc.layout)
        pad.slice(0, 16).store(gl.zeros([16, DD], gl.bfloat16, gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])))
    for i in gl.static_range(3):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(q_bar, count=1)

    row0 = mb * 4
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 * NH, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [row0 * NH + HC, 0], q_bar, q_smem.index(1))
    n = gl.cdiv(row0 + 4, BN)  # causal: key tiles 0 .. n-1
    for i in gl.static_range(3):
        _issue_tile(k_desc, k_smem, ready, i, i < n)
    cols = gl.arange(0, HC, layout=col_l)
    w_a = gl.load(W + row0 * NH + cols)
    w_b = gl.load(W + row0 * NH + HC + cols)
    offs_n = gl.arange(0, BN, layout=key_l)
    zero = gl.zeros([BN, HC], gl.float32, acc_l)
    best_a = gl.full([BN], float("-inf"), gl.float32, key_l)
    best_b = gl.full([BN], float("-inf"), gl.float32, key_l)
    mbarrier.wait(q_bar, 0)
    q_a = q_smem.index(0)
    q_b = q_smem.index(1)

    if PINGPONG:
        # At the top of iteration t (>= 1), B(t-1) and then A(t) are in flight. The last A
        # issued (A(n)) reads a stage no tile was loaded into; it is drained and dropped.
        _wait_tile(k_smem, ready, 0, True)
        acc_a = _half_dot(k_smem, q_a, 0, zero)
        acc_b = _half_dot(k_smem, q_b, 0, zero)
        x = warpgroup_mma_wait(num_outstanding=1, deps=[acc_a])  # A(0) retired, B(0) runs
        best_a = _epilogue(x, w_a, offs_n, row0 + 1, best_a)
        _wait_tile(k_smem, ready, 1, 1 < n)
        acc_a = _half_dot(k_smem, q_a, 1, zero)
        for t in range(1, n):
            x = warpgroup_mma_wait(num_outstanding=1, deps=[acc_b])  # B(t-1) retired, A(t) runs
            best_b = _epilogue(x, w_b, (t - 1) * BN + offs_n, row0 + 3, best_b)
            _issue_tile(k_desc, k_smem, ready, t + 2, t + 2 < n)  # into the stage of t-1, now free
            acc_b = _half_dot(k_smem, q_b, t, zero)
            x = warpgroup_mma_wait(num_outstanding=1, deps=[acc_a])  # A(t) retired, B(t) runs
            best_a = _epilogue(x, w_a, t * BN + offs_n, row0 + 1, best_a)
            _wait_tile(k_smem, ready, t + 1, t + 1 < n)
            acc_a = _half_dot(k_smem, q_a, t + 1, zero)
        x = warpgroup_mma_wait(num_outstanding=1, deps=[acc_b])
        best_b = _epilogue(x, w_b, (n - 1) * BN + offs_n, row0 + 3, best_b)
        warpgroup_mma_wait(num_outstanding=0, deps=[acc_a])
    else:
        for t in range(n):
            _wait_tile(k_smem, ready, t, True)
            acc_a = _half_dot(k_smem, q_a, t, zero)
            acc_b = _half_dot(k_smem, q_b, t, zero)
            acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=[acc_a, acc_b])
            _issue_tile(k_desc, k_smem, ready, t + 3, t + 3 < n)
            best_a = _epilogue(acc_a, w_a, t * BN + offs_n, row0 + 1, best_a)
            best_b = _epilogue(acc_b, w_b, t * BN + offs_n, row0 + 3, best_b)
    gl.store(OUT + mb * 2, gl.max(best_a, axis=0))
    gl.store(OUT + mb * 2 + 1, gl.max(best_b, axis=0))


def _descriptors(q2, k2):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    q_layout = gl.NVMMASharedLayout.get_default_for([HALF, D], gl.bfloat16)
    k_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
    return (TensorDescriptor.from_tensor(q2.view(-1, D), [HALF, D], q_layout),
            TensorDescriptor.from_tensor(k2, [BLOCK_N, D], k_layout))


def reference_maxima(q2, k2, w2, blocks):
    """float64 evaluation of the kernel's arithmetic for the given row blocks: [len, 2]"""
    out = []
    for mb in blocks:
        r0 = mb * BLOCK_M
        keys = k2[: r0 + BLOCK_M].double()
        res = []
        for half, last in ((0, r0 + 1), (1, r0 + 3)):
            qh = q2[r0 + 2 * half: r0 + 2 * half + 2].double().reshape(HALF, D)
            wh = w2[r0 + 2 * half: r0 + 2 * half + 2].double().reshape(HALF)
            y = (torch.relu(keys @ qh.T) * wh).sum(1)
            y[last + 1:] = float("-inf")
            res.append(y.max())
        out.append(torch.stack(res))
    return torch.stack(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--variants", default="sync,pingpong,sync:1,pingpong:1")
    ap.add_argument("--check", type=int, default=8, help="row blocks compared with the float64 evaluation")
    ap.add_argument("--compile-only", action="store_true", help="build for sm_90 without a GPU and report registers")
    ap.add_argument("--out", default=os.environ.get("OUT", "calib_out"))
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    for v in names:
        base, *opt = v.split(":")
        if base not in VARIANTS or opt not in ([], ["1"]):
            ap.error(f"unknown variant {v!r}; known: {list(VARIANTS)}, each optionally with :1")
    if args.seq < BLOCK_M or args.seq % BLOCK_M:
        ap.error(f"--seq must be a positive multiple of {BLOCK_M}")
    if args.compile_only:
        return compile_only(names)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("calibrate_gluon_loop.py needs a Hopper GPU (sm_90): wgmma; use --compile-only elsewhere")
    import bench_hytopk as bh

    S = args.seq
    q, k, w = bh.make_inputs(S, "iid", seed=5)
    q2 = q[0].contiguous()                              # [S, H, D]
    k2 = k[0].contiguous()                              # [S, D]
    w2 = (w[0].float() * bh.SCALE).contiguous()         # [S, H], the scale folded in as HyTopK does
    q_desc, k_desc = _descriptors(q2, k2)
    nb = S // BLOCK_M
    out = torch.empty(2 * nb, dtype=torch.float32, device="cuda")
    rate = bh.matmul_rate()
    floor = H * D * 2 * S * (S + 1) / 2 / rate * 1e3
    check_blocks = sorted(set(torch.linspace(0, nb - 1, max(1, args.check)).long().tolist()))
    ref = reference_maxima(q2, k2, w2, check_blocks)
    os.makedirs(args.out, exist_ok=True)
    lines = [f"# calibrate_gluon_loop: S={S}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__}, bf16 matmul {rate / 1e12:.0f} TFLOP/s, floor {floor:.2f} ms",
             "| variant | ms | x floor | regs | spills | max rel. err. vs float64 |", "|---|---|---|---|---|---|"]
    for v in names:
        base, *opt = v.split(":")
        pad = 256 if opt else 0  # +64 KiB (176 KiB in all): one program per SM

        def launch():
            return _calib_kernel[(nb,)](q_desc, k_desc, w2, out, nb, PINGPONG=base == "pingpong", PAD_ROWS=pad,
                                        num_warps=4)

        try:
            ck = launch()
            torch.cuda.synchronize()
            got = out.view(nb, 2)[check_blocks].double()
            err = ((got - ref).abs() / ref.abs().clamp_min(1e-6)).max().item()
            ms = triton.testing.do_bench(launch, warmup=50, rep=300, return_mode="median")
            regs, spills = getattr(ck, "n_regs", -1), getattr(ck, "n_spills", -1)
            lines.append(f"| {v} | {ms:.2f} | {ms / floor:.2f} | {regs} | {spills} | {err:.1e} |")
        except Exception as e:  # report and go on: a variant that fails says something too
            lines.append(f"| {v} | failed: {type(e).__name__}: {str(e).splitlines()[0][:100]} | | | | |")
        print(lines[-1], file=sys.stderr, flush=True)
    table = "\n".join(lines)
    with open(os.path.join(args.out, "calibrate_gluon_loop.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


def compile_only(names) -> int:
    """sm_90 builds through a stand-in driver (as benchmarks/inspect_hytopk.py does)."""
    from triton.runtime import driver

    from inspect_hytopk import _Sm90, ptxas_report

    S = 4096
    q2 = torch.empty(S, H, D, dtype=torch.bfloat16)
    k2 = torch.empty(S, D, dtype=torch.bfloat16)
    w2 = torch.empty(S, H)
    out = torch.empty(2 * (S // BLOCK_M))
    driver.set_active(_Sm90())  # (this process launches nothing afterwards)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    q_desc, k_desc = _descriptors(q2, k2)
    for v in names:
        base, *opt = v.split(":")
        ck = _calib_kernel.warmup(q_desc, k_desc, w2, out, S // BLOCK_M, PINGPONG=base == "pingpong",
                                  PAD_ROWS=256 if opt else 0, num_warps=4, grid=(1,))
        print(f"{v}: {ptxas_report(ck.asm['ptx'], bindir)}, shared {ck.metadata.shared} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
