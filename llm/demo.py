"""`DemoModel`: an offline, deterministic model that follows taskloom's model protocol.

It does not reason. Every answer is a pure function of the request, built from fixed rules and
string matching, so that `taskloom demo` runs with no key and no network, identically in every
process (the planner, executors and critic each hold their own instance). Its rules:

It knows no role's tool names: a forced tool is told apart by the fields its input schema requires
(a `tasks` list: the planner's plan; `answer`, `passed` and `action`: the final answer), and a
verdict asked for as a JSON reply by a request that offers no tool and whose system prompt shows
an object with `"passed"` and `"action"` fields.

**Planner** (`tool_choice` forces a plan tool): order ids are the `[A-Z]` + 3-or-more-digit words
(`A100`) in the user messages. When known support-desk tools (`lookup_order`, `refund_policy`,
`check_refund_eligibility`) are offered, by tool definition or by name in the prompt, and ids are found,
the plan has one task per id (`check-a100`, ...; no dependencies, so they run in parallel) using those
tools, and a final `summarize` task that depends on all of them. The FIRST order's definition of done
also asks for the refund deadline (`DEADLINE_DOD`). Otherwise the plan is a single `answer` task.

**Executor** (no forced tool): on a turn with no tool results yet, it calls every offered tool whose
required inputs it can fill (order id from "order A101" in the prompt, a date from the prompt) in one
turn (parallel tool_use). Once results are there, or when no tool can be called, it answers with text
quoting the tool results (or, for a summary, the prompt's lines that mention order ids), stop reason
`stop`. It writes `Refund deadline: ...` only when the prompt carries the critic's `FEEDBACK`,
at the end of the order's decision line, so that the summary (which keeps each order's decision
line) carries the deadline into the goal's final answer.

**Route first** (a plan tool offered, not forced, beside the goal's tools): the plan above when it
has several tasks; otherwise it starts the goal at once, as the executor below would (tool calls,
or a text answer).

**Critic** (a JSON verdict reply, or a forced verdict tool): rejects (action `retry`, feedback `FEEDBACK`) when
the prompt holds `DEADLINE_DOD` but no `Refund deadline:` answer and no earlier `FEEDBACK`; accepts
otherwise. So the first order's task is retried exactly once, showing the retry path. A forced
final tool (the answer and its verdict in one) gets each order's decision line from the accepted
results, and a verdict by the same rule.

For any other forced tool, it fills the tool's required inputs with placeholder values.
Streamed (`complete(..., on_text=)`): the reply's text is handed out a few words at a time, spread
over the same latency, so a streamed call takes as long as a plain one.
Usage: input tokens are `estimate_input_tokens(request)`; output tokens are counted like the fake
server does (UTF-8 bytes / 4 per block); a reply over `max_tokens` is cut with stop reason `max_tokens`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
from typing import Any

from llm.estimate import estimate_input_tokens
from llm.port import TextSink
from llm.types import (
    ContentBlock,
    ModelRequest,
    ModelResponse,
    StopReason,
    TextBlock,
    ToolDef,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)

KNOWN_TOOLS = ("lookup_order", "refund_policy", "check_refund_eligibility")
DEADLINE_DOD = "and states the refund deadline explicitly"
FEEDBACK = "Say the last day on which a refund can be requested (the refund deadline)."
DEADLINE_MARK = "Refund deadline:"

_ORDER_ID = re.compile(r"\b[A-Z]\d{3,}\b")
_TASK_ORDER = re.compile(r"\border\s+([A-Z]\d{3,})\b", re.IGNORECASE)
_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
_DAYS = re.compile(r"\b(\d{1,3})\s*(?:-\s*)?days?\b|\"\w*days\w*\"\s*:\s*(\d{1,3})", re.IGNORECASE)


def _form(tool: ToolDef) -> str:
    """Which role's form a forced tool is, by the fields its input schema requires (the demo knows
    no role's tool names): `plan` (a `tasks` list), `final` (`answer`, `passed` and `action`),
    `verdict` (`passed` and `action`), else `other`."""
    required = set(tool.input_schema.get("required", []))
    if "tasks" in required:
        return "plan"
    if {"answer", "passed", "action"} <= required:
        return "final"
    if {"passed", "action"} <= required:
        return "verdict"
    return "other"


def _wants_json_verdict(request: ModelRequest) -> bool:
    """A verdict asked for as a JSON reply: no tool offered, and the system prompt shows its fields."""
    return not request.tools and '"passed"' in request.system and '"action"' in request.system


def _user_text(request: ModelRequest) -> str:
    parts: list[str] = []
    for message in request.messages:
        if message.role != "user":
            continue
        for block in message.content:
            if isinstance(block, TextBlock):
                parts.append(block.text)
            elif isinstance(block, ToolResultBlock):
                parts.append(block.content)
    return "\n".join(parts)


def _all_text(request: ModelRequest) -> str:
    return request.system + "\n" + _user_text(request)


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _tool_use_id(request: ModelRequest, name: str, args: dict[str, Any]) -> str:
    seed = f"{len(request.messages)}|{name}|{json.dumps(args, sort_keys=True)}|{_user_text(request)}"
    return "toolu_demo_" + hashlib.sha256(seed.encode()).hexdigest()[:20]


# -- planner ----------------------------------------------------------------------------------


def _plan(request: ModelRequest) -> dict[str, Any]:
    offered = {t.name for t in request.tools}
    text = _all_text(request)
    known = [t for t in KNOWN_TOOLS if t in offered or re.search(rf"\b{t}\b", text)]
    order_ids = _unique(_ORDER_ID.findall(_user_text(request)))
    goal = next((b.text for m in request.messages for b in m.content if isinstance(b, TextBlock)), "").strip()
    if not known or not order_ids:
        return {
            "tasks": [
                {
                    "id": "answer",
                    "title": "Answer the goal",
                    "instructions": f"Answer this goal: {goal[:2000] or 'the goal'}",
                    "depends_on": [],
                    "definition_of_done": "The goal is answered.",
                    "tools": [],
                }
            ],
            "rationale": "demo model: a single task",
        }
    tools = [t for t in ("lookup_order", "refund_policy") if t in known] or known
    tasks: list[dict[str, Any]] = []
    for position, order_id in enumerate(order_ids):
        dod = f"States whether order {order_id} can be refunded, with the reason from the policy"
        tasks.append(
            {
                "id": f"check-{order_id.lower()}",
                "title": f"Check order {order_id}",
                "instructions": (
                    f"Look up order {order_id} with lookup_order, read the refund policy with refund_policy, "
                    f"and say whether order {order_id} can be refunded and why."
                ),
                "depends_on": [],
                "definition_of_done": (f"{dod} {DEADLINE_DOD}." if position == 0 else f"{dod}."),
                "tools": tools,
            }
        )
    tasks.append(
        {
            "id": "summarize",
            "title": "Summarize the refund decisions",
            "instructions": "Summarize, for each order, whether it can be refunded, from the earlier results.",
            "depends_on": [t["id"] for t in tasks],
            "definition_of_done": "One line per order with its refund decision.",
            "tools": [],
        }
    )
    return {"tasks": tasks, "rationale": "demo model: one parallel task per order, then a summary"}


# -- critic -----------------------------------------------------------------------------------


def _verdict(request: ModelRequest) -> dict[str, Any]:
    text = _all_text(request)
    if DEADLINE_DOD in text and DEADLINE_MARK not in text and FEEDBACK not in text:
        return {"passed": False, "feedback": FEEDBACK, "action": "retry"}
    return {"passed": True, "feedback": "Meets the definition of done.", "action": "accept"}


def _final(request: ModelRequest) -> dict[str, Any]:
    """The final answer (each order's decision line from the accepted results, or their lines that
    mention an order, or all of them) and a verdict by the same rule as a task review."""
    text = _user_text(request)
    body = text.split("Accepted results:", 1)[-1].rsplit("\n\nWrite the final answer", 1)[0].strip()
    decisions = _unique_by_order([m.group(0) for m in _DECISION.finditer(body)])
    answer = "\n".join(decisions) or body or "No results."
    return {"answer": answer, **_verdict(request)}


def _route(request: ModelRequest) -> tuple[list[ContentBlock], StopReason]:
    """The planner's first call offers the goal's tools beside the plan tool: a goal the rules plan
    as several tasks gets the plan; any other is done at once, as an executor would start it."""
    plan_tool = next(t for t in request.tools if _form(t) == "plan")
    args = _plan(request)
    if len(args["tasks"]) > 1:
        call = ToolUseBlock(id=_tool_use_id(request, plan_tool.name, args), name=plan_tool.name, input=args)
        return [call], "tool_call"
    return _execute(request)


# -- executor ---------------------------------------------------------------------------------


def _task_order_id(text: str) -> str | None:
    match = _TASK_ORDER.search(text)
    if match:
        return match.group(1).upper()
    found = _ORDER_ID.findall(text)
    return found[0] if found else None


def _fill_inputs(tool: ToolDef, order_id: str | None, text: str) -> dict[str, Any] | None:
    """Inputs for `tool` from what the prompt holds, or None when a required one is unknown."""
    properties: dict[str, Any] = tool.input_schema.get("properties") or {}
    required: list[str] = list(tool.input_schema.get("required") or [])
    date = _DATE.search(text)
    args: dict[str, Any] = {}
    for name in properties:
        lowered = name.lower()
        if "order" in lowered and order_id is not None:
            args[name] = order_id
        elif ("date" in lowered or "today" in lowered) and date is not None:
            args[name] = date.group(0)
    if any(name not in args for name in required):
        return None
    return args


def _deadline(results: list[str]) -> str:
    """A best-effort deadline: the first date in the results plus the first 'N days' window."""
    text = "\n".join(results)
    dates = _DATE.findall(text)
    days = _DAYS.search(text)
    if dates and days:
        import datetime as dt

        window = int(days.group(1) or days.group(2))
        start = dt.date.fromisoformat(dates[0])
        return (start + dt.timedelta(days=window)).isoformat()
    return "see the refund window in the policy above"


_DECISION = re.compile(r"Order [A-Z]\d{3,}: (?:can|cannot) be refunded[^\n]*")
_TODAY = re.compile(r"[Tt]oday is (\d{4}-\d{2}-\d{2})")


def _unique_by_order(lines: list[str]) -> list[str]:
    seen: dict[str, str] = {}
    for line in lines:
        seen.setdefault(line.split(":")[0], line)
    return list(seen.values())


def _refund_decision(order_id: str | None, results: list[str], text: str) -> str | None:
    """One line deciding a refund from an order record (JSON with `delivered`, `final_sale`), a policy
    with an "N days" window, and "Today is YYYY-MM-DD" in the prompt; None when any is missing.
    Fixed arithmetic, not reasoning: it exists so that the demo's answers read like answers."""
    import datetime as dt

    record: dict[str, Any] | None = None
    for result in results:
        try:
            value = json.loads(result)
        except ValueError:
            continue
        if isinstance(value, dict) and "delivered" in value:
            record = value
    window = _DAYS.search("\n".join(results))
    today = _TODAY.search(text)
    if order_id is None or record is None or window is None or today is None:
        return None
    days = int(window.group(1) or window.group(2))
    delivered = dt.date.fromisoformat(str(record["delivered"]))
    age = (dt.date.fromisoformat(today.group(1)) - delivered).days
    if record.get("final_sale"):
        return f"Order {order_id}: cannot be refunded: it was a final-sale item (delivered {delivered})."
    facts = f"delivered {delivered}, {age} days ago"
    if age <= days:
        return f"Order {order_id}: can be refunded: {facts}, within the {days}-day window."
    return f"Order {order_id}: cannot be refunded: {facts}, past the {days}-day window."


