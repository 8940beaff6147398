"""A follow-up trial recomputes only the stages its changed knob feeds (issue 46, item 3).

On the 24-layer A2.7B night a gain_d-change trial recomputed all 24 ridge bases, although a
basis depends only on the trace and the shared expert. The keys are not to blame (the first test
shows each knob's follow-up computing exactly the stages that read it, in a cache without a
limit); eviction was: plain LRU deleted the bases, which a follow-up reads only when a stage
after them computes. The second test runs the same trials in a cache whose limit is smaller than
all their entries: what eviction deletes must then be what is cheap to redo per byte (the routed
outputs of the quantization the follow-up left), never a basis or the trace.
"""

from __future__ import annotations

import json
import math
from functools import partial

import pytest

from healsweep import _cache_disk as disk
from healsweep.cache import StageCache, entry_seconds
from healsweep.data.corpus import load_corpus
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.model import open_model
from healsweep.model.synthetic import write_random_model

CAL = CalibrationConfig(chunk_length=64, min_tokens_per_expert=4)
BASE = Knobs(alpha="mse")  # Part A on the trace: routed_q is part of every trial
# What a follow-up changing one knob computes, per MoE layer (quantize: the down group only,
# since gain_d is read by down alone), against a cache that holds the trials before it.
# Trials built as a sweep builds them: without Part B's held-out diagnostic (ridge_heldout),
# which reads routed_q, so a rho follow-up with it reads the routed outputs too.
FEEDS = {
    "gain_d": {"quantize": 1, "routed_q": 1, "part_a": 1, "residuals": 1, "ridge_rhs": 1,
               "ridge_fit": 1, "part_b": 1},
    "rho": {"ridge_fit": 1, "part_b": 1},
    "eta": {"part_b": 1},
}  # fmt: skip
FOLLOW_UPS = (("gain_d", 0.5), ("rho", 2.0), ("eta", 0.3))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A 2-layer random qwen2moe and ~2,000 calibration tokens: enough that a layer's basis
    (a Gram over every token, stored as its [F, F] eigenvectors) costs more per byte than its
    routed output (y_q [T, D], one routed pass)."""
    root = tmp_path_factory.mktemp("follow")
    model = open_model(write_random_model(root / "m.gguf", n_layer=2, n_ff_exp=64,
                                          types={"ffn_down_shexp.weight": "Q8_0"}))
    texts = ["The quick brown fox jumps over the lazy dog. ",
             "Mixture-of-experts models route every token to a few experts. ",
             '{"name": "launch retro", "items": [1, 2, 3]} ',
             "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 "]
    rows = [{"doc_id": f"cal-{i}", "source": "cal", "index": i, "stratum": "ab"[i % 2],
             "pool": "calibration", "text": texts[i % 4] * 12} for i in range(16)]
    rows.append({"doc_id": "ev-0", "source": "ev", "index": 0, "stratum": "a", "text": "eval"})
    path = root / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, load_corpus(path)


def _trials(model, corpus, cache):
    """The cold trial, then one follow-up per knob, each changing one knob of the one before;
    what each computed (the report's ``executed``), by stage, per layer."""
    n = model.hparams.n_layer
    knobs = BASE
    cold = build_student(model, knobs, CAL, cache, corpus=corpus, diagnostics=False)
    done = []
    for knob, value in FOLLOW_UPS:
        knobs = knobs.replace(**{knob: value})
        student = build_student(model, knobs, CAL, cache, corpus=corpus, diagnostics=False)
        done.append((knob, {str(s): c / n for s, c in student.report["executed"].items()}))
    return cold, done


def test_each_follow_up_computes_exactly_the_stages_its_knob_feeds(setup, tmp_path):
    model, corpus = setup
    cold, done = _trials(model, corpus, StageCache(tmp_path, max_gb=math.inf))
    assert cold.report["executed"]["calib_trace"] == 1
    assert cold.report["executed"]["ridge_basis"] == model.hparams.n_layer
    for knob, executed in done:
        assert executed == FEEDS[knob], knob


def test_a_bounded_cache_evicts_what_is_cheap_to_redo_not_the_basis_or_the_trace(
    setup, tmp_path
):
    model, corpus = setup
    # The same cold trial once without a limit: its entries' size, and the JIT compiled (so
    # the seconds the bounded cache's entries record are their computations, not compiles).
    build_student(model, BASE, CAL, StageCache(tmp_path / "free"), corpus=corpus, diagnostics=False)
    cold_bytes = sum(e.size for e in disk.entries(tmp_path / "free"))
    cache = StageCache(tmp_path / "bounded", max_gb=1.15 * cold_bytes / 2**30)
    cold, done = _trials(model, corpus, cache)
    found = disk.entries(tmp_path / "bounded")
    assert cache.evicted, "the follow-ups' entries fit the limit: the bound was never hit"
    assert sum(cache.bytes_evicted.values()) + sum(e.size for e in found) > cache.max_bytes
    for knob, executed in done:
        assert executed == FEEDS[knob], knob
    assert not {"ridge_basis", "calib_trace", "calib_trace_layer"} & set(cache.evicted)
    assert "routed_q" in cache.evicted  # the gain_d trial's new quantization left them stale
    # every entry records what it cost: the trace's layers at least the trace's forward
    seconds = {e.relpath: entry_seconds(tmp_path / "bounded" / e.relpath, e.size) for e in found}
    assert all(s > 0 for s in seconds.values())
    trace_s = [s for path, s in seconds.items() if path.startswith("calib_trace_layer/")]
    assert len(trace_s) == model.hparams.n_layer


# A night's grid in sweep order (bench night's: eta, then rho, then the quantization, the last
# fastest), each trial holding its entries while it builds, as a sweep trial does.
NIGHT = [(eta, rho, gain_d) for eta in (0.15, 0.3) for rho in (6.0, 2.0) for gain_d in (0.3, 0.5)]


def _night(model, corpus, cache_for):
    """What each trial of :data:`NIGHT` computed, by stage (all layers); ``cache_for()`` is
    the trial's own cache over the one root (a sweep trial opens one)."""
    computed = []
    for eta, rho, gain_d in NIGHT:
        cache = cache_for()
        knobs = BASE.replace(eta=eta, rho=rho, gain_d=gain_d)
        with cache.holding():
            student = build_student(model, knobs, CAL, cache, corpus=corpus, diagnostics=False)
        computed.append({str(s): c for s, c in student.report["executed"].items()})
    return computed


def test_in_a_bounded_cache_the_eta_follow_ups_of_a_night_compute_part_b_alone(setup, tmp_path):
    """Issue 46: on the H100 night 15 of 18 eta follow-ups recomputed ridge fits evicted before
    they were read, while the routed outputs of both quantizations (read by no later trial of a
    grid over gain_d, rho and eta) stayed. With the limit under all the night's entries but over
    them less the routed outputs, a sweep's trials (stating their axes) keep every fit: the
    second eta's four trials compute Part B alone; the same trials stating none (the order
    before) recompute fits."""
    model, corpus = setup
    n = model.hparams.n_layer
    free = tmp_path / "free"
    _night(model, corpus, lambda: StageCache(free))
    sizes: dict[str, int] = {}
    for entry in disk.entries(free):
        sizes[entry.stage] = sizes.get(entry.stage, 0) + entry.size
    total, routed = sum(sizes.values()), sizes["routed_q"]
    # Room, after an eviction pass, for every entry but one quantization's routed outputs (a
    # trial holds the other's while it builds): the night's proportions, where a trial holds
    # far less than the limit and the routed outputs are a fifth of the entries.
    limit = 1.01 * (total - routed / 2) / (1 - disk.MARGIN)
    assert limit < total, sizes  # the limit is hit: the night's entries do not fit in it
    axes = {"eta", "rho", "gain_d"}
    for stated, root in ((axes, tmp_path / "sweep"), (None, tmp_path / "unstated")):
        trial_cache = partial(StageCache, root, max_gb=limit / 2**30, axes=stated)
        done = _night(model, corpus, trial_cache)
        evicted = {e.stage for e in disk.entries(free)} - {e.stage for e in disk.entries(root)}
        second_eta = done[len(NIGHT) // 2:]
        if stated is not None:
            assert all(c == {"part_b": n} for c in second_eta), done
            assert "ridge_fit" not in evicted
        else:
            assert any(c.get("ridge_fit") for c in second_eta), done
