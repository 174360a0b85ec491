"""The model port: the one interface the workers call a model through."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from llm.types import ModelRequest, ModelResponse


class TextSink(Protocol):
    """Told each piece of a reply's text as it arrives (`ModelPort.complete(..., on_text=)`).

    Synchronous on purpose: it runs once per streamed delta (a token or a few), inside the adapter's
    read loop, so it must only note the text; whoever delivers it elsewhere does so on its own time.
    Tool calls and thinking are never passed to it, only text the caller will find in
    `ModelResponse.text`, in order: the pieces of one call concatenate to that text.
    """

    def __call__(self, text: str) -> None: ...


@runtime_checkable
class ModelPort(Protocol):
    """A model the workers can call.

    `complete` sends one request and returns one response, or raises a `llm.errors.ModelError`
    (never a provider SDK exception). Implementations own their retries; callers must not add another
    backoff on top of a `RetryableModelError` within the same job.

    With `on_text`, the reply's text is also handed to it piece by piece while the reply is written
    (the provider's streaming API); the return value is the same complete response either way. A
    caller that passes no sink may call an implementation that takes none (`complete(request)`).
    """

    name: str
    """The implementation ("anthropic", "demo", ...), for logs."""
    model: str
    """The model id requests go to."""

    async def complete(self, request: ModelRequest, on_text: TextSink | None = None) -> ModelResponse: ...
