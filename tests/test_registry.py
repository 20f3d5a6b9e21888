"""``register_score_mod`` (hyscale_compile/registry.py, lowerings/mods.py, passes/score_mods.py):
validation at registration, the rewrite of sites that apply a registered mod (outputs and
gradients equal eager), the cache key, the diagnostics, and the generated kernel."""
import pytest
import torch
import torch.nn.functional as F

import hyscale_compile
from hyscale_compile.lowerings import reference as ref
from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec
from hyscale_compile.registry import ScoreModError, register_score_mod, unregister_score_mod
from tests.contract import fresh_seed
from tests.test_triton_hytopk import cuda, interpret, kernel_cache  # noqa: F401  (fixtures)


@pytest.fixture
def registered():
    """Registers what a test asks for and forgets it afterwards (the registry is global)."""
    names = []

    def add(name, fn):
        register_score_mod(name, fn)
        names.append(name)

    yield add
    for n in names:
        if n in hyscale_compile.registered_score_mods():  # a test may unregister it itself
            unregister_score_mod(n)


# ---------------------------------------------------------------------------------------
# validation: a bad registration fails at registration, naming the problem

@pytest.mark.parametrize("name,fn,message", [
    ("not an identifier", torch.tanh, "must be a Python identifier"),
    ("relu", torch.tanh, "built-in step name"),
    ("cumsum_mod", lambda s: s.cumsum(0), r"not elementwise \(aten.cumsum takes a dim argument\)"),
    ("sm", lambda s: torch.softmax(s, -1),
     r"register_score_mod\('sm'\): the function is not elementwise \(aten._softmax takes a dim argument\)"),
    ("minus_sum", lambda s: s - s.sum(), r"not elementwise \(aten.sum reduces its input\)"),
    ("to_double", lambda s: s.double(), "casts to torch.float64"),
    ("to_bf16", lambda s: s.bfloat16().float(), "casts to torch.bfloat16"),
    ("captures", lambda s: s + torch.ones(16), "tracing fn on a float32 tensor failed"),
    ("shape_dependent", lambda s: s * s.shape[0], "depends on the input's shape"),
    ("not_callable", 3.0, "must be callable"),
    ("identity", lambda s: s, "computes nothing"),
])
def test_bad_registrations_raise_naming_the_problem(name, fn, message):
    with pytest.raises(ScoreModError, match=message):
        register_score_mod(name, fn)
    assert name not in hyscale_compile.registered_score_mods()


def test_duplicate_name_needs_replace(registered):
    registered("softcap30", lambda s: 30.0 * torch.tanh(s / 30.0))
    with pytest.raises(ScoreModError, match="already registered"):
        register_score_mod("softcap30", torch.tanh)
    register_score_mod("softcap30", lambda s: 30.0 * torch.tanh(s / 30.0), replace=True)


def test_unknown_mod_in_a_spec_is_a_clear_error():
    spec = ScoreSpec(epilogue=(("mod", "never_registered"),)).to_json()
    with pytest.raises(ScoreModError, match="unknown score mod 'never_registered'"):
        torch.ops.hyscale.hytopk(torch.randn(1, 4, 2, 8), torch.randn(1, 6, 1, 8), torch.rand(1, 4, 2), [], 2, spec)


def test_a_spec_naming_a_registration_this_process_lacks_is_a_clear_error(registered):
    # a graph compiled elsewhere (or before a replacement, then deserialized) names the mod
    # by its content digest; computing another function under that name would be wrong
    registered("softcap30", lambda s: 30.0 * torch.tanh(s / 30.0))
    spec = ScoreSpec(epilogue=(("mod", "softcap30@00000000deadbeef"),)).to_json()
    with pytest.raises(ScoreModError, match="'softcap30'.*compiled with a registration not present in this process"):
        torch.ops.hyscale.hytopk(torch.randn(1, 4, 2, 8), torch.randn(1, 6, 1, 8), torch.rand(1, 4, 2), [], 2, spec)


def test_registration_changes_the_cache_key(registered):
    from hyscale_compile.passes.selection_pass import HyScaleJointPass

    before = HyScaleJointPass().uuid()
    registered("softcap30", lambda s: 30.0 * torch.tanh(s / 30.0))
    after = HyScaleJointPass().uuid()
    unregister_score_mod("softcap30")
    register_score_mod("softcap30", lambda s: 20.0 * torch.tanh(s / 20.0))  # same name, other arithmetic
    assert len({before, after, HyScaleJointPass().uuid()}) == 3


# ---------------------------------------------------------------------------------------
# the rewrite

B, S, H, D, K = 2, 24, 4, 8, 4


