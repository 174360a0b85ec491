"""Every model call a role makes goes through the goal's ledger: `ModelFactory` -> `MeteredModel`.

The roles (planner, executor, critic) never build a model: they get one from `ModelFactory.for_goal`,
which wraps the one configured `ModelPort` so that each call is reserved before and settled after.
A test scans the roles' imports to keep it that way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

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
from llm.port import ModelPort
from llm.types import ModelRequest, ModelResponse

from . import tracing
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
        inner: ModelPort,
        ledger: Ledger,
        goal_id: str,
        trouble: TroubleClock | None = None,
        limiter: RateLimiter | None = None,
        events: EventLog | None = None,
        degrade: Degrade | None = None,
    ) -> None:
        self.inner = inner
        self.ledger = ledger
        self.goal_id = goal_id
        self.trouble = trouble  # a successful call ends the goal's provider trouble (bus.retry)
        self.limiter = limiter
        self.events = events
        self.degrade = degrade
        self.name = inner.name
        self.model = inner.model

    def __repr__(self) -> str:
        return f"MeteredModel({self.inner!r}, goal_id={self.goal_id!r})"

    async def complete(self, request: ModelRequest) -> ModelResponse:
        # One span per call, the ledger's moves as its events (bus.tracing: GenAI conventions).
        with tracing.model_span(self.inner.name, self.inner.model, request) as span:
            return await self._complete(request, span)

    async def _complete(self, request: ModelRequest, span: Span) -> ModelResponse:
        estimate = estimate_input_tokens(request)
        grant: Grant | None = None
        if self.limiter is not None:
            # Before the reservation: a call waiting its turn holds no budget.
            grant = await self.limiter.acquire(self.inner.model, self.goal_id, estimate, request.max_tokens)
            if grant is not None and grant.waited > 0.01:
                await self._rate_waited(grant)
        try:
            reservation = await self.ledger.reserve(self.goal_id, estimate, request.max_tokens, model=self.inner.model)
        except BudgetExhausted as exc:
            observe(lambda o: o.budget_refused(self.inner.model))
            span.add_event("ledger.refused", tracing.clean({"requested": getattr(exc, "requested", None)}))
            if grant is not None and self.limiter is not None:
                await _shielded(self.limiter.settle(grant, 0, 0))
            raise
        span.add_event("ledger.reserve", {"reserved": reservation.amount})
        if reservation.max_tokens != request.max_tokens:
            # The output alone can then never overrun the budget: the provider stops at max_tokens.
            request = request.model_copy(update={"max_tokens": reservation.max_tokens})
            span.set_attribute("gen_ai.request.max_tokens", reservation.max_tokens)
        inner = await self._model_for(reservation)
        response: ModelResponse | None = None
        failure: BaseException | None = None
        started = time.perf_counter()
        try:
            response = await inner.complete(request)
            tracing.model_response(span, response)
            return response
        except BaseException as exc:  # cancellation included: classified in `_close`, re-raised
            failure = exc
            raise
        finally:
            self._observe(response, failure, time.perf_counter() - started)
            # Shielded: a second cancellation must not stop the write (the reservation would still
            # be forfeited when it expires, but its tokens would be held until then).
            await _shielded(self._close(reservation, response, failure))
            if grant is not None:
                await _shielded(self._after_rate(grant, response, failure))
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

    async def _after_rate(self, grant: Grant, response: ModelResponse | None, failure: BaseException | None) -> None:
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
                await self.limiter.throttled(self.inner.model, failure.retry_after)
            elif info is not None and info.throttled:
                await self.limiter.throttled(self.inner.model, info.retry_after)
            if info is not None:
                await self.limiter.observe_remaining(
                    self.inner.model, info.requests_remaining, info.input_tokens_remaining, info.output_tokens_remaining
                )
        except Exception as exc:
            log.warning("ratelimit.settle_failed", goal_id=self.goal_id, error=repr(exc))

    def _observe(self, response: ModelResponse | None, failure: BaseException | None, seconds: float) -> None:
        # Labelled with the configured model id (bounded), not the id the provider echoes back.
        model = self.inner.model
        if response is not None:
            micro = self.ledger.prices.cost(response.model, response.usage)
            cost = None if micro is None else micro / 1_000_000
            observe(lambda o: o.model_call(model, "ok", seconds, response.usage, cost))
        elif failure is not None:
            kind = error_kind(failure)
            observe(lambda o: o.model_call(model, kind, seconds, None, None))

    async def _close(
        self, reservation: Reservation, response: ModelResponse | None, failure: BaseException | None
    ) -> None:
        try:
            if response is not None:
                # The success also ends the goal's provider trouble, in the settle's own write.
                end_trouble = self.trouble is not None
                await self.ledger.settle(reservation, response.usage, model=response.model, end_trouble=end_trouble)
            elif failure is not None and nothing_billed(failure):
                await self.ledger.release(reservation)
            else:
                await self.ledger.forfeit(reservation)
        except Exception as exc:
            # The call's result (or error) matters more than this write: the reservation stays open
            # and is forfeited at its full amount when it expires, which errs on the safe side.
            log.warning("ledger.close_failed", goal_id=self.goal_id, reservation=reservation.id, error=repr(exc))


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
    """The one place the roles get a model from: always the configured model, metered per goal."""

    def __init__(
        self,
        inner: ModelPort,
        ledger: Ledger,
        trouble: TroubleClock | None = None,
        limiter: RateLimiter | None = None,
        events: EventLog | None = None,
        degrade: Degrade | None = None,
    ) -> None:
        if isinstance(inner, MeteredModel) or (degrade is not None and isinstance(degrade.fallback, MeteredModel)):
            raise TypeError("ModelFactory wraps the provider's model, not an already metered one")
        self._inner = inner
        self._ledger = ledger
        self._trouble = trouble
        self._limiter = limiter
        self._events = events
        self._degrade = degrade

    @property
    def model(self) -> str:
        return self._inner.model

    def for_goal(self, goal_id: str) -> MeteredModel:
        return MeteredModel(
            self._inner, self._ledger, goal_id, self._trouble, self._limiter, self._events, self._degrade
        )
