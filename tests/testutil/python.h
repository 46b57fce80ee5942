// The project's Python interpreter for tests that start Python programs
// (moto, the safetensors reference): $DTE_PYTHON, which CTest sets to the
// environment tools/setup.sh installs, else that environment's default place.
#pragma once

namespace dte::test {

const char* ProjectPython();

}  // namespace dte::test
