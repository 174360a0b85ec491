"""The plan as a graph: validation, cycles, scheduling and rendering. Pure: no I/O, no clock.

Edges follow `TaskSpec.depends_on`: a task may start once every task it depends on is `done`.
Every problem `validate_plan` finds is a full sentence, because it is sent back to the model as
is (an invalid plan is returned to the planner with the reason; docs/internals.md, "The model protocol").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from typing import Any

from bus.schemas import Plan, TaskSpec, TaskState

# A task with no record yet is one the plan just created: save_plan creates every record as pending.
_DEFAULT_STATE = TaskState.PENDING


class CycleError(ValueError):
    """The plan's dependencies are not a DAG; `cycle` is the closed walk found."""

    def __init__(self, cycle: list[str]) -> None:
        super().__init__(f"the dependencies form a cycle: {format_cycle(cycle)}")
        self.cycle = cycle

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.cycle,))


def format_cycle(cycle: list[str]) -> str:
    return " -> ".join(cycle)


def _specs_by_id(plan: Plan) -> dict[str, TaskSpec]:
    """First spec per id (duplicates are reported by `validate_plan`, not silently merged)."""
    out: dict[str, TaskSpec] = {}
    for spec in plan.tasks:
        out.setdefault(spec.id, spec)
    return out


def _edges(plan: Plan) -> dict[str, list[str]]:
    """id -> its known dependencies, without self-loops or unknown ids (reported separately)."""
    specs = _specs_by_id(plan)
    return {
        tid: list(dict.fromkeys(d for d in spec.depends_on if d in specs and d != tid)) for tid, spec in specs.items()
    }


# -- structure --------------------------------------------------------------------------------


def find_cycle(plan: Plan) -> list[str] | None:
    """One dependency cycle as a closed walk (`["a", "b", "c", "a"]`: a depends on b, ...), or None.

    Self-dependencies are not reported here (`validate_plan` names them on their own). Deterministic:
    the search visits tasks and their dependencies in plan order.
    """
    edges = _edges(plan)
    finished: set[str] = set()
    for root in edges:
        if root in finished:
            continue
        # Iterative DFS: a deep chain must not hit the recursion limit.
        path = [root]
        on_path = {root}
        stack = [iter(edges[root])]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                node = path.pop()
                on_path.discard(node)
                finished.add(node)
            elif nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in finished:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(edges[nxt]))
    return None


def topological_order(plan: Plan) -> list[str]:
    """Task ids so that every task comes after its dependencies; ties keep plan order.

    Raises `CycleError` naming the cycle when there is one.
    """
    cycle = find_cycle(plan)
    if cycle is not None:
        raise CycleError(cycle)
    edges = _edges(plan)
    placed: set[str] = set()
    order: list[str] = []
    # Plans hold at most a few hundred tasks: repeated passes in plan order keep ties stable and simple.
    while len(order) < len(edges):
        for tid, deps in edges.items():
            if tid not in placed and all(d in placed for d in deps):
                placed.add(tid)
                order.append(tid)
    return order


def validate_plan(
    plan: Plan,
    *,
    known_tools: Collection[str],
    allowed_tools: Collection[str] | None,
    max_tasks: int,
) -> list[str]:
    """Every problem of `plan`, each as one sentence the model can act on; [] when it is valid.

    `allowed_tools` is the goal's allow-list (None: every known tool is allowed).
    """
    problems: list[str] = []
    if len(plan.tasks) > max_tasks:
        problems.append(f"The plan has {len(plan.tasks)} tasks; at most {max_tasks} are allowed.")
    counts = Counter(t.id for t in plan.tasks)
    for tid, n in counts.items():
        if n > 1:
            problems.append(f"Task id '{tid}' is used by {n} tasks; every task needs its own id.")
    ids = set(counts)
    usable = sorted(t for t in known_tools if allowed_tools is None or t in allowed_tools)
    for spec in plan.tasks:
        problems += _task_problems(spec, ids, set(known_tools), allowed_tools, usable)
    cycle = find_cycle(plan)
    if cycle is not None:
        problems.append(
            f"The dependencies form a cycle: {format_cycle(cycle)} (each task depends on the next); "
            "a plan must be acyclic."
        )
    return problems


