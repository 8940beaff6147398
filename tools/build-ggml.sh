#!/usr/bin/env bash
# Build ggml's base library alone (libggml-base: ggml_quantize_chunk, the quantizer healsweep
# loads for llama.cpp's types) into the virtual environment, at <venv>/lib/healsweep-ggml/.
#
#   tools/build-ggml.sh [PYTHON]        # PYTHON: the venv's python (default .venv/bin/python)
#
# It takes the llama.cpp that llama-cpp-python 0.3.36 pins (the version the [ggml] extra
# installs, so the same quantizer bytes), from that package's source distribution, and compiles
# only the ggml-base target: 9 files instead of all of llama.cpp, libllama and the CPU backend
# (healsweep loads none of them). Needs cmake and a C/C++ compiler. Skipped when
# HEALSWEEP_GGML_LIB names a llama.cpp build you already have, or when the library is already
# built. `healsweep doctor` says which library is used.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-.venv/bin/python}
VERSION=0.3.36
if [ -n "${HEALSWEEP_GGML_LIB:-}" ]; then
  echo "build-ggml: HEALSWEEP_GGML_LIB=$HEALSWEEP_GGML_LIB is set; using that llama.cpp build"
  exit 0
fi
prefix=$("$PYTHON" -c 'import sys; print(sys.prefix)')
dest="$prefix/lib/healsweep-ggml"
case "$(uname -s)" in Darwin) lib=libggml-base.dylib ;; *) lib=libggml-base.so ;; esac
if [ -f "$dest/$lib" ]; then
  echo "build-ggml: $dest/$lib is already built"
  exit 0
fi
for tool in cmake cc c++; do
  command -v "$tool" >/dev/null || { echo "build-ggml: needs $tool (install it, or set HEALSWEEP_GGML_LIB to a llama.cpp build's libggml-base)" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "build-ggml: fetching llama-cpp-python $VERSION's source (the llama.cpp it pins)"
"$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work"
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
jobs=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)
echo "build-ggml: compiling ggml-base alone ($jobs jobs)"
cmake -S "$src" -B "$work/build" -Wno-dev -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF >"$work/configure.log" \
  || { cat "$work/configure.log" >&2; exit 1; }
cmake --build "$work/build" --target ggml-base -j "$jobs" >/dev/null
built=$(find "$work/build" -name "$lib" | head -n 1)
[ -n "$built" ] || { echo "build-ggml: the build left no $lib" >&2; exit 1; }
mkdir -p "$dest"
cp -L "$built" "$dest/$lib.tmp" && mv "$dest/$lib.tmp" "$dest/$lib"
echo "build-ggml: built $dest/$lib"
