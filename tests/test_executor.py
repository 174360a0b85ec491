"""The executor's ReAct loop against real Redis, the real anthropic SDK and the fake Messages API server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import toolkits_for_tests as tk
from arq.connections import ArqRedis
from helpers import eventually

from bus.approvals import AlreadyDecided, ApprovalDecision, EarlierCall
from bus.attempts import AttemptStore, LeaseLost
from bus.client import Client
from bus.jobs import ExecuteJob, ReviewJob
from bus.keys import Keys
from bus.runtime import Runtime
from bus.schemas import GoalState, Plan, TaskResult, TaskSpec, TaskState
from bus.store import NotFound
from executor.handlers import execute
from executor.registry import ToolRegistry
from llm.anthropic import AnthropicModel
from llm.testing import FakeAnthropicServer, RecordedRequest, text_reply, tool_reply
from llm.types import ModelResponse, ToolUseBlock, Usage
from taskloom.settings import Settings
from taskloom.workers import build_runtime

REGISTRY = ToolRegistry([tk.kit])


@pytest.fixture
def fake() -> Iterator[FakeAnthropicServer]:
    with FakeAnthropicServer() as server:
        yield server


@pytest.fixture
async def model(fake: FakeAnthropicServer) -> AsyncIterator[AnthropicModel]:
    m = AnthropicModel("claude-test", api_key="sk-ant-test", base_url=fake.base_url, max_retries=0)
    yield m
    await m.aclose()


@dataclass
class Env:
    rt: Runtime
    client: Client
    goal_id: str


async def start_task(
    redis: ArqRedis,
    keys: Keys,
    settings: Settings,
    model: AnthropicModel,
    tools: list[str],
    budget: int = 200_000,
    deadline: Any = None,
    instructions: str = "use the tools",
    **overrides: Any,
) -> Env:
    """A goal with a one-task plan, the task dispatched (ready, attempt 1)."""
    settings = settings.model_copy(update=overrides)
    client = Client(redis, keys, default_budget_tokens=budget)
    gid = await client.submit({"text": "test goal", "budget_tokens": budget, "deadline": deadline})
    store = client.store
    await store.transition_goal(gid, GoalState.PLANNING)
    spec = TaskSpec(id="t1", title="t", instructions=instructions, definition_of_done="an answer", tools=tools)
    await store.save_plan(gid, Plan(tasks=[spec]), expected_version=0)
    await store.transition_goal(gid, GoalState.RUNNING)
    await store.transition_task(gid, "t1", TaskState.READY, attempt=1)
    return Env(build_runtime(settings, redis, model, REGISTRY), client, gid)


async def run(env: Env) -> TaskResult:
    await execute(env.rt, ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=1), REGISTRY)
    result = await env.rt.store.get_result(env.goal_id, "t1", 1)
    assert result is not None
    return result


def tool_results(req: RecordedRequest) -> list[dict[str, Any]]:
    last = req.messages[-1]
    assert last["role"] == "user"
    return [b for b in last["content"] if isinstance(b, dict) and b.get("type") == "tool_result"]


async def test_the_runtime_looks_its_models_prices_up_before_any_call(
    redis: ArqRedis, settings: Settings, model: AnthropicModel
) -> None:
    """A price from genai-prices loads its table once (about 0.1 s of CPU): at start-up, not in the
    middle of the first model calls, where it would stall every job on the event loop."""
    rt = build_runtime(settings, redis, model, REGISTRY)
    assert model.model in rt.ledger.prices._tiers  # resolved (this id is unpriced) before any call
    # The fallback model past `degrade_at` too, built for the runtime.
    rt = build_runtime(settings.model_copy(update={"fallback_model": "demo"}), redis, model, REGISTRY)
    assert {model.model, "demo"} <= rt.ledger.prices._tiers.keys()


async def test_parallel_read_only_calls_overlap_and_answer_in_one_message(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """Two read-only calls in one turn run concurrently; both results come back in one user message."""
    env = await start_task(redis, keys, settings, model, ["slow_a", "slow_b"])
    fake.enqueue(tool_reply([("slow_a", {"x": 1}), ("slow_b", {"x": 2})]), text_reply("a=1 and b=2"))
    tk.SPANS.clear()
    result = await run(env)
    assert result.stop_reason == "answered" and result.answer == "a=1 and b=2" and result.tool_calls == 2
    (a0, a1), (b0, b1) = ((s, e) for _, s, e in sorted(tk.SPANS))
    assert a0 < b1 and b0 < a1, f"calls did not overlap: {tk.SPANS}"
    second = fake.message_requests[1]
    results = tool_results(second)
    assert [r["content"] for r in results] == ["a=1", "b=2"]
    assert second.messages[-1]["content"][: len(results)] == results  # tool_results lead the message
    task = await env.rt.store.get_task(env.goal_id, "t1")
    assert task.state is TaskState.REVIEWING
    queued = [q.decode() for q in await redis.zrange(keys.queue("critic"), 0, -1)]
    assert queued == [env.rt.jobs.job_id(ReviewJob(goal_id=env.goal_id, task_id="t1", attempt=1))]


async def test_an_attempts_books_are_exact_when_its_result_is_stored(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """Three model calls, each settle held and carried by the attempt's next write (bus.ledger): when
    the job has stored its result, nothing is held or reserved, and the books equal the bill."""
    env = await start_task(redis, keys, settings, model, ["slow_a", "slow_b"], ledger_settle_delay=30)
    assert env.rt.ledger is not None and env.rt.ledger.settle_delay == 30  # no timer within the test
    fake.enqueue(tool_reply([("slow_a", {"x": 1})]), tool_reply([("slow_b", {"x": 2})]), text_reply("a=1, b=2"))
    result = await run(env)
    assert result.stop_reason == "answered" and result.tool_calls == 2
    assert env.rt.ledger.held == 0
    books = await env.rt.ledger.snapshot(env.goal_id)
    assert (books.reserved, books.open, books.calls, books.spent_unknown) == (0, 0, 3, 0)
    assert books.spent == fake.billed.total and books.served_by == {"executor": "claude-test"}

    async def announced() -> bool:  # once, after the first settle ran (in the background)
        events = [e async for e in env.client.events(env.goal_id, follow=False)]
        return [e.data.get("role") for e in events if e.type == "model.serving"] == ["executor"]

    await eventually(announced, timeout=5)


async def test_a_task_given_more_tools_than_the_limit_is_offered_those_its_words_are_about(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """Over tool_select_limit assigned tools: the model is offered the ones the task's text is about."""
    tools = ["slow_a", "slow_b", "count", "big", "charge"]
    env = await start_task(
        redis, keys, settings, model, tools, instructions="Charge the money for the order.", tool_select_limit=2
    )
    fake.enqueue(text_reply("charged"), text_reply("charged"))  # the second answers the use-your-tools nudge
    await run(env)
    offered = [t["name"] for t in fake.message_requests[0].body["tools"]]
    assert offered == ["charge"]


