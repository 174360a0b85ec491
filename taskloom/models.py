"""The models file (`TASKLOOM_MODELS_FILE`): models named by alias, and which alias each role uses.

```toml
[models.fast]
provider = "openai"                 # anthropic | openai | azure | bedrock | vertex | demo
model = "gpt-4.1-mini"
api_key_env = "OPENAI_API_KEY"      # the variable holding the key, never the key itself
prices = { input = 0.4, output = 1.6, cache_read = 0.1, cache_write = 0.4 }   # USD per million tokens
context_window = 1047576
rate_limit = { rpm = 500, input_tpm = 200000, output_tpm = 50000 }
fallbacks = ["sonnet"]              # tried in order when it fails retryably
```

TOML (`.toml`) or JSON (any other name: `{"models": {"fast": {...}}}`). A name that is no alias keeps
its old meaning: `demo`, or a `claude-...` id on Anthropic's API. An alias's chain is the alias, then
each fallback's own chain, depth first, each model once; a fallback that leads back to an alias it
came from is a cycle, refused at start-up with the path.

Which alias a call uses: the goal's own `model` (chosen at submit, among the configured aliases) for
every role of that goal; else the role's (`TASKLOOM_PLANNER_MODEL`, `..._EXECUTOR_...`,
`..._CRITIC_...`); else `TASKLOOM_MODEL`.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bus.metered import ModelRoute
from bus.prices import ModelPrice
from bus.ratelimit import RateLimit
from llm.errors import ModelConfigError
from llm.port import ModelPort
from llm.providers import ModelConfig, build_model, shorthand

log = structlog.get_logger("taskloom.models")

ALIAS_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,127}$"
ROLES = ("planner", "executor", "critic")


class Alias(ModelConfig):
    """One entry of the models file: how to reach the model, what it costs, its limits, its fallbacks."""

    prices: ModelPrice | None = Field(default=None, description="USD per million tokens (else genai-prices)")
    context_window: int | None = Field(default=None, gt=0, description="tokens the model accepts in all")
    rate_limit: RateLimit | None = Field(default=None, description="the provider's limits, per minute")
    fallbacks: list[str] = Field(default_factory=list, description="aliases tried in order when it fails")


class ModelsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    models: dict[str, Alias] = Field(min_length=1)

    @model_validator(mode="after")
    def _names_and_chains(self) -> ModelsFile:
        import re

        for name, alias in self.models.items():
            if not re.match(ALIAS_PATTERN, name):
                raise ValueError(f"alias {name!r}: expected letters, digits and _ . : @ / - (at most 128)")
            for fb in alias.fallbacks:
                if fb not in self.models and shorthand(fb) is None:
                    raise ValueError(f"alias {name!r}: fallback {fb!r} is no alias of the file (nor demo, claude-...)")
        for name in self.models:
            chain_of(self.models, name)  # raises on a cycle
        return self


def chain_of(models: Mapping[str, Alias], name: str, path: tuple[str, ...] = ()) -> list[str]:
    """`name`, then its fallbacks' chains, depth first, each name once. Raises ValueError on a cycle."""
    if name in path:
        raise ValueError(f"alias cycle: {' -> '.join((*path, name))}")
    out = [name]
    alias = models.get(name)
    for fb in alias.fallbacks if alias is not None else []:
        for n in chain_of(models, fb, (*path, name)):
            if n not in out:
                out.append(n)
    return out


