"""structlog set-up: JSON lines on stdout (readable console output on a terminal), secrets redacted.

Context (goal_id, task_id, attempt, role, job_id, step) is bound with contextvars per job, so every
line a job writes carries it, and with tracing on the current span's `trace_id` and `span_id`.
arq's own stdlib logging goes through the same renderer, by the one stdlib handler installed here;
taskloom's own lines are written to that handler's stream by structlog itself (`LineLogger`), not
as stdlib records: a handler added to the root logger sees arq's and httpx's lines, not ours.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from bus.tracing import current_ids
from llm.redact import REDACTED, SECRET_KEYS, SECRET_VALUES

# A logged value is capped: an invalid 1 MB job payload must not become a 1 MB log line. Strings keep
# their head and say how much was cut; containers keep their first items. Secrets are redacted as
# in the cassettes (llm.redact), after the cut so a key split by it is still caught by its prefix.
MAX_STRING = 2000
MAX_ITEMS = 50


def _cap(text: str) -> str:
    return text if len(text) <= MAX_STRING else f"{text[:MAX_STRING]}...[{len(text) - MAX_STRING} more chars]"


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return SECRET_VALUES.sub(REDACTED, _cap(value))
    if isinstance(value, bytes | bytearray):
        return _scrub(bytes(value[: MAX_STRING + 1]).decode("utf-8", "replace")) if len(value) > MAX_STRING else value
    if isinstance(value, dict):
        items = list(value.items())
        out = {k: REDACTED if SECRET_KEYS.search(str(k)) else _scrub(v) for k, v in items[:MAX_ITEMS]}
        if len(items) > MAX_ITEMS:
            out["..."] = f"{len(items) - MAX_ITEMS} more keys"
        return out
    if isinstance(value, list | tuple):
        head = [_scrub(v) for v in list(value[:MAX_ITEMS])]
        return [*head, f"...{len(value) - MAX_ITEMS} more items"] if len(value) > MAX_ITEMS else head
    return value


# A line's keys are a small set (the bound context, the event's fields), so whether a key looks secret
# is decided once per key name, not on every line.
_SECRET_KEY: dict[str, bool] = {}
_PLAIN = (int, float, type(None))


def _secret_key(key: str) -> bool:
    secret = _SECRET_KEY.get(key)
    if secret is None:
        secret = _SECRET_KEY[key] = SECRET_KEYS.search(key) is not None
        if len(_SECRET_KEY) > 10_000:  # keys made from data would otherwise grow it without end
            _SECRET_KEY.clear()
    return secret


def redact_secrets(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: drop values of secret-looking keys and API keys inside any string.

    Most values of a line are short strings holding no key-shaped text and numbers: they are kept
    as they are after one regex search, without a copy (a worker writes ~4 lines per job)."""
    for key, value in event_dict.items():
        if _secret_key(key):
            event_dict[key] = REDACTED
        elif type(value) is str:
            if len(value) > MAX_STRING or SECRET_VALUES.search(value) is not None:
                event_dict[key] = _scrub(value)
        elif not isinstance(value, _PLAIN):
            event_dict[key] = _scrub(value)
    return event_dict


def add_trace_ids(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: the current span's `trace_id` and `span_id`, so a log line leads to its trace."""
    ids = current_ids()
    if ids is not None:
        event_dict.setdefault("trace_id", ids[0])
        event_dict.setdefault("span_id", ids[1])
    return event_dict


class _Sink:
    """Where structlog's own lines go: the stream of the stdlib handler `configure_logging` installed,
    written under that handler's lock (so a line of ours and a stdlib line never interleave), and the
    level below which they are dropped. Read at every line: a later `configure_logging` (another
    stream or level) applies to loggers already cached."""

    handler: logging.Handler | None = None
    level: int = logging.INFO


_SINK = _Sink()
# The processor list every `configure_logging` installs: one list object, its contents replaced by
# each call, so a logger cached under an earlier configuration runs the current processors too.
_PROCESSORS: list[Any] = []
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "msg": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


def filter_by_level(_logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor, first in the chain: a line below the configured level is dropped before
    any other work (the live view runs at WARNING while the roles log at INFO)."""
    if _LEVELS.get(method, logging.NOTSET) < _SINK.level:
        raise structlog.DropEvent
    return event_dict


class LineLogger:
    """structlog's logger: writes each rendered line to the configured handler's stream itself.

    Our lines do not go through stdlib logging: a `LogRecord`, the logger tree and the formatter
    cost about as much again as the rendering (bench/RESULTS.md, "Where the worker CPU goes, sampled;
    cheaper log lines"). Foreign lines (arq, httpx) still do, and are rendered by the same processors."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or "root"  # structlog.stdlib.add_logger_name reads it

    def msg(self, line: str) -> None:
        handler = _SINK.handler
        if handler is None:
            return
        handler.acquire()
        try:
            stream = handler.stream  # type: ignore[attr-defined]
            stream.write(line + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stream: a log line never fails the work it describes (as stdlib's)
        finally:
            handler.release()

    debug = info = warning = warn = error = exception = critical = fatal = msg


def configure_logging(level: str = "INFO", json: bool | None = None, stream: Any = None) -> None:
    stream = stream or sys.stdout
    if json is None:
        json = not stream.isatty()
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        add_trace_ids,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        redact_secrets,
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    # stdlib records are filtered by stdlib itself.
    _PROCESSORS[:] = [filter_by_level, *shared, structlog.processors.format_exc_info, renderer]
    structlog.configure(
        processors=_PROCESSORS,
        logger_factory=LineLogger,
        wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),
        # A logger resolves its processors once, not on every line (a later configure_logging replaces
        # the contents of _PROCESSORS and the stream and level in _SINK, which cached loggers still use).
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    _SINK.handler, _SINK.level = handler, root.level
    # No line of ours shows its source file, thread or process: skip finding the caller's frame and
    # the thread and process names for every record (the logging HOWTO's "Optimization").
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    # httpx logs every request at INFO; that is noise in a worker's log.
    for noisy in ("httpx", "httpcore", "httpx2", "httpcore2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
