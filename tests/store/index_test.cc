// The RocksDB cache index: contents, atomic updates and the one-opener lock.
#include "store/index.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

using test::ScopedTempDir;

std::unique_ptr<Index> OpenOrDie(const std::string& dir) {
  auto index = Index::Open(dir);
  EXPECT_TRUE(index.ok()) << index.status().message();
  return index.ok() ? std::move(index).value() : nullptr;
}

// A manifest with the given files, each with the given tensors, one block each.
Manifest MakeManifest(uint64_t version, const std::vector<std::string>& files,
                      const std::vector<std::string>& tensors) {
  Manifest m;
  m.version = version;
  uint32_t block = 0;
  for (const auto& name : files) {
    FileEntry f;
    f.name = name;
    f.safetensors = true;
    for (const auto& t : tensors) {
      TensorEntry e;
      e.name = t;
      e.first_block = block;
      e.blocks = 1 + block % 3;
      block += e.blocks;
      f.tensors.push_back(e);
    }
    m.files.push_back(f);
  }
  return m;
}

Index::Entry MakeEntry(uint64_t version, const std::string& tag) {
  return Index::Entry{ManifestKey(version, 0), "manifest " + tag + std::string(1, '\0') + "end",
                      "table " + tag + std::string("\0\xff", 2), ""};
}

void ExpectEntry(Index& index, uint64_t version, const Index::Entry& want) {
  auto got = index.GetVersion(version);
  ASSERT_TRUE(got.ok()) << got.status().message();
  ASSERT_TRUE(got->has_value()) << VersionName(version) << " missing";
  EXPECT_EQ((*got)->manifest_key, want.manifest_key);
  EXPECT_EQ((*got)->manifest, want.manifest);
  EXPECT_EQ((*got)->block_table, want.block_table);
}

bool Absent(Index& index, uint64_t version) {
  auto got = index.GetVersion(version);
  EXPECT_TRUE(got.ok()) << got.status().message();
  return got.ok() && !got->has_value();
}

std::optional<std::pair<uint32_t, uint32_t>> Find(Index& index, uint64_t version,
                                                  const std::string& file,
                                                  const std::string& tensor) {
  auto r = index.FindTensor(version, file, tensor);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? *r : std::nullopt;
}

TEST(Index, PutGetListAndDeleteVersions) {
  ScopedTempDir dir;
  auto index = OpenOrDie(dir.path() + "/index");
  ASSERT_NE(index, nullptr);
  const std::vector<uint64_t> versions = {0, 1, 255, 256, 65536, uint64_t{1} << 40};
  for (uint64_t v : versions) {
    ASSERT_TRUE(
        index
            ->PutVersion(MakeManifest(v, {"m.safetensors"}, {"w"}), MakeEntry(v, std::to_string(v)))
            .ok());
  }
  auto listed = index->ListVersions();
  ASSERT_TRUE(listed.ok()) << listed.status().message();
  std::vector<uint64_t> keys;
  for (const auto& [v, key] : *listed) {
    keys.push_back(v);
    EXPECT_EQ(key, ManifestKey(v, 0));
  }
  EXPECT_EQ(keys, versions);
  for (uint64_t v : versions) ExpectEntry(*index, v, MakeEntry(v, std::to_string(v)));
  EXPECT_TRUE(Absent(*index, 2));

  ASSERT_TRUE(index->DeleteVersion(255).ok());
  EXPECT_TRUE(Absent(*index, 255));
  EXPECT_FALSE(Find(*index, 255, "m.safetensors", "w").has_value());
  // The neighbours on either side are untouched.
  ExpectEntry(*index, 1, MakeEntry(1, "1"));
  ExpectEntry(*index, 256, MakeEntry(256, "256"));
  EXPECT_TRUE(Find(*index, 1, "m.safetensors", "w").has_value());
  EXPECT_TRUE(Find(*index, 256, "m.safetensors", "w").has_value());
  EXPECT_EQ(index->ListVersions()->count(255), 0u);
  EXPECT_EQ(index->ListVersions()->size(), versions.size() - 1);
  EXPECT_TRUE(index->DeleteVersion(12345).ok()) << "deleting a missing version is OK";
  EXPECT_TRUE(index->Close().ok());
}

