// Committing checkpoint directories: anchors, deltas and their statistics,
// version numbering and races, failure clean-up, and bit-exact round trips.
#include "store/ops/commit.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "store/materialize.h"
#include "store/ops/gc.h"
#include "store/store.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

namespace fs = std::filesystem;
using test::TestCheckpoint;
using test::TestTensor;

constexpr uint64_t kBB = kDefaultBlockBytes;
constexpr char kShard1[] = "model-00001-of-00002.safetensors";
constexpr char kShard2[] = "model-00002-of-00002.safetensors";

// A store in a temp dir and numbered checkpoint dirs beside it.
class Env {
 public:
  Env() {
    StoreOptions o;
    o.uri = uri();
    o.create = true;
    auto s = Store::Open(o);
    EXPECT_TRUE(s.ok()) << s.status().message();
    if (s.ok()) store_ = std::move(s).value();
  }
  std::string uri() const { return dir_.path() + "/store"; }
  Store& store() { return *store_; }

  std::string Write(const TestCheckpoint& c) {
    std::string path = dir_.path() + "/ckpt" + std::to_string(dirs_++);
    Status s = test::WriteCheckpoint(c, path);
    EXPECT_TRUE(s.ok()) << s.message();
    return path;
  }
  Result<CommitResult> Commit(const TestCheckpoint& c, const CommitOptions& o = {}) {
    return CommitDirectory(*store_, Write(c), o);
  }
  // Every file of `version` equals the file of the same name in `c`.
  void ExpectVersionHolds(uint64_t version, const TestCheckpoint& c) {
    SCOPED_TRACE(VersionName(version));
    auto v = store_->GetVersion(version);
    ASSERT_TRUE(v.ok()) << v.status().message();
    std::map<std::string, std::string> want = c.raw_files;
    for (const auto& f : c.safetensors) want[f.name] = test::SafetensorsBytes(f);
    ASSERT_EQ((*v)->manifest.files.size(), want.size());
    Materializer reader(store_.get());
    for (const auto& f : (*v)->manifest.files) {
      std::string got(f.size, '\0');
      Status s = reader.ReadFile(*v, f, 0, f.size, reinterpret_cast<uint8_t*>(got.data()));
      ASSERT_TRUE(s.ok()) << s.message();
      EXPECT_TRUE(got == want[f.name]) << f.name << " differs";
    }
  }

 private:
  test::ScopedTempDir dir_;
  std::unique_ptr<Store> store_;
  int dirs_ = 0;
};

// Two shards with an index file and a config; lm_head ends in a partial block.
TestCheckpoint Model() {
  TestCheckpoint c;
  c.safetensors.push_back(
      {kShard1,
       {test::Bf16Tensor("model.embed", {1024, 512}, 1), test::Bf16Tensor("model.norm", {512}, 2)},
       {{"format", "pt"}}});
  TestTensor scale{"scale", DType::kF32, {4}, test::RandomBytes(16, 4)};
  c.safetensors.push_back(
      {kShard2, {test::Bf16Tensor("lm_head", {700, 512}, 3), scale}, {{"format", "pt"}}});
  c.raw_files["config.json"] = "{\"hidden_size\": 512}\n";
  std::string index = "{\"metadata\": {}, \"weight_map\": {";
  for (const auto& f : c.safetensors) {
    for (const auto& t : f.tensors) index += "\"" + t.name + "\": \"" + f.name + "\", ";
  }
  index.resize(index.size() - 2);
  c.raw_files["model.safetensors.index.json"] = index + "}}\n";
  return c;
}

uint64_t Elements(const TestCheckpoint& c) {
  uint64_t n = 0;
  for (const auto& f : c.safetensors) {
    for (const auto& t : f.tensors) n += t.elements();
  }
  return n;
}

// The reference count of changed elements per tensor name.
std::map<std::string, uint64_t> Changed(TestCheckpoint a, const TestCheckpoint& b) {
  std::map<std::string, uint64_t> out;
  for (const auto& f : b.safetensors) {
    for (const auto& t : f.tensors) {
      out[t.name] =
          test::CountDifferingElements(a.tensor(t.name).data, t.data, DTypeWidth(t.dtype));
    }
  }
  return out;
}

