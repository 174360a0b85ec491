"""The console shows a task's answer as the model writes it: a real browser on a `taskloom api`
process and a `taskloom worker all` process whose model is the fake Messages API, streaming its
reply over a few seconds (the worker's Anthropic adapter reads it with the SDK's streaming API)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from arq.connections import ArqRedis
from test_browser import (
    ARTIFACTS,
    CHROMIUM,
    CHROMIUM_ARGS,
    TOKENS,
    WAIT_MS,
    _api_url,
    _spawn_api,
    async_playwright,
)
from test_e2e import ACCEPT, fleet, role_of, spec, task_of, worker_env

from bus.client import Client
from bus.keys import Keys
from bus.live import LISTENER_TTL_S
from bus.schemas import GoalState
from llm.testing import FakeAnthropicServer, RecordedRequest, Reply, Script, text_reply, tool_reply
from planner.prompts import PLAN_TOOL
from taskloom.api.auth import entry_for

pytestmark = pytest.mark.browser

ANSWER = "\n".join(f"Line {i}: the refund for order A{100 + i} is approved, within the window." for i in range(8))


class SlowWriter:
    """One task `a`, whose answer streams 16 characters every `pace` seconds; the planner answers
    only once `go` is set (the page is subscribed by then)."""

    def __init__(self, pace: float) -> None:
        self.pace = pace
        self.go = threading.Event()

    def __call__(self, req: RecordedRequest) -> Script:
        role = role_of(req)
        if role == "planner":
            self.go.wait(60)
            return tool_reply([(PLAN_TOOL, {"tasks": [spec("a")]})])
        if role == "executor" and task_of(req) == "a":
            return Reply(content=[{"type": "text", "text": ANSWER}], pace=self.pace)
        if role == "review":
            return text_reply(json.dumps(ACCEPT))
        raise AssertionError(f"unexpected request: {role}")


async def test_the_console_shows_the_answer_growing_before_the_task_is_done(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    assert CHROMIUM is not None and async_playwright is not None
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    writer = SlowWriter(pace=0.12)  # ~36 deltas: about 4 s of writing
    tokens = ",".join(entry_for(n, s, f"token-{n}") for n, s in TOKENS.items())
    log = tmp_path / "api.log"
    client = Client(redis, keys, 200_000)
    with FakeAnthropicServer() as fake:
        fake.respond_with(writer)
        proc = _spawn_api({**subprocess_env, "TASKLOOM_API_TOKENS": tokens}, log)
        try:
            async with async_playwright() as pw, fleet(worker_env(subprocess_env, fake, tmp_path), tmp_path, "all"):
                browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                url = await _api_url(proc, log)
                gid = await client.submit("Approve the refunds, one line per order")
                page = await browser.new_page(viewport={"width": 1280, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                await page.goto(f"{url}#token=token-operator")
                await page.wait_for_selector("#whoami:not(:empty)", timeout=WAIT_MS)
                await page.goto(f"{url}#/goals/{gid}")
                await page.wait_for_selector('[data-testid="goal-state"]', timeout=WAIT_MS)

                async def subscribed() -> bool:
                    return int((await redis.pubsub_numsub(keys.live(gid)))[0][1]) >= 1

                deadline = time.monotonic() + 30
                while not await subscribed():
                    assert time.monotonic() < deadline, "the goal page never subscribed to the live text"
                    await asyncio.sleep(0.05)
                # The planner's call asked whether anyone listens before the page subscribed, and a
                # worker trusts "nobody" for LISTENER_TTL_S: past it, the executor's call asks
                # again and finds the page.
                await asyncio.sleep(LISTENER_TTL_S + 0.1)
                writer.go.set()

                # Observe the task's text while it is written: growing, each a prefix of the answer,
                # shown in the Answer panel too (a one-task goal's answer is its task's answer).
                seen: list[str] = []
                shots: list[Path] = []
                while True:
                    state = await page.get_attribute('#dag g.node[data-task="a"]', "data-state")
                    # Both panels read at one instant (the page changes between two reads).
                    text, shown = await page.evaluate(
                        "() => { const e = document.querySelector('#writing [data-task=\"a\"] pre'); "
                        "const a = document.querySelector('#answer-live'); "
                        "return [e ? e.textContent : null, a ? a.textContent : null]; }"
                    )
                    if state in ("reviewing", "done") or (await client.get(gid)).terminal:
                        break
                    if text and (not seen or len(text) > len(seen[-1])):
                        assert ANSWER.startswith(text), text
                        assert shown == text
                        seen.append(text)
                        if len(shots) < 4:
                            path = ARTIFACTS / f"live-text-{len(shots)}.png"
                            await page.screenshot(path=str(path), full_page=True)
                            shots.append(path)
                    await asyncio.sleep(0.25)
                assert len(shots) >= 3, f"the answer was seen growing {len(seen)} times: {[len(t) for t in seen]}"

                await page.wait_for_selector('[data-testid="goal-state"].succeeded', timeout=WAIT_MS)
                assert (await page.text_content("#answer-text")) == ANSWER
                assert await page.locator("#writing-panel").is_hidden()  # the stored answer took over
                await page.screenshot(path=str(ARTIFACTS / "live-text-done.png"), full_page=True)
                assert (await client.get(gid)).state is GoalState.SUCCEEDED
                assert not errors, errors
                await browser.close()
        finally:
            proc.terminate()
            proc.wait(20)
    # The executor's call was streamed (the SDK asked for SSE), and billed as one call.
    executor_calls = [r for r in fake.message_requests if role_of(r) == "executor"]
    assert len(executor_calls) == 1 and executor_calls[0].body.get("stream") is True
