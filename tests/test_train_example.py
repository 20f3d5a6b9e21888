"""``examples/train_dsa.py``: the DSA indexer recipe (dense model, dense warm-up of the indexer with
its KL loss, sparse training, control) at its CPU defaults, run as a user runs it, with the debug
backend (same passes, no Inductor codegen) to keep it fast; and its two KL losses against the
paper's formula in float64."""
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_dsa.py")


def _run_example(tmp_path, *args):
    png = tmp_path / "loss.png"
    # One CPU thread: the run's numbers do not depend on the machine's core count, and beside
    # the other pytest-xdist worker on 2 cores its threads do not contend with it (2 threads
    # there took 552 s in a -n 2 run, against 51 s alone and 68 s alone at 1 thread)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(png), *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=600)  # the timeout only guards against a hang
    out = proc.stdout
    # the example exits 1 when any of its checks fails
    assert proc.returncode == 0, f"train_dsa exited {proc.returncode}\n{out[-4000:]}\n{proc.stderr[-4000:]}"
    return out, png


def test_train_dsa_meets_the_targets_and_the_control_does_not(tmp_path):
    # The CPU defaults (S = 128) with the debug backend (same passes, no Inductor codegen): the
    # whole recipe, its targets, and the control with the indexer frozen at init.
    # 20 sparse steps instead of the default 50 keep the test near a minute on one CPU thread.
    out, png = _run_example(tmp_path, "--backend", "hyscale_debug", "--steps", "20")
    tail = out[-4000:]
    # explain: both layers' indexer top-k rewritten on the sparse stage's training graph
    assert re.search(r"^hyscale: 2 top-k site\(s\): 2 fused, 0 selected from the table, 0 left alone", out, re.M), tail
    # an honest task: k/S <= 1/16 and every answer's value at distance >= S/2 from its query
    m = re.search(r"top-k (\d+) \(k/S = 1/(\d+)\).*seq (\d+),", out)
    assert m, tail
    k, inv, seq = map(int, m.groups())
    assert seq // k == inv and inv >= 16, tail
    m = re.search(r"\(distance >= (\d+)\); (\d+) values, chance (\S+);", out)
    assert m, tail
    dist, n_values, chance = int(m.group(1)), int(m.group(2)), float(m.group(3))
    assert dist >= seq // 2 and abs(chance - 1 / n_values) < 1e-4, tail
    # the sparse stage under hyscale_debug against the reference backend (the same backend with the
    # rewrite off): step for step at the same weights, the losses within 2% and every selection that
    # differs an exact top-k; then a run of its own, whose final accuracy agrees
    assert re.search(r"^step-for-step check: PASSED: answer loss hyscale_debug vs hyscale_debug with "
                     r"hyscale.enable=False at the same weights within 2% at all of the first 20 step\(s\)", out,
                     re.M), tail
    assert re.search(r"^independent runs \(not a check\): answer loss max relative diff", out, re.M), tail
    assert re.search(r"^final accuracy check: PASSED", out, re.M), tail
    # the warm-up's KL fell
    m = re.search(r"^  warm-up KL (\S+) -> (\S+);", out, re.M)
    assert m and float(m.group(2)) < 0.7 * float(m.group(1)), tail
    # the targets: accuracy >= max(0.9, 10 x chance); the indexer found the answer's key
    m = re.search(r"^final answer accuracy (\S+) ", out, re.M)
    assert m and float(m.group(1)) >= max(0.9, 10 * chance), tail
    m = re.search(r"^recall@k per layer: before training (\S+) / (\S+), after (\S+) / (\S+) "
                  r"\(random baseline (\S+)\)", out, re.M)
    assert m, tail
    r0a, r0b, r1a, r1b, base = map(float, m.groups())
    assert max(r1a, r1b) >= 0.9 and max(r1a, r1b) > 5 * base, tail
    # the control (indexer frozen at init) cannot find the key: at most chance + 0.05
    m = re.search(r"^control \(indexer frozen at init\): accuracy (\S+) ", out, re.M)
    assert m, tail
    assert float(m.group(1)) <= chance + 0.05, tail
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out
    else:
        assert png.is_file() and png.stat().st_size > 0


