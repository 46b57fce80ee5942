#!/usr/bin/env bash
# The main job end to end on the embedded default: installs dependencies,
# builds, generates a realistic checkpoint sequence (a Llama-style model whose
# BF16 weights evolve under AdamW at an RL learning rate), imports the first
# checkpoint into a local directory store, commits the rest as sparse deltas,
# shows the log, exports the latest version and checks it byte for byte, and
# verifies the store.
# Usage: tools/demo.sh   (env DEMO_DIR, default ./demo; DEMO_SIZE, default 256MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh build
ROOT=$PWD
DEMO=${DEMO_DIR:-$ROOT/demo}
SIZE=${DEMO_SIZE:-256MiB}
STEPS=6
DTECTL=$ROOT/build/tools/dtectl
rm -rf "$DEMO"
mkdir -p "$DEMO"
export DTE_STORE=$DEMO/store DTE_CACHE_DIR=$DEMO/cache

echo "== generating $((STEPS + 1)) checkpoints of a $SIZE model"
"$ROOT/build/tools/dte-gen" --out "$DEMO/ckpt" --size "$SIZE" --steps "$STEPS" --shard-size 100MiB

echo "== import + commit"
"$DTECTL" import "$DEMO/ckpt/step-000000"
for s in $(seq 1 "$STEPS"); do
  "$DTECTL" commit "$DEMO/ckpt/step-$(printf %06d "$s")"
done

echo "== log"
"$DTECTL" log

echo "== export latest and compare with the committed directory"
"$DTECTL" export --version latest "$DEMO/export"
diff -r "$DEMO/export" "$DEMO/ckpt/step-$(printf %06d "$STEPS")" && echo "export: byte-identical"

echo "== verify"
"$DTECTL" verify
du -sh "$DEMO/store" "$DEMO/ckpt"
