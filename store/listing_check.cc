#include "store/listing_check.h"

#include <array>

#include "store/hash.h"
#include "store/local_store.h"
#include "store/manifest.h"

namespace dte {
namespace {

constexpr std::array<std::string_view, 4> kOwnPrefixes = {"manifests/", "joins/", "exchange/",
                                                          "blobs/"};

bool IsBlobKey(std::string_view key) {
  constexpr std::string_view kBlobs = "blobs/";
  if (!key.starts_with(kBlobs)) return false;
  const std::string_view hex = key.substr(key.rfind('/') + 1);
  const auto hash = Hash128::FromHex(hex);
  return hash && BlobKey(*hash) == key;
}

std::string Quoted(std::string_view key) { return "\"" + std::string(key) + "\""; }

}  // namespace

bool IsCheckedListingPrefix(std::string_view prefix) {
  for (std::string_view own : kOwnPrefixes) {
    if (prefix.starts_with(own)) return true;
  }
  return false;
}

std::string CheckListedKey(std::string_view prefix, std::string_view key) {
  if (!key.starts_with(prefix)) {
    return "key " + Quoted(key) + " does not start with the prefix " + Quoted(prefix);
  }
  if (!ValidateObjectKey(key).ok()) return "key " + Quoted(key) + " is outside the key grammar";
  bool ok = true;
  if (key.starts_with("manifests/")) {
    ok = ParseManifestKey(key).has_value();
  } else if (key.starts_with(kJoinPrefix)) {
    ok = ParseJoinKey(key).has_value();
  } else if (key.starts_with("blobs/")) {
    ok = IsBlobKey(key);
  }
  if (!ok) return "key " + Quoted(key) + " is not a name the store writes there";
  return "";
}

std::string CheckListedPage(std::string_view prefix, const std::vector<std::string>& keys,
                            std::string_view after, bool grammar) {
  std::string_view previous = after;
  for (const std::string& key : keys) {
    if (grammar) {
      if (std::string why = CheckListedKey(prefix, key); !why.empty()) return why;
    } else if (!key.starts_with(prefix)) {
      return "key " + Quoted(key) + " does not start with the prefix " + Quoted(prefix);
    }
    if (!previous.empty() && key <= previous) {
      return "key " + Quoted(key) + " does not sort after " + Quoted(previous) +
             " (keys out of order or repeated)";
    }
    previous = key;
  }
  return "";
}

}  // namespace dte
