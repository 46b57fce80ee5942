// Chunk entries of CachedStore's index (cache entries, Index::PutCacheEntry).
//
// Key:   "blobchunk/" hash:32 hex '/' chunk:8 hex   (lowercase)
// Value, all integers big-endian:
//   entry  := format:u8 (= 1) chunk_bytes:be64 blob_size:be64 generation:be64
//             tick:be64 pages:be32 page_hash:be64{pages}
// The page size is fixed by the format (kCachePageBytes = 64 KiB); a chunk
// of length L has ceil(L / 64 KiB) pages. An entry whose chunk_bytes differs
// from the cache's current chunk size is dropped at open.
//
// Files: CACHE/hh/<hash>.<chunk:8 hex>.<generation:16 hex>; the generation
// makes every kept chunk's file name unique, so a file being deleted is
// never a newer copy of the same chunk.
#include "store/internal/chunk_entry.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "store/hash.h"

namespace dte::internal {
namespace {

constexpr uint8_t kFormat = 1;
constexpr std::string_view kBlobPrefix = "blobs/";
constexpr size_t kHashHex = 32;
constexpr size_t kFixedBytes = 1 + 8 * 4 + 4;

void PutBe(std::string* out, uint64_t v, int bytes) {
  for (int i = bytes - 1; i >= 0; --i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetBe(std::string_view in, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v = (v << 8) | static_cast<uint8_t>(in[at + i]);
  return v;
}

bool IsLowerHex(std::string_view s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

std::optional<uint64_t> ParseHex(std::string_view s, size_t digits) {
  if (s.size() != digits || !IsLowerHex(s)) return std::nullopt;
  uint64_t v = 0;
  for (char c : s) v = (v << 4) | static_cast<uint64_t>(c <= '9' ? c - '0' : c - 'a' + 10);
  return v;
}

std::string Hex(uint64_t v, int digits) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%0*llx", digits, static_cast<unsigned long long>(v));
  return buf;
}

// The 32 hex digits of a blob key.
std::string_view HashOf(std::string_view blob_key) {
  return blob_key.substr(blob_key.size() - kHashHex);
}

std::string BlobKeyOf(std::string_view hash) {
  return std::string(kBlobPrefix) + std::string(hash.substr(0, 2)) + "/" + std::string(hash);
}

}  // namespace

std::string ChunkEntryKey(std::string_view blob_key, uint32_t chunk) {
  return std::string(kChunkEntryPrefix) + std::string(HashOf(blob_key)) + "/" + Hex(chunk, 8);
}

std::optional<std::pair<std::string, uint32_t>> ParseChunkEntryKey(std::string_view key) {
  const std::string_view prefix = kChunkEntryPrefix;
  if (!key.starts_with(prefix) || key.size() != prefix.size() + kHashHex + 1 + 8) {
    return std::nullopt;
  }
  key.remove_prefix(prefix.size());
  const std::string_view hash = key.substr(0, kHashHex);
  auto chunk = ParseHex(key.substr(kHashHex + 1), 8);
  if (!IsLowerHex(hash) || key[kHashHex] != '/' || !chunk) return std::nullopt;
  return std::make_pair(BlobKeyOf(hash), static_cast<uint32_t>(*chunk));
}

std::string EncodeChunkEntry(const ChunkEntry& e) {
  std::string out;
  out.reserve(kFixedBytes + 8 * e.pages.size());
  out.push_back(static_cast<char>(kFormat));
  PutBe(&out, e.chunk_bytes, 8);
  PutBe(&out, e.blob_size, 8);
  PutBe(&out, e.generation, 8);
  PutBe(&out, e.tick, 8);
  PutBe(&out, e.pages.size(), 4);
  for (uint64_t h : e.pages) PutBe(&out, h, 8);
  return out;
}

std::optional<ChunkEntry> DecodeChunkEntry(std::string_view value) {
  if (value.size() < kFixedBytes || static_cast<uint8_t>(value[0]) != kFormat) return std::nullopt;
  ChunkEntry e;
  e.chunk_bytes = GetBe(value, 1, 8);
  e.blob_size = GetBe(value, 9, 8);
  e.generation = GetBe(value, 17, 8);
  e.tick = GetBe(value, 25, 8);
  const uint64_t pages = GetBe(value, 33, 4);
  if (value.size() != kFixedBytes + 8 * pages) return std::nullopt;
  for (uint64_t i = 0; i < pages; ++i) e.pages.push_back(GetBe(value, kFixedBytes + 8 * i, 8));
  return e;
}

std::string ChunkFileName(std::string_view blob_key, uint32_t chunk, uint64_t generation) {
  const std::string_view hash = HashOf(blob_key);
  return std::string(hash.substr(0, 2)) + "/" + std::string(hash) + "." + Hex(chunk, 8) + "." +
         Hex(generation, 16);
}

std::optional<ChunkFile> ParseChunkFileName(std::string_view dir, std::string_view name) {
  // <32 hex> '.' <8 hex> '.' <16 hex>
  if (name.size() != kHashHex + 1 + 8 + 1 + 16 || name[kHashHex] != '.' ||
      name[kHashHex + 9] != '.') {
    return std::nullopt;
  }
  const std::string_view hash = name.substr(0, kHashHex);
  auto chunk = ParseHex(name.substr(kHashHex + 1, 8), 8);
  auto generation = ParseHex(name.substr(kHashHex + 10), 16);
  if (!IsLowerHex(hash) || hash.substr(0, 2) != dir || !chunk || !generation) return std::nullopt;
  return ChunkFile{BlobKeyOf(hash), static_cast<uint32_t>(*chunk), *generation};
}

void RemoveFiles(const std::vector<std::string>& paths) {
  for (const std::string& p : paths) ::unlink(p.c_str());
}

std::vector<uint64_t> PageHashes(std::string_view data, uint64_t page_bytes) {
  std::vector<uint64_t> out;
  for (uint64_t at = 0; at < data.size(); at += page_bytes) {
    out.push_back(HashBlock(data.data() + at, std::min<uint64_t>(page_bytes, data.size() - at)));
  }
  return out;
}

}  // namespace dte::internal
