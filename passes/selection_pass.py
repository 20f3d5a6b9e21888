"""The joint-graph pass: find every ``aten.topk``, rewrite the selections.

Installed as Inductor's ``joint_custom_pre_pass`` (it sees the joint forward+backward
graph in training and the forward graph in inference, before Inductor's own joint
patterns fold masks away) by ``hyscale_compile.backend``, chained with any pass that
was already in the slot. The pass's ``uuid`` hashes its own sources, the op's sources,
the variant registry and its options, so an Inductor cache hit never serves a graph
compiled without it (or with other patterns).
"""
from __future__ import annotations

import hashlib
import os
from typing import Dict, Iterable, Mapping, Optional, Tuple, Union

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import diagnostics, indexer_loss, score_mods, visible_rows
from .canonicalize import GraphFacts, Unsupported, analyse_site, shape_of
from .table_select import argument_operands, linear_operand, score_contraction, select_from_table
from ..lowerings.spec import tile_skipping
from .order import order_unread
from .rewrite import apply_match
from .sparse_backward import rewrite_backward

aten = torch.ops.aten
_HERE = os.path.dirname(os.path.abspath(__file__))
_INT64_MAX = 2**63 - 1


def _source_files():
    import hyscale_compile.lowerings as low

    out = []
    for d in (_HERE, os.path.dirname(low.__file__)):
        out.extend(sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".py")))
    return tuple(out)


def canonicalize_noop_views(graph: fx.Graph) -> None:
    """Spell no-op indexing as views: a full ``slice`` is its input, ``select`` of a size-1
    dim is ``squeeze``. (``x[:, None, :]``, ``mask[:, 0]``.) Values do not change."""
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in (aten.slice.Tensor, aten.select.int):
            continue
        v = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        if not isinstance(v, torch.Tensor):
            continue
        shape = v.shape
        if n.target is aten.slice.Tensor:
            dim, start, end, step = (list(n.args[1:]) + [0, None, None, 1][len(n.args) - 1 :])[:4]
            # (end == 2**63 - 1 is Python's "to the end": under dynamic shapes a size symbol has no
            # upper bound, so ``end >= size`` is not provable for it, but no dim is larger)
            if start in (0, None) and step == 1 and (end is None or (isinstance(end, int) and (
                    end >= _INT64_MAX or statically_known_true(end >= shape[dim])))):
                n.replace_all_uses_with(n.args[0])
                graph.erase_node(n)
        elif n.target is aten.select.int and statically_known_true(shape[n.args[1]] == 1):
            with graph.inserting_before(n):
                sq = graph.call_function(aten.squeeze.dim, (n.args[0], n.args[1]))
            sq.meta = dict(n.meta)
            n.replace_all_uses_with(sq)
            graph.erase_node(n)


def _cudagraphs() -> bool:
    """Whether Inductor will run the compiled graphs as CUDA graphs (mode="reduce-overhead",
    "max-autotune", or ``triton.cudagraphs`` set): read while the compile's config is in force."""
    from torch._inductor import config as inductor_config

    return bool(inductor_config.triton.cudagraphs)


def _host_read_steps(spec) -> list:
    """The spec's steps whose constant the op reads from a 0-d operand on the host at each
    call (``ScoreSpec.resolve_operands``)."""
    return [st[0] for st in (*spec.epilogue, *spec.post) if st[0].endswith("_operand")]


def _on_cuda(tk: fx.Node) -> bool:
    """Whether the top-k's scores live on a GPU (Inductor captures only CUDA graphs)."""
    v = getattr(tk.args[0], "meta", {}).get("val")
    return isinstance(v, torch.Tensor) and v.device.type == "cuda"


InputKinds = Union[Iterable[int], Mapping[int, Tuple[str, str]]]


def _input_kinds(inputs: InputKinds) -> Dict[int, Tuple[str, str]]:
    """Positions -> (kind, source name); a plain list of positions names parameters or buffers."""
    if isinstance(inputs, Mapping):
        return {int(i): (str(k), str(n)) for i, (k, n) in inputs.items()}
    return {int(i): ("parameter", "") for i in inputs}


