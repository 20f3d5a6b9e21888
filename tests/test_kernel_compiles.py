"""The generated kernel compiles for the GPU (sm_90) on a CPU-only machine.

The Triton interpreter accepts code that compiled Triton rejects (a constexpr reassigned
inside ``tl.static_range`` passed every interpreter test and failed on the H200), so CI also
compiles the DSA kernel for sm_90 through ``benchmarks/inspect_hytopk.py``, in a subprocess
that imports triton without ``TRITON_INTERPRET``. It checks the compile and that the scored
tile loop keeps the shape the speed depends on (docs/kernel.md, "The launch"): shared memory for
two programs per SM, no layout conversions or atomics per tile, bounded spill code.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ptxas_available() -> bool:
    try:
        import importlib.util

        spec = importlib.util.find_spec("triton")
        if spec is None or not spec.submodule_search_locations:
            return False
        base = list(spec.submodule_search_locations)[0]
        return os.path.exists(os.path.join(base, "backends", "nvidia", "bin", "ptxas"))
    except Exception:
        return False


# the offline sm_90 builds' skip (test_triton_attention*.py take it from here)
needs_ptxas = pytest.mark.skipif(not _ptxas_available(), reason="the triton wheel's ptxas is not installed")


@needs_ptxas
def test_dsa_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["HYSCALE_KERNEL_CACHE"] = str(tmp_path / "kernels")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    dump = tmp_path / "dump"
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "inspect_hytopk.py"), "--configs",
                          "default;tma=0,num_stages=3,reread_weights=1;sort=bitonic",
                          "--dump", str(dump)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    names = ("default", "tma=0,num_stages=3,reread_weights=1", "sort=bitonic")
    rows = {ln.split()[0]: ln for ln in out.stdout.splitlines() if ln.split()[:1] and ln.split()[0] in names}
    assert set(rows) == set(names), out.stdout
    for name, row in rows.items():
        print(row)
        cells = row.split("|")
        regs, smem = int(cells[0].split()[1]), int(cells[0].split()[4])
        loop, loop_spill, loop_bar, loop_atom, loop_shfl = (int(x) for x in cells[1].split()[:5])
        assert 0 < regs <= 255
        assert loop > 0, "no scored-tile loop found around the wgmma"
        # two programs per SM with 3 key-tile stages: at most half the SM's 228 KiB, less
        # the 1 KiB the driver reserves per block
        assert smem <= 115712, f"{name}: {smem} B of shared memory: only one program fits per SM"
        if name == "default":
            # TMA key tiles, held weights and the sampled estimate's loop before the tile
            # loop (presample=128; with the third key-tile stage, 114,712 B, the offline build
            # has 415 instructions and 4 spill instructions in the tile loop): the append stays
            # in the head sum's layout, no layout conversion (barriers) or atomics per tile.
            # The dot's columns put the query rows in the quad lanes, so the head sum needs no
            # shuffle and each score lives in one lane (rows in registers took 610
            # instructions per tile, pointer loads 743)
            assert loop_bar <= 3 and loop_atom == 0, row
            assert loop_shfl == 0, f"the head sum left the threads (column order): {row}"
            assert loop_spill <= 8, f"more spill code inside the tile loop than the 4 measured: {row}"
            assert loop < 470, f"the tile loop grew past the 416 instructions measured: {row}"
        elif name == "sort=bitonic":
            # the final sort inside the fused kernel (taken where "after" would need more
            # than two launches): the tile loop as the default's
            assert loop_bar <= 3 and loop_atom == 0 and loop_spill <= 8 and loop < 470, row
        else:
            # the pointer-load path (keys TMA cannot address): 743 instructions, 3 spills
            assert loop_bar <= 2 and loop_atom == 0 and loop_spill <= 8, row


@needs_ptxas
def test_qsa_split_kernel_compiles_for_sm90(tmp_path):
    # bf16 queries against fp32 keys (QSA's pooled keys) take three bf16 tensor-core dots
    # per tile (_dot_split3, docs/kernel.md "Scoring a tile"): 3 dots x 8 k-steps of 16 = 24
    # wgmma instructions at the default 64-key tiles, where the fp32 path had none
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["HYSCALE_KERNEL_CACHE"] = str(tmp_path / "kernels")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "inspect_hytopk.py"), "--shape", "qsa",
                          "--configs", "default"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    row = next(ln for ln in out.stdout.splitlines() if ln.startswith("default"))
    print(row)
    cells = row.split("|")[0].split()
    regs, smem, wgmma = int(cells[1]), int(cells[4]), int(cells[7])
    assert 0 < regs <= 255 and smem <= 115712
    assert wgmma == 24, row


_SORT_ROWS_SASS = r"""
import os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks")); sys.path.insert(0, sys.argv[1])
import torch, triton
import inspect_hytopk as ih
from triton.runtime import driver
driver.set_active(ih._Sm90())
from hyscale_compile.lowerings.triton_sort_rows import NETWORKS, _sort_rows_kernel
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
idx, vals = torch.empty(4, 2048, dtype=torch.int32), torch.empty(4, 2048)
# each network at 2 warps (R = 8), and the library's launches at 2,048 keys: 4 warps (R = 4)
# and the default at 2,048 keys, f64 with 2 rows of 4 warps per program (8 warps)
for name, net, warps, rows in [(n, v, 2, 1) for n, v in NETWORKS.items()] + [
        ("transpose4", NETWORKS["transpose"], 4, 1), ("f644", NETWORKS["f64"], 4, 1), ("f644x2", NETWORKS["f64"], 4, 2)]:
    ck = _sort_rows_kernel.warmup(idx, vals, 4, 2048, 2048, 8 // (warps // 2), True, net, rows, grid=(2,),
                                  num_warps=warps * rows)
    sass = ih.sass_counts(ck.asm["cubin"], bindir)[1]
    isetp = sum(1 for ln in sass.splitlines() if "ISETP" in ln)
    lds = sum(1 for ln in sass.splitlines() if " LDS" in ln)
    shfl = sum(1 for ln in sass.splitlines() if "SHFL" in ln)
    cvt = ck.asm["ttgir"].count("ttg.convert_layout")
    dsetp = sum(1 for ln in sass.splitlines() if "DSETP" in ln)
    print(name, isetp, lds, ih.ptxas_report(ck.asm["ptx"], bindir).get("spill_st", 0), shfl, cvt, dsetp)
