"""API tokens: who may call what.

A token is a random secret handed to one caller; the server keeps only its SHA-256 hash, a name
(recorded in audit events, e.g. who approved a tool call) and its scopes:

* `read`    every GET: goals, plans, ledgers, events, approvals, metrics;
* `submit`  submit and cancel goals;
* `approve` approve or deny tool calls;
* `admin`   everything.

Tokens are configured as `NAME:SCOPE+SCOPE:SHA256HEX` entries, separated by commas or new lines,
in `TASKLOOM_API_TOKENS` or in the file named by `TASKLOOM_API_TOKENS_FILE` (lines starting with
`#` are comments). `taskloom api-token NAME --scope read` makes a new token and prints its entry.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SCOPES = ("read", "submit", "approve", "admin")
_ENTRY = re.compile(r"^(?P<name>[A-Za-z0-9_.@-]{1,64}):(?P<scopes>[a-z+]+):(?P<hash>[0-9a-f]{64})$")


class TokenConfigError(ValueError):
    """A token entry is malformed; the message names the entry and what is wrong."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token's name and scopes."""

    name: str
    scopes: frozenset[str]

    def allows(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return "tl_" + secrets.token_urlsafe(32)


def entry_for(name: str, scopes: Iterable[str], token: str) -> str:
    return f"{name}:{'+'.join(scopes)}:{hash_token(token)}"


def parse_tokens(text: str, source: str) -> dict[str, Principal]:
    """Token hash -> principal, from entries in `text` (`source` names where they came from)."""
    out: dict[str, Principal] = {}
    names: set[str] = set()
    for raw in re.split(r"[,\n]", text):
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        m = _ENTRY.match(entry)
        if not m:
            shown = entry if len(entry) < 40 else entry[:40] + "..."
            raise TokenConfigError(
                f"{source}: {shown!r} is not NAME:SCOPE+SCOPE:SHA256HEX (the hash is 64 lower-case hex digits)"
            )
        scopes = m["scopes"].split("+")
        bad = [s for s in scopes if s not in SCOPES]
        if bad:
            raise TokenConfigError(
                f"{source}: token {m['name']!r}: unknown scope {bad[0]!r}; expected {', '.join(SCOPES)}"
            )
        if m["name"] in names:
            raise TokenConfigError(f"{source}: token name {m['name']!r} appears twice")
        names.add(m["name"])
        out[m["hash"]] = Principal(m["name"], frozenset(scopes))
    return out


def load_tokens(env_value: str, file: Path | None) -> dict[str, Principal]:
    tokens = parse_tokens(env_value, "TASKLOOM_API_TOKENS")
    if file is not None:
        try:
            text = file.read_text()
        except OSError as exc:
            raise TokenConfigError(f"TASKLOOM_API_TOKENS_FILE: cannot read {file}: {exc.strerror}") from None
        for h, p in parse_tokens(text, f"TASKLOOM_API_TOKENS_FILE ({file})").items():
            if any(q.name == p.name for q in tokens.values()):
                raise TokenConfigError(f"token name {p.name!r} is configured twice")
            tokens[h] = p
    return tokens


class TokenBook:
    """Looks a presented bearer token up by its hash."""

    def __init__(self, tokens: dict[str, Principal]) -> None:
        self.tokens = dict(tokens)

    def add(self, name: str, scopes: Iterable[str], token: str) -> None:
        self.tokens[hash_token(token)] = Principal(name, frozenset(scopes))

    def check(self, token: str) -> Principal | None:
        presented = hash_token(token)
        # Compare against every hash in constant time, so timing says nothing about near misses.
        found = None
        for h, p in self.tokens.items():
            if hmac.compare_digest(h, presented):
                found = p
        return found
