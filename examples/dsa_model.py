"""A small, readable DeepSeek-Sparse-Attention (DSA) language model in plain PyTorch.

Nothing here imports ``hyscale_compile``: this is the kind of *unmodified* model code the backend
is meant to find selections in (``torch.compile(model, backend="hyscale")``). The pieces follow the
Hugging Face ``DeepseekV32`` port (transformers 5.24, ``modeling_deepseek_v32.py``), simplified:

* ``LightningIndexer``: ``DeepseekV32Indexer`` -- queries from the low-rank query latent
  (``wq_b(q_resid)``), ONE shared key head with LayerNorm (``k_norm(wk(x))``), per-head weights
  ``weights_proj(x) * H^-0.5``, ``relu(q.k * D^-0.5)``, head-weighted sum, causal mask, and
  ``topk(min(k, T)).indices``. RoPE and the Hadamard/fp8 path of the official code are left out.
* ``SparseAttention``: the HF eager path of ``DeepseekV32Attention`` -- the indices become a bool
  mask (``ones(bool).scatter(-1, idx, False)``) that is ``masked_fill``-ed with ``finfo.min`` into
  the additive causal mask before a dense softmax (plain multi-head attention instead of MLA).
* ``Block``: pre-norm residual block (RMSNorm -> sparse attention, RMSNorm -> SwiGLU MLP).
* ``DSALanguageModel``: token + learned absolute position embeddings (the positions keep repeated
  tokens' layer-0 keys distinct, so index scores rarely tie), blocks, final norm, ``lm_head``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class DSAConfig:
    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    index_heads: int = 16
    index_head_dim: int = 16
    index_topk: int = 8
    max_seq: int = 128
    q_lora_rank: int = 32
    mlp_hidden: int = 128


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, as ``DeepseekV32RMSNorm``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """Additive ``[S, S]`` mask: 0 where key <= query, ``finfo(float32).min`` elsewhere (HF eager)."""
    pos = torch.arange(seq_len, device=device)
    return torch.where(pos[None, :] <= pos[:, None], 0.0, torch.finfo(torch.float32).min)


class LightningIndexer(nn.Module):
    """DSA lightning indexer: ``I[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] / sqrt(D))``."""

    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_heads * cfg.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.dim, cfg.index_heads, bias=False)
        self.softmax_scale = cfg.index_head_dim**-0.5

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Return the ``int32`` top-k key indices ``[B, S, k]`` for each query."""
        b, s, _ = x.shape
        q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)  # [B, S, H, D]
        k = self.k_norm(self.wk(x))  # [B, T, D], one key head shared by all indexer heads
        scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale
        scores = F.relu(scores)  # [B, S, H, T]
        weights = self.weights_proj(x).float() * self.n_heads**-0.5  # [B, S, H]
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, S, T]
        index_scores = index_scores + mask
        return index_scores.topk(min(self.topk, index_scores.shape[-1]), dim=-1).indices.to(torch.int32)

    def projections(self, x: torch.Tensor, q_resid: torch.Tensor):
        """``forward``'s projections with grad, in fp32: ``q [B, S, H, D]``, ``k [B, T, D]`` and the
        head weights ``w [B, S, H]``. A training loop that trains the indexer (DeepSeek-V3.2's KL
        loss) computes its index scores from these."""
        b, s, _ = x.shape
        q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim).float()
        k = self.k_norm(self.wk(x)).float()
        return q, k, self.weights_proj(x).float() * self.n_heads**-0.5


class SparseAttention(nn.Module):
    """Multi-head attention restricted to the indexer's keys (HF eager mask form)."""

    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.dim // cfg.heads
        self.q_a_proj = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)  # low-rank query latent
        self.q_a_norm = RMSNorm(cfg.q_lora_rank)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.dim, bias=False)
        self.kv_proj = nn.Linear(cfg.dim, 2 * cfg.dim, bias=False)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.indexer = LightningIndexer(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, dense: bool = False, return_aux: bool = False):
        """``dense``: attend to every causal key (the dense model DSA starts from; the indexer is not
        run). ``return_aux``: also return what the indexer's training loss needs, the tuple
        ``(q [B, heads, S, d], k [B, heads, T, d], x, q_resid)`` plus, unless dense, the selection."""
        b, s, d = x.shape
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(x).view(b, s, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if dense:
            attn_mask, aux = mask, (q, k, x, q_resid)
        else:
            topk_indices = self.indexer(x, q_resid, mask)  # [B, S, k]
            # True = key not selected; masked with finfo.min on top of the causal mask.
            index_mask = torch.ones(b, s, s, dtype=torch.bool, device=x.device).scatter(-1, topk_indices.long(), False)
            attn_mask = mask.expand(b, s, s).masked_fill(index_mask, torch.finfo(x.dtype).min).unsqueeze(1)
            aux = (q, k, x, q_resid, topk_indices)
        attn = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5 + attn_mask
        attn = F.softmax(attn, dim=-1, dtype=torch.float32).to(q.dtype)
        out = self.o_proj(torch.matmul(attn, v).transpose(1, 2).reshape(b, s, d))
        return (out, aux) if return_aux else out


class MLP(nn.Module):
    """SwiGLU feed-forward, as ``DeepseekV32MLP``."""

    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim), SparseAttention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.dim), MLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, **attn_kwargs):
        """``attn_kwargs``: ``SparseAttention``'s ``dense`` / ``return_aux`` (then ``(x, aux)``)."""
        a = self.attn(self.attn_norm(x), mask, **attn_kwargs)
        a, aux = a if attn_kwargs.get("return_aux") else (a, None)
        x = x + a
        x = x + self.mlp(self.mlp_norm(x))
        return (x, aux) if attn_kwargs.get("return_aux") else x


class DSALanguageModel(nn.Module):
    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_embed = nn.Embedding(cfg.max_seq, cfg.dim)  # learned absolute positions (no RoPE here)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, dense: bool = False, return_aux: bool = False):
        """``input_ids [B, S]`` -> logits ``[B, S, vocab]``; with ``return_aux``, ``(logits, [aux of
        each layer])`` (see ``SparseAttention.forward``); ``dense``: dense attention in every layer."""
        if input_ids.shape[1] > self.cfg.max_seq:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds max_seq={self.cfg.max_seq}")
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.embed(input_ids) + self.pos_embed(pos)
        mask = causal_mask(input_ids.shape[1], input_ids.device)
        # only the flags that are on: an attention whose forward takes just (x, mask) keeps working
        kw = {k: True for k, on in (("dense", dense), ("return_aux", return_aux)) if on}
        auxes = []
        for block in self.blocks:
            h = block(h, mask, **kw)
            if return_aux:
                h, aux = h
                auxes.append(aux)
        logits = self.lm_head(self.norm(h))
        return (logits, auxes) if return_aux else logits


def make_model(config: DSAConfig | None = None) -> DSALanguageModel:
    """Build a randomly initialised model (use ``torch.manual_seed`` first for reproducibility)."""
    return DSALanguageModel(config or DSAConfig())


if __name__ == "__main__":
    torch.manual_seed(0)
    cfg = DSAConfig()
    model = make_model(cfg).eval()
    ids = torch.randint(0, cfg.vocab, (2, 32))
    logits = model(ids)
    print(f"logits {tuple(logits.shape)}; {sum(p.numel() for p in model.parameters())} parameters")
