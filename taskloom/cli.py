"""The `taskloom` command line.

Exit codes (README "Exit codes"): 0 ok (for `wait`/`watch`/`run`: the goal succeeded); 1 unknown goal,
a failure reaching Redis, a corrupt record, an unexpected error; 2 invalid input or configuration (one
line naming the argument, option or variable); 3 the goal ended without succeeding; 4 a `--timeout`
passed; 130/143 interrupted by SIGINT/SIGTERM.

Every error leaves through `_fail` (one `error: ...` line on stderr); `main` turns usage errors and
unexpected exceptions into that same line, with a traceback only under `--debug`/`TASKLOOM_DEBUG=1`.
Text that users or models wrote is printed with `show`/`line` (`taskloom.terminal`), never as markup.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import os
import re
import signal
import sys
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Column, Table

try:  # typer >= 0.22 vendors click; its usage errors are these classes, not the `click` package's
    from typer._click import exceptions as cli_errors
except ImportError:  # pragma: no cover - older typer on the real click
    from click import exceptions as cli_errors  # type: ignore[no-redef]

from bus.approvals import AlreadyDecided, ApprovalDecision, ApprovalRequest
from bus.client import Client, GoalStatus, WaitTimeout
from bus.connection import EmbeddedRedisError, RedisRefused, RedisTimeout, RedisUnavailable
from bus.keys import ROLES
from bus.ledger import LedgerNotFound
from bus.live import LiveFrame, LiveTexts
from bus.schemas import GOAL_ID_PATTERN, Event, Goal, GoalRecord, GoalState
from bus.store import AlreadyExists, CorruptRecord, IllegalTransition, NotFound
from bus.tenants import TenantView
from bus.tracing import trace_id_of
from executor.registry import ToolLoadError
from llm.errors import ModelConfigError
from llm.forced import validation_problems

from . import eventloop
from .settings import Settings, SettingsError, keys_for, load_settings, unknown_variables
from .terminal import clean, line

# The workers (arq's worker, every role's handlers), logging and metrics are imported by the commands
# that use them: every `taskloom` call pays for what it imports at start-up.

app = typer.Typer(
    name="taskloom",
    help="Run AI agents as a fleet of workers: planner, executors and critic over Redis queues.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # main() turns unexpected errors into one line (see _unexpected)
)
out = Console()
err = Console(stderr=True)

T = TypeVar("T")

EXIT_NOT_FOUND = 1
EXIT_INVALID = 2
EXIT_NOT_SUCCEEDED = 3
EXIT_TIMEOUT = 4

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


# -- option checks: a bad value is a usage error naming the option (exit 2, one line) -------------


def _seconds(value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise typer.BadParameter(f"expected a finite number of seconds >= 0, got {value:g}")
    return value


def _log_level(value: str) -> str:
    if value.upper() not in LOG_LEVELS:
        raise typer.BadParameter(f"expected one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return value.upper()


def _position(value: str | None) -> str | None:
    if value is not None and not re.fullmatch(r"\d+(-\d+)?", value):
        raise typer.BadParameter(f"expected a position like 1718000000000-0 (from a previous read), got {value!r}")
    return value


def _goal_id_option(value: str | None) -> str | None:
    if value is not None and not re.fullmatch(GOAL_ID_PATTERN, value):
        raise typer.BadParameter(f"expected 1-64 letters, digits, '_' or '-', got {value!r}")
    return value


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
TimeoutOpt = Annotated[
    float | None, typer.Option("--timeout", help="seconds; default: no limit", callback=_seconds)
]
GoalText = Annotated[
    str, typer.Argument(help="the goal in natural language; '-' reads it from stdin, '@FILE' from a file")
]


def _goal_text(value: str) -> str:
    """The goal argument: text, '-' for stdin, or '@path' for a file (as curl and kubectl read input)."""
    if value == "-":
        return sys.stdin.read()
    if value.startswith("@") and len(value) > 1:
        path = value[1:]
        try:
            with open(path, encoding="utf-8") as fh:
                return fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            _fail(EXIT_INVALID, f"GOAL: cannot read {path!r}: {reason}")
    return value


def show(*parts: str | tuple[str, str], console: Console | None = None) -> None:
    """Print `line(*parts)`; long lines are not re-wrapped (answers are copied and piped)."""
    (console or out).print(line(*parts), soft_wrap=True, highlight=False)


def _fail(code: int, message: str) -> NoReturn:
    """The one error exit: `error: <message>` on one stderr line, then exit `code`."""
    one_line = " ".join(clean(message).split("\n"))
    err.print(line(("error:", "bold red"), " ", one_line), soft_wrap=True, highlight=False)
    raise typer.Exit(code)


def _warn(message: str) -> None:
    err.print(line(("warning:", "bold yellow"), " ", message), soft_wrap=True, highlight=False)


_warned_variables = False


def _settings() -> Settings:
    """The settings, or exit 2 naming each bad variable; warns once about unknown TASKLOOM_* variables."""
    global _warned_variables
    if not _warned_variables:
        _warned_variables = True
        for warning in unknown_variables():
            _warn(warning)
    try:
        return load_settings()
    except SettingsError as exc:
        _fail(EXIT_INVALID, str(exc))


def _guarded(fn: Callable[[], T]) -> T:
    """Run `fn`, turning the errors every command can meet into the one error exit."""
    try:
        return fn()
    except WaitTimeout:
        raise  # a TimeoutError, hence an OSError: not a connection problem; the caller reports it
    except NotFound as exc:
        _fail(EXIT_NOT_FOUND, str(exc))
    except CorruptRecord as exc:
        _fail(EXIT_NOT_FOUND, str(exc))
    except AlreadyExists as exc:
        _fail(EXIT_INVALID, f"--id: {exc} with a different goal; choose another id or submit the same goal")
    except (ModelConfigError, ToolLoadError, SettingsError) as exc:  # SettingsError: e.g. the metrics port
        _fail(EXIT_INVALID, str(exc))
    except (RedisUnavailable, RedisTimeout, EmbeddedRedisError, OSError) as exc:
        _fail(EXIT_NOT_FOUND, f"cannot reach Redis: {exc}")
    except RedisRefused as exc:
        _fail(EXIT_NOT_FOUND, f"Redis refused a command (a key holds data of another kind?): {exc}")


def _with_client(fn: Callable[[Client], Awaitable[T]], settings: Settings | None = None) -> T:
    settings = settings or _settings()

    async def go() -> T:
        from . import tracing  # imported by the commands that use it, like the workers

        tracing.configure(settings)  # `submit` opens the goal's root span, `resume` one in its trace
        try:
            async with Client.open(
                settings.redis_url, settings.home, keys_for(settings), settings.default_budget_tokens
            ) as client:
                return await fn(client)
        finally:
            tracing.flush()

    return _guarded(lambda: _arun(go()))


def _validation_message(exc: ValidationError) -> str:
    return "invalid goal: " + "; ".join(validation_problems(exc))


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


# -- commands ---------------------------------------------------------------------------------


@app.command()
def worker(
    role: Annotated[str, typer.Argument(help="planner | executor | critic | all")],
    burst: Annotated[bool, typer.Option(help="exit once the queues are empty")] = False,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING, ERROR", callback=_log_level)] = "INFO",
) -> None:
    """Run a worker process for one role, or all three roles in one process."""
    roles = list(ROLES) if role == "all" else [role]
    if any(r not in ROLES for r in roles):
        _fail(EXIT_INVALID, f"unknown role {role!r}; expected one of: {', '.join(ROLES)}, all")
    settings = _settings()
    from .logs import configure_logging
    from .workers import run_workers

    configure_logging(log_level)
    _guarded(lambda: _arun(run_workers(roles, settings, burst=burst)))


@app.command()
def health(
    role: Annotated[
        list[str] | None, typer.Option("--role", help="planner | executor | critic | all (repeatable; default all)")
    ] = None,
    local: Annotated[bool, typer.Option("--local", help="only workers on this host (container probes)")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait for Redis (> 0)", callback=_seconds)] = 5.0,
    as_json: JsonOpt = False,
) -> None:
    """Exit 0 if Redis answers and each role has a worker with a fresh heartbeat; else 1 with the reason."""
    import socket

    from bus.connection import EmbeddedRedis, plain_client
    from bus.connection import close as close_client

    from . import health as checks

    wanted = [r for name in (role or ["all"]) for r in (ROLES if name == "all" else [name])]
    if any(r not in ROLES for r in wanted):
        _fail(EXIT_INVALID, f"--role: expected one of {', '.join(ROLES)}, all; got {', '.join(role or [])}")
    if timeout <= 0:
        _fail(EXIT_INVALID, f"--timeout: expected a number of seconds > 0, got {timeout:g}")
    settings = _settings()
    # With no TASKLOOM_REDIS_URL, look for the embedded server without starting one: a health check
    # that started a fresh, empty Redis would only hide the problem.
    url = settings.redis_url or EmbeddedRedis(settings.home).url

    async def go() -> checks.Report:
        redis = plain_client(url, timeout)
        try:
            return await asyncio.wait_for(
                checks.check(redis, keys_for(settings), wanted, socket.gethostname() if local else None), timeout
            )
        except TimeoutError:
            return checks.Report(redis=False, reasons=[f"cannot reach Redis: no answer within {timeout:g} s"])
        finally:
            await close_client(redis)

    report = _arun(go())
    if as_json:
        _print_json(report.as_json())
    elif report.ok:
        live = "; ".join(f"{r}: {sum(b.alive for b in beats)} live" for r, beats in report.roles.items())
        node = report.node
        where = ""
        if node is not None:
            where = f" (master {node.address}{', named by Sentinel' if node.via_sentinel else ''})"
        show(f"ok: Redis answers{where}; {live}")
    else:  # one line, never wrapped: probes and their logs read it
        show(("unhealthy:", "bold red"), " ", "; ".join(report.reasons), console=err)
    raise typer.Exit(0 if report.ok else EXIT_NOT_FOUND)


ReviewOpt = Annotated[
    str | None,
    typer.Option("--review", help="model review: every_task (default), final_only or none"),
]
CheckOpt = Annotated[
    str | None,
    typer.Option(
        "--check",
        help='machine check of the answer, JSON: {"tools_called": [...], "pattern": "...", "json_schema": {...}}',
    ),
]


ModelOpt = Annotated[
    str | None,
    typer.Option("--model", help="a model alias of TASKLOOM_MODELS_FILE for every role of this goal"),
]


def _model_choice(raw: dict[str, Any], model: str | None, settings: Settings) -> None:
    """--model must name an alias of the models file (the workers read the same file)."""
    if model is None:
        return
    aliases = settings.catalog().aliases
    if model not in aliases:
        known = ", ".join(sorted(aliases)) if aliases else "none: set TASKLOOM_MODELS_FILE"
        _fail(EXIT_INVALID, f"--model: {model!r} is no model alias of the models file (aliases: {known})")
    raw["model"] = model


def _review_and_check(raw: dict[str, Any], review: str | None, check: str | None) -> None:
    """--review and --check into the goal (validated with it); a --check that is not JSON exits 2."""
    if review is not None:
        raw["review"] = review
    if check is not None:
        try:
            raw["check"] = json.loads(check)
        except ValueError as exc:
            _fail(EXIT_INVALID, f"invalid goal: --check: expected a JSON object, got {check!r} ({exc})")


@app.command()
def submit(
    text: GoalText,
    dod: Annotated[str, typer.Option("--dod", help="definition of done")] = "",
    budget: Annotated[int | None, typer.Option(help="token budget (default: TASKLOOM_DEFAULT_BUDGET_TOKENS)")] = None,
    budget_usd: Annotated[float | None, typer.Option("--budget-usd", help="dollar budget (cache-aware prices)")] = None,
    tenant: Annotated[str | None, typer.Option(help="tenant whose pool it spends from (default: default)")] = None,
    tool: Annotated[list[str] | None, typer.Option("--tool", help="allowed tool (repeatable; default all)")] = None,
    meta: Annotated[list[str] | None, typer.Option("--meta", help="metadata KEY=VALUE (repeatable)")] = None,
    deadline: Annotated[str | None, typer.Option(help="ISO 8601 time with zone, e.g. 2026-10-13T18:00Z")] = None,
    review: ReviewOpt = None,
    check: CheckOpt = None,
    model: ModelOpt = None,
    goal_id: Annotated[
        str | None,
        typer.Option("--id", help="your own goal id (makes re-submitting safe)", callback=_goal_id_option),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Submit a goal; prints its id."""
    text = _goal_text(text)
    metadata: dict[str, str] = {}
    for item in meta or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            _fail(EXIT_INVALID, f"invalid goal: metadata: expected KEY=VALUE, got {item!r}")
        metadata[key] = value
    raw: dict[str, Any] = {"text": text, "definition_of_done": dod, "metadata": metadata}
    if budget is not None:
        raw["budget_tokens"] = budget
    if budget_usd is not None:
        raw["budget_usd"] = budget_usd
    if tenant is not None:
        raw["tenant"] = tenant
    if tool:
        raw["allowed_tools"] = tool
    if deadline is not None:
        try:
            raw["deadline"] = datetime.fromisoformat(deadline.replace("Z", "+00:00"))
        except ValueError:
            _fail(EXIT_INVALID, f"invalid goal: deadline: expected an ISO 8601 time, got {deadline!r}")
    _review_and_check(raw, review, check)
    settings = _settings()
    _model_choice(raw, model, settings)
    # Validate before touching Redis, so an invalid goal stores nothing and needs no server.
    try:
        goal = Goal.model_validate(raw)
    except ValidationError as exc:
        _fail(EXIT_INVALID, _validation_message(exc))
    if tool:
        _check_tools(tool, settings)
    gid = _with_client(lambda c: c.submit(goal, goal_id=goal_id), settings)
    if as_json:
        _print_json({"goal_id": gid})
    else:
        show(gid)


