"""`taskloom demo` end to end: embedded Redis, the offline model, the demo toolkit, in-process workers."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import live_redis_servers_under, run_cli


def test_demo_succeeds_offline_with_a_retry_and_leaves_no_server(
    subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """Demo exits 0 answering every order (A100 with the deadline the critic asked for); no server remains."""
    env = dict(subprocess_env)
    del env["TASKLOOM_REDIS_URL"]  # the embedded server, as on a fresh machine
    env["TASKLOOM_HOME"] = str(tmp_path / "home")
    res = run_cli("demo", "--json", env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    body = json.loads(res.stdout.strip().splitlines()[-1])
    assert body["state"] == "succeeded"
    answer = body["answer"]
    assert "A100: can be refunded" in answer and "A101: cannot be refunded" in answer
    assert "Refund deadline: 2026-10-20" in answer  # the retry acted on the critic's feedback
    assert "A107: cannot be refunded: it was a final-sale item" in answer
    assert 0 < body["tokens_spent"] <= body["budget"]
    gid = body["goal_id"]
    status = json.loads(run_cli("status", gid, "--json", env=env).stdout)
    attempts = {t["task_id"]: t["attempt"] for t in status["tasks"]}
    assert max(attempts.values()) == 2 and len(attempts) == 4  # one task was retried once
    events = [json.loads(x)["type"] for x in run_cli("events", gid, "--json", env=env).stdout.splitlines()]
    assert "critic.verdict" in events and "tool.call" in events
    mermaid = run_cli("dag", gid, env=env).stdout
    assert mermaid.startswith("flowchart") and mermaid.count("-->") == 3
    dag = json.loads(run_cli("dag", gid, "--format", "json", env=env).stdout)
    assert len(dag["tasks"]) == 4 and all(t["state"] == "done" for t in dag["tasks"])
    assert run_cli("dag", gid, "--format", "svg", env=env).returncode == 2
    assert json.loads(run_cli("dag", gid, "--json", env=env).stdout) == dag
    assert live_redis_servers_under(tmp_path / "home") == []
