"""Redis replies as text: the clients may be built with or without `decode_responses`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any


def as_str(v: Any) -> str:
    """A reply value as text (bytes decoded as UTF-8)."""
    return v.decode() if isinstance(v, bytes) else str(v)


def str_pairs(flat: Sequence[Any]) -> dict[str, str]:
    """A flat `field, value, field, value...` reply (HGETALL from a script) as a dict of text."""
    it: Iterator[Any] = iter(flat)
    return {as_str(k): as_str(v) for k, v in zip(it, it, strict=True)}
