"""Approval records: the stored form of requests and decisions, and the first decision winning."""

from __future__ import annotations

from arq.connections import ArqRedis

from bus.approvals import ApprovalBook, ApprovalDecision, ApprovalRequest
from bus.keys import Keys
from bus.schemas import Event


def test_decisions_keep_their_stored_form() -> None:
    """`approved` and `denied:<reason>` stay the stored strings (the Redis layout of wave 1)."""
    assert ApprovalDecision(approved=True).encode() == "approved"
    assert ApprovalDecision(approved=False, reason="too much").encode() == "denied:too much"
    assert ApprovalDecision.decode("denied:too much") == ApprovalDecision(approved=False, reason="too much")
    assert ApprovalDecision.decode("approved").approved
    assert ApprovalDecision.decode("denied:") == ApprovalDecision(approved=False, reason="")


async def test_the_stored_request_and_decision_read_back_as_records(redis: ArqRedis, keys: Keys) -> None:
    """The request body is an ApprovalRequest; the first decision stands and reads back typed."""
    book = ApprovalBook(redis, keys)
    event = Event(type="tool.approval_requested", goal_id="g1", task_id="t1", data={"call_id": "c1"})
    assert await book.request("g1", "c1", "t1", 2, "refund", {"id": "A1"}, event)
    raw = await redis.hget(keys.approval_requests("g1"), "c1")
    stored = ApprovalRequest.model_validate_json(raw)
    assert (stored.task_id, stored.attempt, stored.tool, stored.input) == ("t1", 2, "refund", {"id": "A1"})
    denied = ApprovalDecision(approved=False, reason="no")
    decided = Event(type="tool.approval_decided", goal_id="g1", task_id="t1", data={"call_id": "c1"})
    assert await book.decide("g1", "c1", denied, decided) == "ok"
    assert await book.decide("g1", "c1", ApprovalDecision(approved=True), decided) == "decided"
    assert await book.decision("g1", "c1") == denied
    assert await book.requests("g1") == {}


async def test_a_request_keeps_the_earlier_calls_it_was_given_and_the_inbox_shows_them(
    redis: ArqRedis, keys: Keys
) -> None:
    """`earlier` is stored on the request and read back by `requests` and by the cross-goal inbox."""
    from bus.approvals import EarlierCall

    book = ApprovalBook(redis, keys)
    await redis.hset(keys.goal("g1"), mapping={"state": "running"})  # the inbox lists live goals only
    earlier = [EarlierCall(attempt=1, call_id="c0", input={"id": "A1"}, outcome="ok", result="refunded A1")]
    event = Event(type="tool.approval_requested", goal_id="g1", task_id="t1", data={"call_id": "c1"})
    assert await book.request("g1", "c1", "t1", 2, "refund", {"id": "A2"}, event, earlier)
    assert (await book.requests("g1"))["c1"].earlier == earlier
    [pending] = await book.pending(goal_id="g1")
    assert pending.earlier == earlier


async def test_the_inbox_lists_requests_oldest_first_even_within_one_millisecond(redis: ArqRedis, keys: Keys) -> None:
    """Requests made microseconds apart keep their order: the later one's goal id sorts first, so a
    tie in the inbox's score (whole milliseconds, before) would put it first most of the time."""
    book = ApprovalBook(redis, keys)
    for n in range(20):
        first, second = f"z{n}", f"a{n}"
        for gid in (first, second):
            await redis.hset(keys.goal(gid), mapping={"state": "running"})
        for gid in (first, second):
            event = Event(type="tool.approval_requested", goal_id=gid, task_id="t1", data={"call_id": "c1"})
            assert await book.request(gid, "c1", "t1", 1, "refund", {}, event)
        pending = await book.pending()
        assert [p.goal_id for p in pending] == [first, second], f"pair {n}"
        assert pending[0].requested_at < pending[1].requested_at
        for gid in (first, second):
            await book.decide(gid, "c1", ApprovalDecision(approved=True), event)
