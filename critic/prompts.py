"""What the critic tells the model. Pure functions of the goal, the task and the results.

A task review shows the goal, the task's instructions, its definition of done and the answer
verbatim (the reviewer judges the answer against the definition of done, nothing else).
"""

from __future__ import annotations

from collections.abc import Sequence

from bus.schemas import FinalVerdict, Goal, TaskResult, TaskSpec, json_schema
from llm.types import ToolDef

FINAL_TOOL = "submit_final"

FINAL_TOOL_DEF = ToolDef(
    name=FINAL_TOOL,
    description="The goal's final answer and your verdict on it.",
    input_schema=json_schema(FinalVerdict),
)

# The verdict is a JSON reply, not a forced tool (llm/jsonform.py says why): its form is this line.
VERDICT_FORMAT = '{"passed": true|false, "action": "accept"|"retry"|"replan", "feedback": "..."}'

REVIEW_SYSTEM = f"""You review one task's answer against its definition of done. Accept when the answer \
meets it (ask for no more). Otherwise give feedback the worker can act on: "retry" when another \
attempt can fix it, "replan" when the task itself is wrong or impossible. Reply with only the JSON \
object {VERDICT_FORMAT}"""

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
    return f"The verdict was not accepted:\n{listed}\nReply again with only the JSON object {VERDICT_FORMAT}"
