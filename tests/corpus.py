"""The bad-input corpus: a table of cases, each one run of the real `taskloom` executable.

Each case says how to call `taskloom` (arguments, environment, stdin, what to seed in Redis first,
whether to stop it with a signal) and what must come out: the exit code, the words that name the
culprit, and what must not be printed. `tests/test_corpus.py` runs the selected cases concurrently
(each is a Python process, about a second of CPU) and checks every case for: the exit code, the
culprit named, no traceback, a finish within the case's bound, and no redis-server left behind under
the case's home.

Seeding helpers write Redis directly, as damaged data or a goal in a given state would look; they
use the real `bus` client where a well-formed record is wanted.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as redis_sync
from arq.connections import create_pool

from bus.client import Client
from bus.connection import redis_settings
from bus.keys import Keys

TRACEBACK = "Traceback (most recent call last)"


@dataclass
class Ctx:
    """What a case's setup may use: its own key prefix, home, Redis and scratch directory."""

    redis_url: str
    prefix: str
    home: Path
    scratch: Path
    toolkits: Path
    held: list[Any] = field(default_factory=list)  # sockets etc. kept open while the case runs

    @property
    def keys(self) -> Keys:
        return Keys(prefix=self.prefix)

    def sync(self) -> redis_sync.Redis:
        return redis_sync.Redis.from_url(self.redis_url)

    def goal(self, text: str = "hello", **fields: str) -> str:
        """A real submitted goal (the bus client), then `fields` written over its hash (state, answer...)."""

        async def go() -> str:
            pool = await create_pool(redis_settings(self.redis_url))
            try:
                return await Client(pool, self.keys, 200_000).submit({"text": text})
            finally:
                await pool.aclose()

        gid = asyncio.run(go())
        if fields:
            r = self.sync()
            r.hset(self.keys.goal(gid), mapping=fields)
            r.close()
        return gid

    def enqueue(self, function: str, payload: Any, role: str) -> None:
        async def go() -> None:
            pool = await create_pool(redis_settings(self.redis_url))
            try:
                await pool.enqueue_job(function, payload, _queue_name=self.keys.queue(role))
            finally:
                await pool.aclose()

        asyncio.run(go())


Setup = Callable[[Ctx], dict[str, str]]


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    code: int
    names: tuple[str, ...] = ()  # each must appear in stdout or stderr (the culprit, what was expected)
    env: tuple[tuple[str, str | None], ...] = ()  # extra variables; None removes one
    embedded: bool = False  # no TASKLOOM_REDIS_URL: the embedded redis-server under the case's home
    setup: Setup | None = None  # returns values substituted into args ("{gid}")
    stdin: str | None = None
    bound: float = 60.0  # seconds: a hang is what this catches, and the machine may be shared
    term_after: float | None = None  # send `term_signal` after this many seconds
    term_signal: int = signal.SIGTERM
    absent: tuple[str, ...] = ()  # must not appear in stdout or stderr
    stdout_has: tuple[str, ...] = ()  # must appear in stdout
    cwd: str | None = None  # "toolkits": run in the toolkit directory (without the worktree on sys.path[0])
    python: str | None = None  # run this Python code (client misuse) instead of the CLI
    cwd_untouched: bool = False  # the command writes nothing into its working directory


def env(**kw: str | None) -> tuple[tuple[str, str | None], ...]:
    return tuple((f"TASKLOOM_{k.upper()}", v) for k, v in kw.items())


# -- toolkits that misbehave, written into the case's toolkit directory -----------------------------

TOOLKITS: dict[str, str] = {
    "good_kit.py": (
        "from taskloom import Toolkit\nkit = Toolkit('good')\n\n@kit.tool(read_only=True)\n"
        "def echo(order_id: str) -> str:\n    'Echo.'\n    return order_id\n"
    ),
    "twin_kit.py": (
        "from taskloom import Toolkit\nkit = Toolkit('twin')\n\n@kit.tool()\n"
        "def echo(order_id: str) -> str:\n    'Echo again.'\n    return order_id\n"
    ),
    "raising_kit.py": "raise RuntimeError('boom at import')\n",
    "syntax_kit.py": "def broken(:\n    pass\n",
    "unannotated_kit.py": (
        "from taskloom import Toolkit\nkit = Toolkit('u')\n\n@kit.tool()\ndef lookup(order_id):\n    'x'\n"
    ),
    "notakit_kit.py": "kit = {'not': 'a toolkit'}\n",
    "importerror_kit.py": "import module_that_does_not_exist_anywhere\n",
    "varargs_kit.py": (
        "from taskloom import Toolkit\nkit = Toolkit('v')\n\n@kit.tool()\ndef many(*orders: str) -> str:\n    'x'\n"
    ),
}