def _execute(request: ModelRequest) -> tuple[list[ContentBlock], StopReason]:
    last = request.messages[-1]
    results = [b for b in last.content if isinstance(b, ToolResultBlock)] if last.role == "user" else []
    text = _user_text(request)
    order_id = _task_order_id(text)
    if not results:
        calls: list[ContentBlock] = []
        for tool in request.tools:
            if _form(tool) != "other":
                continue  # a role's form is never an executor's tool
            args = _fill_inputs(tool, order_id, text)
            if args is not None:
                calls.append(ToolUseBlock(id=_tool_use_id(request, tool.name, args), name=tool.name, input=args))
        if calls:
            return calls, "tool_call"

    if results:
        names = {
            b.id: b.name
            for m in request.messages
            if m.role == "assistant"
            for b in m.content
            if isinstance(b, ToolUseBlock)
        }
        decision = _refund_decision(order_id, [r.content for r in results if not r.is_error], text)
        deadline = f"{DEADLINE_MARK} {_deadline([r.content for r in results])}." if FEEDBACK in text else None
        if decision and deadline:
            # Acting on the critic's feedback: the deadline joins the decision line, which is the line
            # the summary task carries into the goal's final answer.
            decision = f"{decision} {deadline}"
        lines = [decision] if decision else [f"Order {order_id}:" if order_id else "Results:"]
        for result in results:
            label = names.get(result.tool_use_id, "tool")
            lines.append(f"- {label}{' (error)' if result.is_error else ''}: {result.content.strip()}")
        if deadline and not decision:
            lines.append(deadline)
        answer = "\n".join(lines)
    else:
        decisions = _unique_by_order([m.group(0) for m in _DECISION.finditer(text)])
        mentions = _unique([line.strip() for line in text.splitlines() if _ORDER_ID.search(line)])
        if decisions:
            answer = "\n".join(decisions)
        elif mentions:
            answer = "Summary:\n" + "\n".join(mentions)
        else:
            first = next((line.strip() for line in text.splitlines() if line.strip()), "")
            answer = f"Done: {first[:500]}"
    return [TextBlock(text=answer)], "stop"


