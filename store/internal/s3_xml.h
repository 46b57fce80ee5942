// The few XML documents of the S3 REST API dte reads and writes.
//
// ParseXml is a small tolerant parser for what S3 servers send: elements,
// attributes (skipped), character data with the five predefined entities
// and numeric character references, CDATA, comments and processing
// instructions. Namespace prefixes are dropped from element names. It
// refuses DOCTYPE (no entity expansion) and nesting deeper than
// kMaxXmlDepth, and never reads past its input: malformed bodies are a
// Corruption status, never a crash (tests/fuzz/s3_xml_fuzz.cc).
//
// Grammar accepted (a subset of XML 1.0):
//   document := misc* element misc*
//   misc     := whitespace | "<?" ... "?>" | "<!--" ... "-->"
//   element  := "<" name attr* "/>" | "<" name attr* ">" content "</" name ">"
//   content  := (text | element | "<![CDATA[" ... "]]>" | misc)*
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "store/base/status.h"

namespace dte::internal {

inline constexpr int kMaxXmlDepth = 32;

struct XmlElement {
  std::string name;  // local name, without namespace prefix
  std::string text;  // the element's own character data, entities decoded
  std::vector<XmlElement> children;

  // The first child named `name`, or null.
  const XmlElement* Child(std::string_view child) const;
  // Its text, or "" if there is no such child.
  std::string ChildText(std::string_view child) const;
};

// Corruption "malformed XML (WHY at byte N)" for anything it cannot parse.
Result<XmlElement> ParseXml(std::string_view document);

// <Error><Code>..</Code><Message>..</Message></Error>. nullopt if `body` is
// not such a document.
struct S3ErrorBody {
  std::string code;
  std::string message;
};
std::optional<S3ErrorBody> ParseErrorBody(std::string_view body);

// ListObjectsV2 (GET ?list-type=2): one page.
struct ListObjectsPage {
  std::vector<std::string> keys;
  bool truncated = false;
  std::string next_token;  // NextContinuationToken
};
Result<ListObjectsPage> ParseListObjectsV2(std::string_view body);

// InitiateMultipartUpload (POST ?uploads): the UploadId.
Result<std::string> ParseInitiateMultipartUpload(std::string_view body);

// UploadPartCopy (PUT ?partNumber&uploadId with x-amz-copy-source): the
// part's ETag, from the body (a 200 answer may still be an <Error>).
Result<std::string> ParseCopyPartResult(std::string_view body);

// The body of a 200 answer to CompleteMultipartUpload or CopyObject, which
// may still be an <Error>: OK if its root element is `expected_root`.
Status CheckResultRoot(std::string_view body, std::string_view expected_root);

// ListMultipartUploads (GET ?uploads): one page.
struct MultipartUploadInfo {
  std::string key;
  std::string upload_id;
  std::optional<int64_t> initiated;  // seconds since the epoch
};
struct ListUploadsPage {
  std::vector<MultipartUploadInfo> uploads;
  bool truncated = false;
  std::string next_key_marker;
  std::string next_upload_id_marker;
};
Result<ListUploadsPage> ParseListMultipartUploads(std::string_view body);

// The CompleteMultipartUpload request body for parts 1..n with these ETags.
std::string BuildCompleteMultipartUpload(const std::vector<std::string>& etags);

// `text` with & < > " ' escaped.
std::string XmlEscape(std::string_view text);

}  // namespace dte::internal
