"""Train a small DeepSeek-Sparse-Attention LM, indexer included, with ``torch.compile(backend="hyscale")``.

Run ``python examples/train_dsa.py`` (``--help`` for the flags). It follows DeepSeek-V3.2's recipe
for its lightning indexer on a long-range task, associative recall, where sparse attention works
only if the indexer learned to find the answer:

0. **dense model** (``--dense-steps``): the recipe starts from a trained dense model (V3.2 from
   V3.1-Terminus), so the example first trains ``examples/dsa_model.py`` with dense attention
   (``model(ids, dense=True)``) on the answer loss; the indexer is not run;
1. **dense warm-up of the indexer** (``--warmup-steps``): the model is frozen and attention stays
   dense; only the indexer trains, with the dense KL: the target is the main attention's
   probabilities summed over heads and L1-normalised over the keys (detached), and the loss is
   KL(target_t || softmax(index scores_t + causal mask)), averaged over the query rows t;
2. **sparse training** (``--steps``): the attention applies the indexer's top-k selection; the
   model learns from the answer loss and the indexer from the same KL restricted to the selected
   set, on detached indexer inputs (so the indexer learns only from this loss, and the model only
   from the answer loss);
3. **control** (``--control``, on by default): the same sparse training from the same dense model,
   with the indexer frozen at its initialisation (no warm-up, no KL).

The losses. ``model(ids, return_aux=True)`` returns, per layer, what they need (the main
attention's q and k, the indexer's inputs, the selection); ``LightningIndexer.projections`` gives
the indexer's q, k and head weights with grad. The warm-up calls ``hyscale_compile.dense_indexer_kl``
(streamed: no [S, T] table; Triton kernels on CUDA). The sparse stage gathers the index scores at
the k selected slots, recomputes the main attention's head-summed probabilities there (the HF-eager
attention does not return them), and calls ``hyscale_compile.sparse_indexer_kl`` on the two [B, S, k]
tensors. They are library calls rather than plain PyTorch because the backend's indexer-loss pass
(docs/indexer_loss.md) would not rewrite a plain version here: the losses run beside the compiled
model, and ``hyscale_compile.explain`` of the model and its loss together reports no
``[indexer loss]`` site for either (the pass matches Megatron's index-mask form over [S, T] tables,
not a loss already written at the slots, and leaves a dense warm-up dense by design).

Before training it prints ``hyscale_compile.explain(...)`` of the sparse stage's (grad-enabled)
forward: which top-k sites the backend rewrote into ``torch.ops.hyscale.hytopk``. All stages run
through one compiled model (the reference and the control load their weights into it), so each of
the dense, warm-up and sparse graphs compiles once (``TORCH_LOGS=recompiles`` shows three graphs and
the reference's). The step-for-step check: at each of the first 50 sparse steps, before the
update, ``--reference`` computes the same losses at the same weights and batch; the answer losses
must agree within ``LOSS_RTOL`` = 2%, and wherever the two selections differ (as sets of visible
keys), each must be an exact top-k of the float64 index scores within fp32 rounding
(``SameWeightsCheck``). Then the sparse stage runs again under ``--reference`` from the same
warmed-up model and batches, a run of its own; when it covers the whole stage the final
accuracies are compared (within 3 points), and how far its per-step losses drift from the first
run's is printed, not checked: the fused op and ``torch.topk`` compute the index scores in
different kernels, near-tied scores (a trained indexer has many) round differently, exact ties go
to different keys, one flipped slot changes the next update, and two training runs drift apart
whatever the rewrite does. The
reference is default ``torch.compile`` (Inductor) for ``--backend hyscale``; for
``hyscale_debug`` it is ``off``, the same backend with ``options={"hyscale.enable": False}``: the
same AOT graphs and decompositions without the rewrite (``aot_eager`` decomposes differently, so
its fp32 rounding differs from the first step).

The task. Each sequence starts with ``P = 16`` key->value pairs ``K_1 v_1 K_2 v_2 ... K_P v_P`` (the
keys in a fixed order, the values a random permutation of the ``V = P`` value tokens), then filler
drawn from the same value tokens, then ``Q`` query keys at the end (16, or S/32 beyond S = 512:
``num_queries``); the answer loss is the
cross-entropy of the value predicted at each query key; guessing gives 1/V. (With the keys in a
random order the lookup needs a two-layer "induction" circuit that this small model does not find
within a CPU-sized budget; in a fixed order it is one attention hop, and the indexer still has to
find one position among S.) recall@k is the fraction of queries whose selection contains the
answer's value position, printed per layer beside the random baseline (k / number of visible keys).

What keeps the control honest, so that only an indexer that learned to find the key can pass:

- every answer's value sits at distance >= S/2 from its query (``--seq`` >= 94);
- k = S/32 (``--topk``): the dense model reads the answer wherever the selection happens to hold
  it, so a selection that ignores the key scores about k/S + (1 - k/S)/V; at k/S = 1/16 that is
  0.12, over the control's bound of chance + 0.05 = 0.1125, at 1/32 it is 0.09;
- the filler is made of value tokens, so a value position looks like any other to an indexer that
  does not know the key order (with a filler vocabulary of its own, a frozen indexer that happens
  to prefer value tokens finds the answers more often than chance: its layer-1 recall was 1.6-1.7x
  the random rate at k = 4 and 8, against 1.1-1.5x with value filler, same dense model);
- nothing is always selected: the selection is the top-k of the index scores alone (no local
  window, no forced sink), and the control's accuracy is measured in the sparse stage itself.

Other flags: ``--checkpoint {full,sac,none}`` wraps each decoder block in activation checkpointing
in the warm-up and sparse stages (``torch.utils.checkpoint.checkpoint(block, x, mask,
use_reentrant=False)``; ``sac`` saves the projection matmuls; default full; the dense stage runs at
S <= 512 and is not checkpointed); ``--backend`` (default ``hyscale`` on CUDA, ``hyscale_debug`` on
the CPU: the same passes and rewrite, graphs run without Inductor codegen, so the CPU run compiles in
seconds; ``--backend hyscale`` on the CPU compiles with Inductor, minutes cold); ``--reference``;
``--topk``, ``--lr``, ``--indexer-lr``, ``--batch``, ``--dtype``, ``--seed``; ``--out`` is the
loss-curve PNG (default ``out/train_dsa_loss.png``; skipped with a message when matplotlib is not
installed); ``--near-queries`` adds, in the dense stage only, 16 queries right after the pairs (a
curriculum; off by default).

Sizes. The same model at every S: 2 layers, dim 64, 4 heads, indexer 16 heads x dim 16, fp32. The
default runs on a CPU in under a minute: seq 128, k 4, batch 16, 300 dense + 40 warm-up + 50
sparse steps (and 50 reference and 50 control steps). For a GPU::

    python examples/train_dsa.py --device cuda --seq 8192      # up to --seq 32768

k = S/32 (256 at 8K, 1024 at 32K), batch 32768 // S. A dense model at init spreads each query over
S keys and finds the lookup late or never at long S (``dense_phases``), so beyond S = 512 the dense
stage trains at S = 128 and then 512 (300 + 60 steps, 16 queries a sequence), and the warm-up,
sparse and control stages run at the full S (300 warm-up steps, 200 sparse and 200 control), with
S/32 queries a sequence (1,024 a step); the reference runs all the sparse steps up to S = 8192 and the first 50 beyond. Progress
lines print the stage's and the total elapsed time.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import math
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dsa_model import DSAConfig, causal_mask, make_model  # noqa: E402

import hyscale_compile  # noqa: E402  registers backend="hyscale" / "hyscale_debug"; the indexer's KL losses

# The step-for-step comparison: |loss_hyscale - loss_reference| <= LOSS_RTOL * |loss_reference| at
# each compared step, and the final accuracies within ACC_ATOL.
LOSS_RTOL, ACC_ATOL = 0.02, 0.03


T_START = time.perf_counter()  # progress lines print the time since the start


def say(msg: str = "") -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------
# setups
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Setup:
    cfg: DSAConfig
    seq: int
    batch: int
    pairs: int  # key->value pairs at the start of each sequence (= the number of value tokens, V)
    queries: int  # query keys at the end (answer positions)
    device: str
    dtype: torch.dtype

    def describe(self) -> str:
        c = self.cfg
        return (f"{c.layers} layers, dim {c.dim}, {c.heads} attention heads, indexer {c.index_heads} heads x dim "
                f"{c.index_head_dim}, top-k {c.index_topk} (k/S = 1/{self.seq // c.index_topk}), vocab {c.vocab}; "
                f"batch {self.batch} x seq {self.seq}, {self.pairs} pairs, {self.queries} queries; "
                f"{str(self.dtype).replace('torch.', '')} on {self.device}")


def make_setup(seq: int, device: str, dtype: Optional[torch.dtype], batch: Optional[int],
               topk: Optional[int] = None) -> Setup:
    """The same small model at every S (2 layers, dim 64, indexer 16 heads x dim 16): the CPU
    model learns the lookup; a dim-256 variant (indexer 16 x 64) had not learnt it after 360 dense
    steps on the CPU (S = 128 then 512). Batch 16 up to S = 512, else 32768 // S sequences.
    k = S/32 (at most 2048, as DeepSeek-V3.2) unless ``topk``: at k/S = 1/16 a selection that
    ignores the key still holds the answer's value for 1 query in 16, and the dense model reads it
    wherever it is selected, so even a random selection would score 1/16 + 15/16 * 1/V = 0.12 at
    V = 16, over the control's bound of chance + 0.05."""
    k = topk or max(1, min(2048, seq // 32))
    cfg = DSAConfig(vocab=128, dim=64, layers=2, heads=4, index_heads=16, index_head_dim=16, index_topk=k,
                    max_seq=seq, q_lora_rank=32, mlp_hidden=128)
    return Setup(cfg=cfg, seq=seq, batch=batch or (16 if seq <= 512 else max(1, 32768 // seq)), pairs=16,
                 queries=num_queries(seq), device=device, dtype=dtype or torch.float32)


def num_queries(seq: int) -> int:
    """Query keys per sequence: 16 up to S = 512, S/32 beyond. The indexer learns the lookup from
    the query rows alone (the warm-up's KL averages over all S rows, the filler's included), so
    with a fixed 16 their share of the KL fell as 16/S: at S = 8192 (1 row in 512) the warm-up's
    layer-1 recall@k stalled near 0.58 and the sparse stage ended at accuracy 0.68. At S/32 the
    share is 1/32 and, with batch 32768 // S, every step holds 1,024 queries at any S >= 1024.
    The answers stay at distance >= S/2 (S - S/32 - 31 >= S/2 for S >= 94)."""
    return max(16, seq // 32)


# --------------------------------------------------------------------------------------------
# data: associative recall
# --------------------------------------------------------------------------------------------
def vocab_layout(vocab: int, pairs: int) -> Tuple[range, range, range]:
    """Token 0 unused; then ``pairs`` keys, ``pairs`` values and the filler tokens, disjoint ranges."""
    return range(1, 1 + pairs), range(1 + pairs, 1 + 2 * pairs), range(1 + 2 * pairs, vocab)


def make_batch(s: Setup, gen: torch.Generator, near: bool = False):
    """``ids [B, S]``, ``answer_pos [Q]`` (the query positions), ``targets [B, Q]`` (their values)
    and ``value_pos [B, Q]`` (where each answer's value sits in the context).

    Layout: ``K_1 v_1 ... K_P v_P | filler ... | q_1 ... q_Q``; the values are a random permutation
    of the value tokens, and the filler is drawn from the same value tokens, so a value position
    looks like any filler position to anything that does not know the key order; the queries run
    through random orders of the keys (each key once per ``P`` queries).
    ``near``: also ``P`` queries right after the pairs (answer positions first, then the far ones),
    ``--near-queries``' curriculum for the dense stage: a query that sees few keys finds the lookup
    sooner.
    """
    keys_r, vals_r, _ = vocab_layout(s.cfg.vocab, s.pairs)
    B, S, P, Q = s.batch, s.seq, s.pairs, s.queries

    def key_orders(n):
        return torch.cat([torch.rand(B, P, generator=gen).argsort(-1) for _ in range(-(-n // P))], 1)[:, :n]

    vals = torch.rand(B, P, generator=gen).argsort(-1) + vals_r.start
    ids = torch.randint(vals_r.start, vals_r.stop, (B, S), generator=gen)
    ids[:, 0:2 * P:2] = torch.arange(P) + keys_r.start
    ids[:, 1:2 * P:2] = vals
    pick = key_orders(Q)
    ids[:, S - Q:] = pick + keys_r.start
    answer_pos = torch.arange(S - Q, S)
    targets, value_pos = vals.gather(1, pick), 2 * pick + 1
    if near:
        pick = key_orders(P)
        ids[:, 2 * P:3 * P] = pick + keys_r.start
        answer_pos = torch.cat([torch.arange(2 * P, 3 * P), answer_pos])
        targets, value_pos = torch.cat([vals.gather(1, pick), targets], 1), torch.cat([2 * pick + 1, value_pos], 1)
    return tuple(t.to(s.device) for t in (ids, answer_pos, targets, value_pos))


def answer_loss(logits: torch.Tensor, answer_pos: torch.Tensor, targets: torch.Tensor):
    """Cross-entropy (fp32) and accuracy of the value predicted at each query key."""
    lg = logits[:, answer_pos].float()
    loss = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), targets.reshape(-1))
    acc = (lg.argmax(-1) == targets).float().mean()
    return loss, acc


# --------------------------------------------------------------------------------------------
# the indexer's losses (DeepSeek-V3.2)
# --------------------------------------------------------------------------------------------
def _index_scores(iq: torch.Tensor, ik: torch.Tensor, iw: torch.Tensor, scale: float) -> torch.Tensor:
    """``I[b, s, t] = sum_h w[b, s, h] relu(q[b, s, h] . k[b, t] * scale)`` (the indexer's scores)."""
    return torch.einsum("bsh,bsht->bst", iw, F.relu(torch.einsum("bshd,btd->bsht", iq, ik) * scale))


def dense_indexer_kl(q: torch.Tensor, k: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor, iw: torch.Tensor,
                     attn_scale: float, index_scale: float) -> torch.Tensor:
    """DSA's dense warm-up loss, ``mean_t KL(p_t || softmax(I_t))`` over all causal keys:
    ``hyscale_compile.dense_indexer_kl``, streamed (no [S, T] table; Triton kernels on CUDA).

    ``q [B, h, S, d]``, ``k [B, h, T, d]``: the main attention's (the target ``p`` = its softmax
    probabilities summed over heads, L1-normalised over the keys, detached). ``iq [B, S, H, D]``,
    ``ik [B, T, D]``, ``iw [B, S, H]``: the indexer's projections (``LightningIndexer.projections``),
    which get the gradient. The library's index score is ``sum_h w_h relu(q_h . k_t)``; the
    indexer's positive ``index_scale`` inside the ReLU moves into the weights. The paper writes the
    sum over t; the mean over the ``B * S`` query rows keeps the learning rate independent of S."""
    return hyscale_compile.dense_indexer_kl(q.transpose(1, 2), k.transpose(1, 2), iq, ik, iw * index_scale,
                                            scale=attn_scale, causal=True)


def _sparse_kl_chunk(p, iq, ik, iw, idx, valid, scale):
    ks = ik[torch.arange(ik.shape[0], device=ik.device)[:, None, None], idx]  # [B, c, k, D]
    scores = torch.einsum("bsh,bshj->bsj", iw, F.relu(torch.einsum("bshd,bsjd->bshj", iq, ks) * scale))
    # a masked slot (a row with fewer than k visible keys) gets P = 0 and an index score of -inf,
    # and adds exactly 0 to the loss and its gradient
    return hyscale_compile.sparse_indexer_kl(p, scores.masked_fill(~valid, -math.inf), reduction="none").sum()


def sparse_indexer_kl(q: torch.Tensor, k: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor, iw: torch.Tensor,
                      idx: torch.Tensor, mask: torch.Tensor, attn_scale: float, index_scale: float,
                      chunk: int = 1024) -> torch.Tensor:
    """The sparse stage's loss: the same KL over each row's selected keys ``idx [B, S, k]``, both
    distributions restricted to them, through ``hyscale_compile.sparse_indexer_kl`` at the k
    slots. The target needs the main attention's head-summed probabilities at the slots, which the
    model's (HF eager) attention does not return, so it is recomputed here from q and k, one chunk
    of query rows at a time; the index scores are computed at the slots only, under activation
    checkpointing."""
    B, S = iq.shape[:2]
    h = q.shape[1]
    total = iq.new_zeros(())
    for r0 in range(0, S, chunk):
        r = slice(r0, min(S, r0 + chunk))
        sel = idx[:, r].long()
        with torch.no_grad():
            logits = torch.matmul(q[:, :, r].float(), k.float().transpose(-1, -2)) * attn_scale + mask[r]
            p = F.softmax(logits.gather(-1, sel.unsqueeze(1).expand(-1, h, -1, -1)), dim=-1).sum(1)
            p = p / p.sum(-1, keepdim=True)
            valid = mask[r].expand(B, -1, -1).gather(-1, sel) == 0
        total = total + checkpoint(_sparse_kl_chunk, p, iq[:, r], ik, iw[:, r], sel, valid, index_scale,
                                   use_reentrant=False)
    return total / (B * S)


def indexer_losses(model: nn.Module, auxes, mask: torch.Tensor, sparse: bool) -> torch.Tensor:
    """The indexer's KL loss summed over the layers, from ``model(ids, return_aux=True)``'s aux."""
    total = 0.0
    for block, aux in zip(model.blocks, auxes):
        attn = getattr(block, "block", block).attn
        q, k, x, q_resid = aux[:4]
        # detached inputs: the indexer learns only from this loss (and the model not from it)
        iq, ik, iw = attn.indexer.projections(x.detach(), q_resid.detach())
        args = (q.detach(), k.detach(), iq, ik, iw)
        scales = (attn.head_dim**-0.5, attn.indexer.softmax_scale)
        total = total + (sparse_indexer_kl(*args, aux[4], mask, *scales) if sparse
                         else dense_indexer_kl(*args, *scales))
    return total


@torch.no_grad()
def answer_recall(model: nn.Module, auxes, mask: torch.Tensor, answer_pos: torch.Tensor,
                  value_pos: torch.Tensor) -> List[float]:
    """Per layer: the fraction of queries whose top-k selection contains the answer's value position
    (the model's own selection where it ran, else the indexer's top-k computed here)."""
    out = []
    for block, aux in zip(model.blocks, auxes):
        attn = getattr(block, "block", block).attn
        if len(aux) > 4:
            sel = aux[4][:, answer_pos].long()
        else:
            iq, ik, iw = attn.indexer.projections(aux[2], aux[3])
            scores = _index_scores(iq[:, answer_pos], ik, iw[:, answer_pos], attn.indexer.softmax_scale)
            sel = (scores + mask[answer_pos]).topk(min(attn.indexer.topk, scores.shape[-1]), dim=-1).indices
        out.append((sel == value_pos.unsqueeze(-1)).any(-1).float().mean().item())
    return out


# --------------------------------------------------------------------------------------------
# activation checkpointing
# --------------------------------------------------------------------------------------------
_SAVED_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def save_matmuls(ctx, op, *args, **kwargs):
    """SAC policy: save the projection matmuls (every ``nn.Linear``: aten.mm / addmm), recompute
    the rest. The attention-sized bmm's ([heads, S, S]) are recomputed, the cheap-memory choice at
    long context. The selection op itself is always saved: hyscale tags it MUST_SAVE."""
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointedBlock(nn.Module):
    def __init__(self, block: nn.Module, mode: str) -> None:
        super().__init__()
        self.block, self.mode = block, mode

    def forward(self, x: torch.Tensor, mask: torch.Tensor, **kw):
        if self.mode == "none":
            return self.block(x, mask, **kw)
        if self.mode == "full":
            return checkpoint(self.block, x, mask, use_reentrant=False, **kw)
        return checkpoint(self.block, x, mask, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls), **kw)


def build_model(s: Setup, mode: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = make_model(s.cfg)
    # nn.Embedding's N(0, 1) makes the positions as loud as the tokens; at 0.1 the dense model
    # finds the lookup in ~250 steps instead of 300-450 (seeds 0-3 on the CPU setup)
    for emb in (model.embed, model.pos_embed):
        nn.init.normal_(emb.weight, std=0.1)
    model.blocks = nn.ModuleList(CheckpointedBlock(b, mode) for b in model.blocks)
    return model.to(device=s.device, dtype=s.dtype).train()


def split_params(model: nn.Module) -> Tuple[List[nn.Parameter], List[nn.Parameter]]:
    """(the main model's parameters, the indexers')."""
    main, idx = [], []
    for n, p in model.named_parameters():
        (idx if ".indexer." in n else main).append(p)
    return main, idx


def adamw(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------
# the stages
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Log:
    lm: List[float] = dataclasses.field(default_factory=list)
    kl: List[float] = dataclasses.field(default_factory=list)
    acc: List[float] = dataclasses.field(default_factory=list)
    recall: List[List[float]] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    first_step_s: float = 0.0

    def tail(self, xs, frac=0.1):
        n = max(1, len(xs) // int(1 / frac))
        return sum(xs[-n:]) / n

    def recall_tail(self):
        rs = self.recall[-max(1, len(self.recall) // 10):]
        return [sum(r[i] for r in rs) / len(rs) for i in range(len(rs[0]))]


def fmt_recall(r: List[float]) -> str:
    return " / ".join(f"{x:.3f}" for x in r)


def dense_phases(s: Setup, steps: int) -> List[Tuple[Setup, int]]:
    """The dense stage's lengths: S itself up to S = 512; beyond, S = 128 for the first 5/6 of the
    steps and 512 for the rest (batch 16 and 4, as on the CPU). At long S a dense model at init
    spreads each query over S keys, and the lookup is found late or not at all (S = 256 took ~850
    steps on the CPU, S = 128 ~200); learnt at 128 and sharpened at 512 it carries over (CPU model,
    300 + 60 steps: dense accuracy 0.97 at S = 512, 1,024, 2,048 and 4,096). The lookup reads the
    query's token, not its position, so the untrained position embeddings past 512 do not matter."""
    if s.seq <= 512 or steps == 0:
        return [(s, steps)]
    long_steps = max(1, steps // 6)
    return [(dataclasses.replace(s, seq=n, batch=16 * 128 // n, queries=num_queries(n)), k)
            for n, k in ((128, steps - long_steps), (512, long_steps)) if k]


class SameWeightsCheck:
    """The step-for-step comparison at the same weights: at each of the first ``steps`` sparse
    steps, before the run's update, ``ref_fn`` (the reference backend's compiled model) computes
    the answer loss and the KL on the same weights and batch, and both selections are compared.

    Two independent training runs cannot be compared step for step beyond a few steps: the fused
    op and ``torch.topk`` compute the index scores in different kernels, so near-tied scores (a
    trained indexer has many) round differently, exactly tied ones (ReLU's zeros) go to different
    keys (docs/contract.md, "Ties"), one slot flips, the next update differs, and the runs drift
    apart whatever the rewrite does (measured at S = 8192 on an H200: the losses within
    3e-4 at step 10, 6.7% apart at step 30). At the same weights there is no drift: the losses
    must agree within ``LOSS_RTOL``, and wherever the two selections differ as sets, each must
    still be an exact top-k of the float64 index scores within fp32 rounding
    (``hyscale_compile.testing.assert_selection_equal``), i.e. the two differ only at near-ties;
    a wrong selection fails the check."""

    MAX_ROWS = 64  # differing rows validated per layer and step (float64 scores over all T keys)

    def __init__(self, ref_fn, steps: int) -> None:
        self.ref_fn, self.steps = ref_fn, steps
        self.lm: List[float] = []
        self.kl: List[float] = []
        self.rows = self.differ = self.validated = 0
        self.bad: List[str] = []
        self.seconds = 0.0
        self._aux = None

    def reference(self, model: nn.Module, ids, pos, tgt, mask, kl_on: bool) -> None:
        """The reference's losses at the current weights (its grad-mode graph, the one its own
        training run uses; nothing is updated)."""
        t0 = time.perf_counter()
        logits, auxes = self.ref_fn(ids, return_aux=True)
        with torch.no_grad():
            self.lm.append(answer_loss(logits, pos, tgt)[0].item())
            self.kl.append(float(indexer_losses(model, auxes, mask, sparse=True)) if kl_on else 0.0)
        self._aux = [(a[2].detach(), a[3].detach(), a[4]) for a in auxes]
        self.seconds += time.perf_counter() - t0

    @torch.no_grad()
    def compare(self, model: nn.Module, auxes, mask, step: int) -> None:
        """Compare the run's selections with the reference's at this step."""
        from hyscale_compile.testing import assert_selection_equal

        t0 = time.perf_counter()
        for layer, (block, mine, ref) in enumerate(zip(model.blocks, auxes, self._aux)):
            ind = getattr(block, "block", block).attn.indexer
            a, b = mine[4], ref[2]
            # as sets of visible keys: a row with fewer than k visible keys also selects hidden ones,
            # all tied at the mask's value (torch.topk takes any of them, the op the smallest
            # indices), and the attention masks them either way
            row = torch.arange(a.shape[1], device=a.device)[:, None]
            differ = (a.masked_fill(a > row, -1).sort(-1).values
                      != b.masked_fill(b > row, -1).sort(-1).values).any(-1)  # [B, S]
            self.rows += differ.numel()
            self.differ += int(differ.sum())
            where = differ.nonzero()[: self.MAX_ROWS]
            self.validated += where.shape[0]
            for bi in where[:, 0].unique().tolist():
                r = where[where[:, 0] == bi, 1]
                for name, idx, (x, q_resid) in (("hyscale", a, (mine[2], mine[3])), ("reference", b, ref[:2])):
                    iq, ik, iw = (t.double() for t in ind.projections(x[bi:bi + 1], q_resid[bi:bi + 1]))
                    iq, iw = iq[:, r], iw[:, r]
                    terms = torch.einsum("bshd,btd->bsht", iq, ik) * ind.softmax_scale
                    scores = torch.einsum("bsh,bsht->bst", iw, F.relu(terms)) + mask[r].double()
                    # fp32 rounding of the model's own score arithmetic: 64 ulps of the row's bound
                    # sum_h |w_h| |q_h| max_t |k_t| scale (Cauchy-Schwarz)
                    bound = (iw.abs() * iq.norm(dim=-1)).sum(-1) * ik.norm(dim=-1).max() * ind.softmax_scale
                    atol = 1e-5 + 64 * torch.finfo(torch.float32).eps * bound
                    try:
                        assert_selection_equal(idx[bi:bi + 1, r], scores, atol=atol, sorted=False)
                    except AssertionError as e:
                        self.bad.append(f"step {step + 1}, layer {layer + 1}, {name}: {str(e).splitlines()[0]}")
        self._aux = None
        self.seconds += time.perf_counter() - t0


def run_stage(stage: str, fn, model: nn.Module, s: Setup, steps: int, seed: int, opts, kl_on: bool = True,
              every: int = 0, near: bool = False, same: Optional[SameWeightsCheck] = None) -> Log:
    """``stage``: "dense" (answer loss, dense attention), "warmup" (indexer KL only, dense attention,
    model frozen) or "sparse" (answer loss + the indexer's sparse KL unless ``kl_on`` is False).
    ``near``: the dense stage's batches also have near queries (``make_batch``); its accuracy is
    the far queries'.
    ``opts``: the optimizers to step. Batches come from a generator seeded with ``seed``.
    ``same``: a sparse stage's step-for-step comparison at the same weights (its time is not
    counted in the stage's)."""
    gen = torch.Generator().manual_seed(seed)
    mask = causal_mask(s.seq, torch.device(s.device))
    log, every = Log(), every or max(1, steps // 10)
    t_start = time.perf_counter()

    def elapsed(since: float) -> float:  # the stage's own time, without the same-weights check's
        return time.perf_counter() - since - (same.seconds if same is not None else 0.0)

    for i in range(steps):
        ids, pos, tgt, vpos = make_batch(s, gen, near=near and stage == "dense")
        t0 = time.perf_counter() - (same.seconds if same is not None else 0.0)
        if stage == "dense":
            logits = fn(ids, dense=True)
            lm = answer_loss(logits, pos, tgt)[0]
            acc = answer_loss(logits, pos[-s.queries:], tgt[:, -s.queries:])[1]  # the far queries
            kl, loss, rec = torch.zeros(()), lm, None
        elif stage == "warmup":
            with torch.no_grad():  # the model is frozen: only the indexer's projections need grad
                logits, auxes = fn(ids, dense=True, return_aux=True)
                lm, acc = answer_loss(logits, pos, tgt)
            kl = loss = indexer_losses(model, auxes, mask, sparse=False)
            rec = answer_recall(model, auxes, mask, pos, vpos)
        else:
            if same is not None and i < same.steps:
                same.reference(model, ids, pos, tgt, mask, kl_on)
            logits, auxes = fn(ids, return_aux=True)
            if same is not None and i < same.steps:
                same.compare(model, auxes, mask, i)
            lm, acc = answer_loss(logits, pos, tgt)
            kl = indexer_losses(model, auxes, mask, sparse=True) if kl_on else torch.zeros((), device=s.device)
            loss = lm + kl if kl_on else lm
            rec = answer_recall(model, auxes, mask, pos, vpos)
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts:
            o.step()
        sync(s.device)
        if i == 0:
            log.first_step_s = elapsed(t0)
        log.lm.append(lm.item())
        log.kl.append(float(kl.detach()))
        log.acc.append(acc.item())
        if rec is not None:
            log.recall.append(rec)
        if not math.isfinite(log.lm[-1]) or not math.isfinite(log.kl[-1]):
            raise FloatingPointError(f"{stage}: loss {log.lm[-1]}, KL {log.kl[-1]} at step {i + 1}")
        if (i + 1) % every == 0 or i + 1 == steps:
            say(f"  {stage} step {i + 1}/{steps}: answer loss {log.lm[-1]:.4f}  KL {log.kl[-1]:.4f}  "
                f"acc {log.acc[-1]:.3f}" + (f"  recall@k {fmt_recall(rec)}" if rec else "")
                + f"  [{elapsed(t_start):.1f} s; total {time.perf_counter() - T_START:.0f} s]")
    log.seconds = elapsed(t_start)
    return log


def plot(logs: Dict[str, Log], path: str, title: str, chance: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say(f"matplotlib is not installed: skipping the loss-curve PNG ({path}); pip install matplotlib")
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def ema(xs, a=0.9):
        out, m = [], xs[0] if xs else 0.0
        for x in xs:
            m = a * m + (1 - a) * x
            out.append(m)
        return out

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    off = 0
    for name, color in (("dense", "tab:gray"), ("warmup", "tab:green"), ("sparse", "tab:blue")):
        lg = logs.get(name)
        if lg is None or not lg.lm:
            continue
        steps = list(range(off + 1, off + len(lg.lm) + 1))
        if name != "warmup":
            ax.plot(steps, ema(lg.lm), color=color, lw=2, label=f"answer loss, {name} (EMA 0.9)")
            ax2.plot(steps, ema(lg.acc), color=color, lw=1.5, label=f"accuracy, {name}")
        if name != "dense":
            ax.plot(steps, ema(lg.kl), color=color, lw=1, ls="--", label=f"indexer KL, {name}")
        off += len(lg.lm)
    for name, color in (("reference", "tab:orange"), ("control", "tab:red")):
        lg = logs.get(name)
        if lg is not None and lg.lm:
            start = off - len(logs["sparse"].lm)
            steps = list(range(start + 1, start + len(lg.lm) + 1))
            ax.plot(steps, ema(lg.lm), color=color, lw=1, label=f"answer loss, {name}")
            ax2.plot(steps, ema(lg.acc), color=color, lw=1, label=f"accuracy, {name}")
    ax.axhline(math.log(1 / chance), color="k", ls=":", lw=1, label="uniform guess")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7)
    ax2.axhline(chance, color="k", ls=":", lw=1, label=f"chance {chance:.3f}")
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("step")
    ax2.set_ylabel("answer accuracy (EMA 0.9)")
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    say(f"loss curves written to {path}")


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a small DSA LM and its lightning indexer (DeepSeek-V3.2's "
                                            "dense warm-up, then sparse training with the KL loss) on associative "
                                            "recall with torch.compile(backend='hyscale').")
    p.add_argument("--dense-steps", type=int, default=None,
                   help="steps of dense training before the recipe (default 300; beyond S = 512, 360: 300 at "
                        "S = 128, then 60 at 512)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="steps of the indexer's dense warm-up, model frozen (default 40; beyond S = 512, 300)")
    p.add_argument("--steps", type=int, default=None, help="steps of sparse training (default 50; beyond S = 512, 200)")
    p.add_argument("--compare-steps", type=int, default=None,
                   help="sparse steps also run under --reference, a run of its own (default: all up to S = 8192, "
                        "else 50; 0 skips); the first 50 of them are also compared at the same weights")
    p.add_argument("--near-queries", action=argparse.BooleanOptionalAction, default=False,
                   help="dense stage only: also 16 queries right after the pairs, a curriculum for long --seq "
                        "(default off)")
    p.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the control: sparse training with the indexer frozen at init (default on)")
    p.add_argument("--checkpoint", choices=("none", "full", "sac"), default="full",
                   help="activation checkpointing around each decoder block (default full; sac saves matmuls)")
    p.add_argument("--backend", choices=("hyscale", "hyscale_debug"), default=None,
                   help="hyscale (Inductor codegen) or hyscale_debug (the same passes and rewrite, graphs run without "
                        "codegen: fast compiles); default hyscale on CUDA, hyscale_debug on the CPU")
    p.add_argument("--reference", default=None,
                   help="backend the sparse stage is compared with: a torch.compile backend name, or 'off' for "
                        "--backend itself with options={'hyscale.enable': False} (the same graphs without the "
                        "rewrite); default inductor (default torch.compile) with --backend hyscale, off with "
                        "hyscale_debug")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--topk", type=int, default=None, help="keys the indexer selects per query (default seq / 32, at most 2048)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 16 at S <= 512, else 32768 // seq)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="weights/activations dtype (default fp32; the indexer and the losses compute in fp32 either way)")
    p.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate of the model (default 5e-3)")
    p.add_argument("--indexer-lr", type=float, default=3e-3, help="AdamW learning rate of the indexer (default 3e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("out", "train_dsa_loss.png"), help="loss-curve PNG")
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda was asked for, but torch.cuda.is_available() is False on this machine")
    if a.seq - num_queries(a.seq) - 2 * 16 + 1 < a.seq / 2:
        p.error(f"--seq must be at least 94 (16 pairs, then 16 queries at distance >= S/2 from them), got {a.seq}")
    long = a.seq > 512
    a.dense_steps = (360 if long else 300) if a.dense_steps is None else a.dense_steps
    # beyond S = 512 the warm-up's KL averages over S rows per sequence, of which S/32 are query
    # rows (num_queries), and a step holds 1,024 queries at any S: the same work per step, but the
    # indexer finds one key among S and the sparse model starts from a coarser selection, so both
    # stages take more steps (on the CPU, 1 query row in 32: recall@k 0.58 after 20 warm-up steps and
    # 0.92 after 100 at S = 1,024, 0.78 after 60 and rising at 2,048); a warm-up step is the
    # cheapest of the run (0.15 s at S = 8192 on an H200)
    a.warmup_steps = (300 if long else 40) if a.warmup_steps is None else a.warmup_steps
    a.steps = (200 if long else 50) if a.steps is None else a.steps
    for name in ("dense_steps", "warmup_steps", "steps"):
        if getattr(a, name) < 0 or (name == "steps" and a.steps < 1):
            p.error(f"--{name.replace('_', '-')} must be {'at least 1' if name == 'steps' else '>= 0'}, "
                    f"got {getattr(a, name)}")
    if a.topk is not None and not 1 <= a.topk <= a.seq:
        p.error(f"--topk must be in 1..--seq, got {a.topk}")
    if a.compare_steps is None:
        # at 32K the reference's dense index scores cost ~1 s a step (docs/performance.md)
        a.compare_steps = a.steps if a.seq <= 8192 else 50
    if a.compare_steps < 0:
        p.error(f"--compare-steps must be >= 0, got {a.compare_steps}")
    a.compare_steps = min(a.compare_steps, a.steps)
    if a.backend is None:
        a.backend = "hyscale" if a.device == "cuda" else "hyscale_debug"
    if a.reference is None:
        a.reference = "off" if a.backend == "hyscale_debug" else "inductor"
    return a


def main(argv=None) -> int:
    global T_START
    args = parse_args(argv)
    t_start = T_START = time.perf_counter()
    from torch._dynamo.utils import counters

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}[args.dtype]
    s = make_setup(args.seq, args.device, dtype, args.batch, args.topk)
    c = s.cfg
    say("=" * 80)
    say(f"train_dsa: DSA indexer recipe on associative recall, torch.compile(backend={args.backend!r}), "
        f"checkpoint={args.checkpoint}")
    say("=" * 80)
    say(f"torch {torch.__version__}, {torch.get_num_threads()} threads; device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    say(f"setup: {s.describe()}")
    chance = 1 / s.pairs
    qpos = torch.arange(s.seq - s.queries, s.seq, dtype=torch.float64)
    baseline = float((c.index_topk / (qpos + 1)).clamp(max=1).mean())
    say(f"task: {s.pairs} key->value pairs at positions 0..{2 * s.pairs - 1}, filler (value tokens), {s.queries} "
        f"query keys at {s.seq - s.queries}..{s.seq - 1} (distance >= {s.seq - s.queries - 2 * s.pairs + 1}); "
        f"{s.pairs} values, chance {chance:.4f}; target accuracy >= {max(0.9, 10 * chance):.3f}")
    say(f"recall@k random baseline (k / visible keys at the query rows): {baseline:.4f}")

    base = build_model(s, args.checkpoint, args.seed)
    main_p, idx_p = split_params(base)
    say(f"model: {sum(p.numel() for p in main_p):,} parameters + {sum(p.numel() for p in idx_p):,} in the lightning "
        f"indexers (which the answer loss never reaches: they run under no_grad)")

    # -- explain: the sparse stage's forward (explain resets Dynamo, so it runs first) -----------
    say("\n[1/5] hyscale_compile.explain(model, input_ids, return_aux=True): the sparse stage's training forward")
    t0 = time.perf_counter()
    peek = make_batch(s, torch.Generator().manual_seed(args.seed + 12345))
    report = hyscale_compile.explain(copy.deepcopy(base), peek[0], return_aux=True)
    say(str(report))
    say(f"      ({time.perf_counter() - t0:.1f} s)")
    if len(report.fused) != c.layers:
        say(f"WARNING: expected {c.layers} fused selection(s) (one per layer), got {len(report.fused)}: "
            f"this is a hyscale_compile bug, please report it")

    logs: Dict[str, Log] = {}
    timings: Dict[str, float] = {}
    # One model and one compiled callable for every stage: the reference and the control load
    # their weights into the same module (load_state_dict copies in place), so Dynamo compiles
    # each of the three graphs (dense, warm-up, sparse) once; only the reference backend adds one.
    model, fn = base, torch.compile(base, backend=args.backend, dynamic=False)
    main_p, idx_p = split_params(model)

    # -- stage 0: the dense model -----------------------------------------------------------------
    phases = dense_phases(s, args.dense_steps)
    say(f"\n[2/5] dense model: {args.dense_steps} step(s) of the answer loss with dense attention (lr {args.lr:g})"
        + ("" if len(phases) == 1 else ", at " + " then ".join(f"S = {p.seq} (batch {p.batch}, {n} steps)"
                                                               for p, n in phases)))
    if args.dense_steps:
        opt = adamw(main_p, args.lr)
        dl = logs["dense"] = Log()
        # no activation checkpointing here: the dense stage runs at S <= 512, where the
        # activations are small (Dynamo guards the mode; this graph is the dense stage's own anyway)
        for b in model.blocks:
            b.mode = "none"
        for i, (ps, n) in enumerate(phases):
            part = run_stage("dense", fn, model, ps, n, args.seed + 1 + 1000 * i, [opt], near=args.near_queries)
            dl.lm += part.lm
            dl.acc += part.acc
            dl.kl += part.kl
            dl.seconds += part.seconds
        timings["dense model"] = dl.seconds
        for b in model.blocks:
            b.mode = args.checkpoint
        say(f"  dense accuracy (last 10% of steps) {logs['dense'].tail(logs['dense'].acc):.3f}")
    control_state = copy.deepcopy(model.state_dict()) if args.control else None  # its indexer is still at init

    # -- stage 1: dense warm-up of the indexer --------------------------------------------------
    say(f"\n[3/5] dense warm-up: {args.warmup_steps} step(s), model frozen, indexer trained on dense_indexer_kl "
        f"(lr {args.indexer_lr:g})")
    if args.warmup_steps:
        wl = logs["warmup"] = run_stage("warmup", fn, model, s, args.warmup_steps, args.seed + 2,
                                        [adamw(idx_p, args.indexer_lr)])
        timings["warm-up"] = wl.seconds
        say(f"  warm-up KL {wl.kl[0]:.4f} -> {wl.tail(wl.kl):.4f}; recall@k per layer {fmt_recall(wl.recall[0])} "
            f"(indexer at init) -> {fmt_recall(wl.recall_tail())} (baseline {baseline:.4f})")
    warm_state = copy.deepcopy(model.state_dict()) if args.compare_steps else None

    # -- stage 2: sparse training, under both backends ----------------------------------------------
    say(f"\n[4/5] sparse training: {args.steps} step(s), answer loss (model, lr {args.lr:g}) + sparse_indexer_kl "
        f"(indexer, lr {args.indexer_lr:g})")
    ok = True
    ref_name = (f"{args.backend} with hyscale.enable=False" if args.reference == "off"
                else f"backend={args.reference!r}")
    ref_fn = same = None
    if args.compare_steps:
        # the same module under the reference backend: Dynamo keeps one graph per backend
        ref_fn = (torch.compile(model, backend=args.backend, dynamic=False, options={"hyscale.enable": False})
                  if args.reference == "off" else torch.compile(model, backend=args.reference, dynamic=False))
        same = SameWeightsCheck(ref_fn, min(50, args.compare_steps))
        say(f"  the first {same.steps} step(s) also under {ref_name} at the same weights and batches "
            f"(step-for-step check)")
    rw0 = counters["hyscale"]["rewritten"]
    sl = logs["sparse"] = run_stage("sparse", fn, model, s, args.steps, args.seed + 3,
                                    [adamw(main_p, args.lr), adamw(idx_p, args.indexer_lr)], same=same)
    timings[f"sparse ({args.backend}; first step {sl.first_step_s:.1f} s)"] = sl.seconds
    n_rw = counters["hyscale"]["rewritten"] - rw0
    if n_rw < c.layers:
        say(f"WARNING: the sparse training graph rewrote {n_rw} selection(s), expected {c.layers}: "
            f"a hyscale_compile bug, please report it")
    if same is not None:
        timings[f"step-for-step check ({same.steps} {ref_name} forwards at the same weights)"] = same.seconds
        rel = [abs(a - b) / abs(b) for a, b in zip(sl.lm, same.lm)]
        worst = max(rel)
        cmp_ok = worst <= LOSS_RTOL and not same.bad
        say(f"step-for-step check: {'PASSED' if cmp_ok else 'FAILED'}: answer loss {args.backend} vs {ref_name} "
            f"at the same weights within {LOSS_RTOL:.0%} at all of the first {len(rel)} step(s) (max relative diff "
            f"{worst:.2e}; KL max |diff| {max(abs(a - b) for a, b in zip(sl.kl, same.kl)):.2e}); selections: "
            + ("the same visible keys in every row" if not same.differ else
               f"{same.differ} of {same.rows} rows differ as sets of visible keys, {same.validated} of them checked "
               f"against float64 index scores: " + ("each side an exact top-k within fp32 rounding (near-ties)"
                                                    if not same.bad else f"{len(same.bad)} NOT an exact top-k")))
        for line in same.bad[:5]:
            say(f"      {line}")
        ok &= cmp_ok
        say(f"  the same {args.compare_steps} step(s) under {ref_name}, a run of its own (same warmed-up model, "
            f"batches)")
        model.load_state_dict(warm_state)
        rl = logs["reference"] = run_stage("sparse", ref_fn, model, s, args.compare_steps, args.seed + 3,
                                           [adamw(main_p, args.lr), adamw(idx_p, args.indexer_lr)])
        timings[f"sparse ({ref_name}; first step {rl.first_step_s:.1f} s)"] = rl.seconds
        rel = [abs(a - b) / abs(b) for a, b in zip(sl.lm, rl.lm)]
        n50 = min(50, len(rel))
        first = next((i + 1 for i, r in enumerate(rel) if r > LOSS_RTOL), None)
        say(f"independent runs (not a check): answer loss max relative diff {max(rel[:n50]):.2e} over the first "
            f"{n50} step(s), {max(rel):.2e} over all {len(rel)}; "
            + ("within 2% at every step" if first is None else
               f"first over 2% at step {first} (each run's own near-ties flip slots; the runs then drift apart)"))
        if args.compare_steps == args.steps:
            da = abs(sl.tail(sl.acc) - rl.tail(rl.acc))
            acc_ok = da <= ACC_ATOL
            say(f"final accuracy check: {'PASSED' if acc_ok else 'FAILED'}: {args.backend} {sl.tail(sl.acc):.3f}, "
                f"{ref_name} {rl.tail(rl.acc):.3f} (|diff| {da:.3f}, tolerance {ACC_ATOL})")
            ok &= acc_ok

    # -- control: the indexer frozen at init ----------------------------------------------------
    if control_state is not None:
        say(f"\n[5/5] control: {args.steps} sparse step(s) from the same dense model, indexer frozen at init (no KL)")
        model.load_state_dict(control_state)
        cl = logs["control"] = run_stage("sparse", fn, model, s, args.steps, args.seed + 3, [adamw(main_p, args.lr)],
                                         kl_on=False)
        timings["control"] = cl.seconds
    else:
        say("\n[5/5] control skipped (--no-control)")

    # -- results --------------------------------------------------------------------------------
    say("\nresults (accuracy and recall@k: means over the last 10% of a stage's steps, each on a fresh batch "
        "before its update)")
    say(f"final answer loss {sl.tail(sl.lm):.4f}, final indexer KL {sl.tail(sl.kl):.4f}")
    say(f"final answer accuracy {sl.tail(sl.acc):.3f} (chance {chance:.4f}; target {max(0.9, 10 * chance):.3f})")
    first = logs["warmup"].recall[0] if "warmup" in logs else sl.recall[0]
    say(f"recall@k per layer: before training {fmt_recall(first)}, after {fmt_recall(sl.recall_tail())} "
        f"(random baseline {baseline:.4f})")
    if "control" in logs:
        cl = logs["control"]
        say(f"control (indexer frozen at init): accuracy {cl.tail(cl.acc):.3f} (chance + 0.05 = {chance + 0.05:.4f}); "
            f"recall@k {fmt_recall(cl.recall_tail())}")
    for k, v in timings.items():
        say(f"time {k}: {v:.1f} s")
    plot(logs, args.out, f"DSA indexer recipe, associative recall: backend={args.backend}; {c.layers} layers, dim "
         f"{c.dim}, indexer {c.index_heads}x{c.index_head_dim} top-{c.index_topk}; {s.batch}x{s.seq} tokens/step, "
         f"{str(s.dtype).replace('torch.', '')}", chance)
    say(f"total {time.perf_counter() - t_start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
