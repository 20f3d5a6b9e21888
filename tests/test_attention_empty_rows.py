"""``empty_row="dense"``: an index mask that hides the unselected keys with a finite value
(finfo.min), rewritten where no compile-time proof shows every row keeps a visible selected
key (the causal mask passed in as an input, HF padding masks). The op recomputes the rows
without one densely, as the original (lowerings/attention_reference.py,
``dense_rows_forward``; the backward ``attention_backward.dense_rows_backward``).

Numerics as docs/contract.md: err(op) <= 2 err(orig) + 2 eps(dtype) against the float64
original, err = max |x - ref| / max |ref|, orig the same original in the op's dtype."""
import dataclasses

import pytest
import torch

import hyscale_compile  # noqa: F401
from hyscale_compile.lowerings import attention_ops  # noqa: F401  registers the ops
from hyscale_compile.lowerings.attention_reference import flagged_rows
from hyscale_compile.lowerings.attention_spec import AttentionSpec
from hyscale_compile.lowerings.spec import MaskTerm, SpecError
from hyscale_compile.passes import diagnostics
from tests.contract import fresh_seed

B, S, T, H, HK, D, DV, K = 2, 12, 12, 4, 2, 8, 6, 4
SCALE = D ** -0.5


def err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def _spec(dtype, replaces, fill):
    post = (("mul", SCALE), ("mask", 0))
    # replaces: HF's mask.masked_fill(~selected, fill) added (the fill replaces the mask term at
    # the unselected keys); else full(fill).scatter(idx, 0) added after the mask
    return AttentionSpec(name="test", post=post, masks=(MaskTerm(kind="add", operand=0),),
                         out_dtype=str(dtype).split(".")[-1], empty_row="dense",
                         dense_fill=(fill, 1 if replaces else 2, replaces))


def _case(seed, dtype):
    """q, k, v, idx and an additive [B, S, T] mask (0 visible, finfo(dtype).min hidden, -inf
    for some) with rows of every kind: ordinary (a visible selected key), padding (every key
    hidden), selected keys all hidden by finfo.min while unselected ones are visible, and
    selected keys all hidden by -inf (the original then averages the unselected keys)."""
    gen = torch.Generator().manual_seed(seed)
    fmin = torch.finfo(dtype).min
    q = torch.randn(B, S, H, D, generator=gen)
    k = torch.randn(B, T, HK, D, generator=gen)
    v = torch.randn(B, T, HK, DV, generator=gen)
    idx = torch.stack([torch.stack([torch.randperm(T, generator=gen)[:K] for _ in range(S)]) for _ in range(B)])
    t = torch.arange(T)
    amask = torch.where(t[None, :] <= torch.arange(S)[:, None], 0.0, fmin).expand(B, S, T).clone()
    for b in range(B):  # ordinary rows select their own (visible) diagonal key
        for s in range(S):
            if s not in idx[b, s].tolist():
                idx[b, s, 0] = s
    amask[0, :3] = fmin  # padding: rows that see no key at all
    sel = torch.zeros(B, S, T, dtype=torch.bool).scatter(-1, idx, True)
    amask[1, 5] = torch.where(sel[1, 5], fmin, 0.0)  # only unselected keys visible
    amask[1, 7] = torch.where(sel[1, 7], -torch.inf, 0.0)  # selected keys hidden with -inf
    amask[1, 8] = torch.where(sel[1, 8], -torch.inf, torch.where(t % 2 == 0, fmin, 0.0))  # some finfo.min
    return q.to(dtype), k.to(dtype), v.to(dtype), idx, amask.to(dtype)


def _original(q, k, v, idx, amask, replaces, fill, dtype):
    """The dense original in ``dtype`` (float64: the reference): HF's eager attention."""
    q, k, v, amask = q.to(dtype), k.to(dtype), v.to(dtype), amask.to(dtype)
    G = H // HK
    kk, vv = k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)
    s = torch.einsum("bshd,bthd->bhst", q, kk) * SCALE
    unsel = torch.ones(B, S, T, dtype=torch.bool).scatter(-1, idx, False)
    if replaces:
        y = s + amask.masked_fill(unsel, fill)[:, None]
    else:
        y = s + amask[:, None] + torch.zeros(B, S, T, dtype=dtype).masked_fill(unsel, fill)[:, None]
    p = torch.softmax(y, -1, dtype=torch.float32 if dtype != torch.float64 else dtype).to(dtype)
    return torch.einsum("bhst,bthd->bshd", p, vv)


