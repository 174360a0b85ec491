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
