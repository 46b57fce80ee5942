// Header and index JSON parsing for store/safetensors.cc.
//
// The header is consumed as nlohmann SAX events rather than a DOM: a DOM
// silently keeps one of two duplicate keys, and memory for a hostile 100 MB
// header stays proportional to the tensors it declares rather than to its
// size. Index files are small; they are parsed into a DOM whose parser
// callback watches for duplicate keys.

#include "store/internal/safetensors_json.h"

#include <limits>
#include <nlohmann/json.hpp>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "store/dtype.h"

namespace dte::safetensors_internal {
namespace {

using Json = nlohmann::json;

// nlohmann messages start with "[json.exception.parse_error.101] ".
std::string JsonErrorText(const Json::exception& e) {
  std::string_view what = e.what();
  size_t pos = what.find("] ");
  return std::string(pos == std::string_view::npos ? what : what.substr(pos + 2));
}

// Receives the SAX events of a header and collects its tensors and metadata,
// stopping at the first event that breaks the grammar at the top of
// store/safetensors.cc. Brackets arrive balanced (the parser checks that), so
// one Close() serves both kinds. Not thread-safe: one instance per parse.
class HeaderSax {
 public:
  explicit HeaderSax(const std::string& file) : file_(file) {}

  bool null() { return Other(); }
  bool boolean(bool) { return Other(); }
  bool number_integer(Json::number_integer_t v) {
    return v < 0 ? BadNumber("negative") : Unsigned(static_cast<uint64_t>(v));
  }
  bool number_unsigned(Json::number_unsigned_t v) { return Unsigned(v); }
  bool number_float(Json::number_float_t, const std::string&) {
    return BadNumber("not an integer or too large for 64 bits");
  }
  bool string(std::string& s);
  bool binary(Json::binary_t&) { return Other(); }
  bool start_object(size_t) { return Open(/*object=*/true); }
  bool start_array(size_t) { return Open(/*object=*/false); }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }
  bool key(std::string& k);
  bool parse_error(size_t, const std::string&, const Json::exception& e) {
    return Fail(file_ + ": header is not valid JSON: " + JsonErrorText(e));
  }

  bool done() const { return mode_ == Mode::kDone; }
  Status status;  // the first error
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;

 private:
  enum class Mode {
    kRoot,
    kEntries,
    kMetaObject,
    kMeta,
    kMetaValue,
    kEntryObject,
    kEntry,
    kDType,
    kShapeArray,
    kShape,
    kOffsetsArray,
    kOffsets,
    kSkip,
    kDone
  };
  enum Field : unsigned { kDTypeField = 1, kShapeField = 2, kOffsetsField = 4 };

  bool Fail(std::string message) {
    status = InvalidArgument(std::move(message));
    return false;
  }
  bool FailTensor(const std::string& message) {
    return Fail(file_ + ": tensor " + Quote(tensors.back().name) + ": " + message);
  }
  bool SkipScalar() {
    if (skip_depth_ == 0) mode_ = Mode::kEntry;
    return true;
  }
  bool Unsigned(uint64_t v);
  bool BadNumber(const char* why);
  bool Other();
  bool Open(bool object);
  bool Close();
  bool EntryKey(const std::string& k);
  bool FinishEntry();

  const std::string& file_;
  Mode mode_ = Mode::kRoot;
  unsigned fields_ = 0;  // Field bits seen in the current entry
  size_t skip_depth_ = 0;
  size_t n_offsets_ = 0;
  uint64_t offsets_[2] = {0, 0};
  bool seen_metadata_ = false;
  std::string meta_key_;
  std::unordered_set<std::string> names_;
};

bool HeaderSax::Unsigned(uint64_t v) {
  if (mode_ == Mode::kShape) {
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return FailTensor("shape dimension " + std::to_string(v) + " overflows a 64-bit integer");
    }
    tensors.back().shape.push_back(static_cast<int64_t>(v));
    return true;
  }
  if (mode_ == Mode::kOffsets) {
    if (n_offsets_ == 2) return FailTensor("data_offsets must hold exactly 2 integers");
    offsets_[n_offsets_++] = v;
    return true;
  }
  return Other();
}

bool HeaderSax::BadNumber(const char* why) {
  if (mode_ == Mode::kShape) return FailTensor(std::string("shape dimension is ") + why);
  if (mode_ == Mode::kOffsets) return FailTensor(std::string("data offset is ") + why);
  return Other();
}

