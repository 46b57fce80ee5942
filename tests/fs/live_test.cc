// Unit tests of live apply (sync/live/live.h) without FUSE: the live view, the
// changed set in every direction and across an anchor, page pushes limited
// to resident changed pages, refusals, and the one-apply-at-a-time rule.
// Receivers need a Llama layout and real /dev/shm objects: they are covered
// end to end by tests/py/test_fs_live.py.
#include "sync/live/live.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "fs/filesystem.h"
#include "tests/fs/fs_fixture.h"
#include "tests/testutil/wait.h"

namespace dte::fs {
namespace {

using live::kPageBytes;
using live::Live;
using live::LivePageStats;
using live::PageCache;
using test::SeriesStore;
using test::WaitFor;

// Records the pages an apply pushes; every page of every file is resident
// unless told otherwise.
class FakePageCache : public PageCache {
 public:
  Status Resident(const std::string& file, uint64_t size, std::vector<uint8_t>* out) override {
    if (on_resident) on_resident();
    if (gate.valid()) gate.wait();  // lets a test hold an apply here
    out->assign((size + kPageBytes - 1) / kPageBytes, resident_default);
    for (uint64_t p : evicted[file]) (*out)[p] = 0;
    return Status::Ok();
  }
  Status Store(uint32_t file_index, uint64_t offset, const char* data, size_t len) override {
    EXPECT_EQ(offset % kPageBytes, 0u);
    std::lock_guard<std::mutex> lock(mu);  // applies store from several threads
    pushes.push_back({file_index, offset, std::string(data, len)});
    auto it = kernel.find(file_index);
    if (it != kernel.end()) {
      EXPECT_LE(offset + len, it->second.size());
      it->second.replace(offset, len, data, len);
    }
    return Status::Ok();
  }
  // Files in `kernel` can be fetched: their bytes from `offset` up to the
  // first page in `gone` (evicted since the residency was read).
  Status Fetch(uint32_t file_index, uint64_t offset, size_t len, char* dst, size_t* got) override {
    if (on_fetch) on_fetch(file_index, offset);
    std::lock_guard<std::mutex> lock(mu);
    auto it = kernel.find(file_index);
    if (it == kernel.end()) return PageCache::Fetch(file_index, offset, len, dst, got);
    EXPECT_EQ(offset % kPageBytes, 0u);
    fetched++;
    uint64_t end = std::min<uint64_t>(offset + len, it->second.size());
    for (uint64_t p = offset / kPageBytes; p * kPageBytes < end; ++p) {
      if (gone[file_index].count(p)) end = std::min(end, p * kPageBytes);
    }
    *got = end > offset ? end - offset : 0;
    std::memcpy(dst, it->second.data() + offset, *got);
    return Status::Ok();
  }
  struct Push {
    uint32_t file;
    uint64_t offset;
    std::string bytes;
  };
  uint8_t resident_default = 1;
  std::map<std::string, std::set<uint64_t>> evicted;
  std::map<uint32_t, std::string> kernel;            // page-cache contents by file index
  std::map<uint32_t, std::set<uint64_t>> gone;       // pages evicted after Resident
  std::function<void(uint32_t, uint64_t)> on_fetch;  // before each fetch
  std::function<void()> on_resident;                 // before each residency read
  int fetched = 0;
  std::vector<Push> pushes;
  std::shared_future<void> gate;
  std::mutex mu;
};

class LiveTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kSteps = 5;
  LiveTest() : series_(kSteps) {}

  void SetUp() override {
    store_ = series_.Open();
    ASSERT_TRUE(store_);
    for (uint64_t s = 0; s < kSteps; ++s) ASSERT_TRUE(series_.Commit(*store_, s).ok());
    fs_ = std::make_unique<Filesystem>(store_.get(), uint64_t{64} << 20);
  }

  void Mount(std::optional<uint64_t> live) {
    fs_->SetInitialLive(live);
    ASSERT_TRUE(fs_->Refresh().ok());
  }

