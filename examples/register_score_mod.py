"""Teach the backend a variant it does not know: a soft-capped indexer.

The indexer below scores keys like DSA's, but caps every head's logit with
``cap * tanh(s / cap)`` (Gemma-style soft-capping) instead of a ReLU, and trains its
head weights through an NSA-style gate over the selected scores. ``tanh`` is not a step
the matcher knows, so out of the box the site is not fused: it is selected from the score
table the graph materializes (``explain`` says why and what to do); one
``register_score_mod`` call later it is rewritten into the fused op, the cap compiled into
the generated kernel, with its backward at the k selected keys.

    python examples/register_score_mod.py            # CPU, a few seconds
    python examples/register_score_mod.py --device cuda --seq 8192

Prints the two ``explain`` reports, then checks that the compiled model's outputs and
gradients equal eager.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn

import hyscale_compile

CAP = 30.0


class SoftCappedIndexer(nn.Module):
    """Selects k keys per query with a soft-capped, head-weighted score; returns the gated
    mean of the selected values."""

    def __init__(self, dim: int = 64, heads: int = 8, head_dim: int = 32, topk: int = 16):
        super().__init__()
        self.heads, self.head_dim, self.topk = heads, head_dim, topk
        self.wq = nn.Linear(dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, head_dim, bias=False)
        self.ww = nn.Linear(dim, heads, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k = self.wk(x)
        scores = torch.einsum("bshd,btd->bsht", q, k) * self.head_dim**-0.5
        scores = CAP * torch.tanh(scores / CAP)  # the soft cap: unknown to the matcher
        scores = (scores * self.ww(x).sigmoid().unsqueeze(-1)).sum(2)
        # each query sees the keys before it plus `topk` more: every row has >= k keys
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(self.topk)
        scores = scores.masked_fill(causal, float("-inf"))
        vals, idx = scores.topk(self.topk, dim=-1)
        v = self.wv(x)
        picked = torch.gather(v.unsqueeze(1).expand(b, s, s, v.shape[-1]), 2,
                              idx.unsqueeze(-1).expand(b, s, self.topk, v.shape[-1]))
        return x + (vals.softmax(-1).unsqueeze(-1) * picked).sum(2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    if args.seq < 32:
        p.error("--seq must be at least 32")

    torch.manual_seed(0)
    model = SoftCappedIndexer().to(args.device)
    x = torch.randn(2, args.seq, 64, device=args.device)

    print("== before registration ==")
    print(hyscale_compile.explain(model, x))

    hyscale_compile.register_score_mod("softcap30", lambda s: CAP * torch.tanh(s / CAP))
    print("\n== after register_score_mod('softcap30', lambda s: 30 * tanh(s / 30)) ==")
    report = hyscale_compile.explain(model, x)
    print(report)
    if len(report.fused) != 1:
        print("expected the selection to be fused", file=sys.stderr)
        return 1

    def step(fn):
        xx = x.clone().requires_grad_(True)
        out = fn(xx)
        out.pow(2).mean().backward()
        grads = [xx.grad] + [p_.grad.clone() for p_ in model.parameters()]
        model.zero_grad()
        return out.detach(), grads

    want = step(model)
    torch._dynamo.reset()
    got = step(torch.compile(model, backend="hyscale"))
    out_err = (got[0] - want[0]).abs().max().item()
    grad_err = max((a - b).abs().max().item() for a, b in zip(got[1], want[1]))
    ok = out_err <= 1e-4 and grad_err <= 1e-4
    print(f"\ncompiled (backend='hyscale') vs eager: max |out diff| {out_err:.2e}, "
          f"max |grad diff| {grad_err:.2e}: {'equal' if ok else 'DIFFERENT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
