#include "store/crypto.h"

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>
#include <climits>
#include <string>

namespace dte::crypto {

Status RandomBytes(void* out, size_t n) {
  auto* p = static_cast<unsigned char*>(out);
  while (n > 0) {
    const int chunk = static_cast<int>(std::min<size_t>(n, INT_MAX));
    if (RAND_bytes(p, chunk) != 1) {
      char why[256] = {};
      ERR_error_string_n(ERR_get_error(), why, sizeof why);
      return Internal(std::string("RAND_bytes: ") + why);
    }
    p += chunk;
    n -= static_cast<size_t>(chunk);
  }
  return Status::Ok();
}

Result<Mac> HmacSha256(std::string_view key, std::string_view data) {
  Mac mac{};
  unsigned int len = 0;
  if (key.size() > INT_MAX ||
      HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(data.data()), data.size(), mac.data(),
           &len) == nullptr ||
      len != mac.size()) {
    return Internal("HMAC-SHA256 failed in libcrypto");
  }
  return mac;
}

bool EqualInConstantTime(const void* a, const void* b, size_t n) {
  return CRYPTO_memcmp(a, b, n) == 0;
}

}  // namespace dte::crypto
