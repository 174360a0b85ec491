"""Pure decisions of the ReAct loop: when to stop, what a model reply means, and how to condense a
long history. No I/O here; `executor.loop` applies these. What counts as a repeated tool call is a
rule of the tool-call pipeline (`executor.pipeline.repeats`), not of the loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from bus.attempts import ToolOutcome
from bus.stops import STOPS, TaskStop
from llm.types import ContentBlock, Message, ModelResponse, ToolResultBlock

BREVITY_NUDGE = "Your reply was cut off at the token limit. Answer again, much more briefly."
USE_TOOLS_NUDGE = (
    "You answered without using any tool, but this task requires its tools. "
    "Call the tools you need, then give your answer."
)


@dataclass
class LoopState:
    """What the loop knows about its attempt so far; rebuilt from the stored steps after a crash."""

    steps: int = 0
    tool_calls: int = 0
    notes: set[str] = field(default_factory=set)  # nudges already given: "brevity", "use_tools"


def stop_before_call(
    state: LoopState, max_steps: int, elapsed: float, timeout: float, cancelled: bool
) -> TaskStop | None:
    """Checked before every model call."""
    if cancelled:
        return TaskStop.CANCELLED
    if elapsed >= timeout:
        return TaskStop.DEADLINE
    if state.steps >= max_steps:
        return TaskStop.MAX_STEPS
    return None


Action = (
    Literal[
        "tools",  # run the tool calls, then continue
        "continue",  # pause: send the turn back as is
        "nudge_brevity",  # max_tokens once: ask for a shorter answer
        "nudge_use_tools",  # answered without the required tools: one corrective turn
    ]
    | TaskStop  # the attempt ends (ANSWERED: the reply's text is the result)
)


def classify(response: ModelResponse, state: LoopState, requires_tools: bool) -> Action:
    """What to do with a model reply."""
    reason = response.stop_reason
    if reason == "tool_call" and response.tool_uses:
        return "tools"
    if reason == "pause":
        return "continue"
    if reason == "content_filter":
        return TaskStop.REFUSAL
    if reason == "context_length":
        return TaskStop.CONTEXT_FULL
    if reason == "length":
        if response.tool_uses:
            return "tools"  # the calls are complete blocks; run them
        return TaskStop.MAX_TOKENS if "brevity" in state.notes else "nudge_brevity"
    # stop (or tool_call without blocks): an answer
    if requires_tools and state.tool_calls == 0 and "use_tools" not in state.notes:
        return "nudge_use_tools"
    return TaskStop.ANSWERED


def stop_answer(stop: TaskStop, response: ModelResponse) -> str:
    """What an attempt that a reply ends keeps as its answer: the reply's text (an answer, or what a
    cut-off or refused reply said), or for a full context window the reason, as no text came."""
    return STOPS[stop].meaning if stop is TaskStop.CONTEXT_FULL else response.text


def stop_after_tools(outcomes: Sequence[ToolOutcome]) -> TaskStop | None:
    """A turn's tool outcomes that end the attempt: a loop the gateway detected, or a cancellation
    that arrived while the calls ran."""
    if any(o.outcome == "loop" for o in outcomes):
        return TaskStop.LOOP_DETECTED
    if any(o.outcome == "cancelled" for o in outcomes):
        return TaskStop.CANCELLED
    return None


def condense(messages: Sequence[Message], keep_last: int, note_chars: int = 200, block: int = 10) -> list[Message]:
    """Shrink the observations of older turns, keeping every block (and so every tool_use/tool_result
    pair) in place: only long tool_result contents are cut to a stub. The first message (the task's
    context) and at least the last `keep_last` turns are never touched.

    The condensed region grows in steps of `block` messages, not one turn at a time: between two
    steps the condensed prefix is byte-for-byte the same on every call, so the provider's prompt
    cache keeps serving it (a boundary that moved every call would rewrite the cache each time).
    """
    movable = len(messages) - 1 - 2 * keep_last
    boundary = 1 + (movable // block) * block if movable > 0 else 1
    out: list[Message] = []
    for i, msg in enumerate(messages):
        if i == 0 or i >= boundary or msg.role != "user":
            out.append(msg)
            continue
        blocks: list[ContentBlock] = []
        for b in msg.content:
            if isinstance(b, ToolResultBlock) and len(b.content) > note_chars:
                stub = f"{b.content[:note_chars]}\n[condensed: {len(b.content) - note_chars} more characters omitted]"
                blocks.append(b.model_copy(update={"content": stub}))
            else:
                blocks.append(b)
        out.append(msg.model_copy(update={"content": blocks}))
    return out


def reply_message(results: Sequence[ToolResultBlock]) -> Message:
    """The next user message: the turn's tool_results (a nudge goes in a message of its own)."""
    return Message(role="user", content=list(results))


