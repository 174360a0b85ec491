"""Any model, end to end on worker processes: the README's goal on an OpenAI-compatible alias (the fake
Chat Completions server), and a fleet whose roles run on different aliases, the executors' first choice
dead, failing over to an OpenAI-compatible model with the dollar spend exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from arq.connections import ArqRedis
from helpers import fake_model_env, openai_model_env, run_cli
from test_e2e import fleet

from bus.client import Client
from bus.events import EventLog
from bus.keys import Keys
from bus.prices import ModelPrice, PriceTable
from bus.schemas import GoalState
from llm.demo import DemoModel
from llm.testing import (
    FakeAnthropicServer,
    FakeOpenAIServer,
    openai_responder_from_model,
    overloaded,
    responder_from_model,
)
from taskloom.cli import DEMO_DOD, DEMO_GOAL

pytestmark = pytest.mark.e2e

OA_PRICE = ModelPrice(input=1, output=4, cache_read=0.25, cache_write=1)
SONNET_PRICE = ModelPrice(input=3, output=15, cache_read=0.3, cache_write=3.75)


async def test_the_readme_goal_runs_on_an_openai_compatible_alias(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """TASKLOOM_MODEL names an alias of the fake Chat Completions server: the demo goal is planned, its
    tasks call tools in parallel, the critic sends one back, the final answer is written; the ledger's
    tokens equal what the fake billed, priced at the alias's prices."""
    with FakeOpenAIServer(prompt_caching=True) as oa:
        oa.respond_with(openai_responder_from_model(DemoModel(latency=0)))
        env = openai_model_env(
            subprocess_env,
            oa.base_url,
            tmp_path / "counter.txt",
            tmp_path / "models.toml",
            TASKLOOM_TOOLS="executor.demo_tools:support",
            TASKLOOM_POLL_DELAY="0.01",
        )
        client = Client(redis, keys, default_budget_tokens=200_000)
        async with fleet(env, tmp_path, "planner", "critic", "executor", "executor"):
            gid = await client.submit({"text": DEMO_GOAL, "definition_of_done": DEMO_DOD, "budget_tokens": 100_000})
            goal = await client.wait(gid, timeout=60)
            events = await EventLog(redis, keys).read(gid)
            books = await client.ledger.snapshot(gid)
        billed = oa.billed
        requests = oa.requests
    assert goal.state is GoalState.SUCCEEDED, goal
    assert goal.answer and "A100" in goal.answer and "A107" in goal.answer
    kinds = [e.type for e in events]
    assert kinds.count("plan.stored") == 1
    verdicts = [e.data for e in events if e.type == "critic.verdict"]
    assert any(v["action"] == "retry" for v in verdicts)  # the demo's critic sends one answer back
    assert len({e.task_id for e in events if e.type == "tool.call"}) >= 3  # the three parallel checks
    assert all(r.path == "/v1/chat/completions" for r in requests)
    assert any(r.body.get("tools") for r in requests)  # native tool calling on the wire
    assert books.spent == billed.total and books.usage_unknown == 0 and books.open == 0
    assert books.calls == len(requests)
    assert billed.cache_read_tokens > 0  # cached prefixes are billed (and booked) as cache reads
    assert books.spent_cache_read == billed.cache_read_tokens
    # Each call is priced on its own, rounded up to a whole micro-dollar: the sum is within a micro-dollar
    # a call of the price of everything billed.
    total = PriceTable({"gpt-test": OA_PRICE}, library=False).cost("gpt-test", billed) or 0
    assert total <= books.cost_micro_usd < total + books.calls
    assert books.served_by == {"planner": "oa", "executor": "oa", "critic": "oa"}


