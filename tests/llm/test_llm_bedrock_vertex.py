"""Claude on AWS Bedrock and Google Vertex AI: `AnthropicModel(provider=...)` through the SDK's own
`AsyncAnthropicBedrock` / `AsyncAnthropicVertex` clients, against the fake server's platform paths.

No test reaches AWS or Google: every AWS_*/GOOGLE_* variable is cleared, the AWS config files and
Google credentials point at files that do not exist, the EC2 metadata service is disabled, and the
network guard (tests/llm/conftest.py) fails any test that tried to leave loopback.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anthropic
import pytest

from llm import (
    Message,
    ModelConfigError,
    ModelRequest,
    RetryableModelError,
    TerminalModelError,
    ToolDef,
    ToolResultBlock,
)
from llm.anthropic import AnthropicModel, count_cache_markers
from llm.testing import Failure, FakeAnthropicServer, rate_limited, text_reply, tool_reply

BEDROCK_MODEL = "anthropic.claude-sonnet-4-5-20250929-v1:0"
VERTEX_MODEL = "claude-sonnet-4-5@20250929"
AWS_KEY_ID = "AKIDTESTNOTAREALKEY"
LOOKUP = ToolDef(
    name="svc.order.lookup",
    description="Look up an order",
    input_schema={"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
)

Factory = Callable[..., AnthropicModel]


@pytest.fixture(autouse=True)
def _no_cloud_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing from this machine's AWS or Google setup can be used, and boto3 never asks the EC2
    metadata service (which the guard would block, after a wait)."""
    for name in [n for n in os.environ if n.startswith(("AWS_", "GOOGLE_", "GCLOUD", "CLOUDSDK_", "CLOUD_ML_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-google-credentials.json"))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))


@pytest.fixture
async def make(server: FakeAnthropicServer) -> AsyncIterator[Factory]:
    """`make(provider, **options)`: an adapter for that platform on the fake server, with explicit
    test credentials and strict response validation; closed after the test."""
    made: list[AnthropicModel] = []

    def factory(provider: str, **options: object) -> AnthropicModel:
        defaults: dict[str, object] = {"base_url": server.base_url, "strict_validation": True, "max_retries": 2}
        if provider == "bedrock":
            defaults.update(aws_region="us-east-1", aws_access_key=AWS_KEY_ID, aws_secret_key="test-secret")
            model = BEDROCK_MODEL
        else:
            defaults.update(project_id="test-project", region="us-east5", access_token="test-token")
            model = VERTEX_MODEL
        adapter = AnthropicModel(model, provider=provider, **{**defaults, **options})  # type: ignore[arg-type]
        made.append(adapter)
        return adapter

    yield factory
    for adapter in made:
        await adapter.aclose()


def _request(*messages: Message, **kwargs: object) -> ModelRequest:
    history = list(messages) or [Message.user("Can order A100 be refunded?")]
    fields: dict[str, object] = {"system": "You are a support agent.", "max_tokens": 256, "tools": [LOOKUP]}
    return ModelRequest.model_validate({**fields, "messages": history, **kwargs})


async def test_bedrock_text_reply_signed_with_sigv4(server: FakeAnthropicServer, make: Factory) -> None:
    """Bedrock: POST /model/{id}/invoke, model only in the URL, its own anthropic_version, a SigV4
    signature for the given key and region, and the x-amzn-requestid as the request id."""
    server.enqueue(text_reply("A100 can be refunded."))
    model = make("bedrock")
    response = await model.complete(_request())

    [sent] = server.requests
    assert sent.path == f"/model/{BEDROCK_MODEL}/invoke"
    assert sent.platform == "bedrock" and sent.model == BEDROCK_MODEL
    assert "model" not in sent.body and sent.body["anthropic_version"] == "bedrock-2023-05-31"
    assert sent.headers["authorization"].startswith(f"AWS4-HMAC-SHA256 Credential={AWS_KEY_ID}/")
    assert "/us-east-1/bedrock/aws4_request" in sent.headers["authorization"]
    assert "x-api-key" not in sent.headers
    assert response.text == "A100 can be refunded."
    assert response.stop_reason == "stop"
    assert response.model == BEDROCK_MODEL
    assert response.request_id == sent.request_id  # from x-amzn-requestid
    assert model.name == "bedrock"


