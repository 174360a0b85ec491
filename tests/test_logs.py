"""Logging: one JSON object per line, job context bound, secrets never written."""

from __future__ import annotations

import io
import json
import logging

import structlog

from taskloom.logs import configure_logging


def test_json_lines_with_context_and_no_api_key() -> None:
    """Bound context appears on each line; API keys are redacted by key name and by value shape."""
    buf = io.StringIO()
    configure_logging("INFO", json=True, stream=buf)
    try:
        log = structlog.stdlib.get_logger("test")
        with structlog.contextvars.bound_contextvars(goal_id="g1", task_id="t1", role="executor"):
            log.info("model.call", api_key="sk-ant-api03-SECRETSECRET", note="used sk-ant-api03-OTHERSECRET")
            log.info("http", headers={"Authorization": "Bearer abcdefghijklmnop", "x-api-key": "k"})
        logging.getLogger("arq.worker").info("stdlib line %d", 7)
    finally:
        logging.getLogger().handlers.clear()
        structlog.reset_defaults()
    text = buf.getvalue()
    assert "SECRET" not in text and "abcdefghijklmnop" not in text
    lines = [json.loads(x) for x in text.splitlines()]
    assert len(lines) == 3
    assert lines[0]["goal_id"] == "g1" and lines[0]["task_id"] == "t1" and lines[0]["role"] == "executor"
    assert lines[1]["headers"]["x-api-key"] == "[redacted]"
    assert lines[2]["event"] == "stdlib line 7" and lines[2]["logger"] == "arq.worker"


def test_logged_values_are_capped() -> None:
    """A 1 MB value (an invalid job payload, say) is logged as its head and a count, not as a 1 MB line."""
    buf = io.StringIO()
    configure_logging("INFO", json=True, stream=buf)
    try:
        big = {"text": "x" * 1_000_000}
        log = structlog.stdlib.get_logger("test")
        log.error("job.invalid_payload", errors=[{"input": big}], ids=list(range(10_000)))
    finally:
        logging.getLogger().handlers.clear()
        structlog.reset_defaults()
    (line,) = buf.getvalue().splitlines()
    assert len(line) < 10_000
    body = json.loads(line)
    assert body["errors"][0]["input"]["text"].endswith("[998000 more chars]")
    assert body["ids"][-1] == "...9950 more items"


def test_a_later_configuration_applies_to_loggers_already_used() -> None:
    """Our lines are written by structlog itself (not through stdlib logging), yet a second
    configure_logging (another stream, level or renderer) still reaches a logger that was cached
    at its first line, as the stdlib handler did."""
    first, second = io.StringIO(), io.StringIO()
    log = structlog.stdlib.get_logger("test.cached")
    try:
        configure_logging("INFO", json=True, stream=first)
        log.info("one")
        configure_logging("WARNING", json=True, stream=second)
        log.info("dropped: below the new level")
        log.warning("two")
        logging.getLogger("arq.worker").info("stdlib, below the new level too")
    finally:
        logging.getLogger().handlers.clear()
        structlog.reset_defaults()
    assert [json.loads(x)["event"] for x in first.getvalue().splitlines()] == ["one"]
    assert [json.loads(x)["event"] for x in second.getvalue().splitlines()] == ["two"]


def test_a_closed_stream_never_fails_the_caller() -> None:
    """A log line never fails the work it describes: a closed stream drops the line, as stdlib's
    handler would."""
    buf = io.StringIO()
    configure_logging("INFO", json=True, stream=buf)
    try:
        buf.close()
        structlog.stdlib.get_logger("test").info("nowhere to go")
        structlog.stdlib.get_logger("test").exception("nor this")
    finally:
        logging.getLogger().handlers.clear()
        structlog.reset_defaults()
