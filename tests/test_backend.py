"""The backend's plumbing: registration, options, pass chaining, the cache key."""
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.fx as fx

import hyscale_compile
from hyscale_compile import registry
from hyscale_compile.passes.selection_pass import HyScaleJointPass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROGRAM = """
import torch
def f(q, k, w):
    s = (torch.einsum('bshd,btd->bsht', q, k).relu() * w.unsqueeze(-1)).sum(2)
    return s.topk(3, dim=-1).indices
# inputs whose top-3 is unique in every row (ReLU zeros can tie at the boundary, and
# torch.topk breaks ties in an unspecified order): docs/contract.md, "Equality with eager"
g = torch.Generator().manual_seed(0)
while True:
    q, k, w = torch.randn(1, 8, 2, 16, generator=g), torch.randn(1, 8, 16, generator=g), torch.rand(1, 8, 2, generator=g)
    top4 = (torch.einsum('bshd,btd->bsht', q, k).relu() * w.unsqueeze(-1)).sum(2).topk(4, dim=-1).values
    if bool((top4[..., 2] > top4[..., 3]).all()):
        break
import sys
if BACKEND == "hyscale":
    # plain Inductor first, filling this process's fresh on-disk cache with the same graph
    # compiled without the pass: the hyscale compile below must not be served it
    from torch._inductor.utils import run_and_get_code
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(f, backend="inductor"), q, k, w)
    assert "hyscale" not in "\\n".join(code) and "hyscale_compile" not in sys.modules
    torch._dynamo.reset()
    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(f, backend=BACKEND), q, k, w)
    assert "torch.ops.hyscale.hytopk" in "\\n".join(code)
else:
    with torch.no_grad():
        out = torch.compile(f, backend=BACKEND)(q, k, w)
assert torch.equal(out.sort(-1).values, f(q, k, w).sort(-1).values)
assert "hyscale_compile" in sys.modules, "the entry point did not load the backend"
from torch._dynamo.utils import counters
print("rewritten", counters["hyscale"]["rewritten"])
"""


def _run_fresh(backend: str, cache_dir) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # Inductor's caches on, in a directory of this test's own: only the program's own
    # plain-Inductor compile is there to be (wrongly) served
    env.update(TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    code = _PROGRAM.replace("BACKEND", repr(backend))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_entry_point_debug_backend_without_import(tmp_path):
    """``backend="hyscale_debug"`` works in a fresh process that never imported us."""
    assert "rewritten 1" in _run_fresh("hyscale_debug", tmp_path)


@pytest.mark.inductor
def test_entry_point_hyscale_without_import_and_not_served_a_plain_inductor_graph(tmp_path):
    """``backend="hyscale"`` in a fresh process that never imported us, after plain Inductor
    compiled the same graph into the (fresh) FX graph cache: the hyscale compile must not
    reuse that artifact (the pass ran: rewritten 1, the op in the code)."""
    assert "rewritten 1" in _run_fresh("hyscale", tmp_path)


def test_import_then_lookup_does_not_double_register():
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("hyscale") is hyscale_compile.hyscale_backend
    assert lookup_backend("hyscale_debug") is hyscale_compile.hyscale_debug_backend


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(options={"no_such_key": 1}), ValueError, "no_such_key"),
        (dict(options={"hyscale.nope": True}), ValueError, "hyscale.nope"),
        (dict(options={"hyscale.enable": "yes"}), TypeError, "hyscale.enable"),
        (dict(options={"hyscale.elide_sort": 1}), TypeError, "hyscale.elide_sort"),
        (dict(options=["max_autotune"]), TypeError, "options must be a dict"),
        (dict(mode="fastest"), ValueError, "unknown mode 'fastest'"),
    ],
)
def test_bad_options_name_the_problem(kwargs, exc, match):
    f = torch.compile(lambda x: x + 1, backend="hyscale", **kwargs)
    with pytest.raises(Exception) as info:
        f(torch.randn(3))
    # dynamo wraps backend errors (BackendCompilerFailed.inner_exception is ours)
    err = getattr(info.value, "inner_exception", info.value)
    assert isinstance(err, exc) and match in str(err), repr(info.value)
    assert match in str(info.value)  # and the user sees it


