"""Build one model adapter from a provider-neutral description (`ModelConfig`): one alias of the models
file, or the `TASKLOOM_MODEL` shorthands (`demo`, a `claude-...` id).

The SDKs are imported only when their provider is built, so an install without the `openai` extra
(or the Bedrock/Vertex ones) runs every other provider; asking for a missing one is a
`ModelConfigError` naming the extra to install.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llm.errors import ModelConfigError
from llm.port import ModelPort

Provider = Literal["anthropic", "openai", "azure", "bedrock", "vertex", "demo"]
PROVIDERS: tuple[str, ...] = ("anthropic", "openai", "azure", "bedrock", "vertex", "demo")
# The variable a provider's key is read from when the alias names none.
DEFAULT_KEY_ENV: dict[str, str] = {
    "anthropic": "ANTHROPIC_API_KEY",
    "openai": "OPENAI_API_KEY",
    "azure": "AZURE_OPENAI_API_KEY",
}
# The pip extra each provider's SDK comes with.
EXTRAS: dict[str, str] = {"openai": "openai", "azure": "openai", "bedrock": "bedrock", "vertex": "vertex"}


class ModelConfig(BaseModel):
    """How to reach one model. Keys are never held here: only the name of the variable holding one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    provider: Provider
    model: str = Field(min_length=1, description="the model id (Azure: the deployment name)")
    base_url: str | None = Field(default=None, description="the API's root URL (OpenAI-compatible: ends in /v1)")
    api_key_env: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="the environment variable holding the key (default: the provider's usual one)",
    )
    # Azure OpenAI
    azure_endpoint: str | None = None
    api_version: str | None = None
    # AWS Bedrock (credentials from boto3's usual chain: environment, profile, instance role)
    aws_region: str | None = None
    aws_profile: str | None = None
    # Google Vertex AI (credentials from google-auth's default chain)
    project_id: str | None = None
    region: str | None = None
    # Transport
    max_retries: int | None = Field(default=None, ge=0, le=10, description="default: TASKLOOM_MODEL_MAX_RETRIES")
    timeout: float | None = Field(default=None, gt=0, description="seconds per request; default TASKLOOM_MODEL_TIMEOUT")
    stream: bool = Field(default=False, description="OpenAI-compatible: use streaming Chat Completions")
    prompt_cache_key: bool = Field(default=False, description="OpenAI: send a prompt_cache_key per goal")
    max_tokens_param: Literal["max_tokens", "max_completion_tokens"] | None = Field(
        default=None,
        description="OpenAI-compatible: the field the output cap is sent in; default max_completion_tokens on "
        "OpenAI and Azure (their reasoning models refuse max_tokens), max_tokens on a server with a base_url "
        "(Ollama and llama.cpp read only that one, and would ignore the cap)",
    )

    @model_validator(mode="after")
    def _provider_needs(self) -> ModelConfig:
        if self.provider == "azure" and not (self.azure_endpoint or self.base_url):
            raise ValueError("provider 'azure' needs azure_endpoint (https://NAME.openai.azure.com)")
        if self.provider == "azure" and not self.api_version:
            raise ValueError("provider 'azure' needs api_version (e.g. 2024-10-21)")
        if self.provider == "vertex" and not self.project_id:
            raise ValueError("provider 'vertex' needs project_id")
        if self.provider == "vertex" and not self.region:
            raise ValueError("provider 'vertex' needs region (e.g. us-east5)")
        return self

    def key_env(self) -> str | None:
        """The variable this model's key is read from, or None when it needs none (demo, Bedrock, Vertex,
        and an OpenAI-compatible local server with no `api_key_env`)."""
        if self.api_key_env:
            return self.api_key_env
        if self.provider == "openai" and self.base_url:
            return None  # vLLM, Ollama, llama.cpp...: no key unless the alias names one
        return DEFAULT_KEY_ENV.get(self.provider)


# A key for a local OpenAI-compatible server that checks none (the SDK insists on one).
NO_KEY = "no-key"


def build_model(
    config: ModelConfig,
    *,
    max_retries: int = 2,
    timeout: float = 60.0,
    demo_latency: float = 0.03,
    environ: dict[str, str] | None = None,
    **extra: Any,
) -> ModelPort:
    """The adapter for `config`. Raises `ModelConfigError` naming what is missing (the key's variable,
    an SDK extra). `extra` goes to the adapter (tests: `strict_validation=True`)."""
    env = os.environ if environ is None else environ
    retries = config.max_retries if config.max_retries is not None else max_retries
    seconds = config.timeout if config.timeout is not None else timeout
    if config.provider == "demo":
        from llm.demo import DemoModel

        # Its own id: an alias of the demo is priced as its own model.
        return DemoModel(model=config.model, latency=demo_latency)
    key_env = config.key_env()
    key = env.get(key_env) if key_env else None
    if key_env and not key:
        raise ModelConfigError(f"model {config.model!r} ({config.provider}): no API key: set {key_env}")
    try:
        if config.provider == "anthropic":
            from llm.anthropic import AnthropicModel

            return AnthropicModel(
                config.model, api_key=key, base_url=config.base_url, max_retries=retries, timeout=seconds, **extra
            )
        if config.provider in ("bedrock", "vertex"):
            from llm.anthropic import AnthropicModel

            return AnthropicModel(
                config.model,
                provider=config.provider,
                base_url=config.base_url,
                max_retries=retries,
                timeout=seconds,
                aws_region=config.aws_region,
                aws_profile=config.aws_profile,
                project_id=config.project_id,
                region=config.region,
                **extra,
            )
        from llm.openai import OpenAIModel

        return OpenAIModel(
            config.model,
            api_key=key or NO_KEY,
            api_key_env=key_env or "OPENAI_API_KEY",
            base_url=config.base_url,
            max_retries=retries,
            timeout=seconds,
            azure_endpoint=config.azure_endpoint if config.provider == "azure" else None,
            api_version=config.api_version if config.provider == "azure" else None,
            stream=config.stream,
            prompt_cache_key=config.prompt_cache_key,
            max_tokens_param=config.max_tokens_param or ("max_tokens" if config.base_url else "max_completion_tokens"),
            **extra,
        )
    except ImportError as exc:
        extra_name = EXTRAS.get(config.provider, config.provider)
        raise ModelConfigError(
            f"provider {config.provider!r} needs an SDK that is not installed ({exc.name or exc}): "
            f"pip install 'taskloom[{extra_name}]'"
        ) from None


def shorthand(name: str) -> ModelConfig | None:
    """`demo` and `claude-...` ids, as `TASKLOOM_MODEL` has always taken them; None for anything else."""
    if name == "demo":
        return ModelConfig(provider="demo", model="demo")
    if name.startswith("claude-"):
        return ModelConfig(provider="anthropic", model=name)
    return None
