"""The model port: the one interface the workers call a model through."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from llm.types import ModelRequest, ModelResponse


@runtime_checkable
class ModelPort(Protocol):
    """A model the workers can call.

    `complete` sends one request and returns one response, or raises a `llm.errors.ModelError`
    (never a provider SDK exception). Implementations own their retries; callers must not add another
    backoff on top of a `RetryableModelError` within the same job.
    """

    name: str
    """The implementation ("anthropic", "demo", ...), for logs."""
    model: str
    """The model id requests go to."""

    async def complete(self, request: ModelRequest) -> ModelResponse: ...
