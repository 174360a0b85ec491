"""The `taskloom` command line, run as a real process."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

from helpers import live_redis_servers_under, run_cli


def _embedded_env(subprocess_env: dict[str, str], home: Path) -> dict[str, str]:
    env = dict(subprocess_env)
    del env["TASKLOOM_REDIS_URL"]
    env["TASKLOOM_HOME"] = str(home)
    return env


def test_submit_and_status_on_the_embedded_server_leave_no_server_running(
    subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """Without TASKLOOM_REDIS_URL: submit prints the id, status shows the goal, no redis-server remains."""
    env = _embedded_env(subprocess_env, tmp_path / "home")
    sub = run_cli("submit", "hello", "--json", env=env)
    assert sub.returncode == 0, sub.stderr
    gid = json.loads(sub.stdout)["goal_id"]
    st = run_cli("status", gid, "--json", env=env)
    assert st.returncode == 0, st.stderr
    body = json.loads(st.stdout)
    assert body["id"] == gid and body["goal"]["text"] == "hello" and body["state"] == "submitted"
    assert (tmp_path / "home" / "appendonlydir").exists() or (tmp_path / "home" / "appendonly.aof").exists()
    assert live_redis_servers_under(tmp_path / "home") == []


def test_unknown_goal_exits_1_with_a_message(subprocess_env: dict[str, str]) -> None:
    """status of an id that does not exist says so on stderr and exits 1."""
    res = run_cli("status", "no-such-id", env=subprocess_env)
    assert res.returncode == 1
    assert "no-such-id" in res.stderr and "not found" in res.stderr


def test_empty_goal_exits_2_naming_the_field_and_stores_nothing(subprocess_env: dict[str, str], tmp_path: Path) -> None:
    """submit "" exits 2, names `text`, and no goal (nor even a server) appears."""
    env = _embedded_env(subprocess_env, tmp_path / "home")
    res = run_cli("submit", "", "--json", env=env)
    assert res.returncode == 2
    assert "text" in res.stderr and res.stdout == ""
    assert not (tmp_path / "home" / "redis.sock").exists()


def test_bad_budget_and_bad_setting_exit_2(subprocess_env: dict[str, str]) -> None:
    """A negative budget names budget_tokens; a bad TASKLOOM_ variable is named too."""
    res = run_cli("submit", "x", "--budget", "-5", env=subprocess_env)
    assert res.returncode == 2 and "budget_tokens" in res.stderr
    env = dict(subprocess_env, TASKLOOM_POLL_DELAY="often")
    res = run_cli("status", "whatever", env=env)
    assert res.returncode == 2 and "TASKLOOM_POLL_DELAY" in res.stderr


def test_events_cancel_and_wait_round_trip(subprocess_env: dict[str, str]) -> None:
    """events lists goal.submitted with a position; cancel ends the goal; wait then exits 3 (not succeeded)."""
    gid = json.loads(run_cli("submit", "hello", "--json", env=subprocess_env).stdout)["goal_id"]
    ev = run_cli("events", gid, "--json", env=subprocess_env)
    lines = [json.loads(x) for x in ev.stdout.splitlines()]
    assert [e["type"] for e in lines] == ["goal.submitted"] and lines[0]["position"]
    after = run_cli("events", gid, "--json", "--after", lines[0]["position"], env=subprocess_env)
    assert after.returncode == 0 and after.stdout == ""
    assert run_cli("wait", gid, "--timeout", "0.3", env=subprocess_env).returncode == 4
    res = run_cli("cancel", gid, "--json", env=subprocess_env)
    assert res.returncode == 0 and json.loads(res.stdout)["changed"] is True
    res = run_cli("wait", gid, "--json", env=subprocess_env)
    assert res.returncode == 3 and json.loads(res.stdout)["state"] == "cancelled"


def _command_rows(help_text: str) -> list[tuple[str, str]]:
    """The Commands panel of `--help` as (command name or "", description column) rows."""
    lines = help_text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("╭") and "Commands" in ln)
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("╰"))
    inner = [ln[2:-2] for ln in lines[start + 1 : end]]  # without the box's "│ " and " │"
    first_name = inner[0].split(" ", 1)[0]
    width = len(inner[0]) - len(inner[0][len(first_name) :].lstrip(" "))  # where descriptions start
    return [(row[:width].strip(), row[width:]) for row in inner]


def test_the_command_list_wraps_each_summary_to_the_terminal() -> None:
    """Each command's summary in `taskloom --help` (and `taskloom tenant --help`) fills every line before
    it breaks: no line of a summary ends early because its docstring was wrapped in the source."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TASKLOOM_", "ANTHROPIC_"))}
    env["COLUMNS"] = "80"
    for args in (("--help",), ("tenant", "--help")):
        res = run_cli(*args, env=env)
        assert res.returncode == 0, res.stderr
        rows = _command_rows(res.stdout)
        assert len(rows) >= 2
        desc_width = len(rows[0][1])
        for (_, text), (next_name, next_text) in itertools.pairwise(rows):
            if next_name:  # the next row starts another command
                continue
            first_word = next_text.split()[0]
            assert len(text.rstrip()) + 1 + len(first_word) > desc_width, (
                f"{args}: a summary line ends early: {text.rstrip()!r}, then {next_text.strip()!r}"
            )
