"""Shared fixtures: a tiny trained byte-level BPE tokenizer and small random MoE GGUFs.

``random_gguf(arch, **kwargs)`` writes (once per session and argument set) a random model with
``healsweep.model.synthetic.write_random_model`` and returns its path; other test files use it
to get real qwen2moe/qwen3moe GGUFs with a real tokenizer.
"""

from __future__ import annotations

import json
import os

import pytest

# On a GPU host the tests' process and the processes they start (doctor, Ray trials) share one
# device; JAX's default preallocation (75% of it per process) would leave the later ones a
# sliver. Read when a backend starts, so set before any test computes; a no-op on a CPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from healsweep.model.synthetic import train_tiny_tokenizer, write_random_model


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A byte-level BPE (Qwen2 regex) with ChatML control tokens and <think>/</think>."""
    return train_tiny_tokenizer()


@pytest.fixture(scope="session")
def random_gguf(tmp_path_factory, tiny_tokenizer):
    """Factory ``random_gguf(arch="qwen2moe", **write_random_model_kwargs) -> Path``."""
    made = {}
    root = tmp_path_factory.mktemp("random-gguf")

    def make(arch: str = "qwen2moe", **kwargs):
        key = json.dumps([arch, kwargs], sort_keys=True, default=str)
        if key not in made:
            path = root / f"model-{len(made)}-{arch}.gguf"
            made[key] = write_random_model(path, arch, tokenizer=tiny_tokenizer, **kwargs)
        return made[key]

    return make


@pytest.fixture
def own_runtime():
    """A fresh :class:`healsweep.runtime.Runtime` installed for the test and closed after it:
    its in-memory stores, counters and once-only notices start empty."""
    from healsweep.runtime import Runtime, use

    with Runtime() as rt, use(rt):
        yield rt
