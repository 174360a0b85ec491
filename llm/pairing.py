"""The tool_use / tool_result pairing rule that providers enforce, checked before we send.

Rule: every assistant message with tool_use blocks is followed by a user message that starts with
exactly one tool_result per tool_use id (in any order) before any other block; every tool_result
answers a tool_use of the assistant message just before it; tool_use ids are unique in the history.
"""

from __future__ import annotations

from collections.abc import Sequence

from llm.errors import ToolPairingError
from llm.types import Message, ToolResultBlock, ToolUseBlock


def check_tool_pairing(messages: Sequence[Message], *, allow_pending: bool = False) -> None:
    """Raise `ToolPairingError` naming the message index and ids when `messages` breaks the rule.

    `allow_pending=True` accepts a history that ends with an assistant turn whose tool calls are not
    answered yet (a checkpoint taken between the model turn and the tool results).
    """
    seen_ids: set[str] = set()
    pending: list[str] = []  # ids the next message must answer
    for index, message in enumerate(messages):
        if message.role == "assistant":
            if pending:
                raise ToolPairingError(
                    f"message {index}: assistant turn follows tool_use ids {pending} that have no tool_result"
                )
            for block in message.content:
                if isinstance(block, ToolResultBlock):
                    raise ToolPairingError(f"message {index}: tool_result in an assistant message")
                if isinstance(block, ToolUseBlock):
                    if block.id in seen_ids:
                        raise ToolPairingError(f"message {index}: duplicate tool_use id {block.id!r}")
                    seen_ids.add(block.id)
                    pending.append(block.id)
            continue

        answered: list[str] = []
        leading = True
        for position, block in enumerate(message.content):
            if isinstance(block, ToolUseBlock):
                raise ToolPairingError(f"message {index}: tool_use in a user message")
            if not isinstance(block, ToolResultBlock):
                leading = False
                continue
            if not leading:
                raise ToolPairingError(
                    f"message {index}: tool_result for {block.tool_use_id!r} at block {position} comes after "
                    "other content; tool_results must open the user message"
                )
            if block.tool_use_id not in pending:
                raise ToolPairingError(
                    f"message {index}: tool_result for {block.tool_use_id!r} answers no tool_use of the "
                    f"previous assistant message (open ids: {pending})"
                )
            if block.tool_use_id in answered:
                raise ToolPairingError(f"message {index}: two tool_results for {block.tool_use_id!r}")
            answered.append(block.tool_use_id)
        missing = [i for i in pending if i not in answered]
        if missing:
            raise ToolPairingError(
                f"message {index}: tool_use ids {missing} of message {index - 1} have no tool_result"
            )
        pending = []

    if pending and not allow_pending:
        raise ToolPairingError(
            f"message {len(messages) - 1}: the history ends with tool_use ids {pending} that have no tool_result"
        )
