"""Span helpers shared by every role, through the OpenTelemetry API only.

The API is a hard dependency; the SDK and the OTLP exporter are the `taskloom[otel]` extra, installed
and switched on by the composition root (`taskloom.tracing`, `TASKLOOM_TRACING=otlp`). Until then
every tracer here is the API's no-op: a span costs one object and records nothing.

A goal is one trace. Its context travels through Redis as a W3C `traceparent` string, in the goal
record and in every job payload, so a job picked up by any worker on any machine continues the
trace of the step that enqueued it (see docs/operations.md, "Tracing").

Content (prompts, completions) and tool arguments may hold personal data: they are recorded only
when `settings.content` / `settings.tool_arguments` say so (both off by default).
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACER_NAME = "taskloom"
CONTENT_LIMIT = 8000  # characters of one recorded prompt or completion (when content capture is on)

_propagator = TraceContextTextMapPropagator()


@dataclass
class TraceSettings:
    """What spans may record besides timings and counts (set once per process by `taskloom.tracing`)."""

    enabled: bool = False  # an SDK provider is installed (spans are recorded and exported)
    content: bool = False  # TASKLOOM_TRACE_CONTENT: prompts and completions on model spans
    tool_arguments: bool = False  # TASKLOOM_TRACE_TOOL_ARGUMENTS: tool call arguments on tool spans


settings = TraceSettings()


# The global provider's tracer (a proxy until `taskloom.tracing` installs the SDK's provider, then
# that provider's); tests swap in their own provider with `use_provider`.
_tracer: trace.Tracer = trace.get_tracer(TRACER_NAME)


def tracer() -> trace.Tracer:
    return _tracer


def use_provider(provider: trace.TracerProvider | None) -> None:
    """Send this process's spans to `provider` instead of the global one (None: back to the global)."""
    global _tracer
    _tracer = trace.get_tracer(TRACER_NAME) if provider is None else provider.get_tracer(TRACER_NAME)


def current_traceparent() -> str | None:
    """The W3C traceparent of the current span, or None when there is none (tracing off)."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent")


def new_traceparent() -> str:
    """A fresh sampled traceparent, for a goal submitted by a process that does not trace.

    Workers that trace then still put the whole goal in one trace, under a root span that nobody
    exports (trace viewers show it as a missing parent). Costs 24 random bytes, nothing else.
    """
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def context_of(traceparent: str | None) -> otel_context.Context | None:
    """The context a traceparent names (None for None or a malformed value: then no parent)."""
    if not traceparent:
        return None
    ctx = _propagator.extract({"traceparent": traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def trace_id_of(traceparent: str | None) -> str | None:
    """The 32-hex trace id inside a traceparent (`00-<trace id>-<span id>-<flags>`)."""
    if not traceparent:
        return None
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the current span as hex, or None (for log lines and events)."""
    sc = trace.get_current_span().get_span_context()
    if not sc.is_valid:
        return None
    return format(sc.trace_id, "032x"), format(sc.span_id, "016x")


def current_trace_id() -> str | None:
    ids = current_ids()
    return ids[0] if ids else None


def fail(span: Span, exc: BaseException) -> None:
    """Mark `span` failed by `exc` (its type and message; never a traceback with local values)."""
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:500]))
    span.record_exception(exc)


@contextlib.contextmanager
def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    parent: str | None = None,
    start_time: int | None = None,
    links: list[trace.Link] | None = None,
) -> Iterator[Span]:
    """A span around a block; an exception escaping it sets the error status and is re-raised.

    `parent` is a traceparent read from Redis (a job payload, the goal record); without one the
    span is a child of the current span.
    """
    ctx = context_of(parent) if parent is not None else None
    with tracer().start_as_current_span(
        name,
        context=ctx,
        kind=kind,
        attributes=clean(attributes),
        start_time=start_time,
        links=links,
        record_exception=False,
        set_status_on_exception=False,
    ) as current:
        try:
            yield current
        except BaseException as exc:
            if _unset(current):  # keep a status set inside (the error behind a retry, say)
                fail(current, exc)
            raise