async def test_roles_on_different_aliases_and_a_dead_first_choice_fails_over(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """The planner and critic run on an Anthropic alias, the executors on an alias whose model answers only
    529, with an OpenAI-compatible fallback. The goal succeeds on the fallback with model.failover events;
    after two failures the breaker keeps both executor processes off the dead model; `taskloom status`
    shows each role's model; the dollar spend is exactly each fake's billing at its own price."""
    with FakeAnthropicServer() as sonnet, FakeAnthropicServer() as dead, FakeOpenAIServer() as oa:
        sonnet.respond_with(responder_from_model(DemoModel(latency=0)))
        dead.respond_with(lambda _: overloaded())
        oa.respond_with(openai_responder_from_model(DemoModel(latency=0)))
        models = tmp_path / "models.toml"
        models.write_text(
            f"""
[models.sonnet]
provider = "anthropic"
model = "claude-sonnet-test"
base_url = "{sonnet.base_url}"
api_key_env = "TL_TEST_SONNET_KEY"
prices = {{ input = 3, output = 15, cache_read = 0.3, cache_write = 3.75 }}

[models.primary]
provider = "anthropic"
model = "claude-dead-test"
base_url = "{dead.base_url}"
api_key_env = "TL_TEST_SONNET_KEY"
prices = {{ input = 3, output = 15, cache_read = 0.3, cache_write = 3.75 }}
fallbacks = ["oa"]

[models.oa]
provider = "openai"
model = "gpt-test"
base_url = "{oa.base_url}"
api_key_env = "TL_TEST_OA_KEY"
prices = {{ input = 1, output = 4, cache_read = 0.25, cache_write = 1 }}
"""
        )
        env = fake_model_env(
            subprocess_env,
            sonnet.base_url,
            tmp_path / "counter.txt",
            TASKLOOM_MODELS_FILE=str(models),
            TASKLOOM_MODEL="sonnet",
            TASKLOOM_EXECUTOR_MODEL="primary",
            TASKLOOM_TOOLS="executor.demo_tools:support",
            TASKLOOM_POLL_DELAY="0.01",
            TASKLOOM_BREAKER_FAILURES="2",
            TASKLOOM_BREAKER_COOLDOWN="600",
            TL_TEST_SONNET_KEY="sk-ant-test",
            TL_TEST_OA_KEY="sk-oa-test",
        )
        client = Client(redis, keys, default_budget_tokens=200_000)
        async with fleet(env, tmp_path, "planner", "critic", "executor", "executor"):
            gid = await client.submit(
                {"text": DEMO_GOAL, "definition_of_done": DEMO_DOD, "budget_tokens": 100_000, "budget_usd": 5}
            )
            goal = await client.wait(gid, timeout=60)
            events = await EventLog(redis, keys).read(gid)
            books = await client.ledger.snapshot(gid)
            status = run_cli("status", gid, "--json", env=env)
        dead_requests = len(dead.requests)
        oa_requests = oa.requests
        billed_sonnet, billed_oa = sonnet.billed, oa.billed
    assert goal.state is GoalState.SUCCEEDED, goal
    failovers = [e.data for e in events if e.type == "model.failover"]
    assert failovers and all(f["from"] == "primary" and f["to"] == "oa" and f["status"] == 529 for f in failovers)
    # The breaker opens at its second failure; calls already under way when it opened (the three parallel
    # checks start together) still reach the dead model, no call after that does.
    assert 2 <= dead_requests <= 3 and len(failovers) == dead_requests
    assert len(oa_requests) > dead_requests + 3  # every later executor call went straight to the fallback
    assert json.loads(status.stdout)["models"] == {"planner": "sonnet", "executor": "oa", "critic": "sonnet"}
    serving = {(e.data["role"], e.data["model"]) for e in events if e.type == "model.serving"}
    assert serving == {("planner", "sonnet"), ("executor", "oa"), ("critic", "sonnet")}
    assert books.spent == billed_sonnet.total + billed_oa.total
    prices = PriceTable({"claude-sonnet-test": SONNET_PRICE, "gpt-test": OA_PRICE}, library=False)
    expected = (prices.cost("claude-sonnet-test", billed_sonnet) or 0) + (prices.cost("gpt-test", billed_oa) or 0)
    assert expected <= books.cost_micro_usd < expected + books.calls  # each call rounded up to a micro-dollar
