"""The benchmarks import, and the smallest configuration of one of them runs (they are not timed here:
CI does not assert on their numbers)."""

from __future__ import annotations

import importlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import bench.testing_kit
import bench.tokens
from bench._harness import Responder, goal_text, plan_for, role_of
from bench.memory import _quarters
from bench.profile import sampled
from llm.testing import RecordedRequest, Reply
from planner.prompts import PLAN_TOOL
from planner.prompts import SYSTEM as PLANNER_SYSTEM


@pytest.mark.parametrize(
    "name",
    [
        "hops",
        "speedup",
        "throughput",
        "floor",
        "profile",
        "roundtrips",
        "tokens",
        "memory",
        "ledger",
        "toolkit",
        "recovery",
        "tools",
        "testing_kit",
        "replicawait",
        "streaming",
        "critical",
        "coalesce",
    ],
)
def test_bench_modules_import(name: str) -> None:
    importlib.import_module(f"bench.{name}")


def test_responder_plans_the_shape_the_goal_asks_for() -> None:
    body = {
        "system": PLANNER_SYSTEM,
        "tool_choice": {"type": "tool", "name": PLAN_TOOL},
        "tools": [{"name": PLAN_TOOL, "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": goal_text(2, 3, 1)}],
    }
    req = RecordedRequest("POST", "/v1/messages", {}, body, "req_1", 0.0)
    assert role_of(req) == "planner"
    reply = Responder()(req)
    assert isinstance(reply, Reply)
    plan = reply.content[0]["input"]
    assert plan == plan_for(2, 3, 1)
    assert [t["depends_on"] for t in plan["tasks"]][:3] == [[], ["c0-t0"], ["c0-t1"]]


def test_responder_routes_a_one_task_goal_and_plans_a_wider_one() -> None:
    """Route first: offered `fetch` beside submit_plan, the responder calls fetch itself for a goal of one
    task, as a model would, and submits a plan for a wider one."""
    tools = [{"name": "fetch", "input_schema": {"type": "object"}}, {"name": PLAN_TOOL, "input_schema": {}}]

    def reply_to(width: int) -> dict[str, Any]:
        messages = [{"role": "user", "content": goal_text(width, 1, 1)}]
        body = {"system": PLANNER_SYSTEM, "tools": tools, "messages": messages}
        reply = Responder()(RecordedRequest("POST", "/v1/messages", {}, body, "req_1", 0.0))
        assert isinstance(reply, Reply)
        block: dict[str, Any] = reply.content[0]
        return block

    assert reply_to(1)["name"] == "fetch"
    assert reply_to(2)["name"] == PLAN_TOOL


async def test_tokens_smallest_configuration(redis_url: str) -> None:
    table = await bench.tokens.run(redis_url, steps=2, observation=500, cache_min=0)
    assert "| no limit, no compaction, no cache (peer) |" in table
    assert table.count("\n| ") >= 6  # header, rule and one row per configuration


async def test_testing_kit_smallest_configuration(redis_url: str) -> None:
    """bench.testing_kit runs the demo goal once per configuration and prints its table."""
    table = await bench.testing_kit.run(1, redis_url)
    assert table.count("\n| ") == 6  # header, rule and four rows


def test_roundtrips_charges_scripts_and_arqs_transactions_to_their_job() -> None:
    """A script's commands go with its EVALSHA; arq's MULTI...EXEC after the job ended goes to the
    job it names (one round trip); a poll between jobs is idle; the client's own commands apart."""
    from bench.roundtrips import Job, attribute, parse_monitor

    p = "bench-rt-x:"
    lines = [
        f'100.000 [0 127.0.0.1:1] "HGETALL" "{p}goal:g"',  # client
        f'100.100 [0 127.0.0.1:2] "EVALSHA" "abc" "1" "{p}goal:g"',  # executor, in the job
        '100.101 [0 lua] "HMGET" "x" "state"',
        '100.102 [0 lua] "HSET" "x" "state" "running"',
        '100.300 [0 127.0.0.1:2] "MULTI"',
        f'100.301 [0 127.0.0.1:2] "SET" "arq:result:{p}job:execute:g:t:1" "r"',
        f'100.302 [0 127.0.0.1:2] "DEL" "arq:in-progress:{p}job:execute:g:t:1"',
        '100.303 [0 127.0.0.1:2] "EXEC"',
        f'100.400 [0 127.0.0.1:2] "ZRANGEBYSCORE" "{p}queue:executor" "-inf" "1"',  # idle poll
    ]
    commands = parse_monitor(lines, p)
    jobs = [Job("executor", "execute", f"{p}job:execute:g:t:1", 100.05, 100.2)]
    tallies, other = attribute(commands, jobs, {"127.0.0.1:2": "executor"}, {"127.0.0.1:1"}, p)
    t = tallies["execute"]
    assert (t.handler, t.handler_trips, t.arq, t.arq_trips) == (3, 1, 4, 1)
    assert other["benchmark client (submit, wait)"] == 1
    assert other["idle (polls, wake-ups, heartbeats, health checks)"] == 1


