#!/bin/bash
# The medium model's 2.31-bpw confirm (issue 29's last open item): build the medium demo model
# (bit-identical to docs/demo-model.md's sha256), sweep the budget-2.31 recipe against llama.cpp's
# IQ2_XS bytes on dev, report, and open the test split once (milestone budget-medium-2.31).
# Carry results/ledger.jsonl and .head so the ledger entry extends the project's chain.
set -u
out=/tmp/hs/out
cd /tmp/hs/repo
start=$SECONDS
[ -f demo-build-medium/demo-moe-medium.gguf ] || \
  python3 -m healsweep demo build --preset medium --out-dir demo-build-medium --no-figures
sha256sum demo-build-medium/demo-moe-medium.gguf
echo "built after $((SECONDS - start)) s"
python3 -m healsweep sweep run sweeps/medium-confirm-2.31.yaml --results "$out/results" \
  || python3 -m healsweep sweep resume "$out/results/medium-confirm-2.31"
python3 -m healsweep report "$out/results/medium-confirm-2.31"
cp results/ledger.jsonl* "$out/results/" 2>/dev/null
python3 -m healsweep confirm "$out/results/medium-confirm-2.31" --milestone budget-medium-2.31 \
  --results-root "$out/results" --quiet
python3 -m healsweep ledger verify --results "$out/results"
echo "medium231 done after $((SECONDS - start)) s"
