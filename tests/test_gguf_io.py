"""gguf_io: write/read round trips, dequantization against numpy, validation errors, tokenizer."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from healsweep.bundled import demo_model_path, resolve_model
from healsweep.errors import GGUFFormatError, TokenizerError, UnsupportedArchitectureError
from healsweep.gguf_io import (
    ModelHparams,
    build_tokenizer,
    file_fingerprint,
    tokenizer_metadata_from_tokenizer,
)
from healsweep.model import expected_tensor_shapes, open_model, write_model
from healsweep.model.synthetic import RandomTensors

CHATML = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2? Answer in "
    "JSON.<|im_end|>\n<|im_start|>assistant\n<think>\nsimple sum\n</think>\n\n {\"answer\": 4}"
    "<|im_end|>\n<|endoftext|>"
)
TEXTS = [
    CHATML,
    "The  quick\tbrown fox —   jumps!!\n\n\nover 12345 lazy dogs' tails, doesn't it?",
    "東京は晴れです。日本語のテキスト 🙂 and émojis",
    "def f(x):\n    return x ** 2  # square\n",
    "",
]


def _hparams(**changes) -> ModelHparams:
    base = ModelHparams(
        arch="qwen2moe", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_expert=4,
        n_expert_used=2, n_ff_exp=32, n_ff_shexp=64, n_vocab=96, rope_freq_base=1e6,
        rms_norm_eps=1e-6, context_length=256, norm_topk_prob=False,
    )
    return base.replace(**changes)


def _q8_0_reference(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Q8_0 decoded from its byte layout in float64: per 34-byte block, fp16 d then 32 int8."""
    blocks = raw.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float64)  # [N, 1]
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float64)  # [N, 32]
    return (d * q).reshape(shape)


def test_write_then_open_round_trips_hparams_shapes_and_values(tmp_path):
    hp = _hparams()
    tensors = dict(RandomTensors(expected_tensor_shapes(hp), seed=3))
    types = {"blk.0.ffn_up_exps.weight": QT.Q8_0, "blk.1.attn_q.weight": QT.F32,
             "blk.0.ffn_down_exps.weight": QT.Q4_0}
    path = write_model(tmp_path / "m.gguf", "qwen2moe", hp, tensors, types)
    model = open_model(path)
    assert model.hparams == hp.replace(rms_norm_eps=model.hparams.rms_norm_eps)
    assert model.hparams.rms_norm_eps == pytest.approx(1e-6, rel=1e-6)
    assert set(model.tensor_names) == set(tensors)
    for name, values in tensors.items():
        got = model.tensor(name)
        assert got.dtype == np.float32 and got.shape == values.shape
        kind = model.tensor_type(name)
        if kind == QT.F32:
            np.testing.assert_array_equal(got, values)
        elif kind == QT.F16:
            np.testing.assert_array_equal(got, values.astype(np.float16).astype(np.float32))
        elif kind == QT.Q8_0:
            _, raw = model.raw_tensor(name)
            np.testing.assert_allclose(got, _q8_0_reference(np.asarray(raw), values.shape),
                                       rtol=0, atol=1e-6)
            amax = np.abs(values.reshape(-1, 32)).max(axis=1, keepdims=True)
            err = np.abs(got - values).reshape(-1, 32)
            assert np.all(err <= amax / 127 * 0.5 + amax * 1e-3 + 1e-7)
        else:  # Q4_0: 16 levels over [-amax, amax], so at most one step of error
            amax = np.abs(values.reshape(-1, 32)).max(axis=1, keepdims=True)
            assert np.all(np.abs(got - values).reshape(-1, 32) <= amax / 8 + 1e-6)
    assert {t.name for t in (model.tensor_type(n) for n in types)} == {"Q8_0", "F32", "Q4_0"}


def test_layer_rows_and_take_agree_with_whole_tensors(random_gguf):
    model = open_model(random_gguf("qwen3moe", types={"ffn_gate_exps.weight": "Q8_0"}))
    layer = model.layer(1)
    assert set(layer) == {n[len("blk.1."):] for n in model.tensor_names if n.startswith("blk.1.")}
    np.testing.assert_array_equal(layer["ffn_gate_exps.weight"],
                                  model.tensor("blk.1.ffn_gate_exps.weight"))
    whole = model.tensor("blk.1.ffn_gate_exps.weight")
    np.testing.assert_array_equal(model.tensor_rows("blk.1.ffn_gate_exps.weight", 2, 5),
                                  whole[2:5])
    embd = model.tensor("token_embd.weight")
    np.testing.assert_array_equal(model.tensor_take("token_embd.weight", [5, 0, 5]),
                                  embd[[5, 0, 5]])
    with pytest.raises(GGUFFormatError, match="out of range"):
        model.layer(model.hparams.n_layer)


