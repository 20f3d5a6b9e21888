"""The attention pass over sdpa's fused nodes (passes/sdpa.py): a CUDA trace of
``F.scaled_dot_product_attention`` keeps the kernel the dispatcher picked
(``aten._scaled_dot_product_efficient_attention``, ``..._cudnn_attention``, ...) with the
index mask as its bias. These tests call the fused ATen ops directly on CPU tensors, which
compile (their meta kernels trace them) but have no CPU kernel, so a compiled function runs
only if the rewrite removed the node; the CPU flash kernel does run on the CPU and is the
``orig`` of its test. The HF model on CUDA is the GPU test at the end.

Numerics: the reference is the float64 dense attention with sdpa's safe softmax at the op's
own indices; err(op) <= 2 err(orig) + 2 eps (``testing.assert_consumer_close``)."""
import math

import pytest
import torch
import torch.nn.functional as F

import hyscale_compile  # noqa: F401
from hyscale_compile.lowerings import attention_ops
from hyscale_compile.passes import diagnostics, mla
from hyscale_compile.testing import assert_consumer_close
from tests.contract import fresh_seed
from tests.models import attention_forms as af

aten = torch.ops.aten
OP = torch.ops.hyscale.sparse_attention.default
EFFICIENT = aten._scaled_dot_product_efficient_attention.default
CUDNN = aten._scaled_dot_product_cudnn_attention.default
FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
CUDNN_FILL = -65504.0  # convert_boolean_attn_mask_cudnn's value at a hidden key (torch 2.10, 2.11)


def compiled(fn, **kw):
    torch._dynamo.reset()
    diagnostics.clear()
    cap = []
    return torch.compile(fn, backend="hyscale_debug", fullgraph=True, options={"hyscale.capture": cap}, **kw), cap


def targets(cap, kind="inference"):
    return [n.target for k, g in cap if k == kind for n in g.graph.nodes if n.op == "call_function"]


def _bias(idx, bool_mask, T, H, pad, fill=-math.inf):
    """sdpa's preprocessing of HF V3.2's mask for a fused kernel: ``attention_mask &
    ~index_mask`` as an additive -inf bias (``convert_boolean_attn_mask``; cuDNN's
    ``convert_boolean_attn_mask_cudnn`` fills -65504), for efficient attention padded to an
    aligned last dim and sliced back (``pad_bias``), expanded to [B, H, S, T]."""
    B, S = idx.shape[:2]
    index_mask = idx.new_ones((B, S, T), dtype=torch.bool).scatter(-1, idx.long(), False).unsqueeze(1)
    bias = torch.where(bool_mask & ~index_mask, torch.scalar_tensor(0.0), torch.scalar_tensor(fill))
    if pad:
        bias = F.pad(bias, (0, 16 - T % 16))[..., :T]
    return bias.expand(B, H, S, T)


def fused_v32(qi, ki, w, q, kk, v, bool_mask, op=EFFICIENT, pad=False, scale=None, dropout_p=0.0, gqa=1,
              is_causal=False):
    """HF V3.2 sdpa as a CUDA trace holds it: the selection, the index mask, the fused node.
    ``gqa``: key heads shared by that many query heads (the first of each group is kept).
    ``is_causal``: the causal part of ``bool_mask`` is the kernel's flag instead."""
    idx = af.indexer(qi, ki, w, 4)
    if is_causal:  # the rows with no visible key stay so; every other key is visible in the mask
        bool_mask = bool_mask.any(-1, keepdim=True).expand(bool_mask.shape)
    q, kk, v = q.transpose(1, 2), kk.transpose(1, 2)[:, ::gqa], v.transpose(1, 2)[:, ::gqa]
    bias = _bias(idx, bool_mask, kk.shape[2], q.shape[1], pad, CUDNN_FILL if op is CUDNN else -math.inf)
    kw = {} if scale is None else {"scale": scale}
    if op is EFFICIENT:
        out = op(q, kk, v, bias, False, dropout_p, is_causal, **kw)[0]
    elif op is CUDNN:
        out = op(q, kk, v, bias, False, dropout_p, False, **kw)[0]
    else:
        out = op(q, kk, v, dropout_p, False, attn_mask=bias, **kw)[0]
    return out.transpose(1, 2)


