"""Megatron-Core's DSA indexer (megatron-core==0.16.1, ``megatron/core/transformer/
experimental_attention_variant/dsa.py``) on the CPU, at a tiny bf16 configuration.

``DSAttention`` and its ``DSAIndexer`` are built from their module specs (``ModuleSpec`` /
``build_module``, as ``get_dsa_module_spec_for_backend`` writes them) with CPU stand-ins where
the spec names Transformer Engine: ``Linear`` takes ``TELinear``'s arguments (the indexer asks for
``parallel_mode="duplicated"``, no bias) and ``k_norm`` is Megatron's ``WrappedTorchNorm``.
Megatron needs its parallel state: ``parallel_state_1x1()`` makes a gloo process group of world
size 1 and calls ``initialize_model_parallel(1, 1)``. Its RoPE asks for
``torch.cuda.current_device()`` at init and at the first forward even with
``use_cpu_initialization``; ``cpu_current_device()`` answers ``"cpu"``.

The indexer (``forward_with_scores``)::

    q = rope(linear_wq_b(qr).reshape(S, B, H, D)); k = rope(k_norm(linear_wk(x)))  # [S, B, D]
    q, k = rotate_activation(q), rotate_activation(k)   # hadamard_transform(x, scale=D**-0.5)
    weights = linear_weights_proj(x) * H**-0.5 * D**-0.5
    s = relu(einsum('sbhd,tbd->sbht', q.float(), k.float())) * weights[..., None]
    s = s.sum(2).transpose(0, 1) + mask            # [B, S, T]; DSAttention: triu(-inf, 1)
    return s, s.topk(min(index_topk, S), dim=-1)[1]

``rotate_activation`` calls ``fast_hadamard_transform.hadamard_transform`` (a CUDA extension, a
graph break under Dynamo). ``ROTATIONS`` stands in for it: ``"matmul"`` (a plain traced matmul by
the +-1 Sylvester matrix built in the graph), ``"matmul_global"`` (by a module-level matrix:
Dynamo makes it a graph input), ``"custom_op"`` (an opaque ``torch.library`` op) and
``"graph_break"`` (the matmul behind ``torch._dynamo.graph_break()``). Patch it in with
``use_rotation(name)`` (a context manager) and call ``build``.

The attention (``unfused_dsa_fn``, the per-head form ``DSAttention`` runs in 0.16.1; this version
has no absorbed variant)::

    scores = bmm(q.float(), k.float()) * softmax_scale             # [b, np, sq, skv]
    index_mask = full((b, sq, skv), -inf).scatter_(-1, topk, 0) + triu(full(-inf), 1)
    p = softmax(scores + index_mask.unsqueeze(1), dim=-1, dtype=float32)
    out = bmm(p.to(v.dtype), v) -> [sq, b, np * hnv]

``forced_indices(att, idx)`` makes the indexer return given indices (a reference at another
run's selection); ``attention_reference`` is that attention in float64.

Without the module (fp32, ``site_inputs``): ``dsa_site`` is a causal top-k over ``qi @ ki^T``
and ``unfused_dsa_fn`` over it (or ``unfused_dsa_fn_with_index_bias``, whose index mask gets a
gradient); ``absorbed_site`` the same with ``absorbed_dsa_fn``, MQA over one latent head
masked as ``unfused_dsa_fn`` masks (the in-place add on a view of the scores).

Megatron-Core's own absorbed form (``_unfused_absorbed_dsa_fn`` of newer Megatron-LM, source
commit and path at ``megatron_absorbed_dsa_fn``), op for op: the index mask scattered in row
chunks (``scatter_reduce_(amax)`` of ``where(idx >= 0, 0, -inf)`` at ``clamp_min(idx, 0)`` into
slices of one ``full(-inf)``), the causal row mask added (or, on DSAttention's plain causal path,
``masked_fill`` by varlen bounds), ``masked_softmax`` over ``isfinite(index_mask)``, the value
the latent's first ``v_channels``; ``megatron_absorbed_site`` puts a selection before it and the
value up-projection after it, ``absorbed_reference`` is it in float64.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Callable, Dict

import torch

S_HIDDEN, Q_LORA, H, D, TOPK, POS = 64, 32, 16, 32, 8, 8
HEADS, QK_DIM, V_DIM = 4, 16, 16  # the attention DSAttention's output is computed with


def megatron_available() -> bool:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False
    return True


def _sylvester(n: int, dtype: torch.dtype) -> torch.Tensor:
    """The unnormalized +-1 Hadamard matrix (``fast_hadamard_transform`` multiplies by ``scale``)."""
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


_GLOBAL_H = {torch.bfloat16: _sylvester(D, torch.bfloat16), torch.float32: _sylvester(D, torch.float32)}


def _matmul(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x @ _sylvester(x.shape[-1], x.dtype)) * scale


def _matmul_global(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x @ _GLOBAL_H[x.dtype]) * scale


@torch.library.custom_op("hyscale_tests::hadamard_transform", mutates_args=())
def _hadamard_op(x: torch.Tensor, scale: float) -> torch.Tensor:
    return _matmul(x, scale)


@_hadamard_op.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _custom_op(x: torch.Tensor, scale: float) -> torch.Tensor:
    return _hadamard_op(x, scale)


def _graph_break(x: torch.Tensor, scale: float) -> torch.Tensor:
    torch._dynamo.graph_break()
    return _matmul(x, scale)


ROTATIONS: Dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "matmul": _matmul, "matmul_global": _matmul_global, "custom_op": _custom_op, "graph_break": _graph_break,
}


@contextlib.contextmanager
def use_rotation(name: str):
    """Make ``dsa.hadamard_transform`` (None without the CUDA extension) the ``name`` rotation."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    old = dsa.hadamard_transform
    dsa.hadamard_transform = ROTATIONS[name]
    try:
        yield
    finally:
        dsa.hadamard_transform = old


