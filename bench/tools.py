"""Tool selection for large catalogs (`llm.toolselect`): tool-definition tokens per step with and
without the selector, and recall of the right tools, on a synthetic 150-tool catalog of a
mid-size online shop (15 departments x 10 tools) and 40 goals whose right tools are known (36 in the
catalog's own vocabulary, 4 paraphrases that avoid it).

    python -m bench.tools [--limit 16] [--sweep]

Tokens are counted the way the fake Messages API bills them (`llm.testing.tokens`: UTF-8 bytes of
name + description + compact JSON schema / 4, plus 8 per tool and 300 once when any tool is
offered), which is close to Claude's tokenizers on English and JSON. Two steps are measured:

- an executor-style step that offers tool definitions (full schemas), as a loop that offers the
  whole catalog on every step would; with the selector it offers what the goal's words select;
- the planner's prompt, which lists every tool by name and one-line description.

Recall: of all (goal, right tool) pairs, the share whose tool the selector kept for that goal.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass

from llm.toolselect import ToolIndex
from llm.types import ToolDef
from planner.prompts import tools_section


def _schema(params: str) -> dict[str, object]:
    """'order_id, reason?' -> a JSON schema with string properties (`?` = optional)."""
    props: dict[str, object] = {}
    required = []
    for raw in (p.strip() for p in params.split(",") if p.strip()):
        name = raw.rstrip("?")
        kind = "integer" if name.endswith(("_count", "days", "quantity", "limit", "points")) else "string"
        props[name] = {"type": kind, "description": name.replace("_", " ")}
        if not raw.endswith("?"):
            required.append(name)
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


# department -> [(name, description, parameters)]
CATALOG_SPEC: dict[str, list[tuple[str, str, str]]] = {
    "orders": [
        ("lookup_order", "Look up an order by id: items, amounts, status, delivery date.", "order_id"),
        ("list_customer_orders", "List a customer's orders, newest first.", "customer_id, limit?"),
        ("cancel_order", "Cancel an order that has not shipped yet.", "order_id, reason"),
        ("update_shipping_address", "Change the delivery address of an order before it ships.", "order_id, address"),
        ("order_timeline", "Every event of an order: placed, paid, packed, shipped, delivered.", "order_id"),
        ("split_order", "Split an order into two shipments.", "order_id, item_ids"),
        ("merge_orders", "Merge two open orders of one customer into one shipment.", "order_id, other_order_id"),
        ("reorder", "Place a new order with the same items as a past order.", "order_id"),
        ("add_order_note", "Attach an internal note to an order.", "order_id, note"),
        ("order_fraud_score", "Fraud risk score of an order, with the signals behind it.", "order_id"),
    ],
    "returns": [
        ("issue_refund", "Refund an order (fully or partly) to the original payment method.", "order_id, amount?"),
        ("check_refund_eligibility", "Whether an order can still be refunded, with the deadline.", "order_id, today"),
        ("refund_policy", "The store's refund and return policy.", ""),
        ("create_return_label", "Create a prepaid return shipping label for items of an order.", "order_id, item_ids"),
        ("return_status", "Status of a return: label created, in transit, received, inspected.", "return_id"),
        ("approve_return", "Approve a return request after inspection.", "return_id"),
        ("reject_return", "Reject a return request, with the reason shown to the customer.", "return_id, reason"),
        ("exchange_item", "Exchange an item of an order for another size or color.", "order_id, item_id, new_sku"),
        ("issue_store_credit", "Give a customer store credit instead of a refund.", "customer_id, amount"),
        ("refund_status", "Where a refund is: pending, sent to the bank, completed.", "refund_id"),
    ],
    "shipping": [
        ("track_shipment", "Track a parcel: carrier, last scan, estimated delivery.", "tracking_number"),
        ("create_shipment", "Create a shipment for a packed order and buy the label.", "order_id, carrier"),
        ("carrier_rates", "Compare carrier rates and delivery times for a parcel.", "weight, destination"),
        ("schedule_pickup", "Schedule a carrier pickup at a warehouse.", "warehouse_id, date"),
        ("delivery_exceptions", "Parcels with delivery problems: lost, damaged, returned to sender.", "since?"),
        ("update_delivery_window", "Change the delivery date or time window of a parcel.", "tracking_number, window"),
        ("print_packing_slip", "Print the packing slip of an order.", "order_id"),
        ("nearest_warehouse", "The warehouse that ships fastest to an address.", "address"),
        ("customs_declaration", "Create the customs declaration for an international parcel.", "order_id, country"),
        (
            "reroute_package",
            "Redirect a parcel in transit to another address or pickup point.",
            "tracking_number, address",
        ),
    ],
    "inventory": [
        ("stock_level", "Units in stock of a product, per warehouse.", "sku"),
        ("reserve_stock", "Reserve units of a product for an order.", "sku, quantity, order_id"),
        ("release_stock", "Release a stock reservation.", "reservation_id"),
        (
            "set_reorder_point",
            "Set the stock level at which a product is reordered from its supplier.",
            "sku, quantity",
        ),
        ("list_low_stock", "Products whose stock is below their reorder point.", "warehouse_id?"),
        (
            "transfer_stock",
            "Move units of a product between warehouses.",
            "sku, quantity, from_warehouse, to_warehouse",
        ),
        (
            "adjust_inventory_count",
            "Correct the counted stock of a product after a stocktake.",
            "sku, quantity, reason",
        ),
        ("product_details", "A product's details: name, price, dimensions, supplier.", "sku"),
        ("search_products", "Search the product catalog by words, category or price range.", "query"),
        ("supplier_lead_time", "How many days a supplier needs to deliver a product.", "sku"),
    ],
    "billing": [
        ("create_invoice", "Create an invoice for an order or a business customer.", "customer_id, lines"),
        ("void_invoice", "Void an invoice that was issued in error.", "invoice_id, reason"),
        ("payment_status", "Whether an order's payment was authorized, captured or failed.", "order_id"),
        ("charge_card", "Charge a customer's saved card.", "customer_id, amount"),
        ("retry_failed_payment", "Retry a payment that failed (expired card, insufficient funds).", "payment_id"),
        ("list_overdue_invoices", "Invoices past their due date, with amounts and days overdue.", "days?"),
        ("apply_discount_code", "Apply a discount code to an open order.", "order_id, code"),
        ("tax_rate_lookup", "Sales tax or VAT rate for an address.", "address"),
        ("saved_payment_methods", "A customer's saved cards and wallets.", "customer_id"),
        ("send_payment_reminder", "Email a reminder about an unpaid invoice.", "invoice_id"),
    ],
    "customers": [
        ("customer_profile", "A customer's profile: name, contact details, addresses, since when.", "customer_id"),
        ("update_customer_email", "Change a customer's email address.", "customer_id, email"),
        ("find_customer", "Find customers by name, email or phone number.", "query"),
        ("merge_customer_records", "Merge two duplicate customer accounts.", "customer_id, duplicate_id"),
        ("loyalty_points_balance", "A customer's loyalty points and tier.", "customer_id"),
        (
            "add_loyalty_points",
            "Credit loyalty points to a customer, e.g. as a goodwill gesture.",
            "customer_id, points",
        ),
        ("customer_segment", "Which marketing segment a customer belongs to, and why.", "customer_id"),
        ("export_customer_data", "Export everything stored about a customer (GDPR access request).", "customer_id"),
        ("erase_customer_data", "Erase a customer's personal data (GDPR right to be forgotten).", "customer_id"),
        ("customer_lifetime_value", "Total spend and predicted lifetime value of a customer.", "customer_id"),
    ],
    "support": [
        ("create_ticket", "Open a support ticket for a customer.", "customer_id, subject, body"),
        ("escalate_ticket", "Escalate a ticket to a senior agent or another team.", "ticket_id, team"),
        ("assign_ticket", "Assign a ticket to an agent.", "ticket_id, agent_id"),
        ("close_ticket", "Close a solved ticket with a resolution note.", "ticket_id, resolution"),
        ("search_tickets", "Search support tickets by words, customer, status or tag.", "query"),
        ("add_ticket_comment", "Add a public reply or an internal comment to a ticket.", "ticket_id, text"),
        ("ticket_sla_status", "Time left before a ticket breaches its service level agreement.", "ticket_id"),
        ("merge_tickets", "Merge duplicate tickets into one.", "ticket_id, duplicate_id"),
        ("search_macros", "Search saved reply templates (macros) for agents.", "query"),
        ("send_csat_survey", "Send a customer satisfaction survey after a ticket is closed.", "ticket_id"),
    ],
    "messaging": [
        ("send_email", "Send an email to a customer or colleague.", "to, subject, body"),
        ("list_email_templates", "List the email templates (order confirmation, apology, ...).", ""),
        ("send_sms", "Send a text message to a phone number.", "phone, text"),
        ("schedule_email_campaign", "Schedule a marketing email to a segment.", "segment, template_id, send_at"),
        ("unsubscribe_contact", "Unsubscribe an address from marketing email.", "email"),
        ("email_delivery_status", "Whether an email was delivered, opened or bounced.", "message_id"),
        ("post_slack_message", "Post a message to a Slack channel.", "channel, text"),
        ("slack_channel_history", "Recent messages of a Slack channel.", "channel, limit?"),
        ("send_push_notification", "Send a push notification to the mobile app of a customer.", "customer_id, text"),
        ("translate_text", "Translate text into another language.", "text, language"),
    ],
    "calendar": [
        ("create_calendar_event", "Create an event in a calendar.", "title, start, end, attendees?"),
        ("find_free_slots", "Times when all the given people are free.", "people, duration, within"),
        ("cancel_calendar_event", "Cancel a calendar event and notify its attendees.", "event_id"),
        ("list_calendar_events", "Events of a calendar between two dates.", "calendar_id, start, end"),
        ("book_meeting_room", "Book a meeting room for a time slot.", "room, start, end"),
        ("convert_timezone", "Convert a time between time zones.", "time, from_zone, to_zone"),
        ("reschedule_event", "Move a calendar event to another time.", "event_id, start"),
        ("send_meeting_invite", "Invite people to an existing meeting.", "event_id, people"),
        ("out_of_office_status", "Whether a colleague is out of office, and until when.", "person"),
        ("public_holidays", "Public holidays of a country in a year.", "country, year"),
    ],
    "hr": [
        ("employee_directory", "Find colleagues: role, team, manager, contact details.", "query"),
        ("request_time_off", "Request vacation or sick leave.", "employee_id, start, end, kind"),
        ("time_off_balance", "Vacation days an employee has left this year.", "employee_id"),
        ("approve_time_off", "Approve a time-off request.", "request_id"),
        ("payroll_summary", "Salary, deductions and net pay of a pay period.", "employee_id, period"),
        ("onboarding_checklist", "Onboarding tasks of a new hire and which are done.", "employee_id"),
        ("org_chart", "The reporting lines below a manager.", "manager_id"),
        ("performance_review_status", "Where an employee's performance review stands.", "employee_id"),
        ("list_open_positions", "Open job positions, by team and location.", "team?"),
        ("benefits_enrollment", "Enroll an employee in health, dental or pension benefits.", "employee_id, plan"),
    ],
    "documents": [
        ("search_knowledge_base", "Search help-center and internal knowledge-base articles.", "query"),
        ("get_document", "Read a document by id.", "document_id"),
        ("create_document", "Create a new document in a folder.", "folder_id, title, body"),
        ("update_document", "Replace the text of a document.", "document_id, body"),
        ("summarize_document", "Summarize a long document.", "document_id"),
        ("list_folder", "Documents and subfolders of a folder.", "folder_id"),
        ("share_document", "Share a document with people or a team.", "document_id, people"),
        ("document_versions", "The version history of a document.", "document_id"),
        ("convert_to_pdf", "Convert a document to PDF.", "document_id"),
        ("extract_tables", "Extract the tables of a PDF or spreadsheet as CSV.", "document_id"),
    ],
    "analytics": [
        ("run_sql_query", "Run a read-only SQL query on the data warehouse.", "sql"),
        ("sales_report", "Sales totals for a period, by day, week or month.", "start, end, granularity?"),
        ("revenue_by_region", "Revenue per country or region for a period.", "start, end"),
        ("conversion_funnel", "Visits, carts, checkouts and purchases of the web shop for a period.", "start, end"),
        ("top_products", "Best-selling products of a period.", "start, end, limit?"),
        ("churn_rate", "Share of customers who stopped buying in a period.", "start, end"),
        ("cohort_retention", "Repeat-purchase retention of monthly customer cohorts.", "start, end"),
        ("dashboard_snapshot", "A picture of a BI dashboard as it is now.", "dashboard_id"),
        ("export_csv", "Export a query result or report as a CSV file.", "report_id"),
        ("forecast_demand", "Forecast units sold of a product for the coming weeks.", "sku, weeks?"),
    ],
    "devops": [
        ("deploy_service", "Deploy a version of a service to an environment.", "service, version, environment"),
        ("rollback_deployment", "Roll a service back to its previous version.", "service, environment"),
        ("service_health", "Health, error rate and latency of a service.", "service"),
        ("list_incidents", "Open incidents with severity and owner.", "status?"),
        ("create_incident", "Declare an incident.", "title, severity, service"),
        ("page_on_call", "Page the on-call engineer of a team.", "team, message"),
        ("fetch_logs", "Recent log lines of a service, optionally filtered.", "service, query?"),
        ("restart_pod", "Restart a Kubernetes pod of a service.", "service, pod"),
        ("scale_service", "Change the number of replicas of a service.", "service, replicas"),
        ("toggle_feature_flag", "Turn a feature flag on or off.", "flag, enabled"),
    ],
    "security": [
        ("reset_password", "Send a password reset link to a user.", "user_id"),
        ("disable_user_account", "Disable a user's account and end their sessions.", "user_id, reason"),
        ("list_user_permissions", "Roles and permissions of a user.", "user_id"),
        ("grant_role", "Give a user a role.", "user_id, role"),
        ("revoke_role", "Take a role away from a user.", "user_id, role"),
        ("search_audit_log", "Search the security audit log: logins, permission changes, exports.", "query"),
        ("create_api_key", "Create an API key for an integration.", "name, scopes"),
        ("rotate_api_key", "Replace an API key with a new one.", "key_id"),
        ("request_vpn_access", "Request VPN access for a user.", "user_id"),
        ("device_inventory", "Laptops and phones assigned to a user.", "user_id"),
    ],
    "marketing": [
        (
            "create_discount_code",
            "Create a discount code: percentage or amount, expiry, usage limit.",
            "percent, expires",
        ),
        ("landing_page_stats", "Visits and sign-ups of a landing page.", "page"),
        ("seo_keyword_rank", "Search ranking of the shop for a keyword.", "keyword"),
        ("publish_blog_post", "Publish a post on the company blog.", "title, body"),
        ("post_to_social_media", "Post to the shop's social media accounts.", "network, text"),
        ("ad_campaign_spend", "Spend, clicks and conversions of an ad campaign.", "campaign_id"),
        ("pause_ad_campaign", "Pause a running ad campaign.", "campaign_id"),
        ("newsletter_subscribers", "Newsletter subscriber count and growth.", "since?"),
        ("ab_test_results", "Results of an A/B test with its significance.", "test_id"),
        ("website_uptime", "Uptime and response time of the public website.", "days?"),
    ],
}

CATALOG: list[ToolDef] = [
    ToolDef(name=name, description=desc, input_schema=_schema(params))
    for tools in CATALOG_SPEC.values()
    for name, desc, params in tools
]

# Goals as people write them, and the tools a good plan uses for each.
GOALS: list[tuple[str, set[str]]] = [
    (
        "Order A100 arrived broken. Check it can still be refunded and refund the customer.",
        {"lookup_order", "check_refund_eligibility", "issue_refund"},
    ),
    (
        "Where is the parcel with tracking number 1Z999? The customer asks when it will be delivered.",
        {"track_shipment"},
    ),
    ("Customer C-17 wants to return the jacket from order B220: make a return label.", {"create_return_label"}),
    ("Cancel order A311 before it ships; the customer changed their mind.", {"cancel_order"}),
    ("Which products are running low on stock in the Leeds warehouse?", {"list_low_stock"}),
    ("Move 40 units of SKU TEE-RED from Leeds to Bristol warehouse.", {"transfer_stock"}),
    (
        "List the invoices that are overdue by more than 30 days and send a payment reminder for each.",
        {"list_overdue_invoices", "send_payment_reminder"},
    ),
    ("The payment for order A412 failed; retry the payment.", {"payment_status", "retry_failed_payment"}),
    ("A customer asks us to delete all their personal data under GDPR.", {"erase_customer_data"}),
    ("Give customer C-88 200 loyalty points as an apology for the late delivery.", {"add_loyalty_points"}),
    ("Escalate ticket T-5521 to the billing team.", {"escalate_ticket"}),
    ("Which tickets are about to breach their SLA? Check ticket T-77.", {"ticket_sla_status"}),
    ("Send the customer an email apologizing for the delay of order A500.", {"send_email"}),
    ("Post the outage update in the #support Slack channel.", {"post_slack_message"}),
    (
        "Find a free 30-minute slot for Ana and Ben next week and create the meeting.",
        {"find_free_slots", "create_calendar_event"},
    ),
    ("Book a meeting room for the Friday retrospective from 3 to 4 pm.", {"book_meeting_room"}),
    ("How many vacation days does employee E-12 have left?", {"time_off_balance"}),
    ("Request time off for E-40 from June 2 to June 6.", {"request_time_off"}),
    (
        "Search the knowledge base for our warranty article and summarize it.",
        {"search_knowledge_base", "summarize_document"},
    ),
    (
        "Convert the Q3 supplier contract document to PDF and share it with the legal team.",
        {"convert_to_pdf", "share_document"},
    ),
    ("What were sales last month, by week?", {"sales_report"}),
    (
        "Which were the top selling products in Q3, and what is the revenue by region?",
        {"top_products", "revenue_by_region"},
    ),
    ("The checkout service is throwing errors: check its health and fetch the logs.", {"service_health", "fetch_logs"}),
    (
        "Roll back the payments service deployment in production and declare an incident.",
        {"rollback_deployment", "create_incident"},
    ),
    (
        "A laptop was stolen: disable the user account of U-301 and rotate their API key.",
        {"disable_user_account", "rotate_api_key"},
    ),
    ("Grant the analyst role to user U-77.", {"grant_role"}),
    ("Create a 15% discount code that expires at the end of the month.", {"create_discount_code"}),
    (
        "How is the spring ad campaign doing on spend and conversions? Pause it if it is wasting money.",
        {"ad_campaign_spend", "pause_ad_campaign"},
    ),
    ("Change the shipping address of order A650 to 12 High Street, York.", {"update_shipping_address"}),
    ("Exchange the size M shirt in order A700 for size L.", {"exchange_item"}),
    ("What is the VAT rate for a delivery address in Lyon, France?", {"tax_rate_lookup"}),
    ("Merge the duplicate customer accounts C-10 and C-99.", {"merge_customer_records"}),
    (
        "Compare carrier rates for a 4 kg parcel to Canada and schedule a pickup at the Leeds warehouse.",
        {"carrier_rates", "schedule_pickup"},
    ),
    (
        "Forecast demand for SKU MUG-01 for the next 8 weeks and check the supplier lead time.",
        {"forecast_demand", "supplier_lead_time"},
    ),
    ("Publish the summer sale blog post and share it on social media.", {"publish_blog_post", "post_to_social_media"}),
    ("Page the on-call engineer of the platform team: the website is down.", {"page_on_call"}),
    # Paraphrases that avoid the catalog's own words (synonyms are where a keyword index is weakest).
    ("My package 1Z999 still hasn't shown up. When is it coming?", {"track_shipment"}),
    ("Someone on the team forgot their login; send them a link to set a new one.", {"reset_password"}),
    ("How much money did we make in Germany versus France last quarter?", {"revenue_by_region"}),
    ("Is the shop's site reachable and how fast has it been this week?", {"website_uptime"}),
]
TUNED = 4  # the last 4 goals above were missed before `llm.toolselect.SYNONYM_GROUPS` existed

# Written after the synonym table, and not used to change it: a held-out check of the paraphrase case.
HELD_OUT: list[tuple[str, set[str]]] = [
    ("The buyer never got their stuff from order A880 and wants their cash back.", {"issue_refund"}),
    ("Kick off a postmortem: checkout has been failing since noon.", {"create_incident"}),
    ("Who does Maria report to, and what's her phone number?", {"employee_directory"}),
    ("Lock out the account of the contractor who left today.", {"disable_user_account"}),
    ("Tell everyone on the mailing list about the new collection.", {"schedule_email_campaign"}),
    ("How many mugs do we have left?", {"stock_level"}),
]


def tool_tokens(tools: list[ToolDef]) -> int:
    """Tokens of tool definitions as the fake Messages API bills them (see the module docstring)."""
    if not tools:
        return 0
    nbytes = 0
    for t in tools:
        schema = json.dumps(t.input_schema, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        nbytes += len((t.name + t.description + schema).encode())
    return math.ceil(nbytes / 4) + 8 * len(tools) + 300


def prompt_tokens(tools: list[ToolDef]) -> int:
    """Tokens of the planner prompt's tool list (name: one-line description per tool)."""
    return math.ceil(len(tools_section(tools).encode()) / 4)