def _unset(current: Span) -> bool:
    status = getattr(current, "status", None)  # the SDK's spans have one; the API's no-op has not
    return status is None or status.status_code is StatusCode.UNSET


def queue_wait(parent: str | None, start_ns: int, end_ns: int, job: str) -> None:
    """A span for the time a job waited in its queue (enqueue, or due time if deferred, to start)."""
    ctx = context_of(parent)
    wait = tracer().start_span("queue wait", context=ctx, kind=SpanKind.INTERNAL, start_time=start_ns)
    wait.set_attribute("taskloom.job", job)
    wait.end(end_time=end_ns)


def set_attributes(**attributes: Any) -> None:
    """Add attributes to the current span (dots are spelled `__`: `taskloom__verdict=` for `taskloom.verdict`)."""
    current = trace.get_current_span()
    if current.is_recording():
        current.set_attributes(clean({k.replace("__", "."): v for k, v in attributes.items()}))


def add_event(name: str, **attributes: Any) -> None:
    current = trace.get_current_span()
    if current.is_recording():
        current.add_event(name, clean({k.replace("__", "."): v for k, v in attributes.items()}))


def content(value: Any) -> str:
    """A prompt, completion or tool arguments as bounded JSON text for an attribute."""
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= CONTENT_LIMIT else text[:CONTENT_LIMIT] + f"...[{len(text) - CONTENT_LIMIT} more]"


def clean(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """Attributes without None values (OTel refuses them), tuples as lists."""
    if not attributes:
        return {}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in attributes.items() if v is not None}


# -- GenAI semantic conventions (model and tool calls) --------------------------------------------


# Our adapters' names as the OpenTelemetry GenAI conventions spell the providers.
GENAI_PROVIDERS = {"bedrock": "aws.bedrock", "vertex": "gcp.vertex_ai"}


def model_span(provider: str, model: str, request: Any) -> contextlib.AbstractContextManager[Span]:
    """The span of one model call (`chat <model>`, kind CLIENT), named and tagged per the GenAI conventions.

    `request` is an `llm.types.ModelRequest`; its contents are recorded only with `settings.content`.
    """
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": GENAI_PROVIDERS.get(provider, provider),
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": request.max_tokens,
        "taskloom.purpose": request.metadata.get("purpose"),
    }
    if settings.content:
        attrs["gen_ai.system_instructions"] = content(request.system)
        attrs["gen_ai.input.messages"] = content([m.model_dump(mode="json") for m in request.messages])
    return span(f"chat {model}", attrs, kind=SpanKind.CLIENT)


def model_response(current: Span, response: Any) -> None:
    """Usage, finish reason and request id of a `ModelResponse` on its model span."""
    if not current.is_recording():
        return
    usage = response.usage
    current.set_attributes(
        clean(
            {
                "gen_ai.response.model": response.model,
                # The conventions count every input token, cached ones included, in input_tokens.
                "gen_ai.usage.input_tokens": usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens,
                "gen_ai.usage.output_tokens": usage.output_tokens,
                "gen_ai.usage.cache_read.input_tokens": usage.cache_read_tokens,
                "gen_ai.usage.cache_creation.input_tokens": usage.cache_write_tokens,
                "gen_ai.response.finish_reasons": [str(response.stop_reason)],
                "taskloom.request_id": response.request_id,
            }
        )
    )
    if settings.content:
        blocks = [b.model_dump(mode="json") for b in response.content]
        current.set_attribute("gen_ai.output.messages", content([{"role": "assistant", "parts": blocks}]))


def tool_span(name: str, call_id: str, arguments: Any) -> contextlib.AbstractContextManager[Span]:
    """The span of one tool call (`execute_tool <name>`); arguments only with `settings.tool_arguments`."""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": name,
        "gen_ai.tool.call.id": call_id,
    }
    if settings.tool_arguments:
        attrs["gen_ai.tool.call.arguments"] = content(arguments)
    return span(f"execute_tool {name}", attrs)