"""


@needs_ptxas
def test_sort_rows_minmax_network_compiles_for_sm90(tmp_path):
    # The rows' sort kernel at the DSA row length (2,048 keys, 2 and 4 warps): the minmax network
    # (docs/kernel.md, "The final sort") compares each in-register pair once, so it has about half
    # tl.sort's 64-bit compares (2,786 against 5,456 ISETP when measured), and its pair
    # splitting stays in registers (no shared-memory loads beyond tl.sort's). The transpose
    # network compares every pair once (2,131 ISETP) and moves the keys through shared
    # memory instead of shuffling them (32 shuffles against 1,344): its moves are the only
    # layout conversions besides the store's (if the layout pass stopped honouring the
    # anchor, the splits would convert at most steps and the shuffles or converts would show)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    out = subprocess.run([sys.executable, "-c", _SORT_ROWS_SASS, ROOT], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    counts = {ln.split()[0]: [int(x) for x in ln.split()[1:]] for ln in out.stdout.splitlines() if ln.strip()}
    print(counts)
    (isetp_old, lds_old, _, _, _, _), (isetp_new, lds_new, spill, shfl, _, _) = counts["tl.sort"], counts["minmax"]
    assert isetp_new < 0.6 * isetp_old, counts
    assert lds_new <= lds_old and spill == 0, counts
    from hyscale_compile.lowerings.triton_keys import _transpose_plan
    isetp_tp, _, spill_tp, shfl_tp, cvt_tp, _ = counts["transpose"]
    moves = sum(1 for order, _ in _transpose_plan(11, 5) if order)
    assert isetp_tp < 0.8 * isetp_new and shfl_tp <= 64 < shfl and spill_tp == 0, counts
    assert cvt_tp <= moves + 1, counts
    # the default launch (4 warps: 4 register bits, its own plan: 14 moves; the indices'
    # and the values' stores may each add a conversion: 16 when measured)
    _, _, spill_4, shfl_4, cvt_4, _ = counts["transpose4"]
    moves_4 = sum(1 for order, _ in _transpose_plan(11, 4) if order)
    assert spill_4 == 0 and shfl_4 <= 64 and cvt_4 <= moves_4 + 2, counts
    # the f64 network (the default launch): the same moves, each pair compared by one
    # DSETP (66 steps x 8 pairs per thread at 4 warps: 528 when measured; at 2 warps ptxas
    # repeated 15 of 1,056) and no 64-bit integer compare left (an ISETP per key word, or
    # max.f64's emulation, two DSETP per pair, would show here)
    # Two rows per program: each thread does the same pairs, and one move more puts the
    # loaded rows in the plan's first layout (the rows' bits warp bits; 16 conversions when
    # measured): had the rows' bits landed in registers, every step would convert.
    for name, pairs, moves_f in (("f64", 66 * 16, moves), ("f644", 66 * 8, moves_4), ("f644x2", 66 * 8, moves_4 + 1)):
        isetp_f, _, spill_f, shfl_f, cvt_f, dsetp_f = counts[name]
        assert pairs <= dsetp_f <= 1.05 * pairs and isetp_f < 64 and spill_f == 0 and shfl_f <= 64, (name, counts)
        assert cvt_f <= moves_f + 2, (name, counts)


_MASK_KERNELS = r"""
import dataclasses, math, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks")); sys.path.insert(0, sys.argv[1])
import torch
import inspect_hytopk as ih
from triton.runtime import driver
driver.set_active(ih._Sm90())
from hyscale_compile.lowerings import score_bound as sb, triton_hytopk as th, triton_mask_ranges as tmr
from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec, tensor_mask_term

