#include "store/ops/export.h"

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>

#include "store/base/posix_file.h"
#include "store/materialize.h"
#include "store/snapshot.h"
#include "store/store.h"

namespace dte {
namespace {

namespace fs = std::filesystem;

Status CheckOutputDir(const std::string& out_dir) {
  std::error_code ec;
  if (!fs::exists(out_dir, ec)) return Status::Ok();
  if (!fs::is_directory(out_dir, ec) || !fs::is_empty(out_dir, ec)) {
    return InvalidArgument("output directory " + out_dir + " exists and is not empty");
  }
  return Status::Ok();
}

Status ExportFile(Materializer& reader, const std::shared_ptr<const Version>& v, const FileEntry& f,
                  const std::string& dir, uint64_t* done, uint64_t total,
                  const std::function<void(uint64_t, uint64_t)>& progress) {
  std::string path = dir + "/" + f.name;
  int err = 0;
  Result<ScopedFd> fd = OpenFile(path, O_WRONLY | O_CREAT | O_EXCL, 0644, &err);
  if (!fd.ok()) return ErrnoStatus("cannot create " + path, err);
  // Block hashes cover every byte written; the tensor hashes are verify's.
  Status s = reader.StreamFile(
      v, f,
      [&](uint64_t, const uint8_t* data, size_t len) {
        *done += len;
        if (progress) progress(*done, total);
        return CannotWording(WriteAll(fd->get(), data, len, path));
      },
      /*check_tensor_hashes=*/false);
  Status closed = CannotWording(fd->Close(path));
  return s.ok() ? closed : s;
}

}  // namespace

Result<ExportResult> ExportVersion(Store& store, uint64_t version, const std::string& out_dir,
                                   const std::function<void(uint64_t, uint64_t)>& progress) {
  RETURN_IF_ERROR(CheckOutputDir(out_dir));
  ASSIGN_OR_RETURN(auto v, store.GetVersion(version));
  fs::path out = fs::absolute(out_dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();
  std::string tmp = out.string() + ".dte-export-" + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(tmp, ec);
  // The topmost ancestor this export creates, removed again on failure.
  fs::path created = out.parent_path();
  while (!created.empty() && !fs::exists(created.parent_path(), ec) &&
         created.parent_path() != created) {
    created = created.parent_path();
  }
  if (fs::exists(created, ec)) created.clear();
  if (!fs::create_directories(tmp, ec)) {
    return IOError("cannot create " + tmp + ": " + ec.message());
  }
  // Blocks come from the nearest snapshot this host has, else from the
  // nearest self-contained version: never a walk back to the first anchor.
  std::unique_ptr<SnapshotSet> snapshots = OpenStoreSnapshots(store);
  Materializer reader(&store);
  reader.SetBase(snapshots.get());
  ExportResult r;
  r.version = version;
  uint64_t total = 0;
  for (const auto& f : v->manifest.files) total += f.size;
  Status s;
  for (const auto& f : v->manifest.files) {
    s = ExportFile(reader, v, f, tmp, &r.bytes, total, progress);
    if (!s.ok()) break;
    r.files++;
  }
  if (s.ok()) {
    fs::remove(out, ec);  // an empty directory, checked above
    if (::rename(tmp.c_str(), out.c_str()) != 0) {
      s = ErrnoStatus("cannot move " + tmp + " to " + out.string(), errno);
    }
  }
  if (!s.ok()) {
    fs::remove_all(created.empty() ? fs::path(tmp) : created, ec);
    return s;
  }
  return r;
}

}  // namespace dte
