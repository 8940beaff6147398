"""gpt2-style byte-level BPE tokenizers to and from GGUF ``tokenizer.ggml.*`` metadata.

A GGUF stores the vocabulary (``tokens``, in id order), the merges (``"a b"`` strings in rank
order), a token type per token (1 normal, 3 control, 4 user-defined, ...), the special ids and
the name of the pre-tokenizer regex (``tokenizer.ggml.pre``). The tokenizer built here is a
``tokenizers`` BPE model behind that regex and a byte-level pre-tokenizer, with a byte-level
decoder; control tokens (``<|im_start|>``, ``<|endoftext|>``) become special added tokens and
user-defined tokens (``<think>``) plain added tokens, which is how Qwen ships them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import Keys

from healsweep._inputs import MIB, read_text
from healsweep.errors import TokenizerError
from healsweep.gguf_io._tokenizer_checks import check_merges

TOKENIZER_FILE_LIMIT = 256 * MIB  # a tokenizer.json of 10^6 tokens and merges is ~100 MiB

# ``tokenizer.ggml.pre`` names and their split regexes, applied in order (as llama.cpp and the HF
# tokenizers use them). Names that share regexes are told apart by llama.cpp for other reasons.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (  # Qwen2's with digits in runs of up to three
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEEPSEEK_V3_PATTERNS = (  # digits in threes, CJK and kana runs, then the rest
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"""
    r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
PRE_PATTERNS: dict[str, tuple[str, ...]] = {
    "qwen2": (QWEN2_PATTERN,),
    "gpt-2": (GPT2_PATTERN,),
    "deepseek-v3": DEEPSEEK_V3_PATTERNS,  # DeepSeek-V3/R1 (V2 files name deepseek-llm)
    "llama-bpe": (LLAMA3_PATTERN,),
    "glm4": (LLAMA3_PATTERN,),  # GLM-4.5/4.6
    "olmo": (GPT2_PATTERN,),  # OLMoE
}

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4


@dataclass(frozen=True)
class TokenizerMetadata:
    """The ``tokenizer.ggml.*`` content of a gpt2-style BPE tokenizer."""

    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    pre: str = "qwen2"  # tokenizer.ggml.pre: which split regexes (a key of PRE_PATTERNS)

    def to_gguf_fields(self) -> dict[str, Any]:
        """Metadata key → value, as :func:`write_model` writes them."""
        fields: dict[str, Any] = {
            Keys.Tokenizer.MODEL: "gpt2",
            Keys.Tokenizer.PRE: self.pre,
            Keys.Tokenizer.LIST: list(self.tokens),
            Keys.Tokenizer.TOKEN_TYPE: [int(t) for t in self.token_types],
            Keys.Tokenizer.MERGES: list(self.merges),
        }
        for key, value in (
            (Keys.Tokenizer.BOS_ID, self.bos_id),
            (Keys.Tokenizer.EOS_ID, self.eos_id),
            (Keys.Tokenizer.PAD_ID, self.pad_id),
        ):
            if value is not None:
                fields[key] = int(value)
        return fields


def tokenizer_metadata_from_gguf(get: Callable[[str], Any], where: str) -> TokenizerMetadata:
    """Read ``tokenizer.ggml.*`` through ``get(key)`` (None when absent)."""
    model = get(Keys.Tokenizer.MODEL)
    if model is None:
        raise TokenizerError(
            f"{where} has no tokenizer.ggml.* metadata; pass a tokenizer.json with --tokenizer"
        )
    if model != "gpt2":
        raise TokenizerError(
            f"{where} has a {model!r} tokenizer; only gpt2-style byte-level BPE is supported "
            "here, pass a tokenizer.json with --tokenizer"
        )
    tokens = get(Keys.Tokenizer.LIST) or []
    types = get(Keys.Tokenizer.TOKEN_TYPE) or [TOKEN_NORMAL] * len(tokens)
    return TokenizerMetadata(
        tokens=list(tokens),
        merges=list(get(Keys.Tokenizer.MERGES) or []),
        token_types=[int(t) for t in types],
        bos_id=get(Keys.Tokenizer.BOS_ID),
        eos_id=get(Keys.Tokenizer.EOS_ID),
        pad_id=get(Keys.Tokenizer.PAD_ID),
        pre=get(Keys.Tokenizer.PRE) or "default",
    )


