"""The dev/test split of a corpus, and its lock id.

A split config (YAML) says, per source, how documents are divided (the parity rule: odd index →
dev, even → test), which documents are set aside by name (calibration, canary, burned) and which
form the calibration pool. :func:`assign` maps one document to ``dev``, ``test``,
``calibration``, ``canary`` or ``excluded``.

The split lock id is sha256 over the sorted ``(doc_id, source, index, stratum, content_hash,
assignment, reason)`` of every document of the corpus, so any edit that moves a document, renames
its stratum or changes its text yields a new id. Free-text ``note`` fields and YAML layout do not enter the id: they change nothing about
which text is tuned on or tested on. Documents of the corpus's ``train`` pool are ``excluded``.

Only ``test`` is sealed: materializing it needs a ledger grant (:func:`require_access`).
Canary documents lie outside dev and test and may be scored at any time.

Test membership is fixed by the parity rule, never by a role the file assigns: an eval-pool
document of a parity source with an even index is *test-side*, and a config that names one as a
canary or as calibration (which would make it scorable, or trainable, without a grant) is refused
in one line. A test-side document may only be ``burned`` (kept out of every split: never scored,
never trained on), which changes the lock id like any other edit, so the ledger refuses it after a
confirm. Two documents with the same text cannot sit on both sides either: a dev, canary or
calibration document whose content equals a test document's is refused the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from healsweep._inputs import quoted
from healsweep._yaml_input import load_yaml
from healsweep.errors import SplitError
from healsweep.ledger import require_grant

Assignment = Literal["dev", "test", "calibration", "canary", "excluded"]
ASSIGNMENTS: tuple[str, ...] = ("dev", "test", "calibration", "canary", "excluded")
EVAL_SPLITS: tuple[str, ...] = ("dev", "test", "canary")
_LOCK_TAG = "healsweep-split-lock-v1"


class SplitDocument(Protocol):
    """What the split reads from a corpus document (``healsweep.data.corpus.Document``)."""

    doc_id: str
    source: str
    index: int
    stratum: str

    @property
    def content_hash(self) -> str: ...


class Exclusion(BaseModel):
    """A document set aside by name, with the reason and a free-text note."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    reason: Literal["calibration", "canary", "burned"]
    note: str = ""


class SourceRule(BaseModel):
    """How one source's documents divide: ``parity`` (odd index → dev, even → test) or
    ``exclude`` (the whole source stays out of dev and test)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rule: Literal["parity", "exclude"] = "parity"


class CalibrationPool(BaseModel):
    """The calibration pool: corpus documents with ``pool: calibration`` and/or listed doc ids."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    from_corpus_pool: bool = True
    doc_ids: tuple[str, ...] = ()


