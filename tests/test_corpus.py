"""The bad-input corpus (`tests/corpus.py`): every case is one run of the real `taskloom` executable.

For each case: the exit code; the words naming the culprit in its output; no traceback; a finish
within the case's bound; no redis-server left behind under its home. The selected cases run once,
concurrently (each is a Python process, about a second of CPU), in a module fixture; each test then
checks its own case's result, so a failure names the case.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis as redis_sync
from corpus import CASES, TRACEBACK, Case, Ctx, command, write_toolkits
from helpers import live_redis_servers_under

ROOT = Path(__file__).resolve().parent.parent
BY_ID = {case.id: case for case in CASES}
# Processes at once: most of a case is CPU (imports), some of it waiting on a timeout or a signal.
PARALLEL = int(os.environ.get("TL_CORPUS_PARALLEL", "0")) or max(4, 2 * (os.cpu_count() or 2))

pytestmark = [pytest.mark.corpus, pytest.mark.timeout(1800)]  # the first test waits for the whole run


@dataclass
class Outcome:
    code: int | None
    stdout: str
    stderr: str
    seconds: float
    servers_left: list[int]
    subs: dict[str, str]
    error: str | None = None  # the harness itself failed (setup, timeout)


def _fill(text: str, subs: dict[str, str]) -> str:
    for key, value in subs.items():
        text = text.replace("{" + key + "}", value)
    return text


def _run(case: Case, redis_url: str, base: Path, toolkits: Path) -> Outcome:
    # A short home: the embedded server's socket path must stay under 107 bytes.
    home = Path(tempfile.mkdtemp(prefix="c", dir=base))
    scratch = home / "scratch"
    scratch.mkdir()
    prefix = f"tlc:{uuid.uuid4().hex[:10]}:"
    ctx = Ctx(redis_url=redis_url, prefix=prefix, home=home, scratch=scratch, toolkits=toolkits)
    subs: dict[str, str] = {}
    started = time.monotonic()
    try:
        if case.setup is not None:
            subs = case.setup(ctx)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "TASKLOOM_"))}
        env.update(
            TASKLOOM_KEY_PREFIX=prefix,
            TASKLOOM_HOME=str(home),
            TASKLOOM_POLL_DELAY="0.05",
            XDG_DATA_HOME=str(scratch / "xdg"),  # where an empty TASKLOOM_HOME's default lands
            PYTHONPATH=os.pathsep.join([str(ROOT), str(toolkits)] if case.cwd is None else [str(ROOT)]),
            PYTHONUNBUFFERED="1",
            COLUMNS="200",
        )
        if not case.embedded:
            env["TASKLOOM_REDIS_URL"] = redis_url
        for name, value in case.env:
            if value is None:
                env.pop(name, None)
            else:
                env[name] = _fill(value, subs)
        cwd = str(toolkits) if case.cwd == "toolkits" else str(scratch)
        started = time.monotonic()
        proc = subprocess.Popen(
            [_fill(a, subs) for a in command(case)],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE if case.stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if case.term_after is not None:
            # The signal is meant for a command at work: with the embedded server, once it runs (the
            # command is connected), then `term_after` seconds more; on a busy machine imports are slow.
            deadline = time.monotonic() + case.bound / 2
            while case.embedded and not live_redis_servers_under(home) and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(case.term_after)
            proc.send_signal(case.term_signal)
        try:
            out, err = proc.communicate(case.stdin, timeout=case.bound + 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            return Outcome(None, out, err, time.monotonic() - started, [], subs, "did not finish")
        seconds = time.monotonic() - started
        left = live_redis_servers_under(home)
        deadline = time.monotonic() + 5  # a server told to stop may take a moment to exit
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = live_redis_servers_under(home)
        if case.cwd_untouched and any(p.name != "xdg" for p in scratch.iterdir()):
            err += f"\n(harness) files written into the working directory: {sorted(os.listdir(scratch))}"
            return Outcome(proc.returncode, out, err, seconds, left, subs, "wrote into its working directory")
        left += live_redis_servers_under(scratch / "xdg" / "taskloom")
        return Outcome(proc.returncode, out, err, seconds, left, subs)
    except Exception as exc:  # the harness's own failure is reported on the case
        return Outcome(None, "", "", time.monotonic() - started, [], subs, f"{type(exc).__name__}: {exc}")
    finally:
        for held in ctx.held:
            held.close()
        for pid in live_redis_servers_under(home) + live_redis_servers_under(scratch / "xdg" / "taskloom"):
            # never leave one behind, even when the case fails
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, redis_url: str) -> Iterator[dict[str, Outcome]]:
    """Run every selected case of this module concurrently, once."""
    selected = [
        item.callspec.params["case_id"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    ]
    base = Path(tempfile.mkdtemp(prefix="tlcorpus-"))
    toolkits = base / "kits"
    write_toolkits(toolkits)
    started = time.monotonic()
    with ThreadPoolExecutor(PARALLEL) as pool:
        # The slowest cases first, so that they do not finish the run alone.
        order = sorted(selected, key=lambda cid: -(BY_ID[cid].bound + (BY_ID[cid].term_after or 0)))
        futures = {cid: pool.submit(_run, BY_ID[cid], redis_url, base, toolkits) for cid in order}
        results = {cid: f.result() for cid, f in futures.items()}
    slowest = sorted(results.items(), key=lambda kv: -kv[1].seconds)[:5]
    print(f"\ncorpus: {len(results)} cases in {time.monotonic() - started:.1f} s with {PARALLEL} at once; slowest:")
    print("  " + ", ".join(f"{cid} {r.seconds:.1f} s" for cid, r in slowest))
    yield results
    r = redis_sync.Redis.from_url(redis_url)
    for key in r.scan_iter(match="tlc:*", count=1000):
        r.delete(key)
    for key in r.scan_iter(match="arq:*tlc:*", count=1000):
        r.delete(key)
    r.close()


@pytest.mark.parametrize("case_id", [c.id for c in CASES])
def test_case(case_id: str, outcomes: dict[str, Outcome]) -> None:
    """One bad (or good) input: the exit code, the culprit named, no traceback, in time, no server left."""
    case, got = BY_ID[case_id], outcomes[case_id]
    both = got.stdout + got.stderr
    shown = (
        f"exit {got.code} in {got.seconds:.1f} s\n--- stdout\n{got.stdout[-3000:]}\n--- stderr\n{got.stderr[-3000:]}"
    )
    assert got.error is None, f"{got.error}\n{shown}"
    assert got.code == case.code, shown
    assert TRACEBACK not in both, shown
    for word in case.names:
        assert _fill(word, got.subs) in both, f"{word!r} not named\n{shown}"
    for word in case.stdout_has:
        assert _fill(word, got.subs) in got.stdout, f"{word!r} not in stdout\n{shown}"
    for word in case.absent:
        assert word not in both, f"{word!r} printed\n{shown}"
    if case.code in (1, 2) and case.python is None and case.names and "--json" not in case.args:
        # One line says what is wrong (`unhealthy:` is health's, read by probes), naming the culprit
        # (the case's first word; the others may be in a warning or the rest of the output).
        errors = [line for line in got.stderr.splitlines() if line.startswith(("error:", "unhealthy:"))]
        assert len(errors) == 1, shown
        assert _fill(case.names[0], got.subs) in errors[0], shown
    assert got.seconds <= case.bound, shown
    assert got.servers_left == [], shown
