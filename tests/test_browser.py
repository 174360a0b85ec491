"""The web console in a real browser: headless Chromium (Debian's `chromium` package) driven by
Playwright, against a `taskloom api` process and a `taskloom worker all` process whose model is the
fake Messages API. Screenshots go to `test-artifacts/browser/` (or `$TASKLOOM_TEST_ARTIFACTS`)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest
from arq.connections import ArqRedis
from helpers import TASKLOOM, eventually
from test_e2e import Scenario, _first_user, fleet, role_of, spec, worker_env

from bus.client import Client
from bus.keys import Keys
from bus.schemas import Event, GoalState
from critic.prompts import FINAL_TOOL
from llm.testing import FakeAnthropicServer, RecordedRequest, Script, tool_reply
from planner.prompts import PLAN_TOOL
from taskloom.api.auth import entry_for

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.async_api import Browser, Locator, Page, async_playwright
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

    async def page(self, who: str = "operator", width: int = 1440) -> Page:
        page = await self.browser.new_page(viewport={"width": width, "height": 900})
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        await page.goto(f"{self.url}#token=token-{who}")
        await page.wait_for_selector("#whoami:not(:empty)", timeout=WAIT_MS)
        return page

    async def shot(self, page: Page, what: str) -> Path:
        path = ARTIFACTS / f"{self.name}-{what}.png"
        await page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")
        return path


def _spawn_api(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([*TASKLOOM, "api", "--port", "0"], env=env, stdout=out, stderr=subprocess.STDOUT)


def _printed_url(proc: subprocess.Popen[bytes], log: Path) -> str | None:
    """The console URL a starting `taskloom api` prints (None: not yet); fails if it exited."""
    text = log.read_text()
    assert proc.poll() is None, text
    m = re.search(r"^console: (\S+)$", text, re.M)
    return m.group(1) if m else None


async def _api_url(proc: subprocess.Popen[bytes], log: Path) -> str:
    """The console URL of a starting `taskloom api`, once it answers `/readyz`."""

    async def started() -> bool:
        return _printed_url(proc, log) is not None

    await eventually(started, timeout=60)
    url = _printed_url(proc, log)
    assert url is not None
    async with httpx2.AsyncClient(base_url=url, trust_env=False, timeout=10) as http:

        async def ready() -> bool:
            try:
                return (await http.get("/readyz")).status_code == 200
            except httpx2.TransportError:
                return False

        await eventually(ready, timeout=30)
    return url


GATED = "(needs approval)"
AFTER_A = "(after a)"  # with GATED: task a first, then the gated task w
MODEL_MARKUP = '<img src="y" onerror="window.__pwned = 3">Answer <i>in markup</i>'


class WipeAware(Scenario):
    """Goals whose text contains GATED get a task `w` calling the approval-gated `wipe` tool (after a task `a`
    if the text also contains AFTER_A); others a -> b."""

    def __call__(self, req: RecordedRequest) -> Script:
        if role_of(req) == "goal_review" and "<script>" in _first_user(req):
            final = {"answer": MODEL_MARKUP, "passed": True, "action": "accept", "feedback": "ok"}
            return tool_reply([(FINAL_TOOL, final)])  # a model's text is data too
        if role_of(req) == "planner":
            text = _first_user(req)
            if GATED in text and AFTER_A in text:
                tasks = [spec("a"), spec("w", deps=("a",), tools=("wipe",))]
            elif GATED in text:
                tasks = [spec("w", tools=("wipe",))]
            else:
                tasks = [spec("a"), spec("b", deps=("a",))]
            return tool_reply([(PLAN_TOOL, {"tasks": tasks})])
        return super().__call__(req)


@pytest.fixture(scope="module", autouse=True)
def artifacts() -> Path:
    """The screenshot directory (made once, printed so CI logs say where to look)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    print(f"browser test screenshots: {ARTIFACTS}")
    return ARTIFACTS


