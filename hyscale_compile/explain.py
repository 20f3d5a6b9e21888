"""``explain(model, *args)``: which top-k sites the backend rewrote, and why not the others."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional

import torch

from .passes import diagnostics
from .passes.diagnostics import AttentionRecord, SiteRecord


@dataclasses.dataclass
class ExplainReport:
    sites: List[SiteRecord]
    graph_breaks: int
    # frames Dynamo gave up on and ran eagerly (e.g. a graph break inside a per-query
    # Python loop): top-k calls in them never reach the backend, so no site lists them
    skipped_frames: List[str] = dataclasses.field(default_factory=list)
    # each consumer of a selection's index mask (passes/attention.py): sparse, with its form,
    # or dense, with the reason
    attention: List[AttentionRecord] = dataclasses.field(default_factory=list)
    # each indexer KL loss beside a selection (passes/indexer_loss.py): at the k slots, or dense with the reason
    losses: List[Any] = dataclasses.field(default_factory=list)
    # what the compiled model returned on that run (compare it with eager without compiling again)
    output: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def rewritten(self) -> List[SiteRecord]:
        """Sites whose ``aten.topk`` was replaced: ``fused`` plus ``table``."""
        return [s for s in self.sites if s.rewritten]

    @property
    def fused(self) -> List[SiteRecord]:
        """Sites that became the fused op (``hyscale.hytopk``): no score table."""
        return [s for s in self.sites if s.rewritten and s.variant != "table"]

    @property
    def table(self) -> List[SiteRecord]:
        """Sites selected from the score table the graph materializes (not fused)."""
        return [s for s in self.sites if s.rewritten and s.variant == "table"]

    @property
    def left_alone(self) -> List[SiteRecord]:
        return [s for s in self.sites if not s.rewritten]

    def __str__(self) -> str:
        head = (
            f"hyscale: {len(self.sites)} top-k site(s): {len(self.fused)} fused, {len(self.table)} selected from "
            f"the table, {len(self.left_alone)} left alone; {self.graph_breaks} graph break(s)"
        )
        lines = [head] + ["  " + s.line() for s in self.sites]
        lines += ["  " + a.line() for a in self.attention]
        lines += ["  " + r.line() for r in self.losses]
        lines += [f"  [not compiled] {f}: Dynamo ran this frame eagerly, so the backend never saw its top-k "
                  "calls (a graph break inside a loop, e.g. a per-query loop)" for f in self.skipped_frames]
        return "\n".join(lines)


def explain(model: Callable, *args: Any, dynamic: Any = None, options: Optional[dict] = None,
            **kwargs: Any) -> ExplainReport:
    """Compile ``model`` with the hyscale pass (debug backend: no Inductor codegen), run it
    once on ``args``/``kwargs``, and report every top-k site it saw (and, as ``output``,
    what that run returned).

    ``options``: what ``torch.compile(..., options=...)`` would get (the ``hyscale.*`` keys
    take effect, e.g. ``{"hyscale.sparse_attention": False}``; Inductor's are accepted and
    ignored), so the report describes the compile you run.

    The model runs under the grad mode you call this in; call it under ``torch.no_grad()``
    to see the inference graph, or with grad enabled to see the training (joint) graph.
    """
    if not callable(model):
        raise TypeError(f"explain: model must be callable (an nn.Module or function), got {type(model).__name__}")
    from .backend import hyscale_debug_backend

    torch._dynamo.reset()
    diagnostics.clear()
    breaks = 0
    counters = torch._dynamo.utils.counters
    before = dict(counters["graph_break"])
    unimpl_before = dict(counters["unimplemented"])
    compiled = torch.compile(model, backend=hyscale_debug_backend, dynamic=dynamic, options=options)
    output = compiled(*args, **kwargs)
    after = counters["graph_break"]
    breaks = sum(after.values()) - sum(before.values())
    skipped = []
    for msg, n in counters["unimplemented"].items():
        if n > unimpl_before.get(msg, 0) and "frame skipped:" in msg:
            skipped.append(msg.split("frame skipped:", 1)[1].splitlines()[0].strip())
    report = ExplainReport(sites=diagnostics.records(), graph_breaks=breaks, skipped_frames=sorted(set(skipped)),
                           attention=diagnostics.attention_records(), output=output,
                           losses=list(diagnostics._losses))
    torch._dynamo.reset()
    return report
