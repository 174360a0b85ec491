"""The support-desk demo toolkit used by `taskloom demo` and the tests: orders, a refund policy,
an eligibility check, and one side-effecting tool (issuing a refund), over fixed in-memory data."""

from __future__ import annotations

import datetime as dt
from typing import Any

from .toolkit import ToolContext, Toolkit

support = Toolkit("support")

REFUND_WINDOW_DAYS = 30

ORDERS: dict[str, dict[str, Any]] = {
    "A100": {"delivered": "2026-09-20", "item": "wireless headphones", "amount_usd": 129.00, "final_sale": False},
    "A101": {"delivered": "2026-08-30", "item": "standing desk", "amount_usd": 449.00, "final_sale": False},
    "A102": {"delivered": "2026-10-10", "item": "usb-c cable", "amount_usd": 12.50, "final_sale": False},
    "A107": {"delivered": "2026-10-01", "item": "clearance jacket", "amount_usd": 60.00, "final_sale": True},
}

# Refunds issued, keyed by idempotency key: issuing twice for one call changes nothing.
ISSUED: dict[str, str] = {}


@support.tool(read_only=True)
def lookup_order(order_id: str) -> dict[str, Any]:
    """Look up an order by its id (e.g. A100): delivery date, item, amount, and whether it was a final sale."""
    order = ORDERS.get(order_id.strip().upper())
    if order is None:
        raise KeyError(f"no order {order_id!r}; known orders: {', '.join(sorted(ORDERS))}")
    return {"order_id": order_id.upper(), **order}


@support.tool(read_only=True)
def refund_policy() -> str:
    """The store's refund policy."""
    return (
        f"Refunds can be requested within {REFUND_WINDOW_DAYS} days of delivery. "
        "Final-sale items are not refundable. Refunds go back to the original payment method."
    )


@support.tool(read_only=True)
def check_refund_eligibility(order_id: str, today: dt.date) -> dict[str, Any]:
    """Whether an order can still be refunded on `today` (YYYY-MM-DD), with the refund deadline."""
    order = lookup_order(order_id)
    delivered = dt.date.fromisoformat(order["delivered"])
    deadline = delivered + dt.timedelta(days=REFUND_WINDOW_DAYS)
    eligible = not order["final_sale"] and today <= deadline
    reason = "final sale" if order["final_sale"] else ("within the window" if eligible else "window closed")
    return {"order_id": order["order_id"], "eligible": eligible, "deadline": deadline.isoformat(), "reason": reason}


@support.tool(side_effects=True)
def issue_refund(order_id: str, ctx: ToolContext) -> str:
    """Issue a refund for an eligible order. Has side effects: never repeated for one call."""
    order = lookup_order(order_id)
    ISSUED.setdefault(ctx.idempotency_key, order["order_id"])
    return f"refund of ${order['amount_usd']:.2f} issued for {order['order_id']}"
