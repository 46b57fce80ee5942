"""Writes PyTorch reference data for tests/kernels/torch_interop_test.cc.

Usage: torch_interop.py OUT_DIR

With DTE_TORCH_DEVICE=cuda the conversions and the optimizer steps run on
the GPU (tools/gpu_check.sh does this); the default is the CPU.

Files written to OUT_DIR (all little-endian, no headers):
  bf16_in.u32          FP32 inputs as raw bits: 10^7 random bit patterns, then
                       every special class (see special_patterns()).
  bf16_contig.u16      t.to(torch.bfloat16) of the contiguous tensor.
  bf16_strided.u16     the same conversion on a non-contiguous view, which
                       PyTorch runs through its scalar c10::BFloat16 path.
  adamw.txt            one line per (case, step):
                         name device order lr weight_decay beta1 beta2 eps step n file
                       order: the dte order name of the kernel that ran the
                       step (sync/python/dte/_lib.py ORDERS, see adamw_order());
                       floats in repr() form so C++ strtod reads the exact
                       doubles Python used.
  unmodelled.txt       one line per kernel not run because no dte order
                       models it: impl cases reason. On the CPU, the
                       single-tensor and foreach kernels when this torch's
                       FP32 torch.sqrt is not correctly rounded (torch 2.x
                       with MKL: about 1 in 5 results 1 ulp off; the fused
                       CPU kernel's square root is exact); the publisher
                       compares weights for them instead.
  adamw_*.f32          per line: prev, exp_avg, exp_avg_sq, param as four
                       consecutive float32 arrays of n elements.
  bias.txt             (DEVICE cuda only) one line per (order, beta1, beta2):
                         order beta1 beta2 steps file
                       for the two fused CUDA orders.
  bias_*.u32           per line: for steps 1..steps, the FP32 bits of
                       1 - beta1^step and of sqrt(1 - beta2^step) as that
                       fused kernel computes them (torch.pow on DEVICE, in
                       FP64 or FP32), two uint32 arrays.

Exits non-zero with a message on stderr when torch or numpy is missing.
"""

import os
import sys
import zlib
from fractions import Fraction

try:
    import numpy as np
    import torch
except ImportError as e:  # The caller turns this into a test failure.
    sys.stderr.write(f"torch_interop.py needs numpy and torch: {e}\n")
    sys.exit(3)

RANDOM_PATTERNS = 10_000_000
DEVICE = os.environ.get("DTE_TORCH_DEVICE", "cpu")
ADAMW_STEPS = 5
BIAS_STEPS = 100_000


def special_patterns():
    """Every class where FP32 -> BF16 rounding has a special case."""
    hi = np.arange(0x10000, dtype=np.uint32) << 16
    grid = [hi | low for low in (0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF)]
    named = [
        0x7F800001, 0x7FA00000, 0x7FBFFFFF, 0x7FC00000, 0x7FC00001, 0x7FFFFFFF,  # NaNs
        0xFF800001, 0xFFC00000, 0xFFFFFFFF, 0x7F80FFFF, 0x7F818000,
        0x7F800000, 0xFF800000, 0x00000000, 0x80000000,  # +-inf, +-0
        0x00000001, 0x00007FFF, 0x00008000, 0x00008001, 0x00018000, 0x007FFFFF,  # subnormals
        0x80000001, 0x80008000, 0x80018000, 0x807FFFFF,
        0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001,  # near overflow
        0xFF7F7FFF, 0xFF7F8000, 0xFF7F8001, 0x00800000, 0x3F808000, 0x3F818000,
    ]
    # All subnormals of one sign in a coarse sweep, so every exponent-0 low
    # half appears.
    sub = np.arange(0, 0x800000, 97, dtype=np.uint32)
    return np.concatenate(grid + [np.array(named, dtype=np.uint32), sub, sub | 0x80000000])


def write_bf16(out):
    rng = np.random.default_rng(20240611)
    bits = np.concatenate([
        rng.integers(0, 2**32, size=RANDOM_PATTERNS, dtype=np.uint64).astype(np.uint32),
        special_patterns(),
    ])
    bits.tofile(os.path.join(out, "bf16_in.u32"))
    f = torch.from_numpy(bits.view(np.float32)).to(DEVICE)

    def host_bits(t):
        return t.view(torch.int16).cpu().numpy().view(np.uint16)

    host_bits(f.to(torch.bfloat16)).tofile(os.path.join(out, "bf16_contig.u16"))
    spread = torch.empty(2 * len(bits), dtype=torch.float32, device=DEVICE)
    spread[::2] = f
    strided = spread[::2].to(torch.bfloat16).contiguous()
    host_bits(strided).tofile(os.path.join(out, "bf16_strided.u16"))


