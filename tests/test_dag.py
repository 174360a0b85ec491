"""Plan DAGs (pure): validation sentences, cycles, scheduling, ordering, rendering, replan reconciliation."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.schemas import Plan, TaskRecord, TaskSpec, TaskState
from planner.dag import (
    CycleError,
    all_done,
    find_cycle,
    ready_tasks,
    render_json,
    render_mermaid,
    topological_order,
    validate_plan,
)
from planner.reconcile import reconcile

TOOLS = {"lookup_order", "refund_policy", "send_email"}


def spec(tid: str, *deps: str, tools: tuple[str, ...] = (), dod: str = "it is done", title: str = "") -> TaskSpec:
    return TaskSpec(
        id=tid,
        title=title or f"task {tid}",
        instructions=f"do {tid}",
        depends_on=list(deps),
        definition_of_done=dod,
        tools=list(tools),
    )


def plan(*specs: TaskSpec) -> Plan:
    return Plan(tasks=list(specs))


def check(p: Plan, allowed: set[str] | None = None, max_tasks: int = 20) -> list[str]:
    return validate_plan(p, known_tools=TOOLS, allowed_tools=allowed, max_tasks=max_tasks)


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "allowed", "max_tasks", "expected"),
    [
        (plan(spec("a"), spec("b", "a"), spec("c", "a")), None, 20, []),
        (
            plan(spec("a"), spec("a")),
            None,
            20,
            ["Task id 'a' is used by 2 tasks; every task needs its own id."],
        ),
        (
            plan(spec("a", "zz")),
            None,
            20,
            ["Task 'a' depends on 'zz', which is not a task of this plan."],
        ),
        (plan(spec("a", "a")), None, 20, ["Task 'a' depends on itself."]),
        (
            plan(spec("a", "c"), spec("b", "a"), spec("c", "b")),
            None,
            20,
            [
                "The dependencies form a cycle: a -> c -> b -> a (each task depends on the next); "
                "a plan must be acyclic."
            ],
        ),
        (
            plan(spec("a"), spec("b"), spec("c")),
            None,
            2,
            ["The plan has 3 tasks; at most 2 are allowed."],
        ),
        (
            plan(spec("a", tools=("teleport",))),
            None,
            20,
            [
                "Task 'a' uses the tool 'teleport', which does not exist; the tools you may use are: "
                "lookup_order, refund_policy, send_email."
            ],
        ),
        (
            plan(spec("a", tools=("send_email",))),
            {"lookup_order"},
            20,
            [
                "Task 'a' uses the tool 'send_email', which this goal does not allow; the tools you may use are: "
                "lookup_order."
            ],
        ),
        (
            plan(spec("a", tools=("lookup_order",))),
            set(),
            20,
            ["Task 'a' uses the tool 'lookup_order', which this goal does not allow; no tools are available."],
        ),
        (
            Plan.model_construct(
                tasks=[TaskSpec.model_construct(**{**spec("a").model_dump(), "definition_of_done": " "})]
            ),
            None,
            20,
            ["Task 'a' has no definition of done; say how the result will be checked."],
        ),
    ],
    ids=[
        "valid",
        "duplicate-id",
        "unknown-dep",
        "self-dep",
        "cycle",
        "too-many",
        "unknown-tool",
        "tool-not-allowed",
        "no-tools-allowed",
        "no-dod",
    ],
)
def test_validate_plan_names_each_problem(
    p: Plan, allowed: set[str] | None, max_tasks: int, expected: list[str]
) -> None:
    """Each kind of invalid plan yields exactly one precise sentence; a valid plan yields none."""
    assert check(p, allowed, max_tasks) == expected


def test_validate_plan_reports_every_problem_at_once() -> None:
    """Several problems are all reported in one pass, so one correction round can fix them all."""
    p = plan(spec("a", "b", tools=("teleport",)), spec("b", "a"), spec("b"), spec("c", "nope"))
    problems = check(p, max_tasks=3)
    assert len(problems) == 5
    assert problems[0].startswith("The plan has 4 tasks")
    assert any("a -> b -> a" in s for s in problems)
    assert any("'teleport'" in s for s in problems) and any("'nope'" in s for s in problems)


# -- cycles and order -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "cycle"),
    [
        (plan(spec("a"), spec("b", "a")), None),
        (plan(spec("a", "b"), spec("b", "a")), ["a", "b", "a"]),
        (plan(spec("x"), spec("a", "x", "b"), spec("b", "c"), spec("c", "a")), ["a", "b", "c", "a"]),
        (plan(spec("a", "a")), None),  # a self-dependency is reported on its own, not as a cycle
        (plan(spec("a", "ghost")), None),
    ],
)
def test_find_cycle(p: Plan, cycle: list[str] | None) -> None:
    """find_cycle returns a closed walk through the cycle (first node repeated), or None for a DAG."""
    assert find_cycle(p) == cycle


def test_topological_order_is_stable_and_refuses_cycles() -> None:
    """Dependencies come first, ties keep plan order; a cyclic plan raises CycleError naming the cycle."""
    assert topological_order(plan(spec("d", "b", "c"), spec("c", "a"), spec("b"), spec("a"))) == ["b", "a", "c", "d"]
    with pytest.raises(CycleError, match="a -> b -> a"):
        topological_order(plan(spec("a", "b"), spec("b", "a")))


# -- scheduling -------------------------------------------------------------------------------

P4 = plan(spec("a"), spec("b"), spec("c"), spec("d", "a", "b", "c"))
S = TaskState


@pytest.mark.parametrize(
    ("states", "ready"),
    [
        ({}, ["a", "b", "c"]),
        ({"a": S.READY, "b": S.RUNNING}, ["c"]),
        ({"a": S.DONE, "b": S.DONE, "c": S.REVIEWING}, []),
        ({"a": S.DONE, "b": S.DONE, "c": S.DONE}, ["d"]),
        ({"a": S.DONE, "b": S.DONE, "c": S.DONE, "d": S.READY}, []),
        ({"a": S.DONE, "b": S.FAILED, "c": S.DONE}, []),
    ],
)
def test_ready_tasks(states: dict[str, TaskState], ready: list[str]) -> None:
    """Only pending tasks whose dependencies are all done are ready; anything else blocks them."""
    assert ready_tasks(P4, states) == ready


def test_all_done() -> None:
    """The goal is complete only when every task of the plan is done."""
    assert not all_done(P4, {"a": S.DONE, "b": S.DONE, "c": S.DONE})
    assert all_done(P4, dict.fromkeys("abcd", S.DONE))


# -- rendering --------------------------------------------------------------------------------


def test_render_mermaid() -> None:
    """Mermaid nodes are positional (an id like `end` is a keyword), labelled and styled by state, quotes escaped."""
    p = plan(spec("end", title='say "hi"'), spec("b", "end"))
    out = render_mermaid(p, {"end": S.DONE})
    assert out.splitlines()[0] == "flowchart TD"
    assert '    t0["end: say #quot;hi#quot; (done)"]:::done' in out
    assert '    t1["b: task b (pending)"]:::pending' in out
    assert "    t0 --> t1" in out
    assert "classDef done" in out and "classDef pending" in out and "classDef failed" not in out


def test_render_json() -> None:
    """The JSON rendering is plain data: tasks with states, edges, topological order and the ready set."""
    out = render_json(P4, {"a": S.DONE})
    json.dumps(out)
    assert [t["state"] for t in out["tasks"]] == ["done", "pending", "pending", "pending"]
    assert {"from": "a", "to": "d"} in out["edges"] and len(out["edges"]) == 3
    assert out["order"] == ["a", "b", "c", "d"] and out["cycle"] is None and out["ready"] == ["b", "c"]
    cyclic = render_json(plan(spec("a", "b"), spec("b", "a")), {})
    assert cyclic["order"] is None and cyclic["cycle"] == ["a", "b", "a"]


# -- properties -------------------------------------------------------------------------------


@st.composite
def dags(draw: st.DrawFn) -> tuple[Plan, dict[str, TaskState]]:
    """A random DAG (edges only to earlier tasks) with random task states."""
    n = draw(st.integers(min_value=1, max_value=12))
    ids = [f"t{i}" for i in range(n)]
    specs = []
    for i, tid in enumerate(ids):
        deps = draw(st.lists(st.sampled_from(ids[:i]), unique=True, max_size=i)) if i else []
        specs.append(spec(tid, *deps))
    states = {tid: draw(st.sampled_from(list(TaskState))) for tid in ids}
    return plan(*specs), states


@settings(max_examples=150, deadline=None)
@given(dags())
def test_ready_tasks_never_depend_on_unfinished_work(case: tuple[Plan, dict[str, TaskState]]) -> None:
    """For any DAG and states: every ready task is pending, all its deps are done, and nothing is missed."""
    p, states = case
    ready = ready_tasks(p, states)
    by_id = {t.id: t for t in p.tasks}
    for tid in ready:
        assert states[tid] is TaskState.PENDING
        assert all(states[d] is TaskState.DONE for d in by_id[tid].depends_on)
    expected = [
        t.id
        for t in p.tasks
        if states[t.id] is TaskState.PENDING and all(states[d] is TaskState.DONE for d in t.depends_on)
    ]
    assert ready == expected
    assert find_cycle(p) is None and check(p) == []
    order = topological_order(p)
    assert all(order.index(d) < order.index(t.id) for t in p.tasks for d in t.depends_on)


@settings(max_examples=150, deadline=None)
@given(dags(), st.data())
def test_a_back_edge_produces_a_named_cycle(case: tuple[Plan, dict[str, TaskState]], data: st.DataObject) -> None:
    """Adding an edge from an ancestor back to a descendant creates a cycle that validation names."""
    p, _ = case
    paths = [(t.id, d) for t in p.tasks for d in t.depends_on]  # t depends on d
    if not paths:
        p = plan(*p.tasks, spec("extra", p.tasks[0].id))
        paths = [("extra", p.tasks[0].id)]
    child, parent = data.draw(st.sampled_from(paths))
    tasks = [t.model_copy(update={"depends_on": [*t.depends_on, child]}) if t.id == parent else t for t in p.tasks]
    broken = Plan(tasks=tasks)
    cycle = find_cycle(broken)
    assert cycle is not None and cycle[0] == cycle[-1] and len(cycle) >= 3
    by_id = {t.id: t for t in broken.tasks}
    assert all(cycle[i + 1] in by_id[cycle[i]].depends_on for i in range(len(cycle) - 1))
    assert any(" -> ".join(cycle) in s for s in check(broken))


# -- replan reconciliation --------------------------------------------------------------------


def rec(tid: str, state: TaskState, version: int = 1, attempt: int = 1) -> TaskRecord:
    return TaskRecord(goal_id="g", task_id=tid, state=state, plan_version=version, attempt=attempt)


def test_reconcile_keeps_accepted_work_and_supersedes_the_rest() -> None:
    """Same spec + done is kept; changed, failed or dropped tasks are superseded; returning ids are restored."""
    old = plan(spec("a"), spec("b"), spec("c", "a", "b"), spec("x"))
    new = plan(spec("a"), spec("b", dod="now with a deadline"), spec("c", "a", "b"), spec("n", "a"))
    records = {
        "a": rec("a", S.DONE),
        "b": rec("b", S.FAILED, attempt=3),
        "c": rec("c", S.PENDING, attempt=0),
        "x": rec("x", S.RUNNING),
        "n": rec("n", S.PENDING, version=2, attempt=0),  # created by save_plan
        "old": rec("old", S.SUPERSEDED),
    }
    moves = reconcile(old, new, records, 2)
    assert moves.keep == ["a", "c"]
    assert moves.supersede == ["b", "x"]
    assert moves.restore == ["b"]


def test_reconcile_reruns_a_done_task_whose_dependency_changed() -> None:
    """A done task is kept only if everything it depends on is kept: its inputs must not change."""
    old = plan(spec("a"), spec("b", "a"))
    new = plan(spec("a", dod="stricter"), spec("b", "a"))
    moves = reconcile(old, new, {"a": rec("a", S.DONE), "b": rec("b", S.DONE)}, 2)
    assert moves.keep == [] and moves.supersede == ["a", "b"] and moves.restore == ["a", "b"]


def test_reconcile_is_idempotent_after_a_partial_run() -> None:
    """Re-running after the moves were made finds nothing left to do; a dropped id coming back is restored."""
    old = plan(spec("a"), spec("b"))
    new = plan(spec("a"), spec("b", dod="changed"), spec("gone"))
    after = {
        "a": rec("a", S.DONE),
        "b": rec("b", S.PENDING, version=2),
        "gone": rec("gone", S.SUPERSEDED),
    }
    moves = reconcile(old, new, after, 2)
    assert moves.keep == ["a"] and moves.supersede == [] and moves.restore == ["gone"]
