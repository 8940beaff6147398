"""`healsweep doctor` on this machine, and the conformance machinery it runs.

The CLI runs are subprocesses with ``HOME``/``RAY_TMPDIR`` in the test's folder and no ``RAY_*``
variable, so no Ray of another process is ever found. The comparison is checked against a float64
numpy re-implementation; a kernel off its reference must be reported as not ok, and so must a
kernel that fails to lower (a primitive with no lowering rule for the platform) or to run (a
callback that raises): nothing runs such a kernel on the CPU instead, so doctor exits 1 and names
it. Wrong production kernels (one code off in one block of the Q2_0 search, the scales of the
packed Q2_0 decoder transposed) are planted by replacing the function production calls.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback
from jax.extend.core import Primitive
from jax.interpreters import mlir
from typer.testing import CliRunner

import healsweep.conformance.suite as suite
from _cli import run_cli
from healsweep.cli import _register
from healsweep.cli._apps import app
from healsweep.conformance import KernelCase, all_cases, run_case
from healsweep.conformance import max_rel_err as _max_rel_err
from healsweep.heal import device_phases
from healsweep.heal.device_phases import phase_cases
from healsweep.kernels import q2_0, q2_0_gpu


@pytest.fixture(scope="module")
def doctor_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    (root / "home").mkdir()
    (root / "raytmp").mkdir()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {
        **clean,
        "HOME": str(root / "home"),
        "RAY_TMPDIR": str(root / "raytmp"),
        "HEALSWEEP_CACHE": str(root / "cache"),
        # The two doctor runs compile the same kernels: the second reuses the first's programs.
        "JAX_COMPILATION_CACHE_DIR": str(root / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def _doctor(env: dict, *args: str) -> subprocess.CompletedProcess:
    return run_cli("doctor", *args, env=env)


CPU_ONLY = (
    "kernel conformance: CPU only, checked against float64 references "
    "(decoders: gguf-py's and ggml's):"
)


def _conformance_rows(stdout: str) -> dict[str, str]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("kernel conformance")) + 1
    return {line.split()[0]: line for line in lines[start:] if line.startswith("  ")}


def _verdict(row: str) -> str:
    """A row's verdict (ok, WRONG or FAILS), wherever the host puts it: an accelerator's rows
    carry a 'vs cpu' column that a CPU host's do not."""
    return next(word for word in row.split() if word in ("ok", "WRONG", "FAILS"))


def test_doctor_without_a_cluster_reports_none_and_every_kernel_against_references(doctor_env):
    done = _doctor(doctor_env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    backend = jax.default_backend()
    assert lines[0].startswith(f"jax {jax.__version__} (jaxlib ")
    assert lines[0].endswith(f"default backend: {backend}")
    assert any(line.startswith(f"  device {backend}:0") for line in lines)
    assert "ray cluster: none running here" in done.stdout
    rows = _conformance_rows(done.stdout)
    assert set(rows) == {case.name for case in (*all_cases(), *phase_cases())}
    assert {"q2_0.Q2Packed.dequantize", "ggml_decode.Q4_K", "model.forward"} <= set(rows)
    assert {"phase.teacher_record", "phase.routed_q", "phase.ridge_basis[device]"} <= set(rows)
    assert "[device, float64]" in rows["phase.ridge_basis[device]"]
    for name, row in rows.items():
        assert row.split()[1] == backend and " vs reference " in row, row
        assert _verdict(row) == "ok", (name, row)
    if backend == "cpu":  # CI: says that nothing was compared with a device
        assert CPU_ONLY in lines and "vs cpu" not in done.stdout
        assert "[cpu tiles]" in rows["q2_0.quantize_rows"]  # the production path of a CPU
        assert lines[-1] == (
            f"doctor: all {len(rows)} kernels agree with their float64 references "
            "(CPU only: no device was compared)"
        )
    else:  # an accelerator: its production path, and the device compared with the CPU
        assert CPU_ONLY not in lines and " vs cpu " in rows["q2_0.dequantize"]
        if backend == "gpu":
            assert "[pallas]" in rows["q2_0.quantize_rows"]
        assert lines[-1].startswith(
            f"doctor: all {len(rows)} kernels agree with their float64 references on {backend} "
            "and on the CPU"
        )


def test_doctor_no_ray_skips_the_cluster_check(doctor_env):
    done = _doctor(doctor_env, "--no-ray")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ray cluster" not in done.stdout
    assert done.stdout.splitlines()[-1].startswith("doctor: all ")
    # one line says whether ggml's quantizer (llama-cpp-python, the [ggml] extra) is there
    ggml = [line for line in done.stdout.splitlines() if line.startswith("ggml quantizer: ")]
    installed = importlib.util.find_spec("llama_cpp") is not None
    assert len(ggml) == 1 and ggml[0].split()[2] == ("present" if installed else "absent")


def _rel_err_f64(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, np.max(np.abs(a64 - b64)) / np.max(np.abs(b64)))
    return worst


def test_max_rel_err_matches_a_float64_reference_over_a_pytree():
    rng = np.random.default_rng(3)
    want = [rng.standard_normal((5, 7)).astype(np.float32) * 10**k for k in range(-2, 3)]
    got = [w + rng.standard_normal(w.shape).astype(np.float32) * 1e-3 for w in want]
    tree_got = {"a": (got[0], got[1]), "b": [got[2], {"c": got[3]}], "d": got[4]}
    tree_want = {"a": (want[0], want[1]), "b": [want[2], {"c": want[3]}], "d": want[4]}
    err = _max_rel_err(tree_got, tree_want)
    assert err == pytest.approx(_rel_err_f64(got, want), rel=1e-4)
    assert _max_rel_err(tree_want, tree_want) == 0.0
    half = np.asarray([1.0, -2.0, 4.0], np.float16)
    assert _max_rel_err(half + np.float16(0.5), half) == pytest.approx(0.5 / 4.0)


@pytest.mark.parametrize(
    ("got", "want"),
    [
        (np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)),  # shape
        (np.array([1, 2, 3], np.int8), np.array([1, 2, 4], np.int8)),  # integers are exact
        (np.array([1.0, np.nan], np.float32), np.array([1.0, 2.0], np.float32)),  # NaN vs number
        (np.array([1.0, 2.0], np.float32), np.array([1.0, np.nan], np.float32)),
        (np.array([np.inf, 1.0], np.float32), np.array([-np.inf, 1.0], np.float32)),
    ],
)
def test_max_rel_err_is_infinite_for_what_cannot_be_compared(got, want):
    assert _max_rel_err(got, want) == float("inf")


