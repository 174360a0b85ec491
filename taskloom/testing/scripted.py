"""`ScriptedModel`: a model whose every reply the test writes, per role, as a list or a function.

It is a `ModelPort` like the production models, so its calls go through the goal's ledger
(`bus.metered`) exactly as Claude's do. Usage is counted the way the fake Messages API server
(`llm.testing`) counts it, so a scripted run spends the same tokens in-process and against real
workers.

The roles are the calls taskloom makes: `planner` (its first call offers the goal's tools beside
`submit_plan`, so a script may reply with a plan, a call of the goal's tools, which makes the goal
one task starting with that call, or text, the goal's answer), `executor`, `review` (a task), and
`goal_review` (a goal of several tasks: the final answer and its verdict in one `submit_final` call;
the `answer` script writes the answer part when `goal_review` gives a verdict). A goal of one task
makes no final-answer call.

Who is asking is read from the request's `metadata` (the labels every role sets and no provider
sees); a request without them (one that came over HTTP, see `taskloom.testing.parity`) is told apart
by its system prompt, and its task by the prompt's first line about it.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from bus.schemas import FinalVerdict, TaskSpec, Verdict
from critic.prompts import FINAL_SYSTEM, FINAL_TOOL, REVIEW_SYSTEM
from executor.loop import SYSTEM as EXECUTOR_SYSTEM
from llm.demo import word_chunks
from llm.errors import TerminalModelError
from llm.port import TextSink
from llm.testing import Failure, RecordedRequest, error_body, reply_from_response, request_from_wire
from llm.testing import Script as FakeScript
from llm.testing.tokens import count_input_tokens, count_output_tokens
from llm.types import (
    ContentBlock,
    ModelRequest,
    ModelResponse,
    StopReason,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from planner.prompts import PLAN_TOOL
from planner.prompts import SYSTEM as PLANNER_SYSTEM

Role = Literal["planner", "executor", "review", "goal_review", "answer"]
ROLES: tuple[Role, ...] = ("planner", "executor", "review", "goal_review", "answer")

Reply = ModelResponse | str
"""What a script gives back: a response (use the builders below), or a string for a plain text answer."""
Script = Sequence[Reply] | Callable[[ModelRequest], Reply]
"""Replies in order, or a function of the request."""

_ids = itertools.count(1)


class UnscriptedRequest(TerminalModelError):
    """The script has no reply for this request (none written for its role or task, or used up)."""


# -- reply builders -----------------------------------------------------------------------------


def _response(content: list[ContentBlock], stop_reason: StopReason, output_tokens: int | None) -> ModelResponse:
    usage = Usage(output_tokens=output_tokens) if output_tokens is not None else Usage()
    return ModelResponse(content=content, stop_reason=stop_reason, usage=usage, model="scripted")


def text(answer: str, *, output_tokens: int | None = None) -> ModelResponse:
    """A plain text reply (`stop`): an executor's answer, or the goal's final answer."""
    return _response([TextBlock(text=answer)], "stop", output_tokens)


def tool_calls(*calls: tuple[str, Mapping[str, Any]], say: str | None = None) -> ModelResponse:
    """One turn calling every `(tool name, arguments)` at once (parallel tool use)."""
    if not calls:
        raise ValueError("tool_calls needs at least one (name, arguments) pair")
    content: list[ContentBlock] = [TextBlock(text=say)] if say else []
    content += [ToolUseBlock(id=f"toolu_script_{next(_ids)}", name=name, input=dict(args)) for name, args in calls]
    return _response(content, "tool_call", None)


def tool_call(name: str, /, **args: Any) -> ModelResponse:
    """One turn calling one tool: `tool_call("issue_refund", order_id="A100")`."""
    return tool_calls((name, args))


def task(
    id: str,
    *,
    depends_on: Sequence[str] = (),
    tools: Sequence[str] = (),
    title: str | None = None,
    instructions: str | None = None,
    definition_of_done: str | None = None,
) -> dict[str, Any]:
    """One task of a plan, as the model writes it (validated now, so a typo fails here, not in a worker)."""
    spec = TaskSpec(
        id=id,
        title=title or f"task {id}",
        instructions=instructions or f"Do {id}.",
        depends_on=list(depends_on),
        definition_of_done=definition_of_done or f"{id} is done",
        tools=list(tools),
    )
    return spec.model_dump(mode="json")


def plan(*tasks: Mapping[str, Any], rationale: str = "") -> ModelResponse:
    """The planner's `submit_plan` call. Tasks are `task(...)` dicts, or any dicts at all: the planner
    validates what it receives, so an invalid plan (a cycle, an unknown tool) tests its corrections."""
    body: dict[str, Any] = {"tasks": [dict(t) for t in tasks]}
    if rationale:
        body["rationale"] = rationale
    return tool_calls((PLAN_TOOL, body))


def verdict(action: Literal["accept", "retry", "replan"], feedback: str = "") -> ModelResponse:
    """The critic's verdict on a task: a JSON reply."""
    body = Verdict(passed=action == "accept", action=action, feedback=feedback)
    return text(body.model_dump_json())


