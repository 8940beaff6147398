"""Stage ``calib_trace``: the teacher's forward over the calibration pool, captured layer by layer.

Calibration documents are the corpus's ``pool: calibration`` documents (minus any excluded ids),
tokenized whole and cut into consecutive chunks of at most ``chunk_length`` tokens; every chunk
is traced, so any number of tokens is used and nothing is dropped unless ``max_tokens`` asks for
it (then the cut is recorded in the report; the default budget, ``night``, is sized from the model's
shape: :func:`healsweep.heal.knobs.night_tokens`). Per layer the trace keeps the FFN input X [T, D]
(float16, see ``X_DTYPE``), the routing, the routed output y_ref, the shared expert's gate [T], and the sums behind
``act`` importance (E[x²] and E[h²] per expert): its size does not grow with the shared expert's
width (Part B recomputes that expert's down input from X, :mod:`healsweep.heal.ridge`). The report counts tokens per stratum (with the
tokens inside tool calls and tool turns) and the tokens each expert received per layer, so a
calibration that starves a stratum or an expert is visible.

Storage: one small summary entry (report + per-layer expert counts) keyed by the model
fingerprint, the calibration settings and the content of the calibration documents; each layer's
arrays are their own entry keyed by (summary key, layer), so later stages load one layer at a time.
The trace runs layer-major (every calibration token through layer l before layer l + 1 is
read), and each layer's entry is written as soon as that layer is done.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from healsweep._code import code_digest
from healsweep.cache import StageCache, content_key
from healsweep.data.chat_template import ChatFormat, model_chat_format, render_document
from healsweep.data.corpus import load_corpus
from healsweep.errors import CacheError, CorpusError
from healsweep.heal.knobs import CalibrationConfig
from healsweep.heal.stages import expert_weights
from healsweep.model.forward import capture_layers
from healsweep.quant.expert_moments import expert_hidden_moments, expert_input_moments
from healsweep.stage_names import VERSIONS, Stage

if TYPE_CHECKING:
    from healsweep.data.corpus import Corpus, Document
    from healsweep.gguf_io import GGUFModel

STAGE = Stage.CALIB_TRACE
LAYER_STAGE = Stage.CALIB_TRACE_LAYER
VERSION = VERSIONS[STAGE]  # entry format; code changes are in the key's code digest
BATCH_TOKENS = 4096  # padded tokens per teacher forward call
LENGTH_BUCKET = 64  # smallest padded chunk length; buckets double from here
# The trace is computed by functions of this module: the closure of its imports is its code.
CODE_ROOTS = ("healsweep.heal.trace",)
FIELDS = ("x", "ids", "weights", "y_ref", "gate")  # per token, as captured
_CAPTURED = ("ffn_input", "topk_ids", "topk_weights", "routed_output", "shexp_gate")  # their fields
# The stored FFN input: float16 moved alpha by 2.6e-6 (relative), dW by <= 1.9e-4 and the ridge's
# in-sample and held-out changes by <= 6e-7 (absolute) on the demo's four layers (35k tokens).
X_DTYPE = np.float16
_TOOL_SPAN = re.compile(r"<tool_call>.*?</tool_call>", re.S)


@dataclass(frozen=True)
class CalibrationChunk:
    """One traced sequence: a piece of one document."""

    doc_id: str
    stratum: str
    tokens: np.ndarray  # [n] int32
    tool_tokens: int  # how many of them sit inside tool calls / tool turns


def calibration_documents(corpus: Corpus, calibration: CalibrationConfig) -> list[Document]:
    """The calibration pool in corpus order, minus ``exclude_doc_ids``; CorpusError if empty."""
    excluded = set(calibration.exclude_doc_ids)
    docs = [d for d in corpus.pool("calibration") if d.doc_id not in excluded]
    if not docs:
        where = getattr(corpus, "path", None) or calibration.corpus
        raise CorpusError(
            f"corpus {where} has no calibration documents left (pool: calibration, "
            f'{len(excluded)} excluded); add documents with "pool": "calibration"'
        )
    return docs


def documents_digest(docs: list[Document]) -> str:
    """sha256 over (doc_id, content hash) of the documents, in order."""
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(f"{doc.doc_id}\0{doc.content_hash}\n".encode())
    return digest.hexdigest()


def budgeted(model: GGUFModel, calibration: CalibrationConfig) -> CalibrationConfig:
    """``calibration`` with ``max_tokens: night`` resolved to this model's tokens
    (:meth:`CalibrationConfig.for_model`): what the trace, its key and its report use."""
    hp = model.hparams
    return calibration.for_model(hp.n_embd, hp.n_expert_used, hp.n_expert, hp.n_ff_exp)


def trace_key(model: GGUFModel, calibration: CalibrationConfig, docs: list[Document]) -> str:
    """Content key of the trace: model fingerprint, calibration settings (the budget resolved:
    :func:`budgeted`), document contents."""
    calibration = budgeted(model, calibration)
    return content_key(
        STAGE,
        VERSION,
        {
            "code": code_digest(CODE_ROOTS),
            "model": model.fingerprint,
            "calibration": calibration.key_inputs(),
            "documents": documents_digest(docs),
        },
    )


def layer_key(trace: str, layer: int) -> str:
    """Content key of one layer's arrays of trace ``trace``."""
    return content_key(LAYER_STAGE, VERSION, {"trace": trace, "layer": layer})


