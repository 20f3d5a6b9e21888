"""The sparse backward (lowerings/backward.py, passes/sparse_backward.py).

When top-k values carry gradient, the rewrite's backward works at the k selected keys per
query (``hyscale.hytopk_values_backward``), never rebuilding the dense query x key table,
and its gradients equal the original's (docs/contract.md, "Values and gradients")."""
import math

import pytest
import torch
import torch._functorch.config as fconfig
import torch.nn as nn
import torch.nn.functional as F

import hyscale_compile
from hyscale_compile.lowerings import reference as ref
from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec
from hyscale_compile.testing import graph_text
from tests.contract import fresh_seed, input_and_param_grads, tolerance
from tests.test_partition import SETUPS as REPLAY_SETUPS

# ---------------------------------------------------------------------------------------
# The op: autograd of hytopk_values against a float64 dense reference at the same indices

B, S, T, D, K = 2, 12, 16, 8, 5


def _spec_cases():
    causal_hi = lambda: (torch.arange(S) + 4).view(1, S)  # row s sees keys < s + 4: some rows < K keys
    return {
        "dsa_relu_range_fill": (ScoreSpec(epilogue=(("relu",), ("mul", 0.25)), post=(("mask", 0),),
                                          masks=(MaskTerm(kind="range", hi=0, mode="fill"),)), 4, 1, "w", [causal_hi]),
        "sum_additive_float_mask": (ScoreSpec(reduce="sum", epilogue=(("relu",),), post=(("div", 2.0), ("mask", 0)),
                                              masks=(MaskTerm(kind="add", operand=0),)), 2, 2, None,
                                    [lambda: torch.randn(1, S, T)]),
        "sigmoid_range_add_gqa": (ScoreSpec(epilogue=(("sigmoid",),), post=(("mask", 0),),
                                            masks=(MaskTerm(kind="range", hi=0, mode="add"),)), 4, 2, "w", [causal_hi]),
        "bool_fill_bf16_logits": (ScoreSpec(logit_dtype="bfloat16", epilogue=(("relu",), ("neg",), ("add", 1.0)),
                                            post=(("mask", 0),), masks=(MaskTerm(kind="fill", operand=0, where=False),)),
                                  4, 4, "w", [lambda: torch.rand(B, S, T) > 0.3]),
    }


@pytest.mark.parametrize("name", sorted(_spec_cases()))
def test_op_gradients_equal_dense_reference(name):
    spec, H, Hk, has_w, mask_makers = _spec_cases()[name]
    torch.manual_seed(fresh_seed(name))
    masks = [m() for m in mask_makers]
    q = torch.randn(B, S, H, D, dtype=torch.float64)
    k = torch.randn(B, T, Hk, D, dtype=torch.float64)
    w = torch.rand(B, S, H, dtype=torch.float64) + 0.1 if has_w else None
    leaves = [t.clone().requires_grad_(True) for t in (q, k) + ((w,) if has_w else ())]
    vals, idx = torch.ops.hyscale.hytopk_values(*[t.float() for t in leaves[:2]], leaves[2].float() if has_w else None,
                                               masks, K, spec.to_json())
    g = torch.randn(B, S, K)
    (vals * g).sum().backward()
    got = [t.grad for t in leaves]
    # float64 reference: the dense scores' autograd, read at the op's own indices
    ref_leaves = [t.clone().requires_grad_(True) for t in (q, k) + ((w,) if has_w else ())]
    dense = ref.dense_scores(ref_leaves[0], ref_leaves[1], ref_leaves[2] if has_w else None, masks, spec,
                             dtype=torch.float64)
    picked = dense.gather(-1, idx.long())
    finite = picked > -math.inf
    assert torch.equal(finite, vals > -math.inf)
    # values within the contract's per-row tolerance: with bf16-rounded logits the op's fp32
    # logit and the float64 one can round to neighbouring bf16 values (a fixed 1e-5 failed
    # for seed 701400901: 3.5e-5 off)
    row_tol = tolerance(q, k, w, spec).unsqueeze(-1).expand_as(vals)
    err = (vals.double() - picked.detach()).abs()
    assert (err[finite] <= row_tol[finite]).all(), float((err[finite] - row_tol[finite]).max())
    (picked * g.double()).sum().backward()
    tol = 2e-2 if spec.logit_dtype != "float32" else 1e-5  # the bf16 rounding's gradient is bf16-rounded
    for a, b, what in zip(got, [t.grad for t in ref_leaves], "qkw"):
        torch.testing.assert_close(a, b.to(a.dtype), atol=tol, rtol=tol, msg=f"d/d{what}")


