"""Checks the checkpoint-sequence generators (tools/gen): dte-gen and torch_gen.py.

Every checkpoint is read with the real `safetensors` package, as inference
loaders read it. Run by CTest with DTE_BUILD_DIR set (for dte-gen) under
/opt/dte/venv/bin/python (which has torch).
"""

import filecmp
import glob
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

SOURCE_DIR = os.environ.get(
    "DTE_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TORCH_GEN = os.path.join(SOURCE_DIR, "tools", "gen", "torch_gen.py")
MODEL_FILES = ["config.json", "generation_config.json", "special_tokens_map.json",
               "tokenizer.json", "tokenizer_config.json"]
STEP_LINE = re.compile(r"^step (\d+) changed_bf16 ([\d.]+)% \((\d+)/(\d+)\)", re.M)
TINY_TORCH = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
              "--intermediate", "192", "--pretrain-steps", "10", "--warm-steps", "6",
              "--prompts", "2", "--group", "4", "--prompt-len", "16", "--gen-len", "16"]


def dte_gen_path():
    build = os.environ.get("DTE_BUILD_DIR") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "build")
    path = os.path.join(build, "tools", "dte-gen")
    assert os.access(path, os.X_OK), "dte-gen is not built at " + path
    return path


def run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, "%s failed:\n%s\n%s" % (cmd, proc.stdout, proc.stderr)
    return proc.stdout


def run_dte_gen(out, *flags):
    return run([dte_gen_path(), "--out", str(out), "--quiet", *flags])


def run_torch_gen(out, *flags):
    return run([sys.executable, TORCH_GEN, "--out", str(out), *flags])


def step_dirs(out):
    return sorted(glob.glob(os.path.join(str(out), "step-*")))


def expected_shapes(cfg):
    h, hd, i, v = (cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"],
                   cfg["vocab_size"])
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    for n in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % n
        shapes.update({
            p + "self_attn.q_proj.weight": [q, h], p + "self_attn.k_proj.weight": [kv, h],
            p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, q],
            p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h],
            p + "mlp.down_proj.weight": [h, i], p + "input_layernorm.weight": [h],
            p + "post_attention_layernorm.weight": [h]})
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = [v, h]
    return shapes


