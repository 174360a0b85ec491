"""The Anthropic adapter: `ModelPort` over the official SDK's `AsyncAnthropic` client.

Retries belong to the SDK (`max_retries`; it backs off exponentially and honours `retry-after`,
`retry-after-ms` and `x-should-retry`). This adapter adds no second backoff: when the SDK gives up,
the failure is mapped once to an `llm.errors` type and the caller (an arq job) decides what next.

Error mapping (after the SDK's retries):

- 408, 409, 429, 5xx and 529 (overloaded) -> `RetryableModelError(status, request_id, retry_after)`
  (an explicit `x-should-retry: false` from the server makes it terminal);
- any other status -> `TerminalModelError`;
- the connection could not be opened (refused, DNS, connect or pool timeout) on every attempt ->
  `ModelConnectionError` (nothing reached the provider);
- read timeout, or the connection dropped after the request was sent -> `ModelTimeoutError`
  (the provider may have done the work: `maybe_spent=True`);
- a success status whose body cannot be parsed -> `RetryableModelError(maybe_spent=True)`;
- streamed (`complete(..., on_text=)`): an `error` event inside the 200 stream is mapped by its status
  like an error response; a stream that breaks or ends before its stop reason -> `ModelTimeoutError`
  (the text so far was billed).

`maybe_spent` is True whenever any attempt, not only the last, may have been billed: attempts are
observed through an SDK middleware.

The same adapter reaches Claude on AWS Bedrock and Google Vertex AI (`provider="bedrock"` /
`"vertex"`) through the SDK's `AsyncAnthropicBedrock` / `AsyncAnthropicVertex` clients: the request,
the response, the middleware and the tables above are shared; only the client, its credentials, the
model ids, the body's `anthropic_version` and where a request id is found differ. Bedrock adds one
status: 424 (`ModelErrorException`, "try your request again") is retryable, though the SDK does not
retry it within the call.
"""

from __future__ import annotations

import contextvars
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import aiohttp
import anthropic
import httpx2
import pydantic
from anthropic._request import APIRequest
from anthropic._response import AsyncAPIResponse

from llm.errors import (
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
    ModelRequest,
    ModelResponse,
    RateLimitInfo,
    StopReason,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)

# Anthropic's stop reasons, by their neutral names (`llm.types.StopReason`).
STOP_REASONS: dict[str, StopReason] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_call",
    "max_tokens": "length",
    "refusal": "content_filter",
    "pause_turn": "pause",
    "model_context_window_exceeded": "context_length",
}

Provider = Literal["anthropic", "bedrock", "vertex"]
PROVIDERS: tuple[Provider, ...] = ("anthropic", "bedrock", "vertex")

API_KEY_ENV = "ANTHROPIC_API_KEY"
BASE_URL_ENV = "ANTHROPIC_BASE_URL"
HTTP_CLIENT_ENV = "TASKLOOM_HTTP_CLIENT"
HttpClient = Literal["aiohttp", "httpx"]
_EPHEMERAL = {"type": "ephemeral"}

# The body's `anthropic_version` each platform documents. SDK 2.14 fills in the Messages API header's
# version (a date) when the body has none, which neither platform lists; so the adapter sets its own.
BODY_VERSIONS: dict[Provider, str] = {"bedrock": "bedrock-2023-05-31", "vertex": "vertex-2023-10-16"}

AWS_REGION_ENVS = ("AWS_REGION", "AWS_DEFAULT_REGION")
VERTEX_REGION_ENV = "CLOUD_ML_REGION"
VERTEX_PROJECT_ENVS = ("ANTHROPIC_VERTEX_PROJECT_ID", "GOOGLE_CLOUD_PROJECT")

# Where each platform puts its request id: Anthropic `request-id`, Bedrock `x-amzn-requestid`.
# Vertex is not documented to send either; its error bodies carry a top-level `request_id` (`req_vrtx_...`).
REQUEST_ID_HEADERS = ("request-id", "x-amzn-requestid")

