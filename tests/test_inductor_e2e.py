"""The named set of full Inductor compiles (slow on a CPU: ~15-40 s each).

Everything else tests the pass through the debug backend; these check that with
``backend="hyscale"`` the compiled code really calls ``torch.ops.hyscale`` for every
selection, keeps ``aten.topk`` for every other top-k, and matches eager."""
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from tests.contract import fresh_seed
from tests.models import hf_models
from tests.models.dsa_forms import FORMS
from tests.test_canonicalize import _as_tuple, assert_same_outputs

pytestmark = pytest.mark.inductor


def compiled_code(fn, *args, options=None):
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(fn, backend="hyscale", options=options), *args)
    return out, "\n".join(code)


# (a selection beside a MoE router's top-k, which must stay aten.topk in the generated code:
# the HF DeepSeek-V3.2 model below has both, its three router top-k counted)
@pytest.mark.parametrize("name", ["v4_official_einsum_triu", "hf_v32_nograd_bool_bf16", "megatron_sbhd_values_minus_one",
                                  "kernel_ref_mhd_nd_range", "hf_v4_position_ids_threshold"])
def test_forms_through_inductor(name):
    case = FORMS[name](fresh_seed(name) % 1000)
    with torch.no_grad():
        # the selection's rewrite alone (exact); a rewritten attention consumer has its own
        # numerics rule (tests/test_attention_pass.py::test_inductor_end_to_end)
        out, code = compiled_code(case.fn, *case.args, options={"hyscale.sparse_attention": False})
        ref = case.fn(*case.args)
        if any(o.dtype in (torch.bfloat16, torch.float16) for o in _as_tuple(ref)):
            # Inductor itself rounds low-precision math differently from eager: compare
            # with what the default backend gives for the same graph
            torch._dynamo.reset()
            ref = torch.compile(case.fn, backend="inductor")(*case.args)
        assert_same_outputs(out, ref)
    assert code_count(code, HYTOPK_CALL) == case.num_selections, code
    assert code_count(code, TOPK_CALL) == case.num_other_topk


@pytest.mark.skipif(not hf_models.transformers_available(), reason="transformers==5.24.0 not installed")
# glm_moe_dsa is deepseek_v32's indexer with interleaved RoPE on q and k: it only changes
# the producers of the op's operands (plain Inductor code); test_hf_models.py checks its
# rewrite and logits with the debug backend. So for deepseek_v4: its indexer (the runtime
# position_ids threshold an operand of the op) goes through Inductor as the form
# hf_v4_position_ids_threshold above; the rest of the model (compressor, hyper-connections,
# hash MoE) is plain Inductor code, its rewrite and logits test_hf_models.py's
@pytest.mark.parametrize("name", ["deepseek_v32"])
def test_hf_models_through_inductor(name):
    model, kwargs = hf_models.BUILDERS[name](fresh_seed(name) % 8)
    sel, other = hf_models.EXPECTED_TOPK[name]
    with torch.no_grad():
        ref = model(**kwargs).logits
        torch._dynamo.reset()
        out, code = run_and_get_code(torch.compile(model, backend="hyscale"), **kwargs)
    assert code_count(code, HYTOPK_CALL) == sel
    assert code_count(code, TOPK_CALL) == other
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=1e-5)


HYTOPK_CALL = r"= torch\.ops\.hyscale\.hytopk(_values)?\.default\("
TOPK_CALL = r"= torch\.ops\.aten\.topk\.default\("


def code_count(code, pattern):
    """Calls (not the size asserts that name the op) in the generated code."""
    return len(re.findall(pattern, code if isinstance(code, str) else "\n".join(code)))


def test_training_step_through_inductor():
    case = FORMS["hf_v32_grad_additive_finfo"](fresh_seed("train") % 1000)

    def run(fn):
        args = [a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in case.args]
        out = _as_tuple(fn(*args))
        sum(o.float().sum() for o in out if o.is_floating_point()).backward()
        grads = [a.grad for a in args if isinstance(a, torch.Tensor) and a.grad is not None]
        grads += [p.grad.clone() for p in case.fn.parameters() if p.grad is not None]
        case.fn.zero_grad()
        return out, grads

    ref_out, ref_grads = run(case.fn)
    torch._dynamo.reset()
    out, grads = run(torch.compile(case.fn, backend="hyscale"))
    assert_same_outputs(out, ref_out)
    assert len(grads) == len(ref_grads) > 0
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_sparse_backward_through_inductor():
    """Differentiable top-k values under Inductor: the backward kernel code calls the
    sparse backward op and no selection; gradients equal eager."""
    from tests.test_sparse_backward import GatedSelect, S2, E, _grads

    torch.manual_seed(fresh_seed("sparse_bwd_inductor"))
    model, x0 = GatedSelect(), torch.randn(2, S2, E)
    run = lambda m, x: m(x)
    want = _grads(model, run, x0)
    torch._dynamo.reset()
    compiled = torch.compile(run, backend="hyscale")
    got, code = run_and_get_code(lambda: _grads(model, compiled, x0))
    # one forward and one backward module: one selection, one sparse backward, no other selection
    assert len(code) == 2
    assert code_count(code[0], r"torch\.ops\.hyscale\.hytopk_values\.default\(") == 1
    assert code_count(code[1], r"torch\.ops\.hyscale\.hytopk_values_backward\.default\(") == 1
    assert code_count(code[1], r"torch\.ops\.hyscale\.hytopk_values\.default\(|aten\.topk") == 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