std::set<std::string> Keys(Store& store, const std::string& prefix) {
  auto keys = store.objects().List(prefix);
  EXPECT_TRUE(keys.ok()) << keys.status().message();
  return keys.ok() ? std::set<std::string>(keys->begin(), keys->end()) : std::set<std::string>();
}

TEST(Commit, AnchorThenDeltaWithExactChangedCounts) {
  Env env;
  TestCheckpoint c0 = Model();
  auto r0 = env.Commit(c0);
  ASSERT_TRUE(r0.ok()) << r0.status().message();
  EXPECT_EQ(r0->version, 0u);
  EXPECT_FALSE(r0->parent.has_value());
  EXPECT_EQ(r0->anchor_reason, "first version");
  EXPECT_EQ(r0->tensors, 4u);
  EXPECT_EQ(r0->elements, Elements(c0));
  EXPECT_EQ(r0->changed_elements, Elements(c0));
  EXPECT_EQ(r0->dense_bytes, 2 * (1024 * 512 + 512 + 700 * 512) + 16u);

  TestCheckpoint c1 = c0;
  test::PerturbElements(&c1.tensor("model.embed").data, 2, 1000, 11);
  test::PerturbElements(&c1.tensor("lm_head").data, 2, 37, 12);
  c1.tensor("scale").data[3] ^= 0x01;
  auto r1 = env.Commit(c1);
  ASSERT_TRUE(r1.ok()) << r1.status().message();
  EXPECT_EQ(r1->version, 1u);
  EXPECT_EQ(r1->parent, std::optional<uint64_t>(0));
  EXPECT_EQ(r1->anchor_reason, "");
  EXPECT_EQ(r1->changed_elements, 1000u + 37u + 1u);
  EXPECT_LT(r1->stored_bytes * 20, r1->dense_bytes) << "a sparse step should be small";
  auto changed = Changed(c0, c1);
  auto v1 = env.store().GetVersion(1);
  ASSERT_TRUE(v1.ok()) << v1.status().message();
  EXPECT_EQ((*v1)->manifest.stats.changed_elements, r1->changed_elements);
  for (const auto& f : (*v1)->manifest.files) {
    for (const auto& t : f.tensors) EXPECT_EQ(t.changed, changed[t.name]) << t.name;
  }
  ASSERT_EQ((*v1)->manifest.blobs.size(), 1u) << "one delta blob";
  env.ExpectVersionHolds(0, c0);
  env.ExpectVersionHolds(1, c1);
}

TEST(Commit, UnchangedCheckpointIsAnEmptyDelta) {
  Env env;
  TestCheckpoint c = Model();
  ASSERT_TRUE(env.Commit(c).ok());
  for (uint64_t v : {1u, 2u}) {
    auto r = env.Commit(c);
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(r->parent, std::optional<uint64_t>(v - 1));
    EXPECT_EQ(r->changed_elements, 0u);
    auto ver = env.store().GetVersion(v);
    ASSERT_TRUE(ver.ok());
    EXPECT_TRUE((*ver)->manifest.blobs.empty()) << "no delta blob";
    for (const auto& rec : (*ver)->records) EXPECT_EQ(rec.kind, BlockKind::kSame);
    // v1 stores only its new block table; v2's table is v1's, so nothing.
    EXPECT_EQ(r->stored_bytes, v == 1 ? (*ver)->manifest.block_table.size : 0u);
  }
  env.ExpectVersionHolds(2, c);
}

