"""A fleet-wide circuit breaker per model, so that every worker stops calling a model that is down.

State per model, one Redis hash (`Keys.breaker`): `count` failures since `since`, and `open_until`
(Redis time). The rules:
- closed: calls go through; a retryable failure adds to `count` (the window restarts once it is
  older than `window` seconds); the `failures`-th failure within the window opens the breaker for
  `cooldown` seconds;
- open: every worker skips the model until `open_until`;
- half-open (past `open_until`): one worker, whoever claims the probe first, calls it; a success
  closes the breaker, a failure opens it for another cool-down; the others keep skipping it meanwhile.

Only chains of more than one model consult it (a lone model has nowhere to fail over to: the job
layer's patience applies, as before), so a fleet without fallbacks pays nothing for it. Every change
is one script; times come from Redis, so workers' clocks do not matter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from redis.asyncio import Redis

from .keys import Keys
from .replies import as_str
from .scripts import lua, registered

Gate = Literal["call", "probe", "skip"]


@dataclass(frozen=True)
class BreakerPolicy:
    failures: int = 5
    window: float = 60.0
    cooldown: float = 30.0


@dataclass(frozen=True)
class BreakerState:
    count: int = 0
    open_until: float = 0.0  # 0: closed
    probe_at: float = 0.0  # when the half-open probe was claimed (0: none)
    now: float = 0.0

    @property
    def clean(self) -> bool:
        """Nothing to reset after a success."""
        return self.count == 0 and self.open_until == 0


def gate(state: BreakerState, cooldown: float) -> Gate:
    """Whether a call may go to the model: `call` (closed), `probe` (half-open, the probe is free to
    claim), or `skip` (open, or another worker's probe is under way, for at most one cool-down)."""
    if state.open_until == 0:
        return "call"
    if state.now < state.open_until or (state.probe_at > 0 and state.now - state.probe_at < cooldown):
        return "skip"
    return "probe"


# The scripts (bus/lua/): each file's header says its KEYS, ARGV and reply.
_FAILED = lua("breaker_failed")
_READ = lua("breaker_read")
_PROBE = lua("breaker_probe")


class Breaker:
    """The breakers of every model under one key prefix. Cheap; share one per process."""

    def __init__(self, redis: Redis, keys: Keys, policy: BreakerPolicy | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.policy = policy or BreakerPolicy()
        self._failed = registered(redis, _FAILED)
        self._read = registered(redis, _READ)
        self._probe = registered(redis, _PROBE)

    async def states(self, models: Sequence[str]) -> list[BreakerState]:
        """Every model's state, in one round trip."""
        out = await self._read(keys=[self.keys.breaker(m) for m in models])
        now = float(as_str(out[0]))
        return [
            BreakerState(
                count=int(as_str(out[1 + 3 * i])),
                open_until=float(as_str(out[2 + 3 * i])),
                probe_at=float(as_str(out[3 + 3 * i])),
                now=now,
            )
            for i in range(len(models))
        ]

    async def failed(self, model: str) -> bool:
        """Count a retryable failure of `model`; True when this failure opened its breaker."""
        p = self.policy
        out = await self._failed(keys=[self.keys.breaker(model)], args=[p.failures, p.window, p.cooldown])
        return bool(int(out[0]))

    async def claim_probe(self, model: str) -> bool:
        """Take the half-open probe of `model`; False when another worker has it (or it is not half-open)."""
        return bool(await self._probe(keys=[self.keys.breaker(model)], args=[self.policy.cooldown]))

    async def succeeded(self, model: str) -> None:
        """A call went through: the breaker is closed and its count cleared."""
        await self.redis.delete(self.keys.breaker(model))