@contextlib.contextmanager
def cpu_current_device():
    old = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = old


@contextlib.contextmanager
def traceable_rope():
    """Inside: ``RotaryEmbedding.get_emb`` without its move of ``inv_freq`` to
    ``torch.cuda.current_device()``, which it makes on every call while ``inv_freq`` is on the
    CPU (a no-op here). Under Dynamo the stand-in's answer ``"cpu"`` is a torch.* call that
    returns a non-tensor, a graph break that puts the indexer's selection and the attention
    that applies it in different graphs (the attention then gets the indices as an input)."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rpe

    old = rpe.RotaryEmbedding.get_emb

    def get_emb(self, max_seq_len: int, offset: int = 0):
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]

    rpe.RotaryEmbedding.get_emb = get_emb
    try:
        yield
    finally:
        rpe.RotaryEmbedding.get_emb = old


@contextlib.contextmanager
def parallel_state_1x1():
    """A gloo process group of world size 1 and Megatron's model-parallel state (1, 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    own = not dist.is_initialized()
    path = None
    if own:
        fd, path = tempfile.mkstemp(prefix="hyscale_gloo_")
        os.close(fd)
        os.unlink(path)  # the file store creates it
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if own:
            dist.destroy_process_group()
            if path and os.path.exists(path):
                os.unlink(path)


class Linear(torch.nn.Module):
    """A CPU stand-in for ``TELinear`` in the indexer's spec (``parallel_mode="duplicated"``: no
    tensor parallelism); returns ``(output, bias)`` as Megatron's linear layers do."""

    def __init__(self, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                 skip_weight_param_allocation, parallel_mode, **_):
        super().__init__()
        if parallel_mode != "duplicated" or bias or skip_weight_param_allocation:
            raise ValueError(f"Linear stand-in: parallel_mode={parallel_mode!r}, bias={bias} not supported")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        init_method(self.weight)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None


