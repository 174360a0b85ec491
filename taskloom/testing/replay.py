"""`ReplayModel`: answer from a cassette recorded against a real model; or record it.

Record once, against the real model, by running the test with `TASKLOOM_RECORD` naming the
cassette (and `TASKLOOM_MODEL` / `ANTHROPIC_API_KEY` set as for a worker):

    TASKLOOM_RECORD=tests/cassettes/refund.jsonl TASKLOOM_MODEL=claude-sonnet-4-5 python -m pytest tests/test_refund.py

`ReplayModel("tests/cassettes/refund.jsonl")` then sees that it is asked to record: it calls the real
model through a `llm.cassette.RecordingModel` that rewrites the file. Without the variable (in CI)
it replays: each request is looked up by its digest, and a request the cassette does not hold fails
with a diff against the nearest recorded one. The same variable makes worker processes record
every call they make (`taskloom.workers.make_inner_model`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from llm.cassette import CassetteMiss, RecordingModel, Replayer
from llm.port import ModelPort, TextSink
from llm.types import ModelRequest, ModelResponse

from ..settings import load_settings
from ..workers import make_inner_model


def recording_requested(path: Path, environ: dict[str, str] | None = None) -> bool:
    """True when `TASKLOOM_RECORD` names `path`."""
    env = os.environ if environ is None else environ
    target = env.get("TASKLOOM_RECORD", "")
    return bool(target) and Path(target).resolve() == path.resolve()


class ReplayModel:
    """A `ModelPort` that replays the cassette at `path`, or records it (see the module docstring).

    `real` builds the model to record against (default: the one `TASKLOOM_MODEL` configures, as a
    worker would). `problems` lists the requests the cassette could not answer.
    """

    def __init__(self, path: Path | str, *, real: Callable[[], ModelPort] | None = None) -> None:
        self.path = Path(path)
        self.problems: list[str] = []
        self.recording = recording_requested(self.path)
        self._recorder: RecordingModel | None = None
        self._replayer: Replayer | None = None
        if self.recording:
            settings = load_settings().model_copy(update={"record": None})  # the recorder is ours
            inner = real() if real is not None else make_inner_model(settings)
            self._recorder = RecordingModel(inner, self.path, fresh=True)
            self.name, self.model = inner.name, inner.model
        else:
            self._replayer = Replayer.open(self.path)
            recorded = {e.response.model for e in self._replayer.entries}
            self.name, self.model = "replay", recorded.pop() if len(recorded) == 1 else "replay"

    def __repr__(self) -> str:
        return f"ReplayModel({str(self.path)!r}, recording={self.recording})"

    async def complete(self, request: ModelRequest, on_text: TextSink | None = None) -> ModelResponse:
        if self._recorder is not None:
            return await self._recorder.complete(request, on_text)
        assert self._replayer is not None
        try:
            response = self._replayer.reply(request)
        except CassetteMiss as exc:
            self.problems.append(str(exc))
            raise
        if on_text is not None and response.text:
            on_text(response.text)  # a recorded reply arrives whole
        return response

    async def aclose(self) -> None:
        if self._recorder is not None:
            await self._recorder.aclose()