def reference(args, scale=None, gqa=1):
    """The float64 dense attention at the op's indices, sdpa's math path (a safe softmax)."""
    qi, ki, w, q, kk, v, mask = args
    idx = af.indexer(qi, ki, w, 4)
    q, kk, v = (x.double().transpose(1, 2) for x in (q, kk, v))
    kk, v = kk[:, ::gqa].repeat_interleave(gqa, 1), v[:, ::gqa].repeat_interleave(gqa, 1)
    bias = _bias(idx, mask, kk.shape[2], q.shape[1], False).double()
    return F.scaled_dot_product_attention(q, kk, v, attn_mask=bias, scale=scale).transpose(1, 2)


def _args(seed, S=16, empty_rows=((1, 5),), Dv=8):
    mask = af.hf_bool_causal_mask(2, S).clone()
    for b, s in empty_rows:  # a padding row: every key hidden
        mask[b, :, s] = False
    return af.make_inputs(seed, S=S, Dv=Dv) + (mask,)


@pytest.mark.parametrize("case", ["efficient", "efficient_padded", "efficient_default_scale", "efficient_gqa",
                                  "efficient_causal", "flash_cpu"])
def test_fused_sdpa_is_rewritten(case):
    """The fused node is written out as its math and rewritten: no fused node left (the
    efficient one would not run on the CPU), the op with empty_row="zero" (the kernels give a
    row with every key hidden 0), within the numerics rule for 2 printed seeds."""
    kw = {"efficient": dict(scale=0.3), "efficient_padded": dict(pad=True, scale=0.3),
          "efficient_default_scale": dict(), "efficient_gqa": dict(gqa=2, scale=0.3),
          "efficient_causal": dict(is_causal=True, scale=0.3),
          "flash_cpu": dict(op=FLASH_CPU, scale=0.3)}[case]
    S = 20 if kw.get("pad") else 16  # (T = 20: the bias is padded to 32 and sliced back)
    for i in range(2):
        seed = fresh_seed(f"fused sdpa {case} #{i}")
        args = _args(seed, S=S, Dv=16 if kw.get("op") is FLASH_CPU else 8)  # (the CPU kernel: Dv == Dqk)
        c, cap = compiled(lambda *a: fused_v32(*a, **kw))
        with torch.no_grad():
            out = c(*args)
            ref = reference(args, kw.get("scale"), kw.get("gqa", 1))
            if kw.get("op") is FLASH_CPU:
                orig = fused_v32(*args, **kw)
            else:  # the kernel has no CPU path: the math sdpa in fp32 stands for it
                orig = _math_fp32(args, kw.get("scale"), kw.get("gqa", 1))
        got = targets(cap)
        assert OP in got and not any(t in got for t in (EFFICIENT, FLASH_CPU)), got
        recs = diagnostics.attention_records()
        assert len(recs) == 1 and recs[0].rewritten and "safe_softmax" in recs[0].spec, [r.line() for r in recs]
        spec = next(n for k, g in cap if k == "inference" for n in g.graph.nodes if n.target is OP).args[5]
        assert '"empty_row":"zero"' in spec
        assert (out[1, 5] == 0).all() and (orig[1, 5] == 0).all() and torch.isfinite(out).all()
        assert_consumer_close(out, orig, ref, torch.float32, f"{case} out")


@pytest.mark.parametrize("case", ["efficient"])  # (its autograd formula has no GQA: the kernel has none)
def test_fused_sdpa_training(case):
    """Training: the fused node and its backward become the op and its backward (the
    compiled step runs on the CPU, so neither fused kernel is left); out and the gradients
    of q, k and v within the rule, zero for the hidden row's q."""
    kw = dict(scale=0.3, gqa=2 if case == "efficient_gqa" else 1)
    seed = fresh_seed(f"fused sdpa training {case}")
    args = list(_args(seed))
    go = torch.randn(2, 16, 4, 8, generator=torch.Generator().manual_seed(seed))
    c, cap = compiled(lambda *a: fused_v32(*a, **kw))

    def grads(f, dtype):
        xs = [a.detach().to(dtype).requires_grad_(True) if i in (3, 4, 5) else a for i, a in enumerate(args)]
        out = f(*xs)
        out.backward(go.to(dtype))
        return [out.detach()] + [xs[i].grad for i in (3, 4, 5)]
    got = grads(c, torch.float32)
    assert OP in targets(cap, "forward") and torch.ops.hyscale.sparse_attention_backward.default in targets(cap, "backward")
    recs = diagnostics.attention_records()
    assert len(recs) == 1 and recs[0].rewritten and recs[0].backward == "sparse", [r.line() for r in recs]
    orig = grads(lambda *a: _math_fp32(a, kw["scale"], kw["gqa"]), torch.float32)
    ref = grads(lambda *a: reference(a, kw["scale"], kw["gqa"]), torch.float64)
    assert (got[0][1, 5] == 0).all() and (got[1][1, 5] == 0).all()
    for what, a, b, r in zip(("out", "gq", "gk", "gv"), got, orig, ref):
        assert_consumer_close(a, b, r, torch.float32, f"{case} {what}")


