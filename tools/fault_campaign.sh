#!/usr/bin/env bash
# The whole fault campaign (docs/s3.md, "Fault campaign"): every fault kind
# at every request position of every scenario, where the test suite tries a
# sample. Each case is one run of a scenario with exactly one fault, on a
# fresh store, followed by the invariant checks.
#
# Usage: tools/fault_campaign.sh [JOBS]
#   JOBS      scenarios run side by side, each with its own moto server and
#             proxy (default 1; the figures in docs/s3.md are for 1)
# Environment:
#   DTE_FAULT_CAMPAIGN_SCENARIOS  commit,gc,mount,publish,catchup (default: all)
#   DTE_FAULT_CAMPAIGN_KINDS      5xx,reset_before,reset_after,truncate,flip,stall,
#                                 list_drop_key,list_damage_key (default: all)
#   DTE_FAULT_CAMPAIGN            all (default) or sample (the suite's positions)
#   DTE_BUILD_DIR                 the build to test (default build/)
#   OUT                           where the reports go (default BUILD/fault_campaign)
# Prints each scenario's summary line and every failing case; writes every
# case as JSON to OUT/SCENARIO.json. Exit status 1 if any invariant failed.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${1:-1}
export DTE_SOURCE_DIR=$PWD
. tools/python_env.sh
export DTE_BUILD_DIR=${DTE_BUILD_DIR:-$PWD/build}
export DTE_FAULT_CAMPAIGN=${DTE_FAULT_CAMPAIGN:-all}
out=${OUT:-$DTE_BUILD_DIR/fault_campaign}
mkdir -p "$out"
scenarios=${DTE_FAULT_CAMPAIGN_SCENARIOS:-commit,gc,mount,publish,catchup}

run_one() {  # SCENARIO: one pytest run, its output in OUT/SCENARIO.log
  DTE_FAULT_CAMPAIGN_SCENARIOS=$1 DTE_FAULT_CAMPAIGN_REPORT=$out/$1.json \
    "$DTE_PYTHON" -m pytest -q -p no:cacheprovider -s \
    tests/py/test_fault_campaign.py::test_fault_campaign >"$out/$1.log" 2>&1
}
export -f run_one
export out

start=$(date +%s)
rc=0
tr ',' '\n' <<<"$scenarios" | xargs -P "$jobs" -I{} bash -c 'run_one {}' || rc=$?
for s in ${scenarios//,/ }; do
  grep -h -e '^fault campaign:' -e '^[a-z]* [a-z_0-9]*@[0-9]*: .*INVARIANT' "$out/$s.log" \
    | sed "s/^fault campaign:/$s: fault campaign:/" || echo "$s: no summary (see $out/$s.log)"
done
echo "fault campaign ($DTE_FAULT_CAMPAIGN positions): $(( $(date +%s) - start )) s with" \
  "$jobs job(s); reports in $out"
exit $(( rc != 0 ))
