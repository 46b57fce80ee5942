// dtefs under load: reader threads do what FUSE workers do (lookups,
// listings, opens, reads at random offsets, status) while a publisher
// commits new versions, a poller refreshes, and gc removes old versions.
// Every byte read is checked against the committed checkpoint, and every
// inode number against every other sighting of the same node. Written for
// ThreadSanitizer: CI runs this suite in a -fsanitize=thread build.
#include <fcntl.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fs/filesystem.h"
#include "store/ops/gc.h"
#include "tests/fs/fs_fixture.h"
#include "tests/testutil/wait.h"

namespace dte::fs {
namespace {

constexpr int kReaders = 8;
constexpr uint64_t kMinOpsPerReader = 300;
// Requests the readers make between two writes of the publisher, whatever
// their relative speed (ThreadSanitizer slows the readers most).
constexpr uint64_t kRequestsPerWrite = 400;

// What the threads share. The publisher announces a gc before it starts, so
// a reader can tell an expected NotFound (its version was removed, or it
// holds a revision gc replaced, or gc ran since the Filesystem last caught
// up) from a wrong one.
struct World {
  explicit World(uint64_t steps) : env(steps), store(env.Open()) {}

  test::SeriesStore env;
  std::unique_ptr<Store> store;  // the Filesystem's
  std::unique_ptr<Filesystem> fs;
  std::atomic<bool> stop{false};

  std::atomic<uint64_t> oldest_kept{0};  // versions below it are removed
  std::atomic<uint64_t> gc_begun{0};     // gc passes started
  std::atomic<uint64_t> gc_done{0};      // gc passes finished
  std::atomic<uint64_t> caught_up{0};    // gc passes done before the last Refresh began

  std::atomic<uint64_t> ops{0}, bytes_checked{0}, expected_not_found{0};

  // Waits until the readers have made kRequestsPerWrite more requests.
  void Pace() {
    const uint64_t until = ops.load() + kRequestsPerWrite;
    if (!test::WaitFor([&] { return ops.load() >= until; })) {
      Fail("the readers made no " + std::to_string(kRequestsPerWrite) + " requests in 30 s");
    }
  }

  std::mutex mu;
  std::map<uint64_t, uint32_t> revision;                      // newest revisions after a gc
  std::map<std::pair<uint64_t, std::string>, uint64_t> ino;   // (version, name) -> inode
  std::map<uint64_t, std::pair<uint64_t, std::string>> node;  // inode -> (version, name)
  std::vector<std::string> failures;

  void Fail(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    if (failures.size() < 20) failures.push_back(what);
  }
  uint32_t Revision(uint64_t version) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = revision.find(version);
    return it == revision.end() ? 0 : it->second;
  }
  // One inode per node, one node per inode, for the life of the Filesystem.
  void Saw(uint64_t version, const std::string& name, uint64_t number) {
    std::lock_guard<std::mutex> lock(mu);
    const auto key = std::make_pair(version, name);
    auto [a, new_key] = ino.try_emplace(key, number);
    auto [b, new_ino] = node.try_emplace(number, key);
    if (a->second != number || b->second != key) {
      if (failures.size() < 20) {
        failures.push_back(VersionName(version) + "/" + name + " has inode " +
                           std::to_string(number) + ", seen before as " +
                           std::to_string(a->second) + " (that inode named " +
                           VersionName(b->second.first) + "/" + b->second.second + ")");
      }
    }
  }
};

// One FUSE worker's worth of random requests.
class Reader {
 public:
  Reader(World* w, uint64_t seed) : w_(w), rng_(seed) {}

  void Run() {
    uint64_t n = 0;
    while (!w_->stop.load() || n < kMinOpsPerReader) {
      epoch_ = w_->caught_up.load();
      switch (rng_.Below(8)) {
        case 0:
          ListRoot();
          break;
        case 1:
          ListVersion();
          break;
        case 2:
        case 3:
          OpenAndRead();
          break;
        case 4:
        case 5:
          ReadHeld();
          break;
        case 6:
          Latest();
          break;
        default:
          StatusAndAttrs();
      }
      ++n;
      w_->ops++;
    }
  }

 private:
  struct Held {
    std::unique_ptr<OpenFile> file;
    uint64_t version;
    std::string name;
  };