@pytest.mark.gpu
def test_train_dsa_learns_at_8k_on_the_gpu(tmp_path):
    # The GPU run the issue asks for, at its long-S defaults (k = S/32, S/32 queries a sequence,
    # 360 dense + 300 warm-up + 200 sparse steps, reference and control): the targets, the control,
    # the step-for-step check against default compile, within 10 minutes (expected about 4).
    t0 = time.perf_counter()
    png = tmp_path / "loss.png"
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cuda", "--seq", "8192", "--out", str(png)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    wall, out = time.perf_counter() - t0, proc.stdout
    tail = out[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert re.search(r"top-k 256 \(k/S = 1/32\).*seq 8192, 16 pairs, 256 queries", out), tail
    assert re.search(r"^step-for-step check: PASSED: answer loss hyscale vs backend='inductor' at the same weights", out,
                     re.M), tail
    assert re.search(r"^final accuracy check: PASSED", out, re.M), tail
    m = re.search(r"^final answer accuracy (\S+) ", out, re.M)
    assert m and float(m.group(1)) >= 0.9, tail
    m = re.search(r"^control \(indexer frozen at init\): accuracy (\S+) ", out, re.M)
    assert m and float(m.group(1)) <= 1 / 16 + 0.05, tail
    assert wall <= 600, f"{wall:.0f} s\n{tail}"


def _example():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_dsa

    return train_dsa


def _loss_inputs(B=2, h=3, S=11, d=4, H=5, D=6, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, h, S, d, generator=g), torch.randn(B, h, S, d, generator=g)
    iq, ik, iw = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, D, generator=g), torch.randn(B, S, H, generator=g)
    return [t.to(dtype).requires_grad_(i >= 2) for i, t in enumerate((q, k, iq, ik, iw))]


def _dense_kl_float64(q, k, iq, ik, iw, mask, attn_scale, index_scale):
    """The paper's formula on full tables, in float64: mean_t KL(p_t || softmax(I_t))."""
    q, k, iq, ik, iw, mask = (t.double() for t in (q, k, iq, ik, iw, mask))
    valid = mask == 0
    logits = (q @ k.transpose(-1, -2) * attn_scale).masked_fill(~valid, -math.inf)
    p = logits.softmax(-1).sum(1)
    p = p / p.sum(-1, keepdim=True)
    scores = torch.einsum("bsh,bsht->bst", iw, torch.relu(torch.einsum("bshd,btd->bsht", iq, ik) * index_scale))
    logq = scores.masked_fill(~valid, -math.inf).log_softmax(-1)
    kl = torch.where(valid, p * (torch.log(p.clamp_min(1e-300)) - logq.masked_fill(~valid, 0)), 0.0)
    return kl.sum() / (iq.shape[0] * iq.shape[1])


def test_dense_indexer_kl_matches_float64_formula_and_gradient():
    t = _example()
    mask = t.causal_mask(11, torch.device("cpu"))
    for seed in range(3):
        q, k, iq, ik, iw = _loss_inputs(seed=seed)
        ref = _dense_kl_float64(q, k, iq, ik, iw, mask, 0.5, 0.4)
        ref_grads = torch.autograd.grad(ref, (iq, ik, iw))
        got = t.dense_indexer_kl(q, k, iq, ik, iw, 0.5, 0.4)
        grads = torch.autograd.grad(got, (iq, ik, iw))
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # b: the float64 gradient, cast back


def test_sparse_indexer_kl_over_every_key_is_the_dense_loss():
    # Selecting every key (the causally invalid ones as masked slots, as a top-k of a short row
    # picks them) must give the dense loss: the masked slots count in neither distribution (the
    # slot loss's 1e-10 inside the logs moves it by far less than the tolerance).
    t = _example()
    S = 11
    mask = t.causal_mask(S, torch.device("cpu"))
    q, k, iq, ik, iw = _loss_inputs()
    g = torch.Generator().manual_seed(5)
    idx = torch.rand(2, S, S, generator=g).argsort(-1).to(torch.int32)  # every key, in a shuffled order
    dense = t.dense_indexer_kl(q, k, iq, ik, iw, 0.5, 0.4)
    sparse = t.sparse_indexer_kl(q, k, iq, ik, iw, idx, mask, 0.5, 0.4, chunk=4)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(sparse, (iq, ik, iw)), torch.autograd.grad(dense, (iq, ik, iw))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # a k-slot selection with rows shorter than k: finite, and zero gradient to unselected keys
    idx4 = torch.arange(4, dtype=torch.int32).expand(2, S, 4).contiguous()
    loss = t.sparse_indexer_kl(q, k, iq, ik, iw, idx4, mask, 0.5, 0.4)
    gk = torch.autograd.grad(loss, ik)[0]
    assert torch.isfinite(loss) and torch.isfinite(gk).all()
    assert (gk[:, 4:] == 0).all() and (gk[:, 1:4] != 0).any()


