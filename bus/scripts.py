"""The Lua scripts of `bus`, kept as Lua files under `bus/lua/` and read once, at import.

A script that shares a library (`ledger_lib.lua`, `ratelimit_lib.lua`) is the library's text followed
by its own: Redis runs one self-contained script per call, so the functions are prepended here rather
than required at run time.
"""

from __future__ import annotations

import weakref
from functools import cache
from pathlib import Path
from typing import Any

from redis.commands.core import AsyncScript

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


# Per client, its scripts as registered: redis-py's `register_script` hashes the script's text
# (SHA-1) every time, and a job builds a dozen such objects (its attempt store, tenant slots,
# approvals...). The objects hold nothing but the client, the text and its SHA, so one per client
# and script is shared. Weak: a closed client's entries go with it.
_REGISTERED: weakref.WeakKeyDictionary[Any, dict[str, AsyncScript]] = weakref.WeakKeyDictionary()


def registered(redis: Any, source: str) -> AsyncScript:
    """`redis.register_script(source)`, made once per client and script text."""
    scripts = _REGISTERED.get(redis)
    if scripts is None:
        scripts = _REGISTERED[redis] = {}
    script = scripts.get(source)
    if script is None:
        script = scripts[source] = redis.register_script(source)
    return script
