"""Loading toolkits from `TASKLOOM_TOOLS` (`module:attribute,...`) into one registry."""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from llm.types import ToolDef

from .toolkit import Tool, Toolkit


class ToolLoadError(Exception):
    """`TASKLOOM_TOOLS` names something that cannot be loaded; the message says which and why."""


class ToolRegistry:
    def __init__(self, toolkits: Iterable[Toolkit] = ()) -> None:
        self.tools: dict[str, Tool] = {}
        for kit in toolkits:
            for tool in kit:
                if tool.name in self.tools:
                    raise ToolLoadError(f"two toolkits define a tool named {tool.name!r}")
                self.tools[tool.name] = tool

    def __contains__(self, name: object) -> bool:
        return name in self.tools

    def get(self, name: str) -> Tool | None:
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


def load_registry(spec: str, default: Iterable[Toolkit] = ()) -> ToolRegistry:
    """The toolkits named in `spec` (comma-separated), or `default` when `spec` is empty."""
    paths = [p for p in (s.strip() for s in spec.split(",")) if p]
    return ToolRegistry([load_toolkit(p) for p in paths] if paths else list(default))