def build(seed: int, B: int = 1, S: int = 32):
    """``(attention, args)``: a ``DSAttention`` in eval mode and the positional arguments of its
    forward (query, key, value, attention_mask=None, x, qr); call it with
    ``attn_mask_type=AttnMaskType.causal``. Needs ``parallel_state_1x1()`` and
    ``cpu_current_device()``."""
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    torch.manual_seed(seed)  # Megatron initializes parameters from the global generator
    cfg = MLATransformerConfig(
        num_layers=1, hidden_size=S_HIDDEN, num_attention_heads=HEADS, q_lora_rank=Q_LORA, kv_lora_rank=32,
        qk_head_dim=QK_DIM, qk_pos_emb_head_dim=POS, v_head_dim=V_DIM, dsa_indexer_n_heads=H,
        dsa_indexer_head_dim=D, dsa_indexer_topk=TOPK, rope_type="rope", normalization="RMSNorm", bf16=True,
        params_dtype=torch.bfloat16, init_method_std=0.2, use_cpu_initialization=True,
    )
    spec = ModuleSpec(module=dsa.DSAttention, submodules=dsa.DSAttentionSubmodules(indexer=ModuleSpec(
        module=dsa.DSAIndexer, submodules=dsa.DSAIndexerSubmodules(
            linear_wq_b=Linear, linear_wk=Linear, k_norm=WrappedTorchNorm, linear_weights_proj=Linear))))
    att = build_module(spec, config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                       attention_type="self").eval()
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    query = torch.randn(S, B, HEADS, QK_DIM + POS, generator=g).to(bf)
    key = torch.randn(S, B, HEADS, QK_DIM + POS, generator=g).to(bf)
    value = torch.randn(S, B, HEADS, V_DIM, generator=g).to(bf)
    x = torch.randn(S, B, S_HIDDEN, generator=g).to(bf)
    qr = torch.randn(S, B, Q_LORA, generator=g).to(bf)
    return att, (query, key, value, None, x, qr)


def causal_mask(S: int) -> torch.Tensor:
    """The fp32 mask ``DSAttention`` gives its indexer under ``AttnMaskType.causal``."""
    return torch.triu(torch.full((S, S), float("-inf")), diagonal=1)


def index_inputs(indexer, x, qr, mask):
    """Run ``indexer.forward_with_scores`` in eager; returns ``(scores, topk, q, weights, k)``
    with the (rotated) q, the scaled weights and k its ``_compute_index_scores`` received."""
    seen = []
    inner = indexer._compute_index_scores

    def spy(q, weights, k):
        seen.append((q, weights, k))
        return inner(q, weights, k)

    indexer._compute_index_scores = spy
    try:
        scores, topk = indexer.forward_with_scores(x, qr, mask=mask)
    finally:
        del indexer._compute_index_scores
    (q, w, k), = seen
    return scores, topk, q, w, k


@contextlib.contextmanager
def forced_indices(att, idx: torch.Tensor):
    """Inside: ``att.indexer.forward_with_scores`` returns ``(None, idx)`` (``DSAttention``
    reads the scores only for its training loss)."""
    att.indexer.forward_with_scores = lambda *a, **k: (None, idx.long())
    try:
        yield
    finally:
        del att.indexer.forward_with_scores


def attention_reference(query, key, value, idx, softmax_scale):
    """``unfused_dsa_fn`` in float64 (it casts to fp32 itself): the causal attention of each
    query over its selected keys ``idx`` [b, sq, k]; returns [sq, b, np * hnv]."""
    sq, b, nh, _ = query.shape
    skv = key.shape[0]
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, d]
    scores = q @ k.transpose(-1, -2) * softmax_scale
    keep = torch.zeros(b, sq, skv, dtype=torch.bool).scatter(-1, idx.long(), True)
    keep &= torch.ones(sq, skv, dtype=torch.bool).tril()
    p = scores.masked_fill(~keep.unsqueeze(1), float("-inf")).softmax(-1)
    return (p @ v).permute(2, 0, 1, 3).reshape(sq, b, -1)


