"""The side-effect ledger (bus.effects): one claim per task, tool and arguments, across attempts."""

from __future__ import annotations

from arq.connections import ArqRedis

from bus.effects import EffectRecord, SideEffects
from bus.keys import Keys


def _rec(attempt: int, call: str) -> EffectRecord:
    return EffectRecord(key="charge:abc", tool="charge", args={"amount": 5}, attempt=attempt, call_id=call)


async def test_a_done_or_unknown_call_is_never_claimed_again_but_a_failed_one_is(redis: ArqRedis, keys: Keys) -> None:
    """ok and started/unknown calls return the earlier record; a call whose tool failed may run again."""
    fx = SideEffects(redis, keys)
    assert await fx.begin("g", "t", _rec(1, "c1")) is None  # claimed: run it
    again = await fx.begin("g", "t", _rec(2, "c2"))
    assert again is not None and again.state == "started" and again.attempt == 1  # worker died mid-call?
    await fx.finish("g", "t", _rec(1, "c1").model_copy(update={"state": "failed", "result": "boom"}))
    assert await fx.begin("g", "t", _rec(2, "c2")) is None  # the tool said it did nothing: may run
    await fx.finish("g", "t", _rec(2, "c2").model_copy(update={"state": "ok", "result": "charged 5"}))
    done = await fx.begin("g", "t", _rec(3, "c3"))
    assert done is not None and (done.state, done.attempt, done.result) == ("ok", 2, "charged 5")
    assert await fx.begin("g", "other-task", _rec(3, "c4")) is None  # per task
    assert [r.attempt for r in await fx.history("g", "t")] == [2]
