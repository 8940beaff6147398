"""The teacher-forced forward of a GGUF MoE model, layer by layer, with capture points.

Weights reach the device as their stored GGUF bytes (one layer at a time, plus the next one,
read ahead on a thread while the current one computes) and are decoded inside the jitted layer
function (``kernels.ggml_decode``): no float32 copy of a layer exists on the host, and a routed
expert's float32 copy exists on the device only while its tiles run. A tensor type without an
in-graph decoder is dequantized on the host instead, with one log notice per type (per runtime,
:mod:`healsweep.runtime`). Each layer runs as one jitted function of ``(weights, hidden)``;
sequences are right-padded to a multiple of 64 tokens so that a handful of shapes cover every
call and recompilation is rare. Causal attention makes the padding invisible to real tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from healsweep.gguf_io import HEAD, GGUFModel, ModelHparams, block_prefix
from healsweep.kernels.ggml_decode import IN_GRAPH_TYPES, GGMLWeight
from healsweep.model.expert_cache import CacheState, ExpertCacheInput, layer_routing
from healsweep.model.layers import expert_tile_rows, matmul, rms_norm, swiglu
from healsweep.model.registry import architecture
from healsweep.model.resident import resident_layers
from healsweep.runtime import current

PAD_MULTIPLE = 64
HEAD_ROWS = 256  # forward_each's rows per output-head call (a fixed shape, the last block padded)
_LOGIT_CHUNK_BYTES = 64 << 20  # float32 bytes of output-matrix rows decoded at a time
log = logging.getLogger(__name__)


class LayerCapture(NamedTuple):
    """What one layer's MoE block saw and produced, over the batch's real tokens (numpy)."""

    ffn_input: np.ndarray  # [T, D] normed input of router and experts
    router_logits: np.ndarray  # [T, E]
    topk_ids: np.ndarray  # [T, k] int32
    topk_weights: np.ndarray  # [T, k]
    routed_output: np.ndarray  # [T, D] weighted sum over routed experts, before the shared one
    shexp_gate: np.ndarray  # [T] the shared expert's per-token factor; (0,) without one


class LayerReplacement(NamedTuple):
    """Weights that replace a layer's routed experts / shared-expert down projection, and any
    other of its tensors by suffix (``tensors``: a requantized attention or shared expert).

    At key :data:`HEAD` of ``replacements`` a replacement's ``tensors`` hold the model's tensors
    outside the layers (``token_embd.weight``, ``output.weight``)."""

    gate_exps: Any = None  # [E, F, D] dense or quantized pytree; None keeps the model's
    up_exps: Any = None  # [E, F, D]
    down_exps: Any = None  # [E, D, F]
    down_shexp: Any = None  # [D, Fs] (models with a shared expert)
    tensors: Mapping[str, Any] | None = None  # suffix (or, at HEAD, name) -> weight




class ForwardResult(NamedTuple):
    """Logits per sequence, optional per-layer captures, and top-k expert ids per token; with an
    expert cache, its misses per token and layer and each layer's final cache states."""

    logits: list[Any]  # [T_b or len(logits_for[b]), V] float32: numpy (jax: pad_rows)
    captures: list[LayerCapture] | None  # one per MoE layer (``hp.moe_layers``)
    router: list[np.ndarray]  # per sequence: [T_b, L_moe, k] int32 top-k ids, MoE layers only
    cache_misses: list[np.ndarray] | None = None  # per sequence: [T_b, L_moe] int32
    cache_states: list[CacheState] | None = None  # per MoE layer: stamp [B, E], clock [B] (numpy)


_REPLACED = {
    "gate_exps": "ffn_gate_exps.weight",
    "up_exps": "ffn_up_exps.weight",
    "down_exps": "ffn_down_exps.weight",
    "down_shexp": "ffn_down_shexp.weight",
}


@partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _block(hp: ModelHparams, tile: int, capture: bool, dense: bool, w: dict[str, Any], h,
           positions, cache=None):  # fmt: skip
    """One transformer layer: ``h [B, T, D]`` → ``(h, capture dict over the B*T tokens)``;
    ``cache`` (a ``CacheRouting``) routes through the layer's expert cache.

    A ``dense`` layer (glm4moe's leading layers) has a SwiGLU FFN instead of experts and
    captures nothing."""
    arch = architecture(hp.arch)
    b, t, d = h.shape
    x = rms_norm(h, w["attn_norm.weight"], hp.rms_norm_eps)
    h = h + jax.vmap(lambda xs: arch.attention(hp, w, xs, positions))(x)
    x = rms_norm(h, w[arch.ffn_norm], hp.rms_norm_eps).reshape(b * t, d)  # [B*T, D]
    if dense:
        out = swiglu(x, w["ffn_gate.weight"], w["ffn_up.weight"], w["ffn_down.weight"])
        return h + out.reshape(b, t, d), {}
    out, cap = arch.moe_block(hp, w, x, tile, cache)
    h = h + out.reshape(b, t, d)
    if not capture:
        return h, {k: v for k, v in cap.items() if k == "topk_ids" or k.startswith("cache_")}
    return h, {**{k: v for k, v in cap.items() if k != "shexp_hidden"}, "ffn_input": x}


@partial(jax.jit, static_argnums=(0,))
def _final_norm_rows(eps: float, h, weight, rows):
    return rms_norm(h.reshape(-1, h.shape[-1])[rows], weight, eps)  # [N, D]


def _final_norm(eps: float, h, weight, rows) -> np.ndarray:
    """The final norm of the ``rows`` (flat token indices) of ``h``: ``[N, D]`` on the host.
    The rows are padded to a power of two, at least :data:`PAD_MULTIPLE` (repeating row
    0), and the padding dropped on the host, so a handful of shapes compile: a compile per distinct row
    count (and a device slice per count) kept every executable in memory, several MB a
    scored window over a test split (issue 47)."""
    rows = np.asarray(rows, np.int32)
    n = len(rows)
    padded = np.zeros(max(PAD_MULTIPLE, 1 << max(n - 1, 0).bit_length()), np.int32)
    padded[:n] = rows
    return np.asarray(_final_norm_rows(eps, h, weight, _on_device(padded)))[:n]


def _on_device(values: np.ndarray) -> jax.Array:
    """A host array on the device as it is. ``jnp.asarray`` compiles (and keeps) an identity
    per shape, 1-2 MiB each, and a forward's inputs take a shape per padded length (issue 47)."""
    return jax.device_put(values)


def device_weight(model: GGUFModel, name: str) -> Any:
    """A tensor on the device: a matrix as its stored bytes (:class:`GGMLWeight`), decoded in
    the graph; a vector, or a matrix of a type without an in-graph decoder, as float32."""
    qtype = model.tensor_type(name)
    if len(model.tensor_shape(name)) >= 2:
        if int(qtype) in IN_GRAPH_TYPES:
            return GGMLWeight(
                jax.device_put(model.raw_rows(name)), int(qtype), model.tensor_shape(name)[-1]
            )
        if current().first_time(("host-decoded type", qtype.name)):
            log.warning(
                "%s tensors have no in-graph decoder; they are dequantized on the host "
                "(slower, float32 in host memory)",
                qtype.name,
            )
    return jax.device_put(model.tensor(name))


@jax.jit
def _decoded(weight: GGMLWeight) -> jax.Array:
    return weight.dequantize()


def dense_on_device(model: GGUFModel, name: str) -> jax.Array:
    """A tensor as a float32 device array, decoded in the graph from its stored bytes where a
    decoder exists (the float32 copy is made on the device, not on the host)."""
    weight = device_weight(model, name)
    return weight if isinstance(weight, jax.Array) else _decoded(weight)