def test_max_rel_err_accepts_matching_non_finite_values_and_empty_leaves():
    want = np.array([np.nan, np.inf, -np.inf, 2.0], np.float32)
    got = np.array([np.nan, np.inf, -np.inf, 2.002], np.float32)
    assert _max_rel_err(got, want) == pytest.approx(0.001, rel=1e-3)
    assert _max_rel_err(np.zeros((0, 4), np.float32), np.zeros((0, 4), np.float32)) == 0.0
    assert _max_rel_err(np.array([3, 4], np.int32), np.array([3, 4], np.int32)) == 0.0


def _scaled_kernel(factor: float):
    """A kernel that is its input times ``factor``: off the identity reference by factor - 1."""
    return lambda x: x * np.float32(factor)  # [N, D]


def _square_inputs(rng):
    return (rng.standard_normal((8, 16)).astype(np.float32),)


def _identity(x):
    return np.asarray(x, np.float64)


def test_a_kernel_off_its_float64_reference_is_reported_not_ok():
    loose = run_case(KernelCase("off.loose", _scaled_kernel(1.001), _square_inputs, _identity,
                                rtol=1e-2))  # fmt: skip
    assert loose.ok and loose.lowered and loose.backend == jax.default_backend()
    assert loose.err == pytest.approx(1e-3, rel=1e-3)
    tight = run_case(KernelCase("off.tight", _scaled_kernel(1.001), _square_inputs, _identity,
                                rtol=1e-4))  # fmt: skip
    assert not tight.ok and tight.lowered
    assert tight.err == pytest.approx(1e-3, rel=1e-3)
    assert "vs the float64 reference" in tight.note


def test_a_custom_check_decides_and_names_what_is_wrong():
    def check(got, want, inputs):
        return 7.0, "seven blocks are wrong"

    result = run_case(KernelCase("off.custom", _scaled_kernel(1.0), _square_inputs, _identity,
                                 check=check))  # fmt: skip
    assert not result.ok and result.err == 7.0 and "seven blocks are wrong" in result.note


def test_a_cpu_placed_kernel_is_judged_on_the_cpu_against_its_reference():
    case = KernelCase("placed", _scaled_kernel(2.0), _square_inputs, lambda x: 2.0 * _identity(x),
                      cpu_placed=True)  # fmt: skip
    result = run_case(case)
    assert result.ok and result.err == 0.0
    assert np.isnan(result.device_err)  # never run on, nor compared with, a device


def _primitive(name: str, lower_on: tuple[str, ...] = ()) -> Primitive:
    """An elementwise identity primitive that lowers only on the platforms in ``lower_on``."""
    prim = Primitive(name)
    prim.def_abstract_eval(lambda x: x)
    for platform in lower_on:
        mlir.register_lowering(prim, mlir.lower_fun(lambda x: x, multiple_results=False), platform)
    return prim


_UNLOWERABLE = _primitive("healsweep_test_unlowerable")
_CPU_ONLY = _primitive("healsweep_test_cpu_only", lower_on=("cpu",))