def test_op_backward_bf16_operands_and_needs():
    """bf16 operands get bf16 gradients (the original's upcast backward casts them); an
    input that needs no gradient gets none."""
    spec = ScoreSpec(epilogue=(("relu",),))
    q = torch.randn(1, 8, 2, 16).bfloat16().requires_grad_(True)
    k = torch.randn(1, 10, 1, 16).bfloat16()
    w = torch.rand(1, 8, 2).requires_grad_(True)
    vals, idx = torch.ops.hyscale.hytopk_values(q, k, w, [], 3, spec.to_json())
    vals.sum().backward()
    assert q.grad.dtype == torch.bfloat16 and k.grad is None
    qd, kd, wd = q.detach().double().requires_grad_(True), k.double(), w.detach().double().requires_grad_(True)
    ref.dense_scores(qd, kd, wd, [], spec, dtype=torch.float64).gather(-1, idx.long()).sum().backward()
    torch.testing.assert_close(q.grad, qd.grad.bfloat16(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(w.grad, wd.grad.float(), atol=1e-5, rtol=1e-5)


def test_op_backward_rejects_bad_gradient_shape():
    spec = ScoreSpec(epilogue=(("relu",),)).to_json()
    q, k, w = torch.randn(1, 4, 2, 8), torch.randn(1, 6, 1, 8), torch.rand(1, 4, 2)
    idx = torch.zeros(1, 4, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"must both be \[B,S,k\]"):
        torch.ops.hyscale.hytopk_values_backward(torch.randn(1, 4, 2), q, k, w, [], idx, spec, True, True, True)


# ---------------------------------------------------------------------------------------
# The pass: models whose top-k values carry gradient, compiled with the debug backend

E, H2, D2, K2, S2 = 32, 8, 16, 4, 24


class GatedSelect(nn.Module):
    """NSA-style differentiable gate: softmax over the selected scores weighs gathered values.
    Row s sees keys < s + K2, so every row has >= K2 finite scores and (8 heads, positive
    weights) its selection is unique."""

    def __init__(self, bf16: bool = False):
        super().__init__()
        self.wq, self.wk, self.ww, self.wv = nn.Linear(E, H2 * D2), nn.Linear(E, D2), nn.Linear(E, H2), nn.Linear(E, E)
        self.bf16 = bf16

    def forward(self, x):
        Bx, Sx, _ = x.shape
        q, k, w = self.wq(x).view(Bx, Sx, H2, D2), self.wk(x), self.ww(x).exp()
        if self.bf16:  # HF/Megatron: bf16 activations upcast right before the contraction
            q, k = q.bfloat16().float(), k.bfloat16().float()
        s = (torch.einsum("bshd,btd->bsht", q, k).relu() * w.unsqueeze(-1)).sum(2) * D2**-0.5
        s = s + torch.full((Sx, Sx), float("-inf"), device=x.device).triu(K2)
        vals, idx = s.topk(K2, dim=-1)
        v = self.wv(x)
        gathered = torch.gather(v.unsqueeze(1).expand(Bx, Sx, Sx, E), 2, idx.unsqueeze(-1).expand(Bx, Sx, K2, E))
        return x + (vals.softmax(-1).unsqueeze(-1) * gathered).sum(2)


class KLIndexer(nn.Module):
    """An indexer trained with a KL loss over its selected set (DSA's indexer warm-up):
    the target is the main attention restricted to the selected keys, detached."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.ww = nn.Linear(E, H2 * D2), nn.Linear(E, D2), nn.Linear(E, H2)
        self.aq, self.ak = nn.Linear(E, D2), nn.Linear(E, D2)

    def forward(self, x):
        Bx, Sx, _ = x.shape
        q, k, w = self.wq(x).view(Bx, Sx, H2, D2), self.wk(x), torch.sigmoid(self.ww(x))
        s = torch.matmul(q, k.transpose(1, 2).unsqueeze(1)).relu()  # [B, S, H, T]
        s = (s * w.unsqueeze(-1)).sum(2)
        s = s.masked_fill(torch.ones(Sx, Sx, dtype=torch.bool, device=x.device).triu(K2), float("-inf"))
        vals, idx = torch.topk(s, K2, dim=-1)
        with torch.no_grad():
            att = torch.einsum("bsd,btd->bst", self.aq(x), self.ak(x))
            target = att.gather(-1, idx).softmax(-1)
        return F.kl_div(vals.log_softmax(-1), target, reduction="batchmean")


# the replay tests' checkpointing setups (run(model, x), memory budget)
SETUPS = {k: REPLAY_SETUPS[k] for k in ("no_checkpoint", "checkpoint", "sac_recompute_everything", "budget_0")}


def _grads(model, run, x0):
    return input_and_param_grads(lambda x: run(model, x), x0, model)


def _compile_grads(model, run, x0, budget=None, **kw):
    cap = []
    torch._dynamo.reset()
    with fconfig.patch(activation_memory_budget=fconfig.activation_memory_budget if budget is None else budget):
        got = _grads(model, torch.compile(run, backend="hyscale_debug", options={"hyscale.capture": cap}, **kw), x0)
    fw = graph_text(next(g for k, g in cap if k == "forward").graph)
    bw = graph_text(next(g for k, g in cap if k == "backward").graph)
    return got, fw, bw


def _assert_sparse_backward(fw, bw):
    assert fw.count("hyscale.hytopk_values(") == 1, fw
    assert bw.count("hyscale.hytopk_values_backward(") == 1, bw
    assert "hyscale.hytopk_values(" not in bw and "aten.topk" not in bw
    # no score contraction and no dense [.., S, T] gradient: the original backward scattered
    # the values' gradient into a [B, S, T] table (aten.scatter) and ran two bmms over it
    assert "aten.bmm" not in bw and "aten.scatter.src" not in bw and "aten.scatter.value" not in bw, bw


def _assert_dense_backward_matches(model, x0):
    """Compiled gradients equal eager's, and the backward is the dense one (no sparse
    values backward in the graph)."""
    run = lambda m, x: m(x)  # noqa: E731
    want = _grads(model, run, x0)
    got, fw, bw = _compile_grads(model, run, x0)
    assert "hytopk_values_backward" not in bw
    _assert_same(got, want)


def _assert_same(got, want, tol=1e-5):
    # fp32 gradients summed in another order (k selected keys vs a dense bmm over all keys):
    # compared normwise, relative to each tensor's largest entry (parameter gradients sum
    # many cancelling terms, so single small entries carry the large entries' rounding)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=tol * max(1.0, b.abs().max().item()), rtol=tol)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_gated_selection_backward_is_sparse(setup):
    run, budget = SETUPS[setup]
    torch.manual_seed(fresh_seed(setup))
    model, x0 = GatedSelect(), torch.randn(2, S2, E)
    want = _grads(model, run, x0)
    got, fw, bw = _compile_grads(model, run, x0, budget)
    _assert_sparse_backward(fw, bw)
    _assert_same(got, want)


def test_kl_trained_indexer_backward_is_sparse():
    torch.manual_seed(fresh_seed("kl"))
    model, x0 = KLIndexer(), torch.randn(2, S2, E)
    run = lambda m, x: m(x)
    want = _grads(model, run, x0)
    got, fw, bw = _compile_grads(model, run, x0)
    _assert_sparse_backward(fw, bw)
    _assert_same(got, want)
    report = hyscale_compile.explain(model, x0)
    assert "backward: sparse, at the k selected keys" in str(report), str(report)


def test_bf16_upcast_and_dynamic_shapes():
    torch.manual_seed(fresh_seed("bf16_dynamic"))
    model = GatedSelect(bf16=True)
    run = lambda m, x: m(x)
    for s in (S2, S2 + 8):  # dynamic=True: the second length reuses the symbolic graph
        x0 = torch.randn(1, s, E)
        want = _grads(model, run, x0)
        got, fw, bw = _compile_grads(model, run, x0, dynamic=True)
        _assert_sparse_backward(fw, bw)
        _assert_same(got, want, tol=1e-2)  # q, k gradients pass a bf16 rounding (the cast's backward)


@pytest.mark.parametrize("spelling", ["relu", "clamp_min", "maximum"])
def test_relu_spellings_differentiate_like_autograd_at_zero(spelling):
    """relu, clamp_min(x, 0) and maximum(x, 0) give the same scores but different
    gradients at a logit of exactly 0 (zero key vectors: padding): 0, all, half."""
    act = {"relu": torch.relu, "clamp_min": lambda s: s.clamp_min(0.0),
           "maximum": lambda s: torch.maximum(s, torch.zeros((), dtype=s.dtype))}[spelling]

    def f(q, k, w, bias):
        s = (act(torch.einsum("bshd,btd->bsht", q, k)) * w.unsqueeze(-1)).sum(2) + bias
        vals, idx = s.topk(4, dim=-1)
        return vals, idx

    torch.manual_seed(fresh_seed("relu_spelling_" + spelling))
    q = torch.randn(1, 8, 4, 8, requires_grad=True)
    k0 = torch.randn(1, 8, 8)
    k0[:, 5:] = 0.0  # keys 5..7: every logit exactly 0 ...
    k = k0.requires_grad_(True)
    w = (torch.rand(1, 8, 4) + 0.5).requires_grad_(True)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 100.0, 101.0, 102.0])  # ... and selected by every row
    g = torch.randn(1, 8, 4)

    def run(fn):
        vals, idx = fn(q, k, w, bias)
        (vals * g).sum().backward()
        out = [t.grad.clone() for t in (q, k, w)]
        for t in (q, k, w):
            t.grad = None
        return idx, out

    idx_ref, want = run(f)
    torch._dynamo.reset()
    idx, got = run(torch.compile(f, backend="hyscale_debug"))
    assert torch.equal(idx[..., :3], idx_ref[..., :3])  # the three zero-logit keys, by their bias
    if not torch.equal(idx, idx_ref):
        pytest.skip("a tie at the 4th slot (ReLU zeros): the selections differ, gradients are not comparable")
    _assert_same(got, want)
    if spelling != "relu":  # the point: these pass gradient to the zero keys, relu does not
        assert got[1][0, 5:].abs().sum() > 0


def test_dense_scores_also_in_the_loss_keep_the_dense_backward():
    """A loss that reads the dense scores keeps its dense backward (docs/contract.md); the
    selection is still rewritten, the diagnostics say why the backward is dense."""

    class AlsoDense(GatedSelect):
        def forward(self, x):
            Bx, Sx, _ = x.shape
            q, k, w = self.wq(x).view(Bx, Sx, H2, D2), self.wk(x), self.ww(x).exp()
            s = (torch.einsum("bshd,btd->bsht", q, k).relu() * w.unsqueeze(-1)).sum(2)
            s = s + torch.full((Sx, Sx), float("-inf")).triu(K2)
            vals, idx = s.topk(K2, dim=-1)
            return vals.softmax(-1).sum() + torch.logsumexp(s, -1).mean()

    torch.manual_seed(fresh_seed("also_dense"))
    model, x0 = AlsoDense(), torch.randn(2, S2, E)
    _assert_dense_backward_matches(model, x0)
    report = hyscale_compile.explain(model, x0)
    (site,) = report.rewritten
    assert site.backward.startswith("dense: the scores get gradient from more than the top-k values"), site.line()
    assert site.table_consumers, site.line()


def test_k_equal_to_T_with_a_dense_loss_keeps_the_dense_backward():
    """``topk(min(k, T))`` on a short sequence gives k == T: then a gradient of the dense
    scores has the values' shape. It must not be taken for the values' gradient (it is in
    key order); the values here carry none (only ``vals == -inf`` reads them)."""
    Sx = 8

    class Indexer(GatedSelect):
        def forward(self, x):
            Bx = x.shape[0]
            q, k, w = self.wq(x).view(Bx, Sx, H2, D2), self.wk(x), self.ww(x)
            s = (torch.einsum("bshd,btd->bsht", q, k).relu() * w.unsqueeze(-1)).sum(2)
            s = s.masked_fill(torch.ones(Sx, Sx, dtype=torch.bool).triu(1), float("-inf"))
            vals, idx = s.topk(min(16, Sx), dim=-1)
            idx = idx.masked_fill(vals == float("-inf"), -1)
            return torch.logsumexp(s, -1).mean() + 0 * idx.sum()

    torch.manual_seed(fresh_seed("k_eq_T"))
    model, x0 = Indexer(), torch.randn(2, Sx, E)
    _assert_dense_backward_matches(model, x0)
    (site,) = hyscale_compile.explain(model, x0).rewritten
    assert site.backward.startswith("dense: ") and "not the top-k values' gradient" in site.backward, site.line()


@pytest.mark.gpu
def test_gpu_op_backward_dsa_like_shape():
    """CUDA: the Triton forward and the sparse backward at S=T=2048, H=16, D=64, k=256,
    bf16 q/k, against float64 autograd of the dense scores at the op's own indices."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(fresh_seed("gpu_backward"))
    Bg, Sg, Hg, Dg, Kg = 1, 2048, 16, 64, 256
    spec = ScoreSpec(epilogue=(("mul", Dg**-0.5), ("relu",)), post=(("mask", 0),),
                     masks=(MaskTerm(kind="range", hi=0, mode="fill"),))
    hi = (torch.arange(Sg, device="cuda") + 1).view(1, Sg)
    q = torch.randn(Bg, Sg, Hg, Dg, device="cuda").bfloat16().requires_grad_(True)
    k = torch.randn(Bg, Sg, 1, Dg, device="cuda").bfloat16().requires_grad_(True)
    w = (torch.rand(Bg, Sg, Hg, device="cuda") / Hg).requires_grad_(True)
    vals, idx = torch.ops.hyscale.hytopk_values(q, k, w, [hi], Kg, spec.to_json())
    g = torch.randn(Bg, Sg, Kg, device="cuda")
    (vals.masked_fill(vals == -math.inf, 0) * g).sum().backward()
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, w)]
    dense = ref.dense_scores(*leaves, [hi], spec, dtype=torch.float64)
    (dense.gather(-1, idx.long()) * g.double()).sum().backward()
    for a, b, what in zip((q.grad, k.grad, w.grad), [t.grad for t in leaves], "qkw"):
        tol = 2e-2 if a.dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(a.double(), b.to(a.dtype).double(), atol=tol * b.abs().max().item(), rtol=tol,
                                   msg=f"d/d{what}")


