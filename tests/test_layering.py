"""The layering rules, read from the import statements of every module (ast, no import side effects).

- `llm` imports nothing of ours; `bus` imports only `llm`; a role (planner, executor, critic) imports
  only `bus` and `llm`, never another role and never the composition root `taskloom`.
- Redis belongs to `bus`: a module elsewhere that imports `redis`, or holds a Lua script, is a violation.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
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


LUA_MARKERS = ("register_script(", "redis.call(", ".eval(", ".evalsha(")


def outside_bus(breaks_rule: Callable[[Path], bool]) -> set[str]:
    """Modules outside bus/ for which `breaks_rule` holds."""
    return {
        str(path.relative_to(ROOT))
        for package in OURS
        if package != "bus"
        for path in modules_of(package)
        if breaks_rule(path)
    }


def imports_redis(path: Path) -> bool:
    # The package only names relative imports, which are never `redis`.
    return any(name == "redis" or name.startswith("redis.") for name in imported_modules(path, package="."))


def holds_lua(path: Path) -> bool:
    text = path.read_text()
    return any(marker in text for marker in LUA_MARKERS)


def test_only_bus_talks_to_redis() -> None:
    """No module outside bus/ imports redis: roles and the composition root go through bus."""
    assert outside_bus(imports_redis) == set()


def test_every_lua_script_lives_in_bus() -> None:
    """No module outside bus/ registers, runs or spells out a Lua script: state changes live in bus."""
    assert outside_bus(holds_lua) == set()


def test_the_redis_and_lua_checks_see_a_violation(tmp_path: Path) -> None:
    """A sample importing redis and registering a script is caught by both checks."""
    sample = tmp_path / "x.py"
    sample.write_text('from redis.asyncio import Redis\nS = r.register_script("return 1")\n')
    assert imports_redis(sample) and holds_lua(sample)


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The ast reader finds a role importing another role, so the rules above are not vacuous."""
    sample = tmp_path / "x.py"
    sample.write_text("from planner.dag import validate\nimport critic.checks\nfrom . import loop\n")
    assert imported_modules(sample, package="executor") == {"planner.dag", "critic.checks", "executor"}
