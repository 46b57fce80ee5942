// Where the tests find the project: the build folder, the checkout and the
// project's Python interpreter (the environment tools/setup.sh installs).
// Each is fixed when the tests are built (tests/CMakeLists.txt, the
// dte_test_paths library) and can be overridden by DTE_BUILD_DIR,
// DTE_SOURCE_DIR and DTE_PYTHON.
#pragma once

namespace dte::test {

const char* BuildDir();
const char* SourceDir();
const char* ProjectPython();

}  // namespace dte::test