def test_op_backward_with_sorted_flag():
    # hytopk_values called with topk's sorted flag (positional or keyword; the rewrite passes
    # sorted=False on): the backward returns one None per argument as called
    spec = ScoreSpec(epilogue=(("relu",),)).to_json()
    torch.manual_seed(fresh_seed("sorted_flag"))
    q, k, w = torch.randn(1, 8, 2, 4), torch.randn(1, 16, 1, 4), torch.randn(1, 8, 2)
    grads = []
    for args, kwargs in (((), {}), ((False,), {}), ((), {"sorted": False})):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, w)]
        vals, idx = torch.ops.hyscale.hytopk_values(*leaves, [], 3, spec, *args, **kwargs)
        (vals * torch.arange(3.0)).sum().backward()
        grads.append([t.grad for t in leaves])
    for g in grads[1:]:
        for a, b in zip(grads[0], g):
            assert torch.equal(a, b)  # (the CPU reference returns the sorted order either way)


# ---------------------------------------------------------------------------------------
# Determinism: the key gradients sum in (row, slot) order, whatever the run or the chunking
#
# The inputs are small integers and each row's gradient is a small integer times one power of
# two (2^-20..2^20, per row): every per-slot product and per-row sum is then exact in fp32,
# whatever order a matmul adds in, and the only rounding is where one key sums the
# contributions of rows of very different magnitudes. So bitwise comparisons see exactly
# the key accumulation's order, across runs, chunk sizes and devices.

