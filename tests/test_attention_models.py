"""The sparse attention over the selection (``torch.ops.hyscale.sparse_attention``) on the real
models' own attention code: HF DeepSeek-V3.2 (eager and sdpa), GLM-5 with IndexCache (one
selection feeds two layers), Megatron-Core's ``unfused_dsa_fn`` (the per-head form
``DSAttention`` runs in megatron-core 0.16.1, which has no absorbed variant), newer Megatron-Core's
``_unfused_absorbed_dsa_fn`` (a stand-in of its source: MQA over the latent, its row-chunked
index mask and masked_softmax) and DeepSeek-V4 CSA (left dense, with a reason). Debug backend,
tiny configs (tests/models/hf_models.py, tests/models/megatron_dsa.py), no_grad and training.

For each form: the op appears in the compiled graphs where expected (counted), and the outputs
and gradients satisfy the numerics rule ``err(op) <= 2 err(orig) + 2 eps(dtype)``
(``hyscale_compile.testing.assert_consumer_close``).

How the float64 reference gets the op's own indices: while the compiled model runs, the
selections' indices are recorded from the selection op's CPU implementation (``ops._impl``:
what ``hyscale::hytopk`` returned, in call order, i.e. layer order). The reference is then the
same model, copied and cast to float64 (MoE experts on their eager path: ``grouped_mm`` has no
float64 kernel), with each layer's indexer replaced by a function that returns the recorded
indices of that layer. So the reference and the compiled model attend over the same keys,
whatever ties the indexer's scores have; ``orig`` is the same copy in the model's own dtype (the
original graph in eager, standing in for the default backend: no Inductor compile here). A
layer that reuses the previous layer's indices (IndexCache) has no indexer and reuses the
recorded ones as the model does. Megatron's ``unfused_dsa_fn`` casts to fp32 inside, so its
float64 reference is written out here (``_megatron_reference``: scores, causal and index masks,
softmax, values, in float64 at the recorded indices). Each reference check also bounds
err(orig) (a reference that computed something else, e.g. another MoE routing, would make the
rule vacuous).

The numerics tests hold for a dense original too; the count tests say which forms are rewritten.
"""
import contextlib
import copy

import pytest
import torch

import hyscale_compile
from hyscale_compile.lowerings import ops as hy_ops
from hyscale_compile.passes import diagnostics
from hyscale_compile.testing import assert_consumer_close, square_tensors
from tests.contract import fresh_seed
from tests.models import hf_models

