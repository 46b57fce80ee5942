// Content hashes. Blobs and tensors use XXH3-128, blocks use XXH3-64; both
// are printed as lowercase hex, XXH3-128 in its canonical (big-endian) form,
// so `python -c "import xxhash; xxhash.xxh3_128_hexdigest(b)"` agrees.
//
// Thread-safety: Hasher128 is a value type, one per thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace dte {

struct Hash128 {
  uint64_t high = 0;
  uint64_t low = 0;
  bool operator==(const Hash128&) const = default;
  std::string Hex() const;  // 32 hex digits
  static std::optional<Hash128> FromHex(std::string_view hex);
};

uint64_t HashBlock(const void* data, size_t len);  // XXH3-64, seed 0
Hash128 HashBytes(const void* data, size_t len);   // XXH3-128, seed 0
std::string Hex64(uint64_t h);                     // 16 hex digits
std::optional<uint64_t> FromHex64(std::string_view hex);

// Streaming XXH3-128: Update() over consecutive pieces gives HashBytes() of
// their concatenation.
class Hasher128 {
 public:
  Hasher128();
  ~Hasher128();
  Hasher128(Hasher128&&) noexcept;
  Hasher128& operator=(Hasher128&&) noexcept;
  void Update(const void* data, size_t len);
  Hash128 Finish() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace dte
