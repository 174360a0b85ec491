"""The Lua scripts of `bus`, kept as Lua files under `bus/lua/` and read once, at import.

A script that shares a library (`ledger_lib.lua`, `ratelimit_lib.lua`) is the library's text followed
by its own: Redis runs one self-contained script per call, so the functions are prepended here rather
than required at run time.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from redis.exceptions import NoScriptError

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


class Script:
    """A Lua script of one client: `await script(keys=..., args=...)` runs it by its SHA-1 (`EVALSHA`),
    loading it first when the server does not know it (a new, restarted or flushed server answers
    NOSCRIPT). redis-py's `register_script` does the same, but its call first asks whether its client
    is a pipeline, an isinstance check against a runtime protocol: about 10 µs of CPU on every script
    call (bench/RESULTS.md, "Tenant grants"), and a job makes a few dozen."""

    __slots__ = ("redis", "script", "sha")

    def __init__(self, redis: Any, source: str) -> None:
        self.redis = redis
        self.script = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        try:
            return await self.redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            self.sha = await self.redis.script_load(self.script)
            return await self.redis.evalsha(self.sha, len(keys), *keys, *args)


# Per client, its scripts: a job builds a dozen objects that run scripts (its attempt store, tenant
# slots, approvals...), and each script's SHA-1 is computed once per client. Weak: a closed client's
# entries go with it.
_REGISTERED: weakref.WeakKeyDictionary[Any, dict[str, Script]] = weakref.WeakKeyDictionary()


def registered(redis: Any, source: str) -> Script:
    """The script `source` on `redis`, made once per client and script text."""
    scripts = _REGISTERED.get(redis)
    if scripts is None:
        scripts = _REGISTERED[redis] = {}
    script = scripts.get(source)
    if script is None:
        script = scripts[source] = Script(redis, source)
    return script