  // A failure is expected only as NotFound, and only for a version that gc
  // removed, a revision gc replaced, or while the Filesystem may not have
  // caught up with a gc.
  //
  // Known issue: the block cache keys blocks by version number, not
  // revision, so a read of a rebased version's new revision can share the
  // failing load of a file still open at the old one (see
  // ReadPathTest.ReaderOfTheCurrentRevisionGetsNoErrorOfASupersededOne).
  // Until that is fixed, NotFound on any revision of a rebased version is
  // let through here; the test named above fails instead.
  void Check(const Status& s, uint64_t version, const std::string& what,
             const OpenFile* held = nullptr) {
    if (s.ok()) return;
    const uint32_t revision = w_->Revision(version);
    const bool superseded = held && held->version->manifest.revision < revision;
    const bool rebased = revision > 0;  // the known issue; else `superseded` suffices
    const bool expected =
        s.code() == Code::kNotFound &&
        (version < w_->oldest_kept.load() || w_->gc_begun.load() > epoch_ || superseded || rebased);
    if (expected) {
      w_->expected_not_found++;
      return;
    }
    w_->Fail(VersionName(version) + "/" + what + ": " + s.message() + " (oldest kept " +
             std::to_string(w_->oldest_kept.load()) + ", gc passes " +
             std::to_string(w_->gc_begun.load()) + ", caught up with " + std::to_string(epoch_) +
             ", revision held " +
             (held ? std::to_string(held->version->manifest.revision) : std::string("-")) +
             ", in store " + std::to_string(w_->Revision(version)) + ")");
  }

  std::optional<uint64_t> PickVersion() {
    if (listed_.empty()) ListRoot();
    if (listed_.empty()) return std::nullopt;
    return listed_[rng_.Below(listed_.size())];
  }

  void ListRoot() {
    auto root = w_->fs->ReadDir(kRootIno);
    if (!root.ok()) return w_->Fail("ReadDir(/): " + root.status().message());
    listed_.clear();
    for (const auto& e : *root) {
      if (e.name == "latest" || e.name == "live" || e.name == ".dte") continue;
      listed_.push_back(std::stoull(e.name.substr(1)));
      if (listed_.size() > 1 && listed_.back() <= listed_[listed_.size() - 2]) {
        w_->Fail("root listing out of order at " + e.name);
      }
      w_->Saw(listed_.back(), "", e.attr.ino);
    }
    if (root->size() != listed_.size() + 3 || root->back().name != ".dte" ||
        (*root)[listed_.size()].name != "latest" || (*root)[listed_.size() + 1].name != "live") {
      w_->Fail("root listing does not end with latest, live, .dte");
    }
  }

  void ListVersion() {
    auto v = PickVersion();
    if (!v) return;
    auto dir = w_->fs->Lookup(kRootIno, VersionName(*v));
    if (!dir.ok()) return Check(dir.status(), *v, "lookup");
    w_->Saw(*v, "", dir->ino);
    auto entries = w_->fs->ReadDir(dir->ino);
    if (!entries.ok()) return Check(entries.status(), *v, "readdir");
    const auto& files = w_->env.series().files(*v);
    auto want = files.begin();
    for (const auto& e : *entries) {
      if (want == files.end() || e.name != want->first || e.attr.size != want->second.size()) {
        return w_->Fail(VersionName(*v) + " lists " + e.name + " of " +
                        std::to_string(e.attr.size) + " bytes");
      }
      w_->Saw(*v, e.name, e.attr.ino);
      ++want;
    }
    if (want != files.end()) w_->Fail(VersionName(*v) + " does not list " + want->first);
  }

  void OpenAndRead() {
    auto v = PickVersion();
    if (!v) return;
    const auto& files = w_->env.series().files(*v);
    auto pick = std::next(files.begin(), static_cast<long>(rng_.Below(files.size())));
    const std::string& name = pick->first;
    auto dir = w_->fs->Lookup(kRootIno, VersionName(*v));
    if (!dir.ok()) return Check(dir.status(), *v, "lookup");
    auto attr = w_->fs->Lookup(dir->ino, name);
    if (!attr.ok()) return Check(attr.status(), *v, name + " lookup");
    w_->Saw(*v, name, attr->ino);
    auto f = w_->fs->Open(attr->ino, O_RDONLY);
    if (!f.ok()) return Check(f.status(), *v, name + " open");
    Held held{std::move(f).value(), *v, name};
    for (uint64_t i = 0, n = 1 + rng_.Below(3); i < n; ++i) ReadRandom(held);
    if (rng_.Below(2) == 0) {
      held_.push_back(std::move(held));
      if (held_.size() > 6) held_.pop_front();
    }
  }