@dataclass(frozen=True)
class Run:
    limit: int
    recall: float
    goals_full_recall: int
    selected_mean: float
    defs_with: float
    defs_without: int
    prompt_with: float
    prompt_without: int
    misses: list[tuple[str, str]]
    query_us: float
    goals: int


def run(limit: int, goals: list[tuple[str, set[str]]] | None = None) -> Run:
    index = ToolIndex.build(CATALOG)
    hits = total = full = 0
    selected_sizes, defs, prompts, misses, times = [], [], [], [], []
    goals = GOALS if goals is None else goals
    for text, right in goals:
        started = time.perf_counter()
        chosen = index.select(text, limit)
        times.append(time.perf_counter() - started)
        names = {t.name for t in chosen}
        found = right & names
        hits += len(found)
        total += len(right)
        full += found == right
        misses += [(text, name) for name in sorted(right - names)]
        selected_sizes.append(len(chosen))
        defs.append(tool_tokens(chosen))
        prompts.append(prompt_tokens(chosen))
    return Run(
        limit=limit,
        recall=hits / total,
        goals_full_recall=full,
        selected_mean=statistics.mean(selected_sizes),
        defs_with=statistics.mean(defs),
        defs_without=tool_tokens(CATALOG),
        prompt_with=statistics.mean(prompts),
        prompt_without=prompt_tokens(CATALOG),
        misses=misses,
        query_us=statistics.median(times) * 1e6,
        goals=len(goals),
    )


