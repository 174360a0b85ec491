"""The OpenAI-compatible adapter: `ModelPort` over the official SDK's Chat Completions API.

Speaks `POST /chat/completions` with native tool calling, to OpenAI itself, Azure OpenAI
(`AsyncAzureOpenAI`), or any server with an OpenAI-compatible endpoint (vLLM, llama.cpp, Ollama,
LM Studio...). Local servers bend the dialect; every bend handled here is named in `to_response`
and in llm/README.md.

Retries belong to the SDK (`max_retries`; it backs off exponentially and honours `retry-after` and
`retry-after-ms`). This adapter adds no second backoff: when the SDK gives up, the failure is mapped
once to an `llm.errors` type.

Error mapping (after the SDK's retries):

- 408, 409, 429, 5xx -> `RetryableModelError(status, request_id, retry_after)`;
- a 4xx saying the prompt does not fit the context window (code `context_length_exceeded`, or a
  message about the context length) -> `ContextLengthError`, a `TerminalModelError`;
- any other status -> `TerminalModelError`;
- the connection could not be opened on any attempt -> `ModelConnectionError` (nothing was sent);
- read timeout, or the connection dropped after the request was sent (also mid-stream) ->
  `ModelTimeoutError` (`maybe_spent=True`);
- a success status whose body cannot be parsed -> `RetryableModelError(maybe_spent=True)`.

`maybe_spent` is True whenever any attempt, not only the last, may have been billed: the SDK is
given an HTTP client (its own default one) that records every attempt it sends.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx2
import openai

from llm.errors import (
    ContextLengthError,
    ModelConfigError,
    ModelConnectionError,
    ModelError,
    ModelTimeoutError,
    RetryableModelError,
    TerminalModelError,
)
from llm.keepalive import connection_limits
from llm.pacing import gulped
from llm.pairing import check_tool_pairing
from llm.port import TextSink
from llm.toolnames import ToolNameMap
from llm.types import (
    ContentBlock,
    Message,
    ModelRequest,
    ModelResponse,
    RateLimitInfo,
    StopReason,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)

API_KEY_ENV = "OPENAI_API_KEY"
BASE_URL_ENV = "OPENAI_BASE_URL"

# Chat Completions finish reasons, by their neutral names. A reply without one (None, or a name a
# local server made up) is read by `stop_reason`: `tool_call` when it calls tools, else `stop`.
OPENAI_FINISH_REASONS: dict[str, StopReason] = {
    "stop": "stop",
    "tool_calls": "tool_call",
    "function_call": "tool_call",
    "length": "length",
    "content_filter": "content_filter",
}

# A tool_result with is_error=true is sent as a tool message whose content starts with this (Chat
# Completions has no error flag on tool messages): the model reads that the call failed. Content that
# already starts with it (the tool gateway's `ERROR: ...` observations) is sent unchanged.
ERROR_PREFIX = "ERROR: "

# How a 4xx says the prompt does not fit: OpenAI's code, or the message of servers without one
# (vLLM "maximum context length", llama.cpp "exceeds the available context size", Azure's wording).
CONTEXT_LENGTH_CODE = "context_length_exceeded"
_CONTEXT_MESSAGE = re.compile(r"context.{0,12}(length|window|size)|maximum context", re.IGNORECASE)

# Exceptions whose cause means the request never left this machine.
_NOT_SENT = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout)


# -- request building (pure) -------------------------------------------------------------------


def tool_name_map(request: ModelRequest) -> ToolNameMap:
    """The name map for every tool name the request mentions: offered tools, then history calls."""
    names = [t.name for t in request.tools]
    names += [b.name for m in request.messages for b in m.content if isinstance(b, ToolUseBlock)]
    return ToolNameMap(names)


def tool_result_content(block: ToolResultBlock) -> str:
    """A tool_result's content as the model reads it (with `ERROR_PREFIX` when it failed)."""
    if block.is_error and not block.content.startswith(ERROR_PREFIX.strip()):
        return ERROR_PREFIX + block.content
    return block.content


