"""The state store: atomic, state-machine-checked transitions against a real Redis."""

from __future__ import annotations

import asyncio

import pytest
from arq.connections import ArqRedis, create_pool

from bus import mux
from bus.attempts import AttemptStore
from bus.connection import redis_settings
from bus.events import EventLog
from bus.keys import Keys
from bus.schemas import Goal, GoalRecord, GoalState, Plan, TaskProgress, TaskResult, TaskSpec, TaskState
from bus.store import CorruptRecord, IllegalTransition, NotFound, StaleWrite, Store


def _plan(*ids: str, deps: dict[str, list[str]] | None = None) -> Plan:
    deps = deps or {}
    return Plan(
        tasks=[
            TaskSpec(
                id=i, title=f"task {i}", instructions="do it", definition_of_done="done", depends_on=deps.get(i, [])
            )
            for i in ids
        ]
    )


async def _goal(store: Store, gid: str = "g1") -> GoalRecord:
    record = GoalRecord(id=gid, goal=Goal(text="refund A100?"), budget_tokens=1000)
    assert await store.create_goal(record)
    return record


async def test_create_and_read_goal(redis: ArqRedis, keys: Keys) -> None:
    """A stored goal reads back equal, in `submitted`, and a second create with the same id is refused."""
    store = Store(redis, keys)
    record = await _goal(store)
    got = await store.get_goal("g1")
    assert got.goal == record.goal and got.state is GoalState.SUBMITTED and got.budget_tokens == 1000
    assert not await store.create_goal(record)
    with pytest.raises(NotFound):
        await store.get_goal("nope")


async def test_illegal_goal_transition_raises_and_writes_nothing(redis: ArqRedis, keys: Keys) -> None:
    """submitted -> succeeded is not in the state machine: typed error, state and stream unchanged."""
    store, log = Store(redis, keys), EventLog(redis, keys)
    await _goal(store)
    before = await log.read("g1")
    with pytest.raises(IllegalTransition) as exc:
        await store.transition_goal("g1", GoalState.SUCCEEDED, answer="x")
    assert exc.value.current == "submitted" and exc.value.target == "succeeded"
    got = await store.get_goal("g1")
    assert got.state is GoalState.SUBMITTED and got.answer is None
    assert await log.read("g1") == before


async def test_goal_walks_its_state_machine_and_emits_events(redis: ArqRedis, keys: Keys) -> None:
    """Each legal step moves the goal and appends exactly one event; repeating a step is a no-op."""
    store, log = Store(redis, keys), EventLog(redis, keys)
    await _goal(store)
    for target in (GoalState.PLANNING, GoalState.RUNNING, GoalState.REVIEWING):
        assert await store.transition_goal("g1", target)
    assert not await store.transition_goal("g1", GoalState.REVIEWING)  # already there
    assert await store.transition_goal("g1", GoalState.SUCCEEDED, answer="yes")
    got = await store.get_goal("g1")
    assert got.state is GoalState.SUCCEEDED and got.answer == "yes" and got.terminal
    states = [e.data.get("state") for e in await log.read("g1") if e.type == "goal.state"]
    assert states == ["planning", "running", "reviewing", "succeeded"]
    with pytest.raises(IllegalTransition):
        await store.transition_goal("g1", GoalState.RUNNING)


async def test_save_plan_versions_and_refuses_a_stale_writer(redis: ArqRedis, keys: Keys) -> None:
    """Plan v1 creates pending tasks; a re-run planner that saw version 0 gets StaleWrite, not v2."""
    store = Store(redis, keys)
    await _goal(store)
    assert await store.save_plan("g1", _plan("a", "b"), expected_version=0) == 1
    with pytest.raises(StaleWrite):
        await store.save_plan("g1", _plan("a", "b"), expected_version=0)
    tasks = await store.get_tasks("g1")
    assert sorted(tasks) == ["a", "b"] and all(t.state is TaskState.PENDING for t in tasks.values())
    assert await store.save_plan("g1", _plan("a", "c"), expected_version=1, reason="replan") == 2
    assert (await store.get_plan("g1", 1)).plan == _plan("a", "b")  # old versions stay readable
    assert (await store.get_plan("g1")).version == 2
    assert sorted(await store.get_tasks("g1")) == ["a", "b", "c"]


