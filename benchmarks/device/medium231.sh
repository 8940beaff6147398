#!/bin/bash
# The medium model's confirms on a GPU (issue 29's last open item, issue 49's item 7): build the
# medium demo model (docs/demo-model.md's sha256 f15bee22…), sweep the budget-2.31 and budget-3.06
# recipes against llama.cpp's IQ2_XS and IQ3_XXS bytes on dev, report, and open the test split
# once each (milestones budget-medium-2.31, budget-medium-3.06). The confirms record in a copy of
# the project's ledger (ledger/ledger.jsonl and its .head) under $HS/out/ledger, which comes back
# with the collect; copy it over ledger/ here and commit it.
#   bash benchmarks/device/medium231.sh [2.31 3.06]
# MEDIUM_SMOKE=1: a smoke run of the whole script on a CPU (the medium build's dense training
# step needs 32 GB there, so the shipped demo-medium-cpu file stands in for the model; 2 windows
# a sweep and a confirm, milestones smoke-…, the ledger copy under $HS/out/ledger-smoke).
set -u
HS=${HS:-/tmp/hs}
out=$HS/out
cd "$HS/repo"
start=$SECONDS
budgets=("$@"); [ ${#budgets[@]} -gt 0 ] || budgets=(2.31 3.06)
smoke=${MEDIUM_SMOKE:-}
ledger=$out/ledger${smoke:+-smoke}
mkdir -p "$ledger" "$out/results"
cp ledger/ledger.jsonl ledger/ledger.jsonl.head "$ledger/"
if [ -n "$smoke" ]; then
  mkdir -p demo-build-medium
  cp src/healsweep/assets/demo-moe-medium-cpu.gguf demo-build-medium/demo-moe-medium.gguf
fi
[ -f demo-build-medium/demo-moe-medium.gguf ] || \
  python3 -m healsweep demo build --preset medium --out-dir demo-build-medium --no-figures \
  || { echo "medium: build failed"; exit 1; }
sha256sum demo-build-medium/demo-moe-medium.gguf
echo "built after $((SECONDS - start)) s"
for budget in "${budgets[@]}"; do
  name=medium-confirm-$budget
  spec=sweeps/$name.yaml
  milestone=budget-medium-$budget
  windows=()
  if [ -n "$smoke" ]; then  # the same spec, 2 windows, recording in the smoke ledger
    name=smoke-$name
    sed -e "s/max_windows: 96/max_windows: 2/" -e "s#^ledger: .*#ledger: $ledger/ledger.jsonl#" \
      -e "s/^name: .*/name: $name/" "$spec" > "sweeps/$name.yaml"
    spec=sweeps/$name.yaml milestone=smoke-$milestone windows=(--max-windows 2)
  fi
  python3 -m healsweep sweep run "$spec" --results "$out/results" --quiet \
    || python3 -m healsweep sweep resume "$out/results/$name" --quiet \
    || { echo "$name: the sweep failed after $((SECONDS - start)) s"; continue; }
  python3 -m healsweep report "$out/results/$name" | head -40
  python3 -m healsweep confirm "$out/results/$name" --milestone "$milestone" \
    --results-root "$ledger" "${windows[@]}" \
    && echo "$name confirmed after $((SECONDS - start)) s" \
    || echo "$name: the confirm failed after $((SECONDS - start)) s"
done
python3 -m healsweep ledger verify --results "$ledger"
echo "medium231 done after $((SECONDS - start)) s"
