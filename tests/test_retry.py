"""The job layer's retry decisions (bus.retry): backoff, patience, retry-after, give-up reasons."""

from __future__ import annotations

import random

import redis.exceptions

from bus.retry import GiveUp, RetryLater, RetryPolicy, backoff, on_model_error, on_other_error
from llm.errors import ModelTimeoutError, RetryableModelError, TerminalModelError

POLICY = RetryPolicy(patience=60, base=1, cap=8, internal_tries=3)


def test_backoff_grows_exponentially_with_jitter_and_is_capped() -> None:
    """Each try's delay lies in [c/2, c] for c = base * 2^(tries-1), capped at `cap`."""
    rng = random.Random(1)
    for tries, ceiling in [(1, 1), (2, 2), (3, 4), (4, 8), (9, 8)]:
        for _ in range(50):
            d = backoff(tries, POLICY, rng)
            assert ceiling / 2 <= d <= ceiling


def test_a_transient_error_is_retried_within_patience_honouring_retry_after() -> None:
    """A 529 with retry-after 5 s on the first try waits at least 5 s, not the 1 s backoff."""
    exc = RetryableModelError("overloaded", status=529, request_id="req_1", retry_after=5)
    decision = on_model_error(exc, 1, 0.0, POLICY)
    assert isinstance(decision, RetryLater) and decision.delay >= 5


def test_the_last_retry_lands_at_the_end_of_patience() -> None:
    """With 2 s of patience left, the delay is at most 2 s even if the backoff says 8."""
    decision = on_model_error(ModelTimeoutError("slow"), 10, 58.0, POLICY)
    assert isinstance(decision, RetryLater) and decision.delay <= 2


def test_past_patience_the_goal_gives_up_naming_the_error_and_request_id() -> None:
    """Provider trouble longer than the patience gives up with status and request id in the reason."""
    exc = RetryableModelError("Overloaded", status=529, request_id="req_abc")
    decision = on_model_error(exc, 7, 61.0, POLICY)
    assert isinstance(decision, GiveUp)
    assert "529" in decision.reason and "req_abc" in decision.reason and "patience" in decision.reason


def test_a_terminal_model_error_gives_up_at_once() -> None:
    """A 401 is not retried, whatever the patience left."""
    decision = on_model_error(TerminalModelError("bad key", status=401, request_id="req_x"), 1, 0.0, POLICY)
    assert isinstance(decision, GiveUp) and "401" in decision.reason and "req_x" in decision.reason


def test_redis_trouble_is_retried_without_limit_and_bugs_a_few_times() -> None:
    """A lost Redis connection is always retried; an unexpected exception only `internal_tries` times."""
    assert isinstance(on_other_error(redis.exceptions.ConnectionError("gone"), 100, POLICY), RetryLater)
    assert isinstance(on_other_error(KeyError("record"), 2, POLICY), RetryLater)
    gave_up = on_other_error(KeyError("record"), 3, POLICY)
    assert isinstance(gave_up, GiveUp) and "KeyError" in gave_up.reason
