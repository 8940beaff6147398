"""Hostile models and ledgers (issue 47, items 3, 4, 7, 9): chat templates that build at compile
time or through a filter, tokenizer metadata and GGUF headers that contradict themselves, ledger
lines of the wrong types or depth. Each class goes through the real CLI as a child process (the
wrapper of ``test_hostile_files``: one ``error:`` line, exit 1, peak RSS under 1 GB); its
instances are checked in-process where the CLI adds nothing but start-up time.
"""

from __future__ import annotations

import time

import pytest

from healsweep.model.synthetic import write_random_model
from test_hostile_files import refused, run_cli

# --- templates: constant folding, builders estimated before they build, the time limit -------

FOLDED = "{{ 'x'|center(1500000000)|length }}"  # Jinja's optimizer folded this at compile time
BUILDERS = {
    # name: (template, what the refusal names)
    "constant folding": (FOLDED, "'center' would bring"),
    "an autoescape value": ("{% autoescape ('x'|center(1500000000)|length) > 0 %}x"
                            "{% endautoescape %}", "'center' would bring"),
    "batch padding": ("{{ [1]|batch(300000000, 'x')|list|length }}", "'batch' would bring"),
    "slice padding": ("{{ [1]|slice(30000000, 'x')|list|length }}", "'slice' would bring"),
    "a % star width": ("{{ '%*s' % (1500000000, 'x') }}", "'%' would bring"),
    "a format star width": ("{{ '%*s'|format(1500000000, 'x') }}", "'format' would bring"),
    "a nested format width": ("{{ '{:>{}}'.format('x', '1500000000') }}", "'format' would bring"),
    "a width inside a list": ("{{ '{0[0]:>{0[1]}}'.format(['x', 1500000000]) }}",
                              "'format' would bring"),
    "lipsum paragraphs": ("{{ lipsum(1000000) }}", "'generate_lorem_ipsum' would bring"),
    "lipsum words": ("{{ lipsum(3, max=100000000) }}", "'generate_lorem_ipsum' would bring"),
    "indent": ("{{ ('x\n' * 1000000)|indent(1000) }}", "'indent' would bring"),
    "title of many words": ("{{ ('x ' * 10000000)|title|length }}", "'title' would bring"),
    "split into many pieces": ("{{ ('ab ' * 10000000).split()|length }}", "'split' would bring"),
    "a list doubled by +": ("{% set ns = namespace(s=['x']) %}{% for i in range(40) %}"
                            "{% set ns.s = ns.s + ns.s %}{% endfor %}", "'+' would bring"),
    "pprint": ("{{ (range(100000)|list)|pprint }}", "'pprint' would bring"),
}  # fmt: skip
SLOW = {  # Python-level filters whose loops pass none of the template's own checks
    "wordwrap of a long word": "{{ ('x' * 300000)|wordwrap(1) }}",
    "join of many pieces": "{{ (range(100000)|map('string')|list)|join('y' * 1000) }}",
}


def _render(template: str, seconds: float = 1.0) -> str:
    from healsweep.data.chat_template import ChatFormat, RenderLimits
    from healsweep.data.corpus import Message
    from healsweep.errors import ChatTemplateError

    chat = ChatFormat(template, source="T", limits=RenderLimits(seconds=seconds))
    with pytest.raises(ChatTemplateError) as refusal:
        chat.render([Message("user", "hi")])
    return str(refusal.value)


@pytest.mark.parametrize("case", list(BUILDERS))
def test_a_template_builder_is_refused_before_it_builds(case):
    import resource

    template, expected = BUILDERS[case]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    message = _render(template, seconds=30)  # memory, not time, must stop it
    assert expected in message and "over 33,554,432 (32 MiB)" in message, message
    assert time.monotonic() - start < 5
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB
    assert grown < 200 * 1024, f"the peak grew by {grown >> 10} MiB"


@pytest.mark.parametrize("case", list(SLOW))
def test_the_time_limit_holds_inside_a_python_filter(case):
    start = time.monotonic()
    message = _render(SLOW[case], seconds=1)
    assert "it ran past 1 s of wall time" in message, message
    assert time.monotonic() - start < 2  # within 2x of the setting


