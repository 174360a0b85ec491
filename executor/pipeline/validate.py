"""Step 1, validate: the tool exists and this task may use it, and the arguments fit its schema.

First, because every later rule reads the tool's flags (read_only, side_effects, requires_approval)
and the parsed arguments; a call that fails here never ran and never will as written, so it is not
remembered by the repeat policy either (the same mistake gets the same ERROR, bounded by max_steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from ..registry import ToolRegistry
from ..sources.base import InvalidArguments
from .call import Call

RAW_LIMIT = 200  # characters of arguments that are not a JSON object, quoted back to the model


def quote_raw(raw: str, limit: int = RAW_LIMIT) -> str:
    """The provider's raw argument text, cut so that a huge broken payload does not fill the context."""
    if len(raw) <= limit:
        return repr(raw)
    return f"{raw[:limit]!r} [... {len(raw) - limit} more characters]"


class Validate:
    name: ClassVar[str] = "validate"
    every_call: ClassVar[bool] = False

    def __init__(self, registry: ToolRegistry, allowed: Sequence[str]) -> None:
        self.registry = registry
        self.allowed = list(allowed)

    async def __call__(self, call: Call) -> None:
        block = call.block
        if block.name not in self.allowed:
            listed = ", ".join(self.allowed) or "(none)"
            if block.name in self.registry:
                call.fail("not_allowed", f"tool {block.name!r} is not allowed; available: {listed}", self.name)
            else:
                call.fail("unknown_tool", f"unknown tool {block.name!r}; available: {listed}", self.name)
            return
        if block.invalid_input is not None:
            # `input` is {} then: parsing it could even succeed (a tool without required parameters)
            # and run a call the model never wrote.
            call.fail(
                "invalid_args",
                f"invalid arguments for {block.name}: the arguments were not a JSON object "
                f"(received {quote_raw(block.invalid_input)}); send them as one JSON object",
                self.name,
            )
            return
        tool = self.registry.tools[block.name]
        try:
            call.args = tool.parse(block.input)
        except InvalidArguments as exc:
            call.fail("invalid_args", f"invalid arguments for {block.name}: {exc}", self.name)
            return
        call.tool = tool
