"""The HTTP API over real HTTP (uvicorn on a loopback port) and a real Redis, with httpx2 as the caller."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx2
import pytest
from arq.connections import ArqRedis
from helpers import TASKLOOM, eventually, run_cli
from openapi_spec_validator import validate
from redis.asyncio import Redis

from bus.approvals import ApprovalBook, EarlierCall
from bus.client import Client
from bus.goal_index import BadCursor, GoalIndex
from bus.keys import Keys
from bus.schemas import Event, Goal, GoalRecord, GoalState, Plan, TaskSpec
from taskloom.api.app import ApiConfig, create_app
from taskloom.api.auth import TokenBook, TokenConfigError, entry_for, load_tokens, parse_tokens
from taskloom.api.openapi import document
from taskloom.api.server import ApiServer, bind

DOCS = Path(__file__).parent.parent / "docs"
TOKENS = {
    "reader": ("read",),
    "submitter": ("read", "submit"),
    "approver": ("read", "approve"),
    "boss": ("admin",),
    "writer": ("submit",),
}


@dataclass
class Api:
    url: str
    client: Client
    http: httpx2.AsyncClient

    def auth(self, name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer secret-{name}"}


@contextlib.asynccontextmanager
async def serving(client: Client, config: ApiConfig) -> AsyncIterator[str]:
    @contextlib.asynccontextmanager
    async def shared() -> AsyncIterator[Client]:
        yield client

    sock = bind("127.0.0.1", 0)
    server = ApiServer(create_app(shared, config))  # as `taskloom api` runs it
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await eventually(lambda: _true(server.started), timeout=20)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)
        sock.close()


async def _true(v: bool) -> bool:
    return v


@pytest.fixture
async def api(redis: ArqRedis, keys: Keys) -> AsyncIterator[Api]:
    book = TokenBook(parse_tokens(",".join(entry_for(n, s, f"secret-{n}") for n, s in TOKENS.items()), "test"))
    client = Client(redis, keys, default_budget_tokens=50_000)
    async with serving(client, ApiConfig(tokens=book, max_body=8192)) as url:
        async with httpx2.AsyncClient(base_url=url, timeout=20, trust_env=False) as http:
            yield Api(url, client, http)


def error_of(r: httpx2.Response) -> dict[str, Any]:
    assert r.headers["content-type"].startswith("application/json"), r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message", "field"}, body
    err: dict[str, Any] = body["error"]
    return err


# -- submit ------------------------------------------------------------------------------------


async def test_submit_with_idempotency_key_maps_to_the_goal_id(api: Api) -> None:
    """The same Idempotency-Key returns the same goal (201 then 200); another goal under it is a 409."""
    h = {**api.auth("submitter"), "Idempotency-Key": "order-42-refund"}
    first = await api.http.post("/v1/goals", json={"text": "refund order 42"}, headers=h)
    assert first.status_code == 201, first.text
    assert first.json() == {"goal_id": "order-42-refund", "created": True}
    again = await api.http.post("/v1/goals", json={"text": "refund order 42"}, headers=h)
    assert again.status_code == 200 and again.json() == {"goal_id": "order-42-refund", "created": False}
    other = await api.http.post("/v1/goals", json={"text": "something else"}, headers=h)
    assert other.status_code == 409 and error_of(other)["field"] == "Idempotency-Key"
    record = await api.client.get("order-42-refund")
    assert record.goal.text == "refund order 42" and record.budget_tokens == 50_000
    assert record.goal.review == "every_task" and record.goal.check is None
    checked = {"text": "check it", "review": "final_only", "check": {"pattern": "^ok"}}
    made = await api.http.post("/v1/goals", json=checked, headers=api.auth("submitter"))
    assert made.status_code == 201, made.text
    shown = (await api.http.get(f"/v1/goals/{made.json()['goal_id']}", headers=api.auth("reader"))).json()
    assert shown["goal"]["goal"]["review"] == "final_only" and shown["goal"]["goal"]["check"]["pattern"] == "^ok"
    bad = await api.http.post("/v1/goals", json={"text": "x"}, headers={**h, "Idempotency-Key": "no spaces!"})
    assert bad.status_code == 422 and error_of(bad)["field"] == "Idempotency-Key"


async def test_bad_input_gets_a_named_4xx_and_stores_nothing(api: Api, redis: ArqRedis, keys: Keys) -> None:
    """Invalid, malformed, oversized and wrongly typed bodies get JSON errors naming the field, never a 500."""
    h = api.auth("submitter")
    cases: list[tuple[dict[str, Any], int, str | None]] = [
        ({"json": {"definition_of_done": "x"}}, 422, "text"),
        ({"json": {"text": "   "}}, 422, "text"),
        ({"json": {"text": "x", "budget_tokens": "lots"}}, 422, "budget_tokens"),
        ({"json": {"text": "x", "budget_tokens": -5}}, 422, "budget_tokens"),
        ({"json": {"text": "x", "colour": "red"}}, 422, "colour"),
        ({"json": {"text": "x", "deadline": "2026-10-13T12:00:00"}}, 422, "deadline"),
        ({"json": ["text"]}, 422, None),
        ({"content": b"{not json", "headers": {"content-type": "application/json"}}, 422, None),
        ({"json": {"text": "x" * 9000}}, 413, None),
        ({"json": {"text": None}}, 422, "text"),
        ({"content": b"\xff\xfe{", "headers": {"content-type": "application/json"}}, 400, None),
        (
            {"content": b'{"text": "x", "budget_tokens": 1e999}', "headers": {"content-type": "application/json"}},
            422,
            "budget_tokens",
        ),
        ({"content": b"text=x", "headers": {"content-type": "application/x-www-form-urlencoded"}}, 415, "Content-Type"),
        ({"json": {"text": "x", "budget_tokens": True}}, 422, "budget_tokens"),
        ({"json": {"text": "x", "budget_tokens": "5000"}}, 422, "budget_tokens"),
        ({"json": {"text": "x", "metadata": {"k": 1}}}, 422, "metadata.k"),
        ({"json": {"text": "x", "review": "sometimes"}}, 422, "review"),
        ({"json": {"text": "x", "check": {"pattern": "("}}}, 422, "check.pattern"),
    ]
    for kwargs, status, fld in cases:
        headers = {**h, **kwargs.pop("headers", {})}
        r = await api.http.post("/v1/goals", headers=headers, **kwargs)
        assert r.status_code == status, (kwargs, r.text)
        err = error_of(r)
        assert err["field"] == fld, (kwargs, err)
        assert err["message"], err
    assert await redis.zcard(keys.goal_index()) == 0
    for path in ("/v1/goals/nope", "/v1/goals/bad%20id/plan", "/v1/goals/x/ledger"):
        r = await api.http.get(path, headers=api.auth("reader"))
        assert r.status_code == 404 and error_of(r)["type"] == "not_found", path
    r = await api.http.get("/v1/goals", params={"state": "bogus"}, headers=api.auth("reader"))
    assert r.status_code == 422 and error_of(r)["field"] == "state.0"
    r = await api.http.get("/v1/goals", params={"cursor": "%%%"}, headers=api.auth("reader"))
    assert r.status_code == 422 and error_of(r)["field"] == "cursor"
    r = await api.http.get("/v1/goals", params={"limit": 0}, headers=api.auth("reader"))
    assert r.status_code == 422 and error_of(r)["field"] == "limit"


# -- auth --------------------------------------------------------------------------------------


async def test_every_route_needs_a_token_with_the_right_scope(api: Api) -> None:
    """No token or an unknown one is 401; a token without the scope is 403; health probes are open."""
    gid = await api.client.submit("auth check")
    routes = [
        ("GET", "/v1/goals", "read"),
        ("GET", f"/v1/goals/{gid}", "read"),
        ("GET", "/v1/approvals", "read"),
        ("GET", "/metrics", "read"),
        ("POST", "/v1/goals", "submit"),
        ("POST", f"/v1/goals/{gid}/cancel", "submit"),
        ("POST", f"/v1/approvals/{gid}/call1/approve", "approve"),
        ("POST", f"/v1/approvals/{gid}/call1/deny", "approve"),
    ]
    for method, path, scope in routes:
        r = await api.http.request(method, path)
        assert r.status_code == 401 and error_of(r)["type"] == "unauthorized", (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        r = await api.http.request(method, path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401, path
        lacking = next(n for n, s in TOKENS.items() if scope not in s and "admin" not in s)
        r = await api.http.request(method, path, headers=api.auth(lacking), json={"text": "x"})
        assert r.status_code == 403, (path, lacking, r.text)
        assert scope in error_of(r)["message"]
    assert (await api.client.get(gid)).state is GoalState.SUBMITTED  # nothing above changed it
    for path in ("/healthz", "/readyz"):
        r = await api.http.get(path)
        assert r.status_code == 200 and r.json()["ok"] is True
    me = await api.http.get("/v1/me", headers=api.auth("approver"))
    assert me.json() == {"name": "approver", "scopes": ["approve", "read"]}


def test_token_entries_are_validated_and_stored_hashed(tmp_path: Path) -> None:
    """Malformed entries name the problem; only the SHA-256 of a token is kept; the file adds tokens."""
    with pytest.raises(TokenConfigError, match="NAME:SCOPE"):
        parse_tokens("ci:read:plaintext-secret", "TASKLOOM_API_TOKENS")
    with pytest.raises(TokenConfigError, match="unknown scope 'write'"):
        parse_tokens(entry_for("ci", ["write"], "t"), "TASKLOOM_API_TOKENS")
    with pytest.raises(TokenConfigError, match="appears twice"):
        parse_tokens(entry_for("ci", ["read"], "a") + "," + entry_for("ci", ["read"], "b"), "X")
    f = tmp_path / "tokens"
    f.write_text(f"# ops team\n{entry_for('ops', ['approve'], 'tok-ops')}\n")
    tokens = load_tokens(entry_for("ci", ["read", "submit"], "tok-ci"), f)
    assert all("tok-" not in h for h in tokens)
    book = TokenBook(tokens)
    ci, ops = book.check("tok-ci"), book.check("tok-ops")
    assert ci is not None and ci.allows("submit") and not ci.allows("approve")
    assert ops is not None and ops.name == "ops" and ops.allows("approve")
    assert book.check("tok-nobody") is None
    with pytest.raises(TokenConfigError, match="cannot read"):
        load_tokens("", tmp_path / "missing")


# -- reading -----------------------------------------------------------------------------------


async def test_list_filters_by_state_and_pages_with_a_cursor(api: Api) -> None:
    """Goals come newest first; a state filter and a cursor walk every match exactly once."""
    ids = [await api.client.submit(f"goal {i}") for i in range(7)]
    for gid in ids[::2]:
        await api.client.store.transition_goal(gid, GoalState.PLANNING)
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        r = await api.http.get("/v1/goals", params=params, headers=api.auth("reader"))
        assert r.status_code == 200, r.text
        seen += [g["id"] for g in r.json()["goals"]]
        cursor = r.json()["next_cursor"]
        pages += 1
        if cursor is None:
            break
        await api.client.submit("submitted meanwhile")  # never shifts a later page
    assert seen == ids[::-1]
    assert pages == 3
    r = await api.http.get("/v1/goals", params={"state": "planning"}, headers=api.auth("reader"))
    body = r.json()
    assert [g["id"] for g in body["goals"]] == ids[::2][::-1]
    assert {g["state"] for g in body["goals"]} == {"planning"}
    row = body["goals"][0]
    assert row["budget_tokens"] == 50_000 and row["spent_tokens"] == 0 and row["text"] == "goal 6"
    r = await api.http.get(
        "/v1/goals", params=[("state", "planning"), ("state", "submitted")], headers=api.auth("reader")
    )
    assert len(r.json()["goals"]) == 7 + 2  # two were submitted while paging


async def test_status_plan_ledger_and_attempts(api: Api) -> None:
    """A goal's status, its DAG as JSON and Mermaid, its ledger, and its tasks' attempts."""
    gid = await api.client.submit({"text": "plan me", "budget_tokens": 1234})
    await api.client.store.transition_goal(gid, GoalState.PLANNING)
    plan = Plan(
        tasks=[
            TaskSpec(id="a", title="first <b>", instructions="do a", definition_of_done="a done"),
            TaskSpec(id="b", title="second", instructions="do b", definition_of_done="b done", depends_on=["a"]),
        ]
    )
    await api.client.store.save_plan(gid, plan, 0, reason="first plan")
    h = api.auth("reader")
    status = (await api.http.get(f"/v1/goals/{gid}", headers=h)).json()
    assert status["goal"]["state"] == "planning" and status["plan"]["version"] == 1
    assert {t["task_id"]: t["state"] for t in status["tasks"]} == {"a": "pending", "b": "pending"}
    dag = (await api.http.get(f"/v1/goals/{gid}/plan", headers=h)).json()
    assert [t["id"] for t in dag["tasks"]] == ["a", "b"]
    assert dag["edges"] == [{"from": "a", "to": "b"}] and dag["ready"] == ["a"]
    assert dag["mermaid"].startswith("flowchart TD") and "t0 --> t1" in dag["mermaid"]
    books = (await api.http.get(f"/v1/goals/{gid}/ledger", headers=h)).json()
    assert books["budget"] == 1234 and books["spent"] == 0
    attempts = (await api.http.get(f"/v1/goals/{gid}/attempts", headers=h)).json()
    assert [(t["task_id"], t["title"], t["attempts"]) for t in attempts["tasks"]] == [
        ("a", "first <b>", []),
        ("b", "second", []),
    ]


async def _sse(
    api: Api, path: str, headers: dict[str, str], stop_after: int | None = None
) -> list[tuple[str, str, str]]:
    """(event, id, data) frames of an event stream until it ends (or `stop_after` frames)."""
    frames: list[tuple[str, str, str]] = []
    cur: dict[str, str] = {}
    async with api.http.stream("GET", path, headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line == "":
                if "data" in cur:
                    frames.append((cur.get("event", "message"), cur.get("id", ""), cur["data"]))
                    if stop_after is not None and len(frames) >= stop_after:
                        break
                cur = {}
            elif not line.startswith(":"):
                k, _, v = line.partition(":")
                cur[k] = v.lstrip()
    return frames


async def test_events_stream_resumes_after_last_event_id_and_ends_with_the_goal(api: Api) -> None:
    """SSE ids are stream positions; Last-Event-ID resumes after one; the stream ends when the goal ends."""
    gid = await api.client.submit("follow me")
    await api.client.store.transition_goal(gid, GoalState.PLANNING)
    h = api.auth("reader")
    first = await _sse(api, f"/v1/goals/{gid}/events", h, stop_after=2)
    assert [json.loads(d)["type"] for _, _, d in first] == ["goal.submitted", "goal.state"]
    assert first[0][1] == json.loads(first[0][2])["position"]

    async def cancel_soon() -> None:
        await asyncio.sleep(0.5)
        await api.client.cancel(gid)

    canceller = asyncio.create_task(cancel_soon())
    rest = await _sse(api, f"/v1/goals/{gid}/events", {**h, "Last-Event-ID": first[0][1]})
    await canceller
    assert [(e, json.loads(d).get("data", {}).get("state")) for e, _, d in rest] == [
        ("message", "planning"),
        ("message", "cancelled"),
        ("end", None),
    ]
    # EventSource sends no headers: the token may come as access_token, and `after` as a parameter.
    token = h["Authorization"].removeprefix("Bearer ")
    tail = await _sse(api, f"/v1/goals/{gid}/events?access_token={token}&after={rest[0][1]}", {})
    assert [e for e, _, _ in tail] == ["message", "end"]
    r = await api.http.get(f"/v1/goals/{gid}/events", headers={**h, "Last-Event-ID": "yesterday"})
    assert r.status_code == 422 and error_of(r)["field"] == "Last-Event-ID"


# -- approvals ---------------------------------------------------------------------------------


async def _ask(api: Api, text: str, call_id: str, tool: str = "wipe", earlier: Sequence[EarlierCall] = ()) -> str:
    """A goal whose task `t1` asks for approval of one call, as the executor records it."""
    gid = await api.client.submit(text)
    await api.client.store.transition_goal(gid, GoalState.PLANNING)
    spec = TaskSpec(id="t1", title="wipe the disk", instructions="x", definition_of_done="y")
    await api.client.store.save_plan(gid, Plan(tasks=[spec]), 0)
    event = Event(type="tool.approval_requested", goal_id=gid, task_id="t1", data={"call_id": call_id})
    book = ApprovalBook(api.client.redis, api.client.keys)
    assert await book.request(gid, call_id, "t1", 1, tool, {"target": "prod"}, event, earlier)
    assert not await book.request(gid, call_id, "t1", 1, tool, {"target": "prod"}, event)  # asked twice: once
    return gid


async def test_approvals_inbox_lists_across_goals_and_records_who_decided(api: Api) -> None:
    """Pending calls of every running goal, with tool, arguments and asker; a decision names its token."""
    g1 = await _ask(api, "first goal", "call-1")
    before = EarlierCall(attempt=1, call_id="call-0", input={"amount": 5}, outcome="ok", result="charged 5")
    g2 = await _ask(api, "second goal", "call-2", tool="charge", earlier=[before])
    g3 = await _ask(api, "cancelled goal", "call-3")
    await api.client.cancel(g3)
    inbox = (await api.http.get("/v1/approvals", headers=api.auth("reader"))).json()["approvals"]
    assert [(a["goal_id"], a["call_id"], a["tool"]) for a in inbox] == [
        (g1, "call-1", "wipe"),
        (g2, "call-2", "charge"),
    ]
    assert inbox[0]["arguments"] == {"target": "prod"} and inbox[0]["earlier"] == []
    # What already happened in the task travels with the request: the person deciding sees it.
    assert inbox[1]["earlier"] == [before.model_dump(mode="json")]
    assert (inbox[0]["goal_text"], inbox[0]["task_id"], inbox[0]["task_title"]) == ("first goal", "t1", "wipe the disk")

    r = await api.http.post(f"/v1/approvals/{g1}/call-1/approve", headers=api.auth("reader"))
    assert r.status_code == 403
    r = await api.http.post(f"/v1/approvals/{g1}/call-1/approve", headers=api.auth("approver"))
    assert r.status_code == 200 and r.json() == {"goal_id": g1, "call_id": "call-1", "approved": True, "by": "approver"}
    r = await api.http.post(f"/v1/approvals/{g1}/call-1/deny", headers=api.auth("boss"), json={"reason": "late"})
    assert r.status_code == 409 and error_of(r)["type"] == "conflict"
    r = await api.http.post(f"/v1/approvals/{g2}/call-2/deny", headers=api.auth("boss"), json={"reason": "too much"})
    assert r.status_code == 200 and r.json()["by"] == "boss"
    r = await api.http.post(f"/v1/approvals/{g2}/nope/deny", headers=api.auth("boss"))
    assert r.status_code == 404
    r = await api.http.post(f"/v1/approvals/{g2}/call-2/deny", headers=api.auth("boss"), json={"reason": 5})
    assert r.status_code == 422 and error_of(r)["field"] == "reason"

    audit = [e.data for gid in (g1, g2) for e in await api.client.log.read(gid) if e.type == "tool.approval_decided"]
    assert audit == [
        {"call_id": "call-1", "approved": True, "reason": "", "by": "approver"},
        {"call_id": "call-2", "approved": False, "reason": "too much", "by": "boss"},
    ]
    assert (await api.http.get("/v1/approvals", headers=api.auth("reader"))).json() == {"approvals": []}
    assert await api.client.redis.zcard(api.client.keys.approvals_pending()) == 0  # the cancelled one swept too


# -- operations --------------------------------------------------------------------------------


async def test_metrics_reuse_the_prometheus_registry(api: Api) -> None:
    """/metrics serves the workers' registry (queue depth, process) plus API request counts."""
    await api.http.get("/v1/goals", headers=api.auth("reader"))
    r = await api.http.get("/metrics", headers=api.auth("reader"))
    assert r.status_code == 200
    assert "taskloom_queue_depth" in r.text and "process_cpu_seconds_total" in r.text
    assert re.search(r'taskloom_api_requests_total\{method="GET",route="/v1/goals",status="200"\} \d', r.text)


