#include "tests/testutil/python.h"

#include <cstdlib>

namespace dte::test {

const char* ProjectPython() {
  const char* p = std::getenv("DTE_PYTHON");
  return p != nullptr && *p != '\0' ? p : "/opt/dte/venv/bin/python";
}

}  // namespace dte::test
