"""A fake OpenAI Chat Completions API on loopback: real HTTP, scripted answers, billing you can check.

The same shape as `FakeAnthropicServer` (llm/testing/server.py): a stdlib `ThreadingHTTPServer` in a
daemon thread, serving the test's own SDK clients and worker subprocesses pointed at `base_url`
(which ends in `/v1`, as `openai.AsyncOpenAI(base_url=...)` and `OPENAI_BASE_URL` expect).

Each `POST /v1/chat/completions` is recorded, validated like the real API (bearer key, model,
roles, tool messages answering the assistant's tool_call ids, tool names, tool_choice naming an
offered tool: a 400 with OpenAI's error JSON otherwise) and answered by, in order: the next enqueued
script item, the `respond_with` function, or a 500 saying nothing was scripted. A script item is an
`OpenAIReply`, a neutral `ModelResponse`, or a `Failure` (llm/testing/script.py). Replies are streamed
as SSE (`data: {chunk}` frames, then `data: [DONE]`) when the body says `"stream": true`, with a final
usage chunk when `stream_options.include_usage` is set. Every response has an `x-request-id`.

Tokens are counted as the Anthropic fake counts them (llm/testing/tokens.py, on the same prompt), so
never above `llm.estimate.estimate_input_tokens`. With `prompt_caching=True`, the longest prefix of
the prompt (tools, system, messages, in that order) that an earlier request to the same model also
started with is reported as `prompt_tokens_details.cached_tokens`, when it is at least
`cache_min_tokens` long (OpenAI's floor is 1024), as OpenAI's automatic prefix cache does.

Quirks of local servers, as constructor switches (or per reply, on `OpenAIReply`): `omit_usage`,
`omit_tool_call_ids`, `repeat_stream_ids` (every tool-call delta carries the id), `ignore_tool_choice`
(the responder is asked without the forced tool; a scripted reply is sent as scripted anyway).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from llm.anthropic import build_params as anthropic_params
from llm.anthropic import tool_name_map
from llm.testing.loopback import LoopbackServer
from llm.testing.openai_wire import (
    OpenAIReply,
    OpenAIScript,
    ToolCall,
    openai_error_body,
    openai_reply_from_response,
    openai_request_from_wire,
    validate_chat_body,
)
from llm.testing.script import Failure
from llm.testing.tokens import count_input_tokens, count_output_tokens, segments
from llm.types import ModelRequest, ModelResponse, Usage

DEFAULT_MODEL = "gpt-fake-1"
TOOLS_OVERHEAD = 300  # tokens.count_input_tokens adds this when tools are offered


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server received it. Header names are lower-case."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: Mapping[str, Any]
    request_id: str
    at: float  # time.monotonic() on arrival
    tool_choice_ignored: bool = False

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body.get("messages") or [])

    @property
    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.body.get("tools") or []]

    @property
    def request(self) -> ModelRequest:
        """The body as a port request (wire tool names), as the responder should see it: without its
        tool_choice when the server ignores tool_choice."""
        request = openai_request_from_wire(self.body)
        return request.model_copy(update={"tool_choice": None}) if self.tool_choice_ignored else request


OpenAIResponder = Callable[[RecordedRequest], OpenAIScript]


def _neutral_prompt(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prompt as the token counter reads it (the Messages layout of the same request, no markers)."""
    request = openai_request_from_wire(body).model_copy(update={"cache": False})
    return anthropic_params(request, str(body.get("model", "")), tool_name_map(request))


