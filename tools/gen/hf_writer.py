"""Writes Hugging Face model directories: config, tokenizer, sharded weights.

The bytes match what dte-gen (tools/gen/hf_files.cc, shard_plan.cc) writes
for the same dims, and what transformers' save_pretrained writes: JSON with
sorted keys and two-space indent, shards named model-0000i-of-0000n
.safetensors with model.safetensors.index.json, or one model.safetensors.

The tokenizer is byte-level: ids 0-2 are <unk>, <s>, </s>; id 3 + b is the
byte b, spelled with the usual byte-to-printable mapping of byte-level BPE;
no merges. Text is tokenized as `encode_bytes` does.
"""

import json
import os
import re

from safetensors.torch import save_file

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_BYTE_ID = 3
TOKENIZER_VOCAB = FIRST_BYTE_ID + 256
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
MAX_POSITIONS = 4096
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_SIZE_SUFFIXES = [
    ("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("TiB", 1 << 40),
    ("KB", 10**3), ("MB", 10**6), ("GB", 10**9), ("TB", 10**12), ("B", 1),
]


def parse_byte_size(text):
    """"3MiB" -> 3145728, "5GB" -> 5000000000, "1000" -> 1000."""
    for suffix, factor in _SIZE_SUFFIXES:
        if text.endswith(suffix) and len(text) > len(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(float(text))


def encode_bytes(data):
    """Token ids of raw bytes (no <s>)."""
    return [FIRST_BYTE_ID + b for b in data]


def _dump(obj):
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _byte_symbol(byte):
    def printable(b):
        return 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF

    if printable(byte):
        return chr(byte)
    return chr(256 + sum(1 for b in range(byte) if not printable(b)))


def tokenizer_json():
    def byte_level(add_prefix_space):
        return {"type": "ByteLevel", "add_prefix_space": add_prefix_space,
                "trim_offsets": True, "use_regex": True}

    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for i, tok in enumerate(SPECIAL_TOKENS)]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({_byte_symbol(b): FIRST_BYTE_ID + b for b in range(256)})
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    post = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<s>", "type_id": 1}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS_ID], "tokens": ["<s>"]}},
    }
    model = {"type": "BPE", "dropout": None, "unk_token": None,
             "continuing_subword_prefix": None, "end_of_word_suffix": None,
             "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": []}
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
           "normalizer": None, "pre_tokenizer": byte_level(False), "post_processor": post,
           "decoder": byte_level(True), "model": model}
    return json.dumps(tok, indent=2, ensure_ascii=False) + "\n"


def config_json(dims):
    return _dump({
        "architectures": ["LlamaForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        "head_dim": dims.head_dim, "hidden_act": "silu", "hidden_size": dims.hidden,
        "initializer_range": 0.02, "intermediate_size": dims.intermediate,
        "max_position_embeddings": MAX_POSITIONS, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": dims.heads, "num_hidden_layers": dims.layers,
        "num_key_value_heads": dims.kv_heads, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": dims.tied,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": dims.vocab,
    })


def model_dir_files(dims):
    """Non-weight files of the model directory: {file name: text}."""
    decoder = {str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
               for i, tok in enumerate(SPECIAL_TOKENS)}
    return {
        "config.json": config_json(dims),
        "generation_config.json": _dump(
            {"_from_model_config": True, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}),
        "special_tokens_map.json": _dump(
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": _dump({
            "added_tokens_decoder": decoder, "bos_token": "<s>",
            "clean_up_tokenization_spaces": False, "eos_token": "</s>",
            "model_max_length": MAX_POSITIONS, "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": "<unk>"}),
    }


def plan_shards(state_dict, max_shard_bytes):
    """Groups tensor names in state-dict order: a new shard starts when the
    next tensor would push the current one past max_shard_bytes."""
    groups, current = [[]], 0
    for name, tensor in state_dict.items():
        size = tensor.numel() * tensor.element_size()
        if groups[-1] and current + size > max_shard_bytes:
            groups.append([])
            current = 0
        groups[-1].append(name)
        current += size
    return groups


def _remove_stale_weights(out_dir):
    pattern = re.compile(r"^model.*\.safetensors$")
    for name in os.listdir(out_dir):
        if pattern.match(name) or name == INDEX_FILE:
            os.remove(os.path.join(out_dir, name))


def write_model_dir(out_dir, state_dict, dims, max_shard_bytes):
    """Writes a complete model directory for `state_dict` (ordered name ->
    contiguous tensor, already in the saved dtype)."""
    os.makedirs(out_dir, exist_ok=True)
    _remove_stale_weights(out_dir)
    for name, text in model_dir_files(dims).items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            f.write(text)
    groups = plan_shards(state_dict, max_shard_bytes)
    weight_map, total = {}, 0
    for i, names in enumerate(groups):
        file_name = SINGLE_FILE if len(groups) == 1 else \
            "model-%05d-of-%05d.safetensors" % (i + 1, len(groups))
        shard = {n: state_dict[n] for n in names}
        save_file(shard, os.path.join(out_dir, file_name), metadata={"format": "pt"})
        for n in names:
            weight_map[n] = file_name
            total += state_dict[n].numel() * state_dict[n].element_size()
    if len(groups) > 1:
        with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
            f.write(_dump({"metadata": {"total_size": total}, "weight_map": weight_map}))