def softcapped_indexer(q, k, w):
    """A soft-capped indexer (Gemma-style logit capping), per head, before the head sum."""
    s = torch.einsum("bshd,btd->bsht", q, k)
    s = 30.0 * torch.tanh(s / 30.0)
    s = (s * w.unsqueeze(-1)).sum(2)
    s = s + torch.full((S, S), float("-inf")).triu(K)  # every row has >= K keys
    vals, idx = s.topk(K, dim=-1)
    return vals.softmax(-1), idx


def softplus_after_sum(q, k):
    """A mod after the head reduction (QSA-like unweighted sum, then softplus)."""
    s = torch.matmul(q.transpose(1, 2), k.unsqueeze(1).transpose(-1, -2))  # [B, H, S, T]
    s = F.softplus(s.sum(1) * D**-0.5)
    return s.topk(K, dim=-1).indices


def _gate_and_grads(fn, q, k, w):
    """fn's gate and indices at (q, k, w), and the gradients of sum(gate^2) on q, k and w."""
    gate, idx = fn(q, k, w)
    gate.pow(2).sum().backward()
    grads = [t.grad.clone() for t in (q, k, w)]
    for t in (q, k, w):
        t.grad = None
    return gate, idx, grads


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, S, H, D, generator=g), torch.randn(B, S, D, generator=g),
            torch.rand(B, S, H, generator=g) + 0.1)


def test_unregistered_mod_is_not_fused_and_says_how_to_teach_it():
    """Without the registration the site is selected from the materialized table
    (passes/table_select.py), and the reason it was not fused names the fix."""
    q, k, w = _inputs(fresh_seed("unregistered") % 1000)
    report = hyscale_compile.explain(softcapped_indexer, q, k, w)
    (site,) = report.sites
    assert site.variant == "table", site.line()
    assert "tanh" in site.reason and "register_score_mod" in site.reason, site.reason


def test_registered_mod_is_rewritten_and_equals_eager(registered):
    registered("softcap30", lambda s: 30.0 * torch.tanh(s / 30.0))
    q, k, w = [t.requires_grad_(True) for t in _inputs(fresh_seed("softcap") % 1000)]
    report = hyscale_compile.explain(softcapped_indexer, q, k, w)
    (site,) = report.rewritten
    assert site.variant.endswith("+softcap30") and "mod('softcap30')" in site.spec, site.line()
    assert site.backward == "sparse" and not site.table_consumers, site.line()

    want = _gate_and_grads(softcapped_indexer, q, k, w)
    torch._dynamo.reset()
    got = _gate_and_grads(torch.compile(softcapped_indexer, backend="hyscale_debug"), q, k, w)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _capped(q, k, w, cap):
    s = torch.einsum("bshd,btd->bsht", q, k)
    s = cap * torch.tanh(s / cap)
    s = (s * w.unsqueeze(-1)).sum(2)
    s = s + torch.full((S, S), float("-inf")).triu(K)
    vals, idx = s.topk(K, dim=-1)
    return vals.softmax(-1), idx


# two models (their own code objects, so each compile keeps its own Dynamo cache entry)
def capped30(q, k, w):
    return _capped(q, k, w, 30.0)


def capped3(q, k, w):
    return _capped(q, k, w, 3.0)


