"""Logical-axis bookkeeping for the canonicalizer.

Every tensor on the path from the score contraction to the top-k is described by a
*layout*: one tuple of ``Atom``s per tensor dim. An atom is a logical axis (a label and
its size); a dim holding several atoms is those axes merged by a view, outer first; an
empty tuple is a size-1 dim that carries no axis. Views, permutes, unsqueezes and
expands move atoms around without changing them, so after following a chain of them
we still know which logical axis (batch, query, head, key, contracted) each dim holds.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, List, Optional, Sequence, Tuple

from torch.fx.experimental.symbolic_shapes import statically_known_true

_fresh = itertools.count()


def inverse_permutation(perm) -> list:
    """``inv`` with ``permute(permute(x, perm), inv) == x``."""
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    return inv


class Unsupported(Exception):
    """Raised while analysing a site: the message is the diagnostic reason. ``hint``: what
    a user could do about it, shown only where it applies (a query-key score upstream)."""

    def __init__(self, msg: str, hint: str = ""):
        super().__init__(msg)
        self.hint = hint


@dataclasses.dataclass(frozen=True)
class Atom:
    label: str
    size: Any  # int or SymInt
    bcast: bool = False  # created by expand: the tensor does not vary along it

    def __repr__(self):
        return f"{self.label}{'*' if self.bcast else ''}:{self.size}"


Dim = Tuple[Atom, ...]
Layout = List[Dim]


def fresh(prefix: str) -> str:
    return f"{prefix}{next(_fresh)}"


def same_size(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return statically_known_true(a == b)


def is_one(a) -> bool:
    return same_size(a, 1)


def _prod_sizes(sizes):
    out = 1
    for s in sizes:
        out = out * s
    return out


def dim_size(dim: Dim):
    out = 1
    for a in dim:
        out = out * a.size
    return out


def source_layout(shape: Sequence[Any], prefix: str) -> Layout:
    """Fresh atoms for a tensor whose dims we know nothing about yet."""
    return [() if is_one(s) else (Atom(fresh(prefix), s),) for s in shape]


def permute(layout: Layout, dims: Sequence[int]) -> Layout:
    n = len(layout)
    return [layout[d % n] for d in dims]


def unsqueeze(layout: Layout, dim: int) -> Layout:
    n = len(layout) + 1
    d = dim % n
    return layout[:d] + [()] + layout[d:]


def squeeze(layout: Layout, dims: Optional[Sequence[int]], shape) -> Layout:
    n = len(layout)
    dims = range(n) if dims is None else [d % n for d in dims]
    drop = {d for d in dims if is_one(shape[d])}
    for d in drop:
        if layout[d] and not all(is_one(a.size) for a in layout[d]):
            raise Unsupported("squeeze of a non-unit axis")
    return [l for i, l in enumerate(layout) if i not in drop]


def expand(layout: Layout, sizes: Sequence[Any]) -> Layout:
    out: Layout = []
    lead = len(sizes) - len(layout)
    for i, s in enumerate(sizes):
        if i < lead:
            out.append(() if is_one(s) else (Atom(fresh("bc"), s, bcast=True),))
            continue
        cur = layout[i - lead]
        if (isinstance(s, int) and s == -1) or cur and same_size(dim_size(cur), s):
            out.append(cur)
        elif not cur:
            out.append(() if is_one(s) else (Atom(fresh("bc"), s, bcast=True),))
        else:
            raise Unsupported(f"expand of axis {cur} to {s}")
    return out


def view(layout: Layout, sizes: Sequence[Any]) -> Layout:
    """Regroup atoms to a new shape. Atoms may merge; an atom may split only into
    statically sized pieces (then it becomes new atoms, ``label/0``, ``label/1``)."""
    atoms = [a for d in layout for a in d]
    sizes = list(sizes)
    if any(isinstance(s, int) and s == -1 for s in sizes):
        known = 1
        for s in sizes:
            if not (isinstance(s, int) and s == -1):
                known = known * s
        total = 1
        for a in atoms:
            total = total * a.size
        sizes = [total // known if (isinstance(s, int) and s == -1) else s for s in sizes]
    out: Layout = []
    i = 0
    for s in sizes:
        if is_one(s):
            # a unit dim may absorb unit atoms but never a real axis
            while i < len(atoms) and is_one(atoms[i].size):
                i += 1
            out.append(())
            continue
        group: List[Atom] = []
        acc = 1
        while not same_size(acc, s):
            if i >= len(atoms):
                raise Unsupported(f"view to {sizes} does not regroup axes {atoms}")
            a = atoms[i]
            if is_one(a.size):
                i += 1
                continue
            need = s // acc
            if not statically_known_true(need * acc == s):
                raise Unsupported(f"view to {sizes} does not regroup axes {atoms}")
            if not same_size(a.size, need) and not statically_known_true((need // a.size) * a.size == need):
                inner = a.size // need
                if is_one(inner) or not statically_known_true(inner * need == a.size):
                    raise Unsupported(f"view splits axis {a} unevenly")
                # split a into (need) outer x (a.size // need) inner
                outer = Atom(a.label + "/0", need, a.bcast)
                atoms[i : i + 1] = [outer, Atom(a.label + "/1", inner, a.bcast)]
                a = outer
            group.append(a)
            acc = acc * a.size
            i += 1
        out.append(tuple(group))
    while i < len(atoms) and is_one(atoms[i].size):
        i += 1
    if i != len(atoms):
        raise Unsupported(f"view to {sizes} drops axes {atoms[i:]}")
    return out


def broadcast_align(operand_shape, layout: Layout) -> Layout:
    """Layout of an operand that broadcasts against a tensor of ``layout`` (trailing
    alignment). Its unit dims carry nothing; its other dims carry the full atoms."""
    lead = len(layout) - len(operand_shape)
    if lead < 0:
        raise Unsupported("operand has more dims than the score")
    out: Layout = []
    for i, s in enumerate(operand_shape):
        full = layout[lead + i]
        if is_one(s):
            out.append(())
        elif full and same_size(dim_size(full), s):
            if any(a.bcast for a in full):
                raise Unsupported("operand varies along a broadcast axis")
            out.append(full)
        else:
            raise Unsupported(f"operand dim of size {s} does not match the score's axis {full}")
    return out


def labels(layout: Layout) -> List[str]:
    return [a.label for d in layout for a in d if not a.bcast]
