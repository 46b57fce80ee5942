// The inputs of MakeTransferPlan (sync/transfer/transfer_plan.h) for the
// receivers of a stored version: its canonical tensors and the attention
// geometry of its config.json.
#pragma once

#include <vector>

#include "store/base/status.h"
#include "sync/transfer/transfer_plan.h"

namespace dte {

class Store;
struct Version;

// The canonical tensors of a version and its attention geometry (from its
// config.json): the inputs of MakeTransferPlan for receivers of it.
struct PlanInputs {
  std::vector<PlanTensor> canonical;
  AttentionGeometry geometry;
};
Result<PlanInputs> PlanInputsOf(Store& store, const Version& v);

}  // namespace dte
