"""Tracing with the OpenTelemetry SDK's in-memory exporter: spans, attributes, propagation, no content.

End to end across worker processes (OTLP/HTTP to a collector stub): tests/test_tracing_e2e.py.
"""

from __future__ import annotations

import io
import json
import typing
from collections.abc import Iterator

import pytest
import structlog
from arq.connections import ArqRedis
from helpers import run_cli
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from toolkits_for_tests import kit

import bus.tracing as bt
from bus.client import Client
from bus.jobs import Jobs, PlanJob, parse_payload
from bus.keys import Keys
from bus.ledger import BudgetExhausted, Ledger
from bus.metered import MeteredModel
from bus.schemas import GoalState
from executor.gateway import ToolGateway
from executor.registry import ToolRegistry
from executor.sources.base import ToolContext
from llm.anthropic import AnthropicModel
from llm.errors import RetryableModelError
from llm.port import ModelPort
from llm.testing import FakeAnthropicServer, server_error, text_reply
from llm.types import Message, ModelRequest, ModelResponse, ToolUseBlock
from taskloom.logs import configure_logging
from taskloom.testing import DemoModel, run_goal

SECRET_PROMPT = "Refund order A100 for Jane Q. Customer, card 4111?"


_providers: dict[int, TracerProvider] = {}


def spans_provider(exporter: InMemorySpanExporter) -> TracerProvider:
    """The provider that feeds the `spans` fixture's exporter."""
    return _providers[id(exporter)]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """This process's spans go to an in-memory exporter; tracing flags back to off afterwards."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _providers[id(exporter)] = provider
    bt.use_provider(provider)
    saved = bt.TraceSettings(**vars(bt.settings))
    bt.settings.enabled = True
    try:
        yield exporter
    finally:
        bt.use_provider(None)
        vars(bt.settings).update(vars(saved))
        provider.shutdown()
        del _providers[id(exporter)]


@pytest.fixture
def server() -> typing.Iterator[FakeAnthropicServer]:
    with FakeAnthropicServer() as fake:
        yield fake


def _request() -> ModelRequest:
    return ModelRequest(system="You are terse.", messages=[Message.user(SECRET_PROMPT)], max_tokens=300)


def _named(spans: InMemorySpanExporter, prefix: str) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name.startswith(prefix)]


def _all_text(span: ReadableSpan) -> str:
    parts = [json.dumps(dict(span.attributes or {}), default=str)]
    parts += [json.dumps(dict(e.attributes or {}), default=str) for e in span.events]
    return " ".join(parts)


async def _metered(server: FakeAnthropicServer, redis: ArqRedis, keys: Keys, budget: int = 10_000) -> MeteredModel:
    ledger = Ledger(redis, keys)
    await ledger.open("g1", budget)
    inner = AnthropicModel("claude-test", api_key="sk-ant-test", base_url=server.base_url, max_retries=0)
    return MeteredModel(inner, ledger, "g1")


async def test_model_span_has_genai_attributes_and_ledger_events(
    spans: InMemorySpanExporter, server: FakeAnthropicServer, redis: ArqRedis, keys: Keys
) -> None:
    """A model call is one CLIENT span with the GenAI attributes, and reserve/settle events with headroom."""
    server.enqueue(text_reply("fine", output_tokens=7))
    model = await _metered(server, redis, keys)
    response = await model.complete(_request())
    (span,) = _named(spans, "chat ")
    attrs = dict(span.attributes or {})
    assert span.name == "chat claude-test"
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "anthropic"
    assert attrs["gen_ai.request.model"] == "claude-test"
    assert attrs["gen_ai.request.max_tokens"] == 300
    assert attrs["gen_ai.usage.output_tokens"] == 7
    usage = response.usage
    assert attrs["gen_ai.usage.input_tokens"] == usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens
    assert attrs["gen_ai.usage.cache_creation.input_tokens"] == usage.cache_write_tokens > 0
    assert "gen_ai.usage.cache_read.input_tokens" in attrs
    assert "gen_ai.usage.cache_creation.input_tokens" in attrs
    assert list(attrs["gen_ai.response.finish_reasons"]) == ["stop"]  # the conventions' neutral names  # type: ignore[arg-type]
    assert attrs["taskloom.request_id"] == server.requests[0].request_id
    events = {e.name: dict(e.attributes or {}) for e in span.events}
    books = await model.ledger.snapshot("g1")
    assert events["ledger.reserve"]["reserved"] > 0
    assert events["ledger.settle"]["settled"] == response.usage.total == books.spent
    assert events["ledger.settle"]["headroom"] == books.headroom
    assert SECRET_PROMPT not in _all_text(span) and "fine" not in _all_text(span)


async def test_prompts_and_completions_are_recorded_only_when_asked(
    spans: InMemorySpanExporter, server: FakeAnthropicServer, redis: ArqRedis, keys: Keys
) -> None:
    """TASKLOOM_TRACE_CONTENT puts the prompt and the completion on the model span; off, neither appears."""
    server.enqueue(text_reply("the completion text"))
    model = await _metered(server, redis, keys)
    bt.settings.content = True
    await model.complete(_request())
    (span,) = _named(spans, "chat ")
    attrs = dict(span.attributes or {})
    assert SECRET_PROMPT in str(attrs["gen_ai.input.messages"])
    assert "the completion text" in str(attrs["gen_ai.output.messages"])
    assert attrs["gen_ai.system_instructions"] == "You are terse."


async def test_a_failed_model_call_sets_the_error_status(
    spans: InMemorySpanExporter, server: FakeAnthropicServer, redis: ArqRedis, keys: Keys
) -> None:
    """A provider error ends the model span with status ERROR and the reservation's release as an event."""
    server.enqueue(server_error(529))
    model = await _metered(server, redis, keys)
    with pytest.raises(RetryableModelError):
        await model.complete(_request())
    (span,) = _named(spans, "chat ")
    assert span.status.status_code is StatusCode.ERROR
    assert "RetryableModelError" in (span.status.description or "")
    assert [e.name for e in span.events] == ["ledger.reserve", "ledger.release", "exception"]


