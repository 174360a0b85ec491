"""A `Toolkit` of Python functions as a tool source: nothing to connect, nothing to cache."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self

from ..toolkit import Toolkit
from .base import CatalogTool, ToolContext


class ToolkitSource:
    def __init__(self, kit: Toolkit) -> None:
        self.kit = kit

    @property
    def label(self) -> str:
        return f"toolkit {self.kit.name!r}"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    async def list_tools(self) -> list[CatalogTool]:
        return list(self.kit)

    async def call_tool(self, name: str, args: Any, ctx: ToolContext) -> Any:
        return await self.kit.tools[name].invoke(args, ctx)
