// S3Store listings checked like bodies (store/listing_check.h): each kind of
// damage a ListObjectsV2 answer can carry is asked for again, never
// trimmed, and a damage that persists fails naming the key and attempts.
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <vector>

#include "store/listing_check.h"
#include "tests/store/s3_store_fixture.h"

namespace dte::s3_store_test {
namespace {

using internal::HttpRequest;
using internal::HttpResponse;

bool IsList(const HttpRequest& r) {
  return r.method == "GET" && r.url.find("list-type=2") != std::string::npos;
}

// Replaces the body of an answer, keeping its Content-Length true.
void SetBody(HttpResponse* resp, std::string body) {
  for (auto& [name, value] : resp->headers) {
    if (name == "content-length") value = std::to_string(body.size());
  }
  resp->body_bytes = body.size();
  resp->body = std::move(body);
}

void Replace(HttpResponse* resp, const std::string& from, const std::string& to) {
  std::string body = resp->body;
  const size_t at = body.find(from);
  ASSERT_NE(at, std::string::npos) << body;
  body.replace(at, from.size(), to);
  SetBody(resp, std::move(body));
}

class S3Listing : public S3StoreFake {
 protected:
  void SetUp() override {
    S3StoreFake::SetUp();
    for (int v = 0; v < 5; ++v) {
      fake_->SetObject("pre/fix/manifests/v0000000" + std::to_string(v) + ".json", "{}");
    }
  }
  std::vector<std::string> All() const {
    std::vector<std::string> keys;
    for (int v = 0; v < 5; ++v) keys.push_back("manifests/v0000000" + std::to_string(v) + ".json");
    return keys;
  }
  int Lists() const {
    int n = 0;
    for (const auto& l : fake_->Log()) n += l.find("list-type=2") != std::string::npos;
    return n;
  }
};

TEST_F(S3Listing, KeyOutsideItsGrammarIsAskedForAgain) {
  std::atomic<int> damaged{0};
  fake_->after = [&](const HttpRequest& r, HttpResponse* resp) {
    if (IsList(r) && damaged++ == 0) Replace(resp, "v00000001.json", "v0000000q.json");
  };
  auto keys = store_->ListStoreKeys("manifests/");
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  EXPECT_EQ(*keys, All());
  EXPECT_EQ(Lists(), 4);  // three pages of two, the first one twice
}

TEST_F(S3Listing, DamageThatPersistsFailsNamingTheKeyAndTheAttempts) {
  fake_->after = [&](const HttpRequest& r, HttpResponse* resp) {
    if (IsList(r) && resp->body.find("v00000001.json") != std::string::npos) {
      Replace(resp, "v00000001.json", "v0000000#.json");
    }
  };
  auto keys = store_->ListStoreKeys("manifests/");
  ASSERT_FALSE(keys.ok());
  EXPECT_EQ(keys.status().code(), Code::kIOError);
  const std::string& m = keys.status().message();
  EXPECT_TRUE(Contains(m, "manifests/v0000000#.json")) << m;
  EXPECT_TRUE(Contains(m, "damaged")) << m;
  EXPECT_TRUE(Contains(m, "4 attempts")) << m;
}

TEST_F(S3Listing, KeysOutOfOrderInAPageAreAskedForAgain) {
  std::atomic<int> damaged{0};
  fake_->after = [&](const HttpRequest& r, HttpResponse* resp) {
    if (IsList(r) && damaged++ == 0) Replace(resp, "v00000001.json", "v00000000.json");
  };
  auto keys = store_->ListStoreKeys("manifests/");
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  EXPECT_EQ(*keys, All());
  EXPECT_EQ(damaged.load(), 4);
}

TEST_F(S3Listing, TruncatedPageWithoutATokenIsAskedForAgain) {
  std::atomic<int> damaged{0};
  fake_->after = [&](const HttpRequest& r, HttpResponse* resp) {
    if (!IsList(r) || damaged++ != 0) return;
    std::string body = resp->body;
    const size_t from = body.find("<NextContinuationToken>");
    const size_t to = body.find("</NextContinuationToken>");
    ASSERT_NE(to, std::string::npos);
    body.erase(from, to + 24 - from);
    SetBody(resp, body);
  };
  auto keys = store_->ListStoreKeys("manifests/");
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  EXPECT_EQ(*keys, All());
  EXPECT_EQ(Lists(), 4);
}

TEST_F(S3Listing, RepeatedTokenListsAgainFromTheStart) {
  std::atomic<int> pages{0};
  fake_->after = [&](const HttpRequest& r, HttpResponse* resp) {
    // The second page names the token it was asked with: the chain loops.
    if (IsList(r) && ++pages == 2) Replace(resp, "tok+/=4", "tok+/=2");
  };
  auto keys = store_->ListStoreKeys("manifests/");
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  EXPECT_EQ(*keys, All());
  EXPECT_EQ(Lists(), 2 + 3);  // two pages, then the whole listing again
}

TEST_F(S3Listing, PageThatDoesNotFollowThePreviousListsAgainFromTheStart) {
  std::atomic<int> pages{0};
  std::string first_page;
  fake_->after = [&](const HttpRequest& r, HttpResponse* resp) {
    if (!IsList(r)) return;
    const int n = ++pages;
    if (n == 1) first_page = resp->body;
    // Page two carries page one's keys (another listing's page) and goes on.
    if (n == 2) {
      std::string body = first_page;
      const size_t at = body.find("tok+/=2");
      body.replace(at, 7, "tok+/=4");
      SetBody(resp, body);
    }
  };
  auto keys = store_->ListStoreKeys("manifests/");
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  EXPECT_EQ(*keys, All());
  EXPECT_EQ(Lists(), 2 + 3);
}

TEST_F(S3Listing, BrokenChainThatPersistsFailsNamingTheListingAndAttempts) {
  fake_->after = [&](const HttpRequest& r, HttpResponse* resp) {
    if (IsList(r) && resp->body.find("tok+/=4") != std::string::npos) {
      Replace(resp, "tok+/=4", "tok+/=2");
    }
  };
  auto keys = store_->ListStoreKeys("manifests/");
  ASSERT_FALSE(keys.ok());
  EXPECT_EQ(keys.status().code(), Code::kIOError);
  const std::string& m = keys.status().message();
  EXPECT_TRUE(Contains(m, "listing manifests/ of store s3://bucket/pre/fix failed 4 times")) << m;
  EXPECT_TRUE(Contains(m, "no new continuation token")) << m;
}

TEST_F(S3Listing, ListAfterRefusesKeysNotAfterTheStartKey) {
  std::atomic<int> damaged{0};
  fake_->after = [&](const HttpRequest& r, HttpResponse* resp) {
    if (!IsList(r) || damaged++ != 0) return;
    SetBody(resp,
            "<ListBucketResult><Contents><Key>pre/fix/manifests/v00000001.json</Key></Contents>"
            "<IsTruncated>false</IsTruncated></ListBucketResult>");
  };
  auto* lister = dynamic_cast<PagedLister*>(store_.get());
  ASSERT_NE(lister, nullptr);
  auto page = lister->ListAfter("manifests/", "manifests/v00000002.json", 1000);
  ASSERT_TRUE(page.ok()) << page.status().ToString();
  EXPECT_EQ(page->keys,
            (std::vector<std::string>{"manifests/v00000003.json", "manifests/v00000004.json"}));
  EXPECT_EQ(damaged.load(), 2);
}

TEST_F(S3Listing, PlainListsCheckOrderButLeaveTheGrammarToTheirCaller) {
  fake_->SetObject("pre/fix/manifests/v10", "x");  // any key: List is generic
  auto keys = store_->List("manifests/");
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  EXPECT_EQ(keys->size(), 6u);
  std::atomic<int> damaged{0};
  fake_->after = [&](const HttpRequest& r, HttpResponse* resp) {
    if (IsList(r) && damaged++ == 0) Replace(resp, "v00000001.json", "v00000000.json");
  };
  keys = store_->List("manifests/");
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  EXPECT_EQ(keys->size(), 6u);
  EXPECT_EQ(damaged.load(), 4);  // the damaged first page, then three pages
}

TEST_F(S3Listing, ForeignKeysOutsideTheStoresOwnPrefixesAreStillSkipped) {
  fake_->SetObject("pre/fix/notes/a#b", "x");
  fake_->SetObject("pre/fix/manifests/", "");  // a console folder marker
  auto notes = store_->List("notes/");
  ASSERT_TRUE(notes.ok()) << notes.status().ToString();
  EXPECT_TRUE(notes->empty());
  auto keys = store_->ListStoreKeys("manifests/");
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  EXPECT_EQ(*keys, All());
}

TEST(ListingCheck, KeysOfEachOwnPrefixFollowTheirGrammar) {
  EXPECT_EQ(CheckListedKey("manifests/", "manifests/v00000003.json"), "");
  EXPECT_EQ(CheckListedKey("manifests/", "manifests/v00000003.r2.json"), "");
  EXPECT_NE(CheckListedKey("manifests/", "manifests/v0000000s.json"), "");
  EXPECT_NE(CheckListedKey("manifests/", "manifests/v00000003.r0.json"), "");
  EXPECT_EQ(CheckListedKey("joins/", "joins/v00000012.json"), "");
  EXPECT_NE(CheckListedKey("joins/", "joins/v0000001.json"), "");
  const std::string blob = "blobs/3f/3f000000000000000000000000000abc";
  EXPECT_EQ(CheckListedKey("blobs/", blob), "");
  EXPECT_NE(CheckListedKey("blobs/", "blobs/3e/3f000000000000000000000000000abc"), "");
  EXPECT_NE(CheckListedKey("blobs/", "blobs/3f/3f00000000000000000000000000abc"), "");
  EXPECT_EQ(CheckListedKey("exchange/", "exchange/job/m/0-1/7"), "");
  EXPECT_NE(CheckListedKey("exchange/", "exchange/job/m/0-1/7#"), "");
  EXPECT_NE(CheckListedKey("manifests/v1", "manifests/v00000003.json"), "");
  EXPECT_TRUE(IsCheckedListingPrefix("manifests/v00000003."));
  EXPECT_FALSE(IsCheckedListingPrefix(""));
  EXPECT_FALSE(IsCheckedListingPrefix("dte-store.json"));
  EXPECT_NE(
      CheckListedPage("manifests/", {"manifests/v00000002.json", "manifests/v00000001.json"}, ""),
      "");
  EXPECT_NE(CheckListedPage("manifests/", {"manifests/v00000002.json"}, "manifests/v00000002.json"),
            "");
}

}  // namespace
}  // namespace dte::s3_store_test
