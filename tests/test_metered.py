"""Metered model calls: the real SDK against the fake Messages API, with the ledger in between.

The fake server bills every token it serves; what it billed, not the ledger's own view, is the proof
that a budget held.
"""

from __future__ import annotations

import ast
import asyncio
import socket
import typing
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from arq.connections import ArqRedis

from bus.keys import Keys
from bus.ledger import BudgetExhausted, Ledger
from bus.metered import MeteredModel, ModelFactory, live_sink, nothing_billed
from bus.runtime import ModelSource
from llm.anthropic import AnthropicModel
from llm.errors import (
    ModelConnectionError,
    ModelTimeoutError,
    RetryableModelError,
    TerminalModelError,
)
from llm.port import ModelPort
from llm.testing import FakeAnthropicServer, RecordedRequest, Reply, malformed, server_error, text_reply
from llm.types import Message, ModelRequest, ModelResponse, TextBlock, Usage

ROOT = Path(__file__).resolve().parents[1]
TEST_KEY = "sk-ant-test"


def _request(max_tokens: int = 1024) -> ModelRequest:
    return ModelRequest(system="You are terse.", messages=[Message.user("Refund order A100?")], max_tokens=max_tokens)


def _worst_case(request: RecordedRequest) -> Reply:
    """What a provider may do at worst: use every output token it was allowed."""
    return text_reply("ok", output_tokens=int(request.body["max_tokens"]))


@pytest.fixture
def server() -> typing.Iterator[FakeAnthropicServer]:
    with FakeAnthropicServer() as fake:
        yield fake


@pytest.fixture
def ledger(redis: ArqRedis, keys: Keys) -> Ledger:
    return Ledger(redis, keys)


@pytest.fixture
async def claude(server: FakeAnthropicServer) -> AsyncIterator[AnthropicModel]:
    model = AnthropicModel("claude-test", api_key=TEST_KEY, base_url=server.base_url, max_retries=0)
    yield model
    await model.aclose()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# -- through the real SDK -------------------------------------------------------------------------


async def test_tight_budget_stops_calls_and_the_bill_stays_within_it(
    server: FakeAnthropicServer, claude: AnthropicModel, ledger: Ledger
) -> None:
    """Calls that spend every output token they may: the fake server's total bill never exceeds the
    budget, the last call went out with max_tokens clamped, and the ledger agrees with the bill."""
    server.respond_with(_worst_case)
    budget = 4000
    await ledger.open("g", budget)
    model = ModelFactory(claude, ledger).for_goal("g")
    calls = 0
    with pytest.raises(BudgetExhausted):
        for _ in range(20):
            await model.complete(_request(max_tokens=1024))
            calls += 1
    billed = server.billed
    snap = await ledger.snapshot("g")
    assert calls >= 3 and len(server.message_requests) == calls  # the refused call sent nothing
    assert billed.total <= budget
    assert snap.spent == billed.total and snap.reserved == 0 and snap.calls == calls
    assert server.message_requests[-1].body["max_tokens"] < 1024


async def test_connection_refused_releases_the_reservation(ledger: Ledger) -> None:
    """Nothing listening: ModelConnectionError, and the reservation is freed, nothing spent."""
    await ledger.open("g", 10_000)
    nowhere = f"http://127.0.0.1:{_closed_port()}"
    inner = AnthropicModel("claude-test", api_key=TEST_KEY, base_url=nowhere, max_retries=0)
    with pytest.raises(ModelConnectionError):
        await MeteredModel(inner, ledger, "g").complete(_request())
    await inner.aclose()
    snap = await ledger.snapshot("g")
    assert (snap.reserved, snap.spent, snap.releases, snap.calls) == (0, 0, 1, 0)


