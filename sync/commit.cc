#include "sync/commit.h"

namespace dte {

Result<CommitResult> CommitDirectory(Store&, const std::string&, const CommitOptions&, bool) {
  return Unimplemented("commit");
}

}  // namespace dte
