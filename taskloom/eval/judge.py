"""LLM-as-judge: a case's `rubric`, scored by the judge model through the ledger, its cost kept apart.

The judge reads the goal, the rubric and the final answer, and replies in the critic's JSON verdict
form (`{"passed", "action", "feedback"}`), so any model that can be the critic can judge, and the
offline demo model judges deterministically (it accepts). Each judged run has books of its own in
the ledger (`judge-<goal id>`, at the configured prices), apart from the goal's: grading never
counts as the agent's spend, and the judge's tokens and cost are reported beside it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from bus.ledger import Ledger, LedgerError
from bus.metered import ModelFactory
from llm.errors import ModelError
from llm.port import ModelPort
from llm.types import Message, ModelRequest

from ..models import ModelRouter

JUDGE_BUDGET = 200_000  # tokens one judged run may spend
JUDGE_MAX_TOKENS = 1_024

SYSTEM = """You grade the final answer an AI agent gave to a goal, against a rubric.
Judge only what the rubric asks; do not solve the goal yourself.
Reply with one JSON object and nothing else:
{"passed": true or false, "action": "accept" if passed else "retry", "feedback": "one or two sentences: why"}"""

_OBJECT = re.compile(r"\{.*\}", re.S)


class JudgeReplyError(ValueError):
    """The judge's reply is not a verdict."""


@dataclass(frozen=True)
class Judgement:
    passed: bool | None  # None: the judge could not score (its error is in `feedback`)
    feedback: str
    tokens: int = 0
    cost_usd: float = 0.0


def books_of(goal_id: str) -> str:
    return f"judge-{goal_id}"


def request_for(goal: str, rubric: str, answer: str, books: str) -> ModelRequest:
    prompt = f"Goal:\n{goal}\n\nRubric:\n{rubric}\n\nThe agent's final answer:\n{answer or '(no answer)'}"
    return ModelRequest(
        system=SYSTEM,
        messages=[Message.user(prompt)],
        max_tokens=JUDGE_MAX_TOKENS,
        metadata={"goal_id": books, "role": "judge", "purpose": "judge"},
    )


def parse(text: str) -> tuple[bool, str]:
    """The verdict in a judge's reply: (passed, feedback). Raises `JudgeReplyError`."""
    found = _OBJECT.search(text)
    if found is None:
        raise JudgeReplyError(f"no JSON object in the judge's reply: {text[:200]!r}")
    try:
        value = json.loads(found.group(0))
    except ValueError as exc:
        raise JudgeReplyError(f"the judge's reply is not JSON ({exc}): {text[:200]!r}") from None
    if not isinstance(value, dict) or not isinstance(value.get("passed"), bool):
        raise JudgeReplyError(f"the judge's reply has no boolean `passed`: {text[:200]!r}")
    return value["passed"], str(value.get("feedback") or "")


class Judge:
    """Scores rubrics with `model` (one model, or the router of a judge model's settings), metered
    by `ledger`."""

    def __init__(self, model: ModelPort | ModelRouter, ledger: Ledger) -> None:
        self.ledger = ledger
        self.factory = ModelFactory(model, ledger)

    async def score(self, goal_id: str, goal: str, rubric: str, answer: str) -> Judgement:
        books = books_of(goal_id)
        await self.ledger.open(books, JUDGE_BUDGET)
        try:
            response = await self.factory.for_goal(books).complete(request_for(goal, rubric, answer, books))
            passed, feedback = parse(response.text)
        except (ModelError, LedgerError, JudgeReplyError) as exc:
            passed, feedback = None, f"the judge could not score: {exc}"
        spent = await self.ledger.snapshot(books)
        return Judgement(passed, feedback, spent.spent, spent.cost_usd)
