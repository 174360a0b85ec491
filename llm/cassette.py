"""Cassettes: record every model call of a run to a JSON-lines file, replay them offline.

One line per call: `{"digest", "role", "task", "request", "response"}`. `request` is the canonical
form the digest is computed over, `response` the `ModelResponse` as returned. Both are redacted
before anything is written (`llm.redact`, plus the literal values of secret-looking environment
variables), so an API key that reached a prompt or a reply never reaches the file.

The digest identifies a request by what the model sees and who asks: the role and purpose and the
task id from the request's `metadata` (our labels, never sent to a provider), the system prompt,
the messages, the offered tools and the tool choice. It leaves out what changes from one run to the
next without changing the question: the goal id, and `max_tokens` (the ledger clamps it to what the
budget has left). Tool-use ids are kept: replayed replies carry the recorded ids, so the requests
that follow match again.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from llm.errors import TerminalModelError
from llm.port import ModelPort, TextSink
from llm.redact import SECRET_KEYS, scrub
from llm.types import ModelRequest, ModelResponse

SECRET_MIN_LENGTH = 8  # shorter environment values are too likely to occur by chance


def env_secrets(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """Values of environment variables whose names look secret (`ANTHROPIC_API_KEY`, `..._PASSWORD`)."""
    env = os.environ if environ is None else environ
    return tuple(sorted({v for k, v in env.items() if SECRET_KEYS.search(k) and len(v) >= SECRET_MIN_LENGTH}))


def canonical(request: ModelRequest, secrets: tuple[str, ...] = ()) -> dict[str, Any]:
    """What identifies a request (see the module docstring), redacted."""
    meta = request.metadata
    body = {
        "role": meta.get("role", "executor" if "task_id" in meta else ""),
        "purpose": meta.get("purpose", ""),
        "task": meta.get("task_id", ""),
        "system": request.system,
        "messages": [m.model_dump(mode="json") for m in request.messages],
        "tools": [t.model_dump(mode="json") for t in request.tools],
        "tool_choice": request.tool_choice.model_dump(mode="json") if request.tool_choice else None,
        "stop_sequences": list(request.stop_sequences),
    }
    redacted: dict[str, Any] = scrub(body, secrets)
    return redacted


def digest_of(canon: dict[str, Any]) -> str:
    raw = json.dumps(canon, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()[:24]


def request_digest(request: ModelRequest, secrets: tuple[str, ...] = ()) -> str:
    """The stable digest a cassette files `request` under."""
    return digest_of(canonical(request, secrets))


class Entry(BaseModel):
    """One recorded call."""

    model_config = ConfigDict(frozen=True)

    digest: str
    role: str
    task: str = ""
    request: dict[str, Any]
    response: ModelResponse


class CassetteError(ValueError):
    """A cassette file cannot be read; the message names the file and line."""


class CassetteMiss(TerminalModelError):
    """The cassette holds no reply for this request. The message shows the nearest recorded request
    and a diff against it, which usually names the prompt change that broke the match."""


def load(path: Path) -> list[Entry]:
    entries = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise CassetteError(
            f"cassette {path} does not exist; record it once with TASKLOOM_RECORD={path} against a real model"
        ) from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entries.append(Entry.model_validate_json(line))
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "line"
            raise CassetteError(f"cassette {path}, line {n}: {where}: {first['msg']}") from None
    return entries


def _pretty(value: Any, indent: str = "") -> list[str]:
    """A readable rendering for diffs: one line per line of text, so a diff points at the line that
    changed rather than at one long JSON string."""
    if isinstance(value, dict):
        out = []
        for k in sorted(value):
            v = value[k]
            if isinstance(v, dict | list) and v:
                out += [f"{indent}{k}:", *_pretty(v, indent + "  ")]
            elif isinstance(v, str) and "\n" in v:
                out += [f"{indent}{k}: |", *(f"{indent}  {line}" for line in v.split("\n"))]
            else:
                out.append(f"{indent}{k}: {json.dumps(v, ensure_ascii=False)}")
        return out
    if isinstance(value, list):
        out = []
        for item in value:
            body = _pretty(item, indent + "  ")
            out += [f"{indent}- {body[0].lstrip()}", *body[1:]] if body else [f"{indent}-"]
        return out
    if isinstance(value, str) and "\n" in value:
        return [f"{indent}|", *(f"{indent}  {line}" for line in value.split("\n"))]
    return [f"{indent}{json.dumps(value, ensure_ascii=False)}"]


def nearest(entries: Iterable[Entry], canon: dict[str, Any]) -> Entry | None:
    """The recorded request most like `canon`: same role, purpose and task first, then by text similarity."""
    mine = _pretty(canon)
    best: tuple[tuple[bool, float], Entry] | None = None
    for entry in entries:
        same = all(entry.request.get(k) == canon.get(k) for k in ("role", "purpose", "task"))
        ratio = difflib.SequenceMatcher(None, _pretty(entry.request), mine, autojunk=False).ratio()
        if best is None or (same, ratio) > best[0]:
            best = ((same, ratio), entry)
    return best[1] if best else None


def miss_message(path: Path, canon: dict[str, Any], digest: str, entries: list[Entry], max_lines: int = 80) -> str:
    who = f"role={canon['role'] or '?'} purpose={canon['purpose'] or '-'} task={canon['task'] or '-'}"
    head = f"cassette {path} has no reply for this request ({who}, digest {digest}); "
    near = nearest(entries, canon)
    if near is None:
        return head + "the cassette is empty. Re-record it with TASKLOOM_RECORD."
    diff = list(
        difflib.unified_diff(
            _pretty(near.request), _pretty(canon), f"recorded {near.digest}", f"requested {digest}", lineterm="", n=2
        )
    )
    if len(diff) > max_lines:
        diff = [*diff[:max_lines], f"... {len(diff) - max_lines} more diff lines"]
    return (
        head
        + f"nearest recorded request (role={near.role} task={near.task or '-'}) differs by:\n"
        + "\n".join(diff)
        + "\nIf the change is intended, re-record the cassette with TASKLOOM_RECORD."
    )


class RecordingModel:
    """A `ModelPort` that passes each call to `inner` and appends it to the cassette at `path`.

    Appends one line per call with a single `write` on a file opened in append mode, so that several
    worker processes may record into one file. `fresh=True` empties the file first.
    """

    def __init__(self, inner: ModelPort, path: Path | str, *, fresh: bool = False) -> None:
        self.inner = inner
        self.path = Path(path)
        self.name = inner.name
        self.model = inner.model
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            self.path.write_text("", encoding="utf-8")

    def __repr__(self) -> str:
        return f"RecordingModel({self.inner!r}, {str(self.path)!r})"

    async def complete(self, request: ModelRequest, on_text: TextSink | None = None) -> ModelResponse:
        # The recorded entry is the complete response either way: a streamed call records the same line.
        response = await (self.inner.complete(request) if on_text is None else self.inner.complete(request, on_text))
        secrets = env_secrets()
        canon = canonical(request, secrets)
        entry = {
            "digest": digest_of(canon),
            "role": canon["role"],
            "task": canon["task"],
            "request": canon,
            "response": scrub(response.model_dump(mode="json"), secrets),
        }
        self._append(json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n")
        return response

    def _append(self, line: str) -> None:
        # A line of a few kB: written in one call, not worth a thread hop.
        with self._lock, open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)

    async def aclose(self) -> None:
        close = getattr(self.inner, "aclose", None)
        if close is not None:
            await close()


@dataclass
class Replayer:
    """The replies of a cassette by digest, handed out in recorded order (the last one again when a
    request repeats more often than recorded, as a re-delivered job does)."""

    path: Path
    entries: list[Entry]
    _next: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, path: Path | str) -> Replayer:
        return cls(Path(path), load(Path(path)))

    def reply(self, request: ModelRequest) -> ModelResponse:
        """The recorded reply to `request`; raises `CassetteMiss` with a diff when there is none."""
        canon = canonical(request, env_secrets())
        digest = digest_of(canon)
        matches = [e for e in self.entries if e.digest == digest]
        if not matches:
            raise CassetteMiss(miss_message(self.path, canon, digest, self.entries))
        with self._lock:
            i = self._next.get(digest, 0)
            self._next[digest] = i + 1
        return matches[min(i, len(matches) - 1)].response
