"""Prometheus metrics of one worker process, served on `TASKLOOM_METRICS_PORT` (unset: no endpoint).

Every label value is bounded: a role, a job function, a model id from the configuration, a tool name
from the loaded toolkits (a name the model invented is counted as "(unknown)"), an outcome from a
fixed list. No goal, task or job id is ever a label: per-goal numbers are in `taskloom ledger` and the
goal's event stream.

The roles do not import this module: they report through `bus.observe`, and `PrometheusObserver` is
the observer the composition root installs when the endpoint is on.

Queue depth is read by every worker process, for all three queues, every `TASKLOOM_METRICS_INTERVAL`
seconds (ZCARD of arq's sorted set: queued and deferred jobs, not the ones running). So the executor
queue's depth is still exported when no executor runs (scale from zero); aggregate with `max by (role)`.
"""

from __future__ import annotations

import asyncio
import errno
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

from bus import fleet
from bus.connection import RedisClient
from bus.keys import Keys
from bus.observe import Observer
from llm.types import Usage

from .settings import SettingsError

log = structlog.get_logger("taskloom.metrics")

# One registry per process, with the process collector (CPU, memory, open fds) but nothing else
# that a library might register on prometheus_client's global one.
REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

# Model turns take seconds; tool calls and steps range from milliseconds to minutes.
_SLOW = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)

