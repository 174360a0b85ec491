"""The web console in a real browser: headless Chromium (Debian's `chromium` package) driven by
Playwright, against a `taskloom api` process and a `taskloom worker all` process whose model is the
fake Messages API. Screenshots go to `test-artifacts/browser/` (or `$TASKLOOM_TEST_ARTIFACTS`)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest
from arq.connections import ArqRedis
from helpers import TASKLOOM, eventually
from test_e2e import Scenario, _first_user, fleet, role_of, spec, worker_env

from bus.client import Client
from bus.keys import Keys
from bus.schemas import GoalState
from critic.prompts import FINAL_TOOL
from llm.testing import FakeAnthropicServer, RecordedRequest, Script, tool_reply
from planner.prompts import PLAN_TOOL
from taskloom.api.auth import entry_for

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.async_api import Browser, Page, async_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    async_playwright = None  # type: ignore[assignment]

if CHROMIUM is None or async_playwright is None:
    pytest.skip(
        "browser tests need Debian's chromium (apt-get install -y chromium) and the playwright package "
        f"(pip install playwright); found chromium={CHROMIUM!r}, playwright={'yes' if async_playwright else 'no'}",
        allow_module_level=True,
    )

ARTIFACTS = Path(
    os.environ.get("TASKLOOM_TEST_ARTIFACTS") or Path(__file__).parent.parent / "test-artifacts" / "browser"
)
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TOKENS = {"operator": ("admin",), "viewer": ("read",)}
WAIT_MS = 60_000  # generous: the machine is shared


@dataclass
class Console:
    url: str
    client: Client
    browser: Browser
    fake: FakeAnthropicServer
    name: str
    errors: list[str]

    async def page(self, who: str = "operator") -> Page:
        page = await self.browser.new_page(viewport={"width": 1440, "height": 900})
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        await page.goto(f"{self.url}#token=token-{who}")
        await page.wait_for_selector("#whoami:not(:empty)", timeout=WAIT_MS)
        return page

    async def shot(self, page: Page, what: str) -> Path:
        path = ARTIFACTS / f"{self.name}-{what}.png"
        await page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")
        return path


def _start_api(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    with log.open("wb") as out:
        proc = subprocess.Popen([*TASKLOOM, "api", "--port", "0"], env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        m = re.search(r"^console: (\S+)$", log.read_text(), re.M)
        if m:
            return proc, m.group(1)
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


GATED = "(needs approval)"
MODEL_MARKUP = '<img src="y" onerror="window.__pwned = 3">Answer <i>in markup</i>'


class WipeAware(Scenario):
    """Goals whose text contains GATED get one task `w` calling the approval-gated `wipe` tool; others a -> b."""

    def __call__(self, req: RecordedRequest) -> Script:
        if role_of(req) == "goal_review" and "<script>" in _first_user(req):
            final = {"answer": MODEL_MARKUP, "passed": True, "action": "accept", "feedback": "ok"}
            return tool_reply([(FINAL_TOOL, final)])  # a model's text is data too
        if role_of(req) == "planner":
            gated = GATED in _first_user(req)
            tasks = [spec("w", tools=("wipe",))] if gated else [spec("a"), spec("b", deps=("a",))]
            return tool_reply([(PLAN_TOOL, {"tasks": tasks})])
        return super().__call__(req)


@pytest.fixture(scope="module", autouse=True)
def artifacts() -> Path:
    """The screenshot directory (made once, printed so CI logs say where to look)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    print(f"browser test screenshots: {ARTIFACTS}")
    return ARTIFACTS


@pytest.fixture
async def console(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Console]:
    responder = WipeAware(plans={}, calls={"w": [("wipe", {"target": "staging"})]})
    tokens = ",".join(entry_for(n, s, f"token-{n}") for n, s in TOKENS.items())
    with FakeAnthropicServer() as fake:
        fake.respond_with(responder)
        env = worker_env(subprocess_env, fake, tmp_path)
        async with fleet(env, tmp_path, "all"):
            proc, url = _start_api({**subprocess_env, "TASKLOOM_API_TOKENS": tokens}, tmp_path / "api.log")
            try:
                async with httpx2.AsyncClient(base_url=url, trust_env=False, timeout=10) as http:

                    async def ready() -> bool:
                        try:
                            return (await http.get("/readyz")).status_code == 200
                        except httpx2.TransportError:
                            return False

                    await eventually(ready, timeout=30)
                async with async_playwright() as pw:
                    browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                    c = Console(url, Client(redis, keys, 200_000), browser, fake, request.node.name, [])
                    try:
                        yield c
                    finally:
                        await browser.close()
                assert not c.errors, c.errors  # no JavaScript error on any page
                assert not responder.unrouted
            finally:
                proc.terminate()
                proc.wait(20)
                print(f"--- api.log ---\n{(tmp_path / 'api.log').read_text()[-3000:]}")


