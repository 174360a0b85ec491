"""The fake Messages API server: wire format, SSE streaming, validation, billing, other processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import anthropic
import httpx2
import pytest

from llm.testing import Failure, FakeAnthropicServer, text_reply, tool_reply
from llm.testing.tokens import count_input_tokens

TEST_KEY = "sk-ant-test-not-a-real-key"
HEADERS = {"x-api-key": TEST_KEY, "anthropic-version": "2023-06-01"}
BODY = {"model": "claude-test", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}


def _post(server: FakeAnthropicServer, body: object, headers: dict[str, str] | None = None) -> httpx2.Response:
    return httpx2.post(f"{server.base_url}/v1/messages", json=body, headers=HEADERS if headers is None else headers)


async def test_sdk_stream_helper_parses_fake_sse(server: FakeAnthropicServer) -> None:
    """`messages.stream(...)` over the fake server's SSE yields the text and tool call, strictly validated."""
    server.enqueue(
        tool_reply([("lookup_order", {"order_id": "A100", "note": "x" * 40})], text="Let me check that order.")
    )
    client = anthropic.AsyncAnthropic(api_key=TEST_KEY, base_url=server.base_url, _strict_response_validation=True)
    async with client.messages.stream(
        model="claude-test", max_tokens=200, messages=[{"role": "user", "content": "A100?"}]
    ) as stream:
        text = "".join([chunk async for chunk in stream.text_stream])
        final = await stream.get_final_message()
    await client.close()
    assert server.requests[0].body["stream"] is True
    assert text == "Let me check that order."
    assert final.stop_reason == "tool_use"
    tool_use = final.content[1]
    assert tool_use.type == "tool_use" and tool_use.input == {"order_id": "A100", "note": "x" * 40}
    assert final.usage.output_tokens > 1


async def test_create_stream_event_sequence(server: FakeAnthropicServer) -> None:
    """`create(stream=True)` sees message_start, block start/delta/stop, message_delta, message_stop."""
    server.enqueue(text_reply("hello world, this is long enough for two deltas"))
    client = anthropic.AsyncAnthropic(api_key=TEST_KEY, base_url=server.base_url)
    stream = await client.messages.create(
        model="claude-test", max_tokens=50, messages=[{"role": "user", "content": "hi"}], stream=True
    )
    kinds = [event.type async for event in stream]
    await client.close()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_delta") >= 2
    assert kinds.index("content_block_start") < kinds.index("content_block_delta") < kinds.index("content_block_stop")


def test_every_sse_frame_names_its_event(server: FakeAnthropicServer) -> None:
    """Each SSE frame carries an `event:` line matching its data's type (the SDK skips frames without one)."""
    server.enqueue(tool_reply([("a", {"x": 1}), ("b", {})], text="t"))
    response = _post(server, {**BODY, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["request-id"]
    frames = [f for f in response.text.split("\n\n") if f.strip()]
    assert len(frames) > 6
    for frame in frames:
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        assert json.loads(lines["data"])["type"] == lines["event"]


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"anthropic-version": "2023-06-01"}, 401),
        ({"authorization": f"Bearer {TEST_KEY}"}, 400),
        ({"authorization": f"Bearer {TEST_KEY}", "anthropic-version": "2099-01-01"}, 200),
        (HEADERS, 200),
    ],
)
def test_auth_and_version_headers(server: FakeAnthropicServer, headers: dict[str, str], status: int) -> None:
    """x-api-key or Bearer auth is required (401), an anthropic-version of any value too (400)."""
    server.respond_with(lambda _: text_reply("ok"))
    response = _post(server, BODY, headers)
    assert response.status_code == status
    assert response.headers["request-id"].startswith("req_fake_")


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({**BODY, "max_tokens": 0}, "max_tokens"),
        ({**BODY, "tools": [{"name": "svc.order.lookup", "input_schema": {}}]}, "does not match"),
        (
            {**BODY, "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}] * 5},
            "maximum of 4",
        ),
        (
            {
                **BODY,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "a", "input": {}}]},
                    {"role": "user", "content": "no result"},
                ],
            },
            "t1",
        ),
    ],
)
def test_invalid_bodies_get_a_400_like_the_real_api(server: FakeAnthropicServer, body: object, fragment: str) -> None:
    """Bad tool names, too many cache markers, broken pairing and bad fields are 400s naming the problem."""
    server.respond_with(lambda _: text_reply("should not be used"))
    response = _post(server, body)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert fragment in response.json()["error"]["message"]
    assert server.billed.total == 0


