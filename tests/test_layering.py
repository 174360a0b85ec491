"""The layering rules, read from the import statements of every module (ast, no import side effects).

- `llm` imports nothing of ours; `bus` imports only `llm`; a role (planner, executor, critic) imports
  only `bus` and `llm`, never another role and never the composition root `taskloom`.
- Redis belongs to `bus`: a module elsewhere that imports `redis` is a violation, except the ones
  listed in `REDIS_OUTSIDE_BUS` (empty now; it may only shrink), and so is one that holds a Lua script.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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

# Modules outside `bus` that still talk to Redis directly. The list may only shrink: the test fails
# both when a new module starts importing `redis` and when a listed one no longer does.
REDIS_OUTSIDE_BUS: set[str] = set()


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


def redis_importers() -> set[str]:
    found = set()
    for package in OURS:
        if package == "bus":
            continue
        for path in modules_of(package):
            if any(name == "redis" or name.startswith("redis.") for name in imported_modules(path)):
                found.add(str(path.relative_to(ROOT)))
    return found


LUA_MARKERS = ("register_script(", "redis.call(", ".eval(", ".evalsha(")


def lua_holders() -> set[str]:
    """Modules outside bus/ that hold or run a Lua script."""
    found = set()
    for package in OURS:
        if package == "bus":
            continue
        for path in modules_of(package):
            text = path.read_text()
            if any(marker in text for marker in LUA_MARKERS):
                found.add(str(path.relative_to(ROOT)))
    return found


def test_every_lua_script_lives_in_bus() -> None:
    """No module outside bus/ registers, runs or spells out a Lua script: state changes live in bus."""
    assert lua_holders() == set()


def test_only_bus_talks_to_redis_except_the_listed_modules() -> None:
    """A new module outside bus/ importing redis fails; so does a listed one that no longer needs to."""
    found = redis_importers()
    assert found - REDIS_OUTSIDE_BUS == set(), "new modules outside bus/ import redis"
    assert REDIS_OUTSIDE_BUS - found == set(), "these modules no longer import redis: drop them from the list"


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The ast reader finds a role importing another role, so the rules above are not vacuous."""
    sample = tmp_path / "x.py"
    sample.write_text("from planner.dag import validate\nimport critic.checks\nfrom . import loop\n")
    assert imported_modules(sample, package="executor") == {"planner.dag", "critic.checks", "executor"}
