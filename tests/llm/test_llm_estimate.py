"""`estimate_input_tokens`: deterministic, documented, and never below what the fake server bills."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from llm import Message, ModelRequest, TextBlock, ToolDef, ToolResultBlock, ToolUseBlock, estimate_input_tokens
from llm.anthropic import build_params, tool_name_map
from llm.testing.tokens import count_input_tokens


def test_formula_on_a_small_request() -> None:
    """The documented formula, worked by hand: ceil(bytes/2.5) + 16 + 8/message + 4/block (+ tool terms)."""
    request = ModelRequest(system="abcde", messages=[Message.user("fghij")], max_tokens=5)
    assert estimate_input_tokens(request) == math.ceil(10 / 2.5) + 16 + 8 + 4
    with_tool = request.model_copy(update={"tools": [ToolDef(name="t", description="", input_schema={})]})
    assert estimate_input_tokens(with_tool) == math.ceil((10 + 1 + 2) / 2.5) + 16 + 8 + 4 + 16 + 500


def test_counts_utf8_bytes() -> None:
    """Non-Latin text counts by UTF-8 bytes, so it is not under-estimated."""
    ascii_request = ModelRequest(messages=[Message.user("a" * 30)], max_tokens=1)
    cjk_request = ModelRequest(messages=[Message.user("漢" * 30)], max_tokens=1)
    assert estimate_input_tokens(cjk_request) > estimate_input_tokens(ascii_request)


_text = st.text(max_size=200)
_names = st.from_regex(r"[a-z][a-z.]{0,20}", fullmatch=True)


@st.composite
def requests(draw: st.DrawFn) -> ModelRequest:
    tools = [ToolDef(name=n, description=draw(_text)) for n in draw(st.lists(_names, max_size=3, unique=True))]
    messages = [Message.user(draw(_text) or "x")]
    for i in range(draw(st.integers(0, 3))):
        name = draw(_names)
        call = ToolUseBlock(id=f"t{i}", name=name, input={"q": draw(_text)})
        messages.append(Message(role="assistant", content=[TextBlock(text=draw(_text) or "y"), call]))
        messages.append(Message(role="user", content=[ToolResultBlock(tool_use_id=f"t{i}", content=draw(_text))]))
    return ModelRequest(system=draw(_text), messages=messages, tools=tools, max_tokens=10)


@settings(max_examples=60, deadline=None)
@given(requests())
def test_estimate_covers_what_the_fake_server_bills(request: ModelRequest) -> None:
    """For any request, the estimate is at least the input the fake server counts for its wire form."""
    names = tool_name_map(request)
    wire = build_params(request, "claude-test", names)
    assert estimate_input_tokens(request) >= count_input_tokens(wire)
    assert estimate_input_tokens(request) == estimate_input_tokens(request.model_copy())
