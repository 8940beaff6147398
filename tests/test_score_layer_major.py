"""Layer-major scoring (issue 46): the batches of a group advance through each student layer
together, so a streamed student's layers are read once per group, and every window's metrics
equal those of the batch-by-batch forward bit for bit."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields

import jax
import numpy as np
import pytest

from healsweep.cache import StageCache
from healsweep.data.corpus import Document, load_corpus, write_corpus
from healsweep.data.split import parity_split
from healsweep.data.windows import make_windows
from healsweep.heal.streamed import LayerMap
from healsweep.model import LayerReplacement, open_model
from healsweep.model.synthetic import write_random_model
from healsweep.score import score_windows
from healsweep.score.compact import cache_format
from healsweep.score.metrics import bucket_rows, compact_window_metrics
from healsweep.score.runner import run_student, student_batches
from healsweep.score.teacher_cache import teacher_outputs

BATCH = 3
N_WINDOWS = 7  # not a multiple of BATCH: the last batch is short


@dataclass
class HealedStudent:
    """A healed student as the pipeline hands it over: the base and a map that loads each
    layer's replacement when read (here: counting the reads)."""

    base: object
    replacements: LayerMap


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return open_model(write_random_model(tmp_path_factory.mktemp("m") / "m.gguf", seed=5, n_layer=3))


@pytest.fixture(scope="module")
def windows(base, tmp_path_factory):
    docs = [
        Document(f"t{i}", "docs", i, "docs", text=f"Numbers: {i} 2 3 4 5 6 7 8 {i}. " * (3 + i))
        for i in range(1, 16, 2)  # odd index: dev; lengths differ, so do padded lengths
    ]
    path = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    write_corpus(docs, path)
    corpus = load_corpus(path)
    found = make_windows(corpus, base.tokenizer(), parity_split(corpus), max_scored=20,
                         max_context=70, max_windows_per_doc=1)  # fmt: skip
    assert len(found) >= N_WINDOWS
    return found[:N_WINDOWS]


def _student(base, reads: Counter) -> HealedStudent:
    """Every MoE layer's routed down projection scaled (a student that differs from its
    teacher), loaded on each read of the map, as a streamed student's layers are."""

    def load(i: int) -> LayerReplacement:
        reads[i] += 1
        return LayerReplacement(down_exps=base.layer(i)["ffn_down_exps.weight"] * 1.25)

    return HealedStudent(base, LayerMap(base.hparams.moe_layers, load))


def test_layer_major_batches_equal_batch_by_batch_forwards_bit_for_bit(base, windows, tmp_path):
    """Logits kept on the device (jax arrays, padded there) give the metrics of the host
    logits of a batch's own forward, bit for bit."""
    student = _student(base, Counter())
    batches = [windows[a : a + BATCH] for a in range(0, len(windows), BATCH)]
    together = list(student_batches(student, batches))
    assert len(together) == len(batches) == 3
    cache = StageCache(tmp_path / "cache")
    for group, found in zip(batches, together, strict=True):
        alone = run_student(student, group)  # the forward of one batch, as before issue 46
        records = teacher_outputs(base, group, cache, cache_format("compact"))
        for window, record, (logits, topk, _), (ref_logits, ref_topk, _) in zip(
            group, records, found, alone, strict=True
        ):
            assert isinstance(logits, jax.Array) and isinstance(ref_logits, np.ndarray)
            n = window.n_scored
            assert logits.shape == (bucket_rows(n), ref_logits.shape[1])  # padded on the device
            np.testing.assert_array_equal(np.asarray(logits)[:n], ref_logits)
            assert not np.asarray(logits)[n:].any()  # zero rows: KL 0, dropped
            np.testing.assert_array_equal(topk, ref_topk)
            on_device = compact_window_metrics(record, logits, window.scored_tokens)
            on_host = compact_window_metrics(record, ref_logits, window.scored_tokens)
            assert n not in (8, 16)  # rows padded
            for f in fields(on_host):
                np.testing.assert_array_equal(getattr(on_device, f.name),
                                              getattr(on_host, f.name), f.name)  # fmt: skip


def test_a_group_reads_each_layer_once_and_scores_as_batch_by_batch(base, windows, tmp_path):
    """3 layers (a LayerMap keeps the last 2 read: a batch-by-batch forward reads each layer
    again for every batch)."""
    cache = StageCache(tmp_path / "cache")
    layers = base.hparams.moe_layers
    reads = {}
    scored = {}
    for group in (1, None, 4):  # 1: a batch at a time, as before issue 46; 4: two batches
        reads[group] = Counter()
        student = _student(base, reads[group])
        scored[group] = list(score_windows(base, student, windows, cache, batch=BATCH,
                                           group=group))  # fmt: skip
    assert reads == {1: {i: 3 for i in layers}, None: {i: 1 for i in layers},
                     4: {i: 2 for i in layers}}  # fmt: skip
    for group in (None, 4):
        assert [w.window_id for w, _ in scored[group]] == [w.window_id for w in windows]
        for (_, m), (_, ref) in zip(scored[group], scored[1], strict=True):
            for f in fields(ref):
                np.testing.assert_array_equal(getattr(m, f.name), getattr(ref, f.name), f.name)
    assert max(m.kld_mean for _, m in scored[None]) > 0  # the student differs from its teacher


def test_a_group_below_one_window_is_refused(base, windows, tmp_path):
    with pytest.raises(ValueError, match="group must be >= 1"):
        next(score_windows(base, base, windows, StageCache(tmp_path / "c"), group=0))


def test_the_group_field_keeps_earlier_specs_hashes_and_defaults_by_pruner():
    from healsweep.sweep.manifest import spec_hash
    from healsweep.sweep.spec_files import spec_from_dict

    plain = spec_from_dict({"name": "x", "scoring": {"batch": 8}})
    assert "group" not in plain.model_dump(mode="json")["scoring"]  # stored (hashed) as before
    before = "1148cc5c449e176bbd5d94105f2bb33087322507c917a7e3a2faa49f78cbc87c"  # main, 3d2ad56
    assert spec_hash(spec_from_dict({"name": "x"})) == before
    given = spec_from_dict({"name": "x", "scoring": {"batch": 8, "group": 24}})
    assert given.model_dump(mode="json")["scoring"]["group"] == 24
    assert spec_hash(given) != spec_hash(plain)
    assert plain.scoring.group_for(pruned=True) == 32  # 4 batches: a pruner still reports often
    assert plain.scoring.group_for(pruned=False) is None  # the hidden-state budget decides
    assert given.scoring.group_for(pruned=True) == 24
