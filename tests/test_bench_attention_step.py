"""benchmarks/bench_attention_step.py's peak breakdown (``--mem-breakdown``) on a synthetic
allocator trace: the allocations live at the trace's peak, largest first, each named by
its first frame in hyscale / Inductor's code / transformers."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_attention_step as bench  # noqa: E402


def _ev(action, addr, size, fn="torch/_ops.py", line=1):
    return {"action": action, "addr": addr, "size": size,
            "frames": [{"filename": "/x/torch/_ops.py", "line": 9, "name": "__call__"},
                       {"filename": fn, "line": line, "name": "f"}]}


def test_peak_breakdown_lists_what_is_live_at_the_peak():
    trace = [_ev("alloc", 1, 100, "/x/hyscale_compile/lowerings/attention_backward.py", 7),
             _ev("alloc", 2, 50, "/tmp/torchinductor_root/ab/cab.py", 3),
             _ev("free_requested", 2, 50), _ev("free_completed", 2, 50),
             _ev("alloc", 3, 70),  # peak: 1 and 3 live (170)
             _ev("free_requested", 1, 100),
             _ev("alloc", 4, 60)]  # 130: below the peak
    got = bench.peak_breakdown({"device_traces": [[], trace]}, top=5)
    assert got == [(100, "attention_backward.py:7 f"), (70, "_ops.py:9 __call__")]
    assert bench.peak_breakdown({"device_traces": [[]]}) == []


def _hf_tiny():
    pytest.importorskip("transformers")
    from tests.models import hf_models as HF

    if not HF.transformers_available():
        pytest.skip("transformers without DeepseekV32")
    return bench.build(32, 4, True, "cpu", "eager")


def test_train_step_adds_the_indexer_losses():
    """--indexer-loss sparse's step (eager here): the LM loss plus every layer's indexer loss,
    the indexers trained by them alone, the model's LM loss unchanged, the list emptied."""
    import torch
    from tests.models import hf_indexer_loss as R

    model, vocab = _hf_tiny()
    ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(0))
    lm = bench.step_fn(model, "train")(ids)
    ix = [layer.self_attn.indexer.wq_b.weight for layer in model.model.layers]
    assert all(w.grad is None for w in ix)  # HF's indexer selects under no_grad
    model.zero_grad(set_to_none=True)
    losses = R.attach_indexer_losses(model)
    total = bench.step_fn(model, "train", losses)(ids)
    assert losses == []
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in ix)
    out = model(ids, labels=ids, use_cache=False)
    assert len(losses) == 2  # one a layer
    torch.testing.assert_close(out.loss, lm)  # the recipe's selection is HF's
    torch.testing.assert_close(total, lm + sum(losses))
    assert all(0 < x.item() < 10 for x in losses)
    with pytest.raises(TypeError, match="DeepseekV32ForCausalLM"):
        R.attach_indexer_losses(torch.nn.Linear(2, 2))


def test_indexer_loss_state_and_arguments():
    from hyscale_compile.passes.indexer_loss import LossRecord

    sparse = LossRecord("i", "s", True, backward="sparse")
    assert bench.indexer_loss_state([sparse, sparse]) == "sparse 2/2"
    assert bench.indexer_loss_state([sparse, LossRecord("i", "s", True)]) == "sparse 2/2 (backward dense)"
    assert bench.indexer_loss_state([sparse, LossRecord("i", "s", False, "why")]) == "sparse 1/2"
    assert bench.indexer_loss_state([LossRecord("i", "s", False, "why")]) == "DENSE 0/1: why"
    assert bench.indexer_loss_state([]).startswith("DENSE")
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--mode", "prefill", "--indexer-loss", "sparse"])
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--mode", "train", "--model", "glm_moe_dsa", "--indexer-loss", "sparse"])