async def test_vertex_text_reply_with_bearer_token(server: FakeAnthropicServer, make: Factory) -> None:
    """Vertex: POST .../publishers/anthropic/models/{model}:rawPredict with the bearer token, its own
    anthropic_version and no model in the body; Vertex sends no request-id header, so none is invented."""
    server.enqueue(text_reply("A100 can be refunded."))
    model = make("vertex")
    response = await model.complete(_request())

    [sent] = server.requests
    prefix = "/projects/test-project/locations/us-east5/publishers/anthropic/models"
    assert sent.path == f"{prefix}/{VERTEX_MODEL}:rawPredict"
    assert sent.platform == "vertex" and sent.model == VERTEX_MODEL
    assert "model" not in sent.body and sent.body["anthropic_version"] == "vertex-2023-10-16"
    assert sent.headers["authorization"] == "Bearer test-token"
    assert response.text == "A100 can be refunded."
    assert response.model == VERTEX_MODEL
    assert response.request_id is None
    assert model.name == "vertex"


@pytest.mark.parametrize("provider", ["bedrock", "vertex"])
async def test_tool_calls_usage_and_cache_round_trip(server: FakeAnthropicServer, make: Factory, provider: str) -> None:
    """A tool call and its result round-trip with names mapped both ways; cache markers are sent and the
    second call reads the cached prefix, reported in the usage fields."""
    server.enqueue(tool_reply([("svc_order_lookup", {"order_id": "A100"})]), text_reply("Refundable until May 1."))
    model = make(provider)
    request = _request()
    first = await model.complete(request)
    assert first.stop_reason == "tool_call"
    assert [(t.name, t.input) for t in first.tool_uses] == [("svc.order.lookup", {"order_id": "A100"})]
    assert first.usage.cache_write_tokens > 0 and first.usage.cache_read_tokens == 0

    results = Message(role="user", content=[ToolResultBlock(tool_use_id=first.tool_uses[0].id, content="{}")])
    history = [*request.messages, first.as_message(), results]
    final = await model.complete(request.model_copy(update={"messages": history}))
    assert final.text == "Refundable until May 1."
    assert final.usage.cache_read_tokens > 0
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0

    first_sent, second_sent = server.message_requests
    assert first_sent.tool_names == ["svc_order_lookup"]
    assert second_sent.messages[1]["content"][0]["name"] == "svc_order_lookup"
    assert count_cache_markers(dict(second_sent.body)) == 3
    assert server.billed == first.usage + final.usage


@pytest.mark.parametrize("provider", ["bedrock", "vertex"])
async def test_throttled_then_served(server: FakeAnthropicServer, make: Factory, provider: str) -> None:
    """A 429 (Bedrock's ThrottlingException) is retried by the SDK and the next answer is served,
    with the throttle reported in rate_limit."""
    server.enqueue(rate_limited(retry_after=0.01), text_reply("done"))
    response = await make(provider).complete(_request())
    assert response.text == "done"
    assert len(server.message_requests) == 2
    assert response.rate_limit is not None and response.rate_limit.throttled == 1


async def test_bedrock_throttling_exhausted_is_retryable_with_its_request_id(
    server: FakeAnthropicServer, make: Factory
) -> None:
    """Bedrock's ThrottlingException after the SDK's retries -> RetryableModelError naming the
    exception, with the x-amzn-requestid of the last answer and nothing spent."""
    server.enqueue(rate_limited(retry_after=0.01), rate_limited(retry_after=0.01))
    with pytest.raises(RetryableModelError) as caught:
        await make("bedrock", max_retries=1).complete(_request())
    err = caught.value
    assert err.status == 429 and not err.maybe_spent
    assert "ThrottlingException" in err.message
    assert err.request_id == server.requests[-1].request_id


async def test_vertex_error_request_id_comes_from_the_body(server: FakeAnthropicServer, make: Factory) -> None:
    """Vertex errors carry no request-id header; the body's request_id (req_vrtx_...) is used."""
    server.enqueue(Failure(status=529))
    with pytest.raises(RetryableModelError) as caught:
        await make("vertex", max_retries=0).complete(_request())
    assert caught.value.status == 529
    assert caught.value.request_id == server.requests[-1].request_id


