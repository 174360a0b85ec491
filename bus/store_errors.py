"""The store's typed errors, shared by every module that reads or moves records in Redis.

A record that does not parse is `bus.events.CorruptRecord` (`corrupt` builds one).
"""

from __future__ import annotations

from typing import Any

from .events import CorruptRecord, first_error


class StoreError(Exception):
    """Base of the store's typed errors."""


def corrupt(what: str, key: str, exc: Exception) -> CorruptRecord:
    """The error for a record at `key` that does not parse (`exc` says why)."""
    return CorruptRecord(what, key, first_error(exc))


class NotFound(StoreError):
    def __init__(self, what: str, ident: str) -> None:
        super().__init__(f"{what} {ident!r} not found")
        self.what = what
        self.ident = ident

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.ident))


class IllegalTransition(StoreError):
    """The requested transition is not allowed from the current state; nothing was written."""

    def __init__(self, entity: str, current: str, target: str) -> None:
        super().__init__(f"{entity}: illegal transition {current} -> {target}")
        self.entity = entity
        self.current = current
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.entity, self.current, self.target))


class StaleWrite(StoreError):
    """The record moved on (another attempt or plan version) since the caller read it."""

    def __init__(self, entity: str, expected: str, actual: str) -> None:
        super().__init__(f"{entity}: expected {expected}, found {actual}")
        self.entity = entity
        self.expected = expected
        self.actual = actual

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.entity, self.expected, self.actual))


class AlreadyExists(StoreError):
    def __init__(self, what: str, ident: str) -> None:
        super().__init__(f"{what} {ident!r} already exists")
        self.what = what
        self.ident = ident

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.ident))


__all__ = ["AlreadyExists", "CorruptRecord", "IllegalTransition", "NotFound", "StaleWrite", "StoreError", "corrupt"]
