"""Selection replay (passes/partition.py): under every checkpointing a user may choose,
the compiled backward holds no selection op, no top-k and no indexer score arithmetic,
and gradients equal eager."""
import functools

import pytest
import torch
import torch._functorch.config as fconfig
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import hyscale_compile  # noqa: F401
from hyscale_compile.testing import graph_text
from tests.contract import fresh_seed, input_and_param_grads

B, S, H, D, E, K = 1, 24, 8, 16, 32, 4


class Block(nn.Module):
    """An indexer (its selection feeds a gather of values) inside a residual block."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.ww, self.wv = nn.Linear(E, H * D), nn.Linear(E, D), nn.Linear(E, H), nn.Linear(E, E)

    def forward(self, x):
        # 8 heads and positive weights: exact-zero ReLU ties at the k-th score are rare
        q, k, w = self.wq(x).view(B, S, H, D), self.wk(x), self.ww(x).exp()
        s = (torch.einsum("bshd,btd->bsht", q, k).relu() * w.unsqueeze(-1)).sum(2)
        s = s + torch.full((S, S), float("-inf")).triu(K)  # row s sees keys < s + K: >= K valid keys, unique
        idx = s.topk(K, dim=-1).indices
        v = self.wv(x)
        g = torch.gather(v.unsqueeze(1).expand(B, S, S, E), 2, idx.unsqueeze(-1).expand(B, S, K, E))
        return x + g.mean(2)


def _recompute_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE


def _save_mm(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


SETUPS = {
    "no_checkpoint": (lambda blk, x: blk(x), None),
    "checkpoint": (lambda blk, x: checkpoint(blk, x, use_reentrant=False), None),
    "sac_recompute_everything": (
        lambda blk, x: checkpoint(blk, x, use_reentrant=False,
                                  context_fn=functools.partial(create_selective_checkpoint_contexts, _recompute_all)), None),
    "sac_save_matmuls": (
        lambda blk, x: checkpoint(blk, x, use_reentrant=False,
                                  context_fn=functools.partial(create_selective_checkpoint_contexts, _save_mm)), None),
    "budget_0": (lambda blk, x: blk(x), 0.0),
    "budget_0.3": (lambda blk, x: blk(x), 0.3),
    "checkpoint_budget_0": (lambda blk, x: checkpoint(blk, x, use_reentrant=False), 0.0),
}


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_backward_replays_the_selection(setup):
    run, budget = SETUPS[setup]
    torch.manual_seed(fresh_seed(setup))
    blk = Block()
    x0 = torch.randn(B, S, E)

    def grads(fn):
        return input_and_param_grads(lambda x: fn(blk, x), x0, blk)

    ref = grads(run)
    cap = []
    torch._dynamo.reset()
    with fconfig.patch(activation_memory_budget=budget if budget is not None else fconfig.activation_memory_budget):
        got = grads(torch.compile(run, backend="hyscale_debug", options={"hyscale.capture": cap}))
    fw = graph_text(next(g for k, g in cap if k == "forward").graph)
    bw = graph_text(next(g for k, g in cap if k == "backward").graph)
    assert fw.count("hyscale.hytopk") == 1
    assert "hyscale.hytopk" not in bw and "aten.topk" not in bw
    assert "aten.bmm" not in bw, "the indexer's score contraction was recomputed in the backward"
    for a, b in zip(got, ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_indices_saved_as_int32():
    """The saved activation is the op's int32 output (4 bytes per selected key)."""
    blk = Block()
    cap = []
    torch._dynamo.reset()
    x = torch.randn(B, S, E, requires_grad=True)
    torch.compile(lambda x: checkpoint(blk, x, use_reentrant=False), backend="hyscale_debug",
                  options={"hyscale.capture": cap})(x).sum().backward()
    fw = next(g for k, g in cap if k == "forward")
    out = fw.graph.find_nodes(op="output")[0]
    saved = [n for n in out.args[0] if isinstance(n, torch.fx.Node) and n.target is torch.ops.hyscale.hytopk.default]
    assert len(saved) == 1 and saved[0].meta["val"].dtype == torch.int32


def test_replay_off_recomputes_under_checkpoint():
    """``hyscale.replay=False`` (for measuring what replay saves) leaves the checkpoint
    policy in charge: the backward then selects again."""
    blk = Block()
    cap = []
    torch._dynamo.reset()
    x = torch.randn(B, S, E, requires_grad=True)
    torch.compile(lambda x: checkpoint(blk, x, use_reentrant=False), backend="hyscale_debug",
                  options={"hyscale.capture": cap, "hyscale.replay": False})(x).sum().backward()
    bw = graph_text(next(g for k, g in cap if k == "backward").graph)
    assert bw.count("hyscale.hytopk") == 1


@pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"), reason="needs torch.compiler.nested_compile_region")
@pytest.mark.parametrize("budget", [None, 0.0])
def test_replay_inside_a_nested_compile_region(budget):
    """A block compiled once and reused (``torch.compiler.nested_compile_region``, the
    invoke_subgraph path): the selection inside is rewritten, the backward subgraph holds
    no selection and no score bmm, and gradients equal eager."""
    torch.manual_seed(fresh_seed("nested_region"))
    blk = Block()
    region = torch.compiler.nested_compile_region(lambda x: blk(x))

    def run(x):
        return region(region(x))

    x0 = torch.randn(B, S, E)

    def grads(fn):
        return input_and_param_grads(fn, x0, blk)

    want = grads(run)
    cap = []
    torch._dynamo.reset()
    with fconfig.patch(activation_memory_budget=fconfig.activation_memory_budget if budget is None else budget):
        got = grads(torch.compile(run, backend="hyscale_debug", options={"hyscale.capture": cap}))
    graphs = {k: [graph_text(g.graph)] + [graph_text(m.graph) for _, m in g.named_children()]
              for k, g in cap if k in ("forward", "backward")}
    fw, bw = "\n".join(graphs["forward"]), "\n".join(graphs["backward"])
    assert "hyscale.hytopk" in fw and "aten.topk" not in fw
    assert "hyscale.hytopk" not in bw and "aten.topk" not in bw and "aten.bmm" not in bw
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-5 * max(1.0, b.abs().max().item()), rtol=1e-5)