def unfused_dsa_fn_with_index_bias(query, key, value, topk_indices, softmax_scale, bias):
    """``unfused_dsa_fn`` with a learned [b, sq, skv] ``bias`` added into the index mask (a
    mask that gets a gradient), otherwise line for line the same (the in-place adds on views)."""
    sq, b, np, hn = query.size()
    skv = key.size(0)
    hnv = value.size(3)
    query = query.permute(1, 2, 0, 3).reshape(b * np, sq, hn)
    key = key.permute(1, 2, 3, 0).reshape(b * np, hn, skv)
    attention_scores = torch.bmm(query.float(), key.float()) * softmax_scale
    attention_scores = attention_scores.reshape(b, np, sq, skv)
    index_mask = torch.full((b, sq, skv), float("-inf"), device=attention_scores.device)
    index_mask.scatter_(-1, topk_indices, 0)
    causal_mask = torch.triu(torch.full((sq, skv), float("-inf"), dtype=torch.float32, device=index_mask.device),
                             diagonal=1)
    index_mask += causal_mask.view(1, sq, skv)
    index_mask = index_mask + bias
    attention_scores += index_mask.unsqueeze(1)
    attention_scores = torch.nn.functional.softmax(attention_scores, dim=-1, dtype=torch.float32)
    value = value.permute(1, 2, 0, 3).reshape(b * np, skv, hnv)
    attention_scores = attention_scores.reshape(b * np, sq, skv)
    output = torch.bmm(attention_scores.to(value.dtype), value)
    output = output.reshape(b, np, sq, hnv).permute(2, 0, 1, 3).contiguous()
    return output.reshape(sq, b, np * hnv)


def dsa_site(qi, ki, query, key, value, *extra, topk: int = 4, attention=None):
    """A selection and Megatron's attention over it, without the module: the indexer's scores
    ``qi @ ki^T`` [b, sq, skv] under the causal mask, their top-``topk`` indices, and
    ``attention(query, key, value, indices, 1/sqrt(hn), *extra)`` (``unfused_dsa_fn`` by
    default; query, key [s, b, np, hn], value [s, b, np, hnv])."""
    if attention is None:
        from megatron.core.transformer.experimental_attention_variant.dsa import unfused_dsa_fn as attention
    s = qi @ ki.transpose(-1, -2) + causal_mask(qi.shape[1])
    idx = s.topk(topk, dim=-1).indices
    return attention(query, key, value, idx, query.shape[-1] ** -0.5, *extra)


def site_inputs(seed: int, B: int = 1, S: int = 16, NP: int = 2, HN: int = 8, DI: int = 8):
    """fp32 (qi, ki, query, key, value) for ``dsa_site``; query, key and value require grad."""
    g = torch.Generator().manual_seed(seed)
    qi, ki = (torch.randn(B, S, DI, generator=g) for _ in range(2))
    q, k, v = (torch.randn(S, B, NP, HN, generator=g).requires_grad_() for _ in range(3))
    return qi, ki, q, k, v


def absorbed_dsa_fn(query, latent, topk_indices, softmax_scale, v_channels: int = 8):
    """The absorbed form (``_unfused_absorbed_dsa_fn`` of later Megatron-Core, which 0.16.1
    lacks) written as ``unfused_dsa_fn`` writes its masking: MQA over one latent head
    (query [sq, b, np, hn], latent [skv, b, 1, hn], value = latent[..., :v_channels]), the
    scores reshaped (a view) and the index mask added in place."""
    sq, b, np, hn = query.size()
    skv = latent.size(0)
    q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
    k = latent.permute(1, 2, 3, 0)  # [b, 1, hn, skv]
    attention_scores = (torch.matmul(q.float(), k.float()) * softmax_scale).reshape(b, np, sq, skv)
    index_mask = torch.full((b, sq, skv), float("-inf"), device=attention_scores.device)
    index_mask.scatter_(-1, topk_indices, 0)
    causal_mask = torch.triu(torch.full((sq, skv), float("-inf"), dtype=torch.float32, device=index_mask.device),
                             diagonal=1)
    index_mask += causal_mask.view(1, sq, skv)
    attention_scores += index_mask.unsqueeze(1)
    attention_scores = torch.nn.functional.softmax(attention_scores, dim=-1, dtype=torch.float32)
    value = latent[..., :v_channels].permute(1, 2, 0, 3)  # [b, 1, skv, v]
    output = torch.matmul(attention_scores.to(value.dtype), value)  # [b, np, sq, v]
    return output.permute(2, 0, 1, 3).contiguous().reshape(sq, b, np * v_channels)


