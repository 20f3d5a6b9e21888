"""The attention pass (passes/attention.py): the dense attention that applies a selection's
index mask becomes hyscale.sparse_attention over the k selected keys.

Numerics (docs/contract.md): the reference is the consumer evaluated in float64 at the op's
own indices (the selection's, recomputed in eager: the inputs' selections are unique); for
each output, err(op) <= 2 err(orig) + 2 eps(dtype), err = max |x - ref| / max |ref|, orig =
the original graph run in eager in the same dtype."""
import functools

import pytest
import torch

import hyscale_compile  # noqa: F401
from hyscale_compile.passes import diagnostics
from hyscale_compile.testing import assert_consumer_close
from tests.contract import fresh_seed
from tests.models import attention_forms as af

OP = torch.ops.hyscale.sparse_attention.default
BWD = torch.ops.hyscale.sparse_attention_backward.default


def compiled(fn, options=None, dynamic=None):
    torch._dynamo.reset()
    diagnostics.clear()
    cap = []
    opts = {"hyscale.capture": cap, **(options or {})}
    return torch.compile(fn, backend="hyscale_debug", fullgraph=True, dynamic=dynamic, options=opts), cap


def targets(cap, kind):
    return [n.target for k, g in cap if k == kind for n in g.graph.nodes if n.op == "call_function"]


def assert_numerics(out, orig, ref, dtype, what):
    """The consumer rule, eps = torch.finfo(dtype).eps (``testing.assert_consumer_close``)."""
    assert_consumer_close(out, orig, ref, dtype, what)


def attention_records():
    return diagnostics.attention_records()


@pytest.mark.parametrize("i", range(5))
def test_official_v32_inference(i):
    seed = fresh_seed(f"official_v32_inference[{i}]")
    args = af.make_inputs(seed)
    fn, cap = compiled(af.official_v32)
    with torch.no_grad():
        out = fn(*args)
        orig = af.official_v32(*args)
        qi, ki, w, q, k, v = args
        idx = af.indexer(qi, ki, w, 4)
        ref = af.official_v32_attention(idx, q.double(), k.double(), v.double())
    assert OP in targets(cap, "inference")
    assert aten_bmm_count(cap, "inference") == 0, "the dense score and value contractions must be gone"
    recs = attention_records()
    assert len(recs) == 1 and recs[0].rewritten and recs[0].form == "per_head", [r.line() for r in recs]
    assert_numerics(out, orig, ref, torch.float32, "out")


def test_run_time_scale_is_an_operand_of_the_op():
    """A 0-d tensor softmax scale becomes the op's ``mul_operand`` step (read at each call):
    rewritten, within the rule against float64, and a new scale value is followed."""
    seed = fresh_seed("attention run-time scale")
    args = af.make_inputs(seed)
    fn, cap = compiled(af.official_v32_scaled)
    for scale in (0.3, -0.7):
        s = torch.tensor(scale)
        with torch.no_grad():
            out = fn(*args, s)
            orig = af.official_v32_scaled(*args, s)
            qi, ki, w, q, k, v = args
            ref = af.official_v32_scaled_attention(af.indexer(qi, ki, w, 4), q.double(), k.double(), v.double(),
                                                   s.double())
        assert_numerics(out, orig, ref, torch.float32, f"out at scale {scale}")
    recs = attention_records()
    assert recs and all(r.rewritten and "mul_operand" in r.spec for r in recs), [r.line() for r in recs]


def aten_bmm_count(cap, kind):
    return sum(t is torch.ops.aten.bmm.default for t in targets(cap, kind))


def test_option_off_keeps_attention_dense():
    args = af.make_inputs(0)
    fn, cap = compiled(af.official_v32, {"hyscale.sparse_attention": False})
    with torch.no_grad():
        out = fn(*args)
        torch.testing.assert_close(out, af.official_v32(*args))
    assert OP not in targets(cap, "inference")
    assert torch.ops.hyscale.hytopk.default in targets(cap, "inference")  # the selection still fuses
    recs = attention_records()
    assert len(recs) == 1 and not recs[0].rewritten and "hyscale.sparse_attention=False" in recs[0].reason


