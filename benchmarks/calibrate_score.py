"""Where the scoring loop's time goes: a bisection of plain Triton score kernels (one GPU).

    python benchmarks/calibrate_score.py [--seq 32768] [--variants bare,sum,...]

Each variant is one standalone kernel at the DSA shape (H=64, D=128, bf16, causal, keys as the
rows of the dot, BLOCK_M=4 query rows x BLOCK_N=64 keys, 4 warps, one program per row block,
heaviest blocks first) that differs from the previous by one feature of the HyTopK tile loop:

* bare       the dot alone; per (key, row) the max over heads, kept as a running max
* sum        ReLU, head weights (loaded once per block), head sum by ``tl.sum`` (Triton's order)
* sum-rr     as sum, the weights re-read per tile (as HyTopK v6 does)
* tree       as sum, the head sum by HyTopK's fixed pairwise tree (``_head_sum``)
* tree-rr    tree + weights re-read: HyTopK v6's scoring arithmetic
* mask       sum + the causal ``where``
* sel        mask + selection by per-lane sub-buffers: keys not below the row's threshold are
             packed into int64 keys and stored to slot ``cnt[lane, row]`` of their lane's
             sub-buffer, ``cnt`` kept in registers (no atomics, no scans, no barriers). The
             threshold is each row's true k-th score (computed first), so acceptance is the
             steady state's; slots wrap (no compaction: this is a timing kernel only)
* sel-rr     sel with the weights re-read per tile
* <name>:s3  any of the above with num_stages=3 (default 2); <name>:r168 with maxnreg=168
             (3 programs of 4 warps fit an SM at <= 168 registers, 2 at <= 255); combinable

Prints a table: median ms (do_bench), ratio to the floor (causal score FLOPs at the bf16
matmul rate measured here), registers and spills; with ``--power S`` also each variant back to
back for S seconds under ``nvidia-smi`` (ms, SM clock, board power, mJ per call: at the power
limit time follows energy). Full log to --out.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

H, D, TOPK = 64, 128, 2048
SCALE = D**-0.5
BLOCK_M, BLOCK_N = 4, 64
SUBCAP = 64  # slots per lane sub-buffer (a row's buffer is SUBCAP x BLOCK_N keys)

VARIANTS = {
    # name: (EPI, WREREAD, TREE, MASK, SEL)
    "bare": (0, 0, 0, 0, 0),
    "sum": (1, 0, 0, 0, 0),
    "sum-rr": (1, 1, 0, 0, 0),
    "tree": (1, 0, 1, 0, 0),
    "tree-rr": (1, 1, 1, 0, 0),
    "mask": (1, 0, 0, 1, 0),
    "sel": (1, 0, 0, 1, 1),
    "sel-rr": (1, 1, 0, 1, 1),
}


@triton.jit
def _head_tree(x, BN: tl.constexpr, BM: tl.constexpr, GP: tl.constexpr):
    # HyTopK's pairwise tree (lowerings/triton_codegen.py, _head_sum), GP = 64
    x = tl.reshape(x, [BN, BM, GP])
    x = tl.sum(tl.reshape(x, [BN, BM, 2, GP // 2]), axis=2)
    x = tl.sum(tl.reshape(x, [BN, BM, 2, GP // 4]), axis=2)
    x = tl.sum(tl.reshape(x, [BN, BM, 2, GP // 8]), axis=2)
    x = tl.sum(tl.reshape(x, [BN, BM, 2, GP // 16]), axis=2)
    x = tl.sum(tl.reshape(x, [BN, BM, 2, GP // 32]), axis=2)
    x = tl.sum(tl.reshape(x, [BN, BM, 2, GP // 64]), axis=2)
    return tl.reshape(x, [BN, BM])


@triton.jit
def _pack(y, keys64):
    y = tl.where(y == 0.0, 0.0, y)
    y = tl.where(y != y, float("nan"), y)
    b = y.to(tl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    return (b.to(tl.int64) << 32) | (4294967295 - keys64)


@triton.jit
def _calib_kernel(Q, K, W, THR, OUT, SCR, S, num_blocks, num_scr,
                  H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SUBCAP: tl.constexpr, EPI: tl.constexpr, WREREAD: tl.constexpr, TREE: tl.constexpr,
                  MASK: tl.constexpr, SEL: tl.constexpr):
    pid = tl.program_id(0)
    mb = num_blocks - 1 - pid                      # heaviest causal blocks first
    offs_c = tl.arange(0, BLOCK_M * H)
    col_rows = (mb * BLOCK_M + offs_c // H).to(tl.int64)
    offs_d = tl.arange(0, D)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    rows = mb * BLOCK_M + offs_m
    qb = tl.load(Q + col_rows[:, None] * (H * D) + (offs_c % H)[:, None] * D + offs_d[None, :])
    w_off = col_rows * H + offs_c % H
    wv0 = tl.load(W + w_off)
    thr = tl.load(THR + rows)
    t_end = mb * BLOCK_M + BLOCK_M
    acc = tl.full([BLOCK_N, BLOCK_M], float("-inf"), tl.float32)
    cnt = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
    scr = SCR + (pid % num_scr).to(tl.int64) * (BLOCK_M * SUBCAP * BLOCK_N) + offs_m[None, :] * (SUBCAP * BLOCK_N)
    for t0 in range(0, t_end, BLOCK_N):
        keys = t0 + offs_n
        kt = tl.load(K + keys[:, None].to(tl.int64) * D + offs_d[None, :], mask=keys[:, None] < S, other=0.0)
        x = tl.dot(kt, tl.trans(qb), out_dtype=tl.float32)
        if EPI:
            x = tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
            if WREREAD:
                wv = tl.load(W + w_off + t0 // (S + 1))
            else:
                wv = wv0
            x = x * wv[None, :]
            if TREE:
                y = _head_tree(x, BLOCK_N, BLOCK_M, H)
            else:
                y = tl.sum(tl.reshape(x, [BLOCK_N, BLOCK_M, H]), axis=2)
        else:
            y = tl.max(tl.reshape(x, [BLOCK_N, BLOCK_M, H]), axis=2)
        if MASK:
            y = tl.where(keys[:, None] <= rows[None, :], y, float("-inf"))
        if SEL:
            take = (~(y < thr[None, :])) & (keys[:, None] < t_end)
            p = _pack(y, keys[:, None].to(tl.int64))
            tl.store(scr + (cnt % SUBCAP) * BLOCK_N + offs_n[:, None], p, mask=take)
            cnt += take.to(tl.int32)
        else:
            acc = tl.maximum(acc, y)
    if SEL:
        tl.store(OUT + rows, tl.sum(cnt, axis=0).to(tl.float32))
    else:
        tl.store(OUT + rows, tl.max(acc, axis=0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--variants", default="bare,sum,sum-rr,tree,tree-rr,mask,sel,sel-rr,sum:s3,sel:s3,sum-rr:r168,sel-rr:r168,sel-rr:r168:s3")
    ap.add_argument("--out", default=os.environ.get("OUT", "calib_out"))
    ap.add_argument("--power", type=float, default=0.0,
                    help="also run each variant back to back for this many seconds under nvidia-smi "
                         "(power_during.py): ms per call, SM clock, board power and energy per call")
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    for v in names:
        base, *opt = v.split(":")
        if base not in VARIANTS or any(not re.fullmatch(r"s\d|r\d+", o) for o in opt):
            ap.error(f"unknown variant {v!r}; known: {sorted(VARIANTS)} (optionally :s3, :r168)")
    os.makedirs(args.out, exist_ok=True)
    import bench_hytopk as bh

    S = args.seq
    q, k, w = bh.make_inputs(S, "iid", seed=5)
    # the kernel's arithmetic is relu(x) * w' with the positive scale folded into w'
    w2 = (w[0].float() * SCALE).contiguous()
    q2 = q[0].contiguous()
    k2 = k[0].contiguous()
    # each row's k-th best score (sel variants' thresholds): from HyTopK's values
    from hyscale_compile.lowerings import triton_hytopk as th

    hi = (torch.arange(S, device="cuda") + 1).view(1, S)
    vals, _ = th.hytopk_triton(q, k.unsqueeze(2), w, [hi], TOPK, bh.dsa_spec(), return_values=True)
    thr = vals[0, :, -1].float().contiguous()
    rate = bh.matmul_rate()
    floor = H * D * 2 * S * (S + 1) / 2 / rate * 1e3
    nb = S // BLOCK_M
    num_scr = 264
    scr = torch.empty(num_scr * BLOCK_M * SUBCAP * BLOCK_N, dtype=torch.int64, device="cuda")
    out = torch.empty(S, dtype=torch.float32, device="cuda")
    lines = [f"# calibrate_score: S={S}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__}, bf16 matmul {rate / 1e12:.0f} TFLOP/s, floor {floor:.2f} ms",
             f"{'variant':>10} {'ms':>8} {'x floor':>8} {'regs':>5} {'spills':>6}"
             + (f" {'ms (back to back)':>18} {'MHz':>6} {'W':>5} {'mJ / call':>10}" if args.power > 0 else "")]
    for v in names:
        base, *opt = v.split(":")
        epi, rr, tree, mask, sel = VARIANTS[base]
        stages = next((int(o[1:]) for o in opt if o[0] == "s"), 2)
        extra = {"maxnreg": int(o[1:]) for o in opt if o[0] == "r"}

        def launch():
            return _calib_kernel[(nb,)](q2, k2, w2, thr, out, scr, S, nb, num_scr, H=H, D=D, BLOCK_M=BLOCK_M,
                                        BLOCK_N=BLOCK_N, SUBCAP=SUBCAP, EPI=epi, WREREAD=rr, TREE=tree, MASK=mask,
                                        SEL=sel, num_warps=4, num_stages=stages, **extra)

        try:
            ck = launch()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(launch, warmup=50, rep=300, return_mode="median")
            regs, spills = getattr(ck, "n_regs", -1), getattr(ck, "n_spills", -1)
            line = f"{v:>10} {ms:8.2f} {ms / floor:8.2f} {regs:>5} {spills:>6}"
            if args.power > 0:
                from power_during import sampled_run

                # at the board's power limit time follows energy: what each feature costs in mJ
                ms_b, mhz, watts, _ = sampled_run(launch, args.power)
                line += f" {ms_b:18.2f} {mhz:6.0f} {watts:5.0f} {ms_b * watts:10.1f}"
            lines.append(line)
        except Exception as e:  # report and go on: one variant failing to compile says something too
            lines.append(f"{v:>10} failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        print(lines[-1], file=sys.stderr, flush=True)
    table = "\n".join(lines)
    with open(os.path.join(args.out, "calibrate_score.txt"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