def _unlowerable_kernel(x):
    return _UNLOWERABLE.bind(x) * 2.0  # [N, D]


def _failing_callback_kernel(x):
    def fail() -> np.ndarray:
        raise RuntimeError("the callback refuses")

    return x * io_callback(fail, jax.ShapeDtypeStruct((), jnp.float32))  # [N, D]


def test_a_kernel_that_fails_to_lower_is_reported_failing_not_compared_with_itself():
    result = run_case(
        KernelCase("broken.unlowerable", _unlowerable_kernel, _square_inputs, _identity)
    )
    assert not result.ok and not result.lowered
    assert result.err == float("inf")
    assert result.note == "fails to lower on cpu"
    assert "healsweep_test_unlowerable" in result.error


def test_a_kernel_that_fails_at_run_time_is_reported_failing():
    result = run_case(
        KernelCase("broken.callback", _failing_callback_kernel, _square_inputs, _identity)
    )
    assert not result.ok and not result.lowered
    assert result.note == "fails to run on cpu"


@pytest.mark.device
def test_a_kernel_that_lowers_on_cpu_only_fails_on_the_default_device():
    assert jax.default_backend() != "cpu", "a device test: run it where JAX has an accelerator"
    case = KernelCase("broken.cpu_only", lambda x: _CPU_ONLY.bind(x), _square_inputs, _identity)
    result = run_case(case)
    assert not result.ok and not result.lowered
    assert result.note == f"fails to lower on {jax.default_backend()}"


def _doctor_in_process(monkeypatch, names: tuple[str, ...], extra=(), phases=()) -> object:
    """``healsweep doctor --no-ray`` in this process over the named cases (and ``extra``) and
    the named device phases."""
    cases = [case for case in all_cases() if case.name in names]
    assert len(cases) == len(names)
    chosen = [case for case in phase_cases() if case.name in phases]
    assert len(chosen) == len(phases)
    monkeypatch.setattr(suite, "all_cases", lambda: [*cases, *extra])
    monkeypatch.setattr(device_phases, "phase_cases", lambda: chosen)
    jax.clear_caches()  # a fresh doctor traces the kernels as they are now
    _register()
    done = CliRunner().invoke(app, ["doctor", "--no-ray"])
    monkeypatch.undo()  # the planted kernels go, and so do the programs traced from them
    jax.clear_caches()
    return done


def test_doctor_exits_1_with_one_line_naming_a_kernel_that_fails_to_lower(monkeypatch):
    broken = KernelCase("broken.unlowerable", _unlowerable_kernel, _square_inputs, _identity)
    done = _doctor_in_process(monkeypatch, ("q2_0.dequantize",), [broken])
    assert done.exit_code == 1, done.output
    rows = _conformance_rows(done.stdout)
    assert _verdict(rows["q2_0.dequantize"]) == "ok"
    assert "FAILS  fails to lower on cpu" in rows["broken.unlowerable"]
    assert "agree" not in done.output
    assert done.stderr.splitlines() == [
        "doctor: 1 of 2 kernel(s) failing: broken.unlowerable (fails to lower on cpu)"
    ]


Q2_SEARCH = ("q2_0.quantize_rows", "q2_0.quantize_rows_grouped")


def test_doctor_exits_1_naming_a_search_with_one_code_off_in_one_block(monkeypatch):
    def one_code_off(d, q):
        flip = jnp.where(q[0, 5] == 2, 1, q[0, 5] + 1).astype(q.dtype)  # block 0 of row 0
        return d, q.at[0, 5].set(flip)

    cpu_kernel, gpu_kernel = q2_0._quantize_rows, q2_0_gpu.quantize_rows
    monkeypatch.setattr(  # the kernels production's selector picks from, whatever the backend
        q2_0,
        "_quantize_rows",
        lambda w, a, g, **kw: (*one_code_off(*cpu_kernel(w, a, g, **kw)[:2]), ()),
    )
    monkeypatch.setattr(
        q2_0_gpu, "quantize_rows", lambda *a, **kw: one_code_off(*gpu_kernel(*a, **kw))
    )
    done = _doctor_in_process(monkeypatch, (*Q2_SEARCH, "q2_0.dequantize"))
    assert done.exit_code == 1, done.output
    rows = _conformance_rows(done.stdout)
    for name in Q2_SEARCH:
        assert "WRONG" in rows[name] and "1 of 1024 blocks differ" in rows[name], rows[name]
    assert _verdict(rows["q2_0.dequantize"]) == "ok"
    [line] = done.stderr.splitlines()
    assert line.startswith("doctor: 2 of 3 kernel(s) failing: q2_0.quantize_rows (")
    assert "q2_0.quantize_rows_grouped (" in line


