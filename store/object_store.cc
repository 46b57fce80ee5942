// OpenObjectStore and the key grammar shared by every ObjectStore.
#include "store/object_store.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "store/listing_check.h"
#include "store/local_store.h"
#include "store/s3_store.h"

namespace dte {
namespace {

constexpr size_t kMaxKeyBytes = 1024;     // what S3 allows
constexpr size_t kMaxSegmentBytes = 255;  // NAME_MAX of common filesystems

bool IsKeyByte(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

// The key as text a terminal shows: control and non-ASCII bytes as \xNN.
std::string Printable(std::string_view key) {
  std::string out;
  for (char c : key) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f) {
      out += c;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", u);
      out += buf;
    }
  }
  return out;
}

// Why `segment` (a whole segment unless `partial`) is not allowed, or nullptr.
const char* SegmentError(std::string_view segment, bool partial) {
  if (segment.size() > kMaxSegmentBytes) return "a segment is longer than 255 bytes";
  for (char c : segment) {
    if (!IsKeyByte(c)) return "only [A-Za-z0-9._-] segments separated by '/' are allowed";
  }
  if (partial) return nullptr;
  if (segment.empty()) return "empty segment";
  if (segment == "." || segment == "..") return "'.' and '..' segments are not allowed";
  return nullptr;
}

// Checks the segments of `text`; with `partial_last`, the part after the
// last '/' may be any run of key bytes (a List prefix).
Status CheckSegments(std::string_view text, bool partial_last, const char* what) {
  auto invalid = [&](const char* why) {
    return InvalidArgument(std::string("invalid object ") + what + " \"" + Printable(text) +
                           "\": " + why);
  };
  if (text.size() > kMaxKeyBytes) return invalid("longer than 1024 bytes");
  if (text.starts_with('/')) return invalid("it must be relative (no leading '/')");
  for (size_t start = 0;;) {
    const size_t end = std::min(text.find('/', start), text.size());
    const bool last = end == text.size();
    if (const char* why = SegmentError(text.substr(start, end - start), last && partial_last)) {
      return invalid(why);
    }
    if (last) return Status::Ok();
    start = end + 1;
  }
}

}  // namespace

Status ValidateObjectKey(std::string_view key) {
  if (key.empty()) return InvalidArgument("invalid object key \"\": empty");
  return CheckSegments(key, /*partial_last=*/false, "key");
}

Status ValidateObjectKeyPrefix(std::string_view prefix) {
  return CheckSegments(prefix, /*partial_last=*/true, "key prefix");
}

Result<std::vector<std::string>> ObjectStore::ListStoreKeys(const std::string& prefix) {
  ASSIGN_OR_RETURN(auto keys, List(prefix));
  if (std::string why = CheckListedPage(prefix, keys, ""); !why.empty()) {
    return Corruption("the listing of " + prefix + " in store " + Describe() +
                      " is damaged: " + why);
  }
  return keys;
}

Result<std::unique_ptr<ObjectStore>> OpenObjectStore(const std::string& uri, bool create) {
  if (uri.starts_with("s3://")) {
    ASSIGN_OR_RETURN(S3Location location, ParseS3Uri(uri));
    // The endpoint comes from AWS_ENDPOINT_URL (dtectl --endpoint sets it).
    auto options = S3OptionsFromEnvironment();
    if (!options.ok()) return options.status().WithContext("store " + uri);
    return OpenS3Store(location.bucket, location.prefix, *options, create);
  }
  std::string path = uri;
  if (path.starts_with("file://")) path.erase(0, 7);
  if (path.find("://") != std::string::npos) {
    return InvalidArgument("store " + uri + ": unknown scheme (use a directory or s3://)");
  }
  LocalStoreOptions options;
  options.create = create;
  ASSIGN_OR_RETURN(std::unique_ptr<LocalStore> store, LocalStore::Open(path, options));
  return std::unique_ptr<ObjectStore>(std::move(store));
}

}  // namespace dte