def test_speedup_reports_each_target_met_or_not_from_the_run() -> None:
    """bench.speedup's target table: computed from the rows of the same run, per review configuration."""
    from bench.speedup import Row, Tokens, targets

    def row(width: int, config: str, span: float, same: float, tokens: int) -> Row:
        return Row(
            width, config, spans=[span], tokens=Tokens(tokens, 0), same=[(same, 2 * width)], same_tokens=Tokens(1000, 0)
        )

    rows = [
        row(1, "model review", 0.62, 0.41, 2000),  # 1.51x the single loop: not met
        row(1, "machine check", 0.42, 0.41, 1800),
        row(8, "model review", 0.87, 3.25, 990),  # 3.74x, 1.09x the 0.80 s bound, 0.99x the tokens
        row(8, "machine check", 0.95, 3.25, 1010),  # 3.42x, 1.19x the bound, 1.01x the tokens
    ]
    table = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in targets(rows, 0.2)[2:]}
    assert table["width 1: makespan <= 1.5x the single loop"] == ["**not met**", "met |"]
    assert table["width 8: speed-up >= 3.7x over the single loop"] == ["met", "**not met** |"]
    assert table["width 8: makespan <= 1.15x its bound"] == ["met", "**not met** |"]
    assert table["width 8: tokens <= the single loop's"] == ["met", "**not met** |"]


def test_ledger_reports_the_pair_against_its_targets_its_cost_above_a_ping_and_its_floor() -> None:
    """bench.ledger's target table, from the rows of the run: the held pair against 2.2 PINGs and the
    tenant path's extra, what the pair costs above a PING (the part a faster loopback keeps), the
    pair against the least one script can cost for it (`FLOOR_SCRIPT`), and what a settle adds to
    the step write that carries it instead."""
    from bench.ledger import Stats, targets

    def s(p50_ms: float, server_us: float) -> Stats:
        return Stats(1000.0, p50_ms, 2 * p50_ms, server_us)

    r = {
        "ping": s(0.021, 0.0),
        "ping_pool": s(0.026, 0.0),
        "floor": s(0.032, 9.0),
        "at once|goal only": s(0.080, 30.0),
        "at once|goal + tenant pool, tokens + USD": s(0.084, 36.0),
        "held|goal only": s(0.058, 27.5),
        "held|goal + tenant pool, tokens + USD": s(0.066, 35.0),
        "step": s(0.030, 3.0),
        "carry": s(0.049, 21.0),
    }

    def table() -> dict[str, list[str]]:
        return {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in targets([(1, r)])}

    rows = table()
    assert rows["pair p50 <= 2.2x PING p50, 1 client, settle held"][:2] == ["2.76x", "**not met** (1.26x the target) |"]
    assert rows["tenant pool + USD pair p50 <= goal-only + 10%, 1 client, settle held"][:2] == ["+14%", "**not met** |"]
    above = rows["the pair's cost above a PING, 1 client, settle held: p50"]
    assert above[0] == "+37 µs" and above[1].startswith("of which in Redis 27.5 µs")
    floor = next(v for k, v in rows.items() if k.startswith("the least one script can cost for a pair here"))
    assert floor[0] == "32 µs, 1.52x PING"
    assert floor[1].startswith("the held pair is 1.81x it: +26 µs of the ledger's own logic, +18.5 µs of it in Redis")
    carried = rows["an executor's settle carried by its step write instead (`AttemptStore`), 1 client: p50"]
    assert carried[0] == "+19 µs on that write"
    assert carried[1].startswith("for comparison: the step write 30 µs alone, 49 µs with the close")
    r["held|goal only"] = s(0.046, 20.0)
    rows = table()
    assert rows["pair p50 <= 2.2x PING p50, 1 client, settle held"][:2] == ["2.19x", "met |"]


