"""Type-42 files across healsweep and llama.cpp (slow tier; needs the ``[bench]`` extra).

llama.cpp is independent of healsweep in everything that matters here: its quantizer writes the
Q2_0 files healsweep must read, its ``to_float`` decodes the blocks healsweep writes, and its
runtime (its own GGUF reader, Q2_0 dot products against 8-bit-quantized activations, its own MoE
graph) runs the exported students.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from healsweep.gguf_io import open_model
from healsweep.gguf_io._ggml_lib import dequantize_rows

pytestmark = pytest.mark.slow

_QUANTIZE_SCRIPT = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_0
params.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),
                                        ctypes.byref(params)))
"""


@pytest.fixture(scope="module")
def llama_q2_0(tmp_path_factory):
    """The demo model quantized by llama.cpp (``llama_model_quantize``, ftype MOSTLY_Q2_0)."""
    out = tmp_path_factory.mktemp("llama-q2") / "demo-q2_0.gguf"
    demo = open_model("demo").path
    run = subprocess.run([sys.executable, "-c", _QUANTIZE_SCRIPT, str(demo), str(out)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return out


def test_a_llama_cpp_q2_0_file_decodes_as_ggml_decodes_it(llama_q2_0):
    model = open_model(llama_q2_0)
    q2 = [n for n in model.tensor_names if int(model.tensor_type(n)) == 42]
    assert any(n.endswith("ffn_down_exps.weight") for n in q2) and len(q2) >= 12
    for name in q2:
        n_in = model.tensor_shape(name)[-1]
        want = dequantize_rows(model.raw_rows(name), 42, n_in)
        np.testing.assert_array_equal(model.tensor(name), want, err_msg=name)


def test_score_accepts_a_llama_cpp_q2_0_file(llama_q2_0, tmp_path):
    env = {**os.environ, "HEALSWEEP_CACHE": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "-m", "healsweep", "score", "--model", str(llama_q2_0), "--ref", "demo",
         "--max-windows", "4", "--json", str(tmp_path / "s.json")],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    pooled = json.loads((tmp_path / "s.json").read_text())["pooled"]
    assert pooled["kld_mean"] > 0.05  # ternary everywhere: far from the teacher, but scored