def _tool_char_spans(doc: Any, text: str, chat: ChatFormat | None) -> list[tuple[int, int]]:
    spans = [m.span() for m in _TOOL_SPAN.finditer(text)]
    if doc.messages is not None and chat is not None and not chat.is_chatml:
        rendered = chat.render_chat(doc.messages, what=f"document {doc.doc_id!r}")
        tool_turns = {i for i, m in enumerate(doc.messages) if m.role == "tool"}
        spans += [(s.start, s.end) for s in rendered.spans if s.message in tool_turns]
    elif doc.messages is not None:
        cursor = 0
        for message in doc.messages:
            header = f"<|im_start|>{message.role}\n"
            start = text.find(header + message.content, cursor)
            if start < 0:
                continue
            body = start + len(header)
            if message.role == "tool":
                spans.append((body, body + len(message.content)))
            cursor = body + len(message.content)
    return spans


def make_chunks(
    docs: list[Any], tokenizer: Any, calibration: CalibrationConfig, chat: ChatFormat | None = None
) -> tuple[list[CalibrationChunk], dict[str, Any]]:
    """Tokenize and chunk the documents, rendered in the model's ``chat`` format (None = ChatML);
    returns the chunks, in the documents' order, and what was used or cut. Under a budget the
    documents are taken by :func:`budget_takes`. A ``night`` budget must have been resolved for
    the model first (:func:`budgeted`)."""
    budget = calibration.max_tokens
    if isinstance(budget, str):
        raise ValueError(f"make_chunks: resolve max_tokens {budget!r} for the model (budgeted)")
    encoded = [_encode(doc, tokenizer, chat) for doc in docs]
    takes = budget_takes([d.stratum for d in docs], [len(ids) for ids, _ in encoded], budget)
    chunks: list[CalibrationChunk] = []
    split_docs = 0
    cut_doc = None
    for doc, (ids, in_tool), take in zip(docs, encoded, takes, strict=True):
        if 0 < take < len(ids):
            cut_doc = {"doc_id": doc.doc_id, "kept": take, "of": len(ids)}
        if take > calibration.chunk_length:
            split_docs += 1
        for a in range(0, take, calibration.chunk_length):
            b = min(a + calibration.chunk_length, take)
            chunks.append(
                CalibrationChunk(doc.doc_id, doc.stratum, ids[a:b], int(in_tool[a:b].sum()))
            )
    info = {
        "tokens_used": sum(takes),
        "tokens_available": sum(len(ids) for ids, _ in encoded),
        "documents": len(docs),
        "documents_split_into_chunks": split_docs,
        "document_cut_by_max_tokens": cut_doc,
    }
    return chunks, info


def _encode(doc: Any, tokenizer: Any, chat: ChatFormat | None) -> tuple[np.ndarray, np.ndarray]:
    """A document's token ids and which of them sit inside tool calls or tool turns."""
    text = render_document(doc, chat)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray(encoding.ids, np.int32)
    starts = np.asarray([a for a, _ in encoding.offsets], np.int64)
    in_tool = np.zeros(len(ids), bool)
    for a, b in _tool_char_spans(doc, text, chat):
        in_tool |= (starts >= a) & (starts < b)
    return ids, in_tool


