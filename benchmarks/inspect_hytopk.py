"""Compile the DSA HyTopK kernel for sm_90 on any machine (no GPU needed) and report what
ptxas made of it: registers, spills, stack, shared memory, and SASS instruction counts.

    python benchmarks/inspect_hytopk.py                        # a few configurations
    python benchmarks/inspect_hytopk.py --configs "default;num_stages=2;sort=bitonic"
    python benchmarks/inspect_hytopk.py --dump DIR              # also write ttgir/ptx/sass
    python benchmarks/inspect_hytopk.py --configs default --lines  # the tile loop per source line
    python benchmarks/inspect_hytopk.py --shape qsa             # QSA's chunk: bf16 q, fp32 pooled keys

Each configuration is ``default`` (the launch's own default at the DSA shape) or a
comma-separated list of ``HyTopKConfig`` fields (``field=value``) over that default;
configurations are separated by ``;``. The kernel is specialized exactly as a real launch at
the DSA shape would be (H=64, D=128, k=2048, bf16, causal range mask, 264 programs): Triton's
own ``warmup`` path runs against a stand-in driver that reports an sm_90 target, so only the
launch is skipped. This catches GPU-only compile errors (the interpreter accepts code that
compiled Triton rejects) and shows register pressure before any device time is spent.

Columns: regs (per thread), spill st/ld (bytes, ptxas -v), stack (bytes), smem (bytes the
launch needs), sass (instructions), STL/LDL (spill instructions in the SASS), wgmma, bar
(barriers); then the scored-tile loop alone (the innermost loop around the last wgmma):
its instructions, spill instructions, barriers, atomics and shuffles; compile (seconds).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import subprocess
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("inspect_hytopk.py compiles for the GPU: unset TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

from sweep_hytopk_config import parse_fields  # noqa: E402  (benchmarks/ is this script's directory)

H, D, TOPK = 64, 128, 2048
DEFAULT_CONFIGS = "default;tma=0,num_stages=3,reread_weights=1;reread_weights=1"


class _Sm90:
    """The part of a Triton driver that ``JITFunction.warmup`` asks for."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def compile_qsa(fields: dict):
    """The QSA chunk's kernel (bench_variants / sweep_qsa_config: 4,096 rows, 4 heads of 128,
    8,192 fp32 pooled keys, k=512): bf16 queries against fp32 keys, the three-part bf16 dots."""
    import bench_variants as bv
    from hyscale_compile.lowerings.ops import parse_spec
    from hyscale_compile.lowerings.triton_hytopk import default_config, hytopk_triton
    from sweep_qsa_config import QSA_SPEC

    S, N = bv.CHUNK, 32768 // bv.QR  # the last chunk of a 32K sequence
    q = torch.empty(1, S, bv.QH, bv.QD, dtype=torch.bfloat16)
    k = torch.empty(1, N, 1, bv.QD, dtype=torch.float32)
    hi = torch.arange(1, S + 1).view(1, S)
    base = default_config(S, N, bv.QK, torch.device("cuda"), False, bv.QD, bv.QH, split=True)
    cfg = dataclasses.replace(base, **{"num_programs": 264, **fields})
    t = time.perf_counter()
    ck = hytopk_triton(q, k, None, [hi], bv.QK, parse_spec(QSA_SPEC), config=cfg,
                       _launcher=lambda kern, args, launch: kern.warmup(*args, grid=(1,), **launch))
    return ck, time.perf_counter() - t


def compile_dsa(fields: dict, S: int = 4096):
    from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec
    from hyscale_compile.lowerings.triton_hytopk import default_config, hytopk_triton

    spec = ScoreSpec(name="dsa", epilogue=(("mul", D**-0.5), ("relu",)), reduce="weighted_sum",
                     post=(("mask", 0),), masks=(MaskTerm(kind="range", hi=0),))
    q = torch.empty(1, S, H, D, dtype=torch.bfloat16)
    k = torch.empty(1, S, 1, D, dtype=torch.bfloat16)
    w = torch.empty(1, S, H)
    hi = torch.arange(1, S + 1).view(1, S)
    # the launch's own default at this shape, with the given fields over it
    base = default_config(S, S, TOPK, torch.device("cuda"), True, D, H, tma=True)  # k's layout takes TMA
    cfg = dataclasses.replace(base, **{"num_programs": 264, **fields})

    def launcher(kern, args, launch):
        return kern.warmup(*args, grid=(1,), **launch)

    t = time.perf_counter()
    ck = hytopk_triton(q, k, w, [hi], TOPK, spec, config=cfg, _launcher=launcher)
    return ck, time.perf_counter() - t


