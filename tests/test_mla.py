"""The MLA form of the sparse attention (passes/mla.py): where K and V are per-head
up-projections of one shared latent (HF DeepseekV32 / GlmMoeDsa ``expand_kv``), the
attention runs as MQA over [latent | k_rot] with the key up-projection absorbed into the
query and the value up-projection applied to the output.

Numerics (docs/contract.md): the reference is the original attention evaluated in float64
at the op's own indices; err(op) <= 2 err(orig) + 2 eps(dtype), err = max |x - ref| /
max |ref|, orig = the original run in eager in the same dtype."""
import pytest
import torch
import torch.nn.functional as F

import hyscale_compile  # noqa: F401
from hyscale_compile.passes import diagnostics, mla
from hyscale_compile.testing import assert_consumer_close
from tests.contract import fresh_seed
from tests.models import attention_forms as af

OP = torch.ops.hyscale.sparse_attention.default
aten = torch.ops.aten


def expand_kv(k_pass, k_rot, w_kv, H, Dn, Dv, cat=False):
    """HF ``DeepseekV32Attention.expand_kv``: k_pass [B, 1, T, R], k_rot [B, 1, T, Dr] ->
    key and value states [B, H, T, Dn + Dr] and [B, H, T, Dv] (GLM-5 shares it)."""
    B, _, T, _ = k_pass.shape
    kv = F.linear(k_pass, w_kv).view(B, T, -1, Dn + Dv).transpose(1, 2)
    k_nope, value_states = torch.split(kv, [Dn, Dv], dim=-1)
    k_rot = k_rot.expand(-1, k_nope.shape[1], -1, -1)
    if cat:
        return torch.cat((k_nope, k_rot), dim=-1), value_states
    key_states = kv.new_empty(*kv.shape[:-1], Dn + k_rot.shape[-1])
    key_states[..., :Dn].copy_(k_nope)
    key_states[..., Dn:].copy_(k_rot)
    return key_states, value_states


