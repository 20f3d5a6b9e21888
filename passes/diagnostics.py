"""What the pass did at each top-k site, for ``hyscale_compile.explain`` and the logs.

Every ``aten.topk`` the pass sees gets one ``SiteRecord``: rewritten (with the variant,
sizes, k and the score description) or left alone (with the reason). Records go to an
in-process list that ``explain`` reads, to ``torch._dynamo.utils.counters["hyscale"]``,
and to the ``hyscale_compile`` logger.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Dict, List, Optional

from torch._dynamo.utils import counters

log = logging.getLogger("hyscale_compile")

_lock = threading.Lock()
_records: List["SiteRecord"] = []


@dataclasses.dataclass
class SiteRecord:
    node: str  # the aten.topk node's name in its graph
    source: str  # the user line that called topk, if known
    rewritten: bool
    reason: str = ""  # why not, when not rewritten (for variant "table": why not fused)
    variant: str = ""
    k: Any = None
    sizes: Dict[str, Any] = dataclasses.field(default_factory=dict)
    spec: str = ""  # ScoreSpec.describe()
    values_used: bool = False
    sorted: bool = True  # the op's flag (False: it skips its final sort)
    # topk(sorted=True) whose order nothing reads (passes/order.py): the ops its outputs
    # end in; the op was then called with sorted=False
    sort_elided: str = ""
    tiles: str = ""  # how the kernel treats key tiles the mask hides (spec.tile_skipping)
    table_consumers: List[str] = dataclasses.field(default_factory=list)
    graph: str = ""  # "forward"/"joint"/"inference"
    # joint graphs whose top-k values carry gradient: "sparse" (at the k selected keys) or
    # "dense: <why>" (the original backward, which rebuilds the score table); else ""
    backward: str = ""
    # what the site's classification could not establish (a weight passed as an argument
    # cannot be told from keys passed as one)
    note: str = ""

    def line(self) -> str:
        where = f" at {self.source}" if self.source else ""
        tag, body = self._outcome()
        return f"{tag} {self.node}{where}: {body}"

    def _outcome(self):
        """(tag, what happened): '[rewritten]', 'dsa k=8 ...'."""
        if self.rewritten and self.variant == "table":
            note = f"; note: {self.note}" if self.note else ""
            return ("[rewritten: table]", f"selected from the materialized score table "
                    f"(hyscale.topk_table, k={self.k}){note}; not fused because: {self.reason}")
        if self.rewritten:
            sz = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
            extra = f"; table still materialized by {', '.join(self.table_consumers)}" if self.table_consumers else ""
            vals = " (values used)" if self.values_used else ""
            if self.sort_elided:
                vals += f" (unsorted: nothing reads the order; its uses end in {self.sort_elided})"
            elif not self.sorted:
                vals += " (unsorted)"
            if self.note:
                vals += f"; note: {self.note}"
            if self.tiles:
                extra += f"; {self.tiles}"
            if self.backward == "sparse":
                extra += "; backward: sparse, at the k selected keys"
            elif self.backward:
                extra += f"; backward: {self.backward} (the score table is rebuilt for it)"
            return "[rewritten]", f"{self.variant} k={self.k} {sz}{vals} | {self.spec}{extra}"
        return "[left alone]", self.reason

    def disabled(self) -> "SiteRecord":
        """This site as the pass reports it under ``hyscale.enable=False``: left alone, with
        what the pass would have done."""
        if not self.rewritten:
            return self
        tag, body = self._outcome()
        return SiteRecord(node=self.node, source=self.source, rewritten=False, graph=self.graph,
                          reason=f"hyscale.enable=False; enabled, the pass would give: {tag} {body}")


@dataclasses.dataclass
class AttentionRecord:
    """One consumer of a selection's index mask (``passes/attention.py``): rewritten into
    ``hyscale.sparse_attention`` (with its form) or left dense (with the reason)."""

    selection: str  # the selection's index node
    consumer: str  # the value contraction, or the node that applies the index mask
    rewritten: bool
    reason: str = ""
    form: str = ""  # "per_head" or "mqa" (attention_spec.form_of)
    spec: str = ""  # AttentionSpec.describe()
    sizes: Dict[str, Any] = dataclasses.field(default_factory=dict)
    backward: str = ""  # joint graphs: "sparse" or ""
    # which implementation the sparse backward runs on CUDA (the Triton kernels, or why not)
    backward_impl: str = ""
    graph: str = ""
    # the order the op reads the indices in (passes/order.py)
    order: str = "any deterministic order (the selection may stay unsorted)"
    # an index mask that hides with a finite value: what passes/visible_rows.py proved
    rows: str = ""
    # how the index mask was built, where passes/index_mask.py folded its build into one scatter
    index_mask: str = ""

    def line(self) -> str:
        if self.rewritten:
            sz = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
            bw = "; backward: sparse_attention_backward" if self.backward == "sparse" else ""
            if bw and self.backward_impl:
                bw += f" ({self.backward_impl})"
            return (f"[attention: sparse] {self.consumer} (indices of {self.selection}): form {self.form} {sz} | "
                    f"{self.spec}{bw}; index order: {self.order}" + (f"; {self.rows}" if self.rows else "")
                    + (f"; {self.index_mask}" if self.index_mask else ""))
        return (f"[attention: dense] {self.consumer} (indices of {self.selection}): {self.reason}"
                + (f"; {self.index_mask}" if self.index_mask else ""))


_attention: List[AttentionRecord] = []
_losses: List[Any] = []  # indexer_loss.LossRecord: the indexer's KL losses (passes/indexer_loss.py)


def record_attention(rec: AttentionRecord) -> None:
    with _lock:
        _attention.append(rec)
    counters["hyscale"]["attention_sparse" if rec.rewritten else "attention_dense"] += 1
    log.info("hyscale: %s", rec.line())


def attention_records() -> List[AttentionRecord]:
    with _lock:
        return list(_attention)


def record(rec: SiteRecord) -> None:
    with _lock:
        _records.append(rec)
    counters["hyscale"]["topk_sites"] += 1
    if rec.rewritten:
        counters["hyscale"]["rewritten"] += 1
        counters["hyscale"][f"rewritten:{rec.variant}"] += 1
        if rec.backward:
            counters["hyscale"]["backward:" + rec.backward.split(":")[0]] += 1
    else:
        counters["hyscale"]["left_alone"] += 1
        counters["hyscale"][f"left_alone:{rec.reason}"] += 1
    log.info("hyscale: %s", rec.line())


def records() -> List[SiteRecord]:
    with _lock:
        return list(_records)


def clear() -> None:
    with _lock:
        _records.clear()
        _attention.clear()
        _losses.clear()


def user_line(node) -> str:
    """The last frame of the node's stack trace: 'file:line in fn'."""
    st: Optional[str] = node.meta.get("stack_trace")
    if not st:
        return ""
    lines = [l.strip() for l in st.strip().splitlines() if l.strip().startswith("File")]
    if not lines:
        return ""
    last = lines[-1]  # 'File "x.py", line 12, in fn'
    try:
        f = last.split('"')[1].rsplit("/", 1)[-1]
        ln = last.split("line ")[1].split(",")[0]
        fn = last.rsplit("in ", 1)[1]
        return f"{f}:{ln} in {fn}"
    except IndexError:
        return last