def make_params(gen):
    """A small model: weights ~N(0, 0.02), a zero-initialized bias, large norms."""
    w = torch.randn(513, 257, generator=gen) * 0.02
    bias = torch.zeros(1000)
    norm = 1.0 + torch.randn(333, generator=gen) * 0.5
    tiny = torch.randn(77, generator=gen) * 1e-30
    return [torch.nn.Parameter(t.to(DEVICE)) for t in (w, bias, norm, tiny)]


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).cpu().numpy().astype(np.float32)


def torch_version():
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def adamw_order(impl):
    """The dte order that models the kernel torch runs for impl on DEVICE.

    CPU tensors run the same FP32 operations for every impl (the fused CPU
    kernel too). On CUDA the fused kernel computed with FP64 scalars up to
    torch 2.10 and in FP32 from 2.11 (fused_adam_utils.cuh)."""
    if DEVICE == "cpu":
        return "torch_cpu"
    if impl == "foreach":
        return "torch_cuda_foreach"
    if impl == "single":
        return "torch_cuda_single_tensor"
    return "torch_cuda_fused" if torch_version() < (2, 11) else "torch_cuda_fused_fp32"


def optimizer(params, impl, lr, wd, betas, eps):
    if impl == "fused-tensor-lr":
        # A tensor lr; on CUDA also capturable (the state step on the device).
        lr_t = torch.tensor(lr, dtype=torch.float32, device=DEVICE)
        return torch.optim.AdamW(params, lr=lr_t, betas=betas, eps=eps, weight_decay=wd,
                                 fused=True, capturable=DEVICE != "cpu"), float(lr_t.item())
    kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd, **kw), lr


def write_step(out, lines, name, impl, lr, wd, betas, eps, opt, params, prev):
    state = [opt.state[p] for p in params]
    steps = {int(s["step"]) for s in state}
    assert len(steps) == 1, steps
    step = steps.pop()
    arrays = [prev, flat(s["exp_avg"] for s in state), flat(s["exp_avg_sq"] for s in state),
              flat(params)]
    fname = f"adamw_{name}_{step}.f32"
    np.concatenate(arrays).tofile(os.path.join(out, fname))
    lines.append(f"{name} {DEVICE} {adamw_order(impl)} {lr!r} {wd!r} {betas[0]!r} {betas[1]!r} "
                 f"{eps!r} {step} {len(prev)} {fname}")


def run_adamw(out, lines, name, impl, lr, wd):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    params = make_params(gen)
    betas, eps = (0.9, 0.999), 1e-8
    opt, lr = optimizer(params, impl, lr, wd, betas, eps)
    for _ in range(ADAMW_STEPS):
        for p in params:
            scale = torch.pow(10.0, torch.empty(p.shape).uniform_(-6, 0, generator=gen))
            p.grad = (torch.randn(p.shape, generator=gen) * scale).to(DEVICE)
        prev = flat(params)
        opt.step()
        write_step(out, lines, name, impl, lr, wd, betas, eps, opt, params, prev)


def f32(x):
    return float(np.float32(x))


def hard_decays(count):
    """(x, d) pairs, x FP32, where x - d*x rounded once in FP64 (one fused
    multiply-add) and x - RN(d*x) round to different FP32 values: x (1 - d)
    lies near an FP32 tie plus half an FP64 ulp (exact arithmetic here)."""
    def nudge(d, k):  # k FP64 ulps up (k > 0) or down
        for _ in range(abs(k)):
            d = float(np.nextafter(d, 1.0 if k > 0 else 0.0))
        return d

    found = []
    for j in range(4096):
        x = f32(1.25 + j * 2.0**-12)
        tie = 1.0 + (2 * j + 1) * 2.0**-24
        d0 = 1.0 - (tie + 2.0**-53) / x
        for k in range(-8, 8):
            d = nudge(d0, k)
            fused = f32(float(Fraction(x) * (1 - Fraction(d))))
            two = f32(x - float(Fraction(x) * Fraction(d)))
            if fused != two:
                found.append((x, d))
                break
        if len(found) == count:
            return found
    raise RuntimeError("hard_decays: too few pairs found")


