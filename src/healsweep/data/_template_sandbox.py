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
import re
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from healsweep.errors import SettingError

SECONDS_ENV = "HEALSWEEP_TEMPLATE_SECONDS"
MIB_ENV = "HEALSWEEP_TEMPLATE_MIB"
DEFAULT_SECONDS = 2.0
DEFAULT_MIB = 32.0
MAX_DEPTH = 64  # nested macro / caller calls
_DIGITS = re.compile(r"\d+")


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
            raise RenderLimitExceeded("time", f"it ran past {self.limits.seconds:g} s of wall time")

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


def weight(value: Any, depth: int = 0) -> int:
    """Characters a value stands for: a string's length, a container's items' weights (plus
    one per item), an integer's bytes; other objects 1."""
    if isinstance(value, str | bytes | bytearray):
        return len(value)
    if isinstance(value, bool) or value is None:
        return 1
    if isinstance(value, int):
        return max(1, value.bit_length() // 8)
    if depth < 8 and isinstance(value, list | tuple | set | frozenset | dict):
        items = value.items() if isinstance(value, dict) else value
        return len(value) + sum(weight(item, depth + 1) for item in items)
    return 1


def _largest_int(values: Any) -> int:
    ints = [abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return max(ints, default=0)


def _format_width(text: Any) -> int:
    """The largest number written in a format string (a width or precision it asks for)."""
    digits = _DIGITS.findall(text) if isinstance(text, str) else []
    return max((int(d) if len(d) <= 12 else 10**12 for d in digits), default=0)


_WIDTHS = frozenset({"center", "ljust", "rjust", "zfill"})  # a width pads to that many


def estimate(name: str, subject: Any, args: tuple, kwargs: dict) -> int:
    """Characters an operation may build, estimated before it runs, for the operations that can
    build far more than their inputs (0 for the others: their result is weighed after).

    ``name`` is a filter, method or operator name; ``subject`` what it works on (a method's
    object, a filter's value, an operator's left side); ``args``/``kwargs`` the rest."""
    numbers = _largest_int([*args, *kwargs.values()])
    if name == "join":
        if isinstance(subject, str):  # sep.join(items)
            sep, items = subject, args[0] if args else ()
        else:  # items|join(sep)
            items, sep = subject, args[0] if args else kwargs.get("d", "")
        if not isinstance(items, list | tuple | str):
            return 0  # an iterator: materialized by the caller first (see _checked)
        return weight(items) + len(items) * (len(sep) if isinstance(sep, str) else 1)
    if name == "replace" and isinstance(subject, str) and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        return len(subject) + (len(subject) // max(len(old), 1) + 1) * len(new)
    if name == "indent" and isinstance(subject, str):
        width = kwargs.get("width", args[0] if args else 4)
        pad = len(width) if isinstance(width, str) else abs(int(width or 0))
        return len(subject) + (subject.count("\n") + 1) * pad
    if name == "expandtabs" and isinstance(subject, str):
        return len(subject) + subject.count("\t") * numbers
    if name == "tojson":
        indent = kwargs.get("indent")
        pad = len(indent) if isinstance(indent, str) else _largest_int([indent])
        return weight(subject) * (1 + pad)
    if name == "wordwrap" and isinstance(subject, str):
        width = args[0] if args else kwargs.get("width", 79)
        wrap = args[2] if len(args) > 2 else kwargs.get("wrapstring") or "\n"
        lines = len(subject) // max(_largest_int([width]), 1) + 1
        return len(subject) + lines * len(str(wrap))
    if name in ("format", "format_map", "%") and isinstance(subject, str):
        width = max(numbers, _format_width(subject))
        return weight(subject) + width + sum(weight(a) for a in args)
    if name in _WIDTHS:
        return weight(subject) + numbers
    if name == "*":
        other = args[0] if args else 0
        if isinstance(subject, int) and not isinstance(other, int):
            subject, other = other, subject
        if isinstance(other, int) and not isinstance(subject, int):
            return weight(subject) * max(other, 0)
        return weight(subject) + weight(other)
    if name == "**":
        exponent = args[0] if args else 0
        if isinstance(subject, int) and isinstance(exponent, int) and exponent > 0:
            return max(1, abs(subject).bit_length()) * exponent // 8
    return 0


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
    result = run()
    budget.spend(weight(result), f"{name!r}")
    return result


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


def make_environment(**options: Any) -> Any:
    """An immutable sandboxed Jinja environment whose renders are held to the budget set with
    :class:`budgeted` (outside one it renders without limits). Call :func:`guard_filters` once
    its filters are all in place."""
    # lazy: heavy (jinja2)
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment
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

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            for name, func in _HOOKS.items():
                setattr(self, name, func)

        def _parse(self, source: str, name: Any, filename: Any) -> Any:
            tree = Instrument().visit(super()._parse(source, name, filename))
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

    return BoundedSandbox(**options)


def guard_filters(env: Any) -> None:
    """Wrap every filter of ``env`` (call after adding the environment's own filters)."""
    for name, func in list(env.filters.items()):
        env.filters[name] = guarded_filter(name, func)