def test_a_benign_template_keeps_its_constants():
    """Without folding, constant expressions still render (they run in the render instead)."""
    from healsweep.data.chat_template import ChatFormat

    chat = ChatFormat("{{ 'ab'|center(6) ~ '%03d' % 7 ~ '{:>4}'.format('x') ~ [1, 2]|join('-') }}"
                      "{% autoescape false %}{{ lipsum(1, false, 2, 3)|length > 0 }}"
                      "{% endautoescape %}", source="T")  # fmt: skip
    assert chat.render([]) == "  ab  007   x1-2True"


def test_a_constant_folding_template_is_one_line_through_the_cli(tmp_path, tiny_tokenizer,
                                                                  record_property):  # fmt: skip
    path = write_random_model(tmp_path / "m.gguf", n_ff_exp=64, tokenizer=tiny_tokenizer,
                              chat_template=FOLDED)  # fmt: skip
    run = run_cli("score", "--model", path, "--ref", path, "--max-scored", "16",
                  "--max-context", "16", tmp_path=tmp_path)  # fmt: skip
    message = refused(run, record_property)
    assert message.startswith(f"{path}: tokenizer.chat_template was stopped on document ")
    assert "'center' would bring what it built to 1,500,000,001 characters" in message


# --- GGUF headers and tokenizer metadata -------------------------------------------------------


def _patched(src, dst, old: bytes, new: bytes):
    """``src`` with the first ``old`` replaced by ``new`` (of the same length) in ``dst``."""
    data = bytearray(src.read_bytes())
    at = data.index(old)
    data[at : at + len(old)] = new
    dst.write_bytes(data)
    return dst