f32, bf, i32 = torch.empty(1), torch.empty(1, dtype=torch.bfloat16), torch.empty(1, dtype=torch.int32)
for weighted, hidden in ((True, False), (True, True), (False, True)):
    sb._bound_flag_kernel.warmup(bf, bf, bf, bf, f32, f32, f32, i32, 129.3, 0.088, 0.0, 64.0, 3e38, -math.inf,
                                 1.0, 0.0, math.inf, WEIGHTED=weighted, FROM_HIDDEN=hidden, grid=(1,))
    print("bound", weighted, hidden)
S, H, D, TOPK = 4096, 64, 128, 2048
for add, dt in ((True, torch.float32), (True, torch.bfloat16), (False, torch.uint8)):
    m = torch.empty(1, S, S, dtype=dt)
    tmr._visible_range_kernel.warmup(m, S * S, S, 1, i32, i32, i32, i32, f32, S, S, ADD=add, WHERE=True, BLOCK=1024, grid=(1,))
    print("ranges", add, dt)

# the HyTopK kernel for HF's masks; the launch's device pre-passes are stubbed (CPU tensors)
th.score_bound_flag = lambda *a, **kw: torch.ones(1, dtype=torch.int32)
th.finite_flag = lambda *a, **kw: torch.ones(1, dtype=torch.int32)
def ranges(spec, m, bound_flag, term=None):
    B, S_, T = m.shape
    j, needs_bound = tensor_mask_term(spec)
    lo, hi = torch.zeros(B, S_, dtype=torch.int32), torch.full((B, S_), T, dtype=torch.int32)
    return tmr.MaskRanges(lo, hi, torch.zeros(1) if spec.masks[j].kind == "add" else None,
                          i32 if needs_bound else None, lo, hi)
