"""`healsweep model slice`: layer ranges of real GGUF files, checked with gguf-py's own reader."""

from __future__ import annotations

import signal

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from _cli import run_cli
from healsweep.errors import GGUFFormatError, SliceError
from healsweep.gguf_io import (
    ModelHparams,
    parse_layer_range,
    slice_model,
    tokenizer_metadata_from_tokenizer,
)
from healsweep.model import expected_tensor_shapes, forward, open_model, write_model
from healsweep.model.synthetic import RandomTensors

PROVENANCE = ("healsweep.slice.source_fingerprint", "healsweep.slice.layers")
MIXED_TYPES = {
    "ffn_gate_exps.weight": "Q8_0",
    "ffn_up_exps.weight": "Q4_0",
    "ffn_down_exps.weight": "Q5_1",
    "attn_q.weight": "BF16",
}


def _run(*args, tmp_path, preexec_fn=None):
    return run_cli(*args, cache=tmp_path / "cache", preexec_fn=preexec_fn)


def _fields(path):
    """key → (value types, contents) as gguf-py reads them, header pseudo-fields left out."""
    reader = GGUFReader(path)
    return {
        k: (f.types, f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")
    }


def _tensors(path):
    """name → (ggml type, shape, stored bytes) as gguf-py reads them."""
    reader = GGUFReader(path)
    return {t.name: (t.tensor_type, t.shape.tolist(), t.data.tobytes()) for t in reader.tensors}


@pytest.mark.parametrize(
    ("arch", "start", "stop"), [("qwen2moe", 1, 3), ("qwen3moe", 0, 4), ("qwen3moe", 3, 4)]
)
def test_slice_renumbers_blocks_and_keeps_everything_else(random_gguf, tmp_path, arch, start, stop):
    src = random_gguf(arch, n_layer=4, types=MIXED_TYPES)
    out = slice_model(open_model(src), (start, stop), tmp_path / "slice.gguf")
    sliced = open_model(out)
    assert sliced.hparams == open_model(src).hparams.replace(n_layer=stop - start)

    src_fields, out_fields = _fields(src), _fields(out)
    assert list(out_fields) == list(src_fields) + list(PROVENANCE)  # order kept, keys appended
    block_count = f"{arch}.block_count"
    for key, (types, value) in src_fields.items():
        expected = stop - start if key == block_count else value
        assert out_fields[key] == (types, expected), key
    assert out_fields[PROVENANCE[0]][1] == open_model(src).fingerprint
    assert out_fields[PROVENANCE[1]][1] == f"{start}:{stop}"

    src_tensors, out_tensors = _tensors(src), _tensors(out)
    expected_names = {n for n in src_tensors if not n.startswith("blk.")} | {
        f"blk.{int(n.split('.')[1]) - start}.{n.split('.', 2)[2]}"
        for n in src_tensors
        if n.startswith("blk.") and start <= int(n.split(".")[1]) < stop
    }
    assert set(out_tensors) == expected_names
    for name, stored in out_tensors.items():
        if name.startswith("blk."):
            _, i, suffix = name.split(".", 2)
            name = f"blk.{int(i) + start}.{suffix}"
        assert stored[0] == src_tensors[name][0] and stored[1] == src_tensors[name][1], name
        assert stored[2] == src_tensors[name][2], name
    reader = GGUFReader(out)
    assert all(t.data_offset % reader.alignment == 0 for t in reader.tensors)
    assert out.stat().st_size < src.stat().st_size or (start, stop) == (0, 4)


def test_slice_0_2_gives_the_logits_of_the_source_cut_after_two_layers(random_gguf, tmp_path):
    src = open_model(random_gguf("qwen2moe", n_layer=4, types={"ffn_down_exps.weight": "Q8_0"}))
    ids = [np.arange(3, 60, dtype=np.int32), np.arange(100, 131, dtype=np.int32)]
    head = open_model(slice_model(src, (0, 2), tmp_path / "head.gguf"))  # an open model
    expected = forward(src.with_hparams(n_layer=2), ids).logits
    got = forward(head, ids).logits
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_array_equal(g, e)
    middle = forward(open_model(slice_model(src, (1, 3), tmp_path / "mid.gguf")), ids).logits
    assert [m.shape for m in middle] == [g.shape for g in got]
    assert all(np.isfinite(m).all() for m in middle)
    assert not np.allclose(middle[0], got[0])  # other layers, other logits


def test_a_slice_of_a_slice_is_the_direct_slice(random_gguf, tmp_path):
    src = random_gguf("qwen3moe", n_layer=4, types=MIXED_TYPES)
    outer = slice_model(open_model(src), (1, None), tmp_path / "outer.gguf")
    nested = slice_model(open_model(outer), (1, 3), tmp_path / "nested.gguf")
    direct = slice_model(open_model(src), (2, 4), tmp_path / "direct.gguf")
    assert _tensors(nested) == _tensors(direct)
    # the provenance names the original model and its layers, so the whole file is the same
    assert _fields(nested)[PROVENANCE[1]][1] == "2:4"
    assert nested.read_bytes() == direct.read_bytes()
    assert (
        slice_model(open_model(src), (None, 2), tmp_path / "a.gguf").read_bytes()
        == slice_model(open_model(src), (0, 2), tmp_path / "b.gguf").read_bytes()
    )


def test_array_metadata_keeps_its_types_and_per_layer_arrays_are_cut(tiny_tokenizer, tmp_path):
    hp = ModelHparams(
        arch="qwen2moe",
        n_layer=4,
        n_embd=64,
        n_head=4,
        n_head_kv=2,
        head_dim=16,
        n_expert=4,
        n_expert_used=2,
        n_ff_exp=32,
        n_ff_shexp=64,
        n_vocab=tiny_tokenizer.get_vocab_size(),
        rope_freq_base=10000.0,
        rms_norm_eps=1e-6,
        context_length=256,
        norm_topk_prob=False,
    )
    extra = {
        "general.tags": [f"tag-{i}-é" for i in range(5000)],
        "general.scores": [0.5 * i for i in range(7)],
        "general.four_ints": [1, 2, 3, 4],  # not an {arch}.* key: copied whole
        "qwen2moe.per_layer_width": [10, 11, 12, 13],
        "qwen2moe.rope_dims": -3,
    }
    src = write_model(
        tmp_path / "src.gguf",
        "qwen2moe",
        hp,
        RandomTensors(expected_tensor_shapes(hp), seed=1),
        None,
        tokenizer_metadata_from_tokenizer(tiny_tokenizer, bos="<|endoftext|>", eos="<|im_end|>"),
        extra_metadata=extra,
    )
    out = slice_model(open_model(src), (1, 3), tmp_path / "slice.gguf")
    src_fields, out_fields = _fields(src), _fields(out)
    assert out_fields["qwen2moe.per_layer_width"] == (
        src_fields["qwen2moe.per_layer_width"][0],
        [11, 12],
    )
    for key in (
        "general.tags",
        "general.scores",
        "general.four_ints",
        "qwen2moe.rope_dims",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
    ):
        assert out_fields[key] == src_fields[key], key
    assert out_fields["general.tags"][0] == [GGUFValueType.ARRAY, GGUFValueType.STRING]
    assert (
        open_model(out).tokenizer().encode("<|im_start|>user hi").ids
        == open_model(src).tokenizer().encode("<|im_start|>user hi").ids
    )


def test_parse_layer_range():
    assert parse_layer_range("1:3") == (1, 3)
    assert parse_layer_range(" 2: ") == (2, None)
    assert parse_layer_range(":2") == (None, 2)
    for bad in ("", ":", "3", "1:2:3", "a:b", "1-3", "1.5:2"):
        with pytest.raises(SliceError, match="not of the form A:B"):
            parse_layer_range(bad)


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ("two", "layer range 'two' is not of the form A:B"),
        ("3:1", "layer range 3:1 is empty (A must be less than B)"),
        ("2:2", "layer range 2:2 is empty"),
        ("0:5", "layer range 0:5 runs past the 4 layers of"),
        ("-1:2", "layer range -1:2 has a negative layer"),
        ("5:", "layer range 5: is empty"),
    ],
)
def test_cli_bad_ranges_give_one_line_and_exit_1(random_gguf, tmp_path, layers, message):
    src = random_gguf("qwen2moe", n_layer=4)
    done = _run(
        "model", "slice", src, "--layers", layers, "--out", tmp_path / "s.gguf", tmp_path=tmp_path
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), done.stderr
    assert "Traceback" not in done.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name != "cache"] == []  # nothing written


