"""A fake Anthropic Messages API on loopback: real HTTP, scripted answers, billing you can check.

It runs a stdlib `ThreadingHTTPServer` in a daemon thread, so the same instance serves the test's own
SDK clients and worker subprocesses pointed at it through `ANTHROPIC_BASE_URL=server.base_url`.

Each `POST /v1/messages` is recorded, validated like the real API (auth header, anthropic-version,
required fields, tool names, tool_use/tool_result pairing, at most 4 cache_control markers: a 400
otherwise) and answered by, in order: the next enqueued script item, the `respond_with` function, or a
500 saying nothing was scripted. Replies are streamed as SSE when the body says `"stream": true`.
Every response carries a `request-id` header.

The same Messages endpoint is also served as AWS Bedrock and Google Vertex AI expose it (same scripts,
billing and validation; `RecordedRequest.platform` tells them apart):

- Bedrock: `POST /model/{model_id}/invoke`. The model is in the URL, the body has no `model` and must
  say `"anthropic_version": "bedrock-2023-05-31"`; auth is a SigV4 `Authorization: AWS4-HMAC-SHA256 ...`
  (present, not verified) or a Bedrock API key (`Bearer`). Responses carry `x-amzn-requestid`, errors
  are `{"message": ...}` with an `x-amzn-errortype` header. `invoke-with-response-stream` (AWS event
  stream framing) is not served: a 404 says so.
- Vertex: `POST /projects/{p}/locations/{r}/publishers/anthropic/models/{model}:rawPredict` (JSON) and
  `:streamRawPredict` (SSE), body with `"anthropic_version": "vertex-2023-10-16"` and no `model`, auth
  `Bearer`. No request-id header; error bodies carry a top-level `request_id`, as Vertex's do.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any, Literal

from llm.errors import ToolPairingError
from llm.testing.loopback import LoopbackServer
from llm.testing.script import Failure, Reply, Script, error_body
from llm.testing.tokens import count_input_tokens, count_output_tokens, split_cached
from llm.toolnames import VALID
from llm.types import Usage

DEFAULT_MODEL = "claude-fake-1"

Platform = Literal["anthropic", "bedrock", "vertex"]
# The body's `anthropic_version` each platform requires (the direct API takes a header instead).
PLATFORM_VERSIONS: dict[Platform, str] = {"bedrock": "bedrock-2023-05-31", "vertex": "vertex-2023-10-16"}

_BEDROCK_PATH = re.compile(r"^/model/(?P<model>[^/]+)/(?P<op>invoke|invoke-with-response-stream)$")
_VERTEX_PATH = re.compile(
    r"^(?:/v1)?/projects/[^/]+/locations/[^/]+/publishers/anthropic/models/(?P<model>[^/:]+):(?P<op>rawPredict|streamRawPredict)$"
)
# Bedrock's exception names by status, sent in `x-amzn-errortype` as Bedrock does.
_BEDROCK_ERRORS = {
    400: "ValidationException",
    403: "AccessDeniedException",
    404: "ResourceNotFoundException",
    408: "ModelTimeoutException",
    424: "ModelErrorException",
    429: "ThrottlingException",
    500: "InternalServerException",
    503: "ServiceUnavailableException",
}


@dataclass(frozen=True)
class Route:
    """Which Messages endpoint a path is: its platform, the model named in the URL (Bedrock, Vertex)
    and whether the path itself asks for a stream."""

    platform: Platform
    model: str | None = None
    stream_path: bool = False


def route(path: str) -> Route | None:
    """The Messages endpoint `path` (no query) is, or None (count_tokens and unknown paths)."""
    if path == "/v1/messages":
        return Route("anthropic")
    if match := _BEDROCK_PATH.match(path):
        model = urllib.parse.unquote(match["model"])
        return Route("bedrock", model, match["op"] == "invoke-with-response-stream")
    if match := _VERTEX_PATH.match(path):
        return Route("vertex", urllib.parse.unquote(match["model"]), match["op"] == "streamRawPredict")
    return None


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server received it. Header names are lower-case."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: Mapping[str, Any]
    request_id: str
    at: float  # time.monotonic() on arrival

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body.get("messages") or [])

    @property
    def tool_names(self) -> list[str]:
        return [t["name"] for t in self.body.get("tools") or []]

    @property
    def platform(self) -> Platform | None:
        """"anthropic", "bedrock" or "vertex" for a Messages request, by its path; None otherwise."""
        found = route(self.path)
        return found.platform if found is not None else None

    @property
    def model(self) -> str | None:
        """The model asked for: in the URL (Bedrock, Vertex) or the body."""
        found = route(self.path)
        if found is not None and found.model is not None:
            return found.model
        value = self.body.get("model")
        return value if isinstance(value, str) else None


Responder = Callable[[RecordedRequest], Script]


@dataclass(frozen=True)
class ProviderLimits:
    """Rate limits the fake enforces, per minute (0 = none), as Anthropic does: token buckets that
    refill continuously; output is counted as `max_tokens` when the request arrives and corrected to
    the real output when it ends."""

    rpm: int = 0
    input_tpm: int = 0
    output_tpm: int = 0


class _Buckets:
    def __init__(self, limits: ProviderLimits) -> None:
        self.caps = (limits.rpm, limits.input_tpm, limits.output_tpm)
        self.levels = [float(c) for c in self.caps]
        self.at = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        for i, cap in enumerate(self.caps):
            self.levels[i] = min(cap, self.levels[i] + (now - self.at) * cap / 60)
        self.at = now

    def take(self, input_tokens: int, max_tokens: int) -> float | None:
        """Take one request; None if it fits, else the seconds until it would (retry-after)."""
        self._refill()
        need = (1, input_tokens, max_tokens)
        wait = 0.0
        for i, cap in enumerate(self.caps):
            if cap and self.levels[i] < min(need[i], cap):
                wait = max(wait, (min(need[i], cap) - self.levels[i]) * 60 / cap)
        if wait > 0:
            return wait
        for i, cap in enumerate(self.caps):
            if cap:
                self.levels[i] -= need[i]
        return None

    def refund(self, output_tokens: int) -> None:
        self._refill()
        if self.caps[2]:
            self.levels[2] = min(self.caps[2], self.levels[2] + output_tokens)

    def headers(self) -> dict[str, str]:
        out = {}
        for name, cap, level in zip(("requests", "input-tokens", "output-tokens"), self.caps, self.levels, strict=True):
            if cap:
                out[f"anthropic-ratelimit-{name}-limit"] = str(cap)
                out[f"anthropic-ratelimit-{name}-remaining"] = str(max(0, int(level)))
        return out


class FakeAnthropicServer(LoopbackServer[Script, "RecordedRequest"]):
    """Scripted fake of the Messages API. Use as a (sync or async) context manager, or start()/close().

    >>> with FakeAnthropicServer() as server:
    ...     server.enqueue(text_reply("hello"))
    ...     client = anthropic.Anthropic(api_key="test", base_url=server.base_url)
    """

    thread_name = "fake-anthropic"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        cache_min_tokens: int = 0,
        bill_key: Callable[[RecordedRequest], str | None] | None = None,
        limits: ProviderLimits | None = None,
    ) -> None:
        super().__init__(host=host, port=port)
        # Optional: rate limits enforced with 429s (and reported in anthropic-ratelimit-* headers).
        self._buckets = _Buckets(limits) if limits is not None else None
        self.throttled = 0  # 429s sent for rate limits
        self.admitted: list[tuple[float, int, int]] = []  # (monotonic time, input, max_tokens) let through
        # Optional: attribute each billed reply to a key (a goal, say) for `billed_for`.
        self._bill_key = bill_key
        self._billed_by: dict[str, Usage] = {}
        self._cache_min_tokens = cache_min_tokens
        self._cache: set[str] = set()

    @property
    def base_url(self) -> str:
        """Root URL for `base_url=` / `ANTHROPIC_BASE_URL` (no `/v1`: the SDK adds it)."""
        return self.root_url

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received so far, `/v1/messages` and `/v1/messages/count_tokens` alike."""
        return super().requests

    @property
    def message_requests(self) -> list[RecordedRequest]:
        """The Messages requests (any platform), without count_tokens and unknown paths."""
        return [r for r in self.requests if r.platform is not None]

    # -- called by the handler threads ----------------------------------------------------------

    def billed_for(self, key: str) -> Usage:
        """The usage billed to `key` (see `bill_key`)."""
        with self._lock:
            return self._billed_by.get(key, Usage())

    def _record(self, method: str, path: str, headers: Mapping[str, str], body: Mapping[str, Any]) -> RecordedRequest:
        with self._lock:
            request_id = f"req_fake_{next(self._ids):06d}"
            recorded = RecordedRequest(method, path, dict(headers), body, request_id, time.monotonic())
            self._requests.append(recorded)
            return recorded

    def _next_script(self, request: RecordedRequest) -> Script:
        script = self._scripted(request)
        if script is None:
            return Failure(
                status=500,
                headers={"x-should-retry": "false"},
                body=error_body(500, "fake server: nothing scripted for this request (enqueue or respond_with)"),
            )
        return script

    def _bill(self, body: Mapping[str, Any], output_tokens: int, key: str | None = None) -> Usage:
        with self._lock:
            uncached, read, write = split_cached(dict(body), self._cache, self._cache_min_tokens)
            usage = Usage(
                input_tokens=uncached, output_tokens=output_tokens, cache_read_tokens=read, cache_write_tokens=write
            )
            self._billed = self._billed + usage
            if key is not None:
                self._billed_by[key] = self._billed_by.get(key, Usage()) + usage
            return usage

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._closing.wait(seconds)

    def _admit(self, body: Mapping[str, Any]) -> tuple[float | None, dict[str, str]]:
        """(retry-after if over a rate limit else None, the rate-limit headers to send)."""
        with self._lock:
            input_tokens, max_tokens = count_input_tokens(dict(body)), int(body.get("max_tokens") or 0)
            if self._buckets is None:
                self.admitted.append((time.monotonic(), input_tokens, max_tokens))
                return None, {}
            wait = self._buckets.take(input_tokens, max_tokens)
            if wait is not None:
                self.throttled += 1
            else:
                self.admitted.append((time.monotonic(), input_tokens, max_tokens))
            return wait, self._buckets.headers()

    def _refund(self, max_tokens: int, output_tokens: int) -> None:
        if self._buckets is not None:
            with self._lock:
                self._buckets.refund(max(0, max_tokens - output_tokens))