def _task_problems(
    spec: TaskSpec,
    ids: set[str],
    known: set[str],
    allowed: Collection[str] | None,
    usable: list[str],
) -> list[str]:
    problems: list[str] = []
    tid = spec.id
    if tid in spec.depends_on:
        problems.append(f"Task '{tid}' depends on itself.")
    for dep in spec.depends_on:
        if dep != tid and dep not in ids:
            problems.append(f"Task '{tid}' depends on '{dep}', which is not a task of this plan.")
    choices = f"the tools you may use are: {', '.join(usable)}" if usable else "no tools are available"
    for tool in spec.tools:
        if tool not in known:
            problems.append(f"Task '{tid}' uses the tool '{tool}', which does not exist; {choices}.")
        elif allowed is not None and tool not in allowed:
            problems.append(f"Task '{tid}' uses the tool '{tool}', which this goal does not allow; {choices}.")
    # The schema already refuses an empty string; this also catches a blank one built without validation.
    if not spec.definition_of_done.strip():
        problems.append(f"Task '{tid}' has no definition of done; say how the result will be checked.")
    return problems


# -- scheduling -------------------------------------------------------------------------------


def _state(states: Mapping[str, TaskState], tid: str) -> TaskState:
    return states.get(tid, _DEFAULT_STATE)


def ready_tasks(plan: Plan, states: Mapping[str, TaskState]) -> list[str]:
    """Pending tasks whose dependencies are all `done`, in plan order (what dispatch may claim)."""
    specs = _specs_by_id(plan)
    return [
        tid
        for tid, spec in specs.items()
        if _state(states, tid) is TaskState.PENDING
        and all(_state(states, d) is TaskState.DONE for d in spec.depends_on)
    ]


def all_done(plan: Plan, states: Mapping[str, TaskState]) -> bool:
    """True when every task of the plan is `done`: the goal is ready for its final review."""
    return all(_state(states, t.id) is TaskState.DONE for t in plan.tasks)


# -- rendering --------------------------------------------------------------------------------

_MERMAID_CLASSES = {
    TaskState.PENDING: "fill:#eeeeee,stroke:#999999",
    TaskState.READY: "fill:#dbeafe,stroke:#3b82f6",
    TaskState.RUNNING: "fill:#fef3c7,stroke:#f59e0b",
    TaskState.WAITING_APPROVAL: "fill:#fde68a,stroke:#d97706",
    TaskState.REVIEWING: "fill:#ede9fe,stroke:#8b5cf6",
    TaskState.RETRYING: "fill:#ffedd5,stroke:#f97316",
    TaskState.DONE: "fill:#dcfce7,stroke:#22c55e",
    TaskState.FAILED: "fill:#fee2e2,stroke:#ef4444",
    TaskState.CANCELLED: "fill:#f3f4f6,stroke:#6b7280,stroke-dasharray:3",
    TaskState.SUPERSEDED: "fill:#f3f4f6,stroke:#9ca3af,stroke-dasharray:3",
}


def _mermaid_label(text: str) -> str:
    # Inside a quoted Mermaid label only the quote and angle brackets need entity codes.
    return text.replace('"', "#quot;").replace("<", "#lt;").replace(">", "#gt;")


def render_mermaid(plan: Plan, states: Mapping[str, TaskState]) -> str:
    """A Mermaid flowchart, dependencies pointing at their dependents, each node styled by state.

    Nodes are named `t0, t1, ...` by plan position: a task id such as `end` is a Mermaid keyword.
    """
    specs = _specs_by_id(plan)
    node = {tid: f"t{i}" for i, tid in enumerate(specs)}
    lines = ["flowchart TD"]
    for tid, spec in specs.items():
        state = _state(states, tid)
        label = _mermaid_label(f"{tid}: {spec.title} ({state.value})")
        lines.append(f'    {node[tid]}["{label}"]:::{state.value}')
    for tid, deps in _edges(plan).items():
        lines += [f"    {node[d]} --> {node[tid]}" for d in deps]
    used = {_state(states, tid) for tid in specs}
    lines += [f"    classDef {s.value} {style}" for s, style in _MERMAID_CLASSES.items() if s in used]
    return "\n".join(lines) + "\n"


def render_json(plan: Plan, states: Mapping[str, TaskState]) -> dict[str, Any]:
    """The DAG as plain JSON data (`taskloom dag --format json`): nodes, edges, order, ready set."""
    specs = _specs_by_id(plan)
    cycle = find_cycle(plan)
    return {
        "tasks": [
            {
                "id": tid,
                "title": spec.title,
                "state": _state(states, tid).value,
                "depends_on": list(spec.depends_on),
                "tools": list(spec.tools),
                "definition_of_done": spec.definition_of_done,
            }
            for tid, spec in specs.items()
        ],
        "edges": [{"from": d, "to": tid} for tid, deps in _edges(plan).items() for d in deps],
        "order": None if cycle else topological_order(plan),
        "cycle": cycle,
        "ready": ready_tasks(plan, states),
    }
