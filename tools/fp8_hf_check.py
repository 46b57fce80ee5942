#!/usr/bin/env python3
"""Checks an FP8 model directory of a dtefs mount against an independent
quantization of the same BF16 version, and with a GPU, what transformers
makes of it.

    tools/fp8_hf_check.py --bf16 MOUNT/v00000003 --fp8 MOUNT/fp8/v00000003 [--gpu]

1. Always: every tensor of the BF16 directory is in the FP8 one; each
   tensor stored there as F8_E4M3 equals the reference quantizer
   (tests/py/fp8_ref.py: numpy and ml_dtypes, written from docs/fp8.md) of
   the BF16 tensor, bytes and `weight_scale_inv` scales bit for bit; every
   other tensor is the BF16 tensor unchanged; the quantized set is what the
   public FP8 checkpoints quantize (the linear projections of attention and
   MLP) whose rows and columns are whole blocks (transformers' fine-grained
   FP8 refuses other shapes); config.json's quantization_config names the
   block size and the modules left in BF16. Files are read with the real
   `safetensors` package.
2. With --gpu (a CUDA device, torch >= 2.1 and a transformers with
   fine-grained FP8, 4.49 or newer): writes a directory quantized by the
   reference from the BF16 directory (its own config.json), loads it and the
   mount's FP8 directory with transformers' fine-grained FP8, and checks
   that their logits on fixed inputs and their greedy generations are equal;
   prints how far both are from the BF16 model (for information).

Exits 0 when every check passes, 1 naming the first difference, 2 when
--gpu was asked for and the GPU checks cannot run here (saying why).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "py"))
from fp8_ref import read_safetensors, ref_quantize  # noqa: E402

# What DeepSeek-V3-style FP8 checkpoints quantize in a Llama/Qwen3 model.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class CheckFailed(Exception):
    pass


def tensors_of(directory: Path) -> dict:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, (dtype, shape, array) in read_safetensors(path).items():
            if name in out:
                raise CheckFailed(f"{directory}: tensor {name} is in two files")
            out[name] = (dtype, shape, array, path.name)
    if not out:
        raise CheckFailed(f"{directory}: no safetensors files")
    return out


def quantization_config(directory: Path) -> dict:
    config = json.loads((directory / "config.json").read_text())
    q = config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        raise CheckFailed(f"{directory}/config.json: no fp8 quantization_config")
    return q


def projection(name: str, dtype: str, shape) -> bool:
    module = name[: -len(".weight")] if name.endswith(".weight") else None
    return (dtype == "BF16" and len(shape) == 2 and module is not None
            and module.split(".")[-1] in PROJECTIONS)


def whole_blocks(shape, br: int, bc: int) -> bool:
    return shape[0] % br == 0 and shape[1] % bc == 0


def expected_fp8(name: str, dtype: str, shape, br: int, bc: int) -> bool:
    return projection(name, dtype, shape) and whole_blocks(shape, br, bc)


def check_kept(where: str, name: str, bf16, got, block) -> None:
    """A tensor the view must keep as stored: unchanged, and a projection
    that is not whole blocks not quantized anyway."""
    (dtype, shape, array), (got_dtype, _, got_array, _) = bf16, got
    if got_dtype == "F8_E4M3" and projection(name, dtype, shape):
        raise CheckFailed(f"{where}: {name} {shape} is F8_E4M3 but not whole {block[0]}x"
                          f"{block[1]} blocks: transformers' fine-grained FP8 refuses it")
    if got_dtype != dtype or got_array.tobytes() != array.tobytes():
        raise CheckFailed(f"{where}: {name} should be the {dtype} tensor unchanged")


def check_tensors(bf16_dir: Path, fp8_dir: Path) -> dict:
    """Step 1. Returns the reference quantization: name -> (bytes, scales)."""
    q = quantization_config(fp8_dir)
    br, bc = q.get("weight_block_size", [128, 128])
    rule = "pow2" if q.get("scale_fmt") == "ue8m0" else "plain"
    bf16, fp8 = tensors_of(bf16_dir), tensors_of(fp8_dir)
    reference = {}
    for name, (dtype, shape, array, _) in bf16.items():
        if name not in fp8:
            raise CheckFailed(f"{fp8_dir}: tensor {name} of the BF16 version is missing")
        got_dtype, got_shape, got, file = fp8[name]
        if got_shape != shape:
            raise CheckFailed(f"{fp8_dir}/{file}: {name} has shape {got_shape}, not {shape}")
        if not expected_fp8(name, dtype, shape, br, bc):
            check_kept(f"{fp8_dir}/{file}", name, (dtype, shape, array), fp8[name], (br, bc))
            continue
        if got_dtype != "F8_E4M3":
            raise CheckFailed(f"{fp8_dir}/{file}: {name} is {got_dtype}, expected F8_E4M3")
        ref_q, ref_s = ref_quantize(array.view(np.uint16), br, bc, rule)
        scale_name = name + "_scale_inv"
        if scale_name not in fp8:
            raise CheckFailed(f"{fp8_dir}: {scale_name} is missing")
        s_dtype, s_shape, scales, s_file = fp8[scale_name]
        if s_dtype != "F32" or s_shape != list(ref_s.shape):
            raise CheckFailed(f"{fp8_dir}/{s_file}: {scale_name} is {s_dtype} {s_shape}, "
                              f"expected F32 {list(ref_s.shape)}")
        differ = np.flatnonzero(got.view(np.uint8).ravel() != ref_q.ravel())
        if differ.size:
            raise CheckFailed(f"{fp8_dir}/{file}: {name} differs from the reference at "
                              f"{differ.size} bytes, first at element {differ[0]}")
        if scales.view(np.uint32).tobytes() != ref_s.view(np.uint32).tobytes():
            raise CheckFailed(f"{fp8_dir}/{s_file}: {scale_name} differs from the reference")
        reference[name] = (ref_q, ref_s)
    extra = set(fp8) - set(bf16) - {n + "_scale_inv" for n in reference}
    if extra:
        raise CheckFailed(f"{fp8_dir}: tensors not in the BF16 version: {sorted(extra)[:5]}")
    skipped = {n[: -len(".weight")] for n, (d, s, _, _) in bf16.items()
               if d == "BF16" and len(s) == 2 and n.endswith(".weight") and n not in reference}
    listed = set(q.get("modules_to_not_convert") or [])
    if not skipped <= listed:
        raise CheckFailed(f"{fp8_dir}/config.json: modules_to_not_convert lacks "
                          f"{sorted(skipped - listed)}")
    print(f"fp8_hf_check: {len(reference)} FP8 tensors ({rule} scales, {br}x{bc} blocks) and "
          f"{len(bf16) - len(reference)} others equal the reference quantization of {bf16_dir}")
    return reference


def write_reference_dir(bf16_dir: Path, fp8_dir: Path, reference: dict, out: Path):
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (dtype, _, array, _) in tensors_of(bf16_dir).items():
        if name in reference:
            q, s = reference[name]
            tensors[name] = torch.from_numpy(q.copy()).view(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = torch.from_numpy(s.copy())
        else:
            tensors[name] = torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for path in bf16_dir.iterdir():
        if path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            shutil.copy(path, out / path.name)
    config = json.loads((bf16_dir / "config.json").read_text())
    q = quantization_config(fp8_dir)
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic",
        "weight_block_size": q.get("weight_block_size", [128, 128]),
        "modules_to_not_convert": q.get("modules_to_not_convert") or []}
    (out / "config.json").write_text(json.dumps(config, indent=2))


def gpu_checks(bf16_dir: Path, fp8_dir: Path, reference: dict, tokens: int) -> int:
    """Step 2. Returns the exit status."""
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        print(f"fp8_hf_check: GPU checks not run: {e}")
        return 2
    if not torch.cuda.is_available():
        print("fp8_hf_check: GPU checks not run: torch sees no CUDA device")
        return 2
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(transformers, "FineGrainedFP8Config"):
        print(f"fp8_hf_check: GPU checks not run: torch {torch.__version__} / transformers "
              f"{transformers.__version__} lack float8 or fine-grained FP8 (4.49+)")
        return 2
    with tempfile.TemporaryDirectory(prefix="fp8-ref-") as tmp:
        ref_dir = Path(tmp)
        write_reference_dir(bf16_dir, fp8_dir, reference, ref_dir)
        torch.manual_seed(0)
        config = json.loads((bf16_dir / "config.json").read_text())
        ids = torch.randint(0, config["vocab_size"], (2, 32), device="cuda")

        def run(directory):
            model = AutoModelForCausalLM.from_pretrained(
                str(directory), torch_dtype=torch.bfloat16, device_map="cuda").eval()
            with torch.no_grad():
                logits = model(ids).logits.float()
                gen = model.generate(ids[:, :8], max_new_tokens=tokens, do_sample=False)
            del model
            torch.cuda.empty_cache()
            return logits, gen

        mount_logits, mount_gen = run(fp8_dir)
        ref_logits, ref_gen = run(ref_dir)
        bf16_logits, bf16_gen = run(bf16_dir)
    if not torch.equal(mount_logits, ref_logits):
        diff = (mount_logits - ref_logits).abs().max().item()
        print(f"fp8_hf_check: FAIL: logits of {fp8_dir} differ from the reference's (max {diff})")
        return 1
    if not torch.equal(mount_gen, ref_gen):
        print(f"fp8_hf_check: FAIL: greedy generation of {fp8_dir} differs from the reference's")
        return 1
    agree = (mount_logits.argmax(-1) == bf16_logits.argmax(-1)).float().mean().item()
    print(f"fp8_hf_check: transformers {transformers.__version__} fine-grained FP8 on "
          f"{torch.cuda.get_device_name()}: logits and {tokens}-token greedy generation of the "
          f"mount's FP8 directory equal the reference's; vs BF16: max |logit diff| "
          f"{(mount_logits - bf16_logits).abs().max().item():.4f}, top-1 agreement {agree:.3f}, "
          f"same generation: {bool(torch.equal(mount_gen, bf16_gen))}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bf16", type=Path, required=True, help="a version's directory")
    ap.add_argument("--fp8", type=Path, required=True, help="the same version's FP8 directory")
    ap.add_argument("--gpu", action="store_true", help="also load both with transformers")
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens to generate")
    args = ap.parse_args()
    try:
        reference = check_tensors(args.bf16, args.fp8)
    except (CheckFailed, OSError, ValueError) as e:
        print(f"fp8_hf_check: FAIL: {e}")
        return 1
    if not args.gpu:
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return gpu_checks(args.bf16, args.fp8, reference, args.tokens)


if __name__ == "__main__":
    sys.exit(main())
