"""arq's private parts that taskloom.wake relies on are still what they were in arq 0.28.

`taskloom.wake` re-implements `Worker.main`, calls `Worker._poll_iteration`, and renews arq's
in-progress mark. An arq upgrade that changes any of them fails here, by name, instead of showing
up as slow recovery or a worker loop that silently drifts from arq's own.
"""

from __future__ import annotations

import hashlib
import inspect

import arq
from arq.constants import in_progress_key_prefix
from arq.worker import Worker

# sha256 (first 16 hex digits) of the source of the arq 0.28.0 methods taskloom.wake copies or calls.
# When arq changes one: read the new code, port the change into taskloom.wake, then update the digest.
KNOWN_SOURCES = {
    "main": "45ca1591c9717466",
    "_poll_iteration": "f8d39d823a0a59f2",
    "start_jobs": "b45797cfa40bed7f",
}


def _digest(name: str) -> str:
    return hashlib.sha256(inspect.getsource(getattr(Worker, name)).encode()).hexdigest()[:16]


def test_arq_is_the_version_taskloom_wake_was_written_against() -> None:
    """arq is 0.28.x (pyproject pins it; taskloom.wake names the version)."""
    assert arq.VERSION.startswith("0.28."), f"arq {arq.VERSION}: re-check taskloom/wake.py against it"


def test_the_worker_methods_taskloom_wake_copies_are_unchanged() -> None:
    """Worker.main, _poll_iteration and start_jobs have the source taskloom.wake was written against."""
    changed = {name: _digest(name) for name, known in KNOWN_SOURCES.items() if _digest(name) != known}
    assert changed == {}, f"arq changed these Worker methods; port them into taskloom/wake.py: {changed}"


def test_the_in_progress_mark_is_where_hold_job_renews_it() -> None:
    """start_jobs marks a job in progress at `arq:in-progress:<id>` for `in_progress_timeout_s`."""
    assert in_progress_key_prefix == "arq:in-progress:"
    source = inspect.getsource(Worker.start_jobs)
    assert "in_progress_key_prefix" in source and "self.in_progress_timeout_s" in source
    assert inspect.iscoroutinefunction(Worker._poll_iteration)