def _math_fp32(args, scale, gqa):
    qi, ki, w, q, kk, v, mask = args
    idx = af.indexer(qi, ki, w, 4)
    q, kk, v = (x.transpose(1, 2) for x in (q, kk, v))
    kk, v = kk[:, ::gqa].repeat_interleave(gqa, 1), v[:, ::gqa].repeat_interleave(gqa, 1)
    bias = _bias(idx, mask, kk.shape[2], q.shape[1], False)
    return F.scaled_dot_product_attention(q, kk, v, attn_mask=bias, scale=scale).transpose(1, 2)


def test_cpu_flash_kernel_gives_zero_for_a_hidden_row():
    """The claim passes/sdpa.py makes of the CPU flash kernel (empty_row "zero")."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    bias = torch.zeros(1, 1, 4, 4)
    bias[..., 2, :] = -math.inf
    out = FLASH_CPU(q, k, v, attn_mask=bias)[0]
    assert (out[:, :, 2] == 0).all() and torch.isfinite(out).all()


def _dense(fn, reason, args):
    """The fused node stays (so the compiled function fails on the CPU where it has no
    kernel) and explain gives the reason."""
    c, cap = compiled(fn)
    with torch.no_grad():
        try:
            c(*args)
        except NotImplementedError:
            pass
    recs = diagnostics.attention_records()
    assert OP not in targets(cap) and torch.ops.hyscale.hytopk.default in targets(cap)
    assert len(recs) == 1 and not recs[0].rewritten and reason in recs[0].reason, [r.line() for r in recs]
    return cap


def test_cudnn_stays_fused_where_a_row_may_be_fully_masked():
    """cuDNN gives a fully masked row no one value the op has (a mean over the keys under a
    bool mask's finite fill): a padding mask read as a tensor (which may hide whole rows, as
    row (1, 5) here) proves nothing, so the node stays as it was, with the reason."""
    cap = _dense(lambda *a: fused_v32(*a, op=CUDNN, scale=0.3), "no such row is proven not to occur", _args(0))
    assert CUDNN in targets(cap)
    assert "tensor" in diagnostics.attention_records()[0].reason


def causal_v32(qi, ki, w, q, kk, v, fill=CUDNN_FILL, bool_bias=False, debug_mask=False, window=None):
    """HF V3.2 sdpa as a CUDA trace holds it for cuDNN, with HF's causal bool mask built in the graph
    (``kv_idx <= q_idx``, as ``masking_utils.sdpa_mask``) and shared by the indexer
    (``masked_fill(~mask, -inf)``) and the attention (``mask & ~index_mask``, then made
    additive with ``fill`` as sdpa does before the fused node). ``window``: the attention
    alone also hides keys more than that far back (a range the selection does not share)."""
    B, S = q.shape[:2]
    i = torch.arange(S)
    mask = (i[None, :] <= i[:, None])[None, None].expand(B, 1, S, S)
    s = torch.einsum("bshd,btd->bsht", qi, ki).relu()
    s = (s * w.unsqueeze(-1)).sum(dim=2).masked_fill(~mask[:, 0], -math.inf)
    idx = s.topk(4, dim=-1)[1]
    index_mask = idx.new_ones((B, S, S), dtype=torch.bool).scatter(-1, idx, False).unsqueeze(1)
    m = mask & ~index_mask
    if window is not None:
        m = m & (i[None, :] > i[:, None] - window)
    bias = m if bool_bias else torch.where(m.logical_not(), fill, torch.scalar_tensor(0.0, dtype=q.dtype))
    q, kk, v = q.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2)
    lse = torch.is_grad_enabled() and q.requires_grad
    return CUDNN(q, kk, v, bias, lse, 0.0, False, debug_mask, scale=0.3)[0].transpose(1, 2)


def _causal_reference(args, dtype, fill=CUDNN_FILL):
    """``causal_v32`` at its own indices with sdpa's math in ``dtype`` on the CPU: in float64
    the reference, in the model's dtype the stand-in for the kernel (``orig``): no row is
    fully masked, so the fill's value does not matter."""
    qi, ki, w, q, kk, v = args
    B, S = q.shape[:2]
    i = torch.arange(S)
    mask = (i[None, :] <= i[:, None])[None, None].expand(B, 1, S, S)
    s = torch.einsum("bshd,btd->bsht", qi, ki).relu()
    idx = (s * w.unsqueeze(-1)).sum(dim=2).masked_fill(~mask[:, 0], -math.inf).topk(4, dim=-1)[1]
    index_mask = idx.new_ones((B, S, S), dtype=torch.bool).scatter(-1, idx, False).unsqueeze(1)
    bias = torch.where((mask & ~index_mask).logical_not(), fill, torch.scalar_tensor(0.0, dtype=dtype))
    q, kk, v = (x.to(dtype).transpose(1, 2) for x in (q, kk, v))
    return F.scaled_dot_product_attention(q, kk, v, attn_mask=bias, scale=0.3).transpose(1, 2)


