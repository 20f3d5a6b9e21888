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
