"""Small helpers shared by tests (not fixtures)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

TASKLOOM = [sys.executable, "-m", "taskloom"]


def run_cli(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TASKLOOM, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False)


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 10, every: float = 0.02) -> None:
    """Wait until `check()` is true; fail the test with a clear message otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(every)
    raise AssertionError(f"condition not met within {timeout} s")


def live_redis_servers_under(home: Path) -> list[int]:
    """PIDs of live (not zombie) redis-server processes working in `home` (redis chdirs to its `dir`)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
            stat = Path(f"/proc/{entry}/stat").read_text()
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if comm.startswith("redis-server") and stat.rsplit(")", 1)[-1].split()[0] != "Z" and cwd == str(home):
            pids.append(int(entry))
    return pids


TESTS_DIR = Path(__file__).parent


def fake_model_env(subprocess_env: dict[str, str], base_url: str, counter: Path, **extra: str) -> dict[str, str]:
    """Environment for a `taskloom worker` process whose model is the fake Messages API at `base_url`
    and whose tools are the test toolkit (`toolkits_for_tests:kit` unless `TASKLOOM_TOOLS` is given)."""
    env = dict(
        subprocess_env,
        TASKLOOM_MODEL="claude-test",
        ANTHROPIC_API_KEY="sk-ant-test",
        ANTHROPIC_BASE_URL=base_url,
        TASKLOOM_TOOLS="toolkits_for_tests:kit",
        TASKLOOM_LEASE_TTL="3",
        TL_COUNTER_FILE=str(counter),
        PYTHONPATH=os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
    )
    env.update(extra)
    return env


def openai_model_env(
    subprocess_env: dict[str, str], base_url: str, counter: Path, models_file: Path, **extra: str
) -> dict[str, str]:
    """As `fake_model_env`, with the model an alias (`oa`) of a models file written to `models_file`: the
    OpenAI Chat Completions dialect at `base_url` (the fake server), its key in `TL_TEST_OA_KEY`."""
    models_file.write_text(
        "[models.oa]\n"
        'provider = "openai"\n'
        'model = "gpt-test"\n'
        f'base_url = "{base_url}"\n'
        'api_key_env = "TL_TEST_OA_KEY"\n'
        "prices = { input = 1, output = 4, cache_read = 0.25, cache_write = 1 }\n"
    )
    env = fake_model_env(subprocess_env, base_url, counter, **extra)
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"):
        env.pop(name, None)
    env.update(TASKLOOM_MODEL="oa", TASKLOOM_MODELS_FILE=str(models_file), TL_TEST_OA_KEY="sk-oa-test")
    env.update(extra)
    return env


@contextlib.contextmanager
def demo_mcp_http(tmp_path: Path, *args: str, name: str = "http") -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The demo support-desk MCP server over streamable HTTP on a free loopback port: (URL, process)."""
    port_file = tmp_path / f"mcp-{name}.port"
    with (tmp_path / f"mcp-{name}.stderr").open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "executor.demo_mcp", "--http", "--port-file", str(port_file), *args],
            stderr=err,
            cwd=TESTS_DIR.parent,
        )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None, (tmp_path / f"mcp-{name}.stderr").read_text()
            assert time.monotonic() < deadline, "the demo MCP server did not start within 30 s"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text()}/mcp", proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def mcp_log(path: Path) -> list[dict[str, object]]:
    """The demo MCP server's call log (`--log`): one dict per call phase."""
    import json

    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def store_result(redis: Any, keys: Any, result: Any) -> None:
    """Store an attempt's result the way an executor does: under the attempt's lease, then free it."""
    from bus.attempts import AttemptStore

    attempt = AttemptStore(redis, keys, result.goal_id, result.task_id, result.attempt)
    assert await attempt.acquire("test-executor", ttl=30)
    await attempt.save_result(result)
    await attempt.finish()
