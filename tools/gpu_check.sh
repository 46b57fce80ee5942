#!/usr/bin/env bash
# The checks that need a GPU, in one go: the CUDA backend's tests (which skip
# on machines without a device) must all run and pass here; the PyTorch
# interop tests run with torch on the GPU (the CUDA AdamW orders, fused=True
# included, and BF16 conversion against torch.optim.AdamW there, bit for
# bit; needs a python3 with torch built for CUDA, or DTE_PYTHON naming one:
# without it they are skipped with a message and the check fails at the
# end); then the CUDA
# benchmark prints its figures; with a full build in BUILD_DIR the
# distributed publisher's detection on GPU-resident state and the pushes into
# GPU memory are tested (C++ and Python) and tools/bench/gpu_sync.py measures
# a Qwen3-8B-shaped step from trainer state to receiver weights (JSON in
# $DTE_GPU_SYNC_JSON, default BUILD_DIR/gpu_sync.json; more options in
# $DTE_GPU_SYNC_ARGS), and with two or more GPUs the NCCL transport test runs
# too.
#
#   tools/gpu_check.sh [BUILD_DIR]     (default: build-gpu)
#
# BUILD_DIR may hold prebuilt tests/kernels_test and tools/bench/cuda_bench
# (both link the CUDA runtime statically and need none of the store's
# libraries, so they can be built on one machine and run on a GPU host);
# otherwise they are configured and built there for sm_80 and sm_90 (this
# needs the project's dependencies: tools/setup.sh installs them).
# Exits non-zero if any check fails or a CUDA test skips.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU visible (nvidia-smi -L failed)" >&2
  exit 1
fi
nvidia-smi -L
gpus=$(nvidia-smi -L | grep -c '^GPU')

