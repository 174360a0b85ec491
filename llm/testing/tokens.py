"""How the fake server counts tokens: deterministic, from the wire body, and never above
`llm.estimate.estimate_input_tokens` for the same request (so a ledger that reserves the estimate
always covers what the fake server bills).

    input  = ceil(B / 4) + 8 + 4 per message + 2 per content block + 8 per tool + 300 if any tool
    output = sum over reply blocks of (ceil(b / 4) + 1), at least 1

B counts the same text as the estimator (system, text, tool_use name and input JSON, tool_result
content, thinking, tool name/description/schema JSON), with compact JSON.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

_BYTES_PER_TOKEN = 4


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-8")) / _BYTES_PER_TOKEN)


def _text_of_block(block: Any) -> str:
    if isinstance(block, str):
        return block
    if not isinstance(block, dict):
        return _json(block)
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "tool_use":
        return str(block.get("name", "")) + _json(block.get("input", {}))
    if kind == "tool_result":
        content = block.get("content", "")
        if isinstance(content, list):
            return "".join(_text_of_block(c) for c in content)
        return str(content)
    if kind == "thinking":
        return str(block.get("thinking", ""))
    return ""


@dataclass(frozen=True)
class Segment:
    """One cacheable unit of the prompt, in the order the provider reads it (tools, system, messages)."""

    key: str  # identity of the content, without cache_control
    tokens: int
    marked: bool


def segments(body: dict[str, Any]) -> list[Segment]:
    """The prompt as segments; the per-request overhead is not in any segment."""
    out: list[Segment] = []

    def add(item: Any, text: str, extra: int) -> None:
        marked = isinstance(item, dict) and "cache_control" in item
        clean = {k: v for k, v in item.items() if k != "cache_control"} if isinstance(item, dict) else item
        out.append(Segment(key=_json(clean), tokens=_tokens(text) + extra, marked=marked))

    tools = body.get("tools") or []
    for tool in tools:
        text = str(tool.get("name", "")) + str(tool.get("description", "")) + _json(tool.get("input_schema", {}))
        add(tool, text, 8)
    system = body.get("system")
    if isinstance(system, str) and system:
        add(system, system, 0)
    elif isinstance(system, list):
        for block in system:
            add(block, _text_of_block(block), 0)
    for message in body.get("messages") or []:
        content = message.get("content", "")
        blocks = [content] if isinstance(content, str) else content
        for i, block in enumerate(blocks):
            add(block, _text_of_block(block), 2 + (4 if i == 0 else 0))
    return out


def count_input_tokens(body: dict[str, Any]) -> int:
    """All input tokens of a request, cached or not."""
    return 8 + (300 if body.get("tools") else 0) + sum(s.tokens for s in segments(body))


def split_cached(body: dict[str, Any], cache: set[str], min_tokens: int = 0) -> tuple[int, int, int]:
    """(uncached input, cache read, cache write) for `body`, updating `cache` with its marked prefixes.

    A marked prefix seen before is read from cache; the tokens after it up to the last marker are
    written. Prefixes shorter than `min_tokens` are never cached (the real API has such a floor).
    """
    total = count_input_tokens(body)
    prefix = hashlib.sha256(str(body.get("model", "")).encode())
    running = 0
    boundaries: list[tuple[str, int]] = []  # (prefix key, tokens up to and including the segment)
    marks: list[tuple[str, int]] = []  # the same, for marked segments
    for segment in segments(body):
        prefix.update(segment.key.encode("utf-8"))
        running += segment.tokens
        boundaries.append((prefix.hexdigest(), running))
        if segment.marked and running >= min_tokens:
            marks.append(boundaries[-1])
    last = marks[-1][1] if marks else 0
    # Like the real API, a marker also hits a cached prefix that ends at an earlier block.
    read = max((tokens for key, tokens in boundaries if tokens <= last and key in cache), default=0)
    write = max(0, last - read)
    cache.update(key for key, _ in marks)
    return total - read - write, read, write


def count_output_tokens(content: list[dict[str, Any]]) -> int:
    return max(1, sum(_tokens(_text_of_block(block)) + 1 for block in content))