th.mask_key_ranges = ranges
q, k, w = torch.empty(1, S, H, D, dtype=torch.bfloat16), torch.empty(1, S, 1, D, dtype=torch.bfloat16), torch.empty(1, S, H)
hi = torch.arange(1, S + 1).view(1, S)
fmin = torch.finfo(torch.float32).min
ep = (("mul", D ** -0.5), ("relu",))
for name, term, masks in (
        ("range_add_inf", MaskTerm(kind="range", hi=0, mode="add", value=-math.inf), [hi]),
        ("range_add_finfo", MaskTerm(kind="range", hi=0, mode="add", value=fmin), [hi]),
        ("range_fill_finfo", MaskTerm(kind="range", hi=0, mode="fill", value=fmin), [hi]),
        ("tensor_add", MaskTerm(kind="add", operand=0), [torch.empty(1, S, S)]),
        ("tensor_fill", MaskTerm(kind="fill", operand=0, value=-math.inf), [torch.empty(1, S, S, dtype=torch.bool)])):
    spec = ScoreSpec(epilogue=ep, post=(("mask", 0),), masks=(term,))
    cfg = dataclasses.replace(th.default_config(S, S, TOPK, torch.device("cuda"), True, D, H, tma=True), num_programs=264)
    def launcher(kern, args, launch):
        # the stage count a default launch takes on an H100/H200 (two programs per SM)
        stages = th._resident_stages(kern, 264, args, launch, 2, th._SMEM_PER_SM)
        return stages, kern.warmup(*args, grid=(1,), **dict(launch, num_stages=stages))
    stages, ck = th.hytopk_triton(q, k, w, masks, TOPK, spec, config=cfg, _launcher=launcher)
    print("hytopk", name, ck.metadata.shared, stages)
"""


@needs_ptxas
def test_mask_kernels_compile_for_sm90(tmp_path):
    # The kernels that skip finite hidden values (docs/kernel.md, "Skipping hidden tiles"): the
    # score bound, a mask tensor's key ranges, and the HyTopK kernel for HF's finite masks and
    # for mask tensors, whose shared memory must still let two programs share an SM at the
    # stage count the default launch takes (_resident_stages: 3 for the range forms as at the
    # DSA shape; the mask-tensor forms' 1 KiB more scratch makes 3 stages 115,736 B, so they
    # keep 2)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["HYSCALE_KERNEL_CACHE"] = str(tmp_path / "kernels")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    out = subprocess.run([sys.executable, "-c", _MASK_KERNELS, ROOT], capture_output=True, text=True, env=env,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = out.stdout.splitlines()
    print("\n".join(lines))
    assert sum(ln.startswith("bound") for ln in lines) == 3 and sum(ln.startswith("ranges") for ln in lines) == 3
    shared = {ln.split()[1]: int(ln.split()[2]) for ln in lines if ln.startswith("hytopk")}
    stages = {ln.split()[1]: int(ln.split()[3]) for ln in lines if ln.startswith("hytopk")}
    assert set(shared) == {"range_add_inf", "range_add_finfo", "range_fill_finfo", "tensor_add", "tensor_fill"}, lines
    assert all(0 < s <= 115712 for s in shared.values()), (shared, stages)
    assert stages["range_add_finfo"] == stages["range_fill_finfo"] == 3 and min(stages.values()) >= 2, stages
    # DSA's additive -inf mask (skipping waits for the launch's finite flag): the same as the fill
    assert stages["range_add_inf"] == 3 and shared["range_add_inf"] == shared["range_fill_finfo"], (shared, stages)


@needs_ptxas
def test_indexer_kl_kernels_compile_for_sm90(tmp_path):
    """The dense indexer KL loss's five kernels (benchmarks/bench_indexer_kl.py --inspect, bf16,
    the DSA shape) under the default launch configuration and the previous one, which the
    benchmark compares it with: every kernel builds, on the tensor cores, without spills and
    within one block's 227 KiB of shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    previous = ("dq_heads=1,dq_block_n=0,dk_heads=1,dk_trans=0,dk_block_n=64,dk_head_split=4,lse_block_m=0,"
                "head_stages=0,grad_stages=0")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_indexer_kl.py"), "--inspect",
                          "--dtypes", "bfloat16", "--config", f"default;{previous}"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    rows = [dict(kv.split("=", 1) for kv in ln.split()[1:] if "=" in kv) for ln in out.stdout.splitlines()
            if ln.startswith("inspect ")]
    kernels = {"_attn_lse_kernel", "_kl_fwd_kernel", "_kl_dI_kernel", "_kl_dq_kernel", "_kl_dk_kernel"}
    for config in ("default", previous):
        got = {r["kernel"]: r for r in rows if r.get("config") == config and "kernel" in r}
        assert set(got) == kernels, (config, out.stdout)
        for name, r in got.items():
            assert r["wgmma"] == "1" and r["spill"] == "0", (config, name, r)
            assert 0 < int(r["regs"]) <= 255 and int(r["smem"]) <= 232448, (config, name, r)


