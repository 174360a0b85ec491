"""The models file, aliases, a model per role and per goal: parsing, the checks that stop start-up
(exit 2 naming the problem), routing, and `taskloom models`."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import pytest
import structlog
from helpers import run_cli

from llm.errors import ModelConfigError
from llm.providers import ModelConfig, build_model
from llm.types import Message, ModelRequest
from taskloom.models import ModelCatalog, ModelRouter, chain_of, load_models_file
from taskloom.settings import SettingsError, load_settings

TOML = """
[models.fast]
provider = "openai"
model = "gpt-4.1-mini"
api_key_env = "TL_TEST_OPENAI_KEY"
prices = { input = 0.4, output = 1.6, cache_read = 0.1, cache_write = 0.4 }
context_window = 1047576
rate_limit = { rpm = 500, input_tpm = 200000, output_tpm = 50000 }
fallbacks = ["strong"]

[models.strong]
provider = "anthropic"
model = "claude-sonnet-4-5"
api_key_env = "TL_TEST_ANTHROPIC_KEY"
fallbacks = ["local"]

[models.local]
provider = "openai"
model = "qwen2.5:7b"
base_url = "http://127.0.0.1:11434/v1"
"""


def _file(tmp_path: Path, text: str, name: str = "models.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_toml_file_reads_into_aliases_with_chains(tmp_path: Path) -> None:
    """Aliases keep their provider, key variable, prices and limits; a chain follows fallbacks depth first."""
    file = load_models_file(_file(tmp_path, TOML))
    catalog = ModelCatalog(file)
    assert catalog.chain("fast") == ["fast", "strong", "local"]
    assert catalog.chain("claude-haiku-4-5") == ["claude-haiku-4-5"]
    assert catalog.prices()["gpt-4.1-mini"].output == 1.6
    assert catalog.rate_limits()["gpt-4.1-mini"].rpm == 500
    assert catalog.config("local").key_env() is None  # a local server needs no key unless one is named
    assert catalog.config("strong").key_env() == "TL_TEST_ANTHROPIC_KEY"
    assert catalog.config("demo").provider == "demo"
    with pytest.raises(ModelConfigError, match="unknown model 'gpt'"):
        catalog.config("gpt")


def test_json_is_read_too(tmp_path: Path) -> None:
    """A file not ending in .toml is JSON with the same shape."""
    raw = {"models": {"m": {"provider": "demo", "model": "demo"}}}
    assert list(load_models_file(_file(tmp_path, json.dumps(raw), "models.json")).models) == ["m"]


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ('[models.a]\nprovider = "openia"\nmodel = "x"\n', "models.a.provider"),
        ('[models.a]\nprovider = "openai"\nmodel = "x"\nfallbacks = ["b"]\n', "fallback 'b' is no alias"),
        (
            '[models.a]\nprovider = "demo"\nmodel = "demo"\nfallbacks = ["b"]\n'
            '[models.b]\nprovider = "demo"\nmodel = "demo"\nfallbacks = ["a"]\n',
            "alias cycle: a -> b -> a",
        ),
        ('[models.a]\nprovider = "azure"\nmodel = "x"\n', "azure_endpoint"),
        ('[models.a]\nprovider = "vertex"\nmodel = "x"\nregion = "us-east5"\n', "project_id"),
        ('[models.a]\nprovider = "openai"\nmodel = "x"\napi_key = "sk-123"\n', "api_key"),  # never the key itself
        ("[models.a\n", "invalid TOML"),
        ("", "models"),
    ],
)
def test_a_bad_file_names_what_is_wrong(tmp_path: Path, text: str, expect: str) -> None:
    """Unknown provider, unknown fallback, cycles, missing provider fields, a key in the file, bad syntax."""
    path = _file(tmp_path, text)
    with pytest.raises(ValueError, match=r"models\.toml") as exc:
        load_models_file(path)
    assert expect in str(exc.value)


def test_settings_check_every_model_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """TASKLOOM_MODEL and each role's model must be demo, a claude-... id or an alias of the file."""
    monkeypatch.setenv("TASKLOOM_MODELS_FILE", str(_file(tmp_path, TOML)))
    monkeypatch.setenv("TASKLOOM_MODEL", "fast")
    monkeypatch.setenv("TASKLOOM_CRITIC_MODEL", "strong")
    s = load_settings()
    assert s.role_models() == {None: "fast", "planner": "fast", "executor": "fast", "critic": "strong"}
    monkeypatch.setenv("TASKLOOM_PLANNER_MODEL", "fats")
    with pytest.raises(SettingsError, match="TASKLOOM_PLANNER_MODEL") as exc:
        load_settings()
    assert "fast, local, strong" in str(exc.value)
    monkeypatch.setenv("TASKLOOM_MODELS_FILE", str(tmp_path / "missing.toml"))
    with pytest.raises(SettingsError, match="TASKLOOM_MODELS_FILE"):
        load_settings()