@pytest.mark.parametrize("backend", ["hyscale", "hyscale_debug"])
@pytest.mark.parametrize(
    "options, exc, match",
    [
        ({"triton.nonsense": 1}, ValueError, "unknown option 'triton.nonsense'"),
        ({"patch": 1}, ValueError, "unknown option 'patch'"),  # a config module attribute, not a key
        ({"triton.cudagraphs": "x"}, TypeError, "option 'triton.cudagraphs' must be bool, got str"),
        ({"max_autotune": 1}, TypeError, "option 'max_autotune' must be bool, got int"),
        ({"compile_threads": True}, TypeError, "option 'compile_threads' must be int or None, got bool"),
        ({"max_autotune_gemm_backends": 3}, TypeError, "option 'max_autotune_gemm_backends' must be str"),
    ],
)
def test_inductor_options_checked_against_inductor_config(backend, options, exc, match):
    """Both backends check Inductor keys and their types against torch._inductor.config
    (the debug backend ignores valid ones, but rejects what Inductor would not take)."""
    from hyscale_compile.options import split_options

    with pytest.raises(exc, match=match):
        split_options(None, options)
    f = torch.compile(lambda x: x + 1, backend=backend, options=options)
    with pytest.raises(Exception) as info:
        f(torch.randn(3))
    err = getattr(info.value, "inner_exception", info.value)
    assert isinstance(err, exc) and match in str(err), repr(info.value)


def test_valid_inductor_options_accepted():
    from hyscale_compile.options import split_options

    good = {"triton.cudagraphs": False, "compile_threads": None, "max-autotune": False,
            "max_autotune_gemm_backends": "ATEN"}
    inductor, ours = split_options(None, good)
    assert inductor == {"triton.cudagraphs": False, "compile_threads": None, "max_autotune": False,
                        "max_autotune_gemm_backends": "ATEN"} and ours == {}
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1, backend="hyscale_debug", options=good)
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))


def _three_sites(q, k, w, x, router):
    """One fused selection, one selected from its table (a softmax over the keys), one
    left alone (a router: the contraction's key side is a parameter)."""
    s = (torch.einsum("bshd,btd->bsht", q, k).relu() * w.unsqueeze(-1)).sum(2)
    fused = s.topk(3, dim=-1).indices
    table = torch.einsum("bshd,btd->bsht", q, k).softmax(-1).sum(2).topk(3, dim=-1).indices
    routed = (x @ router).topk(2, dim=-1).indices
    return fused, table, routed


def test_explain_counts_fused_table_and_left_alone_separately():
    q, k, w = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 16), torch.rand(1, 8, 2)
    with torch.no_grad():
        report = hyscale_compile.explain(_three_sites, q, k, w, torch.randn(4, 8),
                                         torch.nn.Parameter(torch.randn(8, 6)))
    text = str(report)
    assert text.splitlines()[0] == (
        "hyscale: 3 top-k site(s): 1 fused, 1 selected from the table, 1 left alone; 0 graph break(s)"), text
    assert [s.node for s in report.fused] == ["topk"] and len(report.table) == 1 and len(report.left_alone) == 1
    assert "[rewritten: table]" in text and "not fused because" in text


def test_explain_names_the_op_that_stopped_the_walk():
    """A contraction feeds the scores, but an elementwise op the matcher does not know sits
    between: the reason names that op instead of claiming there is no contraction."""
    def erfcx_scores(q, k, w):
        s = (torch.einsum("bshd,btd->bsht", q, k).relu() * w.unsqueeze(-1)).sum(2)
        return torch.special.erfcx(s).topk(3, dim=-1).indices

    def plain_input(x):
        return x.topk(3, dim=-1).indices

    def merged_axes(q, k, w):  # the top-k runs over (query, key) pairs: no per-row selection
        s = (torch.einsum("bshd,btd->bsht", q, k).relu() * w.unsqueeze(-1)).sum(2)
        return s.reshape(1, -1).topk(3, dim=-1).indices

    q, k, w = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 16), torch.rand(1, 8, 2)
    with torch.no_grad():
        (site,) = hyscale_compile.explain(erfcx_scores, q, k, w).sites
        (plain,) = hyscale_compile.explain(plain_input, torch.randn(1, 8, 8)).sites
        (merged,) = hyscale_compile.explain(merged_axes, q, k, w).sites
    assert "no contraction" not in site.reason, site.line()
    assert ("the walk back from the top-k stopped at aten.special_erfcx.default (not a view, cast, pointwise step "
            "or contraction the matcher knows)") in site.reason, site.line()
    assert "no contraction (einsum/matmul/bmm) feeds the top-k scores" in plain.reason, plain.line()
    assert re.search(r"stopped at aten\.(_unsafe_)?view\.default \(which does not carry the top-k axis through",
                     merged.reason), merged.line()