def load_models_file(path: Path) -> ModelsFile:
    """Read and check the file; ValueError naming the file and what is wrong."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        raw = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        kind = "TOML" if path.suffix.lower() == ".toml" else "JSON"
        raise ValueError(f"{path}: invalid {kind}: {exc}") from None
    try:
        return ModelsFile.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            loc = ".".join(str(p) for p in err["loc"])
            problems.append(f"{loc + ': ' if loc else ''}{str(err['msg']).removeprefix('Value error, ')}")
        raise ValueError(f"{path}: " + "; ".join(problems)) from None


class ModelCatalog:
    """Every model name this deployment knows (the file's aliases, `demo`, `claude-...` ids), resolved to
    their configurations; pure (builds nothing)."""

    def __init__(self, file: ModelsFile | None = None) -> None:
        self.aliases: dict[str, Alias] = dict(file.models) if file is not None else {}

    def config(self, name: str) -> ModelConfig:
        if name in self.aliases:
            return self.aliases[name]
        config = shorthand(name)
        if config is None:
            known = ", ".join(sorted(self.aliases)) or "none (set TASKLOOM_MODELS_FILE)"
            raise ModelConfigError(f"unknown model {name!r}: expected demo, a claude-... id or an alias ({known})")
        return config

    def known(self, name: str) -> bool:
        return name in self.aliases or shorthand(name) is not None

    def chain(self, name: str) -> list[str]:
        return chain_of(self.aliases, name)

    def prices(self) -> dict[str, ModelPrice]:
        """The file's prices, by model id (they override genai-prices)."""
        return {a.model: a.prices for a in self.aliases.values() if a.prices is not None}

    def rate_limits(self) -> dict[str, RateLimit]:
        return {a.model: a.rate_limit for a in self.aliases.values() if a.rate_limit is not None}


class ModelRouter:
    """The composition root's `bus.metered.Router`: builds each model once, when first routed to.

    `defaults`: the model name of each role (and of `None`, a caller with no role); `build` makes an
    adapter from a configuration (the settings' retries and timeout applied). A model with fallbacks
    is built without SDK retries unless its alias sets `max_retries`: the next model of the chain is
    the retry, at once, instead of waiting out the first one's trouble."""

    def __init__(
        self,
        catalog: ModelCatalog,
        defaults: Mapping[str | None, str],
        build: Callable[[ModelConfig, bool], ModelPort],
    ) -> None:
        self.catalog = catalog
        self.defaults = dict(defaults)
        self._build = build
        self._built: dict[str, ModelPort] = {}
        self._routes: dict[str, ModelRoute] = {}

    def model(self, name: str, in_chain: bool = False) -> ModelPort:
        if name not in self._built:
            self._built[name] = self._build(self.catalog.config(name), in_chain)
        return self._built[name]

    def route_of(self, name: str) -> ModelRoute:
        if name not in self._routes:
            names = self.catalog.chain(name)
            chained = len(names) > 1
            models = tuple(self.model(n, chained and i < len(names) - 1) for i, n in enumerate(names))
            self._routes[name] = ModelRoute(models, tuple(names))
        return self._routes[name]

    def route(self, role: str | None, choice: str | None) -> ModelRoute:
        if choice is not None:
            if choice not in self.catalog.aliases:
                known = ", ".join(sorted(self.catalog.aliases)) or "none"
                raise ModelConfigError(f"the goal asks for model {choice!r}, which is no configured alias ({known})")
            return self.route_of(choice)
        return self.route_of(self.defaults.get(role) or self.defaults[None])

    def start(self, roles: Sequence[str] | None = None) -> None:
        """Build the routes of `roles` (all: None) now, so that a missing key stops start-up, naming
        its variable."""
        for role in roles if roles is not None else ROLES:
            self.route_of(self.defaults.get(role) or self.defaults[None])

    def built(self) -> list[ModelPort]:
        return list(self._built.values())


def make_builder(
    max_retries: int, timeout: float, demo_latency: float = 0.03
) -> Callable[[ModelConfig, bool], ModelPort]:
    def build(config: ModelConfig, in_chain: bool) -> ModelPort:
        retries = 0 if in_chain and config.max_retries is None else max_retries
        model = build_model(config, max_retries=retries, timeout=timeout, demo_latency=demo_latency)
        if config.provider == "anthropic":
            from llm.anthropic import end_of_life  # as build_model: the SDK only when a route needs it

            retired = end_of_life(config.model)
            if retired is not None:
                # Once per model and process: its calls keep working until that date, then fail.
                log.warning(
                    "model.deprecated",
                    model=config.model,
                    end_of_life=retired,
                    detail="Anthropic retires this model on that date; its calls then fail: move to a newer model",
                )
        return model

    return build