def _layer_weights(model: GGUFModel, i: int, replacement: LayerReplacement | None) -> dict:
    """Layer i's weights on the device (stored bytes; the host buffers are dropped right away).

    The model's own tensors come through :func:`~healsweep.model.resident.resident_layers`
    (kept on an accelerator between forwards, within its budget); replacements are sent as they
    are.
    """
    prefix = block_prefix(i)
    stat = model.path.stat()

    def load() -> dict[str, Any]:
        return {
            name[len(prefix) :]: device_weight(model, name)  # one tensor's bytes at a time
            for name in model.tensor_names
            if name.startswith(prefix)
        }

    weights = resident_layers().get((str(model.path), stat.st_size, stat.st_mtime_ns, i), load)
    if replacement is None:
        return weights
    named = [(suffix, suffix, new) for suffix, new in (replacement.tensors or {}).items()]
    named += [(f, suffix, getattr(replacement, f)) for f, suffix in _REPLACED.items()]
    for field, suffix, new in named:  # the named fields last: Part B's down_shexp wins
        if new is None:
            continue
        if suffix not in weights:
            raise ValueError(f"forward: layer {i} of a {model.arch} model has no {suffix}")
        if tuple(new.shape) != tuple(weights[suffix].shape):
            raise ValueError(
                f"forward: replacement {field} of layer {i} has shape {tuple(new.shape)}, "
                f"expected {tuple(weights[suffix].shape)}"
            )
        weights[suffix] = jax.device_put(new)
    return weights


