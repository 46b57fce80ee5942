// Long runs: the anchor policy writes full tables that bound every chain
// walk, commits read their parent from the snapshot the previous commit
// left and leave one behind, and none of it is needed for correct bytes.
#include "store/write/anchor_policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include "store/materialize.h"
#include "store/ops/commit.h"
#include "store/ops/export.h"
#include "store/ops/gc.h"
#include "store/ops/verify.h"
#include "store/snapshot.h"
#include "store/store.h"
#include "tests/testutil/checkpoint.h"
#include "tests/testutil/memory_store.h"
#include "tests/testutil/model_series.h"

namespace dte {
namespace {

namespace fs = std::filesystem;
using test::ModelSeries;

constexpr uint64_t kSteps = 13;

// A store with a cache directory, and the steps of one ModelSeries written
// as checkpoint directories beside it.
class LongRun : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { series_ = new ModelSeries(kSteps); }
  static void TearDownTestSuite() { delete series_; }

  void SetUp() override { store_ = Open(cache()); }

  std::unique_ptr<Store> Open(const std::string& cache_dir) {
    if (store_ && cache_dir == cache()) store_.reset();  // one holder of the index at a time
    StoreOptions o;
    o.uri = dir_.path() + "/store";
    o.cache_dir = cache_dir;
    o.create = true;
    auto s = Store::Open(o);
    EXPECT_TRUE(s.ok()) << s.status().message();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  std::string cache() const { return dir_.path() + "/cache"; }
  std::string SnapDir() const { return store_->CachePath() + "/snapshots"; }

  CommitResult Commit(uint64_t step, const CommitOptions& o) {
    const std::string path = dir_.path() + "/step" + std::to_string(step);
    EXPECT_TRUE(series_->Write(step, path).ok());
    auto r = CommitDirectory(*store_, path, o);
    EXPECT_TRUE(r.ok()) << r.status().message();
    return r.ok() ? *r : CommitResult{};
  }

  // Every file of `version`, read through `store` with no snapshots, equals
  // the step's files; returns the records decoded for it.
  uint64_t ExpectHolds(Store& store, uint64_t version) {
    SCOPED_TRACE(VersionName(version));
    auto v = store.GetVersion(version);
    EXPECT_TRUE(v.ok()) << v.status().message();
    if (!v.ok()) return 0;
    Materializer reader(&store);
    for (const auto& f : (*v)->manifest.files) {
      std::string got(f.size, '\0');
      Status s = reader.ReadFile(*v, f, 0, f.size, reinterpret_cast<uint8_t*>(got.data()));
      EXPECT_TRUE(s.ok()) << s.message();
      EXPECT_TRUE(got == series_->files(version).at(f.name)) << f.name << " differs";
    }
    return reader.counters().records.load();
  }

  static ModelSeries* series_;
  test::ScopedTempDir dir_;
  std::unique_ptr<Store> store_;
};

ModelSeries* LongRun::series_ = nullptr;

TEST(AnchorPolicy, ReasonFollowsVersionsAndBytes) {
  AnchorPolicy every4{0, 4};
  EXPECT_EQ(PolicyAnchorReason(every4, {2, 0}, 1000), "");
  EXPECT_NE(PolicyAnchorReason(every4, {3, 0}, 1000).find("4 versions"), std::string::npos);
  AnchorPolicy half{0.5, 0};
  EXPECT_EQ(PolicyAnchorReason(half, {100, 499}, 1000), "");
  EXPECT_NE(PolicyAnchorReason(half, {1, 500}, 1000).find("budget"), std::string::npos);
  EXPECT_EQ(PolicyAnchorReason(AnchorPolicy{0, 0}, {1u << 30, 1u << 30}, 1), "");
}

TEST(AnchorPolicy, DistanceResetsAtSelfContainedVersions) {
  AnchorDistance d = NextDistance({}, false, 10);
  d = NextDistance(d, false, 5);
  EXPECT_EQ(d.versions, 2u);
  EXPECT_EQ(d.bytes, 15u);
  d = NextDistance(d, true, 999);
  EXPECT_EQ(d.versions, 0u);
  EXPECT_EQ(d.bytes, 0u);
}

TEST(AnchorPolicy, NegativeOrNanBudgetIsRefusedNamingTheOption) {
  EXPECT_EQ(CheckAnchorPolicy({-1, 0}).code(), Code::kInvalidArgument);
  EXPECT_NE(CheckAnchorPolicy({std::nan(""), 0}).message().find("--anchor-budget"),
            std::string::npos);
  EXPECT_TRUE(CheckAnchorPolicy({0, 0}).ok());
}

TEST_F(LongRun, EveryFourthVersionCarriesAFullTableAndChainsStopThere) {
  CommitOptions o;
  o.anchor_policy = {0, 4};
  for (uint64_t s = 0; s < kSteps; ++s) {
    CommitResult r = Commit(s, o);
    EXPECT_EQ(r.full_table, s > 0 && s % 4 == 0) << "step " << s;
    if (r.full_table) {
      EXPECT_GT(r.full_bytes, 0u);
      EXPECT_EQ(r.parent, std::optional<uint64_t>(s - 1));  // still a delta for followers
    }
  }
  for (uint64_t s = 1; s < kSteps; ++s) {
    auto v = store_->GetVersion(s);
    ASSERT_TRUE(v.ok());
    ASSERT_TRUE((*v)->manifest.since_full.has_value());
    EXPECT_EQ((*v)->manifest.since_full->versions, s % 4) << "v" << s;
    EXPECT_EQ((*v)->full_records.size(), s % 4 == 0 ? (*v)->records.size() : 0u);
  }
  // A host with an empty cache: v11 is three records past v8's full table.
  auto fresh = Open("");
  ASSERT_NE(fresh, nullptr);
  auto v11 = fresh->GetVersion(11);
  ASSERT_TRUE(v11.ok());
  const uint64_t blocks = (*v11)->records.size();
  EXPECT_LE(ExpectHolds(*fresh, 11), 4 * blocks);
  EXPECT_EQ(Materializer(fresh.get()).ChainOf(*v11).size(), 4u);  // v11, v10, v9, v8
  for (uint64_t s = 0; s < kSteps; ++s) ExpectHolds(*fresh, s);
  auto report = VerifyStore(*fresh, std::nullopt, nullptr);
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->ok()) << report->problems.front();
}

TEST_F(LongRun, BudgetOfDeltaBytesTriggersFullTables) {
  CommitOptions o;
  o.anchor_policy = {0, 0};
  Commit(0, o);
  uint64_t deltas = 0;
  for (uint64_t s = 1; s <= 3; ++s) deltas += Commit(s, o).stored_bytes;
  const auto dense = static_cast<double>(Commit(4, o).dense_bytes);
  const uint64_t d4 = store_->GetVersion(4).value()->manifest.stats.stored_bytes;
  // Budgets just above and just at what the deltas since v0 hold.
  o.anchor_policy.budget = static_cast<double>(deltas + d4 + 64) / dense;
  EXPECT_FALSE(Commit(5, o).full_table);
  const uint64_t d5 = store_->GetVersion(5).value()->manifest.stats.stored_bytes;
  o.anchor_policy.budget = static_cast<double>(deltas + d4 + d5) / dense;
  CommitResult r6 = Commit(6, o);
  EXPECT_TRUE(r6.full_table);
  EXPECT_NE(r6.anchor_reason.find("budget"), std::string::npos) << r6.anchor_reason;
  EXPECT_FALSE(Commit(7, o).full_table);  // the distance starts again at v6
  EXPECT_EQ(store_->GetVersion(7).value()->manifest.since_full->versions, 1u);
}

TEST_F(LongRun, CommitReadsTheParentFromItsSnapshotAndKeepsTheNewest) {
  CommitOptions o;
  o.keep_snapshots = 2;
  o.snapshot_every = 1;  // a snapshot of every version
  EXPECT_EQ(Commit(0, o).parent_snapshot_blocks, 0u);
  for (uint64_t s = 1; s < 6; ++s) {
    CommitResult r = Commit(s, o);
    auto v = store_->GetVersion(s);
    ASSERT_TRUE(v.ok());
    EXPECT_EQ(r.parent_snapshot_blocks, (*v)->records.size()) << "step " << s;
    EXPECT_EQ(r.snapshot, SnapDir() + "/" + SnapshotSet::FileName(**v));
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(SnapDir())) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  ASSERT_EQ(names.size(), 2u);
  EXPECT_EQ(names[0].substr(0, 9), "v00000004");
  EXPECT_EQ(names[1].substr(0, 9), "v00000005");
}

TEST_F(LongRun, CommitLeavesASnapshotOfEveryEighthVersionByDefault) {
  CommitOptions o;
  o.anchor_policy = {0, 0, 0};  // no full or join tables: those versions always get one
  o.keep_snapshots = 8;
  for (uint64_t s = 0; s < 13; ++s) {
    CommitResult r = Commit(s, o);
    const bool due = s % 8 == 0;  // v0 is stored whole; then 8 versions from the last one
    EXPECT_EQ(r.snapshot.ends_with(".snap"), due) << "v" << s << ": " << r.snapshot;
    // Every parent comes from a snapshot (plus at most 7 deltas on it).
    if (s > 0) {
      EXPECT_GT(r.parent_snapshot_blocks, 0u) << "v" << s;
    }
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(SnapDir())) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  ASSERT_EQ(names.size(), 2u);
  EXPECT_EQ(names[0].substr(0, 9), "v00000000");
  EXPECT_EQ(names[1].substr(0, 9), "v00000008");
  auto fresh = Open("");
  for (uint64_t s : {7u, 12u}) ExpectHolds(*fresh, s);
}

TEST_F(LongRun, DeletedCacheOrDamagedSnapshotStillCommitsTheRightBytes) {
  CommitOptions o;
  for (uint64_t s = 0; s < 3; ++s) Commit(s, o);
  fs::remove_all(cache());
  store_ = Open(cache());
  CommitResult r = Commit(3, o);
  EXPECT_EQ(r.parent_snapshot_blocks, 0u);  // v2's snapshot is gone: read from the store
  // Damage v3's snapshot: every block of v4's parent then comes from the store.
  auto v3 = store_->GetVersion(3);
  ASSERT_TRUE(v3.ok());
  const std::string snap = SnapDir() + "/" + SnapshotSet::FileName(**v3);
  {
    std::fstream f(snap, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x5a');
  }
  store_ = Open(cache());
  r = Commit(4, o);
  EXPECT_LT(r.parent_snapshot_blocks, (*v3)->records.size());
  auto fresh = Open("");
  for (uint64_t s = 0; s < 5; ++s) ExpectHolds(*fresh, s);
}

TEST_F(LongRun, CommitWithoutACacheDirectoryWritesNoSnapshot) {
  store_ = Open("");
  EXPECT_EQ(Commit(0, {}).snapshot, "none: no cache directory");
  EXPECT_EQ(Commit(1, {}).parent_snapshot_blocks, 0u);
  ExpectHolds(*store_, 1);
}

TEST_F(LongRun, ExportOfAFullTableVersionDecodesNoParent) {
  CommitOptions o;
  o.anchor_policy = {0, 3};
  for (uint64_t s = 0; s < 4; ++s) Commit(s, o);
  auto fresh = Open("");
  auto v3 = fresh->GetVersion(3);
  ASSERT_TRUE(v3.ok());
  ASSERT_TRUE((*v3)->manifest.full.has_value());
  // Every block from the full table: one dense record each, nothing else.
  EXPECT_EQ(ExpectHolds(*fresh, 3), (*v3)->records.size());
  const std::string out = dir_.path() + "/export3";
  auto r = ExportVersion(*fresh, 3, out, nullptr);
  ASSERT_TRUE(r.ok()) << r.status().message();
  for (const auto& [name, bytes] : series_->files(3)) {
    std::ifstream in(out + "/" + name, std::ios::binary);
    std::string got((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_TRUE(got == bytes) << name;
  }
}

// Join tables: a tiny join budget gives one to every delta whose parent has
// none (the distance is the parent's, as for policy anchors): v2, v4, ...
CommitOptions JoinEveryOtherVersion() {
  CommitOptions o;
  o.anchor_policy = {0, 0, 1e-9};
  return o;
}

std::set<std::string> JoinBlobKeys(Store& store, uint64_t version) {
  auto text = store.objects().Get(JoinKey(version));
  EXPECT_TRUE(text.ok()) << text.status().message();
  if (!text.ok()) return {};
  auto jt = DecodeJoin(*text, JoinKey(version));
  EXPECT_TRUE(jt.ok()) << jt.status().message();
  if (!jt.ok()) return {};
  std::set<std::string> keys{BlobKey(jt->table.block_table.hash)};
  for (const auto& b : jt->table.blobs) keys.insert(BlobKey(b.hash));
  return keys;
}

std::vector<uint64_t> JoinsListed(Store& store) {
  auto joins = store.ListJoins();
  EXPECT_TRUE(joins.ok());
  std::vector<uint64_t> out;
  if (joins.ok()) {
    for (const auto& [v, key] : *joins) out.push_back(v);
  }
  return out;
}

TEST(AnchorPolicy, JoinReasonFollowsItsOwnBudget) {
  AnchorPolicy p{0, 0, 0.25};
  EXPECT_EQ(JoinTableReason(p, {3, 249}, 1000), "");
  EXPECT_NE(JoinTableReason(p, {3, 250}, 1000).find("join budget"), std::string::npos);
  EXPECT_EQ(JoinTableReason(AnchorPolicy{0, 0, 0}, {1u << 30, 1u << 30}, 1), "");
  EXPECT_NE(CheckAnchorPolicy({1, 0, -0.5}).message().find("--join-budget"), std::string::npos);
}

TEST(JoinFormat, KeysAndObjectsRoundTripAndBadOnesAreRefused) {
  EXPECT_EQ(JoinKey(12), "joins/v00000012.json");
  EXPECT_EQ(ParseJoinKey("joins/v00000012.json"), std::optional<uint64_t>(12));
  EXPECT_EQ(ParseJoinKey("joins/v0000012.json"), std::nullopt);
  EXPECT_EQ(ParseJoinKey("joins/v00000012.json.tmp"), std::nullopt);
  EXPECT_EQ(ParseJoinKey("manifests/v00000012.json"), std::nullopt);
  JoinTable jt;
  jt.version = 7;
  jt.manifest_key = ManifestKey(7, 2);
  jt.created = "2026-11-26T00:00:00Z";
  jt.table.block_table = BlobRef{HashBytes("t", 1), 64, true};
  jt.table.blobs = {BlobRef{HashBytes("p", 1), 4096, true}};
  auto back = DecodeJoin(EncodeJoin(jt), "j");
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->manifest_key, ManifestKey(7, 2));
  EXPECT_EQ(back->table.blobs.size(), 1u);
  jt.manifest_key = ManifestKey(8, 0);  // another version's manifest
  EXPECT_EQ(DecodeJoin(EncodeJoin(jt), "joins/v00000007.json").status().code(), Code::kCorruption);
  EXPECT_NE(DecodeJoin("{", "joins/v00000007.json").status().message().find("joins/v00000007"),
            std::string::npos);
  // The header names the version: a table blob of another version is refused.
  const std::string blob = JoinBlobHeader(7, kJoinTablePart) + "table";
  EXPECT_EQ(JoinTableBody(blob, 7, "j").value(), "table");
  EXPECT_EQ(JoinTableBody(blob, 8, "j").status().code(), Code::kCorruption);
  EXPECT_EQ(JoinBlobHeader(7, 0).size(), kJoinBlobHeaderBytes);
}

TEST_F(LongRun, JoinTablesAreWrittenOnTheirBudgetAndOnlyTheNewestTwoStay) {
  const CommitOptions o = JoinEveryOtherVersion();
  EXPECT_FALSE(Commit(0, o).join_table);  // an anchor needs none
  std::map<uint64_t, std::set<std::string>> blobs;
  for (uint64_t s = 1; s < kSteps; ++s) {
    CommitResult r = Commit(s, o);
    EXPECT_FALSE(r.full_table);
    if (s % 2 == 1) {
      EXPECT_FALSE(r.join_table) << "step " << s;
      EXPECT_EQ(r.join_reason, "");
      continue;
    }
    EXPECT_TRUE(r.join_table) << "step " << s << ": " << r.join_error;
    EXPECT_NE(r.join_reason.find("join budget"), std::string::npos) << r.join_reason;
    EXPECT_GT(r.join_bytes, 0u);
    blobs[s] = JoinBlobKeys(*store_, s);
    auto v = store_->GetVersion(s);
    ASSERT_TRUE(v.ok());
    // Not part of the version: the manifest has no full table, its stored
    // bytes are the delta's alone, and its distance goes on growing.
    EXPECT_FALSE((*v)->manifest.full.has_value());
    EXPECT_LT((*v)->manifest.stats.stored_bytes, r.join_bytes);
    EXPECT_EQ((*v)->manifest.since_full->versions, s);
  }
  EXPECT_EQ(JoinsListed(*store_), (std::vector<uint64_t>{kSteps - 3, kSteps - 1}));
  for (const auto& [v, keys] : blobs) {
    for (const auto& key : keys) {
      EXPECT_EQ(store_->objects().Size(key).value().has_value(), v >= kSteps - 3)
          << "v" << v << " " << key;
    }
  }
  auto fresh = Open("");
  for (uint64_t s = 0; s < kSteps; ++s) ExpectHolds(*fresh, s);
  auto report = VerifyStore(*fresh, std::nullopt, nullptr);
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->ok()) << report->problems.front();
}

TEST_F(LongRun, HostThatJoinsLateReadsLatestFromTheJoinTable) {
  for (uint64_t s = 0; s < kSteps; ++s) Commit(s, JoinEveryOtherVersion());
  auto fresh = Open("");
  auto latest = fresh->GetVersion(kSteps - 1);
  ASSERT_TRUE(latest.ok());
  // One dense record per block, and no parent: the chain is latest alone.
  EXPECT_EQ(ExpectHolds(*fresh, kSteps - 1), (*latest)->records.size());
  EXPECT_EQ(Materializer(fresh.get()).ChainOf(*latest, /*stop_at_joins=*/true).size(), 1u);
  EXPECT_EQ(Materializer(fresh.get()).ChainOf(*latest).size(), kSteps);
  // Its records are raw: read at the speed of a copy. Anchors compress.
  auto join = fresh->JoinOf(**latest);
  ASSERT_NE(join, nullptr);
  for (const auto& r : join->records) EXPECT_EQ(r.kind, BlockKind::kDenseRaw);
  // The same store without its join tables decodes the whole chain.
  fs::remove_all(dir_.path() + "/store/joins");
  auto bare = Open("");
  EXPECT_GT(ExpectHolds(*bare, kSteps - 1), 3 * (*latest)->records.size());
}

TEST_F(LongRun, ReaderWhoseJoinTableWasPrunedWalksTheDeltasInstead) {
  const CommitOptions o = JoinEveryOtherVersion();
  const uint64_t v = kSteps - 5;
  for (uint64_t s = 0; s <= v; ++s) Commit(s, o);
  // A host that listed the store and loaded v's join table...
  auto reader = Open("");
  auto ver = reader->GetVersion(v);
  ASSERT_TRUE(ver.ok());
  ASSERT_NE(reader->JoinOf(**ver), nullptr);
  // ...while two more join tables are written and it is pruned with its blobs.
  for (uint64_t s = v + 1; s < kSteps; ++s) Commit(s, o);
  ASSERT_FALSE(store_->objects().Size(JoinKey(v)).value().has_value());
  Materializer m(reader.get());
  for (const auto& f : (*ver)->manifest.files) {
    std::string got(f.size, '\0');
    Status s = m.ReadFile(*ver, f, 0, f.size, reinterpret_cast<uint8_t*>(got.data()));
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_TRUE(got == series_->files(v).at(f.name)) << f.name;
  }
  EXPECT_EQ(m.counters().join_blocks.load(), 0u);
  EXPECT_EQ(reader->JoinOf(**ver), nullptr);  // forgotten until a listing shows it again
}

TEST_F(LongRun, DamagedJoinTablesAreIgnoredAndTheBytesStayRight) {
  for (uint64_t s = 0; s < kSteps; ++s) Commit(s, JoinEveryOtherVersion());
  const std::string root = dir_.path() + "/store/";
  // The newest: its object does not parse. The one before (v10): a byte of
  // its payload flipped (its own hash no longer matches; readers check the
  // blocks they make, not the blob).
  { std::ofstream(root + JoinKey(kSteps - 1), std::ios::trunc) << "{\"format\": \"dte-join\""; }
  auto jt = DecodeJoin(store_->objects().Get(JoinKey(kSteps - 3)).value(), "j").value();
  {
    std::fstream f(root + BlobKey(jt.table.blobs[0].hash),
                   std::ios::in | std::ios::out | std::ios::binary);
    for (std::streamoff off = kJoinBlobHeaderBytes; off < 4096; off += 97) {
      f.seekg(off);
      const char c = static_cast<char>(f.get());
      f.seekp(off);
      f.put(static_cast<char>(c ^ 0x5a));
    }
  }
  auto fresh = Open("");
  for (uint64_t s = 0; s < kSteps; ++s) ExpectHolds(*fresh, s);
  auto v = fresh->GetVersion(kSteps - 1);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(fresh->JoinOf(**v), nullptr);
  // v10's table loads (it is intact), but the reads found its blocks wrong
  // and dropped it.
  auto v10 = fresh->GetVersion(kSteps - 3);
  ASSERT_TRUE(v10.ok());
  EXPECT_EQ(fresh->JoinOf(**v10), nullptr);
  auto again = Open("");
  ASSERT_TRUE(again->ListVersions().ok());
  EXPECT_NE(again->JoinOf(**v10), nullptr);
  // verify names both, and finds nothing else wrong.
  auto report = VerifyStore(*again, std::nullopt, nullptr);
  ASSERT_TRUE(report.ok());
  ASSERT_EQ(report->problems.size(), 2u);
  EXPECT_NE(report->problems[0].find(JoinKey(kSteps - 3)), std::string::npos)
      << report->problems[0];
  EXPECT_NE(report->problems[0].find("does not match its hash"), std::string::npos)
      << report->problems[0];
  EXPECT_NE(report->problems[1].find(JoinKey(kSteps - 1)), std::string::npos)
      << report->problems[1];
  // gc deletes the object that does not parse.
  GcOptions g;
  g.keep_last = 100;
  ASSERT_TRUE(CollectGarbage(*store_, g, nullptr).ok());
  EXPECT_EQ(JoinsListed(*store_), std::vector<uint64_t>{kSteps - 3});
}

TEST_F(LongRun, GcKeepsJoinTablesOfKeptVersionsAndDropsTheRest) {
  for (uint64_t s = 0; s < kSteps; ++s) Commit(s, JoinEveryOtherVersion());
  const std::set<std::string> newest = JoinBlobKeys(*store_, kSteps - 1);
  GcOptions g;
  g.keep_last = 4;
  g.grace_seconds = 0;
  auto r = CollectGarbage(*store_, g, nullptr);
  ASSERT_TRUE(r.ok()) << r.status().message();
  // v9 was rebased (its parent is gone); v10 and v12 are unchanged and keep
  // their join tables and blobs.
  EXPECT_EQ(JoinsListed(*store_), (std::vector<uint64_t>{kSteps - 3, kSteps - 1}));
  for (const auto& key : newest) EXPECT_TRUE(store_->objects().Size(key).value().has_value());
  auto fresh = Open("");
  for (uint64_t s = kSteps - 4; s < kSteps; ++s) ExpectHolds(*fresh, s);
  // Keeping one version rebases v12 into an anchor: its join table, built
  // for the old revision, goes, with its blobs.
  g.keep_last = 1;
  r = CollectGarbage(*store_, g, nullptr);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(JoinsListed(*store_).empty());
  for (const auto& key : newest) EXPECT_FALSE(store_->objects().Size(key).value().has_value());
  fresh = Open("");
  ExpectHolds(*fresh, kSteps - 1);
}

}  // namespace
}  // namespace dte
