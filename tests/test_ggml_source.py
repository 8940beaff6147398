"""Where ggml's quantizer comes from: ``HEALSWEEP_GGML_LIB`` naming a llama.cpp build's
``libggml-base`` (the file or its folder) wins over the installed package; a name that holds no
library is one line saying what to name; ``healsweep doctor`` says which one it loaded. Each
case runs in a fresh process (the library is loaded once per process)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_spec = importlib.util.find_spec("llama_cpp")
LIB = None if _spec is None else Path(next(iter(_spec.submodule_search_locations))) / "lib"


def _status(value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "HEALSWEEP_GGML_LIB"}
    if value is not None:
        env["HEALSWEEP_GGML_LIB"] = value
    code = "from healsweep.gguf_io._ggml_lib import status_line; print(status_line())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


@pytest.mark.slow  # needs a libggml-base: llama-cpp-python, installed in the slow tier ([bench])
def test_a_library_named_by_the_environment_is_used_file_or_folder(tmp_path):
    assert LIB is not None, "llama-cpp-python is not installed: pip install -e '.[bench]'"
    library = next(p for p in LIB.glob("libggml-base.*") if p.suffix in (".so", ".dylib"))
    for named in (library, LIB, LIB.parent):  # the file, its folder, a prefix with lib/
        line = _status(str(named))
        assert line.startswith("ggml quantizer: present (HEALSWEEP_GGML_LIB"), line
        assert str(library) in line
    assert _status(None).startswith("ggml quantizer: present (llama-cpp-python ")


def test_a_name_without_a_library_says_what_to_name(tmp_path):
    line = _status(str(tmp_path))
    assert line.startswith("ggml quantizer: absent (HEALSWEEP_GGML_LIB=")
    assert "no libggml-base" in line and "build/bin" in line