def _shared_key_case(device, S_=48, T_=6, K_=4, H_=4, Hk_=1, D_=16, reduce="weighted_sum", B_=1, seed="shared-keys"):
    """Heavy key sharing: every row picks K_ of T_ keys."""
    gen = torch.Generator().manual_seed(fresh_seed(seed))
    spec = ScoreSpec(reduce=reduce, epilogue=(("relu",), ("mul", 0.125)), post=(("mask", 0),),
                     masks=(MaskTerm(kind="range", hi=0, mode="fill"),))
    q = torch.randint(-2, 3, (B_, S_, H_, D_), generator=gen).float()
    k = torch.randint(-2, 3, (1, T_, Hk_, D_), generator=gen).float()
    w = torch.randint(1, 4, (B_, S_, H_), generator=gen).float() if reduce == "weighted_sum" else None
    idx = torch.stack([torch.stack([torch.randperm(T_, generator=gen)[:K_] for _ in range(S_)]) for _ in range(B_)])
    hi = torch.full((1, S_), T_, dtype=torch.int64)
    scale = torch.exp2(torch.randint(-20, 21, (B_, S_, 1), generator=gen).float())
    g = torch.randint(-8, 9, (B_, S_, K_), generator=gen).float() * scale
    return [t.to(device) if t is not None else None for t in (g, q, k, w, idx.int(), hi)], spec


