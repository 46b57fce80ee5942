// ExpectSameVersion: gtest expectations that a version of one store and a
// version of another hold the same thing: the same block records (hash and
// changed flag), the same files with the same tensors (hash and changed
// flag). Whether each store also keeps a full table of the version is its
// anchor policy's choice, not compared. For tests that publish the same weights
// by two paths (the engine and a commit, one process and several ranks,
// Hugging Face and Megatron-Core coordinates) and compare the results.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>

#include "store/store.h"

namespace dte::test {

inline void ExpectSameVersion(Store& a, uint64_t version_a, Store& b, uint64_t version_b) {
  auto va = a.GetVersion(version_a);
  auto vb = b.GetVersion(version_b);
  ASSERT_TRUE(va.ok()) << va.status().message();
  ASSERT_TRUE(vb.ok()) << vb.status().message();
  const auto& ra = (*va)->records;
  const auto& rb = (*vb)->records;
  ASSERT_EQ(ra.size(), rb.size()) << "v" << version_a << " / v" << version_b;
  for (size_t k = 0; k < ra.size(); ++k) {
    EXPECT_EQ(ra[k].hash, rb[k].hash) << "v" << version_a << " block " << k;
    EXPECT_EQ(ra[k].changed, rb[k].changed) << "v" << version_a << " block " << k;
  }
  const auto& fa = (*va)->manifest.files;
  const auto& fb = (*vb)->manifest.files;
  ASSERT_EQ(fa.size(), fb.size()) << "v" << version_a << " / v" << version_b;
  for (size_t f = 0; f < fa.size(); ++f) {
    ASSERT_EQ(fa[f].tensors.size(), fb[f].tensors.size()) << fa[f].name;
    for (size_t t = 0; t < fa[f].tensors.size(); ++t) {
      EXPECT_EQ(fa[f].tensors[t].name, fb[f].tensors[t].name);
      EXPECT_EQ(fa[f].tensors[t].hash, fb[f].tensors[t].hash) << fa[f].tensors[t].name;
      EXPECT_EQ(fa[f].tensors[t].changed, fb[f].tensors[t].changed) << fa[f].tensors[t].name;
    }
  }
}

inline void ExpectSameVersion(Store& a, Store& b, uint64_t version) {
  ExpectSameVersion(a, version, b, version);
}

}  // namespace dte::test
