"""Every model call a role makes goes through the goal's ledger: `ModelFactory` -> `MeteredModel`.

The roles (planner, executor, critic) never build a model: they get one from `ModelFactory.for_goal`,
which wraps the one configured `ModelPort` so that each call is reserved before and settled after.
A test scans the roles' imports to keep it that way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import structlog
from opentelemetry.trace import Span

from llm.errors import (
    ModelConfigError,
    ModelConnectionError,
    ModelError,
    ModelTimeoutError,
    RetryableModelError,
    TerminalModelError,
)
from llm.estimate import estimate_input_tokens
from llm.port import ModelPort, TextSink
from llm.types import ModelRequest, ModelResponse

from . import tracing
from .breaker import Breaker, BreakerState, gate
from .events import EventLog
from .ledger import BudgetExhausted, Ledger, Reservation
from .observe import observe
from .ratelimit import Grant, RateLimiter
from .retry import TroubleClock
from .schemas import Event

log = structlog.get_logger("taskloom.ledger")


def nothing_billed(exc: BaseException) -> bool:
    """True when the failed call cannot have been billed, so its reservation may be released.

    A `ModelError` says so itself (`maybe_spent`): false for a refused connection, and for an error
    status the provider answered, because providers bill nothing for an error response. It is true
    for a timeout or a dropped connection after the request went out (the work may have been done),
    and for any error after an earlier attempt that may have been billed. Anything else (a
    cancellation, a bug) is an unknown outcome: counted as spent, never as free.
    """
    return isinstance(exc, ModelError) and not exc.maybe_spent


def error_kind(exc: BaseException) -> str:
    """A bounded label for a failed call (metrics): what kind of failure, never its message."""
    kinds: tuple[tuple[type[BaseException], str], ...] = (
        (ModelTimeoutError, "timeout"),
        (ModelConnectionError, "connection"),
        (RetryableModelError, "retryable"),
        (ModelConfigError, "config"),
        (TerminalModelError, "terminal"),
        (ModelError, "model_error"),
        (asyncio.CancelledError, "cancelled"),
    )
    return next((kind for cls, kind in kinds if isinstance(exc, cls)), "other")


class LiveSink(TextSink, Protocol):
    """A text sink that delivers elsewhere (`bus.live.LiveCall`): told when its text so far is void
    (a failover's next model writes the reply anew), and flushed when the reply is complete, before
    the call's own events (`model.serving`, ...), so that a watcher reads the words first."""

    def restart(self) -> None: ...

    async def flush(self) -> None: ...


def live_sink(on_text: TextSink | None) -> LiveSink | None:
    """`on_text` if it is a `LiveSink` (it has `restart` and `flush`), else None. Checked by its
    attributes: an isinstance against a runtime-checkable protocol took ~14 µs of CPU on Python 3.11,
    at every model call."""
    if on_text is not None and hasattr(on_text, "restart") and hasattr(on_text, "flush"):
        return cast(LiveSink, on_text)
    return None


@dataclass(frozen=True)
class ModelRoute:
    """Where one role's calls for a goal go: `chain[0]`, then each fallback in order. `labels` name
    them as configured (an alias of the models file, or a model id), for events and status."""

    chain: tuple[ModelPort, ...]
    labels: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.chain:
            raise ValueError("a model route needs at least one model")
        if not self.labels:
            object.__setattr__(self, "labels", tuple(m.model for m in self.chain))
        if len(self.labels) != len(self.chain):
            raise ValueError("a model route needs one label per model")

    @classmethod
    def of(cls, model: ModelPort) -> ModelRoute:
        return cls((model,))


class Router(Protocol):
    """Picks the route of a role's calls for a goal (`choice`: the model alias the goal asked for)."""

    def route(self, role: str | None, choice: str | None) -> ModelRoute: ...


def fails_over(exc: BaseException) -> bool:
    """A failed call moves to the next model of its chain when trying again might succeed elsewhere:
    a retryable error (429, 5xx, 529 overloaded, timeout, refused connection). A streamed reply cut
    midway is such an error too: the next model writes it anew (its sink is told to restart), and
    the cut call's reservation is forfeited (its tokens may have been billed). A terminal error (a bad request,
    a refused key) would only fail again, differently: it is raised."""
    return isinstance(exc, ModelError) and exc.retryable


def candidates(states: Sequence[BreakerState], cooldown: float) -> list[tuple[int, str]]:
    """The chain positions to try, in order, each with its gate (`call` or `probe`): the models whose
    breaker is open (or being probed by another worker) are left out."""
    out: list[tuple[int, str]] = []
    for i, state in enumerate(states):
        g = gate(state, cooldown)
        if g != "skip":
            out.append((i, g))
    return out


@dataclass(frozen=True)
class Degrade:
    """Switch a goal's later calls to `fallback` once it (or its tenant's pool) has spent `at` of
    its budget (tokens or dollars, whichever is further along)."""

    fallback: ModelPort
    at: float = 0.8


class MeteredModel:
    """A `ModelPort` that reserves each call's worst case in the goal's ledger and settles it after.

    With a `RateLimiter`, each call first waits for its turn in the fleet's buckets (`bus.ratelimit`);
    with a `Degrade`, a goal past its threshold calls the fallback model instead.

    `complete` raises what the inner model raises, plus `bus.ledger.BudgetExhausted` (nothing was
    sent) and `bus.ledger.LedgerNotFound` (the goal's books were never opened).
    """

    def __init__(
        self,
        inner: ModelPort | ModelRoute,
        ledger: Ledger,
        goal_id: str,
        trouble: TroubleClock | None = None,
        limiter: RateLimiter | None = None,
        events: EventLog | None = None,
        degrade: Degrade | None = None,
        breaker: Breaker | None = None,
        role: str | None = None,
        hold_settles: bool = False,
    ) -> None:
        """`hold_settles`: a call that succeeds has its settle held, to ride on the process's next
        write that carries held settles, or its next reserve (`Ledger.settle_later`); whoever holds
        such a model awaits `Ledger.flush` before storing what the calls produced. The served model
        and the end of provider trouble are written with the settle; a change of the served model
        is announced (`model.serving`) once the settle ran."""
        self.route = inner if isinstance(inner, ModelRoute) else ModelRoute.of(inner)
        self.inner = self.route.chain[0]
        self.breaker = breaker
        self.role = role
        self.ledger = ledger
        self.goal_id = goal_id
        self.trouble = trouble  # a successful call ends the goal's provider trouble (bus.retry)
        self.limiter = limiter
        self.events = events
        self.degrade = degrade
        self.name = self.inner.name
        self.model = self.inner.model
        self.hold_settles = hold_settles

    def __repr__(self) -> str:
        return f"MeteredModel({self.inner!r}, goal_id={self.goal_id!r})"

    async def complete(self, request: ModelRequest, on_text: TextSink | None = None) -> ModelResponse:
        """`on_text`: told the reply's text as it streams (`llm.port.TextSink`); the reservation,
        the settle and the response are those of a plain call."""
        # One span per call, the ledger's moves as its events (bus.tracing: GenAI conventions).
        with tracing.model_span(self.inner.name, self.inner.model, request) as span:
            if len(self.route.chain) == 1 or self.breaker is None:
                return await self._complete(
                    self.inner, self.route.labels[0], request, span, first=True, on_text=on_text
                )
            return await self._failover(request, span, on_text)

    async def _failover(self, request: ModelRequest, span: Span, on_text: TextSink | None = None) -> ModelResponse:
        """Try the chain in order, skipping models whose fleet-wide breaker is open; a retryable
        failure moves to the next model at once. Raises the last failure when every model failed
        (the job layer's patience then applies), or a `RetryableModelError` when all are cooling down."""
        assert self.breaker is not None
        chain, labels = self.route.chain, self.route.labels
        policy = self.breaker.policy
        try:
            states = await self.breaker.states([m.model for m in chain])
        except Exception as exc:  # the breaker is advice: without it, every model is tried
            log.warning("breaker.read_failed", goal_id=self.goal_id, error=repr(exc))
            states = [BreakerState() for _ in chain]
        plan = candidates(states, policy.cooldown)
        failure: ModelError | None = None
        for n, (i, kind) in enumerate(plan):
            model = chain[i]
            if kind == "probe" and not await self.breaker.claim_probe(model.model):
                continue
            live = live_sink(on_text)
            if failure is not None and live is not None:
                live.restart()  # the failed model may have streamed part of its reply
            try:
                response = await self._complete(model, labels[i], request, span, first=i == 0, on_text=on_text)
            except ModelError as exc:
                if not fails_over(exc):
                    raise
                failure = exc
                await _shielded(self._breaker_failed(model.model))
                later = [(j, k) for j, k in plan[n + 1 :]]
                if later:
                    await self._failed_over(labels[i], model, labels[later[0][0]], chain[later[0][0]], exc)
                continue
            if not states[i].clean or kind == "probe":
                await _shielded(self._breaker_succeeded(model.model))
            return response
        if failure is not None:
            raise failure
        waits = [s.open_until - s.now for s in states if s.open_until > s.now]
        raise RetryableModelError(
            f"every model of the chain ({', '.join(labels)}) is cooling down after repeated failures",
            retry_after=max(0.0, min(waits)) if waits else policy.cooldown,
        )

    async def _breaker_failed(self, model: str) -> None:
        assert self.breaker is not None
        try:
            if await self.breaker.failed(model):
                log.warning("breaker.opened", goal_id=self.goal_id, model=model, cooldown=self.breaker.policy.cooldown)
                observe(lambda o: o.breaker_opened(model))
        except Exception as exc:
            log.warning("breaker.write_failed", goal_id=self.goal_id, error=repr(exc))

    async def _breaker_succeeded(self, model: str) -> None:
        assert self.breaker is not None
        try:
            await self.breaker.succeeded(model)
        except Exception as exc:
            log.warning("breaker.write_failed", goal_id=self.goal_id, error=repr(exc))

    async def _failed_over(
        self, from_label: str, from_model: ModelPort, to_label: str, to_model: ModelPort, exc: ModelError
    ) -> None:
        kind = error_kind(exc)
        data = {
            "from": from_label,
            "to": to_label,
            "from_model": from_model.model,
            "to_model": to_model.model,
            "error": kind,
            "status": exc.status,
            "request_id": exc.request_id,
            "role": self.role,
        }
        log.warning("model.failover", goal_id=self.goal_id, **data)
        observe(lambda o: o.model_failover(from_model.model, to_model.model, kind))
        await self._emit("model.failover", {k: v for k, v in data.items() if v is not None})

    async def _complete(
        self,
        model: ModelPort,
        label: str,
        request: ModelRequest,
        span: Span,
        *,
        first: bool,
        on_text: TextSink | None = None,
    ) -> ModelResponse:
        """One call to `model`: its rate-limit turn, its reservation (priced for it), the call, and
        the close. `first`: the chain's first model, which a goal past its degrade threshold swaps
        for the fallback."""
        estimate = estimate_input_tokens(request)
        grant: Grant | None = None
        if self.limiter is not None:
            # Before the reservation: a call waiting its turn holds no budget.
            grant = await self.limiter.acquire(model.model, self.goal_id, estimate, request.max_tokens)
            if grant is not None and grant.waited > 0.01:
                await self._rate_waited(grant)
        try:
            reservation = await self.ledger.reserve(self.goal_id, estimate, request.max_tokens, model=model.model)
        except BudgetExhausted as exc:
            observe(lambda o: o.budget_refused(model.model))
            span.add_event("ledger.refused", tracing.clean({"requested": getattr(exc, "requested", None)}))
            if grant is not None and self.limiter is not None:
                await _shielded(self.limiter.settle(grant, 0, 0))
            raise
        span.add_event("ledger.reserve", {"reserved": reservation.amount})
        if reservation.max_tokens != request.max_tokens:
            # The output alone can then never overrun the budget: the provider stops at max_tokens.
            request = request.model_copy(update={"max_tokens": reservation.max_tokens})
            span.set_attribute("gen_ai.request.max_tokens", reservation.max_tokens)
        inner = await self._model_for(reservation) if first else model
        if inner is not model:
            label = inner.model
        response: ModelResponse | None = None
        failure: BaseException | None = None
        started = time.perf_counter()
        try:
            # Without a sink, the one-argument call: a model that cannot stream is still a ModelPort.
            response = await (inner.complete(request) if on_text is None else inner.complete(request, on_text))
            tracing.model_response(span, response)
            return response
        except BaseException as exc:  # cancellation included: classified in `_close`, re-raised
            failure = exc
            raise
        finally:
            live = live_sink(on_text)
            if live is not None:
                await live.flush()
            self._observe(inner, response, failure, time.perf_counter() - started)
            # Shielded: a second cancellation must not stop the write (the reservation would still
            # be forfeited when it expires, but its tokens would be held until then).
            hold = self.hold_settles and not span.is_recording()  # a recording span reads the books after
            await _shielded(self._close(reservation, response, failure, inner, label, hold))
            if grant is not None:
                await _shielded(self._after_rate(model, grant, response, failure))
            if span.is_recording() and not isinstance(failure, asyncio.CancelledError):
                await self._ledger_event(span, *_closed_as(reservation, response, failure))

    async def _ledger_event(self, span: Span, name: str, attrs: dict[str, int]) -> None:
        """How the reservation closed, with the goal's headroom after it (read only when the span records)."""
        try:
            attrs = {**attrs, "headroom": (await self.ledger.snapshot(self.goal_id)).headroom}
        except Exception:  # a missing read costs the event one number, never the call
            pass
        span.add_event(name, attrs)

    async def _model_for(self, reservation: Reservation) -> ModelPort:
        """The fallback once the goal or its tenant has spent past the threshold, else the model."""
        d = self.degrade
        if d is None or reservation.spent_fraction < d.at or d.fallback.model == self.inner.model:
            return self.inner
        # One event per goal: the first call past the threshold marks the goal's books.
        books = self.ledger.keys.ledger(self.goal_id)
        first = await self.ledger.redis.hsetnx(books, "degraded", d.fallback.model)  # type: ignore[misc]
        if first:
            log.warning(
                "goal.degraded", goal_id=self.goal_id, to=d.fallback.model, spent_fraction=reservation.spent_fraction
            )
            await self._emit(
                "goal.degraded",
                {
                    "from": self.inner.model,
                    "to": d.fallback.model,
                    "spent_fraction": reservation.spent_fraction,
                    "threshold": d.at,
                },
            )
        return d.fallback

    async def _serving(self, label: str, inner: ModelPort) -> None:
        """The event of a role's calls for the goal moving to a model: its first call, or a failover
        (the ledger's close says so, in the settle's own write: no read of its own)."""
        await self._emit("model.serving", {"role": self.role, "model": label, "model_id": inner.model})

    def _served_later(self, closed: int, label: str, inner: ModelPort) -> None:
        """A held settle closed; if it changed the served model (the role's first call for the goal,
        or a failover), the event goes out in the background."""
        if closed == 2:
            task = asyncio.ensure_future(self._serving(label, inner))
            _background.add(task)
            task.add_done_callback(_background.discard)

    async def _rate_waited(self, grant: Grant) -> None:
        observe(lambda o: o.rate_limit_wait(grant.bucket, grant.waited))
        await self._emit("model.rate_limited", {"bucket": grant.bucket, "waited": round(grant.waited, 3)})

    async def _emit(self, kind: str, data: dict[str, Any]) -> None:
        if self.events is None:
            return
        try:
            await self.events.emit(Event(type=kind, goal_id=self.goal_id, data=data))
        except Exception as exc:  # the event is for people; the call matters more
            log.warning("event.emit_failed", goal_id=self.goal_id, type=kind, error=repr(exc))

    async def _after_rate(
        self, model: ModelPort, grant: Grant, response: ModelResponse | None, failure: BaseException | None
    ) -> None:
        """Give the buckets back what the call did not use, and learn from the provider's answer."""
        assert self.limiter is not None
        try:
            info = response.rate_limit if response is not None else None
            if response is not None:
                u = response.usage
                used_input = u.input_tokens + u.cache_read_tokens + u.cache_write_tokens
                await self.limiter.settle(grant, used_input, u.output_tokens)
            elif failure is not None and nothing_billed(failure):
                await self.limiter.settle(grant, 0, 0)
            if isinstance(failure, ModelError) and failure.status == 429:
                await self.limiter.throttled(model.model, failure.retry_after)
            elif info is not None and info.throttled:
                await self.limiter.throttled(model.model, info.retry_after)
            if info is not None:
                await self.limiter.observe_remaining(
                    model.model, info.requests_remaining, info.input_tokens_remaining, info.output_tokens_remaining
                )
        except Exception as exc:
            log.warning("ratelimit.settle_failed", goal_id=self.goal_id, error=repr(exc))

    def _observe(
        self, inner: ModelPort, response: ModelResponse | None, failure: BaseException | None, seconds: float
    ) -> None:
        # Labelled with the configured model id (bounded), not the id the provider echoes back.
        model = inner.model
        if response is not None:
            micro = self.ledger.prices.cost(_priced_as(inner, response), response.usage)
            cost = None if micro is None else micro / 1_000_000
            observe(lambda o: o.model_call(model, "ok", seconds, response.usage, cost))
        elif failure is not None:
            kind = error_kind(failure)
            observe(lambda o: o.model_call(model, kind, seconds, None, None))

    async def _close(
        self,
        reservation: Reservation,
        response: ModelResponse | None,
        failure: BaseException | None,
        inner: ModelPort,
        label: str,
        hold: bool = False,
    ) -> None:
        try:
            served = (self.role, label) if self.role is not None else None
            # A success also ends the goal's provider trouble, in the settle's own write.
            end_trouble = self.trouble is not None
            if response is not None and not response.usage_reported:
                # No usage in the reply (some local servers): the worst case, flagged; never free.
                log.warning("ledger.usage_unknown", goal_id=self.goal_id, model=inner.model)
                closed = await self.ledger.settle_unknown(reservation, end_trouble=end_trouble, served=served)
                if closed == 2:
                    await self._serving(label, inner)
            elif response is not None and hold:
                await self.ledger.settle_later(
                    reservation,
                    response.usage,
                    model=_priced_as(inner, response),
                    end_trouble=end_trouble,
                    served=served,
                    then=lambda closed: self._served_later(closed, label, inner),
                )
            elif response is not None:
                closed = await self.ledger.settle(
                    reservation,
                    response.usage,
                    model=_priced_as(inner, response),
                    end_trouble=end_trouble,
                    served=served,
                )
                if closed == 2:
                    await self._serving(label, inner)
            elif failure is not None and nothing_billed(failure):
                await self.ledger.release(reservation)
            else:
                await self.ledger.forfeit(reservation)
        except Exception as exc:
            # The call's result (or error) matters more than this write: the reservation stays open
            # and is forfeited at its full amount when it expires, which errs on the safe side.
            log.warning("ledger.close_failed", goal_id=self.goal_id, reservation=reservation.id, error=repr(exc))


def _priced_as(inner: ModelPort, response: ModelResponse) -> str:
    """The model id a call is priced at: the one the provider says served it when it names a
    version of the configured model (a dated Claude id), else the configured one (a local server's
    own name for it, an Azure deployment's underlying model: prices are configured for our id)."""
    return response.model if response.model.startswith(inner.model) else inner.model


def _closed_as(
    reservation: Reservation, response: ModelResponse | None, failure: BaseException | None
) -> tuple[str, dict[str, int]]:
    """The span event of how `_close` closes the reservation (the same rule): reserved and settled."""
    reserved = reservation.amount
    if response is not None:
        return "ledger.settle", {"reserved": reserved, "settled": response.usage.total}
    if failure is not None and nothing_billed(failure):
        return "ledger.release", {"reserved": reserved, "settled": 0}
    return "ledger.forfeit", {"reserved": reserved, "settled": reserved}


# Strong references to close-writes that outlive a cancelled caller (the loop keeps only weak ones).
_background: set[asyncio.Task[None]] = set()


async def _shielded(coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` to the end even if the caller is cancelled meanwhile (it then ends in the background)."""
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    await asyncio.shield(task)


class ModelFactory:
    """The one place the roles get a model from: the configured route, metered per goal.

    `inner` is one model for every role and goal, or a `Router` that picks a route per role and per
    goal choice (the models file's aliases, per-role models, fallback chains)."""

    def __init__(
        self,
        inner: ModelPort | Router,
        ledger: Ledger,
        trouble: TroubleClock | None = None,
        limiter: RateLimiter | None = None,
        events: EventLog | None = None,
        degrade: Degrade | None = None,
        breaker: Breaker | None = None,
    ) -> None:
        if isinstance(inner, MeteredModel) or (degrade is not None and isinstance(degrade.fallback, MeteredModel)):
            raise TypeError("ModelFactory wraps the provider's model, not an already metered one")
        self._router: Router | None = None
        self._route: ModelRoute | None = None  # one route for every role and goal, or a router
        if isinstance(inner, ModelPort):
            self._route = ModelRoute.of(inner)
        else:
            self._router = inner
        self._ledger = ledger
        self._trouble = trouble
        self._limiter = limiter
        self._events = events
        self._degrade = degrade
        self._breaker = breaker

    def _route_of(self, role: str | None = None, choice: str | None = None) -> ModelRoute:
        if self._route is not None:
            return self._route
        assert self._router is not None
        return self._router.route(role, choice)

    @property
    def model(self) -> str:
        return self._route_of().chain[0].model

    @property
    def ledger(self) -> Ledger:
        """The ledger every model this factory hands out goes through."""
        return self._ledger

    def for_goal(
        self, goal_id: str, role: str | None = None, choice: str | None = None, *, hold_settles: bool = False
    ) -> MeteredModel:
        """The metered model of `role`'s calls for the goal (`choice`: the alias the goal asked for).
        Raises `ModelConfigError` when `choice` is no configured alias. `hold_settles`: see
        `MeteredModel`; the caller then flushes the ledger before it stores a result."""
        return MeteredModel(
            self._route_of(role, choice),
            self._ledger,
            goal_id,
            self._trouble,
            self._limiter,
            self._events,
            self._degrade,
            self._breaker,
            role,
            hold_settles,
        )
