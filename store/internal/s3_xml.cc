#include "store/internal/s3_xml.h"

#include <utility>

#include "store/internal/s3_protocol.h"

namespace dte::internal {
namespace {

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

bool IsNameByte(char c) {
  return !IsSpace(c) && c != '<' && c != '>' && c != '/' && c != '=' && c != '"' && c != '\'' &&
         c != '&';
}

// Appends code point `cp` as UTF-8; false if it is not a valid XML character.
bool AppendUtf8(uint32_t cp, std::string* out) {
  if (cp == 0 || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
  if (cp < 0x80) {
    *out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    *out += static_cast<char>(0xC0 | (cp >> 6));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    *out += static_cast<char>(0xE0 | (cp >> 12));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    *out += static_cast<char>(0xF0 | (cp >> 18));
    *out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return true;
}

// "#123" or "#x7B" -> the code point; nullopt if malformed.
std::optional<uint32_t> CharRef(std::string_view ref) {
  const bool hex = ref.size() > 1 && ref[1] == 'x';
  std::string_view digits = ref.substr(hex ? 2 : 1);
  if (digits.empty() || digits.size() > 8) return std::nullopt;
  uint32_t cp = 0;
  for (char c : digits) {
    int v = -1;
    if (c >= '0' && c <= '9') v = c - '0';
    if (hex && c >= 'a' && c <= 'f') v = c - 'a' + 10;
    if (hex && c >= 'A' && c <= 'F') v = c - 'A' + 10;
    if (v < 0) return std::nullopt;
    cp = cp * (hex ? 16 : 10) + static_cast<uint32_t>(v);
  }
  return cp;
}

class Parser {
 public:
  explicit Parser(std::string_view doc) : doc_(doc) {}

  Result<XmlElement> Document() {
    RETURN_IF_ERROR(SkipMisc());
    if (!Peek("<")) return Error("no root element");
    XmlElement root;
    RETURN_IF_ERROR(Element(1, &root));
    RETURN_IF_ERROR(SkipMisc());
    if (pos_ != doc_.size()) return Error("content after the root element");
    return root;
  }

 private:
  bool Peek(std::string_view s) const { return doc_.substr(pos_).starts_with(s); }

  Status Error(const std::string& why) const {
    return Corruption("malformed XML (" + why + " at byte " + std::to_string(pos_) + ")");
  }

  // Moves past the next `end`; error if there is none.
  Status SkipPast(std::string_view end, const char* what) {
    const size_t at = doc_.find(end, pos_);
    if (at == std::string_view::npos) return Error(std::string("unterminated ") + what);
    pos_ = at + end.size();
    return Status::Ok();
  }

  // Skips a comment or processing instruction at pos_, if there is one.
  Result<bool> SkipMarkup() {
    if (Peek("<!--")) {
      RETURN_IF_ERROR(SkipPast("-->", "comment"));
      return true;
    }
    if (Peek("<?")) {
      RETURN_IF_ERROR(SkipPast("?>", "processing instruction"));
      return true;
    }
    if (Peek("<!DOCTYPE") || Peek("<!ENTITY")) return Error("DOCTYPE is not supported");
    return false;
  }

  Status SkipMisc() {
    for (;;) {
      while (pos_ < doc_.size() && IsSpace(doc_[pos_])) ++pos_;
      ASSIGN_OR_RETURN(bool skipped, SkipMarkup());
      if (!skipped) return Status::Ok();
    }
  }

  Result<std::string> Name() {
    const size_t start = pos_;
    while (pos_ < doc_.size() && IsNameByte(doc_[pos_])) ++pos_;
    if (pos_ == start) return Error("expected a name");
    std::string_view name = doc_.substr(start, pos_ - start);
    const size_t colon = name.rfind(':');
    if (colon != std::string_view::npos) name.remove_prefix(colon + 1);
    if (name.empty()) return Error("empty local name");
    return std::string(name);
  }

  // Skips attributes up to '>' or "/>"; true for an empty element.
  Result<bool> SkipAttributes() {
    while (pos_ < doc_.size()) {
      const char c = doc_[pos_];
      if (c == '>') {
        ++pos_;
        return false;
      }
      if (c == '/' && Peek("/>")) {
        pos_ += 2;
        return true;
      }
      if (c == '"' || c == '\'') {
        const size_t end = doc_.find(c, pos_ + 1);
        if (end == std::string_view::npos) return Error("unterminated attribute value");
        pos_ = end + 1;
        continue;
      }
      if (c == '<') return Error("'<' inside a tag");
      ++pos_;
    }
    return Error("unterminated tag");
  }

  // Character data up to the next '<', entities decoded, appended to `out`.
  Status Text(std::string* out) {
    while (pos_ < doc_.size() && doc_[pos_] != '<') {
      const char c = doc_[pos_];
      if (c != '&') {
        *out += c;
        ++pos_;
        continue;
      }
      const size_t semi = doc_.find(';', pos_);
      if (semi == std::string_view::npos || semi - pos_ > 12) return Error("bad entity");
      std::string_view ref = doc_.substr(pos_ + 1, semi - pos_ - 1);
      if (ref == "lt")
        *out += '<';
      else if (ref == "gt")
        *out += '>';
      else if (ref == "amp")
        *out += '&';
      else if (ref == "quot")
        *out += '"';
      else if (ref == "apos")
        *out += '\'';
      else if (ref.starts_with('#')) {
        auto cp = CharRef(ref);
        if (!cp || !AppendUtf8(*cp, out)) return Error("bad character reference");
      } else {
        return Error("unknown entity");
      }
      pos_ = semi + 1;
    }
    return Status::Ok();
  }

  Status Element(int depth, XmlElement* element) {
    if (depth > kMaxXmlDepth) return Error("elements nested too deep");
    ++pos_;  // '<'
    ASSIGN_OR_RETURN(element->name, Name());
    ASSIGN_OR_RETURN(bool empty, SkipAttributes());
    if (empty) return Status::Ok();
    for (;;) {
      if (pos_ >= doc_.size()) return Error("unterminated element <" + element->name + ">");
      if (doc_[pos_] != '<') {
        RETURN_IF_ERROR(Text(&element->text));
      } else if (Peek("</")) {
        return EndTag(element->name);
      } else if (Peek("<![CDATA[")) {
        const size_t start = pos_ + 9;
        RETURN_IF_ERROR(SkipPast("]]>", "CDATA section"));
        element->text.append(doc_.substr(start, pos_ - 3 - start));
      } else {
        ASSIGN_OR_RETURN(bool skipped, SkipMarkup());
        if (skipped) continue;
        if (Peek("<!")) return Error("unsupported markup");
        element->children.emplace_back();
        RETURN_IF_ERROR(Element(depth + 1, &element->children.back()));
      }
    }
  }

  Status EndTag(const std::string& name) {
    pos_ += 2;  // "</"
    ASSIGN_OR_RETURN(std::string end, Name());
    if (end != name) return Error("</" + end + "> closes <" + name + ">");
    while (pos_ < doc_.size() && IsSpace(doc_[pos_])) ++pos_;
    if (pos_ >= doc_.size() || doc_[pos_] != '>') return Error("unterminated end tag");
    ++pos_;
    return Status::Ok();
  }

  std::string_view doc_;
  size_t pos_ = 0;
};

// Parses `body` and checks its root element's name.
Result<XmlElement> ParseRoot(std::string_view body, std::string_view root, const char* what) {
  auto doc = ParseXml(body);
  if (!doc.ok()) return doc.status().WithContext(std::string("S3 ") + what + " response");
  if (doc->name != root) {
    return Corruption(std::string("S3 ") + what + " response: root element <" +
                      PrintableText(doc->name, 64) + ">, expected <" + std::string(root) + ">");
  }
  return doc;
}

Result<bool> ParseBool(const XmlElement& parent, std::string_view name, const char* what) {
  const std::string text = parent.ChildText(name);
  if (text.empty() || text == "false") return false;
  if (text == "true") return true;
  return Corruption(std::string("S3 ") + what + " response: <" + std::string(name) + "> is \"" +
                    PrintableText(text, 32) + "\", expected true or false");
}

}  // namespace

const XmlElement* XmlElement::Child(std::string_view child) const {
  for (const XmlElement& c : children) {
    if (c.name == child) return &c;
  }
  return nullptr;
}

std::string XmlElement::ChildText(std::string_view child) const {
  const XmlElement* c = Child(child);
  return c == nullptr ? "" : c->text;
}

Result<XmlElement> ParseXml(std::string_view document) { return Parser(document).Document(); }

std::optional<S3ErrorBody> ParseErrorBody(std::string_view body) {
  auto doc = ParseXml(body);
  if (!doc.ok() || doc->name != "Error") return std::nullopt;
  return S3ErrorBody{doc->ChildText("Code"), doc->ChildText("Message")};
}

Result<ListObjectsPage> ParseListObjectsV2(std::string_view body) {
  ASSIGN_OR_RETURN(XmlElement doc, ParseRoot(body, "ListBucketResult", "ListObjectsV2"));
  ListObjectsPage page;
  ASSIGN_OR_RETURN(page.truncated, ParseBool(doc, "IsTruncated", "ListObjectsV2"));
  page.next_token = doc.ChildText("NextContinuationToken");
  for (const XmlElement& c : doc.children) {
    if (c.name != "Contents") continue;
    const XmlElement* key = c.Child("Key");
    if (key == nullptr) return Corruption("S3 ListObjectsV2 response: <Contents> without <Key>");
    page.keys.push_back(key->text);
  }
  return page;
}

Result<std::string> ParseInitiateMultipartUpload(std::string_view body) {
  ASSIGN_OR_RETURN(XmlElement doc,
                   ParseRoot(body, "InitiateMultipartUploadResult", "CreateMultipartUpload"));
  std::string id = doc.ChildText("UploadId");
  if (id.empty()) return Corruption("S3 CreateMultipartUpload response has no <UploadId>");
  return id;
}

Result<std::string> ParseCopyPartResult(std::string_view body) {
  ASSIGN_OR_RETURN(XmlElement doc, ParseRoot(body, "CopyPartResult", "UploadPartCopy"));
  std::string etag = doc.ChildText("ETag");
  if (etag.empty()) return Corruption("S3 UploadPartCopy response has no <ETag>");
  return etag;
}

Status CheckResultRoot(std::string_view body, std::string_view expected_root) {
  return ParseRoot(body, expected_root, "result").status();
}

Result<ListUploadsPage> ParseListMultipartUploads(std::string_view body) {
  ASSIGN_OR_RETURN(XmlElement doc,
                   ParseRoot(body, "ListMultipartUploadsResult", "ListMultipartUploads"));
  ListUploadsPage page;
  ASSIGN_OR_RETURN(page.truncated, ParseBool(doc, "IsTruncated", "ListMultipartUploads"));
  page.next_key_marker = doc.ChildText("NextKeyMarker");
  page.next_upload_id_marker = doc.ChildText("NextUploadIdMarker");
  for (const XmlElement& c : doc.children) {
    if (c.name != "Upload") continue;
    MultipartUploadInfo info{c.ChildText("Key"), c.ChildText("UploadId"),
                             ParseIso8601(c.ChildText("Initiated"))};
    if (info.key.empty() || info.upload_id.empty()) {
      return Corruption("S3 ListMultipartUploads response: <Upload> without <Key> or <UploadId>");
    }
    page.uploads.push_back(std::move(info));
  }
  return page;
}

std::string XmlEscape(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string BuildCompleteMultipartUpload(const std::vector<std::string>& etags) {
  std::string out = "<CompleteMultipartUpload>";
  for (size_t i = 0; i < etags.size(); ++i) {
    out += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" +
           XmlEscape(etags[i]) + "</ETag></Part>";
  }
  out += "</CompleteMultipartUpload>";
  return out;
}

}  // namespace dte::internal