@pytest.mark.parametrize("dtype,fill", [(torch.bfloat16, CUDNN_FILL), (torch.float32, CUDNN_FILL),
                                        (torch.bfloat16, -math.inf)], ids=["bf16", "fp32", "bf16-neg_inf"])
def test_cudnn_rewritten_where_no_row_is_fully_masked(dtype, fill):
    """cuDNN, with the attention's causal mask the indexer's own (the same graph values): every
    row keeps a visible selected key (its top-1: the diagonal is visible in the selection),
    so no row is fully masked and the op's rows are the kernel's; the node is rewritten with
    the proof in explain, whatever the bias hides with (-65504 from a bool mask, or -inf),
    within the numerics rule for 2 printed seeds (the compiled function ran on the CPU, where
    cuDNN has no kernel)."""
    for i in range(2):
        seed = fresh_seed(f"cudnn proven {dtype} {fill} #{i}")
        args = af.make_inputs(seed, D=16, Dv=8)
        args = args[:3] + tuple(x.to(dtype) for x in args[3:])
        c, cap = compiled(lambda *a: causal_v32(*a, fill=fill))
        with torch.no_grad():
            out = c(*args)
            orig, ref = _causal_reference(args, dtype, fill), _causal_reference(args, torch.float64, fill)
        got = targets(cap)
        assert OP in got and CUDNN not in got, got
        recs = diagnostics.attention_records()
        assert len(recs) == 1 and recs[0].rewritten, [r.line() for r in recs]
        assert recs[0].rows.startswith("cuDNN: no fully masked row, proven: every row keeps a visible selected key")
        assert_consumer_close(out, orig, ref, dtype, f"cuDNN {dtype} out")


def test_cudnn_training_is_rewritten():
    """Training: the cuDNN node's outputs (out, the [B, H, S, 1] log-sum-exp, the philox seed
    and offset its backward reads) and its backward node (gradients of q, k, v as outputs
    0, 1, 2; q and k of one shape) become the op and its backward; no cuDNN node is left
    (the step ran on the CPU); out and the gradients of q, k and v within the rule."""
    seed = fresh_seed("cudnn training")
    args = af.make_inputs(seed, D=16, Dv=8)
    go = torch.randn(2, 16, 4, 8, generator=torch.Generator().manual_seed(seed))
    c, cap = compiled(causal_v32)

    def grads(f, dtype):
        xs = [a.detach().to(dtype).requires_grad_(True) if i >= 3 else a for i, a in enumerate(args)]
        out = f(*xs)
        out.backward(go.to(dtype))
        return [out.detach()] + [xs[i].grad for i in (3, 4, 5)]
    got = grads(c, torch.float32)
    assert OP in targets(cap, "forward") and torch.ops.hyscale.sparse_attention_backward.default in targets(cap, "backward")
    assert not any(t in targets(cap, k) for k in ("forward", "backward")
                   for t in (CUDNN, aten._scaled_dot_product_cudnn_attention_backward.default))
    recs = diagnostics.attention_records()
    assert len(recs) == 1 and recs[0].rewritten and recs[0].backward == "sparse", [r.line() for r in recs]
    assert recs[0].rows.startswith("cuDNN: no fully masked row, proven")
    orig = grads(lambda *a: _causal_reference(a, torch.float32), torch.float32)
    ref = grads(lambda *a: _causal_reference(a, torch.float64), torch.float64)
    for what, a, b, r in zip(("out", "gq", "gk", "gv"), got, orig, ref):
        assert_consumer_close(a, b, r, torch.float32, f"cuDNN training {what}")