  // Every file of live/ equals step `step`'s.
  void ExpectLiveIs(uint64_t step) {
    for (const auto& [name, content] : series_.series().files(step)) {
      uint64_t ino = test::LookupIno(*fs_, kLiveDirIno, name);
      auto f = fs_->Open(ino, O_RDONLY);
      ASSERT_TRUE(f.ok()) << name;
      auto bytes = test::ReadRange(*fs_, **f, 0, content.size() + 10);
      ASSERT_TRUE(bytes.ok()) << bytes.status().message();
      EXPECT_TRUE(*bytes == content) << "live/" << name << " is not step " << step;
    }
  }

  // The pages an apply from `from` to `to` must push for file `name`
  // (everything resident): those whose bytes differ between the steps.
  std::set<uint64_t> ChangedPages(const std::string& name, uint64_t from, uint64_t to) {
    const std::string& a = series_.series().files(from).at(name);
    const std::string& b = series_.series().files(to).at(name);
    std::set<uint64_t> pages;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i] != b[i]) pages.insert(i / kPageBytes);
    }
    return pages;
  }

  SeriesStore series_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<Filesystem> fs_;
};

TEST_F(LiveTest, LiveIsTheNewestOrTheVersionAsked) {
  Mount(std::nullopt);
  EXPECT_EQ(fs_->LiveStatus().live_version, kSteps - 1);
  ExpectLiveIs(kSteps - 1);
  auto fs2 = std::make_unique<Filesystem>(store_.get(), uint64_t{64} << 20);
  fs2->SetInitialLive(1);
  ASSERT_TRUE(fs2->Refresh().ok());
  EXPECT_EQ(fs2->LiveStatus().live_version, 1u);
}

TEST_F(LiveTest, ApplyForwardBackAndSkippingServesTheTargetAndPushesExactlyTheChangedPages) {
  Mount(0);
  uint64_t live = 0;
  for (uint64_t target : {1, 4, 2, 0, 3}) {
    FakePageCache pages;
    auto r = fs_->ApplyLive(target, &pages);
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(r->from_version, live);
    EXPECT_EQ(r->to_version, target);
    EXPECT_GT(r->entries, 0u);
    ExpectLiveIs(target);
    // Pushed pages hold the target's bytes, and are exactly the changed pages.
    for (const auto& p : pages.pushes) {
      const std::shared_ptr<const Version> v = fs_->live().View()->version;
      const std::string& content =
          series_.series().files(target).at(v->manifest.files[p.file].name);
      EXPECT_EQ(content.substr(p.offset, p.bytes.size()), p.bytes);
    }
    for (const auto& [name, content] : series_.series().files(target)) {
      std::set<uint64_t> pushed;
      const std::shared_ptr<const Version> v = fs_->live().View()->version;
      for (const auto& p : pages.pushes) {
        if (v->manifest.files[p.file].name != name) continue;
        for (uint64_t o = 0; o < p.bytes.size(); o += kPageBytes) {
          pushed.insert((p.offset + o) / kPageBytes);
        }
      }
      // A page may be pushed when an element changed and changed back on
      // the way (the union of the deltas); it never misses a changed page.
      for (uint64_t page : ChangedPages(name, live, target)) {
        EXPECT_TRUE(pushed.count(page))
            << name << " page " << page << " " << live << "->" << target;
      }
    }
    live = target;
  }
  dte_live_status st = fs_->LiveStatus();
  EXPECT_EQ(st.applies, 5u);
  EXPECT_EQ(st.live_version, 3u);
}

// A page cache the apply can fetch from: it holds live version `step`'s
// bytes of every file.
void FillKernel(FakePageCache* pages, Filesystem& fs, const test::ModelSeries& series,
                uint64_t step) {
  const std::shared_ptr<const Version> v = fs.live().View()->version;
  for (uint32_t f = 0; f < v->manifest.files.size(); ++f) {
    pages->kernel[f] = series.files(step).at(v->manifest.files[f].name);
  }
}

