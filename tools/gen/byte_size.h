// Byte sizes on the command line: "512MiB", "2GiB", "5GB", "1048576".
//
// Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones
// (KB, MB, GB, TB) powers of 1000, as Hugging Face's `max_shard_size` reads
// them. Suffixes are case-sensitive; a bare number is bytes.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "store/status.h"

namespace dte::gen {

Result<uint64_t> ParseByteSize(std::string_view text);

// "1.50 GiB", "512.00 MiB", "123 B": for logs.
std::string FormatByteSize(uint64_t bytes);

}  // namespace dte::gen
