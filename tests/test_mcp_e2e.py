"""End to end with MCP: every tool of a goal comes from MCP servers (the demo support desk over
stdio and over streamable HTTP), through real planner, executor and critic processes, the real
Anthropic SDK and the fake Messages API. Judged from the servers' own call logs."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from arq.connections import ArqRedis
from helpers import demo_mcp_http, eventually, mcp_log
from test_e2e import (
    ACCEPT,
    _first_user,
    _spawn,
    _tool_results,
    fleet,
    requests_of,
    review_attempt,
    role_of,
    spec,
    task_of,
    worker_env,
)

from bus.client import Client
from bus.keys import Keys
from bus.schemas import GoalState, TaskState
from critic.prompts import FINAL_TOOL
from llm.testing import (
    Failure,
    FakeAnthropicServer,
    RecordedRequest,
    Script,
    content_text,
    error_body,
    text_reply,
    tool_reply,
)
from planner.prompts import PLAN_TOOL

REPO = Path(__file__).parent.parent
pytestmark = pytest.mark.e2e

PLAN = {
    "tasks": [
        spec("look", tools=("desk.lookup_order", "desk.escalate_ticket", "desk.order_history")),
        spec("refund", deps=("look",), tools=("pay.issue_refund",)),
    ]
}


def _turn(req: RecordedRequest) -> int:
    return sum(1 for m in req.messages if m["role"] == "assistant")


class Desk:
    """The scripted model. Provider-side names: `desk.lookup_order` is `desk_lookup_order` on the wire."""

    def __init__(self) -> None:
        self.unrouted: list[RecordedRequest] = []

    def __call__(self, req: RecordedRequest) -> Script:
        role = role_of(req)
        if role == "planner":
            return tool_reply([(PLAN_TOOL, PLAN)])
        if role == "review":
            return text_reply(json.dumps(ACCEPT))
        if role == "goal_review":
            return tool_reply([(FINAL_TOOL, {**ACCEPT, "answer": "Refund of A100 issued."})])
        if role == "executor" and task_of(req) == "look":
            turns = [
                [
                    ("desk_lookup_order", {"order_id": "A100"}),
                    ("desk_escalate_ticket", {"order_id": "A100", "reason": "x"}),
                ],
                [("desk_order_history", {"order_id": "A100"})],  # the stdio server dies during this call
                [("desk_order_history", {"order_id": "A101"})],  # ... and answers this one, restarted
            ]
            turn = _turn(req)
            return tool_reply(turns[turn]) if turn < len(turns) else text_reply("A100 is eligible")
        if role == "executor" and task_of(req) == "refund":
            if _turn(req) == 0:
                return tool_reply([("pay_issue_refund", {"order_id": "A100"})])
            return text_reply("refund handled")
        self.unrouted.append(req)
        return Failure(status=400, body=error_body(400, "the test responder cannot route this request"))


async def test_a_goal_on_mcp_tools_only_with_approval_audit_and_crash_safety(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """stdio + HTTP MCP tools only: isError and a dying server are ERRORs, the refund waits for approval,
    and an executor killed during the approved refund does not make the server run it twice."""
    desk_log, pay_log, die = tmp_path / "desk.jsonl", tmp_path / "pay.jsonl", tmp_path / "die"
    die.write_text("once")
    desk = {
        "command": sys.executable,
        "args": ["-m", "executor.demo_mcp", "--log", str(desk_log), "--die-once", str(die)],
        "cwd": str(REPO),
        "tools": {"issue_refund": {"enabled": False}},
    }
    model = Desk()
    pay = demo_mcp_http(tmp_path, "--log", str(pay_log), "--refund-delay", "10")  # killed well before it ends
    with pay as (url, _), FakeAnthropicServer() as fake:
        config = tmp_path / "mcp.json"
        config.write_text(json.dumps({"mcpServers": {"desk": desk, "pay": {"url": url}}}))
        fake.respond_with(model)
        env = worker_env(subprocess_env, fake, tmp_path, TASKLOOM_TOOLS="", TASKLOOM_MCP_CONFIG=str(config))
        client = Client(redis, keys, default_budget_tokens=200_000)
        async with fleet(env, tmp_path, "planner", "critic", "executor") as workers:
            gid = await client.submit("Refund order A100 if it is eligible")

            async def asked() -> bool:
                return bool(await client.approvals(gid))

            await eventually(asked, timeout=60, every=0.1)
            [(call_id, request)] = (await client.approvals(gid)).items()
            assert request.tool == "pay.issue_refund"
            assert (await client.store.get_tasks(gid))["refund"].state is TaskState.WAITING_APPROVAL
            assert not [line for line in mcp_log(pay_log) if line["tool"] == "issue_refund"]  # not before approval
            assert await client.decide(gid, call_id, approved=True)

            async def refunding() -> bool:
                return any(line["tool"] == "issue_refund" for line in mcp_log(pay_log))

            await eventually(refunding, timeout=120, every=0.05)
            executor = next(w for w in workers if w.role == "executor")
            executor.proc.send_signal(signal.SIGKILL)  # mid-call: the server is still working on it
            executor.proc.wait(10)
            workers.append(_spawn("executor", env, tmp_path / "9-executor.log"))
            goal = await client.wait(gid, timeout=90)
            events = [e async for e in client.events(gid, follow=False)]

    assert goal.state is GoalState.SUCCEEDED, goal
    assert not model.unrouted
    # The planner was offered the MCP tools (route first: as definitions), by their provider-side names.
    [plan_request] = requests_of(fake, "planner")
    offered = {t["name"] for t in plan_request.body["tools"]}
    assert {"desk_lookup_order", "pay_issue_refund"} <= offered

    # From the HTTP server's own log: the refund started once, for one idempotency key.
    refunds = [line for line in mcp_log(pay_log) if line["tool"] == "issue_refund"]
    assert [line["phase"] for line in refunds if line["phase"] == "start"] == ["start"], refunds
    assert len({line["key"] for line in refunds}) == 1
    # The resumed attempt told the model the outcome is unknown instead of running it again.
    last = requests_of(fake, "executor", "refund")[-1]
    [unknown] = _tool_results(last)
    assert unknown["is_error"] is True and "call is unknown" in content_text(unknown["content"])

    # The stdio server: an isError result and a crash were ERROR observations; it was restarted.
    look = requests_of(fake, "executor", "look")
    results = [content_text(r["content"]) for r in _tool_results(look[-1])]
    assert any("wireless headphones" in r for r in results)
    assert any(r.startswith("ERROR: tool desk.escalate_ticket failed") for r in results)
    assert any("ERROR" in r and "stopped while the call ran" in r for r in results)
    assert any("standing desk" in r for r in results)
    histories = [line for line in mcp_log(desk_log) if line["tool"] == "order_history" and line["phase"] == "start"]
    assert len({line["pid"] for line in histories}) == 2  # the second call ran on a new server process

    # Audit: one tool.call event per call, with its outcome; the approval was requested and decided.
    calls = [(e.data["tool"], e.data["outcome"]) for e in events if e.type == "tool.call"]
    assert calls.count(("desk.lookup_order", "ok")) == 1
    assert ("desk.escalate_ticket", "error") in calls
    assert [o for t, o in calls if t == "desk.order_history"] == ["error", "ok"]
    assert [o for t, o in calls if t == "pay.issue_refund"] == ["unknown_outcome"]
    kinds = [e.type for e in events]
    assert "tool.approval_requested" in kinds and "tool.approval_decided" in kinds


RETRY = {"passed": False, "action": "retry", "feedback": "MENTION-THE-AMOUNT"}


class RetryDesk:
    """The scripted model of the pipeline's end-to-end check: `look` retries a lookup that failed;
    `refund` refunds, is sent back by the critic, and its retry makes the same refund call again."""

    def __init__(self) -> None:
        self.unrouted: list[RecordedRequest] = []

    def __call__(self, req: RecordedRequest) -> Script:
        role, task = role_of(req), task_of(req)
        if role == "planner":
            plan = {
                "tasks": [
                    spec("look", tools=("desk.lookup_order",)),
                    spec("refund", deps=("look",), tools=("desk.issue_refund",)),
                ]
            }
            return tool_reply([(PLAN_TOOL, plan)])
        if role == "review":
            return text_reply(json.dumps(RETRY if task == "refund" and review_attempt(req) == 1 else ACCEPT))
        if role == "goal_review":
            return tool_reply([(FINAL_TOOL, {**ACCEPT, "answer": "Refund of A100 issued: $129.00."})])
        if role == "executor" and task == "look":
            turns = [[("desk_lookup_order", {"order_id": "A100"})]] * 2  # fails, then the same call succeeds
            turn = _turn(req)
            return tool_reply(turns[turn]) if turn < len(turns) else text_reply("A100 is eligible")
        if role == "executor" and task == "refund":
            if _turn(req) == 0:
                return tool_reply([("desk_issue_refund", {"order_id": "A100"})])
            retry = "MENTION-THE-AMOUNT" in _first_user(req)
            return text_reply("refund of $129.00 issued" if retry else "refund handled")
        self.unrouted.append(req)
        return Failure(status=400, body=error_body(400, "the test responder cannot route this request"))


async def test_an_approved_mcp_refund_is_replayed_in_the_critics_retry_and_a_failed_lookup_is_retried(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """Real workers, one stdio MCP server: the destructive refund is approved once and runs once; the
    critic's retry makes the same call and gets the recorded outcome with no second approval; the
    read-only lookup that failed (isError) is run again on the model's identical retry; the goal succeeds."""
    desk_log, flaky = tmp_path / "desk.jsonl", tmp_path / "flaky"
    flaky.write_text("once")
    desk = {
        "command": sys.executable,
        "args": ["-m", "executor.demo_mcp", "--log", str(desk_log), "--flaky-once", str(flaky)],
        "cwd": str(REPO),
    }
    model = RetryDesk()
    with FakeAnthropicServer() as fake:
        config = tmp_path / "mcp.json"
        config.write_text(json.dumps({"mcpServers": {"desk": desk}}))
        fake.respond_with(model)
        env = worker_env(subprocess_env, fake, tmp_path, TASKLOOM_TOOLS="", TASKLOOM_MCP_CONFIG=str(config))
        client = Client(redis, keys, default_budget_tokens=200_000)
        async with fleet(env, tmp_path, "planner", "critic", "executor"):
            gid = await client.submit("Refund order A100 if it is eligible")

            async def asked() -> bool:
                return bool(await client.approvals(gid))

            await eventually(asked, timeout=60, every=0.1)
            [(call_id, request)] = (await client.approvals(gid)).items()
            assert request.tool == "desk.issue_refund" and request.earlier == []
            assert await client.decide(gid, call_id, approved=True)
            goal = await client.wait(gid, timeout=90)
            events = [e async for e in client.events(gid, follow=False)]

    assert goal.state is GoalState.SUCCEEDED, goal
    assert not model.unrouted
    refund = (await client.store.get_tasks(gid))["refund"]
    assert (refund.state, refund.attempt) == (TaskState.DONE, 2)  # the critic's retry did run
    kinds = [e.type for e in events]
    assert kinds.count("tool.approval_requested") == 1 and kinds.count("tool.approval_decided") == 1

    # From the server's own log: the refund ran once; the lookup twice (isError, then an answer).
    calls = mcp_log(desk_log)
    assert [line["phase"] for line in calls if line["tool"] == "issue_refund"] == ["start", "done"]
    assert [line["phase"] for line in calls if line["tool"] == "lookup_order"] == ["start", "failed", "start"]

    # What the model saw: the error, then the answer; in the retry, the recorded refund.
    look = requests_of(fake, "executor", "look")
    failed, answered = (content_text(r["content"]) for r in _tool_results(look[-1]))
    assert failed.startswith("ERROR: tool desk.lookup_order failed") and "backend unavailable, try again" in failed
    assert "wireless headphones" in answered
    retry = [r for r in requests_of(fake, "executor", "refund") if "MENTION-THE-AMOUNT" in _first_user(r)]
    [replayed] = _tool_results(retry[-1])
    text = content_text(replayed["content"])
    assert text.startswith("[already done in attempt 1; not run again]") and "refund of $129.00 issued for A100" in text
    audit = [(e.data["tool"], e.data["outcome"], e.data["answered_by"]) for e in events if e.type == "tool.call"]
    assert audit == [
        ("desk.lookup_order", "error", "invoke"),
        ("desk.lookup_order", "ok", "invoke"),
        ("desk.issue_refund", "ok", "invoke"),
        ("desk.issue_refund", "ok", "replay"),
    ]
