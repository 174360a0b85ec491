"""The Lua scripts live in bus/lua/*.lua and ship with the package."""

from __future__ import annotations

import tomllib
import uuid
from pathlib import Path

import pytest
from arq.connections import ArqRedis

from bus.scripts import LUA_DIR, lua, registered

ROOT = Path(__file__).resolve().parent.parent


def test_package_data_ships_every_lua_file() -> None:
    """A non-editable install has the scripts: pyproject's package data for `bus` matches each file."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {path for pattern in data.get("bus", []) for path in (ROOT / "bus").glob(pattern)}
    files = set(LUA_DIR.glob("*.lua"))
    assert files, "bus/lua holds no script"
    assert files <= shipped, f"not in package data: {sorted(p.name for p in files - shipped)}"


def test_a_script_is_its_library_then_its_own_text() -> None:
    """The library's functions come first, so the script that calls them can."""
    joined = lua("ledger_lib", "tenants_reset")
    assert joined == (LUA_DIR / "ledger_lib.lua").read_text() + (LUA_DIR / "tenants_reset.lua").read_text()
    assert joined.index("local function period_label") < joined.index("period_label(period, now())")


def test_an_unknown_script_is_an_error_naming_it() -> None:
    with pytest.raises(FileNotFoundError, match=r"no_such_script\.lua"):
        lua("no_such_script")


async def test_a_script_the_server_does_not_know_is_loaded_and_run(redis: ArqRedis) -> None:
    """`registered` scripts run by SHA-1; one the server has never seen (a new or flushed server) is
    loaded on its NOSCRIPT answer and run, once per client and text."""
    token = uuid.uuid4().hex
    script = registered(redis, f"return {{'{token}', KEYS[1], ARGV[1]}}")
    assert script is registered(redis, script.script)
    assert (await redis.script_exists(script.sha)) == [False]
    assert await script(keys=["k"], args=[7]) == [token.encode(), b"k", b"7"]
    assert (await redis.script_exists(script.sha)) == [True]
    assert await script(keys=["j"], args=["x"]) == [token.encode(), b"j", b"x"]
