"""Build the demo corpus and the demo tokenizer from text that ships with Python.

Order of work (all deterministic for a seed, no network):

1. Collect standard-library facts (:mod:`healsweep.demo.stdlib_facts`) and partition the
   partition units (module families, pydoc topics) into three disjoint parts: eval,
   calibration, train. Every document is written only from its own part's objects.
2. Write the eval pool (sources ``py-code``, ``py-docs``, ``py-json``, ``py-tool``; wording family
   A), the training pool (``train-*``; families A and B) and the calibration candidates
   (``cal-*``; family B only, so no template sentence is shared with eval documents).
3. Train the byte-level BPE tokenizer on the rendered training pool.
4. Drop any calibration candidate that shares a 16-gram of tokens with an eval document (a
   belt-and-braces check; by construction this should drop few or none), then number each
   source's documents 0..n-1.

The standard library's text differs slightly between Python versions, so the shipped JSONL is
the artifact: :data:`BUILT_WITH` records the interpreter that built it, and building twice in
one interpreter gives byte-identical output.
"""

from __future__ import annotations

import platform
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from healsweep.data.corpus import Document, Message, write_corpus
from healsweep.demo import corpus_documents as writers
from healsweep.demo.stdlib_facts import (
    MODULE_GROUPS,
    StdlibObject,
    Topic,
    collect_objects,
    collect_topics,
    partition,
)
from healsweep.demo.tokenizer import DEFAULT_VOCAB_SIZE, save_tokenizer, train_tokenizer
from healsweep.errors import CorpusError

BUILT_WITH = "CPython 3.11.7"  # the interpreter that built the shipped assets
STRATA: tuple[str, ...] = ("code", "docs", "json", "tool")
MIN_CHARS = 1100  # documents shorter than this get another turn (about 300 tokens)
SOURCE_PREFIX = {"eval": "py", "calibration": "cal", "train": "train"}


@dataclass(frozen=True)
class DemoCorpusConfig:
    """Sizes of the demo corpus; the defaults build the shipped one."""

    seed: int = 0
    eval_per_stratum: int = 64
    calibration_per_stratum: int = 20
    train_chars: int = 2_400_000
    vocab_size: int = DEFAULT_VOCAB_SIZE
    eval_objects: int = 480  # objects dealt to the eval part before calibration gets any
    calibration_objects: int = 200
    eval_topics: int = 24
    calibration_topics: int = 8
    max_topics: int | None = None  # None = every pydoc topic
    groups: tuple[tuple[str, tuple[str, ...]], ...] = MODULE_GROUPS
    ngram: int = 16
    min_calibration_tokens: int = 8000


@dataclass
class DemoCorpusBuild:
    """The built documents, the tokenizer trained on the training pool, and a report."""

    documents: list[Document]
    tokenizer: Tokenizer
    report: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Draft:
    stratum: str
    messages: list[Message]
    meta: dict[str, Any]


def build_demo_corpus(config: DemoCorpusConfig | None = None) -> DemoCorpusBuild:
    """Build the demo corpus and tokenizer (see the module docstring for the steps)."""
    config = config or DemoCorpusConfig()
    started = time.perf_counter()
    objects = collect_objects(config.groups)
    topics = collect_topics()[: config.max_topics]
    weights = Counter(obj.unit for obj in objects)
    obj_parts = partition(
        sorted(weights), [config.eval_objects, config.calibration_objects], weights, config.seed
    )
    topic_weights = Counter(t.unit for t in topics)
    topic_parts = partition(
        sorted(topic_weights),
        [config.eval_topics, config.calibration_topics],
        topic_weights,
        config.seed,
    )
    pools = ("eval", "calibration", "train")
    part_objects = {p: [o for o in objects if o.unit in obj_parts[i]] for i, p in enumerate(pools)}
    part_topics = {p: [t for t in topics if t.unit in topic_parts[i]] for i, p in enumerate(pools)}

    eval_drafts = _distinct_pool(
        "eval", part_objects["eval"], part_topics["eval"], config.eval_per_stratum, config.seed
    )
    cal_drafts = _distinct_pool(
        "calibration",
        part_objects["calibration"],
        part_topics["calibration"],
        config.calibration_per_stratum,
        config.seed,
    )
    train_drafts = _train_pool(
        part_objects["train"], part_topics["train"], config.train_chars, config.seed
    )
    train_docs = _number("train", train_drafts)
    tokenizer = train_tokenizer((doc.render() for doc in train_docs), config.vocab_size)
    eval_docs = _number("eval", eval_drafts)
    eval_grams = _ngrams((doc.render() for doc in eval_docs), tokenizer, config.ngram)
    kept = [
        d
        for d in cal_drafts
        if not _shares_ngram(writers_render(d), tokenizer, config.ngram, eval_grams)
    ]
    cal_docs = _number("calibration", kept)
    documents = eval_docs + cal_docs + train_docs
    report = _report(
        documents, tokenizer, len(cal_drafts) - len(kept), time.perf_counter() - started, config
    )
    if report["tokens"]["calibration"] < config.min_calibration_tokens:
        raise CorpusError(
            f"demo calibration pool holds {report['tokens']['calibration']} tokens, fewer than "
            f"{config.min_calibration_tokens}; raise calibration_per_stratum"
        )
    return DemoCorpusBuild(documents=documents, tokenizer=tokenizer, report=report)