def _pad_batch(
    sequences: Sequence[np.ndarray], n_vocab: int, bucket_within: int = 0
) -> tuple[np.ndarray, list[int]]:
    """``sequences`` right-padded with token 0 to a multiple of :data:`PAD_MULTIPLE`, or with
    ``bucket_within`` (a context length) to a power of two as long as that stays within it: a
    forward compiles once per padded length, several seconds of host cores each on a GPU
    (the H100 night's cold trial spent most of its 84 s of teacher record compiling one length
    per window's multiple of 64)."""
    lengths = [int(len(s)) for s in sequences]
    if not sequences or min(lengths) == 0:
        raise ValueError("forward: needs at least one sequence and no empty sequence")
    padded_len = -(-max(lengths) // PAD_MULTIPLE) * PAD_MULTIPLE
    bucket = max(PAD_MULTIPLE, 1 << (max(lengths) - 1).bit_length())
    if bucket <= bucket_within:
        padded_len = bucket
    tokens = np.zeros((len(sequences), padded_len), np.int32)
    for b, seq in enumerate(sequences):
        seq = np.asarray(seq)
        if seq.min() < 0 or seq.max() >= n_vocab:
            raise ValueError(f"forward: sequence {b} has token ids outside [0, {n_vocab})")
        tokens[b, : len(seq)] = seq
    return tokens, lengths


def _head(replacements: Mapping[int, LayerReplacement], name: str) -> Any:
    """The replacement of the model tensor ``name`` outside the layers, or None."""
    head = replacements.get(HEAD)
    return None if head is None or head.tensors is None else head.tensors.get(name)


def _embed(model: GGUFModel, tokens: np.ndarray, replaced: Any = None) -> np.ndarray:
    """The embedding rows of ``tokens`` [B, T] → [B, T, D] float32 (from ``replaced``, a
    ``GGMLWeight`` of the whole table, where the student requantized it)."""
    unique, inverse = np.unique(tokens, return_inverse=True)
    if replaced is None:
        rows = model.tensor_take("token_embd.weight", unique)  # [U, D]
    else:
        taken = GGMLWeight(np.asarray(replaced.raw)[unique], replaced.qtype, replaced.n_in)
        rows = np.asarray(_decoded(taken))
    return rows[inverse.reshape(tokens.shape)]  # [B, T, D]


@jax.jit
def _head_chunk(hidden, w):
    return matmul(hidden, w)  # [N, C]


def _logits(
    model: GGUFModel,
    hidden: jax.Array,
    row_block: int | None = None,
    replaced: Any = None,
    on_device: bool = False,
) -> np.ndarray | jax.Array:
    """``hidden [N, D] @ output.weightᵀ`` → ``[N, V]``, reading the vocab in chunks of rows
    sent as stored bytes and decoded in the graph. With ``row_block``, the rows go through the
    head in blocks of exactly that many (the last one padded), so that a row's logits do not
    depend on how many other rows came with it. ``replaced``: the student's requantized output
    matrix (a ``GGMLWeight``), read in the same chunks. ``on_device``: the chunks' products
    are joined on the device and a device array returned, its rows padded to whole
    ``row_block``s (the same values; a scorer that reduces them there copies no ``[N, V]`` to
    the host, and slicing the padding off would compile a slice per row count)."""
    name = "output.weight" if "output.weight" in model.tensor_names else "token_embd.weight"
    n_vocab, n_embd = model.tensor_shape(name)
    chunk = max(1, _LOGIT_CHUNK_BYTES // (4 * n_embd))
    qtype = int(model.tensor_type(name))
    n_rows = hidden.shape[0]
    blocks = [(0, n_rows)] if row_block is None else [
        (a, min(a + row_block, n_rows)) for a in range(0, n_rows, row_block)]  # fmt: skip
    if row_block is not None and n_rows % row_block:  # on the host: no pad or slice compiled
        hidden = np.pad(np.asarray(hidden), ((0, row_block - n_rows % row_block), (0, 0)))
    out = None if on_device else np.empty((n_rows, n_vocab), np.float32)
    pieces = []  # on_device: [N, C] per chunk of the vocabulary
    stat = model.path.stat()
    replaced_raw = None if replaced is None else np.asarray(replaced.raw)

    def load(start: int) -> dict[str, Any]:
        if qtype in IN_GRAPH_TYPES:  # [C, D] stored bytes
            raw = jax.device_put(model.raw_rows(name, start, start + chunk))
            return {"w": GGMLWeight(raw, qtype, n_embd)}
        return {"w": jax.device_put(model.tensor_rows(name, start, start + chunk))}

    for start in range(0, n_vocab, chunk):
        if replaced_raw is not None:
            piece = jax.device_put(replaced_raw[start : start + chunk])
            w = GGMLWeight(piece, replaced.qtype, n_embd)
        else:
            key = (str(model.path), stat.st_size, stat.st_mtime_ns, name, start, chunk)
            w = resident_layers().get(key, partial(load, start))["w"]
        products = []  # per block of rows: [rows of the block, C]
        for a, b in blocks:
            rows = hidden[a:b] if row_block is None else hidden[a : a + row_block]
            if out is None:
                products.append(_head_chunk(rows, w))
            else:
                out[a:b, start : start + w.shape[0]] = np.asarray(_head_chunk(rows, w))[: b - a]
        if products:
            pieces.append(products[0] if len(products) == 1 else jnp.concatenate(products))
    return jnp.concatenate(pieces, axis=1) if out is None else out


def _gather_capture(cap: dict[str, jax.Array], real: np.ndarray) -> LayerCapture:
    host = {k: np.asarray(v)[real] for k, v in cap.items() if k in LayerCapture._fields}
    empty = {"shexp_gate": np.zeros((0,), np.float32)}
    return LayerCapture(**{f: host.get(f, empty.get(f)) for f in LayerCapture._fields})


class _Batch(NamedTuple):
    """One batch in flight between layers: its hidden states and what places its tokens."""

    h: jax.Array  # [B, T, D]
    positions: jax.Array  # [T] int32
    tile: int  # expert tile rows (a static argument of the layer function)
    lengths: list[int]  # real tokens per sequence
    real: np.ndarray  # flat indices of the real tokens in [B*T]


def _embedded(
    model: GGUFModel, sequences: Sequence[np.ndarray], replacements: Mapping[int, Any]
) -> _Batch:
    """``sequences`` padded into one batch and embedded, before layer 0."""
    hp = model.hparams
    tokens, lengths = _pad_batch(sequences, hp.n_vocab)
    n_batch, padded_len = tokens.shape
    real = np.concatenate([b * padded_len + np.arange(n) for b, n in enumerate(lengths)])
    tile = expert_tile_rows(n_batch * padded_len * hp.n_expert_used, hp.n_expert)
    h = _on_device(_embed(model, tokens, _head(replacements, "token_embd.weight")))  # [B, T, D]
    positions = _on_device(np.arange(padded_len, dtype=np.int32))
    return _Batch(h, positions, tile, lengths, real)


def _layers(
    model: GGUFModel,
    replacements: Mapping[int, LayerReplacement],
    prefetch: bool | None,
    done: Callable[[], None],
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(i, layer i's device weights)`` for every layer, in order; what runs layer-major.

    With ``prefetch`` (default: on an accelerator) layer i + 1 is read on a thread while the
    caller computes layer i. Without (the CPU, where the read would compete with the layer's
    own threads for the same cores and keep two layers in memory), ``done()`` (the caller's
    results of layer i, ready) is awaited and layer i's buffers dropped before layer i + 1 is
    read."""
    n_layer = model.hparams.n_layer
    if prefetch is None:
        prefetch = jax.devices()[0].platform != "cpu"
    load = partial(_layer_weights, model)
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(load, 0, replacements.get(0))
        for i in range(n_layer):
            weights = pending.result()
            if prefetch and i + 1 < n_layer:
                pending = pool.submit(load, i + 1, replacements.get(i + 1))
            yield i, weights
            weights = None
            if not prefetch and i + 1 < n_layer:
                done()  # this layer's buffers go before the next one's arrive
                pending = pool.submit(load, i + 1, replacements.get(i + 1))


def _wanted_rows(batch: _Batch, logits_for: Sequence[np.ndarray] | None) -> list[np.ndarray]:
    """Per sequence, the positions whose logits are asked for (all of them when None)."""
    if logits_for is None:
        return [np.arange(n) for n in batch.lengths]
    wanted = [np.asarray(p, np.int64) for p in logits_for]
    for b, (pos, n) in enumerate(zip(wanted, batch.lengths, strict=True)):
        if pos.size and (pos.min() < 0 or pos.max() >= n):
            raise ValueError(f"forward: logits_for[{b}] has positions outside [0, {n})")
    return wanted


def forward(
    model: GGUFModel,
    sequences: Sequence[np.ndarray],
    *,
    replacements: Mapping[int, LayerReplacement] | None = None,
    capture: bool = False,
    logits_for: Sequence[np.ndarray] | None = None,
    prefetch: bool | None = None,
    expert_cache: ExpertCacheInput | None = None,
) -> ForwardResult:
    """Teacher-forced logits of ``sequences`` (int token ids), one layer at a time.

    ``replacements[i]`` swaps layer i's routed experts and/or shared-expert down weight (dense
    or quantized pytrees) — how a student runs; it is read layer by layer (a mapping that loads
    a layer when asked for, as a healed student's does, is read once per layer). ``capture``
    returns a :class:`LayerCapture` per MoE layer (leading dense layers route nothing and are
    left out, as in ``router``). ``logits_for[b]`` lists the positions of sequence b whose
    logits are wanted (all of them when None), so a ``[T, V]`` matrix is built only for the
    rows asked for.

    ``prefetch``: see :func:`_layers`. ``expert_cache`` routes every MoE layer through an LRU
    cache of routed experts with the MoCE bonus (:mod:`healsweep.model.expert_cache`), the
    sequences in order.
    """
    hp = model.hparams
    replacements = replacements if replacements is not None else {}
    batch = _embedded(model, sequences, replacements)
    n_batch, padded_len = batch.h.shape[:2]
    captures: list[LayerCapture] = []
    router: list[np.ndarray] = []
    misses: list[np.ndarray] = []
    states: list[CacheState] = []
    carried = [batch.h]  # the hidden states between layers ([B, T, D]), awaited by _layers
    for i, weights in _layers(
        model, replacements, prefetch, partial(jax.block_until_ready, carried)
    ):
        dense = i < hp.n_leading_dense
        routing = None
        if expert_cache is not None and not dense:
            # cache capacities and states are counted over MoE layers, as the states come back
            moe_index = i - hp.n_leading_dense
            routing = layer_routing(expert_cache, moe_index, hp.n_expert, batch.lengths,
                                    padded_len)  # fmt: skip
        h, cap = _block(hp, batch.tile, capture, dense, weights, carried[0], batch.positions,
                        routing)  # fmt: skip
        carried[0] = h
        if not dense:
            router.append(np.asarray(cap["topk_ids"])[batch.real])
            if expert_cache is not None:
                misses.append(np.asarray(cap["cache_misses"])[batch.real])
                states.append(CacheState(np.asarray(cap["cache_stamp"]),
                                         np.asarray(cap["cache_clock"])))  # fmt: skip
            if capture:
                captures.append(_gather_capture(cap, batch.real))
        weights = cap = None  # let go before the next layer is read
    result = _finished(model, batch, h, replacements, logits_for)
    return result._replace(
        captures=captures if capture else None,
        router=_per_sequence(router, batch.lengths),
        cache_misses=_per_sequence(misses, batch.lengths) if misses else None,
        cache_states=states or None,
    )


def _per_sequence(per_layer: list[np.ndarray], lengths: list[int]) -> list[np.ndarray]:
    """``L x [T_real, ...]`` over a batch's real tokens → per sequence ``[T_b, L, ...]``."""
    return list(np.split(np.stack(per_layer, axis=1), np.cumsum(lengths)[:-1]))


def _finished(
    model: GGUFModel,
    batch: _Batch,
    h: jax.Array,
    replacements: Mapping[int, LayerReplacement],
    logits_for: Sequence[np.ndarray] | None,
    pad_rows: Callable[[int], int] | None = None,
) -> ForwardResult:
    """A batch's logits after its last layer (final norm and output head of the rows asked
    for); with ``pad_rows``, device arrays of each sequence's ``n`` rows and zero rows up to
    ``pad_rows(n)``. The router fields are the caller's to fill."""
    hp = model.hparams
    padded_len = h.shape[1]
    wanted = _wanted_rows(batch, logits_for)
    rows = np.concatenate([b * padded_len + p for b, p in enumerate(wanted)]).astype(np.int32)
    hidden = _final_norm(hp.rms_norm_eps, h, jnp.asarray(model.tensor("output_norm.weight")), rows)
    head = _head(replacements, "output.weight")
    if head is None and "output.weight" not in model.tensor_names:  # tied: the embedding's
        head = _head(replacements, "token_embd.weight")
    # the head in fixed blocks of rows: one shape, where a batch's row count (its windows'
    # scored tokens) compiled and kept a head product per distinct count (issue 47)
    logits = _logits(model, hidden, row_block=HEAD_ROWS, replaced=head,
                     on_device=pad_rows is not None)  # fmt: skip
    cuts = np.cumsum([0, *(len(p) for p in wanted)])
    if pad_rows is None:
        per_sequence = [logits[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    else:
        per_sequence = [_padded_rows(logits, a, b - a, pad_rows(int(b - a)))
                        for a, b in zip(cuts[:-1], cuts[1:], strict=True)]  # fmt: skip
    return ForwardResult(logits=per_sequence, captures=None, router=[])


@partial(jax.jit, static_argnums=(3,))
def _padded_rows(logits, start, n, rows: int):
    """Rows ``start : start + n`` of ``logits [N, V]`` with zero rows after them up to
    ``rows``: one compile per (N, rows), not per window's offset and count (issue 47: every
    executable stays in memory)."""
    index = jnp.arange(rows)
    taken = logits[jnp.minimum(start + index, logits.shape[0] - 1)]  # [rows, V]
    return jnp.where((index < n)[:, None], taken, jnp.zeros((), logits.dtype))


def forward_batches(
    model: GGUFModel,
    batches: Sequence[Sequence[np.ndarray]],
    *,
    replacements: Mapping[int, LayerReplacement] | None = None,
    logits_for: Sequence[Sequence[np.ndarray]] | None = None,
    prefetch: bool | None = None,
    pad_rows: Callable[[int], int] | None = None,
) -> Iterator[ForwardResult]:
    """:func:`forward` of each of ``batches``, layer-major: every batch advances through layer
    i before layer i + 1 is read (each layer of ``replacements`` is read once, however many
    batches), then the final norm and output head run batch by batch, one
    :class:`ForwardResult` yielded at a time (only one batch's logits exist at once).

    What is carried between layers is each batch's hidden states ``[B, T, D]`` (float32). A
    batch runs exactly as in :func:`forward` (same shapes, same layer function): its logits and
    router ids are the same, bit for bit. ``logits_for[n]`` is ``forward``'s ``logits_for`` of
    batch n. ``pad_rows``: the logits stay on the device for a caller that reduces them there,
    a sequence's ``n`` rows followed by zero rows up to ``pad_rows(n)`` (jax arrays; a
    handful of shapes for the caller's kernels; the same values)."""
    hp = model.hparams
    replacements = replacements if replacements is not None else {}
    outside = replacements.get(HEAD)  # read once for every batch (embedding and head)
    head_only = {} if outside is None else {HEAD: outside}
    states = [_embedded(model, sequences, head_only) for sequences in batches]
    routers: list[list[np.ndarray]] = [[] for _ in states]

    def ready() -> None:
        jax.block_until_ready([s.h for s in states])

    for i, weights in _layers(model, replacements, prefetch, ready):
        dense = i < hp.n_leading_dense
        for n, s in enumerate(states):
            h, cap = _block(hp, s.tile, False, dense, weights, s.h, s.positions, None)
            states[n] = s._replace(h=h)
            if not dense:
                routers[n].append(np.asarray(cap["topk_ids"])[s.real])
            cap = None
        weights = None  # let go before the next layer is read
    for n, s in enumerate(states):
        wanted = None if logits_for is None else logits_for[n]
        result = _finished(model, s, s.h, head_only, wanted, pad_rows)
        states[n] = None  # its hidden states go before the next batch's logits are built
        yield result._replace(router=_per_sequence(routers[n], s.lengths))


def capture_layers(
    model: GGUFModel,
    batches: Sequence[Sequence[np.ndarray]],
    prefetch: bool | None = None,
    replacements: Mapping[int, LayerReplacement] | None = None,
) -> Iterator[tuple[int, list[LayerCapture]]]:
    """The teacher's captures of every MoE layer, layer-major: ``(i, [LayerCapture per
    batch])`` for each MoE layer i in order, every batch advanced through layer i before layer
    i + 1 is read (each layer's weights are read once, however many batches). What is carried
    between layers is the batches' hidden states, never a layer; a layer's captures are the
    caller's once yielded. A batch runs exactly as it would in :func:`forward` (same shapes,
    same layer function): its captures are the same, bit for bit. ``replacements`` (as in
    :func:`forward`, read layer by layer): the captures of a student instead, such as the
    teacher with its attention requantized (:mod:`healsweep.heal.student_trace`)."""
    hp = model.hparams
    replacements = replacements if replacements is not None else {}
    outside = replacements.get(HEAD)
    head_only = {} if outside is None else {HEAD: outside}
    states = [_embedded(model, sequences, head_only) for sequences in batches]

    def ready() -> None:
        jax.block_until_ready([s.h for s in states])

    for i, weights in _layers(model, replacements, prefetch, ready):
        dense = i < hp.n_leading_dense
        found = []
        for n, s in enumerate(states):
            h, cap = _block(hp, s.tile, True, dense, weights, s.h, s.positions, None)
            states[n] = s._replace(h=h)
            if not dense:
                found.append(_gather_capture(cap, s.real))
            cap = None
        weights = None  # let go before the next layer is read
        if not dense:
            yield i, found


def forward_each(
    model: GGUFModel,
    sequences: Sequence[np.ndarray],
    *,
    logits_for: Sequence[np.ndarray] | None = None,
    prefetch: bool | None = None,
    pad_rows: Callable[[int], int] | None = None,
) -> ForwardResult:
    """The logits and router ids of :func:`forward`, each sequence computed as if it were alone.

    A batched forward's float rounding depends on the batch's shape (its size and its padded
    length decide how XLA blocks each matmul), so a sequence's logits in a batch differ in the
    last bits from its logits in another batch. Here every sequence runs as a batch of one,
    padded to its own multiple of :data:`PAD_MULTIPLE`, and the output head takes rows in
    fixed blocks of :data:`HEAD_ROWS`: a sequence's result is a function of its own tokens only, whatever came with
    it, and a layer's weights are still read once for all of them. What the teacher cache stores
    is computed this way, so an entry rebuilt in any batch equals the original bit for bit.
    ``pad_rows``: as :func:`forward_batches`' (the logits stay on the device, each sequence's
    ``n`` rows then zero rows up to ``pad_rows(n)``; the same values).
    """
    hp = model.hparams
    # ([1, T_b], [n_b]): T_b a power of two within the context, a handful of compiled lengths
    padded = [_pad_batch([seq], hp.n_vocab, hp.context_length) for seq in sequences]
    hs = [_on_device(_embed(model, tokens)) for tokens, _ in padded]  # [1, T_b, D] each
    # per sequence, its expert tile rows and token positions (sent once, not once a layer)
    placed = [(expert_tile_rows(tokens.shape[1] * hp.n_expert_used, hp.n_expert),
               _on_device(np.arange(tokens.shape[1], dtype=np.int32)))
              for tokens, _ in padded]  # fmt: skip
    router: list[list[np.ndarray]] = [[] for _ in sequences]
    for i, weights in _layers(model, {}, prefetch, partial(jax.block_until_ready, hs)):
        dense = i < hp.n_leading_dense
        for b, (tile, positions) in enumerate(placed):
            hs[b], cap = _block(hp, tile, False, dense, weights, hs[b], positions, None)
            if not dense:  # copied to the host after the last layer: no wait per window here
                router[b].append(cap["topk_ids"])
            cap = None
        weights = None  # let go before the next layer is read
    norm = jnp.asarray(model.tensor("output_norm.weight"))
    wanted = []
    for b, (_, (n,)) in enumerate(padded):
        pos = np.arange(n) if logits_for is None else np.asarray(logits_for[b], np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= n):
            raise ValueError(f"forward_each: logits_for[{b}] has positions outside [0, {n})")
        wanted.append(pos)
    hidden = np.concatenate([_final_norm(hp.rms_norm_eps, h, norm, p)
                             for h, p in zip(hs, wanted, strict=True)])  # fmt: skip
    logits = _logits(model, hidden, row_block=HEAD_ROWS, on_device=pad_rows is not None)
    cuts = np.cumsum([0, *(len(p) for p in wanted)])
    if pad_rows is None:
        per_sequence = list(np.split(logits, cuts[1:-1]))
    else:
        per_sequence = [_padded_rows(logits, a, b - a, pad_rows(int(b - a)))
                        for a, b in zip(cuts[:-1], cuts[1:], strict=True)]  # fmt: skip
    routed = [np.stack([np.asarray(ids)[:n] for ids in r], axis=1)  # [T_b, L_moe, k]
              for r, (_, (n,)) in zip(router, padded, strict=True)]  # fmt: skip
    return ForwardResult(logits=per_sequence, captures=None, router=routed)
