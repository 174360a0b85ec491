"""Every tool source of a worker process as one catalog: entered together, listed together, one
`ToolRegistry` snapshot that the planner (its prompt) and the executors (their gateways) share.

Sources cache their own lists (an MCP server's for a short TTL, refreshed on `list_changed`), so
a snapshot per job is cheap. A source that cannot list its tools right now (a server that is down)
keeps its last known tools: their calls then fail as ERROR observations, the worker lives on.
A server that is down at start-up is logged and retried on later snapshots (the worker
starts without its tools); a configuration error or a name collision is a start-up error. When a
collision appears later (a server's list changed), the
previous snapshot stays in force and the collision is logged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from types import TracebackType
from typing import Protocol, Self

import structlog

from llm.types import ToolDef

from ..registry import ToolLoadError, ToolRegistry
from .base import CatalogTool, ToolSource

log = structlog.get_logger("taskloom.tools")


class ToolCatalog(Protocol):
    """What the executor handler needs: the registry to use for the job at hand."""

    async def snapshot(self) -> ToolRegistry: ...


class Catalog:
    def __init__(self, sources: Sequence[ToolSource]) -> None:
        self.sources = list(sources)
        self._stack: contextlib.AsyncExitStack | None = None
        self._known: dict[str, list[CatalogTool]] = {}
        self._registry: ToolRegistry | None = None
        self._fingerprint: tuple[tuple[int, ...], ...] = ()

    async def __aenter__(self) -> Self:
        async with contextlib.AsyncExitStack() as stack:
            for source in self.sources:
                await stack.enter_async_context(source)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await stack.aclose()

    async def start(self) -> ToolRegistry:
        """The first snapshot, strictly: a name collision raises `ToolLoadError` naming both tools."""
        return await self.snapshot(strict=True)

    async def snapshot(self, strict: bool = False) -> ToolRegistry:
        groups: list[tuple[str, list[CatalogTool]]] = []
        for source in self.sources:
            try:
                tools = await source.list_tools()
            except ToolLoadError:
                if strict:  # a configuration error (a missing secret, say) stops start-up
                    raise
                tools = self._known.get(source.label, [])
                log.error("tools.source_misconfigured", source=source.label, kept=len(tools), exc_info=True)
            except Exception as exc:
                tools = self._known.get(source.label, [])
                log.warning("tools.list_failed", source=source.label, error=str(exc), kept=len(tools))
            self._known[source.label] = tools
            groups.append((source.label, tools))
        fingerprint = tuple(tuple(id(t) for t in tools) for _, tools in groups)
        if self._registry is not None and fingerprint == self._fingerprint:
            return self._registry
        try:
            registry = ToolRegistry.of(groups)
        except ToolLoadError as exc:
            if strict or self._registry is None:
                raise
            log.error("tools.collision", error=str(exc), detail="keeping the previous tool catalog")
            return self._registry
        if self._registry is not None:
            log.info("tools.catalog_changed", tools=len(registry.tools))
        self._registry, self._fingerprint = registry, fingerprint
        return registry

    async def definitions(self) -> list[ToolDef]:
        """Every tool's definition, for the planner's prompt (the same catalog the executors use)."""
        return (await self.snapshot()).definitions()
