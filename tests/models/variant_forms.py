"""A zoo of selection sites from the NON-DSA sparse-attention families, spelled the way their PUBLIC
implementations spell them (NSA, MoBA, InfLLM-v2, Qwen QSA, DeepSeek-V4 CSA via the HF port).

Conventions follow ``tests/models/dsa_forms.py`` (same ``Case`` dataclass, seeded generators):
``VARIANT_FORMS[name](seed) -> Case`` and ``case.fn(*case.args)`` runs the model eagerly in fp32 at
tiny shapes and returns tensors that *use* the selection. The op sequences mirror the public code
and were checked against the stored public sources named in the comment above each builder (einsum strings, ``masked_fill`` / in-place slice
assignment / ``softmax`` / ``view(...).sum`` / ``topk`` call forms and post-processing are kept);
what was trimmed or replaced (einops / einx calls, CUDA kernels, flash-attn) is stated there.

Fields of ``Case`` (see dsa_forms): ``num_selections`` counts the selection ``topk`` CALLS an eager
run makes (a Python loop unrolls, so the per-batch MoBA loop makes 2 and the QSA per-query loop one
per query that has a complete block), ``num_other_topk`` the other ``topk`` calls.

``unique``:

* ``True``: same meaning as in dsa_forms: every row with more than k valid (finite, not masked)
  scores has distinct k-th / (k+1)-th scores (checked with ``dsa_forms.boundary_ties``; the
  builder re-draws with a salted seed otherwise), and every consumer re-masks picks of masked keys,
  so outputs are independent of tie-breaking.
* ``False``: the scores inevitably contain exact ties that ``dsa_forms.boundary_ties`` counts:
  exact-0.0 softmax probabilities of not-yet-complete / future blocks (NSA fla, NSA lucidrains,
  InfLLM-v2). Those picks are re-masked (``-1`` or ``vals > 1e-10``), so the selected SETS are
  tie-order independent; compare indices against a stable (value desc, index asc) reference.
  (NSA fla also has an inherent tie inside the selected set, which changes the order of its
  sorted ``block_indices`` output: see its notes.)
  The builder re-draws until no tie sits among the POSITIVE scores at a k boundary
  (``positive_boundary_ties``), so the only ties left are the benign zero ones.

Run ``python tests/models/variant_forms.py [seeds...]`` for an eager self-check.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.models.dsa_forms import Case, _build, _gen, _randn, boundary_ties, topk_inputs

NEG_INF = float("-inf")

VARIANT_FORMS: dict[str, Callable[[int], Case]] = {}
RAW_VARIANT_FORMS: dict[str, Callable[[int], Case]] = {}  # the makers without the re-draw

_MAX_REDRAWS = 50


def positive_boundary_ties(scores: torch.Tensor, k: int, dim: int = -1, floor: float = 0.0) -> int:
    """Rows whose k-th and (k+1)-th largest scores are equal AND that value is finite and > ``floor``
    (default 0: ties among exact zeros, i.e. masked probabilities, and among +-inf are ignored).
    Unlike ``dsa_forms.boundary_ties`` this does not require "more than k valid entries" (that count
    leaves out a forced +inf block, so a row with exactly k finite scores plus one +inf would slip)."""
    s = scores.float().movedim(dim, -1)
    if s.shape[-1] <= k:
        return 0
    srt = s.sort(dim=-1, descending=True).values
    a, b = srt[..., k - 1], srt[..., k]
    return int(((a == b) & torch.isfinite(a) & (a > floor)).sum())


_VALID_FLOOR = torch.finfo(torch.float32).min / 2


def _tie_free(case: Case) -> bool:
    recs = topk_inputs(case)
    if case.unique:
        return all(boundary_ties(x, kk, d) == 0 and positive_boundary_ties(x, kk, d, _VALID_FLOOR) == 0
                   for x, kk, d in recs)
    return all(positive_boundary_ties(x, kk, d) == 0 for x, kk, d in recs)


def variant_form(name: str) -> Callable[[Callable[[int], Case]], Callable[[int], Case]]:
    """Register ``make`` under ``name`` in VARIANT_FORMS (deterministic in ``seed``; re-draws with
    ``seed + 100_003 * attempt`` while a draw has a boundary tie, see the module docstring)."""

    def deco(make: Callable[[int], Case]) -> Callable[[int], Case]:
        assert name not in VARIANT_FORMS, name
        RAW_VARIANT_FORMS[name] = make

        def make_tie_free(seed: int) -> Case:
            for attempt in range(_MAX_REDRAWS):
                eff = seed + 100_003 * attempt
                case = make(eff)
                case.seed = eff
                if _tie_free(case):
                    return case
            raise RuntimeError(f"{name}: no tie-free draw for seed {seed}")

        make_tie_free.form_name = name  # type: ignore[attr-defined]
        VARIANT_FORMS[name] = make_tie_free
        return make

    return deco


# ----------------------------------------------------------------------------- helpers


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary_pos_emb(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> torch.Tensor:
    """HF qwen4_exp ``apply_rotary_pos_emb`` (partial rotary: the first ``cos.shape[-1]`` dims)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rope, q_nope = q[..., :rotary_dim], q[..., rotary_dim:]
    q_rope = (q_rope * cos) + (_rotate_half(q_rope) * sin)
    return torch.cat([q_rope, q_nope], dim=-1)


