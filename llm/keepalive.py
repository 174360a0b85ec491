"""How long the model SDKs keep an idle HTTP connection open for the next call.

Both SDKs (Anthropic's, on either transport, and OpenAI's) default to httpx's 5 s: a connection idle
for longer is closed, and the next call opens a new one. A worker's calls come in bursts (a plan's
tasks all start at once, then each waits for its tools, its critic, the next goal), so with 5 s a
fleet that pauses between goals reconnects at nearly every burst. Against a real provider a new
connection is a TCP and a TLS handshake: one or two network round trips and a few milliseconds of
CPU before the request can leave. On loopback alone it cost a width-8 goal of `bench.speedup` 8-9 new
connections and about 20 ms of its makespan (bench/RESULTS.md, "Idle connections kept for the next burst").

`TASKLOOM_HTTP_KEEPALIVE` (seconds, default 30) sets it for every model a process builds. 30 s stays
under the idle timeouts of the load balancers commonly in front of an API (60 s and more), so the
server side rarely closes a connection the client still counts on; when it does, the SDK's own
retry (a connection error is retried like a 5xx) sends the call again on a new one.
"""

from __future__ import annotations

import math
import os

import httpx2

from llm.errors import ModelConfigError

KEEPALIVE_ENV = "TASKLOOM_HTTP_KEEPALIVE"
DEFAULT_KEEPALIVE = 30.0
MAX_KEEPALIVE = 3600.0
# The SDKs' own pool sizes (anthropic._constants and openai._constants hold the same numbers):
# only the idle expiry is taskloom's choice.
MAX_CONNECTIONS = 1000
MAX_IDLE_CONNECTIONS = 100


def keepalive_seconds(value: float | str | None = None) -> float:
    """Seconds an idle connection is kept: `value`, else `TASKLOOM_HTTP_KEEPALIVE`, else 30.
    Anything but a number of seconds in (0, 3600] is a `ModelConfigError` naming where it came from."""
    where = "http_keepalive" if value is not None else KEEPALIVE_ENV
    raw = value if value is not None else os.environ.get(KEEPALIVE_ENV, "").strip() or DEFAULT_KEEPALIVE
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (0 < seconds <= MAX_KEEPALIVE):  # also refuses nan
        raise ModelConfigError(
            f"{where}={raw!r} is not a keep-alive time: give the seconds an idle connection to the model's "
            f"API stays open, more than 0 and at most {MAX_KEEPALIVE:g}"
        )
    return seconds


def connection_limits(value: float | str | None = None) -> httpx2.Limits:
    """The SDKs' connection pool limits with taskloom's idle expiry (`keepalive_seconds`)."""
    return httpx2.Limits(
        max_connections=MAX_CONNECTIONS,
        max_keepalive_connections=MAX_IDLE_CONNECTIONS,
        keepalive_expiry=keepalive_seconds(value),
    )
