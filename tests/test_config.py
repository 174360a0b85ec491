"""Settings from TASKLOOM_* variables, and key naming under a prefix."""

from __future__ import annotations

import asyncio

import pytest

from bus.keys import Keys
from llm.types import Message, ModelRequest
from taskloom.settings import Settings, SettingsError, load_settings


def test_defaults_load_with_an_empty_environment() -> None:
    """No variables set: embedded Redis, the demo model, wake-ups on (the poll is only a fallback)."""
    s = load_settings()
    assert s.embedded and s.redis_url is None and s.model == "demo" and s.wake and s.poll_delay <= 1


@pytest.mark.parametrize(
    ("var", "value", "expect"),
    [
        ("TASKLOOM_POLL_DELAY", "soon", "TASKLOOM_POLL_DELAY"),
        ("TASKLOOM_POLL_DELAY", "-1", "greater than 0"),
        ("TASKLOOM_REDIS_URL", "http://localhost:6379", "redis://"),
        ("TASKLOOM_EXECUTOR_CONCURRENCY", "0", "TASKLOOM_EXECUTOR_CONCURRENCY"),
        ("TASKLOOM_DEFAULT_BUDGET_TOKENS", "lots", "TASKLOOM_DEFAULT_BUDGET_TOKENS"),
        ("TASKLOOM_KEY_PREFIX", "has space", "TASKLOOM_KEY_PREFIX"),
        ("TASKLOOM_DEMO_LATENCY", "-1", "TASKLOOM_DEMO_LATENCY"),
        ("TASKLOOM_DEMO_LATENCY", "inf", "TASKLOOM_DEMO_LATENCY"),
        ("TASKLOOM_LEDGER_SETTLE_DELAY", "-0.1", "TASKLOOM_LEDGER_SETTLE_DELAY"),
        ("TASKLOOM_LEDGER_SETTLE_DELAY", "soon", "TASKLOOM_LEDGER_SETTLE_DELAY"),
    ],
)
def test_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, var: str, value: str, expect: str) -> None:
    """Each bad value stops start-up with a message naming the variable and what was expected."""
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError) as exc:
        load_settings()
    assert var in str(exc.value) and expect in str(exc.value)


def test_a_settle_delay_must_be_shorter_than_a_reservations_life() -> None:
    """A settle held longer than its reservation lives would find it forfeited in full: refused at
    start-up, naming both variables."""
    below = r"TASKLOOM_LEDGER_SETTLE_DELAY .* must be below TASKLOOM_LEDGER_RESERVATION_TTL"
    with pytest.raises(SettingsError, match=below):
        load_settings(ledger_settle_delay=30, ledger_reservation_ttl=20)
    assert load_settings(ledger_settle_delay=0).ledger_settle_delay == 0


def test_variables_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Values given in the environment reach the settings, typed."""
    monkeypatch.setenv("TASKLOOM_REDIS_URL", "redis://127.0.0.1:6379/3")
    monkeypatch.setenv("TASKLOOM_POLL_DELAY", "0.2")
    s = load_settings()
    assert s.redis_url == "redis://127.0.0.1:6379/3" and s.poll_delay == 0.2 and not s.embedded


async def test_the_demo_model_takes_the_configured_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    """TASKLOOM_DEMO_LATENCY reaches the demo model the workers build: a call takes that long."""
    from taskloom.workers import make_inner_model

    monkeypatch.setenv("TASKLOOM_DEMO_LATENCY", "0.3")
    model = make_inner_model(load_settings())
    loop = asyncio.get_running_loop()
    started = loop.time()
    await model.complete(ModelRequest(messages=[Message.user("hello")], max_tokens=100))
    assert loop.time() - started >= 0.3


def test_every_key_carries_the_prefix() -> None:
    """Two deployments with different prefixes share no key, queue or job id."""
    a, b = Keys(prefix="a:"), Keys(prefix="b:")

    def all_keys(k: Keys) -> set[str]:
        return {
            k.queue("planner"),
            k.queue("executor"),
            k.queue("critic"),
            k.health_check("critic"),
            k.job_id("execute", "g", "t", 1),
            k.goal("g"),
            k.tasks("g"),
            k.plan("g", 1),
            k.results("g"),
            k.goal_events("g"),
            k.goal_index(),
            k.submitted_index(),
            k.global_events(),
            k.ledger("g"),
        }

    assert all(x.startswith("a:") for x in all_keys(a))
    assert not all_keys(a) & all_keys(b)
    with pytest.raises(ValueError, match="unknown role"):
        a.queue("janitor")


def test_every_limit_is_a_setting_with_the_same_default() -> None:
    """Each field of bus.runtime.Limits can be set by a TASKLOOM_ variable, and defaults agree."""
    from bus.runtime import Limits
    from taskloom.workers import limits_for

    assert set(Limits.model_fields) <= set(Settings.model_fields)
    assert limits_for(load_settings()) == Limits()
    assert limits_for(load_settings(max_steps=5, lease_ttl=2.5)) == Limits(max_steps=5, lease_ttl=2.5)


def test_unknown_variables_are_named_with_the_closest_setting() -> None:
    """A misspelt TASKLOOM_ variable is reported with a suggestion; known ones and other prefixes are not."""
    from taskloom.settings import unknown_variables

    env = {"TASKLOOM_POLL_DELEY": "1", "TASKLOOM_POLL_DELAY": "1", "TASKLOOM_QQQQQQQQQQ": "x", "OTHER_POLL_DELEY": "1"}
    warnings = unknown_variables(env)
    assert len(warnings) == 2
    assert "TASKLOOM_POLL_DELEY" in warnings[0] and "did you mean TASKLOOM_POLL_DELAY?" in warnings[0]
    assert "TASKLOOM_QQQQQQQQQQ" in warnings[1] and "did you mean" not in warnings[1]


def test_every_setting_is_a_known_variable() -> None:
    """Known names come from the Settings model, so a setting added later is never reported as unknown."""
    from taskloom.settings import known_variables, unknown_variables

    assert {f"TASKLOOM_{name.upper()}" for name in Settings.model_fields} <= known_variables()
    assert unknown_variables({f"TASKLOOM_{name.upper()}": "" for name in Settings.model_fields}) == []
