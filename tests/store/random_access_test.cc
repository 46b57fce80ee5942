// Acceptance: random access into a committed chain (anchor + three deltas)
// returns exact bytes and decodes only the blocks a range overlaps, each
// from its dense record plus every sparse record since.
#include <gtest/gtest.h>

#include <string>

#include "store/materialize.h"
#include "store/ops/commit.h"
#include "store/store.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

constexpr uint64_t kBB = kDefaultBlockBytes;

TEST(RandomAccess, AnchorPlusThreeDecodesOnlyOverlappingBlocks) {
  test::ScopedTempDir tmp;
  StoreOptions so;
  so.uri = tmp.path() + "/store";
  so.create = true;
  auto opened = Store::Open(so);
  ASSERT_TRUE(opened.ok()) << opened.status().message();
  Store& store = **opened;
  test::TestCheckpoint c;
  c.safetensors.push_back({"model.safetensors",
                           {test::Bf16Tensor("bias", {1001}, 1),
                            test::Bf16Tensor("big", {2048, 2048}, 2)},  // 8 MiB, 32 blocks
                           {}});
  for (uint64_t v = 0; v <= 3; ++v) {
    if (v > 0) {
      test::PerturbElements(&c.tensor("big").data, 2, 32 * 300, 10 * v);
      test::PerturbElements(&c.tensor("bias").data, 2, 3, 10 * v + 1);
    }
    const std::string dir = tmp.path() + "/in" + std::to_string(v);
    ASSERT_TRUE(test::WriteCheckpoint(c, dir).ok());
    auto r = CommitDirectory(store, dir, {});
    ASSERT_TRUE(r.ok()) << r.status().message();
    auto ver = store.GetVersion(v);
    ASSERT_TRUE(ver.ok()) << ver.status().message();
    for (const auto& rec : (*ver)->records) {
      ASSERT_EQ(rec.kind, v == 0 ? BlockKind::kDenseRaw : BlockKind::kSparse)
          << "every block must change in every delta";
    }
  }
  const std::string file = test::SafetensorsBytes(c.safetensors[0]);
  auto v3 = store.GetVersion(3).value();
  const FileEntry& f = v3->manifest.files[0];
  const uint64_t big = f.header_size + f.tensors[1].begin;  // big's first byte in the file
  struct Case {
    uint64_t off, len, blocks;
  };
  const Case cases[] = {
      {big + 5 * kBB + 333, 1 << 20, 5},  // 1 MiB, unaligned: blocks 5..9
      {big + 12 * kBB, 1 << 20, 4},       // 1 MiB, aligned
      {f.header_size - 3, 8, 1},          // header into bias
      {big - 4, 9, 2},                    // bias into big
      {big + 31 * kBB - 2, 4, 2},         // across big's last block boundary
      {big + 17 * kBB + 4097, 1, 1},      // single bytes at odd offsets
      {f.header_size + 1, 1, 1},
      {f.size - 1, 1, 1},
      {1, f.header_size - 2, 0},  // header only
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(std::to_string(k.off) + "+" + std::to_string(k.len));
    Materializer reader(&store);
    std::string got(k.len, '\0');
    ASSERT_TRUE(reader.ReadFile(v3, f, k.off, k.len, reinterpret_cast<uint8_t*>(got.data())).ok());
    EXPECT_TRUE(got == file.substr(k.off, k.len)) << "wrong bytes";
    EXPECT_EQ(reader.counters().blocks.load(), k.blocks);
    EXPECT_EQ(reader.counters().records.load(), 4 * k.blocks);  // 1 dense + 3 sparse
    EXPECT_LT(reader.counters().payload_bytes.load(), (k.blocks + 1) * kBB);
  }
}

}  // namespace
}  // namespace dte
