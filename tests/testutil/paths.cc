#include "tests/testutil/paths.h"

#include <cstdlib>

namespace dte::test {
namespace {

const char* EnvOr(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : fallback;
}

}  // namespace

const char* BuildDir() { return EnvOr("DTE_BUILD_DIR", DTE_TEST_BUILD_DIR); }
const char* SourceDir() { return EnvOr("DTE_SOURCE_DIR", DTE_TEST_SOURCE_DIR); }
const char* ProjectPython() { return EnvOr("DTE_PYTHON", DTE_TEST_PYTHON); }

}  // namespace dte::test
