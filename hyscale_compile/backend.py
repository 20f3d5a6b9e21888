"""``backend="hyscale"``: Inductor plus the selection rewrite.

``hyscale_backend`` is what the ``torch_dynamo_backends`` entry point names (it is not
decorated with ``register_backend``: the entry point registers it, and a second
registration would raise 'duplicate name'). It calls Inductor's ``compile_fx`` with the
selection pass installed in ``joint_custom_pre_pass``, chained after whatever pass a user
or another library had put there, and otherwise leaves Inductor's config alone.

``hyscale_debug_backend`` runs the same pass and the same min-cut partitioner through
AOTAutograd but executes the graphs eagerly (no Inductor codegen): a small graph
compiles in 0.3-2 s on a 2-core CPU instead of 10-40 s, for tests and ``explain``. Both
check ``options`` the same way (``options.split_options``); Inductor keys have no effect on
the debug backend.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx

from .options import split_options

__all__ = ["hyscale_backend", "hyscale_debug_backend"]


def _param_indices(gm: fx.GraphModule, example_inputs) -> List[int]:
    """Positions, among AOTAutograd's flat inputs, of parameters and buffers.

    AOTAutograd puts the module's own parameters and buffers first, then the graph's
    placeholders in order (Dynamo lifts nn.Module parameters to placeholders, whose
    ``grapharg`` source says where they came from)."""
    own = len(list(gm.named_parameters(remove_duplicate=False))) + len(list(gm.named_buffers(remove_duplicate=False)))
    out = list(range(own))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(placeholders):
        ex = example_inputs[i] if i < len(example_inputs) else None
        if isinstance(ex, torch.nn.Parameter) or _is_param_source(n):
            out.append(own + i)
    return out


def _is_param_source(n: fx.Node) -> bool:
    ga = n.meta.get("grapharg")
    src = getattr(ga, "source", None)
    if src is None:
        return False
    try:
        from torch._dynamo.source import is_from_unspecialized_param_buffer_source

        if is_from_unspecialized_param_buffer_source(src):
            return True
    except ImportError:
        pass
    name = src.name() if callable(getattr(src, "name", None)) else str(getattr(src, "name", ""))
    return "._parameters[" in name or "._buffers[" in name or ".parameters[" in name or ".buffers[" in name


def _make_pass(gm, example_inputs, hy_opts, chained=None):
    from .passes.selection_pass import HyScaleJointPass

    return HyScaleJointPass(_param_indices(gm, example_inputs), chained=chained, options=hy_opts)


def hyscale_backend(gm: fx.GraphModule, example_inputs, *, mode: Optional[str] = None, options: Optional[Dict[str, Any]] = None):
    """The ``torch.compile`` backend. ``options`` takes Inductor config keys (as
    ``backend="inductor"`` does) and this backend's own keys prefixed ``hyscale.``."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    inductor_opts, hy_opts = split_options(mode, options)
    from .passes.partition import HyScalePartitioner

    prior = inductor_opts.pop("joint_custom_pre_pass", inductor_config.joint_custom_pre_pass)
    prior_partitioner = inductor_opts.pop("custom_partitioner_fn", inductor_config.custom_partitioner_fn)
    joint_pass = _make_pass(gm, example_inputs, hy_opts, chained=prior)
    patches = {
        **inductor_opts,
        "joint_custom_pre_pass": joint_pass,
        "custom_partitioner_fn": HyScalePartitioner(chained=prior_partitioner),
    }
    return compile_fx(gm, example_inputs, config_patches=patches)


def hyscale_debug_backend(gm: fx.GraphModule, example_inputs, *, mode=None, options=None):
    """Same pass and partitioner as ``hyscale``, graphs run eagerly (tests, explain).

    ``options`` is checked as ``hyscale``'s is: unknown or mistyped keys raise. Valid
    Inductor keys are accepted and have no effect here (there is no Inductor codegen), so a
    model's ``options`` work with either backend."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    import torch._inductor.lowering  # noqa: F401  (some of select_decomp_table's entries need it loaded)
    from torch._inductor.decomposition import select_decomp_table

    _, hy_opts = split_options(mode, options)
    joint_pass = _make_pass(gm, example_inputs, hy_opts)
    captured = hy_opts.get("capture")  # tests: a list that receives (kind, GraphModule)

    def run_pass(g: fx.GraphModule, kind: str):
        if captured is not None:
            from .testing import graph_text

            captured.append((kind + ":before", graph_text(g.graph)))
        joint_pass(g.graph)
        g.graph.eliminate_dead_code()
        g.recompile()
        if captured is not None:
            captured.append((kind, g))

    from .passes.partition import HyScalePartitioner

    partitioner = HyScalePartitioner()

    def partition(joint, joint_inputs, **kw):
        run_pass(joint, "joint")
        fw, bw = partitioner(joint, joint_inputs, **kw)
        if captured is not None:
            captured.append(("forward", fw))
            captured.append(("backward", bw))
        return fw, bw

    def inference(g, ex):
        run_pass(g, "inference")
        return make_boxed_func(g.forward)

    return aot_autograd(
        fw_compiler=lambda g, ex: make_boxed_func(g.forward),
        bw_compiler=lambda g, ex: make_boxed_func(g.forward),
        inference_compiler=inference,
        partition_fn=partition,
        decompositions=select_decomp_table(),
        keep_inference_input_mutations=True,
    )(gm, example_inputs)
