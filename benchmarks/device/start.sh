#!/bin/bash
# On a device machine: start JOB (a script in benchmarks/device/) in the background, detached
# (setsid), from a copy of the work tree at /tmp/hs/repo; its log is /tmp/hs/out/JOB.log.
#   source benchmarks/device/env.sh && bash benchmarks/device/start.sh night24
set -eu
job=$1; shift
mkdir -p /tmp/hs/repo /tmp/hs/out
rsync -a --delete --exclude .whl --exclude .llama --exclude .git ./ /tmp/hs/repo/ 2>/dev/null \
  || { rm -rf /tmp/hs/repo && mkdir -p /tmp/hs/repo && tar --exclude=.whl --exclude=.llama --exclude=.git -cf - . | tar -xf - -C /tmp/hs/repo; }
cd /tmp/hs/repo
export PYTHONPATH=/tmp/site:/tmp/hs/repo/src
setsid nohup bash "benchmarks/device/$job.sh" "$@" > "/tmp/hs/out/$job.log" 2>&1 < /dev/null &
echo "started $job (pid $!), log /tmp/hs/out/$job.log"
