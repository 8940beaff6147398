#!/bin/bash
# A real-size shape beside the A2.7B night (issue 46): a random qwen3moe of Qwen3-30B-A3B's shape
# (D 2048, 32 heads x 128 with 4 KV heads, 128 experts of 768, top-8, no shared expert), 24 of
# its 48 layers (to fit the device's 64 GB disk), a 151,936-token vocabulary, routed experts
# Q8_0 (~16 GB), then its cold trial measured as the night's (`bench night --gpu`, one config).
# No shared expert, so no Part B: the knobs fit alpha on the calibration trace (alpha: mse, the
# default KNOBS), so that the trace and routed_q, the night's costliest host phases, are measured.
# Started by start.sh (alone, or after night24 in one start); writes to $HS/out.
#   bash benchmarks/device/qwen3a3b.sh [LAYERS] [GRID] [WINDOWS] [VOCAB] [KNOBS]
#   (defaults: 24 1x1x1 64 151936 configs/knobs/mse-alpha.yaml; VOCAB 0: the tiny tokenizer)
# A smoke run on a CPU host (no nvidia-smi: no --gpu): `qwen3a3b.sh 1 1x1x1 2 0`.
set -u
HS=${HS:-/tmp/hs}
layers=${1:-24}; grid=${2:-1x1x1}; windows=${3:-64}; vocab=${4:-151936}
knobs=${5:-configs/knobs/mse-alpha.yaml}
model=$HS/qwen3a3b-${layers}l-v${vocab}.gguf
gpu=--gpu
command -v nvidia-smi > /dev/null || gpu=""
out=$HS/out
mkdir -p "$out"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
python3 -c "from healsweep.threads import seen; print('host threads', seen())"
# The A2.7B night's model and stage caches (one start runs both jobs) take the room this model
# needs while it is written: ~16 GB, twice that until it is renamed into place.
free_gb=$(df -Pk "$HS" | awk 'NR==2 {print int($4 / 1048576)}')
if [ ! -f "$model" ] && [ "$free_gb" -lt 40 ]; then
  echo "qwen3a3b: ${free_gb} GB free; removing the earlier jobs' models and night caches"
  find "$HS" -maxdepth 1 -name "*.gguf" ! -name "$(basename "$model")" -print -delete
  find "$out" -mindepth 3 -maxdepth 3 -type d -name cache -path "*/night*" -print -exec rm -rf {} +
  case "${HEALSWEEP_CACHE:-$HS/cache}" in "$HS"/*) rm -rf "${HEALSWEEP_CACHE:-$HS/cache}" ;; esac
  df -h "$HS" | tail -1
fi
if [ ! -f "$model" ]; then
  start=$SECONDS
  python3 - "$model" "$layers" "$vocab" <<'PY'
import sys
from healsweep.model.synthetic import write_random_model
experts = {f"ffn_{n}_exps.weight": "Q8_0" for n in ("gate", "up", "down")}
write_random_model(sys.argv[1], "qwen3moe", n_layer=int(sys.argv[2]), n_embd=2048, n_head=32,
                   n_head_kv=4, head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768,
                   n_ff_shexp=0, context_length=4096, types=experts,
                   vocab_size=int(sys.argv[3]) or None)
PY
  echo "model written in $((SECONDS - start)) s: $(du -h "$model" | cut -f1)"
fi
rm -f "$out/qwen3a3b-samples.txt"
bash benchmarks/device/sample.sh "$out/qwen3a3b-samples.txt" &
smi=$!
start=$SECONDS
python3 -m healsweep bench night "$model" $gpu --grid "$grid" --windows "$windows" --knobs "$knobs" --json \
  --out "$out/qwen3a3b" > "$out/qwen3a3b.json"
echo "bench night exit $? after $((SECONDS - start)) s"
cat "$out/qwen3a3b/night.md" 2>/dev/null
echo "== phase table of each trial (trials.parquet)"
python3 benchmarks/device/phases.py "$out/qwen3a3b"
kill "$smi" 2>/dev/null
echo "== GPU busy and host memory per trial"
python3 benchmarks/device/busy.py "$out/qwen3a3b-samples.txt" "$out/qwen3a3b"
du -sh "${HEALSWEEP_CACHE:-$HS/cache}" "$out/qwen3a3b" 2>/dev/null
echo "qwen3a3b done"