def test_openapi_document_validates_and_matches_the_checked_in_copy() -> None:
    """The generated OpenAPI document is valid OpenAPI 3 and equals docs/openapi.json (regenerate if not)."""
    doc = document()
    validate(doc)
    checked_in = json.loads((DOCS / "openapi.json").read_text())
    assert doc == checked_in, "docs/openapi.json is stale: run `python -m taskloom.api.openapi > docs/openapi.json`"


# -- the process -------------------------------------------------------------------------------


def _start_api(env: dict[str, str], log: Path, *args: str) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    out = log.open("wb")
    proc = subprocess.Popen([*TASKLOOM, "api", "--port", "0", *args], env=env, stdout=out, stderr=subprocess.STDOUT)
    lines: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while not ("console" in lines and ("--open" not in args or "token" in lines)):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"no console line within 30 s: {log.read_text()}"
        time.sleep(0.05)
        lines.update(dict(re.findall(r"^(console|token|open): (\S+)$", log.read_text(), re.M)))
    return proc, lines


def test_api_process_killed_loses_nothing_and_registers_its_console(
    subprocess_env: dict[str, str], tmp_path: Path, redis_url: str, prefix: str
) -> None:
    """`taskloom api --open` prints a one-time token; a goal submitted through it survives a SIGKILL."""
    proc, lines = _start_api(subprocess_env, tmp_path / "api1.log", "--open")
    try:
        base = lines["console"].rstrip("/")
        assert lines["open"] == f"{lines['console']}#token={lines['token']}"
        h = {"Authorization": f"Bearer {lines['token']}"}
        with httpx2.Client(base_url=base, timeout=20, trust_env=False) as http:

            async def ready() -> bool:
                with contextlib.suppress(httpx2.TransportError):
                    return http.get("/readyz").status_code == 200
                return False

            asyncio.run(eventually(ready, timeout=30))
            r = http.post("/v1/goals", json={"text": "survive"}, headers={**h, "Idempotency-Key": "survivor"})
            assert r.status_code == 201, r.text
            registered = run_cli("status", "survivor", "--json", env=subprocess_env)
            assert json.loads(registered.stdout)["state"] == "submitted"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    proc2, lines2 = _start_api(
        {**subprocess_env, "TASKLOOM_API_TOKENS": entry_for("ci", ["read"], "ci-token")}, tmp_path / "api2.log"
    )
    try:
        with httpx2.Client(base_url=lines2["console"].rstrip("/"), timeout=20, trust_env=False) as http:
            r = http.get("/v1/goals/survivor", headers={"Authorization": "Bearer ci-token"})
            assert r.status_code == 200 and r.json()["goal"]["goal"]["text"] == "survive"
            r = http.get("/v1/goals/survivor", headers={"Authorization": f"Bearer {lines['token']}"})
            assert r.status_code == 401  # the one-time token died with its process

        async def url() -> str | None:
            from bus.connection import connect
            from bus.consoles import console_url

            async with connect(redis_url, tmp_path) as redis:
                return await console_url(redis, Keys(prefix=prefix))

        assert asyncio.run(url()) == lines2["console"]
        # `taskloom run` points at the goal in that console (no workers here: it gives up after 1 s).
        ran = run_cli("run", "hello", "--timeout", "1", env=subprocess_env)
        assert re.search(rf"^console: {re.escape(lines2['console'])}#/goals/[0-9a-f]{{32}}$", ran.stdout, re.M), ran
    finally:
        proc2.send_signal(signal.SIGTERM)
        assert proc2.wait(20) == 0, (tmp_path / "api2.log").read_text()


