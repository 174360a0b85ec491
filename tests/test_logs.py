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