# 424 is Bedrock's ModelErrorException ("the system encountered an unexpected error during processing.
# Try your request again"); the others are the SDK's own retry statuses (plus every 5xx).
RETRYABLE_STATUSES = frozenset({408, 409, 424, 429})

# Exceptions whose cause means the request never left this machine.
_NOT_SENT = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout)
# Under the aiohttp transport, what failed before the request left: connecting (refused, DNS, TLS,
# proxy) or its timeout. The transport reports every connection-level failure as httpx's
# ConnectError, a server that closed the connection after the request was sent included, so the
# aiohttp error under it decides.
_AIOHTTP_NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def transport_detail(err: BaseException | None) -> str:
    """A transport error for a message: its repr, and the error at the root of its chain when that
    says more (aiohttp's connect error shows only the OS error's number, which may be None)."""
    text = repr(err)
    root = err
    while root is not None and root.__cause__ is not None:
        root = root.__cause__
    root = getattr(root, "os_error", None) or root
    if root is not None and root is not err and str(root) not in text:
        text += f" ({type(root).__name__}: {root})"
    return text


def not_sent(err: BaseException | None) -> bool:
    """Whether a transport error (the cause of the SDK's APIConnectionError or APITimeoutError)
    happened before any of the request was sent: then the provider cannot have billed it."""
    if not isinstance(err, _NOT_SENT):
        return False
    cause = err.__cause__
    if isinstance(cause, aiohttp.ClientError):
        return isinstance(cause, _AIOHTTP_NOT_SENT)
    return True


# -- request building (pure) -------------------------------------------------------------------


def tool_name_map(request: ModelRequest) -> ToolNameMap:
    """The name map for every tool name the request mentions: offered tools, then history calls."""
    names = [t.name for t in request.tools]
    names += [b.name for m in request.messages for b in m.content if isinstance(b, ToolUseBlock)]
    return ToolNameMap(names)


def _block(block: ContentBlock, names: ToolNameMap) -> dict[str, Any]:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    if isinstance(block, ToolUseBlock):
        return {"type": "tool_use", "id": block.id, "name": names.to_provider(block.name), "input": block.input}
    if isinstance(block, ToolResultBlock):
        out: dict[str, Any] = {"type": "tool_result", "tool_use_id": block.tool_use_id, "content": block.content}
        if block.is_error:
            out["is_error"] = True
        return out
    return {"type": "thinking", "thinking": block.thinking, "signature": block.signature}


def build_params(request: ModelRequest, model: str, names: ToolNameMap) -> dict[str, Any]:
    """The keyword arguments of `messages.create` for `request` (no I/O; `metadata` is not sent).

    With `request.cache`, cache breakpoints go on the last tool (caches the tool list), the system
    block, and the last block of the latest user turn: at most 3 of the 4 the API allows.
    """
    messages: list[dict[str, Any]] = [
        {"role": m.role, "content": [_block(b, names) for b in m.content]} for m in request.messages
    ]
    tools: list[dict[str, Any]] = [
        {"name": names.to_provider(t.name), "description": t.description, "input_schema": t.input_schema}
        for t in request.tools
    ]
    params: dict[str, Any] = {"model": model, "max_tokens": request.max_tokens, "messages": messages}
    if request.system:
        params["system"] = [{"type": "text", "text": request.system}]
    if tools:
        params["tools"] = tools
    if request.stop_sequences:
        params["stop_sequences"] = list(request.stop_sequences)
    choice = request.tool_choice
    if choice is not None:
        wire_choice: dict[str, Any] = {"type": choice.type}
        if choice.type == "tool" and choice.name is not None:
            wire_choice["name"] = names.to_provider(choice.name)
        if choice.type != "none" and choice.disable_parallel:
            wire_choice["disable_parallel_tool_use"] = True
        params["tool_choice"] = wire_choice

    if request.cache:
        if tools:
            tools[-1]["cache_control"] = dict(_EPHEMERAL)
        if "system" in params:
            params["system"][-1]["cache_control"] = dict(_EPHEMERAL)
        last_user = next((m for m in reversed(messages) if m["role"] == "user"), None)
        if last_user is not None and last_user["content"][-1]["type"] != "thinking":
            last_user["content"][-1]["cache_control"] = dict(_EPHEMERAL)
    # At most 3 markers by construction (the blocks built above carry none; the API allows 4): the
    # tests count them with `count_cache_markers`, rather than every call walking the whole request.
    return params


