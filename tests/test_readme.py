"""The README's "Testing your agents" examples run as written: a user's test suite in a temp directory,
with the plugin loaded as a user gets it, the cassette recorded against the fake Messages API, then replayed."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

from llm.demo import DemoModel
from llm.testing import FakeAnthropicServer, responder_from_model

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = "taskloom.testing.plugin"


def readme_files() -> dict[str, str]:
    """The section's ```python blocks that start with `# <file>.py`, by file name."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Testing your agents", 1)[1].split("\n## ", 1)[0]
    files = {}
    for block in re.findall(r"```python\n(.*?)```", section, re.S):
        m = re.match(r"# (\w+\.py)\n", block)
        if m:
            files[m.group(1)] = block
    return files


def pytest_in(where: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # Installed (CI: pip install -e), the pytest11 entry point loads the plugin; from a source tree, -p does.
    installed = any(ep.value == PLUGIN for ep in importlib.metadata.entry_points(group="pytest11"))
    plugin = [] if installed else ["-p", PLUGIN]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, *args],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_readme_examples_run_and_the_cassette_records_then_replays(tmp_path: Path) -> None:
    """The ScriptedModel example passes; the cassette example records once over HTTP, then replays offline."""
    files = readme_files()
    assert set(files) == {"support_tools.py", "test_support_tools.py", "test_refund_flow.py"}
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "TASKLOOM_"))}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")])
    cassette = tmp_path / "cassettes" / "refund_flow.jsonl"

    # Record, as the README says, against a "real" model: the Anthropic SDK talking to the fake API,
    # which answers with the demo model's rules.
    with FakeAnthropicServer() as fake:
        fake.respond_with(responder_from_model(DemoModel(latency=0)))
        record_env = dict(
            base,
            TASKLOOM_RECORD="cassettes/refund_flow.jsonl",  # relative to the test run's directory
            TASKLOOM_MODEL="claude-test",
            ANTHROPIC_API_KEY="sk-ant-readme-test-key",
            ANTHROPIC_BASE_URL=fake.base_url,
        )
        recorded = pytest_in(tmp_path, "test_refund_flow.py", env=record_env)
        assert recorded.returncode == 0, recorded.stdout[-4000:] + recorded.stderr[-2000:]
        served = len(fake.message_requests)
    assert served > 0
    assert len(cassette.read_text().splitlines()) == served
    assert "sk-ant-readme-test-key" not in cassette.read_text()

    # Replay in "CI": no key, no model, the fake API gone; and the ScriptedModel example.
    replayed = pytest_in(tmp_path, env=base)
    assert replayed.returncode == 0, replayed.stdout[-4000:] + replayed.stderr[-2000:]
    assert "2 passed" in replayed.stdout, replayed.stdout[-2000:]