def test_api_refuses_to_start_open_without_tokens_or_on_a_public_address(subprocess_env: dict[str, str]) -> None:
    """No tokens and no flag, --insecure-local off loopback, or a bad token entry: exit 2 with the reason."""
    r = run_cli("api", "--port", "0", env=subprocess_env)
    assert r.returncode == 2 and "no API tokens" in r.stderr
    r = run_cli("api", "--port", "0", "--insecure-local", "--host", "0.0.0.0", env=subprocess_env)
    assert r.returncode == 2 and "loopback" in r.stderr
    r = run_cli("api", "--port", "0", env={**subprocess_env, "TASKLOOM_API_TOKENS": "ci:read:abc"})
    assert r.returncode == 2 and "TASKLOOM_API_TOKENS" in r.stderr
    r = run_cli("api-token", "ci", "--scope", "read", "--scope", "submit", env=subprocess_env)
    token, entry = re.findall(r"^(?:token|entry): (\S+)$", r.stdout, re.M)
    assert entry == entry_for("ci", ["read", "submit"], token)


async def test_goal_pages_never_repeat_or_skip_goals_submitted_in_the_same_instant(redis: ArqRedis, keys: Keys) -> None:
    """Goals with one submission time are paged in a stable order by id, each exactly once."""
    same = datetime(2026, 10, 13, 12, 0, tzinfo=UTC)
    store = Client(redis, keys, 1000).store
    for gid in ("g-c", "g-a", "g-e", "g-b", "g-d"):
        await store.create_goal(GoalRecord(id=gid, goal=Goal(text=gid), budget_tokens=1, created_at=same))
    index = GoalIndex(redis, keys)
    seen: list[str] = []
    cursor = None
    while True:
        page = await index.page(cursor=cursor, limit=2)
        seen += page.ids
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == ["g-e", "g-d", "g-c", "g-b", "g-a"]
    # A page that ends at the last goal says there is no more, full or not (no empty page to fetch).
    assert (await index.page(limit=5)).next_cursor is None
    assert (await index.page(limit=4)).next_cursor is not None
    last = await index.page(cursor=(await index.page(limit=4)).next_cursor, limit=1)
    assert last.ids == ["g-a"] and last.next_cursor is None
    with pytest.raises(BadCursor):
        await index.page(cursor="bm90IGEgY3Vyc29y")


