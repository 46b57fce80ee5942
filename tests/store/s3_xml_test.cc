#include "store/internal/s3_xml.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace dte::internal {
namespace {

constexpr const char* kListPage = R"(<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
  <Name>bucket</Name><Prefix>p/</Prefix><KeyCount>2</KeyCount><MaxKeys>2</MaxKeys>
  <IsTruncated>true</IsTruncated>
  <NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</NextContinuationToken>
  <Contents><Key>p/blobs/ab/1</Key><LastModified>2024-05-01T12:00:00.000Z</LastModified>
    <ETag>&quot;d41d8cd98f00b204e9800998ecf8427e&quot;</ETag><Size>0</Size>
    <StorageClass>STANDARD</StorageClass></Contents>
  <Contents><Key>p/a&amp;b</Key><Size>3</Size></Contents>
</ListBucketResult>)";

TEST(S3Xml, ParsesAListObjectsV2Page) {
  auto page = ParseListObjectsV2(kListPage);
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  EXPECT_EQ(page->keys, (std::vector<std::string>{"p/blobs/ab/1", "p/a&b"}));
  EXPECT_TRUE(page->truncated);
  EXPECT_EQ(page->next_token, "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=");
}

TEST(S3Xml, ParsesTheLastAndEmptyListPages) {
  auto last = ParseListObjectsV2(
      "<ListBucketResult><IsTruncated>false</IsTruncated>"
      "<Contents><Key>k</Key></Contents></ListBucketResult>");
  ASSERT_TRUE(last.ok());
  EXPECT_FALSE(last->truncated);
  EXPECT_EQ(last->keys, std::vector<std::string>{"k"});
  auto empty = ParseListObjectsV2("<ListBucketResult/>");
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->keys.empty());
  EXPECT_FALSE(empty->truncated);
}

TEST(S3Xml, DecodesEntitiesCdataAndNamespacePrefixes) {
  auto doc = ParseXml(
      "<!-- c --><s3:R a='x>y' b=\"<\"><s3:K>&lt;&gt;&amp;&quot;&apos;&#65;&#x42;&#xe9;</s3:K>"
      "<K2><![CDATA[<raw&>]]></K2><?pi x?><E/></s3:R>\n");
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  EXPECT_EQ(doc->name, "R");
  EXPECT_EQ(doc->ChildText("K"), "<>&\"'AB\xc3\xa9");
  EXPECT_EQ(doc->ChildText("K2"), "<raw&>");
  ASSERT_NE(doc->Child("E"), nullptr);
  EXPECT_EQ(doc->Child("missing"), nullptr);
  EXPECT_EQ(doc->ChildText("missing"), "");
}

TEST(S3Xml, ParsesErrorBodies) {
  auto e = ParseErrorBody(
      "<?xml version=\"1.0\"?><Error><Code>NoSuchKey</Code><Message>The specified key does not "
      "exist.</Message><Key>a/b</Key><RequestId>1</RequestId></Error>");
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code, "NoSuchKey");
  EXPECT_EQ(e->message, "The specified key does not exist.");
  EXPECT_FALSE(ParseErrorBody("").has_value());
  EXPECT_FALSE(ParseErrorBody("<html>502 Bad Gateway</html>").has_value());
  EXPECT_FALSE(ParseErrorBody("<Error><Code>Trunc").has_value());
  EXPECT_FALSE(ParseErrorBody("<CompleteMultipartUploadResult/>").has_value());
}

TEST(S3Xml, ParsesMultipartBodies) {
  auto id = ParseInitiateMultipartUpload(
      "<InitiateMultipartUploadResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
      "<Bucket>b</Bucket><Key>k</Key><UploadId>VXBsb2FkIElE+/=</UploadId>"
      "</InitiateMultipartUploadResult>");
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(*id, "VXBsb2FkIElE+/=");
  EXPECT_EQ(ParseInitiateMultipartUpload("<InitiateMultipartUploadResult/>").status().code(),
            Code::kCorruption);
  EXPECT_TRUE(CheckResultRoot("<CompleteMultipartUploadResult><ETag>x</ETag>"
                              "</CompleteMultipartUploadResult>",
                              "CompleteMultipartUploadResult")
                  .ok());
  Status inside =
      CheckResultRoot("<Error><Code>InternalError</Code></Error>", "CompleteMultipartUploadResult");
  EXPECT_EQ(inside.code(), Code::kCorruption);
  EXPECT_NE(inside.message().find("<Error>"), std::string::npos) << inside.message();

  auto uploads = ParseListMultipartUploads(
      "<ListMultipartUploadsResult><IsTruncated>true</IsTruncated>"
      "<NextKeyMarker>p/k2</NextKeyMarker><NextUploadIdMarker>u2</NextUploadIdMarker>"
      "<Upload><Key>p/k1</Key><UploadId>u1</UploadId>"
      "<Initiated>2024-05-01T12:00:00.000Z</Initiated></Upload>"
      "<Upload><Key>p/k2</Key><UploadId>u2</UploadId></Upload>"
      "</ListMultipartUploadsResult>");
  ASSERT_TRUE(uploads.ok()) << uploads.status().ToString();
  ASSERT_EQ(uploads->uploads.size(), 2u);
  EXPECT_EQ(uploads->uploads[0].key, "p/k1");
  EXPECT_EQ(uploads->uploads[0].upload_id, "u1");
  EXPECT_EQ(uploads->uploads[0].initiated, 1714564800);
  EXPECT_FALSE(uploads->uploads[1].initiated.has_value());
  EXPECT_TRUE(uploads->truncated);
  EXPECT_EQ(uploads->next_key_marker, "p/k2");
  EXPECT_EQ(uploads->next_upload_id_marker, "u2");
}

