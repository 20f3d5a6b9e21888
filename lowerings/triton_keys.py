"""Ordered int64 keys: how HyTopK's kernels compare, sort and unpack (score, index) pairs.

A key is (order-preserving fp32 bits) << 32 | (0xFFFFFFFF - key index). A larger key means a
larger score, or an equal score at a smaller key index, so one descending sort gives (value
desc, index asc): the project's tie rule. The generated kernel (``triton_codegen``) and the
rows' sort kernel (``triton_sort_rows``) both import these, so that a row sorted after the
fused kernel is ordered exactly as the fused kernel would have ordered it.
"""
import triton
import triton.language as tl

EMPTY = tl.constexpr(-9223372036854775807)  # below every real key (real high words > INT32_MIN)
FULL = tl.constexpr(9223372036854775807)    # above every real key
NEG_INF_HI = tl.constexpr(-2139095041)      # high word of the key of -inf


@triton.jit
def _pack(y, keys):
    y = tl.where(y == 0.0, 0.0, y)           # -0.0 -> +0.0: ReLU zeros must tie exactly
    y = tl.where(y != y, float("nan"), y)    # one positive NaN: sorts above +inf, like torch.sort
    b = y.to(tl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)         # negative floats: flip magnitude bits
    return (b.to(tl.int64) << 32) | (4294967295 - keys.to(tl.int64))


@triton.jit
def _unpack_value(p):
    hi = (p >> 32).to(tl.int32)
    b = hi ^ ((hi >> 31) & 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _unpack_index(p):
    return 4294967295 - (p & 4294967295)


@triton.jit
def _score_bits(keys):
    # The high words (scores) of packed keys as uint32, order kept: larger score, larger u.
    # Every real key's u is > 0; EMPTY's is 0.
    return ((keys >> 32).to(tl.int32) ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _sort_desc(keys, N: tl.constexpr, R: tl.constexpr):
    # keys [N] in descending order by tl.sort's bitonic network, its low index bits moved into
    # registers first. The network compares elements whose flat indices differ in one bit,
    # and the low bits take the most steps. The keys arrive in the layout of the 32-bit
    # output stores: flat bits 0-1 in registers (4 per vector), then lanes, then warps, then
    # the register repeats at the top (log2(R) bits; the launcher's SORT_R = N / (4 *
    # threads)). The keys are a set, so their order going in is free: viewed as [R, N / R]
    # and transposed, the repeat bits become bits 0..log2(R)-1 and the vector bits follow,
    # so the low four bits are all registers (2048 int64 keys, 4 warps: R = 4; checked in the
    # TTGIR). sm_90: shuffles 2756 -> 2308 and barriers 225 -> 221 over the kernel; 29.5 ->
    # 27.4 ms at 32K (docs/kernel-design.md, v9).
    if R > 1:
        keys = tl.reshape(tl.trans(tl.reshape(keys, [R, N // R])), [N])
    return tl.sort(keys, descending=True)
