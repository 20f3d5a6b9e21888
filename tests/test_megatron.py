"""Megatron-Core's own DSA indexer (megatron-core==0.16.1, ``DSAIndexer`` / ``DSAttention`` built
from their module specs, on the CPU; tests/models/megatron_dsa.py): its top-k
(``forward_with_scores``, dsa.py:611) is fused, whatever its Hadamard rotation of q and k is: a
plain traced matmul (by a matrix built in the graph, or a global), an opaque custom op, or a graph
break (the CUDA extension). The selection passes the threshold check against a float64 reference
of the scores, and ``DSAttention``'s output equals eager. Debug backend."""
import pytest
import torch

megatron_core = pytest.importorskip("megatron.core")

# Dynamo traces through Megatron's own lru_cache-wrapped helpers and says so once per call
# site: a notice about Megatron's code, not ours
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`-wrapped function")

import hyscale_compile  # noqa: E402
from hyscale_compile.lowerings.spec import MaskTerm, ScoreSpec  # noqa: E402
from tests.contract import check_selection, fresh_seed, tolerance  # noqa: E402
from tests.models import megatron_dsa as M  # noqa: E402

SPEC = ScoreSpec(epilogue=(("relu",),), post=(("mask", 0),), masks=(MaskTerm("range", hi=0),))


def _decomposed(fn):
    """``fn`` through AOTAutograd with the debug backend's (Inductor's) decompositions and no
    pass: they change bf16 rounding of the attention at a few elements, so the rewrite's
    output is compared bitwise with this, not with eager."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    import torch._inductor.lowering  # noqa: F401  (select_decomp_table needs it loaded)
    from torch._inductor.decomposition import select_decomp_table

    torch._dynamo.reset()
    return torch.compile(fn, backend=aot_autograd(fw_compiler=lambda g, ex: make_boxed_func(g.forward),
                                                  decompositions=select_decomp_table()))


@pytest.fixture(scope="module")
def megatron_cpu():
    with M.parallel_state_1x1(), M.cpu_current_device():
        yield


def _reference(q, w, k, mask):
    """float64 scores of the eager indexer's own (rotated) operands, and the per-row tolerance."""
    s = torch.einsum("sbhd,tbd->sbht", q.double(), k.double()).relu() * w.double().unsqueeze(-1)
    ref = s.sum(2).transpose(0, 1) + mask.double()
    qb, wb, kb = q.permute(1, 0, 2, 3), w.permute(1, 0, 2), k.permute(1, 0, 2).unsqueeze(2)
    return ref, tolerance(qb, kb, wb, SPEC)


def _draw(label, B, S):
    """A model and inputs whose indexer selection is unique (no tie within tol at the k-th key)."""
    base = fresh_seed(label) % 10_000
    for attempt in range(20):
        seed = base + 7919 * attempt
        att, args = M.build(seed, B=B, S=S)
        x, qr = args[4], args[5]
        with torch.no_grad():
            _, _, q, w, k = M.index_inputs(att.indexer, x, qr, M.causal_mask(S))
        ref, tol = _reference(q, w, k, M.causal_mask(S))
        top = ref.sort(-1, descending=True).values
        kth, nxt = top[..., M.TOPK - 1], top[..., M.TOPK]
        finite = nxt > float("-inf")
        if bool(((kth - nxt)[finite] > 2 * tol[finite]).all()):
            return att, args, (q, w, k, ref, tol)
    raise AssertionError(f"{label}: no draw with a unique selection")


# B=1: the key axis reaches the traced key rotation's matmul ([S*1, D] rows); B=2: it does not
@pytest.mark.parametrize("rotation, B", [("matmul", 1), ("matmul", 2), ("matmul_global", 1), ("custom_op", 1),
                                         ("graph_break", 1), ("graph_break", 2)])
def test_megatron_indexer_is_fused(megatron_cpu, rotation, B):
    from megatron.core.transformer.enums import AttnMaskType

    S = 32
    with M.use_rotation(rotation), torch.no_grad():
        att, args, (q, w, k, ref, tol) = _draw(f"megatron {rotation} B={B}", B, S)
        x, qr, mask = args[4], args[5], M.causal_mask(S)
        report = hyscale_compile.explain(att.indexer.forward_with_scores, x, qr, mask)
        (site,) = report.sites
        assert site.rewritten and site.variant == "dsa", f"{rotation}: {site.line()}"
        assert site.sizes == {"B": B, "S": S, "H": M.H, "D": M.D, "T": S}, site.line()
        scores, idx = report.output  # (explain ran the debug backend's compile)
        check_selection(idx, ref, tol, M.TOPK)

        # the whole attention: the selection feeds the sparse attention's index mask
        want = _decomposed(att)(*args, attn_mask_type=AttnMaskType.causal)
        torch.testing.assert_close(want, att(*args, attn_mask_type=AttnMaskType.causal), atol=0.05, rtol=0.05)
        report = hyscale_compile.explain(att, *args, attn_mask_type=AttnMaskType.causal)
        (site,) = report.sites
        assert site.rewritten and site.variant == "dsa", f"{rotation}: {site.line()}"
        got = report.output
    torch.testing.assert_close(got, want, atol=0, rtol=0)