@pytest.mark.parametrize("case,reason", [
    ("window", "the attention hides keys by a lower bound that the selection's mask does not share"),
    ("bool_bias", "a bool attn_bias"),
    ("debug_mask", "its debug attention mask is asked for")])
def test_cudnn_left_fused(case, reason):
    """cuDNN stays fused, with the reason: a sliding window the selection does not share (its
    top-k may pick only keys the window hides: a fully masked row), a bool attn_bias (cuDNN
    adds it, it is no mask), the debug attention mask asked for."""
    kw = {"window": dict(window=3), "bool_bias": dict(bool_bias=True), "debug_mask": dict(debug_mask=True)}[case]
    cap = _dense(lambda *a: causal_v32(*a, **kw), reason, af.make_inputs(0, D=16, Dv=8))
    assert CUDNN in targets(cap)


def test_fused_dropout_stays_fused():
    """dropout_p > 0 in the fused node: left as it is, with the reason."""
    cap = _dense(lambda *a: fused_v32(*a, dropout_p=0.5), "dropout with p > 0", _args(0))
    assert EFFICIENT in targets(cap)


def test_fused_sdpa_restored_when_not_rewritten():
    """A fused node whose mask is not an index mask (no selection) is untouched: the graph
    holds it, not its math."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    bias = torch.zeros(1, 1, 4, 4)

    def fn(q, k, v, bias):
        return FLASH_CPU(q, k, v, attn_mask=bias)[0]
    c, cap = compiled(fn)
    with torch.no_grad():
        torch.testing.assert_close(c(q, k, v, bias), fn(q, k, v, bias))
    got = targets(cap)
    assert FLASH_CPU in got and aten.bmm.default not in got and aten.amax.default not in got


# ------------------------------------------- HF V3.2 sdpa as a CUDA trace holds it, on the CPU

def cuda_dispatch(backend):
    """``F.scaled_dot_product_attention`` as torch's composite runs it on CUDA once its
    dispatcher has picked ``backend`` (aten/.../transformers/attention.cpp): the bool mask
    made additive (-inf, or for cuDNN ``convert_boolean_attn_mask_cudnn``'s finite -65504),
    efficient attention's bias padded to an aligned last dim and expanded
    (``preprocess_mask``), the log-sum-exp asked for when a gradient is wanted. On CPU
    tensors the fused nodes trace (meta kernels) but do not run: a compiled step runs only
    where the pass rewrote every one of them, forward and backward."""
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert not enable_gqa
        lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        m = attn_mask
        if m is not None and m.dtype == torch.bool:
            fill = -65504.0 if backend == "cudnn" else -math.inf
            m = torch.where(m.logical_not(), fill, torch.scalar_tensor(0.0, dtype=q.dtype))
        if backend == "cudnn":
            return CUDNN(q, k, v, m, lse, dropout_p, is_causal, False, scale=scale)[0]
        if m is not None:
            T = m.shape[-1]
            if T % 16:
                m = F.pad(m, (0, 16 - T % 16))[..., :T]
            m = m.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return EFFICIENT(q, k, v, m, lse, dropout_p, is_causal, scale=scale)[0]
    return sdpa


def run_hf_v32_dispatched(backend, dtype, train, monkeypatch):
    """The tiny HF V3.2 (sdpa) compiled (debug backend) with sdpa dispatched to ``backend``
    as on CUDA, on the CPU; returns ``test_attention_models.run_hf``'s dict (its reference
    and ``orig`` run with the CPU's own sdpa, which stands for the kernel)."""
    from tests import test_attention_models as M

    build = {"first_k_dense_replace": 2} if dtype == torch.bfloat16 else {}
    with monkeypatch.context() as mp:
        mp.setattr(F, "scaled_dot_product_attention", cuda_dispatch(backend))
        mp.setattr(M, "_RUNS", {})
        try:
            r = M.run_hf("deepseek_v32", "sdpa", train, dtype, **build)
        except NotImplementedError as e:  # a fused node left in a graph that ran
            lines = [x.line() for x in M.selection_consumers(diagnostics.attention_records())]
            raise AssertionError(f"a fused sdpa node was left: {lines} ({str(e)[:80]})") from None
    for x in r["records"]:
        print(x.line())
    return r


def test_hf_v32_efficient_training_is_rewritten(monkeypatch):
    """fp32 training on CUDA runs efficient attention: its backward node hands out the
    gradients of q, k and v as its outputs 0, 1, 2, and q and k have one shape (S == T,
    Dqk); the owner of each is its position, so both layers' forward and backward are
    rewritten (the compiled step ran on the CPU, where neither fused kernel has a kernel),
    within the numerics rule for the logits and every gradient."""
    from tests import test_attention_models as M

    r = run_hf_v32_dispatched("efficient", torch.float32, True, monkeypatch)
    recs = r["records"]
    assert len(recs) == 2 and all(x.rewritten and x.backward == "sparse" for x in recs), [x.line() for x in recs]
    assert_absorbed(r)
    assert M.count(r["cap"], OP, ("forward",)) == 2
    assert M.count(r["cap"], torch.ops.hyscale.sparse_attention_backward.default, ("backward",)) == 2
    assert M.count(r["cap"], (EFFICIENT, aten._scaled_dot_product_efficient_attention_backward.default),
                   ("forward", "backward")) == 0
    M.check_numerics(r)


@pytest.mark.parametrize("train", [False, True], ids=["no_grad", "train"])
def test_hf_v32_cudnn_is_rewritten(train, monkeypatch):
    """bf16 on an H200 runs cuDNN: the tiny HF V3.2 (sdpa) with sdpa dispatched to it as on
    CUDA (the bool mask filled with -65504), on the CPU. The indexer reads the attention's own
    mask (``attention_mask[:, 0]``), so no row is fully masked: both layers are rewritten
    (forward and, in training, backward), with the proof in explain; no cuDNN node is left
    (the step ran); the logits and every gradient within the rule."""
    from tests import test_attention_models as M

    r = run_hf_v32_dispatched("cudnn", torch.bfloat16, train, monkeypatch)
    recs = r["records"]
    assert len(recs) == 2 and all(x.rewritten for x in recs), [x.line() for x in recs]
    assert all(x.rows.startswith("cuDNN: no fully masked row, proven: ") for x in recs), [x.rows for x in recs]
    kinds = ("forward", "backward") if train else ("inference",)
    assert M.count(r["cap"], OP, kinds) == 2
    assert M.count(r["cap"], (CUDNN, aten._scaled_dot_product_cudnn_attention_backward.default), kinds) == 0
    if train:
        assert all(x.backward == "sparse" for x in recs)
        assert M.count(r["cap"], torch.ops.hyscale.sparse_attention_backward.default, ("backward",)) == 2
    assert_absorbed(r)
    M.check_numerics(r)


def assert_absorbed(r):
    """Both layers ran as MQA over the shared latent (passes/mla.py), in training through the
    absorbed backward too: no graph, forward or backward, holds an mm over ``kv_b_proj``'s
    weight [H * (Dn + Dv), R] (the per-head K/V up-projection or its weight's gradient)."""
    recs = r["records"]
    assert all(x.form == mla.FORM and f"form {mla.FORM}" in x.line() for x in recs), [x.line() for x in recs]
    cfg = r["model"].config
    E, R = cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank
    w = {(cfg.num_attention_heads * E, R), (R, cfg.num_attention_heads * E)}
    kinds = ("forward", "backward") if r["train"] else ("inference",)
    mms = [n for k, g in r["cap"] if k in kinds and not isinstance(g, str) for n in g.graph.nodes
           if n.target is aten.mm.default and {tuple(x.meta["val"].shape) for x in (n, *n.args)} & w]
    assert not mms, [n.format_node() for n in mms]


def test_hf_v32_cpu_flash_training_is_absorbed(monkeypatch):
    """On the CPU, sdpa runs HF V3.2's attention as the CPU flash kernel where the value
    heads are as wide as the key heads (v_head_dim 24 = 16 + 8 here; else the math path):
    its forward node and its backward node (the gradients of q, k and v as outputs 0, 1, 2)
    become the absorbed op and its backward, in both layers; no CPU flash node is left; the
    logits and every gradient within the rule (the CPU kernel is ``orig``)."""
    from tests import test_attention_models as M
    from tests.models import hf_models

    common = hf_models._dsa_common
    monkeypatch.setattr(hf_models, "_dsa_common", lambda *a, **k: {**common(*a, **k), "v_head_dim": 24})
    monkeypatch.setattr(M, "_RUNS", {})
    r = M.run_hf("deepseek_v32", "sdpa", True)
    recs = r["records"]
    for x in recs:
        print(x.line())
    assert len(recs) == 2 and all(x.rewritten and x.backward == "sparse" for x in recs), [x.line() for x in recs]
    assert M.count(r["cap"], OP, ("forward",)) == 2
    assert M.count(r["cap"], torch.ops.hyscale.sparse_attention_backward.default, ("backward",)) == 2
    assert M.count(r["cap"], (FLASH_CPU, aten._scaled_dot_product_flash_attention_for_cpu_backward.default),
                   ("forward", "backward")) == 0
    assert_absorbed(r)
    M.check_numerics(r)


# ----------------------------------------------------------------------------------- GPU

def _sdpa_pick(model, kwargs, train):
    """The backend sdpa's dispatcher picks for this model's attention (its q, k, v shapes and
    dtype, a [B, 1, S, T] bool mask, a gradient wanted in training), by name."""
    from torch.nn.attention import SDPBackend

    cfg = model.config
    B, S = kwargs["input_ids"].shape
    dt, dev = next(model.parameters()).dtype, kwargs["input_ids"].device
    dqk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q, k = (torch.randn(B, cfg.num_attention_heads, S, dqk, dtype=dt, device=dev, requires_grad=train)
            for _ in range(2))
    v = torch.randn(B, cfg.num_attention_heads, S, cfg.v_head_dim, dtype=dt, device=dev, requires_grad=train)
    mask = torch.ones(S, S, dtype=torch.bool, device=dev).tril()[None, None].expand(B, 1, S, S)
    with torch.set_grad_enabled(train):
        choice = torch.ops.aten._fused_sdp_choice(q, k, v, mask, 0.0, False, scale=None)
    return {int(b.value): name for name, b in SDPBackend.__members__.items()}.get(int(choice), str(choice))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,train,backend", [
    (torch.float32, False, None), (torch.float32, True, "EFFICIENT_ATTENTION"),
    (torch.bfloat16, False, "CUDNN_ATTENTION"), (torch.bfloat16, True, "CUDNN_ATTENTION")],
    ids=["fp32-no_grad", "fp32-train-efficient", "bf16-no_grad-cudnn", "bf16-train-cudnn"])