TEST(Commit, LayoutChangeMakesAnAnchorWithTheReason) {
  Env env;
  std::vector<TestCheckpoint> versions = {Model()};
  ASSERT_TRUE(env.Commit(versions[0]).ok());
  versions.push_back(versions[0]);
  versions[1].raw_files["config.json"] = "{\"hidden_size\": 512, \"note\": 1}\n";
  auto raw_only = env.Commit(versions[1]);
  ASSERT_TRUE(raw_only.ok()) << raw_only.status().message();
  EXPECT_EQ(raw_only->parent, std::optional<uint64_t>(0)) << "raw files do not affect layout";
  versions.push_back(versions[1]);
  versions[2].tensor("scale").shape = {2, 2};
  auto r = env.Commit(versions[2]);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_FALSE(r->parent.has_value());
  EXPECT_NE(r->anchor_reason.find("tensor layout differs from v00000001"), std::string::npos)
      << r->anchor_reason;
  EXPECT_EQ(r->changed_elements, r->elements);
  EXPECT_TRUE(env.store().GetVersion(2).value()->manifest.anchor());
  CommitOptions force;
  force.force_anchor = true;
  versions.push_back(versions[2]);
  auto forced = env.Commit(versions[3], force);
  ASSERT_TRUE(forced.ok());
  EXPECT_FALSE(forced->parent.has_value());
  EXPECT_EQ(forced->anchor_reason, "anchor requested");
  versions.push_back(versions[3]);
  test::PerturbElements(&versions[4].tensor("lm_head").data, 2, 5, 3);
  auto next = env.Commit(versions[4]);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->parent, std::optional<uint64_t>(3));
  for (uint64_t v = 0; v < versions.size(); ++v) env.ExpectVersionHolds(v, versions[v]);
}

TEST(Commit, ExplicitVersionMustExceedTheLatest) {
  Env env;
  TestCheckpoint c = Model();
  CommitOptions o;
  o.version = 5;
  auto r = env.Commit(c, o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->version, 5u);
  for (uint64_t bad : {0u, 3u}) {
    o.version = bad;
    auto again = env.Commit(c, o);
    EXPECT_EQ(again.status().code(), Code::kInvalidArgument) << bad;
    EXPECT_NE(again.status().message().find("latest version 5"), std::string::npos)
        << again.status().message();
  }
  o.version = 5;
  auto taken = env.Commit(c, o);
  EXPECT_EQ(taken.status().code(), Code::kAlreadyExists) << taken.status().message();
  EXPECT_NE(taken.status().message().find("version 5 "), std::string::npos)
      << taken.status().message();
  o.version = 9;
  ASSERT_TRUE(env.Commit(c, o).ok());
  auto next = env.Commit(c);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->version, 10u);
  EXPECT_EQ(next->parent, std::optional<uint64_t>(9));
  EXPECT_EQ(env.store().ListVersions()->size(), 3u);
}

TEST(Commit, VersionBeyondTheManifestKeyGrammarIsRefused) {
  Env env;
  const auto before = Keys(env.store(), "");
  CommitOptions o;
  o.version = 1'000'000'000'000;  // 13 digits: its key would never be listed
  auto r = env.Commit(Model(), o);
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().message();
  EXPECT_EQ(Keys(env.store(), ""), before);
  o.version = 999'999'999'999;
  auto top = env.Commit(Model(), o);
  ASSERT_TRUE(top.ok()) << top.status().message();
  EXPECT_EQ(env.store().Latest().value(), o.version);
  EXPECT_EQ(env.Commit(Model()).status().code(), Code::kInvalidArgument) << "no next version";
}