def count_cache_markers(value: Any) -> int:
    """How many `cache_control` keys a wire request (or any JSON value) holds."""
    if isinstance(value, dict):
        return int("cache_control" in value) + sum(count_cache_markers(v) for v in value.values())
    if isinstance(value, list):
        return sum(count_cache_markers(v) for v in value)
    return 0


# -- response and error mapping (pure) ---------------------------------------------------------


def to_response(
    message: anthropic.types.Message, names: ToolNameMap, model: str, request_id: str | None = None
) -> ModelResponse:
    """`message` in the port's types; `request_id` is used when the SDK found none (`request-id` header)."""
    request_id = getattr(message, "_request_id", None) or request_id
    if message.stop_reason is None:
        raise TerminalModelError("the provider's response has no stop_reason", request_id=request_id)
    content: list[ContentBlock] = []
    for block in message.content:
        if block.type == "text":
            content.append(TextBlock(text=block.text))
        elif block.type == "tool_use":
            content.append(ToolUseBlock(id=block.id, name=names.to_ours(block.name), input=dict(block.input)))
        elif block.type == "thinking":
            content.append(ThinkingBlock(thinking=block.thinking, signature=block.signature))
        # Other block types (server tools, redacted thinking) need features we never enable.
    usage = message.usage
    # Mapped to the neutral names; one we do not know fails validation below, as it always did.
    stop_reason = STOP_REASONS.get(message.stop_reason, message.stop_reason)
    return ModelResponse(
        content=content,
        stop_reason=stop_reason,
        usage=Usage(
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cache_read_tokens=usage.cache_read_input_tokens or 0,
            cache_write_tokens=usage.cache_creation_input_tokens or 0,
        ),
        request_id=request_id,
        model=message.model or model,
    )


class StreamAssembly:
    """The Messages API body a stream of events adds up to, built as the events arrive.

    `add` takes one raw stream event (the SDK's `RawMessageStreamEvent`) and returns its text delta,
    if it is one. Our own, not the SDK's `messages.stream()` helper: that one re-parses a tool call's
    whole partial JSON on every delta and builds a second event object per event; here a tool call's
    input is parsed once, at the end, and a text delta costs an append.
    """

    def __init__(self) -> None:
        self.message: dict[str, Any] | None = None
        self.blocks: dict[int, dict[str, Any]] = {}
        self.parts: dict[int, list[str]] = {}  # text, tool-input JSON or thinking pieces, per block
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict[str, Any] = {}

    def add(self, event: Any) -> str | None:
        kind = event.type
        if kind == "content_block_delta":
            delta = event.delta
            if delta.type == "text_delta":
                self.parts[event.index].append(delta.text)
                return str(delta.text)
            if delta.type == "input_json_delta":
                self.parts[event.index].append(delta.partial_json)
            elif delta.type == "thinking_delta":
                self.parts[event.index].append(delta.thinking)
            elif delta.type == "signature_delta":
                self.blocks[event.index]["signature"] = delta.signature
        elif kind == "content_block_start":
            self.blocks[event.index] = event.content_block.to_dict()
            self.parts[event.index] = []
        elif kind == "message_start":
            self.message = event.message.to_dict()
            self.usage = dict(self.message.get("usage") or {})
        elif kind == "message_delta":
            self.stop_reason = event.delta.stop_reason
            self.stop_sequence = event.delta.stop_sequence
            # The delta's usage is cumulative: each count it gives replaces the start's.
            self.usage.update({k: v for k, v in event.usage.to_dict().items() if v is not None})
        return None

    def body(self) -> dict[str, Any]:
        """The complete Message body; raises `ModelTimeoutError` for a stream cut before its end."""
        if self.message is None or self.stop_reason is None:
            raise ModelTimeoutError("the streamed reply ended before its stop reason (connection cut?)")
        content: list[dict[str, Any]] = []
        for index in sorted(self.blocks):
            block, joined = self.blocks[index], "".join(self.parts[index])
            if block["type"] == "text":
                block["text"] = joined
            elif block["type"] == "tool_use":
                block["input"] = json.loads(joined) if joined else {}
            elif block["type"] == "thinking":
                block["thinking"] = joined
            content.append(block)
        return {
            **self.message,
            "content": content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage,
        }


