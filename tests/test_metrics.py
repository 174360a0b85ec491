"""Prometheus metrics: a real worker process scraped over HTTP, and the hooks behind the metrics."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from arq.connections import ArqRedis
from helpers import TASKLOOM, eventually
from prometheus_client.parser import text_string_to_metric_families

from bus.client import Client
from bus.keys import Keys
from bus.ledger import BudgetExhausted, Ledger
from bus.metered import MeteredModel, error_kind
from bus.observe import Observer, install
from bus.schemas import GoalState
from executor.gateway import ToolGateway
from executor.registry import ToolRegistry
from executor.toolkit import ToolContext, Toolkit
from llm.anthropic import AnthropicModel
from llm.errors import ModelConnectionError, ModelTimeoutError, RetryableModelError, TerminalModelError
from llm.testing import FakeAnthropicServer, server_error, text_reply
from llm.types import Message, ModelRequest, ToolUseBlock, Usage

FAMILIES = {
    "taskloom_queue_depth",
    "taskloom_jobs_in_progress",
    "taskloom_job_duration_seconds",
    "taskloom_task_run_duration_seconds",
    "taskloom_step_duration_seconds",
    "taskloom_model_call_duration_seconds",
    "taskloom_model_call_errors",
    "taskloom_tokens",
    "taskloom_cost_usd",
    "taskloom_budget_refusals",
    "taskloom_tool_calls",
    "taskloom_tool_call_duration_seconds",
    "process_resident_memory_bytes",
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        body: bytes = response.read()
    return body.decode()


def _samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield s.name, s.labels, s.value


def _total(text: str, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in _samples(text) if n == name and all(lab.get(k) == x for k, x in labels.items()))


async def test_a_worker_serves_metrics_that_match_what_it_did_and_what_is_queued(
    redis: ArqRedis, keys: Keys, prefix: str, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """`taskloom worker all` with TASKLOOM_METRICS_PORT runs a demo goal; a real HTTP GET of /metrics
    shows every metric family, counts of the jobs, steps, model and tool calls it made, and queue
    depths equal to the jobs the test left waiting. No label value carries the goal id."""
    port = _free_port()
    env = dict(
        subprocess_env,
        TASKLOOM_METRICS_PORT=str(port),
        TASKLOOM_METRICS_ADDR="127.0.0.1",
        TASKLOOM_METRICS_INTERVAL="0.1",
    )
    log = (tmp_path / "worker.log").open("w")
    proc = subprocess.Popen(  # noqa: ASYNC220 - starting the child is instant; it runs on its own
        [*TASKLOOM, "worker", "all"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        client = Client(redis, keys, default_budget_tokens=100_000)
        gid = await client.submit("Can order A100 be refunded? Today is 2026-10-13.")

        async def succeeded() -> bool:
            return (await client.get(gid)).state is GoalState.SUCCEEDED

        await eventually(succeeded, timeout=60)
        # Jobs deferred for an hour stay in their queues (arq's sorted sets) for the whole test.
        for role, function, n in (("planner", "plan", 3), ("executor", "execute", 2)):
            for i in range(n):
                job_id = f"{prefix}job:waiting:{role}:{i}"
                await redis.enqueue_job(function, {}, _job_id=job_id, _queue_name=keys.queue(role), _defer_by=3600)
        text = ""

        async def depths_seen() -> bool:
            nonlocal text
            text = await asyncio.to_thread(_scrape, port)
            return (
                _total(text, "taskloom_queue_depth", role="planner") == 3
                and _total(text, "taskloom_queue_depth", role="executor") == 2
            )

        await eventually(depths_seen, timeout=15, every=0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()

    assert FAMILIES <= {f.name for f in text_string_to_metric_families(text)}
    assert _total(text, "taskloom_queue_depth", role="critic") == 0
    assert _total(text, "taskloom_job_duration_seconds_count", function="plan", outcome="ok") >= 1
    assert _total(text, "taskloom_job_duration_seconds_count", function="execute", outcome="ok") >= 1
    assert _total(text, "taskloom_job_duration_seconds_count", function="review_goal", outcome="ok") >= 1
    assert _total(text, "taskloom_jobs_in_progress") == 0
    assert _total(text, "taskloom_task_run_duration_seconds_count", outcome="answered") >= 1
    assert _total(text, "taskloom_step_duration_seconds_count") >= 2
    assert _total(text, "taskloom_model_call_duration_seconds_count", model="demo", outcome="ok") >= 4
    assert _total(text, "taskloom_tokens_total", model="demo", kind="output") > 0
    assert _total(text, "taskloom_tool_calls_total", outcome="ok") >= 1
    assert gid not in text


class Recorder(Observer):
    """An observer that keeps what it was told."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def model_call(self, model: str, outcome: str, seconds: float, usage: Usage | None, cost_usd: float | None) -> None:
        self.calls.append(("model_call", model, outcome))

    def budget_refused(self, model: str) -> None:
        self.calls.append(("budget_refused", model))

    def tool_call(self, tool: str, outcome: str, seconds: float) -> None:
        self.calls.append(("tool_call", tool, outcome))


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    previous = install(rec)
    try:
        yield rec
    finally:
        install(previous)


