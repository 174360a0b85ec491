"""End to end, real worker processes against the fake Messages API: the shorter critical path.

Route first (the planner's model starts a one-task goal itself, or answers it), one review for a
one-task goal, the final answer written speculatively and dropped when a review rejects, review
policies, and machine checks that decide without a model call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arq.connections import ArqRedis
from test_e2e import _first_user, _tool_results, fleet, requests_of, review_attempt, role_of, spec, task_of, worker_env

from bus.client import Client
from bus.keys import Keys
from bus.ledger import Ledger
from bus.schemas import Event, GoalRecord, GoalState, TaskState
from critic.prompts import FINAL_TOOL
from llm.testing import Failure, FakeAnthropicServer, RecordedRequest, Script, error_body, text_reply, tool_reply
from planner.prompts import PLAN_TOOL, ROUTED_TASK_ID

ACCEPT = {"passed": True, "action": "accept", "feedback": "ok"}


def _forced(req: RecordedRequest) -> str | None:
    choice = req.body.get("tool_choice") or {}
    return choice.get("name") if choice.get("type") == "tool" else None


def _attempt_of_executor(req: RecordedRequest) -> int:
    return 2 if "Reviewer feedback:" in _first_user(req) else 1


@dataclass
class Paths:
    """The model, by a marker in the goal's text (every role's first message quotes the goal):

    ROUTE-TOOL: the planner calls `count` itself (route first); the executor then answers (a retry,
    which starts without the routed turn, calls `count` first).
    ROUTE-TEXT: the planner answers in text.
    WIDE: the planner submits a plan of tasks a and b; the final answer quotes the results it was given.
    REJECT-B: with WIDE, b's first review waits `slow_review` s and rejects it.
    BAD-FIRST: the executor's first attempt answers without the pattern the goal's check asks for.
    """

    slow_review: float = 1.5
    unrouted: list[RecordedRequest] = field(default_factory=list)

    def __call__(self, req: RecordedRequest) -> Script:
        role, text = role_of(req), _first_user(req)
        if role == "planner":
            if "ROUTE-TOOL" in text and _forced(req) is None:
                return tool_reply([("count", {"name": "routed"})])
            if "ROUTE-TEXT" in text and _forced(req) is None:
                return text_reply("The direct answer.")
            if "WIDE" in text:
                return tool_reply([(PLAN_TOOL, {"tasks": [spec("a"), spec("b")]})])
        elif role == "executor":
            tid, attempt = task_of(req) or "?", _attempt_of_executor(req)
            if tid != ROUTED_TASK_ID:
                return text_reply(f"result of {tid} attempt {attempt}")
            if not _tool_results(req):  # a retry starts afresh: no routed turn
                return tool_reply([("count", {"name": "routed"})])
            if "BAD-FIRST" in text and attempt == 1:
                return text_reply("I could not find it.")
            return text_reply(f"Record routed counted (attempt {attempt}).")
        elif role == "review":
            if "REJECT-B" in text and task_of(req) == "b" and review_attempt(req) == 1:
                verdict = {"passed": False, "action": "retry", "feedback": "B-IS-WRONG"}
                return text_reply(json.dumps(verdict), delay=self.slow_review)
            return text_reply(json.dumps(ACCEPT))
        elif role == "goal_review":
            quoted = sorted(set(re.findall(r"result of \w+ attempt \d", text)))
            return tool_reply([(FINAL_TOOL, {**ACCEPT, "answer": "final: " + "; ".join(quoted)})])
        self.unrouted.append(req)
        return Failure(status=400, body=error_body(400, "the test responder cannot route this request"))


def roles(fake: FakeAnthropicServer, marker: str) -> list[str]:
    return [role_of(r) for r in fake.message_requests if marker in _first_user(r)]


async def events_of(client: Client, gid: str) -> list[Event]:
    return [e async for e in client.events(gid, follow=False)]


async def run(client: Client, goal: dict[str, Any]) -> GoalRecord:
    gid = await client.submit(goal)
    return await client.wait(gid, timeout=30)


async def test_route_first_one_task_goals_and_direct_answers(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """The planner's model calls a tool itself: the goal is one task whose first step was that call (the
    executor runs it, once, and continues), reviewed once, and its answer is the goal's. A goal it answers
    in text is one task with that answer, reviewed. Review policy `none`: no review call at all."""
    model = Paths()
    with FakeAnthropicServer() as fake:
        fake.respond_with(model)
        env = worker_env(subprocess_env, fake, tmp_path)
        client = Client(redis, keys, default_budget_tokens=200_000)
        async with fleet(env, tmp_path, "planner", "critic", "executor"):
            routed = await run(client, {"text": "ROUTE-TOOL: count the routed record"})
            direct = await run(client, {"text": "ROUTE-TEXT: say something"})
            unreviewed = await run(client, {"text": "ROUTE-TOOL unreviewed", "review": "none"})
            routed_events = await events_of(client, routed.id)
            routed_books = await Ledger(redis, keys).snapshot(routed.id)
            routed_tasks = await client.store.get_tasks(routed.id)
    assert not model.unrouted
    assert routed.state is GoalState.SUCCEEDED, routed
    assert routed.answer == "Record routed counted (attempt 1)."
    # plan (the tool call), the executor's answer turn, one review: no final answer, no goal review
    assert roles(fake, "ROUTE-TOOL: count") == ["planner", "executor", "review"]
    assert routed_books.calls == 3
    [executor_request] = [r for r in requests_of(fake, "executor") if "ROUTE-TOOL: count" in _first_user(r)]
    [result] = _tool_results(executor_request)
    assert result["content"] == "counted routed"  # the planner's call, run by the executor's gateway
    assert (tmp_path / "counter.txt").read_text().splitlines() == ["routed", "routed"]  # once per routed goal
    assert {t: (r.state, r.attempt) for t, r in routed_tasks.items()} == {ROUTED_TASK_ID: (TaskState.DONE, 1)}
    [stored] = [e for e in routed_events if e.type == "plan.stored"]
    assert stored.data["route"] == "tool" and stored.data["tasks"] == [ROUTED_TASK_ID]
    [tool_event] = [e for e in routed_events if e.type == "tool.call"]
    assert tool_event.data["tool"] == "count"

    assert direct.state is GoalState.SUCCEEDED and direct.answer == "The direct answer.", direct
    assert roles(fake, "ROUTE-TEXT") == ["planner", "review"]  # the executor had nothing to ask

    assert unreviewed.state is GoalState.SUCCEEDED, unreviewed
    assert roles(fake, "ROUTE-TOOL unreviewed") == ["planner", "executor"]
    submitted = (await events_of(client, unreviewed.id))[0]
    assert submitted.type == "goal.submitted" and submitted.data["review"] == "none"


async def test_a_speculative_final_answer_is_dropped_when_a_review_rejects(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """a and b reach review; the final answer is written from their attempts while b's review still
    runs. b is rejected: that answer is never used; the goal's answer is written from b's accepted
    retry, and never quotes the rejected attempt."""
    model = Paths()
    with FakeAnthropicServer() as fake:
        fake.respond_with(model)
        env = worker_env(subprocess_env, fake, tmp_path)
        client = Client(redis, keys, default_budget_tokens=200_000)
        async with fleet(env, tmp_path, "planner", "critic", "executor"):
            goal = await run(client, {"text": "WIDE REJECT-B"})
            # The goal's verdict event is written by the same script as the move to succeeded, just
            # before it: read once, the moment the goal has succeeded, it is there.
            events = await events_of(client, goal.id)
            [ended] = [i for i, e in enumerate(events) if e.type == "goal.state" and e.data["state"] == "succeeded"]
            assert events[ended - 1].type == "critic.verdict" and events[ended - 1].task_id is None
    assert not model.unrouted
    assert goal.state is GoalState.SUCCEEDED, goal
    finals = requests_of(fake, "goal_review")
    assert len(finals) == 2, [_first_user(r) for r in finals]
    speculative, used = finals
    b_review = next(r for r in requests_of(fake, "review", "b") if review_attempt(r) == 1)
    # The first was asked before b's (slow, rejecting) review answered, from b's attempt 1.
    assert speculative.at < b_review.at + model.slow_review
    assert "result of b attempt 1" in _first_user(speculative)
    assert "result of b attempt 2" in _first_user(used) and "result of b attempt 1" not in _first_user(used)
    assert goal.answer == "final: result of a attempt 1; result of b attempt 2"
    verdicts = [(e.task_id, e.data["action"]) for e in events if e.type == "critic.verdict"]
    assert ("b", "retry") in verdicts and verdicts[-1] == (None, "accept")


async def test_machine_checks_decide_without_a_model_call_and_final_only_reviews_once(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """A goal's machine check is its one task's definition of done: a failing answer is retried with
    feedback naming the check, a passing one accepted, and no review is asked of the model. Review
    policy `final_only`: tasks are accepted without a model review; the final answer is still judged."""
    model = Paths()
    check = {"tools_called": ["count"], "pattern": "^Record routed counted"}
    with FakeAnthropicServer() as fake:
        fake.respond_with(model)
        env = worker_env(subprocess_env, fake, tmp_path)
        client = Client(redis, keys, default_budget_tokens=200_000)
        async with fleet(env, tmp_path, "planner", "critic", "executor"):
            checked = await run(client, {"text": "ROUTE-TOOL BAD-FIRST checked", "check": check})
            checked_events = await events_of(client, checked.id)
            final_only = await run(client, {"text": "WIDE final only", "review": "final_only"})
            status = await client.status(final_only.id)
    assert not model.unrouted
    assert checked.state is GoalState.SUCCEEDED, checked
    assert checked.answer == "Record routed counted (attempt 2)."
    assert "review" not in roles(fake, "BAD-FIRST")
    # attempt 1: the answer after the routed call; attempt 2: a count call, then the answer
    first, *second = [r for r in requests_of(fake, "executor") if "BAD-FIRST" in _first_user(r)]
    assert len(second) == 2 and "Reviewer feedback" not in _first_user(first)
    assert "Reviewer feedback: Machine check failed: check pattern failed" in _first_user(second[0])
    verdicts = [e.data for e in checked_events if e.type == "critic.verdict"]
    assert [(v["action"], v["deterministic"]) for v in verdicts] == [("retry", True), ("accept", True)]
    assert "tools_called" not in verdicts[0]["feedback"]  # the routed call counts as the task's

    assert final_only.state is GoalState.SUCCEEDED, final_only
    assert roles(fake, "WIDE final only") == ["planner", "executor", "executor", "goal_review"]
    assert status.goal.goal.review == "final_only"