@dataclass
class _Attempts:
    """What each HTTP attempt of one call did, recorded by the middleware."""

    maybe_billed: bool = False
    outcomes: list[str] = field(default_factory=list)
    throttled: int = 0  # 429 answers (the SDK retries them within the call)
    retry_after: float | None = None
    remaining: dict[str, int] = field(default_factory=dict)  # anthropic-ratelimit-*-remaining, last seen
    request_id: str | None = None  # of the last response, from whichever header the platform uses

    def rate_limit(self) -> RateLimitInfo | None:
        if not self.throttled and not self.remaining:
            return None
        return RateLimitInfo(
            throttled=self.throttled,
            retry_after=self.retry_after,
            requests_remaining=self.remaining.get("requests"),
            input_tokens_remaining=self.remaining.get("input-tokens"),
            output_tokens_remaining=self.remaining.get("output-tokens"),
        )


_RATELIMIT_KINDS = ("requests", "input-tokens", "output-tokens")


_ATTEMPTS: contextvars.ContextVar[_Attempts | None] = contextvars.ContextVar("llm_anthropic_attempts", default=None)


async def _record_attempt(request: APIRequest, call_next: Any) -> AsyncAPIResponse[Any]:
    attempts = _ATTEMPTS.get()
    try:
        response: AsyncAPIResponse[Any] = await call_next(request)
    except anthropic.APIConnectionError as err:
        if attempts is not None:
            unsent = not_sent(err.__cause__)
            attempts.outcomes.append("not sent" if unsent else "no response")
            attempts.maybe_billed |= not unsent
        raise
    if attempts is not None:
        status = response.http_response.status_code
        attempts.outcomes.append(str(status))
        attempts.maybe_billed |= status < 400
        headers = response.http_response.headers
        attempts.request_id = request_id_from(headers)
        if status == 429:
            attempts.throttled += 1
            attempts.retry_after = _retry_after(headers)
        for kind in _RATELIMIT_KINDS:
            value = headers.get(f"anthropic-ratelimit-{kind}-remaining")
            if value is not None and value.isdigit():
                attempts.remaining[kind] = int(value)
    return response


def _retry_after(headers: httpx2.Headers) -> float | None:
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        try:
            return float(headers[name]) * scale
        except (KeyError, ValueError):
            continue
    return None


def request_id_from(headers: Mapping[str, str], body: object = None) -> str | None:
    """The platform's request id: a header (`REQUEST_ID_HEADERS`), else an error body's `request_id`."""
    for name in REQUEST_ID_HEADERS:
        if headers.get(name):
            return headers[name]
    value = body.get("request_id") if isinstance(body, dict) else None
    return value if isinstance(value, str) and value else None


def _error_detail(err: anthropic.APIStatusError) -> str:
    """The provider's own words: `error.message` (Anthropic, Vertex), else Bedrock's `message`, named by
    its `x-amzn-errortype` (`ThrottlingException:http://...` -> `ThrottlingException`)."""
    body = err.body
    detail = err.api_message
    if detail is None and isinstance(body, dict) and isinstance(body.get("message"), str):
        detail = body["message"]
    aws_type = err.response.headers.get("x-amzn-errortype", "").partition(":")[0]
    if aws_type:
        return f"{aws_type}: {detail or err.message}"
    return detail or err.message


