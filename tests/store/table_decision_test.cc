// DecideTables (store/write/anchor_policy.h): the one policy-anchor and
// join-table decision commit and the Publisher (one rank or several) share.
#include <gtest/gtest.h>

#include <string>

#include "store/write/anchor_policy.h"

namespace dte {
namespace {

constexpr uint64_t kDense = 1000;

TEST(TableDecision, PolicyAnchorIsAskedFirstAndGetsNoJoinTable) {
  const AnchorPolicy p{1.0, 0, 0.125};
  // Over both budgets: a policy anchor, not also a join table.
  TableDecision d = DecideTables(p, {5, 1000}, {5, 1000}, kDense);
  EXPECT_EQ(d.anchor_reason, PolicyAnchorReason(p, {5, 1000}, kDense));
  EXPECT_TRUE(d.policy_anchor());
  EXPECT_EQ(d.join_reason, "");
  EXPECT_FALSE(d.join_table());
  EXPECT_TRUE(d.any_table());
  EXPECT_EQ(d.parent_distance.versions, 5u);
  EXPECT_EQ(d.parent_distance.bytes, 1000u);
}

TEST(TableDecision, JoinTableOnItsOwnBudgetWhenNotAnAnchor) {
  const AnchorPolicy p{1.0, 0, 0.125};
  TableDecision d = DecideTables(p, {5, 200}, {2, 125}, kDense);
  EXPECT_FALSE(d.policy_anchor());
  EXPECT_EQ(d.join_reason, JoinTableReason(p, {2, 125}, kDense));
  EXPECT_NE(d.join_reason.find("join budget"), std::string::npos);
  EXPECT_TRUE(d.join_table());
  EXPECT_TRUE(d.any_table());
  // One byte under the join budget: neither table.
  d = DecideTables(p, {5, 200}, {2, 124}, kDense);
  EXPECT_FALSE(d.policy_anchor());
  EXPECT_FALSE(d.join_table());
  EXPECT_FALSE(d.any_table());
}

TEST(TableDecision, EveryNVersionsMakesAnAnchorWhateverTheBytes) {
  const AnchorPolicy p{0, 4, 0.125};
  TableDecision d = DecideTables(p, {3, 0}, {3, 999}, kDense);
  EXPECT_NE(d.anchor_reason.find("4 versions"), std::string::npos);
  EXPECT_EQ(d.join_reason, "");
  d = DecideTables(p, {2, 0}, {2, 999}, kDense);
  EXPECT_FALSE(d.policy_anchor());
  EXPECT_TRUE(d.join_table());
}

}  // namespace
}  // namespace dte