TEST(Index, FindTensorLocatesEachTensorOfEachFile) {
  ScopedTempDir dir;
  auto index = OpenOrDie(dir.path());
  ASSERT_NE(index, nullptr);
  Manifest m = MakeManifest(3, {"a.safetensors", "b.safetensors"}, {"x", "x.y", "xy"});
  ASSERT_TRUE(index->PutVersion(m, MakeEntry(3, "3")).ok());
  for (const auto& f : m.files) {
    for (const auto& t : f.tensors) {
      auto found = Find(*index, 3, f.name, t.name);
      ASSERT_TRUE(found.has_value()) << f.name << " " << t.name;
      EXPECT_EQ(found->first, t.first_block);
      EXPECT_EQ(found->second, t.blocks);
    }
  }
  EXPECT_FALSE(Find(*index, 3, "a.safetensors", "z").has_value());
  EXPECT_FALSE(Find(*index, 3, "a.safetensor", "x").has_value());
  EXPECT_FALSE(Find(*index, 3, "a.safetensors", "").has_value());
  EXPECT_FALSE(Find(*index, 2, "a.safetensors", "x").has_value());
  EXPECT_FALSE(Find(*index, 4, "a.safetensors", "x").has_value());
}

TEST(Index, PutVersionReplacesEverythingOfThatVersion) {
  ScopedTempDir dir;
  auto index = OpenOrDie(dir.path());
  ASSERT_NE(index, nullptr);
  ASSERT_TRUE(
      index->PutVersion(MakeManifest(4, {"old.safetensors"}, {"a", "b"}), MakeEntry(4, "old"))
          .ok());
  Index::Entry rebased{ManifestKey(4, 1), "new manifest", "new table", ""};
  ASSERT_TRUE(index->PutVersion(MakeManifest(4, {"new.safetensors"}, {"c"}), rebased).ok());
  ExpectEntry(*index, 4, rebased);
  EXPECT_FALSE(Find(*index, 4, "old.safetensors", "a").has_value()) << "stale tensor entry";
  EXPECT_TRUE(Find(*index, 4, "new.safetensors", "c").has_value());
  EXPECT_EQ(index->ListVersions()->at(4), ManifestKey(4, 1));
}

TEST(Index, CacheEntriesAreIndependentOfVersions) {
  ScopedTempDir dir;
  auto index = OpenOrDie(dir.path());
  ASSERT_NE(index, nullptr);
  EXPECT_FALSE(index->GetCacheEntry("blobs/ab/x:0")->has_value());
  ASSERT_TRUE(index->PutCacheEntry("blobs/ab/x:0", std::string("v\0al", 4)).ok());
  ASSERT_TRUE(index->PutCacheEntry("v", "looks like a version tag").ok());
  EXPECT_EQ(index->GetCacheEntry("blobs/ab/x:0")->value(), std::string("v\0al", 4));
  ASSERT_TRUE(index->PutCacheEntry("blobs/ab/x:0", "second").ok());
  EXPECT_EQ(index->GetCacheEntry("blobs/ab/x:0")->value(), "second");
  ASSERT_TRUE(index->PutVersion(MakeManifest(1, {"m.safetensors"}, {"w"}), MakeEntry(1, "1")).ok());
  ASSERT_TRUE(index->DeleteVersion(1).ok());
  EXPECT_EQ(index->GetCacheEntry("v")->value(), "looks like a version tag");
  EXPECT_EQ(index->ListVersions()->size(), 0u) << "a cache entry was listed as a version";
}

TEST(Index, ClearDropsVersionsTensorsAndCacheEntries) {
  ScopedTempDir dir;
  auto index = OpenOrDie(dir.path());
  ASSERT_NE(index, nullptr);
  for (uint64_t v : {uint64_t{0}, uint64_t{9}, UINT64_MAX - 1}) {
    ASSERT_TRUE(
        index->PutVersion(MakeManifest(v, {"m.safetensors"}, {"w"}), MakeEntry(v, "x")).ok());
  }
  ASSERT_TRUE(index->PutCacheEntry("k", "v").ok());
  ASSERT_TRUE(index->Clear().ok());
  EXPECT_TRUE(index->ListVersions()->empty());
  EXPECT_TRUE(Absent(*index, 9));
  EXPECT_TRUE(Absent(*index, UINT64_MAX - 1));
  EXPECT_FALSE(Find(*index, 9, "m.safetensors", "w").has_value());
  EXPECT_FALSE(index->GetCacheEntry("k")->has_value());
  ASSERT_TRUE(index->PutVersion(MakeManifest(9, {"m.safetensors"}, {"w"}), MakeEntry(9, "y")).ok());
  ExpectEntry(*index, 9, MakeEntry(9, "y"));
}

