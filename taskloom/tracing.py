"""Switching tracing on: `TASKLOOM_TRACING=otlp` installs the OpenTelemetry SDK with an OTLP exporter.

Everything else is the standard `OTEL_*` variables, read by the SDK itself: where to send
(`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_HEADERS`),
what to call the process (`OTEL_SERVICE_NAME`, else `taskloom-<roles>`), what to keep
(`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`) and how to batch (`OTEL_BSP_SCHEDULE_DELAY`...).
Off (the default), nothing is installed and spans are the API's no-ops. Nothing is sent anywhere
unless an operator configures it: the exporter's default endpoint is the local collector.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import structlog
from opentelemetry import trace

import bus.tracing as bt

from .settings import Settings, SettingsError

log = structlog.get_logger("taskloom.tracing")

_provider: Any = None  # the SDK TracerProvider this process installed, if any


class TracingUnavailable(SettingsError):
    """TASKLOOM_TRACING=otlp, but the `taskloom[otel]` extra is not installed."""


def configure(settings: Settings, roles: Sequence[str] = ()) -> bool:
    """Apply the tracing settings to this process; True when spans are now exported.

    Idempotent: a second call only updates the content flags (one provider per process, as
    OpenTelemetry allows only one global provider).
    """
    global _provider
    bt.settings.content = settings.trace_content
    bt.settings.tool_arguments = settings.trace_tool_arguments
    if settings.tracing != "otlp":
        return False
    if _provider is None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import SERVICE_NAME, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise TracingUnavailable(
                f"TASKLOOM_TRACING=otlp but the OpenTelemetry SDK cannot be imported ({exc}); "
                "install it with: pip install 'taskloom[otel]'"
            ) from None
        name = os.environ.get("OTEL_SERVICE_NAME") or "taskloom" + "".join(f"-{r}" for r in roles)
        # Resource.create also reads OTEL_RESOURCE_ATTRIBUTES; the sampler comes from OTEL_TRACES_SAMPLER.
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _provider = provider
    bt.settings.enabled = True
    return True


def flush(timeout_s: float = 5.0) -> None:
    """Export what is still buffered (worker shutdown, end of a CLI command); never raises."""
    if _provider is not None:
        try:
            _provider.force_flush(int(timeout_s * 1000))
        except Exception as exc:  # a collector that is away must not stop a shutdown
            log.warning("tracing.flush_failed", error=repr(exc))
