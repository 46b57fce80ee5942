#include "sync/convert/convert_matrix.h"

namespace dte::internal {

int64_t MatrixRows(const std::vector<int64_t>& shape) { return shape.empty() ? 1 : shape[0]; }

int64_t MatrixCols(const std::vector<int64_t>& shape) {
  int64_t cols = 1;
  for (size_t i = 1; i < shape.size(); ++i) cols *= shape[i];
  return cols;
}

uint64_t ShapeElements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

}  // namespace dte::internal
