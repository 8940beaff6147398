"""A Jinja sandbox that bounds what one render of a chat template may cost: time and memory.

Jinja's sandbox stops attribute escapes but bounds neither the work a template does (nested loops
inside ``range``'s limit) nor what it builds (a string doubled in a loop). A chat template comes
from the model file, and the render runs in calibration and in every sweep trial, so one render
is held to a :class:`RenderLimits` budget, checked as it goes:

- **time**: a wall-clock deadline, checked at every loop item and loop body, every call, filter,
  intercepted operator, attribute or item lookup and every output piece (loops are rewritten
  after parsing so that their items and bodies pass through the check, filtered ones included);
- **memory**: a budget of characters *created*. The result of every call, filter, ``~``
  concatenation, ``+``/``*``/``%``/``**`` and every output piece is weighed (a string by its
  length, a container by its items' weights) and added to the total; operations that can build
  far more than their inputs (``'x' * n``, ``n ** k``, ``'%9999999s' % x``, widths in
  ``format``, ``join``, ``replace``, ``indent``, ``center``, ...) are estimated and refused before
  they run. What a render holds at any time was created by it, so its memory stays within the
  budget plus its inputs (a character is 1 to 4 bytes in Python);
- **depth**: macro and ``caller`` calls nest at most :data:`MAX_DEPTH` deep.

A benign template pays a Python call per output piece and loop item: microseconds per document.
Exceeding a limit raises :class:`RenderLimitExceeded`, which :mod:`healsweep.data.chat_template`
turns into a one-line :class:`~healsweep.errors.ChatTemplateError` naming the template and the
limit. The limits come from ``HEALSWEEP_TEMPLATE_SECONDS`` and ``HEALSWEEP_TEMPLATE_MIB``
(:func:`render_limits`).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from healsweep.data._template_estimates import estimate, weight
from healsweep.errors import SettingError

SECONDS_ENV = "HEALSWEEP_TEMPLATE_SECONDS"
MIB_ENV = "HEALSWEEP_TEMPLATE_MIB"
DEFAULT_SECONDS = 2.0
DEFAULT_MIB = 32.0
MAX_DEPTH = 64  # nested macro / caller calls
_WATCH_EVERY = 64  # profile events between two looks at the clock inside an operation


@dataclass(frozen=True)
class RenderLimits:
    """What one render of a chat template may spend: wall seconds and MiB of characters created
    (output included)."""

    seconds: float = DEFAULT_SECONDS
    mib: float = DEFAULT_MIB

    @property
    def chars(self) -> int:
        """The memory budget in characters."""
        return int(self.mib * 2**20)

    def describe(self) -> str:
        """``"2 s and 32 MiB"``, for messages."""
        return f"{self.seconds:g} s and {self.mib:g} MiB"


def _setting(env: str, default: float, what: str) -> float:
    raw = os.environ.get(env)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise SettingError(
            f"{env}={raw!r} is not a positive number; set it to the {what} one render of a "
            "chat template may take, or unset it"
        )
    return value


def render_limits() -> RenderLimits:
    """The limits from ``HEALSWEEP_TEMPLATE_SECONDS`` / ``HEALSWEEP_TEMPLATE_MIB`` (defaults
    2 s and 32 MiB); a value that is not a positive number is a one-line SettingError."""
    return RenderLimits(
        _setting(SECONDS_ENV, DEFAULT_SECONDS, "wall seconds"),
        _setting(MIB_ENV, DEFAULT_MIB, "MiB of characters"),
    )


class RenderLimitExceeded(Exception):
    """A render went past its :class:`RenderLimits`; ``limit`` is ``"time"``, ``"memory"`` or
    ``"depth"`` and the message says what was asked for."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class _Budget:
    """The running account of one render."""

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.created = 0
        self.depth = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimitExceeded("time", self.late())

    def late(self) -> str:
        return f"it ran past {self.limits.seconds:g} s of wall time"

    def spend(self, chars: int, what: str) -> None:
        """Account ``chars`` more characters (``what`` made them); raise past the budget."""
        self.tick()
        if chars > self.limits.chars - self.created:
            raise RenderLimitExceeded(
                "memory",
                f"{what} would bring what it built to {self.created + chars:,} characters, over "
                f"{self.limits.chars:,} ({self.limits.mib:g} MiB)",
            )
        self.created += chars


