// LocalStore behaviour beyond the shared contract: the on-disk layout, crash
// safety mechanics, multi-process races and the descriptor cache.
#include "store/local_store.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/testutil/memory_store.h"

namespace dte {
namespace {

namespace fs = std::filesystem;

std::unique_ptr<LocalStore> OpenOrDie(const std::string& root, size_t max_open_fds = 64) {
  LocalStoreOptions options;
  options.max_open_fds = max_open_fds;
  auto store = LocalStore::Open(root, options);
  EXPECT_TRUE(store.ok()) << store.status().ToString();
  return store.ok() ? std::move(*store) : nullptr;
}

std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename());
  return names;
}

void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary) << data;
}

TEST(ObjectKey, AcceptsTheStoreLayout) {
  for (const char* key : {"blobs/3f/3f2a9c", "manifests/v00000001.json", "a", "A-Z_0.9", ".hidden",
                          "x/y/z/w", "v..1"}) {
    EXPECT_TRUE(ValidateObjectKey(key).ok()) << key;
  }
  for (const char* prefix : {"", "blobs/", "blobs/3", "manifests/v0000", "a/."}) {
    EXPECT_TRUE(ValidateObjectKeyPrefix(prefix).ok()) << prefix;
  }
}

TEST(ObjectKey, RejectsTraversalAndOddBytes) {
  for (const std::string key : {"../x", "a//b", "/abs", "a/./b", "x\\y", "a/..", "é", "a\n", "."}) {
    Status s = ValidateObjectKey(key);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << key;
  }
  EXPECT_FALSE(ValidateObjectKey(std::string("a\0b", 3)).ok());
  EXPECT_FALSE(ValidateObjectKey(std::string(1025, 'a')).ok());
  EXPECT_FALSE(ValidateObjectKeyPrefix("a/../").ok());
}

TEST(LocalStore, ObjectsAreFilesUnderTheRootAndNoTempFilesRemain) {
  test::ScopedTempDir dir;
  auto store = OpenOrDie(dir.path());
  ASSERT_TRUE(store->Put("blobs/ab/cdef", "payload").ok());
  ASSERT_TRUE(store->CreateExclusive("manifests/v00000000.json", "{}").ok());
  EXPECT_EQ(store->CreateExclusive("manifests/v00000000.json", "{}").code(), Code::kAlreadyExists);
  std::ifstream in(dir.path() + "/blobs/ab/cdef");
  std::string on_disk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(on_disk, "payload");
  EXPECT_TRUE(fs::is_regular_file(dir.path() + "/manifests/v00000000.json"));
  EXPECT_TRUE(FilesIn(dir.path() + "/tmp").empty());
}

TEST(LocalStore, WritesRecreateAMissingTmpDirectory) {
  test::ScopedTempDir dir;
  auto store = OpenOrDie(dir.path());
  fs::remove_all(dir.path() + "/tmp");
  EXPECT_TRUE(store->Put("blobs/a", "x").ok());
  fs::remove_all(dir.path() + "/tmp");
  EXPECT_TRUE(store->CreateExclusive("manifests/v1", "x").ok());
  fs::remove_all(dir.path() + "/tmp");
  auto path = store->NewTempPath();
  ASSERT_TRUE(path.ok());
  EXPECT_TRUE(fs::is_directory(dir.path() + "/tmp"));
}

TEST(LocalStore, FailedPutLeavesNoTempFile) {
  test::ScopedTempDir dir;
  auto store = OpenOrDie(dir.path());
  ASSERT_TRUE(store->Put("a", "file").ok());
  Status s = store->Put("a/b", "under a file");  // "a" is not a directory
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("a/b"), std::string::npos) << s.message();
  EXPECT_FALSE(store->CreateExclusive("a/c", "x").ok());
  EXPECT_TRUE(FilesIn(dir.path() + "/tmp").empty());
}