def test_bad_outputs_and_sources_are_refused_before_writing(random_gguf, tmp_path):
    src = random_gguf("qwen2moe", n_layer=4)
    with pytest.raises(SliceError, match="is the source model itself"):
        slice_model(open_model(src), (0, 2), src)
    with pytest.raises(SliceError, match="output folder .* does not exist"):
        slice_model(open_model(src), (0, 2), tmp_path / "missing" / "s.gguf")
    with pytest.raises(SliceError, match="is a folder"):
        slice_model(open_model(src), (0, 2), tmp_path)
    (tmp_path / "text.gguf").write_text("not a model\n")
    with pytest.raises(GGUFFormatError, match="is not a GGUF file"):
        slice_model(open_model(tmp_path / "text.gguf"), (0, 2), tmp_path / "s.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.gguf"]


def test_cli_slice_writes_a_model_and_one_line(random_gguf, tmp_path):
    src = random_gguf("qwen3moe", n_layer=4)
    out = tmp_path / "two.gguf"
    done = _run("model", "slice", src, "--layers", "1:3", "--out", out, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"wrote {out}: layers 1:3 of {src} (2 of 4), ")
    assert open_model(out).hparams.n_layer == 2
    missing = _run(
        "model",
        "slice",
        src,
        "--layers",
        "0:2",
        "--out",
        tmp_path / "no" / "x.gguf",
        tmp_path=tmp_path,
    )
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1
    assert "output folder" in missing.stderr and "Traceback" not in missing.stderr
    over = _run("model", "slice", src, "--layers", "0:2", "--out", src, tmp_path=tmp_path)
    assert over.returncode == 1 and len(over.stderr.strip().splitlines()) == 1
    assert "is the source model itself" in over.stderr and open_model(src).hparams.n_layer == 4


def test_a_slice_that_runs_out_of_space_keeps_the_old_output_and_leaves_no_temp(
    random_gguf, tmp_path
):
    import resource

    src = random_gguf("qwen3moe", n_layer=4)
    folder = tmp_path / "out"
    folder.mkdir()
    out = folder / "two.gguf"
    out.write_bytes(b"the previous slice")
    limit = 16 * 1024  # far below the slice: the write fails half-way with EFBIG

    def limit_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    assert src.stat().st_size > 4 * limit
    done = _run(
        "model", "slice", src, "--layers", "1:3", "--out", out,
        tmp_path=tmp_path, preexec_fn=limit_files,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: cannot write {out}: File too large; free disk space or pass another --out path"
    ]
    assert sorted(p.name for p in folder.iterdir()) == ["two.gguf"]
    assert out.read_bytes() == b"the previous slice"
