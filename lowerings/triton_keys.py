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
    # 27.4 ms at 32K.
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
def _cx_reg(x, N: tl.constexpr, j: tl.constexpr, s: tl.constexpr, KNOWN: tl.constexpr, F64: tl.constexpr = False,
            ROWS: tl.constexpr = 1):
    # One compare-exchange step of the bitonic network (stage s, flat index bit j < s) done
    # once per pair: the halves a (bit j = 0) and b (bit j = 1) split apart (register-only
    # where bit j is a register bit), one 64-bit compare, the larger key to a and the
    # smaller to b, or the reverse where bit s of the flat index is set (the stage's
    # ascending blocks; in the last stage, s = log2(N), every block descends). KNOWN: bit s
    # is a register bit (or s = log2(N)), so each pair's direction is known at compile time.
    # F64: the keys are also ordered as doubles (_pack_f64), and compared as doubles.
    # ROWS: x holds ROWS rows of N keys, one network each (the row bits sit above bit s).
    A: tl.constexpr = (N * ROWS) >> (j + 1)
    B: tl.constexpr = 1 << j
    a, b = tl.split(tl.permute(tl.reshape(x, [A, 2, B]), [0, 2, 1]))
    if F64:
        af = a.to(tl.float64, bitcast=True)
        bf = b.to(tl.float64, bitcast=True)
        gt = af > bf
    else:
        gt = a > b
    if s < _log2c(N):
        up = ((tl.arange(0, A) >> (s - j - 1)) & 1)[:, None] != 0
        c = gt != up
    else:
        c = gt
    hi = tl.where(c, a, b)
    if F64:
        # the other key by two FP64 adds instead of two integer selects or xors (balancing
        # the ALU and FP64 pipes): every _pack_f64 key is a double in [2, 4), so a - b is
        # exact (Sterbenz) and (a - hi) + b is exactly b where hi = a, a where hi = b
        lo = ((af - hi.to(tl.float64, bitcast=True)) + bf).to(tl.int64, bitcast=True)
    elif KNOWN:
        # the direction known at compile time: LLVM would make the two selects max.s64 and
        # min.s64, which ptxas compares twice; the xor keeps the one compare
        lo = a ^ b ^ hi
    else:
        # the direction a lane/warp bit: ptxas folds it into the compare (ISETP.XOR), and
        # the second select needs fewer registers than the xor (1 warp: 165 against 255)
        lo = tl.where(c, b, a)
    return tl.reshape(tl.permute(tl.join(hi, lo), [0, 2, 1]), [N * ROWS])


@triton.constexpr_function
def _minmax_known(s, reg_bits, log_n):
    # after _low_bits_in_registers the low reg_bits flat bits are register bits
    return int(s) < int(reg_bits) or int(s) == int(log_n)


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
                    keys = _cx_reg(keys, N, s - 1 - i, s, _minmax_known(s, REG_BITS, LOG_N))
                else:
                    keys = _cx_xor(keys, N, s - 1 - i, s)
    return keys


# The transpose network: the same bitonic network (the same steps in the same order, so the
# same output bits), every step once per pair in registers (_cx_reg). A step whose bit j is
# a lane or warp bit in the current layout is preceded by a move (_move_bits): the keys go
# through shared memory into a layout whose register bits are the next REG_BITS distinct
# bits the network works on, so that the next steps are register steps (docs/kernel.md,
# "The final sort"). 2,048 keys, 2 warps: 11 moves replace minmax's 21 per-element steps across lanes
# and warps (1,344 shuffles per thread -> 32).

@triton.constexpr_function
def _plan_start(log_n, reg_bits, log_rows):
    # the layout the plan starts from: (register bits per thread, the register bits with the
    # layout's basis 0 first, the others: lane bits (basis 0 first), then warp bits, the
    # rows' on top), as _low_bits_in_registers leaves one row: register bits lowest, then
    # lanes, then warps
    w = min(max(1, int(reg_bits)), int(log_n))  # (a step needs its bit in registers: at least one)
    return w, list(range(w)), list(range(w, int(log_n) + int(log_rows)))