# -- any other forced tool --------------------------------------------------------------------

_PLACEHOLDERS: dict[str, Any] = {
    "string": "demo",
    "boolean": True,
    "integer": 0,
    "number": 0,
    "array": [],
    "object": {},
}


def _placeholder_input(tool: ToolDef) -> dict[str, Any]:
    properties: dict[str, Any] = tool.input_schema.get("properties") or {}
    out: dict[str, Any] = {}
    for name in tool.input_schema.get("required") or []:
        spec = properties.get(name) or {}
        if spec.get("enum"):
            out[name] = spec["enum"][0]
        else:
            out[name] = _PLACEHOLDERS.get(str(spec.get("type")), "demo")
    return out


# -- the model --------------------------------------------------------------------------------


def _output_tokens(content: list[ContentBlock]) -> int:
    total = 0
    for block in content:
        if isinstance(block, TextBlock):
            raw = block.text
        elif isinstance(block, ToolUseBlock):
            raw = block.name + json.dumps(block.input, sort_keys=True, separators=(",", ":"))
        else:
            raw = ""
        total += math.ceil(len(raw.encode("utf-8")) / 4) + 1
    return max(1, total)


class DemoModel:
    """Offline `ModelPort` following the protocol with fixed rules (see the module docstring).

    `latency` seconds are awaited per call, to look like a model without slowing tests down.
    """

    name = "demo"

    def __init__(self, *, latency: float = 0.03, model: str = "demo") -> None:
        self.latency = latency
        self.model = model

    def respond(self, request: ModelRequest) -> ModelResponse:
        """The pure decision: the response to `request`, with no waiting."""
        choice = request.tool_choice
        forced = choice.name if choice is not None and choice.type == "tool" else None
        content: list[ContentBlock]
        stop_reason: StopReason
        if forced is not None:
            tool = next(t for t in request.tools if t.name == forced)
            kind = _form(tool)
            if kind == "plan":
                args = _plan(request)
            elif kind == "final":
                args = _final(request)
            elif kind == "verdict":
                args = _verdict(request)
            else:
                args = _placeholder_input(tool)
            content = [ToolUseBlock(id=_tool_use_id(request, forced, args), name=forced, input=args)]
            stop_reason = "tool_call"
        elif _wants_json_verdict(request):
            content, stop_reason = [TextBlock(text=json.dumps(_verdict(request)))], "stop"
        elif any(_form(t) == "plan" for t in request.tools):
            content, stop_reason = _route(request)
        else:
            content, stop_reason = _execute(request)

        output = _output_tokens(content)
        if output > request.max_tokens:
            # What a real model does at the limit: the text is cut and an unfinished tool call is lost.
            text = "".join(b.text for b in content if isinstance(b, TextBlock))
            content = [TextBlock(text=text.encode()[: request.max_tokens * 4].decode("utf-8", "ignore"))]
            stop_reason = "length"
            output = request.max_tokens
        usage = Usage(input_tokens=estimate_input_tokens(request), output_tokens=output)
        return ModelResponse(content=content, stop_reason=stop_reason, usage=usage, request_id=None, model=self.model)

    async def complete(self, request: ModelRequest, on_text: TextSink | None = None) -> ModelResponse:
        response = self.respond(request)
        pieces = word_chunks(response.text) if on_text is not None else []
        if not pieces:
            if self.latency > 0:
                await asyncio.sleep(self.latency)
            return response
        assert on_text is not None
        pause = self.latency / len(pieces)
        for piece in pieces:
            if pause > 0:
                await asyncio.sleep(pause)
            on_text(piece)
        return response


_WORD_START = re.compile(r"(?<=\s)(?=\S)")


def word_chunks(text: str, words: int = 3) -> list[str]:
    """`text` in pieces of `words` words each (with their spacing), which concatenate to `text`."""
    split = [w for w in _WORD_START.split(text) if w]
    return ["".join(split[i : i + words]) for i in range(0, len(split), words)]
