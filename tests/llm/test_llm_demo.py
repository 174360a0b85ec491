"""The offline demo model follows the model protocol deterministically, with no key and no network."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from critic.prompts import REVIEW_SYSTEM
from llm import DemoModel, Message, ModelRequest, ModelResponse, ToolChoice, ToolDef, ToolResultBlock
from llm.anthropic import AnthropicModel
from llm.demo import DEADLINE_DOD, DEADLINE_MARK, FEEDBACK
from llm.testing import FakeAnthropicServer, responder_from_model

GOAL = "Can orders A100, A101 and A107 be refunded? Today is 2026-10-13."
# The demo tells the roles' forms apart by the fields they require, not by their names.
PLAN = ToolDef(name="submit_plan", input_schema={"type": "object", "required": ["tasks"]})
VERDICT = ToolDef(name="submit_verdict", input_schema={"type": "object", "required": ["passed", "action"]})
LOOKUP = ToolDef(
    name="lookup_order",
    input_schema={"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
)
POLICY = ToolDef(name="refund_policy", input_schema={"type": "object", "properties": {}})
ORDERS = {
    "A100": '{"order_id": "A100", "delivered_on": "2026-09-20", "status": "delivered"}',
    "A101": '{"order_id": "A101", "delivered_on": "2026-08-01", "status": "delivered"}',
    "A107": '{"order_id": "A107", "status": "cancelled"}',
}
POLICY_TEXT = "Refunds are possible within 30 days of delivery."


def _plan_request(prompt: str) -> ModelRequest:
    return ModelRequest(
        system="You are the planner.",
        messages=[Message.user(prompt)],
        tools=[PLAN],
        tool_choice=ToolChoice.force("submit_plan"),
        max_tokens=4000,
    )


def _plan(prompt: str) -> dict[str, Any]:
    response = DemoModel().respond(_plan_request(prompt))
    assert response.stop_reason == "tool_call" and response.tool_uses[0].name == "submit_plan"
    return response.tool_uses[0].input


def test_plan_has_one_parallel_task_per_order_and_a_summary() -> None:
    """With the support tools available, each order id becomes a parallel task and a summary depends on all."""
    plan = _plan(f"Goal: {GOAL}\nAvailable tools: lookup_order, refund_policy")
    tasks = {t["id"]: t for t in plan["tasks"]}
    assert list(tasks) == ["check-a100", "check-a101", "check-a107", "summarize"]
    for order in ("a100", "a101", "a107"):
        assert tasks[f"check-{order}"]["depends_on"] == []
        assert tasks[f"check-{order}"]["tools"] == ["lookup_order", "refund_policy"]
    assert tasks["summarize"]["depends_on"] == ["check-a100", "check-a101", "check-a107"]
    assert DEADLINE_DOD in tasks["check-a100"]["definition_of_done"]
    assert DEADLINE_DOD not in tasks["check-a101"]["definition_of_done"]
    for task in plan["tasks"]:
        assert set(task) == {"id", "title", "instructions", "depends_on", "definition_of_done", "tools"}


def test_plan_without_known_tools_is_one_task() -> None:
    """No support-desk tools offered: a single task that answers the goal."""
    plan = _plan(GOAL)
    assert [t["id"] for t in plan["tasks"]] == ["answer"]
    assert GOAL in plan["tasks"][0]["instructions"]


def _executor_request(instructions: str, *extra: Message) -> ModelRequest:
    return ModelRequest(
        system="You are an executor.",
        messages=[Message.user(instructions), *extra],
        tools=[LOOKUP, POLICY],
        max_tokens=2000,
    )


def _run_task(model: DemoModel, instructions: str) -> str:
    """Drive the executor's ReAct loop with the demo tools until end_turn; return the answer."""
    request = _executor_request(instructions)
    for _ in range(4):
        response = model.respond(request)
        if response.stop_reason == "stop":
            return response.text
        assert response.stop_reason == "tool_call"
        results = []
        for call in response.tool_uses:
            content = ORDERS[call.input["order_id"]] if call.name == "lookup_order" else POLICY_TEXT
            results.append(ToolResultBlock(tool_use_id=call.id, content=content))
        messages = [*request.messages, response.as_message(), Message(role="user", content=results)]
        request = request.model_copy(update={"messages": messages})
    raise AssertionError("the executor did not finish")


