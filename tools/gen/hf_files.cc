#include "tools/gen/hf_files.h"

#include <nlohmann/json.hpp>

namespace dte::gen {
namespace {

using Json = nlohmann::json;                 // keys sorted, like sort_keys=True
using OrderedJson = nlohmann::ordered_json;  // keys in insertion order

std::string Dump(const Json& j) { return j.dump(2) + "\n"; }

// Byte-level BPE spells byte b as a printable code point: printable Latin-1
// bytes stand for themselves, the others map to 256, 257, ... in byte order.
std::string ByteSymbol(int byte) {
  auto printable = [](int b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  };
  int code = byte;
  if (!printable(byte)) {
    code = 256;
    for (int b = 0; b < byte; ++b) code += printable(b) ? 0 : 1;
  }
  std::string utf8;
  if (code < 0x80) {
    utf8.push_back(static_cast<char>(code));
  } else {
    utf8.push_back(static_cast<char>(0xC0 | (code >> 6)));
    utf8.push_back(static_cast<char>(0x80 | (code & 0x3F)));
  }
  return utf8;
}

const char* const kSpecialTokens[] = {"<unk>", "<s>", "</s>"};

OrderedJson AddedTokens() {
  OrderedJson added = OrderedJson::array();
  for (int id = 0; id < kFirstByteId; ++id) {
    added.push_back({{"id", id},
                     {"content", kSpecialTokens[id]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  return added;
}

OrderedJson ByteLevel(bool add_prefix_space) {
  return {{"type", "ByteLevel"},
          {"add_prefix_space", add_prefix_space},
          {"trim_offsets", true},
          {"use_regex", true}};
}

// Prepends <s> to every sequence, as Llama tokenizers do.
OrderedJson PostProcessor() {
  OrderedJson bos = {{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}};
  OrderedJson seq_a = {{"Sequence", {{"id", "A"}, {"type_id", 0}}}};
  OrderedJson seq_b = {{"Sequence", {{"id", "B"}, {"type_id", 1}}}};
  OrderedJson bos1 = {{"SpecialToken", {{"id", "<s>"}, {"type_id", 1}}}};
  return {{"type", "TemplateProcessing"},
          {"single", {bos, seq_a}},
          {"pair", {bos, seq_a, bos1, seq_b}},
          {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {kBosId}}, {"tokens", {"<s>"}}}}}}};
}

std::string TokenizerJson() {
  OrderedJson vocab = OrderedJson::object();
  for (int id = 0; id < kFirstByteId; ++id) vocab[kSpecialTokens[id]] = id;
  for (int b = 0; b < 256; ++b) vocab[ByteSymbol(b)] = kFirstByteId + b;
  OrderedJson model = {{"type", "BPE"},
                       {"dropout", nullptr},
                       {"unk_token", nullptr},
                       {"continuing_subword_prefix", nullptr},
                       {"end_of_word_suffix", nullptr},
                       {"fuse_unk", false},
                       {"byte_fallback", false},
                       {"vocab", vocab},
                       {"merges", OrderedJson::array()}};
  OrderedJson tok = {{"version", "1.0"},
                     {"truncation", nullptr},
                     {"padding", nullptr},
                     {"added_tokens", AddedTokens()},
                     {"normalizer", nullptr},
                     {"pre_tokenizer", ByteLevel(false)},
                     {"post_processor", PostProcessor()},
                     {"decoder", ByteLevel(true)},
                     {"model", model}};
  return tok.dump(2) + "\n";
}

std::string TokenizerConfigJson() {
  Json decoder = Json::object();
  for (int id = 0; id < kFirstByteId; ++id) {
    decoder[std::to_string(id)] = {{"content", kSpecialTokens[id]}, {"lstrip", false},
                                   {"normalized", false},           {"rstrip", false},
                                   {"single_word", false},          {"special", true}};
  }
  return Dump({{"added_tokens_decoder", decoder},
               {"bos_token", "<s>"},
               {"clean_up_tokenization_spaces", false},
               {"eos_token", "</s>"},
               {"model_max_length", kMaxPositions},
               {"tokenizer_class", "PreTrainedTokenizerFast"},
               {"unk_token", "<unk>"}});
}

std::string ConfigJson(const ModelDims& d) {
  return Dump({{"architectures", {"LlamaForCausalLM"}},
               {"attention_bias", false},
               {"attention_dropout", 0.0},
               {"bos_token_id", kBosId},
               {"eos_token_id", kEosId},
               {"head_dim", d.head_dim},
               {"hidden_act", "silu"},
               {"hidden_size", d.hidden},
               {"initializer_range", 0.02},
               {"intermediate_size", d.intermediate},
               {"max_position_embeddings", kMaxPositions},
               {"mlp_bias", false},
               {"model_type", "llama"},
               {"num_attention_heads", d.heads},
               {"num_hidden_layers", d.layers},
               {"num_key_value_heads", d.kv_heads},
               {"pretraining_tp", 1},
               {"rms_norm_eps", 1e-05},
               {"rope_scaling", nullptr},
               {"rope_theta", 10000.0},
               {"tie_word_embeddings", d.tied_embeddings},
               {"torch_dtype", "bfloat16"},
               {"use_cache", true},
               {"vocab_size", d.vocab}});
}

}  // namespace

std::vector<std::pair<std::string, std::string>> ModelDirFiles(const ModelDims& dims) {
  return {
      {"config.json", ConfigJson(dims)},
      {"generation_config.json",
       Dump({{"_from_model_config", true}, {"bos_token_id", kBosId}, {"eos_token_id", kEosId}})},
      {"special_tokens_map.json",
       Dump({{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"unk_token", "<unk>"}})},
      {"tokenizer.json", TokenizerJson()},
      {"tokenizer_config.json", TokenizerConfigJson()},
  };
}

std::string IndexJson(uint64_t total_size, const std::map<std::string, std::string>& weight_map) {
  Json map = Json::object();
  for (const auto& [tensor, shard] : weight_map) map[tensor] = shard;
  return Dump({{"metadata", {{"total_size", total_size}}}, {"weight_map", map}});
}

}  // namespace dte::gen
