// Listing checks: what a listing of the store's own prefixes may hold.
//
// A listing is checked like a body: under the prefixes the store writes and
// parses (manifests/, joins/, exchange/, blobs/) every key must be in that
// prefix's grammar, and the keys of a page, and of a listing's pages in
// turn, must be strictly increasing. A key that is not is not a "foreign
// object" to skip: it is a listing damaged in transit (a flipped byte, a
// cut page), and the listing is asked for again (docs/s3.md, "Listings").
//
//   manifests/  manifests/vNNNNNNNN.json, manifests/vNNNNNNNN.rR.json
//               (ParseManifestKey)
//   joins/      joins/vNNNNNNNN.json (ParseJoinKey)
//   blobs/      blobs/hh/<32 hex digits>, hh the first two of them
//   exchange/   any key in the object key grammar (ValidateObjectKey)
//
// Thread-safety: pure functions.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace dte {

// True if keys listed under `prefix` are checked (the prefix lies inside
// one of the store's own prefixes, or is one of them).
bool IsCheckedListingPrefix(std::string_view prefix);

// Why `key`, listed under the checked prefix `prefix`, cannot be an object
// of the store ("" when it can): outside its prefix's grammar, or not
// starting with `prefix`.
std::string CheckListedKey(std::string_view prefix, std::string_view key);

// Why one page of keys of a listing under `prefix` is damaged ("" when it
// is not): a key outside the grammar (CheckListedKey; with `grammar`
// false, only a key not starting with `prefix`), keys not strictly
// increasing, or a first key not after `after` (the last key of the pages
// before it, or the start-after key; "" for none).
std::string CheckListedPage(std::string_view prefix, const std::vector<std::string>& keys,
                            std::string_view after, bool grammar = true);

}  // namespace dte
