"""The architecture registry against gguf-py's own tables, and the shape of the code around it.

Each architecture's tensor layout must name only tensors gguf-py lists for that architecture
(``gguf.MODEL_TENSORS``), and its metadata only keys gguf-py spells (``gguf.Keys``): an independent
check of the names llama.cpp reads. The header reader is checked against gguf-py's reader on files
gguf-py can open; shared code has no branch on an architecture's name and reaches into no other
package's private names.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest

import healsweep
from healsweep.gguf_io import TensorType, read_header
from healsweep.model import ARCHITECTURES, SUPPORTED_ARCHS, open_model
from healsweep.model.synthetic import write_random_model

SRC = Path(healsweep.__file__).parent
# one random file per architecture and layout variant (MLA both ways, with and without q_lora)
VARIANTS = [(arch, {}) for arch in SUPPORTED_ARCHS] + [
    ("deepseek2", dict(kv_b_split=True, q_lora_rank=0, gating="softmax", norm_topk_prob=False)),
    ("glm4moe", dict(n_layer=3, n_leading_dense=1)),
]


def _gguf_py_keys(arch: str) -> set[str]:
    keys = set()
    for group in (gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope):
        spelled = (v for k, v in vars(group).items() if k.isupper() and isinstance(v, str))
        keys |= {v.replace("{arch}", arch) for v in spelled if v.startswith("{arch}.")}
    return keys


@pytest.fixture(scope="module")
def variants(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("arch-registry")
    return [
        open_model(write_random_model(root / f"{i}.gguf", arch, tokenizer=tiny_tokenizer, **kw))
        for i, (arch, kw) in enumerate(VARIANTS)
    ]


def test_every_module_registers_the_architecture_it_is_named_after():
    for name, arch in ARCHITECTURES.items():
        assert arch.name == name
        assert type(arch).__module__ == f"healsweep.model.{name}"
    assert SUPPORTED_ARCHS == tuple(ARCHITECTURES)


def test_layouts_name_only_tensors_gguf_py_lists_for_the_architecture(variants):
    for model in variants:
        arch = ARCHITECTURES[model.arch]
        gguf_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == model.arch)
        known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf_arch]}
        for name in arch.tensor_shapes(model.hparams):
            base = name.rsplit(".", 1)[0]
            layer = re.match(r"blk\.(\d+)\.", base)
            generic = base if layer is None else base.replace(layer.group(0), "blk.{bid}.", 1)
            assert generic in known, (model.arch, name)


def test_metadata_uses_only_keys_gguf_py_spells_and_reads_back(variants):
    for model in variants:
        arch = ARCHITECTURES[model.arch]
        written = arch.metadata(model.hparams)
        assert set(written) <= _gguf_py_keys(model.arch), model.arch
        for key, value in written.items():  # what the file holds is what the arch wrote
            assert model.metadata(key) == pytest.approx(value), (model.arch, key)


def test_the_header_reader_agrees_with_gguf_pys_reader(random_gguf):
    types = {"ffn_up_exps.weight": "Q8_0", "ffn_down_exps.weight": "Q4_0", "attn_q.weight": "Q4_1"}
    path = random_gguf("qwen3moe", types=types)
    ours, theirs = read_header(path), gguf.GGUFReader(path)
    their_fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(their_fields)
    for key, field in their_fields.items():
        item = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        assert (ours.fields[key].type, ours.fields[key].item_type) == (field.types[0], item)
        assert ours.fields[key].value == field.contents(), key
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    model = open_model(path)
    for mine, t in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.type == t.tensor_type and isinstance(mine.type, TensorType)
        assert mine.dims == tuple(t.shape.tolist())
        assert (mine.offset, mine.n_bytes) == (t.data_offset, t.n_bytes)
        _, stored = model.raw_tensor(t.name)
        assert stored.dtype == t.data.dtype and stored.shape == t.data.shape
        np.testing.assert_array_equal(stored, t.data)


def _sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text(encoding="utf-8")) for p in sorted(SRC.rglob("*.py"))]


def test_no_branch_on_an_architecture_name_outside_its_module():
    names = "|".join(SUPPORTED_ARCHS)
    branch = re.compile(rf"""(==|!=)\s*["']({names})["']|\bin\s*\(\s*["']({names})["']""")
    own = {SRC / "model" / f"{name}.py" for name in SUPPORTED_ARCHS}
    found = [
        f"{path.relative_to(SRC)}:{n}"
        for path, text in _sources()
        if path not in own
        for n, line in enumerate(text.splitlines(), 1)
        if branch.search(line)
    ]
    assert found == []


def test_no_private_name_of_gguf_ray_optuna_or_jax_is_used():
    private = re.compile(
        r"\b(gguf|ray|optuna|jax)(\.[A-Za-z]\w*)*\._[a-z]\w*"  # gguf.quants._type_traits, ...
        r"|\b(GGMLQuantizationType|GGUFReader|GGUFWriter)\._\w+"  # their private members
        r"|from (gguf|ray|optuna|jax)[\w.]* import _\w+"
    )
    found = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path, text in _sources()
        for n, line in enumerate(text.splitlines(), 1)
        if private.search(line)
    ]
    assert found == []