async def test_task_transitions_are_fenced_by_attempt(redis: ArqRedis, keys: Keys) -> None:
    """A worker holding attempt 1 cannot move a task that is on attempt 2."""
    store = Store(redis, keys)
    await _goal(store)
    await store.save_plan("g1", _plan("a"), expected_version=0)
    await store.transition_task("g1", "a", TaskState.READY)
    await store.transition_task("g1", "a", TaskState.RUNNING, attempt=1)
    await store.transition_task("g1", "a", TaskState.REVIEWING, expected_attempt=1)
    await store.transition_task("g1", "a", TaskState.RETRYING, expected_attempt=1, feedback="cite the deadline")
    await store.transition_task("g1", "a", TaskState.RUNNING, expected_attempt=1, attempt=2)
    with pytest.raises(StaleWrite):
        await store.transition_task("g1", "a", TaskState.REVIEWING, expected_attempt=1)
    task = await store.get_task("g1", "a")
    assert task.state is TaskState.RUNNING and task.attempt == 2 and task.feedback == "cite the deadline"
    with pytest.raises(IllegalTransition):
        await store.transition_task("g1", "a", TaskState.DONE)  # running -> done skips review


async def test_cancel_cancels_unfinished_tasks_atomically(redis: ArqRedis, keys: Keys) -> None:
    """Cancel moves the goal and every non-terminal task to cancelled; done tasks keep their state."""
    store = Store(redis, keys)
    await _goal(store)
    await store.transition_goal("g1", GoalState.PLANNING)
    await store.save_plan("g1", _plan("a", "b", "c"), expected_version=0)
    for state in (TaskState.READY, TaskState.RUNNING, TaskState.REVIEWING, TaskState.DONE):
        await store.transition_task("g1", "a", state, **({"attempt": 1} if state is TaskState.RUNNING else {}))
    await store.transition_task("g1", "b", TaskState.READY)
    assert await store.cancel_goal("g1", "user asked")
    assert not await store.cancel_goal("g1")
    tasks = await store.get_tasks("g1")
    assert tasks["a"].state is TaskState.DONE
    assert tasks["b"].state is TaskState.CANCELLED and tasks["c"].state is TaskState.CANCELLED
    goal = await store.get_goal("g1")
    assert goal.state is GoalState.CANCELLED and goal.reason == "user asked"


async def test_result_first_write_wins(redis: ArqRedis, keys: Keys) -> None:
    """A re-run attempt cannot overwrite the result its first run stored (the store reads it back)."""
    store = Store(redis, keys)
    attempt = AttemptStore(redis, keys, "g1", "a", 1)
    assert await attempt.acquire("first-run", ttl=30)
    first = TaskResult(goal_id="g1", task_id="a", attempt=1, answer="first", stop_reason="answered")
    second = TaskResult(goal_id="g1", task_id="a", attempt=1, answer="second", stop_reason="answered")
    assert await attempt.save_result(first)
    assert not await attempt.save_result(second)
    got = await store.get_result("g1", "a", 1)
    assert got is not None and got.answer == "first"


async def test_a_task_is_read_with_its_goal_and_its_attempts_result(redis: ArqRedis, keys: Keys) -> None:
    """`get_goal_and_task(result_of=n)`: the goal, the task and attempt n's result (None when that
    attempt has none); a task that does not exist is NotFound, as with `get_task`."""
    store = Store(redis, keys)
    await _goal(store)
    await store.save_plan("g1", _plan("a"), expected_version=0)
    attempt = AttemptStore(redis, keys, "g1", "a", 1)
    assert await attempt.acquire("run", ttl=30)
    await attempt.save_result(TaskResult(goal_id="g1", task_id="a", attempt=1, answer="42", stop_reason="answered"))
    goal, task, result = await store.get_goal_and_task("g1", "a", result_of=1)
    assert goal.id == "g1" and task.task_id == "a" and task.state is TaskState.PENDING
    assert result is not None and result.answer == "42"
    assert (await store.get_goal_and_task("g1", "a", result_of=2))[2] is None
    assert (await store.get_goal_and_task("g1", "a"))[2] is None
    with pytest.raises(NotFound):
        await store.get_goal_and_task("g1", "zz", result_of=1)