def _as_json_verdict(reply: Reply) -> Reply:
    """A review script written when the verdict was a forced `submit_verdict` tool call still works:
    that one call is sent as the JSON reply the critic now asks for (`verdict(...)` builds it)."""
    if isinstance(reply, ModelResponse) and not reply.text:
        uses = reply.tool_uses
        if len(uses) == 1 and uses[0].name == "submit_verdict":
            return text(json.dumps(uses[0].input))
    return reply


def final(answer: str, action: Literal["accept", "replan"] = "accept", feedback: str = "") -> ModelResponse:
    """The critic's `submit_final` call: the goal's final answer and the verdict on it, in one."""
    body = FinalVerdict(answer=answer, passed=action == "accept", action=action, feedback=feedback)
    return tool_calls((FINAL_TOOL, body.model_dump(mode="json")))


def accept(feedback: str = "meets the definition of done") -> ModelResponse:
    return verdict("accept", feedback)


def retry(feedback: str) -> ModelResponse:
    """Reject the answer; the same task runs again with `feedback` in its prompt."""
    return verdict("retry", feedback)


def replan(feedback: str) -> ModelResponse:
    """Reject the answer; the planner makes a new plan (keeping accepted work)."""
    return verdict("replan", feedback)


# -- reading a request ----------------------------------------------------------------------------

_SYSTEMS: dict[str, Role] = {
    PLANNER_SYSTEM: "planner",
    EXECUTOR_SYSTEM: "executor",
    REVIEW_SYSTEM: "review",
    FINAL_SYSTEM: "goal_review",
}
_PURPOSES: dict[str, Role] = {"review": "review", "review_goal": "goal_review"}
_TASK_LINE = re.compile(r"^Your task \(([^)]+)\)|^Task '([^']+)':", re.M)
_ATTEMPT_LINE = re.compile(r"^Answer \(attempt (\d+)\):", re.M)


def _first_user_text(request: ModelRequest) -> str:
    first = request.messages[0]
    return "\n".join(b.text for b in first.content if isinstance(b, TextBlock))


def role_of(request: ModelRequest) -> Role:
    """Which role sent `request`: planner, executor, review (of a task), goal_review or answer."""
    meta = request.metadata
    if meta.get("role") == "planner":
        return "planner"
    if meta.get("role") == "critic" and meta.get("purpose") in _PURPOSES:
        return _PURPOSES[meta["purpose"]]
    if "task_id" in meta and "role" not in meta:
        return "executor"
    role = _SYSTEMS.get(request.system)
    if role is None:
        raise UnscriptedRequest(f"cannot tell which role sent this request (system prompt {request.system[:60]!r})")
    return role


def task_of(request: ModelRequest) -> str | None:
    """The task an executor or review request is about (None for the planner and the goal)."""
    if "task_id" in request.metadata:
        return request.metadata["task_id"]
    m = _TASK_LINE.search(_first_user_text(request))
    return (m.group(1) or m.group(2)) if m else None


def attempt_of(request: ModelRequest) -> int | None:
    """The attempt a review request judges."""
    m = _ATTEMPT_LINE.search(_first_user_text(request))
    return int(m.group(1)) if m else None