def _check_tools(names: list[str], settings: Settings) -> None:
    """--tool names must be tools the workers load (the same TASKLOOM_TOOLS); the planner checks too,
    so a machine that cannot import the toolkits here skips this early check."""
    from executor.demo_tools import support
    from executor.registry import ToolRegistry, load_toolkits

    if settings.mcp_config:
        return  # MCP tools are known only once their servers answer: the planner checks them
    try:
        kits = load_toolkits(settings.tools, default=[support] if settings.model == "demo" else [])
        known = ToolRegistry(kits).names()
    except ToolLoadError:
        return
    unknown = [n for n in names if n not in known]
    if unknown:
        listed = ", ".join(map(repr, unknown))
        _fail(EXIT_INVALID, f"--tool: unknown tool {listed}; expected one of: {', '.join(known) or '(none loaded)'}")


def _status_json(
    s: GoalStatus, approvals: dict[str, ApprovalRequest], served: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        **s.goal.model_dump(mode="json"),
        "plan": s.plan.model_dump(mode="json") if s.plan else None,
        "tasks": [t.model_dump(mode="json") for t in s.tasks],
        "awaiting_approval": [{"call_id": cid, **req.model_dump(mode="json")} for cid, req in approvals.items()],
        "models": served or {},
    }


@app.command()
def status(goal_id: str, as_json: JsonOpt = False) -> None:
    """Show a goal: its state, answer, plan version, every task's state, the model each role's calls
    went to, and the calls awaiting approval."""

    async def go(c: Client) -> tuple[GoalStatus, dict[str, ApprovalRequest], dict[str, str]]:
        s, approvals = await c.status(goal_id), await c.approvals(goal_id)
        try:
            served = (await c.ledger.snapshot(goal_id)).served_by
        except LedgerNotFound:
            served = {}
        return s, approvals, served

    s, approvals, served = _with_client(go)
    if as_json:
        _print_json(_status_json(s, approvals, served))
        return
    g = s.goal
    show((g.id, "bold"), "  ", (g.state.value, "cyan"), f"  budget {g.budget_tokens:,} tokens  plan v{g.plan_version}")
    show("goal: ", g.goal.text)
    show("review: ", g.goal.review + ("  (machine check)" if g.goal.check is not None else ""))
    if g.goal.model or served:
        roles = "  ".join(f"{role} {served[role]}" for role in ROLES if role in served)
        show("models: ", (f"goal asks for {g.goal.model}  " if g.goal.model else "") + (roles or "no call yet"))
    if g.reason:
        show("reason: ", g.reason)
    if trace_id_of(g.traceparent):
        show("trace: ", trace_id_of(g.traceparent) or "")
    if s.tasks:
        table = Table("task", "state", "attempt", "reason")
        for t in s.tasks:
            table.add_row(line(t.task_id), t.state.value, str(t.attempt), line(t.reason or ""))
        out.print(table)
    for call_id, req in approvals.items():
        args = json.dumps(req.input, default=str)
        show(
            ("awaiting approval: ", "bold magenta"),
            f"{call_id}  {req.tool}({args[:200]})  task {req.task_id}",
            f"  -> taskloom approve {g.id} {call_id}  |  taskloom deny {g.id} {call_id} --reason ...",
        )
        for e in req.earlier:  # what this task's earlier calls of the tool already did
            before = json.dumps(e.input, default=str)[:120]
            result = " ".join(e.result.split())[:200]
            show(f"    earlier, attempt {e.attempt}: {req.tool}({before}) -> {e.outcome}: {result}")
    if g.answer:
        show("\n", ("answer", "bold"), "\n", g.answer)


