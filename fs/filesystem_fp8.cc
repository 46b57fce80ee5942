// fp8/: every version as a block-scaled FP8 checkpoint (fs/fp8_reader.h).
//
//   /fp8/                  one directory per version the root shows
//   /fp8/vNNNNNNNN/<file>  the files of the version's FP8 view
//   /fp8/latest            symlink to the newest one (as /latest)
// Inodes: fp8/ and fp8/latest are fixed; a version's FP8 directory and
// files are (version | kFp8KeyBit, file) in the InodeTable, so they never
// share a number with the BF16 ones.
#include <string>

#include "fs/filesystem.h"
#include "fs/log.h"

namespace dte::fs {
namespace {

std::string Fp8Name(uint64_t version) { return "fp8/" + VersionName(version); }

}  // namespace

void Filesystem::EnableFp8(const Fp8ViewOptions& options) {
  fp8_ = std::make_unique<Fp8Reader>(&reader_, options);
  live_.SetFp8Policy(options.policy);
}

bool Filesystem::IsFp8(uint64_t ino) {
  if (!fp8_) return false;
  if (ino == kFp8DirIno || ino == kFp8LatestIno) return true;
  std::optional<InodeKey> key = inodes_.Find(ino);
  return key && key->version != kLiveKey && (key->version & kFp8KeyBit) != 0;
}

NodeAttr Filesystem::Fp8DirAttr() {
  NodeAttr a = RootAttr();
  a.ino = kFp8DirIno;
  return a;
}

Result<std::shared_ptr<const Fp8Mounted>> Filesystem::Fp8ViewOf(uint64_t version) {
  ASSIGN_OR_RETURN(auto v, VersionOf(version));
  VersionChain chain = reader_.ChainOf(v, /*stop_at_joins=*/true);
  Result<std::shared_ptr<const Fp8Mounted>> view = fp8_->ViewOf(v, &chain);
  if (!view.ok()) {
    MutexLock lock(&mu_);
    if (logged_.insert({version | kFp8KeyBit, kDirFile}).second) {
      LogLine("dtefs: " + Fp8Name(version) + ": " + view.status().message());
      PushErrorLocked(view.status().message());
    }
  }
  return view;
}

Result<NodeAttr> Filesystem::Fp8GetAttr(uint64_t ino) {
  if (ino == kFp8DirIno) return Fp8DirAttr();
  if (ino == kFp8LatestIno) {
    ASSIGN_OR_RETURN(NodeAttr a, GetAttr(kLatestIno));
    a.ino = kFp8LatestIno;
    return a;
  }
  std::optional<InodeKey> key = inodes_.Find(ino);
  if (!key) return NotFound("inode " + std::to_string(ino));
  const uint64_t version = key->version & ~kFp8KeyBit;
  ASSIGN_OR_RETURN(auto m, Fp8ViewOf(version));
  NodeAttr a = VersionDirAttr(*m->version);
  a.ino = ino;
  if (key->file == kDirFile) return a;
  if (key->file >= m->view.files().size()) return NotFound("inode " + std::to_string(ino));
  a.type = NodeType::kRegular;
  a.size = m->view.files()[key->file].size;
  return a;
}

Result<NodeAttr> Filesystem::Fp8Lookup(uint64_t parent, std::string_view name) {
  if (parent == kFp8LatestIno) return NotFound("fp8/latest is a symlink");
  if (parent == kFp8DirIno) {
    if (name == "latest") return Fp8GetAttr(kFp8LatestIno);
    ASSIGN_OR_RETURN(NodeAttr a, Lookup(kRootIno, name));
    if (a.type != NodeType::kDirectory || a.ino == kLiveDirIno || a.ino == kDteDirIno ||
        a.ino == kFp8DirIno) {
      return NotFound("fp8/" + std::string(name));
    }
    const std::optional<InodeKey> key = inodes_.Find(a.ino);
    if (!key) return NotFound("fp8/" + std::string(name));
    return Fp8GetAttr(inodes_.Intern(key->version | kFp8KeyBit, kDirFile));
  }
  std::optional<InodeKey> key = inodes_.Find(parent);
  if (!key || key->file != kDirFile) return NotFound("inode " + std::to_string(parent));
  const uint64_t version = key->version & ~kFp8KeyBit;
  ASSIGN_OR_RETURN(auto m, Fp8ViewOf(version));
  const auto& files = m->view.files();
  for (uint32_t i = 0; i < files.size(); ++i) {
    if (files[i].name == name) return Fp8GetAttr(inodes_.Intern(key->version, i));
  }
  return NotFound(Fp8Name(version) + "/" + std::string(name));
}

// fp8/ lists what the root lists (without loading any version); a
// version's FP8 directory lists its view's files.
Result<std::vector<DirEntry>> Filesystem::Fp8ReadDir(uint64_t ino) {
  std::vector<DirEntry> out;
  if (ino == kFp8DirIno) {
    ASSIGN_OR_RETURN(std::vector<DirEntry> root, RootEntries());
    for (DirEntry& e : root) {
      if (e.attr.ino == kLatestIno) {
        e.attr.ino = kFp8LatestIno;
        out.push_back(std::move(e));
      } else if (e.attr.type == NodeType::kDirectory && e.name.starts_with("v")) {
        const std::optional<InodeKey> key = inodes_.Find(e.attr.ino);
        if (!key) continue;
        e.attr.ino = inodes_.Intern(key->version | kFp8KeyBit, kDirFile);
        out.push_back(std::move(e));
      }
    }
    return out;
  }
  if (ino == kFp8LatestIno) return InvalidArgument("fp8/latest is a symlink");
  std::optional<InodeKey> key = inodes_.Find(ino);
  if (!key) return NotFound("inode " + std::to_string(ino));
  if (key->file != kDirFile) return InvalidArgument("inode " + std::to_string(ino) + " is a file");
  ASSIGN_OR_RETURN(auto m, Fp8ViewOf(key->version & ~kFp8KeyBit));
  for (uint32_t i = 0; i < m->view.files().size(); ++i) {
    ASSIGN_OR_RETURN(NodeAttr a, Fp8GetAttr(inodes_.Intern(key->version, i)));
    out.push_back({m->view.files()[i].name, a});
  }
  return out;
}

Result<std::unique_ptr<OpenFile>> Filesystem::Fp8Open(uint64_t ino) {
  std::optional<InodeKey> key = inodes_.Find(ino);
  if (!key || key->file == kDirFile) {
    return InvalidArgument("inode " + std::to_string(ino) + " is a directory");
  }
  ASSIGN_OR_RETURN(auto m, Fp8ViewOf(key->version & ~kFp8KeyBit));
  if (key->file >= m->view.files().size()) return NotFound("inode " + std::to_string(ino));
  auto f = std::make_unique<OpenFile>();
  f->version = m->version;
  f->chain = reader_.ChainOf(f->version, /*stop_at_joins=*/true);
  f->file_index = key->file;
  f->fp8 = std::move(m);
  return f;
}

Status Filesystem::Fp8ReadPieces(const OpenFile& f, uint64_t offset, uint64_t len,
                                 std::vector<ReadPath::Piece>* out) {
  Status s = fp8_->ReadPieces(*f.fp8, f.file_index, offset, len, &f.chain, out);
  if (s.ok()) {
    bytes_served_ += len;
    return s;
  }
  read_errors_++;
  const uint64_t version = f.version->manifest.version;
  MutexLock lock(&mu_);
  if (logged_.insert({version | kFp8KeyBit, f.file_index}).second) {
    LogLine("dtefs: read of " + Fp8Name(version) + "/" + f.fp8->view.files()[f.file_index].name +
            " failed: " + s.message());
    PushErrorLocked(s.message());
  }
  return s;
}

}  // namespace dte::fs