def tool_results(request: ModelRequest) -> list[ToolResultBlock]:
    """Every tool result in the conversation so far, oldest first."""
    return [b for m in request.messages if m.role == "user" for b in m.content if isinstance(b, ToolResultBlock)]


def accepted_results(request: ModelRequest) -> str:
    """The accepted results quoted in a final-answer request (the default final answer)."""
    prompt = _first_user_text(request)
    body = prompt.split("Accepted results:\n\n", 1)[-1]
    return body.rsplit("\n\nWrite the final answer", 1)[0].strip() or "(no results)"


# -- the model ------------------------------------------------------------------------------------


def _wire_body(request: ModelRequest) -> dict[str, Any]:
    """The parts of a Messages API body that the fake server counts tokens from (its counting reads
    text only: names, descriptions, schemas, texts, tool inputs and results). Built here rather than
    with the Anthropic adapter so that scripted tests never import the provider SDK (~2 s)."""
    return {
        "tools": [t.model_dump(mode="json") for t in request.tools],
        "system": [{"type": "text", "text": request.system}] if request.system else [],
        "messages": [m.model_dump(mode="json") for m in request.messages],
    }


@dataclass(frozen=True)
class ScriptedCall:
    """One call the model answered, for assertions."""

    role: Role
    task_id: str | None
    request: ModelRequest
    response: ModelResponse


def _default(role: Role) -> Callable[[ModelRequest], Reply] | None:
    if role in ("review", "goal_review"):
        return lambda _req: accept()
    if role == "answer":
        return accepted_results
    if role == "executor":
        return lambda req: text(f"{task_of(req) or 'task'} done")
    return None  # the planner has no sensible default: say so


