"""The rewrite beyond one process: FSDP2 and context parallelism (by all-gather) on gloo
process groups, against one process (docs/distributed.md).

The tests share two spawned processes (``Ranks``: ``torch.multiprocessing``, a free port;
what differs at more ranks is only the chunk order, checked in-process); every rank
compiles (``hyscale_debug``: the same pass, no Inductor codegen), so the tests are few and
tiny. A rank's failure is re-raised
with its traceback. The single-process reference
is the same backend on one process: it breaks ties (ReLU's exact zeros) by the same rule,
so selections compare with ``torch.equal`` and losses/gradients within fp32 reassociation.
"""
from __future__ import annotations

import functools
import os
import socket
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from examples.dsa_model import DSAConfig, DSALanguageModel, SparseAttention  # noqa: E402

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build",
                allow_module_level=True)

CFG = DSAConfig(vocab=64, dim=32, layers=2, heads=2, index_heads=4, index_head_dim=8, index_topk=4,
                max_seq=32, q_lora_rank=16, mlp_hidden=32)
SEQ = 16
ATOL, RTOL = 1e-5, 1e-4  # fp32 reassociation: sums over ranks, chunked contractions


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import hyscale_compile  # noqa: F401  registers the backends in the child


class Ranks:
    """``world`` gloo ranks kept for the module's tests of that world size: a fresh process
    costs about 6 s of CPU (Python, torch, this module, the process group), more than most of
    these tests' own work. Each task starts from a reset Dynamo; a rank's failure is re-raised
    with its traceback, and the ranks are replaced (a rank left waiting in a collective)."""

    def __init__(self, world: int):
        self.world, self.procs = world, []

    def _start(self):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.results, self.tasks, port = ctx.Queue(), [ctx.SimpleQueue() for _ in range(self.world)], _free_port()
        self.procs = [ctx.Process(target=_serve, args=(r, self.world, port, self.tasks[r], self.results), daemon=True)
                      for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 600):
        import queue

        if not self.procs:
            self._start()
        for q in self.tasks:
            q.put((fn, args))
        errors, done = {}, 0
        while done < self.world:
            try:  # after a rank's failure the others may wait in a collective: a short grace
                rank, err = self.results.get(timeout=60 if errors else timeout)
            except queue.Empty:
                self.close()
                pytest.fail(f"{fn.__name__}: no answer from {self.world - done} rank(s)\n" + "\n".join(errors.values()))
            done += 1
            if err:
                errors[rank] = f"-- rank {rank}:\n{err}"
        if errors:
            self.close()
            pytest.fail(f"{fn.__name__} failed\n" + "\n".join(errors[r] for r in sorted(errors)))

    def close(self):
        for q in self.tasks if self.procs else ():
            q.put(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        self.procs = []


def _serve(rank, world, port, tasks, results):
    import traceback

    _init(rank, world, port)
    try:
        while (task := tasks.get()) is not None:
            fn, args = task
            torch._dynamo.reset()
            try:
                fn(rank, world, *args)
                results.put((rank, None))
            except BaseException:
                results.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks2():
    ranks = Ranks(2)
    yield ranks
    ranks.close()


def _model_and_data(batch=2):
    torch.manual_seed(0)
    model = DSALanguageModel(CFG)
    ids = torch.randint(0, CFG.vocab, (batch, SEQ + 1))
    return model, ids[:, :-1], ids[:, 1:]


def _op_calls(fn, name="hyscale::hytopk") -> tuple:
    """(fn's result, how many times the op ``name`` ran in it), by the profiler (a dispatch
    mode would make Dynamo run the frames eagerly)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(e.count for e in prof.key_averages() if e.key == name)


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


# ---- FSDP2 ------------------------------------------------------------------------------


def _fsdp_rank(rank, world, per_block):
    from torch.distributed.fsdp import fully_shard

    import hyscale_compile
    from hyscale_compile.passes import diagnostics

    model, ids, labels = _model_and_data(batch=world)
    ref = DSALanguageModel(CFG)
    ref.load_state_dict(model.state_dict())
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if per_block:
        for block in model.blocks:
            block.compile(backend="hyscale_debug")
        compiled = model
    else:
        compiled = torch.compile(model, backend="hyscale_debug")

    diagnostics.clear()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cref = torch.compile(ref, backend="hyscale_debug")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(2):  # the second step replays the compiled graphs with new weights
        if step == 1:  # replayed (compiled at step 0): every block ran the fused op, as in one process
            logits, fused = _op_calls(lambda: compiled(ids[rank:rank + 1]))
            _, ref_fused = _op_calls(lambda: cref(ids[rank:rank + 1]))
            assert fused == ref_fused > 0, f"rank {rank}: the fused op ran {fused} time(s), {ref_fused} in one process"
        else:
            logits = compiled(ids[rank:rank + 1])
        loss = F.cross_entropy(logits.flatten(0, 1), labels[rank].flatten())
        loss.backward()
        # one process, the whole batch: FSDP2 averages the ranks' gradients
        ref_loss = sum(F.cross_entropy(cref(ids[r:r + 1]).flatten(0, 1), labels[r].flatten())
                       for r in range(world)) / world
        ref_loss.backward()
        losses = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(losses, loss.detach())
        _close(sum(losses) / world, ref_loss.detach(), f"rank {rank} step {step} loss")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if q.grad is None:  # the indexer runs under no_grad
                assert p.grad is None, name
                continue
            _close(p.grad.full_tensor(), q.grad, f"rank {rank} step {step} grad {name}")
        opt.step(), opt.zero_grad(), ref_opt.step(), ref_opt.zero_grad()
    # the selections fused and the attention sparse: compiled per block, the causal mask is a
    # graph input, so the rows left without a visible selected key are found per call
    # (empty_row="dense"), as they are for any mask the pass cannot read at compile time
    recs = diagnostics.records() + diagnostics.attention_records()
    assert recs and all(r.rewritten for r in recs), [r.line() for r in recs]
    assert any("recomputed densely per call" in r.line() for r in diagnostics.attention_records()), \
        [r.line() for r in diagnostics.attention_records()]
    # explain under FSDP2, on this rank. The FSDP2 hooks make Dynamo compile each block as its
    # own frame (the model's forward runs eagerly), and the blocks share one graph: one site.
    # Last, and under no_grad: run before training, a forward that no backward follows leaves
    # the root's parameters unsharded, and later forwards would not see the optimizer's steps.
    with torch.no_grad():
        report = hyscale_compile.explain(model, ids[rank:rank + 1])
    assert len(report.fused) == 1 and not report.left_alone, f"rank {rank}:\n{report}"


def test_fsdp2_training_equals_one_process(ranks2):
    # per block, as FSDP2 wraps it; ``torch.compile(model)`` of the whole model compiles the
    # same block frames (the FSDP2 hooks break the model's frame), and _fsdp_rank takes it too
    ranks2.run(_fsdp_rank, True)


def _hf_fsdp_rank(rank, world):
    import copy

    from torch.distributed.fsdp import fully_shard

    from hyscale_compile.passes import diagnostics
    from tests.models.hf_models import build_deepseek_v32

    # dense MLPs (no router: an MoE's expert choice is not what this test is about)
    model, kw = build_deepseek_v32(batch=world, first_k_dense_replace=2)
    ids = kw["input_ids"]
    ref = copy.deepcopy(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    for layer in model.model.layers:  # per decoder layer, as docs/distributed.md says
        layer.compile(backend="hyscale_debug")
    for layer in ref.model.layers:
        layer.compile(backend="hyscale_debug")
    diagnostics.clear()
    loss = model(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1], use_cache=False).loss
    loss.backward()
    # on this rank, under FSDP2: the layers' selections fused and their attention sparse (HF's
    # causal mask is a graph input here, so rows without a visible selected key are found per call)
    recs = diagnostics.records() + diagnostics.attention_records()
    assert diagnostics.attention_records() and all(r.rewritten for r in recs), [r.line() for r in recs]
    # one process, the whole batch: FSDP2 averages the ranks' gradients
    ref_loss = sum(ref(input_ids=ids[r:r + 1], labels=ids[r:r + 1], use_cache=False).loss for r in range(world)) / world
    ref_loss.backward()
    losses = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(losses, loss.detach())
    _close(sum(losses) / world, ref_loss.detach(), f"rank {rank} loss")
    graded = 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:  # HF's indexer runs under no_grad
            assert p.grad is None, name
            continue
        _close(p.grad.full_tensor(), q.grad, f"rank {rank} grad {name}")
        graded += 1
    assert graded > 10, graded


def test_fsdp2_hf_deepseek_v32_training_equals_one_process(ranks2):
    from tests.models.hf_models import transformers_available

    if not transformers_available():
        pytest.skip("transformers with DeepseekV32 is not installed")
    ranks2.run(_hf_fsdp_rank)


# ---- context parallelism by all-gather ----------------------------------------------------


def test_context_parallel_bad_input_is_named():
    from hyscale_compile import distributed as hd

    with pytest.raises(ValueError, match="layout must be one of"):
        hd.context_parallel_positions(16, layout="ring")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
            hd.context_parallel_positions(16)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        hd._chunk_len(18, 2, 2)  # zigzag over 2 ranks: 4 chunks


class Gathered(nn.Module):
    """Wraps the module that makes the keys: its output, all-gathered in position order."""

    def __init__(self, inner: nn.Module, layout: str):
        super().__init__()
        self.inner, self.layout = inner, layout

    def forward(self, x):
        from hyscale_compile.distributed import context_parallel_gather

        return context_parallel_gather(self.inner(x), layout=self.layout, dim=1)


class CPAttention(SparseAttention):
    """``SparseAttention`` over gathered K/V: the example's forward, with ``T`` keys for ``s``
    local queries (its own forward assumes ``T == s``). The indexer needs no change: its
    ``k_norm`` is wrapped in ``Gathered`` and the mask it is given is ``[s, T]``."""

    layout = "contiguous"

    def forward(self, x, mask):
        from hyscale_compile.distributed import context_parallel_gather

        b, s, d = x.shape
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        kv = context_parallel_gather(self.kv_proj(x), layout=self.layout, dim=1)
        t = kv.shape[1]
        k, v = kv.view(b, t, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        topk_indices = self.indexer(x, q_resid, mask)  # [B, s, k], global key positions
        index_mask = torch.ones(b, s, t, dtype=torch.bool, device=x.device).scatter(-1, topk_indices.long(), False)
        attn_mask = mask.expand(b, s, t).masked_fill(index_mask, torch.finfo(x.dtype).min).unsqueeze(1)
        attn = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5 + attn_mask
        attn = F.softmax(attn, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj(torch.matmul(attn, v).transpose(1, 2).reshape(b, s, d))


class CPModel(DSALanguageModel):
    """The example model on this rank's query rows: positions and mask from the global positions."""

    def forward(self, input_ids, positions):
        from hyscale_compile.distributed import causal_mask

        seq_len = input_ids.shape[1] * dist.get_world_size()
        h = self.embed(input_ids) + self.pos_embed(positions)
        mask = causal_mask(positions, seq_len)
        for block in self.blocks:
            h = block(h, mask)
        return self.lm_head(self.norm(h))


def make_cp_model(model: DSALanguageModel, layout: str) -> CPModel:
    cp = CPModel(model.cfg)
    cp.load_state_dict(model.state_dict())
    for block in cp.blocks:
        block.attn.__class__ = CPAttention
        block.attn.layout = layout
        block.attn.indexer.k_norm = Gathered(block.attn.indexer.k_norm, layout)
    return cp


def _capture_indices(model):
    """Record every indexer's output (the selections) on each call."""
    seen = []
    for block in model.blocks:
        block.attn.indexer.register_forward_hook(lambda m, a, out: seen.append(out.clone()))
    return seen


@functools.lru_cache(maxsize=None)
def _cp_reference():
    """One process, the whole sequence: logits, loss, gradients and each layer's selections.
    Computed once for the module's tests (not by every rank: each rank would compile it
    again); read only."""
    model, ids, labels = _model_and_data(batch=1)
    want = _capture_indices(model)
    logits = torch.compile(model, backend="hyscale_debug")(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    torch._dynamo.reset()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return dict(logits=logits.detach(), loss=loss.detach(), grads=grads, selections=want)


def _cp_rank(rank, world, layout, ref):
    from hyscale_compile.distributed import context_parallel_positions, shard_sequence
    from hyscale_compile.passes import diagnostics

    model, ids, labels = _model_and_data(batch=1)
    cp = make_cp_model(model, layout)
    pos = context_parallel_positions(SEQ, layout=layout)
    my_ids, my_labels = shard_sequence(ids, layout=layout), shard_sequence(labels, layout=layout)
    assert torch.equal(my_ids, ids[:, pos])

    got = _capture_indices(cp)
    diagnostics.clear()
    compiled = torch.compile(cp, backend="hyscale_debug")
    logits = compiled(my_ids, pos)
    # every rank's every selection is fused: local queries over the gathered keys
    recs = diagnostics.records()
    assert recs and all(r.rewritten and r.variant != "table" for r in recs), [r.line() for r in recs]
    assert all(r.sizes.get("S") == SEQ // world and r.sizes.get("T") == SEQ for r in recs), [r.line() for r in recs]
    # the loss of the whole sequence: each rank's token sum over the global count
    loss = F.cross_entropy(logits.flatten(0, 1), my_labels.flatten(), reduction="sum") / SEQ
    loss.backward()
    for p in cp.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
    loss = loss.detach()
    dist.all_reduce(loss)

    _close(logits.detach(), ref["logits"][:, pos], f"rank {rank} logits")
    _close(loss, ref["loss"], f"rank {rank} loss")
    for (name, p), q in zip(cp.named_parameters(), ref["grads"]):
        assert (p.grad is None) == (q is None), name
        if q is not None:
            _close(p.grad, q, f"rank {rank} grad {name}")
    # selections: this rank's rows of the one-process selections, as global key positions
    assert len(got) == len(ref["selections"]) == CFG.layers
    for layer, (g, w) in enumerate(zip(got, ref["selections"])):
        assert torch.equal(g, w[:, pos]), f"rank {rank} layer {layer}: selections differ"


# zigzag on 2 ranks runs the same chunk order and key gather code as on 4 (each rank two
# chunks, r and 2W - 1 - r, put back in position order): both layouts on the module's two
# ranks, no spawn of 4 processes; the 4-rank chunk order is checked in-process below
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_context_parallel_equals_one_process(layout, ranks2):
    ranks2.run(_cp_rank, layout, _cp_reference())


def test_zigzag_chunks_cover_the_sequence_once_and_balance_the_work():
    from hyscale_compile.distributed import _chunk_order

    for world in (2, 4, 8):
        held = [_chunk_order(world, r, "zigzag") for r in range(world)]
        assert sorted(c for chunks in held for c in chunks) == list(range(2 * world)), held
        # a causal chunk j costs j + 1 key chunks: every rank holds the same causal work
        assert {sum(c + 1 for c in chunks) for chunks in held} == {2 * world + 1}, held
        assert [_chunk_order(world, r, "contiguous") for r in range(world)] == [[r] for r in range(world)]


# ---- tensor-parallel heads: a partial sum is never fused -----------------------------------


def tp_indexer(q, k, w, group):
    """A DSA indexer whose heads are split over the ranks: this rank's head sum is a partial
    score; the all-reduce makes the full one before the mask and the top-k."""
    from torch.distributed import _functional_collectives as fc

    partial = (torch.einsum("bshd,btd->bsht", q, k).relu() * w.unsqueeze(-1)).sum(2)
    scores = fc.all_reduce(partial, "sum", group)
    t = k.shape[1]
    hidden = torch.ones(q.shape[1], t, dtype=torch.bool).triu(1)
    return scores.masked_fill(hidden, float("-inf")).topk(4, dim=-1)


def _tp_rank(rank, world):
    from hyscale_compile.passes import diagnostics

    torch.manual_seed(0)
    heads = 4
    q, k, w = torch.randn(1, SEQ, heads, 8), torch.randn(1, SEQ, 8), torch.rand(1, SEQ, heads)
    mine = slice(rank * heads // world, (rank + 1) * heads // world)
    diagnostics.clear()
    with torch.no_grad():
        values, indices = torch.compile(tp_indexer, backend="hyscale_debug")(
            q[:, :, mine], k, w[:, :, mine], dist.group.WORLD)
    recs = diagnostics.records()
    # not fused: left alone, or selected from the all-reduced table (exact, that table is whole)
    assert len(recs) == 1 and (not recs[0].rewritten or recs[0].variant == "table"), [r.line() for r in recs]
    assert "_c10d_functional.all_reduce" in recs[0].reason and "partial sum" in recs[0].reason, recs[0].line()
    # the left-alone top-k is the one of the all-reduced scores: the all-heads selection
    full = (torch.einsum("bshd,btd->bsht", q, k).relu() * w.unsqueeze(-1)).sum(2)
    full = full.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    from hyscale_compile.testing import assert_selection_equal

    assert_selection_equal(indices, full, values=values)


def test_tensor_parallel_partial_head_sum_is_left_alone(ranks2):
    ranks2.run(_tp_rank)


# ---- the tiny HF DeepSeek-V3.2, unmodified -------------------------------------------------


def _hf_rank(rank, world, layout, ref_logits):
    from hyscale_compile.distributed import GatherKeysCache, causal_mask, context_parallel_positions, shard_sequence
    from hyscale_compile.passes import diagnostics
    from tests.models.hf_models import build_deepseek_v32

    model, kw = build_deepseek_v32()
    ids = kw["input_ids"]
    pos = context_parallel_positions(ids.shape[1], layout=layout)
    mask = causal_mask(pos, ids.shape[1])[None, None].expand(ids.shape[0], 1, -1, -1)
    diagnostics.clear()
    with torch.no_grad():
        logits = torch.compile(model, backend="hyscale_debug")(
            input_ids=shard_sequence(ids, layout=layout), position_ids=pos[None],
            attention_mask={"indexed_attention": mask}, cache=GatherKeysCache(layout=layout), use_cache=False).logits
    fused = [r for r in diagnostics.records() if r.rewritten]
    # both layers' indexers fused over the gathered keys (the MoE routers' top-k stay left alone)
    assert len(fused) == 2 and all(r.variant != "table" and r.sizes.get("T") == ids.shape[1]
                                   and r.sizes.get("S") == ids.shape[1] // world for r in fused), \
        [r.line() for r in diagnostics.records()]
    _close(logits, ref_logits[:, pos], f"rank {rank} logits")


def test_context_parallel_hf_deepseek_v32(ranks2):
    from tests.models.hf_models import build_deepseek_v32, transformers_available

    if not transformers_available():
        pytest.skip("transformers with DeepseekV32 is not installed")
    model, kw = build_deepseek_v32()
    with torch.no_grad():
        ref = torch.compile(model, backend="hyscale_debug")(**kw).logits
    torch._dynamo.reset()
    ranks2.run(_hf_rank, "zigzag", ref)
