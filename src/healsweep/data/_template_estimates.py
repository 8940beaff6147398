"""What a chat template's operation may build, weighed before it runs and after.

:mod:`healsweep.data._template_sandbox` holds a render to a budget of characters created. Every
result is weighed after it is built (:func:`weight`), and the operations that can build far more
than their inputs, or hold far more while they run, are estimated before (:func:`estimate`) and
refused when the estimate does not fit. A Python object held in a container costs far more than
a character (a pointer and an object header: 60 to 80 bytes for a short string), so each item of
a container, and each piece an operation splits its input into, weighs :data:`ITEM_COST`.
"""

from __future__ import annotations

import re
import string
from typing import Any

ITEM_COST = 64  # characters of budget per object held in a container (its pointer and header)
_DIGITS = re.compile(r"\d+")
_WIDTHS = frozenset({"center", "ljust", "rjust", "zfill"})  # a width pads to that many
# Filters that split their input into a list of pieces while they run (jinja's title, wordcount,
# urlize, wordwrap, striptags; str.split and friends): their transient cost is per piece.
_SPLITTING = frozenset({"do_title", "title", "wordcount", "urlize", "wordwrap", "striptags",
                        "split", "rsplit", "splitlines", "partition", "rpartition", "list"})  # fmt: skip
_WHITESPACE = " \t\n\r\x0b\x0c"


def weight(value: Any, depth: int = 0) -> int:
    """Characters a value stands for: a string's length, a container's items' weights plus
    :data:`ITEM_COST` per item, an integer's bytes; other objects 1."""
    if isinstance(value, str | bytes | bytearray):
        return len(value)
    if isinstance(value, bool) or value is None:
        return 1
    if isinstance(value, int):
        return max(1, value.bit_length() // 8)
    if depth < 8 and isinstance(value, list | tuple | set | frozenset | dict):
        items = value.items() if isinstance(value, dict) else value
        return ITEM_COST * len(value) + sum(weight(item, depth + 1) for item in items)
    return 1


def _numbers(values: Any, depth: int = 0, digit_strings: bool = False) -> list[int]:
    """The integers in ``values`` and, one container level down at a time, in their items (a
    width may come from ``(w, x)`` or ``{'w': w}``); digit-only strings too if asked."""
    found = []
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool):
            found.append(abs(v))
        elif digit_strings and isinstance(v, str) and 0 < len(v.strip()) and v.strip().isdigit():
            found.append(int(v) if len(v.strip()) <= 12 else 10**12)
        elif depth < 2 and isinstance(v, list | tuple | dict):
            items = list(v.values()) if isinstance(v, dict) else v
            found += _numbers(items[:64], depth + 1, digit_strings)
    return found


def _largest(values: Any, digit_strings: bool = False) -> int:
    return max(_numbers(values, digit_strings=digit_strings), default=0)


def _written_width(text: Any) -> int:
    """The largest number written in a format string (a width or precision it asks for)."""
    digits = _DIGITS.findall(text) if isinstance(text, str) else []
    return max((int(d) if len(d) <= 12 else 10**12 for d in digits), default=0)


def _nested_fields(text: str) -> list[str] | None:
    """The field names a ``str.format`` string takes widths from (``{:>{}}`` → ``[""]``);
    None when it does not parse (format() itself will fail)."""
    try:
        parsed = list(string.Formatter().parse(text))
        return [name or "" for _, _, spec, _ in parsed if spec and "{" in spec
                for _, name, _, _ in string.Formatter().parse(spec) if name is not None]  # fmt: skip
    except ValueError:
        return None


_UNBOUNDED = 1 << 62  # what an estimate says when it cannot see the size it would build


def _format(name: str, subject: str, args: tuple, kwargs: dict) -> int:
    """``'%*s' % (w, x)``, ``'%*s'|format(w, x)``, ``'{:>{}}'.format(x, w)``: the width is
    written in the string or passed among the arguments. A width read from an item or an
    attribute of an argument (``{:{0[1]}}``) is not followed: refused as unbounded."""
    width = _written_width(subject)
    nested = _nested_fields(subject) if name != "%" else []
    if name == "%" or "*" in subject:  # printf style: '*' takes an int argument
        width = max(width, _largest([*args, *kwargs.values()]))
    if nested:
        if any("[" in field or "." in field for field in nested):
            return _UNBOUNDED
        width = max(width, _largest([*args, *kwargs.values()], digit_strings=True))
    return len(subject) + width + sum(weight(a) for a in args) + sum(map(weight, kwargs.values()))
def _pieces(text: str, sep: Any) -> int:
    """How many pieces splitting ``text`` at ``sep`` (whitespace when None) can give."""
    if isinstance(sep, str) and sep:
        return text.count(sep) + 1
    return sum(text.count(c) for c in _WHITESPACE) + 1


