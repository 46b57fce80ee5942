// Writing a HF model directory from per-rank MCore safetensors files.
#include "sync/convert/convert_dir.h"

#include <fcntl.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <system_error>
#include <utility>

#include "store/base/posix_file.h"

namespace dte {
namespace {

namespace fs = std::filesystem;

bool IsRankFile(const std::string& name) {
  return name.rfind("mp_rank_", 0) == 0 && name.size() > 12 &&
         name.compare(name.size() - 12, 12, ".safetensors") == 0;
}

// One output safetensors file: units [first, end) of the plan.
struct OutFile {
  std::string name;
  size_t first = 0;
  size_t end = 0;
  std::vector<TensorInfo> tensors;  // laid out in plan order
  uint64_t bytes = 0;
};

// Each HF tensor's dtype is that of the shard its first copy reads.
Result<DType> TensorDType(const ConvertUnit& unit, uint32_t tensor, const RankFileSource& source) {
  for (const BlockCopy& c : unit.copies) {
    if (c.tensor == tensor) return source.ShardDType(unit.shards[c.shard].key);
  }
  return Internal("plan has no copy into " + unit.tensors[tensor].name);
}

// Groups whole units into files of at most max_bytes of data (a larger unit
// gets a file of its own).
Result<std::vector<OutFile>> LayOutFiles(const std::vector<ConvertUnit>& plan,
                                         const RankFileSource& source, uint64_t max_bytes) {
  std::vector<OutFile> files;
  for (size_t u = 0; u < plan.size(); ++u) {
    std::vector<TensorInfo> infos;
    uint64_t unit_bytes = 0;
    for (uint32_t t = 0; t < plan[u].tensors.size(); ++t) {
      TensorInfo info;
      info.name = plan[u].tensors[t].name;
      info.shape = plan[u].tensors[t].shape;
      ASSIGN_OR_RETURN(info.dtype, TensorDType(plan[u], t, source));
      unit_bytes += plan[u].tensors[t].elements() * DTypeWidth(info.dtype);
      infos.push_back(std::move(info));
    }
    if (files.empty() || (files.back().bytes > 0 && files.back().bytes + unit_bytes > max_bytes)) {
      files.push_back({"", u, u, {}, 0});
    }
    OutFile& f = files.back();
    for (TensorInfo& info : infos) {
      info.begin = f.bytes;
      f.bytes += info.elements() * DTypeWidth(info.dtype);
      info.end = f.bytes;
      f.tensors.push_back(std::move(info));
    }
    f.end = u + 1;
  }
  for (size_t i = 0; i < files.size(); ++i) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", i + 1, files.size());
    files[i].name = files.size() == 1 ? "model.safetensors" : name;
  }
  return files;
}

// Converts the file's units and appends their tensors after the header.
Status WriteOutFile(const std::vector<ConvertUnit>& plan, const OutFile& f, RankFileSource& source,
                    const std::string& path, ConvertStats* total) {
  ASSIGN_OR_RETURN(ScopedFd fd, OpenFile(path, O_WRONLY | O_CREAT | O_EXCL, 0644));
  const std::string header = BuildSafetensorsHeader(f.tensors, {{"format", "pt"}});
  RETURN_IF_ERROR(WriteAll(fd.get(), header.data(), header.size(), path));
  size_t next = 0;
  const std::span<const ConvertUnit> units(plan.data() + f.first, f.end - f.first);
  ConvertStats stats;
  RETURN_IF_ERROR(ConvertToHf(
      units, source,
      [&](const ConvertUnit&, std::vector<HfTensor>& tensors) -> Status {
        for (const HfTensor& t : tensors) {
          if (next == f.tensors.size() || t.name != f.tensors[next].name ||
              t.tensor.dtype != f.tensors[next].dtype) {
            return Internal(path + ": " + t.name + " does not match the file's header");
          }
          next++;
          RETURN_IF_ERROR(WriteAll(fd.get(), t.tensor.data.data(), t.tensor.data.size(), path));
        }
        return Status::Ok();
      },
      &stats));
  total->units += stats.units;
  total->tensors += stats.tensors;
  total->bytes += stats.bytes;
  total->peak_bytes = std::max(total->peak_bytes, stats.peak_bytes);
  return fd.Close(path);
}

Status WriteIndex(const std::vector<OutFile>& files, const std::string& dir) {
  nlohmann::ordered_json index;
  uint64_t total = 0;
  for (const OutFile& f : files) total += f.bytes;
  index["metadata"]["total_size"] = total;
  nlohmann::json map = nlohmann::json::object();  // sorted keys, as HF writes them
  for (const OutFile& f : files) {
    for (const TensorInfo& t : f.tensors) map[t.name] = f.name;
  }
  index["weight_map"] = std::move(map);
  const std::string path = dir + "/model.safetensors.index.json";
  const std::string text = index.dump(2) + "\n";
  ASSIGN_OR_RETURN(ScopedFd fd, OpenFile(path, O_WRONLY | O_CREAT | O_EXCL, 0644));
  RETURN_IF_ERROR(WriteAll(fd.get(), text.data(), text.size(), path));
  return fd.Close(path);
}

Status CopyExtraFiles(const std::string& from, const std::string& to) {
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(from, ec)) {
    const std::string name = e.path().filename().string();
    const bool weights = name.ends_with(".safetensors") || name == "model.safetensors.index.json";
    if (!e.is_regular_file() || weights) continue;
    if (!fs::copy_file(e.path(), fs::path(to) / name, ec)) {
      return IOError("cannot copy " + e.path().string() + ": " + ec.message());
    }
  }
  if (ec) return IOError("cannot list " + from + ": " + ec.message());
  return Status::Ok();
}

