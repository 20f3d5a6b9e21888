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
def _low_bits_in_registers(keys, N: tl.constexpr, R: tl.constexpr):
    # keys [N] relabelled so that the bitonic network's low flat index bits are register
    # bits. The network compares elements whose flat indices differ in one bit, and the low
    # bits take the most steps. The keys arrive in the layout of the 32-bit
    # output stores: flat bits 0-1 in registers (4 per vector), then lanes, then warps, then
    # the register repeats at the top (log2(R) bits; the launcher's SORT_R = N / (4 *
    # threads)). The keys are a set, so their order going in is free: viewed as [R, N / R]
    # and transposed, the repeat bits become bits 0..log2(R)-1 and the vector bits follow,
    # so the low four bits are all registers (2048 int64 keys, 4 warps: R = 4; checked in the
    # TTGIR). sm_90: shuffles 2756 -> 2308 and barriers 225 -> 221 over the kernel; 29.5 ->
    # 27.4 ms at 32K (docs/kernel-design.md, v9).
    if R > 1:
        keys = tl.reshape(tl.trans(tl.reshape(keys, [R, N // R])), [N])
    return keys


@triton.jit
def _sort_desc(keys, N: tl.constexpr, R: tl.constexpr):
    # keys [N] in descending order by tl.sort's bitonic network, its low index bits moved into
    # registers first (_low_bits_in_registers)
    return tl.sort(_low_bits_in_registers(keys, N, R), descending=True)


@triton.constexpr_function
def _log2c(n):
    return int(n).bit_length() - 1


@triton.jit
def _cx_reg(x, N: tl.constexpr, j: tl.constexpr, s: tl.constexpr, REG_BITS: tl.constexpr):
    # One compare-exchange step of the bitonic network (stage s, flat index bit j < s) done
    # once per pair: the halves a (bit j = 0) and b (bit j = 1) split apart (register-only
    # where bit j is a register bit), one 64-bit compare, the larger key to a and the
    # smaller to b, or the reverse where bit s of the flat index is set (the stage's
    # ascending blocks; in the last stage, s = log2(N), every block descends).
    A: tl.constexpr = N >> (j + 1)
    B: tl.constexpr = 1 << j
    a, b = tl.split(tl.permute(tl.reshape(x, [A, 2, B]), [0, 2, 1]))
    if s < _log2c(N):
        up = ((tl.arange(0, A) >> (s - j - 1)) & 1)[:, None] != 0
        c = (a > b) != up
    else:
        c = a > b
    hi = tl.where(c, a, b)
    if s < REG_BITS or s == _log2c(N):
        # the direction known at compile time: LLVM would make the two selects max.s64 and
        # min.s64, which ptxas compares twice; the xor keeps the one compare
        lo = a ^ b ^ hi
    else:
        # the direction a lane/warp bit: ptxas folds it into the compare (ISETP.XOR), and
        # the second select needs fewer registers than the xor (1 warp: 165 against 255)
        lo = tl.where(c, b, a)
    return tl.reshape(tl.permute(tl.join(hi, lo), [0, 2, 1]), [N])


@triton.jit
def _cx_xor(x, N: tl.constexpr, j: tl.constexpr, s: tl.constexpr):
    # The same step per element, as triton's _compare_and_swap: each element's partner
    # (flat index xor 2^j) is the pair's xor-sum (shuffles where bit j is a lane bit,
    # shared memory where it is a warp bit), and each element keeps the larger or the
    # smaller of the two.
    A: tl.constexpr = N >> (j + 1)
    B: tl.constexpr = 1 << j
    h = tl.reshape(x, [A, 2, B])
    y = h ^ tl.xor_sum(h, 1, keep_dims=True)
    right = (tl.arange(0, 2) != 0)[None, :, None]
    if s < _log2c(N):
        up = ((tl.arange(0, A) >> (s - j - 1)) & 1)[:, None, None] != 0
        take = (h > y) == (up != right)
    else:
        take = (h > y) == right
    return tl.reshape(tl.where(take, y, h), [N])


@triton.jit
def _sort_desc_minmax(keys, N: tl.constexpr, R: tl.constexpr, REG_BITS: tl.constexpr, SKIP: tl.constexpr = -1):
    # keys [N] (N = 2^n) in descending order by the same bitonic network as tl.sort (stage s
    # = 1..n merges blocks of 2^s, one step per flat bit j = s-1..0, each block of the stage
    # descending where bit s of the flat index is 0; the last stage all descending), after
    # _low_bits_in_registers (R) makes the low flat bits register bits. Steps on the
    # low REG_BITS bits are done once per pair (_cx_reg: one 64-bit compare, the pair's max
    # and min); steps on higher bits, whose pairs lie in two lanes or warps, per element
    # (_cx_xor). REG_BITS changes the cost, never the order. SKIP (tests only): the index of
    # one step left out, to show that the tests notice a missing step.
    keys = _low_bits_in_registers(keys, N, R)
    LOG_N: tl.constexpr = _log2c(N)
    for s in tl.static_range(1, LOG_N + 1):
        for i in tl.static_range(s):
            if (s * (s - 1)) // 2 + i != SKIP:
                if s - 1 - i < REG_BITS:
                    keys = _cx_reg(keys, N, s - 1 - i, s, REG_BITS)
                else:
                    keys = _cx_xor(keys, N, s - 1 - i, s)
    return keys


@triton.constexpr_function
def _reg_bits(n, r):
    # the low flat-index bits that are register bits after _low_bits_in_registers: keys
    # arrive 4 per vector (the 32-bit stores' layout), R repeats per thread (fewer when the
    # row is short)
    return min(int(n), 4 * int(r)).bit_length() - 1


@triton.jit
def _sort_desc_by(keys, N: tl.constexpr, R: tl.constexpr, NETWORK: tl.constexpr):
    # keys [N] descending by NETWORK: 0 tl.sort's bitonic network (_sort_desc), 1 the same
    # network with its in-register steps once per pair (_sort_desc_minmax). Same order.
    if NETWORK == 1:
        return _sort_desc_minmax(keys, N, R, _reg_bits(N, R))
    else:
        return _sort_desc(keys, N, R)
