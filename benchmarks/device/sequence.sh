#!/bin/bash
# Run device jobs one after the other (start.sh's list, `JOB ARGS + JOB ARGS ...`), each logging
# to $HS/out/JOB.log; a job that fails does not stop the next. Run from $HS/repo.
set -u
HS=${HS:-/tmp/hs}
run() {
  local job=$1; shift
  local start=$SECONDS
  echo "$(date -u +%T) $job $* started"
  bash "benchmarks/device/$job.sh" "$@" > "$HS/out/$job.log" 2>&1
  echo "$(date -u +%T) $job exit $? after $((SECONDS - start)) s"
}
job=()
for word in "$@" +; do
  if [ "$word" = + ]; then
    [ ${#job[@]} -gt 0 ] && run "${job[@]}"
    job=()
  else
    job+=("$word")
  fi
done
echo "sequence done"
