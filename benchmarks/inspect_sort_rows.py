"""Compile the rows' sort kernel (``lowerings/triton_sort_rows._sort_rows_kernel``) for sm_90
on any machine (no GPU needed) and count what ptxas made of each network.

    python benchmarks/inspect_sort_rows.py                      # k=2048, every network, 1/2/4 warps
    python benchmarks/inspect_sort_rows.py --networks minmax,transpose --warps 2 --converts
    python benchmarks/inspect_sort_rows.py --plan 2             # the transpose network's moves
    python benchmarks/inspect_sort_rows.py --dump DIR           # also ttgir/ptx/sass per build

The kernel is specialized as ``sort_rows_`` launches it (int32 indices, fp32 values, R from
the warps; ``write_values=False`` as ``profile_hytopk.py --target sort_rows`` runs it, unless
``--write-values``); Triton's ``warmup`` runs against a stand-in sm_90 driver (as in
inspect_hytopk.py), so nothing is launched.

Columns: regs, spill st/ld (bytes, ptxas -v), smem (bytes), sass (instructions per thread),
ISETP, SEL, LOP3, IMAD (of them IMAD.MOV, register moves), SHFL, BAR, LDS, STS (SASS
instructions per thread), row (sass x warps: a row's warp-instructions), cvt (TTGIR
``convert_layout`` ops), smem ops (TTGIR local_alloc / local_load / local_store: shared
memory Triton was told to use, none here; conversions get theirs when lowered).
``--converts`` lists each conversion's shapes; ``--plan W`` prints the transpose network's
register windows for W warps (triton_keys._transpose_plan).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("inspect_sort_rows.py compiles for the GPU: unset TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime import driver  # noqa: E402

from inspect_hytopk import _Sm90, ptxas_report  # noqa: E402
from hyscale_compile.lowerings import triton_sort_rows as lib  # noqa: E402
from hyscale_compile.lowerings.triton_keys import _reg_bits, _transpose_plan  # noqa: E402


def launch_r(k_p2: int, num_warps: int) -> int:
    return max(1, k_p2 // (128 * num_warps))  # as sort_rows_


def compile_sort(k: int, num_warps: int, network: str, write_values: bool = False, rows: int = 1):
    # num_warps per row; the program sorts `rows` rows with num_warps * rows warps
    k_p2 = triton.next_power_of_2(k)
    idx = torch.empty(4, k, dtype=torch.int32)
    vals = torch.empty(4, k, dtype=torch.float32)
    return lib._sort_rows_kernel.warmup(idx, vals, 4, k, k_p2, launch_r(k_p2, num_warps), write_values,
                                        lib.NETWORKS[network], rows, grid=(1,), num_warps=num_warps * rows)


def sass_text(cubin: bytes, bindir: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", path], capture_output=True,
                              text=True, check=True).stdout


def counts(ck, bindir: str):
    sass = sass_text(ck.asm["cubin"], bindir)
    ins = [m.group(1) for m in (re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", ln) for ln in sass.splitlines()) if m]
    ops = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in ins]

    def n(name):
        return sum(1 for o in ops if o == name or o.startswith(name + "."))
    ttgir = ck.asm["ttgir"]
    out = dict(sass=len(ins), ISETP=n("ISETP"), SEL=n("SEL"), LOP3=n("LOP3"), IMAD=n("IMAD"),
               MOV=n("IMAD.MOV"), SHFL=n("SHFL"), BAR=n("BAR"), LDS=n("LDS"), STS=n("STS"),
               cvt=ttgir.count("ttg.convert_layout"),
               smem_ops=sum(ttgir.count(f"ttg.local_{x}") for x in ("alloc", "load", "store")))
    out.update(ptxas_report(ck.asm["ptx"], bindir))
    out["smem"] = ck.metadata.shared
    return out, sass


def convert_shapes(ttgir: str):
    # "source layout -> target layout" per conversion, by tensor shape
    for m in re.finditer(r"ttg\.convert_layout %\S+ : tensor<([^,]+), #(\w+)> -> tensor<[^,]+, #(\w+)>", ttgir):
        yield f"{m.group(1)}: #{m.group(2)} -> #{m.group(3)}"


def print_plan(k: int, num_warps: int):
    k_p2 = triton.next_power_of_2(k)
    log_n, reg_bits = k_p2.bit_length() - 1, _reg_bits(k_p2, launch_r(k_p2, num_warps))
    plan = _transpose_plan(log_n, reg_bits)
    print(f"transpose plan, {k_p2} keys, {num_warps} warps ({reg_bits} register bits):")
    t = 0
    for s in range(1, log_n + 1):
        for j in range(s - 1, -1, -1):
            order, known = plan[t]
            if order:
                w = max(1, min(reg_bits, log_n))
                print(f"  step {t:2d} (stage {s}, bit {j}): move; registers {list(order[:w])}, "
                      f"warps+lanes {list(order[w:])} (lanes last)")
            t += 1
    print(f"  {sum(1 for o, _ in plan if o)} moves over {len(plan)} steps")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--warps", default="1,2,4")
    ap.add_argument("--networks", default=",".join(lib.NETWORKS))
    ap.add_argument("--write-values", action="store_true", help="also store the sorted values")
    ap.add_argument("--converts", action="store_true", help="list each build's layout conversions")
    ap.add_argument("--plan", type=int, default=None, metavar="WARPS",
                    help="print the transpose plan of one row and stop (rows per program move the same bits)")
    ap.add_argument("--dump", default=None, help="directory for each build's ttgir/ptx/sass")
    ap.add_argument("--rows-per-program", type=int, default=1,
                    help="rows per program (transpose / f64; --warps then counts warps per row; row = sass x warps)")
    args = ap.parse_args()
    if args.plan is not None:
        print_plan(args.k, args.plan)
        return
    driver.set_active(_Sm90())
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cols = ["regs", "spill_st", "spill_ld", "smem", "sass", "ISETP", "SEL", "LOP3", "IMAD", "MOV", "SHFL", "BAR",
            "LDS", "STS", "row", "cvt", "smem_ops"]
    print(f"{'network':>10s} {'warps':>5s} " + " ".join(f"{c:>8s}" for c in cols), flush=True)
    for nw in [int(x) for x in args.warps.split(",")]:
        for network in args.networks.split(","):
            ck = compile_sort(args.k, nw, network, args.write_values, args.rows_per_program)
            c, sass = counts(ck, bindir)
            c["row"] = c["sass"] * nw
            print(f"{network:>10s} {nw:5d} " + " ".join(f"{c.get(x, 0):8d}" for x in cols), flush=True)
            if args.converts:
                for line in convert_shapes(ck.asm["ttgir"]):
                    print(f"{'':17s}{line}")
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                stem = os.path.join(args.dump, f"{network.replace('.', '_')}_w{nw}")
                for ext in ("ttgir", "ptx"):
                    with open(f"{stem}.{ext}", "w") as f:
                        f.write(ck.asm[ext])
                with open(f"{stem}.sass", "w") as f:
                    f.write(sass)


if __name__ == "__main__":
    main()
