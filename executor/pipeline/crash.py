"""Step 3, crash: a side-effecting call that started before its worker died, and has no stored
result, gets an `unknown_outcome` ERROR instead of running again (it may have taken effect).

Before replay: the call is this attempt's own (same call id, resumed after the crash), so there is
no earlier attempt's record to replay; its effect record, if any, says only `started`. Before
approval: a person cannot decide about an effect whose outcome nobody knows; the model is told to
check it first.
"""

from __future__ import annotations

from typing import ClassVar

from .call import Attempt, Call

UNKNOWN_ERROR = (
    "the outcome of this {tool} call is unknown: the worker stopped while it ran, and it has side "
    "effects, so it was not run again. Check its effect before retrying."
)


class UnknownAfterCrash:
    name: ClassVar[str] = "crash"
    every_call: ClassVar[bool] = False

    def __init__(self, attempt: Attempt | None) -> None:
        self.attempt = attempt

    async def __call__(self, call: Call) -> None:
        if self.attempt is None or call.tool is None or not call.tool.side_effects:
            return
        if call.block.id in self.attempt.started:
            call.fail("unknown_outcome", UNKNOWN_ERROR.format(tool=call.block.name), self.name)
