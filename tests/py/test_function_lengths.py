"""tools/function_lengths.py: the functions it finds in C++ and Python, their
lines, and its exit code."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import function_lengths  # noqa: E402

CXX = r'''#include "a.h"
#define BRACES { {
namespace dte {
namespace {
const int kTable[] = {1, 2, {3}};  // not a function {
}  // namespace

struct Point {
  int x{0};
  int Sum() const { return x; }
};

Widget::Widget(int a) : a_{a}, b_(a) {
  const char* s = R"x(}})x";
  char c = '}';
}

extern "C" {
int dte_f(void) {
  auto f = [](int v) {
    return v;
  };
  /* } */
  return f(1);
}
}

template <typename T>
T Twice(T t) noexcept {
  return t;
}

int Locked() EXCLUDES(mu_) -> int {
  if (true) {
  }
  return 0;
}
}  // namespace dte
'''

PY = '''def outer(a):
    def inner(b):
        return b

    return inner(a)


class K:
    def method(self):
        pass
'''


def test_cxx_functions_named_with_their_lines():
    found = function_lengths.cxx_functions(CXX)
    assert found == [
        ("Sum", 10, 10),
        ("Widget::Widget", 13, 16),
        ("dte_f", 19, 25),
        ("Twice", 28, 31),
        ("Locked", 33, 37),
    ]


def test_python_functions_nested_and_methods():
    found = function_lengths.python_functions(PY, "x.py")
    assert found == [("outer", 1, 5), ("outer.inner", 2, 3), ("K.method", 9, 10)]


def test_exit_code_says_whether_a_function_is_over_the_limit(tmp_path):
    src = tmp_path / "long.cc"
    src.write_text("int Long() {\n" + "  x();\n" * 10 + "}\nint Short() { return 1; }\n")
    tool = os.path.join(ROOT, "tools", "function_lengths.py")
    over = subprocess.run([sys.executable, tool, "--max", "11", str(tmp_path)],
                          capture_output=True, text=True)
    assert over.returncode == 1
    assert over.stdout.split() == ["12", f"{src}:1", "Long"]
    within = subprocess.run([sys.executable, tool, "--max", "12", str(tmp_path)],
                            capture_output=True, text=True)
    assert within.returncode == 0 and within.stdout == ""
    top = subprocess.run([sys.executable, tool, "--top", "1", str(tmp_path)],
                         capture_output=True, text=True)
    assert top.returncode == 0 and top.stdout.split() == ["12", f"{src}:1", "Long"]


def test_no_source_folder_holds_a_function_over_120_lines():
    tool = os.path.join(ROOT, "tools", "function_lengths.py")
    r = subprocess.run([sys.executable, tool, "--max", "120"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, "split these into their phases:\n" + r.stdout
