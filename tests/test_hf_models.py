"""The public Hugging Face DSA-family model classes (transformers 5.24) at tiny random
configurations: every indexer selection is rewritten as a whole (all indexer heads in
the op, no score table left behind), every MoE router top-k is left alone, and logits
equal eager. Debug backend; tests/test_inductor_e2e.py runs them through Inductor."""
import pytest
import torch

import hyscale_compile
from tests.contract import fresh_seed
from tests.models import hf_models

pytestmark = pytest.mark.skipif(not hf_models.transformers_available(), reason="transformers==5.24.0 not installed")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(hf_models.BUILDERS))
def test_hf_model_rewritten_and_equal(name, attn):
    if name == "deepseek_v4" and attn == "sdpa":
        pytest.skip("DeepSeek-V4 ships eager attention only")
    extra = {} if name == "deepseek_v4" else {"attn_implementation": attn}
    model, kwargs = hf_models.BUILDERS[name](fresh_seed(name) % 8, **extra)
    sel, other = hf_models.EXPECTED_TOPK[name]
    with torch.no_grad():
        report = hyscale_compile.explain(model, **kwargs)
        assert len(report.rewritten) == sel and len(report.left_alone) == other, str(report)
        for site in report.rewritten:
            assert site.variant == "dsa" and site.sizes["H"] == model.config.index_n_heads, site.line()
            assert not site.table_consumers, site.line()
        for site in report.left_alone:
            assert any(why in site.reason for why in (
                "not a selection", "no contraction", "the walk back from the top-k stopped at")), site.line()
        ref = model(**kwargs).logits
    # explain compiled the model with the debug backend and ran it: its logits are the rewrite's
    torch.testing.assert_close(report.output.logits, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_hf_causal_mask_becomes_key_ranges(name):
    """HF's mask builder (masking_utils: ``kv_idx <= q_idx`` on the cache positions, and the
    packed-sequence test ``doc[q] == doc[kv]`` on a cumsum of position jumps) reaches the
    indexer as a [B, S, T] float mask. Both comparisons are key ranges: the causal one a
    per-row bound, the document one a run of equal ids in a non-decreasing row (bounds by
    ``searchsorted``). The op must get ranges, not the [B, S, T] tensor, so that nothing of
    size S x T stays behind for the selection; and the model's output is unchanged."""
    model, kwargs = hf_models.BUILDERS[name](fresh_seed(name) % 8, attn_implementation="eager")
    with torch.no_grad():
        report = hyscale_compile.explain(model, **kwargs)
        assert report.rewritten, str(report)
        for site in report.rewritten:
            assert "mask:range" in site.spec and "mask:add" not in site.spec, site.line()
        ref = model(**kwargs).logits
    torch.testing.assert_close(report.output.logits, ref, atol=1e-5, rtol=1e-5)


def test_hf_packed_sequences_keep_documents_apart():
    """position_ids that restart (two packed documents per row): HF then compares the
    *positions* (``pos[b, kv] <= pos[b, q]``), which are not an arange, so the mask stays a
    tensor operand of the op (a known limit: within a document the positions rise by one per
    key, which would make it a range too); the site is still rewritten and the output equals
    eager."""
    model, kwargs = hf_models.BUILDERS["deepseek_v32"](fresh_seed("packed") % 8, attn_implementation="eager")
    S = kwargs["input_ids"].shape[1]
    cut = S // 2 - 3
    pos = torch.cat([torch.arange(cut), torch.arange(S - cut)]).expand(kwargs["input_ids"].shape[0], S)
    kwargs = dict(kwargs, position_ids=pos.contiguous())
    with torch.no_grad():
        report = hyscale_compile.explain(model, **kwargs)
        assert report.rewritten and all(site.variant == "dsa" for site in report.rewritten), str(report)
        ref = model(**kwargs).logits
    torch.testing.assert_close(report.output.logits, ref, atol=1e-5, rtol=1e-5)
