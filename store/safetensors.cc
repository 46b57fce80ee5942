// Safetensors validation and header serialization.
//
// File grammar (integers little-endian):
//
//   file    := N:u64  header[N]  data[D]
//   header  := JSON object, UTF-8, optionally followed by spaces:
//              { ("__metadata__": { string: string, ... })?
//                (name: { "dtype": DTYPE, "shape": [dim, ...],
//                         "data_offsets": [begin, end] })* }
//   DTYPE   := one of the 15 names in store/dtype.h
//   dim, begin, end := non-negative JSON integers
//
// with N <= kMaxSafetensorsHeader, end - begin == width(dtype) * prod(shape),
// and the tensors, ordered by offset, tiling [0, D) exactly: no holes, no
// overlap, D == file size - 8 - N. Other keys in a tensor entry are ignored.
//
// The JSON itself is parsed in store/internal/safetensors_json.cc.

#include "store/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <set>
#include <utility>

#include "store/base/posix_file.h"
#include "store/internal/safetensors_json.h"

namespace dte {
namespace {

using safetensors_internal::Quote;
using safetensors_internal::RangeString;

constexpr size_t kPrefixBytes = 8;

// Returns the offset of the first byte that does not start a well-formed
// UTF-8 sequence (overlong forms, surrogates and code points above U+10FFFF
// are ill-formed), or npos when all of `s` is well-formed.
size_t FindInvalidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<uint8_t>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    const size_t len = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (len == 0 || s.size() - i < len) return i;
    uint32_t cp = c & (0x7F >> len);  // the payload bits of the lead byte
    for (size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<uint8_t>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (cc & 0x3F);
    }
    static constexpr uint32_t kMinForLength[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMinForLength[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string_view::npos;
}

Status CheckUtf8(std::string_view s, const std::string& what, const std::string& file) {
  size_t bad = FindInvalidUtf8(s);
  if (bad == std::string_view::npos) return Status::Ok();
  return InvalidArgument(file + ": " + what + " is not valid UTF-8 (ill-formed sequence at byte " +
                         std::to_string(bad) + ")");
}

uint64_t LoadLe64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// Checks that a header of `n` bytes fits a file of `file_size` bytes.
Status CheckHeaderLength(uint64_t n, uint64_t file_size, const std::string& file) {
  if (file_size < kPrefixBytes) {
    return InvalidArgument(file + ": file is truncated: " + std::to_string(file_size) +
                           " bytes, shorter than the 8-byte header length prefix");
  }
  if (n > kMaxSafetensorsHeader) {
    return InvalidArgument(file + ": header length " + std::to_string(n) +
                           " exceeds the limit of " + std::to_string(kMaxSafetensorsHeader) +
                           " bytes");
  }
  if (n > file_size - kPrefixBytes) {
    return InvalidArgument(file + ": header length " + std::to_string(n) +
                           " extends beyond the end of the file (" + std::to_string(file_size) +
                           " bytes)");
  }
  return Status::Ok();
}

// Sorts `tensors` by offset (keeping header order among equal offsets, as
// the writer laid them out) and checks that they tile [0, data_size).
Status CheckLayout(std::vector<TensorInfo>* tensors, uint64_t data_size, const std::string& file) {
  std::stable_sort(tensors->begin(), tensors->end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t pos = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : *tensors) {
    if (t.begin < pos) {
      return InvalidArgument(file + ": tensor " + Quote(t.name) + " at data_offsets " +
                             RangeString(t.begin, t.end) + " overlaps tensor " + Quote(prev->name) +
                             " at " + RangeString(prev->begin, prev->end));
    }
    if (t.begin > pos) {
      return InvalidArgument(file + ": hole of " + std::to_string(t.begin - pos) +
                             " bytes in the data section before tensor " + Quote(t.name) +
                             " at data_offsets " + RangeString(t.begin, t.end));
    }
    pos = t.end;
    prev = &t;
  }
  if (pos > data_size) {
    return InvalidArgument(file + ": file is truncated: tensor " + Quote(prev->name) +
                           " ends at data offset " + std::to_string(pos) +
                           " but the data section holds " + std::to_string(data_size) + " bytes");
  }
  if (pos < data_size) {
    return InvalidArgument(file + ": " + std::to_string(data_size - pos) +
                           " trailing bytes after the last tensor (data section of " +
                           std::to_string(data_size) + " bytes, tensors cover " +
                           std::to_string(pos) + ")");
  }
  return Status::Ok();
}

// Reads prefix + header of `path` after checking the prefix; stores the
// file's size in `*file_size`.
Result<std::string> ReadRawHeader(const std::string& path, uint64_t* file_size) {
  ASSIGN_OR_RETURN(ScopedFd fd, OpenFile(path, O_RDONLY));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    int err = errno;
    return ErrnoStatus("stat " + path, err);
  }
  if (!S_ISREG(st.st_mode)) return InvalidArgument(path + ": not a regular file");
  *file_size = static_cast<uint64_t>(st.st_size);
  std::string bytes(kPrefixBytes, '\0');
  if (*file_size < kPrefixBytes) return CheckHeaderLength(0, *file_size, path);
  auto shrank = [&](uint64_t) { return IOError(path + ": file shrank while its header was read"); };
  RETURN_IF_ERROR(PreadExact(fd.get(), bytes.data(), kPrefixBytes, 0, path, shrank));
  const uint64_t n = LoadLe64(bytes.data());
  RETURN_IF_ERROR(CheckHeaderLength(n, *file_size, path));
  bytes.resize(kPrefixBytes + n);
  RETURN_IF_ERROR(PreadExact(fd.get(), bytes.data() + kPrefixBytes, n, kPrefixBytes, path, shrank));
  return bytes;
}

// Appends `s` as a JSON string the way the Python writer's serializer does:
// '"', '\\' and control characters escaped (short forms where JSON has one,
// else \u00xx), every other byte verbatim.
void AppendJsonString(std::string_view s, std::string* out) {
  static constexpr char kHex[] = "0123456789abcdef";
  out->push_back('"');
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\b':
        *out += "\\b";
        break;
      case '\f':
        *out += "\\f";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      default:
        if (c < 0x20) {
          *out += "\\u00";
          out->push_back(kHex[c >> 4]);
          out->push_back(kHex[c & 0xF]);
        } else {
          out->push_back(ch);
        }
    }
  }
  out->push_back('"');
}