# The budget of the render running in this context (a thread's own; no module-level store).
_BUDGET: ContextVar[_Budget | None] = ContextVar("healsweep_render_budget", default=None)


def _budget() -> _Budget | None:
    return _BUDGET.get()


class budgeted:
    """``with budgeted(limits):`` renders in this thread are held to ``limits``."""

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits

    def __enter__(self) -> _Budget:
        budget = _Budget(self.limits)
        self.token = _BUDGET.set(budget)
        return budget

    def __exit__(self, *exc: Any) -> None:
        _BUDGET.reset(self.token)


def _materialized(name: str, subject: Any, args: tuple, budget: _Budget) -> tuple[Any, tuple]:
    """For ``join`` of an iterator: the items as a list (ticking), so its size is known first."""
    if name != "join":
        return subject, args
    if isinstance(subject, str):
        if args and not isinstance(args[0], list | tuple | str):
            return subject, (list(_ticking(args[0], budget)), *args[1:])
    elif not isinstance(subject, list | tuple | str) and subject is not None:
        return list(_ticking(subject, budget)), args
    return subject, args


def _checked(budget: _Budget, name: str, run: Any, subject: Any, args: tuple,
             kwargs: dict) -> Any:  # fmt: skip
    """``run()`` (an operation ``name`` on ``subject`` with ``args``), its estimated size
    refused before it runs and its result's weight accounted after."""
    budget.tick()
    ahead = estimate(name, subject, args, kwargs)
    if ahead > budget.limits.chars - budget.created:
        budget.spend(ahead, f"{name!r}")  # raises
    result = _watched(run, budget)
    budget.spend(weight(result), f"{name!r}")
    return result


def _watched(run: Any, budget: _Budget) -> Any:
    """``run()`` with the deadline checked inside it too: a filter written in Python (jinja's
    ``title``, ``urlize``, ``batch``, textwrap's ``wordwrap``, ``lipsum``) loops without passing
    the template's own checks, so a profile hook looks at the clock every few of its calls. A
    single C-level call still runs to its end; its size was estimated before it started."""
    previous = sys.getprofile()
    events = 0

    def watch(frame: Any, event: str, arg: Any) -> None:
        nonlocal events
        events += 1
        if events % _WATCH_EVERY == 0 and time.monotonic() > budget.deadline:
            raise RenderLimitExceeded("time", budget.late())

    sys.setprofile(watch)
    try:
        return run()
    finally:
        sys.setprofile(previous)


def guarded_filter(name: str, func: Any) -> Any:
    """``func`` (a filter) checked against the render's budget."""

    @functools.wraps(func)  # keeps jinja's pass_context/pass_environment marker
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        if budget is None:
            return func(*args, **kwargs)
        lead = next((i for i, a in enumerate(args) if not _is_jinja_context(a)), len(args))
        subject, rest = (args[lead], args[lead + 1 :]) if lead < len(args) else (None, ())
        subject, rest = _materialized(name, subject, rest, budget)
        args = (*args[:lead], subject, *rest) if lead < len(args) else args
        return _checked(budget, name, lambda: func(*args, **kwargs), subject, rest, kwargs)

    return wrapper


def _is_jinja_context(value: Any) -> bool:
    # lazy: heavy (jinja2)
    from jinja2.environment import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    return isinstance(value, Context | EvalContext | Environment)


# --- the hooks the rewritten template calls (``environment.hs_*``) ------------------------------


def _ticking(iterable: Any, budget: _Budget) -> Any:
    for item in iterable:
        budget.tick()
        yield item


def hs_tick() -> str:
    """At the top of every loop body."""
    budget = _budget()
    if budget is not None:
        budget.tick()
    return ""


def hs_items(iterable: Any) -> Any:
    """Around every loop's iterable: each item passes the deadline check."""
    budget = _budget()
    return iterable if budget is None else _ticking(iterable, budget)


def hs_emit(value: Any) -> Any:
    """Around every output piece (literal text included)."""
    budget = _budget()
    if budget is not None:
        budget.spend(weight(value), "its output")
    return value


def hs_value(value: Any) -> Any:
    """Around every ``~`` concatenation."""
    budget = _budget()
    if budget is not None:
        budget.spend(weight(value), "a '~' concatenation")
    return value


