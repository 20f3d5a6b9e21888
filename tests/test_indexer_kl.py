"""The indexer's dense KL loss (DSA warm-up): ``hyscale_compile.losses.dense_indexer_kl``, its
chunked reference and its Triton kernels (interpreted on the CPU) against the loss as
Megatron-Core writes it, dense, in float64."""
import math

import pytest
import torch

from hyscale_compile.losses import dense_indexer_kl
from hyscale_compile.lowerings import indexer_kl_reference as ref
from hyscale_compile.lowerings import triton_indexer_kl as tk
from hyscale_compile.lowerings.spec import SpecError
from hyscale_compile.testing import assert_consumer_close
from tests.contract import fresh_seed


def megatron_dense_kl(q, k, qi, ki, w, scale, causal=True, loss_coeff=1.0, eps=1e-10, dtype=torch.float32):
    """``DSAIndexer._compute_index_scores`` + ``compute_dsa_indexer_loss`` (sparse_loss=False),
    tables and all, in the [B, S, H, D] layout; ``eps=0`` is the exact KL (0 log 0 := 0)."""
    B, S, H, D = q.shape
    T = k.shape[1]
    kk = k.repeat_interleave(H // k.shape[2], dim=2)
    index_scores = torch.einsum("bshd,btd->bsht", qi.to(dtype), ki.to(dtype)).relu()
    index_scores = (index_scores * w.to(dtype).unsqueeze(-1)).sum(2)
    if causal:
        mask = torch.triu(torch.full((S, T), float("-inf"), dtype=dtype), diagonal=1)
    else:
        mask = torch.zeros(S, T, dtype=dtype)
    index_scores = index_scores + mask
    att = torch.bmm(q.permute(0, 2, 1, 3).reshape(B * H, S, D).to(dtype),
                    kk.permute(0, 2, 3, 1).reshape(B * H, D, T).to(dtype)) * scale
    att = att.reshape(B, H, S, T) + mask.view(1, 1, S, T)
    att = torch.softmax(att, dim=-1)
    ind = torch.softmax(index_scores, dim=-1)
    att = att.sum(1)
    att = att / att.sum(-1, keepdim=True)
    if eps:
        kl = att * (torch.log(att + eps) - torch.log(ind + eps))
    else:
        # the logs of hidden keys' 0s kept out of the graph too (their NaN gradient would leak through where)
        seen = att > 0
        one = torch.ones((), dtype=dtype)
        kl = torch.where(seen, att * (torch.log(torch.where(seen, att, one)) - torch.log(torch.where(seen, ind, one))),
                         torch.zeros((), dtype=dtype))
    return kl.sum(-1).mean() * loss_coeff


def make_inputs(seed, B=2, S=24, T=None, H=4, Hk=2, D=16, Hi=4, Di=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    T = S if T is None else T
    q = torch.randn(B, S, H, D, generator=g).to(dtype)
    k = torch.randn(B, T, Hk, D, generator=g).to(dtype)
    qi = torch.randn(B, S, Hi, Di, generator=g).to(dtype)
    ki = torch.randn(B, T, Di, generator=g).to(dtype)
    w = (torch.randn(B, S, Hi, generator=g) * (Hi ** -0.5) * (Di ** -0.5) * 2).to(dtype)
    return q, k, qi, ki, w


def dense_grads(q, k, qi, ki, w, scale, causal, coeff, eps, dtype):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (qi, ki, w)]
    loss = megatron_dense_kl(q, k, *leaves, scale, causal=causal, loss_coeff=coeff, eps=eps, dtype=dtype)
    loss.backward()
    return [loss.detach()] + [t.grad for t in leaves]


def run_path(path, q, k, qi, ki, w, scale, causal, coeff, lse=None, cfg=None):
    """(loss, gqi, gki, gw) from the op's CPU path ("reference") or the Triton kernels."""
    if path == "reference":
        leaves = [t.clone().requires_grad_(True) for t in (qi, ki, w)]
        loss = dense_indexer_kl(q, k, *leaves, scale=scale, causal=causal, lse=lse, loss_coeff=coeff)
        loss.backward()
        return [loss.detach()] + [t.grad for t in leaves]
    loss, stats, row_stats = tk.indexer_kl_triton_forward(q, k, qi, ki, w, lse, scale, causal, coeff, cfg=cfg)
    grads = tk.indexer_kl_triton_backward(torch.ones(()), q, k, qi, ki, w, stats, row_stats, scale, causal, coeff,
                                          cfg=cfg)
    return [loss] + list(grads)


def check_against_float64(out, q, k, qi, ki, w, scale, causal, coeff):
    exact = dense_grads(q, k, qi, ki, w, scale, causal, coeff, eps=0.0, dtype=torch.float64)
    orig = dense_grads(q, k, qi, ki, w, scale, causal, coeff, eps=1e-10, dtype=torch.float32)
    for name, o, g, r in zip(("loss", "grad qi", "grad ki", "grad w"), out, orig, exact):
        assert o.dtype == (torch.float32 if name == "loss" else qi.dtype), (name, o.dtype)
        assert bool(torch.isfinite(r).all()), name
        e_out, e_orig = assert_consumer_close(o, g, r, torch.float32, what=name)
        assert math.isfinite(e_orig), name


# the interpreter's cost grows with the tiles: tiny shapes, with a row count that is not a
# multiple of the 16-row tiles, GQA (Hk=2 of H=4) and a head dim that needs masking (12)
CASES = [dict(S=24), dict(S=21, D=12, Di=12, Hi=3)]


@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_megatron_float64(path, case):
    for i in range(5):
        seed = fresh_seed(f"indexer_kl {path} case {case} #{i}")
        q, k, qi, ki, w = make_inputs(seed, **CASES[case])
        scale = q.shape[-1] ** -0.5
        out = run_path(path, q, k, qi, ki, w, scale, True, 0.7)
        check_against_float64(out, q, k, qi, ki, w, scale, True, 0.7)


# Seeds whose loss (a scalar: one draw of the rounding, where the original's can be ~0) the
# op gave 2.5 eps off against the original's 0.25: the loss scaled by a rounded fp32
# loss_coeff / (B S), one rounding more than the original's mean (a sweep of seeds 100..1099)
@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("case", [("case", 1, 447), ("not causal", None, 329)], ids=lambda c: f"{c[0]}-{c[2]}")
def test_loss_seeds_that_broke_the_rule(path, case):
    if case[0] == "case":
        q, k, qi, ki, w = make_inputs(case[2], **CASES[case[1]])
        scale, causal, coeff = q.shape[-1] ** -0.5, True, 0.7
    else:
        q, k, qi, ki, w = make_inputs(case[2], S=12, T=29, H=2, Hk=1, Hi=2)
        scale, causal, coeff = 0.3, False, 1.0
    out = run_path(path, q, k, qi, ki, w, scale, causal, coeff)
    check_against_float64(out, q, k, qi, ki, w, scale, causal, coeff)


# A seed whose gradient broke the rule (a sweep of seeds 0..2999 with HYSCALE_SEED): the CPU
# path's grad w 4.5 eps off where the original erred 0.76 (softmax's fp32 normaliser; 1.6 in
# two steps; the kernels give 1.1). Not pinned: the kernels' grad ki under CONFIGS[3] at
# 870943460 (tied inputs, not causal), 4.5 eps against a bound of 4.4 with the float64 softmax
# sums, from the fp32 rounding of the index scores, which the CPU path shares: with qi's and
# ki's head dim and the index heads permuted (the same exact result), it exceeds that bound
# in 4 of 150 orderings (up to 5.6 eps).
@pytest.mark.parametrize("path", ["reference", "triton"])
def test_gradient_seed_that_broke_the_rule(path):
    q, k, qi, ki, w = make_inputs(197, **CASES[0])
    scale = q.shape[-1] ** -0.5
    out = run_path(path, q, k, qi, ki, w, scale, True, 0.7)
    check_against_float64(out, q, k, qi, ki, w, scale, True, 0.7)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_not_causal_more_keys(path):
    seed = fresh_seed(f"indexer_kl not causal {path}")
    q, k, qi, ki, w = make_inputs(seed, S=12, T=29, H=2, Hk=1, Hi=2)
    out = run_path(path, q, k, qi, ki, w, 0.3, False, 1.0)
    check_against_float64(out, q, k, qi, ki, w, 0.3, False, 1.0)


def test_backward_in_chunks():
    """Several backward chunks (the key gradient continues across them) give the one-chunk bits' values."""
    seed = fresh_seed("indexer_kl chunks")
    q, k, qi, ki, w = make_inputs(seed, S=32, H=2, Hk=2, Hi=2)
    scale = 0.25
    one = tk.default_config(q, qi, 32)
    assert one.chunk_rows >= 32
    outs = [run_path("triton", q, k, qi, ki, w, scale, True, 1.0, cfg=c)
            for c in (one, tk.IndexerKLConfig(**{**one.__dict__, "chunk_rows": 16}))]
    check_against_float64(outs[1], q, k, qi, ki, w, scale, True, 1.0)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# launch configurations beside the interpreter's default: the GPU default's paths (stacked
# heads in the query gradient, the key-major key gradient, 4 head groups, the loops' own
# pipeline depths, which the interpreter only parses), stacked heads (2
# and 4, with the fallback to one head where they do not divide: Hi=3) in both gradients,
# the query gradient's own tiles (a 32-row tile over 16-row chunks straddles each chunk's
# end; also with stacked heads and the key-major key gradient), and the lse pass's tile
CONFIGS = [
    dict(dq_heads=2, dk_trans=1, dk_head_split=4, lse_block_m=32, head_stages=4, attn_stages=3, grad_stages=3),
    dict(dq_heads=4, dq_block_m=8, dq_block_n=32, dk_heads=2, dk_block_n=16),
    dict(dq_block_m=32, chunk_rows=16, dk_heads=2, dk_trans=1, lse_block_m=32, lse_num_warps=2),
    dict(dq_heads=2, dq_block_m=32, chunk_rows=16, dk_trans=1),
]


def tied_inputs(seed, **kw):
    """make_inputs with ties: index head 0 all zeros (a = 0 exactly: relu's kink, [a > 0] = 0),
    keys 1 and 2 of the indexer equal (tied index scores), attention keys 3 and 4 equal."""
    q, k, qi, ki, w = make_inputs(seed, **kw)
    qi[:, :, 0] = 0.0
    ki[:, 2] = ki[:, 1]
    k[:, 4] = k[:, 3]
    return q, k, qi, ki, w


@pytest.mark.parametrize("fields", range(len(CONFIGS)))
def test_launch_configs(fields):
    """Each configuration against float64 (masked rows: S=21 leaves a partial tile, D=Di=12
    masked head dims; masked keys: causal, and T > S; ties), bitwise repeatable, and within
    fp32 rounding of the default's; the first also where Hi=3 takes the one-head fallback."""
    cases = [(dict(S=21, D=12, Di=12, Hi=4), True), (dict(S=12, T=29, H=2, Hk=1, Hi=4), False)]
    if fields == 0:
        cases.append((dict(S=21, H=2, Hi=3), True))
    for i, (case, causal) in enumerate(cases):
        seed = fresh_seed(f"indexer_kl config {fields} #{i}")
        q, k, qi, ki, w = tied_inputs(seed, **case)
        scale = q.shape[-1] ** -0.5
        base = tk.default_config(q, qi, k.shape[1])
        cfg = tk.IndexerKLConfig(**{**base.__dict__, **CONFIGS[fields]})
        out = run_path("triton", q, k, qi, ki, w, scale, causal, 0.7, cfg=cfg)
        check_against_float64(out, q, k, qi, ki, w, scale, causal, 0.7)
        if i == 0:
            again = run_path("triton", q, k, qi, ki, w, scale, causal, 0.7, cfg=cfg)
            assert all(torch.equal(x, y) for x, y in zip(out, again))
            for x, y in zip(out, run_path("triton", q, k, qi, ki, w, scale, causal, 0.7, cfg=base)):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


def _ulps(x, ref):
    """|x - ref| in units of x's fp32 ulp."""
    x = x.double()
    return (x - ref).abs() / torch.exp2(torch.floor(torch.log2(x.abs())) - 23)


def test_row_stats_over_many_key_tiles():
    """The forward's softmax sums where every row's max rises in each of its 16 key tiles (a
    rescale of the running sums per tile): scores exact in fp32 (one nonzero head dim,
    multiples of 2^-12), so the indexer's l, the attention's l and Z are checked against
    float64 to 2 ulps (the fp32 exps' roundings, then one of the sum). Summed across tiles
    in fp32, each rescale's rounding stayed in l (up to 11 ulps off)."""
    B, S, T = 1, 4, 256
    t = torch.arange(T)
    v = (t // 16).float() / 1024 + ((t * 7) % 16).float() / 4096
    qi = torch.zeros(B, S, 1, 16)
    qi[..., 0] = 1.0
    ki = torch.zeros(B, T, 16)
    ki[0, :, 0] = v
    w = torch.tensor([1.0, 0.5, 4.0, 2.0]).view(1, S, 1)
    q = torch.zeros(B, S, 1, 16)
    q[0, :, 0, 0] = torch.tensor([16.0, 32.0, 64.0, 128.0])
    k = torch.zeros(B, T, 1, 16)
    k[0, :, 0, 0] = v
    _, stats, rs = tk.indexer_kl_triton_forward(q, k, qi, ki, w, None, 0.25, False, 1.0)
    I = w[0].double() * v.double()  # [S, T]
    assert torch.equal(rs[0, :, 0].double(), I.amax(-1))
    assert _ulps(rs[0, :, 1], torch.exp(I - I.amax(-1, keepdim=True)).sum(-1)).max() <= 2
    s = q[0, :, 0, :1].double() * v.double() * 0.25
    m, l = stats[0, :, 0, 0].double(), stats[0, :, 0, 1]
    assert torch.equal(m, s.amax(-1))
    assert _ulps(l, torch.exp(s - m[:, None]).sum(-1)).max() <= 2
    assert _ulps(rs[0, :, 2], (torch.exp(s - m[:, None]) / l.double()[:, None]).sum(-1)).max() <= 2


def test_bad_launch_config():
    q, k, qi, ki, w = make_inputs(0, B=1, S=8, H=2, Hk=2, Hi=2)
    base = tk.default_config(q, qi, 8)
    for change, msg in ((dict(dq_heads=3), "dq_heads must be a power of two, got 3"),
                        (dict(dq_block_n=24), "dq_block_n must be 0 .* or a power of two, got 24"),
                        (dict(block_m=16, chunk_rows=40), "chunk_rows 40 is not a multiple of block_m 16")):
        with pytest.raises(SpecError, match=msg):
            tk.indexer_kl_triton_forward(q, k, qi, ki, w, None, 0.3, True, 1.0,
                                         cfg=tk.IndexerKLConfig(**{**base.__dict__, **change}))


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_supplied_lse(path):
    """The attention's own lse, when given, is what the target reads (within fp32 rounding of
    lse = m + log l: the same loss and gradients as computing it), and a different one changes it."""
    seed = fresh_seed(f"indexer_kl lse {path}")
    q, k, qi, ki, w = make_inputs(seed, S=16, H=2, Hk=2, Hi=2)
    if path == "reference":
        _, stats, _ = torch.ops.hyscale.dense_indexer_kl(q, k, qi, ki, w, None, 0.25, True, 1.0)
    else:
        stats = tk.attention_stats_triton(q, k, 0.25, True)
    lse = stats[..., 0] + torch.log(stats[..., 1])
    want = torch.logsumexp((torch.einsum("bshd,bthd->bhst", q.double(), k.double()) * 0.25).masked_fill(
        torch.ones(16, 16, dtype=torch.bool).triu(1), -math.inf), -1).transpose(1, 2)
    torch.testing.assert_close(lse.double(), want, rtol=0, atol=1e-5)
    a = run_path(path, q, k, qi, ki, w, 0.25, True, 1.0)
    b = run_path(path, q, k, qi, ki, w, 0.25, True, 1.0, lse=lse)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
    # a different lse changes the target: the argument is read
    c = run_path(path, q, k, qi, ki, w, 0.25, True, 1.0, lse=lse + torch.linspace(0, 1, 2))
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_bitwise_reproducible(path):
    seed = fresh_seed(f"indexer_kl repro {path}")
    q, k, qi, ki, w = make_inputs(seed, S=20, H=2, Hk=1, Hi=3)
    a = run_path(path, q, k, qi, ki, w, 0.25, True, 1.0)
    b = run_path(path, q, k, qi, ki, w, 0.25, True, 1.0)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_no_gradient_to_attention():
    seed = fresh_seed("indexer_kl detached")
    q, k, qi, ki, w = make_inputs(seed, S=8, H=2, Hk=2, Hi=2)
    q.requires_grad_(True)
    k.requires_grad_(True)
    leaves = [t.clone().requires_grad_(True) for t in (qi, ki, w)]
    loss = dense_indexer_kl(q, k, *leaves)
    assert loss.shape == () and loss.dtype == torch.float32 and loss.requires_grad
    loss.backward()
    assert q.grad is None and k.grad is None
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in leaves)
    # only the attention requiring grad: the loss is a constant
    assert not dense_indexer_kl(q, k, qi, ki, w).requires_grad


def test_opcheck():
    q, k, qi, ki, w = make_inputs(3, B=1, S=8, H=2, Hk=1, D=8, Hi=2, Di=8)
    leaves = [t.clone().requires_grad_(True) for t in (qi, ki, w)]
    torch.library.opcheck(torch.ops.hyscale.dense_indexer_kl.default, (q, k, *leaves, None, 0.3, True, 1.0),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_megatron_function_itself():
    """The dense helper is Megatron-Core's ``compute_dsa_indexer_loss`` (and its indexer's scores)."""
    dsa = pytest.importorskip("megatron.core.transformer.experimental_attention_variant.dsa")
    from types import SimpleNamespace

    q, k, qi, ki, w = make_inputs(fresh_seed("indexer_kl megatron"), B=2, S=10, H=2, Hk=2, Hi=3)
    scores = dsa.DSAIndexer._compute_index_scores(None, qi.transpose(0, 1), w.transpose(0, 1), ki.transpose(0, 1))
    scores = scores + torch.triu(torch.full((10, 10), float("-inf")), diagonal=1)
    pg = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    theirs = dsa.compute_dsa_indexer_loss(scores, torch.zeros(2, 10, 1, dtype=torch.long), q.transpose(0, 1),
                                          k.transpose(0, 1), 0.25, 0.5, False, pg)
    ours = megatron_dense_kl(q, k, qi, ki, w, 0.25, loss_coeff=0.5)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    torch.testing.assert_close(dense_indexer_kl(q, k, qi, ki, w, scale=0.25, loss_coeff=0.5), theirs,
                               rtol=1e-5, atol=1e-7)


def test_bad_input():
    q, k, qi, ki, w = make_inputs(0, B=1, S=8, H=2, Hk=2, Hi=2)
    bad = [
        (dict(q=q[0]), r"q must be \[B, S, H, D\]"),
        (dict(k=torch.randn(1, 8, 3, 16)), "k has 3 heads, which does not divide q's 2"),
        (dict(k=torch.randn(1, 8, 2, 12)), r"k \(1, 8, 2, 12\) does not match q"),
        (dict(ki=torch.randn(1, 8, 12)), r"ki \(1, 8, 12\) must be \[B, T, Di\]"),
        (dict(w=torch.randn(1, 8, 3)), r"w \(1, 8, 3\) must be \[B, S, Hi\]"),
        (dict(qi=torch.randn(2, 8, 2, 16)), "qi .* does not match q's batch"),
        (dict(k=torch.randn(1, 9, 2, 16), ki=torch.randn(1, 9, 16)), "causal needs S == T"),
        (dict(q=q.double(), k=k.double()), "q has dtype torch.float64"),
        (dict(k=k.bfloat16()), "q is torch.float32 but k is torch.bfloat16"),
        (dict(qi=qi.half()), "qi is torch.float16 but ki is torch.float32"),
        (dict(w=w.to(torch.int32)), "w has dtype torch.int32"),
        (dict(ki=ki.to("meta")), "ki is on meta, q on cpu"),
        (dict(lse=torch.zeros(1, 8, 3)), r"lse \(1, 8, 3\) must be \[B, S, H\]"),
        (dict(lse=torch.zeros(1, 8, 2, dtype=torch.float64)), "lse has dtype torch.float64; expected float32"),
        (dict(w=[1.0]), "w is a list, not a tensor"),
    ]
    base = dict(q=q, k=k, qi=qi, ki=ki, w=w)
    for change, msg in bad:
        args = {**base, **change}
        lse = args.pop("lse", None)
        with pytest.raises(SpecError, match=msg):
            dense_indexer_kl(args["q"], args["k"], args["qi"], args["ki"], args["w"], lse=lse, scale=0.3)
    with pytest.raises(SpecError, match="causal needs S == T"):
        tk.indexer_kl_triton_forward(q, k[:, :7], qi, ki[:, :7], w, None, 0.3, True, 1.0)
    with pytest.raises(SpecError, match="head dim up to 256"):
        tk.indexer_kl_triton_forward(q, k, torch.randn(1, 8, 2, 300), torch.randn(1, 8, 300), w, None, 0.3, True, 1.0)


def test_compiles():
    """Traced whole (fake kernels, the autograd formula) and the same bits as eager."""
    q, k, qi, ki, w = make_inputs(fresh_seed("indexer_kl compile"), S=8, H=2, Hk=2, Hi=2)

    def f(q, k, qi, ki, w):
        return dense_indexer_kl(q, k, qi, ki, w, loss_coeff=0.5) * 2

    outs = []
    for fn in (f, torch.compile(f, backend="hyscale_debug", fullgraph=True)):
        leaves = [t.clone().requires_grad_(True) for t in (qi, ki, w)]
        loss = fn(q, k, *leaves)
        loss.backward()
        outs.append([loss.detach()] + [t.grad for t in leaves])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def check_kernels_at(device, dtype, S, H, D, Hi, Di, chunk_rows, fields=None):
    """The kernels (one backward chunk and several, with ``fields`` over the default config)
    against float64, bitwise repeatable, and the op's path on ``device`` the same bits as the
    kernels called directly."""
    seed = fresh_seed(f"indexer_kl {device} {dtype} S={S}")
    q, k, qi, ki, w = (t.to(device) for t in make_inputs(seed, B=1, S=S, H=H, Hk=H, D=D, Hi=Hi, Di=Di, dtype=dtype))
    scale = D ** -0.5
    base = tk.default_config(q, qi, S)
    cfg = tk.IndexerKLConfig(**{**base.__dict__, **(fields or {}), "chunk_rows": chunk_rows})
    outs = [run_path("triton", q, k, qi, ki, w, scale, True, 1.0, cfg=cfg) for _ in range(2)]
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    one = run_path("triton", q, k, qi, ki, w, scale, True, 1.0)
    host = [t.cpu() for t in (q, k, qi, ki, w)]
    exact = dense_grads(*host, scale, True, 1.0, eps=0.0, dtype=torch.float64)
    orig = dense_grads(*host, scale, True, 1.0, eps=1e-10, dtype=torch.float32)
    for name, o, c, g, r in zip(("loss", "grad qi", "grad ki", "grad w"), outs[0], one, orig, exact):
        assert bool(torch.isfinite(r).all()), name
        assert math.isfinite(assert_consumer_close(o.float().cpu(), g, r, dtype, what=f"{name} (chunks)")[1])
        assert_consumer_close(c.float().cpu(), g, r, dtype, what=f"{name} (default chunk)")
    if device == "cuda":  # the op's CUDA path is the kernels
        leaves = [t.clone().requires_grad_(True) for t in (qi, ki, w)]
        loss = dense_indexer_kl(q, k, *leaves, scale=scale)
        loss.backward()
        assert torch.equal(loss, one[0])
        for t, g in zip(leaves, one[1:]):
            assert torch.equal(t.grad, g)


def test_kernels_chunked_head_dim():
    """A head dim covered by a masked chunk (24 of 32), Di not a power of two, two backward chunks."""
    check_kernels_at("cpu", torch.float32, S=32, H=2, D=24, Hi=4, Di=20, chunk_rows=16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_moderate_shape(dtype):
    """The compiled kernels at a DSA-like shape (head dim 192 in chunks of 64, Di 128,
    several backward chunks)."""
    check_kernels_at("cuda", dtype, S=640, H=8, D=192, Hi=8, Di=128, chunk_rows=256)


# the configuration before the 8-warp default changed (its fields that remain), and the
# alternatives the benchmark compares
GPU_CONFIGS = [
    dict(dq_heads=1, dq_block_n=0, dk_heads=1, dk_trans=0, dk_block_n=64, dk_head_split=4, lse_block_m=0,
         head_stages=0, grad_stages=0),
    dict(attn_stages=3),
    dict(dq_heads=4, dq_block_m=32, dk_trans=0, dk_heads=2, dk_block_n=64, dk_head_split=4),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fields", range(len(GPU_CONFIGS)))
def test_gpu_launch_configs(fields):
    """The compiled kernels under the benchmark's other configurations (bf16, DSA-like head dims)."""
    check_kernels_at("cuda", torch.bfloat16, S=640, H=8, D=192, Hi=8, Di=128, chunk_rows=256,
                     fields=GPU_CONFIGS[fields])


def test_benchmark_script_runs(tmp_path):
    """benchmarks/bench_indexer_kl.py end to end at a toy shape (its CPU smoke mode)."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_indexer_kl.py"
    spec = importlib.util.spec_from_file_location("bench_indexer_kl", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = ["--device", "cpu", "--seqs", "32", "--heads", "2", "--dim", "16", "--index-heads", "2",
            "--index-dim", "16", "--reps", "1", "--out", str(tmp_path)]
    assert mod.main(args) == 0
    res = json.loads((tmp_path / "bench_indexer_kl.json").read_text())["results"]
    assert [r["call"] for r in res] == ["fwd", "fwd, lse given", "fwd+bwd", "dense original fwd"]
    assert "bitwise yes" in res[2]["note"]
    assert float(res[3]["note"].split()[-1]) < 1e-5
    # configurations side by side: each labelled, the later ones compared with the first
    assert mod.main(args + ["--config", "default;dq_heads=2,dk_heads=2", "--dense-max", "0"]) == 0
    res = json.loads((tmp_path / "bench_indexer_kl.json").read_text())["results"]
    assert [r["call"] for r in res] == [f"{c} [{n}]" for n in ("default", "dq_heads=2,dk_heads=2")
                                        for c in ("fwd", "fwd, lse given", "fwd+bwd")]
    assert "bitwise yes" in res[2]["note"] and "first config" not in res[2]["note"]
    assert float(res[5]["note"].split("first config ")[1].split(";")[0]) < 1e-5
    with pytest.raises(SystemExit):
        mod.main(args + ["--config", "dq_heads=two"])
