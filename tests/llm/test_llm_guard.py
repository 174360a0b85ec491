"""The network guard and environment scrubbing that keep tests off real providers."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest

from llm import Message, ModelConnectionError, ModelRequest
from llm.anthropic import AnthropicModel
from llm.testing import (
    FakeAnthropicServer,
    NetworkBlockedError,
    blocked_attempts,
    clear_anthropic_env,
    clear_blocked_attempts,
    install_network_guard,
)


def test_non_loopback_connect_is_blocked_and_recorded() -> None:
    """Connecting to a public address raises NetworkBlockedError and is recorded for the fixture to report."""
    with socket.socket() as sock, pytest.raises(NetworkBlockedError, match=r"203\.0\.113\.7:443"):
        sock.connect(("203.0.113.7", 443))
    assert blocked_attempts() == ["connection to 203.0.113.7:443"]
    clear_blocked_attempts()


def test_provider_dns_lookup_is_blocked() -> None:
    """Resolving api.anthropic.com raises before any packet leaves."""
    with pytest.raises(NetworkBlockedError, match=r"api\.anthropic\.com"):
        socket.getaddrinfo("api.anthropic.com", 443)
    clear_blocked_attempts()


def test_loopback_and_unix_sockets_still_work(server: FakeAnthropicServer) -> None:
    """127.0.0.1, localhost and unix sockets are allowed; installing twice changes nothing."""
    install_network_guard()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection(("localhost", int(port)), timeout=5):
        pass
    with socket.create_connection((host, int(port)), timeout=5):
        pass
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "s")
        with socket.socket(socket.AF_UNIX) as listener, socket.socket(socket.AF_UNIX) as client:
            listener.bind(path)
            listener.listen(1)
            client.connect(path)
    assert blocked_attempts() == []


async def test_sdk_default_endpoint_fails_loudly() -> None:
    """An adapter left on the real endpoint cannot reach it: ModelConnectionError naming the guard."""
    model = AnthropicModel("claude-test", api_key="k", max_retries=0)
    with pytest.raises(ModelConnectionError, match="network guard"):
        await model.complete(ModelRequest(messages=[Message.user("hi")], max_tokens=5))
    await model.aclose()
    assert any("api.anthropic.com" in a for a in blocked_attempts())
    clear_blocked_attempts()


def test_clear_anthropic_env_removes_every_anthropic_variable() -> None:
    """All ANTHROPIC_* names are removed (and returned, without values); others are kept."""
    env = {"ANTHROPIC_API_KEY": "x", "ANTHROPIC_BASE_URL": "y", "ANTHROPIC_PROFILE": "z", "HOME": "/root"}
    assert clear_anthropic_env(env) == ["ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_PROFILE"]
    assert env == {"HOME": "/root"}