def _values_bwd(case, chunk_bytes=None):
    from hyscale_compile.lowerings import backward as bwd

    (g, q, k, w, idx, hi), spec = case
    return bwd.values_backward(g, q, k, w, [hi], idx, spec, chunk_bytes=chunk_bytes)


def _row_bytes(case):  # values_backward's chunk budget for one row
    (g, q, k, _, _, _), _ = case
    return 4 * g.shape[-1] * (2 * k.shape[2] * k.shape[3] + 4 * q.shape[2])


@pytest.mark.parametrize("layout", ["mqa", "gqa_batch2_shared_keys"])
def test_key_gradient_kernel_path_equals_index_add_order(monkeypatch, layout):
    """The CUDA path's key accumulation (the Triton segment sum, here under
    TRITON_INTERPRET=1) gives the CPU index_add_'s bits, with one chunk, one row per chunk
    and 3 rows per chunk; those bits are the sequential (row, slot) sum, which the data can
    tell from another order."""
    import functools

    from hyscale_compile.lowerings import backward as bwd

    # (two batches of 24 rows: as many rows as the MQA case's 48, so as many one-row chunks)
    kw = {} if layout == "mqa" else dict(H_=4, Hk_=2, reduce="sum", B_=2, S_=24)
    case = _shared_key_case("cpu", seed=f"shared-keys-{layout}", **kw)
    want = _values_bwd(case)
    (g, q, k, w, idx, hi), spec = case
    # the order matters for these inputs: summing the rows in reverse changes gk's bits
    rev = bwd.values_backward(g.flip(1), q.flip(1), k, None if w is None else w.flip(1), [hi], idx.flip(1), spec)
    assert torch.equal(rev[0], want[0].flip(1)) and not torch.equal(rev[1], want[1])
    chunks = (None, 1, 3 * _row_bytes(case))
    for chunk_bytes in chunks[1:]:  # CPU: the chunk size changes no bit
        assert all(torch.equal(a, b) for a, b in zip(_values_bwd(case, chunk_bytes), want)), chunk_bytes
    monkeypatch.setattr(bwd, "_add_key_grads", functools.partial(bwd._add_key_grads, use_kernel=True))
    for chunk_bytes in chunks:
        got = _values_bwd(case, chunk_bytes)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), chunk_bytes


