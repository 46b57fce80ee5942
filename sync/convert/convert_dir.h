// Converting a sharded MCore checkpoint on disk into a HF model directory.
//
// Input: a directory of per-rank safetensors files named
// mp_rank_TT_EEE.safetensors (TT the TP rank, two digits; EEE the EP rank,
// three digits), each holding that rank's shards under their MCore names,
// plus any other files (config.json, tokenizer files), which are copied.
// Non-expert tensors are read from the EP rank 0 files only.
//
// Output: a HF model directory (model.safetensors, or model-0000i-of-0000n
// .safetensors plus model.safetensors.index.json when over one file's size
// limit), built in OUT.partial and renamed to OUT when complete. Units are
// converted and written one at a time: memory holds one unit's shards and
// HF tensors, never the model.
//
// Thread-safety: a RankFileSource is used by one thread at a time.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "store/safetensors.h"
#include "sync/convert/convert.h"

namespace dte {

// "mp_rank_01_000.safetensors"
std::string RankFileName(int tp_rank, int ep_rank);

// Reads shards from the rank files of a directory (headers read on Open,
// data on Get, into memory the returned view owns).
class RankFileSource : public ShardSource {
 public:
  // Opens every rank file present in `dir` (ranks within layout's TP / EP /
  // expert TP degrees); missing files surface as missing shards on Get.
  static Result<std::unique_ptr<RankFileSource>> Open(const std::string& dir,
                                                      const ParallelLayout& layout);

  Result<ShardView> Get(const ShardKey& key) override;
  // The dtype recorded in the header, without reading data.
  Result<DType> ShardDType(const ShardKey& key) const;

 private:
  struct Located {
    std::string path;
    uint64_t offset = 0;  // absolute offset of the tensor's bytes
    TensorInfo info;
  };
  Result<const Located*> Find(const ShardKey& key) const;

  std::map<ShardKey, Located> shards_;
};

struct HfDirOptions {
  uint64_t max_file_bytes = 5'000'000'000;  // data bytes per output file
  std::string copy_from;                    // copy this directory's non-rank files
};

struct HfDirResult {
  uint64_t files = 0;  // safetensors files written
  ConvertStats stats;
};

// Writes the HF state `plan` yields from `source` into `out_dir`, which must
// not exist.
Result<HfDirResult> WriteHfDirectory(const std::vector<ConvertUnit>& plan, RankFileSource& source,
                                     const std::string& out_dir, const HfDirOptions& options);

}  // namespace dte
