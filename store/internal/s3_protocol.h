// Small pieces of the S3 REST protocol that need no network: percent
// encoding and the canonical query string SigV4 signs, payload hashes, and
// the date formats S3 answers with.
//
// Why the client builds the query itself: libcurl 7.88's SigV4 signer
// copies the URL's query string into the canonical request as it is, so the
// URL must already carry it sorted and percent-encoded exactly as SigV4's
// canonical form wants, with "name=" for parameters without a value.
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

// The payload hash that tells S3 the body is not signed.
inline constexpr std::string_view kUnsignedPayload = "UNSIGNED-PAYLOAD";

// RFC 3986 percent-encoding as SigV4 defines it: A-Z a-z 0-9 - _ . ~ stay,
// every other byte becomes %XX (upper-case hex); '/' stays when keep_slash.
std::string UriEncode(std::string_view text, bool keep_slash);

// name -> value; a parameter without a value ("uploads") has an empty one.
using QueryParams = std::vector<std::pair<std::string, std::string>>;

// "a=1&b=&c=x%2Fy": every name and value encoded, sorted by encoded name
// then value, '=' always present. Empty for no parameters.
std::string CanonicalQuery(const QueryParams& params);

// Lower-case hex SHA-256 of `data` (what x-amz-content-sha256 carries).
std::string Sha256Hex(std::string_view data);

// "Sun, 06 Nov 1994 08:49:37 GMT" (HTTP Last-Modified) -> seconds since the
// epoch; nullopt if malformed.
std::optional<int64_t> ParseHttpDate(std::string_view text);

// "2024-05-01T12:34:56.789Z" (S3 XML timestamps) -> seconds since the epoch;
// nullopt if malformed.
std::optional<int64_t> ParseIso8601(std::string_view text);

// `text` with control and non-ASCII bytes as \xNN, cut to `max_bytes`:
// for quoting server-provided text in messages.
std::string PrintableText(std::string_view text, size_t max_bytes);

// `text` with every occurrence of each non-empty secret replaced by
// "[redacted]".
std::string RedactSecrets(std::string text, const std::vector<std::string>& secrets);

}  // namespace dte::internal
