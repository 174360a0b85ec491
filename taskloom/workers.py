"""arq workers, one per role, each on its own queue; `run_workers` runs one or several in a process.

Each job handler is wrapped once here: its payload is validated, the log context is bound
(role, job_id, goal_id, task_id, attempt) and start/end/failure are logged. Roles stay plain async
functions `handler(runtime, payload)`.

Shutdown: on SIGTERM/SIGINT a process stops taking jobs and lets running jobs finish for
`shutdown_grace` seconds. An executor job does not start another step meanwhile: at its next step
boundary it hands the attempt over (lease released, resume job enqueued) to another executor. What
still runs when the grace ends is cancelled: arq puts a cancelled job back on its queue, and a
cancelled executor job releases its lease first, so another worker resumes it at once.

Operations: every process records a heartbeat per role (`taskloom.health`), and with
`TASKLOOM_METRICS_PORT` set it serves Prometheus metrics (`taskloom.metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import random
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import structlog
from arq.worker import Function, Retry, Worker, func
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from pydantic import ValidationError

import bus.tracing as tracing
import critic.handlers as critic
import executor.handlers as executor
import planner.handlers as planner
from bus import fleet
from bus.breaker import Breaker, BreakerPolicy
from bus.connection import RedisPool, connect
from bus.events import EventLog
from bus.jobs import JobPayload, parse_payload
from bus.keys import ROLES
from bus.ledger import Ledger
from bus.live import LivePublisher
from bus.metered import Degrade, ModelFactory
from bus.observe import Observer, install, observe
from bus.prices import PriceTable
from bus.ratelimit import RateLimiter
from bus.retention import purge_ended as retention_sweep
from bus.retry import (
    Episode,
    GiveUp,
    RetryPolicy,
    TroubleClock,
    count_job_error,
    describe,
    is_redis_trouble,
    on_model_error,
    on_other_error,
    redis_trouble,
)
from bus.runtime import Limits, Runtime
from bus.schemas import Event, GoalState
from bus.store import CorruptRecord, IllegalTransition, NotFound
from bus.tenants import TenantBusy
from executor.demo_tools import support
from executor.registry import ToolLoadError, ToolRegistry, load_toolkits
from executor.sources.base import ToolSource
from executor.sources.catalog import Catalog, ToolCatalog
from executor.sources.toolkit import ToolkitSource
from llm.cassette import RecordingModel
from llm.errors import ModelError
from llm.port import ModelPort
from llm.providers import ModelConfig
from planner.supervise import supervise

from . import eventloop, health, metrics
from .models import ModelRouter, make_builder
from .settings import Settings
from .settings import keys_for as keys_for  # re-exported: callers import it from here
from .tracing import configure as configure_tracing
from .tracing import flush as flush_traces
from .wake import WakeableWorker, hold_job

log = structlog.get_logger("taskloom.worker")

Handler = Callable[[Runtime, Any], Awaitable[None]]


def handlers_for(role: str, tools: ToolCatalog, stopping: Callable[[], bool] | None = None) -> dict[str, Handler]:
    """`stopping()` is true once the process is shutting down (executors hand their attempts over)."""
    table: dict[str, dict[str, Handler]] = {
        "planner": {"plan": planner.plan, "advance": planner.advance, "replan": planner.replan},
        "executor": {"execute": functools.partial(executor.execute, tools=tools, stopping=stopping)},
        "critic": {"review": critic.review, "review_goal": critic.review_goal},
    }
    return table[role]


def limits_for(settings: Settings) -> Limits:
    return Limits.of(settings)


def load_tools(settings: Settings, with_mcp: bool = True) -> Catalog:
    """`TASKLOOM_TOOLS` (or the bundled support-desk toolkit with the offline demo model) and the
    servers of `TASKLOOM_MCP_CONFIG`, as one catalog (enter it, then `start()` it). `with_mcp=False`
    for processes that never use tools (a critic-only worker starts no MCP server)."""
    kits = load_toolkits(settings.tools, default=[support] if settings.model == "demo" else [])
    sources: list[ToolSource] = [ToolkitSource(k) for k in kits]
    if settings.mcp_config and with_mcp:
        try:
            from executor.sources.mcp import sources_from
        except ImportError as exc:
            raise ToolLoadError(
                f"TASKLOOM_MCP_CONFIG is set but the MCP SDK cannot be imported ({exc}); "
                "install it with: pip install 'taskloom[mcp]'"
            ) from None
        sources.extend(sources_from(settings.mcp_config))
    return Catalog(sources)


def make_ledger(settings: Settings, redis: RedisPool) -> Ledger:
    return Ledger(
        redis,
        keys_for(settings),
        min_reservation=settings.ledger_min_reservation,
        reservation_ttl=settings.ledger_reservation_ttl,
        prices=PriceTable(settings.all_prices()),
        settle_delay=settings.ledger_settle_delay,
    )


def make_models(settings: Settings) -> ModelRouter:
    """Every model this process may call, by name (aliases of the models file, demo, claude-... ids),
    built when first needed, and the route of each role. Every model records its calls to the
    `TASKLOOM_RECORD` cassette when that is set."""
    build = make_builder(settings.model_max_retries, settings.model_timeout, settings.demo_latency)
    record = settings.record

    def built(config: ModelConfig, in_chain: bool) -> ModelPort:
        model = build(config, in_chain)
        return RecordingModel(model, record) if record is not None else model

    return ModelRouter(settings.catalog(), settings.role_models(), built)


def make_inner_model(settings: Settings) -> ModelPort:
    """The configured `TASKLOOM_MODEL` (raises `ModelConfigError` naming the key's variable when it is
    missing), recording every call to the `TASKLOOM_RECORD` cassette when that is set."""
    return make_models(settings).model(settings.model)


async def close_models(model: ModelPort | ModelRouter) -> None:
    """Close every model's client (a router: each model it built)."""
    for m in model.built() if isinstance(model, ModelRouter) else [model]:
        close = getattr(m, "aclose", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()


def _job_function(role: str, name: str, handler: Handler) -> Function:
    async def run(ctx: dict[str, Any], raw: Any) -> None:
        base = {"role": role, "job_id": ctx.get("job_id"), "job_try": ctx.get("job_try")}
        try:
            payload: JobPayload = parse_payload(name, raw)
        except ValidationError as exc:
            # A malformed job can never succeed: say what is wrong and drop it, do not retry it.
            log.error("job.invalid_payload", **base, function=name, errors=exc.errors(include_url=False))
            return
        fields = payload.model_dump(include={"goal_id", "task_id", "attempt"})
        with structlog.contextvars.bound_contextvars(**base, **fields), await _job_span(ctx, name, payload):
            started = time.perf_counter()
            log.info("job.start", function=name)
            observe(lambda o: o.job_started(role, name))
            outcome = "ok"
            holder = asyncio.create_task(hold_job(ctx, ctx["runtime"].limits.lease_ttl, ctx["runtime"].renewer()))
            try:
                goal_id = getattr(payload, "goal_id", None)
                # An execute job reads its goal and task first thing: both go in the deadline's read.
                task_id = getattr(payload, "task_id", None) if name == "execute" else None
                store = ctx["runtime"].store
                if goal_id is not None and await store.expire_if_late(goal_id, hand_over=True, task_id=task_id):
                    log.warning("goal.deadline_passed", function=name)  # the handler then finds it ended
                await handler(ctx["runtime"], payload)
            except TenantBusy as busy:
                # Not a failure: the tenant's running slots are all taken; try again shortly (jittered,
                # so waiting jobs do not all come back at once).
                outcome = "deferred"
                log.info("job.deferred", function=name, reason=str(busy))
                raise Retry(defer=busy.retry_in * random.uniform(0.5, 1.5)) from None
            except (NotFound, CorruptRecord) as exc:
                # A record the job needs is missing or damaged: no re-run can help. Say which, without
                # a traceback (arq would log one), and end the goal visibly if it still can be.
                outcome = "failed"
                tracing.fail(trace.get_current_span(), exc)
                log.error("job.failed", function=name, error=str(exc), seconds=round(time.perf_counter() - started, 4))
                if isinstance(exc, CorruptRecord):
                    await _fail_corrupted(ctx["runtime"], payload, exc)
                return
            except asyncio.CancelledError:
                outcome = "cancelled"
                log.warning("job.cancelled", function=name, seconds=round(time.perf_counter() - started, 4))
                raise
            except Exception as exc:
                # Never a silent arq failure: the job runs again later, or its goal ends visibly.
                outcome = "retry"
                tracing.fail(trace.get_current_span(), exc)  # the span says why, whatever follows
                try:
                    await _after_failure(ctx["runtime"], role, name, payload, exc, int(ctx.get("job_try") or 1))
                except Retry:
                    raise
                except Exception:
                    outcome = "failed"
                    log.exception("job.failed", function=name, seconds=round(time.perf_counter() - started, 4))
                    raise
                outcome = "gave_up"
            finally:
                holder.cancel()
                seconds = time.perf_counter() - started
                observe(lambda o: o.job_finished(role, name, outcome, seconds))
            log.info("job.end", function=name, seconds=round(seconds, 4))

    run.__qualname__ = f"{role}.{name}"
    return func(run, name=name)


# Span names of the jobs (a job span is one run of the job: a retry or a re-run is another span,
# a child of the same parent in the same trace, with its own `taskloom.job_try`).
SPAN_NAMES = {"execute": "task attempt", "review_goal": "review goal"}


async def _job_span(ctx: dict[str, Any], name: str, payload: JobPayload) -> contextlib.AbstractContextManager[Any]:
    """The job's span, continuing the trace of whoever enqueued it, plus its queue wait.

    A job enqueued outside any span (a supervisor re-drive, a watchdog resume, an approval) carries
    no traceparent: it continues the goal's root span from the goal record instead.
    """
    if not tracing.settings.enabled:
        return contextlib.nullcontext()
    parent = payload.traceparent
    goal_id: str | None = getattr(payload, "goal_id", None)
    if parent is None and goal_id is not None:
        with contextlib.suppress(Exception):  # no goal record: the job's handler reports that
            parent = (await ctx["runtime"].store.get_goal(goal_id)).traceparent
    now = time.time_ns()
    queued = ctx.get("enqueue_time")
    queued_ns = int(queued.timestamp() * 1e9) if queued is not None else now
    # A deferred job (arq `Retry`, `_defer_by`) is only due at its score (ms): waiting before that is not queueing.
    due_ns = max(queued_ns, int(ctx.get("score") or 0) * 1_000_000)
    wait = max(0, now - due_ns)
    attrs = {
        "taskloom.job": name,
        "taskloom.job_id": ctx.get("job_id"),
        "taskloom.job_try": ctx.get("job_try"),
        "taskloom.goal_id": goal_id,
        "taskloom.task_id": getattr(payload, "task_id", None),
        "taskloom.attempt": getattr(payload, "attempt", None),
        "taskloom.resume": getattr(payload, "resume", None) or None,
        "taskloom.redrive": payload.redrive or None,
        "taskloom.queue_wait_s": wait / 1e9,
    }
    tracing.queue_wait(parent, now - wait, now, name)
    return tracing.span(SPAN_NAMES.get(name, name), attrs, kind=SpanKind.CONSUMER, parent=parent)


async def _fail_corrupted(rt: Runtime, payload: JobPayload, exc: CorruptRecord) -> None:
    """Fail the goal of a job whose record is damaged, as the supervisor would (the goal's state
    field is moved by a script that does not parse the damaged record)."""
    goal_id: str = payload.goal_id  # type: ignore[attr-defined]  # every payload names its goal
    reason = f"corrupted record: {exc}"[:2000]
    with contextlib.suppress(IllegalTransition, NotFound, CorruptRecord):
        await rt.store.transition_goal(goal_id, GoalState.FAILED, reason=reason)


RETENTION_EVERY = 60.0  # seconds between retention sweeps of one planner process

# Per process: one `redis.trouble` line per kind and episode (bus.retry.Episode).
_REDIS_EPISODES: dict[str, Episode] = {}
_HINTS = {
    "memory_full": "Redis reached maxmemory and refuses writes: jobs wait and retry; raise maxmemory or free "
    "memory (docs/operations.md, 'Memory')",
    "read_only": "Redis refuses writes as a replica: point TASKLOOM_REDIS_URL at the master or use redis+sentinel://",
    "not_replicated": "no replica acknowledged a guarded write (TASKLOOM_REDIS_WAIT_REPLICAS): a replica is down or "
    "resyncing after a failover; jobs wait until enough replicas are back",
}


async def _after_failure(rt: Runtime, role: str, name: str, payload: JobPayload, exc: Exception, tries: int) -> None:
    """Decide (bus.retry) and apply: raise arq's `Retry` to run this same job again later, or fail
    the goal with a reason naming the error (returns normally: the job is over, visibly)."""
    goal_id: str = payload.goal_id  # type: ignore[attr-defined]  # every payload names its goal
    policy = rt.retry
    if isinstance(exc, ModelError):
        cause = "provider"
        now = int(time.time() * 1000)
        since = await TroubleClock(rt.redis, rt.keys).failed(goal_id, now) if exc.retryable else now
        decision = on_model_error(exc, tries, (now - since) / 1000, policy)
        detail = describe(exc)
    else:
        cause = "redis" if is_redis_trouble(exc) else "internal"
        trouble = redis_trouble(exc)
        if trouble is not None and _REDIS_EPISODES.setdefault(trouble, Episode()).seen(time.monotonic()):
            # Once per episode (every job of the fleet meets it): what it is, and what to do.
            log.error("redis.trouble", kind=trouble, error=f"{type(exc).__name__}: {exc}", hint=_HINTS.get(trouble, ""))
        if cause == "internal":
            tries = await count_job_error(rt.redis, rt.keys, rt.jobs.job_id(payload))
        decision = on_other_error(exc, tries, policy)
        detail = f"{type(exc).__name__}: {exc}"
    if isinstance(decision, GiveUp):
        log.error("job.gave_up", function=name, cause=cause, reason=decision.reason, exc_info=exc)
        observe(lambda o: o.goal_given_up(cause))
        try:
            await rt.store.transition_goal(goal_id, GoalState.FAILED, reason=decision.reason, data={"job": name})
        except (IllegalTransition, NotFound) as moved:
            log.info("job.gave_up_goal_moved_on", error=str(moved))  # it ended another way meanwhile
        return
    # Redis trouble is logged once per episode (above); each job's retry then is only detail.
    (log.info if cause == "redis" else log.warning)(
        "job.retry", function=name, cause=cause, delay=round(decision.delay, 3), error=detail
    )
    observe(lambda o: o.job_retry(role, name, cause))
    if cause == "provider":
        with contextlib.suppress(Exception):  # the event is for people; the retry matters more
            await rt.events.emit(
                Event(
                    type="goal.provider_trouble",
                    goal_id=goal_id,
                    task_id=getattr(payload, "task_id", None),
                    data={"job": name, "error": detail, "retry_in": round(decision.delay, 3), "try": tries},
                )
            )
    raise Retry(defer=decision.delay)


def worker_settings(
    role: str,
    settings: Settings,
    registry: ToolCatalog | None = None,
    stopping: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """The arq `WorkerSettings` of one role (as a dict, which arq accepts)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    keys = keys_for(settings)
    handlers = handlers_for(role, registry or ToolRegistry(), stopping)
    return {
        "functions": [_job_function(role, n, h) for n, h in handlers.items()],
        "queue_name": keys.queue(role),
        "poll_delay": settings.poll_delay,
        "max_jobs": getattr(settings, f"{role}_concurrency"),
        "job_timeout": settings.job_timeout,
        "keep_result": 3600,  # a result key blocks re-enqueueing the same deterministic job id
        # The job layer decides when to stop retrying (bus.retry); arq must never give up on its own.
        "max_tries": 1_000_000,
        "health_check_interval": 5,
        "health_check_key": keys.health_check(role),
        "handle_signals": False,  # one handler for the whole process, see run_workers
    }


def build_runtime(
    settings: Settings, redis: RedisPool, model: ModelPort | ModelRouter, registry: ToolRegistry | Catalog
) -> Runtime:
    """`model`: one model for every role and goal (tests), or the router of `make_models`."""
    ledger = make_ledger(settings, redis)
    keys = keys_for(settings)
    limits = settings.all_rate_limits()
    built = model.built() if isinstance(model, ModelRouter) else [model]
    degrade = None
    if settings.fallback_model is not None:
        router = model if isinstance(model, ModelRouter) else make_models(settings)
        fallback = router.model(settings.fallback_model)
        built.append(fallback)
        degrade = Degrade(fallback, settings.degrade_at)
    # The price of every model built so far is looked up now, not at its first call: a price from
    # genai-prices loads that library's table (about 0.1 s of CPU), which would otherwise stall
    # the event loop, and every job on it, in the middle of the first calls.
    for m in built:
        ledger.prices.priced(m.model)
    breaker = Breaker(
        redis,
        keys,
        BreakerPolicy(settings.breaker_failures, settings.breaker_window, settings.breaker_cooldown),
    )
    factory = ModelFactory(
        model,
        ledger,
        TroubleClock(redis, keys),
        limiter=RateLimiter(redis, keys, limits) if limits else None,
        events=EventLog(redis, keys, settings.events_maxlen),
        degrade=degrade,
        breaker=breaker,
    )

    return Runtime.build(
        redis,
        keys,
        settings.events_maxlen,
        models=factory,
        limits=limits_for(settings),
        tool_catalog=tuple(registry.definitions()) if isinstance(registry, ToolRegistry) else (),
        tools=registry if isinstance(registry, Catalog) else None,
        retry=RetryPolicy(patience=settings.provider_patience, cap=settings.provider_backoff_max),
        live=LivePublisher(redis, keys) if settings.stream else None,
    )


def build_workers(
    roles: Sequence[str],
    settings: Settings,
    redis: RedisPool,
    model: ModelPort | ModelRouter,
    registry: ToolRegistry | Catalog,
    burst: bool = False,
    stopping: Callable[[], bool] | None = None,
) -> tuple[Runtime, list[Worker]]:
    runtime = build_runtime(settings, redis, model, registry)
    workers: list[Worker] = [
        WakeableWorker(
            **worker_settings(role, settings, registry, stopping),
            redis_pool=redis,
            burst=burst,
            ctx={"runtime": runtime, "role": role},
            wake_key=runtime.keys.wake(role) if settings.wake else None,
            job_lease=settings.lease_ttl,
        )
        for role in roles
    ]
    return runtime, workers


async def _supervise_forever(runtime: Runtime, settings: Settings) -> None:
    """Every planner worker re-drives goals and tasks left without a live driver (planner.supervise)."""
    while True:
        try:
            n = await supervise(runtime, settings.reconcile_after)
            if n:
                log.warning("supervisor.redriven", jobs=n)
        except Exception as exc:
            log.warning("supervisor.failed", error=repr(exc))  # Redis away: the next pass retries
        await asyncio.sleep(max(0.5, min(settings.reconcile_after / 4, 5.0)))


async def _retain_forever(runtime: Runtime, retention: float) -> None:
    """Every planner worker deletes the goals that ended longer ago than `retention` (bus.retention)."""
    while True:
        try:
            n = await retention_sweep(runtime.redis, runtime.keys, retention, time.time())
            if n:
                log.info("retention.purged", goals=n)
        except Exception as exc:
            log.warning("retention.failed", error=repr(exc))  # Redis away: the next pass retries
        await asyncio.sleep(RETENTION_EVERY)


async def _recover_forever(runtime: Runtime) -> None:
    """Every executor watches for attempts whose executor died and re-enqueues them."""
    while True:
        try:
            await executor.recover_expired(runtime)
        except Exception:
            log.exception("recover.failed")
        await asyncio.sleep(max(0.2, runtime.limits.lease_ttl / 3))


async def run_workers(
    roles: Sequence[str],
    settings: Settings,
    *,
    burst: bool = False,
    stop: asyncio.Event | None = None,
    model: ModelPort | ModelRouter | None = None,
    signals: bool = True,
) -> None:
    """Run the workers of `roles` in this process until `stop` is set, a signal arrives, or (burst) the queues drain.

    `signals=False`: the caller handles SIGTERM/SIGINT (and sets `stop`), as `taskloom run --local` does."""
    stop = stop or asyncio.Event()
    owned = traced = False
    metrics_server = None
    previous_observer: Observer | None = None
    with _signals_set(stop, signals):
        try:
            traced = configure_tracing(settings, roles)
            catalog = load_tools(settings, with_mcp=bool({"planner", "executor"} & set(roles)))
            owned = model is None
            if model is None:
                model = make_models(settings)
                # The routes of this process's roles are built now: a missing key stops start-up.
                model.start(roles)
            if settings.metrics_port is not None and not burst:
                metrics_server = metrics.serve(settings.metrics_port, settings.metrics_addr)
                previous_observer = install(metrics.PrometheusObserver())
            async with (
                catalog,
                connect(
                    settings.redis_url, settings.home, settings.replica_wait, share=settings.redis_shared_connection
                ) as redis,
            ):
                # Every source is listed once now: a tool name collision stops start-up, naming both.
                await catalog.start()
                await _run_fleet(roles, settings, redis, model, catalog, burst, stop, metrics_server)
        finally:
            if traced:
                flush_traces()  # what the batch processor still holds would be lost with the process
            if metrics_server is not None:
                metrics_server.close()
            if previous_observer is not None:
                install(previous_observer)
            if owned and model is not None:
                await close_models(model)


@contextlib.contextmanager
def _signals_set(stop: asyncio.Event, signals: bool) -> Iterator[None]:
    """SIGTERM and SIGINT set `stop` while in the block (where the event loop allows handlers);
    nothing when `signals` is False."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT) if signals else ():
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def _run_fleet(
    roles: Sequence[str],
    settings: Settings,
    redis: RedisPool,
    model: ModelPort | ModelRouter,
    catalog: Catalog,
    burst: bool,
    stop: asyncio.Event,
    metrics_server: metrics.MetricsServer | None,
) -> None:
    """Run the role workers and their background tasks until stopped, then shut them down."""
    # The executors' handlers read `stop` to hand their attempts over between steps.
    runtime, workers = build_workers(roles, settings, redis, model, catalog, burst, stop.is_set)
    instance = health.instance_id()
    log.info(
        "worker.started",
        roles=list(roles),
        poll_delay=settings.poll_delay,
        embedded=settings.embedded,
        instance=instance,
        metrics_port=metrics_server.port if metrics_server else None,
        tracing=settings.tracing,
        event_loop=eventloop.running(),
    )
    # What exists now (modules, the runtime, tool definitions) lives as long as the fleet: moved out
    # of the cyclic collector's reach, so that a full collection scans only what jobs create. Left
    # in (~190,000 objects), each full collection under load paused the worker, and every job in
    # flight, for 100-250 ms; frozen, 4-5 ms (bench/RESULTS.md).
    gc.freeze()
    # The young generation is collected every `gc_threshold` new container objects, not Python's
    # 700. Whatever a job still holds at a young collection moves to an older generation and is
    # scanned again at each collection of that one: with many jobs in flight, much is still held,
    # so the older collections ran again and again, full ones scanning all the work in flight. In
    # the benchmarks (bench/RESULTS.md) the collector's CPU fell by a third to a half, and full
    # collections (150-400 ms) became rare. A young collection now takes 15-60 ms under steady
    # load, up to ~220 ms when a thousand replies arrive at once. The cost is garbage cycles
    # living a little longer.
    thresholds = gc.get_threshold()
    if settings.gc_threshold:
        gc.set_threshold(settings.gc_threshold, *thresholds[1:])
    try:
        mains = [asyncio.create_task(w.main(), name=f"arq-{r}") for w, r in zip(workers, roles, strict=True)]
        side = _background(runtime, settings, redis, roles, instance, burst, with_metrics=metrics_server is not None)
        stopper = asyncio.create_task(stop.wait())
        if burst:
            await asyncio.wait(mains, return_when=asyncio.ALL_COMPLETED)
        else:
            await asyncio.wait([*mains, stopper], return_when=asyncio.FIRST_COMPLETED)
        await _shutdown(workers, mains, [*side, stopper], settings.shutdown_grace)
        await runtime.flush_settles()  # the jobs flushed theirs; a cancelled one may have left some
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()  # the fleet is done: what it held may be collected again (tests run many fleets)
    await fleet.clear_health_checks(redis, runtime.keys, roles)
    if not burst:
        await fleet.deregister(redis, runtime.keys, roles, instance)
    for task in mains:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    log.info("worker.stopped", roles=list(roles), jobs_complete=sum(w.jobs_complete for w in workers))


def _background(
    runtime: Runtime,
    settings: Settings,
    redis: RedisPool,
    roles: Sequence[str],
    instance: str,
    burst: bool,
    *,
    with_metrics: bool,
) -> list[asyncio.Task[Any]]:
    """The process's periodic tasks: supervisor (planner), watchdog (executor), heartbeat, metrics."""
    side: list[asyncio.Task[Any]] = []
    if not burst and "planner" in roles:
        side.append(asyncio.create_task(_supervise_forever(runtime, settings)))
        if settings.retention > 0:
            side.append(asyncio.create_task(_retain_forever(runtime, settings.retention)))
    if not burst and "executor" in roles:
        side.append(asyncio.create_task(_recover_forever(runtime)))
    if not burst:
        beat = health.heartbeat_forever(redis, runtime.keys, roles, instance, settings.heartbeat_ttl)
        side.append(asyncio.create_task(beat))
    if with_metrics:
        depths = metrics.refresh_queue_depth_forever(redis, runtime.keys, settings.metrics_interval)
        side.append(asyncio.create_task(depths))
    return side


async def _shutdown(
    workers: list[Worker], mains: list[asyncio.Task[None]], side: list[asyncio.Task[Any]], grace: float
) -> None:
    for w in workers:
        w.allow_pick_jobs = False
    running = [t for w in workers for t in w.tasks.values() if not t.done()]
    if running:
        log.info("worker.draining", jobs=len(running), grace=grace)
        await asyncio.wait(running, timeout=grace)
    for t in [*mains, *side, *(t for w in workers for t in w.tasks.values())]:
        if not t.done():
            t.cancel()
    await asyncio.gather(*mains, *side, *(t for w in workers for t in w.tasks.values()), return_exceptions=True)
