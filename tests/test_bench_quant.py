"""`healsweep bench quant` from an installed package: a wheel built from this tree, unpacked into
a folder of its own, and the command run from a working directory outside the checkout.

The wheel is what ``pip install`` would copy, so the test fails if the command needs a file of
the checkout (as it did when it loaded ``benchmarks/bench_quant.py`` by path) or if the C
reference is left out of the package data.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from _cli import run_cli

ROOT = Path(__file__).resolve().parents[1]


def _installed(tmp_path: Path) -> Path:
    """The package as a wheel install lays it out: ``site/healsweep/...``, nothing else."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(
        ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(wheels), str(tree)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    site = tmp_path / "site"
    (wheel,) = wheels.glob("healsweep-*.whl")
    zipfile.ZipFile(wheel).extractall(site)
    return site


def test_bench_quant_runs_from_an_installed_package_outside_the_checkout(tmp_path):
    site = _installed(tmp_path)
    work = tmp_path / "elsewhere"
    work.mkdir()
    # PYTHONPATH comes before the editable install's path entry, so `healsweep` is the wheel's.
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    where = subprocess.run(
        [sys.executable, "-c", "import healsweep; print(healsweep.__file__)"],
        cwd=work, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(site)
    done = run_cli("bench", "quant", "--rows", "16", "--cols", "64", "--repeats", "1",
                   cwd=work, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split("  ")[0].strip(): line for line in done.stdout.splitlines()}
    for contender in ("jax kernel, chunks already on device", "jax quantize_matrix, end to end",
                      "numpy, vectorized", "jnp, naive rows"):  # fmt: skip
        assert contender in rows, done.stdout
    assert "100.00%" in rows["numpy, vectorized"]  # numpy's codes equal the kernel's
    if shutil.which("gcc"):  # the C source came with the package and compiled
        assert "100.00%" in rows["C gcc -O3"], done.stdout
    assert "(16x64)" in done.stdout