def test_fingerprint_is_sha256_of_the_file_and_follows_content(random_gguf, tmp_path):
    src = random_gguf("qwen2moe")
    data = src.read_bytes()
    assert open_model(src).fingerprint == hashlib.sha256(data).hexdigest()
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert file_fingerprint(copy) == hashlib.sha256(copy.read_bytes()).hexdigest()
    assert file_fingerprint(copy) != file_fingerprint(src)


def _flip(path, offset: int) -> None:
    with path.open("r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 0xFF]))


def test_sampled_fingerprint_covers_size_header_and_sampled_chunks(tmp_path):
    from healsweep.gguf_io import _model

    header, mib = 4096, 1 << 20
    path = tmp_path / "big.bin"
    path.write_bytes(np.random.default_rng(0).bytes(70 * mib))  # 64 chunks leave gaps
    sampled = _model._sampled_digest(path, header_bytes=header)
    assert sampled.startswith("sampled-sha256:")
    assert sampled.split(":")[1] != hashlib.sha256(path.read_bytes()).hexdigest()
    for offset in (10, header + 5, 70 * mib - 1):  # header, first chunk, last chunk
        _flip(path, offset)
        assert _model._sampled_digest(path, header_bytes=header) != sampled
        _flip(path, offset)
    assert _model._sampled_digest(path, header_bytes=header) == sampled
    _flip(path, header + mib + 1000)  # between chunks 0 and 1: the documented blind spot
    assert _model._sampled_digest(path, header_bytes=header) == sampled
    with path.open("ab") as fh:
        fh.write(b"\0")
    assert _model._sampled_digest(path, header_bytes=header) != sampled


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p, g: p.write_bytes(b"PK\x03\x04 not a gguf at all"), "not a GGUF file"),
        (lambda p, g: p.write_bytes(b""), "not a GGUF file"),
        (lambda p, g: p.write_bytes(g.read_bytes()[:40]), "truncated or corrupt in its header"),
        (lambda p, g: p.write_bytes(g.read_bytes()[:-100]), "is truncated: tensor"),
    ],
    ids=["zip", "empty", "cut-header", "cut-data"],
)
def test_unreadable_files_give_one_line_errors(tmp_path, random_gguf, make, message):
    path = tmp_path / "bad.gguf"
    make(path, random_gguf("qwen2moe"))
    with pytest.raises(GGUFFormatError, match=message) as info:
        open_model(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_unsupported_arch_missing_tensor_and_missing_hparam(random_gguf):
    with pytest.raises(UnsupportedArchitectureError, match="architecture 'gpt2'"):
        open_model(random_gguf("gpt2"))
    with pytest.raises(GGUFFormatError, match="missing tensor blk.1.ffn_up_exps.weight"):
        open_model(random_gguf("qwen2moe", drop_tensors=("blk.1.ffn_up_exps.weight",)))
    with pytest.raises(GGUFFormatError, match="missing hparam qwen3moe.expert_count"):
        open_model(random_gguf("qwen3moe", drop_keys=("expert_count",)))
    with pytest.raises(GGUFFormatError, match="does not exist"):
        open_model("/nonexistent/model.gguf")


def test_resolve_model_maps_demo_to_the_packaged_asset():
    assert str(resolve_model("some/model.gguf")) == "some/model.gguf"
    if demo_model_path().is_file():
        assert resolve_model("demo") == demo_model_path()
    else:
        with pytest.raises(GGUFFormatError, match="healsweep demo build"):
            resolve_model("demo")


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_tokenizer_from_gguf_round_trips_like_its_source(random_gguf, tiny_tokenizer, text):
    tok = open_model(random_gguf("qwen2moe")).tokenizer()
    ours, ref = tok.encode(text), tiny_tokenizer.encode(text)
    assert ours.ids == ref.ids
    assert tok.decode(ours.ids) == tiny_tokenizer.decode(ref.ids)
    assert tok.decode(ours.ids, skip_special_tokens=False) == text


def test_chatml_control_tokens_are_single_special_ids(random_gguf, tiny_tokenizer):
    model = open_model(random_gguf("qwen2moe"))
    tok = model.tokenizer()
    ids = tok.encode("<|im_start|>assistant\n<think>x</think><|im_end|>").ids
    for special in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert tok.token_to_id(special) in ids
        assert tok.token_to_id(special) == tiny_tokenizer.token_to_id(special)
    assert model.metadata("tokenizer.ggml.eos_token_id") == tok.token_to_id("<|im_end|>")
    assert tok.decode(ids) == "assistant\n<think>x</think>"  # control tokens skipped, <think> kept


def test_tokenizer_metadata_round_trips_and_gpt2_regex_is_kept(tiny_tokenizer):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    meta = tokenizer_metadata_from_tokenizer(tiny_tokenizer, eos="<|im_end|>")
    assert tokenizer_metadata_from_tokenizer(build_tokenizer(meta), eos="<|im_end|>") == meta
    gpt2 = Tokenizer(models.BPE())
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    gpt2.decoder = decoders.ByteLevel()
    gpt2.train_from_iterator(TEXTS * 3, trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"], show_progress=False))
    gpt2_meta = tokenizer_metadata_from_tokenizer(gpt2)
    assert gpt2_meta.pre == "gpt-2"
    rebuilt = build_tokenizer(gpt2_meta)
    for text in TEXTS:
        assert rebuilt.encode(text).ids == gpt2.encode(text).ids


def test_tokenizer_json_override_and_its_errors(random_gguf, tiny_tokenizer, tmp_path):
    path = tmp_path / "tokenizer.json"
    tiny_tokenizer.save(str(path))
    model = open_model(random_gguf("qwen2moe"), tokenizer_path=path)
    assert model.tokenizer().encode(CHATML).ids == tiny_tokenizer.encode(CHATML).ids
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        open_model(random_gguf("qwen2moe"), tokenizer_path=tmp_path / "bad.json").tokenizer()
    hp = _hparams()
    bare = write_model(tmp_path / "bare.gguf", "qwen2moe", hp,
                       RandomTensors(expected_tensor_shapes(hp), seed=0))
    with pytest.raises(TokenizerError, match="no tokenizer.ggml"):
        open_model(bare).tokenizer()


def test_writer_refuses_rows_that_do_not_fit_the_block_size(tmp_path):
    hp = _hparams(n_embd=48, n_head=3, head_dim=16)
    tensors = RandomTensors(expected_tensor_shapes(hp), seed=0)
    with pytest.raises(GGUFFormatError, match="not a multiple of its block size 32"):
        write_model(tmp_path / "x.gguf", "qwen2moe", hp, tensors,
                    {"blk.0.attn_q.weight": QT.Q8_0})
    assert not os.path.exists(tmp_path / "x.gguf")


class _NoShapes(dict):
    """A mapping of tensors that cannot tell their shapes up front (a lazy one without
    shape_of): the writer then spools the data before the tensor infos."""

    def __init__(self, lazy):
        super().__init__()
        self._lazy = lazy

    def __getitem__(self, name):
        return self._lazy[name]

    def __iter__(self):
        return iter(self._lazy)

    def __len__(self):
        return len(self._lazy)


def test_tensors_written_in_place_give_the_bytes_of_a_spooled_write(tmp_path):
    """With shapes known up front the data goes straight to its place (no spooled copy of a
    17 GB model on its way); the file is byte for byte the one the spooled path writes, every
    storage type included, and a model re-encoded from its own lazy tensors round-trips."""
    hp = _hparams()
    shapes = expected_tensor_shapes(hp)
    types = {"blk.0.ffn_up_exps.weight": QT.Q8_0, "blk.1.ffn_down_exps.weight": QT.Q4_0,
             "blk.0.attn_q.weight": QT.BF16, "output.weight": QT.F32}  # fmt: skip
    lazy = RandomTensors(shapes, seed=3)
    assert hasattr(lazy, "shape_of")
    direct = write_model(tmp_path / "direct.gguf", "qwen2moe", hp, lazy, types)
    spooled = write_model(tmp_path / "spooled.gguf", "qwen2moe", hp, _NoShapes(lazy), types)
    arrays = write_model(tmp_path / "arrays.gguf", "qwen2moe", hp,
                         {n: lazy[n] for n in lazy}, types)  # fmt: skip
    assert direct.read_bytes() == spooled.read_bytes() == arrays.read_bytes()
    model = open_model(direct)
    again = write_model(tmp_path / "again.gguf", "qwen2moe", hp, model.tensors(),
                        {n: model.tensor_type(n) for n in model.tensor_names})  # fmt: skip
    reread = open_model(again)
    for name in model.tensor_names:
        assert reread.tensor_type(name) == model.tensor_type(name)
        np.testing.assert_array_equal(reread.tensor(name), model.tensor(name))