  void ReadHeld() {
    if (held_.empty()) return OpenAndRead();
    ReadRandom(held_[rng_.Below(held_.size())]);
  }

  // A random range, half the time starting near a header, tensor or block
  // boundary, of one byte to a little over a block.
  void ReadRandom(const Held& h) {
    const FileEntry& f = h.file->version->manifest.files[h.file->file_index];
    uint64_t off = rng_.Below(f.size + 1);
    if (f.safetensors && rng_.Below(2) == 0) {
      const TensorEntry& t = f.tensors[rng_.Below(f.tensors.size())];
      const uint64_t bb = h.file->version->manifest.block_bytes;
      const uint64_t edge = f.header_size + t.begin + bb * rng_.Below(t.bytes() / bb + 1);
      off = std::min(f.size, edge - std::min<uint64_t>(edge, rng_.Below(8)));
    }
    const uint64_t caps[] = {1, 100, 64 << 10, 300 << 10};
    const uint64_t len = 1 + rng_.Below(caps[rng_.Below(4)]);
    std::string got;
    Status s = w_->fs->Read(*h.file, off, len, &got);
    if (!s.ok()) return Check(s, h.version, h.name + " read", h.file.get());
    const std::string& want = w_->env.series().files(h.version).at(h.name);
    if (got != want.substr(std::min<uint64_t>(off, want.size()), len)) {
      return w_->Fail(VersionName(h.version) + "/" + h.name + ": wrong bytes in " +
                      std::to_string(off) + "+" + std::to_string(len));
    }
    w_->bytes_checked += got.size();
  }

  // `latest` never moves back: commits only add newer versions and gc
  // keeps the newest.
  void Latest() {
    auto target = w_->fs->ReadLink(kLatestIno);
    if (!target.ok()) return w_->Fail("readlink latest: " + target.status().message());
    const uint64_t v = std::stoull(target->substr(1));
    if (v < latest_) w_->Fail("latest went back from " + VersionName(latest_) + " to " + *target);
    latest_ = v;
    auto attr = w_->fs->Lookup(kRootIno, "latest");
    if (!attr.ok() || attr->ino != kLatestIno || attr->type != NodeType::kSymlink) {
      w_->Fail("lookup latest: " + attr.status().message());
    }
  }

  void StatusAndAttrs() {
    if (rng_.Below(4) == 0) {
      auto j = nlohmann::json::parse(w_->fs->StatusJson(), nullptr, false);
      if (j.is_discarded() || !j["versions"].is_array()) w_->Fail(".dte/status is not JSON");
      return;
    }
    uint64_t number = 0, version = 0;
    {
      std::lock_guard<std::mutex> lock(w_->mu);
      if (w_->node.empty()) return;
      auto it = std::next(w_->node.begin(), static_cast<long>(rng_.Below(w_->node.size())));
      number = it->first;
      version = it->second.first;
    }
    auto attr = w_->fs->GetAttr(number);
    if (!attr.ok()) return Check(attr.status(), version, "getattr");
    if (attr->ino != number) w_->Fail("GetAttr(" + std::to_string(number) + ") names another");
  }

