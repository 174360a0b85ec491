"""The hot path's shortcuts keep their promises: one enqueue script writes what arq reads, a batch
wakes each role once, reads skipped only where nothing can have changed, ledger books still refuse
what HINCRBY refused."""

from __future__ import annotations

from datetime import timedelta

import pytest
from arq.connections import ArqRedis
from arq.jobs import Job, JobStatus
from redis.exceptions import ResponseError

from bus.attempts import AttemptStore, StepRecord
from bus.batch import run_scripts_and_reads
from bus.jobs import ExecuteJob, Jobs, PlanJob
from bus.keys import Keys
from bus.ledger import Ledger
from bus.schemas import Goal, GoalRecord, GoalState, Plan, TaskSpec, TaskState, utcnow
from bus.store import CorruptRecord, IllegalTransition, Store
from llm.types import Message, ModelResponse, TextBlock, Usage


async def test_an_enqueued_job_is_what_arq_reads_with_its_driver_record(redis: ArqRedis, keys: Keys) -> None:
    """The enqueue script writes arq's job key and queue entry (arq reads the function and the
    payload back), the supervisor's driver record, and refuses the same job id a second time."""
    jobs = Jobs(redis, keys)
    job = ExecuteJob(goal_id="g" * 32, task_id="t1", attempt=1)
    assert await jobs.enqueue(job)
    assert not await jobs.enqueue(job)  # deterministic id: a duplicate is a no-op
    arq_job = Job(jobs.job_id(job), redis, _queue_name=keys.queue("executor"))
    assert await arq_job.status() is JobStatus.queued
    info = await arq_job.info()
    assert info is not None and info.function == "execute"
    assert info.args == (job.model_dump(mode="json", exclude={"traceparent"}),)
    drivers = await jobs.drivers("g" * 32)
    assert drivers["task:t1"][0] == jobs.job_id(job) and drivers["task:t1"][2] is True


async def test_a_batch_wakes_each_role_once_after_its_enqueues(redis: ArqRedis, keys: Keys) -> None:
    jobs = Jobs(redis, keys)
    async with jobs.batch():
        for t in ("a", "b", "c"):
            assert await jobs.enqueue(ExecuteJob(goal_id="h" * 32, task_id=t, attempt=1))
        assert await redis.xlen(keys.wake("executor")) == 0  # nothing woken yet
    assert await redis.xlen(keys.wake("executor")) == 1
    assert await redis.zcard(keys.queue("executor")) == 3
    assert await jobs.enqueue(PlanJob(goal_id="i" * 32))  # outside a batch: woken at once
    assert await redis.xlen(keys.wake("planner")) == 1


async def test_a_first_lease_holder_reads_no_steps_until_it_writes_one(redis: ArqRedis, keys: Keys) -> None:
    """Epoch 1 means nothing was stored under a lease yet; after its own write the store reads again."""
    store = AttemptStore(redis, keys, "g1", "t", 1)
    assert await store.acquire("me", 5)
    assert await store.steps() == [] and (await store.pending()).turn is None
    turn = Message(role="assistant", content=[TextBlock(text="hi")])
    step = StepRecord(index=0, assistant=turn, usage=Usage(), stop_reason="stop")
    await store.append_step(step)
    assert [s.index for s in await store.steps()] == [0]
    await store.release()
    again = AttemptStore(redis, keys, "g1", "t", 1)
    assert await again.acquire("other", 5)  # epoch 3: it must read what the first holder stored
    assert [s.index for s in await again.steps()] == [0]


async def test_a_goal_read_is_handed_over_once_and_only_in_time(redis: ArqRedis, keys: Keys) -> None:
    store = Store(redis, keys)
    await store.create_goal(GoalRecord(id="g2", goal=Goal(text="x"), budget_tokens=10))
    assert not await store.expire_if_late("g2", hand_over=True)
    await store.transition_goal("g2", GoalState.PLANNING)
    # The first read of the job is the wrapper's (an instant earlier); the next goes to Redis.
    assert (await store.get_goal("g2")).state is GoalState.SUBMITTED
    assert (await store.get_goal("g2")).state is GoalState.PLANNING
    # Without hand_over, or too late, nothing is handed over.
    assert not await store.expire_if_late("g2")
    await store.transition_goal("g2", GoalState.RUNNING)
    assert (await store.get_goal("g2")).state is GoalState.RUNNING


