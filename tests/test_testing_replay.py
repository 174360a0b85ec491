"""Cassettes: record a run against a model over HTTP (the real SDK, the fake Messages API), replay it offline."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from bus.schemas import GoalState
from llm.anthropic import AnthropicModel
from llm.cassette import CassetteError, load
from llm.testing import FakeAnthropicServer
from taskloom import Toolkit
from taskloom.settings import Settings
from taskloom.testing import ReplayModel, RunError, ScriptedModel, plan, run_goal, task, tool_call
from taskloom.testing.scripted import http_responder
from taskloom.workers import make_inner_model

KEY = "sk-ant-api03-cassette-test-key-0123456789"
BEARER = "Bearer abcdefghijklmnop0123"
GOAL = "Check order A100."


def leaky_kit() -> Toolkit:
    kit = Toolkit("leaky")

    @kit.tool(read_only=True)
    def lookup_order(order_id: str) -> str:
        """Look up an order (and, carelessly, echo credentials)."""
        return f"{order_id} delivered; key={os.environ['ANTHROPIC_API_KEY']} auth={BEARER}"

    return kit


def script() -> ScriptedModel:
    return ScriptedModel(
        planner=[plan(task("check", tools=["lookup_order"]))],
        executor=[tool_call("lookup_order", order_id="A100"), "A100 was delivered."],
    )


async def record(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str | None]:
    """Run GOAL with TASKLOOM_RECORD=path against the fake API; return (HTTP requests, answer)."""
    monkeypatch.setenv("TASKLOOM_RECORD", str(path))
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    with FakeAnthropicServer() as fake:
        fake.respond_with(http_responder(script()))
        model = ReplayModel(
            path, real=lambda: AnthropicModel("claude-test", base_url=fake.base_url, strict_validation=True)
        )
        assert model.recording
        result = await run_goal(GOAL, tools=leaky_kit(), model=model)
        await model.aclose()
        assert result.state is GoalState.SUCCEEDED, result.summary()
        return len(fake.message_requests), result.answer


async def test_recorded_run_replays_offline_with_the_same_outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TASKLOOM_RECORD records each call once; without it the same run replays with no HTTP at all."""
    path = tmp_path / "cassettes" / "check.jsonl"
    served, answer = await record(path, monkeypatch)
    entries = load(path)
    assert len(entries) == served == 4  # plan, 2 executor turns, review (one task: its answer is the answer)
    monkeypatch.delenv("TASKLOOM_RECORD")
    replay = ReplayModel(path)
    assert not replay.recording
    result = await run_goal(GOAL, tools=leaky_kit(), model=replay)  # the fake server is closed by now
    assert result.state is GoalState.SUCCEEDED, result.summary()
    assert result.answer == answer
    assert [c.input for c in result.tool_calls] == [{"order_id": "A100"}]
    assert result.ledger is not None and result.ledger.calls == served


async def test_secrets_never_reach_the_cassette(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API key (from the environment) and a bearer token a tool echoed are redacted in the file."""
    path = tmp_path / "c.jsonl"
    await record(path, monkeypatch)
    raw = path.read_text()
    assert KEY not in raw and "abcdefghijklmnop0123" not in raw
    assert "[redacted]" in raw
    assert all(json.loads(line)["digest"] for line in raw.splitlines())


async def test_a_changed_prompt_fails_with_a_diff_against_the_nearest_recording(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replaying a run whose goal text changed fails naming the nearest recorded request and the changed line."""
    path = tmp_path / "c.jsonl"
    await record(path, monkeypatch)
    monkeypatch.delenv("TASKLOOM_RECORD")
    with pytest.raises(RunError) as caught:
        await run_goal("Check order A101.", tools=leaky_kit(), model=ReplayModel(path), timeout=20)
    message = str(caught.value)
    assert "has no reply for this request (role=planner" in message
    assert "nearest recorded request (role=planner" in message
    assert re.search(r"^-\s+Check order A100\.$", message, re.M), message
    assert re.search(r"^\+\s+Check order A101\.$", message, re.M), message


def test_a_missing_cassette_says_how_to_record_it(tmp_path: Path) -> None:
    """ReplayModel on a file that does not exist names TASKLOOM_RECORD."""
    with pytest.raises(CassetteError, match="TASKLOOM_RECORD="):
        ReplayModel(tmp_path / "nope.jsonl")


def test_a_worker_records_when_taskloom_record_is_set(tmp_path: Path) -> None:
    """make_inner_model wraps the configured model in the recorder when TASKLOOM_RECORD is set."""
    settings = Settings(model="demo", record=tmp_path / "w.jsonl")
    model = make_inner_model(settings)
    assert type(model).__name__ == "RecordingModel" and model.model == "demo"
    assert type(make_inner_model(Settings(model="demo"))).__name__ == "DemoModel"