// Two publishers that both planned the same version number before either
// published: exactly one wins, the other gets AlreadyExists naming it.
TEST(Commit, RacingPublishersOfOneVersionExactlyOneWins) {
  Env env;
  TestCheckpoint base = Model();
  ASSERT_TRUE(env.Commit(base).ok());
  StoreOptions so;
  so.uri = env.uri();
  auto other_store = Store::Open(so);  // a second publisher process, in effect
  ASSERT_TRUE(other_store.ok());
  for (uint64_t version : {1u, 2u}) {
    SCOPED_TRACE(version);
    std::mutex mu;
    std::condition_variable cv;
    int planned = 0;
    auto rendezvous = [&] {
      std::unique_lock lock(mu);
      ++planned;
      cv.notify_all();
      cv.wait_for(lock, std::chrono::seconds(30), [&] { return planned >= 2; });
    };
    TestCheckpoint a = base, b = base;
    test::PerturbElements(&a.tensor("model.embed").data, 2, 10, 100 + version);
    test::PerturbElements(&b.tensor("model.embed").data, 2, 20, 200 + version);
    std::string dir_a = env.Write(a), dir_b = env.Write(b);
    Result<CommitResult> ra = InvalidArgument("not run"), rb = InvalidArgument("not run");
    auto run = [&](Store* store, const std::string& dir, Result<CommitResult>* out) {
      CommitOptions o;
      bool first = true;
      o.progress = [&](uint64_t, uint64_t) {
        if (std::exchange(first, false)) rendezvous();  // planned, nothing published
      };
      *out = CommitDirectory(*store, dir, o);
    };
    // Round 1 shares one Store object; round 2 uses two.
    Store* second = version == 1 ? &env.store() : other_store->get();
    std::thread ta(run, &env.store(), dir_a, &ra), tb(run, second, dir_b, &rb);
    ta.join();
    tb.join();
    ASSERT_EQ(planned, 2);
    ASSERT_NE(ra.ok(), rb.ok()) << ra.status().message() << " / " << rb.status().message();
    const Result<CommitResult>& loser = ra.ok() ? rb : ra;
    EXPECT_EQ(loser.status().code(), Code::kAlreadyExists) << loser.status().message();
    const std::string& why = loser.status().message();
    EXPECT_TRUE(why.find(VersionName(version)) != std::string::npos ||
                why.find("version " + std::to_string(version) + " ") != std::string::npos)
        << why;
    EXPECT_EQ((ra.ok() ? ra : rb)->version, version);
    env.ExpectVersionHolds(version, ra.ok() ? a : b);
    base = ra.ok() ? a : b;
  }
}

// The input changes under the publisher after the scan: the commit fails and
// no manifest appears. The blobs it added stay until gc's grace window has
// passed (a concurrent publisher may be reusing them); gc then removes them.
void ExpectFailedCommitLeavesNoTrace(Env& env, const TestCheckpoint& c, uint64_t version) {
  const auto blobs_before = Keys(env.store(), "blobs/");
  const auto manifests_before = Keys(env.store(), "manifests/");
  std::string dir = env.Write(c);
  CommitOptions o;
  bool truncated = false;
  o.progress = [&](uint64_t, uint64_t) {
    if (std::exchange(truncated, true)) return;
    fs::resize_file(dir + "/" + kShard2, fs::file_size(dir + "/" + kShard2) - 100);
  };
  auto r = CommitDirectory(env.store(), dir, o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(kShard2), std::string::npos) << r.status().message();
  EXPECT_EQ(Keys(env.store(), "manifests/"), manifests_before);
  EXPECT_EQ(env.store().GetVersion(version).status().code(), Code::kNotFound);
  GcOptions gc;
  gc.keep_last = 1000;
  gc.grace_seconds = 0;
  auto collected = CollectGarbage(env.store(), gc, nullptr);
  ASSERT_TRUE(collected.ok()) << collected.status().message();
  EXPECT_EQ(Keys(env.store(), "blobs/"), blobs_before) << "gc left the failed commit's blobs";
  std::error_code ec;
  EXPECT_TRUE(fs::is_empty(env.uri() + "/tmp", ec) || !fs::exists(env.uri() + "/tmp"))
      << "spool files left behind";
}

TEST(Commit, FailureMidwayLeavesNoManifestAndGcRemovesItsBlobs) {
  Env env;
  TestCheckpoint c0 = Model();
  ExpectFailedCommitLeavesNoTrace(env, c0, 0);  // an anchor
  ASSERT_TRUE(env.Commit(c0).ok());
  TestCheckpoint c1 = c0;
  test::PerturbElements(&c1.tensor("model.embed").data, 2, 500, 7);
  c1.raw_files["config.json"] = "{\"changed\": true}\n";  // a new raw blob to roll back
  ExpectFailedCommitLeavesNoTrace(env, c1, 1);            // a delta
  env.ExpectVersionHolds(0, c0);
  auto r = env.Commit(c1);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->version, 1u);
  env.ExpectVersionHolds(1, c1);
}