async def test_the_wrapper_reads_an_execute_jobs_task_with_its_goal_in_one_round_trip(
    redis: ArqRedis, keys: Keys
) -> None:
    """`expire_if_late(..., task_id=)` reads the goal and the task together; the handler's
    `get_goal_and_task` of that task then reads nothing (it sees the task as it was then). Another
    task is read from Redis; the hand-over serves once."""
    store = Store(redis, keys)
    await store.create_goal(GoalRecord(id="g5", goal=Goal(text="x"), budget_tokens=10))
    plan = Plan(tasks=[TaskSpec(id=t, title=t, instructions="do", definition_of_done="done") for t in ("a", "b")])
    await store.save_plan("g5", plan, expected_version=0)
    assert not await store.expire_if_late("g5", hand_over=True, task_id="a")
    await store.transition_task("g5", "a", TaskState.READY)  # after the read: the handler gets the read
    goal, task, _ = await store.get_goal_and_task("g5", "a")
    assert goal.id == "g5" and task.state is TaskState.PENDING
    _, again, _ = await store.get_goal_and_task("g5", "a")  # once only: then from Redis
    assert again.state is TaskState.READY
    assert not await store.expire_if_late("g5", hand_over=True, task_id="a")
    _, other, _ = await store.get_goal_and_task("g5", "b")
    assert other.task_id == "b"


async def test_a_plan_read_in_another_round_trip_serves_get_plan_and_a_damaged_one_is_reported(
    redis: ArqRedis, keys: Keys
) -> None:
    """`plan_read` rides along the move to running (`run_scripts_and_reads`); its reply, once
    remembered, is what `get_plan` returns. A damaged plan is not kept: `get_plan` names it."""
    store = Store(redis, keys)
    await store.create_goal(GoalRecord(id="g6", goal=Goal(text="x"), budget_tokens=10))
    plan = Plan(tasks=[TaskSpec(id="a", title="a", instructions="do", definition_of_done="done")])
    await store.save_plan("g6", plan, expected_version=0)
    read = store.plan_read("g6", 1)
    assert read == ("GET", keys.plan("g6", 1))
    _, (raw,) = await run_scripts_and_reads(redis, [], [read])
    store.remember_plan("g6", 1, raw)
    assert store.plan_read("g6", 1) is None  # known now: nothing to read
    await redis.set(keys.plan("g6", 1), "{not json")
    assert [t.id for t in (await store.get_plan("g6", 1)).plan.tasks] == ["a"]  # the remembered read
    fresh = Store(redis, keys)
    _, (damaged,) = await run_scripts_and_reads(redis, [], [fresh.plan_read("g6", 1) or ()])
    fresh.remember_plan("g6", 1, damaged)
    with pytest.raises(CorruptRecord, match="plan"):
        await fresh.get_plan("g6", 1)


async def test_a_remembered_deadline_still_fails_a_late_goal(redis: ArqRedis, keys: Keys) -> None:
    store = Store(redis, keys)
    soon = utcnow() + timedelta(seconds=30)
    await store.create_goal(GoalRecord(id="g3", goal=Goal(text="x", deadline=soon), budget_tokens=10))
    await store.get_goal("g3")  # remembered from here on: the next checks need no read
    assert not await store.expire_if_late("g3")
    assert await store.expire_if_late("g3", now=soon + timedelta(seconds=1))
    assert (await store.get_goal("g3")).state is GoalState.FAILED


async def test_a_book_field_that_is_no_integer_is_refused_as_hincrby_refused_it(redis: ArqRedis, keys: Keys) -> None:
    ledger = Ledger(redis, keys)
    await ledger.open("g4", 10_000)
    r = await ledger.reserve("g4", 100, 100)
    await redis.hset(keys.ledger("g4"), "spent_input", "lots")  # type: ignore[misc]
    with pytest.raises(ResponseError, match="not an integer"):
        await ledger.settle(r, Usage(input_tokens=10, output_tokens=5))


async def test_enqueue_many_sends_each_job_once_and_wakes_each_role_once(redis: ArqRedis, keys: Keys) -> None:
    """Several jobs in one round trip: each enqueued as `enqueue` would (a duplicate refused), one
    wake-up per role at the end, and inside a batch the batch's end wakes instead."""
    jobs = Jobs(redis, keys)
    first = ExecuteJob(goal_id="m" * 32, task_id="a", attempt=1)
    assert await jobs.enqueue_many([first, ExecuteJob(goal_id="m" * 32, task_id="b", attempt=1), first]) == [
        True,
        True,
        False,
    ]
    assert await redis.zcard(keys.queue("executor")) == 2
    assert await redis.xlen(keys.wake("executor")) == 1
    arq_job = Job(jobs.job_id(first), redis, _queue_name=keys.queue("executor"))
    info = await arq_job.info()
    assert info is not None and info.function == "execute" and info.args[0]["task_id"] == "a"
    async with jobs.batch():
        assert await jobs.enqueue_many([PlanJob(goal_id="n" * 32), PlanJob(goal_id="o" * 32)]) == [True, True]
        assert await redis.xlen(keys.wake("planner")) == 0
    assert await redis.xlen(keys.wake("planner")) == 1


