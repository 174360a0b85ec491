"""The model port's data: what goes into a model call and what comes back.

Provider-neutral and serialisable: requests and responses are checkpointed in Redis, so every model
here round-trips through `model_dump_json()` / `model_validate_json()` unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Why the model stopped, in provider-neutral terms: the OpenTelemetry GenAI finish reasons (`stop`,
# `length`, `content_filter`, `tool_call`), plus two the executor must tell apart: `pause` (the
# provider paused a long turn; send it back as is to continue) and `context_length` (the
# conversation no longer fits the model's context window). Each adapter maps its provider's reasons
# onto these (llm/anthropic.py).
StopReason = Literal["stop", "tool_call", "length", "content_filter", "pause", "context_length"]

# Responses stored before the names were neutral (step checkpoints, cassettes) carry the provider's
# own names, which were Anthropic's: `ModelResponse` reads them as their neutral equivalents. Frozen:
# an adapter's live table (`llm.anthropic.STOP_REASONS`) may grow, stored data does not.
_STORED_NAMES: dict[str, StopReason] = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_call"}
_STORED_NAMES |= {"max_tokens": "length", "refusal": "content_filter", "pause_turn": "pause"}
_STORED_NAMES |= {"model_context_window_exceeded": "context_length"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextBlock(_Model):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(_Model):
    type: Literal["tool_use"] = "tool_use"
    id: str = Field(min_length=1)
    name: str = Field(min_length=1, description="the tool's own name, before any provider mapping")
    input: dict[str, Any] = Field(default_factory=dict)
    # The provider sent arguments that are not a JSON object (a local server's `null` or broken
    # JSON): their raw text, with `input` empty. The tool gateway answers such a call with an ERROR
    # observation instead of running it. Left out of dumps when unset, so stored histories and
    # cassette digests are unchanged.
    invalid_input: str | None = Field(default=None, exclude_if=lambda v: v is None)


class ToolResultBlock(_Model):
    type: Literal["tool_result"] = "tool_result"
    tool_use_id: str = Field(min_length=1)
    content: str
    is_error: bool = False


class ThinkingBlock(_Model):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Model):
    role: Literal["user", "assistant"]
    content: list[ContentBlock] = Field(min_length=1)

    @classmethod
    def user(cls, text: str) -> Message:
        return cls(role="user", content=[TextBlock(text=text)])


class ToolDef(_Model):
    name: str = Field(min_length=1, description="any name; providers with stricter rules map it")
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None
    disable_parallel: bool = False

    @model_validator(mode="after")
    def _name_iff_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice needs a name exactly when its type is 'tool'")
        return self

    @classmethod
    def force(cls, name: str) -> ToolChoice:
        return cls(type="tool", name=name)


class ModelRequest(_Model):
    system: str = ""
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] = Field(default_factory=list)
    tool_choice: ToolChoice | None = Field(default=None, description="None: the provider's default (auto)")
    max_tokens: int = Field(gt=0)
    stop_sequences: list[str] = Field(default_factory=list)
    cache: bool = Field(default=True, description="ask the provider to cache the stable prefix")
    metadata: dict[str, str] = Field(
        default_factory=dict, description="our labels (goal_id, task_id, ...); never sent to the provider"
    )

    @model_validator(mode="after")
    def _forced_tool_offered(self) -> ModelRequest:
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in {t.name for t in self.tools}:
            raise ValueError(f"tool_choice forces {choice.name!r}, which is not among the offered tools")
        names = [t.name for t in self.tools]
        if len(names) != len(set(names)):
            raise ValueError(f"tool names must be unique, got {names}")
        return self


class Usage(_Model):
    input_tokens: int = Field(default=0, ge=0, description="uncached input tokens")
    output_tokens: int = Field(default=0, ge=0)
    cache_read_tokens: int = Field(default=0, ge=0)
    cache_write_tokens: int = Field(default=0, ge=0)

    @property
    def total(self) -> int:
        """Every token the call consumed (a property, so it is not stored in dumps)."""
        return self.input_tokens + self.output_tokens + self.cache_read_tokens + self.cache_write_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cache_read_tokens=self.cache_read_tokens + other.cache_read_tokens,
            cache_write_tokens=self.cache_write_tokens + other.cache_write_tokens,
        )


class RateLimitInfo(_Model):
    """What the provider said about its rate limits during one call (all attempts of it)."""

    throttled: int = Field(default=0, ge=0, description="429 answers the SDK retried within the call")
    retry_after: float | None = Field(default=None, description="the last 429's retry-after, seconds")
    requests_remaining: int | None = None
    input_tokens_remaining: int | None = None
    output_tokens_remaining: int | None = None


class ModelResponse(_Model):
    content: list[ContentBlock]
    stop_reason: StopReason
    usage: Usage
    request_id: str | None = None
    model: str
    # False when the provider's reply carried no usage (some local servers): `usage` is then zero and
    # means nothing; the ledger charges the call at its reservation's worst case and flags it.
    # Left out of dumps when True, so stored responses and cassettes are unchanged.
    usage_reported: bool = Field(default=True, exclude_if=lambda v: v)
    # Transport metadata, never stored or recorded (cassettes, results): excluded from dumps.
    rate_limit: RateLimitInfo | None = Field(default=None, exclude=True)

    @field_validator("stop_reason", mode="before")
    @classmethod
    def _stored_name(cls, value: Any) -> Any:
        """A stop reason stored under its older, Anthropic name reads as the neutral one."""
        return _STORED_NAMES.get(value, value) if isinstance(value, str) else value

    @property
    def text(self) -> str:
        """The text blocks joined, in order ("" when there are none)."""
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))

    @property
    def tool_uses(self) -> list[ToolUseBlock]:
        return [b for b in self.content if isinstance(b, ToolUseBlock)]

    def as_message(self) -> Message:
        """The assistant turn to append to the history (thinking blocks included, as providers require)."""
        return Message(role="assistant", content=list(self.content))