def test_hf_v32_sdpa_on_cuda(dtype, train, backend, monkeypatch):
    """The tiny HF V3.2 with attn_implementation="sdpa" on CUDA, backend="hyscale": each
    layer's fused sdpa node (the kernel the dispatcher picks is printed; ``backend``: only it
    and the math path are enabled, so the model's dtype runs it and the float64 reference the
    math) becomes the op, forward and in training backward (counted by the op's calls, so a
    site left dense fails), within the numerics rule at the op's indices against the dense
    original on the same kernel (logits, and in training every parameter's gradient).
    cuDNN (bf16: the H200's default pick) is rewritten only with its proof that no row is
    fully masked, which explain records; efficient attention (fp32 training) through its
    backward node's gradients; under both fused kernels, as MQA over the shared latent
    (absorbed, in training too)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests import test_attention_models as M
    from tests.models import hf_models

    weights = M._loss_weights
    monkeypatch.setattr(M, "_loss_weights", lambda logits, seed: weights(logits, seed).to(logits.device))
    seed = fresh_seed(f"hf v32 sdpa cuda {dtype} train={train} {backend}") % 8
    build = {"first_k_dense_replace": 2} if dtype == torch.bfloat16 else {}
    model, kwargs = hf_models.build_deepseek_v32(seed, dtype=dtype, attn_implementation="sdpa", **build)
    model = model.cuda().train(train)
    kwargs = {k: (x.cuda() if isinstance(x, torch.Tensor) else x) for k, x in kwargs.items()}
    kernels = sdpa_kernel([getattr(SDPBackend, backend), SDPBackend.MATH]) if backend else contextlib.nullcontext()
    with kernels:
        pick = _sdpa_pick(model, kwargs, train)
        print(f"sdpa picks {pick} ({dtype}, train={train})")
        assert backend is None or pick == backend, pick
        cap = []
        torch._dynamo.reset()
        diagnostics.clear()
        # Inductor's caches key grad mode but not sdpa's backend flags: this process's earlier
        # case of the same graph under another kernel would be served, without running the pass
        monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
        monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
        compiled_model = torch.compile(model, backend="hyscale", options={"hyscale.capture": cap})
        calls0 = dict(attention_ops.CALLS)
        with M.recorded_selections() as calls, torch.set_grad_enabled(train):
            logits = compiled_model(**kwargs).logits
        recs = M.selection_consumers(diagnostics.attention_records())
        for r in recs:
            print(r.line())
        assert len(recs) == 2 and all(r.rewritten for r in recs), [r.line() for r in recs]
        if pick == "CUDNN_ATTENTION":
            assert all(r.rows.startswith("cuDNN: no fully masked row, proven: ") for r in recs), [r.rows for r in recs]
        # every fused kernel and the math path (its sqrt(scale) on k moves to the query) run
        # the MQA form over the latent
        assert all(r.form == mla.FORM for r in recs), [r.line() for r in recs]
        grads = {}
        if train:
            (logits * M._loss_weights(logits, seed).to(logits.dtype)).sum().backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        # Inductor's graphs are not captured (``hyscale.capture`` is the debug backend's): count
        # the op's calls instead, which the compiled code makes (lowerings/attention_ops.CALLS)
        assert attention_ops.CALLS["sparse_attention"] - calls0["sparse_attention"] == 2
        if train:
            assert all(r.backward == "sparse" for r in recs), [r.line() for r in recs]
            assert attention_ops.CALLS["sparse_attention_backward"] - calls0["sparse_attention_backward"] == 2
        M.check_numerics(dict(model=model, kwargs=kwargs, cap=cap, calls=calls, out=logits.detach(), grads=grads,
                              seed=seed, dtype=dtype, train=train, records=recs))


@pytest.mark.parametrize("spelling", ["all", "not_any_not", "not_zero"])
def test_safe_softmax_spellings(spelling):
    """Both spellings of the safe softmax's empty-row test (torch's ``all`` and its
    decomposition) are recognised; a ``where`` that does not give 0 is not."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from hyscale_compile.passes.sdpa import safe_softmax_output

    def f(x):
        e = torch.exp(x - x.amax(-1, keepdim=True))
        p = e / e.sum(-1, keepdim=True)
        hid = x == -math.inf
        empty = hid.all(-1, keepdim=True) if spelling == "all" else ~(~hid).any(-1, keepdim=True)
        return torch.where(empty, 1.0 if spelling == "not_zero" else 0.0, p)
    g = make_fx(f)(torch.randn(2, 3, 5)).graph
    eq = next(n for n in g.nodes if n.target is aten.eq.Scalar)
    div = next(n for n in g.nodes if n.target is aten.div.Tensor)
    got = safe_softmax_output(eq, div, 2, 3, lambda n: list(n.users))
    if spelling == "not_zero":
        assert got is None
    else:
        assert got is not None and got[0].target is aten.where.self and got[0].args[2] is div


