// Fuzzes the S3 XML reader (store/internal/s3_xml.h) on arbitrary bytes.
//
// Input: a selector byte, then the bytes under test.
//   selector % 2 == 0: a document, fed to every S3 body parser.
//   selector % 2 == 1: text, which must survive XmlEscape -> ParseXml
//                      unchanged (inside an element and as an ETag of a
//                      CompleteMultipartUpload body).
// Beyond memory safety, checks that every error is Corruption.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "store/internal/s3_xml.h"

namespace dte::internal {
namespace {

void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "invariant violated: %s\n", what);
  std::abort();
}

void CheckError(const Status& s) { Check(s.ok() || s.code() == Code::kCorruption, "code"); }

void Document(std::string_view doc) {
  auto xml = ParseXml(doc);
  CheckError(xml.status());
  CheckError(ParseListObjectsV2(doc).status());
  CheckError(ParseInitiateMultipartUpload(doc).status());
  CheckError(ParseListMultipartUploads(doc).status());
  CheckError(CheckResultRoot(doc, "CompleteMultipartUploadResult"));
  auto error = ParseErrorBody(doc);
  Check(!error || (xml.ok() && xml->name == "Error"), "error body");
}

void Text(std::string_view text) {
  auto xml = ParseXml("<a>" + XmlEscape(text) + "</a>");
  Check(xml.ok() && xml->text == text, "escape round trip");
  auto body = ParseXml(BuildCompleteMultipartUpload({std::string(text), "x"}));
  Check(body.ok() && body->children.size() == 2 && body->children[0].ChildText("ETag") == text,
        "complete body round trip");
}

}  // namespace
}  // namespace dte::internal

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    dte::internal::Document(in);
  } else {
    dte::internal::Text(in);
  }
  return 0;
}
