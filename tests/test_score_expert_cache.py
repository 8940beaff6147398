"""Scoring through a simulated expert cache, on real (small, random) GGUF files of both archs."""

from __future__ import annotations

from collections import OrderedDict

import jax
import numpy as np
import pytest

from healsweep.cache import StageCache
from healsweep.data.corpus import Document, Message, load_corpus, write_corpus
from healsweep.data.split import parity_split
from healsweep.data.windows import make_windows
from healsweep.errors import KnobError
from healsweep.model import forward, open_model
from healsweep.model.synthetic import write_random_model
from healsweep.score import score_windows
from healsweep.score.expert_cache import ExpertCacheConfig, expert_bytes, pooled_cache
from healsweep.score.teacher_cache import STAGE

N_EXPERT, K = 8, 2
ANSWER = "<think>\nRouting picks experts {i}.\n</think>\n\nThe answer is {i}."


@pytest.fixture(scope="module", params=["qwen2moe", "qwen3moe"])
def models(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    kw = {"n_expert": N_EXPERT, "n_expert_used": K}
    ref = write_random_model(root / "ref.gguf", request.param, seed=11, **kw)
    student = write_random_model(root / "q4.gguf", request.param, seed=11, types="Q4_0", **kw)
    return open_model(ref), open_model(student)


@pytest.fixture(scope="module")
def windows(models, tmp_path_factory):
    return _windows_for(models[0], tmp_path_factory.mktemp("corpus"))


def _windows_for(model, folder):
    docs = []
    for i in range(1, 6, 2):  # odd index: dev
        question = "Which expert answers the question of the fox? " * (1 + i)
        messages = (Message("user", question), Message("assistant", ANSWER.format(i=i)))
        docs.append(Document(f"c{i}", "chat", i, "chat", messages=messages))
        docs.append(Document(f"t{i}", "docs", i, "docs", text=f"Tokens {i} go in order. " * 12))
    path = folder / "c.jsonl"
    write_corpus(docs, path)
    corpus = load_corpus(path)
    found = make_windows(corpus, model.tokenizer(), parity_split(corpus), max_scored=16,
                         max_context=32, max_windows_per_doc=2)  # fmt: skip
    return found[:8]


def _score(models, windows, cache_dir, expert_cache=None):
    teacher, student = models
    return list(
        score_windows(teacher, student, windows, StageCache(cache_dir), batch=4,
                      teacher_cache="exact", expert_cache=expert_cache)  # fmt: skip
    )


QUALITY = ("kld_sum", "kld_mean", "top1_count", "delta_p_mean", "teacher_nll_sum",
           "student_nll_sum", "router_jaccard", "kld_p50", "kld_p99", "kld_max")  # fmt: skip


@pytest.mark.parametrize("capacity", [K, 5, N_EXPERT])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_bonus_zero_scores_exactly_like_plain_score(models, windows, tmp_path, capacity, warm):
    plain = _score(models, windows, tmp_path)
    cached = _score(models, windows, tmp_path,
                    ExpertCacheConfig(bonus=0.0, experts=capacity, warm=warm))  # fmt: skip
    for (w, a), (_, b) in zip(plain, cached, strict=True):
        assert a.expert_cache is None and b.expert_cache is not None
        for name in QUALITY:
            assert getattr(a, name) == getattr(b, name), (w.window_id, name)
        np.testing.assert_array_equal(a.router_jaccard_layers, b.router_jaccard_layers)


def _reference_misses(probs: np.ndarray, capacity: int, lru: OrderedDict) -> np.ndarray:
    """Plain LRU misses per token at bonus 0 (the top-k of p, touched in rank order)."""
    out = []
    for p in probs:
        chosen = np.argsort(-p, kind="stable")[:K]
        out.append(sum(int(e) not in lru for e in chosen))
        for e in chosen:
            lru.pop(int(e), None)
            lru[int(e)] = True
        while len(lru) > capacity:
            lru.popitem(last=False)
    return np.array(out)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_cache_figures_match_a_reference_replay(models, windows, tmp_path, warm):
    """At bonus 0 the routing is the plain one: replaying the captured router probabilities
    through a Python LRU gives the same misses at the scored positions; bytes from the file."""
    teacher, student = models
    capacity = 3
    scored = _score(models, windows, tmp_path,
                    ExpertCacheConfig(bonus=0.0, experts=capacity, warm=warm))  # fmt: skip
    size = [
        sum(student.tensor_nbytes(f"blk.{layer}.ffn_{t}_exps.weight") for t in ("gate", "up", "down"))
        / N_EXPERT
        for layer in range(student.hparams.n_layer)
    ]
    assert expert_bytes(student) == [int(s) for s in size]
    caches: dict[str, list[OrderedDict]] = {}
    for window, metrics in scored:
        run = forward(student, [window.tokens], capture=True)
        pos = np.arange(window.n_scored) + window.scored_from - 1
        misses = np.zeros(len(pos), np.int64)
        mib = 0.0
        layers = caches.get(window.doc_id) if warm else None
        layers = layers or [OrderedDict() for _ in run.captures]
        for layer, cap in enumerate(run.captures):
            probs = np.asarray(jax.nn.softmax(cap.router_logits, axis=-1))
            per_token = _reference_misses(probs, capacity, layers[layer])[pos]
            misses += per_token
            mib += per_token.sum() * size[layer] / 2**20
        caches[window.doc_id] = layers
        stats = metrics.expert_cache
        assert stats.tokens == window.n_scored
        assert stats.lookups == window.n_scored * student.hparams.n_layer * K
        assert stats.misses == int(misses.sum())
        assert stats.mib == pytest.approx(mib, rel=1e-9)


def test_full_bonus_keeps_the_first_experts_and_teacher_cache_is_untouched(
    models, windows, tmp_path
):
    """Bonus 1 beats any probability: after the first token loads k experts per layer, every
    token reuses them, so nothing misses at the scored positions; the teacher is not biased."""
    _score(models, windows, tmp_path)  # fills the teacher cache
    def entries():
        return sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / STAGE).rglob("*.hsc"))

    before = entries()
    scored = _score(models, windows, tmp_path, ExpertCacheConfig(bonus=1.0, experts=4))
    assert entries() == before and before
    for window, metrics in scored:
        assert window.scored_from > 1
        assert metrics.expert_cache.misses == 0
    pooled = pooled_cache([m.to_dict() for _, m in scored])
    assert pooled["hit_rate"] == 1.0 and pooled["mib_per_token"] == 0.0
    plain = _score(models, windows, tmp_path)
    assert sum(m.kld_sum for _, m in scored) != sum(m.kld_sum for _, m in plain)