async def test_submit_from_the_form_and_watch_the_dag_succeed_without_reload(console: Console) -> None:
    """A goal submitted from the form runs on real workers; its page turns every node and the goal green live."""
    page = await console.page()
    await page.click("nav >> text=Submit")
    await page.fill("#goal-input", "Check both things in order")
    await page.fill("#dod-input", "both checked")
    await page.click("#submit-button")
    await page.wait_for_url(re.compile(r"#/goals/[0-9a-f]{32}$"), timeout=WAIT_MS)
    gid = page.url.rsplit("/", 1)[1]
    # The page is never reloaded: mark the window, and check the mark is still there at the end.
    await page.evaluate("window.__same_page = true")
    await page.wait_for_selector('[data-testid="goal-state"].succeeded', timeout=WAIT_MS)
    await page.wait_for_selector('#dag g.node[data-task="b"][data-state="done"]', timeout=WAIT_MS)
    assert await page.evaluate("window.__same_page === true")
    assert await page.locator('#dag g.node[data-state="done"]').count() == 2
    assert (await page.text_content("#answer-text")) == "The final answer."
    assert await page.locator('#event-rows tr[data-type="goal.state"]').count() >= 3
    assert await page.locator("#tasks .attempt.accept").count() == 2
    await console.shot(page, "goal-succeeded")
    assert (await console.client.get(gid)).state is GoalState.SUCCEEDED
    # The goals table shows it, and follows a new goal live.
    await page.click("nav >> text=Goals")
    await page.wait_for_selector(f'tr.goal-row[data-goal="{gid}"][data-state="succeeded"]', timeout=WAIT_MS)
    other = await console.client.submit("Another goal, submitted elsewhere")
    await page.wait_for_selector(f'tr.goal-row[data-goal="{other}"]', timeout=WAIT_MS)
    await page.wait_for_selector(f'tr.goal-row[data-goal="{other}"][data-state="succeeded"]', timeout=WAIT_MS)
    await console.shot(page, "goals-table")


async def test_approve_from_the_inbox_and_the_goal_goes_on(console: Console) -> None:
    """A gated tool call appears in the inbox; Approve runs it, the goal succeeds, the audit names the token."""
    gid = await console.client.submit(f"Please wipe the staging disk {GATED}")
    page = await console.page()
    await page.click("nav >> text=Approvals")
    row = page.locator(f'.approval[data-goal="{gid}"]')
    await row.wait_for(timeout=WAIT_MS)
    assert "wipe" in await row.inner_text()
    assert '"target": "staging"' in await row.locator("pre.args").inner_text()
    await console.shot(page, "inbox")
    # A second tab watches the goal, its task waiting for the decision.
    watcher = await console.page()
    await watcher.goto(f"{console.url}#/goals/{gid}")
    await watcher.wait_for_selector('#dag g.node[data-task="w"][data-state="waiting_approval"]', timeout=WAIT_MS)
    await watcher.evaluate("window.__same_page = true")
    await row.locator("button.approve").click()
    await page.wait_for_selector("#inbox-empty", timeout=WAIT_MS)
    # The watching tab sees the goal go on to succeeded, live, without a reload.
    await watcher.wait_for_selector('[data-testid="goal-state"].succeeded', timeout=WAIT_MS)
    await watcher.wait_for_selector('#dag g.node[data-task="w"][data-state="done"]', timeout=WAIT_MS)
    await watcher.wait_for_selector('#event-rows tr[data-type="tool.approval_decided"]', timeout=WAIT_MS)
    assert await watcher.evaluate("window.__same_page === true")
    goal = await console.client.get(gid)
    assert goal.state is GoalState.SUCCEEDED, goal
    decided = [e.data for e in await console.client.log.read(gid) if e.type == "tool.approval_decided"]
    assert [(d["approved"], d["by"]) for d in decided] == [(True, "operator")]
    calls = [e.data for e in await console.client.log.read(gid) if e.type == "tool.call"]
    assert [c["outcome"] for c in calls if c["tool"] == "wipe"] == ["ok"], calls
    await console.shot(watcher, "approved-goal")


async def test_goal_text_with_script_is_shown_as_text(console: Console) -> None:
    """Markup in a goal's text and in a model's answer is displayed literally, and never runs."""
    text = '<script>window.__pwned = 1</script><img src="x" onerror="window.__pwned = 2"><b>bold?</b>'
    gid = await console.client.submit(text)
    page = await console.page()
    link = page.locator(f'tr.goal-row[data-goal="{gid}"] td.text a')
    await link.wait_for(timeout=WAIT_MS)
    assert await link.text_content() == text
    await link.click()
    await page.wait_for_selector("#goal-text", timeout=WAIT_MS)
    assert await page.text_content("#goal-text") == text
    assert await page.locator("#goal-text script, #goal-text img, #goal-text b").count() == 0
    await page.wait_for_selector('[data-testid="goal-state"].succeeded', timeout=WAIT_MS)
    await page.wait_for_selector('#event-rows tr[data-type="goal.state"]', timeout=WAIT_MS)
    assert "null" not in await page.inner_text("#goal-head")  # an absent part is left out, not printed
    assert await page.text_content("#answer-text") == MODEL_MARKUP
    assert await page.locator("#answer-text img, #answer-text i").count() == 0
    assert await page.evaluate("window.__pwned === undefined")
    await console.shot(page, "script-as-text")


async def test_a_token_without_approve_sees_no_buttons_and_gets_403(console: Console) -> None:
    """The inbox shows a read-only token the pending call but no buttons; the API refuses its approve with 403."""
    gid = await console.client.submit(f"Wipe it, but only a person may say so {GATED}")
    page = await console.page("viewer")
    await page.click("nav >> text=Approvals")
    row = page.locator(f'.approval[data-goal="{gid}"]')
    await row.wait_for(timeout=WAIT_MS)
    assert await page.locator("#no-approve").is_visible()
    assert await row.locator("button").count() == 0
    await console.shot(page, "read-only-inbox")
    call_id = await row.get_attribute("data-call")
    status = await page.evaluate(
        """async ([gid, call]) => (await fetch(`/v1/approvals/${gid}/${call}/approve`,
             {method: "POST", headers: {Authorization: "Bearer token-viewer"}})).status""",
        [gid, call_id],
    )
    assert status == 403
    await asyncio.sleep(0.5)
    assert (await console.client.approvals(gid)).keys() == {call_id}  # still waiting
    await console.client.cancel(gid)