def _op(q, k, v, idx, amask, spec):
    return torch.ops.hyscale.sparse_attention(q, k, v, idx, [amask], spec.to_json())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("replaces", [True, False])
@pytest.mark.parametrize("i", range(5))
def test_op_recomputes_rows_without_a_visible_selected_key(i, replaces, dtype):
    seed = fresh_seed(f"empty_rows[{i},{replaces},{dtype}]")
    q, k, v, idx, amask = _case(seed, dtype)
    fill = torch.finfo(dtype).min
    spec = _spec(dtype, replaces, fill)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse, _ = _op(*leaves, idx, amask, spec)
    flagged = flagged_rows(lse, spec)
    assert flagged[0, :3].all() and flagged[1, 5].all() and flagged[1, 7].all() and flagged[1, 8].all()
    assert not flagged[0, 3:].any() and not flagged[1, :5].any()
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    grads = torch.autograd.grad(out, leaves, go.to(dtype))
    results = {}
    for dt in (dtype, torch.float64):
        ls = [x.detach().to(dt).requires_grad_(True) for x in (q, k, v)]
        o = _original(*ls, idx, amask, replaces, fill, dt)
        results[dt] = (o, *torch.autograd.grad(o, ls, go.to(dt)))
    eps = torch.finfo(dtype).eps
    for name, a, orig, ref in zip(("out", "gq", "gk", "gv"), (out, *grads), results[dtype], results[torch.float64]):
        assert torch.isfinite(a).all(), name
        e, eo = err(a, ref), err(orig, ref)
        assert e <= 2 * eo + 2 * eps, (name, e, eo)
    # the padding rows' q gets the original's gradient (the fill's add passes it), not none
    assert grads[0][0, :3].abs().amax() > 0
    # the other rows are the sparse op's, bit for bit
    sparse, _, _ = _op(q, k, v, idx, amask, dataclasses.replace(spec, empty_row="nan", dense_fill=()))
    keep = ~flagged.unsqueeze(-1).expand_as(out)
    assert torch.equal(out.detach()[keep], sparse[keep])


