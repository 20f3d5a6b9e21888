"""The indexer's sparse-stage KL loss at the k selected slots (hyscale_compile.losses,
passes/indexer_loss.py): the public function against the dense float64 original (masked
slots included), and the pass on Megatron-Core's ``compute_dsa_indexer_loss`` and on the HF
recipe (tests/models/hf_indexer_loss.py): loss and the indexer's gradients within the
numerics rule, no [S, T] tensor left, explain's record; the dense warm-up stays dense with
its reason. Debug backend, CPU."""
import copy
import math

import pytest
import torch

import hyscale_compile
from hyscale_compile.lowerings.attention_spec import AttentionSpec
from hyscale_compile.lowerings.spec import MaskTerm
from hyscale_compile.losses import indexer_kl_reference, sparse_indexer_kl
from hyscale_compile.passes import diagnostics
from hyscale_compile.passes.indexer_loss import loss_records
from hyscale_compile.testing import assert_consumer_close, square_tensors
from hyscale_compile.passes.canonicalize import val
from tests.contract import fresh_seed
from tests.test_attention_pass import sequence_square_nodes

# Dynamo traces through Megatron's own lru_cache-wrapped helpers and says so once per call site
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`-wrapped function")

B, S, H, D, K = 2, 12, 2, 8, 6  # rows 0..4 have fewer than K causal keys: masked slots
SCALE = D ** -0.5


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, H, D, generator=g)
    causal = torch.triu(torch.full((S, S), float("-inf")), diagonal=1)
    table = torch.randn(B, S, S, generator=g) * 2 + causal
    idx = table.detach().topk(K, dim=-1).indices
    return q, k, table, idx, causal


def _megatron_dense(table, idx, q, k, causal, dtype):
    """Megatron's sparse-stage arithmetic (compute_dsa_indexer_loss) over [B, S, T] tables in ``dtype``."""
    return indexer_kl_reference(q, k, table.to(dtype), idx, SCALE, causal, dtype=dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sparse_function_matches_the_dense_original(device):
    """sparse_indexer_kl on the op's probs (the Triton kernel's on CUDA) and the table at the
    slots: loss and the table's gradient within the rule against Megatron's dense formula
    (fp32 original, float64 reference); masked slots (P = 0, score -inf) add exactly 0 and
    get gradient exactly 0."""
    spec = AttentionSpec(post=(("mul", SCALE), ("mask", 0)), masks=(MaskTerm(kind="range", hi=0),)).to_json()
    hi = (torch.arange(S, device=device) + 1).expand(B, S).contiguous()
    for case in range(5):
        q, k, table, idx, causal = (t.detach().to(device) for t in _inputs(fresh_seed(f"sparse_indexer_kl {case}")))
        table.requires_grad_()
        _, _, probs = torch.ops.hyscale.sparse_attention(q, k, k[..., :1], idx, [hi], spec, True)
        vals = table.gather(-1, idx)
        masked = ~torch.isfinite(vals.detach())
        assert masked.any() and bool((probs[masked] == 0).all())
        out = sparse_indexer_kl(probs, vals)
        (g_out,) = torch.autograd.grad(out, table)
        orig = _megatron_dense(table, idx, q, k, causal, torch.float32)
        (g_orig,) = torch.autograd.grad(orig, table)
        t64 = table.detach().double().requires_grad_()
        ref = _megatron_dense(t64, idx, q, k, causal, torch.float64)
        (g_ref,) = torch.autograd.grad(ref, t64)
        assert out.dtype == torch.float32 and out.dim() == 0 and math.isfinite(out.detach().item())
        assert_consumer_close(out, orig, ref, torch.float32, "loss")
        assert_consumer_close(g_out, g_orig, g_ref, torch.float32, "the table's gradient")
        slot_grad = g_out.gather(-1, idx)
        assert bool((slot_grad[masked] == 0).all()) and bool((g_orig.gather(-1, idx)[masked] == 0).all())
        rows = sparse_indexer_kl(probs, vals, reduction="none")
        assert rows.shape == (B, S) and torch.allclose(rows.mean(), out)


def test_sparse_function_rejects_bad_operands():
    p = torch.rand(B, S, K)
    with pytest.raises(ValueError, match=r"must both be \[B, S, k\]"):
        sparse_indexer_kl(p, torch.rand(B, S, K + 1))
    with pytest.raises(ValueError, match="3-d floating-point"):
        sparse_indexer_kl(p, torch.zeros(B, S, K, dtype=torch.int64))
    with pytest.raises(ValueError, match="reduction"):
        sparse_indexer_kl(p, p, reduction="sum")


# ------------------------------------------------------------------------------------------
# The pass
# ------------------------------------------------------------------------------------------

ST = 20  # unlike every other size of the models, so that [S, T] tensors are found by size


def _compiled(fn, options=None):
    torch._dynamo.reset()
    diagnostics.clear()
    cap = []
    return torch.compile(fn, backend="hyscale_debug", options={"hyscale.capture": cap, **(options or {})}), cap


def _graphs(cap):
    return [(k, g) for k, g in cap if k in ("forward", "backward")]


def _param_grads(loss, params):
    return [g.clone() for g in torch.autograd.grad(loss, params)]


def _ref_param_grads(table, idx, q, k, scale, causal, params):
    """The float64 loss's gradient at the table, taken through the eager indexer to its
    parameters (the indexer's own backward is the selection pass's, tested elsewhere)."""
    t64 = table.detach().double().requires_grad_()
    ref = indexer_kl_reference(q, k, t64, idx, scale, causal, dtype=torch.float64)
    (g64,) = torch.autograd.grad(ref, t64)
    return ref, torch.autograd.grad(table, params, grad_outputs=g64.to(table.dtype))


def _hf_ref_param_grads(ix, inputs, mask, idx, q, k, scale):
    """``_ref_param_grads`` with the HF indexer in float64 too (a float64 copy scores the keys and
    its parameters take the gradients): a reference whose indexer backward ran in fp32 would share
    that backward's rounding with orig's and understate err(orig)."""
    from tests.models import hf_indexer_loss as R

    ix64 = copy.deepcopy(ix).double()
    hs, qr, cos, sin = (t.double() for t in inputs)
    scores = R.index_scores(ix64, hs, qr, (cos, sin), mask.double(), dtype=torch.float64)
    return _ref_param_grads(scores, idx, q, k, scale, mask, list(ix64.parameters()))


def _same_valid_keys(a, b):
    """The same causal keys selected in each row (rows with fewer than k causal keys fill the
    rest with hidden keys, any of which the contract allows)."""
    pos = torch.arange(a.shape[1]).view(1, -1, 1)
    big = a.shape[1] + 1
    va = torch.where(a <= pos, a, big).sort(-1).values
    vb = torch.where(b <= pos, b, big).sort(-1).values
    assert torch.equal(va, vb)


def _check_site(cap, what):
    (rec,) = loss_records()
    assert rec.rewritten and rec.backward == "sparse", rec.line()
    assert rec.sizes["k"] == 8 and rec.sizes["T"] == ST, rec.line()
    left = square_tensors(_graphs(cap), [ST])
    assert not left, f"{what}: [S, T] tensors left: {left}"
    return rec


@pytest.fixture(scope="module")
def megatron_cpu():
    pytest.importorskip("megatron.core")
    from tests.models import megatron_dsa as M

    with M.parallel_state_1x1(), M.cpu_current_device(), M.use_rotation("matmul"), M.traceable_rope():
        yield M


def _megatron_loss_fn(M, att, sparse):
    from megatron.core.transformer.experimental_attention_variant import dsa

    def fn(x, qr, query, key):
        # DSAttention.forward's training branch, without the attention it feeds
        scores, idx = att.indexer.forward_with_scores(x.detach(), qr.detach(), mask=M.causal_mask(x.shape[0]))
        # (the loss adds the index mask to ``scores`` in place: not returned)
        return dsa.compute_dsa_indexer_loss(scores, idx, query.detach(), key.detach(), att.softmax_scale, 1.0,
                                            sparse, att.indexer.pg_collection), idx
    return fn


def test_megatron_sparse_loss_is_rewritten(megatron_cpu):
    """Megatron's own compute_dsa_indexer_loss (sparse stage) on its indexer: the loss and the
    indexer's gradients within the rule (bf16 parameters), no [S, T] tensor in the forward
    or backward graph, explain reports the site."""
    M = megatron_cpu
    att, (query, key, _, _, x, qr) = M.build(fresh_seed("megatron sparse loss") % 10_000, B=1, S=ST)
    params = list(att.indexer.parameters())
    fn = _megatron_loss_fn(M, att, True)
    orig, idx = fn(x, qr, query, key)
    g_orig = _param_grads(orig, params)
    c, cap = _compiled(fn)
    out, idx_c = c(x, qr, query, key)
    g_out = _param_grads(out, params)
    _check_site(cap, "megatron")
    _same_valid_keys(idx_c, idx)
    q4, k4 = query.permute(1, 0, 2, 3), key.permute(1, 0, 2, 3)  # [b, s, np, hn]
    scores, _ = att.indexer.forward_with_scores(x, qr, mask=M.causal_mask(ST))
    ref, g_ref = _ref_param_grads(scores, idx_c, q4, k4, att.softmax_scale, M.causal_mask(ST), params)
    assert_consumer_close(out, orig, ref, torch.float32, "megatron loss")
    for i, (a, b_, r) in enumerate(zip(g_out, g_orig, g_ref)):
        assert_consumer_close(a, b_, r, torch.bfloat16, f"megatron indexer parameter {i}'s gradient")
    report = hyscale_compile.explain(fn, x, qr, query, key)
    assert "[indexer loss: sparse]" in str(report) and report.losses and report.losses[0].rewritten, str(report)


def test_megatron_dense_warmup_stays_dense(megatron_cpu):
    """dsa_indexer_use_sparse_loss=False: no index mask on either table; the loss stays dense
    (the warm-up's streamed kernel is another pass) and gives what eager gives."""
    M = megatron_cpu
    att, (query, key, _, _, x, qr) = M.build(0, B=1, S=ST)
    fn = _megatron_loss_fn(M, att, False)
    c, cap = _compiled(fn)
    out = c(x, qr, query, key)[0]
    (rec,) = loss_records()
    assert not rec.rewritten and rec.reason == "dense warm-up loss: no index mask", rec.line()
    torch.testing.assert_close(out, fn(x, qr, query, key)[0])


def test_megatron_dsattention_training_step(megatron_cpu):
    """The whole DSAttention in training with the sparse loss: DSAIndexerLossAutoScaler's
    backward reads a class attribute, a graph break, so the loss leaves the compiled graph and
    its gradient comes back as a tangent; the loss site is rewritten and the indexer's
    gradients are eager's (within bf16 rounding)."""
    from megatron.core.transformer.enums import AttnMaskType

    M = megatron_cpu
    att, args = M.build(1, B=1, S=ST)
    att.train()
    att.config.dsa_indexer_loss_coeff = 1.0
    att.config.dsa_indexer_use_sparse_loss = True
    q, k, v, _, x, qr = args
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    params = list(att.indexer.parameters())

    def fn(q, k, v, x, qr):
        return att(q, k, v, None, x, qr, attn_mask_type=AttnMaskType.causal)

    grads = []
    for f in (fn, _compiled(fn)[0]):
        out = f(q, k, v, x, qr)
        grads.append(torch.autograd.grad(out.float().sum(), params))
    (rec,) = [r for r in loss_records()]
    assert rec.rewritten and rec.backward == "sparse", rec.line()
    for a, b_ in zip(*grads):
        torch.testing.assert_close(a, b_, rtol=2e-2, atol=1e-2)


def _hf_inputs(seed):
    pytest.importorskip("transformers")
    from tests.models import hf_models as HF

    if not HF.transformers_available():
        pytest.skip("transformers without DeepseekV32")
    model, _ = HF.build_deepseek_v32(seed)
    att = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(seed)
    hs, qr = torch.randn(B, ST, 64, generator=g), torch.randn(B, ST, 32, generator=g)
    cos, sin = model.model.rotary_emb(hs, torch.arange(ST)[None].expand(B, ST))
    q, k = torch.randn(B, 4, ST, 24, generator=g), torch.randn(B, 4, ST, 24, generator=g)
    return att, (hs, qr, cos, sin, q, k)


def test_hf_recipe_is_rewritten():
    """The recipe an HF user writes beside DeepseekV32 (docs/indexer_loss.md): the loss and
    the indexer's gradients within the rule, no [S, T] tensor left, explain reports it."""
    from tests.models import hf_indexer_loss as R

    att, args = _hf_inputs(fresh_seed("hf indexer loss") % 10_000)
    ix = att.indexer
    params = list(ix.parameters())

    def fn(hs, qr, cos, sin, q, k):
        return R.sparse_indexer_loss(ix, hs, qr, (cos, sin), q, k, att.scaling)

    orig, idx = fn(*args)
    g_orig = _param_grads(orig, params)
    c, cap = _compiled(fn)
    out, idx_c = c(*args)
    g_out = _param_grads(out, params)
    _check_site(cap, "hf recipe")
    _same_valid_keys(idx_c, idx)
    hs, qr, cos, sin, q, k = args
    mask = R.causal_mask(ST, ST)
    ref, g_ref = _hf_ref_param_grads(ix, (hs, qr, cos, sin), mask, idx_c, q.transpose(1, 2), k.transpose(1, 2),
                                     att.scaling)
    assert_consumer_close(out, orig, ref, torch.float32, "hf loss")
    for i, (a, b_, r) in enumerate(zip(g_out, g_orig, g_ref)):
        assert_consumer_close(a, b_, r, torch.float32, f"hf indexer parameter {i}'s gradient")
    report = hyscale_compile.explain(fn, *args)
    assert any(r.rewritten for r in report.losses) and "[indexer loss: sparse]" in str(report), str(report)
    # q and k are graph inputs here, not up-projections of a latent: the target runs per head, with the reason
    (rec,) = [r for r in report.losses if r.rewritten]
    assert rec.sizes["form"] == "per_head" and "up-projection" in rec.sizes["latent"], rec.line()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hf_recipe_target_over_the_latent(dtype):
    """The recipe's key is the attention's MLA key (HF ``expand_kv``: the latent's per-head
    up-projection and the shared rope part): the target's probabilities run over the latent
    (passes/mla.py's absorbed form, k [B, T, 1, R + Dr]) in bf16 and fp16, the up-projection
    has no reader left, and the loss and the indexer's gradients keep the rule against float64
    (the absorbed query q_pass W_kb rounds to the operands' dtype, as the model's own absorbed
    attention does); fp32 keys stay per head (absorbed, the loss's error reached 2.7 eps(fp32)
    against a bound of 2.2 at one seed in ten)."""
    from tests.models import hf_indexer_loss as R
    from tests.test_mla import expand_kv

    att, (hs, qr, cos, sin, _, _) = _hf_inputs(fresh_seed(f"hf indexer loss latent {dtype}") % 10_000)
    ix, cfg = att.indexer, att.config
    H, Dn, Dr, Dv, Rk = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                         cfg.kv_lora_rank)
    params = list(ix.parameters())
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, ST, Dn + Dr, generator=g).to(dtype)
    k_pass, k_rot = torch.randn(B, 1, ST, Rk, generator=g).to(dtype), torch.randn(B, 1, ST, Dr, generator=g).to(dtype)
    w = (torch.randn(H * (Dn + Dv), Rk, generator=g) * Rk ** -0.5).to(dtype)

    def fn(hs, qr, cos, sin, q, k_pass, k_rot, w):
        key = expand_kv(k_pass, k_rot, w, H, Dn, Dv)[0]
        return R.sparse_indexer_loss(ix, hs, qr, (cos, sin), q, key, att.scaling)

    args = (hs, qr, cos, sin, q, k_pass, k_rot, w)
    orig, _ = fn(*args)
    g_orig = _param_grads(orig, params)
    c, cap = _compiled(fn)
    out, idx_c = c(*args)
    g_out = _param_grads(out, params)
    _check_site(cap, f"hf recipe over the latent {dtype}")
    (rec,) = loss_records()
    ops = [n for k, gm in cap if k == "forward" for n in gm.graph.nodes if n.op == "call_function"]
    (call,) = [n for n in ops if n.target is torch.ops.hyscale.sparse_attention.default]
    if dtype == torch.float32:  # per head: the absorbed form's reassociation is beyond the rule at the loss
        assert rec.sizes["form"] == "per_head" and "fp32" in rec.sizes["latent"], rec.line()
        assert tuple(val(call.args[1]).shape) == (B, ST, H, Dn + Dr)
    else:
        assert rec.sizes["form"] == "mqa over the latent (absorbed)" and rec.sizes["R"] == Rk, rec.line()
        assert tuple(val(call.args[0]).shape) == (B, ST, H, Rk + Dr) and val(call.args[1]).shape[2:] == (1, Rk + Dr)
        assert val(call.args[1]).dtype == dtype
        up = [n for n in ops if n.target is torch.ops.aten.mm.default and tuple(val(n).shape) == (B * ST, w.shape[0])]
        assert not up, f"the per-head up-projection is still computed: {up}"
    key64 = expand_kv(k_pass.double(), k_rot.double(), w.double(), H, Dn, Dv)[0]
    ref, g_ref = _hf_ref_param_grads(ix, (hs, qr, cos, sin), R.causal_mask(ST, ST), idx_c, q.double().transpose(1, 2),
                                     key64.transpose(1, 2), att.scaling)
    e_out, e_orig = assert_consumer_close(out, orig, ref, dtype, "loss over the latent")
    print(f"{dtype}: loss err {e_out:.3g} (orig {e_orig:.3g})")
    for i, (a, b_, r) in enumerate(zip(g_out, g_orig, g_ref)):
        assert_consumer_close(a, b_, r, dtype, f"indexer parameter {i}'s gradient over the latent")


def test_option_off_and_undetached_target_stay_dense():
    """``hyscale.sparse_attention=False`` reports what the pass would do and changes nothing; a
    target that is not detached (the loss would train the attention) stays dense."""
    from tests.models import hf_indexer_loss as R

    att, args = _hf_inputs(3)
    ix = att.indexer

    def fn(hs, qr, cos, sin, q, k):
        return R.sparse_indexer_loss(ix, hs, qr, (cos, sin), q, k, att.scaling)[0]

    c, _ = _compiled(fn, {"hyscale.sparse_attention": False})
    torch.testing.assert_close(c(*args), fn(*args))
    (rec,) = loss_records()
    assert not rec.rewritten and rec.reason.startswith("hyscale.sparse_attention=False; enabled"), rec.line()

    def undetached(hs, qr, cos, sin, q, k):
        mask = R.causal_mask(ST, ST)
        scores = R.index_scores(ix, hs.detach(), qr.detach(), (cos, sin), mask)
        idx = scores.topk(8, dim=-1).indices
        im = torch.full_like(scores, float("-inf")).scatter(-1, idx, 0.0)
        t = (torch.matmul(q, k.transpose(-1, -2)) * att.scaling + mask + im.unsqueeze(1)).softmax(-1).sum(1)
        t = t / t.sum(-1, keepdim=True)
        p = (scores + im).softmax(-1)
        return (t * (torch.log(t + 1e-10) - torch.log(p + 1e-10))).sum(-1).mean()

    hs, qr, cos, sin, q, k = args
    q = q.clone().requires_grad_()
    c, _ = _compiled(undetached)
    out = c(hs, qr, cos, sin, q, k)
    (rec,) = loss_records()
    assert not rec.rewritten and "not detached" in rec.reason, rec.line()
    (gq,) = torch.autograd.grad(out, q)
    (gq_eager,) = torch.autograd.grad(undetached(hs, qr, cos, sin, q, k), q)
    torch.testing.assert_close(gq, gq_eager)


def test_other_kl_spelling_stays_dense_with_a_reason():
    """A term the pass does not recognize (xlogy) runs as written; explain names its readers."""
    from tests.models import hf_indexer_loss as R

    att, args = _hf_inputs(4)
    ix = att.indexer

    def fn(hs, qr, cos, sin, q, k):
        mask = R.causal_mask(ST, ST)
        scores = R.index_scores(ix, hs.detach(), qr.detach(), (cos, sin), mask)
        idx = scores.topk(8, dim=-1).indices
        im = torch.full_like(scores, float("-inf")).scatter(-1, idx, 0.0)
        t = (torch.matmul(q, k.transpose(-1, -2)) * att.scaling + mask + im.unsqueeze(1)).softmax(-1).sum(1)
        t = t / t.sum(-1, keepdim=True)
        p = (scores + im).softmax(-1)
        return (torch.xlogy(t, t + 1e-10) - t * torch.log(p + 1e-10)).sum(-1).mean()

    c, _ = _compiled(fn)
    torch.testing.assert_close(c(*args), fn(*args))
    (rec,) = loss_records()
    assert not rec.rewritten and "not by a softmax and the KL term" in rec.reason, rec.line()


# the rewrite's own nodes take symbolic sizes as sym_size nodes, not as raw SymInts (FX warns)
@pytest.mark.filterwarnings("error:Raw SymInt value:UserWarning")
def test_megatron_sparse_loss_dynamic_no_square_tensors(megatron_cpu):
    """Under dynamic=True (training), no node value of the forward or backward graph has two
    dims of the sequence length; the loss equals eager's."""
    M = megatron_cpu
    att, (query, key, _, _, x, qr) = M.build(2, B=1, S=ST)
    fn = _megatron_loss_fn(M, att, True)
    torch._dynamo.reset()
    diagnostics.clear()
    cap = []
    c = torch.compile(fn, backend="hyscale_debug", dynamic=True, options={"hyscale.capture": cap})
    out, _ = c(x, qr, query, key)
    out.backward()
    (rec,) = loss_records()
    assert rec.rewritten and rec.backward == "sparse", rec.line()
    graphs = {k: g for k, g in cap if k in ("forward", "backward")}
    assert set(graphs) == {"forward", "backward"}
    bad = sequence_square_nodes(graphs, ST)
    assert not bad, "\n".join(bad)
    torch.testing.assert_close(out, fn(x, qr, query, key)[0])


@pytest.mark.inductor
def test_hf_recipe_through_inductor():
    """backend="hyscale" (Inductor, ~50 s on a CPU): the rewritten loss and its backward lower
    (decomposed softmax, no aten._softmax after the decompositions) and match eager."""
    from tests.models import hf_indexer_loss as R

    att, args = _hf_inputs(5)
    ix = att.indexer
    params = list(ix.parameters())

    def fn(hs, qr, cos, sin, q, k):
        return R.sparse_indexer_loss(ix, hs, qr, (cos, sin), q, k, att.scaling)[0]

    torch._dynamo.reset()
    diagnostics.clear()
    out = torch.compile(fn, backend="hyscale")(*args)
    g_out = _param_grads(out, params)
    (rec,) = loss_records()
    assert rec.rewritten and rec.backward == "sparse", rec.line()
    orig = fn(*args)
    torch.testing.assert_close(out, orig)
    for a, b_ in zip(g_out, _param_grads(orig, params)):
        torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-6)


def test_hf_recipe_attached_to_the_model():
    """``attach_indexer_losses`` on a whole DeepseekV32 training step (the benchmark's
    ``--indexer-loss sparse``): both layers' losses rewritten with their backward, one
    selection a layer feeding the attention and the loss (the attention over it sparse), and
    the step's loss and indexer gradients as eager's."""
    pytest.importorskip("transformers")
    from tests.models import hf_indexer_loss as R
    from tests.models import hf_models as HF

    if not HF.transformers_available():
        pytest.skip("transformers without DeepseekV32")
    model, kw = HF.build_deepseek_v32(6, seq=ST, batch=1)
    model.train()
    losses = R.attach_indexer_losses(model)
    ids = kw["input_ids"]
    params = [p for layer in model.model.layers for p in layer.self_attn.indexer.parameters()]

    def step(ids):
        out = model(ids, labels=ids, use_cache=False)
        loss = out.loss + sum(losses)
        losses.clear()
        return loss

    ref = step(ids)
    g_ref = _param_grads(ref, params)
    c, cap = _compiled(step)
    out = c(ids)
    g_out = _param_grads(out, params)
    recs = loss_records()
    assert len(recs) == 2 and all(r.rewritten and r.backward == "sparse" for r in recs), [r.line() for r in recs]
    fwd = [g for k, g in cap if k == "forward"]
    ops = [n for g in fwd for n in g.graph.nodes if n.op == "call_function"]
    calls = [n for n in ops if n.target is torch.ops.hyscale.sparse_attention.default]
    assert sum(n.target is torch.ops.hyscale.hytopk_values.default for n in ops) == 2
    assert sorted(n.args[-1] is True for n in calls) == [False, False, True, True], calls  # attention, probs
    # fp32: the target stays per head (the absorbed form's reassociation is beyond the rule at the loss)
    assert all(r.sizes.get("form") == "per_head" and "fp32" in r.sizes["latent"] for r in recs), [r.line() for r in recs]
    # (the recipe's selection replaces HF's: the only top-ks left are the MoE router's)
    assert sum(n.target is torch.ops.aten.topk.default for n in ops) == HF.EXPECTED_TOPK["deepseek_v32"][1]
    torch.testing.assert_close(out, ref)
    for a, b_ in zip(g_out, g_ref):
        torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-6)


def test_hf_model_loss_target_over_the_latent_bf16():
    """The bf16 model with ``attach_indexer_losses`` (the benchmark's form): each loss's probs
    call runs over the shared latent as the model's own attention does (passes/mla.py): MQA,
    k [B, T, 1, kv_lora_rank + qk_rope_head_dim], where per head it is [B, T, H, qk_head_dim]."""
    pytest.importorskip("transformers")
    from tests.models import hf_indexer_loss as R
    from tests.models import hf_models as HF

    if not HF.transformers_available():
        pytest.skip("transformers without DeepseekV32")
    model, kw = HF.build_deepseek_v32(6, seq=ST, batch=1, dtype=torch.bfloat16, first_k_dense_replace=2)
    model.train()
    losses = R.attach_indexer_losses(model)

    def step(ids):
        out = model(ids, labels=ids, use_cache=False)
        loss = out.loss + sum(losses)
        losses.clear()
        return loss

    c, cap = _compiled(step)
    c(kw["input_ids"]).backward()
    recs = loss_records()
    assert len(recs) == 2 and all(r.rewritten and r.sizes.get("form") == "mqa over the latent (absorbed)"
                                  for r in recs), [r.line() for r in recs]
    cfg = model.config
    latent = (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    calls = [n for k, g in cap if k == "forward" for n in g.graph.nodes
             if n.op == "call_function" and n.target is torch.ops.hyscale.sparse_attention.default]
    assert sorted(n.args[-1] is True for n in calls) == [False, False, True, True], calls
    for n in calls:  # the model's attention and the loss's target alike
        assert tuple(val(n.args[1]).shape[2:]) == latent, (n.name, n.args[-1], tuple(val(n.args[1]).shape))
        assert tuple(val(n.args[0]).shape[2:]) == (cfg.num_attention_heads, latent[1])
        assert val(n.args[1]).dtype == torch.bfloat16