async def test_a_chunked_body_over_the_limit_is_refused(api: Api, redis: ArqRedis, keys: Keys) -> None:
    """A body without Content-Length is counted as it arrives and refused with 413 past the limit."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"text": "'
        for _ in range(20):
            yield b"x" * 1000
        yield b'"}'

    r = await api.http.post("/v1/goals", content=chunks(), headers=api.auth("submitter"))
    assert r.status_code == 413 and error_of(r)["type"] == "payload_too_large"
    assert await redis.zcard(keys.goal_index()) == 0


async def test_a_client_that_leaves_an_event_stream_stops_its_redis_reads(redis_url: str, keys: Keys) -> None:
    """When the reader of an event stream disconnects, the server stops reading the stream for it."""
    name = f"tl-sse-{uuid.uuid4().hex[:8]}"  # only this server's connections carry it (Redis may be shared)
    own = Redis.from_url(redis_url, client_name=name)
    book = TokenBook(parse_tokens(entry_for("reader", ["read"], "secret-reader"), "test"))

    async def blocked_reads() -> int:
        clients = await own.client_list()
        return sum(1 for c in clients if c.get("name") == name and "b" in c.get("flags", ""))  # b: XREAD BLOCK

    try:
        async with serving(Client(own, keys, 1000), ApiConfig(tokens=book)) as url:  # type: ignore[arg-type]
            async with httpx2.AsyncClient(base_url=url, timeout=20, trust_env=False) as http:
                for _ in range(3):
                    async with http.stream("GET", "/v1/events", headers={"Authorization": "Bearer secret-reader"}) as r:
                        assert r.status_code == 200
                        lines = r.aiter_lines()
                        assert await anext(lines) == "retry: 2000"

                        async def reading() -> bool:
                            return await blocked_reads() == 1

                        await eventually(reading, timeout=15)  # the server waits on Redis for this client

                async def released() -> bool:
                    return await blocked_reads() == 0

                await eventually(released, timeout=15)
                r = await http.get("/metrics", headers={"Authorization": "Bearer secret-reader"})
                assert 'taskloom_api_requests_total{method="GET",route="/v1/events",status="200"}' in r.text
    finally:
        await own.aclose()


async def test_redis_unreachable_is_a_503_not_a_500(keys: Keys) -> None:
    """With Redis gone, readiness fails and every request gets a JSON 503 with Retry-After."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a port nobody listens on: bound, never listening (connections are refused)
    dead = Redis.from_url(f"redis://127.0.0.1:{sock.getsockname()[1]}", socket_connect_timeout=1, socket_timeout=1)
    book = TokenBook(parse_tokens(entry_for("boss", ["admin"], "secret-boss"), "test"))
    try:
        async with serving(Client(dead, keys, 1000), ApiConfig(tokens=book)) as url:  # type: ignore[arg-type]
            async with httpx2.AsyncClient(base_url=url, timeout=20, trust_env=False) as http:
                assert (await http.get("/healthz")).status_code == 200
                r = await http.get("/readyz")
                assert r.status_code == 503 and r.json()["ok"] is False
                h = {"Authorization": "Bearer secret-boss"}
                for r in (
                    await http.get("/v1/goals", headers=h),
                    await http.post("/v1/goals", json={"text": "x"}, headers=h),
                ):
                    assert r.status_code == 503 and error_of(r)["type"] == "unavailable", r.text
                    assert r.headers["retry-after"] == "2"
    finally:
        await dead.aclose()
        sock.close()


