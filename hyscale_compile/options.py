"""Validation of ``torch.compile(..., backend="hyscale"|"hyscale_debug", mode=..., options=...)``.

Inductor keys (nested ones spelled "triton.cudagraphs") must be keys of
``torch._inductor.config`` and their values of the type it declares, as for
``backend="inductor"``; ``hyscale.*`` keys are this backend's own (``HYSCALE_OPTIONS``)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

# This backend's own options (``options={"hyscale.enable": False}``).
HYSCALE_OPTIONS = {
    "enable": (bool, "rewrite selections (default True; False: the graphs compile as plain Inductor's, and "
                     "the diagnostics still record every site, with what the pass would have done)"),
    "capture": (list, "tests: a list that receives the graphs the debug backend ran"),
    "replay": (bool, "save the selection for the backward (default True); False keeps the "
                     "checkpoint policy's tag, so benchmarks can measure what replay saves"),
    "elide_sort": (bool, "call the op with sorted=False where nothing reads the top-k's order (default "
                         "True; the outputs are the same bits either way)"),
    "sparse_attention": (bool, "rewrite the attention that applies a selection's index mask into "
                               "hyscale.sparse_attention over the k selected keys (default True; False keeps it "
                               "dense, and explain says so for each consumer)"),
    "attention_backward": (str, "the sparse attention's CUDA backward: \"deterministic\" (default; bitwise "
                                "reproducible) or \"atomic\" (dK / dV by fp32 atomics: not reproducible, opt-in "
                                "only); carried in each sparse_attention's spec (HYSCALE_ATTN_BWD overrides it at "
                                "run time)"),
}
# options whose value is one of a few strings
_CHOICES = {"attention_backward": ("deterministic", "atomic")}
_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def split_options(mode: Optional[str], options: Optional[Dict[str, Any]]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(Inductor config patches, hyscale options); raises on anything invalid."""
    from torch._inductor import config as inductor_config

    if mode not in _MODES:
        raise ValueError(f"hyscale: unknown mode {mode!r}; expected one of {[m for m in _MODES if m]}")
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"hyscale: options must be a dict, got {type(options).__name__}")
    inductor: Dict[str, Any] = {}
    if mode not in (None, "default"):
        from torch._inductor import list_mode_options

        inductor.update(list_mode_options(mode))
    ours: Dict[str, Any] = {}
    for key, value in (options or {}).items():
        if not isinstance(key, str):
            raise TypeError(f"hyscale: option names must be strings, got {key!r}")
        if key.startswith("hyscale."):
            name = key[len("hyscale.") :]
            if name not in HYSCALE_OPTIONS:
                raise ValueError(f"hyscale: unknown option {key!r}; known: {sorted('hyscale.' + k for k in HYSCALE_OPTIONS)}")
            typ = HYSCALE_OPTIONS[name][0]
            if not isinstance(value, typ):
                raise TypeError(f"hyscale: option {key!r} must be {typ.__name__}, got {type(value).__name__}")
            if name in _CHOICES and value not in _CHOICES[name]:
                raise ValueError(f"hyscale: option {key!r} must be one of {list(_CHOICES[name])}, got {value!r}")
            ours[name] = value
            continue
        name = key.replace("-", "_")
        _check_inductor_option(inductor_config, key, name, value)
        inductor[name] = value
    return inductor, ours


def _check_inductor_option(config, key: str, name: str, value: Any) -> None:
    """``name`` must be a key of Inductor's config (nested ones as "triton.cudagraphs") and
    ``value`` of its declared type, as ``backend="inductor"`` requires."""
    entries = getattr(config, "_config", None)  # key -> entry with its default and declared type
    known = entries if isinstance(entries, dict) else config.get_config_copy()
    if name not in known:
        raise ValueError(f"hyscale: unknown option {key!r} (neither an Inductor config key nor 'hyscale.*')")
    entry = known[name]
    typ = getattr(entry, "value_type", None)
    if typ is None:  # no declared type: the default's (None: anything)
        typ = type(getattr(entry, "default", entry))
    if _accepts(typ, value) is False:
        raise TypeError(f"hyscale: option {key!r} must be {_type_text(typ)}, got {type(value).__name__}")


def _accepts(typ: Any, value: Any) -> Optional[bool]:
    """Whether ``value`` is of the config's declared type; None where that cannot be told
    (callables, forward references, generics' item types): then anything goes. A config
    declared None takes anything; bool and int are told apart."""
    import types
    import typing

    if typ is type(None):
        return None
    origin = typing.get_origin(typ)
    if origin is typing.Union or origin is types.UnionType:
        results = [_accepts(t, value) for t in typing.get_args(typ) if t is not type(None)]
        results += [True] if value is None and type(None) in typing.get_args(typ) else []
        return True if True in results else None if None in results else False
    if origin is typing.Literal:
        return value in typing.get_args(typ)
    if origin is not None:
        typ = origin  # list[str] -> list; the items are not checked
    if not isinstance(typ, type) or typ is object:
        return None
    if typ is bool:
        return isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        return isinstance(value, typ)
    except TypeError:
        return None


def _type_text(typ: Any) -> str:
    import typing

    args = typing.get_args(typ)
    if args and typing.get_origin(typ) is not typing.Literal:
        return " or ".join("None" if a is type(None) else getattr(a, "__name__", str(a)) for a in args)
    return getattr(typ, "__name__", str(typ))
