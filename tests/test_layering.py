"""The layering rules, read from the import statements of every module (ast, no import side effects).

- `llm` imports nothing of ours; `bus` imports only `llm`; a role (planner, executor, critic) imports
  only `bus` and `llm`, never another role and never the composition root `taskloom`.
- Redis belongs to `bus`: elsewhere, a module that imports `redis` or arq's `ArqRedis`, sends Redis
  commands itself, or holds or runs a Lua script is a violation, and only the testing kit runs
  scripts on fakeredis. `bench/` is held to the same rules; a benchmark that measures Redis or arq
  themselves is sanctioned by name, with the reason (`Rule.allowed`).
- No Lua in Python strings, in `bus` either: scripts are files under `bus/lua/`.

Each rule has a test on the real tree and a test that breaks it on a scratch tree and sees it fail.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from arq.connections import ArqRedis

ROOT = Path(__file__).resolve().parent.parent
OURS = ("bus", "llm", "planner", "executor", "critic", "taskloom")
ROLES = ("planner", "executor", "critic")

# Which of our packages each package may import.
ALLOWED: dict[str, set[str]] = {
    "llm": set(),
    "bus": {"llm"},
    "planner": {"bus", "llm"},
    "executor": {"bus", "llm"},
    "critic": {"bus", "llm"},
    "taskloom": set(OURS),
}


def imported_modules(path: Path, package: str | None = None) -> set[str]:
    """Absolute module names imported by one file (a relative import counts as its own package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = package or path.relative_to(ROOT).parts[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.add(package)
            elif node.module:
                names.add(node.module)
    return names


def modules_of(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def layering_violations(package: str) -> list[str]:
    """`file -> imported package` for every import of ours that the rules forbid."""
    found = []
    for path in modules_of(package):
        for name in imported_modules(path):
            top = name.split(".")[0]
            if top in OURS and top != package and top not in ALLOWED[package]:
                found.append(f"{path.relative_to(ROOT)} -> {name}")
    return found


@pytest.mark.parametrize("package", OURS)
def test_package_imports_follow_the_layering(package: str) -> None:
    """No role imports another role or taskloom; llm imports nothing of ours; bus imports only llm."""
    assert layering_violations(package) == []


# -- Redis belongs to bus ----------------------------------------------------------------------------

# Methods of the arq client (redis-py's commands and arq's own): a call of one on a receiver named
# `redis` (`client.redis.hset(...)`, `redis.pexpire(...)`) sends a Redis command.
# Opening and closing a client sends no command of anyone's choosing.
LIFECYCLE = frozenset({"aclose", "close", "initialize", "from_url", "from_pool"})
REDIS_METHODS = frozenset(name for name in dir(ArqRedis) if not name.startswith("_")) - LIFECYCLE
LUA_MARKERS = ("register_script(", "redis.call(", "redis.pcall(", ".eval(", ".evalsha(", "script_load(")
SCRIPT_RUNNERS = ("register_script(", "script_load(", ".eval(", ".evalsha(")


def _imports(source: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def imports_redis_source(source: str) -> bool:
    return any(name == "redis" or name.startswith("redis.") for name in _imports(source))


def holds_lua_source(source: str) -> bool:
    """Registers, loads, runs or spells out a Lua script."""
    return any(marker in source for marker in LUA_MARKERS)


def lua_in_strings(source: str) -> bool:
    """A Python string holding Lua (a script calling Redis)."""
    return any(
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and ("redis.call(" in node.value or "redis.pcall(" in node.value)
        for node in ast.walk(ast.parse(source))
    )


def runs_scripts_on_fakeredis(source: str) -> bool:
    """Imports fakeredis and loads or runs scripts: a second testing kit."""
    uses_fake = any(name == "fakeredis" or name.startswith("fakeredis.") for name in _imports(source))
    return uses_fake and any(marker in source for marker in SCRIPT_RUNNERS)


def imports_arq_redis(source: str) -> bool:
    return any(name.startswith("arq") and name.endswith(".ArqRedis") for name in _imports(source))


def sends_redis_commands(source: str) -> bool:
    """Calls a Redis command on a receiver named `redis` (`x.redis.hset(...)`, `redis.ping()`)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in REDIS_METHODS:
            receiver = node.func.value
            if (isinstance(receiver, ast.Attribute) and receiver.attr == "redis") or (
                isinstance(receiver, ast.Name) and receiver.id == "redis"
            ):
                return True
    return False


@dataclass(frozen=True)
class Rule:
    """`breaks(source)` must not hold for a module under `scope`, except where `allowed` (a path, or a
    folder ending in `/`, relative to the repository) says why it may."""

    name: str
    breaks: Callable[[str], bool]
    scope: tuple[str, ...]
    allowed: Mapping[str, str] = field(default_factory=dict)

    def is_allowed(self, rel: str) -> bool:
        return any(rel == where or (where.endswith("/") and rel.startswith(where)) for where in self.allowed)


def violations(rule: Rule, root: Path = ROOT) -> set[str]:
    """Modules under `root` that break `rule` (relative paths)."""
    found = set()
    for top in rule.scope:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if not rule.is_allowed(rel) and rule.breaks(path.read_text()):
                found.add(rel)
    return found


PACKAGES_AND_BENCH = (*OURS, "bench")
BUS = {"bus/": "Redis belongs to bus"}
RULES = {
    "redis_import": Rule(
        "imports redis",
        imports_redis_source,
        PACKAGES_AND_BENCH,
        {
            **BUS,
            "bench/ledger.py": "measures the ledger's scripts alone, on a bare client without arq",
            "bench/replicawait.py": "starts replica servers and probes them, below taskloom",
            "bench/roundtrips.py": "attributes every command to a job with MONITOR and CLIENT LIST",
        },
    ),
    "lua_outside_bus": Rule(
        "holds or runs a Lua script",
        holds_lua_source,
        PACKAGES_AND_BENCH,
        {
            **BUS,
            "bench/coalesce.py": "a one-line script as the measured command, the shape of a ledger call",
            "bench/ledger.py": "runs the least script a ledger pair needs (bench/ledger_floor.lua): the pair's floor",
        },
    ),
    "lua_in_strings": Rule("holds Lua in a Python string", lua_in_strings, PACKAGES_AND_BENCH),
    "fakeredis_scripts": Rule(
        "runs scripts on fakeredis",
        runs_scripts_on_fakeredis,
        (*PACKAGES_AND_BENCH, "tests"),
        {**BUS, "taskloom/testing/": "the testing kit: goals in-process on fakeredis"},
    ),
    "arq_redis_import": Rule(
        "imports arq's ArqRedis",
        imports_arq_redis,
        PACKAGES_AND_BENCH,
        {
            **BUS,
            "bench/_harness.py": "runs bare arq pools and workers: the floor the benchmarks compare against",
        },
    ),
    "redis_commands": Rule(
        "sends Redis commands",
        sends_redis_commands,
        PACKAGES_AND_BENCH,
        {
            **BUS,
            "bench/_harness.py": "the benchmarks' own Redis: server probes, command counts, key cleanup",
            "bench/floor.py": "measures a bare arq enqueue, the floor under taskloom's",
            "bench/ledger.py": "measures a bare PING beside the ledger's calls: the round trip's floor",
            "bench/hops.py": "measures a bare arq hop (enqueue, BLPOP, XADD) against taskloom's",
            "bench/recovery.py": "watches an attempt's lease and steps from outside while killing workers",
            "bench/roundtrips.py": "attributes every command to a job with MONITOR and CLIENT LIST",
            "bench/streaming.py": "subscribes a listener to each goal's live channel, as a watcher would",
            "bench/throughput.py": "measures arq's own enqueue and queue drain",
        },
    ),
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_the_tree_keeps_the_rule(name: str) -> None:
    rule = RULES[name]
    assert violations(rule) == set(), f"{rule.name}: move it into bus/ (or sanction it in RULES with the reason)"


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_sanctioned_file_still_needs_it(name: str) -> None:
    """An allowance for a file that no longer breaks the rule is stale: it would hide the next break."""
    rule = RULES[name]
    files = [where for where in rule.allowed if not where.endswith("/")]
    assert [where for where in files if not rule.breaks((ROOT / where).read_text())] == []


# One break per rule, as the review tried them on a scratch copy: (file, source).
BREAKS = {
    "redis_import": ("bench/new_bench.py", "import redis\n"),
    "lua_outside_bus": ("critic/x.py", "S = 'return redis.pcall(\"GET\", KEYS[1])'\n"),
    "lua_in_strings": ("bus/x.py", 'S = """\nlocal v = redis.call("GET", KEYS[1])\nreturn v\n"""\n'),
    "fakeredis_scripts": (
        "tests/test_x.py",
        "import fakeredis\n\n\nasync def f(r):\n    await r.script_load('return 1')\n",
    ),
    "arq_redis_import": ("taskloom/api/x.py", "from arq.connections import ArqRedis\n"),
    "redis_commands": ("planner/x.py", "async def f(client):\n    await client.redis.hset('k', 'f', 'v')\n"),
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_each_rule_fails_on_a_scratch_break(tmp_path: Path, name: str) -> None:
    """The rule's checker, run on a scratch tree with one break, reports exactly that file."""
    rel, source = BREAKS[name]
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text(source)
    assert violations(RULES[name], tmp_path) == {rel}


@pytest.mark.parametrize("name", sorted(name for name, rule in RULES.items() if "bus/" in rule.allowed))
def test_the_same_break_inside_bus_is_allowed(tmp_path: Path, name: str) -> None:
    """The rules sanction bus/ (and only the places they name): the same source there passes."""
    (tmp_path / "bus").mkdir()
    (tmp_path / "bus" / "x.py").write_text(BREAKS[name][1])
    assert violations(RULES[name], tmp_path) == set()


def test_a_command_on_another_receiver_is_not_a_redis_command() -> None:
    """Only a receiver named `redis` counts: `s.store.get(...)` or `s.redis_url.strip()` are no commands."""
    assert not sends_redis_commands("async def f(s):\n    await s.store.get('x')\n    s.redis_url.strip()\n")
    assert sends_redis_commands("async def f(redis):\n    await redis.pexpire('k', 10)\n")


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The ast reader finds a role importing another role, so the rules above are not vacuous."""
    sample = tmp_path / "x.py"
    sample.write_text("from planner.dag import validate\nimport critic.checks\nfrom . import loop\n")
    assert imported_modules(sample, package="executor") == {"planner.dag", "critic.checks", "executor"}
