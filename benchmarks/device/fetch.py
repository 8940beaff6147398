"""Here, before a device call: the wheels and the ggml library a device machine lacks.

    python benchmarks/device/fetch.py            # -> .whl/*.whl and .llama/llama_cpp/lib/

A device machine (benchmarks/device/README.md) reaches no package registry, and a call carries at
most 64 MiB with the repository's tracked files (about 35 MB). This downloads the cp312 manylinux
wheels of ``wheels.txt`` into ``.whl/`` and slims Ray's (79 MB) to what a sweep runs: its Java
jars, dashboard web client, RLlib, Serve, LLM and runtime-env third-party files are dropped, its
binaries stripped of symbols, and the wheel recompressed with LZMA (its RECORD rewritten, so pip
installs it as any wheel). ggml's quantizer travels as the ``libggml-base`` of this machine's
llama-cpp-python (``pip install -e ".[ggml]"``), in a minimal ``llama_cpp`` package folder,
after a check that it holds no AVX-512 or AMX instructions (built without ``-march=native``
code, it runs on any x86-64 host). Prints the sizes, and fails where the total would not fit.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WHEELS = ROOT / ".whl"
LLAMA = ROOT / ".llama"
LIMIT = 64 * 2**20  # what one device call carries, tracked files included
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip
RAY_DROPPED = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/", "ray/serve/", "ray/llm/",
               "ray/_private/runtime_env/agent/thirdparty_files/", "ray/tests/")  # fmt: skip


def pinned() -> list[str]:
    lines = (HERE / "wheels.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def download(requirements: list[str]) -> None:
    WHEELS.mkdir(exist_ok=True)
    args = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.12", "--implementation", "cp", "-d", str(WHEELS)]  # fmt: skip
    for platform in PLATFORMS:
        args += ["--platform", platform]
    subprocess.run(args + requirements, check=True)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _stripped(data: bytes) -> bytes:
    """An ELF file's bytes without symbols (``strip --strip-unneeded``); others unchanged."""
    if not data.startswith(b"\x7fELF") or shutil.which("strip") is None:
        return data
    with tempfile.NamedTemporaryFile(delete=False) as fh:
        fh.write(data)
    try:
        done = subprocess.run(["strip", "--strip-unneeded", fh.name], capture_output=True)
        return Path(fh.name).read_bytes() if done.returncode == 0 else data
    finally:
        os.unlink(fh.name)


def slim_ray(wheel: Path) -> Path:
    """Ray's wheel rewritten without what a sweep never loads (see the module docstring)."""
    out = wheel.with_name(wheel.name)  # same name: pip reads name and tags from it
    tmp = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_LZMA) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        records = []
        for info in src.infolist():
            name = info.filename
            if name == record_name or name.startswith(RAY_DROPPED) or "/tests/" in name:
                continue
            data = _stripped(src.read(name))
            zinfo = zipfile.ZipInfo(name, date_time=info.date_time)
            zinfo.external_attr = info.external_attr  # executables stay executable
            zinfo.compress_type = zipfile.ZIP_LZMA
            dst.writestr(zinfo, data)
            records.append(_record_line(name, data))
        records.append(f"{record_name},,")
        dst.writestr(record_name, "\n".join(records) + "\n")
    tmp.replace(out)
    return out


def ggml_library() -> Path:
    """Copy this machine's libggml-base into ``.llama/llama_cpp/lib`` (checked first)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        sys.exit('fetch.py: llama-cpp-python is not installed here (pip install -e ".[ggml]")')
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib" / "libggml-base.so"
    code = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True).stdout
    if "zmm" in code or "tileloadd" in code:
        sys.exit(f"fetch.py: {lib} holds AVX-512/AMX instructions; rebuild llama-cpp-python "
                 'with CMAKE_ARGS="-DGGML_NATIVE=OFF"')  # fmt: skip
    target = LLAMA / "llama_cpp" / "lib"
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy2(lib, target / "libggml-base.so")
    return target / "libggml-base.so"


def tracked_bytes() -> int:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.split(b"\0")  # fmt: skip
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def main() -> None:
    download(pinned())
    for wheel in WHEELS.glob("ray-*.whl"):
        slim_ray(wheel)
    lib = ggml_library()
    carried = sum(p.stat().st_size for p in WHEELS.glob("*.whl")) + lib.stat().st_size
    total = carried + tracked_bytes()
    for wheel in sorted(WHEELS.glob("*.whl")):
        print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
    print(f"{lib.stat().st_size / 2**20:7.2f} MiB  {lib.relative_to(ROOT)}")
    print(f"carried {carried / 2**20:.1f} MiB + tracked files = {total / 2**20:.1f} MiB "
          f"of {LIMIT / 2**20:.0f}")  # fmt: skip
    if total > LIMIT:
        sys.exit("fetch.py: too much to carry in one call; drop a wheel or slim Ray further")


if __name__ == "__main__":
    main()