@pytest.mark.parametrize(
    ("provider", "failure", "words"),
    [
        ("bedrock", Failure(status=403, body={"message": "not authorized to invoke this model"}), "AccessDenied"),
        (
            "vertex",
            Failure(
                status=403,
                body={
                    "error": {"code": 403, "message": "Permission denied on resource", "status": "PERMISSION_DENIED"}
                },
            ),
            "Permission denied on resource",
        ),
    ],
)
async def test_forbidden_is_terminal_and_not_retried(
    server: FakeAnthropicServer, make: Factory, provider: str, failure: Failure, words: str
) -> None:
    """A 403 (Bedrock AccessDeniedException, Vertex PERMISSION_DENIED) is terminal at once: one request,
    nothing spent, the provider's words in the message."""
    server.enqueue(failure)
    with pytest.raises(TerminalModelError) as caught:
        await make(provider).complete(_request())
    assert caught.value.status == 403 and not caught.value.maybe_spent
    assert words in caught.value.message
    assert len(server.requests) == 1


async def test_bedrock_model_error_424_is_retryable(server: FakeAnthropicServer, make: Factory) -> None:
    """Bedrock's 424 ModelErrorException ("try your request again") is retryable for the job, though the
    SDK does not retry it within the call."""
    server.enqueue(Failure(status=424, body={"message": "The system encountered an unexpected error"}))
    with pytest.raises(RetryableModelError) as caught:
        await make("bedrock").complete(_request())
    assert caught.value.status == 424 and "ModelErrorException" in caught.value.message
    assert len(server.requests) == 1


async def test_bedrock_service_unavailable_retried_then_served(server: FakeAnthropicServer, make: Factory) -> None:
    """Bedrock's 503 ServiceUnavailableException is retried by the SDK."""
    server.enqueue(Failure(status=503), text_reply("back"))
    assert (await make("bedrock").complete(_request())).text == "back"
    assert len(server.requests) == 2


# -- the fake's platform paths, through the SDK clients as they are ----------------------------------


async def test_fake_refuses_the_sdk_default_body_version(server: FakeAnthropicServer) -> None:
    """The SDK's own `anthropic_version` (the API header's date) is refused like a wrong one, which is why
    the adapter sets each platform's value: the fake's check, seen failing."""
    client = anthropic.AsyncAnthropicBedrock(
        aws_region="us-east-1", aws_access_key=AWS_KEY_ID, aws_secret_key="s", base_url=server.base_url, max_retries=0
    )
    with pytest.raises(anthropic.BadRequestError, match="anthropic_version") as caught:
        await client.messages.create(model=BEDROCK_MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    await client.close()
    assert caught.value.response.headers["x-amzn-errortype"].startswith("ValidationException:")


async def test_fake_streams_vertex_stream_raw_predict(server: FakeAnthropicServer) -> None:
    """`:streamRawPredict` answers as SSE, which the Vertex client reads into the same message."""
    server.enqueue(text_reply("streamed answer"))
    client = anthropic.AsyncAnthropicVertex(
        region="us-east5", project_id="p", access_token="test-token", base_url=server.base_url, max_retries=0
    )
    async with client.messages.stream(
        model=VERTEX_MODEL,
        max_tokens=20,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"anthropic_version": "vertex-2023-10-16"},
    ) as stream:
        message = await stream.get_final_message()
    await client.close()
    assert message.content[0].type == "text" and message.content[0].text == "streamed answer"
    assert server.requests[0].path.endswith(f"/models/{VERTEX_MODEL}:streamRawPredict")


# -- configuration --------------------------------------------------------------------------------


def test_bedrock_without_a_region_names_what_to_set() -> None:
    """No aws_region, no AWS_REGION/AWS_DEFAULT_REGION, no profile region: ModelConfigError naming them."""
    with pytest.raises(ModelConfigError) as caught:
        AnthropicModel(BEDROCK_MODEL, provider="bedrock", aws_access_key=AWS_KEY_ID, aws_secret_key="s")
    assert "aws_region" in caught.value.message and "AWS_REGION" in caught.value.message