@pytest.mark.parametrize(
    ("call", "expect"),
    [
        (("nope", {}), "unknown tool 'nope'; available: boom, hang, slow_a"),
        (("slow_a", {"x": "not a number"}), "invalid arguments for slow_a: x:"),
        (("slow_a", {}), "invalid arguments for slow_a: x: Field required"),
        (("boom", {}), "tool boom failed: RuntimeError: kaboom"),
        (("hang", {}), "tool hang timed out after 0.2 s"),
        (("count", {"name": "x"}), "tool 'count' is not allowed"),
    ],
)
async def test_tool_failures_become_error_observations_and_the_loop_goes_on(
    redis: ArqRedis,
    keys: Keys,
    settings: Settings,
    model: AnthropicModel,
    fake: FakeAnthropicServer,
    call: tuple[str, dict[str, Any]],
    expect: str,
) -> None:
    """Unknown, invalid, raising, timing-out or disallowed calls: an ERROR result, then an answer."""
    env = await start_task(redis, keys, settings, model, ["slow_a", "boom", "hang"])
    fake.enqueue(tool_reply([call]), text_reply("recovered"))
    result = await run(env)
    assert result.stop_reason == "answered" and result.answer == "recovered"
    (observation,) = tool_results(fake.message_requests[1])
    assert observation["is_error"] is True
    assert observation["content"].startswith("ERROR: ") and expect in observation["content"]
    assert "Traceback" not in observation["content"]