_PTXAS_LOGS: dict = {}  # PTX -> the log of the ptxas run that built its cubin


def _keep_ptxas_logs() -> None:
    """Triton's own build runs ``ptxas -v``: keep its log by PTX, so that ``ptxas_report``
    reads the build's registers and spills instead of running ptxas a second time (as long
    again as the rest of the build for the large kernels)."""
    from triton import knobs
    from triton.backends.nvidia.compiler import CUDABackend

    real = CUDABackend.make_cubin
    if getattr(real, "_keeps_logs", False):
        return

    def make_cubin(self, src, metadata, opt, capability):
        buf = io.StringIO()
        with knobs.nvidia.scope(), contextlib.redirect_stdout(buf):
            knobs.nvidia.dump_ptxas_log = True  # printed after a successful build
            cubin = real(self, src, metadata, opt, capability)
        _PTXAS_LOGS[src] = buf.getvalue()
        return cubin

    make_cubin._keeps_logs = True
    CUDABackend.make_cubin = make_cubin


_keep_ptxas_logs()


def ptxas_report(ptx: str, bindir: str) -> dict:
    log = _PTXAS_LOGS.get(ptx)
    if log is None:  # a kernel from Triton's cache: no build ran here
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            log = subprocess.run([os.path.join(bindir, "ptxas"), "-v", "--gpu-name=sm_90a", src, "-o",
                                  os.path.join(d, "k.cubin")], capture_output=True, text=True, check=True).stderr
    out = {}
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if m:
        out["stack"], out["spill_st"], out["spill_ld"] = map(int, m.groups())
    m = re.search(r"Used (\d+) registers", log)
    if m:
        out["regs"] = int(m.group(1))
    return out


def sass_counts(cubin: bytes, bindir: str) -> tuple[dict, str]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", path], capture_output=True,
                              text=True, check=True).stdout
    ins = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", ln)]
    def count(pat):
        return sum(1 for ln in ins if re.search(pat, ln))
    out = {"sass": len(ins), "STL": count(r"\bSTL\b"), "LDL": count(r"\bLDL\b"), "wgmma": count(r"HGMMA"),
           "bar": count(r"\bBAR\b")}
    out.update(_hot_loop(ins))
    return out, sass


def _hot_loop(ins: list) -> dict:
    """Instruction counts inside the innermost loop that holds the last wgmma (the scored-tile
    loop; the sampled estimate's copy of the tile code comes before it): from the target of the
    first backward branch that jumps over it, to that branch."""
    parsed = []
    for ln in ins:
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", ln)
        if m:
            parsed.append((int(m.group(1), 16), m.group(2)))

    def target(text):
        m = re.search(r"\bBRA\s+(0x[0-9a-f]+)", text)
        return int(m.group(1), 16) if m else None

    span = _tile_loop_span(parsed, target)
    if span is None:
        return {}
    body = [t for b, t in parsed if span[0] <= b <= span[1]]

    def cnt(pat):
        return sum(1 for t in body if re.search(pat, t))
    return {"loop": len(body), "loop_spill": cnt(r"\b(STL|LDL)\b"), "loop_bar": cnt(r"\bBAR\b"),
            "loop_atom": cnt(r"\bATOM|\bRED\b"), "loop_shfl": cnt(r"\bSHFL\b")}


def _tile_loop_span(ins, target):
    """(first, last) address of the scored-tile loop in ``ins`` [(address, instruction)]: from
    the target of the first backward branch that jumps over the last wgmma, to that branch.
    ``target(instruction)`` is a branch's target address, or None."""
    first = next((a for a, t in reversed(ins) if "HGMMA" in t), None)
    if first is None:
        return None
    for a, t in ins:
        dest = target(t) if a > first else None
        if dest is not None and dest <= first:
            return dest, a
    return None


