"""The `taskloom` command line.

Exit codes: 0 ok (for `wait`: the goal succeeded); 1 unknown goal or a failure reaching Redis;
2 invalid input or configuration (the message names the field or variable); 3 the goal ended
without succeeding (`wait`); 4 `wait` timed out.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import redis.exceptions
import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Column, Table

from bus.client import Client, GoalStatus, WaitTimeout
from bus.connection import EmbeddedRedisError
from bus.keys import ROLES
from bus.schemas import Event, Goal, GoalRecord, GoalState
from bus.store import IllegalTransition, NotFound
from bus.tenants import TenantView
from executor.registry import ToolLoadError
from llm.errors import ModelConfigError

from .logs import configure_logging
from .metrics import MetricsError
from .settings import Settings, SettingsError, load_settings
from .workers import keys_for, load_tools, run_workers

app = typer.Typer(
    name="taskloom",
    help="Run AI agents as a fleet of workers: planner, executors and critic over Redis queues.",
    no_args_is_help=True,
    add_completion=False,
)
out = Console()
err = Console(stderr=True)

T = TypeVar("T")

EXIT_NOT_FOUND = 1
EXIT_INVALID = 2
EXIT_NOT_SUCCEEDED = 3
EXIT_TIMEOUT = 4

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def _fail(code: int, message: str) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def _settings() -> Settings:
    try:
        return load_settings()
    except SettingsError as exc:
        _fail(EXIT_INVALID, str(exc))


def _with_client(fn: Callable[[Client], Awaitable[T]]) -> T:
    settings = _settings()

    async def go() -> T:
        async with Client.open(
            settings.redis_url, settings.home, keys_for(settings), settings.default_budget_tokens
        ) as client:
            return await fn(client)

    try:
        return asyncio.run(go())
    except WaitTimeout:
        raise  # a TimeoutError, hence an OSError: not a connection problem; the caller reports it
    except NotFound as exc:
        _fail(EXIT_NOT_FOUND, str(exc))
    except ValidationError as exc:
        _fail(EXIT_INVALID, _validation_message(exc))
    except (redis.exceptions.ConnectionError, EmbeddedRedisError, OSError) as exc:
        _fail(EXIT_NOT_FOUND, f"cannot reach Redis: {exc}")


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors(include_url=False):
        field = ".".join(str(p) for p in e["loc"]) or "input"
        parts.append(f"{field}: {e['msg']}")
    return "invalid goal: " + "; ".join(parts)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


# -- commands ---------------------------------------------------------------------------------


@app.command()
def worker(
    role: Annotated[str, typer.Argument(help="planner | executor | critic | all")],
    burst: Annotated[bool, typer.Option(help="exit once the queues are empty")] = False,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING, ERROR")] = "INFO",
) -> None:
    """Run a worker process for one role, or all three roles in one process."""
    roles = list(ROLES) if role == "all" else [role]
    if any(r not in ROLES for r in roles):
        _fail(EXIT_INVALID, f"unknown role {role!r}; expected one of: {', '.join(ROLES)}, all")
    settings = _settings()
    configure_logging(log_level)
    try:
        asyncio.run(run_workers(roles, settings, burst=burst))
    except (redis.exceptions.ConnectionError, EmbeddedRedisError) as exc:
        _fail(EXIT_NOT_FOUND, f"cannot reach Redis: {exc}")
    except (ModelConfigError, ToolLoadError, MetricsError) as exc:
        _fail(EXIT_INVALID, str(exc))


@app.command()
def health(
    role: Annotated[
        list[str] | None, typer.Option("--role", help="planner | executor | critic | all (repeatable; default all)")
    ] = None,
    local: Annotated[bool, typer.Option("--local", help="only workers on this host (container probes)")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait for Redis")] = 5.0,
    as_json: JsonOpt = False,
) -> None:
    """Exit 0 if Redis answers and each role has a worker with a fresh heartbeat; else 1 with the reason."""
    import socket

    from redis.asyncio import Redis

    from bus.connection import EmbeddedRedis

    from . import health as checks

    wanted = [r for name in (role or ["all"]) for r in (ROLES if name == "all" else [name])]
    if any(r not in ROLES for r in wanted):
        _fail(EXIT_INVALID, f"--role: expected one of {', '.join(ROLES)}, all; got {', '.join(role or [])}")
    settings = _settings()
    # With no TASKLOOM_REDIS_URL, look for the embedded server without starting one: a health check
    # that started a fresh, empty Redis would only hide the problem.
    url = settings.redis_url or EmbeddedRedis(settings.home).url

    async def go() -> checks.Report:
        redis = Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return await asyncio.wait_for(
                checks.check(redis, keys_for(settings), wanted, socket.gethostname() if local else None), timeout
            )
        except TimeoutError:
            return checks.Report(redis=False, reasons=[f"cannot reach Redis: no answer within {timeout:g} s"])
        finally:
            await redis.aclose()

    report = asyncio.run(go())
    if as_json:
        _print_json(report.as_json())
    elif report.ok:
        live = "; ".join(f"{r}: {sum(b.alive for b in beats)} live" for r, beats in report.roles.items())
        out.print(f"ok: Redis answers; {live}", highlight=False, soft_wrap=True)
    else:  # one line, never wrapped: probes and their logs read it
        err.print("[bold red]unhealthy:[/] " + "; ".join(report.reasons), highlight=False, soft_wrap=True)
    raise typer.Exit(0 if report.ok else EXIT_NOT_FOUND)


@app.command()
def submit(
    text: Annotated[str, typer.Argument(help="the goal, in natural language")],
    dod: Annotated[str, typer.Option("--dod", help="definition of done")] = "",
    budget: Annotated[int | None, typer.Option(help="token budget (default: TASKLOOM_DEFAULT_BUDGET_TOKENS)")] = None,
    budget_usd: Annotated[float | None, typer.Option("--budget-usd", help="dollar budget (cache-aware prices)")] = None,
    tenant: Annotated[str | None, typer.Option(help="tenant whose pool it spends from (default: default)")] = None,
    tool: Annotated[list[str] | None, typer.Option("--tool", help="allowed tool (repeatable; default all)")] = None,
    meta: Annotated[list[str] | None, typer.Option("--meta", help="metadata KEY=VALUE (repeatable)")] = None,
    deadline: Annotated[str | None, typer.Option(help="ISO 8601 time with zone, e.g. 2026-10-13T18:00Z")] = None,
    goal_id: Annotated[str | None, typer.Option("--id", help="your own goal id (makes re-submitting safe)")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Submit a goal; prints its id."""
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
    # Validate before touching Redis, so an invalid goal stores nothing and needs no server.
    try:
        goal = Goal.model_validate(raw)
    except ValidationError as exc:
        _fail(EXIT_INVALID, _validation_message(exc))
    gid = _with_client(lambda c: c.submit(goal, goal_id=goal_id))
    if as_json:
        _print_json({"goal_id": gid})
    else:
        out.print(gid)


