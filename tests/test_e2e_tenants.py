"""End to end with real worker processes: two tenants share a fleet; one exhausts its pool while the other
keeps going. The model is the fake Messages API (rate-limited, with taskloom's limiter set to match)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from arq.connections import ArqRedis
from helpers import run_cli
from test_e2e import Scenario, fleet, spec, worker_env

from bus.client import Client
from bus.keys import Keys
from bus.schemas import Goal, GoalState
from llm.testing import FakeAnthropicServer
from llm.testing.server import ProviderLimits


async def test_an_exhausted_tenant_stops_while_the_other_keeps_going(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """Tenant `poor` has a pool too small for any call: its goals end budget_exhausted, its books
    show no spend past the pool; tenant `rich` runs goals to success on the same workers, with no
    429 from the rate-limited provider. Raising the pool lets `poor` go on."""
    scenario = Scenario(plans={0: [{"tasks": [spec("a"), spec("b", deps=("a",))]}]})
    limits = {"rpm": 600, "input_tpm": 400_000, "output_tpm": 100_000}
    with FakeAnthropicServer(limits=ProviderLimits(**limits)) as fake:
        fake.respond_with(scenario)
        prices = {"claude-test": {"input": 3, "output": 15, "cache_read": 0.3, "cache_write": 3.75}}
        env = worker_env(
            subprocess_env,
            fake,
            tmp_path,
            TASKLOOM_RATE_LIMITS=json.dumps({"claude-test": limits}),
            TASKLOOM_PRICES=json.dumps(prices),
        )
        client = Client(redis, keys, default_budget_tokens=200_000)
        set_out = run_cli("tenant", "set", "poor", "--budget-tokens", "500", "--period", "day", "--json", env=env)
        assert set_out.returncode == 0, set_out.stderr
        assert json.loads(set_out.stdout)["budget_tokens"] == 500
        async with fleet(env, tmp_path, "planner", "critic", "executor", "executor"):
            poor = [await client.submit(Goal(text=f"poor {i}", tenant="poor")) for i in range(2)]
            rich = [await client.submit(Goal(text=f"rich {i}", tenant="rich", budget_usd=5)) for i in range(2)]
            ended = await asyncio.gather(*(client.wait(g, timeout=90) for g in poor + rich))
            states = [g.state for g in ended]
            assert states == [GoalState.BUDGET_EXHAUSTED] * 2 + [GoalState.SUCCEEDED] * 2, [
                (g.state, g.reason) for g in ended
            ]
            assert "tenant:poor:" in (ended[0].reason or "")
            # More money for poor: a new goal of it runs (the pool is read at each reservation).
            raised = await client.tenant_set("poor", budget_tokens=1_000_000)
            assert raised.budget_tokens == 1_000_000
            again = await client.wait(await client.submit(Goal(text="poor again", tenant="poor")), timeout=90)
            assert again.state is GoalState.SUCCEEDED, again.reason
    assert fake.throttled == 0
    shown = run_cli("ledger", "--tenant", "rich", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    (period,) = view["periods"]
    assert period["books"]["spent"] > 0 and period["books"]["reserved"] == 0
    (model,) = period["models"]
    assert model["model"] == "claude-test" and model["input"] + model["cache_read"] > 0 and model["output"] > 0
    listed = run_cli("tenant", "list", "--json", env=env)
    assert [t["settings"]["name"] for t in json.loads(listed.stdout)] == ["poor"]  # rich has no settings
    poor_view = await client.tenant_show("poor")
    assert poor_view.periods[0].books.refusals >= 2
