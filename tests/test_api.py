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
from collections.abc import AsyncIterator
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

from bus.approvals import ApprovalBook
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


async def _ask(api: Api, text: str, call_id: str, tool: str = "wipe") -> str:
    """A goal whose task `t1` asks for approval of one call, as the executor records it."""
    gid = await api.client.submit(text)
    await api.client.store.transition_goal(gid, GoalState.PLANNING)
    spec = TaskSpec(id="t1", title="wipe the disk", instructions="x", definition_of_done="y")
    await api.client.store.save_plan(gid, Plan(tasks=[spec]), 0)
    event = Event(type="tool.approval_requested", goal_id=gid, task_id="t1", data={"call_id": call_id})
    book = ApprovalBook(api.client.redis, api.client.keys)
    assert await book.request(gid, call_id, "t1", 1, tool, {"target": "prod"}, event)
    assert not await book.request(gid, call_id, "t1", 1, tool, {"target": "prod"}, event)  # asked twice: once
    return gid


async def test_approvals_inbox_lists_across_goals_and_records_who_decided(api: Api) -> None:
    """Pending calls of every running goal, with tool, arguments and asker; a decision names its token."""
    g1 = await _ask(api, "first goal", "call-1")
    g2 = await _ask(api, "second goal", "call-2", tool="charge")
    g3 = await _ask(api, "cancelled goal", "call-3")
    await api.client.cancel(g3)
    inbox = (await api.http.get("/v1/approvals", headers=api.auth("reader"))).json()["approvals"]
    assert [(a["goal_id"], a["call_id"], a["tool"]) for a in inbox] == [
        (g1, "call-1", "wipe"),
        (g2, "call-2", "charge"),
    ]
    assert inbox[0]["arguments"] == {"target": "prod"}
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
