"""The Lua scripts live in bus/lua/*.lua and ship with the package."""

from __future__ import annotations

import asyncio
import contextlib
import tomllib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from arq.connections import ArqRedis
from redis.exceptions import ResponseError

from bus import scripts
from bus.batch import ScriptCall, run_scripts
from bus.connection import connect
from bus.keys import Keys
from bus.scripts import LUA_DIR, library, lua, registered

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


@pytest.fixture
async def own_library(redis: ArqRedis, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[dict[str, str]]:
    """A library of the ledger's sweep under a name of its own, registered for this test only (a
    script's text maps to one function per process, and this text is also the ledger's sweep);
    deleted from the server afterwards (where the server has Functions)."""
    monkeypatch.setattr(scripts, "_FUNCTIONS", dict(scripts._FUNCTIONS))
    own = library("scriptstest", "ledger_lib", {"sweep": ("ledger_sweep",)})
    yield own
    with contextlib.suppress(ResponseError):
        await redis.execute_command("FUNCTION", "DELETE", scripts._FUNCTIONS[own["sweep"]].library)


async def test_a_library_script_runs_as_its_function_and_its_library_is_loaded_again_when_lost(
    redis: ArqRedis, keys: Keys, own_library: dict[str, str]
) -> None:
    """On a server with Functions (Redis 7+) a script of a `library` is called as its function, the
    library loaded on first use and again after the server lost it; on one without (Redis 6) the
    same text runs by EVALSHA. Either way the reply is the script's."""
    script = registered(redis, own_library["sweep"])
    assert script.function is not None and script.function.name.startswith("taskloom_scriptstest_")
    name = script.function.library
    script_keys = [keys.ledger_open(), keys.ledger_expiry()]
    major = await _major(redis)
    assert await script(keys=script_keys, args=[10]) == [0]
    if major < 7:
        assert script.function is None  # told "unknown command": EVALSHA from now on
        assert (await redis.script_exists(script.sha)) == [True]
        return
    listed = await redis.execute_command("FUNCTION", "LIST", "LIBRARYNAME", name)
    assert len(listed) == 1 and script.function is not None
    await redis.execute_command("FUNCTION", "DELETE", name)  # as a restart without persistence would
    loads_before = await _function_loads(redis)
    # Calls in flight that all find it gone: they wait on one load.
    replies = await asyncio.gather(*(script(keys=script_keys, args=[10]) for _ in range(50)))
    assert replies == [[0]] * 50
    assert await _function_loads(redis) - loads_before == 1
    assert len(await redis.execute_command("FUNCTION", "LIST", "LIBRARYNAME", name)) == 1


async def _calls(redis: ArqRedis, command: str) -> int:
    """How many times the server ran `command` (`INFO commandstats`, e.g. "fcall", "function|load")."""
    stats = await redis.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def _function_loads(redis: ArqRedis) -> int:
    return await _calls(redis, "function|load")


async def _major(redis: ArqRedis) -> int:
    return int(str((await redis.info("server"))["redis_version"]).split(".")[0])


async def _damaged_expired_reservation(redis: ArqRedis, keys: Keys) -> None:
    """An expired reservation of books that hold a word where a number belongs: a sweep fails on it."""
    await redis.hset(keys.ledger("g"), "reserved", "lots")  # type: ignore[misc]
    member = "\n".join(["r1", keys.ledger("g"), "10", "0", "-", "-"])
    await redis.zadd(keys.ledger_expiry(), {member: 1})


@contextlib.asynccontextmanager
async def _user_without_functions(redis: ArqRedis, redis_url: str) -> AsyncIterator[str]:
    """The URL of a Redis user whose ACL allows scripts but not Functions (FCALL answers NOPERM).
    Redis 6 has no Functions to forbid (nor the ACL names): there FCALL is an unknown command."""
    user, password = f"taskloom-test-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    rules = ["on", f">{password}", "~*", "&*", "+@all", *(["-fcall", "-function"] if await _major(redis) >= 7 else [])]
    await redis.execute_command("ACL", "SETUSER", user, *rules)
    try:
        yield redis_url.replace("redis://", f"redis://{user}:{password}@", 1)
    finally:
        await redis.execute_command("ACL", "DELUSER", user)


async def test_an_error_inside_a_function_is_the_callers_not_a_missing_function(
    redis: ArqRedis, keys: Keys, own_library: dict[str, str]
) -> None:
    """A script of a library that fails (books that hold no number) raises its own error, whether it
    ran as a function or by EVALSHA; it is not taken for a missing function and run again."""
    script = registered(redis, own_library["sweep"])
    await _damaged_expired_reservation(redis, keys)
    with pytest.raises(ResponseError, match="not an integer"):
        await script(keys=[keys.ledger_open(), keys.ledger_expiry()], args=[10])


async def test_a_user_not_allowed_functions_runs_the_library_by_evalsha(
    redis: ArqRedis, redis_url: str, keys: Keys, tmp_path: Path, own_library: dict[str, str]
) -> None:
    """A Redis user whose ACL allows scripts but not Functions (FCALL answers NOPERM) still runs a
    library's scripts: by EVALSHA, the same text."""
    async with _user_without_functions(redis, redis_url) as url, connect(url, tmp_path) as limited:
        script = registered(limited, own_library["sweep"])
        assert await script(keys=[keys.ledger_open(), keys.ledger_expiry()], args=[10]) == [0]
        assert script.function is None
        assert await script(keys=[keys.ledger_open(), keys.ledger_expiry()], args=[10]) == [0]


# -- in a pipeline (`bus.batch`) ---------------------------------------------------------------------


async def test_a_library_script_in_a_pipeline_runs_as_its_function_and_only_the_lost_call_runs_again(
    redis: ArqRedis, keys: Keys, own_library: dict[str, str]
) -> None:
    """In a pipeline (`bus.batch.run_scripts`, as an attempt's write carries the ledger's held
    settles) a library's script goes as its FCALL where the server has Functions. After the server
    lost the library it is loaded once and that call alone is sent again: the plain script beside
    it ran once. On Redis 6 the same call runs by EVALSHA."""
    script = registered(redis, own_library["sweep"])
    assert script.function is not None
    name = script.function.library
    count = registered(redis, "return redis.call('INCR', KEYS[1])")
    counter = f"{keys.prefix}counter"
    calls = [ScriptCall(script, [keys.ledger_open(), keys.ledger_expiry()], [10]), ScriptCall(count, [counter], [])]
    major = await _major(redis)
    fcalls = await _calls(redis, "fcall")
    assert await run_scripts(redis, calls) == [[0], 1]
    if major < 7:
        assert script.function is None  # told "unknown command": EVALSHA from now on
        assert await run_scripts(redis, calls) == [[0], 2]
        return
    assert script.function is not None and await _calls(redis, "fcall") > fcalls
    await redis.execute_command("FUNCTION", "DELETE", name)  # as a restart without persistence would
    loads = await _function_loads(redis)
    assert await run_scripts(redis, calls) == [[0], 2]
    assert await _function_loads(redis) - loads == 1
    assert len(await redis.execute_command("FUNCTION", "LIST", "LIBRARYNAME", name)) == 1


async def test_a_library_scripts_own_error_in_a_pipeline_is_its_reply_and_nothing_runs_again(
    redis: ArqRedis, keys: Keys, own_library: dict[str, str]
) -> None:
    """A library's script that fails inside a pipeline (books that hold no number) has its error as
    its reply; it is not taken for a missing function, and no call of the pipeline runs twice."""
    script = registered(redis, own_library["sweep"])
    count = registered(redis, "return redis.call('INCR', KEYS[1])")
    counter = f"{keys.prefix}counter"
    await _damaged_expired_reservation(redis, keys)
    sweep = ScriptCall(script, [keys.ledger_open(), keys.ledger_expiry()], [10])
    failed, counted = await run_scripts(redis, [sweep, ScriptCall(count, [counter], [])])
    assert isinstance(failed, ResponseError) and "not an integer" in str(failed)
    assert counted == 1 and await redis.get(counter) == b"1"


async def test_a_user_not_allowed_functions_runs_a_pipelined_library_script_by_evalsha(
    redis: ArqRedis, redis_url: str, keys: Keys, tmp_path: Path, own_library: dict[str, str]
) -> None:
    """In a pipeline too, a user whose ACL forbids Functions runs a library's script by EVALSHA
    (loaded first: this client never ran it)."""
    async with _user_without_functions(redis, redis_url) as url, connect(url, tmp_path) as limited:
        await limited.script_flush()
        script = registered(limited, own_library["sweep"])
        call = ScriptCall(script, [keys.ledger_open(), keys.ledger_expiry()], [10])
        assert await run_scripts(limited, [call]) == [[0]]
        assert script.function is None
        assert await run_scripts(limited, [call]) == [[0]]