async def test_a_budget_refusal_is_an_error_span(
    spans: InMemorySpanExporter, server: FakeAnthropicServer, redis: ArqRedis, keys: Keys
) -> None:
    """A call the ledger refuses is a failed model span with a `ledger.refused` event, and no request is sent."""
    model = await _metered(server, redis, keys, budget=50)
    with pytest.raises(BudgetExhausted):
        await model.complete(_request())
    (span,) = _named(spans, "chat ")
    assert span.status.status_code is StatusCode.ERROR
    assert [e.name for e in span.events] == ["ledger.refused", "exception"]
    assert server.requests == []


async def test_job_payloads_carry_the_enqueuers_traceparent(
    spans: InMemorySpanExporter, redis: ArqRedis, keys: Keys
) -> None:
    """A job enqueued inside a span carries its traceparent; one enqueued outside has no such key."""
    jobs = Jobs(redis, keys)
    with bt.span("caller") as caller:
        await jobs.enqueue(PlanJob(goal_id="traced"))
    await jobs.enqueue(PlanJob(goal_id="untraced"))
    (_, traced, _) = (await jobs.drivers("traced"))["goal"]
    assert traced is not None and traced.traceparent is not None
    sc = caller.get_span_context()
    assert traced.traceparent.startswith(f"00-{sc.trace_id:032x}-{sc.span_id:016x}-")
    raw = json.loads(await redis.hget(keys.drivers("untraced"), "goal"))  # type: ignore[misc]
    assert "traceparent" not in raw["payload"]
    assert parse_payload("plan", raw["payload"]).traceparent is None


async def test_submit_joins_the_callers_trace_or_starts_one(
    spans: InMemorySpanExporter, redis: ArqRedis, keys: Keys
) -> None:
    """submit's root span `goal` is a child of the caller's span; its traceparent is kept in the goal record."""
    client = Client(redis, keys, 10_000)
    with bt.span("request") as request:
        gid = await client.submit("Say hi.")
    record = await client.get(gid)
    (goal,) = _named(spans, "goal")
    assert goal.parent is not None and goal.parent.span_id == request.get_span_context().span_id
    assert bt.trace_id_of(record.traceparent) == f"{request.get_span_context().trace_id:032x}"
    assert (record.traceparent or "").startswith(f"00-{goal.context.trace_id:032x}-{goal.context.span_id:016x}-")
    other = await client.get(await client.submit("Say bye."))
    assert bt.trace_id_of(other.traceparent) not in (None, bt.trace_id_of(record.traceparent))