def test_executor_calls_both_tools_in_one_turn_then_answers() -> None:
    """First turn: lookup_order(order from the task) and refund_policy in parallel; then an end_turn answer."""
    model = DemoModel()
    first = model.respond(_executor_request(f"Goal: {GOAL}\nTask: Look up order A101 and check the policy."))
    assert first.stop_reason == "tool_call"
    assert [(c.name, c.input) for c in first.tool_uses] == [
        ("lookup_order", {"order_id": "A101"}),
        ("refund_policy", {}),
    ]
    assert len({c.id for c in first.tool_uses}) == 2
    answer = _run_task(model, "Look up order A101 and check the policy.")
    assert "2026-08-01" in answer and POLICY_TEXT in answer and DEADLINE_MARK not in answer


def _verdict(prompt: str) -> dict[str, Any]:
    """The demo's verdict as the critic asks for it: a JSON reply (no tool offered)."""
    request = ModelRequest(system=REVIEW_SYSTEM, messages=[Message.user(prompt)], max_tokens=500)
    response = DemoModel().respond(request)
    assert response.stop_reason == "stop" and not response.tool_uses
    verdict: dict[str, Any] = json.loads(response.text)
    return verdict


def test_a_forced_verdict_tool_gets_the_same_verdict_as_the_json_reply() -> None:
    prompt = f"Definition of done: the decision {DEADLINE_DOD}\n\nAnswer (attempt 1):\nA100: eligible."
    request = ModelRequest(
        messages=[Message.user(prompt)], tools=[VERDICT], tool_choice=ToolChoice.force("submit_verdict"), max_tokens=500
    )
    response = DemoModel().respond(request)
    assert response.tool_uses[0].name == "submit_verdict"
    assert response.tool_uses[0].input == _verdict(prompt)
    assert _verdict(prompt)["action"] == "retry"


def test_critic_retries_the_first_order_once_then_accepts() -> None:
    """The first order's answer is sent back once for its deadline; with the feedback applied it is accepted."""
    plan = {t["id"]: t for t in _plan(f"{GOAL} tools: lookup_order refund_policy")["tasks"]}
    model = DemoModel()
    first_task = plan["check-a100"]
    answer = _run_task(model, first_task["instructions"])
    review = f"Definition of done: {first_task['definition_of_done']}\nResult:\n{answer}"
    verdict = _verdict(review)
    assert verdict == {"passed": False, "feedback": FEEDBACK, "action": "retry"}

    retried = _run_task(model, f"{first_task['instructions']}\nFeedback from review: {verdict['feedback']}")
    assert f"{DEADLINE_MARK} 2026-10-20." in retried  # delivered 2026-09-20 + 30 days
    second = _verdict(f"Definition of done: {first_task['definition_of_done']}\nResult:\n{retried}")
    assert second["passed"] and second["action"] == "accept"

    other = plan["check-a101"]
    other_answer = _run_task(model, other["instructions"])
    assert _verdict(f"Definition of done: {other['definition_of_done']}\nResult:\n{other_answer}")["action"] == "accept"


def test_summary_task_answers_without_tools() -> None:
    """A task with no tools gets an end_turn text built from the results in its prompt."""
    request = ModelRequest(
        messages=[Message.user("Summarize.\nOrder A100: refundable\nOrder A107: cancelled")], max_tokens=500
    )
    response = DemoModel().respond(request)
    assert response.stop_reason == "stop"
    assert "Order A100: refundable" in response.text and "Order A107: cancelled" in response.text