class SplitConfig(BaseModel):
    """A validated split config; see the module docstring for the rules."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: Literal[1] = 1
    corpus: str | None = Field(default=None, description="the corpus it was made for (or demo)")
    sources: dict[str, SourceRule]
    exclusions: dict[str, Exclusion] = {}
    calibration: CalibrationPool = CalibrationPool()
    canary: tuple[str, ...] = ()

    @field_validator("sources", mode="before")
    @classmethod
    def _rule_shorthand(cls, value: Any) -> Any:
        # `py-code: parity` is shorthand for `py-code: {rule: parity}`.
        if isinstance(value, dict):
            return {k: {"rule": v} if isinstance(v, str) else v for k, v in value.items()}
        return value

    def assign(self, doc: SplitDocument) -> str:
        """Where ``doc`` goes: ``dev|test|calibration|canary|excluded`` (see :func:`assign`)."""
        return assign(self, doc)

    def named_doc_ids(self) -> set[str]:
        """Every doc id the config names explicitly."""
        return set(self.exclusions) | set(self.canary) | set(self.calibration.doc_ids)


def assign(config: SplitConfig, doc: SplitDocument) -> str:
    """The split of one document.

    Precedence: named canary, named exclusion, calibration pool, ``train`` pool (excluded), the
    source rule (parity: odd index → dev, even → test). A source the config does not list raises
    :class:`SplitError`, so a corpus that grew a new source cannot slip into dev or test unseen,
    and so does a test-side document named as a canary or as calibration (module docstring).
    """
    return _assign_with_reason(config, doc)[0]


def on_test_side(config: SplitConfig, doc: SplitDocument) -> bool:
    """Whether the parity rule puts ``doc`` on the test side (an eval-pool document of a parity
    source with an even index), whatever role the config names it in."""
    pool = getattr(doc, "pool", "eval") or "eval"
    rule = config.sources.get(doc.source)
    return pool == "eval" and rule is not None and rule.rule == "parity" and doc.index % 2 == 0


def _named_role(config: SplitConfig, doc_id: str) -> str | None:
    """The role the config names ``doc_id`` in (canary, calibration or burned), if any."""
    if doc_id in config.canary:
        return "canary"
    exclusion = config.exclusions.get(doc_id)
    if exclusion is not None:
        return exclusion.reason
    return "calibration" if doc_id in config.calibration.doc_ids else None


def _assign_with_reason(config: SplitConfig, doc: SplitDocument) -> tuple[str, str]:
    role = _named_role(config, doc.doc_id)
    if role is not None:
        if role != "burned" and on_test_side(config, doc):
            raise SplitError(
                f"the split config names {doc.doc_id!r} as {role}, but it is a test document "
                f"(index {doc.index} of parity source {doc.source!r}); the parity rule fixes "
                f"the test split, so a test document can only be burned: pick a dev-side (odd "
                f"index) document as {role}, or burn this one"
            )
        target = {"calibration": "calibration", "canary": "canary", "burned": "excluded"}
        return target[role], role
    pool = getattr(doc, "pool", "eval") or "eval"
    if pool == "calibration" and config.calibration.from_corpus_pool:
        return "calibration", "calibration-pool"
    if pool == "train":
        return "excluded", "train-pool"
    rule = config.sources.get(doc.source)
    if rule is None:
        raise SplitError(
            f"document {doc.doc_id!r} has source {doc.source!r}, which the split config does not "
            f"list (sources: {sorted(config.sources)}); add it or run `healsweep split make` again"
        )
    if rule.rule == "exclude":
        return "excluded", "source-excluded"
    return ("dev", "parity") if doc.index % 2 == 1 else ("test", "parity")


@dataclass(frozen=True)
class ResolvedSplit:
    """A split config applied to one corpus: every document's split and the lock id."""

    lock_id: str
    assignments: Mapping[str, str]  # doc_id -> split
    reasons: Mapping[str, str]  # doc_id -> why (parity, canary, burned, train-pool, ...)
    documents: tuple[Any, ...]

    def doc_ids(self, split: str) -> list[str]:
        """The doc ids assigned to ``split``, in corpus order."""
        return [d.doc_id for d in self.documents if self.assignments[d.doc_id] == split]

    def counts(self) -> dict[tuple[str, str], Counter]:
        """``{(source, stratum): Counter(split -> n)}``."""
        table: dict[tuple[str, str], Counter] = {}
        for doc in self.documents:
            table.setdefault((doc.source, doc.stratum), Counter())[
                self.assignments[doc.doc_id]
            ] += 1
        return table


def resolve_split(config: SplitConfig, documents: Iterable[SplitDocument] | Any) -> ResolvedSplit:
    """Apply ``config`` to a corpus (a ``Corpus`` or its documents) and compute the lock id.

    Raises :class:`SplitError` when the config names a doc id the corpus lacks, names one doc
    twice with different roles, or leaves the dev set empty.
    """
    docs = tuple(getattr(documents, "documents", documents))
    check_named_ids(config, docs)
    _check_roles(config)
    assignments, reasons = {}, {}
    for doc in docs:
        assignments[doc.doc_id], reasons[doc.doc_id] = _assign_with_reason(config, doc)
    _check_test_text_stays_test(docs, assignments)
    if not any(v == "dev" for v in assignments.values()):
        raise SplitError(
            f"the split leaves the dev set empty ({len(docs)} documents, sources "
            f"{sorted(config.sources)}); sweeps tune on dev, so give it odd-index eval documents"
        )
    lock = _lock_id(docs, assignments, reasons)
    return ResolvedSplit(lock, assignments, reasons, docs)


def check_named_ids(config: SplitConfig, documents: Iterable[SplitDocument] | Any) -> None:
    """SplitError when ``config`` names doc ids (canary, exclusions, calibration) that the
    corpus does not contain: the config was made for another corpus."""
    present = {d.doc_id for d in getattr(documents, "documents", documents)}
    missing = sorted(config.named_doc_ids() - present)
    if missing:
        raise SplitError(
            f"the split config names doc ids the corpus does not contain: "
            f"{quoted(missing[:5])}{' ...' if len(missing) > 5 else ''}; remove them or use the "
            "matching corpus"
        )


def split_lock_id(config: SplitConfig, documents: Iterable[SplitDocument] | Any) -> str:
    """The split lock id of ``config`` applied to a corpus (see the module docstring)."""
    return resolve_split(config, documents).lock_id


