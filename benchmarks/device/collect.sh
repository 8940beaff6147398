#!/bin/bash
# On a device machine: wait up to SECONDS (default 540) for every job start.sh started to end,
# print the tail of each log and nvidia-smi, and copy /tmp/hs/out (logs, JSON, tables; each job
# writes there) to $OUT as one tarball (the device tool brings back at most 8 files).
#   source benchmarks/device/env.sh && bash benchmarks/device/collect.sh 540
wait_s=${1:-540}
end=$((SECONDS + wait_s))
while pgrep -f "benchmarks/device/[a-z0-9-]*\.sh" > /dev/null && [ $SECONDS -lt $end ]; do sleep 5; done
if pgrep -f "benchmarks/device/[a-z0-9-]*\.sh" > /dev/null; then echo "collect: still running"; else echo "collect: all jobs ended"; fi
for log in /tmp/hs/out/*.log; do echo "== $log"; tail -n 25 "$log"; done
nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv 2>/dev/null
du -sh /tmp/hs/cache 2>/dev/null
tar -czf "$OUT/hs-out.tgz" --exclude="*.hsc" --exclude="*.lock" --exclude="*/jax/*" -C /tmp/hs out 2>/dev/null && ls -la "$OUT"