pytestmark = [
    pytest.mark.skipif(not hf_models.transformers_available(), reason="transformers==5.24.0 not installed"),
    pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`-wrapped function"),
]

ATTENTION = torch.ops.hyscale.sparse_attention.default
ATTENTION_BACKWARD = torch.ops.hyscale.sparse_attention_backward.default
SELECTION = (torch.ops.hyscale.hytopk.default, torch.ops.hyscale.hytopk_values.default)
# err(orig) above this: the reference is not the same computation (it would make the rule vacuous)
ORIG_SANE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def count(cap, targets, kinds=("inference", "forward")):
    """Nodes calling one of ``targets`` in the captured graphs of ``kinds``."""
    targets = targets if isinstance(targets, tuple) else (targets,)
    return sum(1 for kind, g in cap if kind in kinds and not isinstance(g, str)
               for n in g.graph.nodes if n.op == "call_function" and n.target in targets)


def selection_consumers(records):
    """The attention records of the DSA selections (the fused ones): the MoE routers' own
    top-k scatters (a group mask, not an index mask over keys) are left out."""
    return [r for r in records if r.selection.startswith("hytopk")]


@contextlib.contextmanager
def recorded_selections():
    """Inside: every index tensor the selection op (CPU) returns, appended in call order."""
    calls = []
    inner = hy_ops._impl

    def spy(*args, **kwargs):
        out = inner(*args, **kwargs)
        calls.append((out[1] if isinstance(out, tuple) else out).detach().clone())
        return out

    hy_ops._impl = spy
    try:
        yield calls
    finally:
        hy_ops._impl = inner


def forced_copy(model, calls, dtype):
    """``model`` copied and cast to ``dtype``, each indexer returning its recorded indices."""
    m = copy.deepcopy(model).to(dtype)
    m.zero_grad(set_to_none=True)
    if dtype == torch.float64:
        m.set_experts_implementation("eager")
    full = [layer.self_attn for layer in m.model.layers if getattr(layer.self_attn, "indexer", None) is not None]
    assert len(full) == len(calls), f"{len(full)} indexers but {len(calls)} recorded selections"
    for attn, idx in zip(full, calls):
        attn.indexer.forward = lambda *a, _idx=idx, **k: _idx
    return m


def _loss_weights(logits, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(logits.shape, generator=g, dtype=torch.float64)


def _step(model, kwargs, train, weights_seed):
    """Logits and, in training, the parameters' gradients of sum(logits * w)."""
    if not train:
        with torch.no_grad():
            return model(**kwargs).logits, {}
    logits = model(**kwargs).logits
    (logits * _loss_weights(logits, weights_seed).to(logits.dtype)).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


_RUNS = {}


def run_hf(name, attn, train, dtype=torch.float32, **build):
    """Compile the tiny model once per case (cached for the count and numerics tests): its
    captured graphs, outputs and gradients, and the recorded selections."""
    key = (name, attn, train, dtype, tuple(sorted(build.items())))
    if key in _RUNS:
        return _RUNS[key]
    seed = fresh_seed(f"{name} {attn} train={train}") % 8  # hf_models: seeds 0-7 have no boundary tie
    extra = {} if name == "deepseek_v4" else {"attn_implementation": attn}
    model, kwargs = hf_models.BUILDERS[name](seed, dtype=dtype, **extra, **build)
    model.train(train)
    cap = []
    torch._dynamo.reset()
    diagnostics.clear()
    compiled = torch.compile(model, backend="hyscale_debug", options={"hyscale.capture": cap})
    with recorded_selections() as calls, torch.set_grad_enabled(train):
        logits = compiled(**kwargs).logits
    records = selection_consumers(diagnostics.attention_records())
    grads = {}
    if train:  # the backward runs outside the recording: nothing in it may re-select
        (logits * _loss_weights(logits, seed).to(logits.dtype)).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    out = logits.detach()
    torch._dynamo.reset()
    _RUNS[key] = dict(model=model, kwargs=kwargs, cap=cap, calls=calls, out=out, grads=grads, seed=seed,
                      dtype=dtype, train=train, records=records)
    return _RUNS[key]


def check_numerics(r):
    """The rule for the logits and every parameter gradient, against float64 at the recorded
    indices; err(orig) must be small (the reference computes the same function)."""
    dtype = r["dtype"]
    orig_out, orig_grads = _step(forced_copy(r["model"], r["calls"], dtype), r["kwargs"], r["train"], r["seed"])
    ref_out, ref_grads = _step(forced_copy(r["model"], r["calls"], torch.float64), r["kwargs"], r["train"], r["seed"])
    e, eo = assert_consumer_close(r["out"], orig_out, ref_out, dtype, what="logits")
    print(f"logits: err {e:.3g}, err(orig) {eo:.3g}")
    assert eo < ORIG_SANE[dtype], f"logits: err(orig) {eo:.3g}: the reference is not the same computation"
    assert set(r["grads"]) == set(ref_grads) == set(orig_grads), "different parameters got gradients"
    worst = 0.0
    for n, g in ref_grads.items():
        e, eo = assert_consumer_close(r["grads"][n], orig_grads[n], g, dtype, what=f"grad {n}")
        assert eo < ORIG_SANE[dtype], f"grad {n}: err(orig) {eo:.3g}: the reference is not the same computation"
        worst = max(worst, e)
    if r["train"]:
        assert ref_grads, "no gradients"
        print(f"{len(ref_grads)} gradients: worst err {worst:.3g}")


# --- HF DeepSeek-V3.2 and GLM-5 ----------------------------------------------------------------

# the finfo.min index masks (masked_fill(scatter(new_ones, idx, False), finfo.min)): rewritten where
# passes/visible_rows.py proves every row keeps a visible selected key (the indexer adds the
# attention's own causal mask to its scores, so its top-1 is visible); HF V3.2 sdpa: its math
# path's safe softmax runs as the op's empty_row="zero"
REWRITTEN = [("deepseek_v32", "eager"), ("glm_moe_dsa", "eager"), ("deepseek_v32", "sdpa")]
CASES = REWRITTEN
NUMERIC_CASES = REWRITTEN
# the layers whose attention applies an index mask: two per model (GLM: one selection, two layers)
EXPECTED_ATTENTION = {"deepseek_v32": 2, "glm_moe_dsa": 2}


@pytest.mark.parametrize("train", [False, True], ids=["no_grad", "train"])
@pytest.mark.parametrize("name, attn", NUMERIC_CASES)
def test_hf_numerics_at_the_ops_indices(name, attn, train):
    """Logits (and in training every parameter's gradient) within the rule of the float64
    model attending over the same selected keys."""
    check_numerics(run_hf(name, attn, train))


def test_hf_numerics_bf16_training():
    """The same in bf16 (the dtype the models train in): V3.2, eager attention, a training step.
    Both MLPs dense: with a router, bf16 and float64 route near-equal experts differently."""
    r = run_hf("deepseek_v32", "eager", True, torch.bfloat16, first_k_dense_replace=2)
    # its scores are rounded to bf16 twice (the matmul's output, the scaled score): the
    # Triton backward differentiates the roundings, so on CUDA it runs (explain says which)
    for x in r["records"]:
        assert "round('bfloat16')" in x.line() and "(on CUDA: Triton kernels)" in x.line(), x.line()
    check_numerics(r)


@pytest.mark.parametrize("train", [False, True], ids=["no_grad", "train"])
@pytest.mark.parametrize("name, attn", CASES)
def test_hf_attention_rewritten(name, attn, train):
    """Each layer's masked attention became one sparse-attention op (and its backward in
    training); the selections stayed fused, one per indexer (GLM's IndexCache: one for two)."""
    r = run_hf(name, attn, train)
    cap = r["cap"]
    selections = hf_models.EXPECTED_TOPK[name][0]
    assert len(r["calls"]) == selections
    if name == "glm_moe_dsa":
        assert selections == 1  # IndexCache: the shared layer reuses layer 0's indices
    kinds = ("forward",) if train else ("inference",)
    assert count(cap, SELECTION, kinds) == selections
    assert count(cap, ATTENTION, kinds) == EXPECTED_ATTENTION[name]
    if train:
        assert count(cap, ATTENTION_BACKWARD, ("backward",)) == EXPECTED_ATTENTION[name]
        assert count(cap, SELECTION, ("backward",)) == 0  # nothing re-selects


@pytest.mark.parametrize("name, attn, train", [*((n, a, False) for n, a in REWRITTEN), ("deepseek_v32", "eager", True)])
def test_hf_batch_one_is_rewritten(name, attn, train):
    """Batch 1, the long-context case: HF then detects packed sequences from the positions
    (``find_packed_sequence_indices``), so the causal mask is ``causal & doc[q] == doc[t]``
    with a batch dim of size 1; both the selection's mask and the attention's canonicalize to
    ranges (no [S, T] mask operand), and the numerics rule holds."""
    r = run_hf(name, attn, train, batch=1)
    kinds = ("forward",) if train else ("inference",)
    assert count(r["cap"], ATTENTION, kinds) == EXPECTED_ATTENTION[name], [x.line() for x in r["records"]]
    for x in r["records"]:
        assert "mask:range" in x.line() and "mask:add" not in x.line(), x.line()
    check_numerics(r)


@pytest.mark.parametrize("name, attn", NUMERIC_CASES)
def test_hf_every_consumer_is_reported(name, attn):
    """Each layer's index mask has one explain record: sparse (and then the op is in the
    graph) or dense with its reason; GLM's two records share one selection."""
    r = run_hf(name, attn, False)
    recs = r["records"]
    assert len(recs) == EXPECTED_ATTENTION[name], [x.line() for x in recs]
    for x in recs:
        assert x.rewritten or x.reason, x.line()
    assert count(r["cap"], ATTENTION, ("inference",)) == sum(x.rewritten for x in recs)
    assert len({x.selection for x in recs}) == hf_models.EXPECTED_TOPK[name][0]


def test_hf_rewrite_switch_off_leaves_the_attention_dense():
    """``hyscale.sparse_attention: False`` keeps the dense attention (the selection is still
    fused), with the same logits."""
    model, kwargs = hf_models.build_deepseek_v32(fresh_seed("switch off") % 8)
    from hyscale_compile.options import HYSCALE_OPTIONS

    opts = {"hyscale.capture": []}
    assert "sparse_attention" in HYSCALE_OPTIONS
    opts["hyscale.sparse_attention"] = False
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="hyscale_debug", options=opts)(**kwargs).logits
        ref = model(**kwargs).logits
    cap = opts["hyscale.capture"]
    assert count(cap, ATTENTION) == 0 and count(cap, SELECTION) == 2
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# --- left dense: DeepSeek-V4 CSA, returned attention weights -------------------------------------

def _attention_lines(report):
    """explain's lines about the DSA selections' attention consumers."""
    return [x.line() for x in selection_consumers(report.attention)]


def test_v4_csa_stays_dense():
    """V4's CSA mask is the scattered block bias concatenated onto the sliding-window mask,
    with per-head sinks appended to the logits: no sparse-attention op, logits as eager."""
    r = run_hf("deepseek_v4", "eager", False)
    assert count(r["cap"], SELECTION, ("inference",)) == hf_models.EXPECTED_TOPK["deepseek_v4"][0]
    assert count(r["cap"], ATTENTION, ("inference",)) == 0
    with torch.no_grad():
        ref = r["model"](**r["kwargs"]).logits
    torch.testing.assert_close(r["out"], ref, atol=1e-5, rtol=1e-5)


def test_v4_csa_dense_reason_in_explain():
    """V4 remaps the selected indices before the scatter (a future pick becomes -1, then -1 the
    sentinel column T_c, sliced off after the scatter): the scattered positions are no longer
    a top-k's distinct ones, so the pass does not follow them, and explain says so, once per
    CSA layer, naming the remapping. The MoE router's top-k builds no index mask: no record."""
    model, kwargs = hf_models.build_deepseek_v4(fresh_seed("v4 reason") % 8)
    with torch.no_grad():
        report = hyscale_compile.explain(model, **kwargs)
    lines = [x.line() for x in report.attention]
    assert len(lines) == 2 and len(_attention_lines(report)) == 2, lines  # one per CSA layer, none for the router
    for ln in lines:
        assert ln.startswith("[attention: dense] scatter"), ln
        assert "remapped by where" in ln and "not a top-k's distinct positions" in ln, ln


def test_v4_block_bias_at_unsqueezed_indices_is_reported():
    """V4's block bias is [B, 1, S, T], scattered at ``idx.unsqueeze(1)``; even without the
    remapping the walk does not follow a scatter at a view of the indices of another shape:
    one dense record that says so, and the output is eager's."""
    from tests.models import attention_forms as af

    def fn(qi, ki, w, q, kk, v):  # (the indexer with no causal mask: no ties at -inf, eager picks the op's keys)
        idx = (torch.einsum("bshd,btd->bsht", qi, ki).relu() * w.unsqueeze(-1)).sum(dim=2).topk(4, dim=-1)[1]
        bias = torch.full((q.shape[0], 1, q.shape[1], kk.shape[1]), float("-inf")).scatter(-1, idx.unsqueeze(1), 0.0)
        scores = torch.einsum("bshd,bthd->bhst", q, kk) * q.shape[-1] ** -0.5 + bias
        return torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)

    args = af.make_inputs(fresh_seed("v4 unsqueezed block bias"))
    cap = []
    torch._dynamo.reset()
    diagnostics.clear()
    with torch.no_grad():
        out = torch.compile(fn, backend="hyscale_debug", options={"hyscale.capture": cap})(*args)
        torch.testing.assert_close(out, fn(*args), atol=1e-5, rtol=1e-5)
    recs = diagnostics.attention_records()
    assert count(cap, ATTENTION, ("inference",)) == 0 and len(recs) == 1, [x.line() for x in recs]
    assert not recs[0].rewritten and "a view of the indices shaped [2, 1, 16, 4]" in recs[0].reason, recs[0].line()


def test_v32_returned_attention_weights_stay_dense_with_reason():
    """``output_attentions=True`` returns the dense probabilities: the site stays dense and
    explain says why; the logits are eager's."""
    model, kwargs = hf_models.build_deepseek_v32(fresh_seed("output_attentions") % 8)
    kwargs = dict(kwargs, output_attentions=True)
    cap = []
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="hyscale_debug", options={"hyscale.capture": cap})(**kwargs)
        ref = model(**kwargs)
        lines = _attention_lines(hyscale_compile.explain(model, **kwargs))
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    assert count(cap, ATTENTION) == 0
    assert len(lines) == 2 and all(ln.startswith("[attention: dense]") and "weights" in ln for ln in lines), lines


# --- dynamic=True: no [S, T] tensor in the training step ---------------------------------------

DYN_SEQ = 36  # no dim of the tiny model is 36 (40 is kv_lora + rope)


def test_v32_dynamic_training_step_has_no_square_tensor():
    """Under dynamic=True the tiny V3.2 training step's forward and backward graphs hold no
    node value, saved tensor or buffer with two sequence-length dims."""
    model, kwargs = hf_models.build_deepseek_v32(fresh_seed("dynamic") % 8, seq=DYN_SEQ)
    model.train()
    cap = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="hyscale_debug", dynamic=True, options={"hyscale.capture": cap})
    compiled(**kwargs).logits.sum().backward()
    graphs = [(k, g) for k, g in cap if k in ("forward", "backward")]
    assert len(graphs) == 2, [k for k, _ in cap]
    sym = [n for _, g in graphs for n in g.graph.nodes if n.op == "placeholder"
           and isinstance(n.meta.get("val"), torch.Tensor) and any(isinstance(d, torch.SymInt) for d in n.meta["val"].shape)]
    assert sym, "dynamic=True gave no symbolic input: the check below would see concrete sizes only"
    found = square_tensors(graphs, [DYN_SEQ])
    assert found == [], "\n".join(found)


# --- Megatron-Core DSAttention (unfused_dsa_fn) --------------------------------------------------

@pytest.fixture(scope="module")
def megatron_cpu():
    pytest.importorskip("megatron.core")
    from tests.models import megatron_dsa as M

    # traceable_rope: one graph from the indexer to the attention (megatron_dsa.traceable_rope)
    with M.parallel_state_1x1(), M.cpu_current_device(), M.use_rotation("matmul"), M.traceable_rope():
        yield M


def run_megatron(M, grad):
    """``DSAttention`` compiled (bf16, B=1, S=32), with grad of sum(out * w) for query, key and
    value when ``grad``; cached per mode."""
    from megatron.core.transformer.enums import AttnMaskType

    key_ = ("megatron", grad)
    if key_ in _RUNS:
        return _RUNS[key_]
    seed = fresh_seed(f"megatron grad={grad}") % 10_000
    att, args = M.build(seed, B=1, S=32)
    qkv = [t.clone().requires_grad_(grad) for t in args[:3]]
    cap = []
    torch._dynamo.reset()
    compiled = torch.compile(att, backend="hyscale_debug", options={"hyscale.capture": cap})
    with recorded_selections() as calls, torch.set_grad_enabled(grad):
        out = compiled(*qkv, *args[3:], attn_mask_type=AttnMaskType.causal)
    w = _loss_weights(out, seed).to(out.dtype)
    grads = torch.autograd.grad((out * w).sum(), qkv) if grad else ()
    torch._dynamo.reset()
    _RUNS[key_] = dict(M=M, att=att, args=args, cap=cap, calls=calls, out=out.detach(), grads=grads, w=w, grad=grad)
    return _RUNS[key_]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_megatron_numerics_at_the_ops_indices(megatron_cpu, grad):
    """The output (and the gradients of query, key and value) within the rule of the float64
    attention over the recorded selection; orig is eager bf16 at the same selection."""
    from megatron.core.transformer.enums import AttnMaskType

    r = run_megatron(megatron_cpu, grad)
    M, att, args = r["M"], r["att"], r["args"]
    (idx,) = r["calls"]
    qkv = [t.clone().requires_grad_(grad) for t in args[:3]]
    with M.forced_indices(att, idx), torch.set_grad_enabled(grad):
        orig = att(*qkv, *args[3:], attn_mask_type=AttnMaskType.causal)
    q64 = [t.double().requires_grad_(grad) for t in args[:3]]
    with torch.set_grad_enabled(grad):
        ref = M.attention_reference(*q64, idx, att.softmax_scale)
    e, eo = assert_consumer_close(r["out"], orig, ref, torch.bfloat16, what="output")
    print(f"output: err {e:.3g}, err(orig) {eo:.3g}")
    assert eo < ORIG_SANE[torch.bfloat16]
    if grad:
        orig_g = torch.autograd.grad((orig * r["w"]).sum(), qkv)
        ref_g = torch.autograd.grad((ref * r["w"].double()).sum(), q64)
        for name, g, go, gr in zip(("query", "key", "value"), r["grads"], orig_g, ref_g):
            e, eo = assert_consumer_close(g, go, gr, torch.bfloat16, what=f"grad {name}")
            print(f"grad {name}: err {e:.3g}, err(orig) {eo:.3g}")
            assert eo < ORIG_SANE[torch.bfloat16]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_megatron_attention_rewritten(megatron_cpu, grad):
    r = run_megatron(megatron_cpu, grad)
    kinds = ("forward",) if grad else ("inference",)
    assert count(r["cap"], SELECTION, kinds) == 1
    assert count(r["cap"], ATTENTION, kinds) == 1
    if grad:
        # the backward of the in-place `attention_scores += index_mask` on a view (functionalized:
        # new_empty_strided -> copy -> view -> clone -> copy -> view) is the region's own
        assert count(r["cap"], ATTENTION_BACKWARD, ("backward",)) == 1
        assert count(r["cap"], ATTENTION, ("backward",)) == 0
        assert count(r["cap"], SELECTION + (torch.ops.aten.topk.default,), ("backward",)) == 0  # nothing re-selects
        assert not [n for _, g in r["cap"] if not isinstance(g, str) for n in g.graph.nodes
                    if n.target in (torch.ops.aten.scatter.value, torch.ops.aten.scatter.src)], \
            "an index mask is still built"


def _megatron_site(case, seed):
    """(fn, inputs, leaves) for ``megatron_dsa.dsa_site`` in one of the proof's cases."""
    from tests.models import megatron_dsa as M

    qi, ki, q, k, v = M.site_inputs(seed)
    if case == "distinct":
        return M.dsa_site, (qi, ki, q, k, v), (q, k, v)
    if case == "key_is_query":  # one tensor is q and k: its gradient comes from two places
        return M.dsa_site, (qi, ki, q, q, v), (q, v)
    if case == "absorbed":  # MQA over one latent head, the value a view of it
        q = torch.randn(16, 1, 4, 12, generator=torch.Generator().manual_seed(seed)).requires_grad_()
        lat = torch.randn(16, 1, 1, 12, generator=torch.Generator().manual_seed(seed + 2)).requires_grad_()
        return M.absorbed_site, (qi, ki, q, lat), (q, lat)
    if case.startswith("mla"):  # HF's K/V expansion of one latent (tests/test_mla.py) under unfused_dsa_fn
        from tests import test_mla as T

        args = [t.requires_grad_() if i >= 3 else t for i, t in enumerate(T.make_inputs(seed))]
        extra = ()
        if case == "mla_mask_gets_gradient":
            extra = ((0.1 * torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(seed))).requires_grad_(),)

        def fn(qi, ki, w, q_pass, q_rot, k_pass, k_rot, w_kv, *bias):
            H, Dn = q_pass.shape[1], q_pass.shape[-1]
            k, v = T.expand_kv(k_pass, k_rot, w_kv, H, Dn, w_kv.shape[0] // H - Dn)
            sf = lambda t: t.permute(2, 0, 1, 3)  # noqa: E731  ([B, H, S, D] -> Megatron's [S, B, H, D])
            attention = M.unfused_dsa_fn_with_index_bias if bias else None
            return M.dsa_site(qi.mean(2), ki, sf(torch.cat((q_pass, q_rot), -1)), sf(k), sf(v), *bias,
                              attention=attention)  # (qi [B, S, Hi, Di]: one indexer head)
        return fn, (*args, *extra), (*args[3:], *extra)
    bias = (0.1 * torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(seed))).requires_grad_()
    fn = lambda *a: M.dsa_site(*a, attention=M.unfused_dsa_fn_with_index_bias)  # noqa: E731
    return fn, (qi, ki, q, k, v, bias), (q, k, v, bias)


@pytest.mark.parametrize("case", ["distinct", "absorbed", "mla", "key_is_query", "mask_gets_gradient",
                                  "mla_mask_gets_gradient"])
def test_megatron_inplace_add_on_a_view_backward_proof(case):
    """``unfused_dsa_fn``'s in-place ``attention_scores += index_mask`` on a view, in training:
    its functionalized backward (new_empty_strided -> copy -> view -> clone -> copy -> view,
    nodes no forward node names by seq_nr) is taken into the region, and the proof still
    rejects a gradient into the mask and an operand used twice (dense, with the reason). The
    gradients match the rule (rewritten) or the eager original (dense)."""
    pytest.importorskip("megatron.core")
    from hyscale_compile.passes import mla

    seed = fresh_seed(f"megatron in-place proof {case}") % 10_000
    fn, args, leaves = _megatron_site(case, seed)
    cap = []
    diagnostics.clear()
    torch._dynamo.reset()
    c = torch.compile(fn, backend="hyscale_debug", fullgraph=True, options={"hyscale.capture": cap})
    out = c(*args)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    grads = torch.autograd.grad(out, leaves, go)
    recs = diagnostics.attention_records()
    torch._dynamo.reset()
    assert len(recs) == 1, [r.line() for r in recs]
    orig = fn(*args)
    orig_g = torch.autograd.grad(orig, leaves, go)
    if case in ("distinct", "absorbed", "mla"):
        assert recs[0].rewritten and recs[0].backward == "sparse", recs[0].line()
        assert (recs[0].form == mla.FORM) == (case == "mla"), recs[0].line()
        assert count(cap, ATTENTION, ("forward",)) == 1 and count(cap, ATTENTION_BACKWARD, ("backward",)) == 1
        assert count(cap, SELECTION + (torch.ops.aten.topk.default,), ("backward",)) == 0  # nothing re-selects
        # float64 at the same keys (the -inf picks of the first rows are hidden by the causal mask)
        a64 = [a.detach().double().requires_grad_(a.requires_grad) for a in args]
        ref = fn(*a64)
        ref_g = torch.autograd.grad(ref, [a for a in a64 if a.requires_grad], go.double())
        names = {"distinct": ("grad query", "grad key", "grad value"), "absorbed": ("grad query", "grad latent"),
                 "mla": ("grad q_pass", "grad q_rot", "grad k_pass", "grad k_rot", "grad w_kv")}[case]
        assert len(names) == len(grads) == len(ref_g)
        for what, x, xo, xr in zip(("output", *names),
                                   (out, *grads), (orig, *orig_g), (ref, *ref_g)):
            assert_consumer_close(x, xo, xr, torch.float32, what=what)
        return
    assert not recs[0].rewritten, recs[0].line()
    assert "training graph: cannot tell which operand the gradient" in recs[0].reason, recs[0].line()
    assert "(a gradient into a mask or an operand used twice)" in recs[0].reason, recs[0].line()
    if case == "mla_mask_gets_gradient":  # the absorbed backward refused it first, then the per-head one
        assert recs[0].sizes["latent"].startswith("training graph:") and "read outside" in recs[0].sizes["latent"]
    assert count(cap, ATTENTION, ("forward",)) == 0 and count(cap, ATTENTION_BACKWARD, ("backward",)) == 0
    torch.testing.assert_close(out, orig, rtol=1e-5, atol=1e-5)
    for x, xo in zip(grads, orig_g):
        torch.testing.assert_close(x, xo, rtol=1e-5, atol=1e-5)


# --- Megatron-Core _unfused_absorbed_dsa_fn (newer Megatron-LM; tests/models/megatron_dsa.py) -----

# (mask, seq_chunk_size) at S = 16: 256 is the source's chunk (one chunk), 8 gives two row chunks
ABSORBED_CASES = [("additive", 256), ("varlen", 256), ("additive", 8), ("varlen", 8)]
ABSORBED_IDS = ["additive", "varlen", "additive-chunked", "varlen-chunked"]


def run_megatron_absorbed(mask, chunk, grad):
    """``megatron_absorbed_site`` (fp32, B=1, S=16, 4 heads over one latent of 8 + 4) compiled
    with the debug backend; with grad, the gradients of query, latent and the value
    up-projection for a seeded output gradient. Cached per case."""
    import functools

    from tests.models import megatron_dsa as M

    key_ = ("megatron_absorbed", mask, chunk, grad)
    if key_ in _RUNS:
        return _RUNS[key_]
    seed = fresh_seed(f"megatron absorbed {mask} chunk={chunk} grad={grad}") % 10_000
    args = M.absorbed_site_inputs(seed)
    fn = functools.partial(M.megatron_absorbed_site, mask=mask, seq_chunk_size=chunk)
    cap = []
    diagnostics.clear()
    torch._dynamo.reset()
    c = torch.compile(fn, backend="hyscale_debug", fullgraph=True, options={"hyscale.capture": cap})
    with recorded_selections() as calls, torch.set_grad_enabled(grad):
        out = c(*args)
    recs = selection_consumers(diagnostics.attention_records())
    selections = [x.line() for x in diagnostics.records()]
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    grads = torch.autograd.grad(out, args[2:], go) if grad else ()  # (outside the recording: no re-selection)
    torch._dynamo.reset()
    _RUNS[key_] = dict(M=M, args=args, cap=cap, calls=calls, out=out.detach(), grads=grads, go=go, grad=grad,
                       records=recs, selections=selections, mask=mask, chunk=chunk)
    return _RUNS[key_]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("mask, chunk", ABSORBED_CASES, ids=ABSORBED_IDS)
def test_megatron_absorbed_explain(mask, chunk, grad):
    """One explain record per consumer: the absorbed attention ran as MQA over the latent, its
    masked_softmax read as the op's softmax with empty_row="zero", and the index mask's build
    (a scatter_reduce ('amax') of where(idx >= 0, 0, -inf) at clamp_min(idx, 0), one per row
    chunk) named with its chunks and folded into one scatter (passes/index_mask.py)."""
    r = run_megatron_absorbed(mask, chunk, grad)
    chunks = -(-16 // chunk)
    (x,) = r["records"]
    ln = x.line()
    assert x.rewritten and x.form == "mqa", ln
    assert x.sizes["H"] == 4 and x.sizes["Hk"] == 1 and x.sizes["Dqk"] == 12 and x.sizes["Dv"] == 8, ln
    assert "softmax=masked_softmax over isfinite(index mask)" in ln and "safe_softmax" in ln, ln
    assert "mask:range" in ln and "mask:add" not in ln, ln  # the causal row mask (or varlen bounds) as a range
    rows = f"{chunks} row chunks" if chunks > 1 else "one chunk"
    assert f"index mask built in {rows} (" in ln and "scatter_reduce ('amax') of where(idx >= 0, 0.0, -inf)" in ln, ln
    assert "at clamp_min(idx, 0)" in ln and "folded into one scatter of 0.0" in ln, ln
    assert x.backward == ("sparse" if grad else ""), ln
    # the chunked scatter_reduce ('amax') of two constants reads no order: the selection skips its sort
    (sel,) = r["selections"]
    assert "(unsorted: nothing reads the order; its uses end in aten.scatter_reduce.two)" in sel, sel


def _padded(idx, S):
    """Megatron's padding of invalid picks: the slots a causal row cannot fill become -1."""
    pos = torch.arange(S).view(1, S, 1)
    return torch.where(idx <= pos, idx, -1)


@pytest.mark.parametrize("chunk", [256, 8])
def test_megatron_absorbed_padded_indices_stay_dense(chunk):
    """Indices padded with -1 (``where(idx <= s, idx, -1)``) are no longer a top-k's positions:
    the op cannot read a -1 slot (clamped to key 0 with src -inf, amax would leave the mask as it
    is, but the op would gather key 0). Dense, one record per row chunk naming the remapping;
    the output is eager's."""
    from tests.models import megatron_dsa as M

    def fn(qi, ki, q, lat, w):
        s = qi @ ki.transpose(-1, -2) + M.causal_mask(qi.shape[1])
        idx = _padded(s.topk(4, dim=-1).indices, qi.shape[1])
        return M.megatron_absorbed_attention(q, lat, w, idx, seq_chunk_size=chunk)

    args = M.absorbed_site_inputs(fresh_seed(f"megatron absorbed padded {chunk}") % 10_000)
    cap = []
    diagnostics.clear()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend="hyscale_debug", fullgraph=True, options={"hyscale.capture": cap})(*args)
        torch.testing.assert_close(out, fn(*args), rtol=1e-5, atol=1e-5)
    recs = selection_consumers(diagnostics.attention_records())
    assert len(recs) == -(-16 // chunk), [x.line() for x in recs]
    for x in recs:
        assert not x.rewritten and "remapped by where" in x.reason and "not a top-k's distinct" in x.reason, x.line()
    assert count(cap, ATTENTION, ("inference",)) == 0 and count(cap, SELECTION, ("inference",)) == 1


@pytest.mark.parametrize("mask, chunk", [("additive", 8)])
def test_megatron_absorbed_switch_off_keeps_the_chunked_build(mask, chunk):
    """``hyscale.sparse_attention: False``: dense, explain says what the pass would do, and the
    graph keeps Megatron's own chunked build (its scatter_reduce per chunk, no folded scatter);
    the output is eager's, bit for bit."""
    import functools

    from tests.models import megatron_dsa as M

    fn = functools.partial(M.megatron_absorbed_site, mask=mask, seq_chunk_size=chunk)
    args = M.absorbed_site_inputs(fresh_seed("megatron absorbed off") % 10_000)
    cap = []
    diagnostics.clear()
    torch._dynamo.reset()
    opts = {"hyscale.capture": cap, "hyscale.sparse_attention": False}
    with torch.no_grad():
        out = torch.compile(fn, backend="hyscale_debug", fullgraph=True, options=opts)(*args)
        assert torch.equal(out, fn(*args))
    (x,) = selection_consumers(diagnostics.attention_records())
    assert not x.rewritten and "hyscale.sparse_attention=False" in x.reason and "form mqa" in x.reason, x.line()
    g = next(g for k, g in cap if k == "inference").graph
    targets = [n.target for n in g.nodes]
    assert targets.count(torch.ops.aten.scatter_reduce.two) == 2 and torch.ops.aten.scatter.value not in targets
    assert count(cap, ATTENTION, ("inference",)) == 0


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("mask, chunk", ABSORBED_CASES, ids=ABSORBED_IDS)
def test_megatron_absorbed_numerics_at_the_ops_indices(mask, chunk, grad):
    """The output (and the gradients of query, latent and the value up-projection) within the
    rule of the float64 attention over the recorded selection; orig is the eager fp32 function
    at the same selection. (Holds for the dense graph too; it is the rule the rewrite must keep.)"""
    r = run_megatron_absorbed(mask, chunk, grad)
    M, (qi, ki, q, lat, w) = r["M"], r["args"]
    (idx,) = r["calls"]
    with torch.set_grad_enabled(grad):
        orig = M.megatron_absorbed_attention(q, lat, w, idx, mask=mask, seq_chunk_size=chunk)
    leaves64 = [t.detach().double().requires_grad_(grad) for t in (q, lat, w)]
    with torch.set_grad_enabled(grad):
        ref = M.absorbed_reference(*leaves64, idx)
    e, eo = assert_consumer_close(r["out"], orig.detach(), ref.detach(), torch.float32, what="output")
    print(f"output: err {e:.3g}, err(orig) {eo:.3g}")
    assert eo < ORIG_SANE[torch.float32]
    if grad:
        orig_g = torch.autograd.grad(orig, (q, lat, w), r["go"])
        ref_g = torch.autograd.grad(ref, leaves64, r["go"].double())
        for name, g, go, gr in zip(("query", "latent", "up_v_weight"), r["grads"], orig_g, ref_g):
            e, eo = assert_consumer_close(g, go, gr, torch.float32, what=f"grad {name}")
            print(f"grad {name}: err {e:.3g}, err(orig) {eo:.3g}")
            assert eo < ORIG_SANE[torch.float32]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("mask, chunk", ABSORBED_CASES, ids=ABSORBED_IDS)
def test_megatron_absorbed_attention_rewritten(mask, chunk, grad):
    """The absorbed attention becomes one sparse-attention op (MQA over the latent), and in
    training its backward one sparse_attention_backward; nothing re-selects and no index mask
    is rebuilt in the backward."""
    r = run_megatron_absorbed(mask, chunk, grad)
    kinds = ("forward",) if grad else ("inference",)
    assert count(r["cap"], SELECTION, kinds) == 1
    assert count(r["cap"], ATTENTION, kinds) == 1
    assert [x.rewritten for x in r["records"]] == [True], [x.line() for x in r["records"]]
    if grad:
        assert count(r["cap"], ATTENTION_BACKWARD, ("backward",)) == 1
        assert count(r["cap"], ATTENTION, ("backward",)) == 0
        assert count(r["cap"], SELECTION + (torch.ops.aten.topk.default,), ("backward",)) == 0  # nothing re-selects
        assert not [n for k, g in r["cap"] if k == "backward" and not isinstance(g, str) for n in g.graph.nodes
                    if n.target in (torch.ops.aten.scatter.value, torch.ops.aten.scatter.src,
                                    torch.ops.aten.scatter_reduce.two)], "an index mask is rebuilt in the backward"


@pytest.mark.parametrize("lo", [0, 1])
def test_clamp_min_of_the_indices_is_a_remapping_only_above_zero(lo):
    """``clamp_min(idx, 0)`` (Megatron's ``safe_idx``) is the top-k's indices themselves, so the
    ``amax`` scatter of 0 into ``full(-inf)`` is a scatter of max(-inf, 0) = 0 there and the
    attention is rewritten (passes/index_mask.py); ``clamp_min(idx, 1)`` moves the picks of
    key 0 and is reported as a remapping. Either way the output is eager's."""
    from tests.models import attention_forms as af

    def fn(qi, ki, w, q, kk, v):
        idx = (torch.einsum("bshd,btd->bsht", qi, ki).relu() * w.unsqueeze(-1)).sum(dim=2).topk(4, dim=-1)[1]
        im = torch.full((q.shape[0], q.shape[1], kk.shape[1]), float("-inf"))
        im = im.scatter_reduce(-1, idx.clamp_min(lo), torch.zeros(idx.shape), "amax")
        scores = torch.einsum("bshd,bthd->bhst", q, kk) * q.shape[-1] ** -0.5 + im.unsqueeze(1)
        return torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)

    args = af.make_inputs(fresh_seed(f"clamp_min {lo}"))
    diagnostics.clear()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend="hyscale_debug")(*args)
        torch.testing.assert_close(out, fn(*args), atol=1e-5, rtol=1e-5)
    recs = diagnostics.attention_records()
    assert len(recs) == 1 and recs[0].rewritten == (lo == 0), [x.line() for x in recs]
    if lo == 0:
        assert "scatter_reduce ('amax') of 0.0 at clamp_min(idx, 0)), folded into one scatter of 0.0" in \
            recs[0].line(), recs[0].line()
    else:
        assert "remapped by clamp_min = clamp_min(idx, 1)" in recs[0].reason, recs[0].line()


@pytest.mark.parametrize("mask, chunk", [("additive", 256), ("varlen", 8)])
def test_megatron_absorbed_dynamic_training_step_has_no_square_tensor(mask, chunk):
    """Under dynamic=True the absorbed form is rewritten (the source's chunk loop, a Python
    ``range`` over the rows, specializes S; heads and head dims stay symbolic) and its training
    step's forward and backward graphs hold no tensor with two sequence-length dims."""
    from tests.models import megatron_dsa as M

    # the chunk a literal, as in the source (an int from a closure or an argument becomes a symbol too)
    fn = {256: lambda *a: M.megatron_absorbed_site(*a, mask=mask, seq_chunk_size=256),
          8: lambda *a: M.megatron_absorbed_site(*a, mask=mask, seq_chunk_size=8)}[chunk]

    args = M.absorbed_site_inputs(fresh_seed(f"megatron absorbed dynamic {mask}") % 10_000, S=DYN_SEQ)
    cap = []
    diagnostics.clear()
    torch._dynamo.reset()
    out = torch.compile(fn, backend="hyscale_debug", dynamic=True, options={"hyscale.capture": cap})(*args)
    out.sum().backward()
    (x,) = selection_consumers(diagnostics.attention_records())
    assert x.rewritten and x.form == "mqa" and x.backward == "sparse", x.line()
    # its run-time scale is read at each call and is then the constant step the kernels take
    assert x.backward_impl == "on CUDA: Triton kernels", x.line()
    assert not isinstance(x.sizes["H"], int), x.line()  # the heads are symbolic
    graphs = [(k, g) for k, g in cap if k in ("forward", "backward")]
    assert len(graphs) == 2, [k for k, _ in cap]
    found = square_tensors(graphs, [DYN_SEQ])
    assert found == [], "\n".join(found)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("chunk", [256, 32])
def test_gpu_megatron_absorbed_dynamic_training_runs_the_kernels(chunk):
    """The absorbed form under dynamic=True through Inductor on CUDA, in training: its run-time
    scale (a 0-d operand) is resolved before the launch, so the Triton forward and backward
    run it; output and gradients within the numerics rule of the float64 reference at the
    selection's own indices, and a second call gives the same bits."""
    from tests.models import megatron_dsa as M

    S = 128

    def select(qi, ki):  # megatron_absorbed_site's selection, its causal mask on the inputs' device
        s = qi @ ki.transpose(-1, -2) + torch.triu(torch.full((S, S), float("-inf"), device=qi.device), 1)
        return s.topk(16, dim=-1).indices

    # the chunk a literal, as in the source (an int from a closure becomes a symbol)
    site = {256: lambda qi, ki, q, lat, w: M.megatron_absorbed_attention(q, lat, w, select(qi, ki), v_channels=64,
                                                                         seq_chunk_size=256),
            32: lambda qi, ki, q, lat, w: M.megatron_absorbed_attention(q, lat, w, select(qi, ki), v_channels=64,
                                                                        seq_chunk_size=32)}[chunk]

    seed = fresh_seed(f"gpu megatron absorbed dynamic {chunk}") % 10_000
    args = M.absorbed_site_inputs(seed, S=S, NP=16, C=64, R=16, DI=32, DV=32)
    go = torch.randn(S, 1, 16 * 32, generator=torch.Generator().manual_seed(seed + 1))
    cuda = [x.detach().cuda().requires_grad_(x.requires_grad) for x in args]
    diagnostics.clear()
    torch._dynamo.reset()
    c = torch.compile(site, backend="hyscale", dynamic=True)
    runs = []
    for _ in range(2):
        with recorded_selections() as calls:
            out = c(*cuda)
        runs.append((out, *torch.autograd.grad(out, cuda[2:], go.cuda())))
    torch._dynamo.reset()
    (x,) = selection_consumers(diagnostics.attention_records())
    assert x.rewritten and x.form == "mqa" and x.backward == "sparse", x.line()
    assert x.backward_impl == "on CUDA: Triton kernels", x.line()
    assert all(torch.equal(a, b) for a, b in zip(*runs)), "two calls gave different bits"
    idx = calls[0].cpu()
    leaves = [x.detach().requires_grad_() for x in args[2:]]
    ref_out = M.absorbed_reference(*[x.double() for x in leaves], idx, v_channels=64)
    ref = (ref_out, *torch.autograd.grad(ref_out, leaves, go.double()))
    orig_out = M.megatron_absorbed_attention(*[x.cuda() for x in leaves], idx.cuda(), v_channels=64,
                                             seq_chunk_size=chunk)
    orig = (orig_out, *torch.autograd.grad(orig_out, leaves, go.cuda()))
    for name, a, b, r in zip(("out", "query", "latent", "w_uv"), runs[0], orig, ref):
        assert_consumer_close(a.cpu(), b.cpu(), r, torch.float32, what=name)
