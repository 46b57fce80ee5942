// Byte and bit stream primitives of the delta block codec (the varint32 and
// bit-field rules of the grammar at the top of store/delta_codec.cc).
//
// The bit reader and writer sit on the codec's per-element paths, so they
// are defined here, inline.
//
// Thread-safety: the functions are pure; a BitWriter or BitReader belongs to
// one thread.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace dte::internal {

// Appends `v` as a varint32: little-endian base-128, 7 bits a byte, high bit
// set on every byte but the last; at most 5 bytes.
void PutVarint32(std::string* out, uint32_t v);

// Takes a varint32 off the front of `*in`. False, leaving `*in` as it was,
// when it is truncated, longer than 5 bytes or holds more than 32 bits.
bool GetVarint32(std::string_view* in, uint32_t* v);

// Takes one byte off the front of `*in`; false if it is empty.
bool GetByte(std::string_view* in, uint8_t* v);

// Writes bit fields into `*out`, least significant bit first; Finish
// zero-pads the last byte and trims `*out` to the bytes written. The caller
// bounds the total size up front, so that the writer can store whole 64-bit
// words into a buffer sized once instead of appending byte by byte.
class BitWriter {
 public:
  // `*out` is replaced; at most max_bits bits may be put before Finish.
  BitWriter(std::string* out, size_t max_bits) : out_(out) {
    out_->clear();
    out_->resize(max_bits / 8 + sizeof(uint64_t));
    p_ = reinterpret_cast<uint8_t*>(out_->data());
  }

  void Put(uint64_t v, int n) {  // v < 2^n, n <= 64
    if (n > 56) {
      Put56(v & 0xFFFFFFFF, 32);
      v >>= 32;
      n -= 32;
    }
    Put56(v, n);
  }
  void Finish() {
    Store(acc_);  // the buffer has room for a whole word past the bits put
    out_->resize(p_ + (used_ + 7) / 8 - reinterpret_cast<uint8_t*>(out_->data()));
  }

 private:
  // Without a branch on whether a byte is complete: stores the whole
  // accumulator each time and moves on by the complete bytes.
  void Put56(uint64_t v, int n) {  // v < 2^n, n <= 56
    acc_ |= v << used_;            // used_ < 8
    used_ += n;
    Store(acc_);
    p_ += used_ >> 3;
    acc_ >>= used_ & ~7;
    used_ &= 7;
  }
  void Store(uint64_t word) {
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(p_, &word, sizeof word);
    } else {
      for (size_t i = 0; i < sizeof word; ++i, word >>= 8) p_[i] = static_cast<uint8_t>(word);
    }
  }

  std::string* out_;
  uint8_t* p_;
  uint64_t acc_ = 0;
  int used_ = 0;
};

// Reads what BitWriter wrote. Every read fails, rather than reading past the
// end, when the stream is too short. Bits of buf_ above avail_ are zero.
class BitReader {
 public:
  BitReader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}

  bool Read(int n, uint64_t* v) {  // n <= 64
    if (n <= 32) return Read32(n, v);
    uint64_t low = 0, high = 0;
    if (!Read32(32, &low) || !Read32(n - 32, &high)) return false;
    *v = low | high << 32;
    return true;
  }
  // Consumes zero bits up to and including the next one bit; fails when more
  // than max_zeros zeros come first.
  bool ReadZeroRun(int max_zeros, int* zeros) {
    int z = 0;
    while (true) {
      if (avail_ == 0) Refill();
      if (avail_ == 0) return false;
      if (buf_ == 0) {
        z += avail_;
        avail_ = 0;
        if (z > max_zeros) return false;
        continue;
      }
      int t = std::countr_zero(buf_);
      z += t;
      if (z > max_zeros) return false;
      buf_ = (buf_ >> t) >> 1;
      avail_ -= t + 1;
      *zeros = z;
      return true;
    }
  }
  // For decoders' fast paths: makes at least n <= 56 bits available when the
  // stream has them (false otherwise), after which Take(m) for a total of
  // m <= n bits needs no further check.
  bool Ensure(int n) {
    if (avail_ < n) Refill();
    return avail_ >= n;
  }
  uint64_t Take(int n) {  // n <= the bits Ensure made available, n < 64
    const uint64_t v = buf_ & ((uint64_t{1} << n) - 1);
    buf_ >>= n;
    avail_ -= n;
    return v;
  }
  // True when only zero padding of the last byte remains.
  bool AtCleanEnd() const { return p_ == end_ && avail_ < 8 && buf_ == 0; }

 private:
  bool Read32(int n, uint64_t* v) {
    if (avail_ < n) Refill();
    if (avail_ < n) return false;
    *v = buf_ & ((uint64_t{1} << n) - 1);
    buf_ >>= n;
    avail_ -= n;
    return true;
  }
  void Refill() {
    if (std::endian::native == std::endian::little && end_ - p_ >= 8) {
      uint64_t word;
      std::memcpy(&word, p_, 8);
      int bytes = (63 - avail_) >> 3;
      buf_ |= word << avail_;
      p_ += bytes;
      avail_ += bytes * 8;
      buf_ &= (uint64_t{1} << avail_) - 1;  // avail_ <= 63: drop the bytes not taken
      return;
    }
    while (avail_ <= 56 && p_ < end_) {
      buf_ |= uint64_t{*p_++} << avail_;
      avail_ += 8;
    }
  }

  const uint8_t* p_;
  const uint8_t* end_;
  uint64_t buf_ = 0;
  int avail_ = 0;
};

}  // namespace dte::internal
