"""taskloom.testing: goals run in-process on fakeredis through the production handlers, scripted models."""

from __future__ import annotations

import pytest

from bus.schemas import GoalState, TaskState
from taskloom import ToolContext, Toolkit
from taskloom.cli import DEMO_DOD, DEMO_GOAL
from taskloom.testing import (
    InProcessFleet,
    RunError,
    ScriptedModel,
    TestRedis,
    accept,
    plan,
    retry,
    run_goal,
    task,
    text,
    tool_call,
    tool_calls,
    tool_results,
)
from taskloom.testing.plugin import Runner


def refund_kit(refunds: list[tuple[str, str]]) -> Toolkit:
    kit = Toolkit("refunds")

    @kit.tool(read_only=True)
    def lookup_order(order_id: str) -> dict[str, str]:
        """Look up an order."""
        return {"order_id": order_id, "status": "delivered"}

    @kit.tool(side_effects=True)
    def issue_refund(order_id: str, ctx: ToolContext) -> str:
        """Refund an order."""
        refunds.append((order_id, ctx.idempotency_key))
        return f"refunded {order_id}"

    return kit


async def test_demo_goal_runs_in_process_like_taskloom_demo() -> None:
    """The `taskloom demo` goal with the demo model succeeds in-process, with its one critic retry."""
    result = await run_goal({"text": DEMO_GOAL, "definition_of_done": DEMO_DOD, "budget_tokens": 100_000})
    assert result.state is GoalState.SUCCEEDED, result.summary()
    assert {t: (r.state, r.attempt) for t, r in result.tasks.items()} == {
        "check-a100": (TaskState.DONE, 2),
        "check-a101": (TaskState.DONE, 1),
        "check-a107": (TaskState.DONE, 1),
        "summarize": (TaskState.DONE, 1),
    }
    assert result.answer is not None and "Order A101: cannot be refunded" in result.answer
    assert sorted(c.input["order_id"] for c in result.calls("lookup_order") if c.input) == [
        "A100", "A100", "A101", "A107",
    ]  # fmt: skip
    assert result.ledger is not None and 0 < result.ledger.spent <= 100_000
    assert result.event_types[0] == "goal.submitted"
    assert [e.data.get("state") for e in result.events if e.type == "goal.state"][-1] == "succeeded"
    assert not result.failed_jobs
    assert (result.id, result.plan_version, result.terminal) == (result.goal.id, 1, True)


async def test_scripted_side_effect_tool_runs_once_and_every_call_is_metered() -> None:
    """A scripted executor calls a side-effect tool once; tool calls, steps and ledger are returned."""
    refunds: list[tuple[str, str]] = []
    model = ScriptedModel(
        planner=[plan(task("refund", tools=["lookup_order", "issue_refund"]))],
        executor=[tool_call("lookup_order", order_id="A100"), tool_call("issue_refund", order_id="A100"), "Refunded."],
    )
    result = await run_goal("Refund order A100", tools=refund_kit(refunds), model=model)
    assert result.state is GoalState.SUCCEEDED, result.summary()
    assert [order for order, _ in refunds] == ["A100"]
    # ctx.idempotency_key: goal, task, tool and an argument digest, the same in every attempt
    assert refunds[0][1].startswith(f"{result.goal_id}:refund:issue_refund:")
    assert [(c.name, c.input, c.outcome, c.output) for c in result.tool_calls] == [
        ("lookup_order", {"order_id": "A100"}, "ok", '{"order_id": "A100", "status": "delivered"}'),
        ("issue_refund", {"order_id": "A100"}, "ok", "refunded A100"),
    ]
    assert len(result.steps[("refund", 1)]) == 3
    assert result.result("refund") is not None and result.result("refund").answer == "Refunded."  # type: ignore[union-attr]
    # Every model call went through the goal's ledger, and what it settled is what the calls used.
    assert result.ledger is not None
    # plan, 3 executor turns, review: a goal of one task has no separate final answer or goal review
    assert result.ledger.calls == len(model.calls) == 5
    assert result.ledger.spent == sum(c.response.usage.total for c in model.calls)
    assert result.ledger.open == 0


async def test_per_task_critic_script_retries_with_feedback() -> None:
    """review={"x": [retry(...), accept()]}: x runs twice, the second prompt carries the feedback."""
    model = ScriptedModel(
        planner=[plan(task("x"), task("y"))],
        executor={"x": ["first try", "second try"], "y": ["y done"]},
        critic={"x": [retry("NAME-THE-DEADLINE"), accept()]},  # the same as review=
    )
    result = await run_goal("two tasks", model=model)
    assert result.state is GoalState.SUCCEEDED, result.summary()
    assert (result.tasks["x"].attempt, result.tasks["y"].attempt) == (2, 1)
    first, second = model.requests("executor", "x")
    assert "NAME-THE-DEADLINE" not in first.messages[0].content[0].text  # type: ignore[union-attr]
    assert "Reviewer feedback: NAME-THE-DEADLINE" in second.messages[0].content[0].text  # type: ignore[union-attr]
    assert [r.answer for r in result.results if r.task_id == "x"] == ["first try", "second try"]


