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
                         name device foreach lr weight_decay beta1 beta2 eps step n file
                       floats in repr() form so C++ strtod reads the exact
                       doubles Python used.
  adamw_*.f32          per line: prev, exp_avg, exp_avg_sq, param as four
                       consecutive float32 arrays of n elements.

Exits non-zero with a message on stderr when torch or numpy is missing.
"""

import os
import sys
import zlib

try:
    import numpy as np
    import torch
except ImportError as e:  # The caller turns this into a test failure.
    sys.stderr.write(f"torch_interop.py needs numpy and torch: {e}\n")
    sys.exit(3)

RANDOM_PATTERNS = 10_000_000
DEVICE = os.environ.get("DTE_TORCH_DEVICE", "cpu")
ADAMW_STEPS = 5


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


def run_adamw(out, lines, name, foreach, lr, wd):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    params = make_params(gen)
    betas, eps = (0.9, 0.999), 1e-8
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd,
                            foreach=foreach)
    for _ in range(ADAMW_STEPS):
        for p in params:
            scale = torch.pow(10.0, torch.empty(p.shape).uniform_(-6, 0, generator=gen))
            p.grad = (torch.randn(p.shape, generator=gen) * scale).to(DEVICE)
        prev = flat(params)
        opt.step()
        state = [opt.state[p] for p in params]
        steps = {int(s["step"]) for s in state}
        assert len(steps) == 1, steps
        step = steps.pop()
        arrays = [prev, flat(s["exp_avg"] for s in state), flat(s["exp_avg_sq"] for s in state),
                  flat(params)]
        fname = f"adamw_{name}_{step}.f32"
        np.concatenate(arrays).tofile(os.path.join(out, fname))
        lines.append(f"{name} {DEVICE} {int(foreach)} {lr!r} {wd!r} {betas[0]!r} {betas[1]!r} {eps!r} "
                     f"{step} {len(prev)} {fname}")


def main():
    if len(sys.argv) != 2:
        sys.stderr.write(__doc__)
        return 2
    out = sys.argv[1]
    write_bf16(out)
    lines = []
    for foreach in (False, True):
        for lr, wd in ((1e-6, 0.01), (1e-3, 0.1), (3e-4, 0.0)):
            name = f"{'foreach' if foreach else 'single'}-lr{lr:g}-wd{wd:g}"
            run_adamw(out, lines, name, foreach, lr, wd)
    with open(os.path.join(out, "adamw.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