def absorbed_site(qi, ki, query, latent, topk: int = 4):
    """``dsa_site`` for ``absorbed_dsa_fn``."""
    s = qi @ ki.transpose(-1, -2) + causal_mask(qi.shape[1])
    idx = s.topk(topk, dim=-1).indices
    return absorbed_dsa_fn(query, latent, idx, query.shape[-1] ** -0.5)


# --- Megatron-Core's absorbed form, as its source writes it ---------------------------------------
# NVIDIA/Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22),
# megatron/core/transformer/experimental_attention_variant/dsa.py ``_unfused_absorbed_dsa_fn``
# and the dsa_masking.py helpers it calls (prepare_sparse_mask_context, prepare_additive_mask,
# normalize_varlen_bounds, scatter_topk_into_index_mask, apply_sparse_validity_to_index_mask,
# build_valid_mask_from_starts_ends, masked_softmax), inlined op for op (their asserts and the
# branches the arguments do not take left out). ``seq_chunk_size`` is the scatter's chunk
# (the source passes 256; a smaller one gives several chunks at a tiny S).

def _mg_valid_from_starts_ends(starts, ends, key_positions):
    key_positions = key_positions.to(dtype=torch.int64)
    starts = starts.to(dtype=torch.int64)
    ends = ends.to(dtype=torch.int64)
    return (key_positions.unsqueeze(0) >= starts.unsqueeze(-1)) & (key_positions.unsqueeze(0) < ends.unsqueeze(-1))


def _mg_normalize_varlen_bounds(varlen_starts, varlen_ends, key_positions, sk, device):
    if varlen_starts is None:
        return None, None, None
    varlen_starts_i64 = varlen_starts.to(device=device, dtype=torch.int64)
    varlen_ends_i64 = varlen_ends.to(device=device, dtype=torch.int64)
    if key_positions is None:
        key_positions_i64 = torch.arange(sk, dtype=torch.int64, device=device)
    else:
        key_positions_i64 = key_positions.to(device=device, dtype=torch.int64)
    return varlen_starts_i64, varlen_ends_i64, key_positions_i64


def _mg_prepare_sparse_mask_context(mask, varlen_starts, varlen_ends, key_positions, sq, sk, b, device):
    varlen_starts_i64, varlen_ends_i64, key_positions_i64 = _mg_normalize_varlen_bounds(
        varlen_starts, varlen_ends, key_positions, sk, device)
    if varlen_starts_i64 is not None:
        return None, varlen_starts_i64, varlen_ends_i64, key_positions_i64
    # prepare_additive_mask: its index_score_mask
    if mask is None:
        score_mask = torch.triu(torch.full((sq, sk), float("-inf"), dtype=torch.float32, device=device), diagonal=1)
    else:
        score_mask = mask
    index_score_mask = score_mask.unsqueeze(0) if score_mask.ndim == 2 else score_mask
    return index_score_mask, None, None, None


