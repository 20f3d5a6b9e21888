"""Validation of ``torch.compile(..., backend="hyscale", mode=..., options=...)``."""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

# This backend's own options (``options={"hyscale.enable": False}``).
HYSCALE_OPTIONS = {
    "enable": (bool, "rewrite selections (False: plain Inductor, diagnostics still recorded)"),
    "capture": (list, "tests: a list that receives the graphs the debug backend ran"),
    "replay": (bool, "save the selection for the backward (default True); False keeps the "
                     "checkpoint policy's tag, so benchmarks can measure what replay saves"),
    "elide_sort": (bool, "call the op with sorted=False where nothing reads the top-k's order (default "
                         "True; the outputs are the same bits either way)"),
}
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
            ours[name] = value
            continue
        if not hasattr(inductor_config, key.replace("-", "_")) and "." not in key:
            raise ValueError(f"hyscale: unknown option {key!r} (neither an Inductor config key nor 'hyscale.*')")
        inductor[key.replace("-", "_")] = value
    return inductor, ours
