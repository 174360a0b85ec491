"""MCP servers as tool sources, on the official `mcp` SDK (2.x; the optional extra `taskloom[mcp]`).

Configuration (`TASKLOOM_MCP_CONFIG` names a JSON file) uses the shape MCP hosts share, plus
per-tool overrides that taskloom reads:

    {"mcpServers": {
        "desk": {"command": "python", "args": ["-m", "desk_server"], "env": {"DESK_TOKEN": "${DESK_TOKEN}"}},
        "pay":  {"url": "https://pay.internal/mcp", "headers": {"Authorization": "Bearer ${PAY_TOKEN}"},
                 "tools": {"issue_refund": {"requires_approval": true, "timeout": 20}}}}}

- `${NAME}` in `env` and `headers` values is read from this process's environment when the server
  is connected, never earlier: the loaded config holds only the placeholders, and no log line ever
  shows an `env` or header value (nor a URL's user-info or query string).
- A stdio server starts with the SDK's minimal default environment plus its `env`, not the
  worker's (which holds the model's API key).
- Tools are named `<server>.<tool>`; the Anthropic adapter maps that to the provider's name rule.
- Policy: `readOnlyHint` -> `read_only`; `destructiveHint` -> `side_effects` + `requires_approval`;
  anything not read-only is treated as having side effects (annotations are hints from a server we
  may not trust); `idempotentHint` is recorded. A per-tool override in the config always wins.

Connection: one connection per server and worker process, opened on first use by a background
task that owns it (the SDK's task groups must be entered and left in one task). The handshake is
the classic one (`initialize`, then `notifications/initialized`); tools/list follows every page.
A server that dies or stops answering turns the call into an ERROR observation (for a tool with
side effects: an unknown outcome, never retried), and the next use reconnects, with exponential
backoff between failed attempts. After a call that was cancelled (timed out), the server is pinged in
the background; no answer within `PING_TIMEOUT` means a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TextIO, cast
from urllib.parse import urlsplit, urlunsplit

import jsonschema
import mcp_types as mt
import structlog
from mcp import Client, MCPDeprecationWarning, MCPError, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llm.forced import validation_problems
from llm.types import ToolDef

from ..registry import ToolLoadError
from .base import CatalogTool, InvalidArguments, OutcomeUnknown, ToolContext, ToolError

log = structlog.get_logger("taskloom.mcp")

SERVER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
IDEMPOTENCY_META_KEY = "dev.taskloom/idempotency-key"  # in a tools/call request's `_meta`
PING_TIMEOUT = 3.0  # seconds a server has to answer a ping after a cancelled call
STABLE_AFTER = 60.0  # a connection that lived this long resets the backoff when it is lost


class McpConfigError(ToolLoadError, ValueError):
    """`TASKLOOM_MCP_CONFIG` cannot be used; the message names the file, the server and the field."""


# -- configuration ----------------------------------------------------------------------------


class ToolOverride(BaseModel):
    """Per-tool settings that win over the server's annotations."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    read_only: bool | None = None
    side_effects: bool | None = None
    requires_approval: bool | None = None
    # Only the config can make a side-effecting MCP tool repeatable: `idempotentHint` comes from a
    # server we may not trust, so it is recorded, never acted on.
    idempotent: bool | None = None
    timeout: float | None = Field(default=None, gt=0)
    description: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ToolOverride:
        if self.read_only and self.side_effects:
            raise ValueError("a tool cannot be both read_only and side_effects")
        return self


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    command: str | None = Field(default=None, min_length=1)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    # "type" is what several hosts write ("stdio", "http", "streamable-http"); checked, not needed.
    type: Literal["stdio", "http", "streamable-http", "streamableHttp"] | None = None
    timeout: float | None = Field(default=None, gt=0, description="default per-call timeout of this server's tools")
    connect_timeout: float = Field(default=20.0, gt=0)
    list_ttl: float = Field(default=60.0, ge=0, description="seconds a tools/list answer is reused")
    tools: dict[str, ToolOverride] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_transport(self) -> ServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("give either 'command' (a stdio server) or 'url' (a streamable HTTP server)")
        if self.url is not None:
            if urlsplit(self.url).scheme not in ("http", "https"):
                raise ValueError("'url' must be an http(s) URL")
            if self.args or self.env or self.cwd:
                raise ValueError("'args', 'env' and 'cwd' are for stdio servers ('command'), not 'url'")
        elif self.headers:
            raise ValueError("'headers' are for HTTP servers ('url'), not 'command'")
        return self

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "http"


class McpConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    servers: dict[str, ServerConfig] = Field(alias="mcpServers")


def load_config(path: str | Path) -> McpConfig:
    """Read and check the config file; every problem is named with its place in the file."""
    where = f"TASKLOOM_MCP_CONFIG ({path})"
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise McpConfigError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise McpConfigError(f"{where}: cannot read it: {exc}") from None
    except json.JSONDecodeError as exc:
        raise McpConfigError(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict) or "mcpServers" not in raw:
        raise McpConfigError(f'{where}: expected an object with "mcpServers": {{"<name>": {{...}}}}')
    try:
        config = McpConfig.model_validate(raw)
    except ValidationError as exc:
        raise McpConfigError(f"{where}: {'; '.join(validation_problems(exc))}") from None
    for name in config.servers:
        if not SERVER_NAME.match(name):
            raise McpConfigError(f"{where}: server name {name!r} must match {SERVER_NAME.pattern} (no dots)")
    return config


def expand(values: Mapping[str, str], what: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`${NAME}` placeholders filled from the environment; a missing variable is named, never its value."""
    env = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for key, value in values.items():
        missing = [name for name in PLACEHOLDER.findall(value) if name not in env]
        if missing:
            raise McpConfigError(f"{what} {key!r} needs the environment variable {missing[0]} (not set)")
        out[key] = PLACEHOLDER.sub(lambda m: env[m.group(1)], value)
    return out


def safe_url(url: str) -> str:
    """The URL for logs: no user-info, no query string, no fragment."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


# -- policy -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flags:
    read_only: bool
    side_effects: bool
    requires_approval: bool
    idempotent: bool  # repeat a side-effecting call instead of replaying its recorded outcome
    idempotent_hint: bool | None  # what the server's annotations said (recorded only)


def policy_flags(annotations: mt.ToolAnnotations | None, override: ToolOverride | None) -> Flags:
    """Our flags for an MCP tool: from its annotations, "side effects" when unsure, config wins."""
    a = annotations
    read_only = bool(a is not None and a.read_only_hint is True)
    destructive = bool(a is not None and a.destructive_hint is True and not read_only)
    flags = Flags(
        read_only=read_only,
        side_effects=not read_only,
        requires_approval=destructive,
        idempotent=False,
        idempotent_hint=a.idempotent_hint if a is not None else None,
    )
    if override is None:
        return flags
    read_only = override.read_only if override.read_only is not None else flags.read_only
    if override.side_effects is not None:
        side_effects = override.side_effects
    else:  # an override to read-only drops the side effects the annotations implied, and back
        side_effects = not read_only
    if override.read_only is None and override.side_effects is True:
        read_only = False
    return Flags(
        read_only=read_only,
        side_effects=side_effects,
        requires_approval=(
            override.requires_approval if override.requires_approval is not None else flags.requires_approval
        ),
        idempotent=bool(override.idempotent),
        idempotent_hint=flags.idempotent_hint,
    )


# -- tools ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class McpTool:
    """One tool of one MCP server, in the shape the gateway needs (`CatalogTool`)."""

    source: McpSource = field(repr=False, compare=False)
    remote_name: str
    name: str
    description: str
    input_schema: dict[str, Any]
    read_only: bool
    side_effects: bool
    requires_approval: bool
    idempotent: bool
    idempotent_hint: bool | None
    timeout: float | None
    validator: Any = field(repr=False, compare=False)

    @property
    def definition(self) -> ToolDef:
        return ToolDef(name=self.name, description=self.description, input_schema=self.input_schema)

    def parse(self, arguments: dict[str, Any]) -> dict[str, Any]:
        errors = sorted(self.validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
        if errors:
            problems = "; ".join(f"{'.'.join(str(p) for p in e.absolute_path) or 'input'}: {e.message}" for e in errors)
            raise InvalidArguments(problems)
        return dict(arguments)

    async def invoke(self, args: Any, ctx: ToolContext) -> Any:
        return await self.source.call_tool(self.remote_name, args, ctx)


def result_value(result: mt.CallToolResult) -> Any:
    """What the model sees of a result: the structured content when there is some, else the text."""
    if result.structured_content is not None and not result.is_error:
        return result.structured_content
    parts: list[str] = []
    for block in result.content:
        if isinstance(block, mt.TextContent):
            parts.append(block.text)
        elif isinstance(block, mt.ImageContent | mt.AudioContent):
            parts.append(f"[{block.type}: {block.mime_type}, not shown]")
        elif isinstance(block, mt.EmbeddedResource):
            inner = block.resource
            parts.append(inner.text if isinstance(inner, mt.TextResourceContents) else f"[resource {inner.uri}]")
        elif isinstance(block, mt.ResourceLink):
            parts.append(f"[resource link {block.uri}]")
        else:
            parts.append(f"[{getattr(block, 'type', 'content')}]")
    return "\n".join(parts)


# -- the source -------------------------------------------------------------------------------


class ServerUnavailable(ToolError):
    """The server could not be (re)connected; the message says when the next attempt is."""


class McpSource:
    """One MCP server. Enter it for the worker's lifetime; it connects on first use."""

    def __init__(
        self,
        name: str,
        config: ServerConfig,
        *,
        backoff: tuple[float, float] = (0.5, 30.0),
        clock: Callable[[], float] = time.monotonic,
        errlog: TextIO | None = None,
    ) -> None:
        if not SERVER_NAME.match(name):
            raise McpConfigError(f"MCP server name {name!r} must match {SERVER_NAME.pattern}")
        self.name = name
        self.config = config
        self.backoff = backoff
        self.clock = clock
        self.errlog = errlog
        self._client: Client | None = None
        self._runner: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._lock = asyncio.Lock()
        self._failures = 0
        self._retry_at = 0.0
        self._last_error = ""
        self._checks: set[asyncio.Task[None]] = set()  # health checks after cancelled calls
        self._tools: list[CatalogTool] | None = None
        self._side_effects: dict[str, bool] = {}  # by the server's tool name, kept across reconnects
        self._listed_at = 0.0
        self._generation = 0  # bumped on each (re)connect, for logs and tests
        self._connected_at = 0.0

    @property
    def label(self) -> str:
        return f"MCP server {self.name!r}"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for check in list(self._checks):
            check.cancel()
        await asyncio.gather(*self._checks, return_exceptions=True)
        await self._disconnect()

    # -- connection -------------------------------------------------------------------------

    async def _own_connection(self, ready: asyncio.Future[Client], stop: asyncio.Event) -> None:
        """Runs in its own task: opens the connection, holds it until `stop`, closes it."""
        cfg = self.config
        try:
            async with contextlib.AsyncExitStack() as stack:
                transport: Any
                if cfg.command is not None:
                    params = StdioServerParameters(
                        command=cfg.command,
                        args=list(cfg.args),
                        env=expand(cfg.env, f"MCP server {self.name!r}: env") or None,
                        cwd=cfg.cwd,
                    )
                    transport = stdio_client(params, errlog=self.errlog or sys.stderr)
                else:
                    assert cfg.url is not None
                    headers = expand(cfg.headers, f"MCP server {self.name!r}: header")
                    http = await stack.enter_async_context(create_mcp_http_client(headers=headers))
                    transport = streamable_http_client(cfg.url, http_client=http)
                client = Client(
                    transport,
                    mode="legacy",  # initialize, then notifications/initialized: what every server speaks
                    cache=None,  # we cache tools/list ourselves, with our TTL
                    message_handler=self._on_message,
                    client_info=mt.Implementation(name="taskloom", version="0.1.0"),
                )
                await stack.enter_async_context(client)
                ready.set_result(client)
                await stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else ToolError("connection cancelled"))
            elif not stop.is_set():
                log.warning("mcp.connection_lost", server=self.name, error=_describe(exc))
            if isinstance(exc, asyncio.CancelledError) and not stop.is_set():
                raise
        finally:
            if self._runner is asyncio.current_task():
                self._client = None

    async def _connect(self, patient: bool = True) -> Client:
        """The live connection, (re)opened if needed. Within a backoff period: a `patient` caller (a
        tool call) waits up to 5 s for it to end; others (catalog refreshes) fail at once."""
        if self._client is not None and self._runner is not None and not self._runner.done():
            return self._client
        async with self._lock:
            if self._client is not None and self._runner is not None and not self._runner.done():
                return self._client
            wait = self._retry_at - self.clock()
            if wait > 0:
                if wait > 5 or not patient:
                    raise ServerUnavailable(
                        f"MCP server {self.name!r} is unavailable ({self._last_error}); "
                        f"next reconnect attempt in {wait:.0f} s"
                    )
                await asyncio.sleep(wait)
            await self._disconnect()
            loop = asyncio.get_running_loop()
            ready: asyncio.Future[Client] = loop.create_future()
            stop = asyncio.Event()
            self._stop = stop
            self._runner = asyncio.create_task(self._own_connection(ready, stop), name=f"mcp-{self.name}")
            try:
                async with asyncio.timeout(self.config.connect_timeout):
                    client = await asyncio.shield(ready)
            except McpConfigError:
                await self._disconnect()
                raise
            except Exception as exc:
                await self._disconnect()
                self._note_failure(_describe(exc))
                raise ServerUnavailable(f"MCP server {self.name!r} could not be started: {self._last_error}") from None
            self._client = client
            self._connected_at = self.clock()
            self._generation += 1
            self._tools = None  # a restarted server may list other tools
            log.info("mcp.connected", server=self.name, transport=self.config.transport, target=self._target())
            return client

    def _note_failure(self, error: str) -> None:
        self._failures += 1
        self._last_error = error
        low, high = self.backoff
        delay = min(high, low * 2 ** (self._failures - 1))
        self._retry_at = self.clock() + delay
        log.warning("mcp.backoff", server=self.name, failures=self._failures, retry_in=delay, error=error)

    async def _disconnect(self) -> None:
        runner, stop = self._runner, self._stop
        self._runner, self._stop, self._client = None, None, None
        if runner is None:
            return
        if stop is not None:
            stop.set()
        try:
            async with asyncio.timeout(5):
                await asyncio.gather(runner, return_exceptions=True)
        except TimeoutError:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    def _target(self) -> str:
        cfg = self.config
        return cfg.command if cfg.command is not None else safe_url(cfg.url or "")

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, mt.ToolListChangedNotification):
            log.info("mcp.tools_changed", server=self.name)
            self._tools = None
        elif isinstance(message, Exception):
            log.warning("mcp.transport_error", server=self.name, error=_describe(message))

    # -- the ToolSource interface -----------------------------------------------------------

    async def list_tools(self) -> list[CatalogTool]:
        if self._tools is not None and self.clock() - self._listed_at < self.config.list_ttl:
            return self._tools
        client = await self._connect(patient=False)  # a catalog refresh never waits out a backoff
        listed: list[mt.Tool] = []
        cursor: str | None = None
        for _ in range(1000):  # a server whose cursor never ends cannot hang us
            page = await client.list_tools(cursor=cursor, cache_mode="refresh")
            listed.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        tools: list[CatalogTool] = []
        for remote in listed:
            tool = self._make_tool(remote)
            if tool is not None:
                tools.append(tool)
        self._tools, self._listed_at = tools, self.clock()
        self._side_effects.update({t.remote_name: t.side_effects for t in tools if isinstance(t, McpTool)})
        log.info("mcp.tools_listed", server=self.name, tools=len(tools))
        return tools

    def _make_tool(self, remote: mt.Tool) -> McpTool | None:
        override = self.config.tools.get(remote.name)
        if override is not None and not override.enabled:
            return None
        schema = dict(remote.input_schema or {"type": "object"})
        schema.setdefault("type", "object")
        try:
            validator_cls = jsonschema.validators.validator_for(schema)
            validator_cls.check_schema(schema)
        except jsonschema.SchemaError as exc:
            problem = f"bad input schema: {exc.message}"
            log.warning("mcp.tool_skipped", server=self.name, tool=remote.name, error=problem)
            return None
        flags = policy_flags(remote.annotations, override)
        description = (override.description if override and override.description else None) or (
            remote.description or remote.title or ""
        )
        return McpTool(
            source=self,
            remote_name=remote.name,
            name=f"{self.name}.{remote.name}",
            description=description.strip(),
            input_schema=schema,
            read_only=flags.read_only,
            side_effects=flags.side_effects,
            requires_approval=flags.requires_approval,
            idempotent=flags.idempotent,
            idempotent_hint=flags.idempotent_hint,
            timeout=(override.timeout if override and override.timeout else None) or self.config.timeout,
            validator=validator_cls(schema),
        )

    async def call_tool(self, name: str, args: Any, ctx: ToolContext) -> Any:
        client = await self._connect()
        side_effects = self._side_effects.get(name, True)  # unknown: assume the worst
        meta = cast(mt.RequestParamsMeta, {IDEMPOTENCY_META_KEY: ctx.idempotency_key})
        try:
            result = await client.call_tool(name, args, meta=meta)
        except asyncio.CancelledError:
            self._check_soon()  # timed out or cancelled: the server may hang
            raise
        except Exception as exc:
            if isinstance(exc, MCPError) and exc.code != mt.CONNECTION_CLOSED:
                # The server answered with a JSON-RPC error: the call did not run (or failed for sure).
                raise ToolError(f"the MCP server {self.name!r} refused the call: {exc.message}") from None
            await self._lost(_describe(exc))
            if side_effects:
                raise OutcomeUnknown(
                    f"the MCP server {self.name!r} stopped while the call ran ({_describe(exc)}); its outcome is "
                    "unknown and it has side effects, so it was not retried. Check its effect before retrying."
                ) from None
            raise ToolError(
                f"the MCP server {self.name!r} stopped while the call ran ({_describe(exc)}); it is being restarted"
            ) from None
        if result.is_error:
            raise ToolError(str(result_value(result)) or "the server reported an error without a message")
        return result_value(result)

    def _check_soon(self) -> None:
        if not self._checks:
            task = asyncio.get_running_loop().create_task(self._check(), name=f"mcp-check-{self.name}")
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)

    async def _check(self) -> None:
        """After a cancelled call: a server that does not answer a ping within `PING_TIMEOUT` is
        restarted now (after the backoff), so the next call does not pay for finding out."""
        client = self._client
        if client is None:
            return
        try:
            async with asyncio.timeout(PING_TIMEOUT):
                with warnings.catch_warnings():  # ping is legacy-mode only, which is the mode we use
                    warnings.simplefilter("ignore", MCPDeprecationWarning)
                    await client.send_ping()
            return
        except Exception as exc:
            log.warning("mcp.unresponsive", server=self.name, error=_describe(exc) or "no answer to a ping")
        if self._client is not client:
            return  # already replaced
        await self._lost("did not answer a ping after a cancelled call")
        with contextlib.suppress(Exception):  # a failed restart is logged and retried on next use
            await self._connect()

    async def _lost(self, error: str) -> None:
        async with self._lock:
            if self._client is None and self._runner is None:
                return  # someone else noticed first
            await self._disconnect()
            if self.clock() - self._connected_at >= STABLE_AFTER:
                self._failures = 0  # it had been fine for a while: start the backoff over
            self._note_failure(error)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def sources_from(path: str | Path, errlog: TextIO | None = None) -> list[McpSource]:
    """One source per configured server."""
    config = load_config(path)
    return [McpSource(name, server, errlog=errlog) for name, server in config.servers.items()]
