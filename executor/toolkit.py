"""The public toolkit API: plain (sync or async) functions with typed parameters become tools.

    support = Toolkit("support")

    @support.tool(read_only=True)
    async def lookup_order(order_id: str) -> dict[str, str]:
        "Look up an order by id."
        ...

The parameters' pydantic model is the tool's `input_schema`, and it validates what the model
wrote before the function runs: a tool only ever receives validated, typed values. A parameter
annotated `ToolContext` is not shown to the model; it receives the call's context, including an
idempotency key (`goal:task:tool:args digest`, the same in every attempt of the task for the same
call) a side-effecting tool can pass on downstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import re
import threading
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from bus.schemas import json_schema
from llm.forced import validation_problems
from llm.types import ToolDef

from .sources.base import InvalidArguments, ToolContext

__all__ = ["Tool", "ToolContext", "ToolDefinitionError", "Toolkit", "make_tool"]

F = typing.TypeVar("F", bound=Callable[..., Any])

TOOL_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,127}$")


class ToolDefinitionError(ValueError):
    """A function cannot be made into a tool (bad name, untyped parameter, ...)."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    fn: Callable[..., Any]
    params: type[BaseModel]
    context_param: str | None = None
    read_only: bool = False  # safe to run concurrently with other read-only calls
    side_effects: bool = False  # never run twice for one task: a repeat gets the recorded outcome
    idempotent: bool = False  # a side_effects tool that is safe to repeat (the ledger lets it run again)
    requires_approval: bool = False  # a person approves each call (`taskloom approve`)
    timeout: float | None = None  # seconds; None = the gateway's default

    @property
    def definition(self) -> ToolDef:
        return ToolDef(name=self.name, description=self.description, input_schema=json_schema(self.params))

    def parse(self, arguments: dict[str, Any]) -> BaseModel:
        try:
            return self.params.model_validate(arguments)
        except ValidationError as exc:
            raise InvalidArguments("; ".join(validation_problems(exc))) from None

    async def invoke(self, args: BaseModel, ctx: ToolContext) -> Any:
        kwargs = {name: getattr(args, name) for name in type(args).model_fields}
        if self.context_param:
            kwargs[self.context_param] = ctx
        if inspect.iscoroutinefunction(self.fn):
            return await self.fn(**kwargs)
        # A sync tool runs in a thread, so a slow one cannot stall the worker's event loop.
        return await run_in_daemon_thread(self.fn, kwargs, name=f"tool-{self.name}")


async def run_in_daemon_thread(fn: Callable[..., Any], kwargs: dict[str, Any], name: str) -> Any:
    """`fn(**kwargs)` in a new daemon thread, awaited without blocking the event loop.

    Not `asyncio.to_thread`: its pool threads are joined when the loop closes and again at
    interpreter exit, so one sync tool stuck past its timeout kept a worker alive long after its
    shutdown grace. Python cannot kill a thread; a daemon thread is abandoned instead: the call's
    await ends at the tool's timeout (the model sees a timeout error), the thread runs on in the
    background until the function returns, and the process exits without waiting for it.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()  # log context (goal, task, ...) as to_thread would carry it

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def target() -> None:
        try:
            ok, value = True, context.run(fn, **kwargs)
        except BaseException as exc:
            ok, value = False, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody awaits this any more
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=target, name=name, daemon=True).start()
    return await future


def _params_model(fn: Callable[..., Any], tool_name: str) -> tuple[type[BaseModel], str | None]:
    hints = typing.get_type_hints(fn, include_extras=True)
    fields: dict[str, Any] = {}
    context_param = None
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolDefinitionError(f"tool {tool_name!r}: *args/**kwargs cannot be described to a model")
        if name not in hints:
            raise ToolDefinitionError(f"tool {tool_name!r}: parameter {name!r} needs a type annotation")
        if hints[name] is ToolContext:
            context_param = name
            continue
        default = ... if param.default is param.empty else param.default
        fields[name] = (hints[name], Field(default=default))
    model_name = "".join(part.capitalize() for part in re.split(r"[^A-Za-z0-9]", tool_name)) + "Input"
    model = create_model(model_name, __config__=ConfigDict(extra="forbid"), **fields)
    return model, context_param


def make_tool(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    read_only: bool = False,
    side_effects: bool = False,
    requires_approval: bool = False,
    timeout: float | None = None,
    idempotent: bool = False,
) -> Tool:
    tool_name = name or fn.__name__
    if not TOOL_NAME.match(tool_name):
        raise ToolDefinitionError(f"tool name {tool_name!r} must match {TOOL_NAME.pattern}")
    if read_only and side_effects:
        raise ToolDefinitionError(f"tool {tool_name!r} cannot be both read_only and side_effects")
    if timeout is not None and timeout <= 0:
        raise ToolDefinitionError(f"tool {tool_name!r}: timeout must be > 0, got {timeout}")
    doc = description if description is not None else inspect.getdoc(fn) or ""
    params, context_param = _params_model(fn, tool_name)
    return Tool(
        name=tool_name,
        description=doc.strip(),
        fn=fn,
        params=params,
        context_param=context_param,
        read_only=read_only,
        side_effects=side_effects,
        requires_approval=requires_approval,
        timeout=timeout,
        idempotent=idempotent,
    )


@dataclass
class Toolkit:
    """A named set of tools; load it with `TASKLOOM_TOOLS=module:attribute`."""

    name: str = "tools"
    tools: dict[str, Tool] = field(default_factory=dict)

    @typing.overload
    def tool(self, fn: F) -> F: ...

    @typing.overload
    def tool(
        self,
        fn: None = None,
        *,
        name: str | None = None,
        description: str | None = None,
        read_only: bool = False,
        side_effects: bool = False,
        requires_approval: bool = False,
        timeout: float | None = None,
        idempotent: bool = False,
    ) -> Callable[[F], F]: ...

    def tool(
        self,
        fn: F | None = None,
        *,
        name: str | None = None,
        description: str | None = None,
        read_only: bool = False,
        side_effects: bool = False,
        requires_approval: bool = False,
        timeout: float | None = None,
        idempotent: bool = False,
    ) -> F | Callable[[F], F]:
        """Decorator, usable bare (`@kit.tool`) or with options (`@kit.tool(read_only=True)`)."""

        def register(f: F) -> F:
            t = make_tool(
                f,
                name=name,
                description=description,
                read_only=read_only,
                side_effects=side_effects,
                requires_approval=requires_approval,
                timeout=timeout,
                idempotent=idempotent,
            )
            if t.name in self.tools:
                raise ToolDefinitionError(f"toolkit {self.name!r} already has a tool named {t.name!r}")
            self.tools[t.name] = t
            return f

        return register(fn) if fn is not None else register

    def __iter__(self) -> typing.Iterator[Tool]:
        return iter(self.tools.values())
