"""MCP servers as tool sources: the demo support-desk server over real stdio and HTTP, every call
through the executor's gateway (validation, timeout, isError, crashes, hangs, list_changed)."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mcp_types as mt
import pytest
import structlog
from helpers import demo_mcp_http, eventually, mcp_log, run_cli

from executor.gateway import ToolGateway
from executor.registry import ToolLoadError, ToolRegistry
from executor.sources.base import ToolContext
from executor.sources.catalog import Catalog
from executor.sources.mcp import (
    McpConfigError,
    McpSource,
    ServerConfig,
    ServerUnavailable,
    ToolOverride,
    load_config,
    policy_flags,
    safe_url,
)
from executor.sources.toolkit import ToolkitSource
from executor.toolkit import Toolkit
from llm.types import ToolUseBlock

REPO = Path(__file__).parent.parent


def stdio_config(*args: str, **extra: Any) -> ServerConfig:
    return ServerConfig(command=sys.executable, args=["-m", "executor.demo_mcp", *args], cwd=str(REPO), **extra)


def ctx(call_id: str = "c1") -> ToolContext:
    return ToolContext(goal_id="g1", task_id="t1", attempt=1, step=0, call_id=call_id)


@asynccontextmanager
async def gateway_on(*sources: Any, timeout: float = 30.0) -> AsyncIterator[tuple[ToolGateway, Catalog]]:
    catalog = Catalog(list(sources))
    async with catalog:
        registry = await catalog.start()
        yield ToolGateway(registry, registry.names(), default_timeout=timeout), catalog


async def call(gw: ToolGateway, name: str, args: dict[str, Any], call_id: str = "c1") -> Any:
    return await gw.run(ToolUseBlock(id=call_id, name=name, input=args), ctx(call_id))


# -- configuration and policy (pure) -----------------------------------------------------------


def test_config_file_errors_name_the_file_the_server_and_the_field(tmp_path: Path) -> None:
    """A bad TASKLOOM_MCP_CONFIG stops start-up with a message naming what is wrong."""
    path = tmp_path / "mcp.json"
    with pytest.raises(McpConfigError, match="no such file"):
        load_config(path)
    path.write_text("{not json")
    with pytest.raises(McpConfigError, match="not valid JSON"):
        load_config(path)
    path.write_text(json.dumps({"servers": {}}))
    with pytest.raises(McpConfigError, match='"mcpServers"'):
        load_config(path)
    path.write_text(json.dumps({"mcpServers": {"desk": {"command": "x", "url": "http://h/mcp"}}}))
    with pytest.raises(McpConfigError, match=r"mcpServers\.desk.*either 'command'"):
        load_config(path)
    path.write_text(json.dumps({"mcpServers": {"desk.v2": {"command": "x"}}}))
    with pytest.raises(McpConfigError, match=r"'desk\.v2' must match"):
        load_config(path)
    bad_override = {"command": "x", "tools": {"t": {"read_only": True, "side_effects": True}}}
    path.write_text(json.dumps({"mcpServers": {"desk": bad_override}}))
    with pytest.raises(McpConfigError, match=r"tools\.t.*both read_only and side_effects"):
        load_config(path)
    ok = {"command": "x", "args": ["-y"], "env": {"K": "${K}"}, "tools": {"t": {"timeout": 3}}}
    path.write_text(json.dumps({"mcpServers": {"desk": ok, "pay": {"url": "https://p/mcp", "headers": {"A": "b"}}}}))
    config = load_config(path)
    assert config.servers["desk"].tools["t"].timeout == 3
    assert config.servers["desk"].env == {"K": "${K}"}  # kept as a placeholder until connect time
    assert config.servers["pay"].transport == "http"


@pytest.mark.parametrize(
    ("annotations", "override", "expected"),
    [
        (None, None, (False, True, False)),  # unsure: side effects
        (mt.ToolAnnotations(read_only_hint=True), None, (True, False, False)),
        (mt.ToolAnnotations(destructive_hint=True), None, (False, True, True)),
        (mt.ToolAnnotations(read_only_hint=False, destructive_hint=False), None, (False, True, False)),
        # The config wins over the server's hints, both ways.
        (mt.ToolAnnotations(read_only_hint=True), ToolOverride(side_effects=True), (False, True, False)),
        (mt.ToolAnnotations(read_only_hint=True), ToolOverride(requires_approval=True), (True, False, True)),
        (mt.ToolAnnotations(destructive_hint=True), ToolOverride(requires_approval=False), (False, True, False)),
        (None, ToolOverride(read_only=True), (True, False, False)),
    ],
)
def test_annotations_map_to_policy_flags_and_the_config_wins(
    annotations: mt.ToolAnnotations | None, override: ToolOverride | None, expected: tuple[bool, bool, bool]
) -> None:
    """readOnlyHint -> read_only, destructiveHint -> side_effects + approval, unsure -> side effects; override wins."""
    flags = policy_flags(annotations, override)
    assert (flags.read_only, flags.side_effects, flags.requires_approval) == expected


def test_urls_in_logs_lose_their_credentials() -> None:
    """A URL is logged without user-info or query string (where tokens hide)."""
    assert safe_url("https://user:pw@h.example:8443/mcp?token=s3cret#x") == "https://h.example:8443/mcp"


# -- a real server over stdio ------------------------------------------------------------------


async def test_stdio_server_tools_run_through_the_gateway(tmp_path: Path) -> None:
    """Namespaced names, flags from annotations, structured results, isError and bad arguments as ERRORs."""
    log = tmp_path / "calls.jsonl"
    source = McpSource("desk", stdio_config("--log", str(log), "--page-size", "2"))
    async with gateway_on(source) as (gw, _):
        tools = {name: gw.registry.tools[name] for name in gw.allowed}
        assert len(tools) == 7  # every page of tools/list (2 tools a page)
        assert "desk.lookup_order" in tools and "desk.issue_refund" in tools
        assert tools["desk.lookup_order"].read_only and not tools["desk.lookup_order"].side_effects
        refund = tools["desk.issue_refund"]
        assert refund.side_effects and refund.requires_approval and not refund.read_only
        assert tools["desk.escalate_ticket"].side_effects and not tools["desk.escalate_ticket"].requires_approval
        assert gw.registry.origins["desk.lookup_order"] == "MCP server 'desk'"

        ok = await call(gw, "desk.lookup_order", {"order_id": "A100"})
        assert ok.outcome == "ok" and json.loads(ok.content)["item"] == "wireless headphones"
        # The call carried its idempotency key to the server.
        assert [line["key"] for line in mcp_log(log)] == [ctx().idempotency_key]

        failed = await call(gw, "desk.escalate_ticket", {"order_id": "A100", "reason": "angry"})
        assert failed.outcome == "error"
        assert failed.content.startswith("ERROR: tool desk.escalate_ticket failed:")
        assert "escalation queue is closed" in failed.content

        bad = await call(gw, "desk.lookup_order", {"order": "A100"})
        assert bad.outcome == "invalid_args"
        assert "'order_id' is a required property" in bad.content
        assert len(mcp_log(log)) == 1  # an invalid call never reached the server

        unknown = await call(gw, "desk.lookup_order", {"order_id": "Z999"})
        assert unknown.outcome == "error" and "no order" in unknown.content


async def test_a_server_that_dies_mid_call_is_an_error_then_restarted(tmp_path: Path) -> None:
    """The call in flight becomes an ERROR observation; the next call runs on a restarted server."""
    log, die = tmp_path / "calls.jsonl", tmp_path / "die"
    die.write_text("once")
    source = McpSource("desk", stdio_config("--log", str(log), "--die-once", str(die)), backoff=(0.2, 2.0))
    async with gateway_on(source) as (gw, _):
        lost = await call(gw, "desk.order_history", {"order_id": "A100"}, "c1")
        assert lost.outcome == "error", lost
        assert "stopped while the call ran" in lost.content
        again = await call(gw, "desk.order_history", {"order_id": "A100"}, "c2")
        assert again.outcome == "ok", again
        assert "wireless headphones" in again.content
    pids = [line["pid"] for line in mcp_log(log) if line["phase"] == "start"]
    assert len(pids) == 2 and pids[0] != pids[1]  # a new server process answered


async def test_a_hung_server_times_out_and_is_restarted(tmp_path: Path) -> None:
    """A frozen server: the call times out (ERROR), the next use finds no answer to a ping and restarts it."""
    log, hang = tmp_path / "calls.jsonl", tmp_path / "hang"
    hang.write_text("once")
    config = stdio_config("--log", str(log), "--hang-once", str(hang), tools={"order_history": ToolOverride(timeout=2)})
    source = McpSource("desk", config, backoff=(0.1, 1.0))
    async with gateway_on(source) as (gw, _):
        hung = await call(gw, "desk.order_history", {"order_id": "A100"}, "c1")
        assert hung.outcome == "timeout", hung
        assert "timed out after 2 s" in hung.content

        async def restarted() -> bool:
            return source._generation == 2

        await eventually(restarted, timeout=30, every=0.1)  # by itself, before any other call
        again = await call(gw, "desk.order_history", {"order_id": "A101"}, "c2")
        assert again.outcome == "ok", again
        assert "standing desk" in again.content
    starts = [line for line in mcp_log(log) if line["phase"] == "start"]
    assert len(starts) == 2 and starts[0]["pid"] != starts[1]["pid"]


async def test_tools_list_changed_refreshes_the_catalog_before_the_ttl(tmp_path: Path) -> None:
    """notifications/tools/list_changed drops the cached list: the new tool appears in the next snapshot."""
    source = McpSource("desk", stdio_config(list_ttl=3600))
    async with gateway_on(source) as (gw, catalog):
        assert "desk.warranty_status" not in gw.registry.tools
        assert (await catalog.snapshot()) is gw.registry  # cached: the same snapshot
        done = await call(gw, "desk.unlock_warranty_tools", {})
        assert done.outcome == "ok", done

        async def listed() -> bool:
            return "desk.warranty_status" in (await catalog.snapshot()).tools

        await eventually(listed, timeout=10, every=0.1)


async def test_disabled_tools_and_overrides_shape_the_catalog() -> None:
    """A per-tool override hides a tool, changes its flags and its timeout, whatever the server says."""
    overrides = {
        "escalate_ticket": ToolOverride(enabled=False),
        "lookup_order": ToolOverride(requires_approval=True, timeout=7),
    }
    async with gateway_on(McpSource("desk", stdio_config(tools=overrides, timeout=11))) as (gw, _):
        assert "desk.escalate_ticket" not in gw.registry.tools
        lookup = gw.registry.tools["desk.lookup_order"]
        assert (lookup.read_only, lookup.requires_approval, lookup.timeout) == (True, True, 7)
        assert gw.registry.tools["desk.refund_policy"].timeout == 11


async def test_name_collisions_are_a_start_up_error_naming_both(tmp_path: Path) -> None:
    """desk.lookup_order (MCP) and desk_lookup_order (toolkit) are one name for the provider: refused."""
    kit = Toolkit("local")

    @kit.tool(read_only=True)
    def desk_lookup_order(order_id: str) -> str:
        """A local look-alike."""
        return order_id

    catalog = Catalog([ToolkitSource(kit), McpSource("desk", stdio_config())])
    async with catalog:
        with pytest.raises(ToolLoadError) as raised:
            await catalog.start()
    assert "'desk.lookup_order'" in str(raised.value) and "'desk_lookup_order'" in str(raised.value)
    with pytest.raises(ToolLoadError, match=r"from MCP server 'b' and 'a\.x' from toolkit 'a'"):
        clash = Toolkit("a")
        clash.tool(name="a.x")(lambda: 1)
        ToolRegistry.of([("toolkit 'a'", list(clash)), ("MCP server 'b'", list(clash))])


# -- a real server over streamable HTTP ---------------------------------------------------------


async def test_http_server_with_secret_headers_never_logs_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Headers come from ${VARS} at connect time; neither they nor the URL's query appear in any log line."""
    secret = "tl-secret-4f9a1c"
    monkeypatch.setenv("TL_TEST_MCP_TOKEN", secret)
    log = tmp_path / "calls.jsonl"
    with demo_mcp_http(tmp_path, "--log", str(log)) as (url, _):
        config = ServerConfig(url=f"{url}?k={secret}", headers={"Authorization": "Bearer ${TL_TEST_MCP_TOKEN}"})
        with structlog.testing.capture_logs() as logs:
            async with gateway_on(McpSource("pay", config)) as (gw, _):
                ok = await call(gw, "pay.lookup_order", {"order_id": "A102"})
                assert ok.outcome == "ok" and "usb-c cable" in ok.content
        assert any(entry["event"] == "mcp.connected" for entry in logs)
        assert secret not in repr(logs)
    assert [line["tool"] for line in mcp_log(log)] == ["lookup_order"]

    monkeypatch.delenv("TL_TEST_MCP_TOKEN")
    async with Catalog([McpSource("pay", config)]) as catalog:
        with pytest.raises(McpConfigError, match="needs the environment variable TL_TEST_MCP_TOKEN"):
            await catalog.start()