async def test_timeout_counts_the_full_reservation_as_spent(server: FakeAnthropicServer, ledger: Ledger) -> None:
    """No answer before the timeout: the provider may have billed it, so the whole reservation is spent."""
    server.enqueue(Reply(content=[{"type": "text", "text": "late"}], delay=2))
    await ledger.open("g", 10_000)
    inner = AnthropicModel("claude-test", api_key=TEST_KEY, base_url=server.base_url, max_retries=0, timeout=0.3)
    with pytest.raises(ModelTimeoutError):
        await MeteredModel(inner, ledger, "g").complete(_request(max_tokens=500))
    await inner.aclose()
    snap = await ledger.snapshot("g")
    assert snap.forfeits == 1 and snap.reserved == 0
    assert snap.spent == snap.spent_unknown >= 500 and server.billed.total <= snap.spent


async def test_error_status_releases_but_a_broken_success_is_spent(
    server: FakeAnthropicServer, claude: AnthropicModel, ledger: Ledger
) -> None:
    """A 400 or 500 the provider answered bills nothing (released); a 200 with a broken body was
    billed (forfeited: the usage is unknown)."""
    await ledger.open("g", 10_000)
    model = MeteredModel(claude, ledger, "g")
    server.enqueue(server_error(400), server_error(500, should_retry=True), malformed())
    with pytest.raises(TerminalModelError):
        await model.complete(_request())
    with pytest.raises(RetryableModelError):
        await model.complete(_request())
    with pytest.raises((RetryableModelError, TerminalModelError)):
        await model.complete(_request())
    snap = await ledger.snapshot("g")
    assert (snap.releases, snap.forfeits, snap.reserved, snap.calls) == (2, 1, 0, 1)
    assert server.billed.total == 0 < snap.spent  # the fake bills replies only; the ledger errs safe


# -- without a network --------------------------------------------------------------------------


class StubModel:
    """A ModelPort double: answers with `usage` after `delay`, or raises `error`."""

    name = "stub"

    def __init__(
        self, *, usage: Usage | None = None, error: BaseException | None = None, delay: float = 0, model: str = "stub"
    ) -> None:
        self.model = model
        self.usage = usage or Usage(input_tokens=10, output_tokens=20)
        self.error = error
        self.delay = delay
        self.requests: list[ModelRequest] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return ModelResponse(content=[TextBlock(text="ok")], stop_reason="end_turn", usage=self.usage, model=self.model)


async def test_settle_uses_the_model_named_in_the_response(ledger: Ledger) -> None:
    """The cost is priced for `ModelResponse.model`, and the request keeps its max_tokens when it fits."""
    await ledger.open("g", 10_000)
    stub = StubModel(usage=Usage(input_tokens=100, output_tokens=100), model="claude-sonnet-4-5-20250929")
    await MeteredModel(stub, ledger, "g").complete(_request(max_tokens=300))
    snap = await ledger.snapshot("g")
    assert (snap.spent, snap.cost_micro_usd) == (200, 100 * 3 + 100 * 15)
    assert stub.requests[0].max_tokens == 300