def write_demo_assets(build: DemoCorpusBuild, corpus_path: Path, tokenizer_path: Path) -> None:
    """Write the corpus JSONL and the tokenizer.json of a build."""
    write_corpus(build.documents, corpus_path)
    save_tokenizer(build.tokenizer, tokenizer_path)


def writers_render(draft: _Draft) -> str:
    """The ChatML text of a draft document."""
    return Document("draft", "draft", 0, draft.stratum, messages=tuple(draft.messages)).render()


_ELIGIBLE: dict[str, Callable[[StdlibObject], bool]] = {
    "code": lambda o: o.source is not None,
    "docs": lambda o: len(o.doc) >= 120,
    "json": lambda o: o.signature is not None,
    "tool": lambda o: o.signature is not None,
}
_TURNS = {"code": (1, 1, 1, 2), "docs": (1, 1, 1, 2), "json": (1, 1, 2, 3), "tool": (1, 1, 2)}


def _members(objects: Iterable[StdlibObject], limit: int = 24) -> dict[str, list[str]]:
    by_module: dict[str, list[str]] = {}
    for obj in objects:
        if obj.kind != "method":
            by_module.setdefault(obj.module, []).append(obj.name)
    return {m: sorted(names)[:limit] for m, names in by_module.items()}


def _draft(
    stratum: str,
    objs: Sequence[StdlibObject],
    rng: random.Random,
    family: str,
    members: dict[str, list[str]],
) -> _Draft:
    if stratum == "code":
        messages = writers.code_document(objs, rng, family)
    elif stratum == "docs":
        messages = writers.docs_document(objs, rng, family)
    elif stratum == "json":
        messages = writers.json_document(objs, rng, family)
    else:
        messages = writers.tool_document(objs, rng, family, members)
    meta = {
        "units": sorted({o.unit for o in objs}),
        "objects": [o.qualname for o in objs],
        "wording": family,
    }
    return _Draft(stratum, messages, meta)


def _topic_draft(topic: Topic, part: int, rng: random.Random, family: str, turns: int) -> _Draft:
    messages = writers.topic_document(topic, part, rng, family, turns)
    meta = {"units": [topic.unit], "topic": topic.key, "part": part, "wording": family}
    return _Draft("docs", messages, meta)


def _grown_draft(
    stratum: str,
    candidates: Sequence[StdlibObject],
    wanted: int,
    seed_text: str,
    family: str,
    members: dict[str, list[str]],
) -> _Draft:
    """A draft about ``wanted`` candidates, more (up to 4) while it is shorter than MIN_CHARS."""
    count = min(wanted, len(candidates))
    while True:
        draft = _draft(stratum, candidates[:count], random.Random(seed_text), family, members)
        if len(writers_render(draft)) >= MIN_CHARS or count >= min(4, len(candidates)):
            return draft
        count += 1


def _grown_topic(topic: Topic, part: int, turns: int, seed_text: str, family: str) -> _Draft:
    available = len(writers.topic_chunks(topic)) - part
    turns = min(turns, available)
    while True:
        draft = _topic_draft(topic, part, random.Random(seed_text), family, turns)
        if len(writers_render(draft)) >= MIN_CHARS or turns >= min(3, available):
            return draft
        turns += 1


def _distinct_pool(
    pool: str, objects: list[StdlibObject], topics: list[Topic], per_stratum: int, seed: int
) -> list[_Draft]:
    """Eval or calibration drafts; every object and topic is used by one document only."""
    family = "A" if pool == "eval" else "B"
    queue = list(objects)
    random.Random(f"{seed}:{pool}:order").shuffle(queue)
    used: set[str] = set()
    members = _members(objects)
    topic_queue = list(topics)
    drafts: list[_Draft] = []
    for number in range(per_stratum):
        for stratum in STRATA:
            seed_text = f"{seed}:{pool}:{stratum}:{number}"
            rng = random.Random(seed_text)
            if stratum == "docs" and number % 3 == 2 and topic_queue:
                topic = topic_queue.pop(0)
                drafts.append(_grown_topic(topic, 0, rng.choice((1, 1, 2)), seed_text, family))
                continue
            free = [o for o in queue if o.qualname not in used and _ELIGIBLE[stratum](o)]
            if not free:
                raise CorpusError(f"demo {pool} part ran out of {stratum} objects; lower its size")
            draft = _grown_draft(
                stratum, free, rng.choice(_TURNS[stratum]), seed_text, family, members
            )
            used.update(draft.meta["objects"])
            drafts.append(draft)
    return drafts