async def test_http_server_lost_during_a_side_effecting_call_is_an_unknown_outcome(tmp_path: Path) -> None:
    """The server dies while issue_refund runs: the model is told the outcome is unknown, not 'failed'."""
    log = tmp_path / "calls.jsonl"
    with demo_mcp_http(tmp_path, "--log", str(log), "--refund-delay", "30") as (url, proc):
        async with gateway_on(McpSource("pay", ServerConfig(url=url), backoff=(5.0, 5.0))) as (gw, _):
            import asyncio

            pending = asyncio.create_task(call(gw, "pay.issue_refund", {"order_id": "A100"}))

            async def refund_started() -> bool:
                return any(line["phase"] == "start" for line in mcp_log(log))

            await eventually(refund_started, timeout=20, every=0.05)
            proc.kill()
            outcome = await asyncio.wait_for(pending, 30)
            assert outcome.outcome == "unknown_outcome", outcome
            assert "outcome is unknown" in outcome.content
            down = await call(gw, "pay.lookup_order", {"order_id": "A100"}, "c2")
            assert down.outcome == "error" and "pay" in down.content  # still down: an ERROR, no crash


def test_a_worker_with_a_bad_mcp_config_stops_with_a_clear_message(
    subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """`taskloom worker` exits 2 naming TASKLOOM_MCP_CONFIG and the problem; no traceback."""
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"desk": {"url": "ftp://x"}}}))
    done = run_cli("worker", "executor", env={**subprocess_env, "TASKLOOM_MCP_CONFIG": str(path)})
    assert done.returncode == 2, done.stderr
    assert "TASKLOOM_MCP_CONFIG" in done.stderr and "'url' must be an http(s) URL" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_readme_config_example_works(subprocess_env: dict[str, str], tmp_path: Path) -> None:
    """The README's MCP config, with its HTTP server running, loads as documented (`taskloom tools --json`)."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("<!-- mcp-config-example", 1)[1].split("```json", 1)[1].split("```", 1)[0]
    with demo_mcp_http(tmp_path) as (url, _):
        text = block.replace("http://127.0.0.1:8931/mcp", url).replace(
            '"command": "python"', json.dumps({"command": sys.executable})[1:-1]
        )
        config = tmp_path / "mcp.json"
        config.write_text(text)
        secret = "pay-token-7d1e"
        env = {**subprocess_env, "TASKLOOM_MCP_CONFIG": str(config), "PAY_TOKEN": secret}
        done = run_cli("tools", "--json", env=env)
    assert done.returncode == 0, done.stderr
    tools = {row["name"]: row for row in json.loads(done.stdout)}
    assert "desk.lookup_order" in tools and "desk.issue_refund" not in tools
    refund = tools["pay.issue_refund"]
    assert (refund["requires_approval"], refund["side_effects"], refund["timeout"]) == (True, True, 60)
    assert tools["pay.lookup_order"]["read_only"] and tools["pay.refund_policy"]["timeout"] == 20
    assert tools["desk.lookup_order"]["origin"] == "MCP server 'desk'"
    assert secret not in done.stdout + done.stderr


async def test_a_server_that_cannot_start_backs_off_exponentially() -> None:
    """Failed starts are retried only after 10 s, then 20 s (fake clock); calls meanwhile fail at once."""
    now = [1000.0]
    source = McpSource("gone", ServerConfig(command="/nonexistent/mcp-server"), backoff=(10, 100), clock=lambda: now[0])
    async with source:
        with pytest.raises(ServerUnavailable, match="could not be started"):
            await source.list_tools()
        with pytest.raises(ServerUnavailable, match=r"unavailable .* next reconnect attempt in 10 s"):
            await source.call_tool("x", {}, ctx())
        now[0] += 10.5
        with pytest.raises(ServerUnavailable, match="could not be started"):
            await source.list_tools()
        with pytest.raises(ServerUnavailable, match="next reconnect attempt in 20 s"):
            await source.list_tools()
