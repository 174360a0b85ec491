"""The public toolkit API, toolkit loading, and the loop's pure decisions."""

from __future__ import annotations

import asyncio
import threading

import pytest

from bus.stops import TaskStop
from executor import policy
from executor.gateway import truncate
from executor.pipeline.repeats import Seen, decide
from executor.registry import ToolLoadError, ToolRegistry, load_registry
from executor.toolkit import _THREADS, ToolContext, ToolDefinitionError, Toolkit, run_in_daemon_thread
from llm.pairing import check_tool_pairing
from llm.types import Message, ModelResponse, TextBlock, ToolResultBlock, ToolUseBlock, Usage
from taskloom import Toolkit as PublicToolkit


def test_functions_become_tools_with_a_schema_from_their_parameters() -> None:
    """Name and description come from the function; typed parameters become the input schema; ctx is hidden."""
    kit = Toolkit("k")

    @kit.tool(read_only=True)
    async def lookup(order_id: str, verbose: bool = False) -> str:
        """Find an order."""
        return order_id

    @kit.tool(name="svc.charge", description="Charge a card.", side_effects=True, timeout=5)
    def charge(amount: int, ctx: ToolContext) -> str:
        return ctx.idempotency_key

    t = kit.tools["lookup"]
    assert t.description == "Find an order." and t.read_only and not t.side_effects
    schema = t.definition.input_schema
    assert schema["required"] == ["order_id"] and set(schema["properties"]) == {"order_id", "verbose"}
    c = kit.tools["svc.charge"]
    assert c.side_effects and c.timeout == 5 and c.description == "Charge a card."
    assert set(c.definition.input_schema["properties"]) == {"amount"}  # the context is not shown to the model
    ctx = ToolContext(goal_id="g", task_id="t", attempt=2, step=3, call_id="c")
    out = asyncio.run(c.invoke(c.params(amount=5), ctx))
    assert out == "g:t:2:3:c"
    stable = ToolContext(goal_id="g", task_id="t", attempt=2, step=3, call_id="c", tool="charge", args_digest="d1")
    assert stable.idempotency_key == "g:t:charge:d1"  # the same in every attempt of the task
    assert PublicToolkit is Toolkit


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "has space"}, "must match"),
        ({"read_only": True, "side_effects": True}, "both read_only and side_effects"),
        ({"timeout": 0}, "timeout must be > 0"),
    ],
)
def test_bad_tool_definitions_are_refused(kwargs: dict[str, object], message: str) -> None:
    """A tool the model could not use, or with contradictory flags, fails at definition time."""
    kit = Toolkit()
    with pytest.raises(ToolDefinitionError, match=message):

        @kit.tool(**kwargs)  # type: ignore[call-overload]
        def f(x: int) -> int:
            return x


def test_untyped_parameters_and_duplicates_are_refused() -> None:
    """Every parameter needs a type; one toolkit cannot hold two tools of one name."""
    kit = Toolkit()
    with pytest.raises(ToolDefinitionError, match="needs a type annotation"):

        @kit.tool
        def f(x) -> int:  # type: ignore[no-untyped-def]
            return 1

    @kit.tool
    def g(x: int) -> int:
        return x

    with pytest.raises(ToolDefinitionError, match="already has a tool named 'g'"):
        kit.tool(g)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "not of the form module:attribute"),
        ("no_such_module_xyz:kit", "cannot import module 'no_such_module_xyz'"),
        ("executor.demo_tools:nothing", "has no attribute 'nothing'"),
        ("executor.demo_tools:ORDERS", "is a dict, not a taskloom Toolkit"),
    ],
)
def test_bad_toolkit_paths_are_clear_errors(spec: str, message: str) -> None:
    """TASKLOOM_TOOLS pointing at nothing usable names the variable and what is wrong."""
    with pytest.raises(ToolLoadError, match=message) as exc:
        load_registry(spec)
    assert "TASKLOOM_TOOLS" in str(exc.value)