def tool_call_arguments(block: ToolUseBlock) -> str:
    """The `arguments` string of a call in the history: its input as JSON, or the raw invalid text."""
    return block.invalid_input if block.invalid_input is not None else json.dumps(block.input)


def _messages(message: Message, names: ToolNameMap) -> list[dict[str, Any]]:
    if message.role == "assistant":
        text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
        calls = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": names.to_provider(b.name), "arguments": tool_call_arguments(b)},
            }
            for b in message.content
            if isinstance(b, ToolUseBlock)
        ]
        if not text and not calls:
            return []  # only thinking blocks, which Chat Completions cannot carry
        out: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            out["tool_calls"] = calls
        return [out]
    # A user turn: its tool_results (which open it) become one tool message each, in order; the rest
    # of its text one user message after them.
    wire = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": tool_result_content(b)}
        for b in message.content
        if isinstance(b, ToolResultBlock)
    ]
    texts = [b.text for b in message.content if isinstance(b, TextBlock)]
    if texts:
        wire.append({"role": "user", "content": "\n\n".join(texts)})
    return wire


def prompt_cache_key(goal_id: str) -> str:
    """A short stable key for OpenAI's prompt cache routing (the goal id itself is not sent)."""
    return "tl-" + hashlib.sha256(goal_id.encode("utf-8")).hexdigest()[:16]


def build_params(
    request: ModelRequest,
    model: str,
    names: ToolNameMap,
    *,
    cache_key: bool = False,
    max_tokens_param: str = "max_completion_tokens",
) -> dict[str, Any]:
    """The keyword arguments of `chat.completions.create` for `request` (no I/O, no streaming keys).

    The prompt's stable parts come first (tools, then the system message), as OpenAI's automatic
    prefix cache wants. `metadata` is not sent; with `cache_key`, a hash of its `goal_id` is, as
    `prompt_cache_key`.
    """
    messages: list[dict[str, Any]] = [{"role": "system", "content": request.system}] if request.system else []
    for message in request.messages:
        messages += _messages(message, names)
    params: dict[str, Any] = {"model": model, "messages": messages, max_tokens_param: request.max_tokens}
    if request.tools:
        params["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": names.to_provider(t.name),
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in request.tools
        ]
    if request.stop_sequences:
        params["stop"] = list(request.stop_sequences)
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool" and choice.name is not None:
            params["tool_choice"] = {"type": "function", "function": {"name": names.to_provider(choice.name)}}
        else:
            params["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel and request.tools:
            params["parallel_tool_calls"] = False
    goal_id = request.metadata.get("goal_id")
    if cache_key and request.cache and goal_id:
        params["prompt_cache_key"] = prompt_cache_key(goal_id)
    return params


# -- response mapping (pure) -------------------------------------------------------------------


def synthetic_call_id(index: int, name: str, arguments: Any, turn: int = 0) -> str:
    """A stable id for a tool call that came without a usable one: the same reply to the same history
    always gets the same id. `turn` (the history's length) keeps the same call in a later turn apart."""
    digest = hashlib.sha256(f"{turn}\x00{index}\x00{name}\x00{arguments}".encode()).hexdigest()[:24]
    return f"call_{digest}"


def _history_ids(request: ModelRequest | None) -> set[str]:
    if request is None:
        return set()
    return {b.id for m in request.messages for b in m.content if isinstance(b, ToolUseBlock)}


def parse_arguments(arguments: Any, *, no_parameters: bool = False) -> tuple[dict[str, Any], str | None]:
    """(input, invalid_input) for a call's `arguments`: a JSON object, or the raw text of anything else.

    `null`, broken JSON and JSON that is not an object never crash: the input is {} and the raw text
    (`"null"` for a missing value) is kept for the tool gateway to refuse. An empty string is {} for a
    tool that takes no parameters (local servers send "" for such calls) and invalid otherwise.
    """
    if arguments is None:
        return {}, "null"
    if isinstance(arguments, dict):  # a server that sends the object itself
        return dict(arguments), None
    if not isinstance(arguments, str):
        return {}, json.dumps(arguments)
    if not arguments.strip():
        return ({}, None) if no_parameters else ({}, arguments)
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}, arguments
    return (value, None) if isinstance(value, dict) else ({}, arguments)


