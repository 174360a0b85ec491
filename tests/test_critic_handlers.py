"""Critic handlers against a real Redis: task verdicts (accept / retry / replan), goal review, stop conditions.

Models: the offline DemoModel, or the real Anthropic SDK against the fake Messages API server for
scripted verdicts; both behind the metered ModelFactory with the goal's ledger opened.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from arq.connections import ArqRedis
from helpers import store_result

from bus.jobs import AdvanceJob, ExecuteJob, JobPayload, ReplanJob, ReviewGoalJob, ReviewJob
from bus.keys import Keys
from bus.ledger import Ledger
from bus.metered import ModelFactory
from bus.runtime import Limits, Runtime
from bus.schemas import Event, FinalVerdict, Goal, GoalRecord, GoalState, Plan, TaskResult, TaskState
from bus.synthesis import accepted_key
from critic.handlers import conclude, review, review_goal
from llm import DemoModel
from llm.anthropic import AnthropicModel
from llm.demo import DEADLINE_DOD, FEEDBACK
from llm.port import ModelPort
from llm.testing import FakeAnthropicServer, Reply, text_reply, tool_reply


@pytest.fixture
async def fake() -> AsyncIterator[FakeAnthropicServer]:
    async with FakeAnthropicServer() as server:
        yield server


def runtime(redis: ArqRedis, keys: Keys, model: ModelPort, **limits: Any) -> Runtime:
    return Runtime.build(redis, keys, models=ModelFactory(model, Ledger(redis, keys)), limits=Limits(**limits))


def sdk(server: FakeAnthropicServer) -> AnthropicModel:
    return AnthropicModel("claude-test", api_key="sk-ant-test", base_url=server.base_url, max_retries=0)


def final(answer: str, passed: bool, action: str, feedback: str = "") -> Reply:
    body = {"answer": answer, "passed": passed, "action": action, "feedback": feedback}
    return tool_reply([("submit_final", body)])


def verdict(passed: bool, action: str, feedback: str = "") -> Reply:
    return text_reply(json.dumps({"passed": passed, "action": action, "feedback": feedback}))


def task(tid: str, *deps: str, dod: str = "States the number.", tools: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "id": tid,
        "title": f"task {tid}",
        "instructions": f"INSTRUCTIONS-{tid}: compute it.",
        "depends_on": list(deps),
        "definition_of_done": dod,
        "tools": list(tools),
    }


async def running_goal(rt: Runtime, *tasks: dict[str, Any], budget: int = 100_000, dod: str = "") -> None:
    goal = Goal(text="GOAL-TEXT: what is the answer?", definition_of_done=dod)
    await rt.store.create_goal(GoalRecord(id="g1", goal=goal, budget_tokens=budget))
    await Ledger(rt.redis, rt.keys).open("g1", budget)
    await rt.store.transition_goal("g1", GoalState.PLANNING)
    await rt.store.save_plan("g1", Plan.model_validate({"tasks": list(tasks)}), expected_version=0)
    await rt.store.transition_goal("g1", GoalState.RUNNING)


async def in_review(
    rt: Runtime,
    tid: str,
    answer: str = "ANSWER: 42",
    *,
    attempt: int = 1,
    stop: str = "answered",
    tool_calls: int = 1,
    first_attempt: int | None = None,
) -> None:
    """Walk a task to `reviewing` at `attempt` with its result stored, as the executor leaves it."""
    await rt.store.transition_task("g1", tid, TaskState.READY, attempt=attempt, first_attempt=first_attempt)
    await rt.store.transition_task("g1", tid, TaskState.RUNNING, expected_attempt=attempt)
    result = TaskResult(
        goal_id="g1", task_id=tid, attempt=attempt, answer=answer, stop_reason=stop, tool_calls=tool_calls
    )
    await store_result(rt.redis, rt.keys, result)
    await rt.store.transition_task("g1", tid, TaskState.REVIEWING, expected_attempt=attempt)


async def reviewing_goal(rt: Runtime, dod: str = "GOAL-DOD: one number") -> None:
    """Plan v1 of two tasks, both accepted; goal in `reviewing`."""
    await running_goal(rt, task("a"), task("b", "a"), dod=dod)
    for tid, answer in (("a", "RESULT-A: 40"), ("b", "RESULT-B: 42")):
        await in_review(rt, tid, answer)
        await rt.store.transition_task("g1", tid, TaskState.DONE, expected_attempt=1)
    await rt.store.transition_goal("g1", GoalState.REVIEWING)


async def queued(rt: Runtime, role: str) -> set[str]:
    return {m.decode() for m in await rt.redis.zrange(rt.keys.queue(role), 0, -1)}


def ids(rt: Runtime, *jobs: JobPayload) -> set[str]:
    return {rt.jobs.job_id(j) for j in jobs}


async def verdicts(rt: Runtime) -> list[Event]:
    return [e for e in await rt.events.read("g1") if e.type == "critic.verdict"]


# -- task review ------------------------------------------------------------------------------


async def test_accepting_the_only_task_concludes_the_goal_with_its_answer(redis: ArqRedis, keys: Keys) -> None:
    """A goal of one task: its review is the goal's review, and its accepted answer the goal's answer
    (no advance, no final-answer call); one critic.verdict event."""
    rt = runtime(redis, keys, DemoModel(latency=0))
    await running_goal(rt, task("t"))
    await in_review(rt, "t")
    await review(rt, ReviewJob(goal_id="g1", task_id="t", attempt=1))
    rec = await rt.store.get_task("g1", "t")
    assert rec.state is TaskState.DONE and rec.attempt == 1
    goal = await rt.store.get_goal("g1")
    assert goal.state is GoalState.SUCCEEDED and goal.answer == "ANSWER: 42"
    assert await queued(rt, "planner") == set() and await queued(rt, "critic") == set()
    [event] = await verdicts(rt)
    assert event.task_id == "t" and event.data["passed"] is True and event.data["action"] == "accept"


async def test_accept_asks_to_advance_only_when_a_task_waits_or_the_final_answer_is_missing(
    redis: ArqRedis, keys: Keys
) -> None:
    """a has a dependent: accepting it asks the planner to dispatch. b and c have none: accepting b
    (c still open) enqueues nothing for the planner; accepting c, the last, with no final answer
    written for these attempts, hands the goal to the planner for its final review."""
    rt = runtime(redis, keys, DemoModel(latency=0))
    await running_goal(rt, task("a"), task("b"), task("d", "a"), task("c"))
    for tid in ("a", "b"):
        await in_review(rt, tid)
    await review(rt, ReviewJob(goal_id="g1", task_id="a", attempt=1))
    assert await queued(rt, "planner") == ids(rt, AdvanceJob(goal_id="g1", task_id="a", attempt=1))
    await review(rt, ReviewJob(goal_id="g1", task_id="b", attempt=1))
    assert await queued(rt, "planner") == ids(rt, AdvanceJob(goal_id="g1", task_id="a", attempt=1))
    for tid in ("d", "c"):
        await in_review(rt, tid)
    await rt.jobs.redis.delete(rt.keys.queue("critic"))  # the speculative final answer's job: never run
    await review(rt, ReviewJob(goal_id="g1", task_id="d", attempt=1))
    await review(rt, ReviewJob(goal_id="g1", task_id="c", attempt=1))
    assert rt.jobs.job_id(AdvanceJob(goal_id="g1", task_id="c", attempt=1)) in await queued(rt, "planner")
    assert (await rt.store.get_goal("g1")).state is GoalState.RUNNING


async def test_rejection_retries_with_the_feedback(redis: ArqRedis, keys: Keys) -> None:
    """A rejected first attempt goes to retrying with attempt 2 and the feedback; attempt 2 is enqueued."""
    rt = runtime(redis, keys, DemoModel(latency=0))
    await running_goal(rt, task("t", dod=f"States whether order A100 can be refunded {DEADLINE_DOD}."))
    await in_review(rt, "t", "Order A100 can be refunded.")
    await review(rt, ReviewJob(goal_id="g1", task_id="t", attempt=1))
    rec = await rt.store.get_task("g1", "t")
    assert rec.state is TaskState.RETRYING and rec.attempt == 2 and rec.feedback == FEEDBACK
    assert await queued(rt, "executor") == ids(rt, ExecuteJob(goal_id="g1", task_id="t", attempt=2))
    [event] = await verdicts(rt)
    assert event.data == {
        "passed": False,
        "action": "retry",
        "feedback": FEEDBACK,
        "attempt": 1,
        "review": "every_task",
        "deterministic": False,
    }
    *_, verdict_event, moved = await rt.events.read("g1")  # the verdict, then the move it made (one script)
    assert verdict_event.type == "critic.verdict" and moved.type == "task.state"
    assert moved.task_id == "t" and moved.data["state"] == "retrying"
    # A re-delivered review of attempt 1 only re-enqueues attempt 2: no second verdict.
    await review(rt, ReviewJob(goal_id="g1", task_id="t", attempt=1))
    assert len(await verdicts(rt)) == 1 and (await rt.store.get_task("g1", "t")).attempt == 2


async def test_retries_exhausted_becomes_a_replan(redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer) -> None:
    """A retry verdict on the last allowed attempt fails the task and asks the planner to replan."""
    rt = runtime(redis, keys, sdk(fake), max_task_retries=2)
    await running_goal(rt, task("t", dod="DOD-T: the exact number"))
    await in_review(rt, "t", "ANSWER-3: about 40", attempt=3)
    fake.enqueue(verdict(False, "retry", "still not exact"))
    await review(rt, ReviewJob(goal_id="g1", task_id="t", attempt=3))
    prompt = json.dumps(fake.message_requests[0].body)
    assert all(s in prompt for s in ("GOAL-TEXT", "INSTRUCTIONS-t", "DOD-T", "ANSWER-3"))
    rec = await rt.store.get_task("g1", "t")
    assert rec.state is TaskState.FAILED and rec.reason is not None and "still not exact" in rec.reason
    assert (await rt.store.get_goal("g1")).state is GoalState.REPLANNING
    assert await queued(rt, "planner") == ids(rt, ReplanJob(goal_id="g1", plan_version=1))
    [event] = await verdicts(rt)
    assert event.data["action"] == "replan"


async def test_retries_are_counted_per_plan_version(redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer) -> None:
    """A task a replan brought back (first attempt 3 of this version) still gets its retries on attempt 3."""
    rt = runtime(redis, keys, sdk(fake), max_task_retries=2)
    await running_goal(rt, task("t", dod="DOD-T: the exact number"))
    await in_review(rt, "t", "ANSWER-3: about 40", attempt=3, first_attempt=3)
    fake.enqueue(verdict(False, "retry", "still not exact"))
    await review(rt, ReviewJob(goal_id="g1", task_id="t", attempt=3))
    rec = await rt.store.get_task("g1", "t")
    assert rec.state is TaskState.RETRYING and rec.attempt == 4 and rec.first_attempt == 3
    assert (await rt.store.get_goal("g1")).state is GoalState.RUNNING


async def test_stopped_attempt_is_judged_without_a_model(
    redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer
) -> None:
    """An attempt that stopped on max_steps is retried with feedback naming it, and no model is called."""
    rt = runtime(redis, keys, sdk(fake))
    await running_goal(rt, task("t"))
    await in_review(rt, "t", "", stop="max_steps")
    await review(rt, ReviewJob(goal_id="g1", task_id="t", attempt=1))
    assert fake.message_requests == []
    rec = await rt.store.get_task("g1", "t")
    assert rec.state is TaskState.RETRYING and rec.attempt == 2 and rec.feedback and "max_steps" in rec.feedback
    [event] = await verdicts(rt)
    assert event.data["deterministic"] is True


async def test_invalid_verdict_gets_one_correction_then_retries(
    redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer
) -> None:
    """An inconsistent verdict is sent back once, naming the problem; a second one counts as a retry.
    The verdict is a JSON reply: no tool is offered to the reviewer."""
    rt = runtime(redis, keys, sdk(fake))
    await running_goal(rt, task("t"))
    await in_review(rt, "t")
    fake.enqueue(verdict(True, "retry"), verdict(True, "replan"))
    await review(rt, ReviewJob(goal_id="g1", task_id="t", attempt=1))
    assert len(fake.message_requests) == 2
    assert all(not r.body.get("tools") for r in fake.message_requests)
    *_, replayed, answer = fake.message_requests[1].body["messages"]
    assert replayed["role"] == "assistant" and '"retry"' in replayed["content"][0]["text"]
    assert answer["role"] == "user" and "passed=true goes with action 'accept'" in answer["content"][0]["text"]
    rec = await rt.store.get_task("g1", "t")
    assert rec.state is TaskState.RETRYING and rec.attempt == 2


async def test_a_verdict_wrapped_in_prose_or_a_fence_is_read_and_no_object_is_sent_back(
    redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer
) -> None:
    """The verdict object is read from the reply's text wherever it sits; a reply with no object at
    all gets one correction, then the accepted verdict applies."""
    rt = runtime(redis, keys, sdk(fake))
    await running_goal(rt, task("t"))
    await in_review(rt, "t")
    fenced = '```json\n{"passed": false, "action": "retry", "feedback": "cite the source"}\n```'
    fake.enqueue(text_reply("I think it is fine."), text_reply("Here it is: " + fenced))
    await review(rt, ReviewJob(goal_id="g1", task_id="t", attempt=1))
    assert len(fake.message_requests) == 2
    correction = fake.message_requests[1].body["messages"][-1]["content"][0]["text"]
    assert "no JSON object" in correction
    rec = await rt.store.get_task("g1", "t")
    assert rec.state is TaskState.RETRYING and rec.feedback == "cite the source"


async def test_review_of_an_old_attempt_calls_no_model(redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer) -> None:
    """A review job for an attempt that is no longer in review changes nothing and calls no model."""
    rt = runtime(redis, keys, sdk(fake))
    await running_goal(rt, task("t"))
    await in_review(rt, "t", attempt=2)
    await review(rt, ReviewJob(goal_id="g1", task_id="t", attempt=1))
    assert fake.message_requests == [] and (await rt.store.get_task("g1", "t")).state is TaskState.REVIEWING


async def test_budget_exhausted_in_review_stops_the_goal(
    redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer
) -> None:
    """A verdict call the ledger refuses ends the goal as budget_exhausted; the task is left in review."""
    rt = runtime(redis, keys, sdk(fake))
    await running_goal(rt, task("t"), budget=50)
    await in_review(rt, "t")
    await review(rt, ReviewJob(goal_id="g1", task_id="t", attempt=1))
    assert (await rt.store.get_goal("g1")).state is GoalState.BUDGET_EXHAUSTED
    assert fake.message_requests == []


async def test_ended_goal_gets_no_model_call(redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer) -> None:
    """For a cancelled goal, review and review_goal do nothing and call no model."""
    rt = runtime(redis, keys, sdk(fake))
    await reviewing_goal(rt)
    await rt.store.cancel_goal("g1")
    await review(rt, ReviewJob(goal_id="g1", task_id="a", attempt=1))
    await review_goal(rt, ReviewGoalJob(goal_id="g1", plan_version=1))
    assert fake.message_requests == []
    assert (await rt.store.get_goal("g1")).state is GoalState.CANCELLED


# -- goal review ------------------------------------------------------------------------------


async def test_goal_review_pass_succeeds_with_the_answer(
    redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer
) -> None:
    """The final answer is written from the accepted results and judged against the goal's DoD in one
    forced call, and stored."""
    rt = runtime(redis, keys, sdk(fake))
    await reviewing_goal(rt)
    fake.enqueue(final("FINAL: the answer is 42", True, "accept", "meets it"))
    await review_goal(rt, ReviewGoalJob(goal_id="g1", plan_version=1))
    [call] = fake.message_requests
    assert all(s in json.dumps(call.body) for s in ("GOAL-TEXT", "GOAL-DOD", "RESULT-A: 40", "RESULT-B: 42"))
    assert call.body["tool_choice"] == {"type": "tool", "name": "submit_final"}
    goal = await rt.store.get_goal("g1")
    assert goal.state is GoalState.SUCCEEDED and goal.answer == "FINAL: the answer is 42"
    [event] = await verdicts(rt)
    assert event.task_id is None and event.data["action"] == "accept" and event.data["plan_version"] == 1
    # Written with the move, just before it: a reader that sees `succeeded` has the verdict too.
    *_, verdict_event, succeeded = await rt.events.read("g1")
    assert verdict_event.type == "critic.verdict" and verdict_event.task_id is None
    assert succeeded.type == "goal.state" and succeeded.data["state"] == "succeeded"


async def test_a_final_answer_just_written_concludes_without_reading_it_back(
    redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer
) -> None:
    """A critic that knows the plan (its reviews read it) reads only the tasks' progress for the final
    answer, and hands `conclude` the answer it stored: the goal succeeds with it. `conclude` uses an
    answer handed to it only for the goal's plan version and its accepted attempts; otherwise it reads
    the stored one (none here: the final answer is missing)."""
    rt = runtime(redis, keys, sdk(fake))
    await reviewing_goal(rt)
    stored = await rt.store.get_plan("g1", 1)
    assert rt.store.known_plan("g1", 1) == stored
    key = accepted_key(stored.plan, await rt.store.get_progress("g1", stored.plan.task_ids()))
    assert key is not None
    handed = FinalVerdict(answer="HANDED", passed=True, action="accept", feedback="ok")
    assert await conclude(rt, "g1", stored, (2, key, handed)) == "final_missing"
    assert await conclude(rt, "g1", stored, (1, "another-key", handed)) == "final_missing"
    assert (await rt.store.get_goal("g1")).state is GoalState.REVIEWING
    fake.enqueue(final("FINAL: the answer is 42", True, "accept", "meets it"))
    await review_goal(rt, ReviewGoalJob(goal_id="g1", plan_version=1))
    goal = await rt.store.get_goal("g1")
    assert goal.state is GoalState.SUCCEEDED and goal.answer == "FINAL: the answer is 42"
    assert len(fake.message_requests) == 1
    # Another goal, concluded with an answer handed over and none stored: it is the goal's answer.
    await redis.delete(*[k async for k in redis.scan_iter(match=f"{keys.prefix}*")])
    await reviewing_goal(rt)
    assert await conclude(rt, "g1", stored, (1, key, handed)) == "concluded"
    assert (await rt.store.get_goal("g1")).answer == "HANDED"


async def test_goal_review_fail_replans(redis: ArqRedis, keys: Keys, fake: FakeAnthropicServer) -> None:
    """A final answer that misses the goal's DoD sends the goal to replanning with the feedback."""
    rt = runtime(redis, keys, sdk(fake))
    await reviewing_goal(rt)
    fake.enqueue(final("FINAL: maybe", False, "replan", "no number given"))
    await review_goal(rt, ReviewGoalJob(goal_id="g1", plan_version=1))
    goal = await rt.store.get_goal("g1")
    assert goal.state is GoalState.REPLANNING and goal.answer is None
    assert await queued(rt, "planner") == ids(rt, ReplanJob(goal_id="g1", plan_version=1))
    [event] = await verdicts(rt)
    assert event.data["passed"] is False and event.data["feedback"] == "no number given"
    # Re-delivered: nothing new is asked of the model.
    await review_goal(rt, ReviewGoalJob(goal_id="g1", plan_version=1))
    assert len(fake.message_requests) == 1


async def test_goal_review_with_the_demo_model(redis: ArqRedis, keys: Keys) -> None:
    """The offline demo model follows the protocol end to end: the goal succeeds with a non-empty answer."""
    rt = runtime(redis, keys, DemoModel(latency=0))
    await reviewing_goal(rt, dod="")
    await review_goal(rt, ReviewGoalJob(goal_id="g1", plan_version=1))
    goal = await rt.store.get_goal("g1")
    assert goal.state is GoalState.SUCCEEDED and goal.answer
