"""Tool selection for large catalogs (`llm.toolselect`) and where it applies: the planner's prompt
and the tools a task is offered."""

from __future__ import annotations

import bench.tools
from llm.toolselect import ToolIndex, select_tools, words
from llm.types import ToolDef


def tool(name: str, description: str, *params: str) -> ToolDef:
    schema = {"type": "object", "properties": {p: {"type": "string"} for p in params}}
    return ToolDef(name=name, description=description, input_schema=schema)


CATALOG = [
    tool("lookup_order", "Look up an order by id.", "order_id"),
    tool("issue_refund", "Refund an order to the original payment method.", "order_id"),
    tool("track_shipment", "Track a parcel: carrier, last scan.", "tracking_number"),
    tool("reset_password", "Send a password reset link to a user.", "user_id"),
    tool("deploy_service", "Deploy a version of a service.", "service"),
    tool("svc.calendar.create_event", "Create a calendar event.", "title"),
]


def test_words_split_names_and_stem() -> None:
    """snake_case, camelCase and dotted names split into words; plurals and -ed/-ing meet their stem."""
    assert words("svc.calendar.createEvent") == ["svc", "calendar", "create", "event"]
    assert words("Refunds refunded refunding the orders") == ["refund", "refund", "refund", "order"]


def test_picks_the_tools_the_text_is_about_in_catalog_order() -> None:
    """The best-scoring tools within the limit, in catalog order; unrelated ones dropped."""
    chosen = [t.name for t in select_tools(CATALOG, "Refund order A100 to the customer", 2)]
    assert chosen == ["lookup_order", "issue_refund"]


def test_small_catalogs_and_unmatched_text_keep_everything() -> None:
    """At most `limit` tools, a limit of 0, or text that matches nothing: the catalog is offered whole."""
    assert select_tools(CATALOG, "refund", 6) == CATALOG
    assert select_tools(CATALOG, "refund", 0) == CATALOG
    assert select_tools(CATALOG, "zzz qqq", 2) == CATALOG


def test_a_tool_named_in_the_text_is_always_kept() -> None:
    """An exact tool name in the text keeps that tool even beyond the limit."""
    chosen = [t.name for t in select_tools(CATALOG, "use issue_refund, then track_shipment", 1)]
    assert chosen == ["issue_refund", "track_shipment"]


def test_synonyms_reach_tools_in_other_words() -> None:
    """'package' finds the parcel tracker, at a lower weight than a direct match."""
    index = ToolIndex.build(CATALOG)
    assert [t.name for t in index.select("where is my package?", 1)] == ["track_shipment"]


def test_bench_catalog_meets_the_targets() -> None:
    """On the 150-tool bench catalog: at least 80% fewer definition tokens and recall of at least 0.95."""
    run = bench.tools.run(16)
    assert len(bench.tools.CATALOG) == 150 and len(bench.tools.GOALS) >= 30
    assert 1 - run.defs_with / run.defs_without >= 0.80
    assert run.recall >= 0.95
