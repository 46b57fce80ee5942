#include "store/write/scan.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <set>

#include "store/base/posix_file.h"

namespace dte::internal {
namespace {

constexpr char kIndexName[] = "model.safetensors.index.json";

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

Result<std::vector<InputFile>> ListFiles(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return ErrnoStatus("cannot open checkpoint directory " + dir, errno);
  std::vector<InputFile> files;
  Status status;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    std::string path = dir + "/" + name;
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      status = ErrnoStatus("cannot stat " + path, errno);
      break;
    }
    if (S_ISDIR(st.st_mode)) {
      status = InvalidArgument("checkpoint directory " + dir + " contains the subdirectory " +
                               name + "; only flat model directories can be committed");
      break;
    }
    if (!S_ISREG(st.st_mode) || !IsPlainFileName(name)) {
      status = InvalidArgument(path + " is not a regular file with a plain name");
      break;
    }
    InputFile f;
    f.name = name;
    f.path = path;
    f.size = static_cast<uint64_t>(st.st_size);
    files.push_back(std::move(f));
  }
  ::closedir(d);
  RETURN_IF_ERROR(status);
  if (files.empty()) return InvalidArgument("checkpoint directory " + dir + " is empty");
  std::sort(files.begin(), files.end(),
            [](const InputFile& a, const InputFile& b) { return a.name < b.name; });
  return files;
}

Status CheckIndex(const std::string& dir, const std::vector<InputFile>& files) {
  auto it = std::find_if(files.begin(), files.end(),
                         [](const InputFile& f) { return f.name == kIndexName; });
  if (it == files.end()) return Status::Ok();
  ASSIGN_OR_RETURN(std::string text, CannotWording(ReadWholeFile(it->path)));
  ASSIGN_OR_RETURN(SafetensorsIndex index, ParseSafetensorsIndex(text, it->path));
  for (const auto& entry : index.weight_map) {
    const std::string& tensor = entry.first;  // named, not bound: lambdas capture them
    const std::string& shard = entry.second;
    auto f = std::find_if(files.begin(), files.end(),
                          [&](const InputFile& x) { return x.name == shard; });
    if (f == files.end() || !f->safetensors) {
      return InvalidArgument(it->path + " names shard " + shard + " (for tensor \"" + tensor +
                             "\"), which is not a safetensors file in " + dir);
    }
    bool found = std::any_of(f->header.tensors.begin(), f->header.tensors.end(),
                             [&](const TensorInfo& t) { return t.name == tensor; });
    if (!found) {
      return InvalidArgument(it->path + " places tensor \"" + tensor + "\" in " + shard +
                             ", which does not contain it");
    }
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<InputFile>> ScanCheckpoint(const std::string& dir) {
  ASSIGN_OR_RETURN(auto files, ListFiles(dir));
  for (auto& f : files) {
    if (!EndsWith(f.name, ".safetensors")) continue;
    f.safetensors = true;
    ASSIGN_OR_RETURN(f.header, ReadSafetensorsHeader(f.path));
    ASSIGN_OR_RETURN(f.header_bytes, ReadSafetensorsHeaderBytes(f.path));
    if (f.header_bytes.size() != f.header.data_offset ||
        f.header.data_offset + f.header.data_size != f.size) {
      return InvalidArgument(f.path + " changed while it was being read");
    }
  }
  RETURN_IF_ERROR(CheckIndex(dir, files));
  return files;
}

std::vector<FileEntry> LayoutEntries(const std::vector<InputFile>& files, uint64_t block_bytes) {
  std::vector<FileEntry> out;
  uint32_t next_block = 0;
  for (const auto& f : files) {
    FileEntry e;
    e.name = f.name;
    e.size = f.size;
    e.safetensors = f.safetensors;
    e.header_size = f.header.data_offset;
    for (const auto& ti : f.header.tensors) {
      TensorEntry t;
      t.name = ti.name;
      t.dtype = ti.dtype;
      t.shape = ti.shape;
      t.begin = ti.begin;
      t.end = ti.end;
      t.first_block = next_block;
      t.blocks = static_cast<uint32_t>((t.bytes() + block_bytes - 1) / block_bytes);
      next_block += t.blocks;
      e.tensors.push_back(std::move(t));
    }
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace dte::internal