@pytest.mark.gpu
def test_gpu_values_backward_bitwise_reproducible():
    """CUDA, heavy key sharing (4096 rows over 64 keys, 32 slots each, 16 heads, D = 64):
    repeated calls give the same bits (index_add_'s atomics need not:
    tests/test_attention_op.py shows they do not), so do other chunk sizes (the key sums run
    in (row, slot) order across chunks), and they are the CPU's sequential sum's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    case = _shared_key_case("cuda", S_=4096, T_=64, K_=32, H_=16, Hk_=1, D_=64, seed="gpu-shared-keys")
    runs = [_values_bwd(case) for _ in range(3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
    for rows in (1, 64, 777):  # 777 does not divide S
        got = _values_bwd(case, chunk_bytes=rows * _row_bytes(case))
        for a, b, what in zip(got, runs[0], "qkw"):
            assert torch.equal(a, b), f"d/d{what} changed with {rows} rows per chunk"
    spec = case[1]
    cpu = _values_bwd(([t.cpu() if t is not None else None for t in case[0]], spec))
    assert all(torch.equal(a.cpu(), b) for a, b in zip(runs[0], cpu))


def test_segment_sum_run_tail_adds_nothing():
    """The segment sum loads a key's run in blocks; past the run's end it must add nothing,
    not +0.0 (which turns a -0.0 key gradient into +0.0, unlike index_add_'s loop). Run
    lengths 1..9 straddle the block size."""
    from hyscale_compile.lowerings import attention_backward as ab

    keys = torch.cat([torch.full((n,), t) for t, n in enumerate(range(1, 10))])
    src = torch.full((len(keys), 3), -0.0)
    base = torch.full((9, 3), -0.0)
    want = ab.segment_sum_(base.clone(), keys, src, use_kernel=False)
    assert torch.equal(torch.signbit(want), torch.ones(9, 3, dtype=torch.bool))
    got = ab.segment_sum_(base.clone(), keys, src, use_kernel=True)
    assert torch.equal(torch.signbit(got), torch.signbit(want)) and torch.equal(got, want)
    gen = torch.Generator().manual_seed(fresh_seed("segment-tail"))
    scale = torch.exp2(torch.randint(-20, 20, (len(keys), 1), generator=gen).float())
    src = torch.randn(len(keys), 3, generator=gen) * scale
    assert torch.equal(ab.segment_sum_(base.clone(), keys, src, use_kernel=True),
                       ab.segment_sum_(base.clone(), keys, src, use_kernel=False))


# ---------------------------------------------------------------------------------------
# The fused per-row kernel (lowerings/triton_values_backward.py), here under TRITON_INTERPRET=1

@pytest.mark.parametrize("name", sorted(_spec_cases()))
def test_fused_rows_kernel_gradients_equal_dense_reference(name):
    """The fused kernel's (gq, gk, gw) against float64 autograd of the dense scores read at
    the same indices, for every spec form the op tests cover (fills, additive masks, GQA,
    bf16 logits, sum and weighted sum), and against the PyTorch path."""
    from hyscale_compile.lowerings import backward as bwd
    from hyscale_compile.lowerings import triton_values_backward as tvb

    spec, H, Hk, has_w, mask_makers = _spec_cases()[name]
    assert tvb.supported(spec)
    torch.manual_seed(fresh_seed("fused-" + name))
    masks = [m() for m in mask_makers]
    q, k = torch.randn(B, S, H, D), torch.randn(B, T, Hk, D)
    w = torch.rand(B, S, H) + 0.1 if has_w else None
    _, idx = torch.ops.hyscale.hytopk_values(q, k, w, masks, K, spec.to_json())
    g = torch.randn(B, S, K)
    got = bwd.values_backward(g, q, k, w, masks, idx, spec, fused=True)
    torch_path = bwd.values_backward(g, q, k, w, masks, idx, spec, fused=False)
    leaves = [t.double().requires_grad_(True) for t in (q, k) + ((w,) if has_w else ())]
    dense = ref.dense_scores(leaves[0], leaves[1], leaves[2] if has_w else None, masks, spec, dtype=torch.float64)
    picked = dense.gather(-1, idx.long())
    (picked * g.double()).sum().backward()  # (-inf slots: the sum is not finite, its gradient is)
    tol = 2e-2 if spec.logit_dtype != "float32" else 1e-5
    for a, b, c, what in zip(got, [t.grad for t in leaves] + [None], torch_path, "qkw"):
        if b is None:
            assert a.numel() == 0
            continue
        torch.testing.assert_close(a, b.float(), atol=tol, rtol=tol, msg=f"d/d{what}")
        # (bf16 logits: a logit whose fp32 sum lands at another bf16 neighbour changes gw by
        # ~2^-8 relative, for either path against the other as against float64)
        torch.testing.assert_close(a, c, atol=tol, rtol=tol, msg=f"d/d{what} against the PyTorch path")


@pytest.mark.parametrize("spelling", ["relu", "clamp_min", "maximum"])
def test_fused_rows_kernel_relu_spellings_at_zero(spelling):
    """A logit of exactly 0 (zero keys): relu passes no gradient, clamp_min all of it,
    maximum half, as autograd gives each spelling (and as the PyTorch path does)."""
    from hyscale_compile.lowerings import backward as bwd

    spec = ScoreSpec(epilogue=(("relu",) if spelling == "relu" else ("relu", spelling), ("mul", 0.5)))
    torch.manual_seed(fresh_seed("fused-relu-" + spelling))
    q, k, w = torch.randn(1, 6, 4, 8), torch.randn(1, 10, 1, 8), torch.rand(1, 6, 4) + 0.5
    k[:, 7:] = 0.0
    idx = torch.stack([torch.cat([torch.tensor([7, 8, 9]), torch.randperm(7)[:2]]) for _ in range(6)]).unsqueeze(0)
    g = torch.randn(1, 6, 5)
    got = bwd.values_backward(g, q, k, w, [], idx, spec, fused=True)
    want = bwd.values_backward(g, q, k, w, [], idx, spec, fused=False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    zero_keys = got[1][0, 7:].abs().sum()
    assert (zero_keys == 0) if spelling == "relu" else (zero_keys > 0)


def test_fused_rows_kernel_bits_do_not_depend_on_the_chunking():
    """Exact-product inputs with heavy key sharing (see _shared_key_case): the fused path
    gives the PyTorch path's bits, at one row per chunk, 3 rows and one chunk; several key
    heads, a batch of 2 sharing [1, T] keys."""
    from hyscale_compile.lowerings import backward as bwd

    for kw in ({}, dict(H_=4, Hk_=2, reduce="sum", B_=2)):
        case = _shared_key_case("cpu", seed="fused-chunks", **kw)
        (g, q, k, w, idx, hi), spec = case
        want = bwd.values_backward(g, q, k, w, [hi], idx, spec, fused=False)
        for chunk_bytes in (None, 1, 3 * _row_bytes(case)):
            got = bwd.values_backward(g, q, k, w, [hi], idx, spec, chunk_bytes=chunk_bytes, fused=True)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (kw, chunk_bytes)


def test_fused_key_sum_at_sorted_positions_equals_the_gathered_sum():
    """The fused path writes each slot's key contribution at its key-sorted position and sums
    each key's run contiguously: the same bits as the kernel's contributions in (row, slot)
    layout gathered by segment_sum_ (the Triton kernel, interpreted here), with rows that
    have fewer than k valid keys (a causal fill: -inf values, no gradient at those slots),
    several key heads, and against float64."""
    from hyscale_compile.lowerings import attention_backward as ab
    from hyscale_compile.lowerings import backward as bwd
    from hyscale_compile.lowerings import triton_values_backward as tvb

    torch.manual_seed(fresh_seed("fused-sorted-keys"))
    S_, T_, K_, D_ = 10, 10, 6, 16
    spec = ScoreSpec(epilogue=(("relu",), ("mul", 0.25)), post=(("mask", 0),),
                     masks=(MaskTerm(kind="range", hi=0, mode="fill"),))
    hi = (torch.arange(S_) + 1).view(1, S_)  # rows 0..4 see fewer than k keys
    for H_, Hk_ in ((4, 1), (4, 2)):
        q, k, w = torch.randn(1, S_, H_, D_), torch.randn(1, T_, Hk_, D_), torch.rand(1, S_, H_) + 0.1
        vals, idx = torch.ops.hyscale.hytopk_values(q, k, w, [hi], K_, spec.to_json())
        assert bool((vals[0, :K_ - 1] == -math.inf).any())
        g = torch.randn(1, S_, K_)
        got = bwd.values_backward(g, q, k, w, [hi], idx, spec, fused=True)
        keys = idx.long()
        gy = tvb.post_backward(g, [hi], spec, keys, 0, 1, 0, S_, 1, S_, T_)
        gq, contrib, gw = tvb.rows_backward_fused(gy[0], q[0], k[0], w[0], keys[0], spec, (True, True, True))
        gk = ab.segment_sum_(torch.zeros(T_, Hk_, D_), keys.flatten(), contrib, use_kernel=True)
        for a, b, what in zip(got, (gq, gk, gw), "qkw"):
            assert torch.equal(a[0], b), f"d/d{what}"
        # the sorted layout is the same rows, permuted
        skeys, dest, bounds = ab.key_runs(keys.flatten(), T_)
        placed = tvb.rows_backward_fused(gy[0], q[0], k[0], w[0], keys[0], spec, (True, True, True), dest=dest)
        assert torch.equal(placed[1][:, dest.long()], contrib)
        leaves = [t.double().requires_grad_(True) for t in (q, k, w)]
        picked = ref.dense_scores(*leaves, [hi], spec, dtype=torch.float64).gather(-1, idx.long())
        (picked * g.double()).masked_fill(vals == -math.inf, 0).sum().backward()
        for a, b, what in zip(got, [t.grad for t in leaves], "qkw"):
            torch.testing.assert_close(a, b.float(), atol=1e-5, rtol=1e-5, msg=f"d/d{what}")
    with pytest.raises(ValueError, match="dest"):
        tvb.rows_backward_fused(gy[0], q[0], k[0], w[0], keys[0], spec, (True, True, True), dest=dest[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rows_kernel_contribution_layouts_agree(monkeypatch, dtype):
    """The key contributions as gx^T q (the default below 64 x 128 heads) or as q^T gx (c_trans=1), and
    HYSCALE_VALUES_BWD_CONFIG's other fields: exact-product inputs with heavy key sharing give
    the same bits either way (bf16: the three-part split on either side of the dot); an
    unknown field is an error that names the fields."""
    from hyscale_compile.lowerings import backward as bwd
    from hyscale_compile.lowerings import triton_values_backward as tvb

    case = _shared_key_case("cpu", seed="fused-layouts", H_=4, Hk_=2)
    (g, q, k, w, idx, hi), spec = case
    q, k = q.to(dtype), k.to(dtype)
    outs = {}
    for cfg in ("", "c_trans=1", "c_trans=1,block_n=16,num_warps=2", "block_n=16,num_stages=2"):
        monkeypatch.setenv("HYSCALE_VALUES_BWD_CONFIG", cfg)
        outs[cfg] = bwd.values_backward(g, q, k, w, [hi], idx, spec, fused=True)
    want = bwd.values_backward(g, q, k, w, [hi], idx, spec, fused=False)
    for cfg, got in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(got, want)), cfg
    monkeypatch.setenv("HYSCALE_VALUES_BWD_CONFIG", "blocks=3")
    with pytest.raises(ValueError, match="block_n"):
        tvb.default_config(4, 16)


def test_fused_rows_kernel_needs_and_uncovered_specs():
    """needs=(q only): no key or weight gradient is computed; a spec the kernel does not
    cover (a relu after the head reduction reads the score in its derivative) keeps the
    PyTorch path, with the same gradients."""
    from hyscale_compile.lowerings import backward as bwd
    from hyscale_compile.lowerings import triton_values_backward as tvb

    torch.manual_seed(fresh_seed("fused-needs"))
    spec = ScoreSpec(epilogue=(("relu",),))
    q, k, w = torch.randn(1, 5, 2, 16).bfloat16(), torch.randn(1, 7, 1, 16).bfloat16(), torch.rand(1, 5, 2)
    idx = torch.stack([torch.randperm(7)[:3] for _ in range(5)]).unsqueeze(0)
    g = torch.randn(1, 5, 3)
    gq, gk, gw = bwd.values_backward(g, q, k, w, [], idx, spec, needs=(True, False, False), fused=True)
    assert gq.dtype == torch.bfloat16 and gk.numel() == 0 and gw.numel() == 0
    torch.testing.assert_close(gq, bwd.values_backward(g, q, k, w, [], idx, spec, fused=False)[0], atol=1e-2, rtol=1e-2)
    post_relu = ScoreSpec(epilogue=(("relu",),), post=(("relu",),))
    assert not tvb.supported(post_relu)
    a = bwd.values_backward(g, q.float(), k.float(), w, [], idx, post_relu, fused=True)
    b = bwd.values_backward(g, q.float(), k.float(), w, [], idx, post_relu, fused=False)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.gpu
def test_gpu_fused_rows_kernel_dsa_like_shape():
    """CUDA: the fused kernel at S=T=2048, H=16, D=64, k=256 (bf16 q/k, causal fill) against
    the PyTorch path, and bitwise repeatable (two calls, and another chunk size)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from hyscale_compile.lowerings import backward as bwd

    torch.manual_seed(fresh_seed("gpu_fused"))
    Sg, Hg, Dg, Kg = 2048, 16, 64, 256
    spec = ScoreSpec(epilogue=(("mul", Dg**-0.5), ("relu",)), post=(("mask", 0),),
                     masks=(MaskTerm(kind="range", hi=0, mode="fill"),))
    hi = (torch.arange(Sg, device="cuda") + 1).view(1, Sg)
    q = torch.randn(1, Sg, Hg, Dg, device="cuda").bfloat16()
    k = torch.randn(1, Sg, 1, Dg, device="cuda").bfloat16()
    w = torch.rand(1, Sg, Hg, device="cuda") / Hg
    vals, idx = torch.ops.hyscale.hytopk_values(q, k, w, [hi], Kg, spec.to_json())
    g = torch.randn(1, Sg, Kg, device="cuda").masked_fill(vals == -math.inf, 0)
    got = bwd.values_backward(g, q, k, w, [hi], idx, spec, fused=True)
    want = bwd.values_backward(g, q, k, w, [hi], idx, spec, fused=False)
    for a, b, what in zip(got, want, "qkw"):
        tol = 2e-2 if a.dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(a.float(), b.float(), atol=tol * b.abs().max().item(), rtol=tol, msg=f"d/d{what}")
    again = bwd.values_backward(g, q, k, w, [hi], idx, spec, fused=True)
    other = bwd.values_backward(g, q, k, w, [hi], idx, spec, fused=True, chunk_bytes=8 << 20)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(got, again, other))


