"""hyscale_compile: ``torch.compile(model, backend="hyscale")`` for learned sparse attention.

Public API:
    hyscale_backend / hyscale_debug_backend   the backends ("hyscale", "hyscale_debug")
    explain(model, *args, **kwargs)           which top-k sites were rewritten, and why not
    register_score_mod(name, fn)              teach the matcher an elementwise function of
                                              the score (registry.py); unregister_score_mod,
                                              registered_score_mods, ScoreModError
    ScoreSpec, MaskTerm                       the score description the op carries
    hyscale_compile.testing                   assert_selection_equal (compare a selection
                                              by the contract, not torch.equal), stable_topk

The op itself is ``torch.ops.hyscale.hytopk`` / ``hytopk_values`` (importing this
package registers it; so does the backend).
"""
import importlib.util as _ilu
import os as _os
import sys as _sys

# ``passes/`` and ``lowerings/`` live at the repository root and install as
# ``hyscale_compile.passes`` / ``hyscale_compile.lowerings`` (setuptools package-dir). Run
# from a source checkout (the tests, the benchmarks), load the checkout's two as those
# subpackages; only those two: putting the root on __path__ would make the rest of the
# checkout (tests/, this directory again) importable under hyscale_compile.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if all(_os.path.isfile(_os.path.join(_root, *p)) for p in (("pyproject.toml",), ("passes", "__init__.py"), ("lowerings", "__init__.py"))):
    _subs = [s for s in ("lowerings", "passes") if f"{__name__}.{s}" not in _sys.modules]
    _specs = {s: _ilu.spec_from_file_location(f"{__name__}.{s}", _os.path.join(_root, s, "__init__.py"),
                                              submodule_search_locations=[_os.path.join(_root, s)]) for s in _subs}
    for _s, _spec in _specs.items():  # both in sys.modules before either runs, as for any import cycle
        _sys.modules[_spec.name] = globals()[_s] = _ilu.module_from_spec(_spec)
    try:
        for _spec in _specs.values():
            _spec.loader.exec_module(_sys.modules[_spec.name])
    except BaseException:
        for _spec in _specs.values():
            _sys.modules.pop(_spec.name, None)
        raise

from . import lowerings as _lowerings  # noqa: F401
from . import passes as _passes  # noqa: F401
from .lowerings import ops as _ops  # noqa: F401  registers torch.ops.hyscale
from .lowerings import attention_ops as _attention_ops  # noqa: F401  registers torch.ops.hyscale.sparse_attention
from .lowerings.spec import MaskTerm, ScoreSpec
from .backend import hyscale_backend, hyscale_debug_backend
from .explain import ExplainReport, explain
from .registry import ScoreModError, register_score_mod, registered_score_mods, unregister_score_mod
from .losses import dense_indexer_kl, sparse_indexer_kl  # the DSA indexer's KL losses (docs/indexer_loss.md)

__all__ = ["hyscale_backend", "hyscale_debug_backend", "explain", "ExplainReport", "ScoreSpec", "MaskTerm",
           "register_score_mod", "unregister_score_mod", "registered_score_mods", "ScoreModError", "sparse_indexer_kl",
           "dense_indexer_kl"]


def _register_backends():
    # The entry point registers these lazily on first lookup; registering here too makes
    # ``import hyscale_compile`` enough when entry points are unavailable (e.g. running
    # from a source tree). Guarded: a second registration raises "duplicate name".
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    for name, fn in (("hyscale", hyscale_backend), ("hyscale_debug", hyscale_debug_backend)):
        # an entry point already known to the registry is loaded (and registered) by it
        if name not in _COMPILER_FNS and name not in _BACKENDS:
            register_backend(fn, name)


_register_backends()