// A child's exit code: 10 + its index if it won, 1 if it lost, 2 on other errors.
[[noreturn]] void RaceToCreate(const std::string& root, const std::string& key, int index,
                               int go_fd) {
  ::alarm(60);  // a hang fails the test instead of stalling the suite
  auto store = LocalStore::Open(root);
  char c;
  while (::read(go_fd, &c, 1) < 0 && errno == EINTR) {
  }
  if (!store.ok()) ::_exit(3);
  Status s = (*store)->CreateExclusive(key, std::string(1 << 16, static_cast<char>('a' + index)));
  ::_exit(s.ok() ? 10 + index : s.code() == Code::kAlreadyExists ? 1 : 2);
}

TEST(LocalStore, CreateExclusiveHasOneWinnerAcrossProcesses) {
  test::ScopedTempDir dir;
  constexpr int kProcs = 8;
  for (int round = 0; round < 10; ++round) {
    const std::string key = "manifests/v" + std::to_string(round) + ".json";
    int go[2];
    ASSERT_EQ(::pipe(go), 0);
    std::vector<pid_t> children;
    for (int i = 0; i < kProcs; ++i) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::close(go[1]);
        RaceToCreate(dir.path(), key, i, go[0]);
      }
      ASSERT_GT(pid, 0);
      children.push_back(pid);
    }
    ::close(go[0]);
    ::close(go[1]);  // every child's read returns at once
    int winner = -1, losers = 0;
    for (pid_t pid : children) {
      int status = 0;
      ASSERT_EQ(::waitpid(pid, &status, 0), pid);
      ASSERT_TRUE(WIFEXITED(status));
      const int code = WEXITSTATUS(status);
      if (code >= 10) {
        EXPECT_EQ(winner, -1) << "two winners in round " << round;
        winner = code - 10;
      } else {
        EXPECT_EQ(code, 1) << "child failed otherwise in round " << round;
        ++losers;
      }
    }
    ASSERT_NE(winner, -1) << "no winner in round " << round;
    EXPECT_EQ(losers, kProcs - 1);
    auto store = OpenOrDie(dir.path());
    EXPECT_EQ(store->Get(key).value(), std::string(1 << 16, static_cast<char>('a' + winner)));
  }
}

TEST(LocalStore, PutFileRenamesTheSpoolFileIntoPlace) {
  test::ScopedTempDir dir;
  auto store = OpenOrDie(dir.path());
  auto path = store->NewTempPath();
  ASSERT_TRUE(path.ok());
  EXPECT_EQ(path->rfind(dir.path() + "/tmp/", 0), 0u) << *path;
  WriteFile(*path, "spooled");
  struct stat before {};
  ASSERT_EQ(::stat(path->c_str(), &before), 0);
  ASSERT_TRUE(store->PutFile("blobs/s", *path).ok());
  struct stat after {};
  ASSERT_EQ(::stat((dir.path() + "/blobs/s").c_str(), &after), 0);
  EXPECT_EQ(before.st_ino, after.st_ino) << "copied instead of renamed";
}

TEST(LocalStore, PutFileFromAnotherFilesystemCopies) {
  test::ScopedTempDir dir;
  struct stat shm {};
  struct stat root {};
  ASSERT_EQ(::stat("/dev/shm", &shm), 0);
  ASSERT_EQ(::stat(dir.path().c_str(), &root), 0);
  ASSERT_NE(shm.st_dev, root.st_dev) << "needs /dev/shm on a filesystem other than " << dir.path();
  const std::string src = "/dev/shm/dte-local-store-test-" + std::to_string(::getpid());
  const std::string data(3 << 20, 'q');
  WriteFile(src, data);
  auto store = OpenOrDie(dir.path());
  Status s = store->PutFile("blobs/far", src);
  ::unlink(src.c_str());
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(store->Get("blobs/far").value(), data);
  EXPECT_TRUE(FilesIn(dir.path() + "/tmp").empty());
}

