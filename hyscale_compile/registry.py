"""Teaching the backend a variant it does not know: ``register_score_mod``.

The canonicalizer recognizes the selection's structure by itself (contraction layouts,
head reductions, masks, scales, ReLU, sigmoid, casts); what it cannot know is an
elementwise function of the score it has never seen: a soft-capped indexer
(``c * tanh(s / c)``), a softplus or SiLU gate, a squared ReLU. Register the function once
and every selection that applies it, per head or after the head sum, becomes the fused
op with the function compiled into the generated kernel::

    import hyscale_compile

    hyscale_compile.register_score_mod("softcap30", lambda s: 30.0 * torch.tanh(s / 30.0))
    model = torch.compile(model, backend="hyscale")

Write ``fn`` the way the model writes it (the match is on the ops it traces to, with
their constants). Registration checks it right away and raises ``ScoreModError`` naming
the problem: not elementwise, an op the kernel cannot generate, a captured tensor, a cast
to a reduced dtype, a name that is taken. Registrations are part of the compile cache key
and show in ``explain`` (the site's variant and spec name the mod).

A compiled graph keeps the function it was compiled with: it names the mod by a digest
of its content, and this process keeps every mod it registered. Replacing or
unregistering a name affects only later compiles. A graph loaded from Inductor's cache
in another process was compiled under the same registrations (they are in the cache
key), so there the mod is found again by its digest.
"""
from __future__ import annotations

import hashlib
from typing import Callable, List

import torch

from .lowerings import mods as _mods
from .lowerings.mods import ScoreModError

__all__ = ["register_score_mod", "unregister_score_mod", "registered_score_mods", "ScoreModError", "fingerprint"]


def register_score_mod(name: str, fn: Callable[[torch.Tensor], torch.Tensor], *, replace: bool = False) -> None:
    """Register ``fn``, an elementwise float32 function of the score, under ``name``.

    ``replace=True`` overwrites an earlier registration of the same name (otherwise
    registering a name twice raises). Only later compiles see the new function: graphs
    already compiled keep computing the one they were compiled with (call
    ``torch._dynamo.reset()`` to recompile them with the new one)."""
    if not replace and name in _mods.registered():
        raise ScoreModError(f"register_score_mod: {name!r} is already registered (pass replace=True to overwrite)")
    _mods.add(_mods.build(name, fn))


def unregister_score_mod(name: str) -> None:
    """Forget a registration: later compiles no longer match it; graphs already compiled
    with it keep working."""
    _mods.remove(name)


def registered_score_mods() -> List[str]:
    return sorted(_mods.registered())


def fingerprint() -> str:
    """A digest of every registration: part of the pass's cache key."""
    h = hashlib.sha256()
    for name, mod in sorted(_mods.registered().items()):
        h.update(mod.key.encode() + b"\n")
    return h.hexdigest()
