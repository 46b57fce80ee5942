#!/usr/bin/env bash
# Runs each libFuzzer target for a bounded time, starting from its checked-in
# seed corpus, and exits non-zero if any target crashes, leaks, times out or
# is missing. Targets run side by side, one per core.
#
#   tests/fuzz/run_fuzzers.sh BUILD_DIR SECONDS [TARGET...]
#
# BUILD_DIR is a build configured with -DDTE_FUZZ=ON and clang, with the
# targets built (see docs/formats/safetensors.md, "Fuzzing"). New inputs go
# to a scratch corpus, never into the source tree; crash reproducers are
# written to BUILD_DIR/fuzz-artifacts/TARGET/.
set -u -o pipefail

if [[ $# -lt 2 || ! "$2" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 BUILD_DIR SECONDS [TARGET...]" >&2
  exit 2
fi
build_dir=$(cd "$1" && pwd) || exit 2
seconds=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  targets=(safetensors_header_fuzz delta_block_fuzz s3_xml_fuzz c_api_fuzz auth_handshake_fuzz)
fi

# Longest input per target: headers stay small; codec inputs must reach a
# 256 KiB block of raw payload.
declare -A max_len=([safetensors_header_fuzz]=65536 [delta_block_fuzz]=266000 [s3_xml_fuzz]=65536)

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# One target: its output goes to $scratch/TARGET.out, its verdict to
# $scratch/TARGET.ok when it passed.
fuzz_one() {
  local target=$1 bin="$build_dir/tests/fuzz/$1"
  if [[ ! -x "$bin" ]]; then
    echo "== $target: $bin not built"
    return
  fi
  local artifacts="$build_dir/fuzz-artifacts/$target"
  mkdir -p "$artifacts" "$scratch/$target"
  local args=(-max_total_time="$seconds" -timeout=20 -rss_limit_mb=2048
              -max_len="${max_len[$target]:-65536}" -print_final_stats=1
              -artifact_prefix="$artifacts/")
  [[ -f "$here/$target.dict" ]] && args+=(-dict="$here/$target.dict")
  echo "== $target: ${seconds}s"
  # libFuzzer logs every new input; keep that in a file and show its final
  # statistics, or the whole log when the target fails.
  local log="$build_dir/fuzz-artifacts/$target.log"
  if "$bin" "${args[@]}" "$scratch/$target" "$here/corpus/$target" >"$log" 2>&1; then
    grep -E '^(Done|stat::number_of_executed_units|stat::peak_rss_mb)' "$log" || tail -n 3 "$log"
    echo "== $target: ok"
    touch "$scratch/$target.ok"
  else
    tail -n 60 "$log"
    echo "== $target: FAILED (reproducers in $artifacts, log $log)"
  fi
}

# As many targets at once as there are cores (FUZZ_JOBS), each for SECONDS;
# their outputs are printed in order once all have finished.
jobs_max=${FUZZ_JOBS:-$(nproc)}
for target in "${targets[@]}"; do
  while (($(jobs -rp | wc -l) >= jobs_max)); do wait -n || true; done
  fuzz_one "$target" >"$scratch/$target.out" 2>&1 &
done
wait
failed=()
for target in "${targets[@]}"; do
  if [[ -f "$scratch/$target.ok" ]]; then
    cat "$scratch/$target.out"
  else
    cat "$scratch/$target.out" >&2
    failed+=("$target")
  fi
done

if [[ ${#failed[@]} -gt 0 ]]; then
  echo "fuzzing failed: ${failed[*]}" >&2
  exit 1
fi
echo "fuzzing passed: ${targets[*]}"
