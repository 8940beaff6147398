#!/bin/bash
# The device's phases (issue 46, item 2) in one start: `healsweep doctor` (the kernels and the
# device phases against float64 and their host paths), the device-marked tests, and the phase
# table of benchmarks/device_phases.py (teacher record, routed_q, ridge basis: before vs after).
#   source benchmarks/device/env.sh && bash benchmarks/device/start.sh phases && bash benchmarks/device/collect.sh 540
# Smoke run on a CPU (seconds-sized shapes, the CPU-only tests): bash benchmarks/device/phases.sh --small
set -u
out=${HS:-/tmp/hs}/out
mkdir -p "$out"
cd "$(dirname "$0")/../.."
small=${1:-}
start=$SECONDS
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== doctor"
python3 -m healsweep doctor --no-ray; echo "doctor exit $? after $((SECONDS - start)) s"
echo "== pytest -m device"
tests="tests/test_device_phases.py tests/test_teacher_cache.py tests/test_doctor.py tests/test_backend_rules.py"
marker=device
if [ "$small" = "--small" ]; then  # a CPU has no device to test: the phases' CPU tests instead
  tests=tests/test_device_phases.py marker="not device"
fi
python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "$marker" --durations=10 $tests 2>&1 \
  | tail -n 30
echo "pytest exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
echo "== phase table"
python3 benchmarks/device_phases.py $small --json "$out/device_phases.json"
echo "phases done after $((SECONDS - start)) s"