TEST(LocalStore, PutFileReplacementIsAtomicForReadersInAnotherInstance) {
  test::ScopedTempDir dir;
  auto writer = OpenOrDie(dir.path());
  auto reader_store = OpenOrDie(dir.path());
  const std::string a(256 << 10, 'a'), b(640 << 10, 'b');
  ASSERT_TRUE(writer->Put("refs/latest", a).ok());
  std::atomic<bool> done{false};
  std::atomic<int> reads{0}, torn{0};
  std::thread reader([&] {
    while (!done.load() || reads.load() < 20) {
      auto got = reader_store->Get("refs/latest");
      if (!got.ok() || (*got != a && *got != b)) ++torn;
      ++reads;
    }
  });
  Status s;
  for (int i = 0; i < 40 && s.ok(); ++i) {
    auto path = writer->NewTempPath();
    s = path.status();
    if (!s.ok()) break;
    WriteFile(*path, i % 2 ? a : b);
    s = writer->PutFile("refs/latest", *path);
  }
  done = true;
  reader.join();
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(torn.load(), 0) << "of " << reads.load() << " reads";
}

TEST(LocalStore, GetSeesAReplacementByAnotherInstance) {
  test::ScopedTempDir dir;
  auto one = OpenOrDie(dir.path());
  auto two = OpenOrDie(dir.path());
  ASSERT_TRUE(one->Put("refs/head", "v1").ok());
  ASSERT_TRUE(one->GetRange("refs/head", 0, 2).ok());  // cached in `one`
  ASSERT_TRUE(two->Put("refs/head", "v2").ok());
  EXPECT_EQ(one->Get("refs/head").value(), "v2");
}

TEST(LocalStore, DeleteEvictsTheCachedDescriptor) {
  test::ScopedTempDir dir;
  auto store = OpenOrDie(dir.path());
  ASSERT_TRUE(store->Put("blobs/c", "cached").ok());
  EXPECT_FALSE(store->IsFdCached("blobs/c"));
  ASSERT_EQ(store->GetRange("blobs/c", 0, 3).value(), "cac");
  EXPECT_TRUE(store->IsFdCached("blobs/c"));
  ASSERT_TRUE(store->Delete("blobs/c").ok());
  EXPECT_FALSE(store->IsFdCached("blobs/c"));
  EXPECT_EQ(store->GetRange("blobs/c", 0, 3).status().code(), Code::kNotFound);
  EXPECT_FALSE(fs::exists(dir.path() + "/blobs/c"));
}

TEST(LocalStore, DescriptorCacheIsABoundedLru) {
  test::ScopedTempDir dir;
  auto store = OpenOrDie(dir.path(), /*max_open_fds=*/3);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(store->Put("k" + std::to_string(i), "x").ok());
  for (int i : {0, 1, 2, 0, 3}) ASSERT_TRUE(store->GetRange("k" + std::to_string(i), 0, 1).ok());
  EXPECT_EQ(store->CachedFdCount(), 3u);
  EXPECT_TRUE(store->IsFdCached("k0"));  // used again before k3 came in
  EXPECT_FALSE(store->IsFdCached("k1"));
  EXPECT_TRUE(store->IsFdCached("k2"));
  EXPECT_TRUE(store->IsFdCached("k3"));
  auto uncached = OpenOrDie(dir.path(), /*max_open_fds=*/0);
  ASSERT_TRUE(uncached->GetRange("k0", 0, 1).ok());
  EXPECT_EQ(uncached->CachedFdCount(), 0u);
}

TEST(LocalStore, ConcurrentRangeReadsUnderEvictionReturnTheRightBytes) {
  test::ScopedTempDir dir;
  auto store = OpenOrDie(dir.path(), /*max_open_fds=*/2);
  constexpr int kBlobs = 8;
  for (int i = 0; i < kBlobs; ++i) {
    ASSERT_TRUE(store->Put("blobs/" + std::to_string(i), std::string(4096, char('A' + i))).ok());
  }
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int n = 0; n < 3000; ++n) {
        const int blob = static_cast<int>(rng() % kBlobs);
        char buf[64];
        Status s = store->ReadRange("blobs/" + std::to_string(blob), rng() % 4000, 64, buf);
        if (!s.ok() || std::string(buf, 64) != std::string(64, char('A' + blob))) ++wrong;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_LE(store->CachedFdCount(), 2u);
}

