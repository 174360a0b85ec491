"""Planner handlers against a real Redis: plan, dispatch, advance (concurrently), replan, stop conditions.

Models: the offline DemoModel, or the real Anthropic SDK against the fake Messages API server for
scripted replies; both behind the metered ModelFactory with the goal's ledger opened.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from arq.connections import ArqRedis, create_pool
from helpers import store_result

from bus.connection import redis_settings
from bus.jobs import AdvanceJob, ExecuteJob, JobPayload, PlanJob, ReplanJob, ReviewGoalJob
from bus.keys import Keys
from bus.ledger import Ledger
from bus.metered import ModelFactory
from bus.runtime import Limits, Runtime
from bus.schemas import Goal, GoalRecord, GoalState, Plan, TaskResult, TaskState
from bus.synthesis import accepted_key
from llm import DemoModel
from llm.anthropic import AnthropicModel
from llm.port import ModelPort
from llm.testing import FakeAnthropicServer, Reply, text_reply, tool_reply
from llm.types import ModelRequest, ModelResponse, ToolDef
from planner.handlers import advance, plan, replan

CATALOG = (
    ToolDef(name="lookup_order", description="Look up an order by id: items, date, status."),
    ToolDef(name="refund_policy", description="The shop's refund policy."),
    ToolDef(name="check_refund_eligibility", description="Whether an order can be refunded on a date."),
)
REFUND_GOAL = "Can orders A100, A101 and A107 be refunded? Today is 2026-10-13."


@pytest.fixture
async def fake() -> AsyncIterator[FakeAnthropicServer]:
    async with FakeAnthropicServer() as server:
        yield server


def runtime(redis: ArqRedis, keys: Keys, model: ModelPort, **limits: Any) -> Runtime:
    factory = ModelFactory(model, Ledger(redis, keys))
    return Runtime.build(redis, keys, models=factory, tool_catalog=CATALOG, limits=Limits(**limits))


def sdk(server: FakeAnthropicServer) -> AnthropicModel:
    return AnthropicModel("claude-test", api_key="sk-ant-test", base_url=server.base_url, max_retries=0)


async def new_goal(rt: Runtime, text: str = REFUND_GOAL, gid: str = "g1", budget: int = 100_000, **kw: Any) -> str:
    await rt.store.create_goal(GoalRecord(id=gid, goal=Goal(text=text, **kw), budget_tokens=budget))
    await Ledger(rt.redis, rt.keys).open(gid, budget)
    return gid


def task(tid: str, *deps: str, tools: tuple[str, ...] = (), dod: str = "It is done.") -> dict[str, Any]:
    return {
        "id": tid,
        "title": f"task {tid}",
        "instructions": f"Do {tid}.",
        "depends_on": list(deps),
        "definition_of_done": dod,
        "tools": list(tools),
    }


def plan_reply(*tasks: dict[str, Any]) -> Reply:
    return tool_reply([("submit_plan", {"tasks": list(tasks)})])


async def queued(rt: Runtime, role: str) -> set[str]:
    return {m.decode() for m in await rt.redis.zrange(rt.keys.queue(role), 0, -1)}


def ids(rt: Runtime, *jobs: JobPayload) -> set[str]:
    return {rt.jobs.job_id(j) for j in jobs}


async def states(rt: Runtime, gid: str = "g1") -> dict[str, tuple[str, int]]:
    return {tid: (r.state.value, r.attempt) for tid, r in (await rt.store.get_tasks(gid)).items()}


async def accept(rt: Runtime, gid: str, tid: str, answer: str = "ok") -> int:
    """Walk a ready task through an executor run and an accepting critic (what those roles would do)."""
    rec = await rt.store.get_task(gid, tid)
    if rec.state is TaskState.PENDING:
        await rt.store.transition_task(gid, tid, TaskState.READY, attempt=rec.attempt + 1)
        rec = await rt.store.get_task(gid, tid)
    await rt.store.transition_task(gid, tid, TaskState.RUNNING, expected_attempt=rec.attempt)
    result = TaskResult(goal_id=gid, task_id=tid, attempt=rec.attempt, answer=answer, stop_reason="answered")
    await store_result(rt.redis, rt.keys, result)
    await rt.store.transition_task(gid, tid, TaskState.REVIEWING, expected_attempt=rec.attempt)
    await rt.store.transition_task(gid, tid, TaskState.DONE, expected_attempt=rec.attempt)
    return rec.attempt


async def running_goal(rt: Runtime, *tasks: dict[str, Any], gid: str = "g1") -> str:
    """A goal in `running` with plan v1 stored (as `plan` leaves it, before dispatch)."""
    await new_goal(rt, gid=gid)
    await rt.store.transition_goal(gid, GoalState.PLANNING)
    await rt.store.save_plan(gid, Plan.model_validate({"tasks": list(tasks)}), expected_version=0)
    await rt.store.transition_goal(gid, GoalState.RUNNING)
    return gid


# -- plan and dispatch ------------------------------------------------------------------------


async def test_plan_dispatches_exactly_the_independent_tasks(redis: ArqRedis, keys: Keys) -> None:
    """The demo plan (3 parallel order checks + a summary) stores v1 and dispatches only the 3 checks."""
    rt = runtime(redis, keys, DemoModel(latency=0))
    await new_goal(rt)
    await plan(rt, PlanJob(goal_id="g1"))
    goal = await rt.store.get_goal("g1")
    assert goal.state is GoalState.RUNNING and goal.plan_version == 1
    checks = ["check-a100", "check-a101", "check-a107"]
    assert await states(rt) == {**{t: ("ready", 1) for t in checks}, "summarize": ("pending", 0)}
    assert await queued(rt, "executor") == ids(rt, *(ExecuteJob(goal_id="g1", task_id=t, attempt=1) for t in checks))
    stored = await rt.store.get_plan("g1")
    assert all(set(t.tools) <= {"lookup_order", "refund_policy"} for t in stored.plan.tasks)


async def test_a_routed_first_call_is_stored_with_the_plan_and_never_asked_again(
    redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer
) -> None:
    """The model calls a goal's tool instead of planning: one task, its first turn stored with the plan
    in one write, dispatched once. A re-delivered plan job asks no model and dispatches nothing new."""
    rt = runtime(redis, keys, sdk(fake))
    await new_goal(rt, text="Look up order A100.", definition_of_done="states its status", check={"pattern": "A100"})
    fake.enqueue(tool_reply([("lookup_order", {"order_id": "A100"})]))
    await plan(rt, PlanJob(goal_id="g1"))
    stored = await rt.store.get_plan("g1")
    assert stored.route == "tool" and stored.first_turn is not None
    assert [u.name for u in stored.first_turn.tool_uses] == ["lookup_order"]
    [spec] = stored.plan.tasks
    assert (spec.id, spec.definition_of_done, spec.tools) == ("goal", "states its status", [t.name for t in CATALOG])
    assert spec.check is not None and spec.check.pattern == "A100"
    assert await states(rt) == {"goal": ("ready", 1)}
    assert await queued(rt, "executor") == ids(rt, ExecuteJob(goal_id="g1", task_id="goal", attempt=1))
    await plan(rt, PlanJob(goal_id="g1"))  # re-delivered
    assert len(fake.message_requests) == 1 and await states(rt) == {"goal": ("ready", 1)}
    assert len(await queued(rt, "executor")) == 1


async def test_a_direct_answer_or_an_unclear_reply_is_handled(
    redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer
) -> None:
    """A text answer is a one-task plan with no tools; a reply cut off at max_tokens is asked again with
    submit_plan forced (the goal's tools still defined, as the conversation refers to them)."""
    rt = runtime(redis, keys, sdk(fake))
    await new_goal(rt, text="Say hello.", gid="g1")
    fake.enqueue(text_reply("Hello."))
    await plan(rt, PlanJob(goal_id="g1"))
    direct = await rt.store.get_plan("g1")
    assert direct.route == "text" and direct.plan.tasks[0].tools == [] and direct.first_turn is not None
    await new_goal(rt, gid="g2")
    fake.enqueue(text_reply("Let me think", stop_reason="max_tokens"), plan_reply(task("a"), task("b")))
    await plan(rt, PlanJob(goal_id="g2"))
    forced = fake.message_requests[-1].body
    assert forced["tool_choice"] == {"type": "tool", "name": "submit_plan"}
    assert {t["name"] for t in forced["tools"]} == {t.name for t in CATALOG} | {"submit_plan"}
    second = await rt.store.get_plan("g2")
    assert second.route == "plan" and [t.id for t in second.plan.tasks] == ["a", "b"]


async def test_plan_prompt_lists_the_allowed_tools(redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer) -> None:
    """The planner prompt has the goal, its definition of done and only the tools the goal allows."""
    rt = runtime(redis, keys, sdk(fake))
    await new_goal(rt, definition_of_done="one line per order", allowed_tools=["lookup_order"])
    fake.enqueue(plan_reply(task("a", tools=("lookup_order",))))
    await plan(rt, PlanJob(goal_id="g1"))
    [request] = fake.message_requests
    text = json.dumps(request.body["messages"])
    assert "A100" in text and "one line per order" in text
    # Route first: the allowed tools are offered as definitions beside submit_plan, the model chooses.
    assert [t["name"] for t in request.body["tools"]] == ["lookup_order", "submit_plan"]
    assert request.body.get("tool_choice") in (None, {"type": "auto"})
    assert (await rt.store.get_goal("g1")).state is GoalState.RUNNING


async def test_a_large_catalog_is_narrowed_by_the_goals_words_but_any_tool_may_be_planned(
    redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer
) -> None:
    """Over tool_select_limit tools: the prompt lists the relevant ones; a plan may still use an unlisted one."""
    rt = runtime(redis, keys, sdk(fake), tool_select_limit=2)
    await new_goal(rt)
    fake.enqueue(plan_reply(task("a", tools=("lookup_order", "refund_policy"))))
    await plan(rt, PlanJob(goal_id="g1"))
    [request] = fake.message_requests
    offered = {t["name"] for t in request.body["tools"]}
    # lookup_order ranks below the two refund tools for this goal.
    assert offered == {"check_refund_eligibility", "refund_policy", "submit_plan"}
    assert (await rt.store.get_goal("g1")).state is GoalState.RUNNING  # lookup_order was accepted
async def test_a_goal_allowing_an_unknown_tool_fails_without_a_model_call(
    redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer
) -> None:
    """allowed_tools naming a tool no worker loaded: the goal fails naming it, and no plan is asked for."""
    rt = runtime(redis, keys, sdk(fake))
    await new_goal(rt, allowed_tools=["lookup_order", "nosuchtool"])
    await plan(rt, PlanJob(goal_id="g1"))
    goal = await rt.store.get_goal("g1")
    assert goal.state is GoalState.FAILED and goal.reason is not None
    assert "nosuchtool" in goal.reason and "lookup_order" in goal.reason  # the unknown one, and what is loaded
    assert fake.message_requests == []


async def test_plan_rerun_makes_no_second_model_call(redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer) -> None:
    """A re-delivered plan job for a running goal only re-dispatches: no model call, no new version."""
    rt = runtime(redis, keys, sdk(fake))
    await new_goal(rt)
    fake.enqueue(plan_reply(task("a"), task("b", "a")))
    await plan(rt, PlanJob(goal_id="g1"))
    await plan(rt, PlanJob(goal_id="g1"))
    assert len(fake.message_requests) == 1
    assert (await rt.store.get_goal("g1")).plan_version == 1
    assert await states(rt) == {"a": ("ready", 1), "b": ("pending", 0)}


async def test_plan_after_a_crash_uses_the_stored_plan(redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer) -> None:
    """A plan stored by a run that died before `running` is used as is; a claimed task is enqueued again."""
    rt = runtime(redis, keys, sdk(fake))
    await new_goal(rt)
    await rt.store.transition_goal("g1", GoalState.PLANNING)
    await rt.store.save_plan("g1", Plan.model_validate({"tasks": [task("a"), task("b")]}), expected_version=0)
    await rt.store.transition_task("g1", "a", TaskState.READY, attempt=1)  # claimed, never enqueued
    await plan(rt, PlanJob(goal_id="g1"))
    assert fake.message_requests == []
    assert (await rt.store.get_goal("g1")).state is GoalState.RUNNING
    assert await queued(rt, "executor") == ids(
        rt, ExecuteJob(goal_id="g1", task_id="a", attempt=1), ExecuteJob(goal_id="g1", task_id="b", attempt=1)
    )


async def test_cyclic_plan_is_sent_back_with_the_cycle_named(
    redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer
) -> None:
    """A cyclic plan is answered with an error tool_result naming the cycle; the corrected plan is stored."""
    rt = runtime(redis, keys, sdk(fake))
    await new_goal(rt)
    cyclic = plan_reply(task("a", "c"), task("b", "a"), task("c", "b"))
    fake.enqueue(cyclic, plan_reply(task("a"), task("b", "a"), task("c", "b")))
    await plan(rt, PlanJob(goal_id="g1"))
    _, second = fake.message_requests
    tool_use_id = cyclic.content[0]["id"]
    answer = second.body["messages"][-1]["content"][0]
    assert answer["type"] == "tool_result" and answer["tool_use_id"] == tool_use_id and answer["is_error"] is True
    assert "a -> c -> b -> a" in json.dumps(answer)
    assert second.body["messages"][-2]["role"] == "assistant"
    stored = await rt.store.get_plan("g1")
    assert [t.depends_on for t in stored.plan.tasks] == [[], ["a"], ["b"]]
    assert await states(rt) == {"a": ("ready", 1), "b": ("pending", 0), "c": ("pending", 0)}


async def test_schema_errors_are_sent_back_with_the_field(
    redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer
) -> None:
    """A plan that breaks the schema is refused with the path of the bad field, then corrected."""
    rt = runtime(redis, keys, sdk(fake))
    await new_goal(rt)
    broken = {k: v for k, v in task("a").items() if k != "definition_of_done"}
    fake.enqueue(tool_reply([("submit_plan", {"tasks": [broken]})]), plan_reply(task("a")))
    await plan(rt, PlanJob(goal_id="g1"))
    assert "tasks[0].definition_of_done: Field required" in json.dumps(fake.message_requests[1].body["messages"][-1])
    assert (await rt.store.get_goal("g1")).state is GoalState.RUNNING


async def test_goal_fails_after_max_plan_attempts(redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer) -> None:
    """Invalid plans max_plan_attempts times in a row fail the goal with the reasons; nothing is stored."""
    rt = runtime(redis, keys, sdk(fake), max_plan_attempts=3)
    await new_goal(rt)
    fake.respond_with(lambda _: plan_reply(task("a", tools=("teleport",))))
    await plan(rt, PlanJob(goal_id="g1"))
    goal = await rt.store.get_goal("g1")
    assert len(fake.message_requests) == 3
    assert goal.state is GoalState.FAILED and goal.plan_version == 0
    assert goal.reason is not None and "after 3 attempts" in goal.reason and "'teleport'" in goal.reason


async def test_budget_exhausted_stops_the_goal(redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer) -> None:
    """A model call the ledger refuses ends the goal as budget_exhausted, and nothing reaches the provider."""
    rt = runtime(redis, keys, sdk(fake))
    await new_goal(rt, budget=50)
    await plan(rt, PlanJob(goal_id="g1"))
    goal = await rt.store.get_goal("g1")
    assert goal.state is GoalState.BUDGET_EXHAUSTED and goal.reason and "budget" in goal.reason
    assert fake.message_requests == []


async def test_ended_goal_gets_no_model_call(redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer) -> None:
    """For a cancelled goal, plan, advance and replan do nothing and call no model."""
    rt = runtime(redis, keys, sdk(fake))
    await new_goal(rt)
    await rt.store.cancel_goal("g1")
    await plan(rt, PlanJob(goal_id="g1"))
    await advance(rt, AdvanceJob(goal_id="g1", task_id="a", attempt=1))
    await replan(rt, ReplanJob(goal_id="g1", plan_version=1))
    assert fake.message_requests == []
    assert (await rt.store.get_goal("g1")).state is GoalState.CANCELLED
    assert await queued(rt, "executor") == set()


# -- advance ----------------------------------------------------------------------------------

FOUR = (task("a"), task("b"), task("c"), task("d", "a", "b", "c"))


async def test_dependent_task_waits_for_all_its_dependencies(redis: ArqRedis, keys: Keys) -> None:
    """The dependent task is dispatched only once all 3 are accepted; then the goal goes to review."""
    rt = runtime(redis, keys, DemoModel(latency=0))
    await running_goal(rt, *FOUR)
    await advance(rt, AdvanceJob(goal_id="g1", task_id="a", attempt=1))  # first dispatch
    for n, tid in enumerate("abc", start=1):
        attempt = await accept(rt, "g1", tid)
        await advance(rt, AdvanceJob(goal_id="g1", task_id=tid, attempt=attempt))
        assert (await rt.store.get_task("g1", "d")).state is (TaskState.READY if n == 3 else TaskState.PENDING)
    assert rt.jobs.job_id(ExecuteJob(goal_id="g1", task_id="d", attempt=1)) in await queued(rt, "executor")
    assert (await rt.store.get_goal("g1")).state is GoalState.RUNNING
    await accept(rt, "g1", "d")
    await advance(rt, AdvanceJob(goal_id="g1", task_id="d", attempt=1))
    assert (await rt.store.get_goal("g1")).state is GoalState.REVIEWING
    key = accepted_key((await rt.store.get_plan("g1")).plan, await rt.store.get_tasks("g1"))
    assert key is not None
    assert await queued(rt, "critic") == ids(rt, ReviewGoalJob(goal_id="g1", plan_version=1, attempts=key))


async def test_concurrent_advances_dispatch_the_dependent_task_once(
    redis: ArqRedis, keys: Keys, redis_url: str
) -> None:
    """Critics accepting the 3 siblings at once, plus 20 duplicate advances, on separate connections,
    dispatch the dependent task exactly once (one claim, one event, one job) and never zero times."""
    rt = runtime(redis, keys, DemoModel(latency=0))
    await running_goal(rt, *FOUR)
    for tid in "abc":  # each sibling is in review, as the critics see it
        await rt.store.transition_task("g1", tid, TaskState.READY, attempt=1)
        await rt.store.transition_task("g1", tid, TaskState.RUNNING, expected_attempt=1)
        await rt.store.transition_task("g1", tid, TaskState.REVIEWING, expected_attempt=1)
    pools = [await create_pool(redis_settings(redis_url)) for _ in range(23)]
    try:
        go = asyncio.Event()

        async def critic_then_advance(pool: ArqRedis, tid: str | None) -> None:
            prt = runtime(pool, keys, DemoModel(latency=0))
            await go.wait()
            if tid is not None:
                await prt.store.transition_task("g1", tid, TaskState.DONE, expected_attempt=1)
            await advance(prt, AdvanceJob(goal_id="g1", task_id=tid or "a", attempt=1))

        who = [*"abc", *([None] * 20)]
        runners = [asyncio.create_task(critic_then_advance(p, t)) for p, t in zip(pools, who, strict=True)]
        await asyncio.sleep(0.05)
        go.set()
        await asyncio.gather(*runners)
    finally:
        for p in pools:
            await p.aclose()
    assert await states(rt) == {"a": ("done", 1), "b": ("done", 1), "c": ("done", 1), "d": ("ready", 1)}
    events = [e for e in await rt.events.read("g1") if e.task_id == "d" and e.data.get("state") == "ready"]
    assert len(events) == 1
    assert await queued(rt, "executor") == ids(rt, ExecuteJob(goal_id="g1", task_id="d", attempt=1))


# -- replan -----------------------------------------------------------------------------------


async def replanning_goal(rt: Runtime) -> None:
    """Plan v1: a, b, c (after a and b); a accepted, b failed review; goal replanning."""
    await running_goal(rt, task("a"), task("b"), task("c", "a", "b"))
    await accept(rt, "g1", "a", answer="A-RESULT: order A100 is refundable")
    await rt.store.transition_task("g1", "b", TaskState.READY, attempt=1)
    await rt.store.transition_task("g1", "b", TaskState.RUNNING, expected_attempt=1)
    await rt.store.transition_task("g1", "b", TaskState.REVIEWING, expected_attempt=1)
    await rt.store.transition_task("g1", "b", TaskState.FAILED, expected_attempt=1, reason="B-FAILED: no such order")
    await rt.store.transition_goal("g1", GoalState.REPLANNING)


async def test_replan_keeps_accepted_work_and_supersedes_the_rest(
    redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer
) -> None:
    """Kept tasks stay done and are not re-run; changed ones come back with a new attempt; dropped ones
    are superseded; the prompt carries the accepted result and what failed."""
    rt = runtime(redis, keys, sdk(fake))
    await replanning_goal(rt)
    fake.enqueue(plan_reply(task("a"), task("b", dod="Use the order id B200."), task("n", "a", "b")))
    await replan(rt, ReplanJob(goal_id="g1", plan_version=1, reason="task b cannot pass"))
    prompt = json.dumps(fake.message_requests[0].body["messages"])
    assert "A-RESULT" in prompt and "B-FAILED" in prompt and "task b cannot pass" in prompt
    goal = await rt.store.get_goal("g1")
    assert goal.state is GoalState.RUNNING and goal.plan_version == 2 and goal.replans == 1
    assert await states(rt) == {"a": ("done", 1), "b": ("ready", 2), "c": ("superseded", 0), "n": ("pending", 0)}
    assert (await rt.store.get_task("g1", "b")).plan_version == 2
    assert await queued(rt, "executor") == ids(rt, ExecuteJob(goal_id="g1", task_id="b", attempt=2))
    # A re-delivered replan job changes nothing and calls no model.
    await replan(rt, ReplanJob(goal_id="g1", plan_version=1, reason="task b cannot pass"))
    assert len(fake.message_requests) == 1 and (await rt.store.get_goal("g1")).plan_version == 2


async def test_replan_of_only_accepted_work_goes_straight_to_review(
    redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer
) -> None:
    """A new plan made only of kept, done tasks needs no execution: the goal goes to its final review."""
    rt = runtime(redis, keys, sdk(fake))
    await replanning_goal(rt)
    fake.enqueue(plan_reply(task("a")))
    await replan(rt, ReplanJob(goal_id="g1", plan_version=1))
    assert (await rt.store.get_goal("g1")).state is GoalState.REVIEWING
    key = accepted_key((await rt.store.get_plan("g1")).plan, await rt.store.get_tasks("g1"))
    assert await queued(rt, "critic") == ids(rt, ReviewGoalJob(goal_id="g1", plan_version=2, attempts=key or ""))
    assert await queued(rt, "executor") == set()


async def test_replans_are_bounded(redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer) -> None:
    """Once max_replans were made, a further replan fails the goal with a report and calls no model."""
    rt = runtime(redis, keys, sdk(fake), max_replans=0)
    await replanning_goal(rt)
    await replan(rt, ReplanJob(goal_id="g1", plan_version=1, reason="task b cannot pass"))
    goal = await rt.store.get_goal("g1")
    assert goal.state is GoalState.FAILED and fake.message_requests == []
    assert goal.reason is not None and "0 replans" in goal.reason and "B-FAILED" in goal.reason


async def test_invalid_replan_is_corrected_like_a_plan(redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer) -> None:
    """A replan naming an unknown dependency is sent back; the corrected plan becomes version 2."""
    rt = runtime(redis, keys, sdk(fake))
    await replanning_goal(rt)
    fake.enqueue(plan_reply(task("a"), task("x", "ghost")), plan_reply(task("a"), task("x", "a")))
    await replan(rt, ReplanJob(goal_id="g1", plan_version=1))
    assert "depends on 'ghost'" in json.dumps(fake.message_requests[1].body["messages"][-1])
    assert (await rt.store.get_plan("g1")).version == 2
    assert (await states(rt))["x"] == ("ready", 1)


class RacingModel:
    """A model during whose call another planner stores its plan first (the StaleWrite race)."""

    name = "racing"
    model = "demo"

    def __init__(self, store_first: Any) -> None:
        self.store_first = store_first
        self.inner = DemoModel(latency=0)

    async def complete(self, request: ModelRequest) -> ModelResponse:
        await self.store_first()
        return self.inner.respond(request)


async def test_plan_stored_by_a_concurrent_planner_wins(redis: ArqRedis, keys: Keys) -> None:
    """When another run stored version 1 during the model call, the stored plan is used, not a second one."""
    holder: list[Runtime] = []

    async def store_first() -> None:
        other = Plan.model_validate({"tasks": [task("theirs")]})
        await holder[0].store.save_plan("g1", other, expected_version=0)

    rt = runtime(redis, keys, RacingModel(store_first))
    holder.append(rt)
    await new_goal(rt)
    await plan(rt, PlanJob(goal_id="g1"))
    goal = await rt.store.get_goal("g1")
    assert goal.state is GoalState.RUNNING and goal.plan_version == 1
    assert [t.id for t in (await rt.store.get_plan("g1")).plan.tasks] == ["theirs"]
    assert await queued(rt, "executor") == ids(rt, ExecuteJob(goal_id="g1", task_id="theirs", attempt=1))
