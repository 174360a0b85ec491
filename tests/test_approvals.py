"""Approval records: the stored form of requests and decisions, and the first decision winning."""

from __future__ import annotations

from arq.connections import ArqRedis

from bus.approvals import ApprovalBook, ApprovalDecision, ApprovalRequest
from bus.keys import Keys


def test_decisions_keep_their_stored_form() -> None:
    """`approved` and `denied:<reason>` stay the stored strings (the Redis layout of wave 1)."""
    assert ApprovalDecision(approved=True).encode() == "approved"
    assert ApprovalDecision(approved=False, reason="too much").encode() == "denied:too much"
    assert ApprovalDecision.decode("denied:too much") == ApprovalDecision(approved=False, reason="too much")
    assert ApprovalDecision.decode("approved").approved
    assert ApprovalDecision.decode("denied:") == ApprovalDecision(approved=False, reason="")


async def test_first_decision_wins_and_closes_the_request(redis: ArqRedis, keys: Keys) -> None:
    """A second decision is refused and the first one stays; the decided request is gone."""
    book = ApprovalBook(redis, keys)
    await book.request("g1", "c1", ApprovalRequest(task_id="t1", attempt=2, tool="refund", input={"id": "A1"}))
    assert (await book.requests("g1"))["c1"].attempt == 2
    assert await book.decide("g1", "c1", ApprovalDecision(approved=False, reason="no"))
    assert not await book.decide("g1", "c1", ApprovalDecision(approved=True))
    assert await book.decision("g1", "c1") == ApprovalDecision(approved=False, reason="no")
    assert await book.requests("g1") == {}
