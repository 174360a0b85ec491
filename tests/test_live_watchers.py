"""Live text to its watchers: real workers (the demo model, streaming a few words at a time) on a real
Redis; the real API app over HTTP (`GET /v1/goals/{id}/stream`), `Client.stream`, `taskloom watch` as
a process, and `taskloom run`'s live view."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator

import httpx2
import pytest
from arq.connections import ArqRedis
from helpers import TASKLOOM, eventually
from test_api import serving

from bus.client import Client
from bus.keys import Keys
from bus.live import LiveFrame
from llm.demo import DemoModel
from taskloom.api.app import ApiConfig
from taskloom.api.auth import TokenBook, entry_for, parse_tokens
from taskloom.settings import load_settings
from taskloom.testing import InProcessFleet

# The demo answers with the prompt's lines that name an order ("Summary: ..."): a long one, which it
# writes over its latency, 3 words at a time.
GOAL = "Sum up order A100 slowly: " + " ".join(f"word{i}" for i in range(60))


def _fleet(redis: ArqRedis, prefix: str) -> InProcessFleet:
    settings = load_settings(key_prefix=prefix, poll_delay=0.05)
    return InProcessFleet(model=DemoModel(latency=0.5), tools=[], settings=settings, redis=redis)


@pytest.fixture
async def fleet(redis: ArqRedis, prefix: str) -> AsyncIterator[InProcessFleet]:
    async with _fleet(redis, prefix) as f:
        yield f


async def _frames(http: httpx2.AsyncClient, path: str) -> list[tuple[str, str, str]]:
    """(event, id, data) of every frame until the stream ends."""
    frames: list[tuple[str, str, str]] = []
    cur: dict[str, str] = {}
    async with http.stream("GET", path, headers={"Authorization": "Bearer secret-reader"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line == "":
                if "data" in cur:
                    frames.append((cur.get("event", "message"), cur.get("id", ""), cur["data"]))
                cur = {}
            elif not line.startswith(":"):
                k, _, v = line.partition(":")
                cur[k] = v.lstrip()
    return frames


async def test_sse_stream_sends_the_words_before_the_task_goes_to_review(
    redis: ArqRedis, keys: Keys, prefix: str
) -> None:
    """Watchers first (the models stream only while someone watches), then the fleet."""
    client = Client(redis, keys, 50_000)
    book = TokenBook(parse_tokens(entry_for("reader", ("read",), "secret-reader"), "test"))
    async with serving(client, ApiConfig(tokens=book)) as url:
        async with httpx2.AsyncClient(base_url=url, timeout=30, trust_env=False) as http:
            gid = await client.submit(GOAL)
            watching = asyncio.gather(_frames(http, f"/v1/goals/{gid}/stream"), _collect(client.stream(gid)))

            async def both_subscribed() -> bool:
                return int((await redis.pubsub_numsub(keys.live(gid)))[0][1]) >= 2

            await eventually(both_subscribed, timeout=20)
            async with _fleet(redis, prefix) as fleet:
                frames, via_client = await watching
                result = await fleet.settle(gid)
    assert result.state.value == "succeeded"
    answer = result.answer
    assert answer is not None and answer.startswith("Summary:") and "word59" in answer
    kinds = [e for e, _, _ in frames]
    assert kinds[-1] == "end"
    texts = [json.loads(d) for e, _, d in frames if e == "text"]
    assert len(texts) >= 3, kinds  # batched, but several batches over the call's latency
    assert {(t["goal"], t["task"], t["attempt"], t["step"]) for t in texts} == {(gid, "goal", 1, 0)}
    assert [t["offset"] for t in texts] == [sum(len(u["text"]) for u in texts[:i]) for i in range(len(texts))]
    assert "".join(t["text"] for t in texts) == answer
    # Durable events keep their ids (resumable); live frames have none.
    durable = [(i, json.loads(d)) for i, (e, _, d) in enumerate(frames) if e == "message"]
    assert all(frames[i][1] == ev["position"] for i, ev in durable)
    assert all(not frames[i][1] for i, (e, _, _) in enumerate(frames) if e == "text")
    reviewing = next(i for i, ev in durable if ev["type"] == "task.state" and ev["data"].get("state") == "reviewing")
    last_text = max(i for i, (e, _, _) in enumerate(frames) if e == "text")
    assert last_text < reviewing, kinds
    # Client.stream saw the same words, and ended with the goal.
    assert "".join(f.text for f in via_client if f.type == "text") == answer


async def _collect(frames: AsyncIterator[LiveFrame]) -> list[LiveFrame]:
    return [f async for f in frames]


async def test_stream_of_an_unknown_goal_is_404(fleet: InProcessFleet) -> None:
    assert fleet.client is not None
    book = TokenBook(parse_tokens(entry_for("reader", ("read",), "secret-reader"), "test"))
    async with serving(fleet.client, ApiConfig(tokens=book)) as url:
        async with httpx2.AsyncClient(base_url=url, timeout=30, trust_env=False) as http:
            r = await http.get("/v1/goals/" + "0" * 32 + "/stream", headers={"Authorization": "Bearer secret-reader"})
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
            r = await http.get("/v1/goals/" + "0" * 32 + "/stream")
            assert r.status_code == 401


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([*TASKLOOM, *args], env=env, stdout=subprocess.PIPE, text=True)


@pytest.mark.e2e  # two `taskloom watch` processes: seconds of interpreter start-up, run once in CI
async def test_watch_prints_the_words_before_the_review_then_the_answer(
    redis: ArqRedis, keys: Keys, prefix: str, subprocess_env: dict[str, str]
) -> None:
    """`taskloom watch` subscribes, the fleet starts, the answer is printed as it is written (before
    the task's move to review), then the state and the answer; `--no-stream` prints events only."""
    client = Client(redis, keys, 50_000)
    gid = await client.submit(GOAL)
    watch = _spawn(["watch", gid, "--timeout", "60"], subprocess_env)
    quiet = _spawn(["watch", gid, "--no-stream", "--timeout", "60"], subprocess_env)
    try:

        async def subscribed() -> bool:
            reply = await redis.pubsub_numsub(keys.live(gid))
            return int(reply[0][1]) >= 1

        await eventually(subscribed, timeout=30)
        await asyncio.sleep(1.0)  # the --no-stream watcher, which has no subscription to wait for
        async with _fleet(redis, prefix) as fleet:
            result = await fleet.settle(gid)
        out, _ = await asyncio.to_thread(watch.communicate, timeout=60)
        plain, _ = await asyncio.to_thread(quiet.communicate, timeout=60)
    finally:
        for proc in (watch, quiet):
            if proc.poll() is None:
                proc.kill()
    answer = result.answer
    assert answer is not None and watch.returncode == 0 and quiet.returncode == 0
    lines = out.splitlines()
    header = lines.index("goal (attempt 1, step 0) writes:")
    reviewing = next(i for i, line in enumerate(lines) if "task.state [goal]" in line and "state=reviewing" in line)
    assert header < reviewing
    assert "\n".join(lines[header + 1 : header + 1 + answer.count("\n") + 1]) == answer
    assert lines[-1 - answer.count("\n") :] == answer.splitlines()  # then the answer, once more, at the end
    assert "writes:" not in plain and "state=reviewing" in plain


def test_run_view_shows_a_running_task_s_words() -> None:
    """`taskloom run`'s live tree: a running task's text under its node, gone once it is in review."""
    from rich.console import Console

    from bus.client import GoalStatus
    from bus.live import LiveTexts
    from bus.schemas import Goal, GoalRecord, GoalState, Plan, StoredPlan, TaskRecord, TaskSpec, TaskState
    from taskloom.runner import render

    spec = TaskSpec(id="t1", title="Write", instructions="write", definition_of_done="written")
    goal = GoalRecord(id="g" * 32, goal=Goal(text="x"), state=GoalState.RUNNING, budget_tokens=1000, plan_version=1)
    texts = LiveTexts()
    texts.apply(LiveFrame(type="text", goal=goal.id, task="t1", attempt=1, step=0, text="Dear customer, your refund"))

    def shown(state: TaskState) -> str:
        task = TaskRecord(goal_id=goal.id, task_id="t1", state=state, attempt=1, plan_version=1)
        plan = StoredPlan(goal_id=goal.id, version=1, plan=Plan(tasks=[spec]))
        status = GoalStatus(goal=goal, plan=plan, tasks=[task])
        console = Console(width=100, record=True)
        console.print(render(status, None, 1.0, texts))
        return console.export_text()

    assert "writing: Dear customer, your refund" in shown(TaskState.RUNNING)
    assert "Dear customer" not in shown(TaskState.REVIEWING)


async def test_mcp_wait_goal_reports_progress_with_the_words_being_written(
    redis: ArqRedis, keys: Keys, prefix: str
) -> None:
    """`wait_goal` with a progress callback (an in-process MCP client): state changes and the task's
    words, then the answer; without one, it waits as before (no live text subscription)."""
    from mcp import Client as McpClient

    from taskloom.mcp_server import build

    client = Client(redis, keys, 50_000)
    gid = await client.submit(GOAL)
    messages: list[str] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        messages.append(message or "")

    async with McpClient(build(client)) as mcp:
        call = asyncio.ensure_future(
            mcp.call_tool(
                "wait_goal",
                {"goal_id": gid, "timeout_seconds": 60},
                progress_callback=progress,
                meta={"progressToken": "p1"},  # as a host asking for progress sends it
            )
        )

        async def subscribed() -> bool:
            return int((await redis.pubsub_numsub(keys.live(gid)))[0][1]) >= 1

        await eventually(subscribed, timeout=20)
        async with _fleet(redis, prefix) as fleet:
            result = await call
            await fleet.settle(gid)
    assert not result.is_error and result.structured_content is not None
    assert result.structured_content["done"] is True and result.structured_content["state"] == "succeeded"
    writing = [m for m in messages if m.startswith("goal writing: ")]
    assert writing and "Summary:" in writing[0], messages
    assert "goal: reviewing" in messages and messages[-1] == "goal: succeeded", messages