  World* const w_;
  test::Rng rng_;
  uint64_t epoch_ = 0;
  uint64_t latest_ = 0;
  std::vector<uint64_t> listed_;  // versions of the last root listing
  std::deque<Held> held_;         // open files, some kept across gc
};

class ConcurrencyTest : public ::testing::Test {
 protected:
  // Commits versions [0, first) up front, starts the readers and a poller
  // calling Refresh every millisecond, then runs `publish` (the writer) and
  // stops everything once the Filesystem has caught up.
  void Run(World& w, uint64_t first, const std::function<void()>& publish) {
    ASSERT_NE(w.store, nullptr);
    for (uint64_t v = 0; v < first; ++v) {
      Status s = w.env.Commit(*w.store, v);
      ASSERT_TRUE(s.ok()) << s.message();
    }
    w.fs = std::make_unique<Filesystem>(w.store.get(), uint64_t{2} << 20);  // a few blocks
    ASSERT_TRUE(w.fs->Refresh().ok());
    std::atomic<bool> published{false};
    std::thread poller([&] {
      for (bool last = false; !last;) {
        last = published.load();
        const uint64_t done = w.gc_done.load();
        Status s = w.fs->Refresh();
        if (!s.ok()) w.Fail("Refresh: " + s.message());
        w.caught_up = done;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      w.stop = true;
    });
    std::vector<std::thread> readers;
    for (int r = 0; r < kReaders; ++r) {
      readers.emplace_back([&w, r] { Reader(&w, 1000 + r).Run(); });
    }
    publish();
    published = true;
    poller.join();
    for (auto& t : readers) t.join();
    std::cerr << "[ stats    ] " << w.ops.load() << " requests, " << w.bytes_checked.load()
              << " bytes checked, " << w.expected_not_found.load() << " expected NotFound\n";
    for (const auto& f : w.failures) ADD_FAILURE() << f;
    EXPECT_GE(w.ops.load(), kReaders * kMinOpsPerReader);
    EXPECT_GT(w.bytes_checked.load(), 0u);
  }

  // With everything quiet: the root lists exactly versions [from, to), and
  // each reads back whole as committed.
  void ExpectFinalState(World& w, uint64_t from, uint64_t to) {
    auto root = w.fs->ReadDir(kRootIno);
    ASSERT_TRUE(root.ok()) << root.status().message();
    std::vector<std::string> want;
    for (uint64_t v = from; v < to; ++v) want.push_back(VersionName(v));
    want.push_back("latest");
    want.push_back("live");
    want.push_back(".dte");
    std::vector<std::string> names;
    for (const auto& e : *root) names.push_back(e.name);
    EXPECT_EQ(names, want);
    for (uint64_t v = from; v < to; ++v) {
      for (const auto& [name, bytes] : w.env.series().files(v)) {
        auto f = w.fs->Open(test::FileIno(*w.fs, v, name), O_RDONLY);
        ASSERT_TRUE(f.ok()) << f.status().message();
        auto all = test::ReadRange(*w.fs, **f, 0, bytes.size());
        ASSERT_TRUE(all.ok()) << VersionName(v) << "/" << name << ": " << all.status().message();
        EXPECT_TRUE(*all == bytes) << VersionName(v) << "/" << name;
      }
    }
  }
};

// The publisher commits through the Filesystem's own Store handle (as a
// trainer committing on the serving host would). Nothing may fail.
TEST_F(ConcurrencyTest, ReadersSeeCommittedBytesWhileVersionsAreAdded) {
  constexpr uint64_t kFirst = 2, kSteps = 16;
  World w(kSteps);
  Run(w, kFirst, [&] {
    for (uint64_t v = kFirst; v < kSteps; ++v) {
      w.Pace();
      Status s = w.env.Commit(*w.store, v);
      if (!s.ok()) w.Fail("commit: " + s.message());
    }
  });
  EXPECT_EQ(w.expected_not_found.load(), 0u);
  ExpectFinalState(w, 0, kSteps);
}

// The publisher commits and runs gc (keep the last 3, no grace period)
// through its own Store handle, as dtectl in another process does. Commits
// and gc take turns, so gc never sweeps the blobs of a commit in flight.
TEST_F(ConcurrencyTest, ReadersSeeCommittedBytesOrNotFoundWhileGcRemovesVersions) {
  constexpr uint64_t kFirst = 2, kSteps = 23, kKeep = 3;
  World w(kSteps);
  auto writer = w.env.Open();
  ASSERT_NE(writer, nullptr);
  Run(w, kFirst, [&] {
    for (uint64_t v = kFirst; v < kSteps; ++v) {
      w.Pace();
      Status s = w.env.Commit(*writer, v);
      if (!s.ok()) return w.Fail("commit: " + s.message());
      if ((v + 1) % 3 != 0) continue;
      w.Pace();
      w.oldest_kept = v + 1 - kKeep;
      w.gc_begun++;
      GcOptions o;
      o.keep_last = kKeep;
      o.grace_seconds = 0;
      auto r = CollectGarbage(*writer, o, {});
      if (!r.ok()) return w.Fail("gc: " + r.status().message());
      auto listed = writer->ListVersions();
      if (!listed.ok()) return w.Fail("list: " + listed.status().message());
      {
        std::lock_guard<std::mutex> lock(w.mu);
        for (const auto& [version, key] : *listed) {
          w.revision[version] = ParseManifestKey(key)->second;
        }
      }
      w.gc_done++;
    }
  });
  ExpectFinalState(w, w.oldest_kept.load(), kSteps);
}

}  // namespace
}  // namespace dte::fs