def rewrite_selections(graph: fx.Graph, param_indices: InputKinds = (), graph_kind: str = "", replay: bool = True,
                       elide_sort: bool = True, cudagraphs: bool = False, dry_run: bool = False,
                       sparse_attention: bool = True, attention_backward: str = "deterministic") -> int:
    """Rewrite every selection top-k in ``graph``; returns how many were rewritten.
    ``param_indices``: what the graph's inputs are, by position (``backend._input_kinds``:
    position -> (kind, Dynamo source name)), or the positions of parameters and buffers.
    ``elide_sort``: pass sorted=False where nothing reads the top-k's order (order.py).
    ``cudagraphs``: the graphs will be captured as CUDA graphs, so no site may become an
    op that reads a device value on the host.
    ``dry_run`` (``hyscale.enable=False``): rewrite a copy and leave ``graph`` as it is; the
    diagnostics record every site as left alone, with what the pass would have done.
    ``attention_backward``: the sparse attention's CUDA backward ("deterministic" or "atomic"),
    set in the spec of every sparse-attention call the rewrite emits."""
    record = diagnostics.record
    if dry_run:
        copy = fx.Graph(owning_module=graph.owning_module)
        copy.output(copy.graph_copy(graph, {}))
        graph = copy

        def record(rec):
            diagnostics.record(rec.disabled())
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    kinds = _input_kinds(param_indices)
    sources = {placeholders[i].name: kn for i, kn in kinds.items() if i < len(placeholders)}
    indexer_loss.rewrite_indexer_losses(graph, sources, graph_kind, sparse_attention, dry_run)  # before the top-ks
    facts = GraphFacts(graph, sources=sources)
    topks = [n for n in graph.nodes if n.op == "call_function" and n.target is aten.topk.default]
    if topks:
        canonicalize_noop_views(graph)
    stand_ins = score_mods.collapse(graph, topks)  # registered mods -> one node each
    count = 0
    for tk in topks:
        line = diagnostics.user_line(tk)
        try:
            m = analyse_site(facts, tk)
            if cudagraphs and _on_cuda(tk) and _host_read_steps(m.spec):
                # a capture would fail on the read (a GPU operand) or freeze its value into
                # the recording (a later value ignored): the table's selection is device ops
                raise Unsupported(f"a 0-d tensor operand of the scores ({', '.join(_host_read_steps(m.spec))}) is "
                                  "read on the host at each call, which a CUDA graph (mode='reduce-overhead' or "
                                  "'max-autotune') cannot capture")
            if m.sorted and elide_sort:  # nothing reads the order: the op may skip its sort
                try:
                    unread, uses = order_unread(tk, m.topk_dim)
                except Exception:  # a bug of ours: keep the sort, rewrite the site anyway
                    diagnostics.log.warning("hyscale: internal error in the order analysis at %s; the sort stays",
                                            tk.name, exc_info=True)
                    unread = False
                if unread:
                    m.sorted, m.sort_elided = False, uses
            applied = apply_match(graph, m, replay=replay)  # rolls its own nodes back if it fails
            visible_rows.record(applied.call, m)  # the attention pass's proof reads the selection's mask
        except Unsupported as e:
            # no query-key score upstream (a router, a sampler): not a selection, and the
            # hint (what a user could register) does not apply
            contraction = score_contraction(facts, tk.args[0])
            scored = contraction is not None
            table = None
            if scored:
                try:
                    table = select_from_table(graph, facts, tk, replay=replay)
                except Exception:  # a bug of ours: the site stays as it was
                    diagnostics.log.warning("hyscale: internal error selecting from the table at %s", tk.name,
                                            exc_info=True)
            reason = str(e) + e.hint if scored else str(e)
            if not scored and not reason.startswith("not a selection"):
                linear = linear_operand(facts, tk.args[0])  # a softmax router: the matcher stops at exp
                if linear is not None:
                    reason = (f"not a selection: the scores come from a contraction with {linear} "
                              "(a router or sampler top-k, not sparse attention)")
            if table is not None:
                count += 1
                args = argument_operands(facts, contraction)
                note = (f"the contraction reads the graph input(s) {', '.join(args)}, taken for activations (not "
                        "parameters, buffers, globals or closure cells: the backend cannot tell a weight passed as "
                        "an argument from keys)") if args else ""
                record(diagnostics.SiteRecord(
                    node=tk.name, source=line, rewritten=True, variant="table", reason=reason, graph=graph_kind,
                    k=tk.args[1], sizes={"T": shape_of(table.args[0])[-1]}, note=note))  # the op reads [..., T]
            else:
                record(diagnostics.SiteRecord(node=tk.name, source=line, rewritten=False, reason=reason,
                                              graph=graph_kind))
            continue
        except Exception as e:  # a bug of ours must not break the user's compile: leave the site
            diagnostics.log.warning("hyscale: internal error at %s, site left alone", tk.name, exc_info=True)
            record(diagnostics.SiteRecord(node=tk.name, source=line, rewritten=False,
                                          reason=f"internal error ({type(e).__name__}: {e}); please report",
                                          graph=graph_kind))
            continue
        count += 1
        backward = ""
        if graph_kind == "joint":
            try:
                backward = rewrite_backward(graph, m, applied)
            except Exception as e:  # the forward rewrite stands; the dense backward stays
                diagnostics.log.warning("hyscale: internal error in the sparse backward at %s", tk.name, exc_info=True)
                backward = f"dense: internal error ({type(e).__name__}: {e}); please report"
        record(
            diagnostics.SiteRecord(
                node=tk.name, source=line, rewritten=True, variant=m.spec.name, k=m.k_arg if not isinstance(m.k_arg, fx.Node) else str(m.k_arg.meta.get("val", m.k_arg)),
                sizes={k: v for k, v in m.sizes.items()}, spec=m.spec.describe(), values_used=m.values_used,
                sorted=m.sorted, sort_elided=m.sort_elided, tiles=tile_skipping(m.spec),
                table_consumers=m.other_consumers, graph=graph_kind, backward=backward,
                note=(f"the key-side operand is the graph input {m.key_argument}, taken for keys (not a parameter, "
                      "buffer, global or closure cell: the backend cannot tell a weight passed as an argument "
                      "from keys)") if m.key_argument else "",
            )
        )
    score_mods.restore(graph, stand_ins)
    if count or topks:
        count += _rewrite_attention(graph, facts.sources, graph_kind, replay, sparse_attention and not dry_run,
                                    "hyscale.enable=False" if dry_run else "hyscale.sparse_attention=False")
        _set_attention_backward(graph, attention_backward)
    visible_rows.forget(graph)
    if dry_run:
        return 0
    if count:
        graph.eliminate_dead_code()
        from torch._inductor.fx_passes.post_grad import stable_topological_sort  # noqa

        stable_topological_sort(graph)
        graph.lint()
    return count