def _train_pool(
    objects: list[StdlibObject], topics: list[Topic], budget: int, seed: int
) -> list[_Draft]:
    """Training drafts: each object may appear once per stratum; topics in chunks; up to budget."""
    members = _members(objects)
    queues = {}
    for stratum in STRATA:
        queue = [o for o in objects if _ELIGIBLE[stratum](o)]
        random.Random(f"{seed}:train:{stratum}:order").shuffle(queue)
        queues[stratum] = queue
    drafts: list[_Draft] = []
    for topic in topics:
        for part in range(0, len(writers.topic_chunks(topic)), 2):
            seed_text = f"{seed}:train:topic:{topic.key}:{part}"
            family = random.Random(seed_text).choice("AB")
            drafts.append(_topic_draft(topic, part, random.Random(seed_text), family, 2))
    size = sum(len(writers_render(d)) for d in drafts)
    number = 0
    while size < budget and any(queues.values()):
        for stratum in STRATA:
            if not queues[stratum]:
                continue
            seed_text = f"{seed}:train:{stratum}:{number}"
            rng = random.Random(seed_text)
            wanted, family = rng.choice(_TURNS[stratum]), rng.choice("AB")
            draft = _grown_draft(stratum, queues[stratum], wanted, seed_text, family, members)
            queues[stratum] = queues[stratum][len(draft.meta["objects"]) :]
            drafts.append(draft)
            size += len(writers_render(draft))
        number += 1
    return drafts


def _number(pool: str, drafts: Sequence[_Draft]) -> list[Document]:
    """Documents with per-source indexes 0..n-1, ordered by stratum then draft order."""
    documents = []
    for stratum in STRATA:
        source = f"{SOURCE_PREFIX[pool]}-{stratum}"
        mine = [d for d in drafts if d.stratum == stratum]
        for index, draft in enumerate(mine):
            documents.append(
                Document(
                    doc_id=f"{source}-{index:04d}",
                    source=source,
                    index=index,
                    stratum=stratum,
                    messages=tuple(draft.messages),
                    pool=pool,
                    meta=draft.meta,
                )
            )
    return documents


def ngrams(ids: Sequence[int], n: int) -> set[tuple[int, ...]]:
    """Every run of ``n`` consecutive token ids."""
    return {tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)}


def _ngrams(texts: Iterable[str], tokenizer: Tokenizer, n: int) -> set[tuple[int, ...]]:
    grams: set[tuple[int, ...]] = set()
    for encoding in tokenizer.encode_batch(list(texts)):
        grams |= ngrams(encoding.ids, n)
    return grams


def _shares_ngram(text: str, tokenizer: Tokenizer, n: int, grams: set[tuple[int, ...]]) -> bool:
    return not grams.isdisjoint(ngrams(tokenizer.encode(text).ids, n))


def _report(
    documents: Sequence[Document],
    tokenizer: Tokenizer,
    dropped: int,
    seconds: float,
    config: DemoCorpusConfig,
) -> dict[str, Any]:
    lengths = {doc.doc_id: len(tokenizer.encode(doc.render()).ids) for doc in documents}
    counts: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    for doc in documents:
        counts[f"{doc.pool}/{doc.stratum}"] += 1
        tokens[doc.pool] += lengths[doc.doc_id]
        if doc.pool == "eval":
            counts[f"eval/{'dev' if doc.index % 2 else 'test'}"] += 1
    eval_lengths = sorted(lengths[d.doc_id] for d in documents if d.pool == "eval")
    return {
        "seed": config.seed,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "documents": dict(sorted(counts.items())),
        "tokens": {p: tokens[p] for p in ("eval", "calibration", "train")},
        "train_chars": sum(len(d.render()) for d in documents if d.pool == "train"),
        "eval_doc_tokens": {
            "min": eval_lengths[0],
            "median": eval_lengths[len(eval_lengths) // 2],
            "max": eval_lengths[-1],
        }
        if eval_lengths
        else {},
        "calibration_dropped": dropped,
        "vocab_size": tokenizer.get_vocab_size(),
        "seconds": round(seconds, 1),
    }
