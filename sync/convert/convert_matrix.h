// Shape helpers the converters share: every tensor is a row-major matrix.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dte::internal {

// shape[0], or 1 for a scalar.
int64_t MatrixRows(const std::vector<int64_t>& shape);
// The product of shape[1..], 1 for vectors and scalars.
int64_t MatrixCols(const std::vector<int64_t>& shape);
uint64_t ShapeElements(const std::vector<int64_t>& shape);

}  // namespace dte::internal