def build_tokenizer(meta: TokenizerMetadata, where: str = "the GGUF"):
    """A ``tokenizers.Tokenizer`` equivalent to ``meta`` (BPE + byte-level behind the split
    regexes its ``tokenizer.ggml.pre`` names, :data:`PRE_PATTERNS`)."""
    # lazy: heavy (tokenizers)
    from tokenizers import AddedToken, Tokenizer, decoders, models

    patterns = PRE_PATTERNS.get("gpt-2" if meta.pre == "default" else meta.pre)
    if patterns is None:
        raise TokenizerError(
            f"{where}: pre-tokenizer {meta.pre!r} is not supported (known: "
            f"{', '.join(PRE_PATTERNS)}); pass a tokenizer.json with --tokenizer"
        )
    if len(meta.token_types) != len(meta.tokens):
        raise TokenizerError(
            f"{where}: {len(meta.tokens)} tokens but {len(meta.token_types)} token types; "
            "the tokenizer metadata is corrupt, re-export the GGUF"
        )
    vocab = {tok: i for i, tok in enumerate(meta.tokens)}
    merges = check_merges(meta.merges, vocab, where)
    try:
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
        tokenizer.pre_tokenizer = byte_level_pre_tokenizer(patterns)
        tokenizer.decoder = decoders.ByteLevel()
        added = [
            AddedToken(tok, special=kind == TOKEN_CONTROL, normalized=False)
            for tok, kind in zip(meta.tokens, meta.token_types, strict=True)
            if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
        ]
        # add_tokens/add_special_tokens keep the ids the vocabulary already gives these strings.
        tokenizer.add_special_tokens([a for a in added if a.special])
        tokenizer.add_tokens([a for a in added if not a.special])
    except Exception as exc:  # tokenizers raises bare Exceptions; what it refused, in one line
        detail = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise TokenizerError(
            f"{where}: the tokenizer metadata ({Keys.Tokenizer.LIST}, {Keys.Tokenizer.MERGES}) "
            f"does not build a BPE tokenizer ({detail}); re-export the GGUF or pass a "
            "tokenizer.json with --tokenizer"
        ) from exc
    return tokenizer


def byte_level_pre_tokenizer(patterns: tuple[str, ...]):
    """The ``tokenizers`` pre-tokenizer: each regex splits (matches kept as pieces), then bytes."""
    # lazy: heavy (tokenizers)
    from tokenizers import Regex, pre_tokenizers

    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in patterns]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def load_tokenizer_file(path: str | Path):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json``; raises :class:`TokenizerError`."""
    # lazy: heavy (tokenizers)
    from tokenizers import Tokenizer

    path = Path(path)
    try:
        text = read_text(path, "tokenizer.json", TOKENIZER_FILE_LIMIT, error=TokenizerError)
    except OSError as exc:
        missing = "does not exist" if isinstance(exc, FileNotFoundError) else "cannot be read"
        raise TokenizerError(f"tokenizer file {path} {missing}; pass a tokenizer.json path") from None
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TokenizerError(
            f"{path} is not a valid tokenizer.json ({first_line}); export it with tokenizers"
        ) from exc


def _pre_name(pre_tokenizer: dict | None) -> str:
    """The ``tokenizer.ggml.pre`` name of a tokenizer.json pre-tokenizer section."""
    if pre_tokenizer is None:
        raise TokenizerError("tokenizer has no pre-tokenizer; only byte-level BPE is supported")
    steps = pre_tokenizer.get("pretokenizers", [pre_tokenizer])
    regexes = tuple(s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split")
    for name, patterns in PRE_PATTERNS.items():
        if regexes == patterns:
            return name
    if not regexes and any(
        s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in steps
    ):
        return "gpt-2"
    raise TokenizerError(
        "tokenizer's pre-tokenizer splits by none of the known byte-level regex sets "
        f"({', '.join(PRE_PATTERNS)}); only those can be stored as GGUF tokenizer metadata"
    )


def tokenizer_metadata_from_tokenizer(
    tokenizer, *, bos: str | None = None, eos: str | None = None, pad: str | None = None
) -> TokenizerMetadata:
    """The GGUF tokenizer metadata of a byte-level BPE ``tokenizers.Tokenizer``.

    ``bos``/``eos``/``pad`` name the special tokens to record as ids (e.g. ``"<|endoftext|>"``).
    Special added tokens become CONTROL tokens, other added tokens USER_DEFINED.
    """
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise TokenizerError(f"tokenizer model is {model.get('type')!r}; only BPE is supported")
    vocab: dict[str, int] = dict(model["vocab"])
    types: dict[int, int] = {}
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        types[added["id"]] = TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED
    n = max(vocab.values()) + 1
    tokens = [""] * n
    for tok, i in vocab.items():
        tokens[i] = tok
    if any(t == "" for t in tokens):
        raise TokenizerError("tokenizer ids are not contiguous; GGUF needs ids 0..V-1")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    def token_id(text: str | None) -> int | None:
        if text is None:
            return None
        if text not in vocab:
            raise TokenizerError(f"special token {text!r} is not in the tokenizer's vocabulary")
        return vocab[text]

    return TokenizerMetadata(
        tokens=tokens,
        merges=merges,
        token_types=[types.get(i, TOKEN_NORMAL) for i in range(n)],
        bos_id=token_id(bos),
        eos_id=token_id(eos),
        pad_id=token_id(pad),
        pre=_pre_name(spec.get("pre_tokenizer")),
    )
