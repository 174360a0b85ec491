"""taskloom's model port: provider-neutral request/response types, typed errors, the Anthropic
adapter, the offline demo model, and (in `llm.testing`) a fake Messages API server.

`llm` imports nothing else of taskloom's. `AnthropicModel` and `OpenAIModel` are imported lazily so that
importing the types does not load an SDK (the `openai` one is an extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llm.demo import DemoModel
from llm.errors import (
    ModelConfigError,
    ModelConnectionError,
    ModelError,
    ModelTimeoutError,
    RetryableModelError,
    TerminalModelError,
    ToolNameCollisionError,
    ToolPairingError,
)
from llm.estimate import estimate_input_tokens
from llm.pairing import check_tool_pairing
from llm.port import ModelPort
from llm.types import (
    ContentBlock,
    Message,
    ModelRequest,
    ModelResponse,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolDef,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)

if TYPE_CHECKING:
    from llm.anthropic import AnthropicModel
    from llm.openai import OpenAIModel

__all__ = [
    "AnthropicModel",
    "ContentBlock",
    "DemoModel",
    "Message",
    "ModelConfigError",
    "ModelConnectionError",
    "ModelError",
    "ModelPort",
    "ModelRequest",
    "ModelResponse",
    "ModelTimeoutError",
    "OpenAIModel",
    "RetryableModelError",
    "StopReason",
    "TerminalModelError",
    "TextBlock",
    "ThinkingBlock",
    "ToolChoice",
    "ToolDef",
    "ToolNameCollisionError",
    "ToolPairingError",
    "ToolResultBlock",
    "ToolUseBlock",
    "Usage",
    "check_tool_pairing",
    "estimate_input_tokens",
    "make_model",
]


def __getattr__(name: str) -> Any:
    if name == "AnthropicModel":
        from llm.anthropic import AnthropicModel

        return AnthropicModel
    if name == "OpenAIModel":
        from llm.openai import OpenAIModel

        return OpenAIModel
    raise AttributeError(f"module 'llm' has no attribute {name!r}")


def make_model(model: str, **kwargs: Any) -> ModelPort:
    """`DemoModel()` for "demo", else `AnthropicModel(model, **kwargs)` (the `TASKLOOM_MODEL` rule)."""
    if model == "demo":
        return DemoModel()
    from llm.anthropic import AnthropicModel

    return AnthropicModel(model, **kwargs)