class ScriptedModel:
    """A `ModelPort` answering from scripts, per role.

    Each script is a list of replies (used in order) or a function `request -> reply`. `executor`
    and `review` may also map task ids to scripts, so that tasks running in parallel each follow
    their own list (`critic` is another name for `review`). Roles left out answer by default:
    reviews and the goal review accept, the final answer quotes the accepted results, an executor
    answers "<task> done". The planner has no default. A request the scripts cannot answer (an
    unknown task, a list used up) raises
    `UnscriptedRequest` and is kept in `problems`; `run_goal` then fails the test with it.
    """

    name = "scripted"

    def __init__(
        self,
        *,
        planner: Script | None = None,
        executor: Script | Mapping[str, Script] | None = None,
        review: Script | Mapping[str, Script] | None = None,
        goal_review: Script | None = None,
        answer: Script | None = None,
        critic: Script | Mapping[str, Script] | None = None,
        model: str = "scripted",
    ) -> None:
        if critic is not None:  # the role's name, for the task reviews
            if review is not None:
                raise ValueError("pass the task reviews' script as review= or critic=, not both")
            review = critic
        self.model = model
        self.scripts: dict[Role, Any] = {
            "planner": planner,
            "executor": executor,
            "review": review,
            "goal_review": goal_review,
            "answer": answer,
        }
        self.calls: list[ScriptedCall] = []
        self.problems: list[str] = []
        self._used: dict[tuple[Role, str | None], int] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def __repr__(self) -> str:
        scripted = [r for r, s in self.scripts.items() if s is not None]
        return f"ScriptedModel(scripted={scripted}, calls={len(self.calls)})"

    def requests(self, role: Role, task_id: str | None = None) -> list[ModelRequest]:
        """The requests `role` sent (about `task_id`, if given), in order."""
        return [c.request for c in self.calls if c.role == role and (task_id is None or c.task_id == task_id)]

    async def complete(self, request: ModelRequest, on_text: TextSink | None = None) -> ModelResponse:
        response = self.respond(request)
        if on_text is not None:
            for piece in word_chunks(response.text):  # streamed as a model would, a few words at a time
                on_text(piece)
        return response

    def respond(self, request: ModelRequest) -> ModelResponse:
        """The pure decision (thread-safe): also what answers the fake HTTP server in parity tests."""
        try:
            role = role_of(request)
            tid = task_of(request)
            reply = self._pick(role, tid, request)
            if role == "review":
                reply = _as_json_verdict(reply)
            if role == "goal_review":
                reply = self._final(reply, request)
            response = self._finish(reply, request)
        except UnscriptedRequest as exc:
            with self._lock:
                self.problems.append(str(exc))
            raise
        with self._lock:
            self.calls.append(ScriptedCall(role, tid, request, response))
        return response

    def _pick(self, role: Role, tid: str | None, request: ModelRequest) -> Reply:
        script = self.scripts[role]
        key: tuple[Role, str | None] = (role, None)
        if isinstance(script, Mapping):
            key = (role, tid)
            if tid not in script:
                fallback = _default(role) if role == "review" else None
                if fallback is None:
                    raise UnscriptedRequest(f"no {role} script for task {tid!r} (scripted: {sorted(script)})")
                return fallback(request)
            script = script[tid]
        if script is None:
            fallback = _default(role)
            if fallback is None:
                raise UnscriptedRequest(f"no {role} script: pass ScriptedModel({role}=[...]) or a function")
            return fallback(request)
        if callable(script):
            made: Reply = script(request)
            return made
        with self._lock:
            n = self._used.get(key, 0)
            self._used[key] = n + 1
        if n >= len(script):
            about = f" for task {tid!r}" if key[1] is not None else ""
            raise UnscriptedRequest(f"the {role} script{about} has {len(script)} replies; request {n + 1} has none")
        reply: Reply = script[n]
        return reply

    def _final(self, reply: Reply, request: ModelRequest) -> Reply:
        """The goal review writes the final answer and its verdict in one call (`submit_final`). A
        `goal_review` script may give that call (`final(...)`), a verdict (`accept()`, `replan(...)`:
        the answer is then the `answer` script's reply, by default the accepted results quoted), or
        a string (the answer, accepted)."""
        if isinstance(reply, str):
            return final(reply)
        if reply.tool_uses:
            return reply
        try:
            given = Verdict.model_validate_json(reply.text)
        except ValueError:  # not a verdict: sent as it is (a test of the correction turn)
            return reply
        answer = self._finish(self._pick("answer", None, request), request).text
        if given.action == "accept":
            return final(answer, "accept", given.feedback)
        return final(answer, "replan", given.feedback)

    def _finish(self, reply: Reply, request: ModelRequest) -> ModelResponse:
        if isinstance(reply, str):
            reply = text(reply)
        if not isinstance(reply, ModelResponse):
            raise UnscriptedRequest(f"a script returned {type(reply).__name__}, not a ModelResponse or str")
        # Fresh tool-use ids: a reply object used twice must not repeat an id within a conversation.
        content = [
            b.model_copy(update={"id": f"toolu_{self.model}_{next(self._ids):05d}"})
            if isinstance(b, ToolUseBlock)
            else b
            for b in reply.content
        ]
        output = reply.usage.output_tokens or count_output_tokens([b.model_dump(mode="json") for b in content])
        usage = Usage(input_tokens=count_input_tokens(_wire_body(request)), output_tokens=output)
        return ModelResponse(content=content, stop_reason=reply.stop_reason, usage=usage, model=self.model)


def http_responder(model: ScriptedModel) -> Callable[[RecordedRequest], FakeScript]:
    """A `FakeAnthropicServer.respond_with` function answering with `model`: the same scripts drive
    worker processes that call the fake Messages API over HTTP (see `tests/test_parity.py`). A request
    the scripts cannot answer gets a 400 naming the problem (kept in `model.problems` too)."""

    def respond(recorded: RecordedRequest) -> FakeScript:
        try:
            return reply_from_response(model.respond(request_from_wire(recorded.body)))
        except UnscriptedRequest as exc:
            return Failure(status=400, body=error_body(400, str(exc)))

    return respond


__all__ = [
    "ROLES",
    "Reply",
    "Role",
    "Script",
    "ScriptedCall",
    "ScriptedModel",
    "UnscriptedRequest",
    "accept",
    "accepted_results",
    "attempt_of",
    "final",
    "http_responder",
    "plan",
    "replan",
    "retry",
    "role_of",
    "task",
    "task_of",
    "text",
    "tool_call",
    "tool_calls",
    "tool_results",
    "verdict",
]