def shard_files(step_dir):
    """Weight files of a model dir, checking the index if there is one."""
    index_path = os.path.join(step_dir, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        assert os.path.exists(os.path.join(step_dir, "model.safetensors"))
        assert not glob.glob(os.path.join(step_dir, "model-*.safetensors"))
        return ["model.safetensors"], None
    with open(index_path, encoding="utf-8") as f:
        text = f.read()
    index = json.loads(text)
    assert set(index) == {"metadata", "weight_map"}
    assert text == json.dumps(index, indent=2, sort_keys=True) + "\n"
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n > 1
    assert shards == ["model-%05d-of-%05d.safetensors" % (k + 1, n) for k in range(n)]
    assert sorted(os.path.basename(p) for p in
                  glob.glob(os.path.join(step_dir, "model*.safetensors"))) == shards
    return shards, index


def load_model_dir(step_dir, max_shard_bytes=None):
    """Validates a model dir and returns (config, {name: tensor})."""
    for name in MODEL_FILES:
        assert os.path.exists(os.path.join(step_dir, name)), name
    with open(os.path.join(step_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "llama" and cfg["torch_dtype"] == "bfloat16"
    shards, index = shard_files(step_dir)
    tensors, total = {}, 0
    for shard in shards:
        path = os.path.join(step_dir, shard)
        with safe_open(path, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert name not in tensors, "duplicate " + name
                tensors[name] = f.get_tensor(name)
                total += tensors[name].numel() * tensors[name].element_size()
                if index:
                    assert index["weight_map"][name] == shard
        if max_shard_bytes and len(shards) > 1:
            data = sum(t.numel() * t.element_size() for n, t in tensors.items()
                       if index["weight_map"][n] == shard)
            n_tensors = sum(1 for s in index["weight_map"].values() if s == shard)
            assert data <= max_shard_bytes or n_tensors == 1
    if index:
        assert set(index["weight_map"]) == set(tensors)
        assert index["metadata"]["total_size"] == total
    shapes = expected_shapes(cfg)
    for name, shape in shapes.items():
        assert name in tensors, "missing " + name
        assert list(tensors[name].shape) == shape, name
    return cfg, tensors


def changed_fractions(out):
    """Per step: (changed, total) BF16 elements versus the previous step."""
    result, prev = [], None
    for d in step_dirs(out):
        _, cur = load_model_dir(d)
        cur = {n: t for n, t in cur.items() if t.dtype == torch.bfloat16}
        if prev is not None:
            changed = sum(int((prev[n].view(torch.int16) != t.view(torch.int16)).sum())
                          for n, t in cur.items())
            result.append((changed, sum(t.numel() for t in cur.values())))
        prev = cur
    return result


def assert_same_tree(a, b):
    cmp = filecmp.dircmp(str(a), str(b))
    names = []

    def walk(c, prefix):
        assert not c.left_only and not c.right_only, (c.left_only, c.right_only)
        names.extend(prefix + n for n in c.common_files)
        for sub, subcmp in c.subdirs.items():
            walk(subcmp, prefix + sub + "/")

    walk(cmp, "")
    _, mismatch, errors = filecmp.cmpfiles(str(a), str(b), names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)
    return names


# ---------------------------------------------------------------- dte-gen


@pytest.fixture(scope="module")
def dte_small(tmp_path_factory):
    out = tmp_path_factory.mktemp("dte_small")
    stdout = run_dte_gen(out, "--size", "8MiB", "--steps", "5", "--shard-size", "3MiB",
                         "--seed", "7", "--threads", "2")
    return out, stdout


def test_dte_gen_writes_sharded_hf_dirs(dte_small):
    out, _ = dte_small
    dirs = step_dirs(out)
    assert [os.path.basename(d) for d in dirs] == ["step-%06d" % k for k in range(6)]
    for d in dirs:
        cfg, tensors = load_model_dir(d, max_shard_bytes=3 << 20)
        assert len(shard_files(d)[0]) >= 3
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())
        assert set(tensors) == set(expected_shapes(cfg))
    total = sum(t.numel() * 2 for t in load_model_dir(dirs[0])[1].values())
    assert abs(total - (8 << 20)) < 0.05 * (8 << 20)


def test_dte_gen_weights_look_initialized(dte_small):
    _, tensors = load_model_dir(step_dirs(dte_small[0])[0])
    q = tensors["model.layers.0.self_attn.q_proj.weight"].float()
    assert 0.018 < q.std().item() < 0.022 and abs(q.mean().item()) < 1e-3
    assert torch.all(tensors["model.norm.weight"].float() == 1.0)


def test_dte_gen_changed_fraction_is_realistic(dte_small):
    out, stdout = dte_small
    measured = changed_fractions(out)
    printed = [(int(m[2]), int(m[3])) for m in STEP_LINE.findall(stdout)]
    assert printed == measured
    for changed, total in measured:
        assert 0.005 < changed / total < 0.03, measured


def test_dte_gen_never_seen_tokens_do_not_change(dte_small):
    dirs = step_dirs(dte_small[0])
    first = load_model_dir(dirs[0])[1]["model.embed_tokens.weight"]
    last = load_model_dir(dirs[-1])[1]["model.embed_tokens.weight"]
    changed = first.view(torch.int16) != last.view(torch.int16)
    vocab = first.shape[0]
    # The top 10% of token ids are in no batch: only weight decay (1e-8
    # relative per step) moves them, which almost never crosses a BF16 ulp.
    assert changed[int(vocab * 0.9) + 1:].float().mean().item() < 1e-4
    assert changed[:10].float().mean().item() > 0.01


def test_dte_gen_is_deterministic_across_threads(dte_small, tmp_path):
    run_dte_gen(tmp_path, "--size", "8MiB", "--steps", "5", "--shard-size", "3MiB",
                "--seed", "7", "--threads", "1")
    names = assert_same_tree(dte_small[0], tmp_path)
    assert len(names) > 6 * 8


def test_dte_gen_seed_changes_output(dte_small, tmp_path):
    run_dte_gen(tmp_path, "--size", "8MiB", "--steps", "0", "--shard-size", "3MiB",
                "--seed", "8")
    a = os.path.join(str(dte_small[0]), "step-000000", "model-00001-of-00003.safetensors")
    b = os.path.join(str(tmp_path), "step-000000", "model-00001-of-00003.safetensors")
    assert not filecmp.cmp(a, b, shallow=False)


def test_dte_gen_window_matches_full_run(dte_small, tmp_path):
    run_dte_gen(tmp_path / "w", "--size", "8MiB", "--steps", "5", "--start", "3",
                "--shard-size", "3MiB", "--seed", "7")
    run_dte_gen(tmp_path / "o", "--size", "8MiB", "--only-step", "4",
                "--shard-size", "3MiB", "--seed", "7")
    assert [os.path.basename(d) for d in step_dirs(tmp_path / "w")] == \
        ["step-000003", "step-000004", "step-000005"]
    for step in (3, 4, 5):
        name = "step-%06d" % step
        assert_same_tree(dte_small[0] / name, tmp_path / "w" / name)
    assert_same_tree(dte_small[0] / "step-000004", tmp_path / "o" / "step-000004")


def test_dte_gen_files_equal_python_writer(dte_small, tmp_path):
    d = os.path.join(str(dte_small[0]), "step-000002")
    for shard in shard_files(d)[0]:
        resaved = str(tmp_path / shard)
        save_file(load_file(os.path.join(d, shard)), resaved, metadata={"format": "pt"})
        assert filecmp.cmp(os.path.join(d, shard), resaved, shallow=False), shard


def test_dte_gen_dtype_mix_single_file_and_tied(tmp_path):
    stdout = run_dte_gen(tmp_path / "gen", "--hidden", "128", "--layers", "2", "--vocab", "512",
                         "--steps", "2", "--dtype-mix", "--tie-embeddings")
    assert "changed_f32" in stdout
    dirs = step_dirs(tmp_path / "gen")
    single = os.path.join(dirs[1], "model.safetensors")
    save_file(load_file(single), str(tmp_path / "resaved"), metadata={"format": "pt"})
    assert filecmp.cmp(single, str(tmp_path / "resaved"), shallow=False)
    cfg, first = load_model_dir(dirs[0])
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in first
    assert cfg["intermediate_size"] > cfg["hidden_size"]
    assert first["model.norm.weight"].dtype == torch.float32
    assert first["model.layers.1.input_layernorm.weight"].dtype == torch.float32
    assert first["model.position_ids"].dtype == torch.int64
    assert torch.equal(first["model.position_ids"][0], torch.arange(4096))
    _, last = load_model_dir(dirs[-1])
    assert torch.equal(first["model.position_ids"], last["model.position_ids"])
    assert not torch.equal(first["model.norm.weight"], last["model.norm.weight"])


def test_dte_gen_rejects_bad_flags(tmp_path):
    gen = dte_gen_path()
    for flags in (["--size", "12XB"], ["--shard-size", "-1"], ["--steps", "2", "--start", "3"],
                  ["--hidden", "128", "--layers", "2", "--heads", "4", "--kv-heads", "3"]):
        proc = subprocess.run([gen, "--out", str(tmp_path), "-q", *flags],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0, flags
        assert "dte-gen:" in proc.stderr or "rror" in proc.stderr, (flags, proc.stderr)


# ---------------------------------------------------------------- torch_gen.py


@pytest.fixture(scope="module")
def torch_small(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_small")
    stdout = run_torch_gen(out / "ckpt", *TINY_TORCH, "--steps", "4", "--seed", "3",
                           "--shard-size", "100KiB", "--save-optimizer", str(out / "opt"))
    return out, stdout


def test_torch_gen_writes_sharded_hf_dirs(torch_small):
    dirs = step_dirs(torch_small[0] / "ckpt")
    assert [os.path.basename(d) for d in dirs] == ["step-%06d" % k for k in range(5)]
    for d in dirs:
        cfg, tensors = load_model_dir(d, max_shard_bytes=100 << 10)
        assert cfg["hidden_size"] == 64 and cfg["num_key_value_heads"] == 2
        assert len(shard_files(d)[0]) > 1
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())
        assert set(tensors) == set(expected_shapes(cfg))


def test_torch_gen_changed_fraction_is_realistic(torch_small):
    out, stdout = torch_small
    measured = changed_fractions(out / "ckpt")
    printed = [(int(m[2]), int(m[3])) for m in STEP_LINE.findall(stdout)]
    assert printed == measured
    for changed, total in measured:
        assert 0.005 < changed / total < 0.03, measured


def test_torch_gen_is_deterministic(torch_small, tmp_path):
    run_torch_gen(tmp_path / "ckpt", *TINY_TORCH, "--steps", "4", "--seed", "3",
                  "--shard-size", "100KiB", "--save-optimizer", str(tmp_path / "opt"))
    assert_same_tree(torch_small[0] / "ckpt", tmp_path / "ckpt")
    assert_same_tree(torch_small[0] / "opt", tmp_path / "opt")


def test_torch_gen_optimizer_state_inverts_to_previous_step(torch_small):
    opt = torch_small[0] / "opt"
    for step in (1, 4):
        cur = load_file(str(opt / ("step-%06d" % step) / "master.safetensors"))
        prev = load_file(str(opt / ("step-%06d" % (step - 1)) / "master.safetensors"))
        m = load_file(str(opt / ("step-%06d" % step) / "exp_avg.safetensors"))
        v = load_file(str(opt / ("step-%06d" % step) / "exp_avg_sq.safetensors"))
        with open(opt / ("step-%06d" % step) / "adamw.json", encoding="utf-8") as f:
            hp = json.load(f)
        assert hp["step"] == 6 + step and hp["lr"] == 1e-6
        _, ckpt = load_model_dir(str(torch_small[0] / "ckpt" / ("step-%06d" % step)))
        bc1, bc2 = 1 - hp["beta1"] ** hp["step"], 1 - hp["beta2"] ** hp["step"]
        for name, w in cur.items():
            assert torch.equal(ckpt[name].view(torch.int16), w.to(torch.bfloat16).view(torch.int16))
            denom = v[name].sqrt() / bc2 ** 0.5 + hp["eps"]
            rebuilt = (w + hp["lr"] / bc1 * m[name] / denom) / (1 - hp["lr"] * hp["weight_decay"])
            assert (rebuilt - prev[name]).abs().max().item() < 1e-8, name


def test_both_generators_write_the_same_tokenizer(dte_small, torch_small):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        a = os.path.join(str(dte_small[0]), "step-000000", name)
        b = os.path.join(str(torch_small[0]), "ckpt", "step-000000", name)
        assert filecmp.cmp(a, b, shallow=False), name


def test_tokenizer_loads_and_round_trips(dte_small):
    import tokenizers  # installed by tools/setup.sh
    tok = tokenizers.Tokenizer.from_file(
        os.path.join(str(dte_small[0]), "step-000000", "tokenizer.json"))
    text = "Policy v42: caf\u00e9 \u2713\n"
    enc = tok.encode(text)
    assert enc.ids[0] == 1 and enc.ids[1:] == [3 + b for b in text.encode("utf-8")]
    assert tok.decode(enc.ids) == text


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
