"""Tiny random Hugging Face DSA-family models (transformers==5.24.0) for end-to-end tests.

Builders return ``(model, kwargs)``; call ``model(**kwargs)``. Every model is built at a tiny
random config (2 layers, hidden 64, 16 indexer heads of dim 16, index_topk=8 over 32 tokens, or
over 16 compressed entries for V4), in float32, ``eval()`` mode, on CPU, and runs in eager in
well under a second. Use ``transformers_available()`` (or ``pytest.importorskip("transformers")``)
before calling a builder. ``EXPECTED_TOPK[name] = (num_selections, num_other_topk)`` gives the
number of ``aten.topk`` nodes in the traced forward graph that are indexer selections (must be
rewritten) and that are MoE-router topks (must stay ``aten.topk``).

Settings that matter (all set by the builders):

* ``attn_implementation="eager"`` (the default ``"sdpa"`` path turns the causal mask into a
  bool mask; V4 only ships eager). Pass ``attn_implementation="sdpa"`` to the V3.2/GLM builders
  to get the bool-mask form of the indexer (``masked_fill(~mask, -inf)``).
* ``experts_implementation="grouped_mm"`` (the transformers default). With ``"eager"`` the
  experts loop over ``nonzero()`` hits and Dynamo breaks the graph at every MoE layer
  (11 breaks for V3.2, 13 for V4 at these configs). With ``grouped_mm`` all three models trace
  as ONE graph with ZERO graph breaks (``torch._dynamo.explain``, torch 2.13 CPU), and
  ``torch.compile(model, backend="aot_eager")`` gives logits bitwise equal to eager.
* ``use_cache=False`` in kwargs. With the default ``use_cache=True`` a ``DynamicCache`` is made
  and the V3.2/GLM indexer key goes through ``cache.update_indexer``, which in the traced graph
  is ``cat([<f32[0] constant>, k], dim=1)`` on the key-side operand of the contraction.
* ``initializer_range=0.1`` (instead of 0.02) so indexer scores are well separated.

How the indexers are written (read from transformers 5.24.0 and checked in the aot graphs)
-----------------------------------------------------------------------------------------

DeepSeek-V3.2 (``DeepseekV32Indexer.forward``, ``modeling_deepseek_v32.py``), whole forward
under ``@torch.no_grad()``::

    q = wq_b(q_resid).view(B, S, H, D); split [rope | nope]; half-split (non-interleaved) RoPE
    k = k_norm(wk(x)).unsqueeze(2)       # LayerNorm, one key head; same RoPE; -> [B, T, D]
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * D**-0.5
    scores = F.relu(scores)                                           # [B, S, H, T]
    weights = weights_proj(x.to(weights_proj.weight.dtype)).float() * H**-0.5
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)   # head sum as matmul
    if mask.dtype == bool: index_scores = index_scores.masked_fill(~mask, -inf)
    else:                  index_scores = index_scores + mask          # eager: this branch
    return index_scores.topk(min(index_topk, T), dim=-1).indices.to(torch.int32)

  The mask is ``attention_mask[:, 0, :, :]`` of the model's 4-D mask. Under eager it is a FLOAT
  additive mask built in-graph as ``where(kv_idx <= q_idx, 0.0, finfo(float32).min)``
  (``[B, 1, S, T]``, expanded over B), i.e. a *finite* additive mask: masked scores become
  exactly ``finfo.min`` (the score is absorbed), so rows with fewer than k causal keys tie among
  masked keys. Aten sequence: ``expand/clone -> bmm [B*S, H, D]x[B*S, D, T] -> view ->
  mul(0.25) -> relu``; ``mm(x, Wᵀ) -> mul(H^-0.5) -> unsqueeze(-2) -> expand -> bmm
  [B*S,1,H]x[B*S,H,T] -> view -> squeeze(-2) -> add(mask) -> topk(k) -> getitem[1] ->
  _to_copy(int32)``. Consumer (``DeepseekV32Attention.forward``, eager/sdpa)::

    index_mask = idx.new_ones((B, S, T), dtype=bool).scatter(-1, idx.long(), False).unsqueeze(1)
    attention_mask = attention_mask.masked_fill(index_mask, finfo(x.dtype).min)   # float mask
    (bool mask: attention_mask & ~index_mask) -> eager_attention_forward (+mask, softmax)

GLM-5 (``GlmMoeDsaIndexer.forward``, ``modular_glm_moe_dsa.py``): the scoring code is
identical to V3.2 (matmul -> *scale -> F.relu -> weights matmul head-sum -> +mask -> topk
.indices.int32, under ``@torch.no_grad()``); only the indexer RoPE is *interleaved*. GLM adds
IndexCache: ``config.indexer_types[i]`` is ``"full"`` or ``"shared"``; a shared layer has
``indexer=None`` and reuses ``prev_topk_indices`` returned by the previous layer. The builder
uses ``("full", "shared")`` by default, so ONE selection's indices feed TWO layers' masks.

DeepSeek-V4 (``DeepseekV4IndexerScorer`` + ``DeepseekV4Indexer.forward``), NOT under no_grad::

    compressed = kv_norm(sum_2m(new_kv * softmax(new_gate + position_bias, dim=2))) ; RoPE at 4i
    q = q_b_proj(q_residual).view(B, S, -1, D).transpose(1, 2); interleaved RoPE; .transpose(1, 2)
    scores = torch.matmul(q.float(), compressed_kv.transpose(-1, -2).float().unsqueeze(1))
    scores = F.relu(scores) * D**-0.5                  # scale AFTER the ReLU
    weights = weights_proj(x).float() * H**-0.5
    index_scores = (scores * weights.unsqueeze(-1)).sum(dim=2)          # mul + sum head reduction
    thr = (position_ids + 1) // compress_rate                          # runtime, [B or 1, S]
    future = arange(T_c).view(1, 1, -1) >= thr.unsqueeze(-1)
    index_scores = index_scores.masked_fill(future, -inf)
    idx = index_scores.topk(min(index_topk, T_c), dim=-1).indices      # sorted, int64
    return torch.where(idx >= thr.unsqueeze(-1), torch.full_like(idx, -1), idx)

  Aten: ``bmm -> view -> relu -> mul(0.25) -> mul(unsqueeze(w,-1)) -> sum([2]) ->
  masked_fill(ge(arange, floor_divide(pos+1, 4)), -inf) -> topk(8) -> getitem[1] -> ge/where(-1)``.
  Consumer (``DeepseekV4CSACompressor.forward``)::

    safe = torch.where(idx >= 0, idx, full_like(idx, T_c))
    block_bias = new_full((B, 1, S, T_c + 1), -inf).scatter_(-1, safe.unsqueeze(1), 0.0)[..., :T_c]
    attention_mask = cat([sliding_window_mask, block_bias], -1); eager attention with sinks

  The builder passes ``position_ids`` as an input, so the threshold is a runtime tensor. The
  compressed keys come from a softmax-gated pooling of activations (parameters
  ``position_bias`` enter only through the gate), so the key side is activation-derived.

MoE routers (never selections; must stay ``aten.topk``):

* V3.2 / GLM ``*TopkRouter.forward``: ``logits = F.linear(x.float(), weight.float())`` (weight an
  ``nn.Parameter``) ``-> sigmoid -> + e_score_correction_bias`` then THREE topks:
  ``view(-1, n_group, E/n_group).topk(2, dim=-1)[0].sum(-1)`` (values used),
  ``torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]``, and after a
  ``masked_fill(~group_mask, -inf)``: ``torch.topk(scores, k=top_k, dim=-1, sorted=False)[1]``
  followed by ``scores.gather(1, idx)``. (GLM runs the same three even with ``n_group=1``.)
* V4 ``DeepseekV4TopKRouter``: ``F.linear(flat, weight) -> sqrtsoftplus/sigmoid/softmax ->
  torch.topk(scores + e_score_correction_bias, top_k, dim=-1, sorted=False).indices ->
  scores.gather``. ``DeepseekV4HashRouter`` (``mlp_layer_types == "hash_moe"``) has no topk
  (``tid2eid[input_ids]``). The builder uses ``["hash_moe", "moe"]`` so there is one router topk.

Uniqueness: the index *tensors* of rows with fewer than k valid keys tie among masked keys
(``finfo.min`` for V3.2/GLM, ``-inf`` for V4), and ReLU can leave exact zeros; downstream these
masked picks are re-masked, so compare logits (not raw indices) with eager, or compare indices
against a stable (value desc, index asc) reference. With 16 indexer heads, exact-zero scores among
valid keys are rare, and for seeds 0-7 of every builder no row with more than k valid keys has a
tie at the k-th/(k+1)-th boundary (checked; min gap ~4e-6), so logits are tie-independent there.
(With 8 indexer heads, seed 2 of V3.2 had an exact-zero boundary tie.)
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch

# (num_selections, num_other_topk) among aten.topk nodes of the forward graph, default builders.
EXPECTED_TOPK: dict[str, tuple[int, int]] = {
    "deepseek_v32": (2, 3),  # 2 indexers; layer 1 MoE router: group top-2 values, group topk, expert topk
    "glm_moe_dsa": (1, 3),  # indexer_types ("full", "shared"): 1 indexer feeding 2 layers; same router
    "deepseek_v4": (2, 1),  # 2 CSA indexers; layer 0 hash_moe (no topk), layer 1 TopKRouter
}

BATCH = 2
SEQ = 32  # V3.2 / GLM: index_topk=8 over 32 keys
SEQ_V4 = 64  # V4: 64 tokens / compress_rate 4 = 16 compressed entries, index_topk=8
VOCAB = 256


def transformers_available() -> bool:
    """True if transformers with the DSA model families (5.24.0 or newer) is importable."""
    if importlib.util.find_spec("transformers") is None:
        return False
    try:
        import transformers

        return all(hasattr(transformers, n) for n in ("DeepseekV32Config", "GlmMoeDsaConfig", "DeepseekV4Config"))
    except Exception:  # pragma: no cover - broken install
        return False


def _quiet() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()


def _dsa_common(index_topk: int, first_k_dense_replace: int = 1) -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        index_topk=index_topk,
        index_head_dim=16,
        index_n_heads=16,
        first_k_dense_replace=first_k_dense_replace,  # 1: layer 0 dense MLP, layer 1 MoE (router topk)
        max_position_embeddings=128,
        initializer_range=0.1,
    )


def _ids(seed: int, seq: int, batch: int = BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def _finish(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast and set eval. Note ``.to(bf16)`` casts EVERY parameter, including those
    ``from_pretrained`` would keep in fp32 (``indexer.weights_proj``, router ``gate.weight``)."""
    return model.to(dtype).eval()