async def test_batched_task_moves_report_each_outcome_and_survive_a_flushed_script_cache(
    redis: ArqRedis, keys: Keys
) -> None:
    """`transition_tasks`: each move atomic on its own, its outcome (moved, already there, illegal)
    reported, not raised; after `SCRIPT FLUSH` (a restarted Redis) the batch loads the script again."""
    store = Store(redis, keys)
    await store.create_goal(GoalRecord(id="g9", goal=Goal(text="x"), budget_tokens=100))
    plan = Plan(
        tasks=[TaskSpec(id=t, title=t, instructions="do", definition_of_done="done") for t in ("a", "b", "c")]
    )
    await store.save_plan("g9", plan, expected_version=0)
    await store.transition_task("g9", "b", TaskState.READY)
    await store.transition_task("g9", "c", TaskState.CANCELLED)
    await redis.script_flush()
    moves = [store.task_move("g9", t, TaskState.READY, attempt=1) for t in ("a", "b", "c")]
    a, b, c = await store.transition_tasks(moves)
    assert a is True and b is False
    assert isinstance(c, IllegalTransition) and c.current == "cancelled"
    assert (await store.get_task("g9", "a")).attempt == 1


async def test_a_turn_seeded_first_is_known_without_a_read_and_stored_for_the_next_holder(
    redis: ArqRedis, keys: Keys
) -> None:
    """A first lease holder that seeds a turn knows the attempt holds just that turn (no read back);
    what it wrote is what the next holder reads, and its next write ends the shortcut."""
    store = AttemptStore(redis, keys, "g2", "t", 1)
    assert await store.acquire("me", 5)
    turn = ModelResponse(
        content=[TextBlock(text="routed")], stop_reason="tool_use", usage=Usage(input_tokens=3), model="m"
    )
    await store.save_turn(turn)
    assert await store.steps() == [] and (await store.pending()).turn == turn
    await store.mark_started("call_1")
    assert (await store.pending()).started == {"call_1"}  # read back after its next write
    await store.release()
    again = AttemptStore(redis, keys, "g2", "t", 1)
    assert await again.acquire("other", 5)
    assert (await again.pending()).turn == turn and await again.steps() == []


async def test_a_step_write_brings_back_the_tasks_state_once_and_only_in_time(redis: ArqRedis, keys: Keys) -> None:
    """`append_step` reads the task's state and attempt in its script, for the check before the next
    model call: the state as it is at the write (a cancel before it is seen), once, and not later."""
    store = Store(redis, keys)
    await store.create_goal(GoalRecord(id="g10", goal=Goal(text="x"), budget_tokens=10))
    plan = Plan(tasks=[TaskSpec(id="t", title="t", instructions="i", definition_of_done="d")])
    await store.save_plan("g10", plan, 0)
    attempts = AttemptStore(redis, keys, "g10", "t", 1)
    assert await attempts.acquire("me", 5)
    turn = Message(role="assistant", content=[TextBlock(text="hi")])
    assert attempts.task_seen() is None  # nothing written yet
    await attempts.append_step(StepRecord(index=0, assistant=turn, usage=Usage(), stop_reason="stop"))
    state = (await store.get_task("g10", "t")).state.value
    assert attempts.task_seen() == (state, (await store.get_task("g10", "t")).attempt)
    assert attempts.task_seen() is None  # once
    await store.cancel_goal("g10")
    await attempts.append_step(StepRecord(index=1, assistant=turn, usage=Usage(), stop_reason="stop"))
    seen = attempts.task_seen()
    assert seen is not None and seen[0] == TaskState.CANCELLED.value
    await attempts.append_step(StepRecord(index=2, assistant=turn, usage=Usage(), stop_reason="stop"))
    assert attempts.task_seen(within=0.0) is None  # too late: the caller reads the task itself
    await attempts.append_step(StepRecord(index=3, assistant=turn, usage=Usage(), stop_reason="stop"), read_task=False)
    assert attempts.task_seen() is None  # the last step of an attempt does not read the task
    assert len(await attempts.steps()) == 4


async def test_several_results_are_read_in_one_read_and_a_missing_one_is_none(redis: ArqRedis, keys: Keys) -> None:
    """`get_results` (and `latest_results` with it) reads the fields of the goal's results hash
    together: each stored attempt's result, None for one never stored."""
    from bus.schemas import TaskResult
    from bus.stops import TaskStop

    store = Store(redis, keys)
    for tid, attempt in (("a", 1), ("b", 2)):
        result = TaskResult(
            goal_id="g11", task_id=tid, attempt=attempt, answer=f"{tid}{attempt}", stop_reason=TaskStop.ANSWERED
        )
        await redis.hset(keys.results("g11"), keys.result_field(tid, attempt), result.model_dump_json())
    found = await store.get_results("g11", [("a", 1), ("b", 1), ("b", 2)])
    assert {k: v.answer if v else None for k, v in found.items()} == {("a", 1): "a1", ("b", 1): None, ("b", 2): "b2"}
    assert await store.get_results("g11", []) == {}