def budget_takes(strata: list[str], lengths: list[int], budget: int | None) -> list[int]:
    """Tokens taken of each document (in the pool's order) under ``budget`` (None: all).

    Documents are taken whole, one stratum after the other in turn (strata in the order they
    first appear, each stratum's documents in the pool's order), until the budget is reached; the
    document that reaches it is cut to fit. So a budget smaller than the pool calibrates on every
    stratum (the demo pool lists its strata one after the other: taking documents in the pool's
    order, 17.6% of it was code alone, +54.9% pooled dev KLD for budget-2.06 on demo-medium-cpu
    against the whole pool; docs/sizing.md), the same documents every time, and a smaller
    budget's documents are among a larger one's."""
    takes = [0] * len(lengths)
    if budget is None or budget >= sum(lengths):
        return list(lengths)
    queues: dict[str, list[int]] = {}
    for i, stratum in enumerate(strata):
        queues.setdefault(stratum, []).append(i)
    left = budget
    turn = [q[::-1] for q in queues.values()]  # each stratum's documents, next one last
    while left > 0 and any(turn):
        for queue in turn:
            if queue and left > 0:
                i = queue.pop()
                takes[i] = min(lengths[i], left)
                left -= takes[i]
    return takes


def _bucket(length: int) -> int:
    """Padded length of a chunk: 64 * 2^k, the smallest that holds it (few distinct shapes)."""
    padded = LENGTH_BUCKET
    while padded < length:
        padded *= 2
    return padded