if [[ ! -x $build/tests/kernels_test || ! -x $build/tools/bench/cuda_bench ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="80;90"
  cmake --build "$build" --target kernels_test cuda_bench
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
echo "== CUDA backend tests (Cuda.*)"
"$build/tests/kernels_test" --gtest_filter='Cuda.*' --gtest_color=no | tee "$log"
if grep -q '^\[  SKIPPED \]' "$log"; then
  echo "gpu_check: a CUDA test skipped on a machine with a GPU" >&2
  exit 1
fi
ran=$(grep -c '^\[       OK \]' "$log" || true)
if [[ $ran -lt 6 ]]; then
  echo "gpu_check: only $ran CUDA tests passed; expected every Cuda.* test" >&2
  exit 1
fi

# The script runs the optimizer steps with torch on the device; the test
# checks that the CUDA orders reproduce them bit for bit: foreach, single
# tensor and fused=True (a few steps, a tensor lr with capturable=True, and
# decay probes where an FP64 fused multiply-add and two roundings differ),
# plus the fused kernels' bias corrections from the device's pow.
python=${DTE_PYTHON:-$(command -v python3)}
torch_gpu=0
if fused_order=$("$python" -c '
import sys, torch
if not torch.cuda.is_available():
    sys.exit(1)
v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
print(torch.__version__, "torch_cuda_fused" if v < (2, 11) else "torch_cuda_fused_fp32")
' 2>/dev/null); then
  torch_gpu=1
  echo "== AdamW orders (fused=True included) and BF16 conversion against PyTorch on the GPU" \
    "(TorchInterop.*; torch ${fused_order% *}: fused=True is ${fused_order#* })"
  DTE_TORCH_DEVICE=cuda DTE_PYTHON=$python DTE_SOURCE_DIR=$PWD \
    "$build/tests/kernels_test" --gtest_filter='TorchInterop.*' --gtest_color=no
else
  echo "== AdamW and BF16 against PyTorch on the GPU: SKIPPED: $python has no torch with CUDA" \
    "(torch.cuda.is_available() is false or torch is missing); set DTE_PYTHON" >&2
fi

echo "== CUDA benchmark (tools/bench/cuda_bench)"
"$build/tools/bench/cuda_bench" "${DTE_GPU_BENCH_ELEMENTS:-268435456}"

if [[ -x $build/tests/sync_test && -f $build/sync/libdte.so && -x $build/tools/dtectl ]]; then
  echo "== Publishing from GPU memory and pushes into it (sync_test, tests/py -k 'cuda or gpu')"
  "$build/tests/sync_test" --gtest_filter='PushTest.Cuda*:PublisherRanksTest.StateOnTheGpu*' \
    --gtest_color=no | tee "$log"
  if grep -q '^\[  SKIPPED \]' "$log" || [[ $(grep -c '^\[       OK \]' "$log") -lt 2 ]]; then
    echo "gpu_check: a CUDA publish or push test did not run and pass" >&2
    exit 1
  fi
  python=${DTE_PYTHON:-$(command -v python3)}
  DTE_LIBRARY=$PWD/$build/sync/libdte.so DTE_BUILD_DIR=$PWD/$build DTE_SOURCE_DIR=$PWD \
    DTE_PYTHON=$python "$python" -m pytest -q -p no:cacheprovider -rs \
    tests/py/test_push.py tests/py/test_dist_publish.py -k 'cuda or gpu' | tee "$log"
  if grep -q 'skipped' "$log" || ! grep -q ' passed' "$log"; then
    echo "gpu_check: a Python CUDA test skipped or failed on a machine with a GPU" >&2
    exit 1
  fi
else
  echo "== Publishing from and pushes into GPU memory: not run (needs a full build's sync_test," \
    "dtectl and libdte.so in $build)"
fi

if [[ -f $build/sync/libdte.so && -x $build/tools/dtefs ]]; then
  # The issue-26 measurement: a Qwen3-8B-shaped step (as many layers as fit
  # the card) from trainer state on the GPU to a receiver process's fused
  # weights on the same GPU, by push and by live apply, against full copies.
  echo "== Trainer state to receiver weights on one GPU (tools/bench/gpu_sync.py)"
  python=${DTE_PYTHON:-$(command -v python3)}
  DTE_LIBRARY=$PWD/$build/sync/libdte.so "$python" tools/bench/gpu_sync.py --device cuda --live \
    --build-dir "$build" --json "${DTE_GPU_SYNC_JSON:-$build/gpu_sync.json}" \
    ${DTE_GPU_SYNC_ARGS:-}
else
  echo "== tools/bench/gpu_sync.py: not run (needs a full build's libdte.so and dtefs in $build)"
fi

fp8_hf=0
if [[ -x $build/tools/dtectl && -x $build/tools/dtefs && -x $build/tools/dte-gen ]]; then
  # Issue 29, item 5: transformers' fine-grained FP8 loads MOUNT/fp8/vN and
  # gets the logits and greedy tokens of a directory the reference quantizer
  # made from the same BF16 version (tools/fp8_hf_check.py).
  echo "== FP8 views loaded by transformers' fine-grained FP8 (tools/fp8_hf_check.py)"
  python=${DTE_PYTHON:-$(command -v python3)}
  fp8=$(mktemp -d)
  "$build/tools/dte-gen" -q -o "$fp8/gen" --hidden 1024 --layers 2 --intermediate 2816 \
    --heads 8 --kv-heads 4 --vocab 8192 --steps 1 --lr 2e-5
  "$build/tools/dtectl" import --store "$fp8/store" --cache-dir "$fp8/cache" "$fp8/gen/step-000000"
  "$build/tools/dtectl" commit --store "$fp8/store" --cache-dir "$fp8/cache" "$fp8/gen/step-000001"
  mkdir -p "$fp8/mnt"
  if "$build/tools/dtefs" "$fp8/store" "$fp8/mnt" --cache-dir "$fp8/cache-fs"; then
    for _ in $(seq 100); do [[ -e $fp8/mnt/fp8/latest/config.json ]] && break; sleep 0.1; done
    "$python" tools/fp8_hf_check.py --bf16 "$fp8/mnt/v00000001" --fp8 "$fp8/mnt/fp8/v00000001" \
      --gpu || fp8_hf=$?
    fusermount3 -u "$fp8/mnt" || true
  else
    echo "gpu_check: dtefs could not mount (no /dev/fuse?): the FP8 load check did not run" >&2
    fp8_hf=2
  fi
  rm -rf "$fp8"
else
  echo "== FP8 views in transformers: not run (needs a full build's dtectl, dtefs and dte-gen)"
fi

if [[ $gpus -ge 2 && -x $build/tests/sync_test ]]; then
  echo "== NCCL transport between two GPUs"
  "$build/tests/sync_test" --gtest_filter='P2P.Nccl*' --gtest_color=no
else
  echo "== NCCL transport: not run ($gpus GPU(s); it needs two and a full build's sync_test)"
fi
if [[ $fp8_hf -ne 0 ]]; then
  echo "gpu_check: the FP8 transformers check failed or could not run (status $fp8_hf)" >&2
  exit 1
fi
if [[ $torch_gpu -eq 0 ]]; then
  echo "gpu_check: the PyTorch-on-GPU checks (TorchInterop.*, fused AdamW included) did not run:" \
    "$python has no torch with CUDA" >&2
  exit 1
fi
echo "gpu_check: all GPU checks passed"