def loop_lines(cubin: bytes, bindir: str, top: int = 25) -> str:
    """The tile loop's SASS instructions per kernel source line (``nvdisasm -g`` line info):
    what each line of the generated kernel costs per tile, before any GPU time is spent."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", "-g", path], capture_output=True, text=True,
                             check=True).stdout
    ins, labels, pending, cur = [], {}, [], None  # (address, instruction, (file, line))
    for ln in out.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', ln)
        if m:
            cur = (m.group(1), int(m.group(2)))
            continue
        m = re.match(r"\s*(\.L_x_\d+):", ln)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", ln)
        if m:
            addr = int(m.group(1), 16)
            labels.update((lab, addr) for lab in pending)
            pending = []
            ins.append((addr, m.group(2), cur))
    def target(text):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        return labels.get(m.group(1)) if m else None

    span = _tile_loop_span([(a, t) for a, t, _ in ins], target)
    if span is None:
        return "no tile loop found"
    counts = {}
    for a, _, c in ins:
        if span[0] <= a <= span[1]:
            counts[c] = counts.get(c, 0) + 1
    texts = {}
    lines = [f"tile loop: {sum(counts.values())} instructions per warp per tile, by source line"]
    for c, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]:
        if c is None:
            lines.append(f"{n:5d}  ?")
            continue
        if c[0] not in texts:
            try:
                with open(c[0]) as f:
                    texts[c[0]] = f.read().splitlines()
            except OSError:
                texts[c[0]] = []
        src = texts[c[0]][c[1] - 1].strip() if c[1] <= len(texts[c[0]]) else ""
        lines.append(f"{n:5d}  {os.path.basename(c[0])}:{c[1]}  {src[:100]}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="';'-separated HyTopKConfig field lists")
    ap.add_argument("--dump", default=None, help="directory for ttgir/ptx/sass of each configuration")
    ap.add_argument("--lines", action="store_true", help="also the tile loop's instructions per source line")
    ap.add_argument("--shape", default="dsa", choices=("dsa", "qsa"),
                    help="dsa (H=64, bf16 q and k) or qsa (4 heads, bf16 q, fp32 pooled keys: the split dots)")
    args = ap.parse_args()
    driver.set_active(_Sm90())
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    rows = []
    for i, text in enumerate(filter(None, (c.strip() for c in args.configs.split(";")))):
        print(f"[{i}] compiling {text} ...", file=sys.stderr, flush=True)
        fields = {} if text == "default" else parse_fields(text)
        ck, secs = compile_qsa(fields) if args.shape == "qsa" else compile_dsa(fields)
        rep = ptxas_report(ck.asm["ptx"], bindir)
        counts, sass = sass_counts(ck.asm["cubin"], bindir)
        rows.append((text, rep, ck.metadata.shared, counts, secs))
        if args.lines:
            print(f"[{i}] {text}\n" + loop_lines(ck.asm["cubin"], bindir) + "\n")
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                with open(os.path.join(args.dump, f"cfg{i}.{ext}"), "w") as f:
                    f.write(ck.asm[ext])
            with open(os.path.join(args.dump, f"cfg{i}.sass"), "w") as f:
                f.write(sass)
    hdr = f"{'config':40s} {'regs':>4s} {'spill st/ld':>11s} {'stack':>5s} {'smem':>6s} {'sass':>6s} " \
          f"{'STL/LDL':>8s} {'wgmma':>5s} {'bar':>4s} | {'loop':>5s} {'spill':>5s} {'bar':>4s} {'atom':>4s} " \
          f"{'shfl':>4s} | {'compile':>7s}"
    print(hdr)
    for text, rep, smem, c, secs in rows:
        print(f"{text:40s} {rep.get('regs', 0):4d} {rep.get('spill_st', 0):5d}/{rep.get('spill_ld', 0):<5d} "
              f"{rep.get('stack', 0):5d} {smem:6d} {c['sass']:6d} {c['STL']:>3d}/{c['LDL']:<4d} {c['wgmma']:5d} "
              f"{c['bar']:4d} | {c.get('loop', 0):5d} {c.get('loop_spill', 0):5d} {c.get('loop_bar', 0):4d} "
              f"{c.get('loop_atom', 0):4d} {c.get('loop_shfl', 0):4d} | {secs:6.1f}s")


if __name__ == "__main__":
    main()
