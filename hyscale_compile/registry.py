"""Variants the backend knows beyond the built-in canonicalizer (issue: registration API).

The canonicalizer recognizes the DSA family structurally; this registry is where user
registrations will live. Its ``fingerprint`` is part of the pass's cache key, so a
registration changes the key and a cached graph compiled without it is never reused.
"""
from __future__ import annotations

import hashlib
from typing import Dict

_VARIANTS: Dict[str, str] = {}


def fingerprint() -> str:
    h = hashlib.sha256()
    for name in sorted(_VARIANTS):
        h.update(name.encode())
        h.update(_VARIANTS[name].encode())
    return h.hexdigest()
