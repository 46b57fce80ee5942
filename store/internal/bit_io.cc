#include "store/internal/bit_io.h"

namespace dte::internal {

void PutVarint32(std::string* out, uint32_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

bool GetVarint32(std::string_view* in, uint32_t* v) {
  uint32_t result = 0;
  for (int i = 0; i < 5 && static_cast<size_t>(i) < in->size(); ++i) {
    uint32_t byte = static_cast<uint8_t>((*in)[i]);
    if (i == 4 && byte > 0x0f) return false;  // more than 32 bits
    result |= (byte & 0x7f) << (7 * i);
    if (byte < 0x80) {
      in->remove_prefix(i + 1);
      *v = result;
      return true;
    }
  }
  return false;
}

bool GetByte(std::string_view* in, uint8_t* v) {
  if (in->empty()) return false;
  *v = static_cast<uint8_t>(in->front());
  in->remove_prefix(1);
  return true;
}

}  // namespace dte::internal
