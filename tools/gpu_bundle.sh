#!/usr/bin/env bash
# Packs what tools/gpu_check.sh runs into one archive for a GPU host that
# has neither the project's dependencies nor a network: the CUDA tests, the
# CUDA benchmark, sync_test, libdte.so, dtefs, dtectl and dte-gen of BUILD_DIR
# (stripped, at the same paths under BUILD_DIR), and the shared libraries
# they load that are not the C library's own (under lib/).
#
#   tools/gpu_bundle.sh [BUILD_DIR] [OUT]   (defaults: build, build-bundle/gpu.tar.xz)
#
# On the GPU host, from a checkout of the same commit:
#   mkdir -p /tmp/b && tar -xJf build-bundle/gpu.tar.xz -C /tmp/b &&
#   LD_LIBRARY_PATH=/tmp/b/lib tools/gpu_check.sh /tmp/b/BUILD_DIR
# BUILD_DIR must hold a CUDA build (the default when nvcc is found; set
# CMAKE_CUDA_ARCHITECTURES to the card's, e.g. "80;90", or rely on PTX).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=${2:-build-bundle/gpu.tar.xz}
files=(tests/kernels_test tools/bench/cuda_bench tests/sync_test sync/libdte.so tools/dtefs tools/dte-gen
       tools/dtectl)
for f in "${files[@]}"; do
  [[ -e $build/$f ]] || { echo "gpu_bundle: $build/$f is not built" >&2; exit 1; }
done
if ! grep -q 'cudaGetDeviceCount' <(strings "$build/tests/kernels_test" 2>/dev/null) ; then
  echo "gpu_bundle: $build/tests/kernels_test has no CUDA runtime (a build with DTE_CUDA=OFF?)" >&2
  exit 1
fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib"
for f in "${files[@]}"; do
  mkdir -p "$stage/$build/$(dirname "$f")"
  strip --strip-debug -o "$stage/$build/$f" "$build/$f"
  # Every resolved library but the C library's own and the CUDA driver,
  # which the GPU host provides.
  ldd "$build/$f" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' |
    grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libcuda)\.so' |
    while read -r lib; do cp -nL "$lib" "$stage/lib/"; done
done
mkdir -p "$(dirname "$out")"
tar -C "$stage" -cJf "$out" .
echo "gpu_bundle: $out, $(du -h "$out" | cut -f1) ($(ls "$stage/lib" | wc -l) shared libraries)"