def test_throughput_reports_each_target_met_or_not_from_the_run() -> None:
    """bench.throughput's target table: jobs/s against raw arq's, commands and CPU per job, per row."""
    from bench.throughput import Result, targets

    fast = Result(1, seconds=1.0, goals=10, tasks=40, jobs=100, cpu=0.25, commands=3000)  # 100 jobs/s, 2.5 ms, 30
    slow = Result(2, seconds=1.0, goals=10, tasks=40, jobs=100, cpu=0.5, commands=8600)  # 5 ms, 86 commands
    peer = Result(1, seconds=1.0, goals=0, tasks=0, jobs=300, cpu=0.1, commands=6900)  # 300 jobs/s
    table = targets([(fast, peer), (slow, Result(2, 1.0, 0, 0, 400, 0.1, 9000))])
    assert table[2] == "| 1 | met | met | met |"  # 0.33x, 30 commands, 2.5 ms
    assert table[3] == "| 2 | **not met** | **not met** | **not met** |"  # 0.25x, 86 commands, 5 ms


def test_throughput_reports_the_floor_of_the_parts_every_job_uses() -> None:
    """bench.throughput's floor row: a raw arq worker's CPU and commands per job (its enqueue taken
    out) plus, per model call a job makes, the SDK's CPU and the ledger's commands."""
    from bench.floor import Floor
    from bench.throughput import Result, floor_table

    ours = Result(1, seconds=1.0, goals=10, tasks=40, jobs=100, cpu=0.5, commands=8000, calls=130)
    peer = Result(1, seconds=1.0, goals=0, tasks=0, jobs=300, cpu=0.1, commands=6900)  # 0.33 ms, 23 commands
    under = Floor(
        sdk_cpu_ms_per_call=2.0,
        metered_cpu_ms_per_call=2.5,
        ledger_commands_per_call=14.0,
        enqueue_commands_per_job=6.0,
    )
    table = floor_table([(ours, peer)], under)
    assert "2.00 ms of CPU per model call" in table[0] and "14.0 Redis commands per call" in table[0]
    # 0.33 + 1.3 x 2.0 = 2.9 ms; 23 - 6 + 1.3 x 14 = 35.2 commands; own CPU 5.0 - 2.93 = 2.1 ms (issue 32: <= 4)
    assert table[-1] == "| 1 | 1.30 | 2.9 | 3 | 35.2 | 35 | 2.1 | met |"
    heavy = Result(1, seconds=1.0, goals=10, tasks=40, jobs=100, cpu=0.9, commands=8000, calls=130)  # 9 ms per job
    assert floor_table([(heavy, peer)], under)[-1].endswith("| 6.1 | **not met** (1.52x the target) |")


def test_speedup_reports_the_workers_own_cpu_per_goal_net_of_its_model_calls() -> None:
    from bench.floor import Floor
    from bench.speedup import Row, cpu_table

    row = Row(8, "model review", calls=26, spans=[1.0, 1.2, 0.9], cpu=[0.30, 0.20, 0.25])
    under = Floor(
        sdk_cpu_ms_per_call=3.0, metered_cpu_ms_per_call=4.0, ledger_commands_per_call=14, enqueue_commands_per_job=6
    )
    # median CPU 250 ms, of which 26 x 3.0 = 78 ms the SDK's: 172 ms taskloom's own, 0.17 of the 1.0 s makespan
    assert cpu_table([row], under)[-1] == "| 8 | model review | 250 | 78 | 172 | 0.17 |"


