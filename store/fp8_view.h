// Fp8View: a version seen as a block-scaled FP8 checkpoint (docs/fp8.md,
// "FP8 views"), described without reading a byte of tensor data.
//
// Every file of the version has a counterpart of the same name:
//   - a safetensors file keeps its tensors in order, except that each tensor
//     the policy quantizes (DecideFp8 with the view's block) becomes F8_E4M3
//     of the same shape and is followed at once by
//     "<module>.weight_scale_inv" (F32, shape [ceil(rows / block_rows),
//     ceil(cols / block_cols)]); offsets are laid out again and the header
//     is written as safetensors writes it (the original "__metadata__"
//     kept, padded with spaces to 8 bytes);
//   - model.safetensors.index.json gains the scale tensors in their files'
//     weight_map entries, and metadata.total_size the view's tensor bytes;
//   - config.json gains a quantization_config: quant_method "fp8", fmt
//     "e4m3", activation_scheme "dynamic", weight_block_size, and
//     modules_to_not_convert (the module paths of the BF16 2-D weights the
//     policy skipped, ListedAsNotConverted); the power-of-two rule adds scale_fmt "ue8m0". A
//     config.json that already has a quantization_config is refused;
//   - every other file is unchanged.
// Each view file is a list of parts that cover it in order; a part says
// where its bytes come from: computed text (headers, JSON), a byte range of
// the source file, the E4M3 bytes of a quantized tensor, or its scales.
// Block row r of a quantized tensor (rows [r * block_rows, ...)) is
// quantized from exactly those BF16 rows and gives weight bytes
// [r * block_rows * cols, ...) and scales [r * grid_cols, ...).
//
// JSON files are written with two-space indentation and sorted keys, as
// Hugging Face writes them. Tensor data stays aligned to its element width
// when every quantized tensor's rows * cols is a multiple of 4 (every real
// linear layer): the loaders' zero-copy views need that.
//
// Thread-safety: an Fp8View is an immutable value once built.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/fp8.h"
#include "store/base/status.h"
#include "store/fp8_policy.h"
#include "store/manifest.h"

namespace dte {

inline constexpr char kConfigFile[] = "config.json";
inline constexpr char kIndexFile[] = "model.safetensors.index.json";
inline constexpr char kScaleSuffix[] = "_scale_inv";  // appended to "<module>.weight"

struct Fp8ViewOptions {
  uint64_t block_rows = kernels::kFp8DefaultBlock;
  uint64_t block_cols = kernels::kFp8DefaultBlock;
  kernels::Fp8ScaleRule rule = kernels::Fp8ScaleRule::kPlain;
  Fp8Policy policy;
};

// What a view is built from besides the manifest.
struct Fp8ViewSource {
  const Manifest* manifest = nullptr;
  // By file index: a safetensors file's header bytes (its first header_size
  // bytes: the 8-byte prefix and the JSON); other entries are ignored.
  std::vector<std::string> headers;
  std::optional<std::string> config;  // config.json's bytes, if the version has one
  std::optional<std::string> index;   // model.safetensors.index.json's bytes
};

enum class Fp8PartKind : uint8_t {
  kText,    // bytes of Fp8ViewFile::text from `source_offset`
  kCopy,    // bytes of the source file from `source_offset`, unchanged
  kWeight,  // E4M3 bytes of quantized tensor `tensor`: byte i is element i
  kScale,   // FP32 scales of quantized tensor `tensor`, row-major over its grid
};

struct Fp8Part {
  uint64_t begin = 0;  // offset in the view file
  uint64_t size = 0;
  Fp8PartKind kind = Fp8PartKind::kText;
  uint64_t source_offset = 0;  // kText, kCopy
  uint32_t tensor = 0;         // kWeight, kScale: index into Fp8View::tensors()
  uint64_t end() const { return begin + size; }
};

// A quantized tensor.
struct Fp8Tensor {
  uint32_t file = 0;    // in Manifest::files (and Fp8View::files(): same order)
  uint32_t tensor = 0;  // in that FileEntry's tensors
  std::string name;     // "<module>.weight"
  std::string scale_name;
  kernels::Fp8Layout layout;
  uint64_t source_offset = 0;  // of its BF16 bytes in the source file
  uint64_t weight_offset = 0;  // of its E4M3 bytes in the view file
  uint64_t scale_offset = 0;   // of its scales in the view file
  uint64_t block_row_count() const { return layout.grid_rows(); }
  // Rows of block row r (the last may be partial).
  uint64_t RowsOf(uint64_t r) const;
};

struct Fp8ViewFile {
  std::string name;
  uint64_t size = 0;
  std::string text;            // computed bytes the kText parts point into
  std::vector<Fp8Part> parts;  // in order, contiguous, covering [0, size)
  bool changed = false;        // false: byte for byte the source file
};

class Fp8View {
 public:
  // Errors (InvalidArgument) name the version and the file or tensor: an
  // unusable block size, a header or JSON file that does not parse, a
  // config.json that already has a quantization_config, a scale tensor name
  // the version already uses.
  static Result<Fp8View> Build(const Fp8ViewSource& source, const Fp8ViewOptions& options);

  uint64_t version() const { return version_; }
  const Fp8ViewOptions& options() const { return options_; }
  const std::vector<Fp8ViewFile>& files() const { return files_; }
  const std::vector<Fp8Tensor>& tensors() const { return tensors_; }
  // Module paths of the BF16 2-D weights left unquantized: skipped modules
  // and shapes off the block (sorted).
  const std::vector<std::string>& not_converted() const { return not_converted_; }

  // The parts of file `file` that overlap [offset, offset + len).
  std::span<const Fp8Part> PartsAt(uint32_t file, uint64_t offset, uint64_t len) const;

  // The quantized tensor named `name` (its weight name). NotFound if the
  // version has no such tensor; InvalidArgument, naming the tensor and why,
  // if the view leaves it unquantized (not 2-D, not BF16, ...).
  Result<const Fp8Tensor*> Find(std::string_view name) const;

 private:
  struct FileLayout;
  Status BuildSafetensors(const Fp8ViewSource& source, uint32_t file);
  // Tensor k of safetensors file `file`: kept, or its E4M3 form and scales.
  Status LayOut(uint32_t file, uint32_t k, FileLayout* layout);
  // Tensor t of file f as stored, for decision d (listed, and why, if kept).
  void Keep(const FileEntry& f, const TensorEntry& t, Fp8Decision d, FileLayout* layout);
  Status BuildIndex(const std::string& bytes, Fp8ViewFile* out) const;
  Status BuildConfig(const std::string& bytes, Fp8ViewFile* out) const;
  std::string What(std::string_view file) const;

  uint64_t version_ = 0;
  Fp8ViewOptions options_;
  const Manifest* manifest_ = nullptr;  // during Build only
  std::vector<Fp8ViewFile> files_;
  std::vector<Fp8Tensor> tensors_;
  std::vector<std::string> not_converted_;
  std::map<std::string, std::string> kept_;  // unquantized tensor -> why
  uint64_t tensor_bytes_ = 0;                // of every tensor of the view, for the index
};

}  // namespace dte