def _status_json(s: GoalStatus) -> dict[str, Any]:
    return {
        **s.goal.model_dump(mode="json"),
        "plan": s.plan.model_dump(mode="json") if s.plan else None,
        "tasks": [t.model_dump(mode="json") for t in s.tasks],
    }


@app.command()
def status(goal_id: str, as_json: JsonOpt = False) -> None:
    """Show a goal: its state, answer, plan version and every task's state."""
    s = _with_client(lambda c: c.status(goal_id))
    if as_json:
        _print_json(_status_json(s))
        return
    g = s.goal
    out.print(f"[bold]{g.id}[/]  [cyan]{g.state.value}[/]  budget {g.budget_tokens:,} tokens  plan v{g.plan_version}")
    out.print(f"goal: {g.goal.text}", highlight=False)
    if g.reason:
        out.print(f"reason: {g.reason}", highlight=False)
    if s.tasks:
        table = Table("task", "state", "attempt", "reason")
        for t in s.tasks:
            table.add_row(t.task_id, t.state.value, str(t.attempt), t.reason or "")
        out.print(table)
    if g.answer:
        out.print(f"\n[bold]answer[/]\n{g.answer}", highlight=False)


def _goal_exit(goal: GoalRecord) -> int:
    return 0 if goal.state == GoalState.SUCCEEDED else EXIT_NOT_SUCCEEDED


