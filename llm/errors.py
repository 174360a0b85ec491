"""Typed model-call errors.

They cross arq (a job that fails with one is pickled into Redis), so every class pickles with its
fields: `__reduce__` rebuilds it from the message and restores the attributes.

`maybe_spent` is what the token ledger reads: True when the provider may have done (and billed) work
for this call, so the reservation must be settled as spent; False when no attempt can have been billed
(refused connection, or only error statuses, which providers do not bill), so it can be released.
"""

from __future__ import annotations

from typing import Any


class ModelError(Exception):
    """Base of every error a `ModelPort.complete` raises."""

    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        request_id: str | None = None,
        maybe_spent: bool = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.request_id = request_id
        self.maybe_spent = maybe_spent
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,), self.__dict__.copy())

    def __str__(self) -> str:
        extra = [f"status={self.status}" if self.status is not None else ""]
        extra.append(f"request_id={self.request_id}" if self.request_id else "")
        tail = ", ".join(e for e in extra if e)
        return f"{self.message} ({tail})" if tail else self.message


class RetryableModelError(ModelError):
    """The provider is overloaded, rate-limiting or failing (408/409/429/5xx/529) and the SDK's own
    retries are exhausted; trying again later may succeed. `retry_after` is the provider's hint, if any."""

    retryable = True


class TerminalModelError(ModelError):
    """The request itself is wrong or not allowed (400/401/403/404/413/422...): retrying cannot help."""


class ContextLengthError(TerminalModelError):
    """The conversation no longer fits the model's context window: the provider refused it (a 400 such
    as OpenAI's `context_length_exceeded`). Retrying the same request cannot help; a shorter one can."""


class ModelTimeoutError(ModelError):
    """No answer arrived, but the request may have reached the provider: count it as spent."""

    retryable = True

    def __init__(self, message: str, **kwargs: Any) -> None:
        kwargs.setdefault("maybe_spent", True)
        super().__init__(message, **kwargs)


class ModelConnectionError(ModelError):
    """No attempt reached the provider (connection refused, DNS failure, connect timeout): nothing spent."""

    retryable = True


class ModelConfigError(ModelError):
    """The model cannot be used as configured (missing API key, bad tool names...)."""


class ToolNameCollisionError(ModelConfigError, ValueError):
    """Two distinct tool names map to the same provider-side name."""


class ToolPairingError(ModelError, ValueError):
    """The history breaks the tool_use / tool_result pairing that providers require."""
