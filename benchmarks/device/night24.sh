#!/bin/bash
# The full-depth night on one GPU (issue 38): a random qwen2moe of Qwen1.5-MoE-A2.7B's shape,
# 24 layers, 151,936-token vocabulary, routed experts Q8_0 (17.0 GB), then `bench night --gpu`.
# Started by start.sh (in the background, from $HS/repo; HS defaults to /tmp/hs); writes to
# $HS/out, and prints bench night's tables and each trial's phase table (phases.py) in its log.
#   bash benchmarks/device/night24.sh [LAYERS] [GRID] [WINDOWS] [VOCAB]
#   (defaults: 24 2x3x4 64 151936; VOCAB 0 keeps the tiny test tokenizer)
# A smoke run of this script on a CPU host (no nvidia-smi: no --gpu): `night24.sh 1 1x1x2 2 0`.
set -u
HS=${HS:-/tmp/hs}
layers=${1:-24}; grid=${2:-2x3x4}; windows=${3:-64}; vocab=${4:-151936}
model=$HS/a27b-${layers}l-v${vocab}.gguf
gpu=--gpu
command -v nvidia-smi > /dev/null || gpu=""
out=$HS/out
mkdir -p "$out"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
python3 -c "from healsweep.threads import seen; print('host threads', seen())"
if [ ! -f "$model" ]; then
  start=$SECONDS
  python3 - "$model" "$layers" "$vocab" <<'PY'
import sys
from healsweep.model.synthetic import write_random_model
experts = {f"ffn_{n}_exps.weight": "Q8_0" for n in ("gate", "up", "down")}
write_random_model(sys.argv[1], n_layer=int(sys.argv[2]), n_embd=2048, n_head=16, n_head_kv=16,
                   n_expert=60, n_expert_used=4, n_ff_exp=1408, n_ff_shexp=5632,
                   context_length=4096, types=experts, vocab_size=int(sys.argv[3]) or None)
PY
  echo "model written in $((SECONDS - start)) s: $(du -h "$model" | cut -f1)"
fi
# GPU busy share and host used memory, once a second, for each trial's span (busy.py)
rm -f "$out/night-samples.txt"
bash benchmarks/device/sample.sh "$out/night-samples.txt" &
smi=$!
start=$SECONDS
python3 -m healsweep bench night "$model" $gpu --grid "$grid" --windows "$windows" --json \
  --out "$out/night" > "$out/night.json"
echo "bench night exit $? after $((SECONDS - start)) s"
cp "$out/night/night.md" "$out/night.md" 2>/dev/null && cat "$out/night.md"
echo "== phase table of each trial (trials.parquet)"
python3 benchmarks/device/phases.py "$out/night"
kill "$smi" 2>/dev/null
echo "== GPU busy and host memory per trial"
python3 benchmarks/device/busy.py "$out/night-samples.txt" "$out/night"
du -sh "${HEALSWEEP_CACHE:-$HS/cache}" "$out/night" 2>/dev/null
echo "night24 done"
