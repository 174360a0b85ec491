"""Narrow a large tool catalog to the tools a piece of text is about, before it is sent to a model.

With 150 tools, offering every definition on every step costs tens of thousands of tokens and
makes the model's choice harder. `select_tools` ranks the catalog by BM25 over each tool's name
(weighted: names are short and precise), description and parameter names, with the goal's or the
task's own words as the query (plus common synonyms, at half weight), and keeps the best `limit`.
Rules that keep it safe:

- a catalog of at most `limit` tools is returned unchanged (small catalogs behave as before);
- a tool whose exact name appears in the text is always kept;
- when no word of the text matches any tool, everything is kept (an empty pick would strand the
  model with no tool at all).

Pure and deterministic: the same catalog and text give the same tools, in catalog order.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from llm.types import ToolDef

K1 = 1.2
B = 0.75
NAME_WEIGHT = 3  # a name's words count this many times in its document
MIN_SHARE = 0.15  # tools scoring under this share of the best score are dropped even within the limit

_WORD = re.compile(r"[A-Za-z][a-z]+|[A-Z]+(?![a-z])|[0-9]+")
STOPWORDS = frozenset(
    """a an and any are as at be by can do does for from get has have how i if in into is it its me my
    no not of on or our please so some than that the their them then there these this to up us was we
    what when where which who will with you your all each every per via also just about out""".split()
)


def _stem(word: str) -> str:
    """A light suffix strip, so 'refunds', 'refunded' and 'refunding' meet 'refund'."""
    for suffix, keep in (("ies", "y"), ("ing", ""), ("ed", ""), ("es", ""), ("s", "")):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            if suffix == "es" and not word[:-2].endswith(("ch", "sh", "x", "ss", "z")):
                continue  # 'invoices' -> 'invoice' via the 's' rule, not 'invoic'
            return word[: -len(suffix)] + keep
    return word


def words(text: str) -> list[str]:
    """Lower-case stemmed words of `text`; snake_case, camelCase and dotted names split apart."""
    out = []
    for raw in _WORD.findall(text):
        word = raw.lower()
        if word not in STOPWORDS and len(word) > 1:
            out.append(_stem(word))
    return out


# Query expansion: words people use for the same thing in the domains tools usually cover
# (commerce, support, operations, office). A query word also looks for its group's other words, at
# `SYNONYM_WEIGHT` of a direct match. Kept generic on purpose: no tool's name is listed here.
SYNONYM_GROUPS = (
    "package parcel shipment delivery",
    "money revenue sales income earnings turnover",
    "login password credential sign",
    "site website web homepage",
    "reachable available uptime up",
    "fast speed latency slow response",
    "refund reimburse reimbursement",
    "bill invoice",
    "pay payment charge",
    "customer client buyer shopper",
    "employee staff colleague worker",
    "vacation leave holiday pto",
    "ticket case",
    "email mail",
    "meeting appointment",
    "error failure bug outage down broken",
    "deploy release rollout",
    "stock inventory",
    "product item sku article",
    "discount coupon promo voucher",
    "ad ads advertising advert",
    "document doc file",
    "delete remove erase",
    "address location",
    "country region nation",
    "quarter period month week",
)
SYNONYM_WEIGHT = 0.5


def _synonyms() -> dict[str, set[str]]:
    table: dict[str, set[str]] = {}
    for group in SYNONYM_GROUPS:
        stems = {_stem(w) for w in group.split()}
        for stem in stems:
            table.setdefault(stem, set()).update(stems - {stem})
    return table


SYNONYMS = _synonyms()


def query_terms(text: str) -> dict[str, float]:
    """The words of `text` with weight 1, and their synonyms with `SYNONYM_WEIGHT`."""
    terms = dict.fromkeys(words(text), 1.0)
    for word in list(terms):
        for other in SYNONYMS.get(word, ()):
            terms.setdefault(other, SYNONYM_WEIGHT)
    return terms


def _document(tool: ToolDef) -> list[str]:
    props = tool.input_schema.get("properties") or {}
    params = " ".join(str(p) for p in props) if isinstance(props, dict) else ""
    return words(tool.name) * NAME_WEIGHT + words(tool.description) + words(params)


@dataclass(frozen=True)
class ToolIndex:
    """BM25 statistics of one catalog; build once, query many times."""

    tools: tuple[ToolDef, ...]
    docs: tuple[Counter[str], ...]
    lengths: tuple[int, ...]
    df: Counter[str]

    @classmethod
    def build(cls, tools: Iterable[ToolDef]) -> ToolIndex:
        listed = tuple(tools)
        docs = tuple(Counter(_document(t)) for t in listed)
        df: Counter[str] = Counter()
        for doc in docs:
            df.update(doc.keys())
        return cls(listed, docs, tuple(sum(d.values()) for d in docs), df)

    def scores(self, text: str) -> list[float]:
        n = len(self.tools)
        if n == 0:
            return []
        avg = sum(self.lengths) / n or 1.0
        query = query_terms(text)
        out = []
        for doc, length in zip(self.docs, self.lengths, strict=True):
            score = 0.0
            for term, weight in query.items():
                tf = doc.get(term, 0)
                if not tf:
                    continue
                idf = math.log(1 + (n - self.df[term] + 0.5) / (self.df[term] + 0.5))
                score += weight * idf * tf * (K1 + 1) / (tf + K1 * (1 - B + B * length / avg))
            out.append(score)
        return out

    def select(self, text: str, limit: int) -> list[ToolDef]:
        """The tools `text` is about (see the module docstring), in catalog order."""
        if limit <= 0 or len(self.tools) <= limit:
            return list(self.tools)
        scores = self.scores(text)
        best = max(scores, default=0.0)
        if best <= 0:
            return list(self.tools)  # nothing matches: keep everything
        named = {i for i, t in enumerate(self.tools) if t.name in text}
        ranked = sorted(range(len(self.tools)), key=lambda i: (-scores[i], i))
        chosen = {i for i in ranked[:limit] if scores[i] >= MIN_SHARE * best} | named
        return [t for i, t in enumerate(self.tools) if i in chosen]


def select_tools(tools: Sequence[ToolDef], text: str, limit: int) -> list[ToolDef]:
    """`ToolIndex.build(tools).select(text, limit)`, for one-off use."""
    if limit <= 0 or len(tools) <= limit:
        return list(tools)
    return ToolIndex.build(tools).select(text, limit)