def test_bonus_raises_hit_rate(models, windows, tmp_path):
    rates = [
        pooled_cache([m.to_dict() for _, m in _score(
            models, windows, tmp_path, ExpertCacheConfig(bonus=bonus, experts=3))])["hit_rate"]
        for bonus in (0.0, 0.2, 0.6)
    ]  # fmt: skip
    assert rates[0] < rates[1] < rates[2]


def test_cache_sizes_are_checked(models, windows, tmp_path):
    with pytest.raises(KnobError, match="between 2 and 8"):
        _score(models, windows, tmp_path, ExpertCacheConfig(experts=1))
    with pytest.raises(KnobError, match="between 2 and 8"):
        _score(models, windows, tmp_path, ExpertCacheConfig(experts=9))
    with pytest.raises(KnobError, match="exactly one size"):
        _score(models, windows, tmp_path, ExpertCacheConfig(experts=3, mib=1.0))
    size = expert_bytes(models[1])[0] / 2**20
    config = ExpertCacheConfig(mib=3.5 * size)  # 3 experts fit
    from healsweep.score.expert_cache import layer_capacities

    assert layer_capacities(config, models[1]) == [3] * models[1].hparams.n_layer


def test_sigmoid_grouped_routing_and_a_dense_layer(tmp_path):
    """glm4moe with a leading dense layer, a selection bias, 4 expert groups (2 used) and a
    weight scale: bonus 0 scores exactly like plain score, the dense layer has no cache (the
    lookups count MoE layers), and a bonus raises the hit rate."""
    kw = {"n_layer": 3, "n_expert": N_EXPERT, "n_expert_used": K, "n_leading_dense": 1,
          "n_expert_groups": 4, "n_group_used": 2, "norm_topk_prob": True,
          "expert_weights_scale": 2.5}  # fmt: skip
    ref = open_model(write_random_model(tmp_path / "ref.gguf", "glm4moe", seed=5, **kw))
    student = open_model(
        write_random_model(tmp_path / "q4.gguf", "glm4moe", seed=5, types="Q4_0", **kw)
    )
    assert "exp_probs_b.bias" in " ".join(student.tensor_names)
    found = _windows_for(ref, tmp_path)
    plain = _score((ref, student), found, tmp_path / "c")
    cached = _score((ref, student), found, tmp_path / "c",
                    ExpertCacheConfig(bonus=0.0, experts=3))  # fmt: skip
    for (w, a), (_, b) in zip(plain, cached, strict=True):
        for name in QUALITY:
            assert getattr(a, name) == getattr(b, name), (w.window_id, name)
        assert b.expert_cache.lookups == w.n_scored * 2 * K  # two MoE layers of three
    assert len(expert_bytes(student)) == 2
    bonus = _score((ref, student), found, tmp_path / "c", ExpertCacheConfig(bonus=1.0, experts=3))
    hits = [pooled_cache([m.expert_cache.to_dict() for _, m in run])["hit_rate"]
            for run in (cached, bonus)]  # fmt: skip
    assert hits[1] > hits[0]
