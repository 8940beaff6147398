"""The one YAML loader of every settings file the CLI reads (knob files, sweep specs, split
configs): bounded in bytes, values, characters and depth before anything is built from it.

A YAML alias repeats what its anchor names without costing bytes, so a 1 KB file can stand for
10^9 values ("billion laughs"): the loader itself shares them, but whatever walks the result
(validation, a message quoting the input, the key-line map) walks every repetition. So the
event stream is scanned first, in one pass and without building anything: the expanded number
of values, their characters and the nesting depth are counted (an alias counts as much as what
it names) and the file is refused as soon as one passes its limit; an alias inside the
collection it names (a recursive structure) is refused outright. Only then is the file
composed and built, once. A value the constructor cannot build (an integer of more than 4300
digits, a date out of range) becomes a YAML error at its line.

Limits (all scale with ``HEALSWEEP_YAML_MIB``, default 1 MiB of file): 100,000 values and
16 MiB of scalar characters, expanded, per MiB; 64 levels of nesting.

Base layer: yaml and :mod:`healsweep._inputs` only. YAML syntax errors propagate as
``yaml.YAMLError`` for the caller to word with its file's name (``settings_errors.yaml_problem``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import yaml
from yaml.constructor import ConstructorError

from healsweep._inputs import MIB, InputError, quoted, read_text, size_setting
from healsweep.errors import HealsweepError

YAML_SETTING = "HEALSWEEP_YAML_MIB"
DEFAULT_MIB = 1.0
MAX_DEPTH = 64
MAX_SCALAR = 1 << 16  # characters of one value: a path, a name, a number
_SURROGATE = re.compile("[\ud800-\udfff]")  # from a "\ud800" escape: encodes to nothing
VALUES_PER_MIB = 100_000
CHARS_PER_MIB = 16 * MIB

_Base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml where installed


class _Loader(_Base):  # type: ignore[misc, valid-type]
    """The safe loader, with a value it cannot build turned into a marked YAML error."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError, RecursionError) as exc:
            raise ConstructorError(
                None, None, f"cannot read this value ({quoted(str(exc), 120)})", node.start_mark
            ) from None


class YAMLDocument(NamedTuple):
    """A loaded YAML file: its value and its composed node (for the lines of its keys)."""

    value: Any
    node: yaml.Node | None


@dataclass(frozen=True)
class YAMLBounds:
    """What one YAML file may expand to."""

    values: int
    chars: int
    depth: int = MAX_DEPTH

    @classmethod
    def for_bytes(cls, limit: int) -> YAMLBounds:
        """The bounds of a file of at most ``limit`` bytes."""
        scale = max(limit / MIB, DEFAULT_MIB)
        return cls(values=int(VALUES_PER_MIB * scale), chars=int(CHARS_PER_MIB * scale))


def load_yaml(
    path: str | os.PathLike[str], what: str, *, error: type[HealsweepError] = InputError
) -> YAMLDocument:
    """Read the YAML file ``path`` (a ``what``: "knob file", "sweep spec") within the bounds:
    a regular UTF-8 file of at most ``HEALSWEEP_YAML_MIB``, whose expansion stays within
    :class:`YAMLBounds`; every refusal is ``error`` in one line. ``OSError`` of the open and
    ``yaml.YAMLError`` propagate."""
    limit = size_setting(YAML_SETTING, DEFAULT_MIB)
    text = read_text(path, what, limit, setting=YAML_SETTING, error=error)
    return parse_yaml(text, str(path), what, YAMLBounds.for_bytes(limit), error=error)


def parse_yaml(
    text: str,
    where: str,
    what: str,
    bounds: YAMLBounds,
    *,
    error: type[HealsweepError] = InputError,
) -> YAMLDocument:
    """Scan ``text`` against ``bounds`` (:class:`_Expansion`), then compose and build it once."""
    expansion = _Expansion(where, what, bounds, error)
    for event in yaml.parse(text, Loader=_Loader):
        expansion.add(event)
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        value = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    return YAMLDocument(value, node)


