"""Loop-policy behaviour that a hand-made mutation pass over executor/policy.py found untested."""

from __future__ import annotations

from executor import policy
from llm.types import Message, ToolResultBlock, ToolUseBlock


def test_condense_leaves_short_observations_whole() -> None:
    """Only observations longer than the note size are cut; a short one in the condensed region stays whole."""
    msgs = [Message.user("task")]
    for i in range(6):
        msgs.append(Message(role="assistant", content=[ToolUseBlock(id=f"c{i}", name="t", input={"i": i})]))
        body = "short result" if i == 0 else "y" * 5000
        msgs.append(Message(role="user", content=[ToolResultBlock(tool_use_id=f"c{i}", content=body)]))
    out = policy.condense(msgs, keep_last=2, block=2)
    first = out[2].content[0]
    assert isinstance(first, ToolResultBlock) and first.content == "short result"
    second = out[4].content[0]
    assert isinstance(second, ToolResultBlock) and "condensed" in second.content and len(second.content) < 400