def _batches(
    chunks: list[CalibrationChunk], budget: int = BATCH_TOKENS, uniform: bool = False
) -> list[tuple[int, list[int]]]:
    """``(padded length P, chunk indices)`` per batch, grouped by padded length.

    A bucket of padded length P is cut into batches of ``budget // P - 1`` chunks; :func:`run_trace`
    adds filler sequences (one of exactly P tokens) so every batch of a bucket has the same
    [B, P] shape and the jitted forward compiles once per bucket instead of once per batch.
    ``uniform`` puts every chunk in the longest chunk's bucket: one shape, one compile, at the
    price of padded rows — what an accelerator wants, where compiling a real-size layer takes
    seconds and padded rows cost next to nothing (on a CPU the padding costs more).
    """
    buckets: dict[int, list[int]] = {}
    longest = _bucket(max((len(c.tokens) for c in chunks), default=1))
    for i, chunk in enumerate(chunks):
        buckets.setdefault(longest if uniform else _bucket(len(chunk.tokens)), []).append(i)
    batches = []
    for padded, members in sorted(buckets.items()):
        size = max(1, budget // padded - 1)
        batches += [(padded, members[a : a + size]) for a in range(0, len(members), size)]
    return batches


def _batch_sequences(
    chunks: list[CalibrationChunk], padded: int, batch: list[int], batch_tokens: int
) -> list[np.ndarray]:
    """A batch's sequences: its chunks, then fillers that give every batch of a bucket the
    same [B, P] shape (one of exactly P tokens, the rest of one token)."""
    filler = np.resize(chunks[batch[0]].tokens, padded)  # sets the batch's length to P
    fillers = max(1, batch_tokens // padded - len(batch))
    return [chunks[i].tokens for i in batch] + [filler] + [filler[:1]] * (fillers - 1)


def _layer_arrays(
    captures: list[Any], rows: list[int], order: np.ndarray, no_shexp: bool
) -> dict[str, np.ndarray]:
    """One layer's captured fields over every batch (their real chunks' rows, ``rows[n]`` of
    batch n), put back in chunk order (``order``: the captured row of each row in that order)."""
    arrays = {}
    for name, field in zip(FIELDS, _CAPTURED, strict=True):
        pieces = [getattr(cap, field)[:n] if getattr(cap, field).size else getattr(cap, field)
                  for cap, n in zip(captures, rows, strict=True)]  # fmt: skip
        if not pieces[0].size:
            arrays[name] = pieces[0]
            continue
        stacked = np.concatenate(pieces)
        arrays[name] = stacked[order].astype(np.int32 if name == "ids" else stacked.dtype)
    if no_shexp:
        arrays["gate"] = np.zeros((0,), np.float32)
    return arrays


def run_trace(
    model: GGUFModel,
    chunks: list[CalibrationChunk],
    sink: Callable[[int, dict], None],
    batch_tokens: int = BATCH_TOKENS,
    uniform: bool | None = None,
    replacements: Mapping[int, Any] | None = None,
) -> np.ndarray:
    """Teacher forward with captures over every chunk, layer-major; hands each layer's arrays
    to ``sink(layer, arrays)``, layers in order.

    Every batch of chunks advances through layer l before layer l + 1 is read
    (:func:`~healsweep.model.forward.capture_layers`): what is held is the hidden states of every
    calibration token, one layer's weights and one layer's captures (two where a layer's
    importance sums run on a thread beside the next layer's forward, on an accelerator), never
    a whole model's captures. Arrays are in chunk order (document order), whatever order the
    batches ran in. ``uniform`` (default: on accelerators) runs every batch in one shape (see
    :func:`_batches`). Returns the tokens each expert received, [L_moe, E] (the layers of
    ``hp.moe_layers``; leading dense layers have no experts and no trace). ``replacements``:
    the forward's, for a student's trace (:mod:`healsweep.heal.student_trace`).
    """
    hp = model.hparams
    if uniform is None:
        uniform = jax.default_backend() != "cpu"
    batches = _batches(chunks, batch_tokens, uniform)
    sequences = [_batch_sequences(chunks, p, batch, batch_tokens) for p, batch in batches]
    rows = [int(sum(len(chunks[i].tokens) for i in batch)) for _, batch in batches]
    ran = [i for _, batch in batches for i in batch]  # chunk index of each captured chunk
    starts = np.cumsum([0] + [len(chunks[i].tokens) for i in ran])
    where = {chunk: j for j, chunk in enumerate(ran)}
    order = np.concatenate(
        [np.arange(starts[where[c]], starts[where[c] + 1]) for c in range(len(chunks))]
    )
    grid = np.arange(hp.n_expert, dtype=np.int32)

    def finish(layer: int, arrays: dict[str, np.ndarray]) -> np.ndarray:
        x_sq, layer_counts = expert_input_moments(arrays["x"], arrays["ids"], grid)
        weights = expert_weights(model, layer, ("gate", "up"))  # decoded on the device
        h_sq, _ = expert_hidden_moments(
            arrays["x"], arrays["ids"], weights["ffn_gate_exps.weight"],
            weights["ffn_up_exps.weight"],
        )  # fmt: skip
        del weights
        arrays.update(x_sq_sums=np.asarray(x_sq), h_sq_sums=h_sq, counts=np.asarray(layer_counts))
        arrays["x"] = arrays["x"].astype(X_DTYPE)  # after the importance sums, which read f32
        sink(layer, arrays)
        return np.asarray(layer_counts)

    # On an accelerator a layer's host work (importance sums, the cache write) runs beside the
    # next layer's forward; on the CPU both would share the same cores, so it runs in turn.
    beside = 1 if jax.default_backend() != "cpu" else 0
    counts: list[Future] = []
    with ThreadPoolExecutor(1, thread_name_prefix="trace-layer") as pool:
        for layer, captures in capture_layers(model, sequences, replacements=replacements):
            arrays = _layer_arrays(captures, rows, order, hp.n_ff_shexp == 0)
            del captures
            counts.append(pool.submit(finish, layer, arrays))
            del arrays
            for done in counts[: len(counts) - beside]:
                done.result()  # at most ``beside`` layers' arrays held beside this one's
    return np.stack([c.result() for c in counts]).astype(np.int64)


def _report(
    chunks: list[CalibrationChunk], info: dict, counts: np.ndarray, calibration: CalibrationConfig
) -> dict[str, Any]:
    per_stratum: Counter[str] = Counter()
    tool_per_stratum: Counter[str] = Counter()
    for chunk in chunks:
        per_stratum[chunk.stratum] += len(chunk.tokens)
        tool_per_stratum[chunk.stratum] += chunk.tool_tokens
    starved = (counts < calibration.min_tokens_per_expert).sum(axis=1)
    return {
        **info,
        "chunks": len(chunks),
        "chunk_length": calibration.chunk_length,
        "tokens_per_stratum": dict(sorted(per_stratum.items())),
        "tool_call_tokens_per_stratum": dict(sorted(tool_per_stratum.items())),
        "tool_call_tokens": int(sum(tool_per_stratum.values())),
        "tokens_per_expert_min": [int(c.min()) for c in counts],
        "tokens_per_expert_max": [int(c.max()) for c in counts],
        "experts_below_min_tokens": [int(s) for s in starved],
        "chunk_doc_ids": [c.doc_id for c in chunks],
        "chunk_lengths": [len(c.tokens) for c in chunks],
    }


def report_lines(report: dict[str, Any]) -> list[str]:
    """The trace report in a few lines: tokens used, per stratum, tool calls, per expert."""
    strata = ", ".join(f"{k} {v}" for k, v in report["tokens_per_stratum"].items())
    lines = [
        f"{report['tokens_used']} calibration tokens from {report['documents']} documents in "
        f"{report['chunks']} chunks of <= {report['chunk_length']}",
        f"tokens per stratum: {strata}; inside tool calls and tool turns: "
        f"{report['tool_call_tokens']}",
        f"fewest tokens an expert received, per layer: {report['tokens_per_expert_min']}; "
        f"experts below the act minimum, per layer: {report['experts_below_min_tokens']}",
    ]
    cut = report.get("document_cut_by_max_tokens")
    if cut:
        lines.append(
            f"max_tokens cut {cut['doc_id']} to {cut['kept']} of {cut['of']} tokens; "
            f"{report['tokens_available']} tokens were available"
        )
    return lines


@dataclass(frozen=True)
class Trace:
    """A cached calibration trace: its key, report and per-layer loader. A student's trace
    (:mod:`healsweep.heal.student_trace`) stores its layers under its own ``layer_stage`` and
    hands Part B the student's shared-expert gate and up (``shexp(i)``, where retyped) with
    each layer, as ``shexp_weights``."""

    key: str
    report: dict[str, Any]
    tokens_per_expert: np.ndarray  # [L, E]
    cache: StageCache
    recompute: Callable[[], None]
    layer_stage: str = LAYER_STAGE
    shexp: Callable[[int], Any] | None = None

    def layer(self, i: int) -> dict[str, np.ndarray]:
        """Layer i's arrays (x, ids, weights, y_ref, gate, x_sq_sums, h_sq_sums, counts).

        A layer entry that was deleted or failed its checksum is rebuilt by re-running the trace.
        """
        found = self.cache.get(self.layer_stage, layer_key(self.key, i))
        if found is None:
            self.recompute()
            found = self.cache.get(self.layer_stage, layer_key(self.key, i))
        if found is None:
            raise CacheError(
                f"calibration trace layer {i} could not be stored under "
                f"{self.cache.root}; check that the cache directory is writable"
            )
        student = None if self.shexp is None else self.shexp(i)
        return found[0] if student is None else {**found[0], "shexp_weights": student}


def calibration_trace(
    model: GGUFModel,
    calibration: CalibrationConfig,
    cache: StageCache,
    corpus: Corpus | None = None,
) -> Trace:
    """The cached teacher trace over the calibration pool (computed once per key); documents
    are rendered in the model's chat format, which the model fingerprint in the key covers."""

    corpus = corpus if corpus is not None else load_corpus(calibration.corpus)
    calibration = budgeted(model, calibration)
    docs = calibration_documents(corpus, calibration)
    key = trace_key(model, calibration, docs)
    for i in model.hparams.moe_layers:  # read later, one by one: held from now (a bounded
        cache.hold(LAYER_STAGE, layer_key(key, i))  # cache must not evict layer 5 meanwhile)

    def compute() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        start = time.perf_counter()
        chunks, info = make_chunks(docs, model.tokenizer(), calibration, model_chat_format(model))

        def store(i: int, arrays: dict[str, np.ndarray]) -> None:
            # A layer lost costs the whole trace again (Trace.layer): at least the forward
            # over every layer, which has run by now; the eviction weighs that.
            seconds = time.perf_counter() - start
            cache.put(LAYER_STAGE, layer_key(key, i), arrays, seconds=seconds)

        counts = run_trace(model, chunks, store)  # [L, E]
        return {"tokens_per_expert": counts}, _report(chunks, info, counts, calibration)

    def recompute() -> None:
        arrays, meta = compute()
        cache.put(STAGE, key, arrays, meta)
        cache.computed[STAGE] += 1

    arrays, meta = cache.get_or_compute(STAGE, key, compute)
    return Trace(key, meta, arrays["tokens_per_expert"], cache, recompute)
