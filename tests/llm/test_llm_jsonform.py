"""`llm.jsonform.parse`: a JSON reply read and validated against a form's schema (pure). The ask loop
with its correction turn runs through the real SDK and the fake Messages API in
tests/test_critic_handlers.py."""

from __future__ import annotations

import pytest

from bus.schemas import Verdict
from llm.jsonform import JsonForm, json_object, parse
from llm.types import ModelResponse, StopReason, TextBlock, Usage

FORM = JsonForm(schema=Verdict, correction=lambda problems: "FIX: " + "; ".join(problems), root="verdict")


def reply(text: str, stop: StopReason = "stop") -> ModelResponse:
    usage = Usage(input_tokens=1, output_tokens=1)
    return ModelResponse(content=[TextBlock(text=text)], stop_reason=stop, usage=usage, model="m")


@pytest.mark.parametrize(
    "text",
    [
        '{"passed": true, "action": "accept", "feedback": "ok"}',
        'Verdict:\n```json\n{"passed": true, "action": "accept", "feedback": "ok"}\n```\nDone.',
        '{"passed": true, "action": "accept", "feedback": "ok", "confidence": 0.9, "reason": "meets it"}',
    ],
)
def test_the_object_is_read_wherever_it_sits_and_unknown_keys_are_left_out(text: str) -> None:
    value, problems = parse(reply(text), FORM)
    assert problems == [] and value == Verdict(passed=True, action="accept", feedback="ok")


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("It looks fine to me.", "stop", "holds no JSON object"),
        ('{"passed": true, "action": }', "stop", "not valid JSON"),
        ('{"passed": true, "action": "accept"', "length", "cut at max_tokens"),
        ('{"passed": false, "action": "retry"}', "stop", "feedback is required"),
        ('{"passed": true}', "stop", "action: Field required"),
        ('{"passed": true, "action": "maybe"}', "stop", "action: Input should be 'accept'"),
    ],
)
def test_a_bad_reply_is_refused_naming_what_is_wrong(text: str, stop: StopReason, expected: str) -> None:
    value, problems = parse(reply(text, stop), FORM)
    assert value is None and any(expected in p for p in problems), problems


def test_json_object_spans_the_first_open_to_the_last_close_brace() -> None:
    assert json_object('x {"a": {"b": 1}} y') == '{"a": {"b": 1}}'
    assert json_object("no braces") is None and json_object("} {") is None