def test_the_router_picks_per_role_and_per_goal(tmp_path: Path) -> None:
    """Each role gets its model's chain, a goal's own alias wins for every role, an unknown alias is refused,
    and each model is built once; models with fallbacks are built without SDK retries."""
    catalog = ModelCatalog(load_models_file(_file(tmp_path, TOML.replace('fallbacks = ["local"]', ""))))
    built: list[tuple[str, bool]] = []

    def build(config: ModelConfig, in_chain: bool) -> object:
        built.append((config.model, in_chain))
        return build_model(ModelConfig(provider="demo", model="demo"))

    router = ModelRouter(catalog, {None: "strong", "executor": "fast"}, build)  # type: ignore[arg-type]
    assert router.route("planner", None).labels == ("strong",)
    assert router.route("executor", None).labels == ("fast", "strong")
    assert router.route("planner", "local").labels == ("local",)
    with pytest.raises(ModelConfigError, match="'nope', which is no configured alias"):
        router.route("critic", "nope")
    assert sorted(built) == [("claude-sonnet-4-5", False), ("gpt-4.1-mini", True), ("qwen2.5:7b", False)]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (ModelConfig(provider="openai", model="o3-mini"), "max_completion_tokens"),
        (ModelConfig(provider="openai", model="qwen", base_url="http://127.0.0.1:11434/v1"), "max_tokens"),
        (
            ModelConfig(provider="openai", model="q", base_url="http://h/v1", max_tokens_param="max_completion_tokens"),
            "max_completion_tokens",
        ),
    ],
)
async def test_the_output_cap_goes_where_the_server_reads_it(
    config: ModelConfig, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenAI's own API takes max_completion_tokens; a local server (a base_url) gets max_tokens, the only
    field Ollama and llama.cpp read, so the ledger's cap on output holds there too."""
    from llm.testing import FakeOpenAIServer, openai_text_reply

    with FakeOpenAIServer() as server:
        server.enqueue(openai_text_reply("ok"))
        if config.base_url is None:  # OpenAI's own API, reached through the SDK's variable here
            monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        else:
            config = config.model_copy(update={"base_url": server.base_url})
        model = build_model(config, environ={"OPENAI_API_KEY": "k"})
        await model.complete(ModelRequest(messages=[Message.user("hi")], max_tokens=77))
        await model.aclose()  # type: ignore[attr-defined]
        body = server.requests[0].body
    assert body[expected] == 77 and len({"max_tokens", "max_completion_tokens"} & set(body)) == 1


def test_chain_of_stops_at_cycles() -> None:
    """The chain walk itself refuses a cycle (the file check relies on it)."""
    from taskloom.models import Alias

    models = {"a": Alias(provider="demo", model="demo", fallbacks=["a"])}
    with pytest.raises(ValueError, match="a -> a"):
        chain_of(models, "a")


def test_a_missing_key_variable_is_named(tmp_path: Path) -> None:
    """Building a model whose key variable is unset raises a ModelConfigError naming the variable."""
    config = load_models_file(_file(tmp_path, TOML)).models["strong"]
    with pytest.raises(ModelConfigError, match="set TL_TEST_ANTHROPIC_KEY"):
        build_model(config, environ={})


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TASKLOOM_", "ANTHROPIC_", "OPENAI_"))}
    env.update({"TASKLOOM_HOME": str(tmp_path / "home"), **extra})
    return env


def test_cli_models_lists_roles_chains_keys_and_prices(tmp_path: Path) -> None:
    """`taskloom models --json`: every alias with its provider, key variable (set or not), price and
    its source, limits, chain, and which role uses it."""
    env = _env(
        tmp_path,
        TASKLOOM_MODELS_FILE=str(_file(tmp_path, TOML)),
        TASKLOOM_MODEL="fast",
        TASKLOOM_CRITIC_MODEL="strong",
        TL_TEST_OPENAI_KEY="sk-test",
    )
    proc = run_cli("models", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["roles"] == {"planner": "fast", "executor": "fast", "critic": "strong"}
    rows = {r["name"]: r for r in out["models"]}
    assert rows["fast"]["key_set"] is True and rows["fast"]["price_source"] == "configured"
    assert rows["strong"]["key_set"] is False and rows["strong"]["price_source"] == "genai-prices"
    assert rows["strong"]["price"]["input"] == 3
    assert rows["local"]["price"] is None and rows["local"]["key_env"] is None
    assert rows["fast"]["chain"] == ["fast", "strong", "local"] and rows["fast"]["roles"] == ["planner", "executor"]
    assert "sk-test" not in proc.stdout
    table = run_cli("models", env={**env, "COLUMNS": "250"})
    assert table.returncode == 0 and "MISSING" in table.stdout and "TL_TEST_ANTHROPIC_KEY" in table.stdout


def test_cli_stops_with_exit_2_naming_the_problem(tmp_path: Path) -> None:
    """A misconfigured file, an unknown --model, and a worker whose model's key is missing all exit 2 with
    one line naming the culprit."""
    bad = _file(tmp_path, '[models.a]\nprovider = "openai"\nmodel = "x"\nfallbacks = ["a"]\n', "bad.toml")
    proc = run_cli("models", env=_env(tmp_path, TASKLOOM_MODELS_FILE=str(bad)))
    assert proc.returncode == 2 and "alias cycle: a -> a" in proc.stderr and "Traceback" not in proc.stderr
    good = str(_file(tmp_path, TOML))
    proc = run_cli("submit", "hello", "--model", "fats", env=_env(tmp_path, TASKLOOM_MODELS_FILE=good))
    assert proc.returncode == 2 and "--model: 'fats'" in proc.stderr and "fast, local, strong" in proc.stderr
    env = _env(tmp_path, TASKLOOM_MODELS_FILE=good, TASKLOOM_MODEL="strong")
    proc = run_cli("worker", "critic", "--burst", env=env)
    assert proc.returncode == 2 and "TL_TEST_ANTHROPIC_KEY" in proc.stderr, proc.stderr


def test_demo_runs_on_a_configured_model(tmp_path: Path) -> None:
    """`taskloom demo --model ALIAS` runs the same goal on the alias (here the fake Chat Completions server
    answering with the demo model's rules); with no --model it stays on the offline demo model."""
    from llm.demo import DemoModel
    from llm.testing import FakeOpenAIServer, openai_responder_from_model

    with FakeOpenAIServer() as oa:
        oa.respond_with(openai_responder_from_model(DemoModel(latency=0)))
        models = _file(
            tmp_path,
            f'[models.oa]\nprovider = "openai"\nmodel = "gpt-test"\nbase_url = "{oa.base_url}"\n'
            'api_key_env = "TL_TEST_OA_KEY"\n',
        )
        env = _env(tmp_path, TASKLOOM_MODELS_FILE=str(models), TL_TEST_OA_KEY="sk-test", TASKLOOM_MODEL="oa")
        proc = run_cli("demo", "--model", "oa", "--json", env=env, timeout=120)
        served = len(oa.requests)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert served > 5 and json.loads(proc.stdout.splitlines()[-1])["state"] == "succeeded"
    bad = run_cli("demo", "--model", "nope", env=env)
    assert bad.returncode == 2 and "--model" in bad.stderr


def test_a_model_anthropic_retires_is_named_in_the_log_when_its_route_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK's own warning about a retiring model is a DeprecationWarning, hidden in a library: a
    worker logs `model.deprecated` with the date instead, once per model it builds, and nothing for
    a current model."""
    from llm.anthropic import end_of_life
    from taskloom.logs import configure_logging
    from taskloom.models import make_builder

    retiring = end_of_life("claude-sonnet-4-5")
    assert retiring is not None and end_of_life("claude-sonnet-4-6") is None  # the installed SDK's table
    monkeypatch.setenv("TL_TEST_ANTHROPIC_KEY", "k")
    catalog = load_models_file(_file(tmp_path, TOML.replace("claude-sonnet-4-5", "claude-sonnet-4-6") + """
[models.old]
provider = "anthropic"
model = "claude-sonnet-4-5"
api_key_env = "TL_TEST_ANTHROPIC_KEY"
"""))
    buf = io.StringIO()
    configure_logging("INFO", json=True, stream=buf)
    try:
        build = make_builder(max_retries=0, timeout=5)
        for name in ("strong", "old"):
            build(catalog.models[name], False)
    finally:
        logging.getLogger().handlers.clear()
        structlog.reset_defaults()
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    deprecated = [x for x in lines if x["event"] == "model.deprecated"]
    assert [(x["model"], x["end_of_life"], x["level"]) for x in deprecated] == [
        ("claude-sonnet-4-5", retiring, "warning")
    ]