async def test_cancellation_counts_the_reservation_as_spent(ledger: Ledger) -> None:
    """A cancelled call (the job timed out, the worker shuts down) is an unknown outcome: forfeited."""
    await ledger.open("g", 10_000)
    task = asyncio.create_task(MeteredModel(StubModel(delay=10), ledger, "g").complete(_request(max_tokens=400)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    snap = await ledger.snapshot("g")
    assert (snap.forfeits, snap.reserved) == (1, 0) and snap.spent >= 400


async def test_unexpected_error_counts_the_reservation_as_spent(ledger: Ledger) -> None:
    """A bug in the adapter is not proof that nothing was billed: forfeited, and the error propagates."""
    await ledger.open("g", 10_000)
    with pytest.raises(RuntimeError, match="boom"):
        await MeteredModel(StubModel(error=RuntimeError("boom")), ledger, "g").complete(_request())
    assert (await ledger.snapshot("g")).forfeits == 1


@pytest.mark.parametrize(
    ("error", "released"),
    [
        (ModelConnectionError("refused"), True),
        (TerminalModelError("bad request", status=400), True),
        (RetryableModelError("overloaded", status=529), True),
        (RetryableModelError("overloaded after a timed-out attempt", status=529, maybe_spent=True), False),
        (ModelTimeoutError("no answer"), False),
        (asyncio.CancelledError(), False),
        (RuntimeError("bug"), False),
    ],
)
def test_nothing_billed_table(error: BaseException, released: bool) -> None:
    """Only errors that prove no attempt was billed release the reservation."""
    assert nothing_billed(error) is released


# -- the only way to a model ----------------------------------------------------------------------

FORBIDDEN_MODULES = ("anthropic", "openai", "llm.anthropic", "llm.openai", "llm.providers", "llm.demo", "llm.testing")
FORBIDDEN_NAMES = {"AnthropicModel", "OpenAIModel", "DemoModel", "make_model", "build_model"}


def _forbidden(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in FORBIDDEN_MODULES)


def _violations(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if _forbidden(a.name) or a.name.split(".")[-1] in FORBIDDEN_NAMES]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if _forbidden(module):
                found.append(module)
            found += [f"{module}.{a.name}" for a in node.names if a.name in FORBIDDEN_NAMES or _forbidden(a.name)]
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_NAMES:
            found.append(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _forbidden(node.value):
            found.append(node.value)  # importlib.import_module("llm.demo") and the like
    return [f"{path.relative_to(root)}: {v}" for v in found]


def test_roles_cannot_build_a_model_of_their_own() -> None:
    """No module of the planner, executor or critic imports a provider, a concrete model or the fake:
    their only way to a model is the runtime's ModelFactory, which meters every call."""
    modules = [p for role in ("planner", "executor", "critic") for p in sorted((ROOT / role).rglob("*.py"))]
    assert len(modules) >= 3
    assert [v for p in modules for v in _violations(p)] == []


def test_the_scan_catches_each_forbidden_import(tmp_path: Path) -> None:
    """The scan above is not vacuous: every form of reaching a model directly is reported."""
    sources = [
        "import anthropic",
        "import llm.anthropic",
        "from llm.demo import DemoModel",
        "from llm import make_model",
        "from llm import AnthropicModel",
        "from llm.testing import FakeAnthropicServer",
        "import llm\nllm.make_model('demo')",
        "import importlib\nimportlib.import_module('llm.demo')",
    ]
    for i, source in enumerate(sources):
        path = tmp_path / f"probe_{i}.py"
        path.write_text(source)
        assert _violations(path, tmp_path), source


def test_the_factory_hands_out_only_metered_models(ledger: Ledger) -> None:
    """Every method of ModelFactory that returns a model returns a MeteredModel, bound to its goal."""
    factory = ModelFactory(StubModel(), ledger)
    model = factory.for_goal("g")
    assert type(model) is MeteredModel and model.goal_id == "g" and isinstance(model, ModelPort)
    source: ModelSource = factory  # what the runtime holds: the roles' only way to a model
    assert source.for_goal("g2").goal_id == "g2"  # type: ignore[attr-defined]
    for name, member in vars(ModelFactory).items():
        if callable(member) and not name.startswith("_"):
            returns = typing.get_type_hints(member).get("return")
            assert returns is MeteredModel, f"ModelFactory.{name} returns {returns}"
    with pytest.raises(TypeError):
        ModelFactory(model, ledger)


def test_a_live_sink_is_told_from_a_plain_text_sink_by_its_methods() -> None:
    """A sink with `restart` and `flush` (`bus.live.LiveCall`) is restarted on failover and flushed at
    the call's end; a plain callable or no sink is neither."""

    class Live:
        def __call__(self, text: str) -> None: ...

        def restart(self) -> None: ...

        async def flush(self) -> None: ...

    live = Live()
    assert live_sink(live) is live
    assert live_sink(lambda text: None) is None
    assert live_sink(None) is None