def report(r: Run) -> str:
    cut_defs = 1 - r.defs_with / r.defs_without
    cut_prompt = 1 - r.prompt_with / r.prompt_without
    lines = [
        f"catalog: {len(CATALOG)} tools; {len(GOALS)} goals with {sum(len(t) for _, t in GOALS)} right tools; "
        f"limit {r.limit}",
        "",
        "| tokens per step | without selector | with selector (mean) | fewer |",
        "| --- | ---: | ---: | ---: |",
        f"| tool definitions offered (full schemas) | {r.defs_without:,} | {r.defs_with:,.0f} | {cut_defs:.1%} |",
        f"| planner prompt tool list | {r.prompt_without:,} | {r.prompt_with:,.0f} | {cut_prompt:.1%} |",
        "",
        f"tools kept per goal: mean {r.selected_mean:.1f} of {len(CATALOG)}",
        f"recall of the right tools: {r.recall:.3f} ({r.goals_full_recall}/{r.goals} goals with every right tool)",
        f"selection time per goal (index built once): median {r.query_us:.0f} us",
    ]
    if r.misses:
        lines.append("missed: " + "; ".join(f"{name} for {text[:50]!r}" for text, name in r.misses))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=16, help="tools kept at most (TASKLOOM_TOOL_SELECT_LIMIT)")
    parser.add_argument("--sweep", action="store_true", help="also report limits 8, 12, 16, 24, 32")
    args = parser.parse_args()
    print(report(run(args.limit)))
    print(f"\n| goals (limit {args.limit}) | goals | recall | goals with every right tool |")
    print("| --- | ---: | ---: | ---: |")
    groups = [
        ("in the catalog's vocabulary", GOALS[:-TUNED]),
        ("paraphrases (used to write the synonym table)", GOALS[-TUNED:]),
        ("paraphrases, held out", HELD_OUT),
        ("all", GOALS + HELD_OUT),
    ]
    for label, goals in groups:
        r = run(args.limit, goals)
        print(f"| {label} | {len(goals)} | {r.recall:.3f} | {r.goals_full_recall} |")
    if args.sweep:
        print("\n| limit | tools kept (mean) | definition tokens (mean) | fewer | recall |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for limit in (8, 12, 16, 24, 32):
            r = run(limit)
            cut = 1 - r.defs_with / r.defs_without
            print(f"| {limit} | {r.selected_mean:.1f} | {r.defs_with:,.0f} | {cut:.1%} | {r.recall:.3f} |")


if __name__ == "__main__":
    main()