QUEUE_DEPTH = Gauge(
    "taskloom_queue_depth",
    "Jobs waiting in the role's arq queue (ZCARD: queued and deferred)",
    ["role"],
    registry=REGISTRY,
)
JOBS_IN_PROGRESS = Gauge(
    "taskloom_jobs_in_progress", "Jobs this process is running now", ["role", "function"], registry=REGISTRY
)
JOB_DURATION = Histogram(
    "taskloom_job_duration_seconds",
    "Duration of arq jobs by function and outcome (ok, failed, cancelled)",
    ["role", "function", "outcome"],
    buckets=_SLOW,
    registry=REGISTRY,
)
TASK_RUN_DURATION = Histogram(
    "taskloom_task_run_duration_seconds",
    "Duration of one run of a task attempt's loop, by how it ended (stop reason, paused, handover, ...)",
    ["outcome"],
    buckets=_SLOW,
    registry=REGISTRY,
)
STEP_DURATION = Histogram(
    "taskloom_step_duration_seconds",
    "Duration of one executor step (model turn and its tool calls)",
    buckets=_SLOW,
    registry=REGISTRY,
)
MODEL_CALL_DURATION = Histogram(
    "taskloom_model_call_duration_seconds",
    "Latency of model calls by outcome (ok or error kind)",
    ["model", "outcome"],
    buckets=_SLOW,
    registry=REGISTRY,
)
MODEL_CALL_ERRORS = Counter(
    "taskloom_model_call_errors",
    "Failed model calls by kind (timeout, connection, retryable, terminal, ...)",
    ["model", "kind"],
    registry=REGISTRY,
)
TOKENS = Counter(
    "taskloom_tokens",
    "Tokens the provider reported, by kind (input, output, cache_read, cache_write)",
    ["model", "kind"],
    registry=REGISTRY,
)
COST = Counter(
    "taskloom_cost_usd", "Cost of model calls in USD (models with a known price)", ["model"], registry=REGISTRY
)
RATE_LIMIT_WAIT = Histogram(
    "taskloom_rate_limit_wait_seconds",
    "Seconds model calls waited for their turn in the fleet's rate limit (bus.ratelimit)",
    ["bucket"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
BUDGET_REFUSALS = Counter(
    "taskloom_budget_refusals",
    "Model calls refused by a goal's token budget (nothing sent)",
    ["model"],
    registry=REGISTRY,
)
MODEL_FAILOVERS = Counter(
    "taskloom_model_failovers",
    "Model calls moved to the next model of their chain after a retryable failure",
    ["from_model", "to_model", "cause"],
    registry=REGISTRY,
)
BREAKER_OPENINGS = Counter(
    "taskloom_model_breaker_openings",
    "Times a model's fleet-wide circuit breaker opened (every worker skips it for a cool-down)",
    ["model"],
    registry=REGISTRY,
)
TOOL_CALLS = Counter("taskloom_tool_calls", "Tool calls by tool and outcome", ["tool", "outcome"], registry=REGISTRY)
TOOL_DURATION = Histogram(
    "taskloom_tool_call_duration_seconds", "Duration of tool calls", ["tool"], buckets=_SLOW, registry=REGISTRY
)
QUEUE_READ_ERRORS = Counter(
    "taskloom_queue_depth_read_errors", "Failed reads of the queue depth (Redis unreachable)", registry=REGISTRY
)

JOB_RETRIES = Counter(
    "taskloom_job_retries",
    "Jobs re-run later by the job layer, by cause (provider, redis, internal)",
    ["role", "function", "cause"],
    registry=REGISTRY,
)
GOALS_GIVEN_UP = Counter(
    "taskloom_goals_given_up",
    "Goals failed by the job layer (provider: patience over or terminal model error; internal)",
    ["cause"],
    registry=REGISTRY,
)
REDRIVES = Counter(
    "taskloom_redrives",
    "Stranded goals and tasks re-driven by the supervisor, by the job enqueued",
    ["job"],
    registry=REGISTRY,
)

TOKEN_KINDS = ("input", "output", "cache_read", "cache_write")


class MetricsError(SettingsError):
    """The metrics endpoint could not start; the message names the setting (a configuration error)."""


class PrometheusObserver(Observer):
    """`bus.observe` hooks recorded as the metrics above."""

    def job_started(self, role: str, function: str) -> None:
        JOBS_IN_PROGRESS.labels(role, function).inc()

    def job_finished(self, role: str, function: str, outcome: str, seconds: float) -> None:
        JOBS_IN_PROGRESS.labels(role, function).dec()
        JOB_DURATION.labels(role, function, outcome).observe(seconds)

    def task_run(self, outcome: str, seconds: float) -> None:
        TASK_RUN_DURATION.labels(outcome).observe(seconds)

    def step(self, seconds: float) -> None:
        STEP_DURATION.observe(seconds)

    def model_call(self, model: str, outcome: str, seconds: float, usage: Usage | None, cost_usd: float | None) -> None:
        MODEL_CALL_DURATION.labels(model, outcome).observe(seconds)
        if outcome != "ok":
            MODEL_CALL_ERRORS.labels(model, outcome).inc()
        if usage is not None:
            for kind in TOKEN_KINDS:
                TOKENS.labels(model, kind).inc(getattr(usage, f"{kind}_tokens"))
        if cost_usd:
            COST.labels(model).inc(cost_usd)

    def budget_refused(self, model: str) -> None:
        BUDGET_REFUSALS.labels(model).inc()

    def model_failover(self, from_model: str, to_model: str, cause: str) -> None:
        MODEL_FAILOVERS.labels(from_model, to_model, cause).inc()

    def breaker_opened(self, model: str) -> None:
        BREAKER_OPENINGS.labels(model).inc()

    def rate_limit_wait(self, bucket: str, seconds: float) -> None:
        RATE_LIMIT_WAIT.labels(bucket).observe(seconds)

    def tool_call(self, tool: str, outcome: str, seconds: float) -> None:
        TOOL_CALLS.labels(tool, outcome).inc()
        TOOL_DURATION.labels(tool).observe(seconds)

    def job_retry(self, role: str, function: str, cause: str) -> None:
        JOB_RETRIES.labels(role, function, cause).inc()

    def goal_given_up(self, cause: str) -> None:
        GOALS_GIVEN_UP.labels(cause).inc()

    def redrive(self, job: str) -> None:
        REDRIVES.labels(job).inc()


@dataclass
class MetricsServer:
    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve(port: int, addr: str) -> MetricsServer:
    """Start the HTTP endpoint (`/metrics`) in a daemon thread."""
    try:
        server, thread = start_http_server(port, addr=addr, registry=REGISTRY)
    except OSError as exc:
        # Name the variable at fault: a port in use or privileged is the port's; an address this host
        # does not have, or a name that does not resolve, is the address's.
        in_use = exc.errno in (errno.EADDRINUSE, errno.EACCES)
        variable = "TASKLOOM_METRICS_PORT" if in_use else "TASKLOOM_METRICS_ADDR"
        raise MetricsError(f"{variable}: cannot listen on {addr}:{port}: {exc}") from exc
    return MetricsServer(server, thread)


async def refresh_queue_depth_forever(redis: RedisClient, keys: Keys, interval: float) -> None:
    """Keep `taskloom_queue_depth` current; a failed read keeps the last values and is counted."""
    while True:
        try:
            for role, depth in (await fleet.queue_depths(redis, keys)).items():
                QUEUE_DEPTH.labels(role).set(depth)
        except Exception as exc:
            QUEUE_READ_ERRORS.inc()
            log.warning("metrics.queue_depth_failed", error=repr(exc))
        await asyncio.sleep(interval)
