"""`TASKLOOM_EVENT_LOOP`: which event loop a taskloom process runs on, and its bad values."""

from __future__ import annotations

import asyncio
import sys

import pytest
from helpers import run_cli

from taskloom import eventloop
from taskloom.settings import unknown_variables


async def _loop_name() -> str:
    return eventloop.running()


def test_auto_is_uvloop_when_installed_and_asyncio_when_asked() -> None:
    """With uvloop installed (a dependency of taskloom on Linux), `auto` and an unset variable run it; `asyncio`
    runs the standard library's loop. Values are read case- and space-insensitively."""
    assert eventloop.choice("") == "uvloop" and eventloop.choice("auto") == "uvloop"
    assert eventloop.choice(" UVLOOP ") == "uvloop" and eventloop.choice("asyncio") == "asyncio"
    assert eventloop.run(_loop_name(), "uvloop") == "uvloop"
    assert eventloop.run(_loop_name(), "asyncio") == "asyncio"


def test_the_variable_is_read_when_no_value_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASKLOOM_EVENT_LOOP", "asyncio")
    assert eventloop.choice() == "asyncio"
    assert eventloop.run(_loop_name()) == "asyncio"
    monkeypatch.delenv("TASKLOOM_EVENT_LOOP")
    assert eventloop.run(_loop_name()) == "uvloop"


def test_without_uvloop_auto_falls_back_and_uvloop_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop not importable (None in sys.modules makes `import uvloop` raise ImportError): `auto` is
    asyncio's loop, and asking for uvloop is an error naming the package and the way out."""
    monkeypatch.setitem(sys.modules, "uvloop", None)
    assert eventloop.choice("auto") == "asyncio"
    with pytest.raises(eventloop.EventLoopError) as err:
        eventloop.choice("uvloop")
    assert "TASKLOOM_EVENT_LOOP=uvloop" in str(err.value) and "pip install uvloop" in str(err.value)
    assert "TASKLOOM_EVENT_LOOP=asyncio" in str(err.value)


def test_a_value_that_is_no_loop_is_named() -> None:
    with pytest.raises(eventloop.EventLoopError) as err:
        eventloop.choice("trio")
    assert "TASKLOOM_EVENT_LOOP='trio'" in str(err.value) and "'asyncio'" in str(err.value)


def test_a_coroutine_that_fails_raises_as_with_asyncio_run() -> None:
    async def boom() -> None:
        await asyncio.sleep(0)
        raise KeyError("x")

    for name in ("uvloop", "asyncio"):
        with pytest.raises(KeyError):
            eventloop.run(boom(), name)  # type: ignore[arg-type]


def test_the_loop_and_http_client_variables_are_known_settings() -> None:
    """Neither is a Settings field (both are read before or beside the settings), yet both are documented
    variables: no "is not a taskloom setting" warning for them."""
    assert unknown_variables({"TASKLOOM_EVENT_LOOP": "asyncio", "TASKLOOM_HTTP_CLIENT": "httpx"}) == []


def test_the_cli_refuses_a_bad_loop_naming_the_variable(subprocess_env: dict[str, str]) -> None:
    """Exit 2, one line naming the variable and its value; nothing runs (no traceback, no warning about
    a coroutine never awaited)."""
    res = run_cli("status", "whatever", env=dict(subprocess_env, TASKLOOM_EVENT_LOOP="fast"))
    assert res.returncode == 2, res.stderr
    assert "TASKLOOM_EVENT_LOOP='fast'" in res.stderr and "is not an event loop" in res.stderr
    assert "Traceback" not in res.stderr and "never awaited" not in res.stderr
