"""The Lua scripts of `bus`, kept as Lua files under `bus/lua/` and read once, at import.

A script that shares a library (`ledger_lib.lua`, `ratelimit_lib.lua`) is the library's text followed
by its own: Redis runs one self-contained script per call, so the functions are prepended here rather
than required at run time.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

LUA_DIR = Path(__file__).resolve().parent / "lua"


@cache
def lua(*names: str) -> str:
    """The source of the scripts `names` (files `bus/lua/<name>.lua`), joined in order."""
    if not names:
        raise ValueError("lua() needs at least one script name")
    return "".join((LUA_DIR / f"{name}.lua").read_text(encoding="utf-8") for name in names)


def module_scripts(module: str, *names: str) -> tuple[str, ...]:
    """The sources of `bus/lua/<module>_<name>.lua` for each of `names`, in order."""
    return tuple(lua(f"{module}_{name}") for name in names)
