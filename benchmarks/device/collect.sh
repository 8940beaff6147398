#!/bin/bash
# On a device machine: wait up to SECONDS (default 540) for every job start.sh started to end,
# print the tail of each log and nvidia-smi, and copy $HS/out (HS defaults to /tmp/hs: logs,
# JSON, tables; each job writes there) to $OUT as one tarball (the device tool brings back at
# most 8 files).
#   source benchmarks/device/env.sh && bash benchmarks/device/collect.sh 540
HS=${HS:-/tmp/hs}
wait_s=${1:-540}
end=$((SECONDS + wait_s))
# The jobs start.sh started (sequence.sh and its jobs), not this script: it matched itself and
# always waited the whole SECONDS.
jobs_running() { pgrep -af "benchmarks/device/[a-z0-9-]*\.sh" | grep -v "device/\(collect\|sample\)\.sh" > /dev/null; }
while jobs_running && [ $SECONDS -lt $end ]; do sleep 5; done
if jobs_running; then echo "collect: still running"; else echo "collect: all jobs ended"; fi
for log in "$HS"/out/*.log; do echo "== $log"; tail -n 25 "$log"; done
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv 2>/dev/null
du -sh "$HS/cache" 2>/dev/null
# Only what a person reads (a night's stage cache lives under out/night/*/cache: 43 GB on the
# 24-layer night, and the device tool brings back nothing over its size limit).
(cd "$HS" && find out -type f \( -name "*.log" -o -name "*.json" -o -name "*.md" -o -name "*.csv" \
  -o -name "*.yaml" -o -name "*.txt" -o -name "*.parquet" -o -name "*.png" -o -name "*.jsonl" \
  -o -name "*.head" \) -size -20M \
  -not -path "*/cache/cache/*" | tar -czf "$OUT/hs-out.tgz" -T -) && ls -la "$OUT"
# seeds.sh's model parts (15 MiB each) come back as files of their own
[ -d "$HS/out/seeds" ] && cp "$HS"/out/seeds/*.part* "$OUT/" 2>/dev/null && ls -la "$OUT"