def test_gpu_sized_defaults_keep_the_task_honest(capsys):
    # --seq 8192 / 32768 (the GPU runs): k/S <= 1/16 (S/32), the answers at distance >= S/2, and
    # a dense stage at S = 128 then 512 (16 queries there); a --seq too short for the distance is
    # refused. Beyond S = 512 a sequence holds S/32 queries, so the query rows keep a 1/32 share of
    # the warm-up's KL and a step 1,024 answers at every S (with a fixed 16, at S = 8192 the
    # warm-up's recall@k stalled near 0.58 and the run ended at accuracy 0.68 on an H200).
    t = _example()
    for seq, batch, compare in ((8192, 4, 200), (32768, 1, 50)):
        a = t.parse_args(["--seq", str(seq), "--device", "cpu"])
        s = t.make_setup(seq, "cpu", None, None)
        assert s.cfg.index_topk == seq // 32 and s.batch == batch and s.dtype == torch.float32
        assert s.queries == seq // 32 and s.batch * s.queries == 1024
        assert seq - s.queries - 2 * s.pairs + 1 >= seq // 2
        assert (a.backend, a.reference) == ("hyscale_debug", "off")
        assert (a.dense_steps, a.warmup_steps, a.steps, a.compare_steps) == (360, 300, 200, compare)
        assert [(p.seq, p.batch, p.queries, n) for p, n in t.dense_phases(s, a.dense_steps)] == [
            (128, 16, 16, 300), (512, 4, 16, 60)]
    for seq in (94, 128, 512):
        s = t.make_setup(seq, "cpu", None, None)
        assert s.queries == 16 and seq - s.queries - 2 * s.pairs + 1 >= seq / 2
    s = t.make_setup(128, "cpu", None, None)
    assert [(p.seq, n) for p, n in t.dense_phases(s, 300)] == [(128, 300)] and s.cfg.index_topk == 4
    # (the argument parser's own exit, in this process: a fresh one costs more than the test)
    with pytest.raises(SystemExit) as exit_:
        t.parse_args(["--seq", "80"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--seq must be at least 94" in err, err[-2000:]


def test_same_weights_check_flags_a_selection_that_is_not_a_top_k():
    # The step-for-step check compares the two backends' selections at the same weights: rows whose
    # visible keys agree pass untouched; a row whose selection is not a top-k of the float64 index
    # scores (here: one selected key swapped for the row's lowest-scored visible key) is reported.
    t = _example()
    s = t.make_setup(128, "cpu", None, 2)
    model = t.build_model(s, "none", 0)
    ids = t.make_batch(s, torch.Generator().manual_seed(0))[0]
    mask = t.causal_mask(s.seq, torch.device("cpu"))
    with torch.no_grad():
        _, auxes = model(ids, return_aux=True)
    chk = t.SameWeightsCheck(None, 1)
    chk._aux = [(a[2], a[3], a[4].clone()) for a in auxes]
    chk.compare(model, auxes, mask, 0)
    assert chk.differ == 0 and chk.validated == 0 and not chk.bad and chk.rows == 2 * 2 * s.seq
    # rows with fewer than k visible keys also select hidden keys, in any order: not a difference
    ref = [(a[2], a[3], a[4].clone()) for a in auxes]
    ref[0][2][:, 1] = torch.tensor([1, 0, 3, 2], dtype=torch.int32)  # row 1: keys 0, 1 visible
    chk._aux = ref
    chk.compare(model, auxes, mask, 0)
    assert chk.differ == 0 and not chk.bad
    # layer 2, batch row 1, query row 100: the last selected key replaced by the lowest-scored one
    attn = model.blocks[1].block.attn
    iq, ik, iw = attn.indexer.projections(auxes[1][2], auxes[1][3])
    with torch.no_grad():
        scores = t._index_scores(iq, ik, iw, attn.indexer.softmax_scale)[1, 100, :101]
    worst = int(scores.argmin())
    ref = [(a[2], a[3], a[4].clone()) for a in auxes]
    assert worst not in ref[1][2][1, 100].tolist()
    ref[1][2][1, 100, -1] = worst
    chk._aux = ref
    chk.compare(model, auxes, mask, 4)
    assert chk.differ == 1 and chk.validated == 1, (chk.differ, chk.validated)
    assert len(chk.bad) == 1 and chk.bad[0].startswith("step 5, layer 2, reference: assert_selection_equal: row (0, 0)")
