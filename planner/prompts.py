"""What the planner tells the model. Pure functions of the goal, the tools and the state.

The system prompt is the same for every goal (cacheable); everything goal-specific is in the user
message, goal text first. The tool catalog is listed by name: the model (and the offline demo
model, which matches tool names in the prompt) plans with the tools it is told about.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from bus.schemas import Goal, Plan, TaskRecord, TaskResult, TaskSpec, TaskState
from llm.types import ToolDef

PLAN_TOOL = "submit_plan"
PLAN_TOOL_DESCRIPTION = "Submit the plan: a DAG of tasks."

SYSTEM = """You are the planner of a team of AI workers. If one worker can do the goal alone, step \
by step, start it: call the goal's tools now (that worker continues from your call), or answer in \
text when no tool is needed. Otherwise call submit_plan once with a small DAG of tasks:
- tasks run in parallel unless one needs another's result (depends_on; no cycles);
- instructions say all a worker needs: it sees only them and its dependencies' results;
- a definition of done is a concrete, checkable statement of what the result must contain;
- only the tools you are given, by exact name;
- as few tasks as the goal needs; the team writes the final answer from their results."""

MAX_DESCRIPTION = 200  # characters of a tool description shown in the prompt


def usable_tools(catalog: Iterable[ToolDef], allowed: Collection[str] | None) -> list[ToolDef]:
    """The catalog filtered by the goal's allow-list (None: everything loaded), in catalog order."""
    return [t for t in catalog if allowed is None or t.name in allowed]


def _one_line(text: str, limit: int = MAX_DESCRIPTION) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def tools_section(tools: list[ToolDef]) -> str:
    if not tools:
        return "Available tools: none. Plan tasks that need no tools."
    lines = [f"- {t.name}: {_one_line(t.description) or '(no description)'}" for t in tools]
    return "Available tools (name: what it does):\n" + "\n".join(lines)


def _goal_section(goal: Goal) -> str:
    parts = [f"Goal:\n{goal.text}"]
    if goal.definition_of_done.strip():
        parts.append(f"Definition of done for the whole goal:\n{goal.definition_of_done}")
    return "\n\n".join(parts)


def plan_prompt(goal: Goal, tools: list[ToolDef], max_tasks: int) -> str:
    """The first user message of a forced planning conversation (tools listed by name)."""
    return "\n\n".join(
        [
            _goal_section(goal),
            tools_section(tools),
            f"Make a plan of at most {max_tasks} tasks and submit it with the submit_plan tool.",
        ]
    )


def route_prompt(goal: Goal, max_tasks: int) -> str:
    """The first user message of the route-first call: the tools come as definitions, not as a list."""
    return "\n\n".join([_goal_section(goal), f"Start the goal, or submit a plan of at most {max_tasks} tasks."])


ROUTED_TASK_ID = "goal"
ROUTED_INSTRUCTIONS = "Carry out the goal above and answer it."
DEFAULT_GOAL_DOD = "The answer fully and correctly answers the goal."


def single_task_plan(goal: Goal, tools: Sequence[str]) -> Plan:
    """The plan of a routed goal: one task that is the whole goal (its first step is the planner's
    turn), done when the goal's own definition of done (or check) holds."""
    dod = goal.definition_of_done.strip() or DEFAULT_GOAL_DOD
    spec = TaskSpec(
        id=ROUTED_TASK_ID,
        title="The goal",
        instructions=ROUTED_INSTRUCTIONS,
        definition_of_done=dod[:2000],
        tools=list(tools),
        check=goal.check,
    )
    return Plan(tasks=[spec], rationale="routed: one worker does the whole goal")


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


def replan_prompt(
    goal: Goal,
    tools: list[ToolDef],
    max_tasks: int,
    *,
    current: Plan,
    version: int,
    records: Mapping[str, TaskRecord],
    results: Mapping[str, TaskResult],
    reason: str,
    result_limit: int,
) -> str:
    """The user message of a replan: the goal, the plan so far, what was accepted and what failed."""
    accepted = [
        f"[{tid}]\n{_truncate(results[tid].answer, result_limit)}"
        for tid in (t.id for t in current.tasks)
        if tid in results
    ]
    failures = [
        f"- {t.id} ({records[t.id].state.value}): "
        + "; ".join(x for x in (records[t.id].reason, records[t.id].feedback) if x)
        for t in current.tasks
        if t.id in records
        and records[t.id].state is not TaskState.DONE
        and (records[t.id].reason or records[t.id].feedback)
    ]
    parts = [
        _goal_section(goal),
        tools_section(tools),
        f"The current plan (version {version}) did not work out:\n{current.model_dump_json(indent=2)}",
        "Task states: " + ", ".join(f"{t.id}={_state(records, t.id)}" for t in current.tasks),
        "Accepted results (kept if you keep their task unchanged):\n" + ("\n\n".join(accepted) or "none"),
        "What failed and why:\n" + "\n".join([*failures, *([f"- {reason}"] if reason else [])] or ["- (no details)"]),
        (
            f"Submit a new plan of at most {max_tasks} tasks with the submit_plan tool. A task you keep "
            "with exactly the same id and fields keeps its accepted result and is not run again; change "
            "or replace the tasks that failed, and give new work new ids."
        ),
    ]
    return "\n\n".join(parts)


def _state(records: Mapping[str, TaskRecord], tid: str) -> str:
    rec = records.get(tid)
    return rec.state.value if rec else "unknown"


def correction(problems: list[str]) -> str:
    """The tool_result content that sends an invalid plan back."""
    listed = "\n".join(f"- {p}" for p in problems)
    return f"The plan was not accepted:\n{listed}\nFix every problem and call submit_plan again with the whole plan."