async def test_model_calls_errors_and_budget_refusals_reach_the_observer(
    redis: ArqRedis, keys: Keys, recorder: Recorder
) -> None:
    """Through the real SDK and the fake server: an ok call, a 500 (kind `retryable`), and a call the
    budget refuses are each reported once, labelled with the configured model id."""
    ledger = Ledger(redis, keys)
    await ledger.open("g1", 3000)
    await ledger.open("g2", 10)  # too small for any call
    request = ModelRequest(system="terse", messages=[Message.user("hi")], max_tokens=256)
    with FakeAnthropicServer() as fake:
        model = AnthropicModel("claude-test", api_key="sk-ant-test", base_url=fake.base_url, max_retries=0)
        metered = MeteredModel(model, ledger, "g1")
        fake.enqueue(server_error(500), text_reply("ok"))
        with pytest.raises(RetryableModelError):
            await metered.complete(request)
        await metered.complete(request)
        with pytest.raises(BudgetExhausted):
            await MeteredModel(model, ledger, "g2").complete(request)
        await model.aclose()
    assert recorder.calls == [
        ("model_call", "claude-test", "retryable"),
        ("model_call", "claude-test", "ok"),
        ("budget_refused", "claude-test"),
    ]


def test_error_kinds_are_a_small_fixed_set() -> None:
    """Each failure maps to a bounded label; anything unexpected is `other`."""
    assert error_kind(ModelTimeoutError("t")) == "timeout"
    assert error_kind(ModelConnectionError("c")) == "connection"
    assert error_kind(RetryableModelError("r")) == "retryable"
    assert error_kind(TerminalModelError("x")) == "terminal"
    assert error_kind(asyncio.CancelledError()) == "cancelled"
    assert error_kind(KeyError("k")) == "other"


async def test_a_tool_name_the_model_invented_is_not_a_label(recorder: Recorder) -> None:
    """Known tools are counted by name; an unknown name (unbounded, model-written) as `(unknown)`."""
    kit = Toolkit("t")

    @kit.tool
    def ping() -> str:
        """Pong."""
        return "pong"

    gateway = ToolGateway(ToolRegistry([kit]), ["ping"])
    ctx = ToolContext(goal_id="g", task_id="t", attempt=1, step=0, call_id="c")
    await gateway.run(ToolUseBlock(id="c1", name="ping", input={}), ctx)
    await gateway.run(ToolUseBlock(id="c2", name="made_up_by_the_model_123", input={}), ctx)
    assert recorder.calls == [("tool_call", "ping", "ok"), ("tool_call", "(unknown)", "unknown_tool")]