def _mg_scatter_topk_into_index_mask(index_mask, topk_indices, seq_chunk_size=256):
    b, sq, _ = index_mask.shape
    device = index_mask.device
    seq_chunk_size = max(1, int(seq_chunk_size))
    for s0 in range(0, sq, seq_chunk_size):
        s1 = min(s0 + seq_chunk_size, sq)
        idx_chunk = topk_indices[:, s0:s1]
        if idx_chunk.dtype != torch.int64 or idx_chunk.device != device:
            idx_chunk = idx_chunk.to(dtype=torch.int64, device=device)
        valid_topk = idx_chunk >= 0
        safe_idx = idx_chunk.clamp_min(0)
        src = torch.where(
            valid_topk,
            torch.zeros((), dtype=index_mask.dtype, device=device),
            torch.full((), float("-inf"), dtype=index_mask.dtype, device=device),
        )
        index_mask[:, s0:s1].scatter_reduce_(-1, safe_idx, src, reduce="amax", include_self=True)


def _mg_apply_sparse_validity_to_index_mask(index_mask, row_mask, varlen_starts, varlen_ends, key_positions):
    if varlen_starts is not None:
        varlen_starts, varlen_ends, key_positions = _mg_normalize_varlen_bounds(
            varlen_starts, varlen_ends, key_positions, index_mask.size(-1), index_mask.device)
        valid_mask = _mg_valid_from_starts_ends(varlen_starts, varlen_ends, key_positions).unsqueeze(0)
        return index_mask.masked_fill(~valid_mask, float("-inf"))
    return index_mask + row_mask


def masked_softmax(logits, valid_mask, *, dim=-1, eps=1e-10):
    """``dsa_masking.masked_softmax``: a softmax over the valid entries, 0 elsewhere (and 0 in
    a row with none)."""
    masked_logits = logits.masked_fill(~valid_mask, torch.finfo(logits.dtype).min)
    row_has_valid = valid_mask.any(dim=dim, keepdim=True)
    row_max = masked_logits.max(dim=dim, keepdim=True).values
    row_max = torch.where(row_has_valid, row_max, torch.zeros_like(row_max))
    probs = torch.exp(masked_logits - row_max)
    probs = probs.masked_fill(~valid_mask, 0.0)
    probs = probs / probs.sum(dim=dim, keepdim=True).clamp_min(eps)
    return probs.masked_fill(~valid_mask, 0.0)


def megatron_absorbed_dsa_fn(query, key, topk_indices, softmax_scale, v_channels, mask=None, varlen_starts=None,
                             varlen_ends=None, key_positions=None, seq_chunk_size=256):
    """``_unfused_absorbed_dsa_fn``: MQA over one latent head (query [sq, b, np, hn], key
    [skv, b, 1, hn], value = key[..., :v_channels]); returns [sq, b, np, v_channels]."""
    sq, b, np, hn = query.size()
    skv = key.size(0)
    row_mask, varlen_starts, varlen_ends, key_positions = _mg_prepare_sparse_mask_context(
        mask, varlen_starts, varlen_ends, key_positions, sq, skv, b, query.device)
    q = query.permute(1, 2, 0, 3)
    k = key.permute(1, 2, 3, 0)
    attention_scores = torch.matmul(q.float(), k.float()) * softmax_scale
    index_mask = torch.full((b, sq, skv), float("-inf"), device=attention_scores.device)
    _mg_scatter_topk_into_index_mask(index_mask, topk_indices, seq_chunk_size=seq_chunk_size)
    index_mask = _mg_apply_sparse_validity_to_index_mask(index_mask, row_mask, varlen_starts, varlen_ends,
                                                         key_positions)
    attention_scores = attention_scores + index_mask.unsqueeze(1)
    valid_index_mask = torch.isfinite(index_mask)
    attention_scores = masked_softmax(
        attention_scores.float(), valid_index_mask.unsqueeze(1).expand(b, np, sq, skv), dim=-1)
    value = key[..., :v_channels].permute(1, 2, 0, 3)
    output = torch.matmul(attention_scores.to(value.dtype), value)
    return output.permute(2, 0, 1, 3).contiguous()