def build_deepseek_v32(
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "eager",
    experts_implementation: str = "grouped_mm",
    seq: int = SEQ,
    batch: int = BATCH,
    index_topk: int = 8,
    first_k_dense_replace: int = 1,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """DeepseekV32ForCausalLM: 2 DSA layers (dense MLP, then MoE with n_group=2).

    ``first_k_dense_replace=2``: both MLPs dense, no router (a bf16 model whose float64 copy
    routes as it does: bf16 router scores tie or swap near-equal experts)."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    _quiet()
    torch.manual_seed(seed)
    cfg = DeepseekV32Config(
        **_dsa_common(index_topk, first_k_dense_replace),
        n_group=2,
        topk_group=1,
        attn_implementation=attn_implementation,
        experts_implementation=experts_implementation,
    )
    model = _finish(DeepseekV32ForCausalLM(cfg), dtype)
    return model, {"input_ids": _ids(seed, seq, batch), "use_cache": False}


def build_glm_moe_dsa(
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "eager",
    experts_implementation: str = "grouped_mm",
    indexer_types: tuple[str, ...] = ("full", "shared"),
    seq: int = SEQ,
    batch: int = BATCH,
    index_topk: int = 8,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """GlmMoeDsaForCausalLM: 2 layers; by default layer 1 reuses layer 0's indices (IndexCache).

    With ``indexer_types=("full", "full")`` there are two selections.
    """
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    _quiet()
    torch.manual_seed(seed)
    cfg = GlmMoeDsaConfig(
        **_dsa_common(index_topk),
        n_group=1,
        topk_group=1,
        indexer_types=list(indexer_types),
        attn_implementation=attn_implementation,
        experts_implementation=experts_implementation,
    )
    model = _finish(GlmMoeDsaForCausalLM(cfg), dtype)
    return model, {"input_ids": _ids(seed, seq, batch), "use_cache": False}


def build_deepseek_v4(
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    experts_implementation: str = "grouped_mm",
    layer_types: tuple[str, ...] = ("compressed_sparse_attention", "compressed_sparse_attention"),
    seq: int = SEQ_V4,
    index_topk: int = 8,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """DeepseekV4ForCausalLM: 2 CSA layers (compress rate 4, lightning indexer), hash-MoE then MoE.

    ``position_ids`` is passed explicitly ([B, S] int64), so the indexer's block-causal threshold
    ``(position_ids + 1) // 4`` is computed from a runtime input.
    """
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    _quiet()
    torch.manual_seed(seed)
    cfg = DeepseekV4Config(
        vocab_size=VOCAB,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=32,
        partial_rotary_factor=0.25,  # rope dim 8 <= index_head_dim
        num_experts_per_tok=2,
        n_routed_experts=8,
        scoring_func="sqrtsoftplus",
        layer_types=list(layer_types),
        mlp_layer_types=["hash_moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        hc_mult=2,
        hc_sinkhorn_iters=3,
        sliding_window=16,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=16,
        index_head_dim=16,
        index_topk=index_topk,
        max_position_embeddings=256,
        initializer_range=0.1,
        attn_implementation="eager",
        experts_implementation=experts_implementation,
    )
    model = _finish(DeepseekV4ForCausalLM(cfg), dtype)
    # hash_moe routes by tid2eid[input_ids]; the init leaves it all zeros, give it a spread.
    g = torch.Generator().manual_seed(20_000 + seed)
    for layer in model.model.layers:
        gate = layer.mlp.gate
        if hasattr(gate, "tid2eid"):
            with torch.no_grad():
                gate.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, gate.tid2eid.shape, generator=g))
    position_ids = torch.arange(seq).unsqueeze(0).expand(BATCH, -1).contiguous()
    return model, {"input_ids": _ids(seed, seq), "position_ids": position_ids, "use_cache": False}


BUILDERS: dict[str, Callable[..., tuple[torch.nn.Module, dict[str, Any]]]] = {
    "deepseek_v32": build_deepseek_v32,
    "glm_moe_dsa": build_glm_moe_dsa,
    "deepseek_v4": build_deepseek_v4,
}


def count_topk(graph: torch.fx.Graph) -> int:
    """Number of topk call nodes (torch-level or aten) in an FX graph."""
    n = 0
    for node in graph.nodes:
        t = node.target
        if node.op == "call_method" and t == "topk":
            n += 1
        elif node.op == "call_function" and (
            t is torch.topk or t is torch.ops.aten.topk.default or getattr(t, "__name__", "") == "topk"
        ):
            n += 1
    return n


if __name__ == "__main__":
    import time

    if not transformers_available():
        raise SystemExit("transformers with DeepseekV32/GlmMoeDsa/DeepseekV4 is not installed")
    explain = "--explain" in __import__("sys").argv
    for name, build in BUILDERS.items():
        model, kwargs = build(0)
        t0 = time.time()
        with torch.no_grad():
            logits = model(**kwargs).logits
        print(f"{name}: logits {tuple(logits.shape)} {logits.dtype} eager {time.time() - t0:.3f}s")
        if explain:
            torch._dynamo.reset()
            ex = torch._dynamo.explain(model)(**kwargs)
            topks = sum(count_topk(g.graph) for g in ex.graphs)
            print(f"  dynamo: graphs={ex.graph_count} breaks={ex.graph_break_count} topk={topks} "
                  f"expected={sum(EXPECTED_TOPK[name])}")
            for br in ex.break_reasons:
                print("   break:", br.reason.splitlines()[0])