def map_error(err: anthropic.AnthropicError, maybe_billed: bool) -> ModelError:
    """The `llm.errors` type for an SDK failure that survived the SDK's retries."""
    if isinstance(err, anthropic.APIStatusError):
        status = err.status_code
        should_retry = err.response.headers.get("x-should-retry")
        retryable = status in RETRYABLE_STATUSES or status >= 500
        if should_retry in ("true", "false"):
            retryable = should_retry == "true"
        detail = _error_detail(err)
        request_id = request_id_from(err.response.headers, err.body)
        kwargs: dict[str, Any] = {"status": status, "request_id": request_id, "maybe_spent": maybe_billed}
        if retryable:
            return RetryableModelError(
                f"provider error {status}: {detail}", retry_after=_retry_after(err.response.headers), **kwargs
            )
        return TerminalModelError(f"provider refused the request ({status}): {detail}", **kwargs)
    if isinstance(err, anthropic.APITimeoutError) and not not_sent(err.__cause__):
        return ModelTimeoutError("no response from the provider before the timeout")
    if isinstance(err, anthropic.APIConnectionError):
        if maybe_billed or not not_sent(err.__cause__):
            return ModelTimeoutError(
                f"the connection failed after the request was sent: {transport_detail(err.__cause__)}"
            )
        return ModelConnectionError(f"could not connect to the provider: {transport_detail(err.__cause__)}")
    if isinstance(err, anthropic.APIResponseValidationError):
        return RetryableModelError(
            f"the provider's response does not match the schema: {err.message}",
            status=err.status_code,
            maybe_spent=True,
        )
    return TerminalModelError(f"{type(err).__name__}: {err}", maybe_spent=maybe_billed)


# -- the adapter ------------------------------------------------------------------------------

_Client: TypeAlias = anthropic.AsyncAnthropic | anthropic.AsyncAnthropicBedrock | anthropic.AsyncAnthropicVertex

# Which keyword options each provider takes (the others must be left None).
_OPTIONS: dict[Provider, tuple[str, ...]] = {
    "anthropic": ("api_key", "base_url"),
    "bedrock": (
        "aws_region",
        "aws_access_key",
        "aws_secret_key",
        "aws_session_token",
        "aws_profile",
        "api_key",
        "base_url",
    ),
    "vertex": ("project_id", "region", "access_token", "base_url"),
}


def check_provider_options(provider: str, given: Mapping[str, object]) -> None:
    """Raise `ModelConfigError` for an unknown provider or an option (not None) another provider takes."""
    if provider not in _OPTIONS:
        raise ModelConfigError(f"unknown model provider {provider!r}: use one of {', '.join(PROVIDERS)}")
    allowed = _OPTIONS[provider]
    foreign = sorted(name for name, value in given.items() if value is not None and name not in allowed)
    if foreign:
        raise ModelConfigError(
            f"{', '.join(foreign)} not used by provider {provider!r} (it takes {', '.join(allowed)})"
        )


def _botocore_errors() -> Any:
    """`botocore.exceptions` (untyped; imported only for provider bedrock)."""
    import botocore.exceptions  # type: ignore[import-untyped]

    return botocore.exceptions


def _first_env(names: tuple[str, ...]) -> str | None:
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def http_client_choice(value: str | None = None) -> HttpClient:
    """The HTTP transport under the SDK: `value`, else `TASKLOOM_HTTP_CLIENT`, else 'aiohttp'.
    'httpx' is the SDK's default transport (kept for a proxy or network setup only it handles)."""
    raw = value if value is not None else os.environ.get(HTTP_CLIENT_ENV, "")
    choice = raw.strip().lower() or "aiohttp"
    if choice == "aiohttp":
        return "aiohttp"
    if choice == "httpx":
        return "httpx"
    raise ModelConfigError(f"{HTTP_CLIENT_ENV}={raw!r} is not an HTTP client: use 'aiohttp' (the default) or 'httpx'")