def plain_causal_varlen(sq: int, skv: int):
    """The (starts, ends) ``build_dsattention_forward_mask`` gives a plain causal DSAttention
    (no packing, no context parallelism): what ``_unfused_absorbed_dsa_fn`` then receives."""
    varlen_starts = torch.zeros(sq, dtype=torch.int64)
    varlen_ends = torch.arange(1, sq + 1, dtype=torch.int64).clamp(max=skv)
    return varlen_starts, varlen_ends


def megatron_absorbed_attention(query, latent, w_uv, idx, *, v_channels: int = 8, mask: str = "additive",
                                seq_chunk_size: int = 256):
    """``_run_sparse_attention``'s absorbed path over the indices ``idx`` [b, sq, k]:
    ``megatron_absorbed_dsa_fn`` then ``einsum('sbhc,hdc->sbhd', out, up_v_weight)`` viewed
    [sq, b, np * d]. ``mask``: "additive" (mask=None: the default causal row mask) or
    "varlen" (the plain causal (starts, ends), built in the graph)."""
    sq, skv = query.shape[0], latent.shape[0]
    kw = {}
    if mask == "varlen":
        kw = dict(zip(("varlen_starts", "varlen_ends"), plain_causal_varlen(sq, skv)))
    elif mask != "additive":
        raise ValueError(f"mask must be 'additive' or 'varlen', got {mask!r}")
    out = megatron_absorbed_dsa_fn(query, latent, idx, query.shape[-1] ** -0.5, v_channels,
                                   seq_chunk_size=seq_chunk_size, **kw)
    out = torch.einsum("sbhc,hdc->sbhd", out, w_uv).contiguous()
    return out.view(out.size(0), out.size(1), -1)


def megatron_absorbed_site(qi, ki, query, latent, w_uv, *, topk: int = 4, **kw):
    """A causal top-k over ``qi @ ki^T`` and ``megatron_absorbed_attention`` over it."""
    s = qi @ ki.transpose(-1, -2) + causal_mask(qi.shape[1])
    idx = s.topk(topk, dim=-1).indices
    return megatron_absorbed_attention(query, latent, w_uv, idx, **kw)


def absorbed_reference(query, latent, w_uv, idx, v_channels: int = 8):
    """``megatron_absorbed_attention`` in float64 as what it computes: each query's softmax
    over its selected causal keys of the latent, the value the latent's first ``v_channels``,
    then the value up-projection (a row with no such key gives 0, as ``masked_softmax``)."""
    sq, b, np, hn = query.shape
    skv = latent.shape[0]
    q = query.double().permute(1, 2, 0, 3)  # [b, np, sq, hn]
    lat = latent.double().permute(1, 2, 0, 3)  # [b, 1, skv, hn]
    scores = q @ lat.transpose(-1, -2) * hn ** -0.5
    keep = torch.zeros(b, sq, skv, dtype=torch.bool).scatter(-1, idx.long(), True)
    keep &= torch.ones(sq, skv, dtype=torch.bool).tril()
    p = scores.masked_fill(~keep.unsqueeze(1), float("-inf")).softmax(-1).nan_to_num(0.0)
    out = (p @ lat[..., :v_channels]).permute(2, 0, 1, 3)  # [sq, b, np, c]
    return torch.einsum("sbhc,hdc->sbhd", out, w_uv.double()).reshape(sq, b, -1)


def absorbed_site_inputs(seed: int, B: int = 1, S: int = 16, NP: int = 4, C: int = 8, R: int = 4, DI: int = 8,
                         DV: int = 6):
    """fp32 (qi, ki, query [S, B, NP, C + R], latent [S, B, 1, C + R], up_v_weight [NP, DV, C]);
    query, latent and the weight require grad."""
    g = torch.Generator().manual_seed(seed)
    qi, ki = (torch.randn(B, S, DI, generator=g) for _ in range(2))
    q = torch.randn(S, B, NP, C + R, generator=g).requires_grad_()
    lat = torch.randn(S, B, 1, C + R, generator=g).requires_grad_()
    w = (torch.randn(NP, DV, C, generator=g) * C ** -0.5).requires_grad_()
    return qi, ki, q, lat, w