def _cos_sin(batch: int, seqlen: int, rotary_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.arange(seqlen, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[None].expand(batch, -1, -1).contiguous(), emb.sin()[None].expand(batch, -1, -1).contiguous()


class _QwenRMSNorm(nn.Module):
    """Qwen3-Next-style ``(1 + w)`` RMSNorm (w initialised to zeros)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


# ============================================================================ NSA (fla)


# Mirrors fla-org/native-sparse-attention native_sparse_attention/ops/naive.py::compression
# (the mean-pool revision ``k.view(B, num_block, block_size, H, -1).mean(dim=2)``).
def _fla_compression(k: torch.Tensor, v: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, H = k.shape[:3]
    num_block = math.ceil(T / block_size)
    if k.shape[1] % block_size != 0:
        k = F.pad(k, (0, 0, 0, 0, 0, num_block * block_size - T))
        v = F.pad(v, (0, 0, 0, 0, 0, num_block * block_size - T))
    k_cmp = k.view(B, num_block, block_size, H, -1).mean(dim=2)
    v_cmp = v.view(B, num_block, block_size, H, -1).mean(dim=2)
    return k_cmp, v_cmp


def _repeat_hg(x: torch.Tensor, g: int) -> torch.Tensor:
    """einops ``repeat(x, 'b c h d -> b c (h g) d', g=G)`` (what einops lowers it to: expand+reshape)."""
    b, c, h, d = x.shape
    return x[:, :, :, None, :].expand(b, c, h, g, d).reshape(b, c, h * g, d)


# Mirrors fla-org/native-sparse-attention native_sparse_attention/ops/naive.py::naive_nsa_compression
# (the revision with ``empty_mask`` and ``masked_fill(..., -1)``; the older revision fills 0 and uses
# ``nan_to_num``). ``block_counts`` is an int here (the tensor form only feeds ``.max().item()``).
def _nsa_compression_naive(q, k, v, g_cmp, block_counts: int, block_size: int, scale: float):
    dtype = q.dtype
    B, T = q.shape[0], q.shape[1]
    H, HQ = k.shape[2], q.shape[2]
    G = HQ // H
    BS = block_size
    q, k, v = map(lambda x: x.float(), (q, k, v))
    k_cmp, v_cmp = _fla_compression(k, v, BS)
    C = k_cmp.shape[1]
    S = min(block_counts, C)
    k_cmp, v_cmp = map(lambda x: _repeat_hg(x, G), (k_cmp, v_cmp))

    casual_mask = ((torch.arange(T) - BS + 1)[:, None] // BS < torch.arange(C)[None, :]).to(q.device)
    empty_mask = casual_mask.all(-1, True)
    local_mask = (torch.arange(T)[:, None] // BS == torch.arange(C)[None, :]).to(q.device)

    attn_cmp = torch.einsum('bqhd,bkhd->bhqk', q * scale, k_cmp)
    attn_cmp = attn_cmp.masked_fill(casual_mask & empty_mask.logical_not(), float('-inf'))
    attn_cmp = attn_cmp.softmax(-1).masked_fill(empty_mask, 0.0)
    o_cmp = torch.einsum('bhqk, bkhd -> bqhd', attn_cmp, v_cmp) * g_cmp.unsqueeze(-1)
    attn_select = attn_cmp.masked_fill(local_mask, float(1.0))
    attn_select = attn_select.view(B, H, G, T, C).sum(2)
    block_indices = attn_select.topk(S, -1)[1]

    block_indices = block_indices.masked_fill(block_indices > (block_indices.new_tensor(range(T))[:, None] // BS), -1)
    block_indices = block_indices.transpose(1, 2)
    return o_cmp.to(dtype), block_indices


@variant_form("nsa_compression_naive")
def _(seed: int) -> Case:
    g = _gen(seed, 101)
    B, T, HQ, H, D, BS, n = 2, 32, 8, 2, 16, 4, 3
    q, k, v = _randn(g, B, T, HQ, D), _randn(g, B, T, H, D), _randn(g, B, T, H, D)
    g_cmp = torch.sigmoid(_randn(g, B, T, HQ))
    fn = functools.partial(_nsa_compression_naive, block_counts=n, block_size=BS, scale=D**-0.5)
    return Case(
        "nsa_compression_naive", fn, (q, k, v, g_cmp), 1, 0, k=n, unique=False,
        notes="fla naive_nsa_compression: mean-pooled compressed keys (view+mean), repeat over GQA group, "
        "einsum('bqhd,bkhd->bhqk', q*scale, k_cmp), masked_fill(causal & ~empty, -inf), softmax(-1), "
        "masked_fill(empty, 0); o_cmp = einsum(attn, v_cmp) * g_cmp (other consumer of the probabilities); "
        "sel = attn.masked_fill(local, 1.0).view(B,H,G,T,C).sum(2); sel.topk(n, -1)[1]; "
        "masked_fill(idx > t//BS, -1); transpose(1, 2). Returns (o_cmp, block_indices). "
        "unique=False: future blocks have exact-0 probability (picks of them are all > t//BS -> -1), and "
        "rows t in [BS, 2*BS) tie INSIDE the selected set: the forced local block sums to G (1.0 per head) "
        "and the single complete block's probability is 1.0 per head too, so the sorted order of "
        "block_indices (not the set) depends on tie-breaking; naive_nsa consumes the set",
        tags=("nsa", "softmax_epilogue", "other_consumer", "forced_blocks", "gqa_group_sum", "compressed",
              "block_causal", "minus_one_post", "mask_fill_inf"),
    )


# ============================================================================ NSA (lucidrains)


class _LucidrainsNSA(nn.Module):
    """Mirrors lucidrains/native-sparse-attention-pytorch
    native_sparse_attention_pytorch/native_sparse_attention.py::SparseAttention.forward with
    ``use_diff_topk=True`` (no flex masks), compress_block_size == selection_block_size.

    Replaced (no einops / einx / local_attention / rotary_embedding_torch here): einops
    ``einsum/repeat/rearrange/reduce`` by the equivalent torch ops (same contraction strings),
    ``LocalAttention`` by a dense causal sliding-window attention, and rotary is omitted."""

    def __init__(self, dim: int = 32, dim_head: int = 8, heads: int = 4, kv_heads: int = 2,
                 sliding_window_size: int = 4, compress_block_size: int = 4, selection_block_size: int = 4,
                 num_selected_blocks: int = 2, num_compressed_mem_kv: int = 1) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.num_grouped_queries = heads // kv_heads
        self.scale = dim_head**-0.5
        self.dim_head = dim_head
        dim_inner, dim_kv_inner = dim_head * heads, dim_head * kv_heads
        self.norm = nn.RMSNorm(dim)
        self.qkv_split = (dim_inner, dim_kv_inner, dim_kv_inner)
        self.to_qkv = nn.Linear(dim, sum(self.qkv_split), bias=False)
        self.sliding_window_size = sliding_window_size
        self.compress_block_size = compress_block_size
        self.compress_mem_kv = nn.Parameter(torch.zeros(2, kv_heads, num_compressed_mem_kv, dim_head))
        self.k_intrablock_positions = nn.Parameter(torch.zeros(kv_heads, compress_block_size, dim_head))
        self.v_intrablock_positions = nn.Parameter(torch.zeros(kv_heads, compress_block_size, dim_head))
        compress_dim = compress_block_size * dim_head
        self.k_compress = nn.Sequential(nn.Flatten(-2), nn.Linear(compress_dim, compress_dim), nn.ReLU(),
                                        nn.Linear(compress_dim, dim_head))  # Rearrange('b h w n d -> b h w (n d)')
        self.v_compress = nn.Sequential(nn.Flatten(-2), nn.Linear(compress_dim, compress_dim), nn.ReLU(),
                                        nn.Linear(compress_dim, dim_head))
        self.use_diff_topk = True
        self.selection_block_size = selection_block_size
        self.num_selected_blocks = num_selected_blocks
        strategy_combine_mlp = nn.Linear(dim, 3 * heads)
        nn.init.zeros_(strategy_combine_mlp.weight)
        strategy_combine_mlp.bias.data.copy_(torch.tensor([-2., -2., 2.] * heads))
        self.strategy_combine_mlp = strategy_combine_mlp
        self.combine_heads = nn.Linear(dim_inner, dim, bias=False)

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:  # Rearrange('b n (h d) -> b h n d')
        return t.unflatten(-1, (-1, self.dim_head)).transpose(1, 2)

    def _grouped(self, t: torch.Tensor) -> torch.Tensor:  # repeat 'b h ... -> b (num_grouped_queries h) ...'
        return t.repeat(1, self.num_grouped_queries, *([1] * (t.ndim - 2)))

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        batch, seq_len, device = *inp.shape[:2], inp.device
        compress_divisible_seq_len = seq_len // self.compress_block_size * self.compress_block_size
        num_compress_blocks = compress_divisible_seq_len // self.compress_block_size
        fine_divisible_seq_len = math.ceil(seq_len / self.selection_block_size) * self.selection_block_size
        num_fine_blocks = fine_divisible_seq_len // self.selection_block_size

        inp = self.norm(inp)
        q, k, v = self.to_qkv(inp).split(self.qkv_split, dim=-1)
        q, k, v = map(self._split_heads, (q, k, v))

        k_pos = self.k_intrablock_positions.repeat(1, num_compress_blocks, 1)  # 'h n d -> h (r n) d'
        v_pos = self.v_intrablock_positions.repeat(1, num_compress_blocks, 1)
        k_compress_input = (k[..., :compress_divisible_seq_len, :] + k_pos).unflatten(2, (-1, self.compress_block_size))
        v_compress_input = (v[..., :compress_divisible_seq_len, :] + v_pos).unflatten(2, (-1, self.compress_block_size))
        ck = self.k_compress(k_compress_input)
        cv = self.v_compress(v_compress_input)

        # 1. coarse attention over compressed
        mem_ck, mem_cv = self.compress_mem_kv[:, None].expand(-1, batch, -1, -1, -1)  # 'kv ... -> kv b ...'
        num_mem_compress_kv = mem_ck.shape[-2]
        ck = torch.cat((mem_ck, ck), dim=-2)
        cv = torch.cat((mem_cv, cv), dim=-2)
        ck, cv = self._grouped(ck), self._grouped(cv)

        csim = torch.einsum('bhid,bhjd->bhij', q, ck) * self.scale
        cq_seq = torch.arange(seq_len, device=device)
        ck_seq = ((torch.arange(num_compress_blocks, device=device) + 1) * self.compress_block_size) - 1
        ck_seq = F.pad(ck_seq, (num_mem_compress_kv, 0), value=-1)
        cmask = ck_seq[None, :] < cq_seq[:, None]  # einx.less('j, i -> i j', ck_seq, cq_seq)
        mask_value = -torch.finfo(csim.dtype).max
        csim = csim.masked_fill(~cmask, mask_value)
        cattn = csim.softmax(dim=-1)
        compressed_attn_out = torch.einsum('bhij,bhjd->bhid', cattn, cv)

        # 2. fine attention over selected blocks, importance = compressed attention probabilities
        importance_scores = cattn[..., num_mem_compress_kv:]
        # reduce 'b (grouped_queries h) ... -> b h ...', 'mean'
        importance_scores = importance_scores.unflatten(1, (self.num_grouped_queries, self.kv_heads)).mean(1)
        num_selected = min(self.num_selected_blocks, importance_scores.shape[-1])

        fq, fk, fv = q, k, v
        selected_importance_values, selected_block_indices = importance_scores.topk(num_selected, dim=-1)
        if self.use_diff_topk:
            gates = selected_importance_values + (1. - selected_importance_values).detach()  # straight_through(vals, 1.)
        fmask = selected_importance_values > 1e-10

        fine_window_seq = torch.arange(fine_divisible_seq_len, device=device) // self.selection_block_size
        fine_window_seq = fine_window_seq[None, None, :, None].expand(batch, self.kv_heads, -1, 1)  # 'n -> b h n 1'
        selected_block_indices = torch.cat((selected_block_indices, fine_window_seq), dim=-1)

        fmask = fmask[..., None].expand(*fmask.shape, self.selection_block_size)  # 'b h i w -> b h i w j'
        causal_mask = torch.ones((self.selection_block_size,) * 2, device=device, dtype=torch.bool).tril()
        causal_mask = causal_mask.repeat(num_fine_blocks, 1)[None, None, :, None, :].expand(
            batch, self.kv_heads, -1, 1, -1)  # 'i j -> b h (w i) 1 j'
        fmask = torch.cat((fmask, causal_mask), dim=-2)
        fmask = fmask.flatten(-2)  # 'b h i w j -> b h i (w j)'

        fk = fk.unflatten(2, (num_fine_blocks, -1))  # 'b h (w n) d -> b h w n d'
        fv = fv.unflatten(2, (num_fine_blocks, -1))
        fk = fk[:, :, None].expand(-1, -1, selected_block_indices.shape[2], -1, -1, -1)  # 'b h w j d -> b h i w j d'
        fv = fv[:, :, None].expand(-1, -1, selected_block_indices.shape[2], -1, -1, -1)
        selected_block_indices = selected_block_indices[..., None, None].expand(
            -1, -1, -1, -1, fk.shape[-2], fk.shape[-1])  # 'b h i sel -> b h i sel j d'
        fk = fk.gather(3, selected_block_indices)
        fv = fv.gather(3, selected_block_indices)

        if self.use_diff_topk:
            gates = F.pad(gates, (0, 1), value=1.)
            fk = gates[..., None, None] * fk  # einx.multiply('b h i w, b h i w j d -> b h i w j d')
            fv = gates[..., None, None] * fv

        fk = fk.flatten(3, 4)  # 'b h i w j d -> b h i (w j) d'
        fv = fv.flatten(3, 4)
        fk, fv, fmask = self._grouped(fk), self._grouped(fv), self._grouped(fmask)
        fsim = torch.einsum('bhid,bhijd->bhij', fq, fk) * self.scale
        fsim = fsim.masked_fill(~fmask, mask_value)
        fattn = fsim.softmax(dim=-1)
        fine_attn_out = torch.einsum('bhij,bhijd->bhid', fattn, fv)
        fine_attn_out = fine_attn_out[..., :seq_len, :]

        # 3. sliding window (LocalAttention(causal=True, exact_windowsize=True) as a dense masked attention)
        sk, sv = self._grouped(k), self._grouped(v)
        ssim = torch.einsum('bhid,bhjd->bhij', q, sk) * self.scale
        i_idx, j_idx = cq_seq[:, None], cq_seq[None, :]
        smask = (j_idx <= i_idx) & ((i_idx - j_idx) <= self.sliding_window_size)
        sliding_window_attn_out = torch.einsum('bhij,bhjd->bhid', ssim.masked_fill(~smask, mask_value).softmax(-1), sv)

        # combine strategies: Sequential(Linear, Sigmoid, Rearrange('b n (h s) -> b h n s'))
        strategy_weighted_combine = torch.sigmoid(self.strategy_combine_mlp(inp)).unflatten(-1, (self.heads, 3)).transpose(1, 2)
        out = torch.einsum('bhns,sbhnd->bhnd', strategy_weighted_combine,
                           torch.stack([compressed_attn_out, fine_attn_out, sliding_window_attn_out]))
        out = out.transpose(1, 2).flatten(-2)  # Rearrange('b h n d -> b n (h d)')
        return self.combine_heads(out)


# Mirrors lucidrains/native-sparse-attention-pytorch native_sparse_attention_pytorch/native_sparse_attention.py
# (SparseAttention, use_diff_topk=True: gates = straight_through(vals, 1.) = vals + (1. - vals).detach()).
@variant_form("nsa_diff_topk_lucidrains")
def _(seed: int) -> Case:
    g = _gen(seed, 102)
    m = _build(seed, _LucidrainsNSA)
    with torch.no_grad():  # non-degenerate memory kv / intra-block positions (the repo inits them to zeros)
        m.compress_mem_kv.normal_(generator=g)
        m.k_intrablock_positions.normal_(generator=g).mul_(0.1)
    return Case(
        "nsa_diff_topk_lucidrains", m, (_randn(g, 2, 32, 32),), 1, 0, k=2, unique=False,
        notes="lucidrains SparseAttention(use_diff_topk=True): compressed keys = MLP over k blocks (+mem kv "
        "Parameter prepended), einsum('bhid,bhjd->bhij')*scale, masked_fill(~cmask, -finfo.max), softmax; "
        "cattn feeds compressed_attn_out AND importance = cattn[..., mem:] mean over the GQA group; "
        "vals, idx = importance.topk(2, dim=-1); gates = vals + (1-vals).detach() multiply the gathered fine "
        "K/V (values used, differentiable); fmask = vals > 1e-10. Run with grad to see the joint graph. "
        "unique=False: not-yet-complete blocks have exact-0 importance; their picks are dropped by fmask",
        tags=("nsa", "values_used", "straight_through", "diff_topk", "softmax_epilogue", "other_consumer",
              "gqa_group_mean", "compressed", "gather_consumer", "finite_mask"),
    )


# ============================================================================ MoBA


# Mirrors MoonshotAI/MoBA moba/moba_naive.py::moba_attn_varlen_naive (full function). Deviation:
# ``cu_seqlens`` is a tuple of Python ints, so ``cu_seqlens[i].item()`` became ``cu_seqlens[i]``.
def _moba_attn_varlen_naive(q, k, v, cu_seqlens: tuple[int, ...], max_seqlen: int, moba_chunk_size: int,
                            moba_topk: int):
    batch = len(cu_seqlens) - 1
    softmax_scale = q.shape[-1] ** (-0.5)

    o = torch.zeros_like(q)
    for batch_idx in range(batch):
        batch_start = cu_seqlens[batch_idx]
        batch_end = cu_seqlens[batch_idx + 1]
        # get qkv of this batch
        q_ = q[batch_start:batch_end]
        k_ = k[batch_start:batch_end]
        v_ = v[batch_start:batch_end]
        o_ = o[batch_start:batch_end]
        # calc key gate weight
        key_gate_weight = []
        batch_size = batch_end - batch_start
        num_block = math.ceil(batch_size / moba_chunk_size)
        for block_idx in range(0, num_block):
            block_start = block_idx * moba_chunk_size
            block_end = min(batch_size, block_start + moba_chunk_size)
            key_gate_weight.append(k_[block_start:block_end].mean(dim=0, keepdim=True))
        key_gate_weight = torch.cat(key_gate_weight, dim=0)  # [ N, H, D ]
        # calc & mask gate
        # use fp32 to avoid precision issue in bf16
        q_ = q_.type(torch.float32)
        key_gate_weight = key_gate_weight.type(torch.float32)
        gate = torch.einsum("shd,nhd->hsn", q_, key_gate_weight)  # [ H, S, N ]
        key_gate_weight = key_gate_weight.type_as(k)
        q_ = q_.type_as(k)
        for i in range(num_block):
            # select the future Qs that can attend to KV chunk i
            gate[:, : (i + 1) * moba_chunk_size, i] = float("-inf")
            gate[:, i * moba_chunk_size : (i + 1) * moba_chunk_size, i] = float("inf")
        # gate_top_k_idx = gate_top_k_val = [ H S K ]
        gate_top_k_val, gate_top_k_idx = torch.topk(
            gate, k=min(moba_topk, num_block), dim=-1, largest=True, sorted=False
        )
        gate_top_k_val, _ = gate_top_k_val.min(dim=-1)  # [ H, S ]
        need_attend = gate >= gate_top_k_val.unsqueeze(-1)
        # add gate_idx_mask in case of there is cornercases of same topk val been selected
        gate_idx_mask = torch.zeros(need_attend.shape, dtype=torch.bool, device=q.device)
        gate_idx_mask = gate_idx_mask.scatter_(dim=-1, index=gate_top_k_idx, value=True)
        need_attend = torch.logical_and(need_attend, gate_idx_mask)
        gate[need_attend] = 0
        gate[~need_attend] = -float("inf")
        gate = gate.repeat_interleave(moba_chunk_size, dim=-1)[:, :, :batch_size]  # [ H, S, S ]
        gate.masked_fill_(torch.ones_like(gate, dtype=torch.bool).tril().logical_not(), -float("inf"))

        # calc qk = qk^t
        q_ = q_.type(torch.float32)
        k_ = k_.type(torch.float32)
        v_ = v_.type(torch.float32)
        qk = torch.einsum("xhd,yhd->hxy", q_, k_)
        # mask
        qk += gate
        qk *= softmax_scale
        # calc o
        p = qk.softmax(dim=-1)
        o_ += torch.einsum("hxy,yhd->xhd", p, v_)
        o = o.type_as(q)

    return o


@variant_form("moba_naive")
def _(seed: int) -> Case:
    g = _gen(seed, 103)
    cu, H, D, chunk, topk = (0, 24, 40), 4, 16, 4, 3
    S = cu[-1]
    q, k, v = _randn(g, S, H, D), _randn(g, S, H, D), _randn(g, S, H, D)
    fn = functools.partial(_moba_attn_varlen_naive, cu_seqlens=cu, max_seqlen=24, moba_chunk_size=chunk,
                           moba_topk=topk)
    return Case(
        "moba_naive", fn, (q, k, v), 2, 0, k=topk,
        notes="MoBA moba_attn_varlen_naive, 2 packed sequences (24 and 16 tokens, chunk 4): per-sequence loop "
        "-> 2 selection topk calls. kbar = cat(k_[bs:be].mean(0, keepdim=True)); gate = einsum('shd,nhd->hsn', "
        "q.float(), kbar.float()); python loop of in-place slice writes gate[:, :(i+1)*B, i] = -inf, "
        "gate[:, i*B:(i+1)*B, i] = +inf (current block forced); torch.topk(gate, k=min(3,N), dim=-1, "
        "largest=True, sorted=False); thr = vals.min(-1); need = (gate >= thr[...,None]) & zeros.scatter_(-1, "
        "idx, True) (re-reads gate); gate[need]=0; gate[~need]=-inf; repeat_interleave; tril; "
        "qk += gate; softmax. Ties only among -inf (future) chunks, which the token tril re-masks",
        tags=("moba", "values_used", "threshold_consumer", "inplace_fill", "forced_blocks", "sorted_false",
              "per_head", "bool_scatter_consumer", "loop_unrolled"),
    )


# Mirrors MoonshotAI/MoBA moba/moba_efficient.py::moba_attn_varlen, the gate section (L325-L371,
# verbatim as quoted in a public walkthrough of that file) and calc_chunks (L14-L64, run outside the
# compiled region: it uses lru_cache on a tensor and nonzero). The varlen gather + flash-attn +
# lse merge after ``gate_mask`` is replaced by a dense masked attention that uses the same
# selection (self chunk causal, plus the selected past chunks).
def _moba_calc_chunks(cu_seqlen: torch.Tensor, moba_chunk_size: int):
    batch_sizes = cu_seqlen[1:] - cu_seqlen[:-1]
    batch_num_chunk = (batch_sizes + (moba_chunk_size - 1)) // moba_chunk_size
    cu_num_chunk = torch.ones(batch_num_chunk.numel() + 1, device=cu_seqlen.device, dtype=batch_num_chunk.dtype)
    cu_num_chunk[1:] = batch_num_chunk.cumsum(dim=0)
    num_chunk = cu_num_chunk[-1]
    chunk_sizes = torch.full((num_chunk + 1,), moba_chunk_size, dtype=torch.int32, device=cu_seqlen.device)
    chunk_sizes[0] = 0
    batch_last_chunk_size = batch_sizes - (batch_num_chunk - 1) * moba_chunk_size
    chunk_sizes[cu_num_chunk[1:]] = batch_last_chunk_size
    cu_chunk = chunk_sizes.cumsum(dim=-1, dtype=torch.int32)
    chunk_to_batch = torch.zeros((num_chunk,), dtype=torch.int32, device=cu_seqlen.device)
    chunk_to_batch[cu_num_chunk[1:-1]] = 1
    chunk_to_batch = chunk_to_batch.cumsum(dim=0, dtype=torch.int32)
    chunk_to_remove = cu_num_chunk[1:] - 1
    chunk_to_remain = torch.ones((num_chunk,), dtype=torch.bool, device=cu_seqlen.device)
    chunk_to_remain[chunk_to_remove] = False
    filtered_chunk_indices = chunk_to_remain.nonzero(as_tuple=True)[0]
    num_filtered_chunk = len(filtered_chunk_indices)
    return cu_chunk, filtered_chunk_indices, num_filtered_chunk, chunk_to_batch


def _moba_efficient_gate(q, k, v, cu_seqlens, cu_chunk, filtered_chunk_indices, chunk_to_batch,
                         token_chunk, token_filtered, *, num_filtered_chunk: int, moba_chunk_size: int,
                         moba_topk: int):
    seqlen, num_head, head_dim = q.shape
    kv = torch.stack((k, v), dim=1)
    moba_topk = min(moba_topk - 1, num_filtered_chunk)

    # ---- moba_efficient.py gate section ----
    filtered_kv_indices = torch.arange(0, moba_chunk_size, dtype=torch.int32, device=q.device)[None, :].repeat(
        num_filtered_chunk, 1)
    filtered_kv_indices += cu_chunk[filtered_chunk_indices][:, None]
    filtered_kv = kv.index_select(0, filtered_kv_indices.view(-1))

    key_gate_weight = (
        filtered_kv[:, 0].view(num_filtered_chunk, moba_chunk_size, num_head, head_dim).mean(dim=1).float()
    )
    q = q.type(torch.float32)
    key_gate_weight = key_gate_weight.type(torch.float32)
    gate = torch.einsum("nhd,shd->nhs", key_gate_weight, q)
    key_gate_weight = key_gate_weight.type_as(k)
    q = q.type_as(k)

    gate_seq_idx = torch.arange(0, seqlen, device=q.device, dtype=torch.int32)[None, :].repeat(num_filtered_chunk, 1)
    chunk_end = cu_chunk[filtered_chunk_indices + 1]
    batch_end = cu_seqlens[chunk_to_batch[filtered_chunk_indices] + 1]
    gate_chunk_end_mask = gate_seq_idx < chunk_end[:, None]
    gate_batch_end_mask = gate_seq_idx >= batch_end[:, None]
    gate_inf_mask = gate_chunk_end_mask | gate_batch_end_mask
    gate.masked_fill_(gate_inf_mask.unsqueeze(1), -float("inf"))

    _, gate_top_k_idx = torch.topk(gate, k=moba_topk, dim=0, largest=True, sorted=False)
    gate_mask = torch.logical_not(gate.isinf())
    gate_idx_mask = torch.zeros(gate_mask.shape, dtype=torch.bool, device=q.device)
    gate_idx_mask = gate_idx_mask.scatter_(dim=0, index=gate_top_k_idx, value=True)
    gate_mask = torch.logical_and(gate_mask, gate_idx_mask)
    # ---- end of the gate section; dense stand-in for varlen gather + flash-attn + lse merge ----

    # moba part: key token t of filtered chunk n is attended by query s iff gate_mask[n, h, s]
    gm = torch.cat([gate_mask, gate_mask.new_zeros((1, num_head, seqlen))], dim=0)  # row N = "no filtered chunk"
    moba_allowed = gm[token_filtered].permute(1, 2, 0)  # [H, S_q, S_k]
    # self-attn part: same chunk, causal
    pos = torch.arange(seqlen, device=q.device)
    self_allowed = (token_chunk[None, :] == token_chunk[:, None]) & (pos[None, :] <= pos[:, None])
    allowed = moba_allowed | self_allowed[None]
    qk = torch.einsum("xhd,yhd->hxy", q.float(), k.float()) * head_dim**-0.5
    p = qk.masked_fill(~allowed, -float("inf")).softmax(dim=-1)
    return torch.einsum("hxy,yhd->xhd", p, v.float()).type_as(q)


@variant_form("moba_efficient_dim0")
def _(seed: int) -> Case:
    g = _gen(seed, 104)
    H, D, chunk, topk = 4, 16, 4, 3
    cu_seqlens = torch.tensor([0, 24, 40], dtype=torch.int32)
    S = int(cu_seqlens[-1])
    cu_chunk, filtered, n_filtered, chunk_to_batch = _moba_calc_chunks(cu_seqlens, chunk)
    token_chunk = torch.searchsorted(cu_chunk, torch.arange(S, dtype=torch.int32), right=True) - 1
    pos_in_filtered = torch.full((int(cu_chunk.numel()) - 1,), n_filtered, dtype=torch.long)
    pos_in_filtered[filtered] = torch.arange(n_filtered)
    token_filtered = pos_in_filtered[token_chunk]
    q, k, v = _randn(g, S, H, D), _randn(g, S, H, D), _randn(g, S, H, D)
    fn = functools.partial(_moba_efficient_gate, num_filtered_chunk=n_filtered, moba_chunk_size=chunk,
                           moba_topk=topk)
    args = (q, k, v, cu_seqlens, cu_chunk, filtered, chunk_to_batch, token_chunk, token_filtered)
    return Case(
        "moba_efficient_dim0", fn, args, 1, 0, k=topk - 1,
        notes="MoBA moba_attn_varlen gate: filtered_kv = kv.index_select(chunk token indices); kbar = "
        ".view(N,C,H,D).mean(1).float(); gate = einsum('nhd,shd->nhs', kbar, q) [N,H,S]; masked_fill_ "
        "(s < chunk_end | s >= batch_end, -inf) with runtime cu_chunk / cu_seqlens tensors; "
        "torch.topk(gate, k=min(topk-1, N), dim=0, sorted=False) over the BLOCK axis (values discarded); "
        "gate_mask = ~gate.isinf() & zeros.scatter_(0, idx, True). Consumer: dense stand-in for the varlen "
        "gather + flash-attn + lse merge (self chunk causal | selected chunks)",
        tags=("moba", "dim0", "sorted_false", "runtime_mask", "per_head", "inplace_fill", "bool_scatter_consumer",
              "isinf_consumer", "varlen"),
    )


# ============================================================================ InfLLM-v2


# Mirrors OpenBMB/infllmv2_cuda_impl infllm_v2/max_pooling_1d.py::max_pooling_1d + the CUDA kernel
# csrc/max_pooling_1d.cuh (max over [k*stride-1, k*stride-1+kernel) clipped; blocks < init_blocks
# -> +inf; 0 <= q_block - k_block < local_blocks -> -inf), written with torch ops.
def _infllm_max_pooling_1d(input, cache_len: int, local_blocks: int, init_blocks: int, block_size: int = 64,
                           stride: int = 16):
    stride = block_size // stride
    kernel_size = stride + 1
    padding = 1
    num_heads, q_len, k_len = input.shape
    total_len = q_len + cache_len
    out_len = (total_len + block_size - 1) // block_size
    output = F.max_pool1d(input, kernel_size, stride, padding)
    if output.shape[-1] < out_len:
        output = F.pad(output, (0, out_len - output.shape[-1]), value=float("-inf"))
    output = output[..., :out_len]
    off_bq = (torch.arange(q_len, device=input.device) + cache_len) // block_size
    off_bk = torch.arange(out_len, device=input.device)
    should_mask_neg_inf = (off_bq[:, None] >= off_bk[None, :]) & (off_bq[:, None] < off_bk[None, :] + local_blocks)
    output = output.masked_fill(should_mask_neg_inf, float("-inf"))
    output[..., :init_blocks] = float("inf")
    return output


# Mirrors OpenBMB/infllmv2_cuda_impl: stage 1 = tests/test_causal_stage1.py::naive_torch_implementation
# (repeat_interleave -> q @ k^T / sqrt(d) -> causal masked_fill -> softmax -> reshape(Hkv,G,q,k).sum(1)),
# with the compressed-key causal mask and the NaN -> 0 of tests/test_stage1.py::naive_attention;
# stage 2 = max_pooling_1d and the selection of the MiniCPM/InfLLM-v2 compressed_attention:
# ``block_score.topk(topk, dim=-1).indices.sort(-1).values; topk_idx[topk_idx > q_idx] = -1; int32``
# under torch.no_grad(). K compression (the repo's Triton mean-pool kernel) is ``unfold(...).mean``;
# the consumer is a dense stand-in for the block-sparse flash kernel.
def _infllm_v2(q, k, v, *, kernel_size: int, kernel_stride: int, block_size: int, topk: int, init_blocks: int,
               local_blocks: int):
    q_len, n_head, head_dim = q.shape
    k_head = k.shape[1]
    group_size = n_head // k_head
    with torch.no_grad():
        # stage 1: compressed keys (mean pool, kernel_size / kernel_stride) and group-summed softmax
        k_cmp = k.unfold(0, kernel_size, kernel_stride).mean(dim=-1)  # [C, Hkv, D]
        k_len = k_cmp.shape[0]
        qh = q.transpose(0, 1)  # (n_head, q_len, head_dim)
        kh = k_cmp.transpose(0, 1)  # (n_kv_head, k_len, head_dim)
        kh = kh.repeat_interleave(group_size, dim=0)
        S = qh @ kh.transpose(-2, -1) / (qh.shape[-1] ** 0.5)  # (n_head, q_len, k_len)
        q_idx = torch.arange(q_len, device=q.device)
        q_compress_idx = ((q_idx - (kernel_size - kernel_stride - 1)) // kernel_stride).clamp(0, k_len)
        causal_mask = torch.arange(k_len, device=q.device)[None, :] >= q_compress_idx[:, None]
        score = S.masked_fill(causal_mask.expand(S.shape[0], q_len, k_len), -float("inf"))
        score = torch.softmax(score, dim=-1)
        score = score.reshape(k_head, group_size, q_len, k_len).sum(dim=1)
        score = torch.where(torch.isnan(score), 0, score)
        # stage 2: block scores and selection
        block_score = _infllm_max_pooling_1d(score, cache_len=0, local_blocks=local_blocks, init_blocks=init_blocks,
                                             block_size=block_size, stride=kernel_stride)
        topk = min(topk, block_score.shape[-1])
        topk_idx = block_score.topk(topk, dim=-1).indices.sort(-1).values
        q_blk = q_idx // block_size
        topk_idx[topk_idx > q_blk[None, :, None]] = -1
        topk_idx = topk_idx.to(torch.int32)

    # consumer: block-sparse attention over the selected blocks + the local window, causal
    nb = block_score.shape[-1]
    safe = torch.where(topk_idx >= 0, topk_idx, nb).long()
    sel = torch.zeros(k_head, q_len, nb + 1, dtype=torch.bool, device=q.device).scatter_(-1, safe, True)[..., :nb]
    k_blk = torch.arange(q_len, device=q.device) // block_size
    tok_sel = sel.gather(-1, k_blk[None, None, :].expand(k_head, q_len, -1))  # [Hkv, q, k]
    local = (q_blk[:, None] - k_blk[None, :]) < local_blocks
    allowed = (tok_sel | local[None]) & (q_idx[None, :] <= q_idx[:, None])[None]
    allowed = allowed.repeat_interleave(group_size, dim=0)
    attn = (q.transpose(0, 1) @ k.transpose(0, 1).repeat_interleave(group_size, dim=0).transpose(-2, -1)) * head_dim**-0.5
    attn = attn.masked_fill(~allowed, -float("inf")).softmax(-1)
    out = attn @ v.transpose(0, 1).repeat_interleave(group_size, dim=0)
    return out.transpose(0, 1), topk_idx


@variant_form("infllm_v2_naive")
def _(seed: int) -> Case:
    g = _gen(seed, 105)
    T, HQ, HKV, D = 64, 8, 2, 16
    q, k, v = _randn(g, T, HQ, D), _randn(g, T, HKV, D), _randn(g, T, HKV, D)
    topk = 4  # <= num_blocks - local_blocks, so picks never reach the -inf local blocks
    fn = functools.partial(_infllm_v2, kernel_size=4, kernel_stride=2, block_size=8, topk=topk, init_blocks=1,
                           local_blocks=2)
    return Case(
        "infllm_v2_naive", fn, (q, k, v), 1, 0, k=topk, unique=False,
        notes="InfLLM-v2 (MiniCPM4) scaled down (kernel 4 / stride 2 / block 8 / topk 4): mean-pooled K, "
        "repeat_interleave over the group, q @ k^T / sqrt(d), masked_fill(compressed-causal, -inf), softmax, "
        "reshape(Hkv, G, q, k).sum(1), where(isnan, 0); max_pooling_1d to 8-token blocks (F.max_pool1d k=5 "
        "s=4 p=1), local blocks -> -inf (masked_fill), init block -> +inf (in-place slice); "
        ".topk(4).indices.sort(-1).values; idx[idx > q_block] = -1 (index_put); .to(int32); all under "
        "torch.no_grad(). Returns (out, topk_idx). unique=False: future blocks pool exact-0 probabilities; "
        "their picks sort last and become -1",
        tags=("infllm", "softmax_epilogue", "gqa_group_sum", "max_pool", "forced_blocks", "inplace_fill",
              "no_grad", "sort_post", "minus_one_post", "int32", "compressed", "overlapping_kernel"),
    )


# ============================================================================ Qwen QSA


# Vectorised restatement of huggingface/transformers src/transformers/models/qwen4_exp/modular_qwen4_exp.py
# Qwen4ExpTextQSAIndexer.forward for an all-causal mask (what the third-party fast paths, e.g.
# ``qsa_block_scores`` / ``fast_indexer_forward``, do): fp32 mean-pool of 4 raw keys -> back to
# dtype -> k_layernorm -> RoPE at the group start -> relu(q.k).sum(heads)/sqrt(d) over complete
# blocks -> topk over blocks (dim=-1) -> block->token expansion idx*4 + arange(4) + the tail.
class _QSAVectorized(nn.Module):
    def __init__(self, head_dim: int = 16, compress_ratio: int = 4, token_budget: int = 12) -> None:
        super().__init__()
        self.index_head_dim = head_dim
        self.compress_ratio = compress_ratio
        self.token_budget = token_budget
        self.block_topk = token_budget // compress_ratio
        self.k_layernorm = _QwenRMSNorm(head_dim)

    def forward(self, q, raw_keys, full_cos, full_sin, v):
        batch_size, seq_length, n_heads, _ = q.shape
        r = self.compress_ratio
        nb = seq_length // r
        block_token_indices = torch.arange(nb * r, device=q.device).view(nb, r)
        key_groups = raw_keys[:, : nb * r].view(batch_size, nb, r, self.index_head_dim)
        pooled_keys = key_groups.float().mean(dim=2).to(raw_keys.dtype)
        pooled_keys = self.k_layernorm(pooled_keys)
        group_starts = block_token_indices[:, 0]
        block_key_states = _apply_rotary_pos_emb(
            pooled_keys.unsqueeze(2), cos=full_cos[:, group_starts], sin=full_sin[:, group_starts], unsqueeze_dim=2
        ).squeeze(2)  # [B, nb, D]

        scores = torch.matmul(q.float(), block_key_states.float().transpose(-1, -2).unsqueeze(1))  # [B, S, H, nb]
        scores = torch.relu(scores).sum(dim=2) / math.sqrt(self.index_head_dim)  # [B, S, nb]
        pos = torch.arange(seq_length, device=q.device)
        num_complete_blocks = (pos + 1) // r
        scores = scores.masked_fill(torch.arange(nb, device=q.device)[None, :] >= num_complete_blocks[:, None],
                                    float("-inf"))
        selected_block_indices = scores.topk(min(self.block_topk, nb), dim=-1).indices  # [B, S, kb]
        invalid = selected_block_indices >= num_complete_blocks[None, :, None]
        selected_tokens = (selected_block_indices[..., None] * r + torch.arange(r, device=q.device)).flatten(-2)
        selected_tokens = torch.where(invalid.repeat_interleave(r, dim=-1), -1, selected_tokens).to(torch.int32)
        # selected_token_mask as in the HF indexer (scatter the -1 to a dropped last column) + the tail
        kv_length = seq_length
        scatter_indices = torch.where(selected_tokens >= 0, selected_tokens, kv_length).long()
        selected_token_mask = torch.zeros((batch_size, seq_length, kv_length + 1), dtype=torch.bool, device=q.device)
        selected_token_mask = selected_token_mask.scatter(-1, scatter_indices, True)[..., :kv_length]
        tail = (pos[None, :] >= (num_complete_blocks * r)[:, None]) & (pos[None, :] <= pos[:, None])
        attention_mask = (selected_token_mask | tail[None]) & (pos[None, :] <= pos[:, None])[None]
        # consumer: sdpa with the bool mask (one KV head)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), raw_keys[:, None], v[:, None],
                                             attn_mask=attention_mask[:, None])
        return out.transpose(1, 2), selected_tokens


@variant_form("qsa_vectorized")
def _(seed: int) -> Case:
    g = _gen(seed, 106)
    B, S, H, D = 2, 32, 4, 16
    m = _build(seed, _QSAVectorized)
    cos, sin = _cos_sin(B, S, D // 2)
    args = (_randn(g, B, S, H, D), _randn(g, B, S, D), cos, sin, _randn(g, B, S, D))
    return Case(
        "qsa_vectorized", m, args, 1, 0, k=3,
        notes="QSA indexer vectorised: 4 MQA heads, no weights_proj; kbar = raw_keys.view(B,nb,4,D).float()"
        ".mean(2).to(dtype) -> (1+w) RMSNorm -> partial RoPE at the group start; matmul(q.float(), "
        "kbar.float().T.unsqueeze(1)); relu(.).sum(heads) / sqrt(d); masked_fill(block >= (t+1)//4, -inf); "
        ".topk(min(3, nb), dim=-1).indices; tokens = idx*4 + arange(4), -1 for invalid picks; bool scatter "
        "mask + incomplete tail block, sdpa. Returns (out, selected_tokens)",
        tags=("qsa", "no_weights", "unweighted_head_sum", "div_scale", "compressed", "block_causal", "mask_fill_inf",
              "block_to_token", "int32", "bool_scatter_consumer", "sdpa"),
    )


# Mirrors huggingface/transformers src/transformers/models/qwen4_exp/modular_qwen4_exp.py
# Qwen4ExpTextQSAIndexer.forward from ``visible_token_indices`` on (the per-batch, per-query Python
# double loop with nonzero / index_select / ``scores.topk(min(block_topk, nb), dim=0).indices``),
# fed with already normed+roped q, no cache; consumer = the eager attention with the additive mask.
class _QSAPerQueryLoop(nn.Module):
    def __init__(self, head_dim: int = 8, compress_ratio: int = 4, token_budget: int = 8) -> None:
        super().__init__()
        self.index_head_dim = head_dim
        self.compress_ratio = compress_ratio
        self.token_budget = token_budget
        self.block_topk = token_budget // compress_ratio
        self.k_layernorm = _QwenRMSNorm(head_dim)

    def forward(self, q, raw_keys, full_cos, full_sin, attention_mask, v):
        batch_size, seq_length = q.shape[:2]
        hidden_device = q.device
        visible_token_indices = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        selected_token_indices = torch.full(
            (batch_size, seq_length, self.token_budget + self.compress_ratio - 1), -1, dtype=torch.int32,
            device=hidden_device,
        )
        for batch_idx in range(batch_size):
            for query_idx in range(seq_length):
                local_visible_indices = torch.nonzero(visible_token_indices[batch_idx, 0, query_idx], as_tuple=False).flatten()
                num_complete_blocks = local_visible_indices.shape[-1] // self.compress_ratio
                if num_complete_blocks > 0:
                    block_token_indices = local_visible_indices[: num_complete_blocks * self.compress_ratio].view(
                        num_complete_blocks, self.compress_ratio)
                    key_groups = raw_keys[batch_idx].index_select(0, block_token_indices.flatten())
                    key_groups = key_groups.view(*block_token_indices.shape, self.index_head_dim)
                    pooled_keys = key_groups.float().mean(dim=1).to(raw_keys.dtype)
                    pooled_keys = self.k_layernorm(pooled_keys)
                    group_starts = block_token_indices[:, 0]
                    block_key_states = _apply_rotary_pos_emb(
                        pooled_keys.unsqueeze(1),
                        cos=full_cos[batch_idx].index_select(0, group_starts),
                        sin=full_sin[batch_idx].index_select(0, group_starts),
                    ).squeeze(1)
                    scores = torch.matmul(q[batch_idx, query_idx].float(), block_key_states.float().transpose(-1, -2)).transpose(-1, -2)
                    scores = torch.relu(scores).sum(dim=-1) / math.sqrt(self.index_head_dim)
                    selected_block_indices = scores.topk(min(self.block_topk, num_complete_blocks), dim=0).indices
                    selected_tokens = block_token_indices.index_select(0, selected_block_indices).flatten()
                else:
                    selected_tokens = torch.tensor([], device=hidden_device)
                tail = local_visible_indices[num_complete_blocks * self.compress_ratio :]
                selected_tokens = torch.cat([selected_tokens, tail]).to(torch.int32)
                selected_token_indices[batch_idx, query_idx, : selected_tokens.numel()] = selected_tokens

        kv_length = attention_mask.shape[-1]
        selected_token_mask = torch.zeros((*selected_token_indices.shape[:-1], kv_length + 1),
                                          device=attention_mask.device, dtype=torch.bool)
        scatter_indices = torch.where(selected_token_indices >= 0, selected_token_indices, kv_length)
        selected_token_mask = selected_token_mask.scatter(-1, scatter_indices.long(), True)[..., :kv_length].unsqueeze(1)
        if attention_mask.is_floating_point():
            min_dtype = torch.finfo(attention_mask.dtype).min
            selected_token_mask = torch.where(selected_token_mask, attention_mask.new_zeros(()), min_dtype)
        attention_mask = attention_mask + selected_token_mask  # eager path: float masks add
        attn_weights = torch.matmul(q.transpose(1, 2), raw_keys[:, None].transpose(2, 3)) * self.index_head_dim**-0.5
        attn_weights = F.softmax(attn_weights + attention_mask, dim=-1, dtype=torch.float32)
        return torch.matmul(attn_weights, v[:, None]).transpose(1, 2), selected_token_indices


@variant_form("qsa_per_query_loop")
def _(seed: int) -> Case:
    g = _gen(seed, 107)
    B, S, H, D = 1, 12, 4, 8
    m = _build(seed, _QSAPerQueryLoop)
    cos, sin = _cos_sin(B, S, D // 2)
    pos = torch.arange(S)
    mask = torch.where(pos[None, :] <= pos[:, None], 0.0, torch.finfo(torch.float32).min)[None, None].expand(B, 1, S, S)
    args = (_randn(g, B, S, H, D), _randn(g, B, S, D), cos, sin, mask.contiguous(), _randn(g, B, S, D))
    n_sites = B * sum(1 for t in range(S) if (t + 1) // 4 > 0)  # queries with >= 1 complete visible block
    return Case(
        "qsa_per_query_loop", m, args, n_sites, 0, k=2,
        notes="HF Qwen4ExpTextQSAIndexer per-(batch, query) Python loop: nonzero(visible) -> index_select "
        "groups -> .float().mean(1) -> k_layernorm -> RoPE(index_select cos/sin) -> matmul(q[b,t].float(), "
        "kbar.T).T -> relu().sum(-1)/sqrt(d) -> scores.topk(min(2, nb), dim=0).indices -> block tokens "
        "+ tail -> int32 row writes; float additive mask into eager attention. One topk call per query "
        "with a complete block (9 here); the backend may leave these alone as a per-query loop",
        tags=("qsa", "per_query_loop", "dim0", "nonzero", "data_dependent", "no_weights", "unweighted_head_sum",
              "block_to_token", "int32", "additive_finite"),
    )


# ============================================================================ DeepSeek-V4 CSA (HF port)


# Mirrors huggingface/transformers src/transformers/models/deepseek_v4/modeling_deepseek_v4.py
# (transformers 5.24): DeepseekV4IndexerScorer.forward verbatim, DeepseekV4Indexer.forward's
# runtime ``future_mask`` / ``masked_fill`` / ``topk(min(index_topk, T)).indices`` / ``torch.where``,
# and the CSA compressor's ``block_bias`` consumer. Trimmed: the compressor is a non-overlapping
# softmax-gated pool (no Ca/Cb overlap, no RMSNorm / RoPE); the where adds the official code's
# ``+ offset`` into a ``[window kv || compressed kv]`` cache (the HF port uses offset 0).
class _HFV4CSA(nn.Module):
    def __init__(self, hidden: int = 64, n_heads: int = 8, head_dim: int = 16, compress_rate: int = 4,
                 index_topk: int = 4, window: int = 4) -> None:
        super().__init__()
        self.compress_rate, self.head_dim, self.index_topk, self.window = compress_rate, head_dim, index_topk, window
        self.softmax_scale = head_dim**-0.5
        self.weights_scaling = n_heads**-0.5
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)
        self.kv_proj = nn.Linear(hidden, head_dim, bias=False)
        self.gate_proj = nn.Linear(hidden, head_dim, bias=False)

    def scorer(self, q, compressed_kv, hidden_states):
        scores = torch.matmul(q.float(), compressed_kv.transpose(-1, -2).float().unsqueeze(1))  # [B, S, H, T]
        scores = F.relu(scores) * self.softmax_scale
        weights = self.weights_proj(hidden_states).float() * self.weights_scaling  # [B, S, H]
        return (scores * weights.unsqueeze(-1)).sum(dim=2)  # [B, S, T]

    def forward(self, hidden_states, q, position_ids, q_main):
        batch, seq_len, _ = hidden_states.shape
        kv = self.kv_proj(hidden_states)
        gate = self.gate_proj(hidden_states)
        n_windows = seq_len // self.compress_rate
        chunk_kv = kv.view(batch, n_windows, self.compress_rate, -1)
        chunk_gate = gate.view(batch, n_windows, self.compress_rate, -1)
        compressed_kv = (chunk_kv * chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype)).sum(dim=2)

        index_scores = self.scorer(q, compressed_kv, hidden_states)  # [B, S, T]
        compressed_len = compressed_kv.shape[1]
        top_k = min(self.index_topk, compressed_len)
        causal_threshold = (position_ids + 1) // self.compress_rate  # [B, S]
        entry_indices = torch.arange(compressed_len, device=index_scores.device)
        future_mask = entry_indices.view(1, 1, -1) >= causal_threshold.unsqueeze(-1)  # [B, S, T]
        index_scores = index_scores.masked_fill(future_mask, float("-inf"))
        top_k_indices = index_scores.topk(top_k, dim=-1).indices  # [B, S, k]
        invalid = top_k_indices >= causal_threshold.unsqueeze(-1)
        offset = seq_len  # compressed entries live after the window kv in the combined cache
        top_k_indices = torch.where(invalid, torch.full_like(top_k_indices, -1), top_k_indices + offset)

        # consumer: HF block_bias over the combined [window kv || compressed kv] cache
        combined_len = seq_len + compressed_len
        valid = top_k_indices >= 0
        safe_indices = torch.where(valid, top_k_indices, torch.full_like(top_k_indices, combined_len))
        block_bias = kv.new_full((batch, 1, seq_len, combined_len + 1), float("-inf"))
        block_bias.scatter_(-1, safe_indices.unsqueeze(1), 0.0)
        block_bias = block_bias[..., :combined_len]
        pos = position_ids[:, :, None]
        t = torch.arange(seq_len, device=kv.device)[None, None, :]
        block_bias[..., :seq_len] = torch.where((t <= pos) & (pos - t < self.window), 0.0, float("-inf")).unsqueeze(1)
        keys = torch.cat([kv, compressed_kv], dim=1)  # [B, S + T, D]
        attn = torch.matmul(q_main, keys.transpose(-1, -2).unsqueeze(1)) * self.softmax_scale + block_bias
        attn = F.softmax(attn, dim=-1, dtype=torch.float32)
        return torch.matmul(attn, keys.unsqueeze(1)), top_k_indices


@variant_form("v4_csa_compressed")
def _(seed: int) -> Case:
    g = _gen(seed, 108)
    B, S, HID, H, D, HM = 2, 32, 64, 8, 16, 4
    m = _build(seed, _HFV4CSA)
    position_ids = torch.arange(S)[None].expand(B, S).contiguous()
    args = (_randn(g, B, S, HID), _randn(g, B, S, H, D), position_ids, _randn(g, B, HM, S, D))
    return Case(
        "v4_csa_compressed", m, args, 1, 0, k=4,
        notes="HF DeepseekV4IndexerScorer: matmul(q.float(), compressed_kv.transpose(-1,-2).float().unsqueeze(1)) "
        "-> F.relu(.) * softmax_scale -> (scores * weights_proj(h).float()*H^-0.5 .unsqueeze(-1)).sum(2); "
        "DeepseekV4Indexer: masked_fill(arange(T) >= (position_ids+1)//4, -inf) with RUNTIME position_ids, "
        ".topk(min(4, T)).indices, where(idx >= thr, -1, idx + offset); consumer: full(-inf).scatter_(-1, "
        "safe, 0) block_bias + window bias over cat([kv, compressed_kv]). Compressed keys = softmax-gated "
        "pool of activations. Returns (out, indices)",
        tags=("v4", "csa", "hf", "compressed", "block_causal", "runtime_mask", "mask_fill_inf", "minus_one_post",
              "offset_post", "scatter_inf_consumer", "weighted_head_sum"),
    )


# ============================================================================ self-check


def make_all(seed: int = 0) -> list[Case]:
    return [make(seed) for make in VARIANT_FORMS.values()]


if __name__ == "__main__":
    import sys

    seeds = [int(a) for a in sys.argv[1:]] or [0]
    bad = 0
    for seed in seeds:
        for name, make in VARIANT_FORMS.items():
            case = make(seed)
            out = case.fn(*case.args)
            outs = out if isinstance(out, tuple) else (out,)
            finite = not any(bool(torch.isnan(o).any()) for o in outs if o.is_floating_point())
            recs = topk_inputs(case)
            ties = [boundary_ties(x, kk, d) for x, kk, d in recs]
            floor = _VALID_FLOOR if case.unique else 0.0
            pties = [positive_boundary_ties(x, kk, d, floor) for x, kk, d in recs]
            ok = len(recs) == case.num_selections + case.num_other_topk and finite
            ok = ok and sum(pties) == 0 and (sum(ties) == 0 or not case.unique)
            bad += not ok
            print(f"[seed {seed}->{case.seed}] {'ok ' if ok else 'BAD'} {name:28s} topk_calls={len(recs)} "
                  f"sel={case.num_selections} other={case.num_other_topk} unique={case.unique} "
                  f"boundary_ties={sum(ties)} positive_ties={sum(pties)} no_nan={finite}")
    print(f"{len(VARIANT_FORMS)} forms, {bad} problems")
    sys.exit(1 if bad else 0)