@triton.constexpr_function
def _transpose_plan(log_n, reg_bits, log_rows=0, _plans={}):
    # Per step t of the network (stage s = 1..log_n, bit j = s-1..0): (order, known). order,
    # where the step needs a move first: the flat bits as the dims of the moved hypercube,
    # register bits first, then warp bits, lane bits last (_move_bits); () where bit j is
    # already a register bit. known: bit s is a register bit (or s = log_n) at that step.
    # The window (register bits) after a move is the next reg_bits distinct bits the steps
    # use: the longest run of register steps any window gives (a greedy choice is optimal
    # when every move costs the same). Lane and warp slots keep their bits where they can,
    # and a bit leaving the registers takes the slot of one entering them, the warp slots
    # going to the bits used last, so that fewer moves cross warps (a barrier). log_rows:
    # 2^log_rows rows of 2^log_n keys, the row bits above the keys' (warp bits; no step
    # uses them, so they keep their slots, and orders list them too).
    # _plans: asked at every step of every sort (tens of thousands of times in an interpreted
    # test), a plan depends only on the three integers, so each is built once (a default
    # argument: Triton's dependency hashing refuses a reference to a plain global function)
    log_n = int(log_n)
    key = (log_n, int(reg_bits), int(log_rows))
    if key in _plans:
        return _plans[key]
    w, regs, others = _plan_start(log_n, reg_bits, log_rows)
    steps = [(s, s - 1 - i) for s in range(1, log_n + 1) for i in range(s)]
    plan = []
    for t in range(len(steps)):
        s = steps[t][0]
        j = steps[t][1]
        order = ()
        if j not in regs:
            later = [st[1] for st in steps[t:]]
            nxt = []
            for b in later:
                if b not in nxt and len(nxt) < w:
                    nxt.append(b)
            for b in regs:  # the network's last steps: keep register bits rather than move more
                if b not in nxt and len(nxt) < w:
                    nxt.append(b)
            # bits leaving the registers, the one used last (or never) first
            leaving = sorted([b for b in regs if b not in nxt],
                             key=lambda b: -(later.index(b) if b in later else len(later) + b))
            slots = sorted([k for k in range(len(others)) if others[k] in nxt], reverse=True)
            for k in range(len(slots)):
                others[slots[k]] = leaving[k]
            regs = nxt[::-1]
            order = tuple(regs[::-1]) + tuple(others[::-1])
        else:
            regs = [j] + [b for b in regs if b != j]  # (the step's join makes bit j basis 0)
        plan.append((order, s == log_n or s in regs))
    _plans[key] = tuple(plan)
    return _plans[key]


@triton.constexpr_function
def _tp_order(log_n, reg_bits, t, log_rows=0):
    return _transpose_plan(log_n, reg_bits, log_rows)[int(t)][0]


@triton.constexpr_function
def _tp_moves(log_n, reg_bits, t, log_rows=0):
    return len(_transpose_plan(log_n, reg_bits, log_rows)[int(t)][0]) > 0


@triton.constexpr_function
def _tp_start(log_n, reg_bits, log_rows):
    # _plan_start's layout as a move's order (register bits first, then warp bits, lane bits
    # last: _transpose_plan's orders)
    _, regs, others = _plan_start(log_n, reg_bits, log_rows)
    return tuple(regs[::-1]) + tuple(others[::-1])


@triton.constexpr_function
def _tp_known(log_n, reg_bits, t, log_rows=0):
    return _transpose_plan(log_n, reg_bits, log_rows)[int(t)][1]


@triton.constexpr_function
def _cube(n):
    return tuple([2] * int(n))


@triton.constexpr_function
def _dims_of(log_n, order):
    # hypercube dims for flat bits `order` (dim d of tl.reshape(x, [2] * log_n) is bit
    # log_n-1-d); a constexpr so that `.value` is the tuple both compiled and interpreted
    return tl.constexpr(tuple(int(log_n) - 1 - b for b in order))


@triton.constexpr_function
def _undims_of(log_n, order):
    order = list(order)
    return tl.constexpr(tuple(order.index(int(log_n) - 1 - k) for k in range(int(log_n))))


@triton.jit
def _move_bits(x, N: tl.constexpr, ORDER: tl.constexpr):
    # The same keys [N], moved through shared memory so that flat bits ORDER[:REG_BITS] are
    # register bits, then the warp bits, the last five lane bits. Triton has no explicit
    # layout conversion; this makes one. `anchor` (all true) is a reorderable reshape, which
    # Triton's layout pass takes as an anchor: it keeps the default layout of its shape (a
    # [2, ..., 2] blocked layout: slowest dims in registers, fastest dims in lanes), and the
    # select takes the layout of its nearest anchor, so the keys, viewed as that hypercube
    # with dims ORDER, are converted into it (one ttg.convert_layout). LLVM folds the
    # always-true select away. The order of the keys is unchanged: a reorder of an all-true
    # mask is the same mask; only the layout moves (test_kernel_compiles counts the
    # conversions and shuffles, which show it if the layout pass stops doing this).
    LOG_N: tl.constexpr = _log2c(N)
    h = tl.permute(tl.reshape(x, _cube(LOG_N)), _dims_of(LOG_N, ORDER).value)
    anchor = tl.reshape(tl.arange(0, N) >= 0, _cube(LOG_N), can_reorder=True)
    h = tl.where(anchor, h, EMPTY)
    return tl.reshape(tl.permute(h, _undims_of(LOG_N, ORDER).value), [N])


