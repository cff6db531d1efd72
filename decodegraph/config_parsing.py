"""How a config dataclass is given on the command line or in Python: itself, a dict, a
JSON string, or None (vLLM's `--compilation-config '{...}'` convention)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

T = TypeVar("T")


def dataclass_from_any(cls: type[T], value: Any, field_name: str) -> T:
    """`value` as a `cls`: None gives the defaults; a dict or JSON object gives its
    fields; an unknown field or another type is a ValueError naming `field_name`."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field_name}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field_name}: expected a dict, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{field_name}: unknown field(s) {unknown}; known: {sorted(known)}")
    return cls(**value)
