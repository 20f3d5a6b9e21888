"""Gluon helpers shared by the Gluon calibrations (calibrate_gluon_compact.py,
calibrate_gluon_ws.py). Gluon kernels cannot call ``triton.jit`` functions, so these are the
Gluon forms of pieces the library's Triton kernel has (lowerings/triton_codegen.py)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _highest_bit(x):
    # triton_codegen._highest_bit: index of the highest set bit of a uint32 scalar (0 for
    # x <= 1), five halving steps
    hb = gl.zeros([], dtype=gl.int32)
    for i in gl.static_range(5):
        sh = 16 >> i
        big = x >= (1 << sh)
        x = gl.where(big, x >> sh, x)
        hb += gl.where(big, sh, 0)
    return hb