def usage_from_wire(usage: Mapping[str, Any] | None) -> Usage | None:
    """Our usage for a Chat Completions `usage` object (None when the reply carried none)."""
    if not usage:
        return None
    prompt = int(usage.get("prompt_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Usage(
        input_tokens=max(0, prompt - cached),
        output_tokens=int(usage.get("completion_tokens") or 0),
        cache_read_tokens=min(cached, prompt) if prompt else cached,
    )


def stop_reason(
    finish_reason: str | None, has_tool_calls: bool, usage: Usage | None = None, max_tokens: int | None = None
) -> StopReason:
    """The neutral stop reason of a choice.

    Unknown or missing: `tool_call` when the reply calls tools, else `stop`. `length` with fewer
    output tokens than the request allowed, and no tool call, means the context window, not
    `max_tokens`, ended the reply (llama.cpp and vLLM stop so when the prompt fills the context):
    `context_length`. With tool calls it stays `length`, whose complete calls the executor runs.
    """
    mapped = OPENAI_FINISH_REASONS.get(finish_reason or "")
    if mapped is None:
        return "tool_call" if has_tool_calls else "stop"
    cut_short = usage is not None and max_tokens is not None and usage.output_tokens < max_tokens
    if mapped == "length" and cut_short and not has_tool_calls:
        return "context_length"
    return mapped


def _tools_without_parameters(request: ModelRequest | None, names: ToolNameMap) -> set[str]:
    if request is None:
        return set()
    return {names.to_provider(t.name) for t in request.tools if not (t.input_schema.get("properties") or {})}


def to_response(
    completion: Mapping[str, Any],
    names: ToolNameMap,
    model: str,
    *,
    request: ModelRequest | None = None,
    request_id: str | None = None,
) -> ModelResponse:
    """Our response for a Chat Completions body (a dict; the first choice is read).

    A `refusal` (OpenAI's structured-outputs refusal) is a `content_filter` stop with its text.
    Fields of other dialects (`reasoning_content`, logprobs) are ignored.
    Local-server bends handled: no `usage` (usage_reported=False, usage zero); a tool call without an
    id, with an empty one, or with one the history or this reply already used (`synthetic_call_id`);
    arguments that are null, empty, broken or not an object (`parse_arguments`); a missing or unknown
    finish reason (`stop_reason`).
    """
    choices = completion.get("choices") or []
    if not choices:
        raise RetryableModelError("the provider's response has no choices", request_id=request_id, maybe_spent=True)
    choice = choices[0]
    message = choice.get("message") or {}
    content: list[ContentBlock] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append(TextBlock(text=text))
    # OpenAI's refusal (structured outputs): its explanation as the text, and a content_filter stop.
    refusal = message.get("refusal")
    if isinstance(refusal, str) and refusal and not content:
        content.append(TextBlock(text=refusal))
    no_parameters = _tools_without_parameters(request, names)
    taken = _history_ids(request)
    turn = len(request.messages) if request is not None else 0
    for index, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") or {}
        wire_name = str(function.get("name") or "")
        if not wire_name:
            continue  # nothing to route it to; the model sees its turn without it
        raw_arguments = function.get("arguments")
        tool_input, invalid = parse_arguments(raw_arguments, no_parameters=wire_name in no_parameters)
        call_id = str(call.get("id") or "")
        if not call_id or call_id in taken:  # missing, or reused (servers numbering calls `call_0`... per turn)
            call_id = synthetic_call_id(index, wire_name, raw_arguments, turn)
        taken.add(call_id)
        content.append(ToolUseBlock(id=call_id, name=names.to_ours(wire_name), input=tool_input, invalid_input=invalid))
    usage = usage_from_wire(completion.get("usage"))
    has_calls = any(isinstance(b, ToolUseBlock) for b in content)
    reason = stop_reason(
        choice.get("finish_reason"), has_calls, usage, request.max_tokens if request is not None else None
    )
    return ModelResponse(
        content=content,
        stop_reason="content_filter" if refusal and not has_calls else reason,
        usage=usage or Usage(),
        usage_reported=usage is not None,
        request_id=request_id,
        model=str(completion.get("model") or model),
    )


def assemble_stream(chunks: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The Chat Completions body a sequence of streamed chunks (dicts) adds up to.

    Tool-call deltas are grouped by their `index`, never by `id`: the id arrives only on a call's
    first delta, and some servers repeat it on every delta or leave it out.
    """
    completion: dict[str, Any] = {"model": None, "usage": None}
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish_reason: str | None = None
    for chunk in chunks:
        completion["model"] = completion["model"] or chunk.get("model")
        completion["id"] = completion.get("id") or chunk.get("id")
        if chunk.get("usage"):
            completion["usage"] = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                text.append(delta["content"])
            for position, part in enumerate(delta.get("tool_calls") or []):
                index = part.get("index", position)
                call = calls.setdefault(index, {"id": None, "name": "", "arguments": None})
                call["id"] = call["id"] or part.get("id")
                function = part.get("function") or {}
                if function.get("name"):
                    call["name"] = call["name"] or function["name"]
                piece = function.get("arguments")
                if piece is not None:
                    call["arguments"] = (call["arguments"] or "") + (
                        piece if isinstance(piece, str) else json.dumps(piece)
                    )
            if choice.get("finish_reason"):
                finish_reason = choice["finish_reason"]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(calls.items())
        ]
    completion["choices"] = [{"index": 0, "message": message, "finish_reason": finish_reason}]
    return completion


def chunk_text(chunk: Mapping[str, Any]) -> str:
    """The text a streamed chunk adds to the reply (the first choice's `content` delta, as
    `assemble_stream` reads it), or ""."""
    for choice in chunk.get("choices") or []:
        if choice.get("index", 0) == 0:
            content = (choice.get("delta") or {}).get("content")
            return content if isinstance(content, str) else ""
    return ""


# -- attempts and errors -----------------------------------------------------------------------


@dataclass
class _Attempts:
    """What each HTTP attempt of one call did, recorded by the transport."""

    maybe_billed: bool = False
    outcomes: list[str] = field(default_factory=list)
    throttled: int = 0  # 429 answers (the SDK retries them within the call)
    retry_after: float | None = None
    remaining: dict[str, int] = field(default_factory=dict)  # x-ratelimit-remaining-*, last seen

    def rate_limit(self) -> RateLimitInfo | None:
        if not self.throttled and not self.remaining:
            return None
        return RateLimitInfo(
            throttled=self.throttled,
            retry_after=self.retry_after,
            requests_remaining=self.remaining.get("requests"),
            # OpenAI counts one token budget for input and output; it is reported as the input's.
            input_tokens_remaining=self.remaining.get("tokens"),
        )


_ATTEMPTS: contextvars.ContextVar[_Attempts | None] = contextvars.ContextVar("llm_openai_attempts", default=None)


def retry_after(headers: Mapping[str, str]) -> float | None:
    """The server's retry hint in seconds: `retry-after-ms`, else `retry-after` (seconds)."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        try:
            return float(headers[name]) * scale
        except (KeyError, ValueError):
            continue
    return None


class _RecordingClient(openai.DefaultAsyncHttpxClient):
    """The SDK's HTTP client (with its defaults), seeing every attempt: the SDK retries above `send`.

    `send`, not a transport, so that attempts through proxy transports (`HTTPS_PROXY`) are seen too.
    """

    async def send(self, request: httpx2.Request, **kwargs: Any) -> httpx2.Response:
        attempts = _ATTEMPTS.get()
        try:
            response = await super().send(request, **kwargs)
        except Exception as err:
            if attempts is not None:
                not_sent = isinstance(err, _NOT_SENT)
                attempts.outcomes.append("not sent" if not_sent else "no response")
                attempts.maybe_billed |= not not_sent
            raise
        if attempts is not None:
            status = response.status_code
            attempts.outcomes.append(str(status))
            attempts.maybe_billed |= status < 400
            if status == 429:
                attempts.throttled += 1
                attempts.retry_after = retry_after(response.headers)
            for kind in ("requests", "tokens"):
                value = response.headers.get(f"x-ratelimit-remaining-{kind}")
                if value is not None and value.isdigit():
                    attempts.remaining[kind] = int(value)
        return response


def is_context_length(code: str | None, message: str) -> bool:
    """Whether a 4xx refusal says the prompt does not fit the model's context window."""
    return code == CONTEXT_LENGTH_CODE or bool(_CONTEXT_MESSAGE.search(message))


def map_error(err: openai.OpenAIError, maybe_billed: bool) -> ModelError:
    """The `llm.errors` type for an SDK failure that survived the SDK's retries."""
    if isinstance(err, openai.APIStatusError):
        status = err.status_code
        kwargs: dict[str, Any] = {"status": status, "request_id": err.request_id, "maybe_spent": maybe_billed}
        if status in (408, 409, 429) or status >= 500:
            return RetryableModelError(
                f"provider error {status}: {err.message}", retry_after=retry_after(err.response.headers), **kwargs
            )
        if is_context_length(err.code, err.message):
            return ContextLengthError(
                f"the request does not fit the model's context length ({status}): {err.message}", **kwargs
            )
        return TerminalModelError(f"provider refused the request ({status}): {err.message}", **kwargs)
    if isinstance(err, openai.APITimeoutError) and not isinstance(err.__cause__, _NOT_SENT):
        return ModelTimeoutError("no response from the provider before the timeout")
    if isinstance(err, openai.APIConnectionError):
        if maybe_billed or not isinstance(err.__cause__, _NOT_SENT):
            return ModelTimeoutError(f"the connection failed after the request was sent: {err.__cause__!r}")
        return ModelConnectionError(f"could not connect to the provider: {err.__cause__!r}")
    if isinstance(err, openai.APIResponseValidationError):
        return RetryableModelError(
            f"the provider's response does not match the schema: {err.message}",
            status=err.status_code,
            maybe_spent=True,
        )
    if isinstance(err, openai.APIError):  # an error event inside a 200 stream
        return RetryableModelError(f"the provider reported an error mid-reply: {err.message}", maybe_spent=True)
    return TerminalModelError(f"{type(err).__name__}: {err}", maybe_spent=maybe_billed)


# -- the adapter ------------------------------------------------------------------------------


class OpenAIModel:
    """`ModelPort` over `openai.AsyncOpenAI` (or `AsyncAzureOpenAI`) Chat Completions (one client, reused)."""

    name = "openai"

    def __init__(
        self,
        model: str,
        *,
        api_key: str | None = None,
        api_key_env: str = API_KEY_ENV,
        base_url: str | None = None,
        max_retries: int = 2,
        timeout: float = 60.0,
        strict_validation: bool = False,
        azure_endpoint: str | None = None,
        api_version: str | None = None,
        prompt_cache_key: bool = False,
        stream: bool = False,
        extra_body: dict[str, Any] | None = None,
        max_tokens_param: str = "max_completion_tokens",
    ) -> None:
        key = api_key or os.environ.get(api_key_env)
        if not key:
            raise ModelConfigError(
                f"no API key for the OpenAI-compatible model {model!r}: set {api_key_env} or pass api_key="
            )
        if max_tokens_param not in ("max_completion_tokens", "max_tokens"):
            raise ModelConfigError(
                f"max_tokens_param must be 'max_completion_tokens' or 'max_tokens', got {max_tokens_param!r}"
            )
        self.model = model
        self.base_url = base_url or os.environ.get(BASE_URL_ENV) or None
        self.azure_endpoint = azure_endpoint
        self._cache_key = prompt_cache_key
        self._stream = stream
        self._extra_body = dict(extra_body) if extra_body else None
        self._max_tokens_param = max_tokens_param
        common: dict[str, Any] = {
            "api_key": key,
            "max_retries": max_retries,
            "timeout": httpx2.Timeout(timeout, connect=min(timeout, 5.0)),
            # Idle connections kept 30 s, not the SDK's 5 (llm.keepalive: a fleet's calls come in bursts).
            "http_client": _RecordingClient(limits=connection_limits(openai.DEFAULT_CONNECTION_LIMITS)),
            "_strict_response_validation": strict_validation,
        }
        self._client: openai.AsyncOpenAI
        try:
            if azure_endpoint:
                self._client = openai.AsyncAzureOpenAI(azure_endpoint=azure_endpoint, api_version=api_version, **common)
            else:
                self._client = openai.AsyncOpenAI(base_url=self.base_url, **common)
        except (openai.OpenAIError, ValueError) as err:  # Azure without an api_version, say
            raise ModelConfigError(f"the OpenAI client for {model!r} cannot be built: {err}") from err

    def __repr__(self) -> str:
        where = self.azure_endpoint or self.base_url
        return f"OpenAIModel(model={self.model!r}, base_url={where!r})"

    async def complete(self, request: ModelRequest, on_text: TextSink | None = None) -> ModelResponse:
        check_tool_pairing(request.messages)
        names = tool_name_map(request)
        params = build_params(
            request, self.model, names, cache_key=self._cache_key, max_tokens_param=self._max_tokens_param
        )
        if self._extra_body:
            params["extra_body"] = self._extra_body
        attempts = _Attempts()
        token = _ATTEMPTS.set(attempts)
        try:
            if self._stream or on_text is not None:
                completion, request_id = await self._streamed(params, on_text)
            else:
                completion, request_id = await self._whole(params)
        except openai.OpenAIError as err:
            raise map_error(err, attempts.maybe_billed) from err
        except httpx2.HTTPError as err:  # the connection broke while a 200 stream was being read
            raise ModelTimeoutError(f"the connection failed during the reply: {err!r}") from err
        except ValueError as err:  # a 2xx body that is not JSON (JSONDecodeError...)
            raise RetryableModelError(f"the provider's response could not be parsed: {err}", maybe_spent=True) from err
        finally:
            _ATTEMPTS.reset(token)
        response = to_response(completion, names, self.model, request=request, request_id=request_id)
        info = attempts.rate_limit()
        return response if info is None else response.model_copy(update={"rate_limit": info})

    async def _whole(self, params: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        completion = await self._client.chat.completions.create(**params)
        if not hasattr(completion, "to_dict"):  # a 2xx whose body was not a JSON object
            raise ValueError(f"expected a chat completion object, got {type(completion).__name__}")
        return completion.to_dict(), getattr(completion, "_request_id", None)

    async def _streamed(
        self, params: dict[str, Any], on_text: TextSink | None = None
    ) -> tuple[dict[str, Any], str | None]:
        stream = await self._client.chat.completions.create(
            **params, stream=True, stream_options={"include_usage": True}
        )
        chunks: list[dict[str, Any]] = []
        # Gulped only for a watcher: a reply streamed because the server needs it (no watcher) would
        # only end later for it.
        chunks_in = aiter(stream) if on_text is None else gulped(aiter(stream))
        async with stream:
            async for chunk in chunks_in:
                data = chunk.to_dict()
                chunks.append(data)
                if on_text is not None:
                    text = chunk_text(data)
                    if text:
                        on_text(text)
        request_id = stream.response.headers.get("x-request-id")
        if not chunks:  # a 200 whose body held no `data:` chunk (not SSE at all, say)
            raise ValueError("the streamed reply carried no chunks")
        completion = assemble_stream(chunks)
        if completion["choices"][0]["finish_reason"] is None:
            # Every server we know ends a stream with a finish_reason (OpenAI, vLLM, llama.cpp, Ollama);
            # a stream whose connection closed before one is a cut reply, not a complete one.
            raise ModelTimeoutError(
                f"the streamed reply ended after {len(chunks)} chunks without a finish_reason (connection cut?)",
                request_id=request_id,
            )
        return completion, request_id

    async def aclose(self) -> None:
        await self._client.close()