def test_fused_rows_kernel_bf16_operands_split_dots():
    """bf16 q and k: the kernel's gradient dots split the fp32 gradient into three bf16 parts
    (run as fp32 dots under the interpreter): the parts sum to it exactly, so the result
    keeps an fp32 dot's accuracy against the PyTorch path (fp32 matmuls of the upcast
    operands)."""
    from hyscale_compile.lowerings import backward as bwd

    torch.manual_seed(fresh_seed("fused-split"))
    spec = ScoreSpec(epilogue=(("mul", 0.125), ("relu",)), post=(("mask", 0),),
                     masks=(MaskTerm(kind="range", hi=0, mode="fill"),))
    q, k = torch.randn(1, 12, 4, 32).bfloat16(), torch.randn(1, 20, 1, 32).bfloat16()
    w = torch.rand(1, 12, 4)
    idx = torch.stack([torch.randperm(20)[:6] for _ in range(12)]).unsqueeze(0)
    hi = torch.full((1, 12), 20)
    g = torch.randn(1, 12, 6) * 1e3
    f32 = bwd.values_backward(g, q.float(), k.float(), w, [hi], idx, spec, fused=False)
    got = bwd.values_backward(g, q, k, w, [hi], idx, spec, fused=True)
    f32_fused = bwd.values_backward(g, q.float(), k.float(), w, [hi], idx, spec, fused=True)
    for a, b, c in zip(got, f32_fused, f32):
        torch.testing.assert_close(b, c, atol=1e-5 * c.abs().max().item(), rtol=1e-5)
        torch.testing.assert_close(a, c.to(a.dtype), atol=0, rtol=2**-7)  # one bf16 rounding
    # before the cast: the split dots' fp32 gq and key contributions equal the fp32 dots' up
    # to summation order (dropping the low part would be ~2^-17 relative per term, 8x this)
    from hyscale_compile.lowerings import triton_values_backward as tvb

    gy = tvb.post_backward(g, [hi], spec, idx, 0, 1, 0, 12, 1, 12, 20)[0]
    split = tvb.rows_backward_fused(gy, q[0], k[0], w[0], idx[0], spec, (True, True, True))
    plain = tvb.rows_backward_fused(gy, q[0].float(), k[0].float(), w[0], idx[0], spec, (True, True, True))
    for a, b in zip(split, plain):
        torch.testing.assert_close(a, b, atol=1e-6 * b.abs().max().item(), rtol=0)