@pytest.mark.parametrize("shared", [False, True], ids=["pool", "shared connection"])
async def test_the_progress_of_a_plans_tasks(redis: ArqRedis, keys: Keys, redis_url: str, shared: bool) -> None:
    """`get_progress` and `get_goal_and_progress`: each task's state and attempt as its whole record
    says, a task without a record left out, the goal as `get_goal` reads it (also from the job's
    hand-over), and NotFound for a goal that does not exist; through the pool and through the
    shared connection a worker uses (`bus.mux`), whose replies are shaped differently."""
    client = await create_pool(redis_settings(redis_url)) if shared else redis
    if shared:
        assert mux.attach(client) is not None
    try:
        store = Store(client, keys)
        await _goal(store)
        await store.save_plan("g1", _plan("a", "b", "c"), expected_version=0)
        await store.transition_task("g1", "b", TaskState.READY, attempt=1)
        await store.transition_task("g1", "b", TaskState.RUNNING, attempt=2)
        records = await store.get_tasks("g1", ["a", "b", "c"])
        progress = await store.get_progress("g1", ["c", "b", "a", "nope"])
        assert progress == {t: TaskProgress(r.state, r.attempt) for t, r in records.items()}
        assert progress["b"] == TaskProgress(TaskState.RUNNING, 2) and progress["a"].attempt == 0
        goal, again = await store.get_goal_and_progress("g1", ["b", "nope"])
        assert goal == await store.get_goal("g1") and again == {"b": progress["b"]}
        fresh = Store(client, keys)  # knows no deadline yet: its check reads the goal and hands it over
        assert not await fresh.expire_if_late("g1", hand_over=True)
        handed, kept = await fresh.get_goal_and_progress("g1", ["a"])
        assert handed == goal and kept == {"a": progress["a"]}
        assert await store.get_progress("g1", []) == {}
        with pytest.raises(NotFound):
            await store.get_goal_and_progress("g2", ["a"])
    finally:
        if shared:
            await client.aclose()


@pytest.mark.parametrize(
    "damage",
    [
        ("SET", "not a hash"),
        ("HSET", "attempt", "1"),
        ("HSET", "state", "bogus", "attempt", "1"),
        ("HSET", "state", "done", "attempt", "-1"),
        ("HSET", "state", "done", "attempt", "two"),
    ],
    ids=["no hash", "no state", "unknown state", "negative attempt", "attempt not a number"],
)
async def test_a_damaged_task_record_is_named_by_the_progress_read(
    redis: ArqRedis, keys: Keys, damage: tuple[str, ...]
) -> None:
    """A task key that holds no task record makes the progress read raise CorruptRecord naming that
    key (not another task's), whichever of the plan's tasks it is."""
    store = Store(redis, keys)
    await _goal(store)
    await store.save_plan("g1", _plan("a", "b", "c"), expected_version=0)
    key = keys.task("g1", "b")
    await redis.delete(key)
    await redis.execute_command(damage[0], key, *damage[1:])
    for read in (store.get_progress("g1", ["a", "b", "c"]), store.get_goal_and_progress("g1", ["c", "b"])):
        with pytest.raises(CorruptRecord) as exc:
            await read
        assert exc.value.key == key


