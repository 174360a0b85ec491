"""What the critic tells the model. Pure functions of the goal, the task and the results.

A task review shows the goal, the task's instructions, its definition of done and the answer
verbatim (the reviewer judges the answer against the definition of done, nothing else).
"""

from __future__ import annotations

from collections.abc import Sequence

from bus.schemas import FinalVerdict, Goal, TaskResult, TaskSpec, Verdict, json_schema
from llm.types import ToolDef

VERDICT_TOOL = "submit_verdict"

VERDICT_TOOL_DEF = ToolDef(
    name=VERDICT_TOOL,
    description="Your verdict on the answer.",
    input_schema=json_schema(Verdict),
)

FINAL_TOOL = "submit_final"

FINAL_TOOL_DEF = ToolDef(
    name=FINAL_TOOL,
    description="The goal's final answer and your verdict on it.",
    input_schema=json_schema(FinalVerdict),
)

REVIEW_SYSTEM = """You review one task's answer against its definition of done; call submit_verdict once. \
Accept when the answer meets it (ask for no more). Otherwise give feedback the worker can act on: \
'retry' when another attempt can fix it, 'replan' when the task itself is wrong or impossible."""

FINAL_SYSTEM = """You write the final answer to a goal from its tasks' accepted results, using only what \
they establish, and judge it against the goal's definition of done ('replan', with feedback, when it \
falls short). Call submit_final once."""

DEFAULT_GOAL_DOD = "The answer fully and correctly answers the goal."


def review_prompt(
    goal: Goal, spec: TaskSpec, result: TaskResult, earlier_feedback: str | None, *, final: bool = False
) -> str:
    """A task review; `final`: the task is the goal's only one, so its answer is the final answer and
    this review is also the goal review (its definition of done is the goal's)."""
    parts = [
        f"Goal:\n{goal.text}",
        f"Task '{spec.id}': {spec.title}\nInstructions:\n{spec.instructions}",
        f"Definition of done:\n{spec.definition_of_done}",
    ]
    if final:
        parts.append("This answer is the goal's final answer: it must also answer the goal itself.")
    if earlier_feedback:
        parts.append(f"Feedback given on the previous attempt:\n{earlier_feedback}")
    parts.append(f"Answer (attempt {result.attempt}):\n{result.answer}")
    return "\n\n".join(parts)


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


def final_prompt(goal: Goal, results: Sequence[tuple[TaskSpec, TaskResult | None]], limit: int) -> str:
    """The synthesis-and-review request: the goal, its definition of done and every accepted result."""
    blocks = [
        f"[{spec.id}] {spec.title}\n{_truncate(result.answer, limit) if result else '(no result stored)'}"
        for spec, result in results
    ]
    return "\n\n".join(
        [
            f"Goal:\n{goal.text}",
            f"Definition of done:\n{goal.definition_of_done.strip() or DEFAULT_GOAL_DOD}",
            "Accepted results:\n\n" + "\n\n".join(blocks),
            "Write the final answer to the goal.",
        ]
    )


def final_correction(problems: list[str]) -> str:
    listed = "\n".join(f"- {p}" for p in problems)
    return f"The final answer was not accepted:\n{listed}\nCall submit_final again with a valid input."


def verdict_correction(problems: list[str]) -> str:
    listed = "\n".join(f"- {p}" for p in problems)
    return f"The verdict was not accepted:\n{listed}\nCall submit_verdict again with a valid verdict."