@asynccontextmanager
async def _serve(
    redis: ArqRedis,
    keys: Keys,
    subprocess_env: dict[str, str],
    tmp_path: Path,
    name: str,
    roles: tuple[str, ...],
) -> AsyncIterator[Console]:
    """A `taskloom api` process (with one `taskloom worker <role>` per role) and a headless Chromium,
    all three started at once (each takes seconds on a busy machine)."""
    responder = WipeAware(plans={}, calls={"w": [("wipe", {"target": "staging"})]})
    tokens = ",".join(entry_for(n, s, f"token-{n}") for n, s in TOKENS.items())
    api_log = tmp_path / "api.log"
    with FakeAnthropicServer() as fake:
        fake.respond_with(responder)
        env = worker_env(subprocess_env, fake, tmp_path)
        proc = _spawn_api({**subprocess_env, "TASKLOOM_API_TOKENS": tokens}, api_log)
        try:
            async with async_playwright() as pw:
                launch = asyncio.create_task(pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS))
                try:
                    async with fleet(env, tmp_path, *roles):
                        url = await _api_url(proc, api_log)
                        c = Console(url, Client(redis, keys, 200_000), await launch, fake, name, [])
                        yield c
                finally:
                    if not launch.done():
                        launch.cancel()
                    elif not launch.cancelled() and launch.exception() is None:
                        await launch.result().close()
            assert not c.errors, c.errors  # no JavaScript error on any page
            assert not responder.unrouted
        finally:
            proc.terminate()
            proc.wait(20)
            print(f"--- api.log ---\n{api_log.read_text()[-3000:]}")


@pytest.fixture
async def console(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Console]:
    """The console of an API whose fleet (one `taskloom worker all`) runs goals on the fake model."""
    async with _serve(redis, keys, subprocess_env, tmp_path, request.node.name, ("all",)) as c:
        yield c


@pytest.fixture
async def idle_console(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Console]:
    """The console of an API with no worker running: goals stay `submitted`."""
    async with _serve(redis, keys, subprocess_env, tmp_path, request.node.name, ()) as c:
        yield c


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
    # The answer and the attempts come from their own reads, the events from the goal's stream: a
    # goal that ended before its page first drew shows "succeeded" before they have all arrived.
    await page.wait_for_selector("#answer-text", timeout=WAIT_MS)
    assert (await page.text_content("#answer-text")) == "The final answer."
    states, accepted = page.locator('#event-rows tr[data-type="goal.state"]'), page.locator("#tasks .attempt.accept")
    await eventually(lambda: _at_least(states, 3), timeout=WAIT_MS / 1000)
    await eventually(lambda: _at_least(accepted, 2), timeout=WAIT_MS / 1000)
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


async def test_a_click_that_spans_a_live_redraw_still_opens_the_goal(console: Console) -> None:
    """The goals table redraws on every event. One due while a button is held down on the table
    waits for the release, and a goal's row and link stay the same elements across redraws, so a
    click pressed before the goal moved on and released after it still opens the goal (a replaced
    link made the press and the release land on two elements, and the click was lost)."""
    gid = await console.client.submit(f"Wipe the scratch disk {GATED}")
    page = await console.page()
    row = page.locator(f'tr.goal-row[data-goal="{gid}"][data-waiting="1"]')
    await row.wait_for(timeout=WAIT_MS)
    box = await row.locator("td.text a").bounding_box()
    assert box is not None
    await page.mouse.move(box["x"] + 5, box["y"] + box["height"] / 2)
    await page.mouse.down()
    # The goal moves on meanwhile: the page reads it again, and its redraw waits for the release.
    async with page.expect_response(lambda r: "/v1/goals?" in r.url, timeout=WAIT_MS):
        assert await console.client.decide(gid, await pending_call(console.client, gid), True, by="test")
    await page.mouse.up()
    await page.wait_for_selector("#goal-text", timeout=WAIT_MS)
    assert page.url.endswith(f"#/goals/{gid}")
    await page.evaluate("location.hash = '#/'")
    await page.locator(f'tr.goal-row[data-goal="{gid}"]:not([data-waiting])').wait_for(timeout=WAIT_MS)