TEST(Index, ReopenAfterCloseKeepsData) {
  ScopedTempDir dir;
  {
    auto index = OpenOrDie(dir.path());
    ASSERT_NE(index, nullptr);
    ASSERT_TRUE(
        index->PutVersion(MakeManifest(6, {"m.safetensors"}, {"w"}), MakeEntry(6, "six")).ok());
    ASSERT_TRUE(index->PutCacheEntry("c", "kept").ok());
    ASSERT_TRUE(index->Close().ok());
    EXPECT_TRUE(index->Close().ok()) << "a second Close is a no-op";
  }
  auto index = OpenOrDie(dir.path());
  ASSERT_NE(index, nullptr);
  ExpectEntry(*index, 6, MakeEntry(6, "six"));
  EXPECT_TRUE(Find(*index, 6, "m.safetensors", "w").has_value());
  EXPECT_EQ(index->GetCacheEntry("c")->value(), "kept");
}

// A process per version, as dtectl commits are: each open flushes what the
// last one wrote into new table files, and the files stay few (merged on
// close) instead of growing by one per family per process.
TEST(Index, TableFilesStayFewAcrossManyShortLivedOpens) {
  ScopedTempDir dir;
  constexpr uint64_t kOpens = 80;
  for (uint64_t v = 0; v < kOpens; ++v) {
    auto index = OpenOrDie(dir.path());
    ASSERT_NE(index, nullptr);
    ASSERT_TRUE(
        index
            ->PutVersion(MakeManifest(v, {"m.safetensors"}, {"w"}), MakeEntry(v, std::to_string(v)))
            .ok());
    ASSERT_TRUE(index->Close().ok());
  }
  size_t tables = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    tables += e.path().extension() == ".sst";
  }
  // Five families get entries: at most a few level-0 files and a short
  // tail of small level-1 files each (without the merge: one per family
  // per open, 400).
  EXPECT_LE(tables, 5u * 12) << tables << " table files after " << kOpens << " opens";
  auto index = OpenOrDie(dir.path());
  ASSERT_NE(index, nullptr);
  EXPECT_EQ(index->ListVersions()->size(), kOpens);
  for (uint64_t v : {uint64_t{0}, kOpens / 2, kOpens - 1}) {
    ExpectEntry(*index, v, MakeEntry(v, std::to_string(v)));
  }
}

// Readers racing a writer see each version whole or not at all: the manifest
// key, manifest and block table always come from the same update.
TEST(Index, ConcurrentReaderNeverSeesHalfAVersion) {
  ScopedTempDir dir;
  auto index = OpenOrDie(dir.path());
  ASSERT_NE(index, nullptr);
  std::atomic<bool> done{false};
  std::atomic<uint64_t> seen{0}, torn{0};
  std::thread reader([&] {
    while (!done.load()) {
      auto got = index->GetVersion(7);
      if (!got.ok() || !got->has_value()) continue;
      seen++;
      const std::string key = (*got)->manifest_key;
      const std::string tag = key.substr(key.find(".r") + 2);  // the writer's generation
      if ((*got)->manifest != "manifest " + tag || (*got)->block_table != "table " + tag) torn++;
    }
  });
  for (uint32_t gen = 1; gen <= 3000; ++gen) {
    std::string tag = std::to_string(gen) + ".json";
    Index::Entry e{ManifestKey(7, gen), "manifest " + tag, "table " + tag, ""};
    ASSERT_TRUE(index->PutVersion(MakeManifest(7, {"m.safetensors"}, {"w"}), e).ok());
    if (gen % 5 == 0) {
      ASSERT_TRUE(index->DeleteVersion(7).ok());
    }
  }
  done = true;
  reader.join();
  EXPECT_EQ(torn.load(), 0u);
  EXPECT_GT(seen.load(), 0u) << "the reader never overlapped the writer";
}

void ExpectBusyNaming(const Result<std::unique_ptr<Index>>& r, const std::string& dir) {
  ASSERT_FALSE(r.ok()) << "a second opener got the index";
  EXPECT_EQ(r.status().code(), Code::kUnavailable) << r.status().message();
  EXPECT_NE(r.status().message().find(dir), std::string::npos) << r.status().message();
}