def test_attention_backward_option_reaches_both_ops_spec():
    """``hyscale.attention_backward="atomic"`` is written into the spec of the forward and the
    backward call (what the CUDA backward reads, lowerings/attention_backward.backward_mode);
    the default leaves the specs as they were (no field), and HYSCALE_ATTN_BWD still overrides."""
    import json

    from hyscale_compile.lowerings.attention_backward import backward_mode
    from hyscale_compile.lowerings.attention_spec import AttentionSpec

    def specs(options):
        fn, cap = compiled(af.official_v32, options)
        args = af.make_inputs(0, requires_grad=True)
        fn(*args).sum().backward()
        got = [json.loads(n.args[5] if n.target is OP else n.args[8]) for kind, g in cap
               if kind in ("forward", "backward") for n in g.graph.nodes if n.target in (OP, BWD)]
        assert len(got) == 2, got  # the forward call and the backward call
        return got

    assert all("backward" not in d for d in specs(None))
    atomic = specs({"hyscale.attention_backward": "atomic"})
    assert all(d["backward"] == "atomic" for d in atomic), atomic
    spec = AttentionSpec.from_json(json.dumps(atomic[0]))
    assert backward_mode(None, spec) == "atomic" and backward_mode(None, AttentionSpec()) == "deterministic"
    assert backward_mode("pytorch", spec) == "pytorch"


def test_explain_reports_the_consumer_and_its_form():
    args = af.make_inputs(0)
    with torch.no_grad():
        rep = hyscale_compile.explain(af.official_v32, *args)
    text = str(rep)
    assert len(rep.attention) == 1 and rep.attention[0].rewritten
    assert "[attention: sparse]" in text and "form per_head" in text and "mul(0.25) -> mask:range -> softmax -> @v" in text
    assert "index order: any deterministic order" in text


def grads_of(fn, args, grad_out):
    """(out, gq, gk, gv) of ``fn(*args)`` with ``grad_out`` as the output's gradient."""
    args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    out = fn(*args)
    out.backward(grad_out)
    return (out.detach(), *[args[i].grad for i in (3, 4, 5)])


@pytest.mark.parametrize("i", range(5))
def test_official_v32_training(i):
    seed = fresh_seed(f"official_v32_training[{i}]")
    args = af.make_inputs(seed, requires_grad=True)
    go = torch.randn(args[3].shape[:3] + (args[5].shape[-1],), generator=torch.Generator().manual_seed(seed))
    fn, cap = compiled(af.official_v32)
    got = grads_of(fn, args, go)
    orig = grads_of(af.official_v32, args, go)
    qi, ki, w = args[:3]
    idx = af.indexer(qi, ki, w, 4)
    ref = grads_of(lambda *a: af.official_v32_attention(idx, *[x.double() for x in a[3:]]), args, go.double())
    assert OP in targets(cap, "forward") and BWD in targets(cap, "backward")
    assert aten_bmm_count(cap, "forward") == 0 and aten_bmm_count(cap, "backward") == 0
    recs = attention_records()
    assert len(recs) == 1 and recs[0].rewritten and recs[0].backward == "sparse", [r.line() for r in recs]
    for what, a, b, r in zip(("out", "gq", "gk", "gv"), got, orig, ref):
        assert_numerics(a, b, r, torch.float32, what)


@pytest.mark.parametrize("how", ["checkpoint", "budget0"])
def test_checkpointing_neither_reselects_nor_rebuilds_the_index_mask(how):
    """Under torch.utils.checkpoint / activation_memory_budget=0 the backward reads the saved
    indices and log-sum-exp: no selection, no scatter, no dense contraction in it."""
    from torch.utils.checkpoint import checkpoint

    args = af.make_inputs(1, requires_grad=True)
    go = torch.randn(2, 16, 4, 8, generator=torch.Generator().manual_seed(1))
    if how == "checkpoint":
        def fn(*a):
            return checkpoint(af.official_v32, *a, use_reentrant=False)
    else:
        fn = af.official_v32
    cfg = torch._functorch.config.patch(activation_memory_budget=0.0 if how == "budget0" else 1.0)
    with cfg:
        c, cap = compiled(fn)
        got = grads_of(c, args, go)
    orig = grads_of(af.official_v32, args, go)
    bw = targets(cap, "backward")
    assert BWD in bw
    for op in (torch.ops.hyscale.hytopk.default, torch.ops.aten.scatter.value, torch.ops.aten.bmm.default):
        assert op not in bw, f"{op} in the backward graph"
    for a, b in zip(got, orig):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _order_graph(perm_rows: bool):
    from torch.fx.experimental.proxy_tensor import make_fx

    spec = af_spec()

    def f(x, q, k, v):
        idx = x.topk(3, dim=-1).indices
        if perm_rows:
            idx = idx.flip(1)  # each row of the op reads another row's keys
        return torch.ops.hyscale.sparse_attention(q, k, v, idx, [], spec)[0]

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(1, 5, 5, generator=g), torch.randn(1, 5, 2, 4, generator=g), torch.randn(1, 5, 2, 4, generator=g),
            torch.randn(1, 5, 2, 4, generator=g))
    gm = make_fx(f)(*args)
    return next(n for n in gm.graph.nodes if n.target is torch.ops.aten.topk.default)


