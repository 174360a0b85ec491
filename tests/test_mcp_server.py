"""`taskloom mcp` driven by the MCP SDK's own client: over stdio, submit a goal, wait, approve its
call, read its events; over HTTP with --read-only, only the watching tools exist."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from arq.connections import ArqRedis
from helpers import TASKLOOM, eventually
from mcp import Client as McpClient
from mcp import StdioServerParameters
from test_e2e import Scenario, fleet, spec, worker_env

from bus.keys import Keys
from llm.testing import FakeAnthropicServer

REPO = Path(__file__).parent.parent
pytestmark = pytest.mark.e2e


def structured(result: Any) -> dict[str, Any]:
    assert not result.is_error, result.content
    assert isinstance(result.structured_content, dict), result
    return result.structured_content


async def test_submit_wait_and_approve_through_the_mcp_server(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """An MCP host submits a goal, sees its call await approval, approves it, and waits for success."""
    scenario = Scenario(plans={0: [{"tasks": [spec("w", tools=("wipe",))]}]}, calls={"w": [("wipe", {"target": "x"})]})
    with FakeAnthropicServer() as fake:
        fake.respond_with(scenario)
        env = worker_env(subprocess_env, fake, tmp_path)
        server = StdioServerParameters(command=sys.executable, args=["-m", "taskloom", "mcp"], env=env, cwd=str(REPO))
        async with fleet(env, tmp_path, "all"), McpClient(server) as mcp:
            tools = {t.name: t for t in (await mcp.list_tools()).tools}
            assert set(tools) == {
                "submit_goal",
                "goal_status",
                "wait_goal",
                "goal_events",
                "cancel_goal",
                "approve_call",
                "deny_call",
            }
            for name in ("approve_call", "deny_call"):  # marked as approval tools
                assert tools[name].annotations is not None and tools[name].annotations.destructive_hint is True
                assert (tools[name].meta or {}).get("dev.taskloom/approval") is True
            assert tools["goal_status"].annotations is not None and tools["goal_status"].annotations.read_only_hint

            gid = structured(await mcp.call_tool("submit_goal", {"text": "wipe x"}))["goal_id"]
            early = structured(await mcp.call_tool("wait_goal", {"goal_id": gid, "timeout_seconds": 0.5}))
            assert early["done"] is False  # bounded: it answers, it does not fail

            async def awaiting() -> bool:
                status = structured(await mcp.call_tool("goal_status", {"goal_id": gid}))
                return bool(status["approvals"])

            await eventually(awaiting, timeout=60, every=0.2)
            status = structured(await mcp.call_tool("goal_status", {"goal_id": gid}))
            [(call_id, request)] = status["approvals"].items()
            assert request["tool"] == "wipe"
            decided = structured(await mcp.call_tool("approve_call", {"goal_id": gid, "call_id": call_id}))
            assert decided["first_decision"] is True
            again = structured(await mcp.call_tool("deny_call", {"goal_id": gid, "call_id": call_id}))
            assert (again["first_decision"], again["decision"]) == (False, "approved")  # the first decision wins

            done = structured(await mcp.call_tool("wait_goal", {"goal_id": gid, "timeout_seconds": 60}))
            assert (done["done"], done["state"]) == (True, "succeeded"), done
            page = structured(await mcp.call_tool("goal_events", {"goal_id": gid, "limit": 500}))
            kinds = [e["type"] for e in page["events"]]
            assert "tool.approval_requested" in kinds and "tool.approval_decided" in kinds
            assert any(e["type"] == "tool.call" and e["data"]["tool"] == "wipe" for e in page["events"])
            # Paging with `next_after` walks the same append-only stream, three events at a time.
            walked: list[str] = []
            after = None
            while len(walked) < len(page["events"]):
                part = structured(await mcp.call_tool("goal_events", {"goal_id": gid, "after": after, "limit": 3}))
                assert 1 <= len(part["events"]) <= 3
                walked += [e["position"] for e in part["events"]]
                after = part["next_after"]
            assert walked[: len(page["events"])] == [e["position"] for e in page["events"]]

            missing = await mcp.call_tool("goal_status", {"goal_id": "no-such-goal"})
            assert missing.is_error and "no-such-goal" in str(missing.content)
            invalid = await mcp.call_tool("submit_goal", {"text": ""})
            assert invalid.is_error and "invalid goal: text" in str(invalid.content)
    assert not scenario.unrouted


@contextlib.contextmanager
def taskloom_mcp_http(env: dict[str, str], tmp_path: Path, *args: str) -> Iterator[str]:
    """`taskloom mcp --http` on a free loopback port; yields its URL."""
    port_file = tmp_path / "port"
    cmd = [*TASKLOOM, "mcp", "--http", "--port", "0", "--port-file", str(port_file), *args]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "taskloom mcp --http did not start within 30 s"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text()}/mcp"
    finally:
        proc.kill()
        proc.wait(10)


async def test_read_only_http_server_only_watches(subprocess_env: dict[str, str], tmp_path: Path) -> None:
    """`taskloom mcp --http --read-only` serves status, wait and events over streamable HTTP, nothing else."""
    with taskloom_mcp_http(subprocess_env, tmp_path, "--read-only") as url:
        async with McpClient(url) as mcp:
            names = {t.name for t in (await mcp.list_tools()).tools}
            assert names == {"goal_status", "wait_goal", "goal_events"}
            refused = await mcp.call_tool("submit_goal", {"text": "anything"})
            assert refused.is_error
            missing = await mcp.call_tool("wait_goal", {"goal_id": "nope", "timeout_seconds": 1})
            assert missing.is_error and "nope" in str(missing.content)
