"""One snapshot of every tool a worker knows (`ToolRegistry`), and loading toolkits from
`TASKLOOM_TOOLS` (`module:attribute,...`).

A registry is immutable: `executor.sources.catalog.Catalog` builds a new one whenever a source's
tool list changes. Names are checked once, here: two tools with one name, or two names that the
provider would see as one (`llm.toolnames`, e.g. `desk.lookup` and `desk_lookup`), are refused with
a message naming both and where each comes from.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from llm.errors import ToolNameCollisionError
from llm.toolnames import ToolNameMap
from llm.types import ToolDef

from .sources.base import CatalogTool
from .toolkit import Toolkit


class ToolLoadError(Exception):
    """`TASKLOOM_TOOLS` names something that cannot be loaded; the message says which and why."""


class ToolRegistry:
    def __init__(self, toolkits: Iterable[Toolkit] = ()) -> None:
        kits = list(toolkits)
        self.tools: dict[str, CatalogTool] = {}
        self.origins: dict[str, str] = {}
        self._add([(f"toolkit {kit.name!r}", list(kit)) for kit in kits])

    @classmethod
    def of(cls, groups: Iterable[tuple[str, Iterable[CatalogTool]]]) -> ToolRegistry:
        """A registry of `(where from, tools)` groups, e.g. `("MCP server 'desk'", [...])`."""
        registry = cls()
        registry._add([(origin, list(tools)) for origin, tools in groups])
        return registry

    def _add(self, groups: list[tuple[str, list[CatalogTool]]]) -> None:
        for origin, tools in groups:
            for tool in tools:
                if tool.name in self.tools:
                    raise ToolLoadError(
                        f"tool name collision: {tool.name!r} from {origin} and {tool.name!r} from "
                        f"{self.origins[tool.name]}; rename one or disable it"
                    )
                self.tools[tool.name] = tool
                self.origins[tool.name] = origin
        try:
            ToolNameMap(self.tools)
        except ToolNameCollisionError as exc:
            raise ToolLoadError(f"tool name collision: {exc}") from None

    async def snapshot(self) -> ToolRegistry:
        """A registry is its own snapshot (the `ToolCatalog` interface; see `sources.catalog`)."""
        return self

    def __contains__(self, name: object) -> bool:
        return name in self.tools

    def get(self, name: str) -> CatalogTool | None:
        return self.tools.get(name)

    def names(self) -> list[str]:
        return sorted(self.tools)

    def definitions(self, allowed: Iterable[str] | None = None) -> list[ToolDef]:
        chosen = self.names() if allowed is None else sorted(set(allowed) & set(self.tools))
        return [self.tools[n].definition for n in chosen]


def load_toolkit(path: str) -> Toolkit:
    module_name, sep, attr = path.strip().partition(":")
    if not sep or not module_name or not attr:
        raise ToolLoadError(f"TASKLOOM_TOOLS: {path!r} is not of the form module:attribute")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = " (is it on PYTHONPATH, or in the current directory?)" if exc.name == module_name else ""
        raise ToolLoadError(f"TASKLOOM_TOOLS: cannot import module {module_name!r}: {exc}{hint}") from exc
    except SyntaxError as exc:
        where = f"{exc.filename}:{exc.lineno}" if exc.filename else module_name
        raise ToolLoadError(f"TASKLOOM_TOOLS: module {module_name!r} has a syntax error at {where}: {exc.msg}") from exc
    except Exception as exc:
        # Whatever the module does at import time (a tool without type annotations raises
        # ToolDefinitionError when it is decorated) is the toolkit's fault, not a taskloom crash.
        raise ToolLoadError(
            f"TASKLOOM_TOOLS: importing module {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ToolLoadError(f"TASKLOOM_TOOLS: module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, Toolkit):
        raise ToolLoadError(f"TASKLOOM_TOOLS: {path!r} is a {type(obj).__name__}, not a taskloom Toolkit")
    return obj


def load_toolkits(spec: str, default: Iterable[Toolkit] = ()) -> list[Toolkit]:
    """The toolkits named in `spec` (comma-separated), or `default` when `spec` is empty."""
    paths = [p for p in (s.strip() for s in spec.split(",")) if p]
    return [load_toolkit(p) for p in paths] if paths else list(default)


def load_registry(spec: str, default: Iterable[Toolkit] = ()) -> ToolRegistry:
    return ToolRegistry(load_toolkits(spec, default))