def test_registry_loads_named_toolkits_and_refuses_name_clashes() -> None:
    """module:attribute loads a toolkit; two toolkits with one tool name clash loudly."""
    reg = load_registry("executor.demo_tools:support")
    assert {"lookup_order", "refund_policy", "check_refund_eligibility", "issue_refund"} <= set(reg.names())
    with pytest.raises(ToolLoadError, match="lookup_order"):
        load_registry("executor.demo_tools:support, executor.demo_tools:support")
    assert ToolRegistry().names() == []


def test_truncate_says_how_much_was_cut() -> None:
    """Output over the limit is cut with a note of the size; output under it is untouched."""
    assert truncate("abc", 5) == "abc"
    assert truncate("x" * 20, 5) == "xxxxx\n[... truncated: 15 of 20 characters not shown]"


def _resp(stop: str, blocks: list[object]) -> ModelResponse:
    return ModelResponse(content=blocks, stop_reason=stop, usage=Usage(), model="m")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("stop", "tools", "notes", "requires", "calls", "action"),
    [
        ("end_turn", False, set(), False, 0, TaskStop.ANSWERED),
        ("end_turn", False, set(), True, 0, "nudge_use_tools"),
        ("end_turn", False, {"use_tools"}, True, 0, TaskStop.ANSWERED),
        ("end_turn", False, set(), True, 2, TaskStop.ANSWERED),
        ("tool_use", True, set(), False, 0, "tools"),
        ("max_tokens", False, set(), False, 0, "nudge_brevity"),
        ("max_tokens", False, {"brevity"}, False, 0, TaskStop.MAX_TOKENS),
        ("max_tokens", True, set(), False, 0, "tools"),
        ("pause_turn", False, set(), False, 0, "continue"),
        ("refusal", False, set(), False, 0, TaskStop.REFUSAL),
        ("model_context_window_exceeded", False, set(), False, 0, TaskStop.CONTEXT_FULL),
    ],
)
def test_classify_replies(stop: str, tools: bool, notes: set[str], requires: bool, calls: int, action: object) -> None:
    """Each stop reason maps to one action, a reply that ends the attempt to its `TaskStop`; nudges are
    given once."""
    blocks: list[object] = [ToolUseBlock(id="c1", name="t", input={})] if tools else [TextBlock(text="x")]
    state = policy.LoopState(tool_calls=calls, notes=notes)
    assert policy.classify(_resp(stop, blocks), state, requires) == action


@pytest.mark.parametrize(
    ("steps", "elapsed", "cancelled", "expect"),
    [(0, 0.0, False, None), (5, 0.0, False, "max_steps"), (1, 10.0, False, "deadline"), (1, 0.0, True, "cancelled")],
)
def test_stop_before_call(steps: int, elapsed: float, cancelled: bool, expect: str | None) -> None:
    """max_steps, the wall-clock deadline and cancellation each stop the loop with their own reason."""
    state = policy.LoopState(steps=steps)
    assert policy.stop_before_call(state, max_steps=5, elapsed=elapsed, timeout=10, cancelled=cancelled) == expect


def test_repeat_of_a_success_is_warned_then_stopped_within_the_window() -> None:
    """A succeeded call repeated within the window warns; after a warning it stops; outside the window it runs."""
    seen = [Seen("t", "d1", "ok"), Seen("t", "d2", "ok"), Seen("u", "d3", "ok")]
    assert decide(seen, "t", "d1", window=3, retries=2, warned=False) == "warn"
    assert decide(seen, "t", "d1", window=2, retries=2, warned=False) == "run"
    assert decide(seen, "t", "d2", window=3, retries=2, warned=True) == "stop"
    assert decide(seen, "t", "d9", window=3, retries=2, warned=False) == "run"
    assert decide([Seen("t", "d1", None)], "t", "d1", window=3, retries=2, warned=False) == "warn"  # twin still running