@app.command()
def wait(
    goal_id: str,
    timeout: Annotated[float | None, typer.Option(help="seconds; default: no limit")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Wait until a goal ends. Exit 0 if it succeeded, 3 if it ended otherwise, 4 on timeout."""
    try:
        goal = _with_client(lambda c: c.wait(goal_id, timeout))
    except WaitTimeout as exc:
        if as_json:
            _print_json({"goal_id": goal_id, "state": exc.state, "timeout": True})
        _fail(EXIT_TIMEOUT, str(exc))
    if as_json:
        _print_json(goal.model_dump(mode="json"))
    else:
        out.print(f"{goal.id} {goal.state.value}")
        if goal.answer:
            out.print(goal.answer, highlight=False)
        elif goal.reason:
            out.print(goal.reason, highlight=False)
    raise typer.Exit(_goal_exit(goal))


def _event_line(e: Event) -> str:
    task = f" [{e.task_id}]" if e.task_id else ""
    data = " ".join(f"{k}={v}" for k, v in e.data.items())
    return f"{e.at:%H:%M:%S.%f}"[:-3] + f"  {e.type}{task}  {data}"


@app.command()
def events(
    goal_id: str,
    after: Annotated[str | None, typer.Option(help="resume after this position (from a previous read)")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep reading until the goal ends")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Print a goal's events (each with its position, to resume from)."""

    async def go(c: Client) -> None:
        async for e in c.events(goal_id, after=after, follow=follow):
            if as_json:
                _print_json(e.model_dump(mode="json"))
            else:
                out.print(f"{e.position}  {_event_line(e)}", highlight=False)

    _with_client(go)


@app.command()
def watch(goal_id: str, as_json: JsonOpt = False) -> None:
    """Follow a goal live until it ends; exit code as for `wait`."""

    async def go(c: Client) -> GoalRecord:
        async for e in c.events(goal_id, follow=True):
            if as_json:
                _print_json(e.model_dump(mode="json"))
            else:
                out.print(_event_line(e), highlight=False)
        return await c.get(goal_id)

    goal = _with_client(go)
    if not as_json:
        out.print(f"[bold]{goal.state.value}[/]")
        if goal.answer:
            out.print(goal.answer, highlight=False)
    raise typer.Exit(_goal_exit(goal))


@app.command()
def cancel(
    goal_id: str,
    reason: Annotated[str, typer.Option(help="recorded on the goal and its tasks")] = "cancelled by request",
    as_json: JsonOpt = False,
) -> None:
    """Cancel a goal: stop dispatch and cancel its unfinished tasks."""
    try:
        changed = _with_client(lambda c: c.cancel(goal_id, reason))
    except IllegalTransition as exc:
        _fail(EXIT_NOT_SUCCEEDED, f"goal {goal_id} already ended ({exc.current}); nothing to cancel")
    if as_json:
        _print_json({"goal_id": goal_id, "cancelled": True, "changed": changed})
    else:
        out.print(f"{goal_id} cancelled" if changed else f"{goal_id} was already cancelled")


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
        out.print(f"{goal_id} resumed: {goal.state.value}")


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
    out.print(f"[bold]{goal_id}[/]  {snap.calls} calls  ${snap.cost_usd:.4f}  {snap.refusals} refused", highlight=False)
    if snap.pools:
        out.print(f"pools: {', '.join(snap.pools)}", highlight=False)
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
    out.print(f"[bold]{s.name}[/]{note}  {', '.join(limits)}  running now {view.running}", highlight=False)
    if not view.periods:
        out.print("no spend yet")
    for p in view.periods:
        b = p.books
        mark = " (current)" if p.label == view.current else ""
        out.print(
            f"\n[bold]{p.label}[/]{mark}  spent {b.spent:,} tokens  ${b.cost_usd:.4f}  reserved {b.reserved:,} "
            f"({b.open} open)  {b.calls} calls  {b.refusals} refused  {p.resets} resets",
            highlight=False,
        )
        model_col = Column("model", no_wrap=True)  # the id is what people grep for: never wrapped
        table = Table(model_col, "input", "output", "cache read", "cache write", "unknown", "USD")
        for m in p.models:
            table.add_row(
                m.model,
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
        out.print(f"{name}: {settings.model_dump_json(exclude={'name'})}", highlight=False)


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
            s.name,
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
        out.print(f"{name}: {pool} reset")


DEMO_GOAL = "Can orders A100, A101 and A107 be refunded? Today is 2026-10-13."
DEMO_DOD = "For each order: whether it can be refunded, why, and the refund deadline."


def _run(goal: Goal, settings: Settings, local: bool, as_json: bool, timeout: float | None) -> None:
    from .runner import run_goal, summary

    console = Console(stderr=True) if as_json else out
    configure_logging("WARNING", json=True, stream=sys.stderr)  # worker logs stay out of the live view
    try:
        record, books = asyncio.run(run_goal(settings, goal, local=local, console=console, timeout=timeout))
    except (redis.exceptions.ConnectionError, EmbeddedRedisError) as exc:
        _fail(EXIT_NOT_FOUND, f"cannot reach Redis: {exc}")
    except (ModelConfigError, ToolLoadError) as exc:
        _fail(EXIT_INVALID, str(exc))
    if as_json:
        _print_json(summary(record, books))
    else:
        spent = f"{books.spent:,} of {books.budget:,} tokens (${books.cost_usd:.4f})" if books else ""
        out.print(f"\n[bold]{record.state.value}[/]  {spent}")
        if record.answer:
            out.print(f"\n[bold]answer[/]\n{record.answer}", highlight=False)
        elif record.reason:
            out.print(f"reason: {record.reason}", highlight=False)
    raise typer.Exit(_goal_exit(record))


@app.command()
def run(
    text: Annotated[str, typer.Argument(help="the goal, in natural language")],
    dod: Annotated[str, typer.Option("--dod", help="definition of done")] = "",
    budget: Annotated[int | None, typer.Option(help="token budget")] = None,
    local: Annotated[bool, typer.Option(help="run planner, executor and critic in this process")] = False,
    timeout: Annotated[float | None, typer.Option(help="stop watching after this many seconds")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Submit a goal, show its DAG live, print the final answer. Exit 0 only if it succeeded."""
    raw: dict[str, Any] = {"text": text, "definition_of_done": dod}
    if budget is not None:
        raw["budget_tokens"] = budget
    try:
        goal = Goal.model_validate(raw)
    except ValidationError as exc:
        _fail(EXIT_INVALID, _validation_message(exc))
    _run(goal, _settings(), local, as_json, timeout)


@app.command()
def demo(
    as_json: JsonOpt = False,
    timeout: Annotated[float, typer.Option(help="give up after this many seconds")] = 120,
) -> None:
    """The whole system on this machine, no set-up: embedded Redis, the offline demo model, the
    support-desk toolkit, all workers in this process, on a refund question over three orders."""
    settings = _settings().model_copy(update={"model": "demo", "tools": ""})
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


def _decide(goal_id: str, call_id: str, approved: bool, reason: str, as_json: bool) -> None:
    first = _with_client(lambda c: c.decide(goal_id, call_id, approved, reason))
    if as_json:
        _print_json({"goal_id": goal_id, "call_id": call_id, "approved": approved, "first_decision": first})
    else:
        verb = "approved" if approved else "denied"
        out.print(f"{call_id} {verb}" if first else f"{call_id} was already decided; nothing changed")


@app.command()
def tools(as_json: JsonOpt = False) -> None:
    """List the tool catalog a worker would load (TASKLOOM_TOOLS and TASKLOOM_MCP_CONFIG), with each
    tool's origin and policy; a bad configuration or a name collision exits 2 naming it."""
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

    try:
        rows = asyncio.run(listed())
    except ToolLoadError as exc:
        _fail(EXIT_INVALID, str(exc))
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
def mcp(
    http: Annotated[bool, typer.Option("--http", help="serve streamable HTTP instead of stdio")] = False,
    host: Annotated[str, typer.Option(help="HTTP address (no authentication: keep it on loopback)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port (0: a free one)")] = 8000,
    port_file: Annotated[Path | None, typer.Option(help="write the HTTP port here once listening")] = None,
    read_only: Annotated[bool, typer.Option("--read-only", help="only status, wait and events; no changes")] = False,
    max_wait: Annotated[float, typer.Option(help="longest wait_goal call, seconds")] = 60.0,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING, ERROR")] = "WARNING",
) -> None:
    """Serve the fleet to MCP hosts: submit_goal, goal_status, wait_goal, goal_events, cancel_goal,
    approve_call, deny_call (stdio by default; logs go to stderr)."""
    settings = _settings()
    if max_wait <= 0:
        _fail(EXIT_INVALID, f"--max-wait must be > 0, got {max_wait:g}")
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

    try:
        asyncio.run(serve())
    except (redis.exceptions.ConnectionError, EmbeddedRedisError) as exc:
        _fail(EXIT_NOT_FOUND, f"cannot reach Redis: {exc}")
    except KeyboardInterrupt:
        pass


def main() -> None:
    app()


if __name__ == "__main__":
    main()