void AppendTensor(const TensorInfo& t, std::string* out) {
  AppendJsonString(t.name, out);
  *out += ":{\"dtype\":\"";
  *out += DTypeName(t.dtype);
  *out += "\",\"shape\":[";
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (i > 0) out->push_back(',');
    *out += std::to_string(t.shape[i]);
  }
  *out += "],\"data_offsets\":[" + std::to_string(t.begin) + "," + std::to_string(t.end) + "]}";
}

Status CheckShardName(const std::string& shard, const std::string& tensor,
                      const std::string& file) {
  const bool plain = !shard.empty() && shard[0] != '.' &&
                     shard.find_first_of(std::string_view("/\\\0", 3)) == std::string::npos &&
                     shard.find("..") == std::string::npos;
  if (plain) return Status::Ok();
  return InvalidArgument(file + ": tensor " + Quote(tensor) + " maps to shard " + Quote(shard) +
                         ", which is not a plain file name");
}

}  // namespace

uint64_t TensorInfo::elements() const {
  uint64_t n = 1;
  for (int64_t dim : shape) n *= static_cast<uint64_t>(dim);
  return n;
}

Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json, uint64_t file_size,
                                                 const std::string& file) {
  RETURN_IF_ERROR(CheckHeaderLength(json.size(), file_size, file));
  RETURN_IF_ERROR(CheckUtf8(json, "header", file));
  SafetensorsHeader header;
  RETURN_IF_ERROR(
      safetensors_internal::ParseHeaderJson(json, file, &header.tensors, &header.metadata));
  header.header_len = json.size();
  header.data_offset = kPrefixBytes + json.size();
  header.data_size = file_size - header.data_offset;
  RETURN_IF_ERROR(CheckLayout(&header.tensors, header.data_size, file));
  return header;
}

Result<SafetensorsHeader> ParseSafetensorsFile(std::string_view bytes, const std::string& file) {
  RETURN_IF_ERROR(CheckHeaderLength(0, bytes.size(), file));
  const uint64_t n = LoadLe64(bytes.data());
  RETURN_IF_ERROR(CheckHeaderLength(n, bytes.size(), file));
  return ParseSafetensorsHeader(bytes.substr(kPrefixBytes, n), bytes.size(), file);
}

Result<SafetensorsHeader> ReadSafetensorsHeader(const std::string& path,
                                                std::string* header_bytes) {
  uint64_t file_size = 0;
  ASSIGN_OR_RETURN(*header_bytes, ReadRawHeader(path, &file_size));
  return ParseSafetensorsHeader(std::string_view(*header_bytes).substr(kPrefixBytes), file_size,
                                path);
}

Result<SafetensorsHeader> ReadSafetensorsHeader(const std::string& path) {
  std::string bytes;
  return ReadSafetensorsHeader(path, &bytes);
}

Result<std::string> ReadSafetensorsHeaderBytes(const std::string& path) {
  uint64_t file_size = 0;
  return ReadRawHeader(path, &file_size);
}

std::string BuildSafetensorsHeader(const std::vector<TensorInfo>& tensors,
                                   const std::map<std::string, std::string>& metadata) {
  std::string json = "{";
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    for (const auto& [key, value] : metadata) {
      if (json.back() != '{') json.push_back(',');
      AppendJsonString(key, &json);
      json.push_back(':');
      AppendJsonString(value, &json);
    }
    json.push_back('}');
  }
  for (const TensorInfo& t : tensors) {
    if (json.size() > 1) json.push_back(',');
    AppendTensor(t, &json);
  }
  json.push_back('}');
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(kPrefixBytes, '\0');
  for (size_t i = 0; i < kPrefixBytes; ++i) out[i] = static_cast<char>(json.size() >> (8 * i));
  return out + json;
}

Result<SafetensorsIndex> ParseSafetensorsIndex(std::string_view json, const std::string& file) {
  RETURN_IF_ERROR(CheckUtf8(json, "index", file));
  SafetensorsIndex index;
  RETURN_IF_ERROR(safetensors_internal::ParseIndexJson(json, file, &index.weight_map));
  std::set<std::string> shards;
  for (const auto& [tensor, shard] : index.weight_map) {
    RETURN_IF_ERROR(CheckShardName(shard, tensor, file));
    shards.insert(shard);
  }
  index.shards.assign(shards.begin(), shards.end());
  return index;
}

}  // namespace dte
