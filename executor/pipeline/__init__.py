"""The steps of the tool-call pipeline, one module each; `executor.gateway.ToolGateway` puts them
in their order (see its docstring and docs/internals.md, "The tool-call pipeline")."""

from .approval import Approval, Approvals, Paused, RedisApprovals
from .call import Attempt, Call, Step, digest, error_outcome
from .crash import UnknownAfterCrash
from .invoke import Invoke
from .record import Record
from .repeats import History, Repeats
from .replay import Replay
from .truncate import Truncate, truncate
from .validate import Validate

__all__ = [
    "Approval",
    "Approvals",
    "Attempt",
    "Call",
    "History",
    "Invoke",
    "Paused",
    "Record",
    "RedisApprovals",
    "Repeats",
    "Replay",
    "Step",
    "Truncate",
    "UnknownAfterCrash",
    "Validate",
    "digest",
    "error_outcome",
    "truncate",
]
