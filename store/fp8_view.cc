#include "store/fp8_view.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <utility>

#include "store/safetensors.h"

namespace dte {
namespace {

using nlohmann::json;
constexpr uint64_t kPrefixBytes = 8;
constexpr std::string_view kWeightSuffix = ".weight";

std::string ModuleOf(std::string_view weight_name) {
  return std::string(weight_name.substr(0, weight_name.size() - kWeightSuffix.size()));
}

// Why a tensor stays as stored, for Find's message.
std::string KeptReason(Fp8Decision d, const TensorEntry& t, Fp8Block block) {
  std::string why(Fp8DecisionName(d));
  if (d == Fp8Decision::kNot2d) why += " (shape " + ShapeString(t.shape) + ")";
  if (d == Fp8Decision::kNotBf16) why += std::string(" (") + DTypeName(t.dtype) + ")";
  if (d == Fp8Decision::kNotBlockMultiple) {
    why += " (shape " + ShapeString(t.shape) + ", block " + std::to_string(block.rows) + " x " +
           std::to_string(block.cols) + ")";
  }
  return why;
}

// Appends `part`, merging it into the last one when both copy adjacent
// source bytes; empty parts are dropped.
void AddPart(const Fp8Part& part, std::vector<Fp8Part>* parts) {
  if (part.size == 0) return;
  if (!parts->empty()) {
    Fp8Part& last = parts->back();
    if (last.kind == Fp8PartKind::kCopy && part.kind == Fp8PartKind::kCopy &&
        last.source_offset + last.size == part.source_offset && last.end() == part.begin) {
      last.size += part.size;
      return;
    }
  }
  parts->push_back(part);
}

Fp8ViewFile CopiedFile(const FileEntry& f) {
  Fp8ViewFile out;
  out.name = f.name;
  out.size = f.size;
  AddPart(Fp8Part{0, f.size, Fp8PartKind::kCopy, 0, 0}, &out.parts);
  return out;
}

Fp8ViewFile TextFile(const std::string& name, std::string text) {
  Fp8ViewFile out;
  out.name = name;
  out.size = text.size();
  out.text = std::move(text);
  out.changed = true;
  AddPart(Fp8Part{0, out.size, Fp8PartKind::kText, 0, 0}, &out.parts);
  return out;
}

Result<json> ParseObject(const std::string& bytes, const std::string& what) {
  json j = json::parse(bytes, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return InvalidArgument(what + ": not a JSON object; the FP8 view cannot rewrite it");
  }
  return j;
}

}  // namespace

uint64_t Fp8Tensor::RowsOf(uint64_t r) const {
  const uint64_t first = r * layout.block_rows;
  return std::min(layout.rows, first + layout.block_rows) - first;
}

std::string Fp8View::What(std::string_view file) const {
  return "FP8 view of " + VersionName(version_) + "/" + std::string(file);
}

Result<Fp8View> Fp8View::Build(const Fp8ViewSource& source, const Fp8ViewOptions& options) {
  const Manifest& m = *source.manifest;
  Fp8View view;
  view.version_ = m.version;
  view.options_ = options;
  const std::string layout_error =
      kernels::Fp8LayoutError({1, 1, options.block_rows, options.block_cols, options.rule});
  if (!layout_error.empty()) {
    return InvalidArgument("FP8 view of " + VersionName(m.version) + ": block size " +
                           std::to_string(options.block_rows) + " x " +
                           std::to_string(options.block_cols) + ": " + layout_error);
  }
  view.manifest_ = &m;
  view.files_.resize(m.files.size());
  for (uint32_t i = 0; i < m.files.size(); ++i) {
    const FileEntry& f = m.files[i];
    if (f.safetensors) {
      RETURN_IF_ERROR(view.BuildSafetensors(source, i));
    } else {
      view.files_[i] = CopiedFile(f);
    }
  }
  std::sort(view.not_converted_.begin(), view.not_converted_.end());
  for (uint32_t i = 0; i < m.files.size(); ++i) {
    Fp8ViewFile& out = view.files_[i];
    if (out.name == kIndexFile && source.index) {
      RETURN_IF_ERROR(view.BuildIndex(*source.index, &out));
    } else if (out.name == kConfigFile && source.config) {
      RETURN_IF_ERROR(view.BuildConfig(*source.config, &out));
    }
  }
  view.manifest_ = nullptr;
  return view;
}

// A safetensors file of the view being laid out: its tensors and parts,
// offsets relative to the data section until the header is known.
struct Fp8View::FileLayout {
  std::vector<TensorInfo> infos;
  std::vector<Fp8Part> parts;
  uint64_t at = 0;  // bytes of the data section so far
};

Status Fp8View::BuildSafetensors(const Fp8ViewSource& source, uint32_t file) {
  const FileEntry& f = manifest_->files[file];
  const std::string what = What(f.name);
  if (file >= source.headers.size() || source.headers[file].size() != f.header_size ||
      f.header_size < kPrefixBytes) {
    return InvalidArgument(what + ": the header bytes given do not match the manifest's " +
                           std::to_string(f.header_size));
  }
  const std::string_view header_json = std::string_view(source.headers[file]).substr(kPrefixBytes);
  ASSIGN_OR_RETURN(SafetensorsHeader parsed, ParseSafetensorsHeader(header_json, f.size, what));
  FileLayout layout;
  const size_t first_tensor = tensors_.size();
  for (uint32_t k = 0; k < f.tensors.size(); ++k) RETURN_IF_ERROR(LayOut(file, k, &layout));
  tensor_bytes_ += layout.at;
  if (tensors_.size() == first_tensor) {  // nothing quantized: the file as it is
    files_[file] = CopiedFile(f);
    return Status::Ok();
  }
  Fp8ViewFile& out = files_[file];
  out.name = f.name;
  out.changed = true;
  out.text = BuildSafetensorsHeader(layout.infos, parsed.metadata);
  const uint64_t h = out.text.size();
  out.size = h + layout.at;
  AddPart({0, h, Fp8PartKind::kText, 0, 0}, &out.parts);
  for (Fp8Part p : layout.parts) {
    p.begin += h;
    AddPart(p, &out.parts);
  }
  for (size_t i = first_tensor; i < tensors_.size(); ++i) {
    tensors_[i].weight_offset += h;
    tensors_[i].scale_offset += h;
  }
  return Status::Ok();
}

void Fp8View::Keep(const FileEntry& f, const TensorEntry& t, Fp8Decision d, FileLayout* l) {
  if (ListedAsNotConverted(d)) not_converted_.push_back(ModuleOf(t.name));
  kept_[t.name] = KeptReason(d, t, {options_.block_rows, options_.block_cols});
  l->infos.push_back({t.name, t.dtype, t.shape, l->at, l->at + t.bytes()});
  AddPart({l->at, t.bytes(), Fp8PartKind::kCopy, f.header_size + t.begin, 0}, &l->parts);
  l->at += t.bytes();
}

Status Fp8View::LayOut(uint32_t file, uint32_t k, FileLayout* l) {
  const FileEntry& f = manifest_->files[file];
  const TensorEntry& t = f.tensors[k];
  const Fp8Decision d = DecideFp8(options_.policy, {options_.block_rows, options_.block_cols},
                                  t.name, t.dtype, t.shape);
  if (d != Fp8Decision::kQuantize) {
    Keep(f, t, d, l);
    return Status::Ok();
  }
  Fp8Tensor q;
  q.file = file;
  q.tensor = k;
  q.name = t.name;
  q.scale_name = t.name + kScaleSuffix;
  q.layout = {static_cast<uint64_t>(t.shape[0]), static_cast<uint64_t>(t.shape[1]),
              options_.block_rows, options_.block_cols, options_.rule};
  q.source_offset = f.header_size + t.begin;
  if (manifest_->FindTensor(q.scale_name)) {
    return InvalidArgument(What(f.name) + ": tensor '" + q.scale_name +
                           "' already exists; the FP8 view cannot add the scales of '" + t.name +
                           "' under that name");
  }
  const auto index = static_cast<uint32_t>(tensors_.size());
  const uint64_t weight_bytes = q.layout.num_elements();
  q.weight_offset = l->at;
  l->infos.push_back({t.name, DType::kF8E4M3, t.shape, l->at, l->at + weight_bytes});
  AddPart({l->at, weight_bytes, Fp8PartKind::kWeight, 0, index}, &l->parts);
  l->at += weight_bytes;
  const uint64_t scale_bytes = q.layout.num_blocks() * sizeof(float);
  const std::vector<int64_t> grid = {static_cast<int64_t>(q.layout.grid_rows()),
                                     static_cast<int64_t>(q.layout.grid_cols())};
  q.scale_offset = l->at;
  l->infos.push_back({q.scale_name, DType::kF32, grid, l->at, l->at + scale_bytes});
  AddPart({l->at, scale_bytes, Fp8PartKind::kScale, 0, index}, &l->parts);
  l->at += scale_bytes;
  tensors_.push_back(std::move(q));
  return Status::Ok();
}

Status Fp8View::BuildIndex(const std::string& bytes, Fp8ViewFile* out) const {
  const std::string what = What(kIndexFile);
  ASSIGN_OR_RETURN(json j, ParseObject(bytes, what));
  if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
    return InvalidArgument(what + ": no \"weight_map\" object");
  }
  for (const Fp8Tensor& t : tensors_) j["weight_map"][t.scale_name] = files_[t.file].name;
  if (!j.contains("metadata") || !j["metadata"].is_object()) j["metadata"] = json::object();
  j["metadata"]["total_size"] = tensor_bytes_;
  *out = TextFile(out->name, j.dump(2) + "\n");
  return Status::Ok();
}