_FP32_EXAMPLE_PTX = r"""
import os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks")); sys.path.insert(0, sys.argv[1])
import math
import torch
import inspect_hytopk as ih
from triton.runtime import driver
driver.set_active(ih._Sm90())
from hyscale_compile.lowerings import triton_hytopk as th
from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec
# (the launch's device-side flags are kernels of their own; only the selection kernel is built)
th.hidden_value_flag = th.finite_flag = lambda *a, **kw: torch.ones(1, dtype=torch.int32)
B, S, H, D, K = 4, 8192, 16, 16, 256
q, k, w = torch.empty(B, S, H, D), torch.empty(B, S, 1, D), torch.empty(B, S, H)
hi = torch.arange(1, S + 1).view(1, S).expand(B, S).contiguous()
# HF's causal mask as the example's graph canonicalizes it (finfo.min added), DSA's -inf one, and
# an unweighted head sum whose epilogue ends in a product
for name, value, reduce, epi in (
        ("finfo", float(torch.finfo(torch.float32).min), "weighted_sum", (("mul", D ** -0.5), ("relu",))),
        ("inf", -math.inf, "weighted_sum", (("mul", D ** -0.5), ("relu",))),
        ("sum", -math.inf, "sum", (("relu",), ("mul", D ** -0.5)))):
    spec = ScoreSpec(name="dsa", epilogue=epi, reduce=reduce,
                     post=(("mask", 0),), masks=(MaskTerm(kind="range", hi=0, mode="add", value=value),))
    cfg = th.default_config(S, S, K, torch.device("cuda"), False, D, H)
    cfg = th.dataclasses.replace(cfg, num_programs=264)
    ck = th.hytopk_triton(q, k, w if reduce == "weighted_sum" else None, [hi], K, spec, config=cfg,
                          _launcher=lambda kern, args, launch: kern.warmup(*args, grid=(1,), **launch))
    with open(os.path.join(sys.argv[2], name + ".ptx"), "w") as f:
        f.write(ck.asm["ptx"])
    print(name, cfg)
"""


