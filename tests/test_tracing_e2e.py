"""Tracing end to end: planner, executor and critic as separate `taskloom worker` processes (and the
`taskloom submit` CLI) export OTLP/HTTP to a collector stub on loopback, which decodes the protobuf
`ExportTraceServiceRequest`s. The goal must come back as one trace."""

from __future__ import annotations

import gzip
import json
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from arq.connections import ArqRedis
from helpers import eventually, run_cli
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from test_e2e import Scenario, fleet, requests_of, spec, worker_env

from bus.client import Client
from bus.keys import Keys
from bus.schemas import GoalState
from llm.testing import FakeAnthropicServer

pytestmark = pytest.mark.e2e

GOAL_TEXT = "Look up the private file of Jane Q. Customer"  # must never reach a span


@dataclass
class Span:
    service: str
    trace_id: str
    span_id: str
    parent: str
    name: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status: int  # 0 unset, 1 ok, 2 error


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Collector:
    """An OTLP/HTTP traces endpoint on loopback that keeps every span it receives."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                assert self.path == "/v1/traces", self.path
                collector.add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, request: ExportTraceServiceRequest) -> None:
        with self._lock:
            self.requests += 1
            for rs in request.resource_spans:
                res = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            Span(
                                service=str(res.get("service.name")),
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent=s.parent_span_id.hex(),
                                name=s.name,
                                attributes={a.key: _value(a.value) for a in s.attributes},
                                events=[(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events],
                                status=s.status.code,
                            )
                        )

    def named(self, prefix: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.name.startswith(prefix)]


@contextmanager
def collector() -> Iterator[Collector]:
    c = Collector()
    thread = threading.Thread(target=c.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield c
    finally:
        c.server.shutdown()
        c.server.server_close()


GENAI = (
    "gen_ai.operation.name",
    "gen_ai.provider.name",
    "gen_ai.request.model",
    "gen_ai.request.max_tokens",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "gen_ai.usage.cache_read.input_tokens",
    "gen_ai.usage.cache_creation.input_tokens",
    "gen_ai.response.finish_reasons",
    "taskloom.request_id",
)


async def test_a_goal_across_three_worker_processes_is_one_trace(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """One trace id from submit through planner, executor and critic processes; every model and tool call a span."""
    scenario = Scenario(
        plans={0: [{"tasks": [spec("a", tools=("count",)), spec("b", deps=("a",), tools=("count",))]}]},
        calls={t: [("count", {"name": t})] for t in "ab"},
        verdicts={("a", 1): {"passed": False, "action": "retry", "feedback": "count again"}},
    )
    base = {k: v for k, v in subprocess_env.items() if not k.startswith("OTEL_")}
    with FakeAnthropicServer() as fake, collector() as otlp:
        fake.respond_with(scenario)
        env = worker_env(
            base,
            fake,
            tmp_path,
            TASKLOOM_TRACING="otlp",
            OTEL_EXPORTER_OTLP_ENDPOINT=otlp.endpoint,
            # Long enough that nothing is exported on schedule during the run: what arrives was
            # flushed by the CLI on exit and by the workers on shutdown (SIGTERM).
            OTEL_BSP_SCHEDULE_DELAY="600000",
        )
        client = Client(redis, keys, default_budget_tokens=200_000)
        async with fleet(env, tmp_path, "planner", "executor", "critic") as workers:
            submitted = run_cli("submit", GOAL_TEXT, "--dod", "the file is read", env=env)
            assert submitted.returncode == 0, submitted.stderr
            gid = submitted.stdout.strip()
            goal = await client.wait(gid, timeout=60)
            for w in workers:
                w.proc.send_signal(signal.SIGTERM)
            for w in workers:
                assert w.proc.wait(30) == 0, w.log.read_text()[-2000:]
        model_calls = len(fake.message_requests)
        tool_calls = [e async for e in client.events(gid, follow=False) if e.type == "tool.call"]

        async def all_exported() -> bool:
            return len(otlp.named("chat ")) >= model_calls

        await eventually(all_exported, timeout=20)
    assert goal.state is GoalState.SUCCEEDED, goal
    assert not scenario.unrouted
    spans = otlp.spans
    _print_tree(spans)
    by_id = {s.span_id: s for s in spans}

    # One trace, from four processes: the CLI and the three workers.
    assert {s.trace_id for s in spans} == {goal.traceparent.split("-")[1]}  # type: ignore[union-attr]
    assert {s.service for s in spans} == {"taskloom", "taskloom-planner", "taskloom-executor", "taskloom-critic"}
    # A tree: one root (the CLI's `goal` span), every other span's parent received.
    roots = [s for s in spans if not s.parent]
    assert [(r.name, r.service, r.attributes["taskloom.goal_id"]) for r in roots] == [("goal", "taskloom", gid)]
    assert all(s.parent in by_id for s in spans if s.parent), [s.name for s in spans if s.parent not in by_id]

    def parent(s: Span) -> Span:
        return by_id[s.parent]

    (plan,) = [s for s in spans if s.name == "plan"]
    assert parent(plan) is roots[0]
    attempts = {(s.attributes["taskloom.task_id"], s.attributes["taskloom.attempt"]): s for s in otlp.named("task ")}
    assert set(attempts) == {("a", 1), ("a", 2), ("b", 1)}
    assert parent(attempts[("a", 1)]) is plan  # dispatched by the plan job
    # The critic's retry: attempt 2 continues from the review that asked for it.
    retried_by = parent(attempts[("a", 2)])
    assert (retried_by.name, retried_by.attributes["taskloom.review.action"]) == ("review", "retry")
    assert parent(retried_by) is attempts[("a", 1)]
    assert parent(attempts[("b", 1)]).name == "advance"

    # Every model call is a span with the GenAI attributes, inside the job that made it.
    chats = otlp.named("chat ")
    assert len(chats) == model_calls == len(fake.message_requests)
    assert sorted(c.attributes["taskloom.request_id"] for c in chats) == sorted(
        r.request_id for r in fake.message_requests
    )
    for chat in chats:
        missing = [k for k in GENAI if k not in chat.attributes]
        assert not missing, (chat.name, missing)
        assert chat.attributes["gen_ai.provider.name"] == "anthropic"
        assert parent(chat).service == chat.service
        assert [e for e, _ in chat.events][:1] == ["ledger.reserve"] and chat.events[1][0] == "ledger.settle"
    assert {parent(c).name for c in chats} == {"plan", "task attempt", "review", "review goal"}
    assert len(requests_of(fake, "executor")) == len([c for c in chats if parent(c).name == "task attempt"])

    # Every tool call is a span under its task attempt.
    tools = otlp.named("execute_tool")
    assert sorted(t.attributes["gen_ai.tool.call.id"] for t in tools) == sorted(e.data["call_id"] for e in tool_calls)
    assert len(tools) == 3
    assert all(parent(t).name == "task attempt" and t.attributes["taskloom.tool.outcome"] == "ok" for t in tools)
    assert all("gen_ai.tool.call.arguments" not in t.attributes for t in tools)

    # Each job waited in a queue; no prompt or completion text anywhere with content capture off.
    jobs = [s for s in spans if "taskloom.job_id" in s.attributes]
    assert len(otlp.named("queue wait")) == len(jobs) >= 8
    dumped = json.dumps([(s.attributes, s.events) for s in spans], default=str)
    assert GOAL_TEXT not in dumped and "Do a." not in dumped and "result of a" not in dumped
    assert "gen_ai.input.messages" not in dumped


def _print_tree(spans: list[Span]) -> None:
    """Shown by pytest when the test fails: the received spans as an indented tree."""
    children: dict[str, list[Span]] = {}
    for s in spans:
        children.setdefault(s.parent, []).append(s)

    def show(s: Span, depth: int) -> None:
        print("  " * depth + f"{s.name} [{s.service}] {s.attributes.get('taskloom.task_id', '')}")
        for c in children.get(s.span_id, []):
            show(c, depth + 1)

    for root in children.get("", []):
        show(root, 0)
