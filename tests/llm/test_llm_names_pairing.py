"""Tool-name mapping at the provider boundary, and the tool_use/tool_result pairing check."""

from __future__ import annotations

import pytest

from llm import Message, TextBlock, ToolNameCollisionError, ToolPairingError, ToolResultBlock, ToolUseBlock
from llm.pairing import check_tool_pairing
from llm.toolnames import VALID, ToolNameMap, provider_name


@pytest.mark.parametrize(
    ("ours", "wire"),
    [("lookup_order", "lookup_order"), ("svc.order.lookup", "svc_order_lookup"), ("a b/c", "a_b_c"), ("x-1", "x-1")],
)
def test_provider_name(ours: str, wire: str) -> None:
    """Invalid characters become underscores; valid names are untouched."""
    assert provider_name(ours) == wire


def test_long_names_are_cut_with_a_hash_suffix() -> None:
    """Names over 64 characters are shortened to a valid, distinct name that maps back."""
    a, b = "x" * 70 + ".a", "x" * 70 + ".b"
    mapping = ToolNameMap([a, b])
    assert VALID.match(mapping.to_provider(a)) and len(mapping.to_provider(a)) == 64
    assert mapping.to_provider(a) != mapping.to_provider(b)
    assert mapping.to_ours(mapping.to_provider(b)) == b


def test_collisions_name_both_tools() -> None:
    """Two names that land on one provider name fail fast, naming both."""
    with pytest.raises(ToolNameCollisionError, match=r"'a\.b'.*'a_b'"):
        ToolNameMap(["a.b", "a_b"])


def test_unknown_provider_names_pass_through() -> None:
    """A name the model invents is returned as is (the executor reports it as an unknown tool)."""
    assert ToolNameMap(["a.b"]).to_ours("made_up") == "made_up"


def _call(*ids: str) -> Message:
    return Message(role="assistant", content=[ToolUseBlock(id=i, name="f") for i in ids])


def _results(*ids: str, then_text: bool = False) -> Message:
    blocks: list[TextBlock | ToolResultBlock] = [ToolResultBlock(tool_use_id=i, content="ok") for i in ids]
    if then_text:
        blocks.append(TextBlock(text="continue"))
    return Message(role="user", content=list(blocks))


def test_pairing_accepts_parallel_calls_answered_in_any_order() -> None:
    """Two parallel calls answered (in another order, then text) by the next user message pass."""
    check_tool_pairing(
        [Message.user("go"), _call("a", "b"), _results("b", "a", then_text=True), _call("c"), _results("c")]
    )


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([Message.user("go"), _call("a", "b"), _results("a")], r"\['b'\]"),
        ([Message.user("go"), _call("a"), Message.user("no results")], r"\['a'\]"),
        ([Message.user("go"), _call("a"), _results("a", "zzz")], "zzz"),
        (
            [
                Message.user("go"),
                _call("a"),
                Message(role="user", content=[TextBlock(text="x"), ToolResultBlock(tool_use_id="a", content="")]),
            ],
            "must open",
        ),
        ([Message.user("go"), _call("a"), _results("a"), _call("a"), _results("a")], "duplicate"),
        ([Message.user("go"), _call("a")], "ends with"),
    ],
)
def test_pairing_violations_are_named(messages: list[Message], fragment: str) -> None:
    """Each way of breaking the pairing raises ToolPairingError saying which ids are wrong."""
    with pytest.raises(ToolPairingError, match=fragment):
        check_tool_pairing(messages)


def test_pending_calls_allowed_on_request() -> None:
    """A checkpoint between the model turn and the tool results may end with unanswered calls."""
    check_tool_pairing([Message.user("go"), _call("a")], allow_pending=True)