def _lock_id(docs: tuple, assignments: Mapping[str, str], reasons: Mapping[str, str]) -> str:
    rows = sorted(
        (
            d.doc_id,
            d.source,
            int(d.index),
            d.stratum,
            d.content_hash,
            assignments[d.doc_id],
            reasons[d.doc_id],
        )
        for d in docs
    )
    payload = json.dumps([_LOCK_TAG, rows], separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _check_test_text_stays_test(docs: tuple, assignments: Mapping[str, str]) -> None:
    """SplitError when a test document's exact text is also a dev, canary or calibration
    document (scoring or tuning on it would open the test split by another name)."""
    test_text = {d.content_hash: d.doc_id for d in docs if assignments[d.doc_id] == "test"}
    for doc in docs:
        twin = test_text.get(doc.content_hash)
        split = assignments[doc.doc_id]
        if twin is not None and split in ("dev", "canary", "calibration"):
            raise SplitError(
                f"document {doc.doc_id!r} ({split}) has the same text as test document "
                f"{twin!r}; the test split's text cannot be scored or tuned on under another "
                f"id: remove the duplicate from the corpus or burn {doc.doc_id!r}"
            )


def _check_roles(config: SplitConfig) -> None:
    roles: dict[str, set[str]] = {}
    for doc_id in config.canary:
        roles.setdefault(doc_id, set()).add("canary")
    for doc_id, exclusion in config.exclusions.items():
        roles.setdefault(doc_id, set()).add(exclusion.reason)
    for doc_id in config.calibration.doc_ids:
        roles.setdefault(doc_id, set()).add("calibration")
    clashes = sorted(doc_id for doc_id, r in roles.items() if len(r) > 1)
    if clashes:
        raise SplitError(
            f"doc id {clashes[0]!r} is given two roles ({sorted(roles[clashes[0]])}) in the split "
            "config; keep one of canary / calibration / burned per document"
        )


def require_access(split: str, grant: Any, lock_id: str) -> None:
    """Check that windows of ``split`` may be materialized.

    ``dev`` and ``canary`` are always open; ``test`` needs a ledger grant for ``lock_id``
    (raises ``TestSplitSealed`` otherwise); ``calibration`` and ``excluded`` are not eval splits
    and raise :class:`SplitError`.
    """
    if split == "test":

        require_grant(grant, lock_id)
        return
    if split not in ("dev", "canary"):
        raise SplitError(
            f"{split!r} is not an eval split; windows come from one of {list(EVAL_SPLITS)}"
        )


def parity_split(
    documents: Iterable[SplitDocument] | Any, corpus: str | None = None
) -> SplitConfig:
    """The default split of a corpus: every source under the parity rule, calibration from the
    corpus's ``pool: calibration`` documents, no named exclusions (what ``split: auto`` means)."""
    docs = getattr(documents, "documents", documents)
    sources = sorted({d.source for d in docs})
    return SplitConfig(corpus=corpus, sources={s: SourceRule() for s in sources})


def corpus_reference(config: SplitConfig, split_path: str | Path) -> str | None:
    """The corpus a split file was made for: ``demo``, or its path resolved against the file's
    folder (``split make`` stores it relative to the split file)."""
    if config.corpus is None or config.corpus == "demo":
        return config.corpus
    ref = Path(config.corpus)
    return str(ref if ref.is_absolute() else Path(split_path).parent / ref)


def load_split(path: str | Path) -> SplitConfig:
    """Read and validate a split YAML; every problem is a one-line :class:`SplitError`."""
    path = Path(path)
    try:
        raw = load_yaml(path, "split config", error=SplitError).value
    except OSError as exc:
        raise SplitError(
            f"cannot read split config {path}: {exc.strerror}; check the path"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "malformed YAML"
        raise SplitError(f"{path}{where}: {problem}; fix the YAML syntax") from exc
    if not isinstance(raw, dict):
        raise SplitError(f"{path}: a split config is a YAML mapping; got {type(raw).__name__}")
    return split_from_dict(raw, where=str(path))


def split_from_dict(raw: Mapping[str, Any], where: str = "split config") -> SplitConfig:
    """Validate a split config given as a mapping (the parsed YAML)."""
    try:
        return SplitConfig.model_validate(dict(raw))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            msg = f"unknown field {loc!r}"
        else:
            msg = f"field {loc!r}: {err['msg']}"
        allowed = "version, corpus, sources, exclusions, calibration, canary"
        raise SplitError(f"{where}: {msg}; allowed top-level fields are {allowed}") from exc


def dump_split(config: SplitConfig, lock_id: str | None = None) -> str:
    """The YAML text of a split config (with the lock id as a comment when given)."""
    body = config.model_dump(mode="json", exclude_defaults=False)
    body["sources"] = {name: rule["rule"] for name, rule in body["sources"].items()}
    body["canary"] = list(body["canary"])
    body["calibration"]["doc_ids"] = list(body["calibration"]["doc_ids"])
    header = "# healsweep split config: odd index -> dev, even -> test, per source.\n"
    if lock_id:
        header += f"# split lock id when written: {lock_id}\n"
    return header + yaml.safe_dump(body, sort_keys=False, allow_unicode=True)
