"""Launch configurations written as text, for benchmarks and run-time overrides.

``"block_n=32,prefetch_idx=1"`` sets fields of a launch-configuration dataclass (int fields
take digits, bool fields 0 or 1); ``"default;block_n=32"`` is a list of such overrides, the
empty one first. One parser, so every benchmark ``--config`` and ``HYSCALE_*_CONFIG``
variable reads the same syntax and names a bad item the same way."""
from __future__ import annotations

import dataclasses


def parse_fields(text: str, cls) -> dict:
    """``"a=1,b=0"`` -> ``{"a": 1, "b": False}`` for fields of the dataclass ``cls``; raises
    ValueError naming the item and the fields where one is not ``field=<int>`` (0|1 for a bool)."""
    kinds = {f.name: f.type for f in dataclasses.fields(cls)}
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, val = (x.strip() for x in item.partition("="))
        kind = kinds.get(name)
        if kind in (bool, "bool") and val in ("0", "1"):
            out[name] = val == "1"
        elif kind in (int, "int") and val.isdigit():
            out[name] = int(val)
        else:
            raise ValueError(f"{item!r} is not field=<int> (0|1 for a bool) for a field of {cls.__name__} "
                             f"({', '.join(kinds)})")
    return out


def parse_config_list(text: str, cls) -> list:
    """``"default;a=1,b=2"`` -> ``[{}, {"a": 1, "b": 2}]`` (``parse_fields`` per entry)."""
    return [{} if one.strip() in ("", "default") else parse_fields(one, cls) for one in text.split(";")]


def config_name(fields: dict) -> str:
    """The text ``parse_fields`` reads back (bools as 0/1); "default" for no fields."""
    return ",".join(f"{k}={int(v)}" for k, v in fields.items()) or "default"
