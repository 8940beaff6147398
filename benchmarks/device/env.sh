# Sourced on a device machine at the start of every command (benchmarks/device/README.md):
#   source benchmarks/device/env.sh
# Installs the carried wheels (.whl/) and ggml's library (.llama/) into /tmp/site once per
# machine, outside the work tree (a later call replaces the tree; a job started in the
# background keeps running from /tmp/hs/repo), and sets the environment every job runs with.
set -u
export HS=${HS:-/tmp/hs}  # a CPU smoke run points it elsewhere
mkdir -p "$HS/out"
if [ ! -d .whl ]; then  # a CPU smoke run: this python3's own packages
  echo "env.sh: no .whl/ carried; using $(command -v python3)'s packages" >&2
elif [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "env.sh: wheel install failed" >&2; return 1; }
  # ggml's library only where it was fetched (no ggml-typed knob needs it otherwise)
  { [ ! -d .llama/llama_cpp ] || cp -r .llama/llama_cpp /tmp/site/; } && touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$PWD/src  # start.sh points its job at its own copy
export PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1
# One JAX process per GPU at a time takes what it needs, not 75% of the card up front: a doctor
# or test run beside a sweep must not starve it (stop 36).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export HEALSWEEP_CACHE=$HS/cache
# 64 GB of disk: the 17 GB model (34 GB while it is written), the bounded stage cache, the rest
export HEALSWEEP_CACHE_MAX_GB=${HEALSWEEP_CACHE_MAX_GB:-28}
# Keep NVLink multicast off (the device tool's rule for shared hosts).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
hs() { python3 -m healsweep "$@"; }