def test_doctor_exits_1_naming_a_packed_decoder_with_transposed_scales(monkeypatch):
    right = q2_0.Q2Packed.dequantize

    def transposed(self):
        return right(q2_0.Q2Packed(jnp.swapaxes(jnp.asarray(self.d), -1, -2), self.codes))

    monkeypatch.setattr(q2_0.Q2Packed, "dequantize", transposed)
    done = _doctor_in_process(monkeypatch, ("q2_0.Q2Packed.dequantize", "q2_0.Q2Weight.dequantize"))
    assert done.exit_code == 1, done.output
    rows = _conformance_rows(done.stdout)
    assert "WRONG" in rows["q2_0.Q2Packed.dequantize"]
    assert _verdict(rows["q2_0.Q2Weight.dequantize"]) == "ok"
    assert done.stderr.startswith("doctor: 1 of 2 kernel(s) failing: q2_0.Q2Packed.dequantize (")


def test_a_case_without_a_reference_is_reported_failing_not_skipped():
    def missing(x):
        raise ValueError("gguf-py cannot decode ggml type 99")

    result = run_case(KernelCase("decoder.unknown", _scaled_kernel(1.0), _square_inputs, missing))
    assert not result.ok and result.note == "no reference"
    assert result.error == "gguf-py cannot decode ggml type 99"


def test_decoder_cases_follow_in_graph_types(monkeypatch):
    from healsweep.conformance.decoders import decoder_cases, type_name
    from healsweep.kernels import ggml_decode

    names = [case.name for case in decoder_cases()]
    assert names == [f"ggml_decode.{type_name(t)}" for t in sorted(ggml_decode.IN_GRAPH_TYPES)]
    assert "ggml_decode.Q2_0" in names and "ggml_decode.IQ4_XS" in names
    # a type added to the in-graph set is checked without a change to the suite (here one that
    # gguf-py decodes but that has no in-graph decoder behind it: it fails to lower, and is named)
    from gguf import GGMLQuantizationType

    from healsweep.conformance.decoders import gguf_reference

    def gguf_decodes(qtype: int) -> bool:
        try:
            block, size = ggml_decode.block_geometry(qtype)
            gguf_reference(qtype, np.zeros((1, size * max(1, 256 // block)), np.uint8))
        except Exception:  # noqa: BLE001 (any failure: not a usable example)
            return False
        return True

    spare = next(
        int(t)
        for t in GGMLQuantizationType
        if int(t) not in ggml_decode.IN_GRAPH_TYPES and gguf_decodes(int(t))
    )
    monkeypatch.setattr(ggml_decode, "IN_GRAPH_TYPES", ggml_decode.IN_GRAPH_TYPES | {spare})
    added = next(case for case in decoder_cases() if case.name == f"ggml_decode.{type_name(spare)}")
    result = run_case(added)  # the CPU runs first on every host, so it is the CPU that fails
    assert not result.ok and result.note == "fails to lower on cpu"


def test_doctor_exits_1_naming_a_device_ridge_basis_whose_eigenvalues_are_off(monkeypatch):
    """The device eigh planted 1% off: its ridge solve misses float64 and the host path's, the
    host path's passes."""
    true_eigh = jnp.linalg.eigh

    def off_eigh(a, **kwargs):
        sigma, basis = true_eigh(a, **kwargs)
        return sigma * 1.01, basis

    monkeypatch.setattr(jnp.linalg, "eigh", off_eigh)
    names = ("phase.ridge_basis[host]", "phase.ridge_basis[device]")
    done = _doctor_in_process(monkeypatch, ("q2_0.dequantize",), phases=names)
    assert done.exit_code == 1, done.output
    rows = _conformance_rows(done.stdout)
    assert _verdict(rows["phase.ridge_basis[host]"]) == "ok"
    assert _verdict(rows["phase.ridge_basis[device]"]) == "WRONG"
    assert "host path" in rows["phase.ridge_basis[device]"]
    assert done.stderr.startswith("doctor: 1 of 3 kernel(s) failing: phase.ridge_basis[device] (")


def test_doctor_exits_1_naming_a_teacher_record_whose_draws_land_one_token_off(monkeypatch):
    from healsweep.kernels import tail_draws

    true_draws = tail_draws.tail_draws

    def shifted(logp, top_ids, strata):
        ids, tail_logp, mass, full = true_draws(logp, top_ids, strata)
        ids = jnp.minimum(ids + 1, logp.shape[1] - 1)
        return ids, jnp.take_along_axis(logp, ids, axis=1), mass, full

    monkeypatch.setattr(tail_draws, "tail_draws", shifted)
    done = _doctor_in_process(monkeypatch, (), phases=("phase.teacher_record",))
    assert done.exit_code == 1, done.output
    row = _conformance_rows(done.stdout)["phase.teacher_record"]
    assert _verdict(row) == "WRONG" and "off their token" in row