Status Fp8View::BuildConfig(const std::string& bytes, Fp8ViewFile* out) const {
  const std::string what = What(kConfigFile);
  ASSIGN_OR_RETURN(json j, ParseObject(bytes, what));
  if (j.contains("quantization_config")) {
    return InvalidArgument(what + ": config.json already has a quantization_config (" +
                           j["quantization_config"].dump() +
                           "); FP8 views are made from unquantized versions only");
  }
  json q = {{"quant_method", "fp8"},
            {"fmt", "e4m3"},
            {"activation_scheme", "dynamic"},
            {"weight_block_size", {options_.block_rows, options_.block_cols}},
            {"modules_to_not_convert", not_converted_}};
  if (options_.rule == kernels::Fp8ScaleRule::kPowerOfTwo) q["scale_fmt"] = "ue8m0";
  j["quantization_config"] = std::move(q);
  *out = TextFile(out->name, j.dump(2) + "\n");
  return Status::Ok();
}

std::span<const Fp8Part> Fp8View::PartsAt(uint32_t file, uint64_t offset, uint64_t len) const {
  const std::vector<Fp8Part>& parts = files_[file].parts;
  auto first = std::upper_bound(parts.begin(), parts.end(), offset,
                                [](uint64_t off, const Fp8Part& p) { return off < p.end(); });
  auto last = first;
  while (last != parts.end() && last->begin < offset + len) ++last;
  return {first, last};
}

Result<const Fp8Tensor*> Fp8View::Find(std::string_view name) const {
  for (const Fp8Tensor& t : tensors_) {
    if (t.name == name) return &t;
  }
  auto it = kept_.find(std::string(name));
  if (it == kept_.end()) {
    return NotFound("FP8 view of " + VersionName(version_) + ": no tensor '" + std::string(name) +
                    "'");
  }
  return InvalidArgument("FP8 view of " + VersionName(version_) + ": tensor '" + std::string(name) +
                         "' is not quantized: " + it->second +
                         "; FP8 views quantize 2-D BF16 linear weights only");
}

}  // namespace dte