def aws_region_for(aws_region: str | None, aws_profile: str | None) -> str:
    """The Bedrock region: the argument, `AWS_REGION` / `AWS_DEFAULT_REGION`, or the AWS profile's region
    (read from the AWS config files by boto3, no network); none -> `ModelConfigError` naming them."""
    region = aws_region or _first_env(AWS_REGION_ENVS)
    if not region:
        import boto3  # type: ignore[import-untyped]

        try:
            region = boto3.Session(profile_name=aws_profile).region_name
        except _botocore_errors().BotoCoreError as err:  # ProfileNotFound, a broken config file
            raise ModelConfigError(f"AWS configuration for Bedrock: {err}") from err
    if not region:
        raise ModelConfigError(
            "no AWS region for Bedrock: set aws_region (the models file's aws_region), "
            "AWS_REGION or AWS_DEFAULT_REGION, or a region in the AWS profile"
        )
    return region


class AnthropicModel:
    """`ModelPort` for Claude models over the official SDK (one client, reused): Anthropic's API
    (`anthropic.AsyncAnthropic`), AWS Bedrock (`AsyncAnthropicBedrock`) or Google Vertex AI
    (`AsyncAnthropicVertex`), chosen by `provider`; `name` is the provider."""

    name: str = "anthropic"

    def __init__(
        self,
        model: str,
        *,
        provider: Provider = "anthropic",
        api_key: str | None = None,
        base_url: str | None = None,
        max_retries: int = 2,
        timeout: float = 60.0,
        strict_validation: bool = False,
        aws_region: str | None = None,
        aws_access_key: str | None = None,
        aws_secret_key: str | None = None,
        aws_session_token: str | None = None,
        aws_profile: str | None = None,
        project_id: str | None = None,
        region: str | None = None,
        access_token: str | None = None,
        http_client: str | None = None,
    ) -> None:
        check_provider_options(
            provider,
            {
                "api_key": api_key,
                "base_url": base_url,
                "aws_region": aws_region,
                "aws_access_key": aws_access_key,
                "aws_secret_key": aws_secret_key,
                "aws_session_token": aws_session_token,
                "aws_profile": aws_profile,
                "project_id": project_id,
                "region": region,
                "access_token": access_token,
            },
        )
        self.name = provider
        self.model = model
        common: dict[str, Any] = {
            "max_retries": max_retries,
            "timeout": httpx2.Timeout(timeout, connect=min(timeout, 5.0)),
            "middleware": [_record_attempt],
            "_strict_response_validation": strict_validation,
            "open_telemetry": _sdk_telemetry(),
        }
        # Idle connections kept 30 s, not the SDK's 5 (llm.keepalive: a fleet's calls come in bursts).
        limits = connection_limits(anthropic.DEFAULT_CONNECTION_LIMITS)
        if http_client_choice(http_client) == "aiohttp":
            # The SDK's aiohttp transport instead of its default httpx one: a model call's CPU is
            # about a third lower, most of all with hundreds of calls in flight (httpcore's pool
            # scans every connection per request and per response; aiohttp's does not), and the
            # request leaves in one write. bench/RESULTS.md, "The SDK's HTTP transport".
            common["http_client"] = anthropic.DefaultAioHttpClient(timeout=common["timeout"], limits=limits)
        else:
            common["http_client"] = anthropic.DefaultAsyncHttpxClient(timeout=common["timeout"], limits=limits)
        # Errors raised while signing or fetching a token (before anything is sent), per provider:
        # (credentials missing or refused -> ModelConfigError, could not reach the credentials source).
        self._auth_errors: tuple[type[BaseException], ...] = ()
        self._auth_unreachable: tuple[type[BaseException], ...] = ()
        self._extra_body: dict[str, str] | None = None
        self._client: _Client
        if provider == "bedrock":
            self._client = self._bedrock(
                common, aws_region, aws_access_key, aws_secret_key, aws_session_token, aws_profile, api_key, base_url
            )
        elif provider == "vertex":
            self._client = self._vertex(common, project_id, region, access_token, base_url)
        else:
            key = api_key or os.environ.get(API_KEY_ENV)
            if not key:
                raise ModelConfigError(
                    f"no Anthropic API key: set {API_KEY_ENV} or pass api_key= (or use the offline 'demo' model)"
                )
            self._client = anthropic.AsyncAnthropic(
                api_key=key, base_url=base_url or os.environ.get(BASE_URL_ENV) or None, **common
            )
        if provider != "anthropic":
            self._extra_body = {"anthropic_version": BODY_VERSIONS[provider]}
        self.base_url = str(self._client.base_url).rstrip("/")

    def _bedrock(
        self,
        common: dict[str, Any],
        aws_region: str | None,
        aws_access_key: str | None,
        aws_secret_key: str | None,
        aws_session_token: str | None,
        aws_profile: str | None,
        api_key: str | None,
        base_url: str | None,
    ) -> anthropic.AsyncAnthropicBedrock:
        errors = _botocore_errors()
        if (aws_access_key is None) != (aws_secret_key is None):
            missing = "aws_secret_key" if aws_secret_key is None else "aws_access_key"
            raise ModelConfigError(f"Bedrock: aws_access_key and aws_secret_key go together; {missing} is missing")
        region = aws_region_for(aws_region, aws_profile)
        # The SDK raises RuntimeError when boto3's chain finds no credentials at signing time.
        self._auth_errors = (errors.BotoCoreError, RuntimeError)
        self._auth_unreachable = (errors.ConnectionError, errors.HTTPClientError)
        try:
            return anthropic.AsyncAnthropicBedrock(
                aws_region=region,
                aws_access_key=aws_access_key,
                aws_secret_key=aws_secret_key,
                aws_session_token=aws_session_token,
                aws_profile=aws_profile,
                # A Bedrock API key (sent as a bearer token instead of SigV4); the SDK also reads
                # AWS_BEARER_TOKEN_BEDROCK.
                api_key=api_key,
                base_url=base_url,
                **common,
            )
        except ValueError as err:  # both a Bedrock API key and AWS credentials
            raise ModelConfigError(f"Bedrock: {err}") from err

    def _vertex(
        self,
        common: dict[str, Any],
        project_id: str | None,
        region: str | None,
        access_token: str | None,
        base_url: str | None,
    ) -> anthropic.AsyncAnthropicVertex:
        import google.auth.exceptions

        region = region or os.environ.get(VERTEX_REGION_ENV)
        if not region:
            raise ModelConfigError(
                f"no Google Cloud region for Vertex AI: set region (the models file's region) or {VERTEX_REGION_ENV}"
            )
        project = project_id or _first_env(VERTEX_PROJECT_ENVS)
        if not project:
            raise ModelConfigError(
                "no Google Cloud project for Vertex AI: set project_id (the models file's project_id), "
                f"{' or '.join(VERTEX_PROJECT_ENVS)}"
            )
        # The SDK raises RuntimeError when the default credentials yield no token.
        self._auth_errors = (google.auth.exceptions.GoogleAuthError, RuntimeError)
        self._auth_unreachable = (google.auth.exceptions.TransportError,)
        return anthropic.AsyncAnthropicVertex(
            region=region, project_id=project, access_token=access_token, base_url=base_url, **common
        )

    def __repr__(self) -> str:
        return f"AnthropicModel(model={self.model!r}, provider={self.name!r}, base_url={self.base_url!r})"

    async def complete(self, request: ModelRequest, on_text: TextSink | None = None) -> ModelResponse:
        check_tool_pairing(request.messages)
        names = tool_name_map(request)
        params = build_params(request, self.model, names)
        if self._extra_body is not None:
            params["extra_body"] = self._extra_body
        attempts = _Attempts()
        token = _ATTEMPTS.set(attempts)
        try:
            if on_text is None:
                message = await self._plain(params)
            else:
                message = await self._streamed(params, on_text)
        except anthropic.AnthropicError as err:
            raise map_error(err, attempts.maybe_billed) from err
        except self._auth_errors as err:  # before ValueError: some google-auth errors are ValueErrors too
            raise self._auth_failure(err, attempts.maybe_billed) from err
        except httpx2.HTTPError as err:  # the connection broke while a 200 stream was being read
            raise ModelTimeoutError(f"the connection failed during the reply: {err!r}") from err
        except ValueError as err:  # a 2xx body that is not JSON, or not a Message (JSONDecodeError...)
            raise RetryableModelError(f"the provider's response could not be parsed: {err}", maybe_spent=True) from err
        finally:
            _ATTEMPTS.reset(token)
        response = to_response(message, names, self.model, attempts.request_id)
        info = attempts.rate_limit()
        return response if info is None else response.model_copy(update={"rate_limit": info})

    async def _plain(self, params: dict[str, Any]) -> anthropic.types.Message:
        """The call without streaming. Its reply is validated into the SDK's `Message` in one pass of
        pydantic's core, instead of the SDK's own parse, which builds it field by field in Python
        (`construct_type`): 15-25% less CPU per call (bench/RESULTS.md). The request still goes
        through the SDK (its retries, headers, and our attempt recorder). A reply this SDK's types do
        not describe (a block type newer than it) falls back to the SDK's parse, which keeps what it
        can, as before."""
        raw = await self._client.messages.with_raw_response.create(**params)
        try:
            return anthropic.types.Message.model_validate_json(await raw.read())
        except pydantic.ValidationError:
            parsed: anthropic.types.Message = await raw.parse()
            return parsed

    async def _streamed(self, params: dict[str, Any], on_text: TextSink) -> anthropic.types.Message:
        """The call over the streaming API: each text delta goes to `on_text` as it arrives, and the
        events add up to the same Message a plain call returns (validated once, at the end)."""
        assembly = StreamAssembly()
        stream = await self._client.messages.create(**params, stream=True)
        async with stream:
            async for event in gulped(aiter(stream)):
                text = assembly.add(event)
                if text:
                    on_text(text)
        return anthropic.types.Message.model_validate(assembly.body())

    def _auth_failure(self, err: BaseException, maybe_billed: bool) -> ModelError:
        """Signing (Bedrock) or getting a token (Vertex) failed, so this attempt was not sent."""
        if isinstance(err, self._auth_unreachable):
            return ModelConnectionError(f"could not reach the {self.name} credentials source: {err}")
        hint = {
            "bedrock": "AWS credentials come from aws_access_key/aws_secret_key, AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY, aws_profile/AWS_PROFILE or the instance role",
            "vertex": "Google credentials come from access_token or Application Default Credentials "
            "(GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default login, the attached service account)",
        }.get(self.name, "")
        return ModelConfigError(f"{self.name} credentials: {err} ({hint})", maybe_spent=maybe_billed)

    async def aclose(self) -> None:
        await self._client.close()


def end_of_life(model: str) -> str | None:
    """The date the installed SDK says Anthropic retires `model` (e.g. "November 30th, 2026"), or None.

    The SDK warns with a `DeprecationWarning` on each call of such a model, which Python hides in a
    library; a worker logs it once at start-up instead (`model.deprecated`). The table is the SDK's
    own and not public API: when a version of the SDK lacks it, nothing is reported."""
    import anthropic.resources.messages.messages as sdk_messages

    table = getattr(sdk_messages, "DEPRECATED_MODELS", None)
    date = table.get(model) if isinstance(table, Mapping) else None
    return str(date) if date else None


def _sdk_telemetry() -> Literal[False] | None:
    """The SDK's own OpenTelemetry spans: off unless `ANTHROPIC_OPEN_TELEMETRY=true` asks for them.

    taskloom's span of each model call (bus.metered) already carries the GenAI attributes; the SDK's
    spans, one per HTTP attempt, would double the tracing cost of a call and send the trace context
    to the provider in request headers. Asked for, every `ANTHROPIC_OPEN_TELEMETRY_*` variable applies.
    """
    return None if os.environ.get("ANTHROPIC_OPEN_TELEMETRY", "").strip().lower() == "true" else False
