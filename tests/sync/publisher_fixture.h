// PublisherModelTest: the model the single-process publisher tests train: a
// 17-block tensor (past one 16-block chunk), a small one, and two tensors
// the optimizer does not own (a frozen BF16 weight and an F32 buffer), in a
// temporary directory that holds the checkpoints written of it and the
// stores published into.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "store/base/status.h"
#include "store/dtype.h"
#include "tests/testutil/adamw_state.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"

namespace dte::test {

class PublisherModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    states_.push_back(RandomAdamWState("model.embed_tokens.weight", {2200, 1000}, 1));
    states_.push_back(RandomAdamWState("model.norm.weight", {300}, 2));
    for (auto& s : states_) s.theta = s.prev;
    frozen_ = Bf16Tensor("model.frozen.weight", {70, 50}, 3);
    inv_freq_ = TestTensor{"model.rotary.inv_freq", DType::kF32, {16}, RandomBytes(64, 4)};
  }

  TestCheckpoint Checkpoint() const { return AdamWCheckpoint(states_, {frozen_, inv_freq_}); }

  // Writes the model's BF16 checkpoint into a new directory of its own.
  std::string WriteCheckpoint() {
    std::string dir = tmp_.path() + "/ckpt" + std::to_string(dirs_++);
    Status s = test::WriteCheckpoint(Checkpoint(), dir);
    EXPECT_TRUE(s.ok()) << s.message();
    return dir;
  }

  // Objects under the store directory `name` (blobs, manifests, ...).
  size_t StoreFiles(const std::string& name) const {
    size_t n = 0;
    for (const auto& e : std::filesystem::recursive_directory_iterator(tmp_.path() + "/" + name)) {
      n += e.is_regular_file() && e.path().string().find("/tmp") == std::string::npos;
    }
    return n;
  }

  ScopedTempDir tmp_;
  int dirs_ = 0;
  std::vector<AdamWTensorState> states_;
  TestTensor frozen_, inv_freq_;
};

}  // namespace dte::test
