"""The supervisor (planner.supervise): stranded goals and tasks are re-driven, live ones left alone."""

from __future__ import annotations

import asyncio

from arq.connections import ArqRedis

from bus.jobs import ExecuteJob, PlanJob, ReviewJob
from bus.keys import Keys
from bus.ledger import Ledger
from bus.runtime import Runtime
from bus.schemas import Goal, GoalRecord, GoalState, Plan, TaskSpec, TaskState
from planner.supervise import check_goal, supervise


def _plan(*ids: str) -> Plan:
    return Plan(
        tasks=[TaskSpec(id=t, title=t, instructions=f"do {t}", definition_of_done="done") for t in ids]
    )


async def _queued(redis: ArqRedis, keys: Keys, role: str) -> list[str]:
    return [m.decode() for m in await redis.zrange(keys.queue(role), 0, -1)]


async def test_a_submitted_goal_never_enqueued_is_redriven_once(redis: ArqRedis, keys: Keys) -> None:
    """A goal stored without its plan job is found idle and gets a plan job; a queued one is live."""
    rt = Runtime.build(redis, keys)
    await rt.store.create_goal(GoalRecord(id="g1", goal=Goal(text="hello"), budget_tokens=10))
    assert await supervise(rt, stale_after=3600) == 0  # not idle long enough
    assert await supervise(rt, stale_after=0) == 1
    [job_id] = await _queued(redis, keys, "planner")
    assert job_id.startswith(rt.jobs.job_id(PlanJob(goal_id="g1")))
    assert await check_goal(rt, "g1") == []  # its plan job is queued: a live driver
    events = [e.type for e in await rt.events.read("g1")]
    assert "goal.redriven" in events


async def test_a_planning_goal_whose_plan_job_failed_is_redriven(redis: ArqRedis, keys: Keys) -> None:
    """arq dropped the plan job (failed, result kept): the supervisor enqueues one with a fresh id."""
    rt = Runtime.build(redis, keys)
    await rt.store.create_goal(GoalRecord(id="g2", goal=Goal(text="hello"), budget_tokens=10))
    await rt.jobs.enqueue(PlanJob(goal_id="g2"))
    await redis.delete(keys.queue("planner"), f"arq:job:{rt.jobs.job_id(PlanJob(goal_id='g2'))}")  # "failed"
    await rt.store.transition_goal("g2", GoalState.PLANNING)
    [job] = await check_goal(rt, "g2")
    assert isinstance(job, PlanJob) and job.redrive > 0
    assert len(await _queued(redis, keys, "planner")) == 1


async def test_tasks_without_drivers_get_the_job_their_state_calls_for(redis: ArqRedis, keys: Keys) -> None:
    """ready -> execute, reviewing -> review, running without a lease -> execute (resume); a task
    running under a live lease and a goal-level job still queued are left alone."""
    rt = Runtime.build(redis, keys)
    await rt.store.create_goal(GoalRecord(id="g3", goal=Goal(text="hello"), budget_tokens=10))
    await rt.store.transition_goal("g3", GoalState.PLANNING)
    await rt.store.save_plan("g3", _plan("a", "b", "c", "d"), expected_version=0)
    await rt.store.transition_goal("g3", GoalState.RUNNING)
    for tid in "abcd":
        await rt.store.transition_task("g3", tid, TaskState.READY, attempt=1)
    for tid in "bcd":
        await rt.store.transition_task("g3", tid, TaskState.RUNNING, expected_attempt=1)
    await rt.store.transition_task("g3", "b", TaskState.REVIEWING, expected_attempt=1)
    await redis.zadd(keys.leases(), {"g3|d|1": 10**13})  # d's executor is alive
    jobs = await check_goal(rt, "g3")
    got = sorted((type(j).__name__, getattr(j, "task_id", "")) for j in jobs)
    assert got == [("ExecuteJob", "a"), ("ExecuteJob", "c"), ("ReviewJob", "b")]
    assert all(j.redrive > 0 for j in jobs)
    assert await check_goal(rt, "g3") == []  # now each has a queued job
    assert any(isinstance(j, ExecuteJob | ReviewJob) for j in jobs)


async def test_ended_goals_leave_the_index(redis: ArqRedis, keys: Keys) -> None:
    """A terminal goal is not in the supervisor's index, so a fleet of finished goals costs nothing."""
    rt = Runtime.build(redis, keys)
    await rt.store.create_goal(GoalRecord(id="g4", goal=Goal(text="hello"), budget_tokens=10))
    assert await redis.zscore(keys.active_index(), "g4") is not None
    await rt.store.transition_goal("g4", GoalState.FAILED, reason="x")
    assert await redis.zscore(keys.active_index(), "g4") is None


async def test_a_corrupted_goal_record_fails_the_goal_visibly(redis: ArqRedis, keys: Keys) -> None:
    """A goal whose stored record is garbage ends `failed` naming the corruption, instead of hanging."""
    rt = Runtime.build(redis, keys)
    await rt.store.create_goal(GoalRecord(id="g5", goal=Goal(text="hello"), budget_tokens=10))
    await redis.hset(keys.goal("g5"), "record", "{not json")
    await supervise(rt, stale_after=0)
    assert (await redis.hget(keys.goal("g5"), "state")) == b"failed"
    assert b"corrupted record" in (await redis.hget(keys.goal("g5"), "reason") or b"")


async def test_a_supervisor_pass_forfeits_expired_reservations(redis: ArqRedis, keys: Keys) -> None:
    """A dead holder's reservation of a goal nobody calls for again is counted as spent by the
    supervisor's next pass (reserves sweep only when short of room)."""
    ledger = Ledger(redis, keys, reservation_ttl=0.05)
    await ledger.open("idle", 10_000)
    await ledger.reserve("idle", 10, 500)
    await asyncio.sleep(0.1)
    books = keys.ledger("idle")
    assert await redis.hget(books, "expired") is None  # type: ignore[misc]
    await supervise(Runtime.build(redis, keys), stale_after=3600)
    assert [int(v) for v in await redis.hmget(books, ["reserved", "spent_unknown", "expired"])] == [0, 510, 1]  # type: ignore[misc]