async def test_fifty_sibling_transitions_from_separate_connections_lose_nothing(
    redis: ArqRedis, keys: Keys, redis_url: str
) -> None:
    """50 tasks moved at once, each from its own connection: every one of them lands, with its event."""
    store = Store(redis, keys)
    await _goal(store)
    ids = [f"t{i}" for i in range(50)]
    await store.save_plan("g1", _plan(*ids), expected_version=0)
    pools = [await create_pool(redis_settings(redis_url)) for _ in ids]
    try:
        go = asyncio.Event()

        async def move(pool: ArqRedis, tid: str) -> None:
            s = Store(pool, keys)
            await go.wait()
            await s.transition_task("g1", tid, TaskState.READY)
            await s.transition_task("g1", tid, TaskState.RUNNING, attempt=1)

        runners = [asyncio.create_task(move(p, t)) for p, t in zip(pools, ids, strict=True)]
        await asyncio.sleep(0.05)
        go.set()
        await asyncio.gather(*runners)
    finally:
        for p in pools:
            await p.aclose()
    tasks = await store.get_tasks("g1")
    assert len(tasks) == 50
    assert all(t.state is TaskState.RUNNING and t.attempt == 1 for t in tasks.values())
    events = [e for e in await EventLog(redis, keys).read("g1") if e.type == "task.state"]
    assert len(events) == 100


async def test_racing_claims_on_one_task_have_exactly_one_winner(redis: ArqRedis, keys: Keys, redis_url: str) -> None:
    """20 connections race ready -> running on the same task: one moves it, the rest see it done."""
    store = Store(redis, keys)
    await _goal(store)
    await store.save_plan("g1", _plan("a"), expected_version=0)
    await store.transition_task("g1", "a", TaskState.READY)
    pools = [await create_pool(redis_settings(redis_url)) for _ in range(20)]
    try:
        results = await asyncio.gather(
            *(Store(p, keys).transition_task("g1", "a", TaskState.RUNNING, attempt=1) for p in pools)
        )
    finally:
        for p in pools:
            await p.aclose()
    assert sorted(results) == [False] * 19 + [True]


async def test_a_goal_past_its_deadline_is_failed_once(redis: ArqRedis, keys: Keys) -> None:
    """expire_if_late fails a goal whose deadline passed (once), and leaves an on-time or ended goal alone."""
    from datetime import timedelta

    from bus.schemas import utcnow

    store = Store(redis, keys)
    soon = utcnow() + timedelta(seconds=60)
    await store.create_goal(GoalRecord(id="late", goal=Goal(text="x", deadline=soon), budget_tokens=10))
    await store.create_goal(GoalRecord(id="free", goal=Goal(text="x"), budget_tokens=10))
    assert not await store.expire_if_late("late")
    assert not await store.expire_if_late("free", now=soon + timedelta(days=1))
    assert await store.expire_if_late("late", now=soon + timedelta(seconds=1))
    assert not await store.expire_if_late("late", now=soon + timedelta(seconds=2))
    goal = await store.get_goal("late")
    assert goal.state is GoalState.FAILED and goal.reason is not None and "deadline" in goal.reason


async def test_tasks_read_by_the_ids_of_a_plan(redis: ArqRedis, keys: Keys) -> None:
    """`get_tasks(ids=...)` reads just those records, one round trip without the id set; the same
    records as a full read; an id without a record is left out."""
    store = Store(redis, keys)
    await _goal(store)
    await store.save_plan("g1", _plan("a", "b", "c"), expected_version=0)
    await store.transition_task("g1", "b", TaskState.READY)
    every = await store.get_tasks("g1")
    some = await store.get_tasks("g1", ["b", "a", "nope"])
    assert sorted(some) == ["a", "b"] and some["b"] == every["b"] and some["a"] == every["a"]
    assert await store.get_tasks("g1", []) == {}


async def test_a_goal_and_one_of_its_tasks_read_together(redis: ArqRedis, keys: Keys) -> None:
    """`get_goal_and_task` returns what `get_goal` and `get_task` return; a missing goal or task is
    NotFound, a goal key of another type a CorruptRecord."""
    store = Store(redis, keys)
    await _goal(store)
    await store.save_plan("g1", _plan("a"), expected_version=0)
    goal, task, _ = await store.get_goal_and_task("g1", "a")
    assert goal == await store.get_goal("g1") and task == await store.get_task("g1", "a")
    with pytest.raises(NotFound):
        await store.get_goal_and_task("g1", "zz")
    with pytest.raises(NotFound):
        await store.get_goal_and_task("g2", "a")
    await redis.set(keys.goal("g3"), "not a hash")
    with pytest.raises(CorruptRecord):
        await store.get_goal_and_task("g3", "a")