def _rewrite_attention(graph: fx.Graph, sources, graph_kind: str, replay: bool, enabled: bool, off_reason: str) -> int:
    """The attention pass over the selections now in ``graph``; returns how many it rewrote."""
    from .attention import rewrite_attention

    try:
        recs = rewrite_attention(graph, sources, graph_kind, replay=replay, enabled=enabled, off_reason=off_reason)
    except Exception as e:  # a bug of ours must not break the user's compile: the attention stays dense
        diagnostics.log.warning("hyscale: internal error in the attention pass; attention left dense", exc_info=True)
        recs = [diagnostics.AttentionRecord("?", "?", False, f"internal error ({type(e).__name__}: {e}); please "
                                            "report")]
    for rec in recs:
        rec.graph = graph_kind
        diagnostics.record_attention(rec)
    return sum(r.rewritten for r in recs)


def _set_attention_backward(graph: fx.Graph, mode: str) -> None:
    """``hyscale.attention_backward`` into the spec of every sparse-attention forward and
    backward call in ``graph`` (both read it: the forward's spec is what a replayed backward
    gets), so the choice is fixed at compile time and shows in the graph."""
    if mode == "deterministic":
        return
    import dataclasses

    from ..lowerings.attention_spec import AttentionSpec

    ops = (torch.ops.hyscale.sparse_attention.default, torch.ops.hyscale.sparse_attention_backward.default)
    for n in graph.nodes:
        if n.op == "call_function" and n.target in ops:
            i = next(j for j, a in enumerate(n.args) if isinstance(a, str))  # the spec: the op's one string
            spec = dataclasses.replace(AttentionSpec.from_json(n.args[i]), backward=mode)
            n.args = n.args[:i] + (spec.to_json(),) + n.args[i + 1:]


class HyScaleJointPass(CustomGraphPass):
    """The selection rewrite as an Inductor custom graph pass (chains a prior pass)."""

    def __init__(self, param_indices: InputKinds = (), chained: Optional[CustomGraphPass] = None, options=None):
        self.param_indices = tuple(sorted(_input_kinds(param_indices).items()))
        self.chained = chained
        self.options = dict(options or {})

    def __call__(self, graph: fx.Graph) -> None:
        joint = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
        kind = "joint" if joint else "forward"
        enable = self.options.get("enable", True)
        try:
            rewrite_selections(graph, dict(self.param_indices), kind, replay=self.options.get("replay", True),
                               elide_sort=self.options.get("elide_sort", True), cudagraphs=_cudagraphs(),
                               dry_run=not enable, sparse_attention=self.options.get("sparse_attention", True),
                               attention_backward=self.options.get("attention_backward", "deterministic"))
        except Exception:
            if enable:
                raise
            # diagnostics only: a failure must not break the user's (plain) compile
            diagnostics.log.warning("hyscale: internal error recording diagnostics with hyscale.enable=False",
                                    exc_info=True)
        if self.chained is not None:
            self.chained(graph)

    def uuid(self) -> bytes:
        from hyscale_compile import registry

        extra = repr((self.param_indices, sorted(self.options.items()), registry.fingerprint(), _cudagraphs()))
        h = hashlib.sha256(get_hash_for_files(_source_files(), extra))
        if self.chained is not None:
            uuid_fn = getattr(self.chained, "uuid", None)
            inner = uuid_fn() if callable(uuid_fn) else None
            if inner is None:
                return None  # the chained pass opts out of caching: so do we
            h.update(inner if isinstance(inner, bytes) else repr(inner).encode())
        return h.digest()
