"""A zoo of small, self-contained DSA-family indexer spellings (plus non-selection topk sites).

Each entry of ``FORMS`` is ``make(seed) -> Case``. ``case.fn(*case.args)`` runs the model in eager
and returns a tensor (or a tuple of tensors) that *uses* the selected indices, so equality with
eager after a rewrite is meaningful. Shapes are tiny (B<=2, S,T<=64, H 4-8, D 16-32, k 4-8).

Fields of ``Case``:

* ``num_selections``: ``topk`` sites that are sparse-attention selections (must be rewritten).
* ``num_other_topk``: ``topk`` sites that are NOT selections (MoE routers, samplers, topk over a
  plain tensor or over a contraction with a *parameter* key side): must stay ``aten.topk``.
* ``unique``: True when, for every selection row that has more than k valid (unmasked) keys, the
  k-th and (k+1)-th scores differ, and every consumer re-masks picks of masked keys (ties among
  masked keys are inherent when a row has fewer than k valid keys). The outputs are then
  independent of tie-breaking and must equal eager up to fp32 reassociation (checked against a
  stable-sort topk: bitwise equal, except where the consumer reduces over the k slots of a
  ``sorted=False`` / router selection, where the slot order changes the summation order:
  ``v4_official_where_mask_gather``, ``moe_router_sigmoid``, ``indexer_plus_moe_router``;
  allclose at 1e-5). ``unique=False`` (the ties case): compare indices against a stable
  (value desc, index asc) reference instead.
  ``FORMS[name](seed)`` guarantees this by re-drawing with a salted seed when a draw has a
  boundary tie (exact-zero ReLU ties from correlated heads, ~1% of draws); ``case.seed`` is the
  seed actually used and ``RAW_FORMS`` holds the makers without the re-draw.
* ``tags``: free-form labels (``no_grad``, ``bf16``, ``runtime_mask``, ``values_used``, ...).

The spellings follow the public code of the DSA family (official DeepSeek inference code,
Hugging Face transformers 5.24 ports, Megatron-LM reference, the ``ref_fp8_mqa_logits``
kernel-test reference, GLM-5), with deliberate variation (in-place ops,
``w[..., None]`` vs ``unsqueeze``, ``clamp(min=0)`` for ReLU, ``/ sqrt(d)`` for the scale, einsum
head sums, ``dim=0`` topk, ``index_select`` / advanced-index / ``gather`` consumers).

Run ``python tests/models/dsa_forms.py`` for an eager self-check (shapes, topk counts, ties).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

NEG_INF = float("-inf")


@dataclass
class Case:
    name: str
    fn: Callable[..., Any]  # an nn.Module or a plain function
    args: tuple[Any, ...]
    num_selections: int
    num_other_topk: int
    notes: str = ""
    unique: bool = True
    tags: tuple[str, ...] = ()
    k: int | None = None  # the indexer budget of the selection sites (None if no selection)
    seed: int = 0  # the effective seed the inputs/parameters were drawn with (see ``form``)


FORMS: dict[str, Callable[[int], Case]] = {}
RAW_FORMS: dict[str, Callable[[int], Case]] = {}  # the makers without the uniqueness re-draw

_MAX_REDRAWS = 50


def form(name: str) -> Callable[[Callable[[int], Case]], Callable[[int], Case]]:
    """Register ``make`` under ``name``. ``FORMS[name](seed)`` is deterministic in ``seed``; for a
    ``unique=True`` case whose eager run has a tie at the k-th/(k+1)-th boundary of some row with
    more than k valid keys (usually an exact-zero ReLU tie), it re-draws with a salted seed
    (``seed + 100_003 * attempt``) and records the seed used in ``case.seed``."""

    def deco(make: Callable[[int], Case]) -> Callable[[int], Case]:
        assert name not in FORMS, name
        RAW_FORMS[name] = make

        def make_unique(seed: int) -> Case:
            for attempt in range(_MAX_REDRAWS):
                eff = seed + 100_003 * attempt
                case = make(eff)
                case.seed = eff
                if not case.unique or all(boundary_ties(x, kk, d) == 0 for x, kk, d in topk_inputs(case)):
                    return case
            raise RuntimeError(f"{name}: no tie-free draw for seed {seed}")

        make_unique.form_name = name  # type: ignore[attr-defined]
        FORMS[name] = make_unique
        return make

    return deco


# ----------------------------------------------------------------------------- helpers


def _gen(seed: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * salt + seed)


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _build(seed: int, ctor: Callable[[], nn.Module], dtype: torch.dtype = torch.float32) -> nn.Module:
    """Construct a module with parameters drawn from ``seed`` without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ctor().to(dtype).eval()