TEST_F(LiveTest, ResidentPagesArePatchedInPlaceInEveryDirection) {
  Mount(0);
  uint64_t live = 0;
  for (uint64_t target : {1, 4, 2, 0, 3}) {
    FakePageCache pages;
    FillKernel(&pages, *fs_, series_.series(), live);
    auto r = fs_->ApplyLive(target, &pages);
    ASSERT_TRUE(r.ok()) << r.status().message();
    const LivePageStats st = fs_->live().LastPageStats();
    // Every page the kernel holds is the target's, byte for byte.
    const std::shared_ptr<const Version> v = fs_->live().View()->version;
    for (const auto& [f, bytes] : pages.kernel) {
      EXPECT_TRUE(bytes == series_.series().files(target).at(v->manifest.files[f].name))
          << v->manifest.files[f].name << " " << live << "->" << target;
    }
    // Tensor pages were fetched and patched; only whole blobs that differ
    // (headers, other files) came from the read path.
    EXPECT_GT(st.patched_pages, 0u) << live << "->" << target;
    EXPECT_GT(pages.fetched, 0);
    EXPECT_EQ(st.patched_pages + st.read_path_pages, r->pages);
    EXPECT_EQ(st.skipped_pages, 0u);
    EXPECT_EQ(st.refreshed_pages, 0u);
    ExpectLiveIs(target);
    live = target;
  }
}

TEST_F(LiveTest, PartlyResidentAndEvictedPagesCostWhatIsResident) {
  Mount(1);
  FakePageCache all;
  FillKernel(&all, *fs_, series_.series(), 1);
  // The same apply with everything resident, for comparison.
  auto fs2 = std::make_unique<Filesystem>(store_.get(), uint64_t{64} << 20);
  fs2->SetInitialLive(1);
  ASSERT_TRUE(fs2->Refresh().ok());
  ASSERT_TRUE(fs2->ApplyLive(3, &all).ok());
  const uint64_t all_pages = fs2->live().LastPageStats().patched_pages;

  FakePageCache pages;
  FillKernel(&pages, *fs_, series_.series(), 1);
  const std::map<uint32_t, std::string> before = pages.kernel;
  // A tenth of the pages resident; and of those, every third one (past the
  // first, which holds the header) is evicted between the residency check
  // and its fetch.
  const std::shared_ptr<const Version> v = fs_->live().View()->version;
  for (uint32_t f = 0; f < v->manifest.files.size(); ++f) {
    const uint64_t n = (v->manifest.files[f].size + kPageBytes - 1) / kPageBytes;
    for (uint64_t p = 0; p < n; ++p) {
      if (p % 10 != 0) pages.evicted[v->manifest.files[f].name].insert(p);
      if (p % 30 == 0 && p > 0) pages.gone[f].insert(p);
    }
  }
  auto r = fs_->ApplyLive(3, &pages);
  ASSERT_TRUE(r.ok()) << r.status().message();
  const LivePageStats st = fs_->live().LastPageStats();
  EXPECT_GT(st.skipped_pages, 0u);
  EXPECT_GT(st.patched_pages, 0u);
  EXPECT_LT(st.patched_pages * 5, all_pages);  // in proportion to what is resident
  for (const auto& [f, bytes] : pages.kernel) {
    const std::string& want = series_.series().files(3).at(v->manifest.files[f].name);
    for (uint64_t p = 0; p * kPageBytes < bytes.size(); ++p) {
      const std::string got = bytes.substr(p * kPageBytes, kPageBytes);
      if (p % 10 == 0 && (p % 30 != 0 || p == 0)) {
        EXPECT_EQ(got, want.substr(p * kPageBytes, kPageBytes)) << "resident page " << p;
      } else {  // not resident: never stored (its next read is served from v3)
        EXPECT_EQ(got, before.at(f).substr(p * kPageBytes, kPageBytes)) << "page " << p;
      }
    }
  }
  for (const auto& push : pages.pushes) {
    for (uint64_t o = 0; o < push.bytes.size(); o += kPageBytes) {
      const uint64_t p = (push.offset + o) / kPageBytes;
      EXPECT_TRUE(p % 10 == 0 && (p % 30 != 0 || p == 0))
          << "stored page " << p << " was not resident";
    }
  }
  ExpectLiveIs(3);
}