_HOOKS = {f.__name__: f for f in (hs_tick, hs_items, hs_emit, hs_value)}
_HOOK_FUNCS = frozenset(_HOOKS.values())


@functools.cache
def _instrument_class() -> Any:
    """The node transformer that routes loop items and bodies, output pieces and ``~`` through
    the budget (one class, made on first use: jinja2 is imported only then)."""
    # lazy: heavy (jinja2)
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def hook(name: str, *args: Any, lineno: int) -> Any:
        call = nodes.Call(nodes.EnvironmentAttribute(name), list(args), [], None, None)
        return call.set_lineno(lineno)

    class Instrument(NodeTransformer):
        """Routes loop items and bodies, output pieces and ``~`` through the budget."""

        def visit_For(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.iter = hook("hs_items", node.iter, lineno=node.lineno)
            tick = nodes.ExprStmt(hook("hs_tick", lineno=node.lineno)).set_lineno(node.lineno)
            node.body = [tick, *node.body]
            return node

        def visit_Output(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.nodes = [hook("hs_emit", child, lineno=child.lineno or node.lineno)
                          for child in node.nodes]  # fmt: skip
            return node

        def visit_Concat(self, node: Any) -> Any:
            return hook("hs_value", self.generic_visit(node), lineno=node.lineno)

    return Instrument


@functools.cache
def _sandbox_class() -> Any:
    """The bounded sandbox's class: every binary operator, attribute, item and call of a render
    goes through the budget, and templates are parsed through :func:`_instrument_class`."""
    # lazy: heavy (jinja2)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    instrument = _instrument_class()

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            for name, func in _HOOKS.items():
                setattr(self, name, func)

        def _parse(self, source: str, name: Any, filename: Any) -> Any:
            tree = instrument().visit(super()._parse(source, name, filename))
            tree.set_environment(self)
            return tree

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            run = functools.partial(self.binop_table[operator], left, right)
            budget = _budget()
            return run() if budget is None else _checked(budget, operator, run, left, (right,), {})

        def getattr(self, obj: Any, attribute: str) -> Any:
            budget = _budget()
            if budget is not None:
                budget.tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            budget = _budget()
            if budget is None:
                return super().getitem(obj, argument)
            if not isinstance(argument, slice):  # a lookup: returns what exists already
                budget.tick()
                return super().getitem(obj, argument)
            run = functools.partial(ImmutableSandboxedEnvironment.getitem, self, obj, argument)
            return _checked(budget, "a slice", run, obj, (), {})

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            budget = _budget()
            if any(__obj is hook for hook in _HOOK_FUNCS):
                return __obj(*args)
            if budget is None:
                return ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args,
                                                          **kwargs)  # fmt: skip
            if budget.depth >= MAX_DEPTH:
                raise RenderLimitExceeded("depth", f"its calls nest more than {MAX_DEPTH} deep")
            name = getattr(__obj, "__name__", None) or getattr(__obj, "name", None) or "a call"
            # a method's object; the sandbox wraps str.format, keeping the method as __wrapped__
            bound = getattr(__obj, "__wrapped__", __obj)
            subject = getattr(bound, "__self__", None)
            subject, args = _materialized(name, subject, args, budget)
            run = functools.partial(ImmutableSandboxedEnvironment.call, __self, __context, __obj,
                                    *args, **kwargs)  # fmt: skip
            budget.depth += 1
            try:
                return _checked(budget, name, run, subject, args, kwargs)
            finally:
                budget.depth -= 1

    return BoundedSandbox


def make_environment(**options: Any) -> Any:
    """An immutable sandboxed Jinja environment whose renders are held to the budget set with
    :class:`budgeted` (outside one it renders without limits). Call :func:`guard_filters` once
    its filters are all in place."""
    # No constant folding: Jinja's optimizer evaluates constant filters while it compiles,
    # before any render and so outside its budget (``{{ 'x'|center(1500000000)|length }}``
    # built 1.5 GB that way); unfolded, they run in the render, through the guards.
    return _sandbox_class()(**{**options, "optimized": False})


def guard_filters(env: Any) -> None:
    """Wrap every filter of ``env`` (call after adding the environment's own filters)."""
    for name, func in list(env.filters.items()):
        env.filters[name] = guarded_filter(name, func)