async def test_a_goal_submitted_without_tracing_still_has_a_trace(redis: ArqRedis, keys: Keys) -> None:
    """With tracing off at submit, the goal record still gets a fresh traceparent for the workers to continue."""
    client = Client(redis, keys, 10_000)
    first = await client.get(await client.submit("one"))
    second = await client.get(await client.submit("two"))
    assert bt.context_of(first.traceparent) is not None
    assert bt.trace_id_of(first.traceparent) != bt.trace_id_of(second.traceparent)


def _ctx(call_id: str) -> ToolContext:
    return ToolContext(goal_id="g", task_id="t", attempt=1, step=0, call_id=call_id)


async def test_tool_calls_are_spans_and_arguments_only_when_asked(spans: InMemorySpanExporter) -> None:
    """Every tool call, run or refused, is an `execute_tool` span (name, call id, outcome); arguments only if asked."""
    gateway = ToolGateway(ToolRegistry([kit]), ["slow_a"])
    ok = ToolUseBlock(id="call_1", name="slow_a", input={"x": 41})
    bad = ToolUseBlock(id="call_2", name="nope", input={})
    await gateway.run(ok, _ctx("call_1"))
    await gateway.run(bad, _ctx("call_2"))
    bt.settings.tool_arguments = True
    await gateway.run(ToolUseBlock(id="call_3", name="slow_a", input={"x": 97}), _ctx("call_3"))
    first, second, third = _named(spans, "execute_tool")
    assert dict(first.attributes or {}) == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "slow_a",
        "gen_ai.tool.call.id": "call_1",
        "taskloom.tool.outcome": "ok",
    }
    assert first.status.status_code is StatusCode.UNSET
    assert (second.attributes or {})["taskloom.tool.outcome"] == "unknown_tool"
    assert second.status.status_code is StatusCode.ERROR
    assert json.loads(str((third.attributes or {})["gen_ai.tool.call.arguments"])) == {"x": 97}


def test_log_lines_carry_the_trace_and_span_ids(spans: InMemorySpanExporter) -> None:
    """A line logged inside a span names its trace_id and span_id; one outside names neither."""
    stream = io.StringIO()
    configure_logging("INFO", json=True, stream=stream)
    log = structlog.stdlib.get_logger("test")
    with bt.span("work") as work:
        log.info("inside")
    log.info("outside")
    inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert inside["trace_id"] == f"{work.get_span_context().trace_id:032x}"
    assert inside["span_id"] == f"{work.get_span_context().span_id:016x}"
    assert "trace_id" not in outside and "span_id" not in outside


class Counting:
    """A ModelPort that counts the calls it passes on (the protocol boundary, not our own class)."""

    def __init__(self, inner: ModelPort) -> None:
        self.inner = inner
        self.name = inner.name
        self.model = inner.model
        self.calls = 0

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.calls += 1
        return await self.inner.complete(request)


async def test_a_goal_run_is_one_trace_with_a_parent_chain(spans: InMemorySpanExporter) -> None:
    """In-process run of the demo goal: one trace, every span's parent in it, a span per model and tool call."""
    model = Counting(DemoModel(latency=0))
    with bt.span("caller"):
        result = await run_goal(
            {"text": "Can orders A100 and A101 be refunded? Today is 2026-10-13.", "definition_of_done": "each order"},
            model=model,  # type: ignore[arg-type]
        )
    finished = spans.get_finished_spans()
    assert {s.context.trace_id for s in finished} == {finished[0].context.trace_id}
    ids = {s.context.span_id for s in finished}
    roots = [s for s in finished if s.parent is None]
    assert [s.name for s in roots] == ["caller"]
    assert all(s.parent.span_id in ids for s in finished if s.parent is not None)  # type: ignore[union-attr]
    by_id = {s.context.span_id: s for s in finished}
    chats = _named(spans, "chat ")
    assert len(chats) == model.calls > 0
    for chat in chats:
        assert by_id[chat.parent.span_id].name in ("plan", "replan", "task attempt", "review", "review goal")  # type: ignore[union-attr]
        assert {"gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"} <= set(chat.attributes or {})
    tools = _named(spans, "execute_tool")
    assert sorted(str((s.attributes or {})["gen_ai.tool.call.id"]) for s in tools) == sorted(
        c.id for c in result.tool_calls
    )
    assert all(by_id[s.parent.span_id].name == "task attempt" for s in tools)  # type: ignore[union-attr]
    reviews = _named(spans, "review")
    assert reviews and all((s.attributes or {}).get("taskloom.review.action") for s in reviews)
    jobs = [s for s in finished if s.name != "queue wait" and (s.attributes or {}).get("taskloom.job")]
    assert len(_named(spans, "queue wait")) == len(jobs) > 0
    traced = [e for e in result.events if e.trace_id is not None]
    assert traced and {e.trace_id for e in traced} == {f"{finished[0].context.trace_id:032x}"}


