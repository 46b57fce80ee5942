#!/usr/bin/env bash
# Installs every dependency dte needs on Debian 12 (run as root) and builds it.
# Usage: tools/setup.sh [BUILD_DIR [TARGET...]]   (default: build, every target)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}
TARGETS=("${@:2}")  # e.g. dtectl dtefs: only these and what they link

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  librocksdb-dev libzstd-dev zstd libfuse3-dev fuse3 libcurl4-openssl-dev libssl-dev
  libcli11-dev nlohmann-json3-dev libxxhash-dev libgtest-dev libgmock-dev prometheus-cpp-dev
  clang libclang-rt-14-dev clang-format
  python3 python3-pip python3-numpy python3-torch python3-pytest python3-matplotlib mypy
  time awscli chromium prometheus prometheus-pushgateway python3-prometheus-client
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

# Python packages the tests read mounted and exported files with; Debian's
# python3 (where python3-torch lives) is the interpreter the project uses.
PY=/usr/bin/python3
# moto is the S3-compatible server the S3 tests start on loopback (5.2.5
# honours `If-None-Match: *` on PutObject). It pulls a cryptography release
# Debian's python3-openssl cannot load, which Debian's awscli imports:
# pyOpenSSL>=25 matches it.
# transformers serves the push example's model (4.44 is the last release that
# runs on Debian's torch 1.13). ml_dtypes' float8_e4m3fn is the FP8 tests'
# reference, pinned: 0.4.1 runs on Debian's numpy 1.24, while 0.6 pulls in
# numpy 2, which Debian's scipy rejects.
# accelerate: transformers.Trainer needs it (dte.hf.PublishCallback's tests);
# 0.31 runs on torch 1.13 (0.34's multi-CPU setup calls torch.cpu.device_count,
# which 1.13 lacks).
if ! "$PY" -c 'import safetensors, xxhash, tokenizers, moto.server, OpenSSL.SSL, transformers, ml_dtypes, accelerate' \
    2>/dev/null; then
  echo "setup: installing python packages (safetensors, xxhash, tokenizers, moto, transformers, ml_dtypes, accelerate)"
  "$PY" -m pip install -q --break-system-packages --root-user-action=ignore \
    safetensors xxhash tokenizers 'moto[server]==5.2.5' 'pyOpenSSL>=25' 'transformers==4.44.2' \
    'ml_dtypes==0.4.1' 'accelerate==0.31.0'
fi

if [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: note: no CUDA toolkit at /usr/local/cuda; the CUDA backend is not built"
fi

cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDTE_WERROR=ON >/dev/null
ninja -C "$BUILD_DIR" -j "$(nproc)" "${TARGETS[@]}"