TEST(Commit, InvalidCheckpointWritesNothing) {
  Env env;
  const auto before = Keys(env.store(), "");
  TestCheckpoint c = Model();
  std::string dir = env.Write(c);
  std::string bytes = test::ReadFileBytes(dir + "/" + kShard1).value();
  bytes[20] = '\x01';  // inside the JSON header
  ASSERT_TRUE(test::WriteFileBytes(dir + "/" + kShard1, bytes).ok());
  auto r = CommitDirectory(env.store(), dir, {});
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find(kShard1), std::string::npos) << r.status().message();
  EXPECT_EQ(Keys(env.store(), ""), before);
}

// One tensor per dtype, seeded with signed zeros, NaN-like patterns with
// different payloads, all-ones and denormal patterns; the delta flips
// exactly such bits.
TestCheckpoint EveryDtype() {
  const std::vector<DType> all = {DType::kBool,   DType::kU8,  DType::kI8,  DType::kF8E4M3,
                                  DType::kF8E5M2, DType::kU16, DType::kI16, DType::kF16,
                                  DType::kBF16,   DType::kU32, DType::kI32, DType::kF32,
                                  DType::kU64,    DType::kI64, DType::kF64};
  TestCheckpoint c;
  c.safetensors.push_back({"model.safetensors", {}, {}});
  constexpr uint64_t kElements = 70000;  // 8-byte types span three blocks
  uint64_t seed = 50;
  for (DType d : all) {
    const int w = DTypeWidth(d);
    TestTensor t{
        std::string("t_") + DTypeName(d), d, {700, 100}, test::RandomBytes(kElements * w, seed++)};
    if (d == DType::kBool) {
      for (auto& ch : t.data) ch &= 1;
    }
    // +0, -0, NaNs with two payloads, an all-ones (negative) NaN, a denormal.
    const uint64_t sign = uint64_t{1} << (8 * w - 1);
    const uint64_t specials[] = {0, sign, sign - 1, sign - 2, ~uint64_t{0}, 1};
    for (size_t k = 0; k < std::size(specials) && d != DType::kBool; ++k) {
      for (uint64_t at = k * 997; at < kElements; at += 9973) {
        std::memcpy(&t.data[at * w], &specials[k], static_cast<size_t>(w));
      }
    }
    c.safetensors[0].tensors.push_back(std::move(t));
  }
  return c;
}

TEST(Commit, EveryDtypeWithNanPayloadsAndSignedZerosRoundTripsBitExactly) {
  Env env;
  TestCheckpoint c0 = EveryDtype();
  ASSERT_TRUE(env.Commit(c0).ok());
  TestCheckpoint c1 = c0;
  for (auto& t : c1.safetensors[0].tensors) {
    const int w = DTypeWidth(t.dtype);
    if (t.dtype == DType::kBool) {
      for (uint64_t at = 5; at < t.elements(); at += 4001) t.data[at] ^= 1;
      continue;
    }
    t.data[(0 * 997) * w + w - 1] ^= '\x80';  // +0 -> -0
    t.data[(1 * 997) * w + w - 1] ^= '\x80';  // -0 -> +0
    t.data[(2 * 997) * w] ^= '\x02';          // another NaN payload
    test::PerturbElements(&t.data, w, 40, 77);
  }
  auto r = env.Commit(c1);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_EQ(r->parent, std::optional<uint64_t>(0));
  uint64_t want = 0;
  for (const auto& [name, n] : Changed(c0, c1)) want += n;
  EXPECT_EQ(r->changed_elements, want);
  env.ExpectVersionHolds(0, c0);
  env.ExpectVersionHolds(1, c1);
}