TEST(Index, SecondOpenInProcessIsBusyNamingTheDir) {
  ScopedTempDir dir;
  auto first = OpenOrDie(dir.path());
  ASSERT_NE(first, nullptr);
  ExpectBusyNaming(Index::Open(dir.path()), dir.path());
  ASSERT_TRUE(first->Close().ok());
  EXPECT_TRUE(Index::Open(dir.path()).ok()) << "the lock outlived Close";
}

// Another process holds the index: Open fails fast instead of waiting.
TEST(Index, OpenWhileAnotherProcessHoldsItIsBusy) {
  ScopedTempDir dir;
  int ready[2], release[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(release), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::alarm(60);  // a hang fails the test instead of stalling the suite
    ::close(ready[0]);
    ::close(release[1]);  // else the read below never sees the parent's close
    auto held = Index::Open(dir.path());
    char c = held.ok() ? 'r' : 'e';
    if (::write(ready[1], &c, 1) != 1) ::_exit(2);
    ssize_t n = ::read(release[0], &c, 1);  // until the parent says so (or dies)
    (void)n;
    ::_exit(held.ok() ? 0 : 1);
  }
  ::close(ready[1]);
  ::close(release[0]);
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  EXPECT_EQ(c, 'r') << "the child could not open the index";
  const auto start = std::chrono::steady_clock::now();
  ExpectBusyNaming(Index::Open(dir.path()), dir.path());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << "not fail-fast";
  ::close(release[1]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ::close(ready[0]);
  EXPECT_TRUE(Index::Open(dir.path()).ok()) << "the lock outlived the holder";
}

TEST(Index, OpenInForkedChildWhileParentHoldsItIsBusy) {
  ScopedTempDir dir;
  // Fork before the parent opens anything: a child forked from a process
  // whose RocksDB threads hold locks can block forever inside Open.
  int opened[2];
  ASSERT_EQ(::pipe(opened), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::alarm(60);  // a hang fails the test instead of stalling the suite
    ::close(opened[1]);
    char c = 0;
    if (::read(opened[0], &c, 1) != 1 || c != 'o') ::_exit(2);
    auto r = Index::Open(dir.path());
    bool busy = !r.ok() && r.status().code() == Code::kUnavailable &&
                r.status().message().find(dir.path()) != std::string::npos;
    ::_exit(busy ? 0 : 1);
  }
  ::close(opened[0]);
  auto held = OpenOrDie(dir.path());
  const char c = held != nullptr ? 'o' : 'e';
  ASSERT_EQ(::write(opened[1], &c, 1), 1);
  ::close(opened[1]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_NE(held, nullptr);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child was not told Busy naming " << dir.path();
}

// Other open failures are reported as they are, even when the path happens
// to contain "lock".
TEST(Index, OpenFailureUnderAPathSayingLockIsNotBusy) {
  ScopedTempDir dir;
  const std::string file = dir.path() + "/blocked";
  FILE* f = std::fopen(file.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  for (const std::string& path : {file, file + "/index"}) {
    auto r = Index::Open(path);
    ASSERT_FALSE(r.ok()) << path;
    EXPECT_NE(r.status().code(), Code::kUnavailable) << r.status().message();
    EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().message();
  }
}

TEST(Index, TheLargestVersionNumberIsStoredAndDropped) {
  ScopedTempDir dir;
  auto index = OpenOrDie(dir.path());
  ASSERT_NE(index, nullptr);
  for (uint64_t v : {UINT64_MAX - 1, UINT64_MAX}) {
    ASSERT_TRUE(
        index->PutVersion(MakeManifest(v, {"m.safetensors"}, {"w"}), MakeEntry(v, "x")).ok())
        << v;
  }
  ExpectEntry(*index, UINT64_MAX, MakeEntry(UINT64_MAX, "x"));
  EXPECT_TRUE(Find(*index, UINT64_MAX, "m.safetensors", "w").has_value());
  ASSERT_TRUE(index->PutCacheEntry("after", "tags").ok());
  Status s = index->DeleteVersion(UINT64_MAX);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_TRUE(Absent(*index, UINT64_MAX));
  EXPECT_FALSE(Find(*index, UINT64_MAX, "m.safetensors", "w").has_value());
  ExpectEntry(*index, UINT64_MAX - 1, MakeEntry(UINT64_MAX - 1, "x"));
  EXPECT_TRUE(Find(*index, UINT64_MAX - 1, "m.safetensors", "w").has_value());
  EXPECT_EQ(index->GetCacheEntry("after")->value_or(""), "tags");
}

}  // namespace
}  // namespace dte
