"""Every model call a role makes goes through the goal's ledger: `ModelFactory` -> `MeteredModel`.

The roles (planner, executor, critic) never build a model: they get one from `ModelFactory.for_goal`,
which wraps the one configured `ModelPort` so that each call is reserved before and settled after.
A test scans the roles' imports to keep it that way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import structlog

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

from .ledger import BudgetExhausted, Ledger, Reservation
from .observe import observe
from .retry import TroubleClock

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


class MeteredModel:
    """A `ModelPort` that reserves each call's worst case in the goal's ledger and settles it after.

    `complete` raises what the inner model raises, plus `bus.ledger.BudgetExhausted` (nothing was
    sent) and `bus.ledger.LedgerNotFound` (the goal's books were never opened).
    """

    def __init__(self, inner: ModelPort, ledger: Ledger, goal_id: str, trouble: TroubleClock | None = None) -> None:
        self.inner = inner
        self.ledger = ledger
        self.goal_id = goal_id
        self.trouble = trouble  # a successful call ends the goal's provider trouble (bus.retry)
        self.name = inner.name
        self.model = inner.model

    def __repr__(self) -> str:
        return f"MeteredModel({self.inner!r}, goal_id={self.goal_id!r})"

    async def complete(self, request: ModelRequest) -> ModelResponse:
        try:
            reservation = await self.ledger.reserve(
                self.goal_id, estimate_input_tokens(request), request.max_tokens, model=self.inner.model
            )
        except BudgetExhausted:
            observe(lambda o: o.budget_refused(self.inner.model))
            raise
        if reservation.max_tokens != request.max_tokens:
            # The output alone can then never overrun the budget: the provider stops at max_tokens.
            request = request.model_copy(update={"max_tokens": reservation.max_tokens})
        response: ModelResponse | None = None
        failure: BaseException | None = None
        started = time.perf_counter()
        try:
            response = await self.inner.complete(request)
            return response
        except BaseException as exc:  # cancellation included: classified in `_close`, re-raised
            failure = exc
            raise
        finally:
            self._observe(response, failure, time.perf_counter() - started)
            # Shielded: a second cancellation must not stop the write (the reservation would still
            # be forfeited when it expires, but its tokens would be held until then).
            await _shielded(self._close(reservation, response, failure))

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
                await self.ledger.settle(reservation, response.usage, model=response.model)
                if self.trouble is not None:
                    await self.trouble.succeeded(self.goal_id)
            elif failure is not None and nothing_billed(failure):
                await self.ledger.release(reservation)
            else:
                await self.ledger.forfeit(reservation)
        except Exception as exc:
            # The call's result (or error) matters more than this write: the reservation stays open
            # and is forfeited at its full amount when it expires, which errs on the safe side.
            log.warning("ledger.close_failed", goal_id=self.goal_id, reservation=reservation.id, error=repr(exc))


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

    def __init__(self, inner: ModelPort, ledger: Ledger, trouble: TroubleClock | None = None) -> None:
        if isinstance(inner, MeteredModel):
            raise TypeError("ModelFactory wraps the provider's model, not an already metered one")
        self._inner = inner
        self._ledger = ledger
        self._trouble = trouble

    @property
    def model(self) -> str:
        return self._inner.model

    def for_goal(self, goal_id: str) -> MeteredModel:
        return MeteredModel(self._inner, self._ledger, goal_id, self._trouble)