TEST_F(LiveTest, APageAReadRefilledDuringTheApplyIsStoredAgain) {
  Mount(0);
  FakePageCache pages;
  FillKernel(&pages, *fs_, series_.series(), 0);
  const std::shared_ptr<const Version> v = fs_->live().View()->version;
  // The first fetch finds its first page evicted and read again since the
  // switch: the kernel holds v2's bytes there, and the read was noted.
  std::atomic<bool> first{true};
  uint32_t refilled_file = 0;
  uint64_t refilled_at = 0;
  pages.on_fetch = [&](uint32_t f, uint64_t offset) {
    if (!first.exchange(false)) return;
    std::lock_guard<std::mutex> lock(pages.mu);
    const std::string& target = series_.series().files(2).at(v->manifest.files[f].name);
    pages.kernel[f].replace(offset, kPageBytes, target, offset, kPageBytes);
    fs_->live().NoteRead(fs_->live().View().get(), f, offset, kPageBytes);
    refilled_file = f;
    refilled_at = offset;
  };
  auto r = fs_->ApplyLive(2, &pages);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_FALSE(first.load());
  const LivePageStats st = fs_->live().LastPageStats();
  EXPECT_GE(st.refreshed_pages, 1u);
  for (const auto& [f, bytes] : pages.kernel) {
    EXPECT_TRUE(bytes == series_.series().files(2).at(v->manifest.files[f].name))
        << v->manifest.files[f].name << " (refilled: file " << refilled_file << " at "
        << refilled_at << ")";
  }
  // Reads of another view, or with no apply running, are not noted.
  fs_->live().NoteRead(fs_->live().View().get(), 0, 0, kPageBytes);
  FakePageCache again;
  FillKernel(&again, *fs_, series_.series(), 2);
  ASSERT_TRUE(fs_->ApplyLive(4, &again).ok());
  EXPECT_EQ(fs_->live().LastPageStats().refreshed_pages, 0u);
}

TEST_F(LiveTest, OnlyResidentPagesArePushed) {
  Mount(0);
  FakePageCache pages;
  pages.resident_default = 0;
  auto r = fs_->ApplyLive(2, &pages);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->pages, 0u);
  EXPECT_TRUE(pages.pushes.empty());
  ExpectLiveIs(2);  // uncached pages are read from the new version
}

TEST_F(LiveTest, AcrossAnAnchorTheBlocksAreCompared) {
  // v5: step 4's content again, stored as an anchor: no delta leads from v2.
  CommitOptions o;
  o.version = 5;
  o.force_anchor = true;
  ASSERT_TRUE(series_.series().Write(4, ::testing::TempDir() + "/live-anchor").ok());
  ASSERT_TRUE(CommitDirectory(*store_, ::testing::TempDir() + "/live-anchor", o).ok());
  Mount(2);
  FakePageCache pages;
  auto r = fs_->ApplyLive(5, &pages);
  ASSERT_TRUE(r.ok()) << r.status().message();
  ExpectLiveIs(4);
  // Exactly the elements that differ: compare with a delta path 2 -> 4.
  auto fs2 = std::make_unique<Filesystem>(store_.get(), uint64_t{64} << 20);
  fs2->SetInitialLive(2);
  ASSERT_TRUE(fs2->Refresh().ok());
  auto direct = fs2->ApplyLive(4, nullptr);
  ASSERT_TRUE(direct.ok());
  EXPECT_LE(r->entries, direct->entries);
  EXPECT_GT(r->entries, 0u);
  // Across the anchor every changed block was read from both versions; along
  // the delta chain the deltas' entries were composed instead.
  EXPECT_GT(r->blocks, 0u);
  EXPECT_EQ(r->compared_blocks, r->blocks);
  EXPECT_EQ(direct->blocks, r->blocks);
  EXPECT_EQ(direct->compared_blocks, 0u);
}

TEST_F(LiveTest, ApplyingTheLiveVersionChangesNothing) {
  Mount(3);
  FakePageCache pages;
  auto r = fs_->ApplyLive(3, &pages);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->entries, 0u);
  EXPECT_TRUE(pages.pushes.empty());
}

