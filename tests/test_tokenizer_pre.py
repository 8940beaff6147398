"""The ``tokenizer.ggml.pre`` variants: each family's split regexes, checked against llama.cpp.

The default tier checks what each family's regexes are for (digit runs, CJK runs) and the
one-line error for an unknown name; the slow tier tokenizes the same texts with llama.cpp
(``llama-cpp-python``, ``vocab_only``) from the same GGUF and wants identical ids, and a file
built with the wrong family's regexes must disagree with it.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from healsweep.errors import TokenizerError
from healsweep.gguf_io import build_tokenizer, tokenizer_metadata_from_tokenizer
from healsweep.gguf_io._tokenizer import PRE_PATTERNS
from healsweep.model import open_model
from healsweep.model.synthetic import train_tiny_tokenizer, write_random_model

TEXTS = [
    "Numbers 1234567 and 3.14159, 2024-05-01!",
    "日本語のテキスト 東京は晴れです。カタカナ and a東京",
    "def f(x):\n    return x**2  # sq\n\n\n",
    "It's   spaced\t\ttabs \r\n end ",
    "<|im_start|>user\nhi<|im_end|>\n<think>\nok\n</think>",
    "émigré Ωmega ÀÉÎ 𝔘nicode 😀 ['a'], {\"k\": -1}",
]


@pytest.fixture(scope="module")
def tokenizers_by_pre():
    return {pre: train_tiny_tokenizer(pre=pre) for pre in PRE_PATTERNS}


def _pieces(tokenizer, text: str) -> list[str]:
    return [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def _gguf_tokenizer(tokenizer, pre: str):
    meta = tokenizer_metadata_from_tokenizer(tokenizer, eos="<|im_end|>")
    return build_tokenizer(dataclasses.replace(meta, pre=pre))


@pytest.mark.parametrize(
    ("pre", "digits"),
    [
        ("qwen2", ["1", "2", "3", "4", "5", "6", "7"]),
        ("gpt-2", ["1234567"]),
        ("olmo", ["1234567"]),
        ("deepseek-v3", ["123", "456", "7"]),
        ("glm4", ["123", "456", "7"]),
        ("llama-bpe", ["123", "456", "7"]),
    ],
)
def test_digit_runs_split_as_each_family_does(tokenizers_by_pre, pre, digits):
    tok = _gguf_tokenizer(tokenizers_by_pre[pre], pre)
    assert _pieces(tok, "abc1234567") == ["abc", *digits]


def test_deepseek_v3_splits_cjk_runs_off_latin_letters(tokenizers_by_pre):
    deepseek = _gguf_tokenizer(tokenizers_by_pre["deepseek-v3"], "deepseek-v3")
    qwen = _gguf_tokenizer(tokenizers_by_pre["qwen2"], "qwen2")
    latin, cjk = "a", "東京"
    assert len(_pieces(deepseek, latin + cjk)) == 2
    assert len(_pieces(qwen, latin + cjk)) == 1


def test_tokenizer_json_regexes_map_back_to_their_pre_name(tokenizers_by_pre):
    for pre, tok in tokenizers_by_pre.items():
        meta = tokenizer_metadata_from_tokenizer(tok)
        # names sharing regexes come back as the first of them (glm4 -> llama-bpe, olmo -> gpt-2)
        assert PRE_PATTERNS[meta.pre] == PRE_PATTERNS[pre]


def test_unknown_pre_tokenizer_is_one_line_naming_the_supported(tiny_tokenizer):
    meta = dataclasses.replace(tokenizer_metadata_from_tokenizer(tiny_tokenizer), pre="kimi-k2")
    with pytest.raises(TokenizerError, match="'kimi-k2' is not supported") as info:
        build_tokenizer(meta, "x.gguf")
    message = str(info.value)
    assert "\n" not in message and all(name in message for name in PRE_PATTERNS)


_LLAMA_TOKENIZE = """
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
print(json.dumps([llm.tokenize(t.encode(), add_bos=False, special=True)
                  for t in json.loads(sys.argv[2])]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("pre", sorted(PRE_PATTERNS))
def test_token_ids_match_llama_cpp(tmp_path, tokenizers_by_pre, pre):
    pytest.importorskip("llama_cpp")
    path = write_random_model(tmp_path / "m.gguf", tokenizer=tokenizers_by_pre[pre], pre=pre)
    model = open_model(path)
    assert model.metadata("tokenizer.ggml.pre") == pre
    out = subprocess.run(
        [sys.executable, "-c", _LLAMA_TOKENIZE, str(path), json.dumps(TEXTS)],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    reference = json.loads(out.stdout)
    ours = [model.tokenizer().encode(t, add_special_tokens=False).ids for t in TEXTS]
    assert ours == reference
    if pre in ("deepseek-v3", "glm4", "llama-bpe"):  # the wrong family's regexes disagree
        wrong = _gguf_tokenizer(tokenizers_by_pre[pre], "qwen2")
        assert [wrong.encode(t, add_special_tokens=False).ids for t in TEXTS] != reference