def _with_dims(src, dst, tensor: str, dims: tuple[int, ...]):
    """``src`` with tensor ``tensor``'s stored dims (ggml ``ne``) replaced, written to ``dst``."""
    import struct

    data = bytearray(src.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack_from("<I", data, at)[0] == len(dims)
    struct.pack_into(f"<{len(dims)}Q", data, at + 4, *dims)
    dst.write_bytes(data)
    return dst


@pytest.fixture(scope="module")
def sound_gguf(tmp_path_factory, tiny_tokenizer):
    return write_random_model(tmp_path_factory.mktemp("sound") / "m.gguf", n_ff_exp=64,
                              tokenizer=tiny_tokenizer)  # fmt: skip


@pytest.fixture(scope="module")
def vocab(tiny_tokenizer):
    from healsweep.gguf_io import tokenizer_metadata_from_tokenizer

    return tokenizer_metadata_from_tokenizer(tiny_tokenizer, bos="<|endoftext|>", eos="<|im_end|>")


DOWN = "blk.0.ffn_down_exps.weight"  # ggml ne (64, 64, 8): rows of n_ff_exp, n_embd, experts


def _tokenizer_case(case: str, vocab) -> dict:
    tokens, types = list(vocab.tokens), list(vocab.token_types)
    if case == "a string bos id":
        return {"tokenizer.ggml.bos_token_id": "one"}
    if case == "string token types":
        return {"tokenizer.ggml.token_type": ["normal"] * len(tokens)}
    if case == "an out-of-range eos id":
        return {"tokenizer.ggml.eos_token_id": len(tokens)}
    if case == "more tokens than embedding rows":
        return {"tokenizer.ggml.tokens": [*tokens, "extra-a", "extra-b"],
                "tokenizer.ggml.token_type": [*types, 1, 1]}  # fmt: skip
    if case == "a 10 MB control token":
        tokens[-1], types[-1] = "A" * 10_000_000, 3
        return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    if case == "a token type out of range":
        return {"tokenizer.ggml.token_type": [*types[:-1], 99]}
    raise KeyError(case)


TOKENIZER_CASES = {
    # name: (message after "PATH: ", through the CLI or not)
    "a string bos id": ("tokenizer.ggml.bos_token_id is a string 'one'; expected the integer id "
                        "of one of the 386 tokens (0 to 385)", True),
    "string token types": ("tokenizer.ggml.token_type is an array of string; expected an array "
                           "of integers", False),
    "an out-of-range eos id": ("tokenizer.ggml.eos_token_id is 386; expected the integer id of "
                               "one of the 386 tokens", False),
    "more tokens than embedding rows": ("tokenizer.ggml.tokens holds 388 tokens but the "
                                        "embedding (token_embd.weight) has 386 rows", True),
    "a 10 MB control token": ("tokenizer.ggml.tokens[385] is a control or user-defined token of "
                              "10,000,000 bytes; such tokens may have at most 4,096", True),
    "a token type out of range": ("tokenizer.ggml.token_type[385] is 99; expected a token type "
                                  "0 to 6", False),
}  # fmt: skip


def _score(path) -> tuple:
    return ("score", "--model", path, "--ref", path, "--max-scored", "16", "--max-context", "16")


@pytest.mark.parametrize("case", list(TOKENIZER_CASES))
def test_inconsistent_tokenizer_metadata_is_one_line(case, tmp_path, tiny_tokenizer, vocab,
                                                     record_property):  # fmt: skip
    """Checked when the model is opened, before anything reads a token; the classes go
    through `score` as a child, the other instances through open_model (the same raise)."""
    from healsweep.errors import TokenizerError
    from healsweep.model import open_model

    expected, through_cli = TOKENIZER_CASES[case]
    path = write_random_model(tmp_path / "t.gguf", n_ff_exp=64, tokenizer=tiny_tokenizer,
                              extra_metadata=_tokenizer_case(case, vocab))  # fmt: skip
    if through_cli:
        message = refused(run_cli(*_score(path), tmp_path=tmp_path), record_property)
    else:
        with pytest.raises(TokenizerError) as refusal:
            open_model(path)
        message = str(refusal.value)
    assert message.startswith(f"{path}: {expected}"), message
    assert message.endswith("re-export the GGUF (or pass a tokenizer.json with --tokenizer)")


def test_merges_naming_unknown_tokens_are_one_line(tmp_path, tiny_tokenizer, vocab,
                                                   record_property):  # fmt: skip
    merges = ["zzz qqq", *vocab.merges]
    path = write_random_model(tmp_path / "t.gguf", n_ff_exp=64, tokenizer=tiny_tokenizer,
                              extra_metadata={"tokenizer.ggml.merges": merges})  # fmt: skip
    message = refused(run_cli(*_score(path), tmp_path=tmp_path), record_property)
    assert message.startswith(f"{path}: tokenizer.ggml.merges[0] is 'zzz qqq'; expected two "
                              "tokens of tokenizer.ggml.tokens separated by a space")  # fmt: skip


HEADER_CASES = {
    # name: (how the sound file is changed, message after "PATH is corrupt in its header: ")
    "dims whose product overflows 64 bits": (
        lambda src, dst: _with_dims(src, dst, DOWN, (64, 2**62, 8)),
        f"tensor '{DOWN}' has dims (64, 4.61e+18, 8): 2,361,183,241,434,822,606,848 elements"),
    "dims that wrap to 0 in int64": (
        lambda src, dst: _with_dims(src, dst, DOWN, (64, 2**58, 1024)),
        f"tensor '{DOWN}' has dims (64, 2.88e+17, 1,024)"),
    "dims of more bytes than the file": (
        lambda src, dst: _with_dims(src, dst, DOWN, (64, 2**40, 8)),
        f"tensor '{DOWN}' has dims (64, 1.1e+12, 8): 1,125,899,906,842,624 bytes of data, more "
        "than the file's"),
    "a duplicate tensor name": (
        lambda src, dst: _patched(src, dst, b"blk.1.attn_q.weight", b"blk.0.attn_q.weight"),
        "tensor 'blk.0.attn_q.weight' appears twice"),
    "a duplicate metadata key": (
        lambda src, dst: _patched(src, dst, b"tokenizer.ggml.bos_token_id",
                                  b"tokenizer.ggml.eos_token_id"),
        "metadata key 'tokenizer.ggml.eos_token_id' appears twice"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_a_header_that_cannot_be_is_one_line(case, tmp_path, sound_gguf):
    """Every command opens a model through read_gguf (model info, score, heal, slice)."""
    from healsweep.errors import GGUFFormatError
    from healsweep.gguf_io import read_gguf

    change, expected = HEADER_CASES[case]
    path = change(sound_gguf, tmp_path / "h.gguf")
    with pytest.raises(GGUFFormatError) as refusal:
        read_gguf(path)
    assert str(refusal.value).startswith(f"{path} is corrupt in its header: {expected}")


@pytest.mark.parametrize(
    "case", ["dims whose product overflows 64 bits", "a duplicate tensor name"]
)
def test_a_header_that_cannot_be_is_one_line_through_the_cli(case, tmp_path, sound_gguf,
                                                             record_property):  # fmt: skip
    """`model slice` wrote a file gguf-py refuses from overflowing dims; `heal` crashed."""
    change, expected = HEADER_CASES[case]
    path = change(sound_gguf, tmp_path / "h.gguf")
    run = run_cli("model", "slice", path, "--layers", "0:1", "--out", tmp_path / "s.gguf",
                  tmp_path=tmp_path)  # fmt: skip
    message = refused(run, record_property)
    assert message.startswith(f"{path} is corrupt in its header: {expected}"), message
    assert not (tmp_path / "s.gguf").exists()


def _header_only(path, fields: list[tuple[str, int, bytes]]):
    """A GGUF of no tensors and these ``(key, value type, packed value)`` fields."""
    import struct

    body = b"".join(struct.pack("<Q", len(k)) + k.encode() + struct.pack("<I", t) + v
                    for k, t, v in fields)  # fmt: skip
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields)) + body)
    return path