def _sized(value: Any) -> int:
    return len(value) if isinstance(value, list | tuple | str | dict | set | frozenset) else 0


def estimate(name: str, subject: Any, args: tuple, kwargs: dict) -> int:
    """Characters an operation may build or hold, estimated before it runs, for the operations
    that can build far more than their inputs (0 for the others: their result is weighed after).

    ``name`` is a filter, method or operator name; ``subject`` what it works on (a method's
    object, a filter's value, an operator's left side); ``args``/``kwargs`` the rest."""
    numbers = _largest([*args, *kwargs.values()])
    if name == "join":
        return _join(subject, args, kwargs)
    if name in ("format", "format_map", "%") and isinstance(subject, str):
        return _format(name, subject, args, kwargs)
    if name in _WIDTHS:
        return weight(subject) + numbers
    if name in _SPLITTING and isinstance(subject, str):
        sep = args[0] if args else kwargs.get("sep")
        pieces = len(subject) if name == "list" else _pieces(subject, sep)
        return len(subject) + ITEM_COST * pieces
    if name == "generate_lorem_ipsum":  # lipsum(n=5, html=True, min=20, max=100)
        return _lipsum(args, kwargs)
    if name in ("batch", "slice"):
        return _batches(name, subject, args, kwargs)
    if name in ("*", "+", "**"):
        return _arithmetic(name, subject, args[0] if args else 0)
    return _builders(name, subject, args, kwargs, numbers)


def _builders(name: str, subject: Any, args: tuple, kwargs: dict, numbers: int) -> int:
    if name == "replace" and isinstance(subject, str) and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        return len(subject) + (len(subject) // max(len(old), 1) + 1) * len(new)
    if name == "indent" and isinstance(subject, str):
        width = kwargs.get("width", args[0] if args else 4)
        pad = len(width) if isinstance(width, str) else _largest([width])
        return len(subject) + (subject.count("\n") + 1) * pad
    if name == "expandtabs" and isinstance(subject, str):
        return len(subject) + subject.count("\t") * numbers
    if name == "tojson":
        indent = kwargs.get("indent")
        pad = len(indent) if isinstance(indent, str) else _largest([indent])
        return weight(subject) * (1 + pad)
    if name in ("pprint", "do_pprint", "string", "xmlattr", "urlencode"):
        return 8 * weight(subject)  # quoting, separators and (pprint) indentation per item
    return 0


def _join(subject: Any, args: tuple, kwargs: dict) -> int:
    if isinstance(subject, str):  # sep.join(items)
        sep, items = subject, args[0] if args else ()
    else:  # items|join(sep)
        items, sep = subject, args[0] if args else kwargs.get("d", "")
    if not isinstance(items, list | tuple | str):
        return 0  # an iterator: materialized by the caller first
    return weight(items) + len(items) * (len(sep) if isinstance(sep, str) else 1)


def _lipsum(args: tuple, kwargs: dict) -> int:
    named = dict(zip(("n", "html", "min", "max"), args, strict=False)) | kwargs
    paragraphs, longest = _largest([named.get("n", 5)]), _largest([named.get("max", 100)])
    longest = max(longest, _largest([named.get("min", 20)]))
    return paragraphs * longest * 12 + ITEM_COST * longest  # words of up to 12 chars, one list


def _batches(name: str, subject: Any, args: tuple, kwargs: dict) -> int:
    """``batch(value, linecount, fill_with)`` / ``slice(value, slices, fill_with)``: lazy, but
    their lists (and the padding of the last ones) are fixed by the arguments."""
    count = _largest([args[0] if args else kwargs.get("linecount", kwargs.get("slices", 0))])
    fill = (args[1] if len(args) > 1 else kwargs.get("fill_with")) is not None
    items = _sized(subject)
    if name == "batch":
        lists = items // max(count, 1) + 1
        padding = count if fill else 0
    else:  # slice: `count` lists, each padded by one when filled
        lists, padding = count, count if fill else 0
    return ITEM_COST * (items + lists + padding) + weight(subject)


def _arithmetic(name: str, subject: Any, other: Any) -> int:
    if name == "**":
        if isinstance(subject, int) and isinstance(other, int) and other > 0:
            return max(1, abs(subject).bit_length()) * other // 8
        return 0
    if name == "+":
        return weight(subject) + weight(other)
    if isinstance(subject, int) and not isinstance(other, int):  # n * seq
        subject, other = other, subject
    if isinstance(other, int) and not isinstance(subject, int):  # seq * n
        return weight(subject) * max(other, 0)
    return weight(subject) + weight(other)
