"""Launch configurations written as text, for benchmarks and run-time overrides.

``"block_n=32,prefetch_idx=1"`` sets fields of a launch-configuration dataclass, each value
read as its field's annotation says (int; bool as 0 or 1; float; str; ``none`` for an
Optional number or bool); ``"default;block_n=32"`` is a list of such overrides, the empty
one first. One parser, so every benchmark's ``--config(s)`` and the
``HYSCALE_ATTN_BWD_CONFIG`` variable read the same syntax and name a bad item the same way."""
from __future__ import annotations

import dataclasses


def _kind(f: dataclasses.Field) -> str:
    # the annotation as text: a string under ``from __future__ import annotations``
    return (f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))).replace("typing.", "")


def _value(kind: str, val: str):
    if kind.startswith("Optional[") and kind.endswith("]"):
        kind = kind[len("Optional["):-1]
        if val.lower() == "none" and kind != "str":  # (a str field takes "none" as itself: sort=none)
            return None
    if kind == "bool" and val in ("0", "1"):
        return val == "1"
    if kind == "int":
        return int(val)
    if kind == "float":
        return float(val)
    if kind == "str" and val:
        return val
    raise ValueError(val)


def parse_fields(text: str, cls) -> dict:
    """``"a=1,b=0"`` -> ``{"a": 1, "b": False}`` for fields of the dataclass ``cls``; raises
    ValueError naming the item and the fields (with their types) where one does not parse."""
    kinds = {f.name: _kind(f) for f in dataclasses.fields(cls)}
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, val = (x.strip() for x in item.partition("="))
        try:
            out[name] = _value(kinds[name], val)
        except (KeyError, ValueError):
            raise ValueError(f"{item!r} is not field=value (a bool 0|1) for a field of {cls.__name__} ("
                             + ", ".join(f"{n}: {k}" for n, k in kinds.items()) + ")") from None
    return out


def parse_config_list(text: str, cls) -> list:
    """``"default;a=1,b=2"`` -> ``[{}, {"a": 1, "b": 2}]`` (``parse_fields`` per entry)."""
    return [{} if one.strip() in ("", "default") else parse_fields(one, cls) for one in text.split(";")]


def config_name(fields: dict) -> str:
    """The text ``parse_fields`` reads back (bools as 0/1); "default" for no fields."""
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in fields.items()) or "default"
