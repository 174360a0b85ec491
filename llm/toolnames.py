"""Map our tool names to what a provider accepts, and back.

Anthropic accepts `^[a-zA-Z0-9_-]{1,64}$`. We keep any name (e.g. `svc.order.lookup`) and translate at
the adapter boundary: invalid characters become `_`; a name still longer than 64 is cut and given a
hash suffix of the full name. Two distinct names that land on the same provider name are refused,
naming both, rather than silently routing one tool's calls to the other.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from llm.errors import ToolNameCollisionError

VALID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_INVALID_CHAR = re.compile(r"[^a-zA-Z0-9_-]")
MAX_LEN = 64
_HASH_LEN = 8


def provider_name(name: str) -> str:
    """The provider-side name for `name` (itself when already valid)."""
    if not name:
        raise ValueError("a tool name cannot be empty")
    if VALID.match(name):
        return name
    cleaned = _INVALID_CHAR.sub("_", name)
    if len(cleaned) <= MAX_LEN:
        return cleaned
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:_HASH_LEN]
    return f"{cleaned[: MAX_LEN - _HASH_LEN - 1]}_{digest}"


class ToolNameMap:
    """A two-way map between our names and provider names for one request."""

    def __init__(self, names: Iterable[str]) -> None:
        self._to_provider: dict[str, str] = {}
        self._to_ours: dict[str, str] = {}
        for name in names:
            if name in self._to_provider:
                continue
            wire = provider_name(name)
            other = self._to_ours.get(wire)
            if other is not None:
                raise ToolNameCollisionError(
                    f"tool names {other!r} and {name!r} both map to {wire!r} for the provider; rename one"
                )
            self._to_provider[name] = wire
            self._to_ours[wire] = name

    def to_provider(self, name: str) -> str:
        return self._to_provider.get(name) or provider_name(name)

    def to_ours(self, wire_name: str) -> str:
        """Our name for a provider name; an unknown one (a name the model made up) is returned as is."""
        return self._to_ours.get(wire_name, wire_name)
