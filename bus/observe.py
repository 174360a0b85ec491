"""Operational hooks: what the workers report about their work, for metrics.

The roles and `bus` call `observe(lambda o: o.<hook>(...))`; the composition root installs an
implementation (`taskloom.metrics` exports them to Prometheus). The default observer does nothing,
so roles never import a metrics library and tests need no set-up.

Rules every hook follows (as dramatiq's middleware does): it is cheap, synchronous, and it never
breaks the work it observes: `observe` logs a failing hook and carries on. Label values a hook
receives are bounded (a role, a job function, a model id, a tool name from the loaded toolkits, an
outcome from a fixed list), never a goal or task id.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from llm.types import Usage

log = structlog.get_logger("taskloom.observe")


class Observer:
    """No-op hooks; subclass and override what you need."""

    def job_started(self, role: str, function: str) -> None:
        """An arq job of `function` started on a `role` worker."""

    def job_finished(self, role: str, function: str, outcome: str, seconds: float) -> None:
        """It ended: `outcome` is ok, failed or cancelled."""

    def task_run(self, outcome: str, seconds: float) -> None:
        """One run of a task attempt's loop ended (a resumed attempt has several runs). `outcome` is
        the result's stop reason, or paused, handover or lease_lost."""

    def step(self, seconds: float) -> None:
        """One executor step (model turn and its tool calls) was stored."""

    def model_call(self, model: str, outcome: str, seconds: float, usage: Usage | None, cost_usd: float | None) -> None:
        """A model call ended: `outcome` is ok or an error kind (see `bus.metered.error_kind`)."""

    def model_failover(self, from_model: str, to_model: str, cause: str) -> None:
        """A call moved from `from_model` to the next model of its chain (`cause`: the error's kind)."""

    def breaker_opened(self, model: str) -> None:
        """`model` failed often enough that every worker skips it for a cool-down."""

    def budget_refused(self, model: str) -> None:
        """The ledger refused a call's reservation: nothing was sent."""

    def rate_limit_wait(self, bucket: str, seconds: float) -> None:
        """A call waited `seconds` for its turn in the fleet's rate limit `bucket` (bus.ratelimit)."""

    def tool_call(self, tool: str, outcome: str, seconds: float) -> None:
        """A tool call ended with `outcome` (executor.gateway's outcome names)."""

    def job_retry(self, role: str, function: str, cause: str) -> None:
        """A job will run again later (`bus.retry`): `cause` is provider, redis or internal."""

    def goal_given_up(self, cause: str) -> None:
        """The job layer failed a goal: `cause` is provider (patience over or terminal error) or internal."""

    def redrive(self, job: str) -> None:
        """The supervisor re-drove a stranded goal or task with a `job` job."""


_current = Observer()


def install(observer: Observer) -> Observer:
    """Make `observer` this process's observer; returns the previous one (to restore it)."""
    global _current
    previous, _current = _current, observer
    return previous


def observe(hook: Callable[[Observer], None]) -> None:
    """Call one hook on the installed observer; a failing hook is logged, never raised."""
    try:
        hook(_current)
    except Exception:
        log.warning("observe.hook_failed", exc_info=True)