@pytest.mark.parametrize(
    ("earlier", "retries", "expect"),
    [
        (["error"], 2, "run"),
        (["error", "timeout"], 2, "run"),
        (["error", "unknown_outcome", "cancelled"], 2, "warn"),
        (["error"], 0, "warn"),
        (["ok", "error"], 2, "run"),  # the latest identical call failed: a retry may help
        (["error", "ok"], 2, "warn"),  # the latest succeeded: the result will not change
        (["denied"], 2, "warn"),
        (["repeated"], 2, "warn"),
    ],
)
def test_a_failed_call_may_be_retried_up_to_the_setting(earlier: list[str], retries: int, expect: str) -> None:
    """After a failure an identical call runs again, `retries` times; a repeat of a settled call does not."""
    seen = [Seen("t", "d1", o) for o in earlier]
    assert decide(seen, "t", "d1", window=8, retries=retries, warned=False) == expect


def test_condense_keeps_every_tool_pair_valid() -> None:
    """Condensing shrinks old observations but keeps every tool_use answered at the start of the next message."""
    msgs = [Message.user("task")]
    for i in range(6):
        msgs.append(Message(role="assistant", content=[ToolUseBlock(id=f"c{i}", name="t", input={"i": i})]))
        msgs.append(Message(role="user", content=[ToolResultBlock(tool_use_id=f"c{i}", content="y" * 5000)]))
    out = policy.condense(msgs, keep_last=2, block=2)
    check_tool_pairing(out)
    sizes = [len(m.content[0].content) for m in out[2::2]]  # type: ignore[union-attr]
    assert all(s < 400 for s in sizes[:4]) and sizes[4:] == [5000, 5000]
    assert out[0] == msgs[0]


def test_condensed_prefix_stays_stable_between_blocks() -> None:
    """With block=10, adding a turn does not change the condensed prefix until the next block boundary."""
    msgs = [Message.user("task")]
    prefixes = []
    for i in range(12):
        msgs.append(Message(role="assistant", content=[ToolUseBlock(id=f"c{i}", name="t", input={"i": i})]))
        msgs.append(Message(role="user", content=[ToolResultBlock(tool_use_id=f"c{i}", content="y" * 5000)]))
        out = policy.condense(msgs, keep_last=2, block=10)
        condensed = sum(1 for m in out if "condensed" in str(m.content[0]))
        prefixes.append(condensed)
    # The number of condensed turns only jumps by whole blocks (5 turns), never one turn at a time.
    assert prefixes == sorted(prefixes) and set(prefixes) <= {0, 5, 10}
    assert prefixes[-1] == 10 and 5 in prefixes


async def test_sync_tools_reuse_daemon_threads_and_a_stuck_call_does_not_hold_up_the_next() -> None:
    """Sequential sync calls run on kept daemon threads (not one new thread each); a call stuck in
    its thread does not stop the next call, which gets another thread named after its tool."""
    release = threading.Event()

    def stuck() -> str:
        release.wait(10)
        return "late"

    def where() -> threading.Thread:
        return threading.current_thread()

    late = asyncio.create_task(run_in_daemon_thread(stuck, {}, "tool-stuck"))
    await asyncio.sleep(0.05)
    # The runner's own threads: any other thread of the process (a client library's, a test
    # fixture's) may come and go meanwhile.
    before = list(_THREADS.threads)
    seen = [await asyncio.wait_for(run_in_daemon_thread(where, {}, "tool-where"), 5) for _ in range(20)]
    added = _THREADS.threads[len(before) :]
    assert len(added) <= 1  # at most one thread added for 20 calls
    assert {t.ident for t in seen} <= {t.ident for t in _THREADS.threads}  # every call ran on one of them
    assert all(t.daemon for t in seen) and all(t is not threading.main_thread() for t in seen)
    assert {t.name for t in seen} == {"taskloom-tool"}  # renamed back once the call returned
    release.set()
    assert await asyncio.wait_for(late, 5) == "late"
