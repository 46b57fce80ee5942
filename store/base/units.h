// Byte sizes on command lines, and defaults the command-line tools share.
//
// Sizes: "512MiB", "2GiB", "5GB", "64M", "1048576". Binary suffixes (KiB,
// MiB, GiB, TiB, and the single letters K, M, G, T) are powers of 1024;
// decimal ones (KB, MB, GB, TB) powers of 1000, as Hugging Face's
// `max_shard_size` reads them. Suffixes are case-sensitive; a bare number is
// bytes; zero is allowed (callers that need a positive size check).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "store/base/status.h"

namespace dte {

Result<uint64_t> ParseByteSize(std::string_view text);

// "1.50 GiB", "512.00 MiB", "123 B": for logs.
std::string FormatByteSize(uint64_t bytes);

// The host-local cache directory for indexes and caches: $DTE_CACHE_DIR,
// else $XDG_CACHE_HOME/dte, else ~/.cache/dte.
std::string DefaultCacheDir();

}  // namespace dte