def test_probs_and_lse_of_a_recomputed_row():
    """probs: the original's probability at each selected key, summed over the heads; lse:
    the log-sum-exp over every key (a padding row: finfo.min, the backward's flag)."""
    q, k, v, idx, amask = _case(0, torch.float32)
    fill = torch.finfo(torch.float32).min
    spec = _spec(torch.float32, True, fill)
    out, lse, probs = torch.ops.hyscale.sparse_attention(q, k, v, idx, [amask], spec.to_json(), True)
    torch.testing.assert_close(probs[0, :3], torch.full((3, K), H / T))  # a uniform mean over T keys
    assert (probs[1, 7] == 0).all()  # its selected keys are -inf: the original averages the others
    assert (lse[0, :3] <= fill / 4).all() and flagged_rows(lse, spec, backward=True)[0, :3].all()
    torch.testing.assert_close(out[0, 0], v.repeat_interleave(H // HK, 2)[0].mean(0))


def test_spec_dense_fill_round_trips_and_is_validated():
    spec = _spec(torch.float32, True, torch.finfo(torch.float32).min)
    again = AttentionSpec.from_json(spec.to_json())
    assert again == spec and '"empty_row":"dense"' in spec.to_json()
    assert "dense_fill" not in dataclasses.replace(spec, empty_row="nan", dense_fill=()).to_json()
    for bad, what in ((dataclasses.replace(spec, dense_fill=()), "needs dense_fill"),
                      (dataclasses.replace(spec, dense_fill=(float("-inf"), 1, True)), "finite negative"),
                      (dataclasses.replace(spec, dense_fill=(-1e38, 0, True)), "not a mask step"),
                      (dataclasses.replace(spec, dense_fill=(-1e38, 0, False)), "only 'round' steps"),
                      (dataclasses.replace(spec, dense_fill=(-1e38, 3, False)), "step index"),
                      (dataclasses.replace(spec, empty_row="nan"), "only empty_row='dense' reads it")):
        with pytest.raises(SpecError, match=what):
            bad.validate()


# ---------------------------------------------------------------------------------------
# the pass: the causal mask as an input (a per-block compile, as FSDP2 runs it), padding


def _block_and_mask(seed):
    from examples.dsa_model import DSAConfig, causal_mask, make_model

    torch.manual_seed(seed)
    cfg = DSAConfig(layers=1, max_seq=16, index_topk=4)
    block = make_model(cfg).blocks[0]
    x = torch.randn(2, 16, cfg.dim)
    return block, x, causal_mask(16, x.device)


def _compiled(fn):
    torch._dynamo.reset()
    diagnostics.clear()
    return torch.compile(fn, backend="hyscale_debug", fullgraph=True)


def _records():
    return diagnostics.attention_records()


@pytest.mark.parametrize("padded", [False, True])
def test_block_with_the_mask_as_an_input_is_rewritten_and_exact(padded):
    """A decoder block compiled alone gets the causal mask as an input: no compile-time
    proof; rewritten with the rows recomputed at run time. With HF-style padding (fully
    masked query rows) too. Forward and gradients equal eager."""
    seed = fresh_seed(f"block_mask_input[{padded}]")
    block, x, mask = _block_and_mask(seed)
    mask = mask.expand(2, 16, 16).clone()
    if padded:
        mask[0, :5] = torch.finfo(torch.float32).min  # left padding: rows 0..4 see no key
        mask[1, :, 12:] = torch.finfo(torch.float32).min  # right padding keys
    c = _compiled(block)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    outs = [c(xs[0], mask), block(xs[1], mask)]
    recs = _records()
    assert len(recs) == 1 and recs[0].rewritten, [r.line() for r in recs]
    assert "recomputed densely" in recs[0].line()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    go = torch.randn_like(outs[1])
    g0 = torch.autograd.grad(outs[0], [xs[0], *block.parameters()], go, allow_unused=True)
    g1 = torch.autograd.grad(outs[1], [xs[1], *block.parameters()], go, allow_unused=True)
    for a, b in zip(g0, g1):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_option_off_keeps_the_site_dense():
    block, x, mask = _block_and_mask(0)
    torch._dynamo.reset()
    diagnostics.clear()
    c = torch.compile(block, backend="hyscale_debug", options={"hyscale.sparse_attention": False})
    with torch.no_grad():
        torch.testing.assert_close(c(x, mask), block(x, mask))
    recs = _records()
    assert len(recs) == 1 and not recs[0].rewritten and "sparse_attention=False" in recs[0].reason


# ---------------------------------------------------------------------------------------
# CUDA: the Triton kernels with the PyTorch fix-up around them


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("replaces", [True, False])
def test_cuda_op_recomputes_rows_without_a_visible_selected_key(replaces, dtype):
    seed = fresh_seed(f"empty_rows_cuda[{replaces},{dtype}]")
    q, k, v, idx, amask = _case(seed, dtype)
    fill = torch.finfo(dtype).min
    spec = _spec(dtype, replaces, fill)
    go = torch.randn(B, S, H, DV, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    res = {}
    for dev in ("cpu", "cuda"):
        leaves = [x.to(dev).clone().requires_grad_(True) for x in (q, k, v)]
        out, lse, _ = _op(*leaves, idx.to(dev), amask.to(dev), spec)
        res[dev] = (out, *torch.autograd.grad(out, leaves, go.to(dev)))
    ls = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    o = _original(*ls, idx, amask, replaces, fill, torch.float64)
    ref = (o, *torch.autograd.grad(o, ls, go.double()))
    lo = [x.detach().requires_grad_(True) for x in (q, k, v)]
    oo = _original(*lo, idx, amask, replaces, fill, dtype)
    orig = (oo, *torch.autograd.grad(oo, lo, go))
    eps = torch.finfo(dtype).eps
    for name, a, b, r in zip(("out", "gq", "gk", "gv"), res["cuda"], orig, ref):
        assert err(a.cpu(), r) <= 2 * err(b, r) + 2 * eps, name
    # deterministic: a second run gives the same bits
    leaves = [x.cuda().clone().requires_grad_(True) for x in (q, k, v)]
    out, _, _ = _op(*leaves, idx.cuda(), amask.cuda(), spec)
    again = (out, *torch.autograd.grad(out, leaves, go.cuda()))
    assert all(torch.equal(a, b) for a, b in zip(again, res["cuda"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_recomputes_every_block():
    """Inside a CUDA graph capture the flagged rows cannot be read on the host: every block is
    computed densely and the unflagged rows kept (``dense_blocks``); the replayed graph gives
    eager's bits, also after the mask changes which rows are flagged."""
    seed = fresh_seed("empty_rows_cuda_graph")
    q, k, v, idx, amask = (x.cuda() for x in _case(seed, torch.float32))
    spec = _spec(torch.float32, True, torch.finfo(torch.float32).min)
    static = amask.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _op(q, k, v, idx, static, spec)  # warm-up (kernel builds) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse, _ = _op(q, k, v, idx, static, spec)
    for mask in (amask, torch.where(torch.rand_like(amask) < 0.5, torch.finfo(torch.float32).min, amask)):
        static.copy_(mask)
        graph.replay()
        want, want_lse, _ = _op(q, k, v, idx, mask, spec)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("replaces", [True, False])
def test_triton_wrappers_recompute_the_same_rows(replaces):
    """The launch wrappers (forward and backward) under TRITON_INTERPRET=1: the kernels' rows
    with the flagged ones recomputed around them, as the CPU path."""
    from hyscale_compile.lowerings.attention_backward import attention_backward, attention_delta
    from hyscale_compile.lowerings.triton_attention import sparse_attention_triton
    from hyscale_compile.lowerings.triton_attention_backward import attention_backward_triton

    seed = fresh_seed(f"empty_rows_triton[{replaces}]")
    q, k, v, idx, amask = _case(seed, torch.float32)
    spec = _spec(torch.float32, replaces, torch.finfo(torch.float32).min)
    out, lse, probs = sparse_attention_triton(q, k, v, idx, [amask], spec, return_probs=True)
    ref = torch.ops.hyscale.sparse_attention(q, k, v, idx, [amask], spec.to_json(), True)
    for a, b in zip((out, lse, probs), ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    delta = attention_delta(go, out, lse)
    got = attention_backward_triton(go, q, k, v, idx, [amask], delta, lse, spec)
    want = attention_backward(go, q, k, v, idx, [amask], delta, lse, spec)
    assert flagged_rows(lse, spec).any()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_hf_v32_with_a_padding_mask_is_rewritten_and_exact():
    """HF DeepSeek-V3.2 (eager, tiny) with a left-padded sequence: the padding reaches the
    attention as a tensor mask, so no compile-time proof; the attention is rewritten, the
    padded rows recomputed at run time, and the logits and gradients are eager's."""
    from tests.models import hf_models

    if not hf_models.transformers_available():
        pytest.skip("transformers==5.24.0 not installed")
    model, kwargs = hf_models.build_deepseek_v32(fresh_seed("hf padding") % 8, first_k_dense_replace=2)
    ids = kwargs["input_ids"]
    keep = torch.ones(ids.shape, dtype=torch.long)
    keep[0, :5] = 0
    kwargs = dict(kwargs, attention_mask=keep)
    model.train()
    c = _compiled(model)
    runs = []
    for fn in (c, model):
        logits = fn(**kwargs).logits
        (logits * torch.linspace(-1, 1, logits.numel()).view(logits.shape)).sum().backward()
        runs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        model.zero_grad()
        if fn is c:
            recs = _records()
    assert recs and all(r.rewritten and "recomputed densely" in r.line() for r in recs), [r.line() for r in recs]
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-5, atol=1e-5)
    assert runs[0][1].keys() == runs[1][1].keys()
    for n, g in runs[1][1].items():  # fp32 reassociation over the whole model: relative to the largest entry
        e = ((runs[0][1][n] - g).abs().max() / g.abs().max()).item()
        assert e <= 1e-5, (n, e)