class FakeOpenAIServer(LoopbackServer[OpenAIScript, RecordedRequest]):
    """Scripted fake of Chat Completions. Use as a (sync or async) context manager, or start()/close().

    >>> with FakeOpenAIServer() as server:
    ...     server.enqueue(openai_text_reply("hello"))
    ...     client = openai.OpenAI(api_key="test", base_url=server.base_url)
    """

    thread_name = "fake-openai"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        prompt_caching: bool = False,
        cache_min_tokens: int = 0,
        context_window: int | None = None,
        omit_usage: bool = False,
        omit_tool_call_ids: bool = False,
        repeat_stream_ids: bool = False,
        ignore_tool_choice: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(host=host, port=port)
        self.prompt_caching = prompt_caching
        self.cache_min_tokens = cache_min_tokens
        self.context_window = context_window  # a prompt counted above it gets context_length_exceeded
        self.omit_usage = omit_usage
        self.omit_tool_call_ids = omit_tool_call_ids
        self.repeat_stream_ids = repeat_stream_ids
        self.ignore_tool_choice = ignore_tool_choice
        self.headers = dict(headers or {})  # sent on every reply (x-ratelimit-remaining-*, say)
        self._prefixes: set[str] = set()

    @property
    def base_url(self) -> str:
        """URL for `base_url=` / `OPENAI_BASE_URL`, ending in `/v1` as the OpenAI SDK expects."""
        return f"{self.root_url}/v1"

    # -- called by the handler threads ----------------------------------------------------------

    def _record(self, path: str, headers: Mapping[str, str], body: Mapping[str, Any]) -> RecordedRequest:
        with self._lock:
            request_id = f"req_fake_{next(self._ids):06d}"
            ignored = self.ignore_tool_choice and body.get("tool_choice") not in (None, "auto")
            recorded = RecordedRequest("POST", path, dict(headers), body, request_id, time.monotonic(), ignored)
            self._requests.append(recorded)
            return recorded

    def _next_script(self, request: RecordedRequest) -> OpenAIScript:
        script = self._scripted(request)
        if script is None:
            return Failure(
                status=500,
                body=openai_error_body(500, "fake server: nothing scripted for this request (enqueue or respond_with)"),
            )
        return script

    def _bill(self, body: Mapping[str, Any], output_tokens: int) -> Usage:
        """Count the prompt (cached prefix apart) and add the reply to `billed`."""
        prompt = _neutral_prompt(body)
        total = count_input_tokens(prompt)
        digest = hashlib.sha256(str(body.get("model", "")).encode())
        boundaries: list[tuple[str, int]] = []
        running = 0
        for segment in segments(prompt):
            digest.update(segment.key.encode("utf-8"))
            running += segment.tokens
            boundaries.append((digest.hexdigest(), running))
        with self._lock:
            cached = 0
            if self.prompt_caching:
                hits = [tokens for key, tokens in boundaries if key in self._prefixes]
                # The tool definitions' fixed overhead sits at the very start of the prompt: in any hit.
                cached = max(hits, default=0) + (TOOLS_OVERHEAD if hits and prompt.get("tools") else 0)
                cached = cached if cached >= max(1, self.cache_min_tokens) else 0
                self._prefixes.update(key for key, _ in boundaries)
            usage = Usage(input_tokens=total - cached, output_tokens=output_tokens, cache_read_tokens=cached)
            self._billed = self._billed + usage
            return usage

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._closing.wait(seconds)


def _completion_id(rid: str) -> str:
    return f"chatcmpl-{rid.removeprefix('req_')}"


