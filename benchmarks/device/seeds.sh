#!/bin/bash
# Issue 49's seed checks: demo-medium-cpu's recipe rebuilt from other seeds on the GPU (the
# shipped seed-0 file took 35 s of training on an H200; about 55 min a seed on the 2-core CPU).
# `healsweep demo build --preset medium-cpu --seed N` for each seed given (default 1 2), each file
# split into 15 MiB parts under $HS/out/seeds (the device tool returns files of at most 16 MiB;
# collect.sh copies the parts to $OUT). Join them here: `cat seedN.gguf.part* > seedN.gguf`,
# and check the sha256 the log prints.
#   bash benchmarks/device/seeds.sh [SEED ...]      (SEED_STEPS=N: a short smoke build)
set -u
HS=${HS:-/tmp/hs}
out=$HS/out/seeds
mkdir -p "$out"
seeds=("$@"); [ ${#seeds[@]} -gt 0 ] || seeds=(1 2)
for seed in "${seeds[@]}"; do
  start=$SECONDS
  dir=$HS/seed$seed
  python3 -m healsweep demo build --preset medium-cpu --seed "$seed" --out-dir "$dir" \
    --no-figures ${SEED_STEPS:+--steps "$SEED_STEPS"} || { echo "seed $seed: build failed"; continue; }
  file=$(ls "$dir"/*.gguf | head -1)
  sha256sum "$file"
  split -b 15M -d "$file" "$out/seed$seed.gguf.part"
  echo "seed $seed built in $((SECONDS - start)) s: $(stat -c %s "$file") bytes"
done
echo "seeds done"
