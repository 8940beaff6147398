"""The bad-input catalogue: each input a user can get wrong, through the real CLI as a subprocess.

Every case asserts exit code 1, exactly one line on stderr, no traceback, and the key phrases of
the message users see (what was wrong, where, what to do). ``docs/reliability.md`` lists the same
catalogue as a table (input -> message).

Read-only folders: tests may run as root, for whom ``chmod`` does not stop writes, so a root run
uses a read-only bind mount of a ``tmp_path`` folder (unmounted afterwards) and anyone else a
``chmod 555`` folder.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest

from _cli import run_cli
from healsweep.data.corpus import Document, write_corpus
from healsweep.ledger import Ledger
from healsweep.model import SUPPORTED_ARCHS
from healsweep.model.synthetic import write_random_model

KNOWN_KNOBS = (
    "importance, importance_down, quantizer, gptq_damp, gptq_refine, down_input, gain_gu, gain_d, "
    "alpha, gamma, "
    "alpha_granularity, ridge, rho, eta, moce_bonus, cache_experts, type_gu, type_d, up_first, "
    "up_last, layer_types, type_attn, type_shexp, type_embd, type_output, type_dense"
)


def healsweep(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess with a private stage cache."""
    return run_cli(*args, cache=tmp_path / "cache")


def one_line_error(run: subprocess.CompletedProcess) -> str:
    """Assert the CLI's contract for a user error and return the message after ``error: ``."""
    assert run.returncode == 1, (run.returncode, run.stdout, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: "), lines
    return lines[0][len("error: ") :]


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[Path]:
    """``folder`` made unwritable for this process (bind mount as root, chmod otherwise)."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True)
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory, tiny_tokenizer) -> Path:
    """A complete qwen2moe GGUF whose expert rows are multiples of 64 values."""
    path = tmp_path_factory.mktemp("bad-inputs") / "good.gguf"
    return write_random_model(path, n_ff_exp=64, tokenizer=tiny_tokenizer)


def test_truncated_gguf(good_gguf, tmp_path):
    blob = good_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(blob[: len(blob) // 2])
    message = one_line_error(healsweep("model", "info", cut, tmp_path=tmp_path))
    assert message.startswith(f"{cut} is truncated: tensor ")
    assert f"but the file has {len(blob) // 2} bytes" in message
    assert "re-download or re-export the file" in message


def _bare_model(path, arch):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture(tmp_path):
    path = _bare_model(tmp_path / "gpt2.gguf", "gpt2")
    message = one_line_error(healsweep("model", "info", path, tmp_path=tmp_path))
    assert message == (f"{path} has architecture 'gpt2'; healsweep supports "
                       f"{', '.join(SUPPORTED_ARCHS)}")


@pytest.mark.parametrize("arch", ["olmoe", "llama", "glm4moe"])
def test_rope_scaling_other_than_deepseek2_yarn_is_refused_in_one_line(tmp_path, arch):
    path = write_random_model(tmp_path / f"{arch}.gguf", arch, n_head_kv=4,
                              extra_metadata={f"{arch}.rope.scaling.type": "yarn"})
    message = one_line_error(healsweep("model", "info", path, tmp_path=tmp_path))
    assert message.startswith(f"{path}: {arch}.rope.scaling.type is 'yarn'; healsweep runs")


def test_dense_llama_is_refused_in_one_line(tmp_path):
    path = _bare_model(tmp_path / "llama.gguf", "llama")
    message = one_line_error(healsweep("model", "info", path, tmp_path=tmp_path))
    assert message.startswith(f"{path} is a dense llama model (no ffn_gate_inp")
    assert ", ".join(SUPPORTED_ARCHS) in message


def test_missing_expert_tensors(tmp_path, tiny_tokenizer):
    path = write_random_model(
        tmp_path / "partial.gguf",
        n_ff_exp=64,
        tokenizer=tiny_tokenizer,
        drop_tensors=("blk.1.ffn_down_exps.weight",),
    )
    message = one_line_error(healsweep("model", "info", path, tmp_path=tmp_path))
    assert message == (
        f"{path} is missing tensor blk.1.ffn_down_exps.weight required by qwen2moe; "
        "the file is incomplete, re-export it"
    )


def test_expert_dims_not_multiples_of_64_refused_by_heal(tmp_path, tiny_tokenizer):
    # n_ff_exp = 32: the down projection's rows (its input dim) are not whole Q2_0 blocks.
    path = write_random_model(tmp_path / "ff32.gguf", n_ff_exp=32, tokenizer=tiny_tokenizer)
    knobs = tmp_path / "knobs.yaml"
    knobs.write_text("gain_d: 0.3\n")
    run = healsweep(
        "heal", path, "--knobs", knobs, "--out", tmp_path / "healed.gguf",
        "--max-tokens", "128", "--chunk-length", "32", tmp_path=tmp_path,
    )  # fmt: skip
    message = one_line_error(run)
    misfit = (
        f"{path}: the rows of ffn_down_exps hold 32 values, not a multiple of the Q2_0 block of "
        "64; they cannot be stored as q2_0. The types that fit this model, smallest first: "
        "gate/up (rows of 64): q2_0 (2.25 bits), iq4_nl (4.5 bits); down (rows of 32): iq4_nl "
        "(4.5 bits); these knobs fit the packaged model demo (rows of 128)"
    )
    assert message.startswith(misfit) and f"--knobs {knobs} " in message
    assert "calib_trace" not in run.stdout  # refused before any teacher pass
    assert not (tmp_path / "healed.gguf").exists()
    # A sweep over the same model is refused before Ray starts, leaving no results folder.
    spec = tmp_path / "ff32.yaml"
    spec.write_text(f"name: ff32\nmodel: {path}\nsearch_space:\n  gain_d: [0.3]\n")
    run = healsweep("sweep", "run", spec, "--results", tmp_path / "results", tmp_path=tmp_path)
    assert one_line_error(run).startswith(misfit)
    assert not (tmp_path / "results" / "ff32").exists()


def test_malformed_yaml_spec(tmp_path):
    spec = tmp_path / "broken.yaml"
    spec.write_text("name: broken\nsearch_space: {gain_d: [0.3, 0.0]\n")
    message = one_line_error(healsweep("sweep", "run", spec, tmp_path=tmp_path))
    assert message.startswith(f"{spec}:3: YAML syntax error (")
    assert message.endswith("); fix the spec")


def test_unknown_knob_in_a_knob_file_and_in_a_spec(tmp_path, good_gguf):
    knobs = tmp_path / "knobs.yaml"
    knobs.write_text("gain_d: 0.3\nsharpness: 2\n")
    run = healsweep("heal", good_gguf, "--knobs", knobs, "--out", tmp_path / "o.gguf",
                    tmp_path=tmp_path)  # fmt: skip
    assert one_line_error(run) == f"{knobs}: unknown knob 'sharpness'; known: {KNOWN_KNOBS}"
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: s\nsearch_space:\n  sharpness: [1, 2]\n")
    message = one_line_error(healsweep("sweep", "run", spec, tmp_path=tmp_path))
    assert message == (
        f"{spec}:3: field 'search_space.sharpness': unknown knob; knobs are {KNOWN_KNOBS}"
    )


def test_knob_out_of_range(tmp_path, good_gguf):
    knobs = tmp_path / "knobs.yaml"
    knobs.write_text("gain_d: 7\n")
    run = healsweep("heal", good_gguf, "--knobs", knobs, "--out", tmp_path / "o.gguf",
                    tmp_path=tmp_path)  # fmt: skip
    message = one_line_error(run)
    assert message == f"{knobs}: knob 'gain_d' = 7 is not allowed: expected a float in [0, 2]"


def test_empty_dev_split(tmp_path, good_gguf):
    # Every eval document has an even index: the parity split puts all of them in test.
    docs = [Document(f"e{i}", "s", 2 * i, "s", text="Even documents only. " * 6) for i in range(3)]
    docs.append(Document("c0", "cal", 1, "cal", text="calibration " * 10, pool="calibration"))
    corpus = tmp_path / "even.jsonl"
    write_corpus(docs, corpus)
    run = healsweep("score", "--model", good_gguf, "--ref", good_gguf, "--corpus", corpus,
                    "--max-scored", "16", "--max-context", "16", tmp_path=tmp_path)  # fmt: skip
    assert one_line_error(run) == (
        "the 'dev' split gives no scoring windows (0 documents); check the split config and "
        "that its documents have assistant turns or text"
    )


def test_malformed_chatml_transcript_and_corpus_line(tmp_path):
    transcript = tmp_path / "chat.txt"
    transcript.write_text("<|im_start|>user\nhello\n<|im_start|>assistant\nhi<|im_end|>\n")
    run = healsweep("corpus", "import", transcript, "--out", tmp_path / "c.jsonl",
                    tmp_path=tmp_path)  # fmt: skip
    assert one_line_error(run) == (
        f"{transcript}:1: unterminated <|im_start|> (no <|im_end|> before a new <|im_start|> "
        "on line 3); close the message with <|im_end|>"
    )
    assert not (tmp_path / "c.jsonl").exists()
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text(
        '{"doc_id": "a", "source": "s", "index": 1, "stratum": "s", '
        '"messages": [{"role": "robot", "content": "x"}]}\n'
    )
    message = one_line_error(healsweep("corpus", "info", corpus, tmp_path=tmp_path))
    assert message == (
        f"{corpus}:1: message 0 has unknown role 'robot'; use ('system', 'user', 'assistant', "
        "'tool')"
    )


def test_results_dir_not_writable(tmp_path):
    spec = tmp_path / "ro.yaml"
    spec.write_text("name: ro\nsearch_space:\n  gain_d: [0.3]\nscoring:\n  max_windows: 1\n")
    with read_only(tmp_path / "results") as results:
        run = healsweep("sweep", "run", spec, "--results", results, tmp_path=tmp_path)
        message = one_line_error(run)
        assert not any(results.iterdir())
    assert message.startswith(f"cannot write to {results}: ")
    assert ("Read-only file system" in message) or ("Permission denied" in message)
    assert message.endswith(
        "pass a writable results root with --results (or fix its permissions or free space)"
    )


def test_tampered_ledger(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    ledger = Ledger.in_results(results)
    ledger.open_milestone("a" * 64, "m1", ["cfg"], ["trial"], user="tester")
    assert healsweep("ledger", "verify", "--results", results, tmp_path=tmp_path).returncode == 0
    ledger.path.write_text(ledger.path.read_text().replace('"m1"', '"m2"'))
    run = healsweep("ledger", "verify", "--results", results, tmp_path=tmp_path)
    assert one_line_error(run) == (
        f"{ledger.path} line 1: its hash does not match its content (the entry was edited); "
        "restore the ledger from a backup or version control, then run `healsweep ledger verify`"
    )


def test_test_split_requested_by_a_sweep(tmp_path):
    spec = tmp_path / "peek.yaml"
    spec.write_text("name: peek\nsplit: test\nsearch_space:\n  gain_d: [0.3, 0.0]\n")
    run = healsweep("sweep", "run", spec, "--results", tmp_path / "results", tmp_path=tmp_path)
    assert one_line_error(run) == (
        f"{spec}:2: field 'split' = 'test': a sweep tunes on dev windows only and never opens "
        "the test split; score test windows once per milestone with `healsweep confirm` (it "
        "records a ledger grant)"
    )
    assert not (tmp_path / "results").exists()