def write_toolkits(where: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    for name, body in TOOLKITS.items():
        (where / name).write_text(body)


# -- setups -----------------------------------------------------------------------------------------


def goal(text: str = "hello", **fields: str) -> Setup:
    return lambda c: {"gid": c.goal(text, **fields)}


def succeeded(answer: str) -> Setup:
    return goal("refund?", state="succeeded", answer=answer)


def corrupt_goal_record(c: Ctx) -> dict[str, str]:
    gid = c.goal()
    r = c.sync()
    r.hset(c.keys.goal(gid), "record", "{not json")
    r.close()
    return {"gid": gid}


def goal_without_state(c: Ctx) -> dict[str, str]:
    gid = c.goal()
    r = c.sync()
    r.hdel(c.keys.goal(gid), "state")
    r.close()
    return {"gid": gid}


def goal_bad_state(c: Ctx) -> dict[str, str]:
    return {"gid": c.goal(state="exploded")}


def goal_key_wrong_type(c: Ctx) -> dict[str, str]:
    r = c.sync()
    r.set(c.keys.goal("strgoal"), "just a string")
    r.close()
    return {"gid": "strgoal"}


def corrupt_task(c: Ctx) -> dict[str, str]:
    gid = c.goal()
    r = c.sync()
    r.sadd(f"{c.keys.tasks(gid)}:ids", "t1")
    r.hset(f"{c.keys.tasks(gid)}:t1", mapping={"state": "sideways", "updated_at": "yesterday"})
    r.close()
    return {"gid": gid}


def corrupt_plan(c: Ctx) -> dict[str, str]:
    gid = c.goal(plan_version="1", state="running")
    r = c.sync()
    r.set(c.keys.plan(gid, 1), '{"version": 1, "plan": {"tasks": "not a list"}}')
    r.close()
    return {"gid": gid}


def corrupt_event(c: Ctx) -> dict[str, str]:
    gid = c.goal()
    r = c.sync()
    r.xadd(c.keys.goal_events(gid), {"e": "{not json"})
    r.close()
    return {"gid": gid}


def events_key_wrong_type(c: Ctx) -> dict[str, str]:
    gid = c.goal()
    r = c.sync()
    r.delete(c.keys.goal_events(gid))
    r.set(c.keys.goal_events(gid), "not a stream")
    r.close()
    return {"gid": gid}


def corrupt_ledger(c: Ctx) -> dict[str, str]:
    gid = c.goal()
    r = c.sync()
    r.hset(c.keys.ledger(gid), "budget", "lots")
    r.close()
    return {"gid": gid}


def corrupt_approval(c: Ctx) -> dict[str, str]:
    gid = c.goal()
    r = c.sync()
    r.hset(c.keys.approval_requests(gid), "toolu_1", "{not json")
    r.close()
    return {"gid": gid}


def awaiting_approval(c: Ctx) -> dict[str, str]:
    gid = c.goal(state="running")
    r = c.sync()
    body = {"task_id": "t1", "attempt": 1, "tool": "issue_refund", "input": {"order_id": "A100"}}
    r.hset(c.keys.approval_requests(gid), "toolu_refund1", json.dumps(body))
    r.close()
    return {"gid": gid}


def approved_once(c: Ctx) -> dict[str, str]:
    gid = c.goal(state="running")
    r = c.sync()
    r.hset(c.keys.approvals(gid), "toolu_refund1", "approved")
    r.close()
    return {"gid": gid}


def denied_once(c: Ctx) -> dict[str, str]:
    gid = c.goal(state="running")
    r = c.sync()
    r.hset(c.keys.approvals(gid), "toolu_refund1", "denied:no")
    r.close()
    return {"gid": gid}


def goal_with_events(c: Ctx) -> dict[str, str]:
    gid = c.goal("[/bold] check [check-a100]")
    r = c.sync()
    data = {"type": "task.state", "goal_id": gid, "task_id": "check-a100", "data": {"state": "[red]ready"}}
    r.xadd(c.keys.goal_events(gid), {"e": json.dumps({**data, "at": "2026-10-13T10:00:00Z"})})
    r.close()
    return {"gid": gid}


def goal_file(text: str, name: str = "goal.txt") -> Setup:
    def setup(c: Ctx) -> dict[str, str]:
        path = c.scratch / name
        path.write_text(text)
        return {"file": str(path)}

    return setup


def binary_goal_file(c: Ctx) -> dict[str, str]:
    path = c.scratch / "goal.bin"
    path.write_bytes(b"\xff\xfe\x00bad")
    return {"file": str(path)}


def enqueue(function: str, payload: Any, role: str) -> Setup:
    def setup(c: Ctx) -> dict[str, str]:
        c.enqueue(function, payload, role)
        return {}

    return setup


def port_in_use(c: Ctx) -> dict[str, str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    c.held.append(s)
    return {"port": str(s.getsockname()[1])}


def free_port(c: Ctx) -> dict[str, str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return {"port": str(port)}


def file_as_home(c: Ctx) -> dict[str, str]:
    path = c.scratch / "home-is-a-file"
    path.write_text("x")
    return {"file": str(path)}


def embedded_goal(c: Ctx) -> dict[str, str]:
    """A goal on the embedded server under the case's home (the server is stopped again after)."""

    async def go() -> str:
        async with Client.open(None, c.home, c.keys) as client:
            return await client.submit({"text": "wait for me"})

    return {"gid": asyncio.run(go())}


LONG_HOME = "/tmp/" + "h" * 110
MARKUP = "[/bold] [red]not red[/red] [link=x]y[/link] :smile:"
ESCAPES = "plain \x1b[31mred\x1b[0m \x1b]0;title\x07 bell\x07 end"
CLIENT = "import asyncio, sys\nfrom taskloom import Client\n"


def client_script(body: str) -> str:
    """A Python program using the library; it prints `TypeName: message` of what it raises, exit 2."""
    return (
        CLIENT
        + "async def main():\n    async with Client.from_settings() as c:\n"
        + "".join(f"        {line}\n" for line in body.splitlines())
        + "try:\n    asyncio.run(main())\nexcept Exception as exc:\n"
        + "    print(f'{type(exc).__name__}: {exc}', file=sys.stderr); sys.exit(2)\n"
    )


HELP = {"submit": ("--tool", "--id"), "watch": ("--timeout",), "run": ("--local", "--timeout")}
NEEDS_ARG = {"worker": "role", "submit": "text", "status": "goal_id", "dag": "goal_id"}


# One bad value per setting of the README's table, each named with what was expected.
BAD_SETTINGS: list[tuple[str, str, str, tuple[str, ...]]] = [
    # (variable, value, command, expected words besides the variable)
    ("POLL_DELAY", "often", "status", ("number",)),
    ("POLL_DELAY", "nan", "events", ()),
    ("WAKE", "maybe", "status", ("boolean",)),
    ("JOB_TIMEOUT", "inf", "worker", ("finite",)),
    ("DEFAULT_BUDGET_TOKENS", "200000000", "submit", ("100000000",)),
    ("MODEL", "DEMO", "run", ("'demo'", "Claude model id")),
    ("MODEL", "gpt-4o", "worker", ("Claude model id",)),
    ("MODELS_FILE", "/nonexistent/models.toml", "worker", ("cannot read",)),
    ("PLANNER_MODEL", "gpt-4o", "worker", ("Claude model id", "alias")),
    ("EXECUTOR_MODEL", "DEMO", "submit", ("'demo'",)),
    ("BREAKER_FAILURES", "0", "worker", ("greater than or equal to 1",)),
    ("BREAKER_COOLDOWN", "-5", "status", ("greater than 0",)),
    ("PRICES", "{bad", "worker", ("JSON",)),
    ("PRICES", "[1, 2]", "status", ("JSON object",)),
    ("PRICES", '{"claude-x": {"input": 1}}', "status", ("claude-x.output", "Field required")),
    ("PRICES", '{"claude-y": {"input": -1, "output": 1, "cache_read": 1, "cache_write": 1}}', "submit", ("input",)),
    ("METRICS_PORT", "70000", "worker", ("less than or equal to 65535",)),
    ("METRICS_ADDR", "bad addr!", "worker", ("IP address or a host name",)),
    ("KEY_PREFIX", "has space", "submit", ("pattern",)),
    ("CRITIC_QUEUE", "planner", "worker", ("TASKLOOM_PLANNER_QUEUE", "one queue per role")),
    ("EXECUTOR_QUEUE", "planner", "submit", ("TASKLOOM_PLANNER_QUEUE",)),
    ("REDIS_URL", "http://localhost:6379", "status", ("redis://",)),
    ("REDIS_URL", "redis://localhost:abc/0", "status", ("Port",)),
    ("REDIS_URL", "redis://localhost:6379/x", "submit", ("database number",)),
    ("REDIS_URL", "redis://localhost:0", "status", ("port between 1 and 65535",)),
    ("REDIS_URL", "unix://", "status", ("unix:///path",)),
    ("REDIS_URL", "redis:///0", "status", ("host",)),
    ("HOME", LONG_HOME, "submit", ("107-byte limit",)),
    ("DEBUG", "maybe", "status", ("boolean",)),
]

# The numeric bounds of the other settings, several per run: one error line must name each of them.
BAD_NUMBERS: list[tuple[str, dict[str, tuple[str, str]]]] = [
    ("concurrency", {
        "PLANNER_CONCURRENCY": ("0", "greater than or equal to 1"),
        "EXECUTOR_CONCURRENCY": ("1001", "less than or equal to 1000"),
        "CRITIC_CONCURRENCY": ("ten", "valid integer"),
    }),
    ("timing", {
        "JOB_TIMEOUT": ("0", "greater than 0"),
        "SHUTDOWN_GRACE": ("-1", "greater than or equal to 0"),
        "RECONCILE_AFTER": ("0", "greater than 0"),
        "TASK_TIMEOUT": ("-5", "greater than 0"),
        "DEFAULT_BUDGET_TOKENS": ("0", "greater than 0"),
    }),
    ("loop-bounds", {
        "MAX_STEPS": ("0", "greater than or equal to 1"),
        "MAX_TASK_RETRIES": ("21", "less than or equal to 20"),
        "MAX_REPLANS": ("-1", "greater than or equal to 0"),
        "MAX_PLAN_TASKS": ("0", "greater than or equal to 1"),
        "MAX_PLAN_ATTEMPTS": ("0", "greater than or equal to 1"),
    }),
    ("model-calls", {
        "MODEL_MAX_TOKENS": ("8", "greater than or equal to 16"),
        "MODEL_MAX_RETRIES": ("11", "less than or equal to 10"),
        "MODEL_TIMEOUT": ("0", "greater than 0"),
    }),
    ("tools-and-context", {
        "TOOL_OUTPUT_LIMIT": ("10", "greater than or equal to 100"),
        "TOOL_TIMEOUT": ("0", "greater than 0"),
        "COMPACT_AFTER_TOKENS": ("5", "greater than or equal to 1000"),
        "DEPENDENCY_RESULT_LIMIT": ("1", "greater than or equal to 100"),
        "LOOP_WINDOW": ("0", "greater than or equal to 1"),
    }),
    ("ledger-and-operations", {
        "LEASE_TTL": ("0.5", "greater than or equal to 1"),
        "LEDGER_MIN_RESERVATION": ("0", "greater than or equal to 1"),
        "LEDGER_RESERVATION_TTL": ("0", "greater than 0"),
        "LEDGER_SETTLE_DELAY": ("-1", "greater than or equal to 0"),
        "EVENTS_MAXLEN": ("5", "greater than or equal to 100"),
        "METRICS_INTERVAL": ("0", "greater than 0"),
        "HEARTBEAT_TTL": ("0.5", "greater than or equal to 1"),
        "POLL_DELAY": ("61", "less than or equal to 60"),
    }),
]  # fmt: skip

ARGS_FOR = {
    "status": ("status", "g1"),
    "submit": ("submit", "hi"),
    "health": ("health",),
    "events": ("events", "g1"),
    "worker": ("worker", "all", "--burst"),
    "run": ("run", "hi", "--local"),
}


def _settings_cases() -> list[Case]:
    cases = []
    for var, value, command, words in BAD_SETTINGS:
        name = f"TASKLOOM_{var}"
        slug = "".join(ch if ch.isalnum() else "-" for ch in value)[:20].strip("-") or "x"
        embedded = var == "HOME"  # the socket-length rule is the embedded server's
        cid = f"setting-{var.lower()}-{slug}-{command}"
        cases.append(Case(cid, ARGS_FOR[command], 2, (name, *words), env=((name, value),), embedded=embedded))
    return cases


def _number_cases() -> list[Case]:
    cases = []
    for group, bad in BAD_NUMBERS:
        names = tuple(w for var, (_, expected) in bad.items() for w in (f"TASKLOOM_{var}", expected))
        variables = tuple((f"TASKLOOM_{var}", value) for var, (value, _) in bad.items())
        cases.append(Case(f"settings-{group}", ("status", "g1"), 2, names, env=variables))
    return cases


def _help_cases() -> list[Case]:
    cases = [Case(f"help-{c}", (c, "--help"), 0, stdout_has=("Usage", *opts)) for c, opts in HELP.items()]
    cases += [Case(f"missing-arg-{c}", (c,), 2, (n, f"taskloom {c} --help")) for c, n in NEEDS_ARG.items()]
    return cases


CASES: list[Case] = [
    # -- the command line itself -------------------------------------------------------------
    Case("no-args-prints-help", (), 2, stdout_has=("Usage", "Commands")),
    Case("top-level-help", ("--help",), 0, stdout_has=("worker", "submit", "--debug")),
    Case("unknown-command", ("frobnicate",), 2, ("No such command", "frobnicate")),
    Case("unknown-option", ("status", "g1", "--colour"), 2, ("--colour",)),
    Case("debug-flag-on-a-clean-error", ("--debug", "status", "nosuch"), 1, ("nosuch", "not found")),
    Case("approve-missing-call-id", ("approve", "g1"), 2, ("call_id",)),
    *_help_cases(),
    # -- worker ---------------------------------------------------------------------------------
    Case("worker-unknown-role", ("worker", "janitor"), 2, ("janitor", "planner, executor, critic")),
    Case("worker-bad-log-level", ("worker", "all", "--log-level", "NOPE"), 2, ("--log-level", "NOPE", "DEBUG")),
    Case("worker-lowercase-log-level-ok", ("worker", "critic", "--burst", "--log-level", "warning"), 0),
    Case("worker-burst-empty-queues", ("worker", "all", "--burst"), 0),
    Case(
        "worker-claude-without-key",
        ("worker", "all", "--burst"),
        2,
        ("ANTHROPIC_API_KEY",),
        env=env(model="claude-sonnet-4-5"),
    ),
    Case(
        "worker-redis-unreachable",
        ("worker", "all", "--burst"),
        1,
        ("cannot reach Redis",),
        env=env(redis_url="redis://127.0.0.1:1/0"),
    ),
    Case(
        "worker-metrics-port-in-use",
        ("worker", "planner"),
        2,
        ("TASKLOOM_METRICS_PORT", "{port}"),
        env=env(metrics_port="{port}", metrics_addr="127.0.0.1"),
        setup=port_in_use,
    ),
    Case(
        "worker-metrics-addr-not-here",
        ("worker", "planner"),
        2,
        ("TASKLOOM_METRICS_ADDR", "192.0.2.1"),
        env=env(metrics_port="{port}", metrics_addr="192.0.2.1"),
        setup=free_port,
    ),
    # -- misbehaving toolkits ------------------------------------------------------------------
    Case(
        "tools-missing-module",
        ("worker", "all", "--burst"),
        2,
        ("TASKLOOM_TOOLS", "nosuchmodule"),
        env=env(tools="nosuchmodule:kit"),
    ),
    Case(
        "tools-not-module-attribute",
        ("worker", "executor", "--burst"),
        2,
        ("TASKLOOM_TOOLS", "module:attribute"),
        env=env(tools="justaname"),
    ),
    Case(
        "tools-raises-on-import",
        ("worker", "all", "--burst"),
        2,
        ("TASKLOOM_TOOLS", "raising_kit", "boom at import"),
        env=env(tools="raising_kit:kit"),
    ),
    Case(
        "tools-syntax-error",
        ("worker", "all", "--burst"),
        2,
        ("TASKLOOM_TOOLS", "syntax_kit", "syntax error"),
        env=env(tools="syntax_kit:kit"),
    ),
    Case(
        "tools-unannotated-parameter",
        ("worker", "all", "--burst"),
        2,
        ("unannotated_kit", "order_id", "annotation"),
        env=env(tools="unannotated_kit:kit"),
    ),
    Case("tools-varargs", ("worker", "all", "--burst"), 2, ("varargs_kit", "*args"), env=env(tools="varargs_kit:kit")),
    Case(
        "tools-not-a-toolkit",
        ("worker", "all", "--burst"),
        2,
        ("notakit_kit:kit", "dict", "Toolkit"),
        env=env(tools="notakit_kit:kit"),
    ),
    Case(
        "tools-missing-attribute",
        ("worker", "all", "--burst"),
        2,
        ("good_kit", "nokit"),
        env=env(tools="good_kit:nokit"),
    ),
    Case(
        "tools-import-error-inside",
        ("worker", "all", "--burst"),
        2,
        ("importerror_kit", "module_that_does_not_exist"),
        env=env(tools="importerror_kit:kit"),
    ),
    Case(
        "tools-duplicate-names",
        ("worker", "all", "--burst"),
        2,
        ("echo", "toolkit 'twin'", "toolkit 'good'"),
        env=env(tools="good_kit:kit,twin_kit:kit"),
    ),
    Case("tools-good-kit-loads", ("worker", "all", "--burst"), 0, env=env(tools="good_kit:kit")),
    Case("tools-in-current-directory", ("worker", "all", "--burst"), 0, env=env(tools="good_kit:kit"), cwd="toolkits"),
    Case(
        "run-local-tools-missing-fails-fast",
        ("run", "hi", "--local"),
        2,
        ("TASKLOOM_TOOLS", "nosuchmodule"),
        env=env(tools="nosuchmodule:kit"),
        bound=45,
    ),
    Case(
        "run-local-tools-raise-fails-fast",
        ("run", "hi", "--local", "--timeout", "600"),
        2,
        ("raising_kit",),
        env=env(tools="raising_kit:kit"),
        bound=45,
    ),
    Case(
        "run-local-no-api-key-fails-fast",
        ("run", "hi", "--local"),
        2,
        ("ANTHROPIC_API_KEY",),
        env=env(model="claude-sonnet-4-5"),
        bound=45,
    ),
    # -- health ---------------------------------------------------------------------------------
    Case("health-negative-timeout", ("health", "--timeout", "-1"), 2, ("--timeout", "-1")),
    Case("health-zero-timeout", ("health", "--timeout", "0"), 2, ("--timeout", "> 0")),
    Case("health-nan-timeout", ("health", "--timeout", "nan"), 2, ("--timeout", "nan")),
    Case("health-unknown-role", ("health", "--role", "janitor"), 2, ("--role", "janitor")),
    Case("health-no-workers", ("health",), 1, ("no live planner worker",)),
    Case("health-no-workers-json", ("health", "--json", "--role", "critic"), 1, ('"ok": false', "no live critic")),
    Case(
        "health-redis-unreachable",
        ("health", "--timeout", "2"),
        1,
        ("cannot reach Redis",),
        env=env(redis_url="redis://127.0.0.1:1/0"),
    ),
    Case("health-embedded-not-running", ("health", "--timeout", "2"), 1, ("cannot reach Redis",), embedded=True),
    # -- submit ---------------------------------------------------------------------------------
    Case("submit-empty-text", ("submit", ""), 2, ("text",)),
    Case("submit-whitespace-text", ("submit", "   "), 2, ("text",)),
    Case("submit-text-too-long", ("submit", "x" * 20_001), 2, ("text", "20000")),
    Case("submit-dod-too-long", ("submit", "hi", "--dod", "d" * 5_001), 2, ("definition_of_done", "5000")),
    Case("submit-negative-budget", ("submit", "hi", "--budget", "-5"), 2, ("budget_tokens", "greater than 0")),
    Case("submit-budget-over-cap", ("submit", "hi", "--budget", "100000001"), 2, ("budget_tokens", "100000000")),
    Case("submit-budget-not-a-number", ("submit", "hi", "--budget", "lots"), 2, ("--budget", "lots")),
    Case("submit-meta-without-equals", ("submit", "hi", "--meta", "novalue"), 2, ("metadata", "KEY=VALUE", "novalue")),
    Case("submit-meta-empty-key", ("submit", "hi", "--meta", "=x"), 2, ("metadata", "=x")),
    Case("submit-deadline-garbage", ("submit", "hi", "--deadline", "tomorrowish"), 2, ("deadline", "tomorrowish")),
    Case("submit-deadline-without-zone", ("submit", "hi", "--deadline", "2026-10-13T12:00"), 2, ("deadline", "zone")),
    Case("submit-unknown-tool", ("submit", "hi", "--tool", "nosuchtool"), 2, ("--tool", "nosuchtool", "lookup_order")),
    Case("submit-empty-tool", ("submit", "hi", "--tool", " "), 2, ("allowed_tools",)),
    Case("submit-bad-id", ("submit", "hi", "--id", "bad id!"), 2, ("--id", "bad id!")),
    Case("submit-id-too-long", ("submit", "hi", "--id", "i" * 65), 2, ("--id",)),
    Case(
        "submit-id-reused-other-text",
        ("submit", "other text", "--id", "{gid}"),
        2,
        ("--id", "{gid}", "already exists"),
        setup=lambda c: {"gid": _submit_with_id(c, "mine-1", "first text")},
    ),
    Case(
        "submit-id-reused-same-text",
        ("submit", "first text", "--id", "{gid}"),
        0,
        stdout_has=("{gid}",),
        setup=lambda c: {"gid": _submit_with_id(c, "mine-2", "first text")},
    ),
    Case("submit-from-missing-file", ("submit", "@/nonexistent/goal.txt"), 2, ("GOAL", "/nonexistent/goal.txt")),
    Case("submit-from-binary-file", ("submit", "@{file}"), 2, ("GOAL", "goal.bin"), setup=binary_goal_file),
    Case(
        "submit-from-file", ("submit", "@{file}", "--json"), 0, stdout_has=("goal_id",), setup=goal_file("Refund A100?")
    ),
    Case("submit-from-empty-file", ("submit", "@{file}"), 2, ("text",), setup=goal_file("")),
    Case("submit-from-stdin", ("submit", "-", "--json"), 0, stdout_has=("goal_id",), stdin="Refund A101?"),
    Case("submit-from-empty-stdin", ("submit", "-"), 2, ("text",), stdin=""),
    Case(
        "submit-redis-unreachable",
        ("submit", "hi"),
        1,
        ("cannot reach Redis",),
        env=env(redis_url="redis://127.0.0.1:1/0"),
    ),
    Case(
        "submit-home-is-a-file",
        ("submit", "hi"),
        1,
        ("home-is-a-file",),
        embedded=True,
        env=env(home="{file}"),
        setup=file_as_home,
    ),
    Case("submit-empty-home-is-default", ("submit", "hi"), 0, embedded=True, env=env(home=""), cwd_untouched=True),
    # -- status ---------------------------------------------------------------------------------
    Case("status-unknown-goal", ("status", "nosuchgoal"), 1, ("nosuchgoal", "not found")),
    Case("status-invalid-goal-id", ("status", "../../etc"), 1, ("../../etc", "not found")),
    Case("status-markup-goal-printed-literally", ("status", "{gid}"), 0, stdout_has=(MARKUP,), setup=goal(MARKUP)),
    Case(
        "status-escape-sequences-stripped",
        ("status", "{gid}"),
        0,
        absent=("\x1b", "\x07"),
        stdout_has=("plain [31mred",),
        setup=goal(ESCAPES),
    ),
    Case(
        "status-shows-call-awaiting-approval",
        ("status", "{gid}"),
        0,
        stdout_has=("awaiting approval", "toolu_refund1", "issue_refund", "taskloom approve {gid} toolu_refund1"),
        setup=awaiting_approval,
    ),
    Case(
        "status-json-lists-approvals",
        ("status", "{gid}", "--json"),
        0,
        stdout_has=('"awaiting_approval"', "toolu_refund1"),
        setup=awaiting_approval,
    ),
    Case("status-corrupt-goal-record", ("status", "{gid}"), 1, ("corrupt goal", "{gid}"), setup=corrupt_goal_record),
    Case("status-goal-without-state", ("status", "{gid}"), 1, ("corrupt goal", "state"), setup=goal_without_state),
    Case("status-goal-unknown-state", ("status", "{gid}"), 1, ("corrupt goal", "state"), setup=goal_bad_state),
    Case(
        "status-goal-key-wrong-type",
        ("status", "{gid}"),
        1,
        ("corrupt goal", "strgoal", "WRONGTYPE"),
        setup=goal_key_wrong_type,
    ),
    Case("status-corrupt-task", ("status", "{gid}"), 1, ("corrupt task", "t1"), setup=corrupt_task),
    Case("status-corrupt-plan", ("status", "{gid}"), 1, ("corrupt plan", "{gid}"), setup=corrupt_plan),
    Case(
        "status-corrupt-approval-request",
        ("status", "{gid}"),
        1,
        ("corrupt approval request", "{gid}"),
        setup=corrupt_approval,
    ),
    # -- wait -----------------------------------------------------------------------------------
    Case("wait-nan-timeout", ("wait", "g1", "--timeout", "nan"), 2, ("--timeout", "nan")),
    Case("wait-inf-timeout", ("wait", "g1", "--timeout", "inf"), 2, ("--timeout", "inf")),
    Case("wait-negative-timeout", ("wait", "g1", "--timeout", "-1"), 2, ("--timeout", "-1")),
    Case("wait-word-timeout", ("wait", "g1", "--timeout", "soon"), 2, ("--timeout", "soon")),
    Case("wait-unknown-goal", ("wait", "nosuchgoal", "--timeout", "5"), 1, ("nosuchgoal", "not found")),
    Case(
        "wait-times-out-and-warns-no-worker",
        ("wait", "{gid}", "--timeout", "0.5"),
        4,
        ("still submitted", "no live planner", "taskloom worker all"),
        setup=goal(),
    ),
    Case("wait-json-timeout", ("wait", "{gid}", "--timeout", "0", "--json"), 4, ('"timeout": true',), setup=goal()),
    Case(
        "wait-succeeded-answer-with-brackets",
        ("wait", "{gid}"),
        0,
        stdout_has=("[A100] ok [/b]",),
        setup=succeeded("[A100] ok [/b]"),
    ),
    Case(
        "wait-failed-goal-exits-3",
        ("wait", "{gid}"),
        3,
        ("[reason]",),
        setup=goal(state="failed", reason="[reason] it broke"),
    ),
    Case("wait-corrupt-goal", ("wait", "{gid}", "--timeout", "5"), 1, ("corrupt goal",), setup=corrupt_goal_record),
    # -- events ---------------------------------------------------------------------------------
    Case("events-after-garbage", ("events", "g1", "--after", "garbage"), 2, ("--after", "garbage")),
    Case("events-after-three-parts", ("events", "g1", "--after", "1-2-3"), 2, ("--after", "1-2-3")),
    Case("events-unknown-goal", ("events", "nosuchgoal"), 1, ("nosuchgoal", "not found")),
    Case(
        "events-keep-task-ids-and-brackets",
        ("events", "{gid}"),
        0,
        stdout_has=("[check-a100]", "state=[red]ready", "goal.submitted"),
        setup=goal_with_events,
    ),
    Case(
        "events-after-valid-position",
        ("events", "{gid}", "--after", "0-0", "--json"),
        0,
        stdout_has=("goal.submitted",),
        setup=goal(),
    ),
    Case("events-corrupt-entry", ("events", "{gid}"), 1, ("corrupt event", "{gid}"), setup=corrupt_event),
    Case(
        "events-stream-wrong-type",
        ("events", "{gid}"),
        1,
        ("corrupt event stream", "{gid}"),
        setup=events_key_wrong_type,
    ),
    Case(
        "events-follow-ended-goal",
        ("events", "{gid}", "--follow"),
        0,
        stdout_has=("goal.submitted",),
        setup=goal(state="cancelled"),
    ),
    # -- watch ----------------------------------------------------------------------------------
    Case("watch-negative-timeout", ("watch", "g1", "--timeout", "-1"), 2, ("--timeout",)),
    Case("watch-nan-timeout", ("watch", "g1", "--timeout", "nan"), 2, ("--timeout", "nan")),
    Case("watch-times-out", ("watch", "{gid}", "--timeout", "1"), 4, ("still submitted", "no live"), setup=goal()),
    Case("watch-unknown-goal", ("watch", "nosuchgoal", "--timeout", "5"), 1, ("nosuchgoal", "not found")),
    Case(
        "watch-ended-goal",
        ("watch", "{gid}", "--timeout", "10"),
        0,
        stdout_has=("succeeded", "[x]"),
        setup=succeeded("[x] done"),
    ),
    Case(
        "watch-task-ids-kept",
        ("watch", "{gid}", "--timeout", "1"),
        4,
        ("still submitted",),
        stdout_has=("[check-a100]",),
        setup=goal_with_events,
    ),
    # -- cancel, ledger, dag ------------------------------------------------------------------------
    Case("cancel-unknown-goal", ("cancel", "nosuchgoal"), 1, ("nosuchgoal", "not found")),
    Case("cancel-twice", ("cancel", "{gid}"), 3, ("already ended", "cancelled"), setup=goal(state="cancelled")),
    Case("cancel-ended-goal", ("cancel", "{gid}"), 3, ("already ended", "succeeded"), setup=succeeded("done")),
    Case("ledger-unknown-goal", ("ledger", "nosuchgoal"), 1, ("nosuchgoal", "not found")),
    Case("ledger-of-a-goal", ("ledger", "{gid}"), 0, stdout_has=("budget", "200,000"), setup=goal()),
    Case("ledger-corrupt", ("ledger", "{gid}"), 1, ("corrupt ledger", "{gid}", "lots"), setup=corrupt_ledger),
    Case("dag-bad-format", ("dag", "g1", "--format", "svg"), 2, ("--format", "svg", "mermaid")),
    Case("dag-unknown-goal", ("dag", "nosuchgoal"), 1, ("nosuchgoal", "not found")),
    Case("dag-goal-without-plan", ("dag", "{gid}"), 1, ("plan", "not found"), setup=goal()),
    Case("dag-version-not-a-number", ("dag", "g1", "--version", "two"), 2, ("--version", "two")),
    Case("dag-corrupt-plan", ("dag", "{gid}"), 1, ("corrupt plan",), setup=corrupt_plan),
    # -- approve, deny ------------------------------------------------------------------------------
    Case("approve-unknown-goal", ("approve", "nosuchgoal", "toolu_1"), 1, ("nosuchgoal", "not found")),
    Case(
        "approve-unknown-call", ("approve", "{gid}", "toolu_nope"), 1, ("approval request", "toolu_nope"), setup=goal()
    ),
    Case(
        "approve-pending-call",
        ("approve", "{gid}", "toolu_refund1"),
        0,
        stdout_has=("toolu_refund1 approved",),
        setup=awaiting_approval,
    ),
    Case(
        "approve-twice", ("approve", "{gid}", "toolu_refund1"), 0, stdout_has=("already approved",), setup=approved_once
    ),
    Case(
        "approve-after-deny",
        ("approve", "{gid}", "toolu_refund1", "--json"),
        0,
        stdout_has=('"first_decision": false', '"decision": "denied"'),
        setup=denied_once,
    ),
    Case(
        "deny-twice",
        ("deny", "{gid}", "toolu_refund1", "--reason", "no"),
        0,
        stdout_has=("already denied",),
        setup=denied_once,
    ),
    # -- run and demo ---------------------------------------------------------------------------------
    Case("run-empty-goal", ("run", ""), 2, ("text",)),
    Case("run-negative-budget", ("run", "hi", "--budget", "-1"), 2, ("budget_tokens",)),
    Case("run-negative-timeout", ("run", "hi", "--timeout", "-1"), 2, ("--timeout",)),
    Case("run-nan-timeout", ("run", "hi", "--timeout", "nan"), 2, ("--timeout", "nan")),
    Case(
        "run-no-worker-warns-and-times-out",
        ("run", "hi", "--timeout", "2"),
        4,
        ("no live planner", "taskloom worker all", "still submitted"),
    ),
    Case(
        "run-local-markup-goal",
        ("run", MARKUP, "--local", "--timeout", "60"),
        0,
        stdout_has=(MARKUP, "succeeded"),
        bound=60,
    ),
    Case(
        "run-local-from-stdin-json",
        ("run", "-", "--local", "--json", "--timeout", "60"),
        0,
        stdout_has=('"state": "succeeded"',),
        stdin="Say hello [x]",
        bound=60,
    ),
    Case(
        "run-local-escape-sequences-stripped",
        ("run", ESCAPES, "--local", "--timeout", "60"),
        0,
        stdout_has=("plain [31mred",),
        absent=("\x1b", "\x07"),
        bound=90,
    ),
    Case("demo-negative-timeout", ("demo", "--timeout", "-1"), 2, ("--timeout",)),
    Case("demo-times-out-and-stops-its-server", ("demo", "--timeout", "0"), 4, ("still",), embedded=True, bound=60),
    # -- signals: a clean stop, and no redis-server left behind ------------------------------------------
    Case("sigterm-wait-embedded", ("wait", "{gid}"), 143, embedded=True, setup=embedded_goal, term_after=1),
    Case(
        "sigint-wait-embedded",
        ("wait", "{gid}"),
        130,
        embedded=True,
        setup=embedded_goal,
        term_after=1,
        term_signal=signal.SIGINT,
    ),
    Case("sigterm-watch-embedded", ("watch", "{gid}"), 143, embedded=True, setup=embedded_goal, term_after=1),
    Case(
        "sigterm-events-follow-embedded",
        ("events", "{gid}", "--follow"),
        143,
        embedded=True,
        setup=embedded_goal,
        term_after=1,
    ),
    Case("sigterm-run-embedded", ("run", "waiting goal"), 143, embedded=True, term_after=1),
    Case("sigterm-worker-embedded", ("worker", "all"), 0, embedded=True, term_after=2),
    Case(
        "sigterm-run-local-embedded",  # its planner hangs on a model that never answers
        ("run", "a goal", "--local"),
        143,
        embedded=True,
        term_after=3,
        bound=60,
        setup=port_in_use,
        env=(
            ("TASKLOOM_MODEL", "claude-test"),
            ("ANTHROPIC_API_KEY", "sk-ant-test"),
            ("ANTHROPIC_BASE_URL", "http://127.0.0.1:{port}"),
            ("TASKLOOM_SHUTDOWN_GRACE", "1"),
        ),
    ),
    # -- settings: unknown variables and empty values ------------------------------------------------------
    Case(
        "unknown-variable-suggests",
        ("status", "nosuch"),
        1,
        ("nosuch", "TASKLOOM_POLL_DELEY", "TASKLOOM_POLL_DELAY"),
        env=env(poll_deley="1"),
    ),
    Case(
        "unknown-variable-no-suggestion",
        ("status", "nosuch"),
        1,
        ("nosuch", "TASKLOOM_QQQQQQQQQQ", "not a taskloom setting"),
        env=(("TASKLOOM_QQQQQQQQQQ", "1"),),
    ),
    Case(
        "two-bad-variables-one-line",
        ("status", "g1"),
        2,
        ("TASKLOOM_POLL_DELAY", "TASKLOOM_MAX_STEPS"),
        env=(("TASKLOOM_POLL_DELAY", "x"), ("TASKLOOM_MAX_STEPS", "0")),
    ),
    Case("empty-prices-is-unset", ("status", "nosuch"), 1, ("not found",), env=(("TASKLOOM_PRICES", ""),)),
    Case("empty-model-is-demo", ("worker", "all", "--burst"), 0, env=(("TASKLOOM_MODEL", ""),)),
    *_settings_cases(),
    *_number_cases(),
    # -- malformed jobs in Redis: logged naming the field, dropped, the worker goes on --------------------
    Case(
        "job-missing-goal-id",
        ("worker", "planner", "--burst"),
        0,
        ("job.invalid_payload", "goal_id"),
        setup=enqueue("plan", {}, "planner"),
    ),
    Case(
        "job-payload-not-an-object",
        ("worker", "critic", "--burst"),
        0,
        ("job.invalid_payload",),
        setup=enqueue("review", "just a string", "critic"),
    ),
    Case(
        "job-bad-attempt",
        ("worker", "executor", "--burst"),
        0,
        ("job.invalid_payload", "attempt"),
        setup=enqueue("execute", {"goal_id": "g1", "task_id": "t1", "attempt": 0}, "executor"),
    ),
    Case(
        "job-huge-payload-log-capped",
        ("worker", "planner", "--burst"),
        0,
        ("job.invalid_payload", "more chars"),
        setup=enqueue("plan", {"goal_id": "g" * 1_000_000}, "planner"),
    ),
    Case(
        "job-unknown-function",
        ("worker", "planner", "--burst"),
        0,
        ("nosuchfunction",),
        setup=enqueue("nosuchfunction", {}, "planner"),
    ),
    Case(
        "job-for-unknown-goal",
        ("worker", "planner", "--burst"),
        0,
        ("job.failed", "nosuchgoal", "not found"),
        setup=enqueue("plan", {"goal_id": "nosuchgoal"}, "planner"),
    ),
    Case(
        "job-for-corrupt-goal",
        ("worker", "planner", "--burst"),
        0,
        ("job.failed", "corrupt goal"),
        setup=lambda c: _enqueued_for(corrupt_goal_record(c), c),
    ),
    # -- client misuse (the library, on the same settings) --------------------------------------------------
    Case("client-empty-goal", (), 2, ("ValidationError", "text"), python=client_script("await c.submit({'text': ''})")),
    Case("client-goal-not-a-mapping", (), 2, ("ValidationError",), python=client_script("await c.submit(42)")),
    Case("client-bad-goal-id", (), 2, ("id", "bad id"), python=client_script("await c.submit('hi', goal_id='bad id')")),
    Case(
        "client-unknown-field",
        (),
        2,
        ("ValidationError", "colour"),
        python=client_script("await c.submit({'text': 'hi', 'colour': 'red'})"),
    ),
    Case(
        "client-wait-unknown-goal",
        (),
        2,
        ("NotFound", "nosuchgoal"),
        python=client_script("await c.wait('nosuchgoal', timeout=5)"),
    ),
    Case(
        "client-wait-nan-timeout",
        (),
        2,
        ("ValueError", "timeout", "nan"),
        python=client_script("gid = await c.submit('hi')\nawait c.wait(gid, timeout=float('nan'))"),
    ),
    Case(
        "client-events-bad-after",
        (),
        2,
        ("ValueError", "after", "garbage"),
        python=client_script("gid = await c.submit('hi')\n[e async for e in c.events(gid, after='garbage')]"),
    ),
    Case(
        "client-decide-unknown-call",
        (),
        2,
        ("NotFound", "toolu_x"),
        python=client_script("gid = await c.submit('hi')\nawait c.decide(gid, 'toolu_x', True)"),
    ),
    Case(
        "client-bad-setting",
        (),
        2,
        ("SettingsError", "TASKLOOM_POLL_DELAY"),
        python=client_script("pass"),
        env=(("TASKLOOM_POLL_DELAY", "x"),),
    ),
    Case(
        "client-embedded-leaves-no-server",
        (),
        0,
        embedded=True,
        python=CLIENT + "async def main():\n    async with Client.from_settings() as c:\n"
        "        print(await c.submit('hi'))\nasyncio.run(main())\n",
    ),
]


def _enqueued_for(seeded: dict[str, str], c: Ctx) -> dict[str, str]:
    c.enqueue("plan", {"goal_id": seeded["gid"]}, "planner")
    return seeded


def _submit_with_id(c: Ctx, gid: str, text: str) -> str:
    async def go() -> str:
        pool = await create_pool(redis_settings(c.redis_url))
        try:
            return await Client(pool, c.keys, 200_000).submit({"text": text}, goal_id=gid)
        finally:
            await pool.aclose()

    return asyncio.run(go())


def command(case: Case) -> list[str]:
    if case.python is not None:
        return [sys.executable, "-P", "-c", case.python]
    # -P: the current directory is not put on sys.path by Python itself, as with the installed
    # `taskloom` script (the CLI adds it, as uvicorn does); the worktree comes from PYTHONPATH.
    return [sys.executable, "-P", "-m", "taskloom", *case.args]
