"""Typed errors of healsweep.

Library code raises a subclass of :class:`HealsweepError` whose message says what was wrong,
where, and what to do. Only the CLI turns it into one line on stderr and exit code 1.
"""

from __future__ import annotations


class HealsweepError(Exception):
    """Base class of every error a user can cause and fix."""


class GGUFFormatError(HealsweepError):
    """A GGUF file is unreadable, truncated, of an unsupported architecture or incomplete."""


class UnsupportedArchitectureError(GGUFFormatError):
    """`general.architecture` names an architecture healsweep has no adapter for."""


class TokenizerError(HealsweepError):
    """A tokenizer could not be built from GGUF metadata or a tokenizer.json."""


class CorpusError(HealsweepError):
    """A corpus file is malformed (the message names the file and line)."""


class ChatTemplateError(HealsweepError):
    """A model's chat template (``tokenizer.chat_template``) does not compile or fails to render."""


class SplitError(HealsweepError):
    """A split config is malformed, or a split has no documents where some are required."""


class TestSplitSealed(HealsweepError):
    """A test window was requested without a ledger grant."""

    __test__ = False  # not a pytest test class


class LedgerError(HealsweepError):
    """The ledger is tampered with, locked, or refuses an operation."""


class KnobError(HealsweepError, ValueError):
    """A knob file or knob value is invalid (unknown knob, value out of range); ``name`` is the
    knob or setting it names, when one. A ``ValueError``, so pydantic reports it where a model
    holds knobs (a sweep spec's ``baseline``) at that field."""

    def __init__(self, message: str, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class SpecError(HealsweepError):
    """A sweep spec is invalid."""


class CacheError(HealsweepError):
    """A cache directory is unusable (not writable, full)."""


class ResultsError(HealsweepError):
    """A results directory is missing, unwritable or inconsistent."""


class SliceError(HealsweepError):
    """A layer range or output path of ``healsweep model slice`` is invalid."""


class SettingError(HealsweepError):
    """An environment setting (``HEALSWEEP_*``) or a build option has a value healsweep cannot use."""
