#!/bin/bash
# Samples, once a second until killed, what issue 46's acceptance reads per trial: the GPU's busy
# share and memory, and the host's used memory (RSS of everything on the machine; page cache
# excluded), each line stamped with the epoch seconds the trials' rows use (started_at, ended_at).
#   bash benchmarks/device/sample.sh FILE &    # lines: epoch gpu_util_% gpu_mem_MiB host_used_MiB
# Without nvidia-smi (a CPU smoke run) the GPU columns are '-'. busy.py reads FILE.
out=$1
parent=$PPID
while kill -0 "$parent" 2> /dev/null; do  # ends with the job that started it
  gpu="- -"
  if command -v nvidia-smi > /dev/null; then
    gpu=$(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits \
      | head -1 | tr -d ',')
  fi
  echo "$(date +%s.%N) $gpu $(free -m | awk '/^Mem:/{print $3}')" >> "$out"
  sleep 1
done
