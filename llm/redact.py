"""Secret redaction shared by the logs and the model-call cassettes: values under secret-looking
keys, and Anthropic-style keys or bearer tokens anywhere inside a string."""

from __future__ import annotations

import re
from typing import Any

SECRET_KEYS = re.compile(r"(api[_-]?key|authorization|password|secret|token_value)", re.I)
SECRET_VALUES = re.compile(r"sk-ant-[A-Za-z0-9_\-]+|(?i:bearer\s+)[A-Za-z0-9._\-]{8,}")
REDACTED = "[redacted]"


def scrub(value: Any, extra: tuple[str, ...] = ()) -> Any:
    """`value` with secrets replaced by `[redacted]`: dict values under secret-looking keys, key-shaped
    substrings, and every literal string in `extra` (secrets known by value, e.g. from the environment)."""
    if isinstance(value, str):
        for secret in extra:
            value = value.replace(secret, REDACTED)
        return SECRET_VALUES.sub(REDACTED, value)
    if isinstance(value, dict):
        return {k: REDACTED if SECRET_KEYS.search(str(k)) else scrub(v, extra) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub(v, extra) for v in value]
    return value
