// The non-weight files of a Hugging Face model directory, and the shard
// index, with the bytes transformers' `save_pretrained` would write
// (JSON with sorted keys, two-space indent, trailing newline).
//
// The tokenizer is byte-level: ids 0-2 are <unk>, <s>, </s>; ids 3-258 are
// the 256 byte values in order, spelled with the usual byte-to-printable
// mapping of byte-level BPE, and there are no merges. It is tiny but a
// complete, loadable `tokenizer.json`. Models may have a larger vocab
// (padding rows), as real checkpoints often do.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tools/gen/model_spec.h"

namespace dte::gen {

inline constexpr int kUnkId = 0;
inline constexpr int kBosId = 1;
inline constexpr int kEosId = 2;
inline constexpr int kFirstByteId = 3;
inline constexpr int kTokenizerVocab = kFirstByteId + 256;

// config.json, generation_config.json, tokenizer.json, tokenizer_config.json
// and special_tokens_map.json for a model of `dims`, as (file name, bytes).
std::vector<std::pair<std::string, std::string>> ModelDirFiles(const ModelDims& dims);

// model.safetensors.index.json: {"metadata": {"total_size": N}, "weight_map": ...}.
std::string IndexJson(uint64_t total_size, const std::map<std::string, std::string>& weight_map);

}  // namespace dte::gen