def test_profile_lists_the_top_self_time_entries_per_job(tmp_path: Any) -> None:
    """bench.profile adds up the workers' stats files and lists the entries by their own time."""
    import cProfile

    from bench.profile import table

    def busy() -> int:
        return sum(i * i for i in range(200_000))

    files = []
    for name in ("a", "b"):
        profiler = cProfile.Profile()
        profiler.runcall(busy)
        files.append(str(tmp_path / f"{name}.prof"))
        profiler.dump_stats(files[-1])
    lines = table(files, top=3, per=10)
    rows = lines.splitlines()
    assert rows[0].startswith("| # | function | calls | self ms per job (of 10 jobs)")
    assert len(rows) == 2 + 3 + 1 and rows[-1].startswith("| | all functions |")
    assert "`<genexpr>` (test_bench_smoke.py:" in lines or "`<genexpr>` (tests/test_bench_smoke.py:" in lines
    assert "| 400002 |" in lines  # the generator's calls, both files added up
    from bench.profile import areas

    by_area = areas(files, per=10).splitlines()
    assert by_area[0] == "| area | self ms per job | share |"
    assert any(row.startswith("| other |") or row.startswith("| built-ins |") for row in by_area)


def test_streaming_targets_are_judged_from_the_rows_of_the_run() -> None:
    """bench.streaming's target table: CPU against the streaming-off row, PUBLISH per batch, none unheard."""
    from bench.streaming import Row, table

    rows = [
        Row("off", 40, 2.0, 16.0, 0.0, 0.0),
        Row("on, nobody", 40, 2.1, 16.3, 0.0, 0.25),
        Row("on, listener", 40, 60.0, 68.0, 50.0, 0.25, 50.0),
        Row("regardless", 40, 55.0, 21.0, 0.0, 5.0),
    ]
    out = table(rows, 1000, 0.02, "test")
    assert "| streaming adds <= 10% worker CPU per call, nobody listening | +5.0% | met |" in out
    assert "a listener | +2900.0%" in out and "MISSED" in out
    assert "1.00 PUBLISH per batch" in out and "1.005 | met |" in out


def test_critical_splits_a_goals_excess_over_its_bound_into_phases_from_its_log() -> None:
    """bench.critical: each phase from the goal's own log lines (another goal's are not its), the
    model delays taken out, and the phases adding up to the makespan less its bound."""
    from bench.critical import goal_events, phases

    def line(at: float, event: str, goal: str = "g1", **extra: str) -> str:
        stamp = datetime.fromtimestamp(1_000 + at, UTC).isoformat().replace("+00:00", "Z")
        return json.dumps({"timestamp": stamp, "event": event, "goal_id": goal, **extra})

    lines = [
        "not json",
        line(0.212, "plan.stored"),
        line(0.215, "execute.start"),
        line(0.230, "execute.start"),
        line(0.240, "execute.start", goal="g2"),  # another goal's: not this one's last start
        line(0.640, "execute.result"),
        line(0.660, "execute.result"),
        line(0.670, "job.start", function="review"),
        line(0.672, "job.start", function="review_goal"),
    ]
    events = goal_events(lines)
    assert set(events) == {"g1", "g2"}
    got = phases(events["g1"], 1_000.0, 1_000.880, delay=0.2)
    want = {"plan": 0.012, "fan-out": 0.018, "tasks": 0.030, "hand-off": 0.012, "final": 0.008}
    assert got == pytest.approx(want, abs=1e-4)
    assert sum(got.values()) == pytest.approx(0.880 - 4 * 0.2, abs=1e-4)
    with pytest.raises(ValueError, match=r"no plan\.stored event"):
        phases(events["g2"], 1_000.0, 1_000.880, delay=0.2)


def test_sampled_profile_counts_leaf_frames_and_leaves_idle_threads_out(tmp_path: Path) -> None:
    stacks = tmp_path / "123.txt"
    stacks.write_text(
        "main (a.py:1);send (mux.py:9) 6\n"
        "main (a.py:1);parse (b.py:2) 3\n"
        "run (threading.py:1);_DaemonThreads._work (executor/toolkit.py:114) 90\n"
        "main (a.py:1);send (mux.py:9) 1\n"
    )
    out = sampled([str(stacks)], top=5)
    assert "| 1 | `send (mux.py:9)` | 7 | 70.0% |" in out
    assert "| 2 | `parse (b.py:2)` | 3 | 30.0% |" in out
    assert "_DaemonThreads" not in out and "| | all samples | 10 | 100% |" in out


def test_first_call_quarters_name_when_each_share_had_arrived() -> None:
    arrivals = [i / 10 for i in range(1, 101)]  # 100 calls, the n-th at n/10 s
    assert _quarters(arrivals) == "10% 1.00, 25% 2.50, 50% 5.00, 75% 7.50, all 10.00"
    assert _quarters([]) == "none"