def test_unscripted_request_fails_loudly(server: FakeAnthropicServer) -> None:
    """With nothing enqueued and no responder, the server answers 500 telling the test to script it."""
    response = _post(server, BODY)
    assert response.status_code == 500
    assert response.headers["x-should-retry"] == "false"
    assert "nothing scripted" in response.json()["error"]["message"]


def test_queue_then_responder_and_billing(server: FakeAnthropicServer) -> None:
    """Enqueued items are used first, then the responder; billed sums the usage of successful replies only."""
    server.enqueue(text_reply("first"), Failure(status=529))
    server.respond_with(lambda request: text_reply(f"echo {len(request.messages)}"))
    texts = []
    for _ in range(3):
        response = _post(server, BODY)
        texts.append(response.json()["content"][0]["text"] if response.status_code == 200 else response.status_code)
    assert texts == ["first", 529, "echo 1"]
    assert server.pending == 0
    assert server.billed.input_tokens == 2 * count_input_tokens(BODY)
    count = httpx2.post(f"{server.base_url}/v1/messages/count_tokens", json=BODY, headers=HEADERS).json()
    assert count == {"input_tokens": count_input_tokens(BODY)}


def test_output_tokens_follow_the_reply(server: FakeAnthropicServer) -> None:
    """Longer replies bill more output tokens; an explicit output_tokens overrides the count."""
    server.enqueue(text_reply("a"), text_reply("a" * 400), text_reply("a", output_tokens=77))
    outputs = [_post(server, BODY).json()["usage"]["output_tokens"] for _ in range(3)]
    assert outputs[0] < outputs[1] and outputs[2] == 77


def test_worker_in_another_process_reaches_the_server(server: FakeAnthropicServer) -> None:
    """A subprocess pointed at the server by ANTHROPIC_BASE_URL gets the scripted reply over HTTP."""
    server.enqueue(text_reply("hello from the fake"))
    script = textwrap.dedent(
        """
        import asyncio
        from llm import Message, ModelRequest
        from llm.anthropic import AnthropicModel
        async def main():
            model = AnthropicModel("claude-test")
            response = await model.complete(ModelRequest(messages=[Message.user("hi")], max_tokens=20))
            print(response.text)
            await model.aclose()
        asyncio.run(main())
        """
    )
    env = {**os.environ, "ANTHROPIC_API_KEY": TEST_KEY, "ANTHROPIC_BASE_URL": server.base_url}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "hello from the fake"
    assert len(server.requests) == 1


def test_module_entrypoint_serves_demo_rules() -> None:
    """`python -m llm.testing --port 0` serves the Messages API answering with the demo model's rules."""
    proc = subprocess.Popen([sys.executable, "-m", "llm.testing", "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        base_url = proc.stdout.readline().split(" on ", 1)[1].split(" ", 1)[0]
        client = anthropic.Anthropic(api_key=TEST_KEY, base_url=base_url)
        message = client.messages.create(
            model="claude-test",
            max_tokens=2000,
            messages=[
                {"role": "user", "content": "Can orders A100 and A101 be refunded? Tools: lookup_order, refund_policy"}
            ],
            tools=[{"name": "submit_plan", "input_schema": {"type": "object", "required": ["tasks"]}}],
            tool_choice={"type": "tool", "name": "submit_plan"},
        )
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    plan = message.content[0]
    assert plan.type == "tool_use" and plan.name == "submit_plan"
    assert [t["id"] for t in plan.input["tasks"]] == ["check-a100", "check-a101", "summarize"]
