"""A pure, deterministic, conservative estimate of a request's input tokens.

The budget ledger reserves `estimate_input_tokens(request) + request.max_tokens` before a call and
settles with the provider's reported usage after it, so the estimate must err high, never low.

Formula (UTF-8 bytes, so non-Latin text is not under-counted):

    tokens = ceil(B / 2.5)                      B = bytes of all the text below
           + 16                                 per request
           + 8 per message + 4 per content block
           + 16 per tool + 500 once if any tool is offered (the provider's hidden tool-use prompt)

where the text is: the system prompt; text blocks; each tool_use block's name and its input as JSON;
each tool_result's content; thinking text; each tool's name, description and input schema as JSON.

2.5 bytes per token is below what Claude tokenizers average on English prose and JSON (about 3.5
characters per token, a little fewer on newer models), which makes the estimate an over-estimate
in practice. It is not a bound: the settlement after the call is what the ledger trusts.
"""

from __future__ import annotations

import json
import math
from typing import Any

from llm.types import ModelRequest, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock

BYTES_PER_TOKEN = 2.5
PER_REQUEST = 16
PER_MESSAGE = 8
PER_BLOCK = 4
PER_TOOL = 16
TOOLS_PROMPT = 500


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


def estimate_input_tokens(request: ModelRequest) -> int:
    """Over-estimate of the input tokens `request` will be billed (see the module docstring)."""
    nbytes = _nbytes(request.system)
    overhead = PER_REQUEST
    for message in request.messages:
        overhead += PER_MESSAGE
        for block in message.content:
            overhead += PER_BLOCK
            if isinstance(block, TextBlock):
                nbytes += _nbytes(block.text)
            elif isinstance(block, ToolUseBlock):
                nbytes += _nbytes(block.name) + _nbytes(_json(block.input))
            elif isinstance(block, ToolResultBlock):
                nbytes += _nbytes(block.content)
            elif isinstance(block, ThinkingBlock):
                nbytes += _nbytes(block.thinking)
    for tool in request.tools:
        overhead += PER_TOOL
        nbytes += _nbytes(tool.name) + _nbytes(tool.description) + _nbytes(_json(tool.input_schema))
    if request.tools:
        overhead += TOOLS_PROMPT
    return math.ceil(nbytes / BYTES_PER_TOKEN) + overhead
