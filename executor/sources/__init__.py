"""Where tools come from. A `ToolSource` lists tools and runs a call; the executor's gateway
(`executor.gateway`) is still the only code that decides whether and how a call runs.

- `executor.sources.toolkit.ToolkitSource`: Python functions of a `Toolkit`.
- `executor.sources.mcp.McpSource`: one MCP server (stdio or streamable HTTP), imported only when
  `TASKLOOM_MCP_CONFIG` is set (the `mcp` package is the optional extra `taskloom[mcp]`).
- `executor.sources.catalog.Catalog`: every source of a worker, one cached, collision-checked catalog.
"""

from .base import CatalogTool, InvalidArguments, OutcomeUnknown, ToolContext, ToolError, ToolSource

__all__ = ["CatalogTool", "InvalidArguments", "OutcomeUnknown", "ToolContext", "ToolError", "ToolSource"]
