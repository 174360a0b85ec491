"""Fixtures for the `llm` tests: no real network, no real credentials, a fresh fake server per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from llm.anthropic import AnthropicModel
from llm.testing import (
    FakeAnthropicServer,
    blocked_attempts,
    clear_anthropic_env,
    clear_blocked_attempts,
    clear_openai_env,
    install_network_guard,
)

TEST_KEY = "sk-ant-test-not-a-real-key"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every llm test runs with the network guard on and no ANTHROPIC_* / OPENAI_* variables, and fails if it
    tried to leave loopback (even if the code under test swallowed the error)."""
    install_network_guard()
    import os

    for name in [n for n in os.environ if n.startswith(("ANTHROPIC_", "OPENAI_", "AZURE_OPENAI_"))]:
        monkeypatch.delenv(name)
    clear_anthropic_env()
    clear_openai_env()
    clear_blocked_attempts()
    yield
    attempts = blocked_attempts()
    clear_blocked_attempts()
    assert not attempts, f"the test tried to reach the network: {attempts}"


@pytest.fixture
def server() -> Iterator[FakeAnthropicServer]:
    with FakeAnthropicServer() as fake:
        yield fake


@pytest.fixture
async def model(server: FakeAnthropicServer) -> AsyncIterator[AnthropicModel]:
    adapter = AnthropicModel("claude-test", api_key=TEST_KEY, base_url=server.base_url, strict_validation=True)
    yield adapter
    await adapter.aclose()