# ------------------------------------------- HF V3.2 sdpa through the math path, on the CPU

@pytest.mark.parametrize("dtype,train", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
                                         (torch.bfloat16, True)],
                         ids=["fp32-no_grad", "fp32-train", "bf16-no_grad", "bf16-train"])
def test_hf_v32_math_path_is_absorbed(dtype, train):
    """On the CPU sdpa runs the tiny HF V3.2's attention (Dv 16 != Dqk 24) by its math path,
    which multiplies q and k each by sqrt(scale) before the matmul (after upcasting bf16 to
    fp32): the factor on the keys is folded into the absorbed query, so both layers run as
    MQA over the shared latent (in training through the absorbed backward), within the rule
    for the logits and every gradient."""
    from tests import test_attention_models as M

    build = {"first_k_dense_replace": 2} if dtype == torch.bfloat16 else {}
    r = M.run_hf("deepseek_v32", "sdpa", train, dtype, **build)
    recs = r["records"]
    for x in recs:
        print(x.line())
    assert len(recs) == 2 and all(x.rewritten and "key_scale=" in x.line() for x in recs), [x.line() for x in recs]
    if train:
        assert all(x.backward == "sparse" for x in recs), [x.line() for x in recs]
    assert_absorbed(r)
    M.check_numerics(r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,train", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)],
                         ids=["fp32-no_grad", "fp32-train", "bf16-no_grad"])
def test_hf_v32_sdpa_math_on_cuda_is_absorbed(dtype, train, monkeypatch):
    """Only sdpa's math path enabled on CUDA (the fallback where no fused kernel takes a
    shape): ``test_hf_v32_sdpa_on_cuda``'s checks (the op's calls, the numerics rule), and
    both layers as MQA over the shared latent, the keys' sqrt(scale) folded into the query."""
    from tests import test_attention_models as M

    test_hf_v32_sdpa_on_cuda(dtype, train, "MATH", monkeypatch)
    recs = M.selection_consumers(diagnostics.attention_records())
    assert len(recs) == 2 and all(r.form == mla.FORM and "key_scale=" in r.line() for r in recs), \
        [r.line() for r in recs]