TEST_F(LiveTest, MissingVersionAndCorruptBlobLeaveTheLiveStateAlone) {
  Mount(1);
  auto missing = fs_->ApplyLive(77, nullptr);
  EXPECT_EQ(missing.status().code(), Code::kNotFound);
  // Damage every blob v3 added.
  auto v3 = store_->GetVersion(3);
  ASSERT_TRUE(v3.ok());
  for (const BlobRef& b : (*v3)->manifest.blobs) {
    if (!b.added) continue;
    const std::string path = series_.PathOf(BlobKey(b.hash));
    auto data = test::ReadFileBytes(path);
    ASSERT_TRUE(data.ok()) << path;
    (*data)[data->size() / 2] ^= 0x5A;
    ::chmod(path.c_str(), 0644);
    ASSERT_TRUE(test::WriteFileBytes(path, *data).ok());
  }
  FakePageCache pages;
  auto r = fs_->ApplyLive(3, &pages);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kCorruption) << r.status().message();
  EXPECT_NE(r.status().message().find("v00000003"), std::string::npos) << r.status().message();
  EXPECT_TRUE(pages.pushes.empty());
  EXPECT_EQ(fs_->LiveStatus().live_version, 1u);
  EXPECT_EQ(fs_->LiveStatus().failed_applies, 2u);
  ExpectLiveIs(1);
}

TEST_F(LiveTest, ASecondApplyWhileOneRunsIsBusy) {
  Mount(0);
  std::promise<void> gate;
  FakePageCache held;
  held.gate = gate.get_future().share();
  // Opened even when an assertion below returns early, so the first apply
  // (whose future's destructor waits for it) always finishes.
  struct Open {
    std::promise<void>* gate;
    ~Open() { gate->set_value(); }
  };
  std::future<Result<dte_live_counts>> first;
  {
    Open open{&gate};
    first = std::async(std::launch::async, [&] { return fs_->ApplyLive(2, &held); });
    // Wait until the first apply holds the flag (it blocks in Resident).
    ASSERT_TRUE(WaitFor([&] { return fs_->LiveStatus().applying != 0; }))
        << "the first apply never started";
    auto second = fs_->ApplyLive(3, nullptr);
    EXPECT_EQ(second.status().code(), Code::kUnavailable);
  }
  auto r = first.get();
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(fs_->LiveStatus().live_version, 2u);
}

TEST_F(LiveTest, AnApplyWaitsForReadsOfTheOldViewOnly) {
  Mount(0);
  auto old_read = std::make_unique<Live::ReadGuard>(&fs_->live());
  ASSERT_EQ(old_read->view()->version->manifest.version, 0u);
  // The apply replaces cached pages (which a read of the old view may have
  // filled) only once no such read is in flight: its first residency read
  // comes after the old read is done. No delay decides it: an apply that did
  // not wait would read residency right after the switch, while this thread
  // still holds the old read.
  std::atomic<bool> old_read_done{false};
  std::atomic<int> residency_reads{0};
  FakePageCache pages;
  pages.on_resident = [&] {
    residency_reads++;
    EXPECT_TRUE(old_read_done.load())
        << "the apply replaced pages while a read of the old version was in flight";
  };
  auto apply = std::async(std::launch::async, [&] { return fs_->ApplyLive(2, &pages); });
  ASSERT_TRUE(WaitFor([&] { return fs_->live().View()->version->manifest.version == 2; }))
      << "the apply never switched the view";
  // Reads that start now see the new view and do not hold the apply up.
  Live::ReadGuard new_read(&fs_->live());
  EXPECT_EQ(new_read.view()->version->manifest.version, 2u);
  old_read_done = true;
  old_read.reset();
  auto r = apply.get();
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_GT(residency_reads.load(), 0);
}

TEST_F(LiveTest, ReceiversNeedAValidRegistration) {
  Mount(1);
  dte_live_register r = {};
  r.abi_version = 99;
  EXPECT_EQ(fs_->live().Register(1, 0, r).status().code(), Code::kInvalidArgument);
  r.abi_version = DTE_LIVE_ABI_VERSION;
  std::memset(r.name, 'x', sizeof r.name);  // not NUL-terminated
  EXPECT_EQ(fs_->live().Register(1, 0, r).status().code(), Code::kInvalidArgument);
  std::snprintf(r.name, sizeof r.name, "model.norm.weight");
  r.tp = 2;
  r.rank = 2;
  auto bad_rank = fs_->live().Register(1, 0, r);
  EXPECT_EQ(bad_rank.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad_rank.status().message().find("rank 2 of tp 2"), std::string::npos);
  EXPECT_EQ(fs_->live().Unregister(1, 5).code(), Code::kNotFound);
}

}  // namespace
}  // namespace dte::fs
