// ModelSeries: the checkpoints of one small sharded model over training
// steps, for tests that commit a version per step and then check every byte
// a reader sees against what was committed.
//
// Two shards with an index file and a config. Step 0 is random; each later
// step changes a few elements of most tensors (an optimizer step), leaves
// lm_head alone on odd steps (so deltas hold kSame records too) and writes
// the step into config.json. model.embed and lm_head span several 256 KiB
// blocks, end in a partial block, and start at unaligned file offsets.
//
// Thread-safety: immutable after construction; const methods may be called
// concurrently.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "tests/testutil/checkpoint.h"

namespace dte::test {

class ModelSeries {
 public:
  static constexpr char kShard1[] = "model-00001-of-00002.safetensors";
  static constexpr char kShard2[] = "model-00002-of-00002.safetensors";

  // Builds steps 0 .. steps-1.
  explicit ModelSeries(uint64_t steps);

  uint64_t steps() const { return checkpoints_.size(); }
  const TestCheckpoint& checkpoint(uint64_t step) const { return checkpoints_.at(step); }
  // File name -> content, for every file of a step.
  const std::map<std::string, std::string>& files(uint64_t step) const { return files_.at(step); }
  // Writes every file of a step into `dir` (created if missing).
  Status Write(uint64_t step, const std::string& dir) const;

 private:
  std::vector<TestCheckpoint> checkpoints_;
  std::vector<std::map<std::string, std::string>> files_;
};

}  // namespace dte::test