Status WriteFiles(const std::vector<ConvertUnit>& plan, const std::vector<OutFile>& files,
                  RankFileSource& source, const std::string& dir, const HfDirOptions& options,
                  HfDirResult* result) {
  for (const OutFile& f : files) {
    RETURN_IF_ERROR(WriteOutFile(plan, f, source, dir + "/" + f.name, &result->stats));
    result->files++;
  }
  if (files.size() > 1) RETURN_IF_ERROR(WriteIndex(files, dir));
  if (!options.copy_from.empty()) RETURN_IF_ERROR(CopyExtraFiles(options.copy_from, dir));
  return Status::Ok();
}

}  // namespace

std::string RankFileName(int tp_rank, int ep_rank) {
  char name[64];
  std::snprintf(name, sizeof(name), "mp_rank_%02d_%03d.safetensors", tp_rank, ep_rank);
  return name;
}

Result<std::unique_ptr<RankFileSource>> RankFileSource::Open(const std::string& dir,
                                                             const ParallelLayout& layout) {
  auto source = std::unique_ptr<RankFileSource>(new RankFileSource());
  std::map<std::string, std::pair<int, int>> expected;
  for (int tp = 0; tp < std::max(layout.tp, layout.expert_tp()); ++tp) {
    for (int ep = 0; ep < layout.ep; ++ep) expected[RankFileName(tp, ep)] = {tp, ep};
  }
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!IsRankFile(name)) continue;
    auto it = expected.find(name);
    if (it == expected.end()) {
      return InvalidArgument(e.path().string() + " is not a rank of the layout (TP " +
                             std::to_string(layout.tp) + ", EP " + std::to_string(layout.ep) + ")");
    }
    ASSIGN_OR_RETURN(SafetensorsHeader header, ReadSafetensorsHeader(e.path().string()));
    for (const TensorInfo& t : header.tensors) {
      ShardKey key{t.name, it->second.first, it->second.second};
      source->shards_[key] = {e.path().string(), header.data_offset + t.begin, t};
    }
  }
  if (ec) return IOError("cannot list " + dir + ": " + ec.message());
  return source;
}

Result<const RankFileSource::Located*> RankFileSource::Find(const ShardKey& key) const {
  auto it = shards_.find(key);
  if (it == shards_.end()) {
    return NotFound("missing MCore shard " + key.ToString() + " in " +
                    RankFileName(key.tp_rank, key.ep_rank));
  }
  return &it->second;
}

Result<DType> RankFileSource::ShardDType(const ShardKey& key) const {
  ASSIGN_OR_RETURN(const Located* at, Find(key));
  return at->info.dtype;
}

Result<ShardView> RankFileSource::Get(const ShardKey& key) {
  ASSIGN_OR_RETURN(const Located* at, Find(key));
  auto bytes = std::make_shared<std::string>(at->info.bytes(), '\0');
  ASSIGN_OR_RETURN(ScopedFd fd, OpenFile(at->path, O_RDONLY));
  RETURN_IF_ERROR(PreadExact(fd.get(), bytes->data(), bytes->size(), at->offset, at->path,
                             [&](uint64_t) { return Corruption(at->path + " is truncated"); }));
  ShardView view;
  view.dtype = at->info.dtype;
  view.shape = at->info.shape;
  view.bytes = *bytes;
  view.owner = std::move(bytes);
  return view;
}

Result<HfDirResult> WriteHfDirectory(const std::vector<ConvertUnit>& plan, RankFileSource& source,
                                     const std::string& out_dir, const HfDirOptions& options) {
  std::error_code ec;
  if (fs::exists(out_dir, ec)) return AlreadyExists(out_dir + " already exists");
  ASSIGN_OR_RETURN(std::vector<OutFile> files, LayOutFiles(plan, source, options.max_file_bytes));
  const std::string tmp = out_dir + ".partial";
  fs::remove_all(tmp, ec);  // left by a run that was killed
  if (!fs::create_directories(tmp, ec))
    return IOError("cannot create " + tmp + ": " + ec.message());
  HfDirResult result;
  Status st = WriteFiles(plan, files, source, tmp, options, &result);
  if (st.ok()) {
    fs::rename(tmp, out_dir, ec);
    if (ec) st = IOError("cannot move " + tmp + " to " + out_dir + ": " + ec.message());
  }
  if (!st.ok()) {
    fs::remove_all(tmp, ec);
    return st;
  }
  return result;
}

}  // namespace dte
