"""The tool-call pipeline (executor/pipeline/), one step at a time and in its order, against real
Redis and the test toolkit's real tools."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import toolkits_for_tests as tk
from arq.connections import ArqRedis

from bus.approvals import ApprovalBook, ApprovalDecision
from bus.attempts import AttemptStore, Pending, StepRecord, ToolOutcome
from bus.effects import EffectRecord, SideEffects
from bus.keys import Keys
from bus.schemas import Event
from executor.gateway import ToolGateway
from executor.pipeline import (
    Approval,
    Attempt,
    Call,
    History,
    Invoke,
    Paused,
    Record,
    RedisApprovals,
    Replay,
    Truncate,
    UnknownAfterCrash,
    Validate,
    digest,
)
from executor.registry import ToolRegistry
from executor.sources.base import ToolContext
from llm.types import Message, ModelResponse, ToolUseBlock, Usage

REGISTRY = ToolRegistry([tk.kit])
GOAL, TASK = "g-pipe", "t1"


def block(tool: str, call_id: str = "c1", invalid_input: str | None = None, **args: Any) -> ToolUseBlock:
    return ToolUseBlock(id=call_id, name=tool, input=args, invalid_input=invalid_input)


def ctx(b: ToolUseBlock, attempt: int = 1) -> ToolContext:
    return ToolContext(
        goal_id=GOAL, task_id=TASK, attempt=attempt, step=0, call_id=b.id, tool=b.name, args_digest=digest(b.input)
    )


def call(tool_name: str, call_id: str = "c1", **args: Any) -> Call:
    """A call as validate leaves it: the tool and its parsed arguments set."""
    b = block(tool_name, call_id, **args)
    tool = REGISTRY.tools[tool_name]
    return Call(b, ctx(b), tool=tool, args=tool.parse(b.input))


@dataclass
class Fixture:
    attempt: Attempt
    gateway: ToolGateway
    book: ApprovalBook
    effects: SideEffects


@pytest.fixture
async def fx(redis: ArqRedis, keys: Keys) -> Fixture:
    store = AttemptStore(redis, keys, GOAL, TASK, 1)
    assert await store.acquire("test", 30)
    effects = SideEffects(redis, keys)
    attempt = Attempt(
        goal_id=GOAL,
        task_id=TASK,
        attempt=1,
        store=store,
        history=History(),
        approvals=RedisApprovals(ApprovalBook(redis, keys), GOAL),
        effects=effects,
    )
    names = ["slow_a", "count", "charge", "refund", "wipe", "big", "hang", "flaky"]
    gateway = ToolGateway(REGISTRY, names, attempt=attempt, output_limit=100)
    return Fixture(attempt, gateway, ApprovalBook(redis, keys), effects)


def test_the_gateway_runs_every_call_through_the_steps_in_the_documented_order(fx: Fixture) -> None:
    """validate, repeats, crash, replay, approval, invoke, truncate, record; the last two see every call."""
    assert [s.name for s in fx.gateway.steps] == [
        "validate",
        "repeats",
        "crash",
        "replay",
        "approval",
        "invoke",
        "truncate",
        "record",
    ]
    assert [s.name for s in fx.gateway.steps if s.every_call] == ["truncate", "record"]


@pytest.mark.parametrize(
    ("b", "kind", "words"),
    [
        (block("nope"), "unknown_tool", "unknown tool 'nope'; available: slow_a"),
        (block("count"), "not_allowed", "tool 'count' is not allowed"),
        (block("slow_a", x="one"), "invalid_args", "invalid arguments for slow_a: x:"),
        (block("slow_a", invalid_input="[1, 2]"), "invalid_args", "not a JSON object (received '[1, 2]')"),
    ],
)
async def test_validate_answers_a_call_it_cannot_run(b: ToolUseBlock, kind: str, words: str) -> None:
    """Unknown, not allowed, invalid or non-object arguments: an ERROR from validate, no tool or args set."""
    c = Call(b, ctx(b))
    await Validate(REGISTRY, ["slow_a"])(c)
    assert c.outcome is not None and c.outcome.outcome == kind and words in c.outcome.content
    assert c.answered_by == "validate" and c.tool is None


async def test_validate_lets_a_good_call_through_with_its_parsed_arguments() -> None:
    """A known, allowed call with valid arguments passes, carrying its tool and parsed arguments."""
    b = block("slow_a", x=3)
    c = Call(b, ctx(b))
    await Validate(REGISTRY, ["slow_a"])(c)
    assert c.outcome is None and c.tool is REGISTRY.tools["slow_a"] and c.args.x == 3


def test_the_repeat_history_is_rebuilt_from_the_stored_steps_and_the_pending_turn() -> None:
    """Stored calls count with their outcomes (refused ones not); a stored warning is remembered."""
    first = block("count", "c1", name="a")
    refused = block("nope", "c2")
    repeat = block("count", "c3", name="a")
    step = StepRecord(
        index=0,
        assistant=Message(role="assistant", content=[first, refused]),
        outcomes=[outcome("c1", "count", "ok"), outcome("c2", "nope", "unknown_tool")],
        stop_reason="tool_call",
    )
    turn = ModelResponse(
        content=[repeat, block("slow_a", "c4", x=1)], stop_reason="tool_call", usage=Usage(), model="m"
    )
    pending = Pending(turn=turn, results={"c3": outcome("c3", "count", "repeated")})
    history = History.rebuild([step], pending)
    assert [(s.tool, s.outcome) for s in history.seen] == [("count", "ok"), ("count", "repeated")]
    assert history.warned


def outcome(call_id: str, tool: str, kind: Any) -> ToolOutcome:
    return ToolOutcome(call_id=call_id, tool=tool, outcome=kind, content="x", full="x")


async def test_crash_answers_a_started_side_effect_as_unknown_and_lets_others_through(fx: Fixture) -> None:
    """A side-effecting call marked started before a crash is an unknown outcome; a read-only one runs again."""
    fx.attempt.started = {"c1"}
    charge, read = call("charge", amount=5), call("slow_a", x=1)
    step = UnknownAfterCrash(fx.attempt)
    await step(charge)
    await step(read)
    assert charge.outcome is not None and charge.outcome.outcome == "unknown_outcome"
    assert "outcome of this charge call is unknown" in charge.outcome.content
    assert read.outcome is None


@pytest.mark.parametrize(("state", "replays"), [("ok", True), ("unknown", True), ("started", True), ("failed", False)])
async def test_replay_answers_a_recorded_side_effect_with_its_outcome(fx: Fixture, state: str, replays: bool) -> None:
    """A recorded call of the task (done, or of unknown outcome) is replayed, not run; a failed one may run again."""
    c = call("charge", "c9", amount=5)
    key = f"charge:{c.digest}"
    earlier = EffectRecord(key=key, tool="charge", args={"amount": 5}, attempt=1, call_id="c1")
    await fx.effects.finish(GOAL, TASK, earlier.model_copy(update={"state": state, "result": "charged 5"}))
    await Replay(fx.attempt)(c)
    assert (c.outcome is not None) == replays
    if state == "ok":
        assert c.outcome is not None and c.outcome.content == "[already done in attempt 1; not run again] charged 5"


async def test_a_recorded_side_effect_needing_approval_is_replayed_and_never_asks(fx: Fixture) -> None:
    """Replay sits before approval: an approval tool whose effect is recorded gets it back with no request."""
    b = block("refund", "c2", order="A1")
    key = f"refund:{digest(b.input)}"
    done = EffectRecord(key=key, tool="refund", args=dict(b.input), attempt=1, call_id="c1", state="ok", result="ok!")
    await fx.effects.finish(GOAL, TASK, done)
    result = await fx.gateway.run(b, ctx(b))
    assert result.outcome == "ok" and "not run again] ok!" in result.content
    assert await fx.book.requests(GOAL) == {}


async def test_approval_pauses_an_undecided_call_and_answers_a_denied_one(fx: Fixture) -> None:
    """Undecided: stored, `Paused` raised; denied: an ERROR saying it was not run; no approval needed: through."""
    step = Approval(fx.attempt)
    c = call("wipe", "c1", target="prod")
    with pytest.raises(Paused):
        await step(c)
    assert list(await fx.book.requests(GOAL)) == ["c1"]
    denied = ApprovalDecision(approved=False, reason="no")
    assert await fx.book.decide(GOAL, "c1", denied.encode(), Event(type="tool.approval_decided", goal_id=GOAL)) == "ok"
    await step(c)
    assert c.outcome is not None and c.outcome.outcome == "denied"
    assert c.outcome.content == "ERROR: wipe was not run: denied by an operator: no"
    free = call("slow_a", "c2", x=1)
    await step(free)
    assert free.outcome is None


async def test_invoke_marks_and_claims_a_side_effect_then_record_stores_how_it_ended(fx: Fixture) -> None:
    """A side-effecting call is marked started and claimed before it runs; record stores outcome, event and effect."""
    c = call("charge", "c1", amount=7)
    await Invoke(30, fx.attempt)(c)
    pending = await fx.attempt.store.pending()
    assert "c1" in pending.started and not pending.results  # started, no result yet
    claimed = await fx.effects.recorded(GOAL, TASK, f"charge:{c.digest}")
    assert claimed is not None and claimed.state == "started"
    assert c.outcome is not None and c.answered_by == "invoke" and c.outcome.content == "charged 7"
    await Record(None, fx.attempt)(c)
    assert (await fx.attempt.store.pending()).results["c1"].content == "charged 7"
    ended = await fx.effects.recorded(GOAL, TASK, f"charge:{c.digest}")
    assert ended is not None and (ended.state, ended.result) == ("ok", "charged 7")


async def test_invoke_turns_a_timeout_into_an_error_observation(fx: Fixture) -> None:
    """A tool past its timeout is an ERROR naming the limit (the call is abandoned, the loop goes on)."""
    c = call("hang", "c1")
    await Invoke(30, fx.attempt)(c)
    assert c.outcome is not None and c.outcome.outcome == "timeout"
    assert c.outcome.content == "ERROR: tool hang timed out after 0.2 s"


async def test_truncate_cuts_what_the_model_sees_and_keeps_the_whole_output() -> None:
    """Any answer longer than the limit is cut with a note; `full` stays whole for the step record."""
    c = call("big")
    c.answer(ToolOutcome(call_id="c1", tool="big", outcome="ok", content="x" * 500, full="x" * 500), "invoke")
    await Truncate(100)(c)
    assert c.outcome is not None and len(c.outcome.full) == 500
    assert c.outcome.content.endswith("[... truncated: 400 of 500 characters not shown]")


async def test_a_failed_call_is_retried_through_the_gateway_then_counts_as_a_repeat(fx: Fixture) -> None:
    """Through the whole pipeline: a failing read-only call runs 1 + retries times, then is answered as a repeat."""
    tk.FLAKY.pop("pipe", None)
    kinds = []
    for i in range(5):
        b = block("flaky", f"f{i}", key="pipe", fails=100)
        kinds.append((await fx.gateway.run(b, ctx(b))).outcome)
    assert kinds == ["error", "error", "error", "repeated", "loop"]
    assert tk.FLAKY["pipe"] == 3