def _replica_unsafe_sums(ptx: str) -> list:
    """The PTX instructions where a lane adds a value shuffled from another lane to a product
    that is not rounded on its own: an fma taking the shuffled value, or an add of it to a
    plain mul.f32 (which ptxas may fuse). The two lanes of such a butterfly step then round
    differently, so the copies of one reduced value that the lanes hold differ."""
    import re

    defs, shuffled = {}, set()
    for ln in ptx.splitlines():
        m = re.match(r"\s*(shfl\.sync\.bfly\.b32|[a-z]+(?:\.[a-z0-9]+)*)\s+(%r\d+)\s*,(.*?);", ln)
        if m:
            defs[m.group(2)] = m.group(1)
            if m.group(1).startswith("shfl.sync.bfly"):
                shuffled.add(m.group(2))
    bad = []
    for ln in ptx.splitlines():
        m = re.match(r"\s*((?:fma|add)\.(?:rn\.)?f32)\s+%r\d+\s*,(.*?);", ln)
        if not m:
            continue
        ops = re.findall(r"%r\d+", m.group(2))
        if not any(o in shuffled for o in ops):
            continue
        if m.group(1).startswith("fma") or any(defs.get(o) == "mul.f32" for o in ops if o not in shuffled):
            bad.append(ln.strip())
    return bad


@needs_ptxas
def test_fp32_head_sum_copies_agree_for_sm90(tmp_path):
    # examples/train_dsa.py's fp32 indexer on an H200 (16 heads x 16, k = 256, HF's causal mask
    # canonicalized to a range; the launch's fp32 default: 32-key FMA-unit tiles, 4 rows):
    # the head sum runs across 8 lanes, and every lane keeps a copy of each reduced score, from
    # which it decides the key's append and counts its lane. LLVM fused the first butterfly
    # step with the lane's own head product (fma(w, x, the partner's rounded product)), so the
    # copies rounded differently; where they straddled a row's threshold, one copy appended
    # the key and counted it and another did not, and from then on their appends overwrote
    # each other's slots, which leaves a key in two slots (what the same-weights check found
    # in 2 of 3.3M rows; the interpreter keeps one copy, so CPU tests cannot show it).
    # Every butterfly step must add two rounded values (IEEE addition commutes, so every copy
    # is then the same bits).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["HYSCALE_KERNEL_CACHE"] = str(tmp_path / "kernels")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    out = subprocess.run([sys.executable, "-c", _FP32_EXAMPLE_PTX, ROOT, str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    print(out.stdout)
    for name in ("finfo", "inf", "sum"):
        with open(tmp_path / f"{name}.ptx") as f:
            ptx = f.read()
        assert ptx.count("shfl.sync.bfly") > 0, "the head sum no longer crosses lanes: revisit this test"
        bad = _replica_unsafe_sums(ptx)
        assert not bad, f"{name}: {len(bad)} butterfly steps fused with a lane's own product, e.g. {bad[:3]}"


@needs_ptxas
def test_values_backward_kernels_compile_for_sm90(tmp_path):
    """hytopk_values_backward's fused row kernel (benchmarks/bench_sparse_backward.py --inspect,
    bf16, 64 x 128 heads) in both contribution layouts (the default's q^T gx, and c_trans=0), with and without the key-sorted
    destinations, and the sorted segment sum: every build succeeds without spills; the row
    kernel on the tensor cores (wgmma) within one block's 227 KiB of shared memory."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HYSCALE_VALUES_BWD_CONFIG")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_sparse_backward.py"), "--inspect",
                          "default;c_trans=0"], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    rows = [dict(kv.split("=", 1) for kv in ln.split()[1:] if "=" in kv) for ln in out.stdout.splitlines()
            if ln.startswith("inspect ")]
    row_builds = {(r["config"], r["dest"]) for r in rows if r["kernel"] == "values_backward_kernel"}
    assert row_builds == {(c, d) for c in ("default", "c_trans=0") for d in ("True", "False")}, out.stdout
    assert [r["kernel"] for r in rows].count("_sorted_runs_kernel") == 1, out.stdout
    for r in rows:
        assert r["spill"] == "0" and 0 < int(r["regs"]) <= 255, r
        if r["kernel"] == "values_backward_kernel":
            assert r["wgmma"] == "1" and int(r["smem"]) <= 232448, r