TEST(Commit, ZeroElementTensorsAndPartialLastBlocks) {
  Env env;
  TestCheckpoint c;
  c.safetensors.push_back(
      {"model.safetensors",
       {TestTensor{"empty", DType::kF32, {0}, ""}, test::Bf16Tensor("w", {kBB / 2 + 3}, 1),
        TestTensor{"empty2", DType::kBF16, {4, 0, 2}, ""}, test::Bf16Tensor("scalar", {}, 2),
        TestTensor{"tail_empty", DType::kI64, {0, 1}, ""}},
       {}});
  auto r0 = env.Commit(c);
  ASSERT_TRUE(r0.ok()) << r0.status().message();
  auto v0 = env.store().GetVersion(0).value();
  const auto& tensors = v0->manifest.files[0].tensors;
  ASSERT_EQ(tensors.size(), 5u);
  EXPECT_EQ(tensors[0].blocks, 0u);
  EXPECT_EQ(tensors[1].blocks, 2u);  // 256 KiB + 6 bytes
  EXPECT_EQ(v0->records.size(), 3u);
  TestCheckpoint c1 = c;
  c1.tensor("w").data[kBB + 4] ^= 0x40;  // only in the 6-byte last block
  auto r1 = env.Commit(c1);
  ASSERT_TRUE(r1.ok()) << r1.status().message();
  EXPECT_EQ(r1->changed_elements, 1u);
  auto v1 = env.store().GetVersion(1).value();
  EXPECT_EQ(v1->records[0].kind, BlockKind::kSame);
  EXPECT_NE(v1->records[1].kind, BlockKind::kSame);
  EXPECT_EQ(v1->records[1].changed, 1u);
  env.ExpectVersionHolds(0, c);
  env.ExpectVersionHolds(1, c1);
}

TEST(Commit, ProgressEndsAtTheInputSize) {
  Env env;
  uint64_t last_done = 0, last_total = 0, calls = 0;
  CommitOptions o;
  o.progress = [&](uint64_t done, uint64_t total) {
    EXPECT_GE(done, last_done);
    last_done = done;
    last_total = total;
    calls++;
  };
  auto r = env.Commit(Model(), o);
  ASSERT_TRUE(r.ok());
  EXPECT_GT(calls, 1u);
  EXPECT_EQ(last_done, r->input_bytes);
  EXPECT_EQ(last_total, r->input_bytes);
}

// Publisher A adds a blob (a new config.json), publisher B reuses it, then A
// fails: B's version must still have every blob it names.
TEST(Commit, FailedCommitKeepsBlobsAConcurrentCommitReused) {
  Env env;
  TestCheckpoint base = Model();
  ASSERT_TRUE(env.Commit(base).ok());
  TestCheckpoint next = base;
  next.raw_files["config.json"] = "{\"shared\": \"by both publishers\"}\n";
  const std::string dir_a = env.Write(next), dir_b = env.Write(next);
  std::mutex mu;
  std::condition_variable cv;
  bool b_reused = false, a_done = false;
  auto wait_for = [&](bool* flag) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(30), [&] { return *flag; });
  };
  auto set = [&](bool* flag) {
    std::lock_guard lock(mu);
    *flag = true;
    cv.notify_all();
  };
  Result<CommitResult> ra = InvalidArgument("not run");
  std::thread a([&] {
    CommitOptions o;
    int calls = 0;
    // Call 1 comes while config.json is read, call 2 after its blob is stored.
    o.progress = [&](uint64_t, uint64_t) {
      if (++calls != 2) return;
      fs::resize_file(dir_a + "/" + kShard2, fs::file_size(dir_a + "/" + kShard2) - 100);
      EXPECT_TRUE(wait_for(&b_reused));
    };
    ra = CommitDirectory(env.store(), dir_a, o);
    set(&a_done);
  });
  CommitOptions o;
  int calls = 0;
  o.progress = [&](uint64_t, uint64_t) {
    if (++calls != 2) return;
    set(&b_reused);
    EXPECT_TRUE(wait_for(&a_done));
  };
  auto rb = CommitDirectory(env.store(), dir_b, o);
  a.join();
  ASSERT_FALSE(ra.ok()) << "publisher A was meant to fail";
  ASSERT_TRUE(rb.ok()) << rb.status().message();
  env.ExpectVersionHolds(rb->version, next);
}

}  // namespace
}  // namespace dte
