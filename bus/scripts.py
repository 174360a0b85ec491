"""The Lua scripts of `bus`, kept as Lua files under `bus/lua/` and read once, at import.

A script that shares a library (`ledger_lib.lua`, `ratelimit_lib.lua`) is the library's text followed
by its own: Redis runs one self-contained script per call, so the functions are prepended here rather
than required at run time.

Redis 7 and later also run the scripts of a library as Redis Functions (`library`): the library is
loaded once (`FUNCTION LOAD`), its definitions run once, and each call is an `FCALL` of one function.
A script run with `EVALSHA` runs the whole library's definitions on every call first: for the
ledger's fold, about 8 µs of Redis's time per model call on a 2-core machine (bench/RESULTS.md).
The function and the script are the same text (the library, then the script's own, inside a
function of `KEYS` and `ARGV`), so they do the same. A server without Functions (Redis 6) answers
`FCALL` with "unknown command": that client then keeps `EVALSHA`. A server that lost the library (a
restart without persistence, `FUNCTION FLUSH`) answers "Function not found": it is loaded again.
The library's name holds a digest of its text, so workers of two versions each call their own;
an older version's library stays on the server (`FUNCTION DELETE` removes it).
"""

from __future__ import annotations

import asyncio
import hashlib
import weakref
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

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


class Function:
    """A script's twin in a library of Redis Functions (`library`): its function's name, and the
    library's name and text to load."""

    __slots__ = ("library", "name", "source")

    def __init__(self, library: str, source: str, name: str) -> None:
        self.library = library
        self.source = source
        self.name = name


# Script text -> its function, for the scripts `library` built.
_FUNCTIONS: dict[str, Function] = {}


def library(module: str, shared: str, scripts: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """The scripts `scripts` (name -> the files of its own text, after the shared library file
    `shared`) as `lua` joins them, by name; each is also made a function of one library of Redis
    Functions, which `registered` scripts call where the server has them."""
    lib = lua(shared)
    bodies = {name: lua(*files) for name, files in scripts.items()}
    digest = hashlib.sha1("\0".join([lib, *bodies.values()]).encode()).hexdigest()[:16]
    lib_name = f"taskloom_{module}_{digest}"
    text = [f"#!lua name={lib_name}\n", lib]
    for name, body in bodies.items():
        # Inside a function whose parameters are named as EVAL's globals: the same text runs as both.
        text.append(f"\nredis.register_function('{lib_name}_{name}', function(KEYS, ARGV)\n{body}\nend)\n")
    source = "".join(text)
    out = {}
    for name, body in bodies.items():
        out[name] = lib + body
        _FUNCTIONS[out[name]] = Function(lib_name, source, f"{lib_name}_{name}")
    return out


class Script:
    """A Lua script of one client: `await script(keys=..., args=...)` runs it by its SHA-1 (`EVALSHA`),
    loading it first when the server does not know it (a new, restarted or flushed server answers
    NOSCRIPT); or, for a script of a `library`, as its function (`FCALL`) where the server has
    Functions. redis-py's `register_script` does the same, but its call first asks whether its client
    is a pipeline, an isinstance check against a runtime protocol: about 10 µs of CPU on every script
    call (bench/RESULTS.md, "Tenant grants"), and a job makes a few dozen.

    Pipelines (`bus.batch`, `bus.durability`) run it by `sha` alone: the same text either way."""

    __slots__ = ("function", "redis", "script", "sha")

    def __init__(self, redis: Any, source: str) -> None:
        self.redis = redis
        self.script = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self.function = _FUNCTIONS.get(source)

    async def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        if self.function is not None:
            try:
                return await self.redis.execute_command("FCALL", self.function.name, len(keys), *keys, *args)
            except ResponseError as exc:
                if not await self.function_missing(exc):
                    raise
            if self.function is not None:
                return await self.redis.execute_command("FCALL", self.function.name, len(keys), *keys, *args)
        try:
            return await self.redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            self.sha = await self.redis.script_load(self.script)
            return await self.redis.evalsha(self.sha, len(keys), *keys, *args)

    async def function_missing(self, exc: ResponseError) -> bool:
        """After an FCALL's error: True when it was the function's absence, now mended (its library
        loaded, or this script set to run by EVALSHA: on a server without Functions, or a user whose
        ACL does not allow them); False for an error of the script itself."""
        text = str(exc)
        if isinstance(exc, NoPermissionError) or text.startswith("unknown command"):
            self.function = None
            return True
        if "Function not found" not in text or self.function is None:
            return False
        # One load per client and library at a time: a fleet's calls in flight all find the library
        # gone at once (a restarted server), and each load compiles the whole library.
        name = self.function.library
        loads = _LOADS.setdefault(self.redis, {})
        pending = loads.get(name)
        if pending is None:
            pending = loads[name] = asyncio.ensure_future(_load(self.redis, self.function.source))
            pending.add_done_callback(lambda _: loads.pop(name, None))
        if not await asyncio.shield(pending):
            self.function = None
        return True


async def _load(redis: Any, source: str) -> bool:
    """Load a library of Functions: True when the server has it now, False when this client cannot
    load it (not allowed, a server in trouble): its scripts then run by EVALSHA."""
    try:
        await redis.execute_command("FUNCTION", "LOAD", source)
    except ResponseError as exc:
        return "already exists" in str(exc)  # loaded meanwhile by another process: the same text
    return True


# Per client, the libraries being loaded (`Script.function_missing`).
_LOADS: weakref.WeakKeyDictionary[Any, dict[str, asyncio.Future[bool]]] = weakref.WeakKeyDictionary()


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