def test_disabled_pass_still_records_diagnostics():
    """hyscale.enable=False: nothing is rewritten, but every site is recorded, with what the
    pass would have done."""
    from hyscale_compile.passes import diagnostics

    q, k, w = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 16), torch.rand(1, 8, 2)
    args = (q, k, w, torch.randn(4, 8), torch.nn.Parameter(torch.randn(8, 6)))
    captured = []
    torch._dynamo.reset()
    diagnostics.clear()
    with torch.no_grad():
        out = torch.compile(_three_sites, backend="hyscale_debug",
                            options={"hyscale.enable": False, "hyscale.capture": captured})(*args)
        eager = _three_sites(*args)
    assert all(torch.equal(a, b) for a, b in zip(out, eager))
    (graph,) = [g for kind, g in captured if kind == "inference"]
    assert "hyscale" not in graph.code and "aten.topk" in graph.code  # plain graph
    recs = diagnostics.records()
    assert len(recs) == 3 and not any(r.rewritten for r in recs), [r.line() for r in recs]
    fused, table, routed = recs
    assert fused.reason.startswith(
        "hyscale.enable=False; enabled, the pass would give: [rewritten] dsa k=3"), fused.line()
    assert "[rewritten: table]" in table.reason and "hyscale.enable=False" in table.reason, table.line()
    assert routed.reason.startswith("not a selection"), routed.line()


def test_explain_rejects_non_callables():
    with pytest.raises(TypeError, match="must be callable"):
        hyscale_compile.explain(3, torch.randn(2))


def test_backend_installs_and_chains_the_joint_pass(monkeypatch):
    """``hyscale`` hands compile_fx a joint_custom_pre_pass that runs ours and then the
    pass that was already installed (user's or another library's), and Inductor options."""
    seen = {}

    class Prior(torch._inductor.custom_graph_pass.CustomGraphPass):
        def __call__(self, graph):
            seen["prior"] = True

        def uuid(self):
            return b"prior"

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kw):
        seen["patches"] = config_patches
        return gm.forward

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake_compile_fx)
    gm = fx.symbolic_trace(lambda x: x * 2)
    # config.patch, not monkeypatch: undoing a monkeypatch deletes the attribute, which
    # hides the key in Inductor's config module for the rest of the process
    with torch._inductor.config.patch(joint_custom_pre_pass=Prior()):
        hyscale_compile.hyscale_backend(gm, [torch.randn(2)], options={"max_autotune": False})
    p = seen["patches"]
    assert p["max_autotune"] is False
    jp = p["joint_custom_pre_pass"]
    assert isinstance(jp, HyScaleJointPass) and isinstance(jp.chained, Prior)
    jp(fx.symbolic_trace(lambda x: x * 2).graph)
    assert seen["prior"]


def test_uuid_keys_on_registry_options_and_chained_pass(monkeypatch):
    base = HyScaleJointPass().uuid()
    assert isinstance(base, bytes) and base == HyScaleJointPass().uuid()
    assert HyScaleJointPass(options={"enable": False}).uuid() != base
    assert HyScaleJointPass(param_indices=[0]).uuid() != base
    with torch._inductor.config.patch({"triton.cudagraphs": True}):  # (runtime scalars then go to the table)
        assert HyScaleJointPass().uuid() != base
    registry.register_score_mod("my_variant", lambda s: s * 0.5 + 1.0)
    try:
        assert HyScaleJointPass().uuid() != base  # a registration changes the key
    finally:
        registry.unregister_score_mod("my_variant")
    assert HyScaleJointPass().uuid() == base

    class NoUuid:
        def __call__(self, graph):
            pass

    assert HyScaleJointPass(chained=NoUuid()).uuid() is None  # then Inductor bypasses its cache


def test_nan_key_hidden_by_an_additive_mask_selected_like_eager():
    """An additive -inf mask (``s + where(t >= n, -inf, 0)``, as DSA's ``+ full(-inf).triu(1)``):
    a NaN key it hides is NaN in eager, which torch.topk ranks first. The rewrite's op
    proves the operands finite before it skips hidden keys (here the CPU path's key chunk
    [1024, 1100), hidden from every row), so it selects the NaN key too."""
    from torch._dynamo.utils import counters

    from hyscale_compile.lowerings.reference import stable_topk

    def indexer(q, k, w):
        s = (torch.einsum("bshd,btd->bsht", q, k).relu() * w.unsqueeze(-1)).sum(2)
        s = s + torch.where(torch.arange(s.shape[-1]) >= 1000, float("-inf"), 0.0)
        return s, s.topk(4, dim=-1).indices

    S = 1100
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-2, 3, (1, S, 2, 8), generator=g).float()
    k = torch.randint(-2, 3, (1, S, 8), generator=g).float()
    w = torch.randint(1, 3, (1, S, 2), generator=g).float()
    k[0, 1050, 3] = -float("nan")
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        s, eager = indexer(q, k, w)
        _, got = torch.compile(indexer, backend="hyscale_debug")(q, k, w)
    assert counters["hyscale"]["rewritten"] == 1
    # integer inputs: the op's fp32 scores are eager's, exactly, and ties go to the smaller key
    assert torch.equal(got.long(), stable_topk(s, 4)[1])
    assert (got[..., 0] == 1050).all() and (eager[..., 0] == 1050).all()
