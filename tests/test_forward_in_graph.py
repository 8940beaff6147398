"""The forward with weights sent as stored bytes and decoded in the graph.

References: transformers' forward of the same GGUF (it dequantizes with gguf-py: an independent
decoder and an independent model) on a file whose tensors use the K-quants, IQ4 and legacy
block types; the raw bytes against gguf-py's memmap; the host-dequantized fallback for a type
without an in-graph decoder; the device-resident layer cache (same logits, no stale file).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch  # noqa: F401  (the [test] extra; transformers needs it)

from healsweep.model import forward, open_model
from healsweep.model.resident import ResidentLayers

# Rows of 256 so every K-quant fits; one matrix (TQ2_0) has no in-graph decoder.
BLOCK_TYPES = {
    "token_embd.weight": "Q4_0",
    "output.weight": "Q6_K",
    "attn_q.weight": "Q4_K",
    "attn_k.weight": "Q5_K",
    "attn_v.weight": "Q6_K",
    "attn_output.weight": "IQ4_XS",
    "ffn_gate_inp.weight": "F32",
    "ffn_gate_exps.weight": "Q4_1",
    "ffn_up_exps.weight": "Q5_1",
    "ffn_down_exps.weight": "Q8_0",
    "ffn_gate_shexp.weight": "BF16",
    "ffn_up_shexp.weight": "Q5_0",
    "ffn_down_shexp.weight": "TQ2_0",
}
SHAPE = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_expert=4, n_expert_used=2,
             n_ff_exp=256, n_ff_shexp=256, rope_freq_base=10000.0)
TOLERANCE = 2e-3  # max |Δlogit| <= TOLERANCE * max |logit|, as in test_model_reference


@pytest.fixture(scope="module")
def block_model(random_gguf):
    return open_model(random_gguf("qwen2moe", types=BLOCK_TYPES, seed=21, **SHAPE))


@pytest.fixture(scope="module")
def sequences(block_model):
    rng = np.random.default_rng(3)
    n_vocab = block_model.hparams.n_vocab
    return [rng.integers(0, n_vocab, 90).astype(np.int32),
            rng.integers(0, n_vocab, 33).astype(np.int32)]


def _relative_error(ours, ref) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def test_the_file_uses_every_block_family(block_model):
    kinds = {block_model.tensor_type(n).name for n in block_model.tensor_names}
    assert {"Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q8_0", "Q4_1", "Q5_1", "Q5_0", "BF16",
            "TQ2_0"} <= kinds


def test_raw_rows_are_the_stored_bytes(block_model):
    for name in block_model.tensor_names:
        if len(block_model.tensor_shape(name)) < 2:
            continue
        _, mapped = block_model.raw_tensor(name)
        want = np.ascontiguousarray(mapped).view(np.uint8).reshape(-1)
        got = block_model.raw_rows(name)
        assert got.dtype == np.uint8
        assert got.shape[-1] == block_model.row_bytes(name)
        np.testing.assert_array_equal(got.reshape(-1), want, err_msg=name)
        rows = block_model.tensor_shape(name)[0]
        part = block_model.raw_rows(name, 1, rows - 1)
        np.testing.assert_array_equal(part, got[1 : rows - 1], err_msg=name)


def test_logits_match_transformers_on_block_types(block_model, sequences, caplog, own_runtime):
    from transformers import AutoModelForCausalLM

    hp = block_model.hparams
    hf = AutoModelForCausalLM.from_pretrained(
        block_model.path.parent, gguf_file=block_model.path.name, dtype=torch.float32,
        moe_intermediate_size=hp.n_ff_exp, shared_expert_intermediate_size=hp.n_ff_shexp,
    ).eval()
    with caplog.at_level(logging.WARNING, logger="healsweep.model.forward"):
        ours = forward(block_model, sequences).logits
        forward(block_model, sequences[1:])
    notices = [r.getMessage() for r in caplog.records if "TQ2_0" in r.getMessage()]
    assert len(notices) == 1 and "dequantized on the host" in notices[0]
    for got, seq in zip(ours, sequences, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor(seq[None], dtype=torch.long)).logits[0].numpy()
        assert np.abs(ref).max() > 1.0
        assert _relative_error(got, ref) <= TOLERANCE


def test_resident_layers_serve_the_same_logits_and_never_a_stale_file(
    random_gguf, monkeypatch, tmp_path, own_runtime
):
    import shutil

    path = tmp_path / "model.gguf"
    shutil.copy(random_gguf("qwen2moe", types={"ffn_gate_exps.weight": "Q8_0"}, seed=8), path)
    model = open_model(path)
    seqs = [np.arange(1, 50, dtype=np.int32)]
    resident = own_runtime.owned(ResidentLayers)
    streamed = forward(model, seqs).logits[0]  # the CPU's default budget: nothing kept
    assert resident.kept_bytes == 0

    monkeypatch.setenv("HEALSWEEP_RESIDENT_GB", "1")
    resident.clear()
    first = forward(model, seqs).logits[0]
    kept = len(resident)
    assert kept == model.hparams.n_layer + 1  # every layer and the output head's one chunk
    second = forward(model, seqs).logits[0]
    assert len(resident) == kept
    np.testing.assert_array_equal(first, streamed)
    np.testing.assert_array_equal(second, streamed)

    other = random_gguf("qwen2moe", types={"ffn_gate_exps.weight": "Q8_0"}, seed=9)
    shutil.copy(other, path)  # same path and size, new bytes and mtime
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    fresh = forward(open_model(path), seqs).logits[0]
    np.testing.assert_array_equal(fresh, forward(open_model(other), seqs).logits[0])
    assert not np.array_equal(fresh, first)

    monkeypatch.setenv("HEALSWEEP_RESIDENT_GB", "0.000001")  # ~1 KB: nothing fits
    resident.clear()
    forward(model, seqs)
    assert resident.kept_bytes == 0


def test_a_bad_budget_is_named(monkeypatch):
    from healsweep.errors import SettingError
    from healsweep.model.resident import resident_budget

    monkeypatch.setenv("HEALSWEEP_RESIDENT_GB", "lots")
    with pytest.raises(SettingError, match="HEALSWEEP_RESIDENT_GB='lots' is not a number"):
        resident_budget()