// A value of the wrong type for the current position.
bool HeaderSax::Other() {
  switch (mode_) {
    case Mode::kSkip:
      return SkipScalar();
    case Mode::kRoot:
      return Fail(file_ + ": header JSON is not an object");
    case Mode::kMetaObject:
      return Fail(file_ + ": __metadata__ is not an object of strings");
    case Mode::kMetaValue:
      return Fail(file_ + ": __metadata__ value of key " + Quote(meta_key_) + " is not a string");
    case Mode::kEntryObject:
      return FailTensor("entry is not a JSON object");
    case Mode::kDType:
      return FailTensor("dtype is not a string");
    case Mode::kShapeArray:
      return FailTensor("shape is not an array");
    case Mode::kShape:
      return FailTensor("shape holds a value that is not an integer");
    case Mode::kOffsetsArray:
      return FailTensor("data_offsets is not an array");
    case Mode::kOffsets:
      return FailTensor("data_offsets holds a value that is not an integer");
    default:
      return Fail(file_ + ": header has an unexpected JSON value");
  }
}

bool HeaderSax::string(std::string& s) {
  if (mode_ == Mode::kMetaValue) {
    metadata.emplace(meta_key_, std::move(s));
    mode_ = Mode::kMeta;
    return true;
  }
  if (mode_ == Mode::kDType) {
    std::optional<DType> dtype = ParseDType(s);
    if (!dtype) return FailTensor("unknown dtype " + Quote(s));
    tensors.back().dtype = *dtype;
    mode_ = Mode::kEntry;
    return true;
  }
  return Other();
}

bool HeaderSax::Open(bool object) {
  struct Step {
    Mode from;
    bool object;
    Mode to;
  };
  static constexpr Step kSteps[] = {
      {Mode::kRoot, true, Mode::kEntries},          {Mode::kMetaObject, true, Mode::kMeta},
      {Mode::kEntryObject, true, Mode::kEntry},     {Mode::kShapeArray, false, Mode::kShape},
      {Mode::kOffsetsArray, false, Mode::kOffsets},
  };
  if (mode_ == Mode::kSkip) {
    ++skip_depth_;
    return true;
  }
  for (const Step& step : kSteps) {
    if (step.from == mode_ && step.object == object) {
      mode_ = step.to;
      return true;
    }
  }
  return Other();
}

bool HeaderSax::Close() {
  switch (mode_) {
    case Mode::kSkip:
      if (--skip_depth_ == 0) mode_ = Mode::kEntry;
      return true;
    case Mode::kOffsets:
      if (n_offsets_ != 2) return FailTensor("data_offsets must hold exactly 2 integers");
      [[fallthrough]];
    case Mode::kShape:
      mode_ = Mode::kEntry;
      return true;
    case Mode::kMeta:
      mode_ = Mode::kEntries;
      return true;
    case Mode::kEntry:
      return FinishEntry();
    case Mode::kEntries:
      mode_ = Mode::kDone;
      return true;
    default:
      return Fail(file_ + ": header has an unexpected end of a JSON value");
  }
}

bool HeaderSax::key(std::string& k) {
  switch (mode_) {
    case Mode::kEntries:
      if (k == "__metadata__") {
        if (seen_metadata_) return Fail(file_ + ": duplicate key '__metadata__'");
        seen_metadata_ = true;
        mode_ = Mode::kMetaObject;
        return true;
      }
      if (!names_.insert(k).second) return Fail(file_ + ": duplicate tensor name " + Quote(k));
      tensors.emplace_back().name = std::move(k);
      fields_ = 0;
      mode_ = Mode::kEntryObject;
      return true;
    case Mode::kMeta:
      if (metadata.count(k) > 0) return Fail(file_ + ": duplicate __metadata__ key " + Quote(k));
      meta_key_ = std::move(k);
      mode_ = Mode::kMetaValue;
      return true;
    case Mode::kEntry:
      return EntryKey(k);
    case Mode::kSkip:
      return true;
    default:
      return Fail(file_ + ": header has an unexpected JSON key " + Quote(k));
  }
}

bool HeaderSax::EntryKey(const std::string& k) {
  static constexpr std::pair<std::string_view, std::pair<Field, Mode>> kKnown[] = {
      {"dtype", {kDTypeField, Mode::kDType}},
      {"shape", {kShapeField, Mode::kShapeArray}},
      {"data_offsets", {kOffsetsField, Mode::kOffsetsArray}},
  };
  unsigned field = 0;
  Mode next = Mode::kSkip;  // other keys are ignored
  for (const auto& [name, step] : kKnown) {
    if (k == name) std::tie(field, next) = step;
  }
  if ((fields_ & field) != 0) return FailTensor("duplicate key " + Quote(k));
  fields_ |= field;
  skip_depth_ = 0;
  n_offsets_ = 0;
  mode_ = next;
  return true;
}

