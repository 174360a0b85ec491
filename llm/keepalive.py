"""How long the model SDKs keep an idle HTTP connection open for the next call.

Both SDKs (Anthropic's, on either transport, and OpenAI's) default to httpx's 5 s: a connection idle
for longer is closed, and the next call opens a new one. A worker's calls come in bursts (a plan's
tasks all start at once, then each waits for its tools, its critic, the next goal), so with 5 s a
fleet that pauses between goals reconnects at nearly every burst. Against a real provider a new
connection is a TCP and a TLS handshake: one or two network round trips and a few milliseconds of
CPU before the request can leave. On loopback alone it cost a width-8 goal of `bench.speedup` 8-9 new
connections and 13-16 ms of its makespan (bench/RESULTS.md, "Idle connections kept for the next burst").

`TASKLOOM_HTTP_KEEPALIVE` (seconds, default 30) sets it for every model a process builds. 30 s stays
under the idle timeouts of the load balancers commonly in front of an API (60 s and more), so the
server side rarely closes a connection the client still counts on. When it does close one first,
the client sees the close and opens a new connection for the next call; only a close racing the
request itself fails the attempt, which the SDK's own retry (connection errors are retried) sends
again.
"""

from __future__ import annotations

import math
import os

import httpx2

from llm.errors import ModelConfigError

KEEPALIVE_ENV = "TASKLOOM_HTTP_KEEPALIVE"
DEFAULT_KEEPALIVE = 30.0
MAX_KEEPALIVE = 3600.0


def keepalive_seconds() -> float:
    """Seconds an idle connection is kept: `TASKLOOM_HTTP_KEEPALIVE`, else 30. Anything but a number
    of seconds in (0, 3600] is a `ModelConfigError` naming the variable."""
    raw = os.environ.get(KEEPALIVE_ENV, "").strip() or str(DEFAULT_KEEPALIVE)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds <= MAX_KEEPALIVE):  # also refuses nan
        raise ModelConfigError(
            f"{KEEPALIVE_ENV}={raw!r} is not a keep-alive time: give the seconds an idle connection to the "
            f"model's API stays open, more than 0 and at most {MAX_KEEPALIVE:g}"
        )
    return seconds


def connection_limits(sdk_defaults: httpx2.Limits) -> httpx2.Limits:
    """An SDK's own connection pool limits (`DEFAULT_CONNECTION_LIMITS`), its idle expiry replaced by
    `keepalive_seconds`: only the expiry is taskloom's choice."""
    return httpx2.Limits(
        max_connections=sdk_defaults.max_connections,
        max_keepalive_connections=sdk_defaults.max_keepalive_connections,
        keepalive_expiry=keepalive_seconds(),
    )