def _goal_exit(goal: GoalRecord) -> int:
    return 0 if goal.state == GoalState.SUCCEEDED else EXIT_NOT_SUCCEEDED


@app.command()
def wait(
    goal_id: str,
    timeout: TimeoutOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Wait until a goal ends. Exit 0 if it succeeded, 3 if it ended otherwise, 4 on timeout."""

    async def go(c: Client) -> GoalRecord:
        await _warn_if_no_workers(c, goal_id)
        return await c.wait(goal_id, timeout)

    try:
        goal = _with_client(go)
    except WaitTimeout as exc:
        if as_json:
            _print_json({"goal_id": goal_id, "state": exc.state, "timeout": True})
        _fail(EXIT_TIMEOUT, str(exc))
    if as_json:
        _print_json(goal.model_dump(mode="json"))
    else:
        show(f"{goal.id} {goal.state.value}")
        if goal.answer:
            show(goal.answer)
        elif goal.reason:
            show(goal.reason)
    raise typer.Exit(_goal_exit(goal))


def _event_line(e: Event) -> str:
    task = f" [{e.task_id}]" if e.task_id else ""
    data = " ".join(f"{k}={v}" for k, v in e.data.items())
    return f"{e.at:%H:%M:%S.%f}"[:-3] + f"  {e.type}{task}  {data}"


@app.command()
def events(
    goal_id: str,
    after: Annotated[
        str | None, typer.Option(help="resume after this position (from a previous read)", callback=_position)
    ] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep reading until the goal ends")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Print a goal's events (each with its position, to resume from)."""

    async def go(c: Client) -> None:
        async for e in c.events(goal_id, after=after, follow=follow):
            if as_json:
                _print_json(e.model_dump(mode="json"))
            else:
                show(f"{e.position}  {_event_line(e)}")

    _with_client(go)


StreamOpt = Annotated[
    bool, typer.Option("--stream/--no-stream", help="print the models' words as they are written (live text)")
]


class _Writer:
    """`watch`'s printing of live text between event lines: a header when another task's call
    starts writing, its words as they come, a marker when a step is written again."""

    def __init__(self) -> None:
        self.texts = LiveTexts()
        self.current: tuple[str, int, int] | None = None  # (task, attempt, step) being printed
        self.printed = 0  # characters of its text printed
        self.mid_line = False

    def frame(self, frame: LiveFrame) -> None:
        held = self.texts.apply(frame)
        if frame.type == "restart":
            self.end_line()
            show((f"[{frame.task} restarted: attempt {frame.attempt} step {frame.step} is written again]", "yellow"))
            self.current = None
            return
        key = (frame.task, held.attempt, held.step)
        if key != self.current or len(held.text) < self.printed:
            self.end_line()
            show((f"{frame.task} (attempt {held.attempt}, step {held.step}) writes:", "dim"))
            self.current, self.printed = key, 0
            if held.gap:
                out.print("…", end="", highlight=False)
        piece = held.text[self.printed :]
        out.print(clean(piece), end="", markup=False, highlight=False, emoji=False, soft_wrap=True)
        self.printed = len(held.text)
        self.mid_line = not held.text.endswith("\n")

    def end_line(self) -> None:
        if self.mid_line:
            out.print()
            self.mid_line = False


@app.command()
def watch(goal_id: str, timeout: TimeoutOpt = None, as_json: JsonOpt = False, stream: StreamOpt = True) -> None:
    """Follow a goal live until it ends, with the models' words as they are written (`--no-stream`:
    events only; `--json`: events and live-text frames, one JSON object a line); exit code as for
    `wait` (4: --timeout passed first)."""
    writer = _Writer()

    async def go(c: Client) -> GoalRecord:
        await _warn_if_no_workers(c, goal_id)
        try:
            async with asyncio.timeout(timeout):
                items = c.follow(goal_id) if stream else c.events(goal_id, follow=True)
                async for e in items:
                    if as_json:
                        _print_json(e.model_dump(mode="json"))
                    elif isinstance(e, LiveFrame):
                        writer.frame(e)
                    else:
                        writer.end_line()
                        show(_event_line(e))
        except TimeoutError:
            goal = await c.get(goal_id)
            raise WaitTimeout(goal_id, goal.state.value, timeout or 0) from None
        return await c.get(goal_id)

    try:
        goal = _with_client(go)
    except WaitTimeout as exc:
        _fail(EXIT_TIMEOUT, str(exc))
    if not as_json:
        writer.end_line()
        show((goal.state.value, "bold"))
        if goal.answer:
            show(goal.answer)
    raise typer.Exit(_goal_exit(goal))


async def _warn_if_no_workers(c: Client, goal_id: str) -> None:
    """A goal that has not ended, and a role without any live worker: say so (once) rather than wait mutely."""
    from . import health

    if (await c.get(goal_id)).terminal:
        return
    missing = await health.missing_roles(c.redis, c.keys, ROLES)
    if missing:
        _warn(health.no_worker_message(missing))


@app.command()
def cancel(
    goal_id: str,
    reason: Annotated[str, typer.Option(help="recorded on the goal and its tasks")] = "cancelled by request",
    as_json: JsonOpt = False,
) -> None:
    """Cancel a goal: stop dispatch and cancel its unfinished tasks. A goal that already ended,
    cancelled included, exits 3 (as the HTTP API answers 409)."""
    try:
        changed = _with_client(lambda c: c.cancel(goal_id, reason))
    except IllegalTransition as exc:
        _fail(EXIT_NOT_SUCCEEDED, f"goal {goal_id} already ended ({exc.current}); nothing to cancel")
    if not changed:
        _fail(EXIT_NOT_SUCCEEDED, f"goal {goal_id} already ended (cancelled); nothing to cancel")
    if as_json:
        _print_json({"goal_id": goal_id, "cancelled": True, "changed": changed})
    else:
        show(f"{goal_id} cancelled")


@app.command()
def resume(
    goal_id: str,
    budget: Annotated[int | None, typer.Option(min=1, help="new token budget (must exceed what was spent)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Restart a failed or budget_exhausted goal: accepted tasks are kept, the rest run again."""
    try:
        goal = _with_client(lambda c: c.resume(goal_id, budget))
    except IllegalTransition as exc:
        _fail(EXIT_NOT_SUCCEEDED, f"goal {goal_id} {exc.current}; only failed or budget_exhausted goals resume")
    except ValueError as exc:
        _fail(EXIT_INVALID, f"--budget: {exc}")
    if as_json:
        _print_json({"goal_id": goal_id, "state": goal.state.value, "resumes": goal.resumes})
    else:
        show(f"{goal_id} resumed: {goal.state.value}")


@app.command()
def ledger(
    goal_id: Annotated[str | None, typer.Argument(help="the goal whose books to show")] = None,
    tenant: Annotated[str | None, typer.Option(help="show this tenant's spend by period, model and kind")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a goal's budget (spent by kind, reserved, calls, cost, headroom), or a tenant's spend."""
    from bus.ledger import Ledger, LedgerSnapshot  # only this command needs it

    if (goal_id is None) == (tenant is None):
        _fail(EXIT_INVALID, "give a goal id or --tenant NAME (one of them)")
    if tenant is not None:
        _print_tenant(_with_client(lambda c: c.tenant_show(tenant)), as_json)
        return
    assert goal_id is not None
    # Reading also forfeits expired reservations, so the numbers shown are what reserve would see.
    # An unknown goal raises LedgerNotFound, a NotFound: exit 1 with the message.
    snap: LedgerSnapshot = _with_client(lambda c: Ledger(c.redis, c.keys).snapshot(goal_id))
    if as_json:
        _print_json(snap.model_dump(mode="json"))
        return
    table = Table("", "tokens", show_header=False)
    table.add_row("budget", f"{snap.budget:,}")
    for kind in ("input", "output", "cache_read", "cache_write", "unknown"):
        table.add_row(f"  spent {kind.replace('_', ' ')}", f"{getattr(snap, 'spent_' + kind):,}")
    table.add_row("spent", f"{snap.spent:,}")
    table.add_row("reserved", f"{snap.reserved:,} ({snap.open} open)")
    table.add_row("headroom", f"{snap.headroom:,}")
    if snap.budget_micro_usd:
        d = 1_000_000
        left = snap.budget_micro_usd - snap.cost_micro_usd - snap.reserved_micro_usd
        table.add_row("budget USD", f"${snap.budget_micro_usd / d:.4f} (headroom ${left / d:.4f})")
    show((goal_id, "bold"), f"  {snap.calls} calls  ${snap.cost_usd:.4f}  {snap.refusals} refused")
    if snap.pools:
        show(f"pools: {', '.join(snap.pools)}")
    out.print(table)


def _print_tenant(view: TenantView, as_json: bool) -> None:
    if as_json:
        _print_json(view.model_dump(mode="json"))
        return
    s = view.settings
    limits = [
        f"period {s.period}",
        f"tokens {s.budget_tokens:,}" if s.budget_tokens else "tokens unlimited",
        f"USD {s.budget_usd:.2f}" if s.budget_usd else "USD unlimited",
        f"max running {s.max_running}" if s.max_running else "running unlimited",
    ]
    note = "" if view.configured else " (no settings: no limits)"
    show((s.name, "bold"), f"{note}  {', '.join(limits)}  running now {view.running}")
    if not view.periods:
        show("no spend yet")
    for p in view.periods:
        b = p.books
        mark = " (current)" if p.label == view.current else ""
        show(
            "\n",
            (p.label, "bold"),
            f"{mark}  spent {b.spent:,} tokens  ${b.cost_usd:.4f}  reserved {b.reserved:,} "
            f"({b.open} open)  {b.calls} calls  {b.refusals} refused  {p.resets} resets",
        )
        model_col = Column("model", no_wrap=True)  # the id is what people grep for: never wrapped
        table = Table(model_col, "input", "output", "cache read", "cache write", "unknown", "USD")
        for m in p.models:
            table.add_row(
                line(m.model),
                f"{m.input:,}",
                f"{m.output:,}",
                f"{m.cache_read:,}",
                f"{m.cache_write:,}",
                f"{m.unknown:,}",
                f"{m.cost_usd:.4f}",
            )
        out.print(table)


tenant_app = typer.Typer(help="Tenants: the pools their goals spend from (see README, Tenants).", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")


@tenant_app.command("set")
def tenant_set(
    name: str,
    period: Annotated[str | None, typer.Option(help="none, day or month (UTC calendar)")] = None,
    budget_tokens: Annotated[
        int | None, typer.Option("--budget-tokens", min=0, help="tokens per period; 0 = no limit")
    ] = None,
    budget_usd: Annotated[float | None, typer.Option("--budget-usd", min=0, help="USD per period; 0 = none")] = None,
    max_running: Annotated[
        int | None, typer.Option("--max-running", min=0, help="concurrent running tasks; 0 = no limit")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Change a tenant's pool atomically (options not given keep their value)."""
    if period is not None and period not in ("none", "day", "month"):
        _fail(EXIT_INVALID, f"--period: expected none, day or month, got {period!r}")
    try:
        settings = _with_client(
            lambda c: c.tenant_set(
                name,
                period=period,  # type: ignore[arg-type]
                budget_tokens=budget_tokens,
                budget_usd=budget_usd,
                max_running=max_running,
            )
        )
    except ValueError as exc:
        _fail(EXIT_INVALID, str(exc))
    if as_json:
        _print_json(settings.model_dump(mode="json"))
    else:
        show(f"{name}: {settings.model_dump_json(exclude={'name'})}")


@tenant_app.command("show")
def tenant_show(name: str, as_json: JsonOpt = False) -> None:
    """A tenant's settings, running tasks and spend by period, model and kind."""
    try:
        view = _with_client(lambda c: c.tenant_show(name))
    except ValueError as exc:
        _fail(EXIT_INVALID, str(exc))
    _print_tenant(view, as_json)


@tenant_app.command("list")
def tenant_list(as_json: JsonOpt = False) -> None:
    """Every tenant with settings, with its current period's spend."""
    views = _with_client(lambda c: c.tenant_list())
    if as_json:
        _print_json([v.model_dump(mode="json") for v in views])
        return
    table = Table("tenant", "period", "tokens", "USD", "max running", "running", "current spend")
    for v in views:
        s = v.settings
        cur = next((p for p in v.periods if p.label == v.current), None)
        spend = f"{cur.books.spent:,} tok ${cur.books.cost_usd:.4f}" if cur else "0"
        table.add_row(
            line(s.name),
            s.period,
            f"{s.budget_tokens:,}" if s.budget_tokens else "-",
            f"{s.budget_usd:.2f}" if s.budget_usd else "-",
            str(s.max_running or "-"),
            str(v.running),
            spend,
        )
    out.print(table)


@tenant_app.command("reset")
def tenant_reset(name: str, as_json: JsonOpt = False) -> None:
    """Start the tenant's current period afresh: its spend goes back to zero (open calls still count)."""
    try:
        pool = _with_client(lambda c: c.tenant_reset(name))
    except ValueError as exc:
        _fail(EXIT_INVALID, str(exc))
    if as_json:
        _print_json({"tenant": name, "pool": pool})
    else:
        show(f"{name}: {pool} reset")


DEMO_GOAL = "Can orders A100, A101 and A107 be refunded? Today is 2026-10-13."
DEMO_DOD = "For each order: whether it can be refunded, why, and the refund deadline."


def _run(
    goal: Goal, settings: Settings, local: bool, as_json: bool, timeout: float | None, stream: bool = True
) -> None:
    from .logs import configure_logging
    from .runner import run_goal, summary

    console = Console(stderr=True) if as_json else out
    configure_logging("WARNING", json=True, stream=sys.stderr)  # worker logs stay out of the live view
    record, books = _guarded(
        lambda: _arun(
            run_goal(settings, goal, local=local, console=console, timeout=timeout, warn=_warn, stream=stream)
        )
    )
    if as_json:
        _print_json({**summary(record, books), "timeout": not record.terminal})
    if not record.terminal:
        where = "its workers stopped with this process" if local else f"follow it with `taskloom watch {record.id}`"
        _fail(EXIT_TIMEOUT, f"goal {record.id} still {record.state.value} after {timeout:g} s ({where})")
    if not as_json:
        spent = f"{books.spent:,} of {books.budget:,} tokens (${books.cost_usd:.4f})" if books else ""
        show("\n", (record.state.value, "bold"), f"  {spent}")
        if record.answer:
            show("\n", ("answer", "bold"), "\n", record.answer)
        elif record.reason:
            show("reason: ", record.reason)
    raise typer.Exit(_goal_exit(record))


@app.command()
def run(
    text: GoalText,
    dod: Annotated[str, typer.Option("--dod", help="definition of done")] = "",
    budget: Annotated[int | None, typer.Option(help="token budget")] = None,
    local: Annotated[bool, typer.Option(help="run planner, executor and critic in this process")] = False,
    review: ReviewOpt = None,
    check: CheckOpt = None,
    model: ModelOpt = None,
    timeout: Annotated[
        float | None, typer.Option(help="stop watching after this many seconds (exit 4)", callback=_seconds)
    ] = None,
    as_json: JsonOpt = False,
    stream: StreamOpt = True,
) -> None:
    """Submit a goal, show its DAG live with each running task's words as they are written
    (`--no-stream`: without them), print the final answer. Exit 0 only if it succeeded."""
    raw: dict[str, Any] = {"text": _goal_text(text), "definition_of_done": dod}
    if budget is not None:
        raw["budget_tokens"] = budget
    _review_and_check(raw, review, check)
    settings = _settings()
    _model_choice(raw, model, settings)
    try:
        goal = Goal.model_validate(raw)
    except ValidationError as exc:
        _fail(EXIT_INVALID, _validation_message(exc))
    _run(goal, settings, local, as_json, timeout, stream)


@app.command()
def demo(
    as_json: JsonOpt = False,
    timeout: Annotated[float, typer.Option(help="give up after this many seconds (exit 4)", callback=_seconds)] = 120,
    model: Annotated[
        str | None, typer.Option("--model", help="run the same goal on this model (an alias, or a claude-... id)")
    ] = None,
) -> None:
    """The whole system on this machine, no set-up: embedded Redis, the offline demo model, the
    support-desk toolkit, all workers in this process, on a refund question over three orders."""
    settings = _settings()
    if model is not None and not settings.catalog().known(model):
        aliases = ", ".join(sorted(settings.catalog().aliases)) or "none: set TASKLOOM_MODELS_FILE"
        _fail(EXIT_INVALID, f"--model: expected a models-file alias ({aliases}) or a claude-... id; got {model!r}")
    # Every role on one model (the demo's by default, whatever the environment says), with the
    # support-desk toolkit the goal is about.
    settings = settings.model_copy(
        update={
            "model": model or "demo",
            "planner_model": None,
            "executor_model": None,
            "critic_model": None,
            "tools": "" if model in (None, "demo") else "executor.demo_tools:support",
        }
    )
    goal = Goal(text=DEMO_GOAL, definition_of_done=DEMO_DOD, budget_tokens=100_000)
    _run(goal, settings, True, as_json, timeout)


@app.command()
def dag(
    goal_id: str,
    fmt: Annotated[str, typer.Option("--format", help="mermaid | json")] = "mermaid",
    version: Annotated[int | None, typer.Option(help="plan version (default: the current one)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print a goal's plan as a Mermaid flowchart or as JSON, with each task's state."""
    from planner.dag import render_json, render_mermaid

    if as_json:
        fmt = "json"
    if fmt not in ("mermaid", "json"):
        _fail(EXIT_INVALID, f"--format: expected mermaid or json, got {fmt!r}")

    async def go(c: Client) -> tuple[Any, dict[str, Any]]:
        await c.get(goal_id)
        plan = await c.store.get_plan(goal_id, version)
        tasks = await c.store.get_tasks(goal_id)
        return plan, {tid: t.state for tid, t in tasks.items()}

    stored, states = _with_client(go)
    if fmt == "json":
        _print_json({"goal_id": goal_id, "version": stored.version, **render_json(stored.plan, states)})
    else:
        sys.stdout.write(render_mermaid(stored.plan, states) + "\n")


@app.command()
def approve(goal_id: str, call_id: str, as_json: JsonOpt = False) -> None:
    """Approve a tool call that awaits approval; its task resumes."""
    _decide(goal_id, call_id, True, "", as_json)


@app.command()
def deny(
    goal_id: str,
    call_id: str,
    reason: Annotated[str, typer.Option(help="shown to the model")] = "denied by operator",
    as_json: JsonOpt = False,
) -> None:
    """Deny a tool call that awaits approval; the model sees an ERROR observation with the reason."""
    _decide(goal_id, call_id, False, reason, as_json)


def _who() -> str:
    """Who decides from this shell, for the audit event (as an API decision records its token's name)."""
    import getpass

    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # a container user with no passwd entry and no USER variable
        return "cli"


def _decide(goal_id: str, call_id: str, approved: bool, reason: str, as_json: bool) -> None:
    async def go(c: Client) -> tuple[bool, ApprovalDecision | None]:
        try:
            first = await c.decide(goal_id, call_id, approved, reason, by=_who())
        except AlreadyDecided as exc:  # idempotent: the first decision stands
            return False, exc.decision
        return first, await c.decision(goal_id, call_id)

    first, decision = _with_client(go)
    verb = "approved" if approved else "denied"
    before = "approved" if decision is not None and decision.approved else "denied"
    if as_json:
        _print_json(
            {"goal_id": goal_id, "call_id": call_id, "approved": approved, "first_decision": first, "decision": before}
        )
    elif first:
        show(f"{call_id} {verb}")
    else:  # idempotent, as a second `kubectl apply` is; the first decision stands
        show(f"{call_id} was already {before}; nothing changed")


@app.command()
def api(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port (0: any free port)", min=0, max=65535)] = 8700,
    open_: Annotated[
        bool, typer.Option("--open", help="loopback only: print a one-time token with every scope, and the URL")
    ] = False,
    insecure_local: Annotated[
        bool, typer.Option("--insecure-local", help="no tokens at all (every caller has every scope); loopback only")
    ] = False,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING, ERROR", callback=_log_level)] = "INFO",
) -> None:
    """Serve the HTTP API and the web console (needs the `api` extra: pip install 'taskloom\\[api]')."""
    try:
        from .api.app import ApiConfig
        from .api.auth import TokenBook, TokenConfigError, load_tokens, new_token
        from .api.server import ApiStartError, bind, is_loopback, public_url, serve
    except ImportError as exc:
        _fail(EXIT_INVALID, f"the API needs the `api` extra: pip install 'taskloom[api]' ({exc})")
    settings = _settings()
    if (open_ or insecure_local) and not is_loopback(host):
        flag = "--open" if open_ else "--insecure-local"
        _fail(EXIT_INVALID, f"{flag} serves on loopback only; --host {host} is not a loopback address")
    try:
        book = TokenBook(load_tokens(settings.api_tokens, settings.api_tokens_file))
    except TokenConfigError as exc:
        _fail(EXIT_INVALID, str(exc))
    one_time = None
    if open_:
        one_time = new_token()  # lives in this process only: it stops working when the process stops
        book.add("console", ("admin",), one_time)
    if not book.tokens and not insecure_local:
        _fail(
            EXIT_INVALID,
            "no API tokens: set TASKLOOM_API_TOKENS or TASKLOOM_API_TOKENS_FILE (make one with "
            "`taskloom api-token NAME --scope read`), or use --open or --insecure-local on loopback",
        )
    try:
        sock = bind(host, port)
    except ApiStartError as exc:
        _fail(EXIT_INVALID, str(exc))
    url = public_url(settings, host, sock.getsockname()[1])
    from .logs import configure_logging

    configure_logging(log_level)
    config = ApiConfig(
        tokens=book,
        insecure_local=insecure_local,
        max_body=settings.api_max_body,
        body_timeout=settings.api_body_timeout,
        ready_requires_workers=settings.api_ready_requires_workers,
        model_aliases=frozenset(settings.catalog().aliases),
    )
    # One line each, on stdout, before serving: scripts and tests read them.
    sys.stdout.write(f"console: {url}\n")
    if one_time is not None:
        sys.stdout.write(f"token: {one_time}\nopen: {url}#token={one_time}\n")
    sys.stdout.flush()
    _guarded(lambda: _arun(serve(settings, sock, config, url)))


@app.command("api-token")
def api_token(
    name: Annotated[str, typer.Argument(help="who holds it; recorded in audit events (approvals)")],
    scope: Annotated[
        list[str] | None, typer.Option("--scope", help="read | submit | approve | admin (repeatable; default read)")
    ] = None,
) -> None:
    """Make a new API token: prints the token (give it to the caller) and its hashed entry (for the server)."""
    from .api.auth import SCOPES, TokenConfigError, entry_for, new_token, parse_tokens

    scopes = scope or ["read"]
    token = new_token()
    entry = entry_for(name, scopes, token)
    try:
        parse_tokens(entry, "the new token")
    except TokenConfigError as exc:
        _fail(EXIT_INVALID, f"{exc} (scopes: {', '.join(SCOPES)}; names: letters, digits, _ . @ -)")
    sys.stdout.write(f"token: {token}\nentry: {entry}\n")


@app.command()
def tools(as_json: JsonOpt = False) -> None:
    """List the tool catalog a worker would load (TASKLOOM_TOOLS and TASKLOOM_MCP_CONFIG), with each
    tool's origin and policy; a bad configuration or a name collision exits 2 naming it."""
    from .logs import configure_logging
    from .workers import load_tools

    settings = _settings()
    configure_logging("WARNING", stream=sys.stderr)

    async def listed() -> list[dict[str, Any]]:
        async with load_tools(settings) as catalog:
            registry = await catalog.start()
            return [
                {
                    "name": name,
                    "origin": registry.origins[name],
                    "read_only": tool.read_only,
                    "side_effects": tool.side_effects,
                    "requires_approval": tool.requires_approval,
                    "timeout": tool.timeout,
                    "description": tool.description,
                }
                for name, tool in sorted(registry.tools.items())
            ]

    rows = _guarded(lambda: _arun(listed()))
    if as_json:
        _print_json(rows)
        return
    table = Table("tool", "from", "policy", "timeout")
    for row in rows:
        flags = [f for f in ("read_only", "side_effects", "requires_approval") if row[f]]
        timeout = row["timeout"] or settings.tool_timeout
        table.add_row(row["name"], row["origin"], ", ".join(flags) or "-", f"{timeout:g} s")
    out.print(table)


@app.command()
def models(as_json: JsonOpt = False) -> None:
    """List the models a worker would use: each role's model and fallback chain, every alias of
    TASKLOOM_MODELS_FILE with its provider, key variable (set or missing), prices and limits."""
    from bus.prices import PriceTable

    settings = _settings()
    catalog = settings.catalog()
    prices = PriceTable(settings.all_prices())
    limits = settings.all_rate_limits()
    names = sorted({*catalog.aliases, *(n for n in settings.role_models().values())})
    rows: list[dict[str, Any]] = []
    for name in names:
        config = catalog.config(name)
        alias = catalog.aliases.get(name)
        key_env = config.key_env()
        price = prices.price(config.model)
        limit = limits.get(config.model)
        rows.append(
            {
                "name": name,
                "provider": config.provider,
                "model": config.model,
                "base_url": config.base_url or config.azure_endpoint,
                "key_env": key_env,
                "key_set": None if key_env is None else bool(os.environ.get(key_env)),
                "price": price.model_dump() if price is not None else None,
                "price_source": prices.source(config.model),
                "context_window": alias.context_window if alias is not None else None,
                "rate_limit": limit.model_dump() if limit is not None else None,
                "chain": catalog.chain(name),
                "roles": [r for r, m in settings.role_models().items() if r is not None and m == name],
            }
        )
    if as_json:
        _print_json({"roles": {r: m for r, m in settings.role_models().items() if r is not None}, "models": rows})
        return
    table = Table("model", "provider / id", "key", "USD per MTok (in/out/cache r/w)", "limits", "fallbacks", "roles")
    for row in rows:
        key = "-" if row["key_env"] is None else f"{row['key_env']} ({'set' if row['key_set'] else 'MISSING'})"
        p = row["price"]
        price_text = (
            "unpriced" if p is None else f"{p['input']:g}/{p['output']:g}/{p['cache_read']:g}/{p['cache_write']:g}"
        )
        if p is not None:
            price_text += f" ({row['price_source']})"
        lim = row["rate_limit"]
        limit_text = "-" if lim is None else f"{lim['rpm']} rpm, {lim['input_tpm']}/{lim['output_tpm']} tpm"
        if row["context_window"]:
            limit_text += f"; {row['context_window']} ctx"
        table.add_row(
            row["name"], f"{row['provider']} / {row['model']}", key, price_text, limit_text,
            " -> ".join(row["chain"][1:]) or "-", ", ".join(row["roles"]) or "-",
        )
    out.print(table)


@app.command("eval")
def eval_(
    suite: Annotated[str, typer.Argument(help="the suite file (YAML or JSON); or `compare A.json B.json`")],
    files: Annotated[list[str] | None, typer.Argument(help="with compare: the two results files")] = None,
    model: Annotated[list[str] | None, typer.Option("--model", help="a model to run on (repeatable)")] = None,
    repeat: Annotated[int, typer.Option(min=1, max=1000, help="runs of each case per model")] = 1,
    concurrency: Annotated[int, typer.Option(min=1, max=256, help="goals running at once")] = 4,
    local: Annotated[bool, typer.Option("--local", help="run the workers in this process")] = False,
    as_json: JsonOpt = False,
    min_pass: Annotated[float, typer.Option(min=0, max=1, help="pass rate each model must reach")] = 1.0,
    max_usd: Annotated[float | None, typer.Option(min=0, help="most the whole run may cost")] = None,
    replay: Annotated[Path | None, typer.Option(help="a cassette, or a directory of <model>.jsonl")] = None,
    tag: Annotated[list[str] | None, typer.Option("--tag", help="run cases tagged T; !T: skip them")] = None,
    out_file: Annotated[Path | None, typer.Option("--out", help="the results file")] = None,
) -> None:
    """Score the fleet on a suite of goals, per model; exit 3 below --min-pass or above --max-usd.
    `taskloom eval compare A.json B.json` prints what changed between two runs (README "Evaluating
    your agents")."""
    from .eval import command as ev

    try:
        if suite == "compare":
            if len(files or []) != 2:
                _fail(EXIT_INVALID, "compare: expected two results files: taskloom eval compare A.json B.json")
            a, b = (Path(f) for f in files or [])
            raise typer.Exit(ev.compare_files(a, b, as_json, out))
        if files:
            _fail(EXIT_INVALID, f"unexpected argument {files[0]!r} after the suite file")
        options = ev.Options(
            Path(suite), model or [], repeat, concurrency, local, min_pass, max_usd, replay, tag or [], out_file
        )
        settings = _settings()
        raise typer.Exit(_guarded(lambda: _arun(ev.main(settings, options, as_json, out, err))))
    except (*ev.INVALID, ValueError) as exc:
        _fail(EXIT_INVALID, str(exc))


@app.command()
def mcp(
    http: Annotated[bool, typer.Option("--http", help="serve streamable HTTP instead of stdio")] = False,
    host: Annotated[str, typer.Option(help="HTTP address (no authentication: keep it on loopback)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port (0: a free one)")] = 8000,
    port_file: Annotated[Path | None, typer.Option(help="write the HTTP port here once listening")] = None,
    read_only: Annotated[bool, typer.Option("--read-only", help="only status, wait and events; no changes")] = False,
    max_wait: Annotated[float, typer.Option(help="longest wait_goal call, seconds")] = 60.0,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING, ERROR", callback=_log_level)] = "WARNING",
) -> None:
    """Serve the fleet to MCP hosts: submit_goal, goal_status, wait_goal, goal_events, cancel_goal,
    approve_call, deny_call (stdio by default; logs go to stderr)."""
    from .logs import configure_logging

    settings = _settings()
    if not math.isfinite(max_wait) or max_wait <= 0:
        _fail(EXIT_INVALID, f"--max-wait: expected a finite number of seconds > 0, got {max_wait:g}")
    configure_logging(log_level, stream=sys.stderr)  # stdout is the protocol's channel on stdio
    try:
        from executor.demo_mcp import serve_http

        from .mcp_server import build
    except ImportError as exc:
        _fail(EXIT_INVALID, f"the MCP SDK cannot be imported ({exc}); install it with: pip install 'taskloom[mcp]'")

    async def serve() -> None:
        async with Client.open(
            settings.redis_url, settings.home, keys_for(settings), settings.default_budget_tokens
        ) as client:
            server = build(client, read_only=read_only, max_wait=max_wait)
            if http:
                await serve_http(server, port_file, port, host)
            else:
                await server.run_stdio_async()

    _guarded(lambda: _arun(serve()))



# -- the process: one error path, no traceback unless asked, signals --------------------------------

_debug = False


def _env_debug() -> bool:
    return os.environ.get("TASKLOOM_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug", help="print the traceback of an unexpected error (or TASKLOOM_DEBUG=1)")
    ] = False,
) -> None:
    global _debug
    _debug = _debug or debug


_terminated_by: int | None = None


def _arun(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)` on the event loop `TASKLOOM_EVENT_LOOP` chooses (uvloop when installed),
    where SIGTERM (and SIGINT) cancel `coro` as Ctrl-C does: its `finally`
    blocks run, connections close, and the embedded redis-server is stopped by its last user. (A
    default SIGTERM kills the process first; a shell's background job even ignores SIGINT.) A worker
    replaces these handlers with its own graceful shutdown while it runs."""

    async def main() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        installed = []

        def stop(signum: int) -> None:
            global _terminated_by
            _terminated_by = signum
            task.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop, sig)
                installed.append(sig)
        try:
            return await coro
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    try:
        loop = eventloop.choice()
    except eventloop.EventLoopError as exc:
        coro.close()  # never started: no "was never awaited" warning beside the error
        _fail(EXIT_INVALID, str(exc))
    try:
        return eventloop.run(main(), loop)
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None  # main() exits 130, or 143 after SIGTERM


def _one_line_summaries(typer_app: typer.Typer) -> None:
    """Give every command a one-line summary for the command list of `--help`.

    Typer's rich help lists each command with its docstring's first paragraph but keeps that
    paragraph's line breaks (it rewraps only a command's own `--help`), so a summary wrapped in the
    source printed as ragged half-lines. The summary is that paragraph with its breaks removed.
    """
    for info in typer_app.registered_commands:
        doc = info.help or (inspect.getdoc(info.callback) if info.callback else None) or ""
        if info.short_help is None and doc:
            info.short_help = " ".join(doc.split("\n\n", 1)[0].split())
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _one_line_summaries(group.typer_instance)


_one_line_summaries(app)


def _cwd_on_path() -> None:
    """Toolkits in the current directory import as they do with `python -m` (uvicorn does the same)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def main(argv: list[str] | None = None) -> None:
    global _debug
    _debug = _env_debug()
    _cwd_on_path()
    try:
        rv = app(args=argv, prog_name="taskloom", standalone_mode=False)
    except cli_errors.NoArgsIsHelpError as exc:
        if exc.ctx is not None:
            sys.stdout.write(exc.ctx.get_help() + "\n")
        sys.exit(EXIT_INVALID)
    except cli_errors.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        _exit_with(EXIT_INVALID, exc.format_message() + _given(exc, sys.argv[1:] if argv is None else argv) + hint)
    except (typer.Abort, KeyboardInterrupt):
        rv = 130
    except Exception as exc:
        _unexpected(exc)
    if rv == 130 and _terminated_by is not None:
        rv = 128 + _terminated_by  # 143: ended by SIGTERM, as shells report it
    sys.exit(rv if isinstance(rv, int) else 0)


def _given(exc: Exception, argv: list[str]) -> str:
    """", got '<value>'" for an option value that could not be converted (typer's message omits it)."""
    param = getattr(exc, "param", None)
    opts = list(getattr(param, "opts", None) or [])
    if not opts or "got " in str(getattr(exc, "message", "")):
        return ""
    for i, arg in enumerate(argv):
        for opt in opts:
            if arg == opt and i + 1 < len(argv):
                return f", got {argv[i + 1]!r}"
            if arg.startswith(opt + "="):
                return f", got {arg[len(opt) + 1 :]!r}"
    return ""


def _exit_with(code: int, message: str) -> NoReturn:
    try:
        _fail(code, message)
    except typer.Exit as done:
        sys.exit(done.exit_code)


def _unexpected(exc: BaseException) -> NoReturn:
    """A bug or an unforeseen failure: one line naming it; the traceback only with --debug."""
    if _debug:
        traceback.print_exception(exc)
        sys.exit(1)
    name = type(exc).__name__
    _exit_with(1, f"unexpected {name}: {exc} (run with --debug or TASKLOOM_DEBUG=1 to see the traceback)")


if __name__ == "__main__":
    main()
