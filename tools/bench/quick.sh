#!/usr/bin/env bash
# The quick benchmark set: the headline ratio of every earlier benchmark, each
# against its baseline measured in the same run, in under 10 minutes on the
# reference machine (2 cores). It reuses the full benchmarks with smaller
# settings, then tools/bench/quick_report.py prints each ratio beside its
# reference figure (tools/bench/quick_reference.json) and flags any that is
# more than 20% worse. Exit status: 0 when nothing is flagged, 1 otherwise.
#
#   commit  store_bench.py: dtectl commit of one step of a 2 GiB model vs
#           zstd -1 -T0 of the same files (3 pairs)
#   fs      fs_bench.py: cold sequential read of a 512 MiB version through dtefs
#           vs passthrough_ll serving the same files exported (4 pairs)
#   chain   longrun_bench.py: 200 versions of a 4 MiB model, commit of the last
#           50 vs the first 50, a fresh mount reading latest and the worst
#           recent version vs the anchor
#   live    live_bench.py: dtectl apply of one step of a 512 MiB model vs a cold
#           reload of the version
#   dist    dist_publish_bench.py: a distributed publish of 2 ranks vs the
#           single-process publisher (CPU, bytes exchanged), 256 MiB model
#   push    push_bench.py: the push of a step to 1 receiver vs sending every
#           tensor whole (time, bytes), 256 MiB model
#   fp8_read  fp8_read.py: cold read of v1 of a 512 MiB model in FP8
#           (MOUNT/fp8/) vs in BF16 from fresh mounts (3 reps, 2 readers)
#   fp8_live  fp8_live_bench.py --quick: dtectl apply of one step into FP8
#           receivers (plain, pow2) vs a BF16 receiver (bytes into the quantized
#           tensors) and vs fp8_requant of the whole version, 256 MiB model
#   fp8_push  fp8_push_bench.py: the push of two steps into an FP8 receiver vs a
#           BF16 receiver (bytes into the quantized tensors; the server's time
#           at step 2, from its block summaries), 256 MiB model
#
# Not part of the test suite. Needs the tools, dtefs and libdte.so built:
#   ninja -C build dtectl dtefs dte-gen dte_shared fp8_requant
# Usage: tools/bench/quick.sh [BUILD_DIR]   (default build)
#   env QUICK_WORK   scratch directory on a disk (default /var/tmp/dte-quick);
#                    its stores and models are removed at the end unless
#                    QUICK_KEEP=1, the JSON and logs stay in QUICK_WORK/results
#   env QUICK_ONLY   a subset, e.g. "commit chain"
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=$(realpath "${1:-build}")
WORK=${QUICK_WORK:-/var/tmp/dte-quick}
ONLY=${QUICK_ONLY:-commit fs chain live dist push fp8_read fp8_live fp8_push}
. tools/python_env.sh
PY=$DTE_PYTHON
B=tools/bench
OUT=$WORK/results
rm -rf "$OUT"
mkdir -p "$OUT"

# run NAME CMD...: runs one benchmark, its output in $OUT/NAME.log; a failure
# is reported and leaves its ratios unmeasured (quick_report.py flags them).
run() {
  local name=$1 start=$SECONDS
  shift
  [[ " $ONLY " == *" $name "* ]] || return 0
  echo "== $name: $*"
  if "$@" >"$OUT/$name.log" 2>&1; then
    echo "   $((SECONDS - start)) s"
  else
    echo "   FAILED after $((SECONDS - start)) s; the last lines of $OUT/$name.log:"
    tail -n 5 "$OUT/$name.log" | sed 's/^/   /'
  fi
}

run commit env DTE_BUILD_DIR="$BUILD" $PY $B/store_bench.py --sizes 2GiB --reps 3 \
  --commit-only --work "$WORK/commit" --json "$OUT/commit.json"
run fs $PY $B/fs_bench.py --build-dir "$BUILD" --work "$WORK/fs" --size 512MiB --steps 1 \
  --depths 1 --repeat 4 --cold-only --quiet-timeout 3 --retries 0 --json "$OUT/fs.json"
run chain $PY $B/longrun_bench.py --build-dir "$BUILD" --work "$WORK/chain" --runs small \
  --small-steps 199 --reps 3 --json "$OUT/chain.json"
run live $PY $B/live_bench.py --build-dir "$BUILD" --work "$WORK/live" --quick --size 512MiB \
  --sections one --distances 1 --mapped-distances 1 --receivers 1 --base 2 --reps 2 \
  --json "$OUT/live.json"
run dist $PY $B/dist_publish_bench.py --build-dir "$BUILD" --worlds 2 --tensors 8 \
  --json "$OUT/dist.json"
run push $PY $B/push_bench.py --build-dir "$BUILD" --size 256MiB --receivers 1 --steps 4 \
  --json "$OUT/push.json"
run fp8_read env DTE_BUILD_DIR="$BUILD" $PY $B/fp8_read.py --size 512MiB --steps 1 --reps 3 \
  --quiet-timeout 3 --retries 0 --work "$WORK/fp8_read" --json "$OUT/fp8_read.json"
run fp8_live $PY $B/fp8_live_bench.py --build-dir "$BUILD" --work "$WORK/fp8_live" --quick \
  --size 256MiB --reps 1 --json "$OUT/fp8_live.json"
run fp8_push $PY $B/fp8_push_bench.py --build-dir "$BUILD" --size 256MiB --steps 2 \
  --kinds bf16,plain --work "$WORK" --json "$OUT/fp8_push.json"

echo "== total $SECONDS s; ratios against tools/bench/quick_reference.json:"
status=0
$PY $B/quick_report.py --results "$OUT" --reference $B/quick_reference.json --benches "$ONLY" ||
  status=$?
if [ "${QUICK_KEEP:-0}" != 1 ]; then
  rm -rf "$WORK/commit" "$WORK/fs" "$WORK/chain" "$WORK/live" "$WORK/fp8_read" "$WORK/fp8_live"
  echo "results and logs in $OUT"
else
  echo "kept $WORK (results and logs in $OUT)"
fi
exit "$status"