def test_demo_is_deterministic_and_reports_usage() -> None:
    """Same request, same response; usage has the estimator's input tokens and nonzero output."""
    request = _plan_request(f"{GOAL} lookup_order refund_policy")
    one, two = DemoModel().respond(request), DemoModel().respond(request)
    assert one == two
    from llm import estimate_input_tokens

    assert one.usage.input_tokens == estimate_input_tokens(request) and one.usage.output_tokens > 10


def test_max_tokens_truncates() -> None:
    """A reply longer than max_tokens is cut with stop reason max_tokens and output == max_tokens."""
    response = DemoModel().respond(
        _executor_request("Summarize A100 " + "x" * 400).model_copy(update={"tools": [], "max_tokens": 5})
    )
    assert response.stop_reason == "length" and response.usage.output_tokens == 5


async def test_complete_waits_the_simulated_latency() -> None:
    """`complete` needs no key or network (the guard is on, env cleared) and takes about `latency`."""
    started = time.monotonic()
    response: ModelResponse = await DemoModel(latency=0.05).complete(_plan_request(GOAL))
    assert time.monotonic() - started >= 0.05
    assert response.model == "demo"


async def test_demo_rules_through_the_fake_server_and_sdk(server: FakeAnthropicServer) -> None:
    """The fake server scripted by the demo model drives the real adapter through plan and tool calls."""
    server.respond_with(responder_from_model(DemoModel(latency=0)))
    model = AnthropicModel("claude-test", api_key="k", base_url=server.base_url, strict_validation=True)
    plan = await model.complete(_plan_request(f"{GOAL} lookup_order refund_policy"))
    assert len(plan.tool_uses[0].input["tasks"]) == 4
    step = await model.complete(_executor_request("Look up order A107."))
    assert {c.name for c in step.tool_uses} == {"lookup_order", "refund_policy"}
    await model.aclose()
    assert server.billed.output_tokens == plan.usage.output_tokens + step.usage.output_tokens


@pytest.mark.parametrize(
    ("record", "today", "expect"),
    [
        ({"delivered": "2026-09-20", "final_sale": False}, "2026-10-13", "A1: can be refunded: delivered 2026-09-20"),
        ({"delivered": "2026-08-30", "final_sale": False}, "2026-10-13", "A1: cannot be refunded: delivered 2026-08"),
        ({"delivered": "2026-10-10", "final_sale": True}, "2026-10-13", "A1: cannot be refunded: it was a final-sale"),
        ({"delivered": "2026-09-13", "final_sale": False}, "2026-10-13", "within the 30-day window"),
    ],
)
def test_demo_refund_decision_is_fixed_arithmetic(record: dict[str, object], today: str, expect: str) -> None:
    """The demo executor decides a refund from the order record, the policy window and today's date."""
    from llm.demo import _refund_decision

    results = [json.dumps({"order_id": "A1", **record}), "Refunds within 30 days of delivery."]
    line = _refund_decision("A1", results, f"Goal: ... Today is {today}.")
    assert line is not None and expect in line
    assert _refund_decision("A1", results, "no date here") is None


def test_demo_knows_the_forms_by_their_fields_not_their_names() -> None:
    """A plan form under another name still gets a plan; a form with neither shape gets placeholders."""
    renamed = ToolDef(name="make_plan", input_schema=PLAN.input_schema)
    request = ModelRequest(
        messages=[Message.user("Answer: what is 2+2?")], tools=[renamed], tool_choice=ToolChoice.force("make_plan"),
        max_tokens=4000,
    )
    assert [t["id"] for t in DemoModel().respond(request).tool_uses[0].input["tasks"]] == ["answer"]
    schema = {"type": "object", "required": ["note"], "properties": {"note": {"type": "string"}}}
    other = ToolDef(name="submit_plan", input_schema=schema)
    request = request.model_copy(update={"tools": [other], "tool_choice": ToolChoice.force("submit_plan")})
    assert "tasks" not in DemoModel().respond(request).tool_uses[0].input
