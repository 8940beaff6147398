"""Requantizing Part B's shared-expert down weight to its own storage type, decoded by gguf-py."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from healsweep.cache import StageCache
from healsweep.data.corpus import load_corpus
from healsweep.errors import GGUFFormatError
from healsweep.heal.export import write_healed_gguf
from healsweep.heal.knobs import CalibrationConfig, Knobs
from healsweep.heal.pipeline import build_student
from healsweep.model import open_model
from healsweep.model.synthetic import write_random_model
from healsweep.quant.formats import requantize


def _values(rng, rows=8, cols=64):
    return (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)


def test_float_types_stay_float():
    values = _values(np.random.default_rng(0))
    raw, dense = requantize("w", values, T.F32)
    np.testing.assert_array_equal(raw, values)
    np.testing.assert_array_equal(dense, values)
    raw, dense = requantize("w", values, T.F16)
    assert raw.dtype == np.float16
    np.testing.assert_array_equal(dense, values.astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.IQ4_NL])
def test_quantized_types_decode_with_gguf_py_to_what_the_student_runs(qtype):
    values = _values(np.random.default_rng(1))
    raw, dense = requantize("w", values, qtype)
    assert raw.dtype == np.uint8
    np.testing.assert_allclose(dequantize(raw, qtype).reshape(values.shape), dense, rtol=0, atol=0)
    if qtype != T.IQ4_NL:
        np.testing.assert_array_equal(raw, quantize(values, qtype))
    # a 4/8-bit grid keeps the tensor close: relative error well under the 2-bit experts'
    assert np.linalg.norm(dense - values) / np.linalg.norm(values) < 0.15


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q8_0, T.IQ4_NL])
def test_the_part_b_entry_keeps_the_bytes_alone_and_reads_back_the_same_values(tmp_path, qtype):
    """The dense values are decoded from the stored bytes when the entry is read, bit for bit
    what the requantization returned (so a trial served from the cache runs what one that
    computed the entry ran)."""
    from healsweep.cache import content_key
    from healsweep.heal.ridge import HealedShexp

    values = _values(np.random.default_rng(4), rows=16, cols=128)
    raw, dense = requantize("w", values, qtype)
    healed = HealedShexp(raw, dense, {"storage_type": qtype.name, "rank": 3})
    arrays, meta = healed.to_entry()
    assert list(arrays) == ["raw"]
    key = content_key("part_b", 4, {"qtype": qtype.name})
    StageCache(tmp_path).put("part_b", key, arrays, meta)
    from healsweep.cache import RecentEntries
    from healsweep.runtime import current

    current().owned(RecentEntries).clear()  # read from disk, as a later trial does
    back = HealedShexp.from_entry(*StageCache(tmp_path).get("part_b", key))
    assert back.dense.dtype == np.float32 and back.dense.shape == values.shape
    np.testing.assert_array_equal(back.dense.view(np.uint32), dense.view(np.uint32))
    np.testing.assert_array_equal(back.raw, raw)
    assert back.stats == healed.stats
    assert StageCache(tmp_path).path("part_b", key).stat().st_size < raw.nbytes + 4096


def test_unsupported_type_and_bad_row_length_are_clear_errors():
    values = _values(np.random.default_rng(2), cols=256)
    with pytest.raises(GGUFFormatError, match="Q4_K.*ridge: false"):
        requantize("blk.0.ffn_down_shexp.weight", values, T.Q4_K)
    with pytest.raises(GGUFFormatError, match="multiple of its block size"):
        requantize("w", _values(np.random.default_rng(3), cols=48), T.Q8_0)


def _with_iq4_nl_shexp(src, dst):
    """Copy a GGUF with every ffn_down_shexp stored as IQ4_NL (healsweep's codec)."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.get_field("general.architecture").contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for tensor in reader.tensors:
        if tensor.name.endswith("ffn_down_shexp.weight"):
            values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            raw, _ = requantize(tensor.name, values, T.IQ4_NL)
            writer.add_tensor(tensor.name, raw, raw_dtype=T.IQ4_NL)
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data),
                              raw_dtype=tensor.tensor_type if tensor.data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_iq4_nl_shared_expert_is_healed_and_written_as_iq4_nl(tmp_path):
    src = write_random_model(tmp_path / "f16.gguf", n_layer=1, n_ff_exp=64)
    model = open_model(_with_iq4_nl_shexp(src, tmp_path / "iq4.gguf"))
    assert model.tensor_type("blk.0.ffn_down_shexp.weight") == T.IQ4_NL
    rows = [{"doc_id": f"c{i}", "source": "c", "index": i, "stratum": "s", "pool": "calibration",
             "text": "Experts route tokens; healing repairs the damage. " * (4 + i)} for i in range(3)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    student = build_student(model, Knobs(eta=1.0), CalibrationConfig(chunk_length=64),
                            StageCache(tmp_path / "cache"), corpus=load_corpus(tmp_path / "c.jsonl"))
    ridge = student.report["layers"][0]["ridge"]
    assert ridge["storage_type"] == "IQ4_NL" and ridge["relative_update"] > 0
    write_healed_gguf(student, tmp_path / "healed.gguf")
    healed = open_model(tmp_path / "healed.gguf")
    assert healed.tensor_type("blk.0.ffn_down_shexp.weight") == T.IQ4_NL
    np.testing.assert_array_equal(healed.tensor("blk.0.ffn_down_shexp.weight"),
                                  student.replacements[0].down_shexp)
