"""The HyTopK kernel's spec-independent Triton helpers (docs/kernel.md).

The kernel file ``triton_codegen`` generates holds only what a ``ScoreSpec`` decides (the
entry kernel, the score tile, the epilogue) and imports everything else from here: loading
and scoring key tiles, the lane sub-buffers, the compactions and their k-th search, the
fillers and the rows' final sort and write. Together with ``triton_keys`` (the packed keys)
this is the selection machinery every spec shares.

Two helpers have a compiled and an interpreted form (inline PTX and a custom reduction,
which ``TRITON_INTERPRET=1`` cannot run); the form is picked when this module is imported,
which is when Triton's own mode is fixed too (``triton_codegen.check_interpreter_mode``).
"""
import triton
import triton.language as tl

from .triton_codegen import _interpreting
from .triton_keys import EMPTY, FULL, _pack, _score_bits, _sort_desc_by, _unpack_index, _unpack_value

_INTERPRETED = _interpreting()


@triton.jit
def _round_bf16(x):
    # fp32 -> bf16 -> fp32 with round-to-nearest-even, on the bits (NaN stays NaN).
    u = x.to(tl.uint32, bitcast=True)
    u = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
    return tl.where(x != x, x, u.to(tl.float32, bitcast=True))


# The tile loop's append. Compiled: one predicated st.global per element in the layout the
# head sum leaves the scores in (lanes of a quad hold the same element and store the same
# value to the same address). A tl.store there makes Triton convert pointers, keys and
# masks to a coalesced layout through shared memory: 2-4 barriers per tile, and 2 KiB of
# shared memory that stopped two programs with 3 pipeline stages from fitting on an SM.
@triton.jit
def _store_taken_ptx(ptrs, p, take):
    # ptrs[i] = p[i] where take[i], in the operands' own layout (no layout conversion)
    tl.inline_asm_elementwise(
        "{ .reg .pred t; setp.ne.b32 t, $3, 0; @t st.global.b64 [$1], $2; mov.b32 $0, 0; }",
        "=r,l,l,r", [ptrs.to(tl.uint64, bitcast=True), p, take.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store_taken_interp(ptrs, p, take):
    tl.store(ptrs, p, mask=take)  # the interpreter runs no inline PTX


_store_taken = _store_taken_interp if _INTERPRETED else _store_taken_ptx


# Two reductions over one axis at once. Compiled: one tl.reduce over a tuple, whose partial
# results cross the warps in one shared-memory exchange (one barrier) instead of two. The
# interpreter runs a custom combine function element by element in Python, so it gets the
# two numpy-backed reductions (same integers).
@triton.jit
def _min_max_combine(lo0, hi0, lo1, hi1):
    return tl.minimum(lo0, lo1), tl.maximum(hi0, hi1)


@triton.jit
def _min_max_compiled(lo, hi):
    # (min of lo, max of hi) over axis 0
    return tl.reduce((lo, hi), 0, _min_max_combine)


@triton.jit
def _min_max_interp(lo, hi):
    return tl.min(lo, 0), tl.max(hi, 0)


_min_max = _min_max_interp if _INTERPRETED else _min_max_compiled


# The head weighting of FMA-unit dots (fp32 IEEE operands). Their head sum runs across lanes,
# and every lane of a butterfly keeps its own copy of each reduced score, from which it decides
# that key's append and counts its lane. LLVM fused the first butterfly add with the lane's own
# product (fma(w, x, the partner's rounded w * x)), so the copies rounded differently; where
# they straddled a row's threshold one copy appended the key and another did not, the lane
# counts diverged and a key could end in two slots. A mul.rn is never fused: every butterfly
# step then adds two rounded values, which commutes, so the copies are the same bits. No more
# instructions (mul + fma -> mul.rn + add: the partner needs the rounded product either way).
# Tensor-core dots keep the plain product: their head sum starts inside each thread (a
# column pair per register), where the fused in-thread sum saves one instruction per product.
@triton.jit
def _mul_rn_ptx(a, b):
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _mul_rn_interp(a, b):
    return a * b  # one copy per element in the interpreter


_mul_rn = _mul_rn_interp if _INTERPRETED else _mul_rn_ptx


@triton.jit
def _add_rn_ptx(x):
    # x + -0.0 as add.rn: x exactly (signed zeros and NaN included), never fused with the mul before
    return tl.inline_asm_elementwise("add.rn.f32 $0, $1, 0f80000000;", "=r,r", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _add_rn_interp(x):
    return x


_add_rn = _add_rn_interp if _INTERPRETED else _add_rn_ptx


@triton.jit
def _unfused(x, UPCAST: tl.constexpr, TF32: tl.constexpr):
    # x, rounded on its own on FMA-unit dots before an unweighted head sum (_weigh's reason), where
    # the epilogue's last step may be a product: one more instruction per element there
    if UPCAST == 1:
        if TF32:
            return x
        else:
            return _add_rn(x)
    else:
        return x


@triton.jit
def _weigh(wv, x, UPCAST: tl.constexpr, TF32: tl.constexpr):
    # wv * x, the head weights times the epilogue'd logits, unfused on FMA-unit dots (_mul_rn)
    if UPCAST == 1:
        if TF32:
            return wv * x
        else:
            return _mul_rn(wv, x)
    else:
        return wv * x


@triton.jit
def _as_key(x, T, IDX32: tl.constexpr):
    # A key position (or a bound compared with key positions) in the tile loop's key type:
    # int32 when T + 2 tiles < 2**31 (the launcher's IDX32), clamped to [0, T], which keeps
    # every compare with a key in [0, T) the same.
    if IDX32:
        return tl.minimum(tl.maximum(x, 0), T).to(tl.int32)
    else:
        return x.to(tl.int64)


@triton.jit
def _head_sum(x, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, GP: tl.constexpr):
    # [BLOCK_N, BLOCK_M * GP] -> [BLOCK_N, BLOCK_M]: the GP heads of each row summed in
    # Triton's own reduction order. Columns are (row m, head i) at _col_row_head's
    # ((i // 2) * BLOCK_M + m) * 2 + i % 2. The order is a function of the compiled kernel,
    # and the launch configuration of the shape and k's layout (no autotuning), so the bits
    # are reproducible across processes; other configurations may round differently
    # (fp32 reassociation, docs/contract.md). A fixed pairwise tree cost 88 more
    # instructions per tile (docs/history.md, "Scoring").
    if GP >= 2:
        # (the long sum first: its chain of adds fuses with the weights' products into FMAs)
        return tl.sum(tl.sum(tl.reshape(x, [BLOCK_N, GP // 2, BLOCK_M, 2]), axis=1), axis=2)
    else:
        return tl.reshape(x, [BLOCK_N, BLOCK_M])


@triton.jit
def _col_row_head(offs_c, BLOCK_M: tl.constexpr, GP: tl.constexpr):
    # The (query row, head in group) of each dot column. The wgmma accumulator gives each
    # thread column bit 0 and bits 3+ in registers and bits 1-2 in the lanes of a quad. With
    # the rows at bits 1-2 (BLOCK_M = 4) the head sum stays inside each thread and leaves
    # every (key, row) score in one lane: with the rows in registers (column m * GP + i)
    # the sum ended in shuffles that left each score in all four lanes of the quad, and the
    # append did its work four times (docs/history.md, "Scoring").
    if GP >= 2:
        return (offs_c // 2) % BLOCK_M, (offs_c // (2 * BLOCK_M)) * 2 + offs_c % 2
    else:
        return offs_c, offs_c * 0


@triton.jit
def _load_q(Q, W, q_col_off, w_col_off, hk, col_ok, offs_d, d_ok,
            stride_qh, stride_qd, stride_wh, G: tl.constexpr, UPCAST: tl.constexpr):
    # The Q block of kv head hk as [BLOCK_M * GP, BLOCK_D]: a column is query row m,
    # head hk*G + i (the offsets carry the i part), with the matching per-column head
    # weights (0 for padding columns).
    qb = tl.load(Q + q_col_off[:, None] + (hk * G) * stride_qh + offs_d[None, :] * stride_qd,
                 mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST == 1 or UPCAST == 3:
        qb = qb.to(tl.float32)
    wv = tl.load(W + w_col_off + (hk * G) * stride_wh, mask=col_ok, other=0.0).to(tl.float32)
    return qb, wv


@triton.jit
def _bf16_top(x):
    # x's top 8 significant bits (sign, exponent, 7 stored bits): its low 16 bits cleared,
    # i.e. rounded toward zero to bf16, which never overflows
    return (x.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _dot_split3(kt, qb, DOT16: tl.constexpr):
    # kt [BLOCK_N, BLOCK_D] fp32 keys . qb [cols, BLOCK_D] bf16 queries (UPCAST 2/3) on the
    # bf16 tensor cores: kt = hi + mid + lo exactly, three bf16 values (the fp32
    # significand's top, middle and last 8 bits, by truncation, which never overflows), so
    # every product with a bf16 query is exact in fp32; only the fp32 accumulation rounds
    # (3 x D terms, the small parts first, in the tensor cores' order: within docs/contract.md's
    # (D + H + 2) u tolerance). Non-finite keys stay whole in hi (mid = lo = 0), and
    # non-finite queries meet only hi (the mid and lo dots see them as 0), so inf and NaN
    # come out as in an fp32 dot (inf * 0 = NaN only where the key itself is 0). Keys
    # below ~2**-103 in magnitude may lose mid or lo to bf16 subnormals (an error below
    # 2**-126 |q|). DOT16 false (the interpreter, which has no bf16 dot): the same parts
    # in fp32 IEEE dots.
    hi = tl.where(kt != kt, kt, _bf16_top(kt))
    r = tl.where(kt - kt == 0.0, kt - hi, 0.0)  # exact; 0 for inf and NaN
    mid = _bf16_top(r)
    lo = r - mid                                # <= 8 significant bits: exact in bf16
    qt = tl.trans(qb)
    qf = tl.trans(tl.where(qb - qb == 0.0, qb, 0.0).to(qb.dtype))  # finite queries only
    if DOT16:
        x = tl.dot(lo.to(tl.bfloat16), qf, out_dtype=tl.float32)
        x = tl.dot(mid.to(tl.bfloat16), qf, acc=x, out_dtype=tl.float32)
        x = tl.dot(hi.to(tl.bfloat16), qt, acc=x, out_dtype=tl.float32)
    else:
        x = tl.dot(lo, qf, input_precision="ieee", out_dtype=tl.float32)
        x = tl.dot(mid, qf, acc=x, input_precision="ieee", out_dtype=tl.float32)
        x = tl.dot(hi, qt, acc=x, input_precision="ieee", out_dtype=tl.float32)
    return x


@triton.jit
def _load_k(K, k_base, hk, t_tile, k_offs, key_ok, d_ok, stride_kt, stride_kh, UPCAST: tl.constexpr):
    # keys as the rows of the dot: [BLOCK_N, BLOCK_D]. 64-bit math once per tile; the
    # per-element offsets (k_offs, 32-bit) are loop invariants.
    t64 = tl.zeros([], dtype=tl.int64) + t_tile  # (a Python int under the interpreter)
    kt = tl.load((K + (k_base + t64 * stride_kt + hk * stride_kh)) + k_offs,
                 mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST == 1:
        kt = kt.to(tl.float32)
    return kt


@triton.jit
def _rank_desc(keys):
    # Position of each key in descending order, by counting the keys above it: O(n^2)
    # compares, but plain vector ops, where the interpreter runs a bitonic network's
    # xor-reductions element by element in Python. Real keys are distinct.
    return tl.sum((keys[None, :] > keys[:, None]).to(tl.int32), axis=1)


@triton.jit
def _highest_bit(x):
    # Index of the highest set bit of a uint32 scalar (0 for x <= 1): five halving steps.
    hb = tl.zeros([], dtype=tl.int32)
    for i in tl.static_range(5):
        sh = 16 >> i
        big = x >= (1 << sh)
        x = tl.where(big, x >> sh, x)
        hb += tl.where(big, sh, 0)
    return hb


@triton.jit
def _prefix_search(u, valid, n, TOPK: tl.constexpr, SLACK: tl.constexpr):
    # _kth_largest's bitwise search: the largest score-bits prefix v (the bits below it 0)
    # with #{u >= v} >= TOPK, or the first one found that keeps at most TOPK + SLACK keys.
    # Returns (v, #{u >= v}).
    umin, umax = _min_max(tl.where(valid, u, tl.full([], 4294967295, tl.uint32)), u)
    # bit: the highest bit where umin and umax differ (0 when every key has the same score)
    hbu = _highest_bit(umin ^ umax).to(tl.uint32)
    bit = tl.where(umin == umax, 0, tl.full([], 1, tl.uint32) << hbu)
    # the bits above it, common to every key; every valid key is >= this prefix
    prefix = tl.where(umin == umax, umin, ((umin >> hbu) >> 1) << 1 << hbu)
    n_ge = n                                              # #{u >= prefix}
    while (bit > 0) & (n_ge > TOPK + SLACK):
        c = prefix | bit
        n_c = tl.sum((u >= c).to(tl.int32), axis=0)      # c >= 1: invalid keys (u = 0) never count
        prefix = tl.where(n_c >= TOPK, c, prefix)
        n_ge = tl.where(n_c >= TOPK, n_c, n_ge)
        bit = bit >> 1
    return prefix, n_ge


@triton.jit
def _kth_largest(keys, u, valid, n, TOPK: tl.constexpr, SLACK: tl.constexpr):
    # A key kth with TOPK <= #{valid keys >= kth} <= TOPK + SLACK (the valid keys are
    # distinct; n > TOPK of them; u: their score bits, _score_bits, 0 where not valid).
    # Returns (kth, that count).
    #
    # SLACK = 0: the TOPK-th largest key, by a bitwise search for the largest score-bits
    # value v with #{u >= v} >= TOPK, then, only when the boundary score is shared by more
    # keys than are needed, over the low words (the index) of the keys with that score.
    # SLACK > 0 (compactions inside the tile loop only need a lower bound): the search stops
    # as soon as the score prefix found so far keeps at most TOPK + SLACK keys, and kth is
    # the smallest key with that prefix.
    #
    # The search starts below the highest bit where the smallest and largest score differ:
    # the bits above (the sign, most of the exponent) are common to every key. One bit per
    # pass, one compare and one count per key (docs/history.md: the multi-bit and bracketing
    # searches tried instead).
    prefix, n_ge = _prefix_search(u, valid, n, TOPK, SLACK)
    # the smallest key whose score bits are >= prefix (keeps exactly those n_ge keys): the
    # answer when SLACK allows it
    kth = (prefix ^ 2147483648).to(tl.int32, bitcast=True).to(tl.int64) << 32
    if n_ge > TOPK + SLACK:
        # all 32 bits resolved and more keys share the boundary score than may be kept
        eq = valid & (u == prefix)
        n_eq = tl.sum(tl.where(eq, 1, 0), axis=0)
        need = TOPK - (n_ge - n_eq)                      # 1 <= need <= n_eq
        kth = tl.min(tl.where(eq, keys, FULL), axis=0)   # right when every tied key is needed
        if n_eq > need:
            low = keys & 4294967295                      # larger low word = smaller key index
            lp = tl.zeros([], dtype=tl.int64)
            lstep = tl.zeros([], dtype=tl.int64) + 2147483648
            for _ in range(32):
                cand = lp + lstep
                c = tl.sum(tl.where(eq & (low >= cand), 1, 0), axis=0)
                lp = tl.where(c >= need, cand, lp)
                lstep = lstep // 2
            kth = tl.max(tl.where(eq & (low == lp), keys, EMPTY), axis=0)
        n_ge = TOPK
    return kth, n_ge


@triton.jit
def _compact_row(row_ptr, valid, n, TOPK: tl.constexpr, CAP: tl.constexpr, SLACK: tl.constexpr):
    # The best m of the n valid keys among row_ptr[0:CAP], moved to row_ptr[0:m] in no
    # particular order: m = n when n <= TOPK, else TOPK <= m <= TOPK + SLACK (m = TOPK when
    # SLACK = 0). Returns (m, the smallest key kept, or EMPTY when n <= TOPK). No sort: a
    # count-based search for the threshold (_kth_largest), then one compaction.
    offs = tl.arange(0, CAP)
    keys = tl.load(row_ptr + offs, mask=valid, other=EMPTY)
    kth = tl.full([], EMPTY, tl.int64)
    m = n
    if n > TOPK:
        u = tl.where(valid, _score_bits(keys), 0)
        kth, m = _kth_largest(keys, u, valid, n, TOPK, SLACK)
    keep = valid & (keys >= kth)                    # real keys are > EMPTY
    k32 = keep.to(tl.int32)
    pos = tl.cumsum(k32, axis=0) - k32
    tl.debug_barrier()  # every thread has read the row before any thread overwrites it
    # (the inline-PTX store keeps the keys in their load layout: a tl.store here with its
    # data-dependent addresses got its own layout, and Triton moved the 32 KiB of keys and
    # the mask through shared memory to it)
    _store_taken(row_ptr + pos, keys, keep)
    return m, kth


@triton.jit
def _compact_lanes(row_ptr, lane_cnt_ptr, TOPK: tl.constexpr, CAP: tl.constexpr, BLOCK_N: tl.constexpr,
                   SLACK: tl.constexpr):
    # _compact_row over a row held as lane sub-buffers
    n = tl.sum(tl.load(lane_cnt_ptr + tl.arange(0, BLOCK_N)), axis=0)
    return _compact_row(row_ptr, _lane_valid(lane_cnt_ptr, CAP, BLOCK_N), n, TOPK, CAP, SLACK)


@triton.jit
def _lane_valid(lane_cnt_ptr, CAP: tl.constexpr, BLOCK_N: tl.constexpr):
    # Which of a row's CAP slots hold keys while the buffer is BLOCK_N lane sub-buffers
    # (slot s of lane j at s * BLOCK_N + j; lane_cnt_ptr[j] keys in lane j).
    offs = tl.arange(0, CAP)
    return (offs // BLOCK_N) < tl.load(lane_cnt_ptr + offs % BLOCK_N)


@triton.jit
def _sample_estimate(row_ptr, lane_cnt_ptr, J: tl.constexpr, CAP: tl.constexpr, BLOCK_N: tl.constexpr):
    # The sampled estimate (docs/kernel.md, "Selecting"): from a row's sampled keys (lane
    # sub-buffers, more than J of them), a score at or below the J-th best sampled one:
    # _kth_largest's search with a slack of J / 4, without its tie-break (a lower estimate is as exact, only less
    # selective). Returned as the fp32 value just below it, which the tile loop's filter
    # (take y > it) turns into "take scores >= it". Below +0.0 that is -1.4e-45, not -0.0,
    # which compares equal.
    valid = _lane_valid(lane_cnt_ptr, CAP, BLOCK_N)
    n = tl.sum(tl.load(lane_cnt_ptr + tl.arange(0, BLOCK_N)), axis=0)
    keys = tl.load(row_ptr + tl.arange(0, CAP), mask=valid, other=EMPTY)
    prefix, _ = _prefix_search(tl.where(valid, _score_bits(keys), 0), valid, n, J, J // 4)
    below = prefix - tl.where(prefix == 2147483648, 2, 1).to(tl.uint32)
    return _unpack_value((below ^ 2147483648).to(tl.int32, bitcast=True).to(tl.int64) << 32)


@triton.jit
def _append_lanes(scr, offs_m, offs_n, cnt, p, take, CAP: tl.constexpr, BLOCK_N: tl.constexpr):
    # Append a tile's packed keys p [BLOCK_N, BLOCK_M] where take, each to its own lane
    # sub-buffer: key j of the tile, row m -> slot cnt[j, m] of lane j, at scr + m * CAP +
    # slot * BLOCK_N + j (the layout _lane_valid and _compact_lanes read). Returns the new
    # lane counts.
    _store_taken(scr + (offs_m[None, :] * CAP + cnt * BLOCK_N + offs_n[:, None]), p, take)
    return cnt + take.to(tl.int32)


@triton.jit
def _lane_counts(n, offs_n, BLOCK_N: tl.constexpr):
    # Keys per lane [BLOCK_N, BLOCK_M] of rows whose n keys sit contiguously at [0, n): slot
    # s of lane j is position s * BLOCK_N + j, so a contiguous row is a valid lane layout.
    return n[None, :] // BLOCK_N + (offs_n[:, None] < n[None, :] % BLOCK_N).to(tl.int32)


@triton.jit
def _select_tile(p, key_ok, row_ok, cnt, thr, scr, scr_cols, offs_m,
                 TOPK: tl.constexpr, CAP: tl.constexpr, BLOCK_M: tl.constexpr):
    # p [BLOCK_N, BLOCK_M]: packed keys of one tile. Keys above a row's threshold are
    # appended, compacted, to that row's candidate buffer; a row whose buffer could
    # overflow is first compacted to its TOPK best (raising its threshold).
    take = (p > thr[None, :]) & key_ok[:, None] & row_ok[None, :]
    n_take = tl.sum(take.to(tl.int32), axis=0)
    if tl.max(cnt + n_take, axis=0) > CAP:
        tl.debug_barrier()  # earlier candidate stores are visible to every thread
        for r in range(BLOCK_M):
            c = tl.sum(tl.where(offs_m == r, cnt, 0), axis=0)
            nr = tl.sum(tl.where(offs_m == r, n_take, 0), axis=0)
            if c + nr > CAP:
                _, kth = _compact_row(scr + r * CAP, tl.arange(0, CAP) < c, c, TOPK, CAP, 0)
                cnt = tl.where(offs_m == r, TOPK, cnt)
                thr = tl.where(offs_m == r, kth, thr)
        tl.debug_barrier()
        # the threshold rose: filter again
        take = (p > thr[None, :]) & key_ok[:, None] & row_ok[None, :]
        n_take = tl.sum(take.to(tl.int32), axis=0)
    if tl.max(n_take, axis=0) > 0:
        take32 = take.to(tl.int32)
        pos = cnt[None, :] + tl.cumsum(take32, axis=0) - take32
        tl.store(scr_cols + pos, p, mask=take)
        cnt += n_take
    return cnt, thr


@triton.jit
def _write_keys(OUT_IDX, OUT_VAL, out, keys, keep, RETURN_VALUES: tl.constexpr):
    # packed keys -> their indices (and fp32 values) at output offsets out, where keep
    tl.store(OUT_IDX + out, _unpack_index(keys).to(OUT_IDX.dtype.element_ty), mask=keep)
    if RETURN_VALUES:
        tl.store(OUT_VAL + out, _unpack_value(keys), mask=keep)


@triton.jit
def _emit_row(row_ptr, n, OUT_IDX, OUT_VAL, out_off, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
              CAP: tl.constexpr, SORT: tl.constexpr, RETURN_VALUES: tl.constexpr, SORT_R: tl.constexpr):
    # Write the TOPK best of the n (>= TOPK) keys in row_ptr[0:n], in (value desc, index
    # asc) order: compact to TOPK keys, then sort only those. SORT: 0 the bitonic network
    # (_sort_desc_minmax), 1 the rank sort (_rank_desc), 2 none (topk's sorted=False): the
    # buffer's order, which the compactions fix (the same for every run of the same launch).
    if n > TOPK:
        _compact_row(row_ptr, tl.arange(0, CAP) < n, n, TOPK, CAP, 0)
        tl.debug_barrier()
    offs = tl.arange(0, TOPK_P2)
    keys = tl.load(row_ptr + offs, mask=offs < TOPK, other=EMPTY)
    if SORT == 2:
        pos = offs
        best = keys
    elif SORT == 1:
        pos = _rank_desc(keys)
        best = keys
    else:
        best = _sort_desc_by(keys, TOPK_P2, SORT_R, 1)  # the minmax bitonic network
        pos = tl.arange(0, TOPK_P2)
    _write_keys(OUT_IDX, OUT_VAL, out_off + pos, best, pos < TOPK, RETURN_VALUES)


@triton.jit
def _compact_full_rows(scr, lane_cnt, lane_cnt_offs, cnt, thr, thr_v, est_v, offs_m, offs_n,
                       TOPK: tl.constexpr, CAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                       LOW_WATER: tl.constexpr, SLACK: tl.constexpr):
    # Between two inner tile loops: when some row's fullest lane has fewer than LOW_WATER
    # free slots, every such row is compacted to its best TOPK (+ SLACK) keys, which raises
    # its threshold. Returns the new (cnt, thr, thr_v).
    SUBCAP: tl.constexpr = CAP // BLOCK_N
    cmax = tl.max(cnt, axis=0)
    if tl.max(cmax, axis=0) > SUBCAP - LOW_WATER:
        tl.store(lane_cnt + lane_cnt_offs, cnt)
        tl.debug_barrier()  # the lane counts and appended keys are visible to every thread
        kept = tl.zeros([BLOCK_M], dtype=tl.int32) - 1
        for r in range(BLOCK_M):
            c = tl.sum(tl.where(offs_m == r, cmax, 0), axis=0)
            if c > SUBCAP - LOW_WATER:
                # (with n <= TOPK keys this only repacks the row; LOW_WATER <=
                # SUBCAP - ceil((TOPK + SLACK) / BLOCK_N) leaves room after it)
                nk, kth = _compact_lanes(scr + r * CAP, lane_cnt + r * BLOCK_N, TOPK, CAP, BLOCK_N, SLACK)
                kept = tl.where(offs_m == r, nk, kept)
                thr = tl.where((offs_m == r) & (kth != EMPTY), kth, thr)
        tl.debug_barrier()
        cnt = tl.where(kept[None, :] >= 0, _lane_counts(kept, offs_n, BLOCK_N), cnt)
        thr_v = tl.where(thr == EMPTY, est_v, _unpack_value(thr))  # (>= est_v when set)
    return cnt, thr, thr_v


@triton.jit
def _compact_all_rows(scr, lane_cnt, lane_cnt_offs, cnt, thr, offs_m,
                      TOPK: tl.constexpr, CAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    # After the tile loop: every row's lanes -> its best min(n, TOPK) keys, contiguous at
    # [0, n). Returns (n per row, thr).
    tl.store(lane_cnt + lane_cnt_offs, cnt)
    tl.debug_barrier()
    cnt1 = tl.zeros([BLOCK_M], dtype=tl.int32)
    for r in range(BLOCK_M):
        nk, kth = _compact_lanes(scr + r * CAP, lane_cnt + r * BLOCK_N, TOPK, CAP, BLOCK_N, 0)
        cnt1 = tl.where(offs_m == r, nk, cnt1)
        thr = tl.where((offs_m == r) & (kth != EMPTY), kth, thr)
    tl.debug_barrier()
    return cnt1, thr


@triton.jit
def _fill_tiles(fill_v, fill_hi, v0, v1, t_end, row_ok, cnt1, thr, scr, scr_cols, offs_m, offs_n,
                TOPK: tl.constexpr, CAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # All hidden tiles below v0 and from v1 to t_end (fillers of value fill_v, whose packed
    # high word is fill_hi), visited only while some row would take the tile's best key; in
    # any order: the packed threshold also compares indices. Returns the new (cnt1, thr).
    for i0 in range(0, v0 + (t_end - v1), BLOCK_N):
        tf = tl.where(i0 < v0, i0, i0 - v0 + v1)  # [0, v0), then [v1, t_end)
        first_key = fill_hi * 4294967296 + (4294967295 - tf)
        wanted = tl.max(tl.where(row_ok & (thr < first_key), 1, 0), axis=0) > 0
        if wanted:
            keys64 = tf + offs_n.to(tl.int64)
            key_ok = keys64 < t_end
            p = _pack(tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32) + fill_v, keys64[:, None])
            cnt1, thr = _select_tile(p, key_ok, row_ok, cnt1, thr, scr, scr_cols, offs_m, TOPK, CAP, BLOCK_M)
    return cnt1, thr


@triton.jit
def _emit_rows(scr, cnt1, mb, b64, S, offs_m, OUT_IDX, OUT_VAL, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
               CAP: tl.constexpr, SORT: tl.constexpr, RETURN_VALUES: tl.constexpr, SORT_R: tl.constexpr,
               BLOCK_M: tl.constexpr):
    # Per row of the block: compact to the TOPK best, sort those (SORT), write them.
    tl.debug_barrier()
    for r in range(BLOCK_M):
        s = mb.to(tl.int64) * BLOCK_M + r
        if s < S:
            c = tl.sum(tl.where(offs_m == r, cnt1, 0), axis=0)
            _emit_row(scr + r * CAP, c, OUT_IDX, OUT_VAL, (b64 * S + s) * TOPK,
                      TOPK, TOPK_P2, CAP, SORT, RETURN_VALUES, SORT_R)
    tl.debug_barrier()


@triton.jit
def _head_logits(kt0, qb0, wv0, Q, K, W, stride_qh, stride_qd, stride_kt, stride_kh, stride_wh,
                 q_col_off, w_col_off, col_ok, k_base, t_tile, k_offs, key_ok, offs_d, d_ok, T, hk,
                 HK: tl.constexpr, G: tl.constexpr, UPCAST: tl.constexpr, TF32: tl.constexpr,
                 REREAD_W: tl.constexpr):
    # The logits x [BLOCK_N, BLOCK_M * GP] of kv head hk (fp32 accumulation): x[t, m*GP + i]
    # = k[t] . q[m, head i], with the head weights wv of the dot's columns. Keys are the rows
    # of the dot, (row, head) pairs its columns, so the head sum runs along the
    # accumulator's columns, mostly inside each thread.
    if HK == 1:
        # one kv head: the Q block and its weights stay on chip for the whole row block
        kt = kt0
        qb = qb0
        if REREAD_W:
            # Re-read per tile (L1): held across the loop, the weights take BLOCK_M*GP/4
            # registers per thread next to the accumulator. The offset t_tile // (T + 1)
            # is 0, but not provably, so Triton's LICM cannot hoist the load.
            wv = tl.load(W + w_col_off + t_tile // (T + 1), mask=col_ok, other=0.0).to(tl.float32)
        else:
            wv = wv0
    else:
        kt = _load_k(K, k_base, hk, t_tile, k_offs, key_ok, d_ok, stride_kt, stride_kh, UPCAST)
        qb, wv = _load_q(Q, W, q_col_off, w_col_off, hk, col_ok, offs_d, d_ok,
                         stride_qh, stride_qd, stride_wh, G, UPCAST)
    if UPCAST >= 2:
        x = _dot_split3(kt, qb, UPCAST == 2)
    elif TF32:
        x = tl.dot(kt, tl.trans(qb), input_precision="tf32", out_dtype=tl.float32)
    else:
        # IEEE for fp32 operands; for 16-bit operands the products are exact anyway
        x = tl.dot(kt, tl.trans(qb), input_precision="ieee", out_dtype=tl.float32)
    return x, wv