def run_decay_probes(out, lines, impl):
    """One fused step per hard (x, d) pair, lr = d and weight decay 1, on a
    tensor of x * 2^k, its negation and signed zeros, with zero gradients:
    theta is the decay line alone, and the two FP64 roundings of the decay
    line give other bits than the one fused multiply-add on every element."""
    for i, (x, d) in enumerate(hard_decays(16)):
        name = f"decay-probe-{impl}-{i}"
        values = [x * 2.0**k for k in range(-8, 9)]
        t = torch.tensor(values + [-v for v in values] + [0.0, -0.0], dtype=torch.float32)
        params = [torch.nn.Parameter(t.to(DEVICE))]
        betas, eps = (0.9, 0.999), 1e-8
        opt, lr = optimizer(params, impl, d, 1.0, betas, eps)
        params[0].grad = torch.zeros_like(params[0])
        prev = flat(params)
        opt.step()
        write_step(out, lines, name, impl, lr, 1.0, betas, eps, opt, params, prev)


def write_bias_corrections(out):
    """The fused CUDA kernels' bias corrections, by torch.pow on the GPU (the
    same device pow the kernels call): FP64 pow from the FP32 step count
    (torch_cuda_fused) and FP32 powf (torch_cuda_fused_fp32), rounded to FP32
    as the kernels round them."""
    lines = []
    steps32 = torch.arange(1, BIAS_STEPS + 1, dtype=torch.float32, device=DEVICE)
    for beta1, beta2 in ((0.9, 0.999), (0.9, 0.95)):
        for order in ("torch_cuda_fused", "torch_cuda_fused_fp32"):
            dt = torch.float64 if order == "torch_cuda_fused" else torch.float32
            steps = steps32.to(dt)
            b1 = torch.full_like(steps, beta1)
            b2 = torch.full_like(steps, beta2)
            bc1 = (1 - torch.pow(b1, steps)).to(torch.float32)
            bc2_sqrt = torch.sqrt(1 - torch.pow(b2, steps)).to(torch.float32)
            fname = f"bias_{order}_{beta1}_{beta2}.u32"
            arrays = [t.cpu().numpy().view(np.uint32) for t in (bc1, bc2_sqrt)]
            np.concatenate(arrays).tofile(os.path.join(out, fname))
            lines.append(f"{order} {beta1!r} {beta2!r} {BIAS_STEPS} {fname}")
    with open(os.path.join(out, "bias.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def sqrt_mismatches():
    """How many of 2^20 FP32 inputs torch.sqrt on DEVICE rounds other than
    the correctly rounded square root (numpy's)."""
    g = torch.Generator().manual_seed(11)
    x = torch.rand(1 << 20, generator=g)
    got = torch.sqrt(x.to(DEVICE)).cpu().numpy()
    return int((got != np.sqrt(x.numpy())).sum()), x.numel()


def main():
    if len(sys.argv) != 2:
        sys.stderr.write(__doc__)
        return 2
    out = sys.argv[1]
    write_bf16(out)
    lines, unmodelled = [], []
    bad, total = sqrt_mismatches()
    for impl in ("single", "foreach", "fused"):
        if impl != "fused" and DEVICE == "cpu" and bad:
            unmodelled.append(f"{impl} 15 torch.sqrt_off_on_{bad}_of_{total}")
            continue
        for lr, wd in ((1e-6, 0.01), (1e-3, 0.1), (3e-4, 0.0)):
            run_adamw(out, lines, f"{impl}-lr{lr:g}-wd{wd:g}", impl, lr, wd)
    with open(os.path.join(out, "unmodelled.txt"), "w") as f:
        f.write("".join(line + "\n" for line in unmodelled))
    run_adamw(out, lines, "fused-tensor-lr-lr1e-3-wd0.1", "fused-tensor-lr", 1e-3, 0.1)
    run_decay_probes(out, lines, "fused")
    with open(os.path.join(out, "adamw.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if DEVICE != "cpu":
        write_bias_corrections(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