def af_spec():
    from hyscale_compile.lowerings.attention_spec import AttentionSpec

    return AttentionSpec().to_json()


def test_order_the_op_reads_its_indices_in_any_order():
    """order_unread: the op's indices operand does not read the top-k's order (the selection
    keeps sorted=False behind it), but indices whose rows were moved do."""
    from hyscale_compile.passes.order import order_unread

    unread, uses = order_unread(_order_graph(False), 2)
    assert unread and "sparse_attention" in uses
    assert not order_unread(_order_graph(True), 2)[0]


@pytest.mark.parametrize("kind", ["add", "fill"])
def test_op_reads_a_tensor_mask_at_the_selected_keys_of_every_head(kind):
    """A tensor mask term (HF's float causal mask, an "add" term; a bool "fill") with H > 1
    heads: each head reads the same mask value at its row's selected keys."""
    from hyscale_compile.lowerings.attention_spec import AttentionSpec
    from hyscale_compile.lowerings.spec import MaskTerm

    g = torch.Generator().manual_seed(0)
    B, S, H, D, K = 2, 6, 4, 8, 3
    q, k, v = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(B * S)]).view(B, S, K)
    if kind == "add":
        mask = torch.randn(B, S, S, generator=g, dtype=torch.float64)
        term = MaskTerm("add", operand=0)
    else:
        mask = torch.rand(B, S, S, generator=g) < 0.3
        term = MaskTerm("fill", operand=0, where=True, value=float("-inf"))
    spec = AttentionSpec(post=(("mask", 0),), masks=(term,)).to_json()
    out = torch.ops.hyscale.sparse_attention(q.float(), k.float(), v.float(), idx, [mask if kind == "fill" else
                                                                                  mask.float()], spec)[0]
    s = torch.einsum("bshd,bthd->bhst", q, k)
    s = s + mask[:, None] if kind == "add" else s.masked_fill(mask[:, None], float("-inf"))
    sel = torch.zeros(B, S, S, dtype=torch.bool).scatter(-1, idx, True)
    s = s.masked_fill(~sel[:, None], float("-inf"))
    ref = torch.einsum("bhst,bthd->bshd", s.softmax(-1).nan_to_num(), v)
    torch.testing.assert_close(out.double().nan_to_num(), ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------- the forms

def _hf_args(seed, requires_grad=False):
    return af.make_inputs(seed, requires_grad=requires_grad) + (af.hf_causal_mask(2, 16),)


def _sdpa_args(seed, requires_grad=False):
    """HF's sdpa bool mask, with row 5 of batch 1 seeing no key (a padding row)."""
    mask = af.hf_bool_causal_mask(2, 16).clone()
    mask[1, :, 5] = False
    return af.make_inputs(seed, requires_grad=requires_grad) + (mask,)


def _mqa_args(seed, requires_grad=False):
    return af.make_mqa_inputs(seed, requires_grad=requires_grad)


# name -> (model, consumer at given indices (the float64 reference), inputs, positions of q/k/v-like inputs,
#          number of consumers, form)
FORMS = {
    "official_v32": (af.official_v32, af.official_v32_attention, af.make_inputs, (3, 4, 5), 1, "per_head"),
    "glm5_eager": (af.glm5_eager, lambda idx, q, k, v, m: af.glm5_eager_attention(idx, q, k, v, m.double()),
                   _hf_args, (3, 4, 5), 1, "per_head"),
    "hf_v32_eager_inf": (af.hf_v32_eager_inf, None, _hf_args, (3, 4, 5), 1, "per_head"),
    "megatron_absorbed": (af.megatron_absorbed, af.megatron_absorbed_attention, _mqa_args, (3, 4), 1, "mqa"),
    "hf_v32_sdpa": (af.hf_v32_sdpa, lambda idx, q, k, v, m: _sdpa_at(idx, q, k, v, m.bool()), _sdpa_args,
                    (3, 4, 5), 1, "per_head"),
    # finfo.min index mask, rewritten by the visible-row proof (passes/visible_rows.py)
    "hf_v32_eager_finfo": (af.hf_v32_eager_in_graph_mask, lambda idx, q, k, v: af.hf_v32_eager_finfo_attention(
        idx, q, k, v, af.finfo_causal(q.shape[1], q.dtype)[None, None].expand(q.shape[0], 1, -1, -1)),
        af.make_inputs, (3, 4, 5), 1, "per_head"),
}


def _reference(name, args, go):
    fn, consumer, _, pos, _, _ = FORMS[name]
    qi, ki, w = args[:3]
    idx = af.indexer(qi, ki, w, 4)  # the op's indices (the inputs' selections are unique)
    if consumer is None:  # the model itself in float64, its selection computed on the float32 inputs
        def consumer(idx_, *rest):
            return fn(qi, ki, w, *rest)
    extra = [a for i, a in enumerate(args[3:], start=3) if i not in pos]

    def run(*xs):
        return consumer(idx, *[x.double() for x in xs], *[e.double() for e in extra])
    return run


@pytest.mark.parametrize("name", sorted(FORMS))
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_form_is_rewritten_and_within_the_numerics_rule(name, train):
    fn, _, make, pos, consumers, form = FORMS[name]
    for i in range(5 if name == "official_v32" else 2):  # (official_v32: five seeds above as well)
        seed = fresh_seed(f"{name}[{train}, {i}]")
        args = make(seed, requires_grad=train)
        c, cap = compiled(fn)
        run = _reference(name, args, None)
        if not train:
            with torch.no_grad():
                out, orig = c(*args), fn(*args)
                ref = run(*[args[p] for p in pos])
            assert OP in targets(cap, "inference") and aten_bmm_count(cap, "inference") == 0
            assert_numerics(out, orig, ref, torch.float32, f"{name} out")
        else:
            out0 = fn(*args)
            go = torch.randn(out0.shape, generator=torch.Generator().manual_seed(seed))

            def grads(f, xs, g):
                xs = [x.detach().clone().requires_grad_(True) for x in xs]
                o = f(*xs)
                o.backward(g)
                return (o.detach(), *[x.grad for x in xs])

            def full(f):
                return lambda *xs: f(*[xs[pos.index(j)] if j in pos else a for j, a in enumerate(args)])

            got = grads(full(c), [args[p] for p in pos], go)
            orig = grads(full(fn), [args[p] for p in pos], go)
            ref = grads(run, [args[p] for p in pos], go.double())
            assert OP in targets(cap, "forward") and BWD in targets(cap, "backward")
            assert aten_bmm_count(cap, "forward") == 0 and aten_bmm_count(cap, "backward") == 0
            for what, a, b, r in zip(("out",) + tuple(f"grad[{p}]" for p in pos), got, orig, ref):
                assert_numerics(a, b, r, torch.float32, f"{name} {what}")
        recs = attention_records()
        assert len(recs) == consumers and all(r.rewritten and r.form == form for r in recs), [r.line() for r in recs]
        assert all(r.backward == ("sparse" if train else "") for r in recs), [r.line() for r in recs]


def test_index_cache_one_selection_feeds_two_layers():
    """GLM-5's IndexCache: both layers' attention read the one selection's indices."""
    args = _hf_args(3)
    c, cap = compiled(af.glm5_index_cache)
    with torch.no_grad():
        torch.testing.assert_close(c(*args), af.glm5_index_cache(*args), rtol=1e-5, atol=1e-5)
    graph = next(g for k, g in cap if k == "inference").graph
    ops = [n for n in graph.nodes if n.target is OP]
    assert len(ops) == 2 and ops[0].args[3] is ops[1].args[3]  # the same indices
    assert sum(n.target is torch.ops.hyscale.hytopk.default for n in graph.nodes) == 1
    assert all(r.rewritten for r in attention_records())
    assert ops[0].args[3].args[-1] is False  # the selection stays unsorted behind the op


# ------------------------------------------------------------------------------ left dense

def _compiled_equals_eager(fn, args):
    """The capture of ``fn`` compiled, after checking its no_grad outputs against eager's."""
    c, cap = compiled(fn)
    with torch.no_grad():
        out = c(*args)
        ref = fn(*args)
    for a, b in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    return cap


def _dense_case(fn, args, reason):
    cap = _compiled_equals_eager(fn, args)
    assert OP not in targets(cap, "inference")
    assert torch.ops.hyscale.hytopk.default in targets(cap, "inference")  # the selection is still fused
    recs = attention_records()
    assert len(recs) == 1 and not recs[0].rewritten and reason in recs[0].reason, [r.line() for r in recs]
    return recs[0]


def _dense_rows_case(fn, args, why):
    """Rewritten with ``empty_row="dense"``: the output is eager's, explain says the rows
    without a visible selected key are recomputed per call and why no proof held."""
    cap = _compiled_equals_eager(fn, args)
    assert OP in targets(cap, "inference") and aten_bmm_count(cap, "inference") == 0
    recs = attention_records()
    assert len(recs) == 1 and recs[0].rewritten, [r.line() for r in recs]
    assert "recomputed densely per call" in recs[0].line() and why in recs[0].line(), recs[0].line()
    assert "softmax(dense rows)" in recs[0].line()
    return recs[0]


def test_finfo_min_index_mask_over_an_input_mask_recomputes_empty_rows():
    """HF V3.2 eager's masked_fill(index_mask, finfo.min) over a mask passed in (a tensor whose
    hidden keys are not known): a row with no visible selected key would average every key in
    the original; not proven not to occur (passes/visible_rows.py), so the op recomputes such
    rows densely at run time (tests/test_attention_empty_rows.py checks the numerics)."""
    _dense_rows_case(af.hf_v32_eager, _hf_args(0), "reads a tensor")


def _sdpa_at(idx, q, kk, v, bool_mask):
    """``af.hf_v32_sdpa``'s attention at given indices (float64 in, float64 out: the reference)."""
    B, S = q.shape[0], q.shape[1]
    q, kk, v = q.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2)
    index_mask = idx.new_ones((B, S, kk.shape[2]), dtype=torch.bool).scatter(-1, idx.long(), False).unsqueeze(1)
    out = torch.nn.functional.scaled_dot_product_attention(q, kk, v, attn_mask=bool_mask & ~index_mask,
                                                           scale=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


@pytest.mark.parametrize("i", range(5))
def test_sdpa_safe_softmax_rewritten(i):
    """HF V3.2 sdpa (bool mask): sdpa's math path is a safe softmax, a row with every key
    hidden gives 0; the op runs with empty_row="zero" and gives 0 there too. Rows 3 and 9 of
    batch 1 see no key at all (a padding row), so every selected key is hidden there."""
    seed = fresh_seed(f"sdpa_safe_softmax[{i}]")
    mask = af.hf_bool_causal_mask(2, 16).clone()
    mask[1, :, 3] = False
    mask[1, :, 9] = False
    args = af.make_inputs(seed) + (mask,)
    c, cap = compiled(af.hf_v32_sdpa)
    with torch.no_grad():
        out = c(*args)
        orig = af.hf_v32_sdpa(*args)
        qi, ki, w, q, k, v = args[:6]
        ref = _sdpa_at(af.indexer(qi, ki, w, 4), q.double(), k.double(), v.double(), mask)
    assert OP in targets(cap, "inference") and aten_bmm_count(cap, "inference") == 0
    recs = attention_records()
    assert len(recs) == 1 and recs[0].rewritten and "safe_softmax" in recs[0].spec, [r.line() for r in recs]
    call = next(n for k, g in cap if k == "inference" for n in g.graph.nodes if n.target is OP)
    assert '"empty_row":"zero"' in call.args[5]
    assert (out[1, 3] == 0).all() and (out[1, 9] == 0).all() and (orig[1, 3] == 0).all()
    assert torch.isfinite(out).all()
    assert_numerics(out, orig, ref, torch.float32, "out")


def test_dense_dropout():
    def fn(*a):
        return af.hf_v32_eager_inf(*a, dropout=0.5, training=True)
    c, cap = compiled(fn)
    with torch.no_grad():
        c(*_hf_args(0))
    recs = attention_records()
    assert OP not in targets(cap, "inference")
    assert len(recs) == 1 and not recs[0].rewritten and "dropout" in recs[0].reason, [r.line() for r in recs]


def test_dropout_p0_in_training_is_rewritten():
    def fn(*a):
        return af.hf_v32_eager_inf(*a, dropout=0.0, training=True)
    c, cap = compiled(fn)
    with torch.no_grad():
        torch.testing.assert_close(c(*_hf_args(0)), fn(*_hf_args(0)), rtol=1e-5, atol=1e-5)
    assert OP in targets(cap, "inference")


def test_dense_output_attentions():
    def fn(*a):
        return af.hf_v32_eager_inf(*a, output_attentions=True)
    _dense_case(fn, _hf_args(0), "used elsewhere")


def test_dense_indices_not_from_a_top_k():
    """Indices that are not a top-k's (argsort slices may be fine, a random draw repeats):
    not a selection, so no index mask is followed."""
    def fn(idx, q, k, v):
        return af.official_v32_attention(idx, q, k, v)
    args = af.make_inputs(0)
    idx = torch.randint(0, 16, (2, 16, 4), generator=torch.Generator().manual_seed(0))
    c, cap = compiled(fn)
    with torch.no_grad():
        torch.testing.assert_close(c(idx, *args[3:]), fn(idx, *args[3:]), equal_nan=True)
    assert OP not in targets(cap, "inference") and not attention_records()


@pytest.mark.parametrize("name", ["official_v32", "megatron_absorbed"])
def test_dynamic_no_tensor_has_two_sequence_dims(name):
    """Under dynamic=True (training), no node value of the forward or backward graph (so no
    saved tensor, buffer or intermediate) has two dims of the sequence length. (The HF forms
    take their [B, 1, S, T] mask as an input, so the graphs hold that one by the API.)"""
    fn, _, make, pos, _, _ = FORMS[name]
    S = 20  # unlike every other size, so that the sequence symbol is the only one with this hint
    if make is _mqa_args:
        args = af.make_mqa_inputs(0, S=S, requires_grad=True)
    else:
        args = af.make_inputs(0, S=S, requires_grad=True) + ((af.hf_causal_mask(2, S),) if make is _hf_args else ())
    c, cap = compiled(fn, dynamic=True)
    out = c(*args)
    out.backward(torch.ones_like(out))
    graphs = {k: g for k, g in cap if k in ("forward", "backward")}
    assert set(graphs) == {"forward", "backward"}
    assert OP in targets(cap, "forward") and BWD in targets(cap, "backward")
    bad = sequence_square_nodes(graphs, S)
    assert not bad, "\n".join(bad)


def sequence_square_nodes(graphs, S):
    """The node values of ``graphs`` ({kind: GraphModule}, compiled with dynamic=True) with two
    dims that grow with the sequence symbol (the SymInt whose hint is ``S``), as lines."""
    seq = None
    for g in graphs.values():
        for n in g.graph.nodes:
            v = n.meta.get("val")
            if isinstance(v, torch.SymInt) and v.node.hint == S and v.node.expr.is_Symbol:
                seq = v.node.expr
    assert seq is not None, "the sequence length is not a symbol"
    bad = []
    for kind, g in graphs.items():
        for n in g.graph.nodes:
            v = n.meta.get("val")
            for t in (v if isinstance(v, (tuple, list)) else [v]):
                if isinstance(t, torch.Tensor):
                    # (a dim of Min(k, S) is the selection's k, at most k)
                    dims = [d for d in t.shape if isinstance(d, torch.SymInt) and seq in d.node.expr.free_symbols
                            and d.node.expr.func.__name__ != "Min"]
                    if len(dims) >= 2:
                        bad.append(f"{kind} graph: {n.name} {n.target} has shape {tuple(t.shape)}")
    return bad


def _chunk_args(seed, S):
    qi, ki, w, q, k, v = af.make_inputs(seed, S=16)
    return qi[:, -S:], ki, w[:, -S:], q[:, -S:], k, v


def test_chunked_prefill_is_rewritten():
    """S = 5 queries at positions 11..15 over T = 16 keys: the offset causal mask becomes a
    range with the offset; the output is within the numerics rule."""
    seed = fresh_seed("chunked_prefill")
    args = _chunk_args(seed, 5)
    c, cap = compiled(af.official_v32_chunk)
    with torch.no_grad():
        out, orig = c(*args), af.official_v32_chunk(*args)
        qi, ki, w, q, k, v = args
        s = (torch.einsum("bshd,btd->bsht", qi, ki).relu() * w.unsqueeze(-1)).sum(2) + af.offset_causal(5, 16)
        ref = af.official_v32_chunk_attention(s.topk(4, dim=-1)[1], q.double(), k.double(), v.double())
    assert OP in targets(cap, "inference")
    recs = attention_records()
    assert len(recs) == 1 and recs[0].rewritten and recs[0].sizes["S"] == 5 and recs[0].sizes["T"] == 16
    assert_numerics(out, orig, ref, torch.float32, "out")


def test_dense_decode():
    """One query row over the cache (decode): left dense, with the reason."""
    _dense_case(af.official_v32_chunk, _chunk_args(0, 1), "decode")


def test_enable_false_reports_the_consumer_dense():
    args = af.make_inputs(0)
    fn, cap = compiled(af.official_v32, {"hyscale.enable": False})
    with torch.no_grad():
        fn(*args)
    assert OP not in targets(cap, "inference")
    recs = attention_records()
    assert len(recs) == 1 and not recs[0].rewritten and recs[0].reason.startswith("hyscale.enable=False")


def test_dense_permuted_index_mask():
    """An index mask whose rows are transposed before it is applied (B == S here, so the
    shapes still fit): not the indices' rows, so the attention stays dense."""
    def fn(qi, ki, w, q, kk, v):
        idx = af.indexer(qi, ki, w, 4)
        S = q.shape[1]
        scores = torch.einsum("bshd,bthd->bsht", q, kk) * q.shape[-1] ** -0.5
        index_mask = torch.full((S, S, S), af.NEG_INF).scatter_(-1, idx, 0).transpose(0, 1)
        scores = scores + index_mask.unsqueeze(2)
        return torch.einsum("bsht,bthd->bshd", scores.softmax(-1), v)
    args = af.make_inputs(0, B=16, S=16)
    c, cap = compiled(fn)
    with torch.no_grad():
        out = c(*args)
    recs = attention_records()
    # (rows with fewer than k visible keys pick tied hidden keys, which the transposed mask
    # exposes: compare with the same selection and the attention left as it was)
    off, _ = compiled(fn, {"hyscale.sparse_attention": False})
    with torch.no_grad():
        torch.testing.assert_close(out, off(*args), equal_nan=True)
    assert OP not in targets(cap, "inference")
    assert len(recs) == 1 and not recs[0].rewritten and "permuted" in recs[0].reason, [r.line() for r in recs]


def test_inductor_end_to_end():
    """backend="hyscale" (Inductor codegen around the op), inference: the op runs and the
    output equals eager's within fp32 reassociation."""
    args = af.make_inputs(2)
    torch._dynamo.reset()
    diagnostics.clear()
    with torch.no_grad():
        out = torch.compile(af.official_v32, backend="hyscale")(*args)
        torch.testing.assert_close(out, af.official_v32(*args), rtol=1e-5, atol=1e-5)
    assert [r.rewritten for r in attention_records()] == [True]


# ------------------------------------------- finfo.min index masks: rows proven visible

@pytest.mark.parametrize("i", range(5))
def test_finfo_min_index_mask_rewritten_where_every_row_keeps_a_visible_key(i):
    """The indexer adds the attention's own causal mask (finfo.min above the diagonal) to
    its scores: its top-1 is visible in every row, so the finfo.min index mask is rewritten
    and the output is within the numerics rule (rows 0..k-2 select hidden keys too)."""
    seed = fresh_seed(f"finfo_min_rewritten[{i}]")
    args = af.make_inputs(seed)
    fn = af.hf_v32_eager_in_graph_mask
    c, cap = compiled(fn)
    with torch.no_grad():
        out, orig = c(*args), fn(*args)
        qi, ki, w, q, k, v = args
        s = (torch.einsum("bshd,btd->bsht", qi, ki).relu() * w.unsqueeze(-1)).sum(dim=2) + af.finfo_causal(16)
        mask64 = af.finfo_causal(16, torch.float64)[None, None].expand(2, 1, 16, 16)
        ref = af.hf_v32_eager_finfo_attention(s.topk(4, dim=-1)[1], q.double(), k.double(), v.double(), mask64)
    assert OP in targets(cap, "inference") and aten_bmm_count(cap, "inference") == 0
    recs = attention_records()
    assert len(recs) == 1 and recs[0].rewritten, [r.line() for r in recs]
    assert "every row keeps a visible selected key (the diagonal key" in recs[0].line()
    assert_numerics(out, orig, ref, torch.float32, "out")


@pytest.mark.parametrize("case, reason", [
    ("no selection mask", "an upper bound that the selection's mask does not share"),
    ("padding on the attention side", "reads a tensor"),
])
def test_finfo_min_index_mask_rows_recomputed_where_a_row_may_lose_every_key(case, reason):
    """Not proven, so the rows without a visible selected key are recomputed at run time:
    an indexer that does not hide the causally hidden keys may select only keys the
    attention hides (the original then averages every key); a padding mask only the
    attention applies may hide a row's every selected key."""
    if case == "no selection mask":
        args = af.make_inputs(0)
        _dense_rows_case(functools.partial(af.hf_v32_eager_in_graph_mask, selection_mask=False), args, reason)
    else:
        keep = torch.ones(2, 16, dtype=torch.bool)
        keep[0, :5] = False  # left padding of the first sequence: its rows 0..4 see no key
        _dense_rows_case(af.hf_v32_eager_in_graph_mask, af.make_inputs(0) + (keep,), reason)


def _megatron_masked(change):
    """Megatron's absorbed attention (tests/models/megatron_dsa.py: the index mask scattered in
    two row chunks, masked_softmax over isfinite(index mask)) with one thing changed, each of
    which the rewrite must not accept: "bias" adds a tensor into the index mask (isfinite then
    reads it), "other" adds a tensor into the logits beside the index mask (a key it hides
    would still count as valid), "valid" narrows the valid mask by another tensor, "rows"
    scatters only the first chunk of rows (no [B, S, T] scatter over every row)."""
    from tests.models import megatron_dsa as M

    def fn(qi, ki, q, lat, extra):
        idx = (qi @ ki.transpose(-1, -2) + M.causal_mask(qi.shape[1])).topk(4, dim=-1).indices
        sq, b, np_, hn = q.shape
        scores = torch.matmul(q.permute(1, 2, 0, 3), lat.permute(1, 2, 3, 0)) * hn ** -0.5
        im = torch.full((b, sq, sq), float("-inf"))
        if change == "rows":
            M._mg_scatter_topk_into_index_mask(im[:, :8], idx[:, :8], seq_chunk_size=8)
        else:
            M._mg_scatter_topk_into_index_mask(im, idx, seq_chunk_size=8)
        im = im + M.causal_mask(sq)
        if change == "bias":
            im = im + extra
        logits = scores + im.unsqueeze(1)
        if change == "other":
            logits = logits + extra.unsqueeze(1)
        valid = torch.isfinite(im)
        if change == "valid":
            valid = valid & (extra > 0)
        p = M.masked_softmax(logits, valid.unsqueeze(1).expand(b, np_, sq, sq))
        return torch.matmul(p, lat[..., :8].permute(1, 2, 0, 3))
    return fn


@pytest.mark.parametrize("change, reason", [
    ("bias", "whose index mask holds an additive tensor at the selected keys"),
    ("other", "with another tensor (add_"),
    ("valid", "is not isfinite of the index mask its logits were given"),
    ("rows", "is a scatter_reduce ('amax') of where(ge(idx, 0), 0.0, -inf) at the indices"),
])
def test_dense_megatron_masked_softmax_variants(change, reason):
    """Each variant of Megatron's masked_softmax form the proof does not cover stays dense, with
    its reason; the output is eager's."""
    from tests.models import megatron_dsa as M

    qi, ki, q, lat, _ = M.absorbed_site_inputs(fresh_seed(f"megatron masked {change}") % 10_000)
    extra = torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(1))
    _dense_case(_megatron_masked(change), (qi, ki, q.detach(), lat.detach(), extra), reason)