async def test_a_press_on_cancel_that_spans_a_refresh_still_cancels(console: Console) -> None:
    """The goal page refreshes on each event of the goal. Its head (state, Cancel) is renewed in
    place, so a press on Cancel that spans a refresh still cancels (a head rebuilt whole replaced
    the button under the press, and the click was lost)."""
    gid = await console.client.submit(f"Wipe the spare disk {GATED}")
    await pending_call(console.client, gid)  # waits for a person: nothing else moves the goal
    page = await console.page()
    page.on("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
    await page.goto(f"{console.url}#/goals/{gid}")
    button = page.locator("#cancel")
    await button.wait_for(timeout=WAIT_MS)
    box = await button.bounding_box()
    assert box is not None
    await page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    await page.mouse.down()
    # An event of the goal (one a worker writes when a role's model serves it): the page refreshes.
    await page.locator('[data-testid="goal-state"]').evaluate("el => { el.dataset.before = '1'; }")
    await console.client.log.emit(Event(type="model.serving", goal_id=gid, data={"role": "executor", "model": "m"}))
    await page.locator('[data-testid="goal-state"]:not([data-before])').wait_for(timeout=WAIT_MS)
    await page.mouse.up()
    await page.wait_for_selector('[data-testid="goal-state"].cancelled', timeout=WAIT_MS)
    assert (await console.client.get(gid)).state is GoalState.CANCELLED


async def test_events_follow_the_newest_only_while_the_reader_is_at_the_bottom(console: Console) -> None:
    """The goal page's event list follows new events while the reader is at its bottom; a reader who
    scrolled up to an earlier event stays there when more arrive (each event pulled them down)."""
    gid = await console.client.submit(f"Wipe the log disk {GATED}")
    await pending_call(console.client, gid)  # waits for a person: nothing else writes events now

    async def emit(n: int) -> None:
        for i in range(n):  # what a worker writes while a call waits its turn in the rate limit
            event = Event(type="model.rate_limited", goal_id=gid, data={"bucket": "b", "waited": i})
            await console.client.log.emit(event)

    await emit(40)
    page = await console.page()
    await page.goto(f"{console.url}#/goals/{gid}")
    rows = page.locator("#event-rows tr")
    await eventually(lambda: _at_least(rows, 40), timeout=WAIT_MS / 1000)
    box = page.locator(".events")
    gap = "el => el.scrollHeight - el.scrollTop - el.clientHeight"
    assert await box.evaluate("el => el.scrollHeight > el.clientHeight + 100")  # it scrolls
    assert await box.evaluate(gap) < 24  # and starts at the newest
    await box.evaluate("el => { el.scrollTop = 0; }")
    shown = await rows.count()
    await emit(3)
    await eventually(lambda: _at_least(rows, shown + 3), timeout=WAIT_MS / 1000)
    assert await box.evaluate("el => el.scrollTop") == 0
    await box.evaluate("el => { el.scrollTop = el.scrollHeight; }")
    await emit(1)
    await eventually(lambda: _at_least(rows, shown + 4), timeout=WAIT_MS / 1000)
    assert await box.evaluate(gap) < 24
    await console.client.cancel(gid)


async def test_text_selected_in_a_finished_task_survives_a_refresh(console: Console) -> None:
    """A finished task's card stays the same element while the goal runs on, so an answer a reader
    selected (to copy it) stays selected through the page's refreshes."""
    gid = await console.client.submit(f"First a, then wipe the old disk {AFTER_A} {GATED}")
    await pending_call(console.client, gid)  # task a is done; w waits for a person
    page = await console.page()
    await page.goto(f"{console.url}#/goals/{gid}")
    answer = page.locator('#tasks .task[data-task="a"] pre')
    await answer.wait_for(timeout=WAIT_MS)
    text = await answer.inner_text()
    await answer.evaluate("el => { const r = document.createRange(); r.selectNodeContents(el); "
                          "const s = getSelection(); s.removeAllRanges(); s.addRange(r); }")
    # An event of the goal: the page refreshes, the tasks panel from a read of the attempts.
    async with page.expect_response(lambda r: r.url.endswith(f"/v1/goals/{gid}/attempts")) as read:
        await console.client.log.emit(Event(type="model.serving", goal_id=gid, data={"role": "executor", "model": "m"}))
    await (await read.value).finished()
    await page.wait_for_timeout(200)  # its reply parsed and drawn
    assert await page.evaluate("getSelection().toString()") == text
    await console.client.cancel(gid)


async def _at_least(rows: Locator, n: int) -> bool:
    return await rows.count() >= n


async def test_a_reason_being_typed_keeps_its_focus_when_another_call_arrives(console: Console) -> None:
    """The inbox redraws when a call arrives or is decided. A card already shown stays in the page
    through that, so the reason a person is typing in it keeps the focus and every key lands (a
    card taken out and put back lost the focus, and the keys typed after it went nowhere)."""
    first = await console.client.submit(f"Wipe the first scratch disk {GATED}")
    page = await console.page()
    await page.click("nav >> text=Approvals")
    reason = page.locator(f'.approval[data-goal="{first}"] input[aria-label="reason"]')
    await reason.wait_for(timeout=WAIT_MS)
    await reason.click()
    await page.keyboard.type("not this disk")
    second = await console.client.submit(f"Wipe the second scratch disk {GATED}")
    await page.locator(f'.approval[data-goal="{second}"]').wait_for(timeout=WAIT_MS)
    await page.keyboard.type(", it holds backups")
    assert await reason.input_value() == "not this disk, it holds backups"
    assert await reason.evaluate("el => el === document.activeElement")
    for gid in (first, second):
        await console.client.cancel(gid)


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


# -- helpers for the tests below ----------------------------------------------------------------

PHONE = 420  # px: a phone held upright


async def pending_call(client: Client, gid: str) -> str:
    """The id of the goal's one tool call waiting for a decision (waits until there is one)."""

    async def asked() -> bool:
        return bool(await client.approvals(gid))

    await eventually(asked, timeout=WAIT_MS / 1000)
    (call_id,) = (await client.approvals(gid)).keys()
    return call_id


async def assert_fits_the_screen(page: Page) -> None:
    """No sideways scrolling, and every header item on screen."""
    width = await page.evaluate("window.innerWidth")
    scroll = await page.evaluate("document.documentElement.scrollWidth")
    assert scroll <= width, f"the page is {scroll} px wide on a {width} px screen"
    for sel in [".brand", 'nav a[data-nav="goals"]', 'nav a[data-nav="approvals"]', 'nav a[data-nav="submit"]',
                "#whoami", "#live", "#signout"]:  # fmt: skip
        item = page.locator(sel)
        assert await item.is_visible(), sel
        box = await item.bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width, (sel, box)


async def placeholder_room(page: Page, selector: str) -> tuple[float, float]:
    """(width of the input's placeholder text, width the input has for text) in px."""
    room: list[float] = await page.locator(selector).first.evaluate(
        """(el) => {
             const cs = getComputedStyle(el);
             const ctx = document.createElement("canvas").getContext("2d");
             ctx.font = `${cs.fontStyle} ${cs.fontWeight} ${cs.fontSize} ${cs.fontFamily}`;
             const inner = el.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
             return [ctx.measureText(el.placeholder).width, inner];
           }"""
    )
    return room[0], room[1]


async def test_pending_calls_show_on_every_page_and_are_decided_on_the_goal_page(console: Console) -> None:
    """The Approvals badge and the goals table follow pending calls live outside the inbox; a goal's page shows
    its waiting call inline, Approve there runs it, the confirmation stays until dismissed, and the
    ledger names each role's model."""
    page = await console.page()
    await page.wait_for_selector("#goals-body", timeout=WAIT_MS)
    gids = [await console.client.submit(f"Wipe disk {i} {GATED}") for i in range(3)]
    await page.wait_for_selector('#approval-count:not([hidden]):text-is("3")', timeout=WAIT_MS)
    assert page.url.endswith("#/")  # never visited the inbox
    for gid in gids:  # the table says the goal waits for a person, not "running 0/1"
        cell = page.locator(f'tr.goal-row[data-goal="{gid}"][data-waiting="1"] td.state-cell')
        await cell.wait_for(timeout=WAIT_MS)
        assert await cell.inner_text() == "waiting for approval"
    await console.shot(page, "goals-waiting")
    # One is decided elsewhere: the badge follows on the Submit page.
    await page.click("nav >> text=Submit")
    await page.wait_for_selector("#submit-form", timeout=WAIT_MS)
    assert await console.client.decide(gids[2], await pending_call(console.client, gids[2]), True, by="test")
    await page.wait_for_selector('#approval-count:text-is("2")', timeout=WAIT_MS)
    await console.shot(page, "badge-on-submit-page")
    # The goal page: the call inline, with its arguments and the buttons.
    gid = gids[0]
    await page.click('nav >> text=Goals')
    await page.click(f'tr.goal-row[data-goal="{gid}"] td.text a')
    card = page.locator("#goal-approvals .approval")
    await card.wait_for(timeout=WAIT_MS)
    assert await page.inner_text('[data-testid="goal-waiting"]') == "waiting for approval"
    assert await page.inner_text('[data-testid="goal-state"]') == "running"
    assert await card.locator(".tool").inner_text() == "wipe"
    assert '"target": "staging"' in await card.locator("pre.args").inner_text()
    text_px, room_px = await placeholder_room(page, "#goal-approvals input")
    assert text_px <= room_px, f"the reason placeholder needs {text_px:.0f} px, the input has {room_px:.0f} px"
    await console.shot(page, "waiting-call-inline")
    await card.locator('input[aria-label="reason"]').fill("looks right")
    await card.locator("button.approve").click()
    notice = page.locator(".flash", has_text="Approved: wipe")
    await notice.wait_for(timeout=WAIT_MS)
    assert gid[:12] in await notice.inner_text()
    await page.wait_for_selector('#approval-count:text-is("1")', timeout=WAIT_MS)
    await page.wait_for_selector('[data-testid="goal-state"].succeeded', timeout=WAIT_MS)
    # The ledger names the model each role's calls went to.
    for role in ("planner", "executor", "critic"):
        row = page.locator(f'#ledger tr:has(td:text-is("model · {role}"))')
        await row.locator('td:text-is("claude-test")').wait_for(timeout=WAIT_MS)
    assert await page.locator("#goal-approvals-panel").is_hidden()
    assert await page.locator('[data-testid="goal-waiting"]').count() == 0
    await asyncio.sleep(1.5)  # the page redrew since: the confirmation is still there
    assert await notice.is_visible()
    await console.shot(page, "approved-from-goal-page")
    await notice.locator("button.dismiss").click()
    assert await notice.count() == 0
    decided = [e.data for e in await console.client.log.read(gid) if e.type == "tool.approval_decided"]
    assert [(d["approved"], d["by"], d["reason"]) for d in decided] == [(True, "operator", "looks right")]
    await page.click("nav >> text=Goals")
    await page.wait_for_selector(f'tr.goal-row[data-goal="{gid}"][data-state="succeeded"]', timeout=WAIT_MS)
    assert await page.locator("tr.goal-row[data-waiting]").count() == 1


async def test_on_a_phone_the_inbox_and_goal_fit_and_approve_works(console: Console) -> None:
    """At 420 px nothing spills sideways, the header stays on screen, and a call is approved from the inbox
    whose row names the goal's id; the confirmation outlives the inbox's redraw."""
    text = f"Wipe the staging disk of the long-named reporting cluster in the eu-west region {GATED}"
    gid = await console.client.submit(text)
    twin = await console.client.submit("Check both things in order")
    page = await console.page(width=PHONE)
    await page.wait_for_selector(f'tr.goal-row[data-goal="{twin}"][data-state="succeeded"]', timeout=WAIT_MS)
    await assert_fits_the_screen(page)
    await page.wait_for_selector(f'tr.goal-row[data-goal="{gid}"][data-waiting="1"]', timeout=WAIT_MS)
    await console.shot(page, "phone-goals")
    await page.click("nav >> text=Approvals")
    row = page.locator(f'.approval[data-goal="{gid}"]')
    await row.wait_for(timeout=WAIT_MS)
    assert await row.locator(".goal-id").inner_text() == gid[:12]
    text_px, room_px = await placeholder_room(page, f'.approval[data-goal="{gid}"] input')
    assert text_px <= room_px, f"the reason placeholder needs {text_px:.0f} px, the input has {room_px:.0f} px"
    approve = row.locator("button.approve")
    box = await approve.bounding_box()
    assert box is not None and box["x"] + box["width"] <= PHONE
    await assert_fits_the_screen(page)
    await console.shot(page, "phone-inbox")
    await approve.click()
    await page.wait_for_selector("#inbox-empty", timeout=WAIT_MS)
    notice = page.locator(".flash", has_text="Approved: wipe")
    assert await notice.is_visible()
    await console.shot(page, "phone-approved")
    await page.goto(f"{console.url}#/goals/{gid}")
    await page.wait_for_selector('[data-testid="goal-state"].succeeded', timeout=WAIT_MS)
    await page.wait_for_selector('#event-rows tr[data-type="goal.state"]', timeout=WAIT_MS)
    await assert_fits_the_screen(page)
    await console.shot(page, "phone-goal")


async def test_an_ended_goal_says_why_and_what_was_accepted(console: Console) -> None:
    """A cancelled or budget-exhausted goal shows its reason and the task results accepted before it ended."""
    gid = await console.client.submit(f"First a, then wipe {AFTER_A} {GATED}")
    await pending_call(console.client, gid)  # task a was accepted; w waits for a person
    await console.client.cancel(gid, "the operator changed their mind")
    poor = await console.client.submit({"text": "Too big for its budget", "budget_tokens": 1})

    async def exhausted() -> bool:
        return (await console.client.get(poor)).state is GoalState.BUDGET_EXHAUSTED

    await eventually(exhausted, timeout=WAIT_MS / 1000)
    page = await console.page()
    await page.goto(f"{console.url}#/goals/{gid}")
    await page.wait_for_selector("#ended.cancelled", timeout=WAIT_MS)
    assert await page.inner_text("#end-reason") == "the operator changed their mind"
    accepted = page.locator('#accepted .accepted[data-task="a"]')
    await accepted.wait_for(timeout=WAIT_MS)
    assert await accepted.locator("pre").inner_text() == "result of a"
    assert await page.locator("#accepted .accepted").count() == 1  # w never ran
    assert "Not yet." not in await page.inner_text("#answer")
    await console.shot(page, "cancelled-goal")
    await page.goto(f"{console.url}#/goals/{poor}")
    await page.wait_for_selector("#ended.budget_exhausted", timeout=WAIT_MS)
    reason = (await console.client.get(poor)).reason
    assert reason and await page.inner_text("#end-reason") == reason
    assert await page.locator("#accepted-none").is_visible()
    await console.shot(page, "budget-exhausted-goal")


async def test_load_more_survives_live_events(idle_console: Console) -> None:
    """After "Load more" shows 53 goals, a new goal's event adds a row instead of cutting the list to 50."""
    c = idle_console
    first = [await c.client.submit(f"Goal number {i}") for i in range(53)]
    page = await c.page()
    await page.wait_for_selector("tr.goal-row", timeout=WAIT_MS)
    assert await page.locator("tr.goal-row").count() == 50
    await page.click("#more")
    await page.wait_for_selector(f'tr.goal-row[data-goal="{first[0]}"]', timeout=WAIT_MS)
    assert await page.locator("tr.goal-row").count() == 53
    newest = await c.client.submit("One more, arriving live")
    await page.wait_for_selector(f'tr.goal-row[data-goal="{newest}"]', timeout=WAIT_MS)
    await asyncio.sleep(0.5)  # a second redraw, if any, has happened
    assert await page.locator("tr.goal-row").count() == 54
    assert await page.locator(f'tr.goal-row[data-goal="{first[0]}"]').count() == 1
    assert await page.locator("#more").is_hidden()
    # Another live event re-reads all 54 rows in one full page: still nothing more to load.
    await c.client.cancel(first[1])
    await page.wait_for_selector(f'tr.goal-row[data-goal="{first[1]}"][data-state="cancelled"]', timeout=WAIT_MS)
    await asyncio.sleep(0.5)
    assert await page.locator("tr.goal-row").count() == 54
    assert await page.locator("#more").is_hidden()
    await c.shot(page, "after-load-more")


async def test_a_click_on_a_row_is_not_moved_by_a_goal_arriving_on_top(idle_console: Console) -> None:
    """A goal that arrives while a button is held down on a row does not move that row under the
    pointer: the table waits for the release, so the click opens the goal it was pressed on (the
    new row on top made the release land on another row, and the click was lost). A release
    anywhere else lets the waiting redraw happen."""
    c = idle_console
    first = await c.client.submit("The goal that is clicked")
    page = await c.page()
    row = page.locator(f'tr.goal-row[data-goal="{first}"]')
    await row.wait_for(timeout=WAIT_MS)

    async def press_on_first_row() -> None:
        box = await row.locator("td.age").bounding_box()
        assert box is not None
        await page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        await page.mouse.down()

    async def arrive(text: str) -> str:
        """A new goal, and the page's fetch of the goals list that follows its event."""
        async with page.expect_response(lambda r: "/v1/goals?" in r.url, timeout=WAIT_MS):
            gid = await c.client.submit(text)
        await asyncio.sleep(0.3)  # the redraw, had it not waited, is done
        return gid

    await press_on_first_row()
    second = await arrive("A goal arriving on top while the button is down")
    assert await page.locator(f'tr.goal-row[data-goal="{second}"]').count() == 0
    await page.mouse.up()
    await page.wait_for_selector("#goal-text", timeout=WAIT_MS)
    assert page.url.endswith(f"#/goals/{first}")

    await page.evaluate("location.hash = '#/'")
    await row.wait_for(timeout=WAIT_MS)
    await press_on_first_row()
    third = await arrive("Another one, released away from the table")
    await page.mouse.move(5, 5)
    await page.mouse.up()
    await page.locator(f'tr.goal-row[data-goal="{third}"]').wait_for(timeout=WAIT_MS)
    rows = await page.locator("tr.goal-row").evaluate_all("rs => rs.map(r => r.dataset.goal)")
    assert rows == [third, second, first]
    assert page.url.endswith("#/")


async def test_an_unknown_goal_says_so_and_stops(idle_console: Console) -> None:
    """A goal id that does not exist gets a plain "no such goal" page, and the console does not keep trying."""
    page = await idle_console.page(width=PHONE)
    missing = "0" * 32
    await page.goto(f"{idle_console.url}#/goals/{missing}")
    await page.wait_for_selector("#no-such-goal", timeout=WAIT_MS)
    assert missing in await page.inner_text("#no-such-goal")
    assert await page.locator("#goal-head, #dag, #events").count() == 0
    await asyncio.sleep(3)  # an EventSource would have failed and retried by now
    assert await page.inner_text("#live") not in ("reconnecting", "disconnected")
    await assert_fits_the_screen(page)
    await idle_console.shot(page, "no-such-goal")
    await page.click("#no-such-goal >> text=all goals")
    await page.wait_for_selector("#goals-body", timeout=WAIT_MS)


async def test_noscript_points_to_documentation_that_exists(idle_console: Console) -> None:
    """Without JavaScript the page names where the API is documented, and each link it gives answers 200."""
    context = await idle_console.browser.new_context(
        java_script_enabled=False, viewport={"width": PHONE, "height": 600}
    )
    page = await context.new_page()
    await page.goto(idle_console.url)
    note = page.locator("noscript p")
    assert await note.is_visible()
    assert "docs/api.md" in await note.inner_text()
    links = [await a.get_attribute("href") or "" for a in await page.locator("noscript a").all()]
    assert links
    async with httpx2.AsyncClient(base_url=idle_console.url, trust_env=False, timeout=10) as http:
        for link in links:
            assert (await http.get(link)).status_code == 200, link
    await idle_console.shot(page, "noscript")
    await context.close()


async def test_a_banner_says_when_no_worker_runs(idle_console: Console) -> None:
    """With no worker alive, every page shows a banner naming the roles nobody serves."""
    c = idle_console
    async with httpx2.AsyncClient(base_url=c.url, trust_env=False, timeout=10) as http:
        fleet_health = await http.get("/v1/fleet", headers={"Authorization": "Bearer token-viewer"})
    if fleet_health.status_code == 404:
        pytest.skip("GET /v1/fleet answers 404: this API has no fleet endpoint yet (the console shows no banner then)")
    assert fleet_health.status_code == 200 and fleet_health.json()["ok"] is False, fleet_health.text
    page = await c.page("viewer", width=PHONE)
    banner = page.locator("#fleet-banner")
    await banner.wait_for(timeout=WAIT_MS)
    assert "No planner, executor or critic worker is running: goals will not move." in await banner.inner_text()
    assert await banner.get_attribute("data-roles") == "planner executor critic"
    await assert_fits_the_screen(page)
    await c.shot(page, "no-worker-banner")