async def test_insecure_local_needs_no_token_but_refuses_other_origins(redis: ArqRedis, keys: Keys) -> None:
    """--insecure-local lets loopback callers in with every scope, but not a foreign page or a rebound host."""
    async with serving(Client(redis, keys, 1000), ApiConfig(insecure_local=True)) as url:
        async with httpx2.AsyncClient(base_url=url, timeout=20, trust_env=False) as http:
            me = await http.get("/v1/me")
            assert me.json() == {"name": "local", "scopes": ["admin", "approve", "read", "submit"]}
            r = await http.post("/v1/goals", json={"text": "from curl"})
            assert r.status_code == 201
            host = url.removeprefix("http://")
            r = await http.post("/v1/goals", json={"text": "same page"}, headers={"Origin": f"http://{host}"})
            assert r.status_code == 201
            r = await http.post("/v1/goals", json={"text": "evil"}, headers={"Origin": "https://evil.example"})
            assert r.status_code == 403 and error_of(r)["type"] == "forbidden"
            r = await http.get("/v1/goals", headers={"Host": "evil.example"})
            assert r.status_code == 403
    assert await redis.zcard(keys.goal_index()) == 2


async def test_goals_carry_a_tenant_and_dollar_budget_and_tenants_are_readable(api: Api) -> None:
    """POST /v1/goals takes `tenant` and `budget_usd`; GET /v1/tenants/{name} shows the tenant's pool;
    a bad tenant name is a named 422."""
    await api.client.tenant_set("acme", period="day", budget_usd=3)
    r = await api.http.post(
        "/v1/goals", json={"text": "t", "tenant": "acme", "budget_usd": 0.5}, headers=api.auth("submitter")
    )
    assert r.status_code == 201, r.text
    record = await api.client.get(r.json()["goal_id"])
    assert (record.goal.tenant, record.goal.budget_usd) == ("acme", 0.5)
    books = await api.client.ledger.snapshot(record.id)
    assert books.budget_micro_usd == 500_000
    view = (await api.http.get("/v1/tenants/acme", headers=api.auth("reader"))).json()
    assert view["settings"]["period"] == "day" and view["settings"]["budget_usd"] == 3
    bad = await api.http.get("/v1/tenants/a:b", headers=api.auth("reader"))
    assert bad.status_code == 422 and "tenant name" in error_of(bad)["message"]
    bad_goal = await api.http.post("/v1/goals", json={"text": "t", "tenant": "a b"}, headers=api.auth("submitter"))
    assert bad_goal.status_code == 422 and error_of(bad_goal)["field"] == "tenant"