async def test_bedrock_region_from_env_and_from_profile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The region comes from AWS_REGION, else from the AWS profile's config (no network), and picks
    the regional endpoint."""
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    from_env = AnthropicModel(BEDROCK_MODEL, provider="bedrock", aws_access_key=AWS_KEY_ID, aws_secret_key="s")
    assert from_env.base_url == "https://bedrock-runtime.us-west-2.amazonaws.com"
    monkeypatch.delenv("AWS_REGION")
    config = tmp_path / "aws-config"
    config.write_text("[profile dev]\nregion = eu-west-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    from_profile = AnthropicModel(BEDROCK_MODEL, provider="bedrock", aws_profile="dev")
    assert from_profile.base_url == "https://bedrock-runtime.eu-west-1.amazonaws.com"
    with pytest.raises(ModelConfigError, match="nope"):
        AnthropicModel(BEDROCK_MODEL, provider="bedrock", aws_profile="nope")
    for model in (from_env, from_profile):
        await model.aclose()


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"project_id": "p"}, "region"),
        ({"region": "us-east5"}, "project_id"),
    ],
)
def test_vertex_without_project_or_region_names_it(options: dict[str, str], named: str) -> None:
    """A missing Vertex region or project is a ModelConfigError naming the option to set."""
    with pytest.raises(ModelConfigError) as caught:
        AnthropicModel(VERTEX_MODEL, provider="vertex", access_token="test-token", **options)  # type: ignore[arg-type]
    assert named in caught.value.message


@pytest.mark.parametrize(
    ("provider", "options", "words"),
    [
        ("vertex", {"aws_region": "us-east-1", "project_id": "p", "region": "r"}, "aws_region"),
        ("anthropic", {"api_key": "k", "project_id": "p"}, "project_id"),
        ("bedrock", {"aws_region": "us-east-1", "access_token": "t"}, "access_token"),
        ("bedrock", {"aws_region": "us-east-1", "aws_access_key": AWS_KEY_ID}, "aws_secret_key"),
        ("azure", {}, "unknown model provider"),
    ],
)
def test_misplaced_options_are_config_errors(provider: str, options: dict[str, str], words: str) -> None:
    """An option of another provider, half an AWS key pair or an unknown provider is refused by name."""
    with pytest.raises(ModelConfigError, match=words):
        AnthropicModel("m", provider=provider, **options)  # type: ignore[arg-type]


def test_api_key_is_required_only_for_anthropic() -> None:
    """Without ANTHROPIC_API_KEY the anthropic provider refuses, the platforms do not need it."""
    with pytest.raises(ModelConfigError, match="ANTHROPIC_API_KEY"):
        AnthropicModel("claude-test")
    AnthropicModel(VERTEX_MODEL, provider="vertex", project_id="p", region="us-east5", access_token="t")


async def test_bedrock_without_credentials_fails_before_sending(server: FakeAnthropicServer, make: Factory) -> None:
    """boto3's chain finding no credentials (no keys, no profile, metadata disabled) is a ModelConfigError
    naming where credentials come from, and nothing reaches the provider."""
    # A region of its own: the SDK caches one boto3 session per (keys, region, profile) per process.
    model = make("bedrock", aws_access_key=None, aws_secret_key=None, aws_region="eu-central-1")
    with pytest.raises(ModelConfigError) as caught:
        await model.complete(_request())
    assert "AWS_ACCESS_KEY_ID" in caught.value.message and not caught.value.maybe_spent
    assert server.requests == []


async def test_bedrock_credentials_from_the_environment(
    server: FakeAnthropicServer, make: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no keys passed, boto3's chain takes AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDFROMTHEENVIRON")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    server.enqueue(text_reply("ok"))
    await make("bedrock", aws_access_key=None, aws_secret_key=None, aws_region="ap-southeast-2").complete(_request())
    assert "Credential=AKIDFROMTHEENVIRON/" in server.requests[0].headers["authorization"]


async def test_bedrock_session_token_is_signed_in(server: FakeAnthropicServer, make: Factory) -> None:
    """Temporary credentials: the session token goes out in x-amz-security-token, inside the signature."""
    server.enqueue(text_reply("ok"))
    await make("bedrock", aws_session_token="test-session-token", aws_region="ca-central-1").complete(_request())
    headers = server.requests[0].headers
    assert headers["x-amz-security-token"] == "test-session-token"
    assert "x-amz-security-token" in headers["authorization"]


async def test_vertex_without_credentials_fails_before_sending(server: FakeAnthropicServer, make: Factory) -> None:
    """No access_token and no Application Default Credentials: a ModelConfigError, nothing sent."""
    with pytest.raises(ModelConfigError) as caught:
        await make("vertex", access_token=None).complete(_request())
    assert "Application Default Credentials" in caught.value.message
    assert server.requests == []
