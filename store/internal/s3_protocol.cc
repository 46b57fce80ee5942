#include "store/internal/s3_protocol.h"

#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <cstdio>

namespace dte::internal {
namespace {

bool IsUnreserved(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_' || c == '.' || c == '~';
}

// Parses exactly `text.size()` decimal digits.
std::optional<int> Digits(std::string_view text) {
  if (text.empty() || text.size() > 9) return std::nullopt;
  int value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + (c - '0');
  }
  return value;
}

// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
// days_from_civil).
int64_t DaysFromCivil(int64_t y, int m, int d) {
  y -= m <= 2;
  const int64_t era = (y >= 0 ? y : y - 399) / 400;
  const int64_t yoe = y - era * 400;
  const int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
  const int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + doe - 719468;
}

std::optional<int64_t> EpochSeconds(int year, int month, int day, int hour, int minute,
                                    int second) {
  if (month < 1 || month > 12 || day < 1 || day > 31 || hour > 23 || minute > 59 || second > 60) {
    return std::nullopt;
  }
  return DaysFromCivil(year, month, day) * 86400 + hour * 3600 + minute * 60 + second;
}

// "HH:MM:SS" -> {h, m, s}.
std::optional<std::array<int, 3>> ParseClock(std::string_view t) {
  if (t.size() != 8 || t[2] != ':' || t[5] != ':') return std::nullopt;
  auto h = Digits(t.substr(0, 2)), m = Digits(t.substr(3, 2)), s = Digits(t.substr(6, 2));
  if (!h || !m || !s) return std::nullopt;
  return std::array<int, 3>{*h, *m, *s};
}

}  // namespace

std::string UriEncode(std::string_view text, bool keep_slash) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (IsUnreserved(c) || (keep_slash && c == '/')) {
      out += c;
    } else {
      const auto u = static_cast<unsigned char>(c);
      out += '%';
      out += kHex[u >> 4];
      out += kHex[u & 15];
    }
  }
  return out;
}

std::string CanonicalQuery(const QueryParams& params) {
  std::vector<std::pair<std::string, std::string>> encoded;
  encoded.reserve(params.size());
  for (const auto& [name, value] : params) {
    encoded.emplace_back(UriEncode(name, false), UriEncode(value, false));
  }
  std::sort(encoded.begin(), encoded.end());
  std::string out;
  for (const auto& [name, value] : encoded) {
    if (!out.empty()) out += '&';
    out += name;
    out += '=';
    out += value;
  }
  return out;
}

std::string Sha256Hex(std::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  // EVP_Digest fails only on allocation failure; an empty hash then fails
  // the request's signature check instead of passing silently.
  if (EVP_Digest(data.data(), data.size(), digest, &len, EVP_sha256(), nullptr) != 1) return "";
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) {
    out += kHex[digest[i] >> 4];
    out += kHex[digest[i] & 15];
  }
  return out;
}

std::optional<int64_t> ParseHttpDate(std::string_view text) {
  // "Sun, 06 Nov 1994 08:49:37 GMT"
  static constexpr std::string_view kMonths[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                                 "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
  const size_t comma = text.find(", ");
  if (comma == std::string_view::npos) return std::nullopt;
  std::string_view rest = text.substr(comma + 2);
  if (rest.size() != 24 || rest[2] != ' ' || rest[6] != ' ' || rest[11] != ' ' || rest[20] != ' ' ||
      rest.substr(21) != "GMT") {
    return std::nullopt;
  }
  const auto month = std::find(std::begin(kMonths), std::end(kMonths), rest.substr(3, 3));
  auto day = Digits(rest.substr(0, 2));
  auto year = Digits(rest.substr(7, 4));
  auto clock = ParseClock(rest.substr(12, 8));
  if (month == std::end(kMonths) || !day || !year || !clock) return std::nullopt;
  return EpochSeconds(*year, static_cast<int>(month - std::begin(kMonths)) + 1, *day, (*clock)[0],
                      (*clock)[1], (*clock)[2]);
}

std::optional<int64_t> ParseIso8601(std::string_view text) {
  // "2024-05-01T12:34:56[.fraction]Z"
  if (text.size() < 20 || text[4] != '-' || text[7] != '-' || text[10] != 'T' ||
      text.back() != 'Z') {
    return std::nullopt;
  }
  auto year = Digits(text.substr(0, 4));
  auto month = Digits(text.substr(5, 2));
  auto day = Digits(text.substr(8, 2));
  auto clock = ParseClock(text.substr(11, 8));
  std::string_view fraction = text.substr(19, text.size() - 20);
  if (!fraction.empty() &&
      (fraction.size() < 2 || fraction[0] != '.' ||
       fraction.find_first_not_of("0123456789", 1) != std::string_view::npos)) {
    return std::nullopt;
  }
  if (!year || !month || !day || !clock) return std::nullopt;
  return EpochSeconds(*year, *month, *day, (*clock)[0], (*clock)[1], (*clock)[2]);
}

std::string PrintableText(std::string_view text, size_t max_bytes) {
  std::string out;
  for (char c : text.substr(0, max_bytes)) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f) {
      out += c;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", u);
      out += buf;
    }
  }
  if (text.size() > max_bytes) out += "...";
  return out;
}

std::string RedactSecrets(std::string text, const std::vector<std::string>& secrets) {
  for (const std::string& secret : secrets) {
    if (secret.empty()) continue;
    for (size_t pos = text.find(secret); pos != std::string::npos;
         pos = text.find(secret, pos + 10)) {
      text.replace(pos, secret.size(), "[redacted]");
    }
  }
  return text;
}

}  // namespace dte::internal