def mla_attention(idx, q_pass, q_rot, k_pass, k_rot, w_kv, cat=False, scale=None):
    """HF's MLA projections (q [B, H, S, Dn | Dr], K/V expanded from the latent) feeding the
    official V3.2 sparse attention (index mask by scatter, fp32 softmax). ``scale``: q and k
    each multiplied by it first, in their dtype, as sdpa's math path does with sqrt(scale)."""
    H, Dn = q_pass.shape[1], q_pass.shape[-1]
    Dv = w_kv.shape[0] // H - Dn
    q = torch.cat((q_pass, q_rot), dim=-1)
    k, v = expand_kv(k_pass, k_rot, w_kv, H, Dn, Dv, cat)
    if scale is not None:
        q, k = q * scale, k * scale
    return af.official_v32_attention(idx, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


def mla_model(qi, ki, w, q_pass, q_rot, k_pass, k_rot, w_kv, k: int = 4, cat: bool = False, scale=None):
    return mla_attention(af.indexer(qi, ki, w, k), q_pass, q_rot, k_pass, k_rot, w_kv, cat, scale)


def make_inputs(seed, B=2, S=16, H=4, Dn=16, Dv=16, R=32, Dr=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    qi, ki, w = af.make_inputs(seed, B=B, S=S)[:3]
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return (qi, ki, w, r(B, H, S, Dn), r(B, H, S, Dr), r(B, 1, S, R), r(B, 1, S, Dr),
            (torch.randn(H * (Dn + Dv), R, generator=g) * R ** -0.5).to(dtype))


def compiled(fn):
    torch._dynamo.reset()
    diagnostics.clear()
    cap = []
    return torch.compile(fn, backend="hyscale_debug", fullgraph=True, options={"hyscale.capture": cap}), cap


def nodes(cap, kind):
    return [n for k, g in cap if k == kind for n in g.graph.nodes if n.op == "call_function"]


def reference(args, cat=False, scale=None):
    qi, ki, w, *rest = args
    idx = af.indexer(qi, ki, w, 4)
    return mla_attention(idx, *[t.double() for t in rest], cat=cat, scale=scale)


def check(seed, dtype, cat=False, scale=None, **dims):
    args = make_inputs(seed, dtype=dtype, **dims)
    fn, cap = compiled(lambda *a: mla_model(*a, cat=cat, scale=scale))
    with torch.no_grad():
        out = fn(*args)
        orig = mla_model(*args, cat=cat, scale=scale)
    ref = reference(args, cat, scale)
    assert out.dtype == orig.dtype and out.shape == orig.shape
    e_op, e_orig = assert_consumer_close(out, orig, ref, dtype, "out")
    print(f"seed {seed} {dtype}: err(op) {e_op:.3g}, err(orig) {e_orig:.3g}")
    return cap, diagnostics.attention_records()


def op_shapes(cap):
    (call,) = [n for n in nodes(cap, "inference") if n.target is OP]
    return [tuple(a.meta["val"].shape) for a in call.args[:3]]


def assert_absorbed(cap, recs, B=2, S=16, H=4, R=32, Dr=8):
    assert len(recs) == 1 and recs[0].rewritten and recs[0].form == mla.FORM, [r.line() for r in recs]
    assert op_shapes(cap) == [(B, S, H, R + Dr), (B, S, 1, R + Dr), (B, S, 1, R)]
    left = {n.target for n in nodes(cap, "inference")}
    # the per-head K/V expansion (the up-projection, the slice writes) has no reader left
    assert aten.mm.default not in left and aten.slice_scatter.default not in left, left


@pytest.mark.parametrize("i", range(5))
def test_absorbed_fp32(i):
    cap, recs = check(fresh_seed(f"mla_absorbed_fp32[{i}]"), torch.float32)
    assert_absorbed(cap, recs)
    assert "rule=latent 160 B against per head 640 B" in recs[0].line()


@pytest.mark.parametrize("i", range(5))
def test_absorbed_bf16(i):
    # q_pass W_kb is rounded to bf16 before the op (as FlashMLA does) and the output over the
    # latent is rounded to bf16 before the value projection: both within the rule
    cap, recs = check(fresh_seed(f"mla_absorbed_bf16[{i}]"), torch.bfloat16)
    assert_absorbed(cap, recs)


def test_absorbed_fp16():
    cap, recs = check(fresh_seed("mla_absorbed_fp16"), torch.float16)
    assert_absorbed(cap, recs)


def test_absorbed_cat_spelling():
    """K written as cat(k_nope, k_rot expanded) instead of new_empty + copy_ into slices."""
    cap, recs = check(fresh_seed("mla_absorbed_cat"), torch.float32, cat=True)
    assert_absorbed(cap, recs)


@pytest.mark.parametrize("dims,why", [
    (dict(H=1), "latent 160 B against per head 160 B"),
    (dict(H=2, Dv=64, R=200), "latent 832 B against per head 704 B"),
])
def test_rule_keeps_per_head(dims, why):
    """The static rule: the latent form runs only where it reads fewer bytes per query."""
    cap, recs = check(fresh_seed(f"mla_rule_per_head[{dims}]"), torch.float32, **dims)
    assert len(recs) == 1 and recs[0].rewritten and recs[0].form == "per_head", [r.line() for r in recs]
    assert f"per head reads fewer bytes ({why} per selected key)" in recs[0].sizes["latent"]
    H = dims["H"]
    assert op_shapes(cap)[1] == (2, 16, H, 24)


def per_head_rope_model(qi, ki, w, q_pass, q_rot, k_pass, k_rot, w_kv):
    """k_rot differs per head: K is not an expansion of one per-token tensor."""
    H = q_pass.shape[1]
    k_rot = k_rot.expand(-1, H, -1, -1) * torch.arange(1, H + 1, dtype=k_rot.dtype).view(1, H, 1, 1)
    return mla_model(qi, ki, w, q_pass, q_rot, k_pass, k_rot, w_kv)


def heads_major_model(qi, ki, w, q_pass, q_rot, k_pass, k_rot, w_kv):
    """The up-projection read as [B, H, T, E] (heads-major): not a per-head projection of each
    token's latent, so the absorbed form would be wrong."""
    B, _, T, _ = k_pass.shape
    H, Dn = q_pass.shape[1], q_pass.shape[-1]
    kv = F.linear(k_pass, w_kv).view(B, H, T, -1)
    k_nope, v = torch.split(kv, [Dn, kv.shape[-1] - Dn], dim=-1)
    k = torch.cat((k_nope, k_rot.expand(-1, H, -1, -1)), dim=-1)
    q = torch.cat((q_pass, q_rot), dim=-1)
    return af.official_v32_attention(af.indexer(qi, ki, w, 4), q.transpose(1, 2), k.transpose(1, 2),
                                     v.transpose(1, 2))


@pytest.mark.parametrize("model,reason", [
    (per_head_rope_model, "is neither an up-projection (mm) nor the same for every head"),
    (heads_major_model, "does not index the up-projection as [b*T + t, h*E + e]"),
])
def test_not_a_shared_latent_runs_per_head(model, reason):
    args = make_inputs(fresh_seed(f"mla_not_latent[{model.__name__}]"))
    fn, cap = compiled(model)
    with torch.no_grad():
        out = fn(*args)
        orig = model(*args)
    recs = diagnostics.attention_records()
    assert len(recs) == 1 and recs[0].rewritten and recs[0].form == "per_head", [r.line() for r in recs]
    assert reason in recs[0].sizes["latent"], recs[0].sizes
    torch.testing.assert_close(out, orig)


def test_absorbed_dynamic():
    """Dynamic batch and sequence length (the heads and head dims stay static, as a model's
    weights make them)."""
    args = make_inputs(fresh_seed("mla_absorbed_dynamic"))
    for t in args[3:7]:
        for d in (1, 3):
            torch._dynamo.mark_static(t, d)
    for d in (0, 1):
        torch._dynamo.mark_static(args[7], d)
    torch._dynamo.reset()
    diagnostics.clear()
    cap = []
    fn = torch.compile(mla_model, backend="hyscale_debug", fullgraph=True, dynamic=True,
                       options={"hyscale.capture": cap})
    with torch.no_grad():
        out = fn(*args)
        orig = mla_model(*args)
    recs = [r for r in diagnostics.attention_records() if r.rewritten]
    assert len(recs) == 1 and recs[0].form == mla.FORM, [r.line() for r in diagnostics.attention_records()]
    assert any(isinstance(s, torch.SymInt) for s in op_shapes(cap)[1])
    torch.testing.assert_close(out, orig)


def grads_of(fn, args, g):
    leaves = [t.detach().clone().requires_grad_(True) if i >= 3 else t for i, t in enumerate(args)]
    out = fn(*leaves)
    out.backward(g)
    return out.detach(), [t.grad for t in leaves[3:]]


def check_training(seed, dtype, cat=False, scale=None, **dims):
    args = make_inputs(seed, dtype=dtype, **dims)
    model = lambda *a: mla_model(*a, cat=cat, scale=scale)  # noqa: E731
    fn, cap = compiled(model)
    g = torch.randn(model(*args).shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    out, grads = grads_of(fn, args, g)
    orig, ograds = grads_of(model, args, g)
    ref, rgrads = grads_of(model, [t.double() if i >= 3 else t for i, t in enumerate(args)], g.double())
    names = ("out", "q_pass", "q_rot", "k_pass", "k_rot", "w_kv")
    for name, x, o, r in zip(names, [out, *grads], [orig, *ograds], [ref, *rgrads]):
        assert x.dtype == o.dtype and x.shape == o.shape, name
        e_op, e_orig = assert_consumer_close(x, o, r, dtype, name)
        print(f"seed {seed} {dtype} {name}: err(op) {e_op:.3g}, err(orig) {e_orig:.3g}")
    return cap, diagnostics.attention_records()


def assert_absorbed_training(cap, recs):
    assert len(recs) == 1 and recs[0].rewritten and recs[0].form == mla.FORM, [r.line() for r in recs]
    assert recs[0].backward == "sparse", [r.line() for r in recs]
    fw = {n.target for n in nodes(cap, "forward")}
    bw = {n.target for n in nodes(cap, "backward")}
    assert OP in fw and torch.ops.hyscale.sparse_attention_backward.default in bw
    # neither the per-head expansion nor its backward is left (no up-projection mm, no slice writes)
    for t in (aten.mm.default, aten.slice_scatter.default):
        assert t not in fw and t not in bw, t


@pytest.mark.parametrize("i", range(5))
def test_training_absorbed_fp32(i):
    cap, recs = check_training(fresh_seed(f"mla_training_fp32[{i}]"), torch.float32)
    assert_absorbed_training(cap, recs)


@pytest.mark.parametrize("i", range(2))
def test_training_absorbed_bf16(i):
    cap, recs = check_training(fresh_seed(f"mla_training_bf16[{i}]"), torch.bfloat16)
    assert_absorbed_training(cap, recs)


def test_training_absorbed_cat_spelling():
    cap, recs = check_training(fresh_seed("mla_training_cat"), torch.float32, cat=True)
    assert_absorbed_training(cap, recs)


def test_training_rule_per_head():
    """H = 1: the rule keeps the per-head form in training too."""
    args = make_inputs(fresh_seed("mla_training_per_head"), H=1)
    fn, cap = compiled(mla_model)
    g = torch.randn(mla_model(*args).shape)
    out, grads = grads_of(fn, args, g)
    orig, ograds = grads_of(mla_model, args, g)
    recs = diagnostics.attention_records()
    assert len(recs) == 1 and recs[0].form == "per_head", [r.line() for r in recs]
    assert "per head reads fewer bytes" in recs[0].sizes["latent"]
    for x, o in zip([out, *grads], [orig, *ograds]):
        torch.testing.assert_close(x, o)


def key_also_returned(qi, ki, w, q_pass, q_rot, k_pass, k_rot, w_kv):
    """The expanded keys are also read outside the attention (a second gradient enters their
    backward): the absorbed backward does not apply. That reader is a second output, not a
    scalar added to the attention's: the backward of such a sum is sum(g) over the output's
    2048 elements, which a random g can bring near 0 (|sum g| 0.05 against sum |g| 1600), and
    its rounding, scaled by 2 k, then errs the key-side gradients by ~300 eps in compiled and
    eager alike, with different bits (a different reduction order): no test of the attention."""
    H, Dn = q_pass.shape[1], q_pass.shape[-1]
    k, v = expand_kv(k_pass, k_rot, w_kv, H, Dn, w_kv.shape[0] // H - Dn)
    q = torch.cat((q_pass, q_rot), dim=-1)
    out = af.official_v32_attention(af.indexer(qi, ki, w, 4), q.transpose(1, 2), k.transpose(1, 2),
                                    v.transpose(1, 2))
    return out, k.square().sum()


def test_training_region_not_absorbable_falls_back_to_per_head():
    seed = fresh_seed("mla_training_fallback")
    args = make_inputs(seed)
    fn, cap = compiled(key_also_returned)
    g = torch.randn(2, 16, 4, 16, generator=torch.Generator().manual_seed(seed + 1))

    def run(f, a, g):
        leaves = [t.detach().clone().requires_grad_(True) if i >= 3 else t for i, t in enumerate(a)]
        out, sq = f(*leaves)
        torch.autograd.backward([out, sq], [g, torch.ones_like(sq)])
        return [out.detach(), sq.detach()] + [t.grad for t in leaves[3:]]

    got = run(fn, args, g)
    orig = run(key_also_returned, args, g)
    ref = run(key_also_returned, [t.double() if i >= 3 else t for i, t in enumerate(args)], g.double())
    recs = diagnostics.attention_records()
    assert len(recs) == 1 and recs[0].form == "per_head", [r.line() for r in recs]
    assert recs[0].sizes["latent"].startswith("training graph: another gradient"), recs[0].sizes
    names = ("out", "k.square().sum()", "q_pass", "q_rot", "k_pass", "k_rot", "w_kv")
    for name, x, o, r in zip(names, got, orig, ref):
        assert x.dtype == o.dtype == torch.float32 and x.shape == o.shape, name
        assert_consumer_close(x, o, r, torch.float32, name)


def hf_layer(build):
    from tests.models import hf_models as hm

    if not hm.transformers_available():
        pytest.skip("transformers is not installed")
    model, _ = getattr(hm, build)(0)
    return model.model.layers[1].self_attn


def hf_glm5_eager_model(layer):
    """HF's own ``expand_kv`` (DeepseekV32Attention / GlmMoeDsaAttention, whose kv_b_proj is a
    parameter) feeding GLM-5's eager sparse attention (index mask of -inf by scatter_, HF's
    causal mask, ``eager_attention_forward``)."""
    def f(qi, ki, w, q_pass, q_rot, k_pass, k_rot, mask):
        k, v = layer.expand_kv(k_pass, k_rot)
        q = torch.cat((q_pass, q_rot), dim=-1)
        return af.glm5_eager_attention(af.indexer(qi, ki, w, 4), q.transpose(1, 2), k.transpose(1, 2),
                                       v.transpose(1, 2), mask)
    return f


@pytest.mark.parametrize("build", ["build_deepseek_v32", "build_glm_moe_dsa"])
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_hf_expand_kv(build, train):
    import copy

    layer = hf_layer(build)
    assert (layer.num_heads, layer.qk_nope_head_dim, layer.v_head_dim, layer.kv_lora_rank,
            layer.qk_rope_head_dim) == (4, 16, 16, 32, 8)
    seed = fresh_seed(f"mla_hf_expand_kv[{build}, {train}]")
    args = list(make_inputs(seed)[:7]) + [af.hf_causal_mask(2, 16)]
    fn, cap = compiled(hf_glm5_eager_model(layer))
    layer64 = copy.deepcopy(layer).double()
    runs = []
    for f, lay, dt in ((fn, layer, torch.float32), (hf_glm5_eager_model(layer), layer, torch.float32),
                       (hf_glm5_eager_model(layer64), layer64, torch.float64)):
        a = [t.to(dt) if 3 <= i < 7 else t for i, t in enumerate(args)]
        a = [t.detach().clone().requires_grad_(train) if 3 <= i < 7 else t for i, t in enumerate(a)]
        lay.zero_grad()
        with torch.set_grad_enabled(train):
            out = f(*a)
            if train:
                out.backward(torch.ones_like(out) * torch.linspace(-1, 1, out.shape[-1], dtype=dt))
        grads = [t.grad for t in a[3:7]] + [lay.kv_b_proj.weight.grad] if train else []
        runs.append([out.detach(), *grads])
    recs = diagnostics.attention_records()
    assert len(recs) == 1 and recs[0].rewritten and recs[0].form == mla.FORM, [r.line() for r in recs]
    assert recs[0].backward == ("sparse" if train else "")
    for j, (x, o, r) in enumerate(zip(*runs)):
        assert_consumer_close(x, o, r, torch.float32, f"output/grad {j}")
    left = {n.target for kind in ("inference", "forward", "backward") for n in nodes(cap, kind)}
    assert OP in left
    assert aten.mm.default not in left and aten.slice_scatter.default not in left


@pytest.mark.parametrize("how", ["checkpoint", "budget0"])
def test_training_absorbed_under_checkpointing(how):
    """The backward reads the op's saved indices and log-sum-exp: no selection, no index
    mask, no per-head expansion in it."""
    from torch.utils.checkpoint import checkpoint

    args = make_inputs(fresh_seed(f"mla_checkpoint[{how}]"))
    model = (lambda *a: checkpoint(mla_model, *a, use_reentrant=False)) if how == "checkpoint" else mla_model
    g = torch.randn(2, 16, 4, 16)
    with torch._functorch.config.patch(activation_memory_budget=0.0 if how == "budget0" else 1.0):
        fn, cap = compiled(model)
        out, grads = grads_of(fn, args, g)
    orig, ograds = grads_of(mla_model, args, g)
    recs = diagnostics.attention_records()
    assert len(recs) == 1 and recs[0].form == mla.FORM and recs[0].backward == "sparse", [r.line() for r in recs]
    bw = {n.target for n in nodes(cap, "backward")}
    for t in (torch.ops.hyscale.hytopk.default, aten.scatter.value, aten.mm.default, aten.slice_scatter.default):
        assert t not in bw, t
    for x, o in zip([out, *grads], [orig, *ograds]):
        torch.testing.assert_close(x, o, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_inductor_end_to_end(train):
    """backend="hyscale" (Inductor codegen around the op and the absorbed bmms)."""
    args = make_inputs(fresh_seed(f"mla_inductor[{train}]"))
    g = torch.randn(2, 16, 4, 16)
    torch._dynamo.reset()
    diagnostics.clear()
    fn = torch.compile(mla_model, backend="hyscale")
    # a cached compile would skip the passes (and their records)
    with torch.set_grad_enabled(train), torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        got = grads_of(fn, args, g) if train else (fn(*args), [])
        want = grads_of(mla_model, args, g) if train else (mla_model(*args), [])
    for x, o in zip([got[0], *got[1]], [want[0], *want[1]]):
        torch.testing.assert_close(x, o, rtol=1e-5, atol=1e-5)
    recs = diagnostics.attention_records()
    assert [(r.rewritten, r.form) for r in recs] == [(True, mla.FORM)], [r.line() for r in recs]


EFFICIENT = aten._scaled_dot_product_efficient_attention.default
FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
FUSED_BACKWARD = (aten._scaled_dot_product_efficient_attention_backward.default,
                  aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def fused_mla_model(qi, ki, w, q_pass, q_rot, k_pass, k_rot, w_kv, mask, op=None):
    """HF V3.2's attention with attn_implementation="sdpa" as a trace holds it: the per-head
    K/V expansion of the latent, the index mask made sdpa's additive bias
    (tests/test_attention_sdpa.py) and the fused node the dispatcher picked (``op``; None:
    ``F.scaled_dot_product_attention`` itself, the references' math path)."""
    from tests.test_attention_sdpa import _bias

    H, Dn = q_pass.shape[1], q_pass.shape[-1]
    k, v = expand_kv(k_pass, k_rot, w_kv, H, Dn, w_kv.shape[0] // H - Dn)
    q = torch.cat((q_pass, q_rot), dim=-1)
    bias = _bias(af.indexer(qi, ki, w, 4), mask, k.shape[2], H, False).to(q.dtype)
    if op is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.3)
    if op is EFFICIENT:  # (sdpa asks for the log-sum-exp where a gradient is wanted)
        return op(q, k, v, bias, torch.is_grad_enabled() and q.requires_grad, 0.0, False, scale=0.3)[0]
    return op(q, k, v, attn_mask=bias, scale=0.3)[0]


@pytest.mark.parametrize("case", ["flash_cpu", "efficient"])
def test_training_absorbed_through_fused_sdpa(case):
    """Training through a fused sdpa node (written out as its math by passes/sdpa.py): its
    backward node hands out the gradients of q, k and v together (outputs 0, 1, 2; q and k
    of one shape) and reads the output's gradient laid out as the node's [B, H, S, Dv]
    output, not as the written-out value contraction. The site still runs absorbed, forward
    and backward; no fused node is left (efficient attention has no CPU kernel: the step ran
    only because of that); out and the gradients of q_pass, q_rot, the latent, k_rot and the
    up-projection within the rule for 5 printed seeds (orig: the CPU kernel itself, or for
    efficient attention the math sdpa in fp32), with a fully masked padding row (0 in every
    kernel and in the op)."""
    op = {"flash_cpu": FLASH_CPU, "efficient": EFFICIENT}[case]
    fn, cap = compiled(lambda *a: fused_mla_model(*a, op=op))
    names = ("out", "q_pass", "q_rot", "k_pass", "k_rot", "w_kv")
    for i in range(5):
        seed = fresh_seed(f"mla_fused_sdpa_training[{case}, {i}]")
        mask = af.hf_bool_causal_mask(2, 16).clone()
        mask[1, :, 5] = False  # a padding row: every key hidden
        args = list(make_inputs(seed, Dv=24)) + [mask]  # (the CPU kernel: Dv == Dqk = 16 + 8)
        g = torch.randn(2, 4, 16, 24, generator=torch.Generator().manual_seed(seed + 1))

        def run(f, dtype):
            xs = [t.detach().to(dtype).requires_grad_(True) if 3 <= j < 8 else t for j, t in enumerate(args)]
            out = f(*xs)
            out.backward(g.to(dtype))
            return [out.detach()] + [t.grad for t in xs[3:8]]
        got = run(fn, torch.float32)
        orig = run(lambda *a: fused_mla_model(*a, op=FLASH_CPU if op is FLASH_CPU else None), torch.float32)
        ref = run(fused_mla_model, torch.float64)
        assert (got[0][1, :, 5] == 0).all() and (got[1][1, :, 5] == 0).all()
        for name, x, o, r in zip(names, got, orig, ref):
            assert x.dtype == o.dtype and x.shape == o.shape, name
            e_op, e_orig = assert_consumer_close(x, o, r, torch.float32, f"{case} {name}")
            print(f"seed {seed} {case} {name}: err(op) {e_op:.3g}, err(orig) {e_orig:.3g}")
    recs = diagnostics.attention_records()
    assert_absorbed_training(cap, recs)
    assert f"form {mla.FORM}" in recs[0].line()
    left = {n.target for kind in ("forward", "backward") for n in nodes(cap, kind)}
    assert not left & {op, *FUSED_BACKWARD}, left


def test_inductor_training_through_fused_sdpa():
    """backend="hyscale" (Inductor) around the absorbed op and backward that replace the CPU
    flash node and its backward node (whose gradient of q the graph's views read with the
    kernel's strides): the step matches the eager model's."""
    args = list(make_inputs(fresh_seed("mla_inductor_fused_sdpa"), Dv=24)) + [af.hf_bool_causal_mask(2, 16)]
    model = lambda *a: fused_mla_model(*a, op=FLASH_CPU)  # noqa: E731
    g = torch.randn(2, 4, 16, 24)

    def run(f):
        xs = [t.detach().clone().requires_grad_(True) if 3 <= j < 8 else t for j, t in enumerate(args)]
        out = f(*xs)
        out.backward(g)
        return [out.detach()] + [t.grad for t in xs[3:8]]
    torch._dynamo.reset()
    diagnostics.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        got = run(torch.compile(model, backend="hyscale"))
    for x, o in zip(got, run(model)):
        torch.testing.assert_close(x, o, rtol=1e-5, atol=1e-5)
    recs = diagnostics.attention_records()
    assert [(r.rewritten, r.form, r.backward) for r in recs] == [(True, mla.FORM, "sparse")], [r.line() for r in recs]


# ------------------------------------------- keys scaled by a constant (sdpa's math path)

# sqrt(scale) for Dqk = 16 + 8: sdpa's math path multiplies q and k each by it before the matmul
SQRT_SCALE = 24 ** -0.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("i", range(5))
def test_absorbed_through_scaled_keys(dtype, i):
    """q and k each multiplied by a constant before the score matmul (in bf16 the original
    rounds k * c to bf16, which the absorbed form cannot reproduce): the factor moves from
    the keys to the query, and the result is within the rule."""
    cap, recs = check(fresh_seed(f"mla_scaled_keys[{dtype}][{i}]"), dtype, scale=SQRT_SCALE)
    assert_absorbed(cap, recs)
    assert f"key_scale={SQRT_SCALE!r}" in recs[0].line(), recs[0].line()


def test_absorbed_through_a_constant_0d_key_scale():
    """The factor as a 0-d tensor built in the graph (known at compile time)."""
    def model(*a):
        return mla_model(*a, scale=torch.tensor(0.5, dtype=a[3].dtype))
    args = make_inputs(fresh_seed("mla_scaled_keys_0d"))
    fn, cap = compiled(model)
    with torch.no_grad():
        out = fn(*args)
        orig = model(*args)
    e_op, e_orig = assert_consumer_close(out, orig, reference(args, scale=0.5), torch.float32, "out")
    print(f"err(op) {e_op:.3g}, err(orig) {e_orig:.3g}")
    recs = diagnostics.attention_records()
    assert_absorbed(cap, recs)
    assert "key_scale=0.5" in recs[0].line(), recs[0].line()


def test_runtime_key_scale_runs_per_head():
    """A factor the graph only knows at run time (an input tensor) is not folded: the
    attention runs per head, with the reason."""
    args = make_inputs(fresh_seed("mla_scaled_keys_runtime"))
    c = torch.tensor(SQRT_SCALE)
    fn, cap = compiled(lambda *a: mla_model(*a[:-1], scale=a[-1]))
    with torch.no_grad():
        out = fn(*args, c)
        orig = mla_model(*args, scale=c)
    recs = diagnostics.attention_records()
    assert len(recs) == 1 and recs[0].rewritten and recs[0].form == "per_head", [r.line() for r in recs]
    assert "by a tensor known only at run time" in recs[0].sizes["latent"], recs[0].sizes
    torch.testing.assert_close(out, orig)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_training_absorbed_through_scaled_keys(dtype):
    """The same in training: the absorbed backward, every gradient within the rule."""
    cap, recs = check_training(fresh_seed(f"mla_training_scaled_keys[{dtype}]"), dtype, scale=SQRT_SCALE)
    assert_absorbed_training(cap, recs)



def test_training_saves_no_absorbed_query():
    """The absorbed query [B, S, H, R + Dr] is the op's widest operand (576 per head against
    q's 192 at DeepSeek's shape; 2.25 GiB a layer at S = 128K with 16 heads): the forward
    saves q (the bmm's input, which dW_kb reads anyway), and the backward recomputes the
    absorbed query (one bmm and a cat) for the backward op."""
    args = make_inputs(fresh_seed("mla_saved_query"))
    g = torch.randn(2, 16, 4, 16, generator=torch.Generator().manual_seed(1))
    fn, cap = compiled(mla_model)
    out, grads = grads_of(fn, args, g)
    orig, ograds = grads_of(mla_model, args, g)
    for x, o in zip([out, *grads], [orig, *ograds]):
        torch.testing.assert_close(x, o, rtol=1e-5, atol=1e-5)
    (fw,) = [gm for k, gm in cap if k == "forward"]
    (op,) = [n for n in fw.graph.nodes if n.target is OP]
    saved = [a for a in fw.graph.output_node().args[0] if isinstance(a, torch.fx.Node)]
    assert op.args[0] not in saved
    shapes = [tuple(a.meta["val"].shape) for a in saved if isinstance(a.meta.get("val"), torch.Tensor)]
    assert (2, 16, 4, 32 + 8) not in shapes, shapes
    (bw,) = [gm for k, gm in cap if k == "backward"]
    (bop,) = [n for n in bw.graph.nodes if n.target is torch.ops.hyscale.sparse_attention_backward.default]
    assert bop.args[1].target is aten.cat.default, bop.args[1].format_node()
    assert aten.bmm.default in {n.target for n in bw.graph.nodes if n.op == "call_function"}
