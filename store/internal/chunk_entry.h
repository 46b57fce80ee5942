// The index entries and file names of CachedStore's chunks (see
// store/cached_store.h). The value's grammar is at the top of
// chunk_entry.cc.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dte::internal {

inline constexpr char kChunkEntryPrefix[] = "blobchunk/";

struct ChunkEntry {
  uint64_t chunk_bytes = 0;  // the layout the chunk was cut with
  uint64_t blob_size = 0;
  uint64_t generation = 0;      // names the file; unique per kept chunk
  uint64_t tick = 0;            // last use, for the LRU order
  std::vector<uint64_t> pages;  // XXH3-64 of each kCachePageBytes page
};

// "blobchunk/<32 hex>/<8 hex chunk>" for the chunk of blob key
// "blobs/hh/<32 hex>".
std::string ChunkEntryKey(std::string_view blob_key, uint32_t chunk);
// The inverse: blob key and chunk, or nullopt for a malformed key.
std::optional<std::pair<std::string, uint32_t>> ParseChunkEntryKey(std::string_view key);

std::string EncodeChunkEntry(const ChunkEntry& e);
// nullopt for a value that does not parse (wrong format version, length).
std::optional<ChunkEntry> DecodeChunkEntry(std::string_view value);

// "hh/<32 hex>.<8 hex chunk>.<16 hex generation>", relative to the cache
// directory.
std::string ChunkFileName(std::string_view blob_key, uint32_t chunk, uint64_t generation);
// The inverse for a file name inside hh/: blob key, chunk and generation.
struct ChunkFile {
  std::string blob_key;
  uint32_t chunk = 0;
  uint64_t generation = 0;
};
std::optional<ChunkFile> ParseChunkFileName(std::string_view dir, std::string_view name);

// Deletes the files (errors ignored: a file left over is removed at the
// next open).
void RemoveFiles(const std::vector<std::string>& paths);

// XXH3-64 of each page of `data`.
std::vector<uint64_t> PageHashes(std::string_view data, uint64_t page_bytes);

}  // namespace dte::internal
