"""The support-desk demo tools served as an MCP server (on the `mcp` SDK's `MCPServer`), for the
tests and for trying `TASKLOOM_MCP_CONFIG` by hand:

    python -m executor.demo_mcp                          # stdio
    python -m executor.demo_mcp --http --port-file PORT  # streamable HTTP on 127.0.0.1, a free port

Besides the demo tools (three read-only ones and `issue_refund`, annotated destructive) it has
`escalate_ticket`, which always fails (an `isError` result), `order_history`, which kills the server
in the middle of the call while the `--die-once` file exists (and freezes it: `--hang-once`),
`lookup_order`, which answers `isError` "backend unavailable, try again" once while the
`--flaky-once` file exists (a read-only tool worth retrying), and
`unlock_warranty_tools`, which adds a tool and sends `notifications/tools/list_changed`.
`--log FILE` appends one JSON line per call phase (`start`, `done`) with the server's pid and the
call's idempotency key, so a test can judge from the server's side what ran and how often.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mcp_types as mt
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from . import demo_tools
from .sources.mcp import IDEMPOTENCY_META_KEY

READ_ONLY = mt.ToolAnnotations(read_only_hint=True, idempotent_hint=True)
DESTRUCTIVE = mt.ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False)


class PagedServer(MCPServer):
    """`tools/list` in pages of `page_size` tools (0: one page), so clients must follow `nextCursor`."""

    page_size = 0

    async def _handle_list_tools(self, ctx: Any, params: mt.PaginatedRequestParams | None) -> mt.ListToolsResult:
        tools = await self.list_tools()
        if not self.page_size:
            return mt.ListToolsResult(tools=tools)
        start = int(params.cursor) if params is not None and params.cursor else 0
        end = start + self.page_size
        return mt.ListToolsResult(tools=tools[start:end], next_cursor=str(end) if end < len(tools) else None)


@dataclass(frozen=True)
class Faults:
    """The misbehaviour a test asks for: each `*_once` file is consumed by the call it breaks."""

    die_once: Path | None = None
    hang_once: Path | None = None
    flaky_once: Path | None = None
    refund_delay: float = 0.0


class CallLog:
    """One JSON line per call phase (`--log`), with the server's pid and the call's idempotency key."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def note(self, tool: str, phase: str, ctx: Context | None, **data: Any) -> None:
        if self.path is None:
            return
        key = None
        if ctx is not None:
            meta = ctx.request_context.meta or {}
            key = meta.get(IDEMPOTENCY_META_KEY)
        line = {"pid": os.getpid(), "tool": tool, "phase": phase, "key": key, "at": time.time(), **data}
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")
            out.flush()


def _order(order_id: str) -> dict[str, Any]:
    try:
        return demo_tools.lookup_order(order_id)
    except KeyError as exc:  # an anticipated failure: the model reads the message, no traceback
        raise ToolError(str(exc.args[0])) from None


def build(
    log: Path | None = None,
    die_once: Path | None = None,
    hang_once: Path | None = None,
    refund_delay: float = 0.0,
    page_size: int = 0,
    flaky_once: Path | None = None,
) -> MCPServer:
    server = PagedServer(
        "support-desk", instructions="Orders, refunds and tickets of the demo store.", log_level="WARNING"
    )
    server.page_size = page_size
    faults = Faults(die_once=die_once, hang_once=hang_once, flaky_once=flaky_once, refund_delay=refund_delay)
    _add_order_tools(server, CallLog(log), faults)
    _add_case_tools(server, CallLog(log), faults)
    return server