async def test_a_review_script_with_the_old_submit_verdict_call_still_retries() -> None:
    """Scripts written when the verdict was a forced tool call keep working: the call is sent as the
    critic's JSON reply (no tool is offered to the reviewer any more)."""
    old_style = tool_calls(("submit_verdict", {"passed": False, "action": "retry", "feedback": "OLD-STYLE"}))
    model = ScriptedModel(
        planner=[plan(task("x"), task("y"))],
        executor={"x": ["first try", "second try"], "y": ["y done"]},
        critic={"x": [old_style, accept()]},
    )
    result = await run_goal("two tasks", model=model)
    assert result.state is GoalState.SUCCEEDED, result.summary()
    assert result.tasks["x"].attempt == 2
    assert all(not r.tools for r in model.requests("review"))
    second = model.requests("executor", "x")[1]
    assert "Reviewer feedback: OLD-STYLE" in second.messages[0].content[0].text  # type: ignore[union-attr]


async def test_executor_function_script_sees_tool_results() -> None:
    """A function script decides from the request: it answers with what the tool returned."""
    refunds: list[tuple[str, str]] = []

    def executor(request):  # type: ignore[no-untyped-def]
        results = tool_results(request)
        if not results:
            return tool_call("lookup_order", order_id="A7")
        return text(f"status: {results[-1].content}")

    model = ScriptedModel(planner=[plan(task("look", tools=["lookup_order"]))], executor=executor)
    result = await run_goal("Look up A7", tools=refund_kit(refunds), model=model)
    assert result.result("look") is not None
    assert result.result("look").answer == 'status: {"order_id": "A7", "status": "delivered"}'  # type: ignore[union-attr]


async def test_an_unscripted_request_fails_the_run_naming_the_role() -> None:
    """No planner script: run_goal raises RunError saying the planner had no script, instead of hanging."""
    with pytest.raises(RunError, match="no planner script"):
        await run_goal("anything", model=ScriptedModel(), timeout=20)


async def test_a_used_up_script_names_the_task_and_the_request_number() -> None:
    """An executor list of one reply for a task that needs two turns fails with the count."""
    model = ScriptedModel(
        planner=[plan(task("t", tools=["lookup_order"]))], executor={"t": [tool_call("lookup_order", order_id="A1")]}
    )
    with pytest.raises(RunError, match="the executor script for task 't' has 1 replies; request 2 has none"):
        await run_goal("goal", tools=refund_kit([]), model=model, timeout=20)


async def test_taskloom_run_fixture_uses_the_test_redis(taskloom_run: Runner, taskloom_redis: TestRedis) -> None:
    """The fixture runs under the test's own prefix, on fakeredis (or TASKLOOM_TEST_REDIS_URL's server)."""
    model = ScriptedModel(planner=[plan(task("a"))])
    result = await taskloom_run("fixture goal", model=model, max_task_retries=0)
    assert result.state is GoalState.SUCCEEDED, result.summary()
    async with taskloom_redis.connect() as redis:
        assert await redis.exists(taskloom_redis.keys.goal(result.goal_id))
    assert await taskloom_redis.exists(taskloom_redis.keys.goal(result.goal_id)) == 1  # one command, no connect
    assert not await taskloom_redis.exists("taskloom:goal:" + result.goal_id)  # nothing outside the prefix


def test_taskloom_run_fixture_works_in_a_plain_test(taskloom_run: Runner) -> None:
    """`taskloom_run.sync(...)` runs a goal from a synchronous test."""
    result = taskloom_run.sync("sync goal", model=ScriptedModel(planner=[plan(task("a"))]))
    assert result.state is GoalState.SUCCEEDED, result.summary()
    assert result.answer == "a done"  # one task: its accepted answer is the goal's answer


async def test_fleet_settles_on_an_approval_and_continues_after_it() -> None:
    """A call that needs approval leaves the goal waiting; approving through the client finishes it."""
    wiped: list[str] = []
    kit = Toolkit("ops")

    @kit.tool(requires_approval=True)
    def wipe(target: str) -> str:
        """Needs a person's approval."""
        wiped.append(target)
        return f"wiped {target}"

    model = ScriptedModel(planner=[plan(task("w", tools=["wipe"]))], executor=[tool_call("wipe", target="db"), "wiped"])
    async with InProcessFleet(model=model, tools=kit) as fleet:
        assert fleet.client is not None
        goal_id = await fleet.submit("wipe the db")
        waiting = await fleet.settle(goal_id, timeout=20)
        assert waiting.state is GoalState.RUNNING and waiting.tasks["w"].state is TaskState.WAITING_APPROVAL
        assert wiped == []
        [call_id] = await fleet.client.approvals(goal_id)
        assert await fleet.client.decide(goal_id, call_id, approved=True)
        done = await fleet.settle(goal_id, timeout=20)
    assert done.state is GoalState.SUCCEEDED, done.summary()
    assert wiped == ["db"]
    assert [(c.name, c.outcome) for c in done.tool_calls] == [("wipe", "ok")]
