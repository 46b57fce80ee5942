#!/usr/bin/env python3
"""Lists the functions longer than a limit in C++, CUDA and Python sources.

  tools/function_lengths.py                   # every source folder, over 120 lines
  tools/function_lengths.py --max 60 fs/      # a folder, another limit
  tools/function_lengths.py --top 20 store/   # the 20 longest, whatever their length

A function's length is its lines from the first line of its signature to its
closing brace (C++) or its last statement (Python), comments and blank lines
included. Lambdas and local classes count towards the function that holds
them; Python's nested functions are listed on their own as well.

Prints "LINES PATH:LINE NAME", longest first, and exits 1 when a function is
over --max (0 when none is, or with --top).

C++ is read by a small scanner, not a compiler: comments, string and character
literals (raw strings included) and preprocessor lines are blanked, then a
'{' outside any function opens a function body when the text since the last
';', '{' or '}' ends in a parameter list (with qualifiers, a trailing return
type or a constructor's initializer list after it). Namespaces, classes,
structs, enums, extern "C" blocks and brace initializers are not functions.
"""

import argparse
import ast
import os
import re
import sys

CXX_SUFFIXES = (".cc", ".cpp", ".cxx", ".h", ".hpp", ".cu", ".cuh")
DEFAULT_PATHS = ("kernels", "store", "sync", "fs", "tools", "tests")
SKIP_DIRS = {"build", ".git", "__pycache__", "third_party", "node_modules"}

# extern "C" reads extern " " once literals are blanked.
_SCOPE = re.compile(r"\b(namespace|class|struct|union|enum)\b|\bextern\s*\"")
# What may follow a function's parameter list before its body.
_QUALIFIERS = re.compile(
    r"\)\s*((const|volatile|noexcept(\s*\([^()]*\))?|override|final|mutable|&&?|"
    r"(REQUIRES|EXCLUDES|ACQUIRE|RELEASE|NO_THREAD_SAFETY_ANALYSIS|"
    r"REQUIRES_SHARED|TRY_ACQUIRE)\b(\s*\([^()]*\))?)\s*)*(->[^;{}]*)?$")
# A constructor's initializer list begins with ") :" (not "::").
_INIT_LIST = re.compile(r"\)\s*(noexcept\s*)?:(?!:)")
_NAME = re.compile(r"(~?[A-Za-z_][\w]*(?:\s*::\s*~?[A-Za-z_]\w*)*|operator\s*[^\s(]+)\s*$")
_CONTROL = {"if", "for", "while", "switch", "catch", "return", "sizeof", "decltype"}


def blank_cxx(text):
    """text with comments, literals and preprocessor lines as spaces (newlines kept)."""
    out = list(text)
    i, n = 0, len(text)
    line_start = True

    def blank(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if line_start and c == "#":
            j = i
            while j < n and (text[j] != "\n" or text[j - 1] == "\\"):
                j += 1
            blank(i, j)
            i = j
            continue
        if c == "\n":
            line_start = True
            i += 1
            continue
        if not c.isspace():
            line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank(i, j)
            i = j
        elif c == "R" and i + 1 < n and text[i + 1] == '"' and not _ident_char(text, i - 1):
            m = re.match(r'R"([^()\\\s]{0,16})\(', text[i:])
            if m is None:
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i + m.end())
            j = n if end < 0 else end + len(m.group(1)) + 2
            blank(i + 1, j)
            i = j
        elif c in "\"'":
            if c == "'" and _ident_char(text, i - 1) and text[i - 1].isdigit():
                i += 1  # a digit separator: 1'000'000
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            blank(i + 1, min(j, n))
            i = j + 1
        else:
            i += 1
    return "".join(out)


def _ident_char(text, i):
    return i >= 0 and (text[i].isalnum() or text[i] == "_")


def _function_name(header):
    """The qualified name before the parameter list of `header`, or None."""
    depth = 0
    for k, c in enumerate(header):
        if c == "(":
            if depth == 0:
                m = _NAME.search(header[:k])
                if m and m.group(1).split("::")[-1].strip() not in _CONTROL:
                    return re.sub(r"\s+", "", m.group(1))
            depth += 1
        elif c == ")":
            depth -= 1
    return None


def _is_function(header):
    h = header.strip()
    if not h or "(" not in h or h.endswith("=") or h.endswith(","):
        return False
    if _SCOPE.search(h) and not re.search(r"\)\s*$", h):
        return False
    if _QUALIFIERS.search(h) or (_INIT_LIST.search(h) and h[-1] in ")}"):
        return _function_name(h) is not None
    return False


def cxx_functions(text):
    """(name, first line, last line) of each function defined in C++ text."""
    code = blank_cxx(text)
    found = []
    # Per open brace: "scope" (namespace, class, ...), "func" (a function's
    # body) or "block" (anything inside a function, or a brace initializer).
    stack = []
    header_start = 0  # where the text before the next '{' at scope level starts
    current = None  # (name, first line) of the function whose body is open
    paren = 0
    for i, c in enumerate(code):
        if c in "()":
            paren += 1 if c == "(" else -1
        elif c == ";":
            if paren == 0 and (not stack or stack[-1] == "scope"):
                header_start = i + 1
        elif c == "{":
            header = code[header_start:i]
            if paren > 0 or (stack and stack[-1] != "scope"):
                stack.append("block")
            elif _is_function(header):
                stack.append("func")
                first = header_start + len(header) - len(header.lstrip())
                current = (_function_name(header.strip()), code.count("\n", 0, first) + 1)
            elif _SCOPE.search(header):
                stack.append("scope")
                header_start = i + 1
            else:
                stack.append("block")  # an initializer: its header goes on after it
        elif c == "}":
            kind = stack.pop() if stack else "scope"
            if kind == "func":
                found.append((current[0], current[1], code.count("\n", 0, i) + 1))
            if kind != "block":
                header_start = i + 1
    return found


def python_functions(text, path):
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as e:
        print(f"{path}: not parsed: {e}", file=sys.stderr)
        return []
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child.lineno, child.end_lineno))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def functions_of(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if path.endswith(".py"):
        return python_functions(text, path)
    return cxx_functions(text)


def source_files(paths):
    for root in paths:
        if os.path.isfile(root):
            yield root
            continue
        for d, dirs, files in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
            for f in sorted(files):
                if f.endswith(CXX_SUFFIXES) or f.endswith(".py"):
                    yield os.path.join(d, f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*", default=list(DEFAULT_PATHS),
                    help="files or folders (default: sync fs tools)")
    ap.add_argument("--max", type=int, default=120, help="longest allowed function (lines)")
    ap.add_argument("--top", type=int, default=0,
                    help="list the N longest functions instead, and exit 0")
    args = ap.parse_args(argv)
    rows = []
    for path in source_files(args.paths):
        for name, first, last in functions_of(path):
            rows.append((last - first + 1, path, first, name))
    rows.sort(key=lambda r: (-r[0], r[1], r[2]))
    shown = rows[: args.top] if args.top else [r for r in rows if r[0] > args.max]
    for lines, path, first, name in shown:
        print(f"{lines:5d} {path}:{first} {name}")
    if not args.top:
        print(f"{len(shown)} of {len(rows)} functions over {args.max} lines", file=sys.stderr)
    return 0 if args.top or not shown else 1


if __name__ == "__main__":
    sys.exit(main())
