#!/bin/bash
# On a device machine: start one job (a script in benchmarks/device/) or a list of them, run one
# after the other, in the background, detached (setsid), from a copy of the work tree at
# $HS/repo (HS defaults to /tmp/hs); each job's log is $HS/out/JOB.log, the list's own
# $HS/out/start.log. Jobs are separated by `+`, each with its arguments:
#   source benchmarks/device/env.sh && bash benchmarks/device/start.sh night24
#   ... && bash benchmarks/device/start.sh night24 24 2x3x4 64 151936 + qwen3a3b 24
# One GPU start then runs the whole list (the A2.7B night, then the Qwen3-30B-A3B cold trial);
# collect.sh waits for the list's end.
set -eu
HS=${HS:-/tmp/hs}
[ $# -gt 0 ] || { echo "start.sh: name a job (a script in benchmarks/device/)" >&2; exit 1; }
for word in "$@"; do  # every job named must exist before anything starts
  case "$word" in +) expect=1 ;; *) if [ "${expect:-1}" = 1 ]; then
    [ -f "benchmarks/device/$word.sh" ] || { echo "start.sh: no job benchmarks/device/$word.sh" >&2; exit 1; }
    expect=0; fi ;; esac
done
mkdir -p "$HS/repo" "$HS/out"
rsync -a --delete --exclude .whl --exclude .llama --exclude .git --exclude .venv ./ "$HS/repo/" 2>/dev/null \
  || { rm -rf "$HS/repo" && mkdir -p "$HS/repo" && tar --exclude=.whl --exclude=.llama --exclude=.git --exclude=.venv -cf - . | tar -xf - -C "$HS/repo"; }
cd "$HS/repo"
export PYTHONPATH=/tmp/site:$HS/repo/src HS
setsid nohup bash benchmarks/device/sequence.sh "$@" > "$HS/out/start.log" 2>&1 < /dev/null &
echo "started $* (pid $!), logs $HS/out/*.log"