async def test_resume_continues_the_goals_trace(spans: InMemorySpanExporter, redis: ArqRedis, keys: Keys) -> None:
    """`resume` of a failed goal is a `goal.resume` span in the goal's trace, and its plan job carries it on."""
    client = Client(redis, keys, 10_000)
    gid = await client.submit("Say hi.")
    record = await client.get(gid)
    await client.store.transition_goal(gid, GoalState.FAILED, reason="provider down")
    await client.resume(gid)
    (resume,) = _named(spans, "goal.resume")
    assert f"{resume.context.trace_id:032x}" == bt.trace_id_of(record.traceparent)
    (_, plan, _) = (await Jobs(redis, keys).drivers(gid))["goal"]
    assert plan is not None and plan.redrive and (plan.traceparent or "").startswith(
        f"00-{resume.context.trace_id:032x}-{resume.context.span_id:016x}-"
    )


async def test_status_prints_the_trace_id(redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str]) -> None:
    """`taskloom status` shows the goal's trace id, the key to its trace in any viewer."""
    client = Client(redis, keys, 10_000)
    gid = await client.submit("Say hi.")
    trace_id = bt.trace_id_of((await client.get(gid)).traceparent)
    shown = run_cli("status", gid, env=subprocess_env)
    assert shown.returncode == 0, shown.stderr
    assert f"trace: {trace_id}" in shown.stdout


async def test_the_http_api_submit_joins_the_callers_trace(
    spans: InMemorySpanExporter, redis: ArqRedis, keys: Keys
) -> None:
    """POST /v1/goals with a W3C traceparent header: the goal's root span continues the caller's trace."""
    import httpx2
    from test_api import serving

    from taskloom.api.app import ApiConfig
    from taskloom.api.auth import TokenBook, entry_for, parse_tokens

    book = TokenBook(parse_tokens(entry_for("caller", ("submit",), "secret-caller"), "test"))
    caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    async with serving(Client(redis, keys, 10_000), ApiConfig(tokens=book, max_body=8192)) as url:
        async with httpx2.AsyncClient(base_url=url, timeout=20, trust_env=False) as http:
            r = await http.post(
                "/v1/goals",
                json={"text": "refund order 42"},
                headers={"Authorization": "Bearer secret-caller", "traceparent": f"00-{caller_trace}-{caller_span}-01"},
            )
    assert r.status_code == 201, r.text
    record = await Client(redis, keys, 10_000).get(r.json()["goal_id"])
    (server,) = _named(spans, "POST /v1/goals")
    (goal,) = _named(spans, "goal")
    assert f"{server.context.trace_id:032x}" == caller_trace == bt.trace_id_of(record.traceparent)
    assert server.parent is not None and f"{server.parent.span_id:016x}" == caller_span
    assert goal.parent is not None and goal.parent.span_id == server.context.span_id


async def test_a_goal_submitted_without_tracing_is_still_one_trace_in_the_workers(
    spans: InMemorySpanExporter,
) -> None:
    """Submitted by a process that does not trace: the plan job has no traceparent, so its span continues
    the goal record's (a root nobody exported), and every later span is in that same trace."""
    from taskloom.testing import InProcessFleet

    async with InProcessFleet(model=DemoModel(latency=0)) as fleet:
        bt.use_provider(None)  # the submitter does not trace (the global provider is the API's no-op)
        gid = await fleet.submit("Can order A100 be refunded? Today is 2026-10-13.")
        bt.use_provider(spans_provider(spans))
        result = await fleet.settle(gid)
    assert result.state is GoalState.SUCCEEDED
    root = result.goal.traceparent or ""
    finished = spans.get_finished_spans()
    assert not _named(spans, "goal")
    assert {f"{s.context.trace_id:032x}" for s in finished} == {bt.trace_id_of(root)}
    (plan,) = _named(spans, "plan")
    assert plan.parent is not None and root.split("-")[2] == f"{plan.parent.span_id:016x}"
