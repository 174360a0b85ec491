"""`taskloom ledger GOAL_ID`, run as a real process against the test Redis."""

from __future__ import annotations

import json

from arq.connections import ArqRedis
from helpers import run_cli

from bus.keys import Keys
from bus.ledger import Ledger, PoolRef
from llm.types import Usage


async def test_ledger_shows_the_books(redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str]) -> None:
    """--json prints budget, spent by kind, reserved, calls, cost and headroom; the table names them too."""
    ledger = Ledger(redis, keys)
    await ledger.open("g1", 10_000, [PoolRef("tenant:acme", 50_000)])
    done = await ledger.reserve("g1", 200, 1000, model="claude-sonnet-4-5")
    await ledger.settle(done, Usage(input_tokens=150, output_tokens=400, cache_read_tokens=50))
    await ledger.reserve("g1", 100, 500)  # still open
    res = run_cli("ledger", "g1", "--json", env=subprocess_env)
    assert res.returncode == 0, res.stderr
    body = json.loads(res.stdout)
    assert (body["budget"], body["spent"], body["reserved"], body["calls"]) == (10_000, 600, 600, 1)
    assert (body["spent_input"], body["spent_output"], body["spent_cache_read"]) == (150, 400, 50)
    assert body["headroom"] == 10_000 - 600 - 600 and body["cost_micro_usd"] == 450 + 6000 + 15
    assert body["pools"] == ["tenant:acme"]
    table = run_cli("ledger", "g1", env=subprocess_env)
    assert table.returncode == 0, table.stderr
    for word in ("budget", "spent output", "reserved", "headroom", "8,800", "1 calls", "$0.0065"):
        assert word in table.stdout, (word, table.stdout)


def test_ledger_of_an_unknown_goal_exits_1(subprocess_env: dict[str, str]) -> None:
    """A goal without books: exit 1 and a message naming it."""
    res = run_cli("ledger", "nobody", env=subprocess_env)
    assert res.returncode == 1
    assert "nobody" in res.stderr and "not found" in res.stderr


async def test_tenant_commands_set_show_list_reset(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str]
) -> None:
    """`taskloom tenant set|show|list|reset` and `ledger --tenant` change and show a tenant's pool;
    bad input exits 2 naming the problem."""
    env = subprocess_env
    res = run_cli("tenant", "set", "acme", "--period", "month", "--budget-usd", "12.5", "--max-running", "3", env=env)
    assert res.returncode == 0, res.stderr
    ledger = Ledger(redis, keys)
    await ledger.open("g1", 10_000, tenant="acme")
    done = await ledger.reserve("g1", 200, 1000, model="claude-sonnet-4-5")
    await ledger.settle(done, Usage(input_tokens=150, output_tokens=400, cache_write_tokens=50))
    shown = run_cli("tenant", "show", "acme", env=env)
    assert shown.returncode == 0, shown.stderr
    for word in ("period month", "USD 12.50", "max running 3", "(current)", "claude-sonnet-4-5", "150", "400"):
        assert word in shown.stdout, (word, shown.stdout)
    body = json.loads(run_cli("ledger", "--tenant", "acme", "--json", env=env).stdout)
    (model,) = body["periods"][0]["models"]
    assert (model["input"], model["output"], model["cache_write"]) == (150, 400, 50)
    assert body["periods"][0]["books"]["cost_micro_usd"] == 450 + 6000 + 188
    listed = run_cli("tenant", "list", env=env)
    assert "acme" in listed.stdout and "month" in listed.stdout
    reset = run_cli("tenant", "reset", "acme", "--json", env=env)
    assert json.loads(reset.stdout)["pool"].startswith("tenant:acme:")
    body = json.loads(run_cli("ledger", "--tenant", "acme", "--json", env=env).stdout)
    assert body["periods"][0]["books"]["spent"] == 0 and body["periods"][0]["resets"] == 1
    bad = run_cli("tenant", "set", "acme", "--period", "week", env=env)
    assert bad.returncode == 2 and "--period" in bad.stderr
    both = run_cli("ledger", "g1", "--tenant", "acme", env=env)
    assert both.returncode == 2 and "one of them" in both.stderr
    badname = run_cli("tenant", "show", "a:b", env=env)
    assert badname.returncode == 2 and "tenant name" in badname.stderr