TEST(LocalStore, ShortReadOfATruncatedObjectIsCorruption) {
  test::ScopedTempDir dir;
  auto store = OpenOrDie(dir.path());
  ASSERT_TRUE(store->Put("blobs/t", std::string(100, 'x')).ok());
  ASSERT_TRUE(store->GetRange("blobs/t", 0, 1).ok());  // caches size 100
  ASSERT_EQ(::truncate((dir.path() + "/blobs/t").c_str(), 10), 0);
  auto got = store->GetRange("blobs/t", 50, 20);
  ASSERT_EQ(got.status().code(), Code::kCorruption);
  EXPECT_NE(got.status().message().find("blobs/t"), std::string::npos);
  EXPECT_NE(got.status().message().find("[50, 70)"), std::string::npos) << got.status().message();
}

TEST(LocalStore, TempFilesAreNeverListedAndTmpKeysAreReserved) {
  test::ScopedTempDir dir;
  auto store = OpenOrDie(dir.path());
  auto path = store->NewTempPath();
  ASSERT_TRUE(path.ok());
  WriteFile(*path, "in flight");
  ASSERT_TRUE(store->Put("blobs/x", "x").ok());
  WriteFile(dir.path() + "/not a key", "foreign file");
  EXPECT_EQ(store->List("").value(), std::vector<std::string>{"blobs/x"});
  EXPECT_TRUE(store->List("tmp").value().empty());
  EXPECT_TRUE(store->List("tmp/").value().empty());
  EXPECT_EQ(store->Put("tmp/x", "x").code(), Code::kInvalidArgument);
  EXPECT_EQ(store->Get("tmp").status().code(), Code::kInvalidArgument);
}

TEST(LocalStore, TouchRefreshesModifiedTime) {
  test::ScopedTempDir dir;
  auto store = OpenOrDie(dir.path());
  ASSERT_TRUE(store->Put("blobs/m", "x").ok());
  const timespec old_times[2] = {{1000, 0}, {1000, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, (dir.path() + "/blobs/m").c_str(), old_times, 0), 0);
  EXPECT_EQ(store->ModifiedTime("blobs/m").value(), 1000);
  ASSERT_TRUE(store->Touch("blobs/m").ok());
  EXPECT_GE(store->ModifiedTime("blobs/m").value(), static_cast<int64_t>(std::time(nullptr)) - 60);
}

TEST(LocalStore, RemoveStaleTempFilesKeepsRecentOnes) {
  test::ScopedTempDir dir;
  auto store = OpenOrDie(dir.path());
  const std::string old_file = store->NewTempPath().value();
  const std::string new_file = store->NewTempPath().value();
  WriteFile(old_file, "crashed writer");
  WriteFile(new_file, "writer in flight");
  const timespec old_times[2] = {{1000, 0}, {1000, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, old_file.c_str(), old_times, 0), 0);
  EXPECT_EQ(store->RemoveStaleTempFiles(3600).value(), 1u);
  EXPECT_FALSE(fs::exists(old_file));
  EXPECT_TRUE(fs::exists(new_file));
}

TEST(LocalStore, OpenMissingDirectoryIsNotFoundUnlessCreating) {
  test::ScopedTempDir dir;
  const std::string root = dir.path() + "/x/y";
  auto missing = OpenObjectStore(root, /*create=*/false);
  ASSERT_EQ(missing.status().code(), Code::kNotFound);
  EXPECT_EQ(missing.status().message(), "store " + root + " does not exist");
  auto created = OpenObjectStore(root + "/", /*create=*/true);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  EXPECT_EQ((*created)->Describe(), root);
  EXPECT_TRUE(fs::is_directory(root));
  EXPECT_TRUE(OpenObjectStore(root, /*create=*/false).ok());
}

TEST(LocalStore, OpenRejectsAFileAndUnknownSchemes) {
  test::ScopedTempDir dir;
  WriteFile(dir.path() + "/file", "");
  EXPECT_EQ(OpenObjectStore(dir.path() + "/file", false).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(OpenObjectStore("gs://bucket/x", false).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(OpenObjectStore("", false).status().code(), Code::kInvalidArgument);
  EXPECT_TRUE(OpenObjectStore("file://" + dir.path(), false).ok());
}

}  // namespace
}  // namespace dte
