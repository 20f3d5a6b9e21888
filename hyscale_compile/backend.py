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

from typing import Any, Dict, Optional, Tuple

import torch
import torch.fx as fx

from .options import split_options

__all__ = ["hyscale_backend", "hyscale_debug_backend"]


def _input_kinds(gm: fx.GraphModule, example_inputs) -> Dict[int, Tuple[str, str]]:
    """What each of AOTAutograd's flat inputs is, by position: ``(kind, source name)``, the
    kind one of ``passes.canonicalize.CONSTANT_KINDS`` ("parameter", "global", "closure")
    or "input" (an argument of the compiled frame, or a source we do not recognize: an
    activation, as far as the pass can tell).

    AOTAutograd puts the module's own parameters and buffers first, then the graph's
    placeholders in order; Dynamo records where each placeholder came from in its
    ``grapharg`` source."""
    own = len(list(gm.named_parameters(remove_duplicate=False))) + len(list(gm.named_buffers(remove_duplicate=False)))
    out = {i: ("parameter", "") for i in range(own)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(placeholders):
        ex = example_inputs[i] if i < len(example_inputs) else None
        src = getattr(n.meta.get("grapharg"), "source", None)
        kind = "parameter" if isinstance(ex, torch.nn.Parameter) else _source_kind(src)
        out[own + i] = (kind, _source_name(src))
    return out


def _source_name(src) -> str:
    if src is None:
        return ""
    try:
        name = src.name() if callable(getattr(src, "name", None)) else getattr(src, "name", "")  # a method before 2.12
        return name if isinstance(name, str) else ""
    except Exception:  # a source without a name (NotImplementedError on some kinds)
        return ""


def _source_kind(src) -> str:
    """"parameter" (a parameter or buffer of an nn.Module), "closure" (a closure cell's
    contents), "global" (reached from a module-level global), else "input"."""
    if src is None:
        return "input"
    try:
        from torch._dynamo import source as ds
    except ImportError:
        return "input"
    name = _source_name(src)
    try:
        if ds.is_from_unspecialized_param_buffer_source(src) or isinstance(src, ds.ParamBufferSource):
            return "parameter"
    except (AttributeError, TypeError):
        pass
    if "._parameters[" in name or "._buffers[" in name or ".parameters[" in name or ".buffers[" in name:
        return "parameter"
    chain = []
    while src is not None:
        chain.append(src)
        src = getattr(src, "base", None)  # ChainedSource: from the accessed value back to its root
    root = chain[-1]
    # ClosureSource (fn.__closure__) and CellContentsSource are not in every torch version
    closure = tuple(c for c in (getattr(ds, "ClosureSource", None), getattr(ds, "CellContentsSource", None)) if c)
    if any(isinstance(s, closure) or getattr(s, "member", None) in ("cell_contents", "__closure__") for s in chain):
        return "closure"
    # the root frame's free variables: Dynamo reads them as locals it dereferences
    if (isinstance(root, ds.LocalSource) and getattr(root, "is_derefed_cell_contents", False)
            and not getattr(root, "is_input", True)):
        return "closure"
    if isinstance(root, (ds.GlobalSource, getattr(ds, "GlobalWeakRefSource", ds.GlobalSource))):
        return "global"
    return "input"


def _make_pass(gm, example_inputs, hy_opts, chained=None):
    from .passes.selection_pass import HyScaleJointPass

    return HyScaleJointPass(_input_kinds(gm, example_inputs), chained=chained, options=hy_opts)


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
