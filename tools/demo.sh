#!/usr/bin/env bash
# The main job end to end on the embedded default: installs dependencies,
# builds, generates a realistic checkpoint sequence (a Llama-style model whose
# BF16 weights evolve under AdamW at an RL learning rate), imports the first
# checkpoint into a local directory store, commits the rest as sparse deltas,
# shows the log, exports the latest version and checks it byte for byte,
# verifies the store, then mounts it with dtefs and loads a tensor from the
# mount with the Python safetensors package; last, a process maps live/ at v1
# and dtectl apply moves it to the latest in place.
# Usage: tools/demo.sh   (env DEMO_DIR, default ./demo; DEMO_SIZE, default 256MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh build dtectl dtefs dte-gen  # the three tools below, not the tests
ROOT=$PWD
. tools/python_env.sh
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
diff -r "$DEMO/export" "$DEMO/ckpt/step-$(printf %06d "$STEPS")"  # set -e: a difference stops here
echo "export: byte-identical"

echo "== verify"
"$DTECTL" verify
du -sh "$DEMO/store" "$DEMO/ckpt"

echo "== mount the store with dtefs"
MNT=$(mktemp -d "${TMPDIR:-/tmp}/dte-demo-mnt.XXXXXX")
unmount() {
  if mountpoint -q "$MNT"; then
    fusermount3 -u "$MNT" || umount -l "$MNT"
  fi
  rmdir "$MNT"
}
trap unmount EXIT  # also when a step below fails
"$ROOT/build/tools/dtefs" "$DTE_STORE" "$MNT"  # index in $DTE_CACHE_DIR; daemonizes once mounted
echo "\$ ls $MNT"
ls "$MNT"
echo "\$ ls -l $MNT/latest/"
ls -l "$MNT/latest/"

echo "== load a tensor from $MNT/latest with safetensors (torch) and compare it with the export"
"$DTE_PYTHON" - "$MNT/latest" "$DEMO/export" <<'PY'
import json, os, sys
import torch
from safetensors import safe_open

mounted, exported = sys.argv[1:]
index = os.path.join(mounted, "model.safetensors.index.json")
if os.path.exists(index):
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
else:
    with safe_open(os.path.join(mounted, "model.safetensors"), framework="pt") as f:
        weight_map = dict.fromkeys(f.keys(), "model.safetensors")
name = "model.layers.0.self_attn.q_proj.weight"
name = name if name in weight_map else sorted(weight_map)[0]
with safe_open(os.path.join(mounted, weight_map[name]), framework="pt") as f:
    got = f.get_tensor(name)
with safe_open(os.path.join(exported, weight_map[name]), framework="pt") as f:
    want = f.get_tensor(name)
print(f"{name} (from latest/{weight_map[name]}): shape {tuple(got.shape)}, dtype {got.dtype}")
# Compare the raw bits (an element-wise == would treat NaNs as different).
assert got.dtype == want.dtype and got.shape == want.shape
assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
print("equal to the same tensor in the exported directory")
PY

echo "== $MNT/.dte/status"
"$DTE_PYTHON" - "$MNT/.dte/status" <<'PY'
import json, sys
with open(sys.argv[1]) as f:
    s = json.load(f)
print(f"versions {s['versions']}, latest {s['latest']}; {s['reads']} reads, "
      f"{s['bytes_served']} bytes served, {s['blocks_decoded']} blocks decoded, "
      f"{s['read_errors']} read errors; cache {s['cache']['bytes']} bytes, "
      f"{s['cache']['hits']} hits, {s['cache']['misses']} misses")
PY

echo "== live apply: a process maps $MNT/live/ and sees v1 become the latest in place"
# Remount with live/ at v1, as a server would have loaded an older policy.
fusermount3 -u "$MNT"
"$ROOT/build/tools/dtefs" "$DTE_STORE" "$MNT" --live-version 1
"$DTE_PYTHON" - "$MNT" "$DEMO/ckpt" "$ROOT/build/tools/dtectl" <<'PY'
import hashlib, json, mmap, os, subprocess, sys
mnt, ckpt, dtectl = sys.argv[1:]
shards = sorted(n for n in os.listdir(os.path.join(mnt, "live")) if n.endswith(".safetensors"))
want = lambda step, n: hashlib.sha256(open(f"{ckpt}/step-{step:06d}/{n}", "rb").read()).hexdigest()
maps = {n: mmap.mmap(os.open(os.path.join(mnt, "live", n), os.O_RDONLY), 0, prot=mmap.PROT_READ)
        for n in shards}
assert all(hashlib.sha256(m[:]).hexdigest() == want(1, n) for n, m in maps.items())
print(f"mapped {len(shards)} shard(s) of live/ at v1")
r = subprocess.run([dtectl, "apply", mnt], capture_output=True, text=True, check=True)
print(r.stdout.strip())
latest = int(os.readlink(os.path.join(mnt, "latest"))[1:])
assert all(hashlib.sha256(m[:]).hexdigest() == want(latest, n) for n, m in maps.items())
print(f"the same mappings now hold v{latest} byte for byte (no reopen, no re-read)")
PY
"$ROOT/build/tools/dtectl" status "$MNT"

echo "== unmount"
fusermount3 -u "$MNT"
trap - EXIT
rmdir "$MNT"
echo "unmounted $MNT"
