"""A SIGKILL of the executor while its model call streams: watchers see the partial text, then a
restart marker, then the whole answer streamed again by the executor that resumed the attempt; the
goal succeeds, and its ledger counts every call the provider billed: each settled call exactly, the
killed one once, as a forfeited reservation. Real worker processes, the real SDK, the fake API."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import pytest
from arq.connections import ArqRedis
from helpers import eventually
from test_e2e import ACCEPT, _spawn, fleet, role_of, spec, task_of, worker_env

from bus.client import Client
from bus.keys import Keys
from bus.ledger import Ledger
from bus.live import LiveFrame
from bus.schemas import GoalState
from llm.testing import FakeAnthropicServer, RecordedRequest, Reply, Script, text_reply, tool_reply
from planner.prompts import PLAN_TOOL

pytestmark = pytest.mark.e2e

ANSWER = " ".join(f"sentence {i} of the answer, written slowly." for i in range(30))
RESERVATION_TTL = 8.0  # the killed call's reservation is forfeited this long after it was made


def responder(req: RecordedRequest) -> Script:
    role = role_of(req)
    if role == "planner":
        return tool_reply([(PLAN_TOOL, {"tasks": [spec("a")]})])
    if role == "executor" and task_of(req) == "a":
        return Reply(content=[{"type": "text", "text": ANSWER}], pace=0.05)  # ~80 deltas, ~4 s
    if role == "review":
        return text_reply(json.dumps(ACCEPT))
    raise AssertionError(f"unexpected request: {role}")


async def test_a_killed_streaming_executor_leaves_a_restart_marker_then_the_whole_answer(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    client = Client(redis, keys, 100_000)
    frames: list[LiveFrame] = []
    # Every request billed under its own id: the killed call's bill can be told apart.
    with FakeAnthropicServer(bill_key=lambda r: r.request_id) as fake:
        fake.respond_with(responder)
        env = worker_env(subprocess_env, fake, tmp_path, TASKLOOM_LEDGER_RESERVATION_TTL=str(RESERVATION_TTL))
        async with fleet(env, tmp_path, "planner", "critic"):
            first = _spawn("executor", env, tmp_path / "executor-1.log")
            second = None
            try:
                gid = await client.submit("Write the answer slowly")

                async def listen() -> None:
                    async for frame in client.stream(gid):
                        frames.append(frame)

                listener = asyncio.create_task(listen())

                async def partly_streamed() -> bool:
                    return sum(len(f.text) for f in frames) > len(ANSWER) // 4

                await eventually(partly_streamed, timeout=90)
                first.proc.send_signal(signal.SIGKILL)
                first.proc.wait(10)
                killed_at = len(frames)
                second = _spawn("executor", env, tmp_path / "executor-2.log")

                async def ended() -> bool:
                    return (await client.get(gid)).terminal

                await eventually(ended, timeout=90)
                await asyncio.wait_for(listener, 10)  # Client.stream ends with the goal
            finally:
                for w in (first, second):
                    if w is not None and w.proc.poll() is None:
                        w.proc.kill()
                    if w is not None:
                        w.proc.wait(10)
                        print(f"--- {w.log.name} ---\n{w.log.read_text()[-3000:]}")
        record = await client.get(gid)
        assert record.state is GoalState.SUCCEEDED, record.reason
        assert record.answer == ANSWER

        # What a watcher saw: part of the answer, the restart marker, then the whole answer from 0.
        before, after = frames[:killed_at], frames[killed_at:]
        partial = "".join(f.text for f in before if f.type == "text")
        assert 0 < len(partial) < len(ANSWER) and ANSWER.startswith(partial)
        restarts = [i for i, f in enumerate(after) if f.type == "restart"]
        assert len(restarts) == 1, [f.type for f in after]
        marker = after[restarts[0]]
        assert (marker.task, marker.attempt, marker.step) == ("a", 1, 0)
        again = [f for f in after[restarts[0] + 1 :] if f.type == "text"]
        assert again[0].offset == 0
        assert [f.offset for f in again] == [sum(len(g.text) for g in again[:i]) for i in range(len(again))]
        assert "".join(f.text for f in again) == ANSWER

        # The ledger: the killed call was billed by the provider and never settled: its reservation
        # is forfeited once it expires, counted once, in full; every other call is settled at
        # exactly what the provider billed. Nothing else is open or reserved.
        executor = [r for r in fake.message_requests if role_of(r) == "executor"]
        assert len(executor) == 2 and all(r.body.get("stream") is True for r in executor)
        killed = fake.billed_for(executor[0].request_id).total
        billed = sum(fake.billed_for(r.request_id).total for r in fake.message_requests)
        ledger = Ledger(redis, keys)
        deadline = time.monotonic() + RESERVATION_TTL + 20
        books = await ledger.snapshot(gid)
        while books.open and time.monotonic() < deadline:  # a snapshot sweeps expired reservations
            await asyncio.sleep(0.5)
            books = await ledger.snapshot(gid)
        assert (books.open, books.reserved, books.expired) == (0, 0, 1), books
        assert books.spent - books.spent_unknown == billed - killed  # every settled call, exactly
        assert books.spent_unknown >= killed > 0  # the killed call: once, at its reservation
        assert books.calls == len(fake.message_requests)