def _add_order_tools(server: MCPServer, calls: CallLog, faults: Faults) -> None:
    @server.tool(annotations=READ_ONLY)
    def lookup_order(order_id: str, ctx: Context) -> dict[str, Any]:
        """Look up an order by its id (e.g. A100): delivery date, item, amount, and whether it was a final sale."""
        calls.note("lookup_order", "start", ctx, order_id=order_id)
        if faults.flaky_once is not None and faults.flaky_once.exists():
            faults.flaky_once.unlink()
            calls.note("lookup_order", "failed", ctx, order_id=order_id)
            raise ToolError("backend unavailable, try again")
        return _order(order_id)

    @server.tool(annotations=READ_ONLY)
    def refund_policy() -> str:
        """The store's refund policy."""
        return demo_tools.refund_policy()

    @server.tool(annotations=READ_ONLY)
    def check_refund_eligibility(order_id: str, today: dt.date) -> dict[str, Any]:
        """Whether an order can still be refunded on `today` (YYYY-MM-DD), with the refund deadline."""
        _order(order_id)
        return demo_tools.check_refund_eligibility(order_id, today)

    @server.tool(annotations=DESTRUCTIVE)
    async def issue_refund(order_id: str, ctx: Context) -> str:
        """Issue a refund for an eligible order. Moves money: needs a person's approval."""
        found = _order(order_id)
        calls.note("issue_refund", "start", ctx, order_id=found["order_id"])
        if faults.refund_delay:
            await asyncio.sleep(faults.refund_delay)
        calls.note("issue_refund", "done", ctx, order_id=found["order_id"])
        return f"refund of ${found['amount_usd']:.2f} issued for {found['order_id']}"


def _add_case_tools(server: MCPServer, calls: CallLog, faults: Faults) -> None:
    @server.tool(annotations=mt.ToolAnnotations(read_only_hint=False, destructive_hint=False))
    def escalate_ticket(order_id: str, reason: str) -> str:
        """Hand an order's case to a human agent."""
        raise ToolError(f"the escalation queue is closed; {order_id} was not escalated")

    @server.tool(annotations=READ_ONLY)
    def order_history(order_id: str, ctx: Context) -> list[str]:
        """Every event of an order so far (placed, shipped, delivered)."""
        calls.note("order_history", "start", ctx, order_id=order_id)
        if faults.die_once is not None and faults.die_once.exists():
            faults.die_once.unlink()
            calls.note("order_history", "dying", ctx, order_id=order_id)
            os._exit(17)  # mid-call, no answer: what a crashing server looks like to the client
        if faults.hang_once is not None and faults.hang_once.exists():
            faults.hang_once.unlink()
            calls.note("order_history", "hanging", ctx, order_id=order_id)
            os.kill(os.getpid(), signal.SIGSTOP)  # the whole process freezes: it answers nothing, not even pings
        found = _order(order_id)
        return [f"placed: {found['item']}", f"delivered: {found['delivered']}"]

    @server.tool(annotations=mt.ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True))
    async def unlock_warranty_tools(ctx: Context) -> str:
        """Make the warranty tools available."""

        def warranty_status(order_id: str) -> str:
            """Whether an order's item is still under warranty."""
            return f"{order_id}: under warranty until 2027-10-01"

        if "warranty_status" not in {t.name for t in await server.list_tools()}:
            server.add_tool(warranty_status, annotations=READ_ONLY)
        await ctx.session.send_tool_list_changed()
        return "warranty tools unlocked"


async def serve_http(server: MCPServer, port_file: Path | None, port: int = 0, host: str = "127.0.0.1") -> None:
    """Streamable HTTP at http://<host>:<port>/mcp; port 0 takes a free one, written to `port_file`."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    app = server.streamable_http_app(host=host)
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    if port_file is not None:
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(sock.getsockname()[1]))
        tmp.replace(port_file)  # whole or absent: a reader never sees half a number
    await uvicorn.Server(config).serve(sockets=[sock])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m executor.demo_mcp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio")
    parser.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one)")
    parser.add_argument("--port-file", type=Path, help="write the HTTP port here once listening")
    parser.add_argument("--log", type=Path, help="append one JSON line per call phase")
    parser.add_argument("--die-once", type=Path, help="order_history kills the server while this file exists")
    parser.add_argument("--hang-once", type=Path, help="order_history freezes the server while this file exists")
    parser.add_argument("--page-size", type=int, default=0, help="tools per tools/list page (0: all in one)")
    parser.add_argument("--refund-delay", type=float, default=0.0, help="seconds issue_refund takes")
    parser.add_argument("--flaky-once", type=Path, help="lookup_order fails (isError) once while this file exists")
    args = parser.parse_args(argv)
    server = build(args.log, args.die_once, args.hang_once, args.refund_delay, args.page_size, args.flaky_once)
    if args.http:
        asyncio.run(serve_http(server, args.port_file, args.port))
    else:
        server.run("stdio")


if __name__ == "__main__":
    main()