def completion_body(reply: OpenAIReply, *, rid: str, model: str, usage: Usage | None, omit_ids: bool) -> dict[str, Any]:
    """The non-streamed Chat Completions body for `reply`."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
    if reply.tool_calls:
        message["tool_calls"] = [_wire_call(c, omit_ids) for c in reply.tool_calls]
    body: dict[str, Any] = {
        "id": _completion_id(rid),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}],
        "system_fingerprint": "fp_fake",
    }
    if usage is not None:
        body["usage"] = usage_body(usage)
    return body


def _wire_call(call: ToolCall, omit_ids: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    if call.id and not omit_ids:
        out["id"] = call.id
    return out


def usage_body(usage: Usage) -> dict[str, Any]:
    prompt = usage.input_tokens + usage.cache_read_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": usage.output_tokens,
        "total_tokens": prompt + usage.output_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cache_read_tokens, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
    }


def stream_chunks(
    reply: OpenAIReply,
    *,
    rid: str,
    model: str,
    usage: Usage | None,
    omit_ids: bool,
    repeat_ids: bool = False,
) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` objects streaming `reply`; with `usage`, a last chunk carrying it
    (every earlier chunk then has `"usage": null`, as OpenAI sends with include_usage)."""
    base = {"id": _completion_id(rid), "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        out = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        if usage is not None:
            out["usage"] = None
        return out

    chunks = [chunk({"role": "assistant", "content": "", "refusal": None})]
    text = reply.content or ""
    chunks += [chunk({"content": text[i : i + 16]}) for i in range(0, len(text), 16)]
    for index, call in enumerate(reply.tool_calls):
        start = "" if call.arguments is not None else None  # a null-arguments call streams null
        first: dict[str, Any] = {
            "index": index,
            "type": "function",
            "function": {"name": call.name, "arguments": start},
        }
        send_id = bool(call.id) and not omit_ids
        if send_id:
            first["id"] = call.id
        chunks.append(chunk({"tool_calls": [first]}))
        raw = call.arguments
        pieces = [raw[i : i + 16] for i in range(0, len(raw), 16)] if raw is not None else []
        for piece in pieces:
            part: dict[str, Any] = {"index": index, "function": {"arguments": piece}}
            if repeat_ids and send_id:
                part["id"] = call.id
            chunks.append(chunk({"tool_calls": [part]}))
    chunks.append(chunk({}, reply.finish_reason))
    if usage is not None:
        chunks.append({**base, "choices": [], "usage": usage_body(usage)})
    return chunks


class _Handler(BaseHTTPRequestHandler):
    fake: FakeOpenAIServer  # set on the per-server subclass
    server_version = "FakeOpenAI/1"
    protocol_version = "HTTP/1.1"  # keep-alive, as the real API (see server.py)
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read `server.requests` instead of access logs."""

    def _send(self, status: int, payload: Any, rid: str, headers: Mapping[str, str] | None = None) -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.send_header("x-request-id", rid)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(404, openai_error_body(404, f"Invalid URL (GET {self.path})"), "req_fake_get")

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError:
            body = {"_unparsed": raw.decode("utf-8", "replace")}
        headers = {k.lower(): v for k, v in self.headers.items()}
        path = self.path.split("?", 1)[0]
        recorded = self.fake._record(path, headers, body)
        rid = recorded.request_id
        try:
            if not headers.get("authorization", "").startswith("Bearer ") and not headers.get("api-key"):
                return self._send(401, openai_error_body(401, "You didn't provide an API key."), rid)
            if not path.endswith("/chat/completions"):
                return self._send(404, openai_error_body(404, f"Invalid URL (POST {path})"), rid)
            if "_unparsed" in body:
                return self._send(400, openai_error_body(400, "We could not parse the JSON body of your request."), rid)
            problem = validate_chat_body(body)
            if problem is not None:
                return self._send(400, openai_error_body(400, problem[0], param=problem[1]), rid)
            window = self.fake.context_window
            if window is not None:
                tokens = count_input_tokens(_neutral_prompt(body))
                if tokens > window:
                    message = (
                        f"This model's maximum context length is {window} tokens. However, your messages "
                        f"resulted in {tokens} tokens. Please reduce the length of the messages."
                    )
                    error = openai_error_body(400, message, code="context_length_exceeded", param="messages")
                    return self._send(400, error, rid)
            script = self.fake._next_script(recorded)
            if isinstance(script, Failure):
                return self._fail(script, rid)
            if isinstance(script, ModelResponse):
                script = openai_reply_from_response(script)
            return self._reply(script, body, rid, arrived=recorded.at)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout); what was billed stays billed

    def _fail(self, failure: Failure, rid: str) -> None:
        self.fake._sleep(failure.delay)
        if failure.disconnect:
            self.close_connection = True
            self.connection.close()
            return
        body: Any = failure.body if failure.body is not None else openai_error_body(failure.status, "fake failure")
        self._send(failure.status, body if isinstance(body, str) else dict(body), rid, failure.headers)

    def _reply(self, reply: OpenAIReply, body: Mapping[str, Any], rid: str, *, arrived: float) -> None:
        fake = self.fake
        blocks: list[dict[str, Any]] = [{"type": "text", "text": reply.content}] if reply.content else []
        blocks += [{"type": "tool_use", "name": c.name, "input": c.arguments or ""} for c in reply.tool_calls]
        output = reply.output_tokens if reply.output_tokens is not None else count_output_tokens(blocks)
        usage = fake._bill(body, output)
        fake._sleep(reply.delay - (time.monotonic() - arrived))  # the model's time, from arrival
        sent_usage = None if (reply.omit_usage or fake.omit_usage) else usage
        omit_ids = reply.omit_ids or fake.omit_tool_call_ids
        model = reply.model or str(body.get("model") or DEFAULT_MODEL)
        headers = {**fake.headers, **reply.headers}
        if not body.get("stream"):
            completion = completion_body(reply, rid=rid, model=model, usage=sent_usage, omit_ids=omit_ids)
            return self._send(200, completion, rid, headers)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = stream_chunks(
            reply,
            rid=rid,
            model=model,
            usage=sent_usage if include_usage else None,
            omit_ids=omit_ids,
            repeat_ids=fake.repeat_stream_ids,
        )
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("x-request-id", rid)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True  # no content-length: the end of the body is the end of the connection
        cut = reply.cut_after is not None
        for data in chunks[: reply.cut_after] if cut else chunks:
            self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()
        if cut:
            return
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


FakeOpenAIServer.handler = _Handler