async def test_long_output_is_truncated_for_the_model_but_kept_whole_in_the_step(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """A 10,000-character observation reaches the model cut, with a note; the step record keeps all of it."""
    env = await start_task(redis, keys, settings, model, ["big"], tool_output_limit=500)
    fake.enqueue(tool_reply([("big", {})]), text_reply("ok"))
    await run(env)
    (observation,) = tool_results(fake.message_requests[1])
    assert len(observation["content"]) < 700 and "truncated: 9500 of 10000 characters" in observation["content"]
    steps = await AttemptStore(redis, keys, env.goal_id, "t1", 1).steps()
    assert len(steps[0].outcomes[0].full) == 10_000


async def test_repeating_the_same_call_is_warned_then_stopped(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """The same call with the same arguments: first an ERROR saying so, then the task stops as loop_detected."""
    env = await start_task(redis, keys, settings, model, ["count"])
    fake.respond_with(lambda req: tool_reply([("count", {"name": "same"})]))
    result = await run(env)
    assert result.stop_reason == "loop_detected"
    assert len(fake.message_requests) == 3
    (warning,) = tool_results(fake.message_requests[2])
    assert warning["is_error"] and "already called count" in warning["content"]


async def test_a_tight_budget_stops_the_task_and_the_server_billed_no_more(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """With a budget for a few calls, a looping model ends budget_exhausted; the billed total stays within budget."""
    budget = 6000
    env = await start_task(redis, keys, settings, model, ["slow_a"], budget=budget, model_max_tokens=300, max_steps=50)
    calls = iter(range(1000))
    fake.respond_with(lambda req: tool_reply([("slow_a", {"x": next(calls)})]))
    result = await run(env)
    assert result.stop_reason == "budget_exhausted"
    assert fake.billed.total <= budget
    assert len(fake.message_requests) >= 2
    goal = await env.client.get(env.goal_id)
    assert goal.state is GoalState.BUDGET_EXHAUSTED
    task = await env.rt.store.get_task(env.goal_id, "t1")
    assert task.state is TaskState.FAILED and task.reason == "budget_exhausted"


async def test_max_steps_and_a_required_tool_nudge(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """An answer without the required tools gets one corrective turn; max_steps then ends the attempt."""
    env = await start_task(redis, keys, settings, model, ["slow_a"], max_steps=2)
    fake.enqueue(text_reply("lazy answer"), tool_reply([("slow_a", {"x": 1})]), text_reply("never asked"))
    result = await run(env)
    assert result.stop_reason == "max_steps" and result.steps == 2
    second = fake.message_requests[1].messages[-1]["content"]
    assert "requires its tools" in json.dumps(second)


async def test_max_tokens_gets_one_brevity_retry_then_stops(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """A reply cut at max_tokens is asked once to be brief; cut again, the task stops as max_tokens."""
    env = await start_task(redis, keys, settings, model, [])
    fake.enqueue(text_reply("long...", stop_reason="max_tokens"), text_reply("still long", stop_reason="max_tokens"))
    result = await run(env)
    assert result.stop_reason == "max_tokens" and len(fake.message_requests) == 2
    assert "briefly" in json.dumps(fake.message_requests[1].messages[-1])


async def test_refusal_stops_with_its_own_reason(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """A refusal ends the attempt as refusal, not as an answer."""
    env = await start_task(redis, keys, settings, model, [])
    fake.enqueue(text_reply("I can't help with that.", stop_reason="refusal"))
    assert (await run(env)).stop_reason == "refusal"


async def test_approval_pauses_the_task_and_a_denial_reaches_the_model(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """A requires_approval call pauses in waiting_approval; after a denial the model sees an ERROR with the reason."""
    env = await start_task(redis, keys, settings, model, ["wipe"])
    fake.enqueue(tool_reply([("wipe", {"target": "prod"})]), text_reply("ok, not wiping"))
    await execute(env.rt, ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=1), REGISTRY)
    task = await env.rt.store.get_task(env.goal_id, "t1")
    assert task.state is TaskState.WAITING_APPROVAL
    pending = await env.client.approvals(env.goal_id)
    (call_id,) = pending
    assert pending[call_id].tool == "wipe" and pending[call_id].input == {"target": "prod"}
    assert await env.client.decide(env.goal_id, call_id, approved=False, reason="not on a Friday")
    # decided already: nothing changes (AlreadyDecided names it), the denial stands and can be read back
    with pytest.raises(AlreadyDecided):
        await env.client.decide(env.goal_id, call_id, approved=True)
    assert await env.client.decision(env.goal_id, call_id) == ApprovalDecision(approved=False, reason="not on a Friday")
    with pytest.raises(NotFound):  # a call that never asked for approval
        await env.client.decide(env.goal_id, "toolu_never_asked", approved=True)
    resume = ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=1, resume=1)
    await execute(env.rt, resume, REGISTRY)
    result = await env.rt.store.get_result(env.goal_id, "t1", 1)
    assert result is not None and result.answer == "ok, not wiping"
    (observation,) = tool_results(fake.message_requests[1])
    assert observation["is_error"] and "denied by an operator: not on a Friday" in observation["content"]
    assert len(fake.message_requests) == 2  # the paused turn was not asked again


async def test_cancelled_goal_makes_no_model_call(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """An execute job for a cancelled goal returns without calling the model."""
    env = await start_task(redis, keys, settings, model, [])
    await env.client.cancel(env.goal_id)
    await execute(env.rt, ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=1), REGISTRY)
    assert fake.message_requests == []


async def test_a_second_copy_of_the_job_does_nothing(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """Running the same execute job twice calls the model once and enqueues one review."""
    env = await start_task(redis, keys, settings, model, [])
    fake.enqueue(text_reply("done"))
    await run(env)
    await run(env)
    assert len(fake.message_requests) == 1
    assert await redis.zcard(keys.queue("critic")) == 1


async def test_an_interrupted_side_effecting_call_is_not_run_again(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer, tmp_path: Any
) -> None:
    """A side_effects call that started but stored no result is reported as unknown, never re-run."""
    import os

    counter = tmp_path / "count.txt"
    os.environ["TL_COUNTER_FILE"] = str(counter)
    try:
        env = await start_task(redis, keys, settings, model, ["charge"])
        # A previous executor got this turn, marked the charge as started, and died.
        dead = AttemptStore(redis, keys, env.goal_id, "t1", 1)
        assert await dead.acquire("dead-worker", ttl=0.05)
        turn = ModelResponse(
            content=[ToolUseBlock(id="call_charge", name="charge", input={"amount": 5})],
            stop_reason="tool_use",
            usage=Usage(input_tokens=10, output_tokens=5),
            model="claude-test",
        )
        await dead.save_turn(turn)
        await dead.mark_started("call_charge")
        await asyncio.sleep(0.1)  # its lease expires
        fake.enqueue(text_reply("I will check the charge first"))
        result = await run(env)
        assert result.answer == "I will check the charge first"
        (observation,) = tool_results(fake.message_requests[0])
        assert observation["is_error"] and "outcome of this charge call is unknown" in observation["content"]
        assert not counter.exists()  # the charge never ran twice (here: never ran in this process at all)
        assert len(fake.message_requests) == 1  # the turn received before the crash was not asked again
        with pytest.raises(LeaseLost):
            await dead.save_turn(turn)  # the dead worker's epoch can no longer write
    finally:
        del os.environ["TL_COUNTER_FILE"]


async def test_cancel_during_a_tool_call_stops_the_task(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """Cancelling the goal while a tool runs stops the call and the attempt; no further model call, no review."""
    env = await start_task(redis, keys, settings, model, ["sleepy"])
    fake.enqueue(tool_reply([("sleepy", {"seconds": 20})]))
    job = asyncio.create_task(execute(env.rt, ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=1), REGISTRY))
    await asyncio.sleep(0.3)
    await env.client.cancel(env.goal_id)
    await asyncio.wait_for(job, 3)
    result = await env.rt.store.get_result(env.goal_id, "t1", 1)
    assert result is not None and result.stop_reason == "cancelled"
    assert len(fake.message_requests) == 1
    assert await redis.zcard(keys.queue("critic")) == 0


async def test_cancel_during_a_model_call_stops_the_task_before_its_next_call(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """A cancel that lands while the model answers is seen by the check before the next call (the
    step's own write reads the task's state): the tool turn is completed, no second call is made."""
    env = await start_task(redis, keys, settings, model, ["sleepy"])
    fake.enqueue(tool_reply([("sleepy", {"seconds": 0})], delay=0.5), text_reply("never asked"))
    job = asyncio.create_task(execute(env.rt, ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=1), REGISTRY))
    await asyncio.sleep(0.2)
    await env.client.cancel(env.goal_id)
    await asyncio.wait_for(job, 5)
    result = await env.rt.store.get_result(env.goal_id, "t1", 1)
    assert result is not None and result.stop_reason == "cancelled" and result.steps == 1
    assert len(fake.message_requests) == 1
    assert await redis.zcard(keys.queue("critic")) == 0


async def test_a_task_moved_on_while_it_answered_is_not_put_in_review(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """The move to review, the review's enqueue and the lease's end go out together: when the move is
    refused (the task was superseded meanwhile), the task stays where it is, the lease still ends,
    and the review that was sent anyway finds the task moved on and skips it, with no model call."""
    from critic.handlers import review

    env = await start_task(redis, keys, settings, model, [])
    fake.enqueue(text_reply("late answer", delay=0.5))
    job = asyncio.create_task(execute(env.rt, ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=1), REGISTRY))
    await asyncio.sleep(0.2)
    await env.rt.store.transition_task(env.goal_id, "t1", TaskState.SUPERSEDED)
    await asyncio.wait_for(job, 5)
    assert (await env.rt.store.get_task(env.goal_id, "t1")).state is TaskState.SUPERSEDED
    assert await redis.zscore(keys.leases(), keys.lease_member(env.goal_id, "t1", 1)) is None  # lease ended
    await review(env.rt, ReviewJob(goal_id=env.goal_id, task_id="t1", attempt=1))
    assert (await env.rt.store.get_task(env.goal_id, "t1")).state is TaskState.SUPERSEDED
    assert len(fake.message_requests) == 1  # the executor's call only: no review call


async def test_a_start_refused_by_the_tasks_state_gives_back_the_lease_it_took(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel
) -> None:
    """The move to running and the lease go out together: when the move is refused (the task was
    cancelled after the job read it), the lease taken with it is given back at once."""
    from executor.handlers import _start

    env = await start_task(redis, keys, settings, model, [])
    read = await env.rt.store.get_task(env.goal_id, "t1")  # ready, as the job read it
    await env.rt.store.transition_task(env.goal_id, "t1", TaskState.CANCELLED)
    store = AttemptStore(redis, keys, env.goal_id, "t1", 1)
    job = ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=1)
    assert await _start(env.rt, job, read, store, "first") is None
    assert store.epoch == 1  # it did take the lease in the same round trip ...
    assert await redis.zscore(keys.leases(), keys.lease_member(env.goal_id, "t1", 1)) is None  # ... and ended it
    assert await AttemptStore(redis, keys, env.goal_id, "t1", 1).acquire("second", 5)  # free at once


async def test_a_task_in_review_has_given_its_tenant_slot_back(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """The slot is held while the attempt runs and released with the review's enqueue (one round
    trip); a renewal of it that was due later does not take it again."""
    env = await start_task(redis, keys, settings, model, ["sleepy"], lease_ttl=1)  # renewed every 0.33 s
    fake.enqueue(tool_reply([("sleepy", {"seconds": 0.8})]), text_reply("done"))
    job = asyncio.create_task(execute(env.rt, ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=1), REGISTRY))
    member = f"{env.goal_id}/t1"
    await asyncio.sleep(0.3)
    assert await redis.zscore(keys.tenant_running("default"), member) is not None  # held while it runs
    await asyncio.wait_for(job, 5)
    assert (await env.rt.store.get_task(env.goal_id, "t1")).state is TaskState.REVIEWING
    assert await redis.zscore(keys.tenant_running("default"), member) is None
    await asyncio.sleep(0.5)  # past the next renewal period
    assert await redis.zscore(keys.tenant_running("default"), member) is None


async def test_pause_turn_continues_with_the_same_turn(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """pause_turn is not an end: the turn is sent back and the model continues to an answer."""
    env = await start_task(redis, keys, settings, model, [])
    fake.enqueue(text_reply("thinking...", stop_reason="pause_turn"), text_reply("final"))
    result = await run(env)
    assert result.stop_reason == "answered" and result.answer == "final" and result.steps == 2
    assert fake.message_requests[1].messages[-1]["role"] == "assistant"


async def test_long_histories_are_condensed_before_the_call(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """Past the token threshold, older observations are cut to stubs; the newest stay whole."""
    env = await start_task(redis, keys, settings, model, ["big"], tool_output_limit=9000)
    env.rt = replace(env.rt, limits=env.rt.limits.model_copy(update={"compact_after_tokens": 3000}))
    fake.enqueue(*(tool_reply([("big", {"n": i})]) for i in range(8)), text_reply("done"))
    assert (await run(env)).answer == "done"
    last = fake.message_requests[8].messages
    contents = [
        b["content"] for m in last if m["role"] == "user" for b in m["content"] if b.get("type") == "tool_result"
    ]
    assert len(contents) == 8 and "condensed" in contents[0] and len(contents[-1]) > 9000


async def test_the_goal_deadline_stops_an_attempt_between_steps(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """A goal whose deadline falls mid-task stops the attempt with reason deadline, well before task_timeout."""
    from datetime import timedelta

    from bus.schemas import utcnow

    env = await start_task(redis, keys, settings, model, ["slow_a"], deadline=utcnow() + timedelta(seconds=1.5))
    calls = iter(range(1000))
    fake.respond_with(lambda req: tool_reply([("slow_a", {"x": next(calls)})]))
    started = asyncio.get_running_loop().time()
    result = await run(env)
    assert result.stop_reason == "deadline"
    assert asyncio.get_running_loop().time() - started < 10


async def test_a_rerun_after_a_crash_past_the_result_hands_it_on_without_a_model_call(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """Died after storing the result (task still running), or after moving to review but before
    enqueueing it: the re-run finishes the hand-over and calls no model."""
    env = await start_task(redis, keys, settings, model, [])
    await env.rt.store.transition_task(env.goal_id, "t1", TaskState.RUNNING, expected_attempt=1)
    dead = AttemptStore(redis, keys, env.goal_id, "t1", 1)
    assert await dead.acquire("dead-worker", ttl=0.05)
    await dead.save_result(
        TaskResult(goal_id=env.goal_id, task_id="t1", attempt=1, answer="42", stop_reason="answered")
    )
    await asyncio.sleep(0.1)  # its lease expires
    review_id = env.rt.jobs.job_id(ReviewJob(goal_id=env.goal_id, task_id="t1", attempt=1))

    await execute(env.rt, ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=1, resume=1), REGISTRY)
    assert (await env.rt.store.get_task(env.goal_id, "t1")).state is TaskState.REVIEWING
    assert [q.decode() for q in await redis.zrange(keys.queue("critic"), 0, -1)] == [review_id]

    await redis.delete(keys.queue("critic"), f"arq:job:{review_id}")  # as if the enqueue had never happened
    await execute(env.rt, ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=1, resume=2), REGISTRY)
    assert [q.decode() for q in await redis.zrange(keys.queue("critic"), 0, -1)] == [review_id]
    assert fake.message_requests == []


@pytest.fixture
def counter(tmp_path: Any) -> Iterator[Any]:
    """The test toolkit's run log (TL_COUNTER_FILE): one line per real run of a counted tool."""
    import os

    path = tmp_path / "count.txt"
    os.environ["TL_COUNTER_FILE"] = str(path)
    yield path
    del os.environ["TL_COUNTER_FILE"]


def runs(counter: Any) -> list[str]:
    return counter.read_text().splitlines() if counter.exists() else []


async def retry_task(env: Env, feedback: str = "SAY MORE") -> None:
    """What the critic does for a retry verdict: attempt 2, with its feedback."""
    await env.rt.store.transition_task(
        env.goal_id, "t1", TaskState.RETRYING, expected_attempt=1, attempt=2, feedback=feedback
    )


async def test_a_retry_repeating_an_approved_done_side_effect_replays_it_without_asking_again(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer, counter: Any
) -> None:
    """Approved and done in attempt 1, the same call in the critic's retry gets the recorded outcome:
    no second approval request, no second run, and the attempt goes on to its answer."""
    env = await start_task(redis, keys, settings, model, ["refund"])
    refund = [tool_reply([("refund", {"order": "A1"})]) for _ in range(2)]  # two turns, two call ids
    fake.enqueue(refund[0], text_reply("refunded A1"), refund[1], text_reply("A1 was refunded (attempt 2)"))
    await run_paused(env)
    (call_id,) = await env.client.approvals(env.goal_id)
    assert await env.client.decide(env.goal_id, call_id, approved=True)
    await execute(env.rt, ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=1, resume=1), REGISTRY)
    assert runs(counter) == ["refund A1"]

    await retry_task(env)
    await execute(env.rt, ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=2), REGISTRY)
    result = await env.rt.store.get_result(env.goal_id, "t1", 2)
    assert result is not None and result.answer == "A1 was refunded (attempt 2)"
    assert (await env.rt.store.get_task(env.goal_id, "t1")).state is TaskState.REVIEWING
    assert await env.client.approvals(env.goal_id) == {}
    assert runs(counter) == ["refund A1"]  # ran once, in attempt 1
    (replay,) = tool_results(fake.message_requests[3])
    assert not replay.get("is_error") and "already done in attempt 1; not run again] refunded A1" in replay["content"]
    events = [e async for e in env.client.events(env.goal_id, follow=False)]
    assert [e.type for e in events].count("tool.approval_requested") == 1
    answered = [e.data["answered_by"] for e in events if e.type == "tool.call"]
    assert answered == ["invoke", "replay"]


async def run_paused(env: Env) -> None:
    await execute(env.rt, ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=1), REGISTRY)
    assert (await env.rt.store.get_task(env.goal_id, "t1")).state is TaskState.WAITING_APPROVAL


async def test_a_denied_call_never_ran_and_the_model_is_told_so(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer, counter: Any
) -> None:
    """A denied side-effecting call does not run, leaves no effect record, and the model reads that it was not run."""
    from bus.effects import SideEffects

    env = await start_task(redis, keys, settings, model, ["refund"])
    fake.enqueue(tool_reply([("refund", {"order": "A1"})]), text_reply("not refunded"))
    await run_paused(env)
    (call_id,) = await env.client.approvals(env.goal_id)
    assert await env.client.decide(env.goal_id, call_id, approved=False, reason="over the limit")
    await execute(env.rt, ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=1, resume=1), REGISTRY)
    (observation,) = tool_results(fake.message_requests[1])
    assert observation["is_error"]
    assert observation["content"] == "ERROR: refund was not run: denied by an operator: over the limit"
    assert runs(counter) == []
    assert await SideEffects(redis, keys).history(env.goal_id, "t1") == []


async def test_an_approval_request_carries_the_earlier_calls_of_its_tool_in_the_task(
    redis: ArqRedis,
    keys: Keys,
    settings: Settings,
    model: AnthropicModel,
    fake: FakeAnthropicServer,
    counter: Any,
    subprocess_env: dict[str, str],
) -> None:
    """A new refund in the retry asks again; the request (and `taskloom status`) shows attempt 1's refund."""
    from helpers import run_cli

    env = await start_task(redis, keys, settings, model, ["refund"])
    a1, a2 = tool_reply([("refund", {"order": "A1"})]), tool_reply([("refund", {"order": "A2"})])
    fake.enqueue(a1, text_reply("done"), a2)
    await run_paused(env)
    (first,) = await env.client.approvals(env.goal_id)
    assert (await env.client.approvals(env.goal_id))[first].earlier == []
    assert await env.client.decide(env.goal_id, first, approved=True)
    await execute(env.rt, ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=1, resume=1), REGISTRY)
    await retry_task(env)
    await execute(env.rt, ExecuteJob(goal_id=env.goal_id, task_id="t1", attempt=2), REGISTRY)
    assert (await env.rt.store.get_task(env.goal_id, "t1")).state is TaskState.WAITING_APPROVAL
    (request,) = (await env.client.approvals(env.goal_id)).values()
    assert request.input == {"order": "A2"}
    [earlier] = request.earlier
    assert earlier == EarlierCall(attempt=1, call_id=first, input={"order": "A1"}, outcome="ok", result="refunded A1")
    [pending] = await env.client.pending_approvals(goal_id=env.goal_id)
    assert [(e.attempt, e.outcome) for e in pending.earlier] == [(1, "ok")]
    status = run_cli("status", env.goal_id, env=subprocess_env)
    assert 'earlier, attempt 1: refund({"order": "A1"}) -> ok: refunded A1' in status.stdout, status.stdout


async def test_a_read_only_call_that_failed_is_run_again_when_the_model_retries_it(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer
) -> None:
    """An identical retry after an error runs the tool again (error, then success), and the attempt answers."""
    env = await start_task(redis, keys, settings, model, ["flaky"])
    call = [tool_reply([("flaky", {"key": "once", "fails": 1})]) for _ in range(2)]
    fake.enqueue(*call, text_reply("fine on the second try"))
    result = await run(env)
    assert result.stop_reason == "answered" and result.answer == "fine on the second try"
    assert tk.FLAKY["once"] == 2
    (failed,) = tool_results(fake.message_requests[1])
    (fine,) = tool_results(fake.message_requests[2])
    assert failed["is_error"] and "backend unavailable, try again" in failed["content"]
    assert not fine.get("is_error") and fine["content"] == "once: fine after 2 calls"


@pytest.mark.parametrize("retries", [2, 0])
async def test_failed_retries_are_bounded_by_the_setting_then_count_as_a_loop(
    redis: ArqRedis,
    keys: Keys,
    settings: Settings,
    model: AnthropicModel,
    fake: FakeAnthropicServer,
    retries: int,
) -> None:
    """A call that keeps failing runs 1 + tool_error_retries times; the next repeat is warned, the one after stops."""
    env = await start_task(redis, keys, settings, model, ["flaky"], tool_error_retries=retries)
    key = f"always-{retries}"
    fake.respond_with(lambda req: tool_reply([("flaky", {"key": key, "fails": 100})]))
    result = await run(env)
    assert result.stop_reason == "loop_detected"
    assert tk.FLAKY[key] == 1 + retries
    assert len(fake.message_requests) == retries + 3
    (warning,) = tool_results(fake.message_requests[-1])
    assert warning["is_error"] and f"failed {1 + retries} times in this task; it is not run again" in warning["content"]


async def test_a_succeeded_call_repeated_identically_is_still_a_loop(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer, counter: Any
) -> None:
    """A call that succeeded runs once; its identical repeat is warned (not run), the next one ends the attempt."""
    env = await start_task(redis, keys, settings, model, ["count"])
    fake.respond_with(lambda req: tool_reply([("count", {"name": "same"})]))
    result = await run(env)
    assert result.stop_reason == "loop_detected"
    assert runs(counter) == ["same"]
    steps = await AttemptStore(redis, keys, env.goal_id, "t1", 1).steps()
    assert [o.outcome for s in steps for o in s.outcomes] == ["ok", "repeated", "loop"]


async def test_arguments_that_are_not_a_json_object_get_an_error_and_never_run(
    redis: ArqRedis, keys: Keys, settings: Settings, model: AnthropicModel, fake: FakeAnthropicServer, counter: Any
) -> None:
    """A turn whose tool_use arguments were not a JSON object (input {}) is answered with an ERROR naming
    the problem and quoting the raw text, cut; the tool does not run, even one that needs no arguments."""
    env = await start_task(redis, keys, settings, model, ["big", "count"])
    raw = "[" + "1, " * 200 + "2]"
    turn = ModelResponse(
        content=[
            ToolUseBlock(id="call_big", name="big", input={}, invalid_input="null"),
            ToolUseBlock(id="call_count", name="count", input={}, invalid_input=raw),
        ],
        stop_reason="tool_use",
        usage=Usage(input_tokens=10, output_tokens=5),
        model="claude-test",
    )
    seeded = AttemptStore(redis, keys, env.goal_id, "t1", 1)
    assert await seeded.acquire("earlier-worker", ttl=0.05)
    await seeded.save_turn(turn)  # as if received just before that worker stopped
    await asyncio.sleep(0.1)
    fake.enqueue(text_reply("I will send proper arguments"))
    assert (await run(env)).answer == "I will send proper arguments"
    big, count = tool_results(fake.message_requests[0])
    assert big["is_error"] and big["content"] == (
        "ERROR: invalid arguments for big: the arguments were not a JSON object (received 'null'); "
        "send them as one JSON object"
    )
    assert count["is_error"] and "were not a JSON object (received '[1, 1, " in count["content"]
    assert "[... 403 more characters]" in count["content"] and len(count["content"]) < 400
    assert runs(counter) == []
