"""Train a small DeepSeek-Sparse-Attention LM with ``torch.compile(backend="hyscale")``.

Run ``python examples/train_dsa.py`` (``--help`` for the flags). It

1. builds the DSA language model of ``examples/dsa_model.py`` (unmodified: nothing in it knows
   about hyscale) and wraps each decoder block in activation checkpointing,
   ``torch.utils.checkpoint.checkpoint(block, x, mask, use_reentrant=False)``
   (``--checkpoint full``, the default), or selective checkpointing that saves the projection
   matmuls (``--checkpoint sac``), or none (``--checkpoint none``);
2. prints ``hyscale_compile.explain(...)`` of one grad-enabled (training) forward: which top-k
   sites the backend rewrote into ``torch.ops.hyscale.hytopk``;
3. checks, before training, that the hyscale-compiled model's loss equals default
   ``torch.compile`` (Inductor)'s step for step for the first ``--compare-steps`` optimizer steps:
   two copies of the model with the same initial weights, the same batches, fp32, and inputs on
   which every selection is unique (see "Unique selections" below);
4. trains on a synthetic long-range task, associative recall: each sequence starts with
   key->value pairs, then filler, then queries ``key value`` for some of those keys; the loss is
   the cross-entropy of predicting the value at each query key (only those "answer positions");
5. writes a loss-curve PNG (``--out``, default ``out/train_dsa_loss.png``) and prints the final
   loss and answer accuracy.

Sizes. The default is tiny and runs on a CPU: fp32, seq 64, batch 16, 300 steps; about a minute
on 2 idle cores with cold Inductor caches (two Inductor compiles: ~30 s and ~15 s), ~20 s with warm
ones; several times that when other work shares the cores. For the real thing on a GPU::

    python examples/train_dsa.py --device cuda --seq 32768

which trains a larger configuration (dim 256, 16 indexer heads of dim 64, top-k 2048, batch 1)
in **bf16 weights** (no autocast: parameters, activations and AdamW states are bf16; the
lightning indexer upcasts q and k to fp32 before its contraction, as the HF code does, so the
selection is computed from fp32 scores). The step-for-step check then runs on the tiny fp32
configuration on the same device (at 32K tokens and k=2048, fp32 reassociation alone flips
near-tied selections, so an exact comparison there is not meaningful).

Unique selections. ``torch.topk`` breaks ties in an unspecified order while the hyscale op
resolves them to the smaller key index (docs/contract.md, "Ties" and "Equality with
eager"), so the two backends may only be compared on inputs whose selections are unique. The
setup uses 16 indexer heads (an exact-zero index score needs all 16 ReLUs to be zero, so ReLU
zero ties essentially never reach the k-th place), and before every compared step
``check_unique_selection`` recomputes every indexer's scores in float64 from the inputs that layer
actually got (forward pre-hooks on an eager forward of *both* model copies) and requires, for each
query row with more than k valid (causal) keys, that the k-th and (k+1)-th largest scores differ by
more than ``UNIQUE_SAFETY`` x the contract's fp32 error bound of a score,
``(D + H + 2) * 2^-24 * max_t sum_h |w_h| sum_d |q_hd k_td| / sqrt(D)``. Each backend's fp32
score is within that bound of the exact one, so twice the bound covers the two backends' arithmetic,
and the rest of the factor covers their layer inputs, which differ by fp32 rounding from layer 2 on.
Sequences of the batch that have such a near-tie are replaced by fresh ones (and the script says
how many); typically 1-2 of 16 are. Rows with k or fewer valid keys need no check: both backends
select all their valid keys, and the masked slots each picks on top are masked out of the
attention either way (``finfo.min`` in both masks), so downstream values are identical.
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
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dsa_model import DSAConfig, LightningIndexer, make_model  # noqa: E402

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # a plain progress line instead
    _tqdm = None

# Step-for-step check (fp32): |loss_hyscale - loss_reference| <= LOSS_ATOL + LOSS_RTOL * |loss_reference|.
# Measured differences on the default CPU setup are ~1e-7 (fp32 reassociation between two
# compiled graphs that fuse differently); a selection that differs in a single row moves the loss
# by far more (~1e-3), so this bound separates the two.
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
# A row's selection counts as unique when its k-th and (k+1)-th index scores differ by more than
# UNIQUE_SAFETY x the contract's fp32 error bound of a score (see the module docstring).
UNIQUE_SAFETY = 4.0
MAX_REDRAWS = 50


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
    pairs: int  # key->value pairs at the start of each sequence
    queries: int  # "key value" queries at the end (answer positions)
    device: str
    dtype: torch.dtype

    def same_as(self, other: "Setup") -> bool:
        return dataclasses.asdict(self) == dataclasses.asdict(other)

    def describe(self) -> str:
        c = self.cfg
        return (f"{c.layers} layers, dim {c.dim}, {c.heads} attention heads, indexer {c.index_heads} heads x dim "
                f"{c.index_head_dim}, top-k {min(c.index_topk, self.seq)}, vocab {c.vocab}; batch {self.batch} x seq "
                f"{self.seq}, {self.pairs} pairs, {self.queries} queries; "
                f"{str(self.dtype).replace('torch.', '')} on {self.device}")


def tiny_setup(device: str) -> Setup:
    """The default: a CPU-sized model where the indexer selects 16 of up to 64 keys."""
    cfg = DSAConfig(vocab=128, dim=64, layers=2, heads=4, index_heads=16, index_head_dim=16, index_topk=16,
                    max_seq=64, q_lora_rank=32, mlp_hidden=128)
    return Setup(cfg=cfg, seq=64, batch=16, pairs=4, queries=16, device=device, dtype=torch.float32)


def large_setup(seq: int, device: str, dtype: torch.dtype, batch: Optional[int]) -> Setup:
    """Long context: k = 2048 as DeepSeek-V3.2 (capped at seq / 4), 16 indexer heads of dim 64."""
    cfg = DSAConfig(vocab=1024, dim=256, layers=2, heads=4, index_heads=16, index_head_dim=64,
                    index_topk=min(2048, max(16, seq // 4)), max_seq=seq, q_lora_rank=128, mlp_hidden=512)
    pairs = max(8, min(256, seq // 128))
    return Setup(cfg=cfg, seq=seq, batch=batch or 1, pairs=pairs, queries=pairs, device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------
# data: associative recall
# --------------------------------------------------------------------------------------------
def vocab_layout(vocab: int) -> Tuple[range, range, range]:
    """Token 0 unused; then keys, values and filler tokens, disjoint ranges."""
    nk, nv = (3 * vocab) // 8, vocab // 4
    return range(1, 1 + nk), range(1 + nk, 1 + nk + nv), range(1 + nk + nv, vocab)


def make_batch(s: Setup, gen: torch.Generator, n: Optional[int] = None):
    """``ids [B, S]``, ``answer_pos [Q]`` (the query-key positions), ``targets [B, Q]`` (their values).

    Layout: ``k1 v1 k2 v2 ... kP vP | filler ... | q1 a1 q2 a2 ... qQ aQ`` with distinct keys per
    sequence, random values, and queries drawn from the sequence's pairs (without repetition when
    ``Q <= P``).
    ``n`` sequences instead of ``s.batch``.
    """
    keys_r, vals_r, fill_r = vocab_layout(s.cfg.vocab)
    B, S, P, Q = n or s.batch, s.seq, s.pairs, s.queries
    keys = torch.rand(B, len(keys_r), generator=gen).argsort(-1)[:, :P] + keys_r.start
    vals = torch.randint(vals_r.start, vals_r.stop, (B, P), generator=gen)
    ids = torch.randint(fill_r.start, fill_r.stop, (B, S), generator=gen)
    ids[:, 0:2 * P:2], ids[:, 1:2 * P:2] = keys, vals
    pick = torch.randint(0, P, (B, Q), generator=gen) if Q > P else torch.rand(B, P, generator=gen).argsort(-1)[:, :Q]
    q0 = S - 2 * Q
    ids[:, q0::2], ids[:, q0 + 1::2] = keys.gather(1, pick), vals.gather(1, pick)
    answer_pos = torch.arange(q0, S, 2)
    targets = ids[:, answer_pos + 1]
    return ids.to(s.device), answer_pos.to(s.device), targets.to(s.device)


def answer_loss(logits: torch.Tensor, answer_pos: torch.Tensor, targets: torch.Tensor):
    """Cross-entropy (fp32) and accuracy of the value predicted at each query key."""
    lg = logits[:, answer_pos].float()
    loss = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), targets.reshape(-1))
    acc = (lg.argmax(-1) == targets).float().mean()
    return loss, acc


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

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.mode == "none":
            return self.block(x, mask)
        if self.mode == "full":
            return checkpoint(self.block, x, mask, use_reentrant=False)
        return checkpoint(self.block, x, mask, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls))


def build_model(s: Setup, mode: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = make_model(s.cfg)
    model.blocks = nn.ModuleList(CheckpointedBlock(b, mode) for b in model.blocks)
    return model.to(device=s.device, dtype=s.dtype).train()


# --------------------------------------------------------------------------------------------
# unique selections (see the module docstring)
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def check_unique_selection(model: nn.Module, ids: torch.Tensor) -> Tuple[int, torch.Tensor, float]:
    """Run ``model`` eagerly on ``ids``, recompute every indexer's scores in float64 from the
    inputs it got, and return (rows checked, bool [B]: sequence has a row whose selection is
    not unique, smallest gap / margin)."""
    calls = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: calls.append((mod, args)))
             for m in model.modules() if isinstance(m, LightningIndexer)]
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    checked, bad, worst = 0, torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device), math.inf
    for mod, (x, q_resid, mask) in calls:
        b, s, _ = x.shape
        H, D, k = mod.n_heads, mod.head_dim, mod.topk
        x, q_resid = x.double(), q_resid.double()
        q = F.linear(q_resid, mod.wq_b.weight.double()).view(b, s, H, D)
        kk = F.layer_norm(F.linear(x, mod.wk.weight.double()), (D,), mod.k_norm.weight.double(),
                          mod.k_norm.bias.double(), mod.k_norm.eps)
        w = F.linear(x, mod.weights_proj.weight.double()) * H**-0.5
        logits = torch.einsum("bshd,btd->bsht", q, kk) * mod.softmax_scale
        scores = torch.einsum("bsh,bsht->bst", w, logits.relu())
        bound = torch.einsum("bsh,bsht->bst", w.abs(), torch.einsum("bshd,btd->bsht", q.abs(), kk.abs())) * mod.softmax_scale
        valid = (mask == 0).expand(b, s, s)
        rows = valid.sum(-1) > k  # rows with more than k valid keys: their selection must be unique
        if k >= s or not rows.any():
            continue
        top = scores.masked_fill(~valid, -math.inf).topk(k + 1, dim=-1).values
        gap = top[..., k - 1] - top[..., k]
        margin = UNIQUE_SAFETY * (D + H + 2) * 2.0**-24 * bound.masked_fill(~valid, 0).amax(-1)
        ratio = (gap / margin).masked_fill(~rows, math.inf)
        checked += int(rows.sum())
        bad |= (ratio <= 1).any(-1)
        worst = min(worst, float(ratio.min()))
    return checked, bad, worst


# --------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------
def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    # only parameters that get gradients: the lightning indexer runs under no_grad (as in the HF
    # port, where DeepSeek trains it with a separate KL objective that this example leaves out)
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def train_step(fn, opt, batch) -> Tuple[float, float]:
    ids, pos, tgt = batch
    loss, acc = answer_loss(fn(ids), pos, tgt)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item(), acc.item()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Progress:
    """tqdm when installed; otherwise a plain progress line (in place on a terminal)."""

    def __init__(self, total: int, initial: int, desc: str) -> None:
        self.total, self.n, self.desc = total, initial, desc
        self.bar = _tqdm(total=total, initial=initial, desc=desc, file=sys.stdout, dynamic_ncols=True,
                         mininterval=0.5) if _tqdm is not None else None
        self.tty, self.every = sys.stdout.isatty(), max(1, total // 20)

    def update(self, loss: float, acc: float, tok_s: float) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, acc {acc:.3f}, {tok_s:,.0f} tok/s", refresh=False)
            self.bar.update(1)
        elif self.tty or self.n % self.every == 0 or self.n == self.total:
            line = f"{self.desc}: step {self.n}/{self.total}  loss {loss:.4f}  acc {acc:.3f}  {tok_s:,.0f} tok/s"
            print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            print(flush=True)


def plot(losses: List[float], accs: List[float], path: str, title: str, chance_loss: float, context_acc: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say(f"matplotlib is not installed: skipping the loss-curve PNG ({path}); pip install matplotlib")
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    steps = list(range(1, len(losses) + 1))

    def ema(xs, a=0.9):
        out, m = [], xs[0]
        for x in xs:
            m = a * m + (1 - a) * x
            out.append(m)
        return out

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, lw=1, label="loss (per step)")
    ax.plot(steps, ema(losses), color="tab:blue", lw=2, label="loss (EMA 0.9)")
    ax.axhline(chance_loss, color="tab:blue", ls=":", lw=1, label=f"uniform guess over values ({chance_loss:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("answer cross-entropy")
    ax2 = ax.twinx()
    ax2.plot(steps, ema(accs), color="tab:orange", lw=1.5, label="answer accuracy (EMA 0.9)")
    ax2.set_ylabel("answer accuracy")
    ax2.axhline(context_acc, color="tab:orange", ls=":", lw=1, label=f"guess among values in context ({context_acc:.2f})")
    ax2.set_ylim(0, 1)
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, loc="upper right", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    say(f"loss curve written to {path}")


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a small DSA LM on associative recall with "
                                            "torch.compile(backend='hyscale') and activation checkpointing.")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in all, the compared ones included (default 300)")
    p.add_argument("--compare-steps", type=int, default=3,
                   help="steps checked against the reference backend before training (default 3; 0 skips)")
    p.add_argument("--checkpoint", choices=("none", "full", "sac"), default="full",
                   help="activation checkpointing around each decoder block (default full; sac saves matmuls)")
    p.add_argument("--backend", choices=("hyscale", "hyscale_debug"), default="hyscale",
                   help="hyscale (Inductor codegen) or hyscale_debug (same passes, graphs run without codegen: fast compiles)")
    p.add_argument("--reference", default=None,
                   help="backend the step-for-step check compares with (default: inductor; aot_eager with --backend hyscale_debug)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 64: the tiny CPU setup)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 16 tiny, 1 large)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="weights/activations dtype for training (default fp32 on CPU, bf16 weights on CUDA)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-2 tiny, 1e-3 large)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("out", "train_dsa_loss.png"), help="loss-curve PNG")
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda was asked for, but torch.cuda.is_available() is False on this machine")
    if a.steps < 1:
        p.error(f"--steps must be at least 1, got {a.steps}")
    if a.compare_steps < 0:
        p.error(f"--compare-steps must be >= 0, got {a.compare_steps}")
    if a.seq is not None and a.seq < 16:
        p.error(f"--seq must be at least 16, got {a.seq}")
    if a.reference is None:
        a.reference = "aot_eager" if a.backend == "hyscale_debug" else "inductor"
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    import hyscale_compile  # registers backend="hyscale" / "hyscale_debug"

    # the training setup, and the (fp32, unique-selection) setup of the step-for-step check
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}[args.dtype]
    if args.seq is None or args.seq == 64:
        train = tiny_setup(args.device)
        if args.batch:
            train.batch = args.batch
        if dtype is not None:
            train.dtype = dtype
    else:
        dt = dtype or (torch.bfloat16 if args.device == "cuda" else torch.float32)
        train = large_setup(args.seq, args.device, dt, args.batch)
    if args.lr is None:
        args.lr = 1e-2 if train.seq <= 512 else 1e-3
    small_fp32 = train.dtype == torch.float32 and train.seq <= 512
    compare = train if small_fp32 else tiny_setup(args.device)
    reuse = compare.same_as(train)  # continue training from the hyscale copy of the check
    n_cmp = min(args.compare_steps, args.steps) if reuse else args.compare_steps

    say("=" * 80)
    say(f"train_dsa: associative recall, torch.compile(backend={args.backend!r}), checkpoint={args.checkpoint}")
    say("=" * 80)
    say(f"torch {torch.__version__}, {torch.get_num_threads()} threads; device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    say(f"training setup: {train.describe()}")
    keys_r, vals_r, _ = vocab_layout(train.cfg.vocab)
    say(f"task: {train.pairs} key->value pairs at the start, filler, {train.queries} queries at the end "
        f"(answer positions {train.seq - 2 * train.queries}..{train.seq - 2}); {len(vals_r)} possible values "
        f"(uniform guess: loss {math.log(len(vals_r)):.2f}, accuracy {1 / len(vals_r):.3f})")
    if not reuse and n_cmp:
        say(f"step-for-step check setup (fp32, unique selections): {compare.describe()}")

    gen = torch.Generator().manual_seed(args.seed + 1)
    base = build_model(compare, args.checkpoint, args.seed)
    n_params = sum(p.numel() for p in base.parameters())
    n_trained = sum(p.numel() for n, p in base.named_parameters() if ".indexer." not in n)
    say(f"model: {n_params:,} parameters ({n_params - n_trained:,} in the lightning indexers, which run under "
        f"no_grad and get no gradient)")

    # -- explain: which top-k sites the backend rewrites (first: explain resets Dynamo) ---------
    say("\n[1/4] hyscale_compile.explain(model, input_ids) on a grad-enabled (training) forward"
        + (" ..." if reuse else " of the check setup's model ..."))
    t0 = time.perf_counter()
    peek = make_batch(compare, torch.Generator().manual_seed(args.seed + 12345))
    report = hyscale_compile.explain(copy.deepcopy(base), peek[0])
    say(str(report))
    say(f"      ({time.perf_counter() - t0:.1f} s)")
    if len(report.fused) != compare.cfg.layers:
        say(f"WARNING: expected {compare.cfg.layers} fused selection(s) (one per layer), got "
            f"{len(report.fused)}: this is a hyscale_compile bug, please report it")

    losses: List[float] = []
    accs: List[float] = []
    timings = {}

    # -- step-for-step check against the reference backend -------------------------------------
    hy_model = hy_fn = hy_opt = None
    if n_cmp:
        say(f"\n[2/4] step-for-step check: backend={args.backend!r} vs backend={args.reference!r}, "
            f"{n_cmp} step(s), fp32, same initial weights and batches")
        say(f"      tolerance: |loss_{args.backend} - loss_{args.reference}| <= {LOSS_ATOL:g} + {LOSS_RTOL:g} * "
            f"|loss_{args.reference}| (fp32)")
        say(f"      unique selections: on every row with more than k valid keys, the k-th and (k+1)-th index "
            f"scores (float64) differ by > {UNIQUE_SAFETY:g} x the fp32 error bound (D+H+2)*2^-24*sum_h|w_h|"
            f"sum_d|q_hd k_td|")
        ref_model, hy_model = copy.deepcopy(base), copy.deepcopy(base)
        ref_fn = torch.compile(ref_model, backend=args.reference, dynamic=False)
        hy_fn = torch.compile(hy_model, backend=args.backend, dynamic=False)
        ref_opt, hy_opt = make_optimizer(ref_model, args.lr), make_optimizer(hy_model, args.lr)
        worst_diff, ok = 0.0, True
        for i in range(n_cmp):
            ids, pos, _ = make_batch(compare, gen)
            replaced = 0
            for attempt in range(MAX_REDRAWS + 1):
                checks = [check_unique_selection(m, ids) for m in (ref_model, hy_model)]
                bad = checks[0][1] | checks[1][1]
                if not bad.any():
                    break
                if attempt == MAX_REDRAWS:
                    say(f"FAILED: sequences with near-tied selections remain after {MAX_REDRAWS} redraws")
                    return 1
                fresh = make_batch(compare, gen, n=int(bad.sum()))[0]
                ids = ids.clone()
                ids[bad] = fresh
                replaced += int(bad.sum())
            batch = (ids, pos, ids[:, pos + 1])
            t0 = time.perf_counter()
            l_ref, _ = train_step(ref_fn, ref_opt, batch)
            sync(compare.device)
            t1 = time.perf_counter()
            l_hy, a_hy = train_step(hy_fn, hy_opt, batch)
            sync(compare.device)
            t2 = time.perf_counter()
            if i == 0:
                timings[f"{args.reference}: compile + first step"] = t1 - t0
                timings[f"{args.backend}: compile + first step"] = t2 - t1
            diff = abs(l_hy - l_ref)
            tol = LOSS_ATOL + LOSS_RTOL * abs(l_ref)
            worst_diff = max(worst_diff, diff)
            ok &= diff <= tol
            say(f"      step {i + 1}: loss {args.reference} {l_ref:.7f}  {args.backend} {l_hy:.7f}  |diff| {diff:.2e} "
                f"(tol {tol:.1e}) {'ok' if diff <= tol else 'MISMATCH'}  [{t1 - t0:.1f} s, {t2 - t1:.1f} s]")
            say(f"              selections unique: {checks[0][0]} rows x 2 models checked, min gap/margin "
                f"{min(c[2] for c in checks):.1f}; {replaced} near-tied sequence(s) replaced")
            if reuse:
                losses.append(l_hy)
                accs.append(a_hy)
        pdiff = max((a - b).abs().max().item() for a, b in zip(ref_model.parameters(), hy_model.parameters()))
        if not ok:
            say(f"step-for-step check: FAILED: {args.backend} and {args.reference} losses differ by up to "
                f"{worst_diff:.2e} on unique selections; this is a hyscale_compile bug, please report it")
            return 1
        say(f"step-for-step check: PASSED: {args.backend} loss matches {args.reference} at all {n_cmp} step(s) "
            f"(max |diff| {worst_diff:.2e}, tolerance {LOSS_ATOL:g} + {LOSS_RTOL:g}*|loss|; max |param diff| "
            f"after the steps {pdiff:.2e}, AdamW turns tiny gradient differences into up to ~lr-sized ones)")
        del ref_model, ref_fn, ref_opt
    else:
        say("\n[2/4] step-for-step check skipped (--compare-steps 0)")

    # -- training ------------------------------------------------------------------------------
    if reuse and hy_model is not None:
        model, fn, opt = hy_model, hy_fn, hy_opt
        say(f"\n[3/4] training: continuing from the {args.backend} copy of the check ({len(losses)} step(s) done)")
    else:
        model = build_model(train, args.checkpoint, args.seed)
        fn, opt = torch.compile(model, backend=args.backend, dynamic=False), make_optimizer(model, args.lr)
        gen = torch.Generator().manual_seed(args.seed + 1)
        say(f"\n[3/4] training ({args.steps} steps)")
    tokens = train.batch * train.seq
    bar = Progress(args.steps, len(losses), "train")
    from torch._dynamo.utils import counters

    rewritten0 = counters["hyscale"]["rewritten"]
    train_t0, tok_s, first = time.perf_counter(), 0.0, not losses
    while len(losses) < args.steps:
        batch = make_batch(train, gen)
        t0 = time.perf_counter()
        loss, acc = train_step(fn, opt, batch)
        sync(train.device)
        dt = time.perf_counter() - t0
        if first:
            timings[f"{args.backend}: compile + first step"] = dt
            first = False
            n_rw = counters["hyscale"]["rewritten"] - rewritten0
            if n_rw < train.cfg.layers:
                say(f"WARNING: the training graph rewrote {n_rw} selection(s), expected {train.cfg.layers}: "
                    f"a hyscale_compile bug, please report it")
        else:
            tok_s = tokens / dt if tok_s == 0 else 0.9 * tok_s + 0.1 * tokens / dt
        losses.append(loss)
        accs.append(acc)
        bar.update(loss, acc, tok_s)
        if not math.isfinite(loss):
            bar.close()
            say(f"loss is {loss} at step {len(losses)}: stopping")
            return 1
    bar.close()
    train_s = time.perf_counter() - train_t0

    # -- results --------------------------------------------------------------------------------
    say("\n[4/4] results")
    tail = max(1, len(losses) // 10)
    say(f"final loss {losses[-1]:.4f} (mean of the last {tail} step(s): {sum(losses[-tail:]) / tail:.4f}; "
        f"first step {losses[0]:.4f})")
    say(f"final answer accuracy {accs[-1]:.3f} (mean of the last {tail} step(s): {sum(accs[-tail:]) / tail:.3f}; "
        f"each step's batch is fresh, measured before its update; uniform guess {1 / len(vals_r):.3f}, "
        f"guessing among the {train.pairs} values in context {1 / train.pairs:.3f})")
    for k, v in timings.items():
        say(f"time {k}: {v:.1f} s")
    say(f"time training loop: {train_s:.1f} s for {args.steps - (n_cmp if reuse else 0)} step(s); "
        f"steady state {tok_s:,.0f} tokens/s")
    c = train.cfg
    plot(losses, accs, args.out,
         f"DSA associative recall: backend={args.backend}, checkpoint={args.checkpoint}\n{c.layers} layers, dim {c.dim}, "
         f"indexer {c.index_heads}x{c.index_head_dim} top-{min(c.index_topk, train.seq)}; {train.batch}x{train.seq} "
         f"tokens/step, {str(train.dtype).replace('torch.', '')}", math.log(len(vals_r)), 1 / train.pairs)
    say(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