def test_metadata_arrays_cost_at_most_twice_their_bytes(tmp_path):
    """A 32 MB uint8 array and 256 K short strings (2.3 MB): read as stored bytes, not as Python
    lists (10x and 6x their bytes before); traced allocations of the read stay under 2x."""
    import struct
    import tracemalloc

    import numpy as np

    from healsweep.gguf_io import read_header

    n = 32 << 20
    numbers = struct.pack("<IQ", 0, n) + np.arange(n, dtype=np.uint64).astype(np.uint8).tobytes()
    k = 1 << 18
    strings = struct.pack("<IQ", 8, k) + (struct.pack("<Q", 1) + b"x") * k
    path = _header_only(tmp_path / "arrays.gguf", [("big.uint8", 9, numbers),
                                                   ("big.strings", 9, strings)])  # fmt: skip
    stored = path.stat().st_size
    tracemalloc.start()
    try:
        header = read_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * stored, f"{peak / stored:.1f}x the file's bytes"
    assert len(header.get("big.uint8")) == n and header.get("big.uint8")[257] == 1
    assert len(header.get("big.strings")) == k and header.get("big.strings")[k - 1] == "x"
    assert header.get("big.uint8")[:3] == [0, 1, 2]


def test_an_array_longer_than_the_file_is_refused_before_it_is_sized(tmp_path):
    import struct

    from healsweep.errors import GGUFFormatError
    from healsweep.gguf_io import read_gguf

    path = _header_only(tmp_path / "a.gguf", [("big.strings", 9, struct.pack("<IQ", 8, 10**12))])
    with pytest.raises(GGUFFormatError, match="an array of 1,000,000,000,000 items runs past"):
        read_gguf(path)
    many = struct.pack("<IQ", 8, 5 << 20) + struct.pack("<Q", 0) * (5 << 20)  # 40 MB of ""
    path = _header_only(tmp_path / "b.gguf", [("many.strings", 9, many)])
    with pytest.raises(GGUFFormatError, match="an array of 5,242,880 strings, over the 4,194,304"):
        read_gguf(path)  # a second per million: refused before the loop
    bad = struct.pack("<IQQ", 8, 2, 1) + b"\xc3" + struct.pack("<Q", 1) + b"\xa9"  # "é" cut in two
    path = _header_only(tmp_path / "c.gguf", [("bad.strings", 9, bad)])
    with pytest.raises(GGUFFormatError, match="UnicodeDecodeError"):
        read_gguf(path)  # valid text together, but the second string starts inside a character


# --- the ledger: types before hashing, nesting, the head record --------------------------------