@triton.jit
def _sort_desc_transpose(keys, N: tl.constexpr, R: tl.constexpr, REG_BITS: tl.constexpr, SKIP: tl.constexpr = -1,
                         F64: tl.constexpr = False, ROWS: tl.constexpr = 1):
    # keys [N] in descending order by _sort_desc_minmax's network, every step once per pair
    # (_cx_reg), with a move (_move_bits) before each step whose bit is not a register bit
    # (_transpose_plan). REG_BITS: the register bits per thread (N / threads), as minmax.
    # SKIP (tests only): the index of one compare-exchange step left out (its move kept).
    # F64: the keys are _pack_f64's, compared as doubles (_sort_desc_f64). ROWS > 1: keys
    # [ROWS * N], ROWS rows (row-major) sorted at once, each descending (the rows' sort
    # kernel: the warps of several rows go in step through the code, docs/kernel.md, "The
    # final sort"); one move first puts them in the layout the plan starts from, the rows' bits as
    # warp bits (Triton's load layout would put the rows in registers).
    LOG_N: tl.constexpr = _log2c(N)
    LOG_ROWS: tl.constexpr = _log2c(ROWS)
    if ROWS == 1:
        keys = _low_bits_in_registers(keys, N, R)
    else:
        keys = _move_bits(keys, N * ROWS, _tp_start(LOG_N, REG_BITS, LOG_ROWS))
    for s in tl.static_range(1, LOG_N + 1):
        for i in tl.static_range(s):
            if _tp_moves(LOG_N, REG_BITS, (s * (s - 1)) // 2 + i, LOG_ROWS):
                keys = _move_bits(keys, N * ROWS, _tp_order(LOG_N, REG_BITS, (s * (s - 1)) // 2 + i, LOG_ROWS))
            if (s * (s - 1)) // 2 + i != SKIP:
                keys = _cx_reg(keys, N, s - 1 - i, s, _tp_known(LOG_N, REG_BITS, (s * (s - 1)) // 2 + i, LOG_ROWS),
                               F64, ROWS)
    return keys


# The f64 network: the transpose network's steps and moves on int64 keys that are also the
# bits of doubles in [2, 4), in the same order (_pack_f64: the 32 score bits and 20 index
# bits, so indices < 2^20). Each pair's compare is then one DSETP on the FP64 pipe, where
# an int64 compare takes two ISETP on the integer ALU pipe, which is what the transpose
# network waits on; and the pair's second key comes from two exact FP64 adds instead of two
# integer selects (docs/history.md, "The final sort"). (Not tl.maximum on doubles: sm_90
# has no double min/max; ptxas emulates max.f64 with a DSETP, two selects and a NaN fix-up,
# 18,216 instructions against 7,856.)

INDEX_BITS_F64 = tl.constexpr(20)
PAD_F64 = tl.constexpr(4611686018427387904)  # the double 2.0 (1 << 62): below every packed key


@triton.jit
def _pack_f64(y, keys):
    # (value, index) as 0x400 << 52 (the exponent of [2, 4): a normal, positive, finite
    # double) | (the score's order-kept uint32 << 20) | (2^20 - 1 - index); ordered as
    # _pack's key, both as int64 and as double
    k = _pack(y, keys)
    u = (k >> 32) + 2147483648  # the signed high word as its unsigned order, > 0
    return 4611686018427387904 | (u << 20) | (k & 1048575)


@triton.jit
def _unpack_index_f64(p):
    return 1048575 - (p & 1048575)


@triton.jit
def _unpack_value_f64(p):
    # the score bits back in _pack's high word, then _pack's own unpack
    return _unpack_value((((p >> 20) & 4294967295) - 2147483648) << 32)


@triton.jit
def _sort_desc_f64(keys, N: tl.constexpr, R: tl.constexpr, REG_BITS: tl.constexpr, SKIP: tl.constexpr = -1,
                   ROWS: tl.constexpr = 1):
    # keys [N] (_pack_f64; PAD_F64 padding) in descending order: _sort_desc_transpose with
    # each pair compared as doubles. SKIP (tests only): one step left out (its move kept).
    # ROWS: as _sort_desc_transpose's.
    return _sort_desc_transpose(keys, N, R, REG_BITS, SKIP, True, ROWS)


@triton.constexpr_function
def _reg_bits(n, r):
    # the low flat-index bits that are register bits after _low_bits_in_registers: keys
    # arrive 4 per vector (the 32-bit stores' layout), R repeats per thread (fewer when the
    # row is short)
    return min(int(n), 4 * int(r)).bit_length() - 1


@triton.jit
def _sort_desc_by(keys, N: tl.constexpr, R: tl.constexpr, NETWORK: tl.constexpr, ROWS: tl.constexpr = 1):
    # keys [N] descending by NETWORK: 0 tl.sort's bitonic network (_sort_desc), 1 the same
    # network with its in-register steps once per pair (_sort_desc_minmax), 2 the same
    # network with every step in registers after moves through shared memory
    # (_sort_desc_transpose). Same order. (3, the f64 network, sorts other keys:
    # _sort_desc_f64.) ROWS > 1 (transpose only): ROWS rows of N, as _sort_desc_transpose's.
    if NETWORK == 1:
        return _sort_desc_minmax(keys, N, R, _reg_bits(N, R))
    elif NETWORK == 2:
        return _sort_desc_transpose(keys, N, R, _reg_bits(N, R), -1, False, ROWS)
    else:
        return _sort_desc(keys, N, R)