def validate_messages_body(body: Mapping[str, Any]) -> str | None:
    """The real API's 400 message for `body`, or None when it is acceptable."""
    from llm.testing.wire import request_from_wire  # the wire module imports this one's neighbours

    if not isinstance(body.get("model"), str) or not body["model"]:
        return "model: Field required"
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
        return "max_tokens: Field required (a positive integer)"
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        return "messages: Field required (a non-empty list)"
    names = [t.get("name", "") for t in body.get("tools") or []]
    names += [
        b.get("name", "")
        for m in body["messages"]
        if isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, dict) and b.get("type") == "tool_use"
    ]
    for name in names:
        if not VALID.match(str(name)):
            return f"tools: name {name!r} does not match '^[a-zA-Z0-9_-]{{1,64}}$'"
    markers = json.dumps(body).count('"cache_control"')
    if markers > 4:
        return f"A maximum of 4 blocks with cache_control may be provided. Found {markers}."
    try:
        request_from_wire(body)
    except ToolPairingError as err:
        return f"messages: {err.message}"
    except ValueError as err:
        return f"invalid request: {err}"
    return None


def platform_body(found: Route, body: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The Messages API body a platform request stands for (model from the URL, no
    `anthropic_version`), and the platform's 400 message when its own rules are broken."""
    wire = dict(body)
    if found.platform == "anthropic":
        return wire, None
    if "model" in wire:
        return wire, "model: Extra inputs are not permitted (the model is named in the URL)"
    expected = PLATFORM_VERSIONS[found.platform]
    version = wire.pop("anthropic_version", None)
    if version != expected:
        return wire, f"anthropic_version: expected {expected!r}, got {version!r}"
    wire["model"] = found.model
    if found.platform == "vertex" and bool(wire.get("stream")) != found.stream_path:
        return wire, "stream: use :streamRawPredict for a stream and :rawPredict otherwise"
    return wire, None


class _Handler(BaseHTTPRequestHandler):
    fake: FakeAnthropicServer  # set on the per-server subclass
    server_version = "FakeAnthropic/1"
    # HTTP/1.1 with keep-alive, like the real API: an SDK client reuses its connection instead of
    # opening one per request (which cost both ends a TCP handshake and a thread per call). Every
    # response says its content-length, except a stream, which closes its connection.
    protocol_version = "HTTP/1.1"
    # Headers and body are separate writes: without TCP_NODELAY the body would wait for the
    # client's delayed ACK on a kept-alive connection.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests read `server.requests` instead of access logs."""

    # -- plumbing -------------------------------------------------------------------------------

    platform: Platform = "anthropic"  # of the request being answered (set per request)

    def _send(self, status: int, payload: Any, request_id: str, headers: Mapping[str, str] | None = None) -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in {**self._id_headers(request_id), **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _id_headers(self, request_id: str) -> dict[str, str]:
        """Where the platform says its request id: Vertex sends none in a header."""
        if self.platform == "bedrock":
            return {"x-amzn-requestid": request_id}
        if self.platform == "vertex":
            return {}
        return {"request-id": request_id}

    def _error(self, status: int, message: str, rid: str, headers: Mapping[str, str] | None = None) -> None:
        """An error response shaped as the platform shapes its own."""
        extra = {**self._error_headers(status), **(headers or {})}
        body: dict[str, Any]
        if self.platform == "bedrock":
            body = {"message": message}
        elif self.platform == "vertex":
            body = {**error_body(status, message), "request_id": rid}
        else:
            body = error_body(status, message)
        self._send(status, body, rid, extra)

    def _error_headers(self, status: int) -> dict[str, str]:
        """Bedrock names its exception in `x-amzn-errortype` on every error."""
        if self.platform != "bedrock" or status < 400:
            return {}
        name = _BEDROCK_ERRORS.get(status, "InternalServerException" if status >= 500 else "ValidationException")
        return {"x-amzn-errortype": f"{name}:http://internal.amazon.com/coral/com.amazon.bedrock/"}

    def do_GET(self) -> None:
        self.platform = "anthropic"
        self._send(404, error_body(404, f"no route {self.path}"), "req_fake_get")

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
        recorded = self.fake._record("POST", path, headers, body)
        rid = recorded.request_id
        found = route(path)
        self.platform = found.platform if found is not None else "anthropic"
        try:
            problem = self._check_auth(headers)
            if problem is not None:
                return self._error(problem[0], problem[1], rid)
            if "_unparsed" in body:
                return self._error(400, "the request body is not a JSON object", rid)
            if path == "/v1/messages/count_tokens":
                return self._send(200, {"input_tokens": count_input_tokens(body)}, rid)
            if found is None:
                return self._error(404, f"no route {path}", rid)
            if found.platform == "bedrock" and found.stream_path:
                return self._error(404, "the fake server does not serve invoke-with-response-stream", rid)
            wire, problem_text = platform_body(found, body)
            if problem_text is None:
                problem_text = validate_messages_body(wire)
            if problem_text is not None:
                return self._error(400, problem_text, rid)
            wait, limit_headers = self.fake._admit(wire)
            if wait is not None:
                headers_429 = {**limit_headers, "retry-after": str(max(1, math.ceil(wait)))}
                return self._error(429, "rate limit exceeded", rid, headers_429)
            self._limit_headers = limit_headers
            script = self.fake._next_script(recorded)
            if isinstance(script, Failure):
                return self._fail(script, rid)
            key = self.fake._bill_key(recorded) if self.fake._bill_key is not None else None
            return self._reply(script, wire, rid, key, arrived=recorded.at)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout); what was billed stays billed

    def _check_auth(self, headers: Mapping[str, str]) -> tuple[int, str] | None:
        """(status, message) when the request lacks the platform's credentials or version header."""
        authorization = headers.get("authorization", "")
        if self.platform == "bedrock":
            # SigV4 (not verified: the fake holds no secret) or a Bedrock API key.
            if not authorization.startswith(("AWS4-HMAC-SHA256 ", "Bearer ")):
                return 403, "Missing Authentication Token"
            return None
        if self.platform == "vertex":
            if not authorization.startswith("Bearer "):
                return 401, "Request is missing required authentication credential (Authorization: Bearer)"
            return None
        if not (headers.get("x-api-key") or authorization.startswith("Bearer ")):
            return 401, "missing x-api-key or Authorization: Bearer"
        if not headers.get("anthropic-version"):
            return 400, "anthropic-version: header is required"
        return None

    def _fail(self, failure: Failure, rid: str) -> None:
        self.fake._sleep(failure.delay)
        if failure.disconnect:
            self.close_connection = True
            self.connection.close()
            return
        if failure.body is None:
            return self._error(failure.status, "fake failure", rid, failure.headers)
        body = failure.body
        headers = {**self._error_headers(failure.status), **failure.headers}
        self._send(failure.status, body if isinstance(body, str) else dict(body), rid, headers)

    def _reply(
        self, reply: Reply, body: Mapping[str, Any], rid: str, key: str | None = None, *, arrived: float | None = None
    ) -> None:
        content = [dict(block) for block in reply.content]
        output = reply.output_tokens if reply.output_tokens is not None else count_output_tokens(content)
        usage = self.fake._bill(body, output, key)
        # `delay` is the model's response time, counted from the request's arrival: the fake's own
        # parsing, validation and token counting (serialised by the GIL when many requests arrive at
        # once) happen inside it, as a real API's do, instead of adding to it.
        spent = 0.0 if arrived is None else time.monotonic() - arrived
        self.fake._sleep(reply.delay - spent)
        self.fake._refund(int(body.get("max_tokens") or 0), output)
        message = {
            "id": f"msg_{rid.removeprefix('req_')}",
            "type": "message",
            "role": "assistant",
            "model": reply.model or str(body.get("model") or DEFAULT_MODEL),
            "content": content,
            "stop_reason": reply.stop_reason,
            "stop_sequence": reply.stop_sequence,
            "usage": {
                "input_tokens": usage.input_tokens,
                "output_tokens": usage.output_tokens,
                "cache_read_input_tokens": usage.cache_read_tokens,
                "cache_creation_input_tokens": usage.cache_write_tokens,
            },
        }
        if body.get("stream"):
            return self._stream(message, rid, reply.pace, reply.cut_after)
        self._send(200, message, rid, getattr(self, "_limit_headers", None))

    def _stream(self, message: dict[str, Any], rid: str, pace: float = 0.0, cut_after: int | None = None) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        for name, value in self._id_headers(rid).items():
            self.send_header(name, value)
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True  # no content-length: the end of the body is the end of the connection
        for n, (event, data) in enumerate(sse_events(message)):
            if cut_after is not None and n >= cut_after:
                self.connection.close()  # mid-reply: no message_stop, the body just ends
                return
            if pace > 0 and event == "content_block_delta":
                self.fake._sleep(pace)
            self.wfile.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()

FakeAnthropicServer.handler = _Handler


def sse_events(message: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The Messages streaming events for a complete `message`; each becomes an `event:` + `data:` frame."""
    usage = message["usage"]
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage, "output_tokens": 1},
    }
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": start})]
    events.append(("ping", {"type": "ping"}))
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        if kind == "text":
            first: dict[str, Any] = {"type": "text", "text": ""}
            text = block["text"]
            deltas = [{"type": "text_delta", "text": text[i : i + 16]} for i in range(0, len(text), 16)]
        elif kind == "tool_use":
            first = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            raw = json.dumps(block.get("input", {}))
            deltas = [{"type": "input_json_delta", "partial_json": raw[i : i + 16]} for i in range(0, len(raw), 16)]
        elif kind == "thinking":
            first = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": block["thinking"]}]
            deltas.append({"type": "signature_delta", "signature": block.get("signature", "")})
        else:
            first, deltas = dict(block), []
        events.append(("content_block_start", {"type": "content_block_start", "index": index, "content_block": first}))
        events += [("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}) for d in deltas]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events
