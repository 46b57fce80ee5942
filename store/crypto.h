// The cryptographic primitives dte uses, from OpenSSL's libcrypto (the one
// place that includes it besides the S3 request signer): random bytes for
// nonces and secrets, HMAC-SHA256, and a comparison whose time does not
// depend on where two MACs differ.
//
// Thread-safety: thread-safe (libcrypto 3 initializes itself once).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "store/base/status.h"

namespace dte::crypto {

inline constexpr size_t kSha256Bytes = 32;
using Mac = std::array<uint8_t, kSha256Bytes>;

// `n` bytes from the operating system's CSPRNG (RAND_bytes); Internal when
// libcrypto cannot seed it.
Status RandomBytes(void* out, size_t n);

// HMAC-SHA256 of `data` under `key`; Internal when libcrypto fails (out of
// memory).
Result<Mac> HmacSha256(std::string_view key, std::string_view data);

// True when the n bytes at a and b are equal, in time independent of their
// contents (CRYPTO_memcmp).
bool EqualInConstantTime(const void* a, const void* b, size_t n);

}  // namespace dte::crypto
