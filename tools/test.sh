#!/usr/bin/env bash
# Installs dependencies, builds, and runs the whole test suite: the libFuzzer
# targets for a bounded time, then every unit, integration and crash test
# under CTest (whose summary is the last thing printed).
# Usage: tools/test.sh   (env FUZZ_SECONDS, default 30 per target)
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh build

if [ -x tests/fuzz/run_fuzzers.sh ]; then
  cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDTE_FUZZ=ON \
    -DDTE_CUDA=OFF -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ >/dev/null
  ninja -C build-fuzz -j "$(nproc)" safetensors_header_fuzz delta_block_fuzz
  tests/fuzz/run_fuzzers.sh build-fuzz "${FUZZ_SECONDS:-30}"
fi

cd build
ctest --output-on-failure -j 2 --timeout 900