def test_replacing_or_removing_a_mod_leaves_compiled_graphs_alone(registered):
    """A compiled graph computes what it was compiled from: replacing the registration
    affects only later compiles, and unregistering it breaks nothing already compiled."""
    from hyscale_compile.passes import diagnostics

    q, k, w = [t.requires_grad_(True) for t in _inputs(fresh_seed("replace") % 1000)]

    def check(got, want):
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
        for a, b in zip(got[2], want[2]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    def rewritten_with(fn):
        diagnostics.clear()
        out = _gate_and_grads(fn, q, k, w)
        assert [s.variant for s in diagnostics.records() if s.rewritten] == ["dsa-norelu+cap"], diagnostics.records()
        return out

    want30, want3 = _gate_and_grads(capped30, q, k, w), _gate_and_grads(capped3, q, k, w)
    assert not torch.allclose(want30[0], want3[0])  # the two mods give different results

    torch._dynamo.reset()
    registered("cap", lambda s: 30.0 * torch.tanh(s / 30.0))
    compiled30 = torch.compile(capped30, backend="hyscale_debug")
    check(rewritten_with(compiled30), want30)

    register_score_mod("cap", lambda s: 3.0 * torch.tanh(s / 3.0), replace=True)
    check(_gate_and_grads(compiled30, q, k, w), want30)  # still the function it was compiled with
    compiled3 = torch.compile(capped3, backend="hyscale_debug")
    check(rewritten_with(compiled3), want3)  # a new compile matches the new function

    unregister_score_mod("cap")
    check(_gate_and_grads(compiled30, q, k, w), want30)
    check(_gate_and_grads(compiled3, q, k, w), want3)


def test_kernel_source_follows_the_spec_not_the_registry(registered, kernel_cache):
    # the matcher writes the mod's content key into the spec: the kernel rendered for it
    # (and its cache file, named by a hash of that source) stays the compiled function's
    from hyscale_compile.lowerings import mods
    from hyscale_compile.lowerings import triton_codegen as cg

    registered("cache_probe", lambda s: torch.tanh(s) * 5.0)
    spec5 = ScoreSpec(epilogue=(("mod", mods.key_of("cache_probe")),), reduce="sum")
    src5 = cg.render_kernel_source(spec5, 0)
    register_score_mod("cache_probe", lambda s: torch.tanh(s) * 7.0, replace=True)
    spec7 = ScoreSpec(epilogue=(("mod", mods.key_of("cache_probe")),), reduce="sum")
    assert spec7 != spec5
    assert cg.render_kernel_source(spec5, 0) == src5
    for spec, c, other in ((spec5, "* 5.0", "* 7.0"), (spec7, "* 7.0", "* 5.0")):
        epilogue = cg.render_kernel_source(spec, 0).split("def _epilogue")[1].split("return x")[0]
        assert c in epilogue and other not in epilogue
    assert cg.load_kernel(spec5, 0) is not cg.load_kernel(spec7, 0)


_CACHE_PROGRAM = """
import sys
import torch
from torch._dynamo.utils import counters
import hyscale_compile
from hyscale_compile.lowerings import mods
from tests.test_registry import _inputs, capped30

looked_up = []
get = mods.get
mods.get = lambda ref: looked_up.append(ref) or get(ref)


def compile_and_check():
    counters.clear()
    torch._dynamo.reset()
    q, k, w = _inputs(0)
    got = torch.compile(capped30, backend="hyscale")(q, k, w)
    want = capped30(q, k, w)
    assert torch.equal(got[1], want[1]), "indices differ from eager"
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    return counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]


if sys.argv[1] == "first":
    hyscale_compile.register_score_mod("cap", lambda s: 30.0 * torch.tanh(s / 30.0))
    assert compile_and_check() == 0
    assert counters["hyscale"]["rewritten:dsa-norelu+cap"] == 1, dict(counters["hyscale"])
else:
    # another function under the same name: the cached graph (which calls the first) must
    # not be served; the site is not matched, so the graph computes as eager does
    hyscale_compile.register_score_mod("cap", lambda s: 3.0 * torch.tanh(s / 3.0))
    assert compile_and_check() == 0, "served a graph compiled with another registration"
    assert counters["hyscale"]["rewritten:table"] == 1, dict(counters["hyscale"])
    # the same function again: the cache hits, and the op finds the mod by its key
    hyscale_compile.register_score_mod("cap", lambda s: 30.0 * torch.tanh(s / 30.0), replace=True)
    del looked_up[:]
    assert compile_and_check() > 0, "the identical registration missed the cache"
    assert mods.key_of("cap") in looked_up, looked_up
print("ok")
"""


@pytest.mark.inductor
def test_a_cached_graph_in_a_fresh_process_computes_what_it_was_compiled_from(tmp_path):
    """Inductor's cache keys on the registrations (the pass's uuid): a process that
    registers another function under the name misses it; one that registers the same
    function hits it and finds the mod by its content key."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1", PYTHONPATH=root)
    for phase in ("first", "second"):
        res = subprocess.run([sys.executable, "-c", _CACHE_PROGRAM, phase], capture_output=True, text=True,
                             cwd=root, env=env, timeout=600)
        assert res.returncode == 0 and "ok" in res.stdout, f"{phase}: {res.stderr[-1500:]}"


def test_constants_are_part_of_the_match(registered):
    registered("softcap50", lambda s: 50.0 * torch.tanh(s / 50.0))  # the model caps at 30
    q, k, w = _inputs(fresh_seed("constants") % 1000)
    report = hyscale_compile.explain(softcapped_indexer, q, k, w)
    (site,) = report.sites
    assert site.variant == "table" and "tanh" in site.reason, site.line()  # not fused with the wrong cap
    assert torch.equal(report.output[1], softcapped_indexer(q, k, w)[1])  # (explain's debug-backend run)


def test_mod_after_the_head_sum(registered):
    registered("softplus", F.softplus)
    q, k, _ = _inputs(fresh_seed("softplus") % 1000)
    with torch.no_grad():
        report = hyscale_compile.explain(softplus_after_sum, q, k)
        (site,) = report.rewritten
        assert "+softplus" in site.variant, site.line()
    assert torch.equal(report.output, softplus_after_sum(q, k))  # (explain's debug-backend run)


# ---------------------------------------------------------------------------------------
# the generated kernel (Triton interpreter on CPU; compiled on a GPU)

def _kernel_case(device, seed):
    from hyscale_compile.lowerings.triton_hytopk import hytopk_triton
    from tests.test_triton_hytopk import check_threshold

    g = torch.Generator().manual_seed(seed)
    Bk, Sk, T, Hh, Dd, topk = 1, 16, 64, 4, 16, 8
    q = torch.randn(Bk, Sk, Hh, Dd, generator=g).to(device)
    k = torch.randn(Bk, T, 1, Dd, generator=g).to(device)
    w = (torch.rand(Bk, Sk, Hh, generator=g) + 0.1).to(device)
    hi = (torch.arange(Sk) * 4 + 8).view(1, Sk).to(device)
    spec = ScoreSpec(epilogue=(("mod", "softcap8"),), post=(("mod", "softplus"), ("mask", 0)),
                     masks=(MaskTerm(kind="range", hi=0, mode="fill"),))
    vals, idx = hytopk_triton(q, k, w, [hi], topk, spec, return_values=True)
    s64 = ref.dense_scores(q.cpu().double(), k.cpu().double(), w.cpu().double(), [hi.cpu()], spec, dtype=torch.float64)
    # |tanh'| <= 1 and |softplus'| <= 1: the per-head error bound carries through; the
    # transcendental functions add a few ulps each
    scale = torch.einsum("bshd,btd->bsht", q.cpu().double().abs(), k.cpu().double().abs()[:, :, 0])
    scale = (scale * w.cpu().double().unsqueeze(-1)).sum(2) + 8.0 * Hh
    check_threshold(vals, idx, s64, scale, Dd, Hh, 2.0**-22)


@pytest.mark.interpret
def test_kernel_with_registered_mods(interpret, registered):
    registered("softcap8", lambda s: 8.0 * torch.tanh(s / 8.0))
    registered("softplus", F.softplus)
    _kernel_case("cpu", fresh_seed("kernel_mods"))


@pytest.mark.gpu
def test_gpu_kernel_with_registered_mods(cuda, registered):
    registered("softcap8", lambda s: 8.0 * torch.tanh(s / 8.0))
    registered("softplus", F.softplus)
    _kernel_case("cuda", fresh_seed("gpu_kernel_mods"))


def test_kernel_lookup_follows_a_replaced_mod(registered, kernel_cache):
    # load_kernel caches its lookup per spec (the source render costs host time on every
    # launch); a mod re-registered under the same name must still get its own kernel
    from hyscale_compile.lowerings import triton_codegen as cg

    registered("cache_probe", lambda s: torch.tanh(s) * 5.0)
    spec = ScoreSpec(epilogue=(("mod", "cache_probe"),), reduce="sum")
    first = cg.load_kernel(spec, 0)
    assert cg.load_kernel(spec, 0) is first
    register_score_mod("cache_probe", lambda s: torch.tanh(s) * 7.0, replace=True)
    second = cg.load_kernel(spec, 0)
    assert second is not first
    assert cg.load_kernel(spec, 0) is second
    src = cg.render_kernel_source(spec, 0)
    epilogue = src.split("def _epilogue")[1].split("return x")[0]
    assert "* 7.0" in epilogue and "* 5.0" not in epilogue


def test_kernel_lookup_keys_on_the_spec_text(kernel_cache):
    # specs that compare equal but render differently (0.0 == -0.0) get their own kernels,
    # and a spec built with lists (unhashable) still loads
    from hyscale_compile.lowerings import triton_codegen as cg

    pos = ScoreSpec(epilogue=(("relu",),), reduce="sum", post=(("mul", 0.0),))
    neg = ScoreSpec(epilogue=(("relu",),), reduce="sum", post=(("mul", -0.0),))
    assert pos == neg and cg.render_kernel_source(pos, 0) != cg.render_kernel_source(neg, 0)
    assert cg.load_kernel(pos, 0) is not cg.load_kernel(neg, 0)
    listed = ScoreSpec(epilogue=[("relu",)], reduce="sum")
    assert cg.load_kernel(listed, 0) is cg.load_kernel(ScoreSpec(epilogue=(("relu",),), reduce="sum"), 0)