def _cos_sin(positions: torch.Tensor, dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved (half-split) RoPE, as the HF DeepSeek-V3.2 indexer; cos/sin [S, d]."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def _rope_interleave(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair RoPE, as the HF GLM-5 indexer (cos/sin carry duplicated halves)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half].to(x.dtype), sin[:, None, :half].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


# Default sizes.
B, S, HID, QL = 2, 32, 64, 32
K = 8


# ============================================================================ official DeepSeek


class _OfficialV4Indexer(nn.Module):
    """Official DeepSeek-V4 ``Indexer.forward`` (prefill, no fp4 QAT, no Hadamard) feeding the
    official additive index mask: ``full(-inf).scatter_(-1, idx, 0)`` + causal mask, added to
    MHA-form main attention scores."""

    def __init__(self, n_heads: int = 8, head_dim: int = 16, main_heads: int = 4, main_dim: int = 16) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.index_topk = n_heads, head_dim, K
        self.softmax_scale = head_dim**-0.5
        self.wq_b = nn.Linear(QL, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(HID, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim)
        self.weights_proj = nn.Linear(HID, n_heads, bias=False)
        self.wq_main = nn.Linear(QL, main_heads * main_dim, bias=False)
        self.wkv = nn.Linear(HID, main_dim, bias=False)
        self.main_heads, self.main_dim = main_heads, main_dim

    def forward(self, x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.size()
        end_pos = seqlen
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        k = self.k_norm(self.wk(x))
        weights = self.weights_proj(x) * (self.softmax_scale * self.n_heads**-0.5)
        index_score = torch.einsum("bshd,btd->bsht", q, k)
        index_score = (index_score.relu_() * weights.unsqueeze(-1)).sum(dim=2)
        mask = torch.full((seqlen, seqlen), NEG_INF, device=x.device).triu_(1)
        index_score += mask
        topk_idxs = index_score.topk(min(self.index_topk, end_pos), dim=-1, sorted=False)[1]
        # official Attention.forward (prefill, MHA form) with the index mask
        qm = self.wq_main(qr).unflatten(-1, (self.main_heads, self.main_dim))
        kv = self.wkv(x)
        scores = torch.einsum("bshd,btd->bsht", qm, kv) * self.main_dim**-0.5
        index_mask = torch.full((bsz, seqlen, seqlen), NEG_INF, device=x.device).scatter_(-1, topk_idxs, 0)
        index_mask += mask
        scores += index_mask.unsqueeze(2)
        scores = scores.softmax(dim=-1, dtype=torch.float32)
        return torch.einsum("bsht,btd->bshd", scores, kv)


@form("v4_official_einsum_triu")
def _(seed: int) -> Case:
    g = _gen(seed, 1)
    m = _build(seed, _OfficialV4Indexer)
    args = (_randn(g, B, S, HID), _randn(g, B, S, QL))
    return Case(
        "v4_official_einsum_triu", m, args, 1, 0, k=K,
        notes="official V4/V3.2 Indexer: einsum('bshd,btd->bsht'), relu_(), *weights.unsqueeze(-1) "
        "(softmax_scale*H^-0.5 folded into weights), sum(dim=2), += full(-inf).triu_(1), "
        ".topk(min(k,T), sorted=False)[1]; consumer full(-inf).scatter_(-1, idx, 0) + mask added to scores",
        tags=("official", "inplace", "sorted_false", "additive_inf", "scatter_inf_consumer"),
    )


def _v4_where_mask_gather(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Official-style scoring with a ``where(t >= s+1, -inf, 0)`` mask; gathers K/V rows by index."""
    bsz, seqlen, _, d = q.shape
    t_len = k.shape[1]
    s = torch.einsum("bshd,btd->bsht", q, k)
    s = (torch.relu(s) * w[..., None]).sum(dim=2)
    pos = torch.arange(seqlen, device=q.device)
    t_idx = torch.arange(t_len, device=q.device)
    s = s + torch.where(t_idx[None, :] >= pos[:, None] + 1, NEG_INF, 0.0)
    idx = s.topk(min(K, t_len), dim=-1, sorted=False)[1]  # [B, S, k]
    # gather selected K/V rows by advanced indexing
    bidx = torch.arange(bsz, device=q.device)[:, None, None]
    k_sel, v_sel = k[bidx, idx], v[bidx, idx]  # [B, S, k, D]
    valid = idx <= pos[None, :, None]
    logits = torch.einsum("bshd,bskd->bshk", q, k_sel) * d**-0.5
    logits = logits.masked_fill(~valid[:, :, None, :], NEG_INF)
    return torch.einsum("bshk,bskd->bshd", logits.softmax(-1), v_sel)


@form("v4_official_where_mask_gather")
def _(seed: int) -> Case:
    g = _gen(seed, 2)
    H, D = 8, 32
    q, k = _randn(g, B, S, H, D), _randn(g, B, S, D)
    w = _randn(g, B, S, H) * (D**-0.5 * H**-0.5)
    v = _randn(g, B, S, D)
    return Case(
        "v4_official_where_mask_gather", _v4_where_mask_gather, (q, k, w, v), 1, 0, k=K,
        notes="einsum, torch.relu, w[..., None], sum(dim=2), + where(t >= s+1, -inf, 0), "
        "topk(sorted=False)[1]; consumer: advanced-index gather of K/V rows, mask idx > s",
        tags=("official", "sorted_false", "additive_inf", "gather_consumer"),
    )


def _v4_compressed(q: torch.Tensor, kv: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Official V4 CSA prefill: block-causal mask on the compressed axis, ``where(idx >= thr, -1,
    idx + offset)`` into a ``[window kv || compressed kv]`` cache, gathered by the sparse attention."""
    ratio, window, topk = 4, 8, 6
    bsz, seqlen, _, d = q.shape
    ckv = kv.view(bsz, seqlen // ratio, ratio, d).mean(2)  # compressed keys from activations
    t_cmp = ckv.shape[1]
    s = torch.einsum("bshd,btd->bsht", q, ckv)
    s = (s.relu_() * w.unsqueeze(-1)).sum(dim=2)
    pos = torch.arange(seqlen, device=q.device)
    thr = (pos + 1) // ratio
    s += torch.where(torch.arange(t_cmp, device=q.device) >= thr.unsqueeze(1), NEG_INF, 0.0)
    idx = s.topk(min(topk, t_cmp), dim=-1)[1]
    idx = torch.where(idx >= thr[None, :, None], -1, idx + seqlen)  # offset past the window cache
    win = pos[:, None] - torch.arange(window, device=q.device)
    win = torch.where(win >= 0, win, -1).expand(bsz, -1, -1)
    all_idx = torch.cat([win, idx], dim=-1)  # [B, S, W + k]
    cache = torch.cat([kv, ckv], dim=1)  # [B, S + Tc, D]
    valid = all_idx >= 0
    flat = all_idx.clamp(min=0).flatten(1)
    sel = cache.gather(1, flat.unsqueeze(-1).expand(-1, -1, d)).view(bsz, seqlen, -1, d)
    logits = torch.einsum("bshd,bskd->bshk", q, sel) * d**-0.5
    logits = logits.masked_fill(~valid.unsqueeze(2), NEG_INF)
    return torch.einsum("bshk,bskd->bshd", logits.softmax(-1), sel)


@form("v4_official_compressed_block_causal")
def _(seed: int) -> Case:
    g = _gen(seed, 3)
    H, D, SS = 8, 16, 64
    q, kv = _randn(g, B, SS, H, D), _randn(g, B, SS, D)
    w = _randn(g, B, SS, H).abs() * (D**-0.5 * H**-0.5)
    return Case(
        "v4_official_compressed_block_causal", _v4_compressed, (q, kv, w), 1, 0, k=6,
        notes="V4 CSA: keys = mean-pooled windows of 4 (T_c=16), += where(t_cmp >= (pos+1)//4, -inf, 0), "
        "topk(6)[1], where(idx >= thr, -1, idx + S); consumer gathers from cat([window kv, compressed kv])",
        tags=("official", "compressed", "block_causal", "additive_inf", "minus_one_post", "offset_post",
              "gather_consumer"),
    )


# ============================================================================ Hugging Face ports


class _HFV32Layer(nn.Module):
    """HF ``DeepseekV32Indexer`` (+ a simplified MLA-free attention) with bool causal mask.

    ``bool_mask=True``: ``masked_fill(~mask, -inf)`` in the indexer and ``mask & ~index_mask`` into
    SDPA (the HF sdpa path). ``bool_mask=False``: ``+ additive finfo.min mask`` in the indexer and
    ``mask.masked_fill(index_mask, finfo.min)`` into eager attention (the HF eager path).
    """

    def __init__(self, bool_mask: bool, n_heads: int = 8, head_dim: int = 32, rope_dim: int = 8,
                 main_heads: int = 4, main_dim: int = 16, interleaved_rope: bool = False,
                 use_relu: bool = True) -> None:
        super().__init__()
        self.bool_mask, self.interleaved_rope, self.use_relu = bool_mask, interleaved_rope, use_relu
        self.n_heads, self.head_dim, self.rope_dim, self.index_topk = n_heads, head_dim, rope_dim, K
        self.softmax_scale = head_dim**-0.5
        self.q_a_proj = nn.Linear(HID, QL, bias=False)
        self.q_a_layernorm = _RMSNorm(QL)
        self.wq_b = nn.Linear(QL, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(HID, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(HID, n_heads, bias=False)
        self.q_b_proj = nn.Linear(QL, main_heads * main_dim, bias=False)
        self.k_proj = nn.Linear(HID, main_dim, bias=False)
        self.v_proj = nn.Linear(HID, main_dim, bias=False)
        self.main_heads, self.main_dim = main_heads, main_dim

    def keep_weights_proj_fp32(self) -> "_HFV32Layer":
        self.weights_proj.float()  # HF: _keep_in_fp32_modules = ["indexer.weights_proj"]
        return self

    def indexer_scores(self, x: torch.Tensor, q_resid: torch.Tensor) -> torch.Tensor:
        batch_size, seq_len, _ = x.shape
        cos, sin = _cos_sin(torch.arange(seq_len, device=x.device), self.rope_dim)
        q = self.wq_b(q_resid).view(batch_size, seq_len, self.n_heads, self.head_dim)
        q_rot, q_pass = torch.split(q, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k = self.k_norm(self.wk(x)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        rope = _rope_interleave if self.interleaved_rope else _rope_half
        q = torch.cat([rope(q_rot, cos, sin), q_pass], dim=-1)
        k = torch.cat([rope(k_rot, cos, sin), k_pass], dim=-1).squeeze(2)
        scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale
        if self.use_relu:
            scores = F.relu(scores)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * (self.n_heads**-0.5)
        return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        index_scores = self.indexer_scores(x, q_resid)
        if attention_mask.dtype == torch.bool:
            index_scores = index_scores.masked_fill(~attention_mask, NEG_INF)
        else:
            index_scores = index_scores + attention_mask
        topk = min(self.index_topk, index_scores.shape[-1])
        return index_scores.topk(topk, dim=-1).indices.to(torch.int32)

    def attend(self, x: torch.Tensor, q_resid: torch.Tensor, mask4: torch.Tensor, topk_indices: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.q_b_proj(q_resid).view(bsz, seqlen, self.main_heads, self.main_dim).transpose(1, 2)
        k = self.k_proj(x).unsqueeze(1).expand(-1, self.main_heads, -1, -1)
        v = self.v_proj(x).unsqueeze(1).expand(-1, self.main_heads, -1, -1)
        index_mask = (
            topk_indices.new_ones((bsz, seqlen, k.shape[2]), dtype=torch.bool)
            .scatter(-1, topk_indices.long(), False)
            .unsqueeze(1)
        )
        if mask4.dtype == torch.bool:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask4 & ~index_mask)
        else:
            mask4 = mask4.masked_fill(index_mask, torch.finfo(x.dtype).min)
            attn = torch.matmul(q, k.transpose(2, 3)) * self.main_dim**-0.5 + mask4
            attn = F.softmax(attn, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(attn, v)
        return out.transpose(1, 2).reshape(bsz, seqlen, -1)

    def causal_mask4(self, x: torch.Tensor) -> torch.Tensor:
        seqlen = x.shape[1]
        pos = torch.arange(seqlen, device=x.device)
        allowed = (pos[None, :] <= pos[:, None])[None, None].expand(x.shape[0], 1, -1, -1)
        if self.bool_mask:
            return allowed
        return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        mask4 = self.causal_mask4(x)
        topk_indices = self.select(x, q_resid, mask4[:, 0, :, :])
        return self.attend(x, q_resid, mask4, topk_indices)


class _HFV32NoGrad(_HFV32Layer):
    @torch.no_grad()
    def select(self, x: torch.Tensor, q_resid: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return super().select(x, q_resid, attention_mask)


@form("hf_v32_nograd_bool_bf16")
def _(seed: int) -> Case:
    g = _gen(seed, 4)
    m = _build(seed, lambda: _HFV32NoGrad(bool_mask=True), torch.bfloat16).keep_weights_proj_fp32()
    return Case(
        "hf_v32_nograd_bool_bf16", m, (_randn(g, B, S, HID, dtype=torch.bfloat16),), 1, 0, k=K,
        notes="HF DeepseekV32Indexer under @torch.no_grad(): bf16 q/k upcast .float(), "
        "matmul(q.float(), k.transpose(-1,-2).float().unsqueeze(1)) * scale, F.relu, "
        "matmul(w.unsqueeze(-2), s).squeeze(-2), masked_fill(~bool, -inf), topk().indices.to(int32); "
        "consumer ones(bool).scatter(-1, idx.long(), False), SDPA with mask & ~index_mask",
        tags=("hf", "no_grad", "bf16", "upcast", "rope", "matmul_head_sum", "bool_mask", "int32",
              "bool_scatter_consumer", "sdpa"),
    )


@form("hf_v32_grad_additive_finfo")
def _(seed: int) -> Case:
    g = _gen(seed, 5)
    m = _build(seed, lambda: _HFV32Layer(bool_mask=False))
    return Case(
        "hf_v32_grad_additive_finfo", m, (_randn(g, B, S, HID),), 1, 0, k=K,
        notes="HF DeepseekV32 indexer WITHOUT no_grad, fp32, additive mask where(causal, 0, finfo.min) "
        "[B,1,S,T] sliced [:, 0] (the HF eager path); consumer mask.masked_fill(index_mask, finfo.min), eager softmax",
        tags=("hf", "rope", "matmul_head_sum", "additive_finite", "int32", "bool_scatter_consumer"),
    )


class _HFRuntimeMask(_HFV32Layer):
    """HF eager path with the 4-D float ``attention_mask`` (finfo.min entries) passed in."""

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        topk_indices = self.select(x, q_resid, attention_mask[:, 0, :, :])
        return self.attend(x, q_resid, attention_mask, topk_indices)


@form("hf_runtime_attention_mask_4d")
def _(seed: int) -> Case:
    g = _gen(seed, 6)
    m = _build(seed, lambda: _HFRuntimeMask(bool_mask=False, n_heads=8, head_dim=16))
    pos = torch.arange(S)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, :4] = False  # left padding in batch 1
    allowed = (pos[None, :] <= pos[:, None])[None] & keep[:, None, :]
    mask4 = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]  # [B, 1, S, T]
    return Case(
        "hf_runtime_attention_mask_4d", m, (_randn(g, B, S, HID), mask4), 1, 0, k=K,
        notes="runtime HF attention_mask input [B,1,S,T] float with finfo.min (causal + left padding), "
        "sliced [:, 0] and added to the index scores; padded query rows are fully masked",
        tags=("hf", "runtime_mask", "additive_finite", "padding", "int32", "bool_scatter_consumer"),
    )


class _HFV4Csa(nn.Module):
    """HF ``DeepseekV4IndexerScorer`` + ``DeepseekV4Indexer`` (runtime ``position_ids`` threshold) +
    the CSA ``block_bias`` consumer (``full(-inf).scatter_(-1, safe, 0.0)``)."""

    def __init__(self, n_heads: int = 8, head_dim: int = 16, ratio: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.compress_rate, self.index_topk = n_heads, head_dim, ratio, K
        self.q_b_proj = nn.Linear(QL, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(HID, n_heads, bias=False)
        self.softmax_scale = head_dim**-0.5
        self.weights_scaling = n_heads**-0.5
        self.q_main = nn.Linear(HID, head_dim, bias=False)

    def forward(self, x: torch.Tensor, q_residual: torch.Tensor, compressed_kv: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        cos, sin = _cos_sin(torch.arange(seq_len, device=x.device), 8)
        q = self.q_b_proj(q_residual).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        q_rot = _rope_half(q[..., :8].transpose(1, 2), cos, sin).transpose(1, 2)
        q = torch.cat([q_rot, q[..., 8:]], dim=-1).transpose(1, 2)  # back to [B, S, H, D]
        scores = torch.matmul(q.float(), compressed_kv.transpose(-1, -2).float().unsqueeze(1))
        scores = F.relu(scores) * self.softmax_scale
        weights = self.weights_proj(x).float() * self.weights_scaling
        index_scores = (scores * weights.unsqueeze(-1)).sum(dim=2)
        compressed_len = compressed_kv.shape[1]
        top_k = min(self.index_topk, compressed_len)
        causal_threshold = (position_ids + 1) // self.compress_rate
        entry_indices = torch.arange(compressed_len, device=x.device)
        future_mask = entry_indices.view(1, 1, -1) >= causal_threshold.unsqueeze(-1)
        index_scores = index_scores.masked_fill(future_mask, NEG_INF)
        top_k_indices = index_scores.topk(top_k, dim=-1).indices
        invalid = top_k_indices >= causal_threshold.unsqueeze(-1)
        top_k_indices = torch.where(invalid, torch.full_like(top_k_indices, -1), top_k_indices)
        # consumer: DeepseekV4CSACompressor block bias, then attention over [self || compressed]
        valid = top_k_indices >= 0
        safe = torch.where(valid, top_k_indices, torch.full_like(top_k_indices, compressed_len))
        block_bias = compressed_kv.new_full((batch, seq_len, compressed_len + 1), NEG_INF)
        block_bias.scatter_(-1, safe, 0.0)
        qm = self.q_main(x)
        logits_c = torch.matmul(qm, compressed_kv.transpose(-1, -2)) + block_bias[..., :compressed_len]
        logits_self = (qm * x[..., : self.head_dim]).sum(-1, keepdim=True)
        probs = torch.cat([logits_self, logits_c], dim=-1).mul(self.head_dim**-0.5).softmax(-1)
        vals = torch.cat([x[..., None, : self.head_dim], compressed_kv.unsqueeze(1).expand(-1, seq_len, -1, -1)], 2)
        return (probs.unsqueeze(-1) * vals).sum(2)


@form("hf_v4_position_ids_threshold")
def _(seed: int) -> Case:
    g = _gen(seed, 7)
    m = _build(seed, _HFV4Csa)
    tc = 20
    position_ids = torch.stack([torch.arange(S), torch.arange(S) + 16])  # batch 1: a later chunk
    args = (_randn(g, B, S, HID), _randn(g, B, S, QL), _randn(g, B, tc, 16), position_ids)
    return Case(
        "hf_v4_position_ids_threshold", m, args, 1, 0, k=K,
        notes="HF DeepseekV4: q view/transpose(1,2)/RoPE/transpose back, matmul(q.float(), ckv^T.float().unsqueeze(1)), "
        "F.relu(s)*scale (scale AFTER relu), (s*w.unsqueeze(-1)).sum(2), masked_fill(arange(Tc) >= (position_ids+1)//4, -inf) "
        "with position_ids a runtime input differing per batch row, topk().indices, where(idx >= thr, -1, idx); "
        "consumer full(-inf).scatter_(-1, safe, 0.0) block bias",
        tags=("hf", "compressed", "runtime_mask", "position_ids", "mask_fill_inf", "minus_one_post",
              "scatter_inf_consumer"),
    )


# ============================================================================ Megatron / kernel tests


def _megatron(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor,
              value: torch.Tensor) -> torch.Tensor:
    """Megatron-LM ``_compute_index_scores`` + ``fused_qk_topk_naive`` (sequence-first)."""
    s = torch.einsum("sbhd,tbd->sbht", q.float(), k.float())
    s = torch.relu(s)
    s = (s * weights.unsqueeze(-1)).sum(dim=2).transpose(0, 1)  # [b, sq, sk]
    s = s + mask
    sk = s.shape[-1]
    vals, idx = s.topk(min(K, sk), dim=-1)
    idx = idx.masked_fill(vals == float("-inf"), -1)
    # consumer: gather key/value rows (batch-first), -1 picks dropped
    kb, vb = k.transpose(0, 1).float(), value.transpose(0, 1)
    bsz, sq, kk = idx.shape
    safe = idx.clamp(min=0).reshape(bsz, sq * kk, 1)
    k_sel = torch.gather(kb, 1, safe.expand(-1, -1, kb.shape[-1])).view(bsz, sq, kk, -1)
    v_sel = torch.gather(vb, 1, safe.expand(-1, -1, vb.shape[-1])).view(bsz, sq, kk, -1)
    qb = q.transpose(0, 1).float().mean(2)  # [b, sq, d]
    logits = (qb.unsqueeze(2) * k_sel).sum(-1).masked_fill(idx < 0, float("-inf"))
    return (logits.softmax(-1).unsqueeze(-1) * v_sel).sum(2)


@form("megatron_sbhd_values_minus_one")
def _(seed: int) -> Case:
    g = _gen(seed, 8)
    H, D = 8, 32
    q = _randn(g, S, B, H, D, dtype=torch.bfloat16)
    k = _randn(g, S, B, D, dtype=torch.bfloat16)
    w = _randn(g, S, B, H).abs() * (H**-0.5 * D**-0.5)
    mask = torch.triu(torch.full((S, S), float("-inf")), diagonal=1)
    value = _randn(g, S, B, 16)
    return Case(
        "megatron_sbhd_values_minus_one", _megatron, (q, k, w, mask, value), 1, 0, k=K,
        notes="Megatron reference: einsum('sbhd,tbd->sbht', q.float(), k.float()) (bf16 inputs), torch.relu, "
        "(s*w.unsqueeze(-1)).sum(dim=2).transpose(0,1), + mask (input), vals, idx = s.topk(); "
        "idx.masked_fill(vals == -inf, -1) (VALUES USED); consumer torch.gather of K/V rows",
        tags=("megatron", "seq_first", "bf16", "upcast", "additive_inf", "values_used", "minus_one_post",
              "gather_consumer"),
    )


def _kernel_ref(q: torch.Tensor, kv: torch.Tensor, weights: torch.Tensor, ks: torch.Tensor,
                ke: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``ref_fp8_mqa_logits`` (DeepGEMM / TileLang tests) without fp8, then topk and an
    ``index_select`` consumer. No batch axis; per-row key windows ``[ks, ke)`` are runtime tensors."""
    n = kv.shape[0]
    cols = torch.arange(n, device=q.device)
    in_range = (cols.unsqueeze(0) >= ks.unsqueeze(1)) & (cols.unsqueeze(0) < ke.unsqueeze(1))
    score = torch.einsum("mhd,nd->hmn", q.float(), kv.float())
    logits = (score.relu() * weights.unsqueeze(-1).transpose(0, 1)).sum(dim=0)
    logits = logits.masked_fill(~in_range, float("-inf"))
    topk_idx = logits.topk(min(K, n), dim=-1).indices  # [M, k]
    m = q.shape[0]
    ok = (topk_idx >= ks[:, None]) & (topk_idx < ke[:, None])
    v_sel = value.index_select(0, topk_idx.reshape(-1)).view(m, -1, value.shape[-1])
    k_sel = kv.index_select(0, topk_idx.reshape(-1)).view(m, -1, kv.shape[-1])
    att = torch.einsum("md,mkd->mk", q.float().mean(1), k_sel.float()).masked_fill(~ok, NEG_INF)
    return torch.einsum("mk,mkd->md", att.softmax(-1), v_sel)


def _varlen_windows(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    ks, ke = [], []
    start = 0
    for n in lengths:
        for i in range(n):
            ks.append(start)
            ke.append(start + i + 1)
        start += n
    return torch.tensor(ks), torch.tensor(ke)


@form("kernel_ref_mhd_nd_range")
def _(seed: int) -> Case:
    g = _gen(seed, 9)
    H, D = 8, 16
    ks, ke = _varlen_windows([20, 28])  # two packed sequences, causal within each
    m = ks.numel()
    q, kv = _randn(g, m, H, D), _randn(g, m, D)
    w = _randn(g, m, H).abs()
    value = _randn(g, m, 16)
    return Case(
        "kernel_ref_mhd_nd_range", _kernel_ref, (q, kv, w, ks, ke, value), 1, 0, k=K,
        notes="kernel-test form: einsum('mhd,nd->hmn') (no batch), .relu(), * w.unsqueeze(-1).transpose(0,1), "
        ".sum(dim=0), masked_fill(~[ks, ke)) with runtime ks/ke (varlen packing), topk().indices; "
        "consumer index_select",
        tags=("kernel_ref", "batchless", "runtime_mask", "range_mask", "mask_fill_inf", "index_select_consumer"),
    )


def _kernel_dim0(q: torch.Tensor, kv: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Scores laid out keys-first ``[N, M]`` and selected with ``topk(dim=0)``."""
    n, m = kv.shape[0], q.shape[0]
    s = torch.einsum("nd,mhd->hnm", kv, q)
    s = (s.relu() * weights.t()[:, None, :]).sum(0)  # [N, M]
    later = torch.arange(n)[:, None] > torch.arange(m)[None, :]
    s = s.masked_fill(later, NEG_INF)
    idx = torch.topk(s, K, dim=0).indices.t()  # [M, k]
    sel = kv[idx]  # [M, k, D]
    ok = idx <= torch.arange(m)[:, None]
    att = (q.mean(1)[:, None, :] * sel).sum(-1).masked_fill(~ok, NEG_INF)
    return (att.softmax(-1)[..., None] * sel).sum(1)


@form("kernel_keys_first_topk_dim0")
def _(seed: int) -> Case:
    g = _gen(seed, 10)
    H, D = 8, 16
    q, kv = _randn(g, S, H, D), _randn(g, S, D)
    w = _randn(g, S, H).abs()
    return Case(
        "kernel_keys_first_topk_dim0", _kernel_dim0, (q, kv, w), 1, 0, k=K,
        notes="no batch, einsum('nd,mhd->hnm') (keys first), relu, * w.t()[:, None, :], sum(0), "
        "masked_fill(n > m, -inf), torch.topk(s, k, dim=0).indices.t(); consumer kv[idx]",
        tags=("batchless", "dim0", "mask_fill_inf", "gather_consumer"),
    )


# ============================================================================ GLM-5 variants


def _glm_norelu_batched(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """GLM-5 with the ReLU disabled (Megatron ``use_relu=False``): signed head weights and scores."""
    bsz, seqlen, h, d = q.shape
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * d**-0.5  # [B,S,H,T]
    weights = w.float() * h**-0.5
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    pos = torch.arange(seqlen)
    additive = torch.where(pos[None, :] <= pos[:, None], 0.0, torch.finfo(torch.float32).min)
    index_scores = index_scores + additive
    idx = index_scores.topk(min(K, index_scores.shape[-1]), dim=-1).indices.to(torch.int32)
    index_mask = torch.ones(bsz, seqlen, k.shape[1], dtype=torch.bool).scatter(-1, idx.long(), False)
    attn = torch.matmul(q.mean(2), k.transpose(1, 2)) * d**-0.5 + additive
    attn = attn.masked_fill(index_mask, torch.finfo(torch.float32).min)
    return torch.matmul(attn.softmax(-1), v)


@form("glm5_norelu_signed_batched")
def _(seed: int) -> Case:
    g = _gen(seed, 11)
    H, D = 8, 16
    args = (_randn(g, B, S, H, D), _randn(g, B, S, D), _randn(g, B, S, H), _randn(g, B, S, 16))
    return Case(
        "glm5_norelu_signed_batched", _glm_norelu_batched, args, 1, 0, k=K,
        notes="GLM-5 without ReLU, weights of both signs; HF matmul form, matmul head sum, "
        "+ where(causal, 0, finfo.min), topk().indices.to(int32); consumer bool scatter + masked_fill(finfo.min)",
        tags=("glm", "no_relu", "signed_weights", "matmul_head_sum", "additive_finite", "int32",
              "bool_scatter_consumer"),
    )


def _glm_norelu_unbatched(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """No batch axis, no ReLU, scale applied to the weights; official-style -inf index mask."""
    seqlen, h, d = q.shape
    t_len = k.shape[0]
    scores = torch.matmul(q.transpose(0, 1), k.t())  # [H, S, T]
    index_scores = (scores * (w * d**-0.5).t().unsqueeze(-1)).sum(0)  # [S, T]
    causal = torch.ones(seqlen, t_len, dtype=torch.bool).tril()
    index_scores = index_scores.masked_fill(~causal, NEG_INF)
    idx = index_scores.topk(min(K, t_len), dim=-1).indices
    index_mask = torch.full((seqlen, t_len), NEG_INF).scatter_(-1, idx, 0.0)
    index_mask = index_mask.masked_fill(~causal, NEG_INF)
    attn = (q.sum(1) @ k.t()) * d**-0.5 + index_mask
    return attn.softmax(-1) @ v


@form("glm5_norelu_signed_unbatched")
def _(seed: int) -> Case:
    g = _gen(seed, 12)
    H, D = 4, 32
    args = (_randn(g, S, H, D), _randn(g, S, D), _randn(g, S, H), _randn(g, S, 16))
    return Case(
        "glm5_norelu_signed_unbatched", _glm_norelu_unbatched, args, 1, 0, k=K,
        notes="GLM-5 no ReLU, no batch: matmul(q.transpose(0,1), k.t()) [H,S,T], "
        "(s * (w*scale).t().unsqueeze(-1)).sum(0), masked_fill(~tril, -inf); consumer full(-inf).scatter_",
        tags=("glm", "no_relu", "signed_weights", "batchless", "mask_fill_inf", "scatter_inf_consumer"),
    )


class _GlmEinsumHeadSum(nn.Module):
    """GLM-5-style indexer (interleaved RoPE), scale BEFORE the ReLU, head sum as an einsum."""

    def __init__(self, n_heads: int = 8, head_dim: int = 16) -> None:
        super().__init__()
        self.h, self.d = n_heads, head_dim
        self.wq_b = nn.Linear(QL, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(HID, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(HID, n_heads, bias=False)
        self.wv = nn.Linear(HID, 16, bias=False)

    def forward(self, x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        cos, sin = _cos_sin(torch.arange(seqlen), 8)
        q = self.wq_b(qr).view(bsz, seqlen, self.h, self.d)
        q = torch.cat([_rope_interleave(q[..., :8], cos, sin), q[..., 8:]], dim=-1)
        k = self.k_norm(self.wk(x))
        k = torch.cat([_rope_interleave(k[:, :, None, :8], cos, sin)[:, :, 0], k[..., 8:]], dim=-1)
        s = F.relu(torch.matmul(q.float(), k.float().transpose(1, 2)[:, None]) * self.d**-0.5)
        w = self.weights_proj(x).float() * self.h**-0.5  # signed
        idx_scores = torch.einsum("bsh,bsht->bst", w, s)
        causal = torch.arange(seqlen)[None, :] <= torch.arange(seqlen)[:, None]
        idx_scores = idx_scores.masked_fill(causal.logical_not(), NEG_INF)
        topk_indices = idx_scores.topk(min(K, seqlen), dim=-1).indices.to(torch.int32)
        drop = torch.ones_like(idx_scores, dtype=torch.bool).scatter(-1, topk_indices.long(), False)
        attn = torch.matmul(q.mean(2), k.transpose(1, 2)).masked_fill(~causal | drop, NEG_INF)
        return torch.matmul(attn.softmax(-1), self.wv(x))


@form("glm5_relu_scale_before_einsum_headsum")
def _(seed: int) -> Case:
    g = _gen(seed, 13)
    m = _build(seed, _GlmEinsumHeadSum)
    return Case(
        "glm5_relu_scale_before_einsum_headsum", m, (_randn(g, B, S, HID), _randn(g, B, S, QL)), 1, 0, k=K,
        notes="GLM-5 (interleaved RoPE), F.relu(matmul * scale) (scale BEFORE relu), signed weights, "
        "head sum as einsum('bsh,bsht->bst'), masked_fill(causal.logical_not(), -inf), topk().indices.int32",
        tags=("glm", "rope", "signed_weights", "einsum_head_sum", "mask_fill_inf", "int32", "bool_scatter_consumer"),
    )


def _glm_scale_after(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Scale AFTER the ReLU spelled as a division, head axis summed with ``sum(-2)``."""
    bsz, seqlen, h, d = q.shape
    s = F.relu(torch.matmul(q, k.unsqueeze(1).transpose(-1, -2))) / math.sqrt(d)  # [B,S,H,T]
    s = (s * w[:, :, :, None]).sum(-2)
    causal = torch.tril(torch.ones(seqlen, seqlen, dtype=torch.bool))
    s = s.masked_fill(~causal, NEG_INF)
    topk_indices = torch.topk(s, min(K, seqlen), dim=-1).indices
    keep = torch.zeros(bsz, seqlen, seqlen, dtype=torch.bool).scatter_(-1, topk_indices, True) & causal
    attn = torch.einsum("bsd,btd->bst", q.sum(2), k).masked_fill(~keep, NEG_INF)
    return torch.einsum("bst,btd->bsd", attn.softmax(-1), v)


@form("glm5_relu_scale_after_div")
def _(seed: int) -> Case:
    g = _gen(seed, 14)
    H, D = 8, 16
    args = (_randn(g, B, S, H, D), _randn(g, B, S, D), _randn(g, B, S, H), _randn(g, B, S, 16))
    return Case(
        "glm5_relu_scale_after_div", _glm_scale_after, args, 1, 0, k=K,
        notes="matmul(q, k.unsqueeze(1).transpose(-1,-2)) without upcast (fp32), F.relu(...) / sqrt(d) "
        "(scale AFTER relu, as a division), w[:, :, :, None], sum(-2), masked_fill(~tril, -inf), "
        "torch.topk(...).indices; consumer zeros(bool).scatter_(idx, True) & causal",
        tags=("glm", "signed_weights", "div_scale", "mask_fill_inf", "bool_scatter_consumer"),
    )


# ============================================================================ more runtime masks / spellings


def _bool_padding(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, key_keep: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
    """Bool key-padding mask as a runtime input, combined with a causal mask."""
    bsz, seqlen, h, d = q.shape
    t_len = k.shape[1]
    causal = torch.ones(seqlen, t_len, dtype=torch.bool).tril()
    mask = causal[None] & key_keep[:, None, :]  # [B, S, T]
    s = torch.einsum("bshd,btd->bsht", q.float(), k.float()).relu()
    s = (s * (w * (d * h) ** -0.5).unsqueeze(-1)).sum(dim=2)
    s = s.masked_fill(~mask, NEG_INF)
    idx = s.topk(min(K, t_len), dim=-1).indices.to(torch.int32)
    index_mask = torch.ones_like(mask).scatter(-1, idx.long(), False)
    allowed = mask & ~index_mask
    attn = torch.einsum("bsd,btd->bst", q.float().mean(2), k.float()) * d**-0.5
    attn = attn.masked_fill(~allowed, NEG_INF)
    return attn.softmax(-1) @ v


@form("bool_padding_mask_input")
def _(seed: int) -> Case:
    g = _gen(seed, 15)
    H, D = 8, 16
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, -5:] = False  # right padding in batch 1
    keep[0, 10:13] = False  # a hole (e.g. packed-document boundary)
    args = (_randn(g, B, S, H, D, dtype=torch.bfloat16), _randn(g, B, S, D, dtype=torch.bfloat16),
            _randn(g, B, S, H).abs(), keep, _randn(g, B, S, 16))
    return Case(
        "bool_padding_mask_input", _bool_padding, args, 1, 0, k=K,
        notes="runtime bool key-padding mask [B,T] & tril, masked_fill(~mask, -inf), bf16 upcast einsum; "
        "consumer bool scatter",
        tags=("runtime_mask", "bool_mask", "padding", "bf16", "upcast", "mask_fill_inf", "int32",
              "bool_scatter_consumer"),
    )


def _bmm_folded(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Heads folded into the rows of a ``bmm``; ReLU spelled ``clamp(min=0)``; keyword topk."""
    bsz, seqlen, h, d = q.shape
    t_len = k.shape[1]
    s = torch.bmm(q.reshape(bsz, seqlen * h, d), k.transpose(1, 2)).view(bsz, seqlen, h, t_len)
    s = s.clamp(min=0) / math.sqrt(d)
    s = (s * w[:, :, :, None]).sum(2)
    future = torch.ones(seqlen, t_len, dtype=torch.bool).triu(1)
    s = s.masked_fill(future, NEG_INF)
    top = torch.topk(s, k=K, dim=-1, largest=True, sorted=True)
    idx = top.indices
    k_sel = torch.gather(k.unsqueeze(1).expand(-1, seqlen, -1, -1), 2, idx[..., None].expand(-1, -1, -1, d))
    v_sel = torch.gather(v.unsqueeze(1).expand(-1, seqlen, -1, -1), 2,
                         idx[..., None].expand(-1, -1, -1, v.shape[-1]))
    ok = idx <= torch.arange(seqlen)[:, None]
    att = torch.einsum("bsd,bskd->bsk", q.mean(2), k_sel).masked_fill(~ok, NEG_INF)
    return torch.einsum("bsk,bskd->bsd", att.softmax(-1), v_sel)


@form("bmm_heads_folded_clamp")
def _(seed: int) -> Case:
    g = _gen(seed, 16)
    H, D = 8, 16
    args = (_randn(g, B, S, H, D), _randn(g, B, S, D), _randn(g, B, S, H).abs(), _randn(g, B, S, 16))
    return Case(
        "bmm_heads_folded_clamp", _bmm_folded, args, 1, 0, k=K,
        notes="bmm(q.reshape(B, S*H, D), k.transpose(1,2)).view(B,S,H,T), clamp(min=0) as ReLU, / sqrt(d), "
        "w[:, :, :, None], sum(2), masked_fill(triu(1), -inf), torch.topk(s, k=, dim=-1, largest=True, sorted=True); "
        "consumer torch.gather of expanded K/V",
        tags=("bmm", "clamp_relu", "div_scale", "mask_fill_inf", "sorted_true", "gather_consumer"),
    )


def _bf16_logits(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The contraction itself in bf16 (no upcast): per-head logits are rounded to bf16 before the
    epilogue, which then runs in fp32."""
    bsz, seqlen, h, d = q.shape
    s = torch.einsum("bshd,btd->bsht", q, k)  # bf16 output
    s = s.relu().float() * w.unsqueeze(-1)
    s = s.sum(dim=2)
    s = s + torch.full((seqlen, seqlen), NEG_INF).triu(1)
    idx = s.topk(min(K, seqlen), dim=-1, sorted=False).indices
    m = torch.full_like(s, NEG_INF).scatter(-1, idx, 0.0) + torch.full((seqlen, seqlen), NEG_INF).triu(1)
    attn = torch.einsum("bsd,btd->bst", q.float().mean(2), k.float()) + m
    return attn.softmax(-1) @ v


@form("bf16_contraction_no_upcast")
def _(seed: int) -> Case:
    g = _gen(seed, 17)
    H, D = 8, 16
    args = (_randn(g, B, S, H, D, dtype=torch.bfloat16), _randn(g, B, S, D, dtype=torch.bfloat16),
            _randn(g, B, S, H).abs() * H**-0.5, _randn(g, B, S, 16))
    return Case(
        "bf16_contraction_no_upcast", _bf16_logits, args, 1, 0, k=K,
        notes="einsum in bf16 (logits rounded to bf16), relu, .float() * w (fp32), sum, + triu(-inf), "
        "topk(sorted=False).indices; consumer full_like(-inf).scatter(0) + mask",
        tags=("bf16", "bf16_logits", "additive_inf", "sorted_false", "scatter_inf_consumer"),
    )


class _IndexCacheShared(nn.Module):
    """GLM-5 IndexCache: one indexer's indices feed two attention layers ("full" then "shared")."""

    def __init__(self) -> None:
        super().__init__()
        self.layer0 = _HFV32Layer(bool_mask=False, n_heads=8, head_dim=16, interleaved_rope=True)
        self.proj = nn.Linear(HID, HID)
        self.q_a1 = nn.Linear(HID, QL, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        l0 = self.layer0
        q_resid = l0.q_a_layernorm(l0.q_a_proj(x))
        mask4 = l0.causal_mask4(x)
        prev_topk_indices = l0.select(x, q_resid, mask4[:, 0])
        h = x + self.proj(l0.attend(x, q_resid, mask4, prev_topk_indices).repeat(1, 1, HID // 64))
        return l0.attend(h, self.q_a1(h), mask4, prev_topk_indices)  # shared layer: no indexer


@form("glm5_indexcache_shared_two_layers")
def _(seed: int) -> Case:
    g = _gen(seed, 18)
    m = _build(seed, _IndexCacheShared)
    return Case(
        "glm5_indexcache_shared_two_layers", m, (_randn(g, B, S, HID),), 1, 0, k=K,
        notes="GLM-5 IndexCache: one selection (HF form, interleaved RoPE) whose int32 indices feed two "
        "layers' bool-scatter masks (prev_topk_indices reuse)",
        tags=("glm", "hf", "rope", "index_reuse", "additive_finite", "int32", "bool_scatter_consumer"),
    )


class _SharedHeadWeights(nn.Module):
    """Per-head weights as one learned vector [H] shared by every token (no weights
    projection): ``relu(q k) * head_w[:, None]`` broadcasts it over batch and queries."""

    def __init__(self, n_heads: int = 4, head_dim: int = 16) -> None:
        super().__init__()
        self.h, self.d = n_heads, head_dim
        self.wq = nn.Linear(HID, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(HID, head_dim, bias=False)
        self.head_w = nn.Parameter(torch.rand(n_heads) + 0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seqlen = x.shape[1]
        q = self.wq(x).unflatten(-1, (self.h, self.d))
        k = self.wk(x)
        s = torch.einsum("bshd,btd->bsht", q, k).relu()
        s = (s * self.head_w[:, None]).sum(dim=2)
        causal = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
        s = s.masked_fill(~causal, NEG_INF)
        idx = s.topk(K, dim=-1).indices
        keep = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, idx, True) & causal
        attn = torch.einsum("bsd,btd->bst", q.mean(2), k).masked_fill(~keep, NEG_INF)
        return torch.einsum("bst,btd->bsd", attn.softmax(-1), k)


@form("shared_head_weights_param")
def _(seed: int) -> Case:
    g = _gen(seed, 26)
    m = _build(seed, _SharedHeadWeights)
    return Case(
        "shared_head_weights_param", m, (_randn(g, B, S, HID),), 1, 0, k=K,
        notes="learned per-head weights nn.Parameter [H] broadcast over batch and queries (s * w[:, None]), "
        "sum(dim=2), masked_fill(~tril, -inf), topk().indices; consumer zeros(bool).scatter_(idx, True) & causal",
        tags=("broadcast_weights", "param_weights", "mask_fill_inf", "bool_scatter_consumer"),
    )


# ============================================================================ non-selections


class _SigmoidRouter(nn.Module):
    """DeepSeek-V3-style router: ``F.linear(x, W)`` (W a Parameter) -> sigmoid -> + bias -> topk."""

    def __init__(self, dim: int = HID, n_experts: int = 16, top_k: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_experts, dim) * dim**-0.5)
        self.e_score_correction_bias = nn.Buffer(torch.randn(n_experts) * 0.01)
        self.experts = nn.Parameter(torch.randn(n_experts, dim, dim) * dim**-0.5)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scores = F.linear(flat, self.weight).sigmoid()
        idx = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False)[1]
        wts = scores.gather(1, idx)
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        expert_out = torch.einsum("nd,nkde->nke", flat, self.experts[idx])
        return (expert_out * wts.unsqueeze(-1)).sum(1).view_as(x)


@form("moe_router_sigmoid")
def _(seed: int) -> Case:
    g = _gen(seed, 19)
    m = _build(seed, _SigmoidRouter)
    return Case(
        "moe_router_sigmoid", m, (_randn(g, B, S, HID),), 0, 1,
        notes="MoE router: F.linear(x, W Parameter).sigmoid() + bias buffer -> torch.topk(sorted=False)[1] -> "
        "gather weights; NOT a selection (key side is a parameter, top-k axis indexes experts)",
        tags=("router", "non_selection"),
    )


class _SoftmaxRouter(nn.Module):
    """Mixtral-style router: ``gate(x)`` -> softmax(float) -> topk values+indices -> renormalise."""

    def __init__(self, dim: int = HID, n_experts: int = 8, top_k: int = 2) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, 32) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, 32, dim) * 32**-0.5)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.view(-1, x.shape[-1])
        router_logits = self.gate(h)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        hidden = F.silu(torch.einsum("nd,nkdf->nkf", h, self.w1[selected_experts]))
        out = torch.einsum("nkf,nkfd->nkd", hidden, self.w2[selected_experts])
        return (out * routing_weights[..., None]).sum(1).view_as(x)


@form("moe_router_softmax")
def _(seed: int) -> Case:
    g = _gen(seed, 20)
    m = _build(seed, _SoftmaxRouter)
    return Case(
        "moe_router_softmax", m, (_randn(g, B, S, HID),), 0, 1,
        notes="Mixtral-style router: nn.Linear gate -> softmax(dim=1, float) -> torch.topk values AND indices",
        tags=("router", "non_selection", "values_used"),
    )


class _Sampler(nn.Module):
    """Top-k sampling head: ``lm_head(x)`` logits of the last position -> topk -> softmax."""

    def __init__(self, dim: int = HID, vocab: int = 128) -> None:
        super().__init__()
        self.norm = _RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lm_head(self.norm(x))[:, -1, :] / 0.7
        vals, idx = logits.topk(K, dim=-1)
        return torch.softmax(vals, dim=-1), idx


@form("sampler_lm_head_topk")
def _(seed: int) -> Case:
    g = _gen(seed, 21)
    m = _build(seed, _Sampler)
    return Case(
        "sampler_lm_head_topk", m, (_randn(g, B, S, HID),), 0, 1,
        notes="sampler: lm_head(x)[:, -1] / T -> .topk(k) values and indices over the vocabulary",
        tags=("sampler", "non_selection", "values_used"),
    )


def _plain_topk(scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """topk over a plain input tensor shaped like index scores (no contraction in the graph)."""
    idx = torch.topk(scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), NEG_INF), K, dim=-1)[1]
    sel = torch.gather(v.unsqueeze(1).expand(-1, S, -1, -1), 2, idx.unsqueeze(-1).expand(-1, -1, -1, v.shape[-1]))
    ok = idx <= torch.arange(S)[:, None]
    return (sel * ok.unsqueeze(-1)).sum(2)


@form("topk_plain_input")
def _(seed: int) -> Case:
    g = _gen(seed, 22)
    return Case(
        "topk_plain_input", _plain_topk, (_randn(g, B, S, S), _randn(g, B, S, 16)), 0, 1,
        notes="topk over an input tensor [B,S,T] (masked causally): no contraction, never a selection",
        tags=("plain", "non_selection"),
    )


class _ProductKeyMemory(nn.Module):
    """Indexer-shaped score whose KEY side is a parameter (a codebook / memory-layer lookup)."""

    def __init__(self, n_heads: int = 8, d: int = 16, n_keys: int = 48) -> None:
        super().__init__()
        self.h, self.d = n_heads, d
        self.wq = nn.Linear(HID, n_heads * d, bias=False)
        self.keys = nn.Parameter(torch.randn(n_keys, d))
        self.values = nn.Parameter(torch.randn(n_keys, HID) * 0.1)
        self.wproj = nn.Linear(HID, n_heads, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.wq(x).unflatten(-1, (self.h, self.d))
        s = torch.einsum("bshd,nd->bshn", q, self.keys).relu()
        s = (s * self.wproj(x).unsqueeze(-1)).sum(dim=2)
        vals, idx = s.topk(K, dim=-1)
        return (F.softmax(vals, dim=-1).unsqueeze(-1) * self.values[idx]).sum(2)


@form("codebook_param_keys")
def _(seed: int) -> Case:
    g = _gen(seed, 23)
    m = _build(seed, _ProductKeyMemory)
    return Case(
        "codebook_param_keys", m, (_randn(g, B, S, HID),), 0, 1,
        notes="looks like an indexer (einsum, relu, weighted head sum, topk) but the key side is an "
        "nn.Parameter (memory-layer codebook): NOT a selection",
        tags=("param_keys", "non_selection", "values_used"),
    )


class _IndexerPlusMoE(nn.Module):
    """One DSA layer (HF V3.2 indexer + sparse attention) followed by a sigmoid MoE router."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _HFV32NoGrad(bool_mask=False, n_heads=8, head_dim=16)
        self.o_proj = nn.Linear(64, HID, bias=False)
        self.moe = _SigmoidRouter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.o_proj(self.attn(x))
        return h + self.moe(h)


@form("indexer_plus_moe_router")
def _(seed: int) -> Case:
    g = _gen(seed, 24)
    m = _build(seed, _IndexerPlusMoE)
    return Case(
        "indexer_plus_moe_router", m, (_randn(g, B, S, HID),), 1, 1, k=K,
        notes="decoder block: HF V3.2 indexer under no_grad (selection) + sigmoid MoE router (not a selection)",
        tags=("hf", "no_grad", "rope", "router", "mixed", "bool_scatter_consumer"),
    )


# ============================================================================ ties


def _ties(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1))  # exact: small ints
    s = F.relu(s)
    s = torch.matmul(w.float().unsqueeze(-2), s).squeeze(-2)  # powers of two: exact
    seqlen = s.shape[-1]
    s = s.masked_fill(torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1), NEG_INF)
    idx = s.topk(K, dim=-1).indices
    m = torch.full_like(s, NEG_INF).scatter_(-1, idx, 0.0)
    return idx, m.masked_fill(torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1), NEG_INF)


@form("ties_small_int_bf16")
def _(seed: int) -> Case:
    g = _gen(seed, 25)
    H, D = 4, 16
    q = torch.randint(-2, 3, (B, S, H, D), generator=g).to(torch.bfloat16)
    k = torch.randint(-1, 2, (B, S, D), generator=g).to(torch.bfloat16)
    w = (2.0 ** torch.randint(-2, 2, (B, S, H), generator=g)).to(torch.bfloat16)
    return Case(
        "ties_small_int_bf16", _ties, (q, k, w), 1, 0, k=K, unique=False,
        notes="small-integer bf16 q/k, power-of-two weights: exact scores, exact-zero ReLU ties and equal "
        "positive scores are common; compare idx against a stable (value desc, index asc) reference. "
        "Returns (idx, additive index mask)",
        tags=("ties", "bf16", "upcast", "matmul_head_sum", "mask_fill_inf"),
    )


# ============================================================================ self-check


def make_all(seed: int = 0) -> list[Case]:
    return [make(seed) for make in FORMS.values()]


def hadamard(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal [n, n] Sylvester-Hadamard matrix (n a power of two), built from ``ones`` and
    ``cat``: what DeepSeek's and Megatron's indexers rotate q and k by (``rotate_activation``:
    ``hadamard_transform(x, scale=n**-0.5)`` equals ``x @ hadamard(n)``)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: n={n} is not a power of two")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h * n**-0.5


def topk_inputs(case: Case) -> list[tuple[torch.Tensor, int, int]]:
    """Run ``case`` in eager and record (scores, k, dim) of every topk call."""
    from torch.overrides import TorchFunctionMode

    seen: list[tuple[torch.Tensor, int, int]] = []

    class _Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if getattr(func, "__name__", "") == "topk":
                x = kwargs.get("input", args[0] if args else None)
                kk = kwargs.get("k", args[1] if len(args) > 1 else None)
                dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
                seen.append((x.detach().clone(), int(kk), int(dim)))
            return func(*args, **kwargs)

    with _Spy():
        case.fn(*case.args)
    return seen


def boundary_ties(scores: torch.Tensor, k: int, dim: int = -1) -> int:
    """Rows with more than k valid entries whose k-th and (k+1)-th largest are equal (valid means
    finite and above finfo.min/2, i.e. not masked)."""
    s = scores.float().movedim(dim, -1)
    srt = s.sort(dim=-1, descending=True).values
    valid = torch.isfinite(srt) & (srt > torch.finfo(torch.float32).min / 2)
    rows = valid.sum(-1) > k
    if srt.shape[-1] <= k:
        return 0
    return int(((srt[..., k - 1] == srt[..., k]) & rows).sum())


def _fmt(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)}:{str(x.dtype).replace('torch.', '')}"
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(_fmt(y) for y in x) + ")"
    return type(x).__name__


if __name__ == "__main__":
    import sys

    seeds = [int(a) for a in sys.argv[1:]] or [0]
    bad = 0
    for seed in seeds:
        for make in FORMS.values():
            case = make(seed)
            with torch.no_grad():
                out = case.fn(*case.args)
            outs = out if isinstance(out, tuple) else (out,)
            finite = not any(bool(torch.isnan(o).any()) for o in outs if o.is_floating_point())
            recs = topk_inputs(case)
            ties = [boundary_ties(x, kk, d) for x, kk, d in recs]
            n_topk = len(recs)
            ok = n_topk == case.num_selections + case.num_other_topk and finite
            ok = ok and (not case.unique or sum(ties) == 0)
            bad += not ok
            print(f"[seed {seed}->{case.seed}] {'ok ' if ok else 'BAD'} {case.name:40s} args={_fmt(case.args)} -> {_fmt(out)} "
                  f"sel={case.num_selections} other={case.num_other_topk} topk_calls={n_topk} "
                  f"boundary_ties={ties} unique={case.unique} no_nan={finite}")
    print(f"{len(FORMS)} forms, {bad} problems")
    sys.exit(1 if bad else 0)