@dataclass
class _Open:
    """A collection being scanned: its anchor and the counts when it opened."""

    anchor: str | None
    values: int
    chars: int
    depth: int
    deepest: int


@dataclass
class _Expansion:
    """The expanded size of a YAML event stream so far; raises once it passes its bounds."""

    where: str
    what: str
    bounds: YAMLBounds
    error: type[HealsweepError]
    values: int = 0
    chars: int = 0
    open: list[_Open] = field(default_factory=list)
    anchors: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # values, chars, height

    def add(self, event: yaml.Event) -> None:
        if isinstance(event, yaml.CollectionStartEvent):
            self._node(event, 1, 0, 1)
            depth = len(self.open) + 1
            self.open.append(_Open(event.anchor, self.values - 1, self.chars, depth, depth))
        elif isinstance(event, yaml.CollectionEndEvent):
            self._close()
        elif isinstance(event, yaml.ScalarEvent):
            if len(event.value) > MAX_SCALAR:
                raise self.error(
                    f"{self._at(event)}: a value of {len(event.value):,} characters (it starts "
                    f"{quoted(event.value[:40])}); a {self.what} holds names, paths and numbers, "
                    f"at most {MAX_SCALAR:,} characters each"
                )
            if found := _SURROGATE.search(event.value):
                raise self.error(
                    f"{self._at(event)}: a value holds a lone surrogate (U+{ord(found[0]):04X}, "
                    f"an escape such as \\u{ord(found[0]):04x} without its pair), which no path, "
                    "name or file can hold; escape a character outside the BMP as \\U0001XXXX"
                )
            self._node(event, 1, len(event.value), 1)
            if event.anchor is not None:
                self.anchors[event.anchor] = (1, len(event.value), 1)
        elif isinstance(event, yaml.AliasEvent):
            self._alias(event)

    def _node(self, event: yaml.Event, values: int, chars: int, height: int) -> None:
        self.values += values
        self.chars += chars
        depth = len(self.open) + height
        if self.open:
            self.open[-1].deepest = max(self.open[-1].deepest, depth)
        if depth > self.bounds.depth:
            raise self.error(
                f"{self._at(event)}: the YAML nests more than {self.bounds.depth} levels deep; "
                f"a {self.what} nests a few levels: flatten it"
            )
        if self.values > self.bounds.values:
            self._refuse(event, f"holds more than {self.bounds.values:,} values")
        if self.chars > self.bounds.chars:
            self._refuse(event, f"holds more than {self.bounds.chars:,} characters of values")

    def _close(self) -> None:
        done = self.open.pop()
        if self.open:
            self.open[-1].deepest = max(self.open[-1].deepest, done.deepest)
        if done.anchor is not None:
            height = done.deepest - done.depth + 1
            self.anchors[done.anchor] = (self.values - done.values, self.chars - done.chars, height)

    def _alias(self, event: yaml.AliasEvent) -> None:
        if any(o.anchor == event.anchor for o in self.open):
            raise self.error(
                f"{self._at(event)}: alias *{quoted(event.anchor, 40)} stands inside the "
                f"collection it names (a recursive structure); a {self.what} cannot hold one"
            )
        named = self.anchors.get(event.anchor)
        if named is not None:  # an undefined alias is the composer's error, with its line
            self._node(event, *named)

    def _at(self, event: yaml.Event) -> str:
        mark = event.start_mark
        return f"{self.where}:{mark.line + 1}" if mark is not None else self.where

    def _refuse(self, event: yaml.Event, what_it_does: str) -> None:
        raise self.error(
            f"{self._at(event)}: the YAML {what_it_does} (an alias counts as often as it is "
            f"used); a {self.what} is a small settings file: write it out plainly, or raise "
            f"{YAML_SETTING} (limits per MiB: {VALUES_PER_MIB:,} values, "
            f"{CHARS_PER_MIB // MIB} MiB of characters)"
        )
