#!/bin/bash
# The device phases' checks alone (healsweep.heal.device_phases: the teacher record, routed_q,
# Part B's requantization and the ridge basis, each on the GPU against float64, its host path
# and the CPU), in seconds: a start that measures the night checks the paths it runs first.
# phases.sh runs them inside `healsweep doctor` with the device tests (about 4 minutes).
set -u
cd "${HS:-/tmp/hs}/repo"
python3 - <<'PY'
import jax
from healsweep.conformance.run import run_case
from healsweep.heal.device_phases import phase_cases

print(f"jax {jax.__version__}, {jax.default_backend()}: {jax.devices()[0].device_kind}")
failed = 0
for case in phase_cases():
    r = run_case(case)
    failed += not r.ok
    print(f"{'ok  ' if r.ok else 'FAIL'} {r.name:<28} {r.backend:<5} err {r.err:.2e} "
          f"cpu {r.cpu_err:.2e} device-vs-cpu {r.device_err:.2e} {r.path} {r.note}")
print(f"phasecheck: {failed} failed")
PY