# -- issue 29: exact answers under concurrency, strict types, clean shutdown, fleet health -------------


async def test_of_parallel_submits_under_one_key_exactly_one_is_created(api: Api, redis: ArqRedis, keys: Keys) -> None:
    """20 parallel POSTs with one Idempotency-Key and body: one 201 `created: true`, 19 200 `created: false`."""
    h = {**api.auth("submitter"), "Idempotency-Key": "race-1"}
    answers = await asyncio.gather(
        *(api.http.post("/v1/goals", json={"text": "only once"}, headers=h) for _ in range(20))
    )
    outcomes = sorted((r.status_code, r.json()["created"]) for r in answers)
    assert outcomes == [(200, False)] * 19 + [(201, True)], [r.text for r in answers]
    assert {r.json()["goal_id"] for r in answers} == {"race-1"}
    assert await redis.zcard(keys.goal_index()) == 1


async def test_request_bodies_are_strictly_typed(api: Api, redis: ArqRedis, keys: Keys) -> None:
    """A boolean or a numeric string for a number, a number for a string or a date: 422 naming the field."""
    h = api.auth("submitter")
    wrong: list[tuple[dict[str, Any], str]] = [
        ({"text": "x", "budget_tokens": True}, "budget_tokens"),
        ({"text": "x", "budget_tokens": "5000"}, "budget_tokens"),
        ({"text": "x", "budget_usd": "0.5"}, "budget_usd"),
        ({"text": "x", "budget_usd": False}, "budget_usd"),
        ({"text": 5}, "text"),
        ({"text": "x", "tenant": 7}, "tenant"),
        ({"text": "x", "deadline": 1760356800}, "deadline"),
        ({"text": "x", "deadline": "1760356800"}, "deadline"),
        ({"text": "x", "allowed_tools": [1]}, "allowed_tools.0"),
        ({"text": "x", "metadata": {"k": True}}, "metadata.k"),
        ({"text": "x", "model": 5}, "model"),
    ]
    for body, fld in wrong:
        r = await api.http.post("/v1/goals", json=body, headers=h)
        assert r.status_code == 422, (body, r.text)
        assert error_of(r)["field"] == fld, (body, r.text)
    assert await redis.zcard(keys.goal_index()) == 0
    good = {"text": "x", "budget_tokens": 5000, "budget_usd": 2, "deadline": "2030-10-13T12:00:00Z", "model": "fast"}
    r = await api.http.post("/v1/goals", json=good, headers=h)
    assert r.status_code == 201, r.text
    record = await api.client.get(r.json()["goal_id"])
    assert (record.budget_tokens, record.goal.budget_usd, record.goal.deadline, record.goal.model) == (
        5000,
        2.0,
        datetime(2030, 10, 13, 12, tzinfo=UTC),
        "fast",
    )
    r = await api.http.post(f"/v1/goals/{record.id}/cancel", json={"reason": 5}, headers=h)
    assert r.status_code == 422 and error_of(r)["field"] == "reason"
    r = await api.http.post("/v1/approvals/g/c/deny", json={"reason": True}, headers=api.auth("approver"))
    assert r.status_code == 422 and error_of(r)["field"] == "reason"


async def test_a_body_not_sent_as_json_is_a_415_naming_content_type(api: Api, redis: ArqRedis, keys: Keys) -> None:
    """Form-encoded or text/plain bodies (curl -d) get 415 naming Content-Type and application/json."""
    gid = await api.client.submit("cancel me")
    posts = [
        ("/v1/goals", "submitter"),
        (f"/v1/goals/{gid}/cancel", "submitter"),
        (f"/v1/approvals/{gid}/c1/approve", "approver"),
        (f"/v1/approvals/{gid}/c1/deny", "approver"),
    ]
    for path, who in posts:
        for ctype in ("application/x-www-form-urlencoded", "text/plain"):
            r = await api.http.post(path, content=b'{"text": "x"}', headers={**api.auth(who), "Content-Type": ctype})
            assert r.status_code == 415, (path, ctype, r.text)
            err = error_of(r)
            assert (err["type"], err["field"]) == ("unsupported_media_type", "Content-Type"), err
            assert "application/json" in err["message"] and ctype in err["message"], err
    assert await redis.zcard(keys.goal_index()) == 1 and (await api.client.get(gid)).state is GoalState.SUBMITTED
    for ctype in ("application/json; charset=utf-8", "application/merge-patch+json"):
        r = await api.http.post(
            "/v1/goals", content=b'{"text": "x"}', headers={**api.auth("submitter"), "Content-Type": ctype}
        )
        assert r.status_code == 201, (ctype, r.text)
    r = await api.http.post(f"/v1/goals/{gid}/cancel", headers=api.auth("submitter"))  # no body: no type needed
    assert r.status_code == 200, r.text


def _raw_http(url: str, request: bytes, then: bytes = b"", wait: float = 0) -> tuple[bytes, bool, float]:
    """Send `request` on a fresh connection (and `then` after `wait` s); the whole answer, whether the
    server closed the connection after it, and the seconds it took."""
    host, port = url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(request)
        if then:
            time.sleep(wait)
            sock.sendall(then)
        data = b""
        while chunk := sock.recv(65536):  # b"": the server closed the connection
            data += chunk
        return data, True, time.monotonic() - started