def _sealed(body: dict, seq: int = 0, prev: str = "0" * 64) -> str:
    """A correctly sealed ledger line (the documented hash: sorted compact JSON, no hash)."""
    import hashlib
    import json

    entry = {**body, "seq": seq, "prev_hash": prev}
    text = json.dumps(entry, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    entry["hash"] = hashlib.sha256(text.encode()).hexdigest()
    return json.dumps(entry, sort_keys=True) + "\n"


OPEN = {"kind": "confirm-open", "time": "2026-01-01T00:00:00+00:00", "user": "u",
        "split_lock_id": "a" * 64, "milestone": "m", "config_hashes": ["c" * 64],
        "trial_ids": ["t"]}  # fmt: skip
LEDGER_CASES = {
    # name: (ledger text, head text or None for a matching head, message fragment)
    "a list-valued milestone": (_sealed({**OPEN, "milestone": ["m"]}), None,
                                "line 1: field 'milestone' is [\"m\"]; expected a string"),
    "a line nested 10**5 deep": ("[" * 100_000 + "]" * 100_000 + "\n", None,
                                 "line 1: not a JSON object"),
    "a line nested 50 deep": ('{"hash": "' + "0" * 64 + '", "a": ' + "[" * 50 + "]" * 50 + "}\n",
                              None,
                              "line 1: values nested more than 4 deep"),
    "a head of bad UTF-8": (_sealed(OPEN), b'{"entries": 1, "hash": "\xff"}',
                            "ledger.jsonl.head is unreadable (UnicodeDecodeError)"),
    "a head with a string entry count": (_sealed(OPEN), '{"entries": "1", "hash": "' + "0" * 64
                                         + '"}', "ledger.jsonl.head is malformed"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(LEDGER_CASES))
def test_a_hostile_ledger_is_one_line(case, tmp_path, record_property):
    """Two classes through `ledger verify` as a child, the other instances in-process."""
    import json

    from healsweep.errors import LedgerError
    from healsweep.ledger import Ledger

    text, head, expected = LEDGER_CASES[case]
    results = tmp_path / "results"
    results.mkdir()
    (results / "ledger.jsonl").write_text(text)
    if head is None:
        last = json.loads(text.splitlines()[-1]) if "hash" in text[:200] else {}
        head = json.dumps({"entries": 1, "hash": last.get("hash", "0" * 64)})
    (results / "ledger.jsonl.head").write_bytes(head if isinstance(head, bytes) else head.encode())
    if case in ("a list-valued milestone", "a head of bad UTF-8"):
        message = refused(run_cli("ledger", "verify", "--results", results, tmp_path=tmp_path),
                          record_property)  # fmt: skip
    else:
        with pytest.raises(LedgerError) as refusal:
            Ledger.in_results(results).verify()
        message = str(refusal.value)
    assert expected in message, message
    assert message.endswith("then run `healsweep ledger verify`")


def test_a_recorded_head_of_the_wrong_type_is_one_line(tmp_path):
    import json

    from healsweep.errors import LedgerError
    from healsweep.ledger import Ledger
    from healsweep.ledger_heads import checked_ledger

    ledger = Ledger.in_results(tmp_path / "results")
    ledger.open_milestone("a" * 64, "m0", ["c" * 64], ["t"], user="tester")
    sweep = tmp_path / "results" / "s"
    sweep.mkdir()
    head = {"path": "../ledger.jsonl", "entries": "1", "hash": ["x"]}
    (sweep / "manifest.json").write_text(json.dumps({"ledger_heads": [head]}))
    with pytest.raises(LedgerError, match="records a ledger head with entries '1'"):
        checked_ledger(ledger, sweeps=[sweep])


# --- confirm's memory: a compile per distinct scored-row count no more --------------------------


def test_scoring_compiles_a_handful_of_shapes_whatever_the_row_counts(tmp_path, random_gguf):
    """Each distinct row count of a window compiled the final norm, the teacher's log-softmax
    (each primitive of it, eagerly) and a device slice anew, and every executable stayed in
    memory: a plain `confirm` of the demo (542 test windows) passed 2.8 GB by window 238. Rows
    are padded to buckets now, so 1..99 rows compile two final-norm shapes and one teacher
    log-softmax per power of two."""
    import jax.numpy as jnp
    import numpy as np

    from healsweep.model.forward import _final_norm, _final_norm_rows
    from healsweep.score.teacher_cache import _log_softmax, run_teacher

    h, weight = jnp.ones((1, 128, 16)), jnp.ones(16)
    before = _final_norm_rows._cache_size()
    for n in range(1, 100):
        assert _final_norm(1e-6, h, weight, np.arange(n)).shape == (n, 16)
    assert _final_norm_rows._cache_size() - before <= 2  # 64 and 128 rows

    from healsweep.data.windows import Window
    from healsweep.model import open_model

    model = open_model(random_gguf())
    windows = [Window(window_id=f"w{n}", doc_id="d", source="s", doc_index=1, stratum="think",
                      split="dev", kind="think", tokens=np.arange(2, 6 + n, dtype=np.int32),
                      scored_from=4, n_scored=n) for n in (3, 9, 17, 40)]  # fmt: skip
    before = _log_softmax()._cache_size()
    outputs = run_teacher(model, windows)
    assert _log_softmax()._cache_size() - before <= 4  # 8, 16, 32, 64 rows
    # the log-probs stay padded to the bucket, the rows past the window's zero (as the scorer
    # pads them); each real row a distribution (its logsumexp 0, in float64)
    from healsweep.score.metrics import _bucket

    for out, window in zip(outputs, windows, strict=True):
        logprobs = np.asarray(out.logprobs, np.float64)
        assert logprobs.shape[0] == _bucket(window.n_scored)
        assert not logprobs[window.n_scored :].any()
        real = logprobs[: window.n_scored]
        top = real.max(axis=1, keepdims=True)
        assert np.allclose(top[:, 0] + np.log(np.exp(real - top).sum(axis=1)), 0.0, atol=1e-5)


def _window(n_tokens: int, n_scored: int, tag: str):
    import numpy as np

    from healsweep.data.windows import Window

    return Window(window_id=f"w{tag}", doc_id="d", source="s", doc_index=1, stratum="think",
                  split="dev", kind="think", tokens=np.arange(2, 2 + n_tokens, dtype=np.int32),
                  scored_from=n_tokens - n_scored, n_scored=n_scored)  # fmt: skip


class _Compiles:
    """XLA compilations counted while the block runs (JAX's monitoring events)."""

    count = 0
    _listening = False

    @classmethod
    def _heard(cls, event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            cls.count += 1

    def __enter__(self):
        import jax.monitoring

        if not _Compiles._listening:  # JAX has no public way to remove a listener: add one once
            jax.monitoring.register_event_duration_secs_listener(_Compiles._heard)
            _Compiles._listening = True
        self.start = _Compiles.count
        return self

    def __exit__(self, *exc) -> None:
        self.compiled = _Compiles.count - self.start


def test_teacher_records_and_student_logits_compile_nothing_new_for_new_row_counts(random_gguf):
    """A test split's windows have every scored-row count from 1 to max_scored, and the
    student's batches every total: on main before issue 47's item 9, each new count compiled a
    device slice and a pad of the teacher's log-probs and a student output-head product, each
    executable kept (1.4-3.6 MiB): a 2-config demo confirm peaked at 2.0 GB. Windows of new row
    counts in the same buckets and padded lengths now compile nothing."""
    from healsweep.model import open_model
    from healsweep.score.compact import compact_record
    from healsweep.score.runner import run_student
    from healsweep.score.teacher_cache import run_teacher

    model = open_model(random_gguf())

    def score(counts: tuple[int, ...], tag: str) -> None:
        windows = [_window(40, n, f"{tag}{n}") for n in counts]
        for window, out in zip(windows, run_teacher(model, windows), strict=True):
            compact_record(out.logprobs, window.scored_tokens, out.topk_ids, window.window_id)
        run_student(model, windows)  # one batch: its head takes every window's scored rows

    score((3, 9, 17, 33), "a")  # warm: buckets 8, 16, 32, 64 (62 rows in all: 64), 40 tokens
    with _Compiles() as fresh:
        score((1, 10, 18, 34), "b")  # other counts, the same buckets (63 rows: 64 too)
    assert fresh.compiled == 0
