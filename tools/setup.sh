#!/usr/bin/env bash
# Installs every dependency dte needs on Debian 12 (run as root) and builds it.
# Usage: tools/setup.sh [BUILD_DIR [TARGET...]]   (default: build, every target)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
TARGETS=("${@:2}")  # e.g. dtectl dtefs: only these and what they link

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git ccache
  librocksdb-dev libzstd-dev zstd libfuse3-dev fuse3 libcurl4-openssl-dev libssl-dev
  libcli11-dev nlohmann-json3-dev libxxhash-dev libgtest-dev libgmock-dev prometheus-cpp-dev
  clang libclang-rt-14-dev clang-format
  python3 python3-venv
  time awscli chromium prometheus prometheus-pushgateway
)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The Python environment: a virtualenv on Debian's python3 with every
# package pinned in tools/python.lock (torch, transformers, accelerate, TRL,
# safetensors, numpy, ml_dtypes, moto, pytest, ...). Every Python test,
# example and benchmark runs in it; tools/python_env.sh names it. A run on
# a machine that has it checks the lock's hash and returns at once.
. tools/python_env.sh
LOCK_HASH=$(sha256sum tools/python.lock | cut -d' ' -f1)
if [ "$(cat "$DTE_VENV/.dte-lock" 2>/dev/null)" != "$LOCK_HASH" ]; then
  echo "setup: installing the Python environment $DTE_VENV from tools/python.lock"
  [ -x "$DTE_PYTHON" ] || /usr/bin/python3 -m venv "$DTE_VENV"
  "$DTE_PYTHON" -m pip install -q --root-user-action=ignore --upgrade 'pip==26.3'
  "$DTE_PYTHON" -m pip install -q --root-user-action=ignore -r tools/python.lock
  echo "$LOCK_HASH" >"$DTE_VENV/.dte-lock"
fi

if [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: note: no CUDA toolkit at /usr/local/cuda; the CUDA backend is not built"
fi

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDTE_WERROR=ON \
  -DDTE_PYTHON="$DTE_PYTHON" >/dev/null
ninja -C "$BUILD_DIR" -j "$(nproc)" "${TARGETS[@]}"