def _json_answer(raw: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


async def test_a_request_the_server_cannot_parse_gets_the_json_error_shape(api: Api) -> None:
    """`Content-Length: abc` and a malformed header line are answered 400 in JSON, and the connection closed."""
    cases = [
        (b"POST /v1/goals HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", "Content-Length"),
        (b"GET /v1/goals HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", None),
    ]
    for request, fld in cases:
        raw, closed, _ = await asyncio.to_thread(_raw_http, api.url, request)
        status, headers, body = _json_answer(raw)
        assert status == 400 and headers["content-type"] == "application/json" and closed, raw
        assert set(body) == {"error"} and body["error"]["type"] == "invalid_request", body
        assert body["error"]["field"] == fld and "malformed HTTP request" in body["error"]["message"], body


async def test_a_body_that_never_arrives_times_out_with_408(redis: ArqRedis, keys: Keys) -> None:
    """A body shorter than its Content-Length is answered 408 in JSON after the body timeout, connection closed."""
    book = TokenBook(parse_tokens(entry_for("submitter", ["submit"], "secret-submitter"), "test"))
    async with serving(Client(redis, keys, 1000), ApiConfig(tokens=book, body_timeout=0.5)) as url:
        head = b"POST /v1/goals HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer secret-submitter\r\n"
        head += b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        raw, closed, took = await asyncio.to_thread(_raw_http, url, head + b'{"text": "x')
        status, headers, body = _json_answer(raw)
        assert status == 408 and closed and headers["connection"] == "close", raw
        assert body["error"]["type"] == "request_timeout" and "TASKLOOM_API_BODY_TIMEOUT" in body["error"]["message"]
        assert 0.5 <= took < 5, took
        # A body that arrives in pieces, within the timeout, is read whole.
        rest = b'", "budget_tokens": 700}'
        raw, _, _ = await asyncio.to_thread(
            _raw_http,
            url,
            head.replace(b"Content-Length: 100", f"Content-Length: {11 + len(rest)}".encode())
            .replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n")
            + b'{"text": "x',
            rest,
            0.2,
        )
        assert _json_answer(raw)[0] == 201, raw
    assert await redis.zcard(keys.goal_index()) == 1


async def test_cancelling_a_goal_that_already_ended_is_409_whatever_ended_it(api: Api) -> None:
    """The first cancel answers 200; cancelling any ended goal, cancelled included, answers 409."""
    h = api.auth("submitter")
    gid = await api.client.submit("cancel twice")
    first = await api.http.post(f"/v1/goals/{gid}/cancel", headers=h)
    assert first.status_code == 200 and first.json() == {"goal_id": gid, "changed": True}
    again = await api.http.post(f"/v1/goals/{gid}/cancel", headers=h, json={"reason": "again"})
    assert again.status_code == 409 and error_of(again)["type"] == "conflict"
    assert "already ended (cancelled)" in error_of(again)["message"]
    ends = {
        GoalState.SUCCEEDED: [GoalState.PLANNING, GoalState.RUNNING, GoalState.REVIEWING, GoalState.SUCCEEDED],
        GoalState.FAILED: [GoalState.FAILED],
        GoalState.BUDGET_EXHAUSTED: [GoalState.BUDGET_EXHAUSTED],
    }
    for end, path in ends.items():
        g = await api.client.submit(f"ends {end.value}")
        for state in path:
            await api.client.store.transition_goal(g, state)
        r = await api.http.post(f"/v1/goals/{g}/cancel", headers=h)
        assert r.status_code == 409 and f"already ended ({end.value})" in error_of(r)["message"], r.text
        assert (await api.client.get(g)).state is end


async def test_fleet_shows_live_workers_queue_depths_and_the_longest_wait(
    api: Api, redis: ArqRedis, keys: Keys
) -> None:
    """GET /v1/fleet: per role live workers, queue depth and oldest due job not running; ok once every role lives."""
    from bus import fleet

    r = await api.http.get("/v1/fleet")
    assert r.status_code == 401
    empty = (await api.http.get("/v1/fleet", headers=api.auth("reader"))).json()
    assert set(empty) == {"ok", "roles", "checked_at", "redis"} and empty["ok"] is False
    assert empty["redis"]["role"] == "master" and empty["redis"]["memory_full"] is False
    assert empty["roles"] == [
        {"role": role, "live_workers": 0, "queue_depth": 0, "oldest_queued_age_s": None}
        for role in ("planner", "executor", "critic")
    ]
    checked = datetime.fromisoformat(empty["checked_at"])
    assert checked.utcoffset() is not None and checked.utcoffset().total_seconds() == 0  # type: ignore[union-attr]
    assert abs((datetime.now(UTC) - checked).total_seconds()) < 60

    await fleet.beat(redis, keys, ["planner", "executor"], "host-a:1", 30)
    await fleet.beat(redis, keys, ["executor"], "host-b:2", 30)
    await fleet.beat(redis, keys, ["critic"], "host-c:3", -1)  # a beat already stale: a dead worker
    now = fleet.now_ms()
    queue = keys.queue("executor")
    await redis.zadd(queue, {"running-job": now - 60_000, "waiting-job": now - 4_000, "deferred-job": now + 60_000})
    await redis.set("arq:in-progress:running-job", b"1", px=30_000)  # arq's mark of a job a worker runs
    try:
        view = (await api.http.get("/v1/fleet", headers=api.auth("reader"))).json()
    finally:
        await redis.delete("arq:in-progress:running-job")
    roles = {row["role"]: row for row in view["roles"]}
    assert view["ok"] is False  # the critic's only worker is dead
    assert (roles["planner"]["live_workers"], roles["executor"]["live_workers"], roles["critic"]["live_workers"]) == (
        1,
        2,
        0,
    )
    assert roles["executor"]["queue_depth"] == 3
    assert 3.5 < roles["executor"]["oldest_queued_age_s"] < 30  # the waiting job, not the running or deferred one
    assert roles["planner"]["oldest_queued_age_s"] is None
    await fleet.beat(redis, keys, ["critic"], "host-c:3", 30)
    assert (await api.http.get("/v1/fleet", headers=api.auth("reader"))).json()["ok"] is True


async def test_fleet_says_when_redis_memory_is_full(api: Api, redis: ArqRedis, keys: Keys) -> None:
    """With Redis past its maxmemory under noeviction (every write refused), /v1/fleet says so and is not ok,
    even with a live worker per role."""
    from bus import fleet

    await fleet.beat(redis, keys, ["planner", "executor", "critic"], "host-a:1", 30)
    before = await redis.config_get("maxmemory*")
    await redis.config_set("maxmemory-policy", "noeviction")
    await redis.config_set("maxmemory", "1")
    try:
        view = (await api.http.get("/v1/fleet", headers=api.auth("reader"))).json()
    finally:
        await redis.config_set("maxmemory", before["maxmemory"])
        await redis.config_set("maxmemory-policy", before["maxmemory-policy"])
    assert view["redis"]["memory_full"] is True and view["redis"]["maxmemory"] == 1
    assert view["ok"] is False and all(r["live_workers"] == 1 for r in view["roles"])
    assert (await api.http.get("/v1/fleet", headers=api.auth("reader"))).json()["ok"] is True


async def test_readyz_can_require_a_live_worker_per_role(redis: ArqRedis, keys: Keys) -> None:
    """/readyz ignores workers by default; with ready_requires_workers it is 503 naming each role without one."""
    from bus import fleet

    client = Client(redis, keys, 1000)
    async with serving(client, ApiConfig(insecure_local=True)) as url:
        async with httpx2.AsyncClient(base_url=url, timeout=20, trust_env=False) as http:
            r = await http.get("/readyz")
            assert r.status_code == 200 and r.json() == {"ok": True, "reasons": []}
    async with serving(client, ApiConfig(insecure_local=True, ready_requires_workers=True)) as url:
        async with httpx2.AsyncClient(base_url=url, timeout=20, trust_env=False) as http:
            await fleet.beat(redis, keys, ["planner", "critic"], "host-a:1", 30)
            r = await http.get("/readyz")
            assert r.status_code == 503 and r.json() == {"ok": False, "reasons": ["no live executor worker"]}
            await fleet.beat(redis, keys, ["executor"], "host-a:1", 30)
            assert (await http.get("/readyz")).status_code == 200


def test_help_names_the_api_extra(subprocess_env: dict[str, str]) -> None:
    """`taskloom --help` and `taskloom api --help` print `pip install 'taskloom[api]'` (no markup eats it)."""
    env = {**subprocess_env, "COLUMNS": "200"}  # no wrapping inside the phrase
    for args in (("--help",), ("api", "--help")):
        r = run_cli(*args, env=env)
        assert r.returncode == 0 and "pip install 'taskloom[api]'" in r.stdout, r.stdout


def _frames(lines: list[str]) -> list[dict[str, str]]:
    frames, cur = [], {}
    for line in lines:
        if line == "":
            if cur:
                frames.append(cur)
            cur = {}
        elif not line.startswith(":"):
            k, _, v = line.partition(":")
            cur[k] = v.lstrip()
    return frames


def test_sigterm_ends_open_event_streams_with_a_shutdown_frame_and_exits_within_2_s(
    subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """SIGTERM with two event streams open: each ends with `retry` + `event: shutdown`; exit 0 in 2 s, no error."""
    env = {**subprocess_env, "TASKLOOM_API_TOKENS": entry_for("ci", ["admin"], "ci-token")}
    log = tmp_path / "api.log"
    proc, lines = _start_api(env, log)
    h = {"Authorization": "Bearer ci-token"}
    base = lines["console"].rstrip("/")
    try:
        with httpx2.Client(base_url=base, timeout=20, trust_env=False) as http:
            gid = http.post("/v1/goals", json={"text": "followed"}, headers=h).json()["goal_id"]
        received: dict[str, list[str]] = {}

        async def follow(path: str, opened: asyncio.Event) -> None:
            async with httpx2.AsyncClient(base_url=base, timeout=20, trust_env=False) as http:
                async with http.stream("GET", path, headers=h) as r:
                    assert r.status_code == 200
                    got = received.setdefault(path, [])
                    async for line in r.aiter_lines():
                        got.append(line)
                        if line == "" and len(got) > 1:
                            opened.set()  # the opening `retry: 2000` frame arrived: the stream is open

        async def scenario() -> float:
            paths = ["/v1/events", f"/v1/goals/{gid}/events"]
            opened = [asyncio.Event() for _ in paths]
            readers = [asyncio.create_task(follow(p, o)) for p, o in zip(paths, opened, strict=True)]
            for o in opened:
                await asyncio.wait_for(o.wait(), 20)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(*readers), 10)  # each stream ends by itself
            await asyncio.to_thread(proc.wait, 10)
            return time.monotonic() - started

        took = asyncio.run(scenario())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    output = log.read_text()
    assert proc.returncode == 0, output
    assert took < 2, (took, output)
    for path, got in received.items():
        last = _frames(got)[-1]
        assert last == {"retry": "1000", "event": "shutdown", "data": '{"reconnect": true}'}, (path, got)
    assert not [line for line in output.splitlines() if '"level": "error"' in line or "Traceback" in line], output


def test_api_settings_reach_the_server(subprocess_env: dict[str, str], tmp_path: Path) -> None:
    """`taskloom api` honours TASKLOOM_API_READY_REQUIRES_WORKERS (503, no workers) and TASKLOOM_API_BODY_TIMEOUT."""
    env = {
        **subprocess_env,
        "TASKLOOM_API_TOKENS": entry_for("ci", ["admin"], "ci-token"),
        "TASKLOOM_API_READY_REQUIRES_WORKERS": "true",
        "TASKLOOM_API_BODY_TIMEOUT": "0.5",
    }
    proc, lines = _start_api(env, tmp_path / "api.log")
    try:
        base = lines["console"].rstrip("/")
        with httpx2.Client(base_url=base, timeout=20, trust_env=False) as http:
            r = http.get("/readyz")
            assert r.status_code == 503 and r.json()["reasons"] == [
                f"no live {role} worker" for role in ("planner", "executor", "critic")
            ], r.text
        head = b"POST /v1/goals HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ci-token\r\nContent-Length: 50\r\n\r\n{"
        raw, _, took = _raw_http(base, head)
        assert _json_answer(raw)[0] == 408 and took < 5, (raw, took)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, (tmp_path / "api.log").read_text()


async def test_a_goal_may_name_only_a_configured_model_alias(redis: ArqRedis, keys: Keys) -> None:
    """With the models file's aliases known to the API, `model` must be one of them: another is a 422
    naming the field and the aliases, and nothing is stored."""
    book = TokenBook(parse_tokens(entry_for("submitter", ("read", "submit"), "secret-submitter"), "test"))
    client = Client(redis, keys, default_budget_tokens=50_000)
    config = ApiConfig(tokens=book, model_aliases=frozenset({"fast", "strong"}))
    async with serving(client, config) as url, httpx2.AsyncClient(base_url=url, timeout=20, trust_env=False) as http:
        h = {"Authorization": "Bearer secret-submitter"}
        bad = await http.post("/v1/goals", json={"text": "x", "model": "cheap"}, headers=h)
        assert bad.status_code == 422, bad.text
        err = error_of(bad)
        assert err["field"] == "model" and "'cheap'" in err["message"] and "fast, strong" in err["message"]
        good = await http.post("/v1/goals", json={"text": "x", "model": "fast"}, headers=h)
        assert good.status_code == 201, good.text
        assert (await client.get(good.json()["goal_id"])).goal.model == "fast"
        assert await redis.zcard(keys.goal_index()) == 1