TEST(S3Xml, BuildsCompleteMultipartUploadWithEscapedEtags) {
  const std::string body = BuildCompleteMultipartUpload({"\"a1\"", "b<2>&"});
  EXPECT_EQ(body,
            "<CompleteMultipartUpload>"
            "<Part><PartNumber>1</PartNumber><ETag>&quot;a1&quot;</ETag></Part>"
            "<Part><PartNumber>2</PartNumber><ETag>b&lt;2&gt;&amp;</ETag></Part>"
            "</CompleteMultipartUpload>");
  auto parsed = ParseXml(body);  // and it reads back
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->children.at(1).ChildText("ETag"), "b<2>&");
}

TEST(S3Xml, MalformedInputIsAClearErrorNeverACrash) {
  const std::vector<std::string> bad = {
      "",
      "   ",
      "text only",
      "<",
      "<A",
      "<A>",
      "<A></B>",
      "<A><B></A></B>",
      "<A>&unknown;</A>",
      "<A>&#xZZ;</A>",
      "<A>&#0;</A>",
      "<A>&#xD800;</A>",
      "<A>&#99999999;</A>",
      "<A>&amp</A>",
      "<A><![CDATA[x</A>",
      "<A><!-- x</A>",
      "<A b='x></A>",
      "<A/><B/>",
      "<A/>trailing",
      "<!DOCTYPE A [<!ENTITY x 'y'>]><A>&x;</A>",
      "<A><!ELEMENT x></A>",
      "</A>",
      "<:>x</:>",
      "<A><B<C/></B></A>",
      std::string("<A>\0</A", 7),
  };
  for (const std::string& doc : bad) {
    auto parsed = ParseXml(doc);
    ASSERT_FALSE(parsed.ok()) << doc;
    EXPECT_EQ(parsed.status().code(), Code::kCorruption) << doc;
    EXPECT_NE(parsed.status().message().find("malformed XML ("), std::string::npos)
        << parsed.status().message();
    EXPECT_FALSE(ParseListObjectsV2(doc).ok()) << doc;
  }
  auto wrong_root = ParseListObjectsV2("<Error><Code>AccessDenied</Code></Error>");
  ASSERT_EQ(wrong_root.status().code(), Code::kCorruption);
  EXPECT_NE(wrong_root.status().message().find("root element <Error>"), std::string::npos);
  auto bad_bool = ParseListObjectsV2(
      "<ListBucketResult><IsTruncated>yes</IsTruncated>"
      "</ListBucketResult>");
  EXPECT_EQ(bad_bool.status().code(), Code::kCorruption);
  auto keyless = ParseListObjectsV2("<ListBucketResult><Contents/></ListBucketResult>");
  EXPECT_EQ(keyless.status().code(), Code::kCorruption);
}

TEST(S3Xml, DeepNestingIsRefusedWithoutRecursingFurther) {
  std::string deep;
  for (int i = 0; i < 100000; ++i) deep += "<a>";
  auto parsed = ParseXml(deep);
  ASSERT_EQ(parsed.status().code(), Code::kCorruption);
  EXPECT_NE(parsed.status().message().find("nested too deep"), std::string::npos);
  std::string ok;
  for (int i = 0; i < kMaxXmlDepth; ++i) ok += "<a>";
  for (int i = 0; i < kMaxXmlDepth; ++i) ok += "</a>";
  EXPECT_TRUE(ParseXml(ok).ok());
}

// Random mutations of valid documents: every outcome is a value or a
// Corruption status (the fuzz target does this at scale under sanitizers).
TEST(S3Xml, MutatedDocumentsNeverCrash) {
  std::mt19937 rng(7);
  const std::string seed = kListPage;
  for (int i = 0; i < 20000; ++i) {
    std::string doc = seed;
    const int edits = 1 + static_cast<int>(rng() % 8);
    for (int e = 0; e < edits && !doc.empty(); ++e) {
      const size_t at = rng() % doc.size();
      switch (rng() % 3) {
        case 0:
          doc[at] = static_cast<char>(rng());
          break;
        case 1:
          doc.erase(at, 1 + rng() % 16);
          break;
        default:
          doc.insert(at, 1, "<>&/;!?[]'\""[rng() % 11]);
      }
    }
    auto parsed = ParseListObjectsV2(doc);
    if (!parsed.ok()) {
      EXPECT_EQ(parsed.status().code(), Code::kCorruption);
    }
  }
}

}  // namespace
}  // namespace dte::internal