bool HeaderSax::FinishEntry() {
  static constexpr std::pair<Field, const char*> kRequired[] = {
      {kDTypeField, "dtype"}, {kShapeField, "shape"}, {kOffsetsField, "data_offsets"}};
  for (const auto& [field, name] : kRequired) {
    if ((fields_ & field) == 0) return FailTensor(std::string("missing '") + name + "'");
  }
  TensorInfo& t = tensors.back();
  t.begin = offsets_[0];
  t.end = offsets_[1];
  if (t.begin > t.end)
    return FailTensor("data_offsets " + RangeString(t.begin, t.end) + " begin after they end");
  uint64_t bytes = static_cast<uint64_t>(DTypeWidth(t.dtype));
  for (int64_t dim : t.shape) {
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(dim), &bytes)) {
      return FailTensor("shape " + ShapeString(t.shape) + " of " + DTypeName(t.dtype) +
                        " overflows 64 bits of byte length");
    }
  }
  if (t.end - t.begin != bytes) {
    return FailTensor("data_offsets " + RangeString(t.begin, t.end) + " hold " +
                      std::to_string(t.end - t.begin) + " bytes but " + DTypeName(t.dtype) +
                      " with shape " + ShapeString(t.shape) + " needs " + std::to_string(bytes));
  }
  mode_ = Mode::kEntries;
  return true;
}

// Parses JSON into a DOM, failing on a duplicate key in any object (the DOM
// itself would keep only one of them).
Result<Json> ParseJsonRejectingDuplicates(std::string_view text, const std::string& file) {
  std::vector<std::unordered_set<std::string>> open;
  std::string duplicate;
  bool has_duplicate = false;
  auto callback = [&](int, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::object_start) open.emplace_back();
    if (event == Json::parse_event_t::object_end) open.pop_back();
    if (event == Json::parse_event_t::key && !has_duplicate &&
        !open.back().insert(parsed.get<std::string>()).second) {
      has_duplicate = true;
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  Json doc;
  try {
    doc = Json::parse(text.data(), text.data() + text.size(), callback);
  } catch (const Json::exception& e) {
    return InvalidArgument(file + ": not valid JSON: " + JsonErrorText(e));
  }
  if (has_duplicate) return InvalidArgument(file + ": duplicate JSON key " + Quote(duplicate));
  return doc;
}

}  // namespace

Status ParseHeaderJson(std::string_view json, const std::string& file,
                       std::vector<TensorInfo>* tensors,
                       std::map<std::string, std::string>* metadata) {
  HeaderSax sax(file);
  bool parsed = false;
  try {
    parsed = Json::sax_parse(json.data(), json.data() + json.size(), &sax);
  } catch (const Json::exception& e) {
    return InvalidArgument(file + ": header is not valid JSON: " + JsonErrorText(e));
  }
  if (!parsed) return sax.status.ok() ? Internal(file + ": header parse stopped") : sax.status;
  if (!sax.done()) return Internal(file + ": header parse ended early");
  *tensors = std::move(sax.tensors);
  *metadata = std::move(sax.metadata);
  return Status::Ok();
}

Status ParseIndexJson(std::string_view json, const std::string& file,
                      std::map<std::string, std::string>* weight_map) {
  ASSIGN_OR_RETURN(Json doc, ParseJsonRejectingDuplicates(json, file));
  if (!doc.is_object()) return InvalidArgument(file + ": index JSON is not an object");
  auto metadata = doc.find("metadata");
  if (metadata != doc.end() && !metadata->is_object()) {
    return InvalidArgument(file + ": \"metadata\" is not an object");
  }
  auto map = doc.find("weight_map");
  if (map == doc.end()) return InvalidArgument(file + ": missing \"weight_map\"");
  if (!map->is_object()) return InvalidArgument(file + ": \"weight_map\" is not an object");
  for (const auto& [tensor, shard] : map->items()) {
    if (!shard.is_string()) {
      return InvalidArgument(file + ": weight_map entry of tensor " + Quote(tensor) +
                             " is not a string");
    }
    weight_map->emplace(tensor, shard.get<std::string>());
  }
  return Status::Ok();
}

}  // namespace dte::safetensors_internal
