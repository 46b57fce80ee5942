"""The dte package's type hints hold: mypy, with the settings of
pyproject.toml's [tool.mypy] (every function annotated), finds no error in
sync/python/dte, and the package ships py.typed so that a user's mypy reads
them.

Needs mypy (pinned in tools/python.lock; tools/setup.sh installs it).
"""

import os
import shutil
import subprocess
import sys

import pytest

SOURCE = os.path.abspath(os.environ.get("DTE_SOURCE_DIR",
                                        os.path.join(os.path.dirname(__file__), "..", "..")))
PACKAGE = os.path.join(SOURCE, "sync", "python", "dte")


def mypy_command():
    try:
        import mypy  # noqa: F401
        return [sys.executable, "-m", "mypy"]
    except ImportError:
        pass
    if shutil.which("mypy"):
        return ["mypy"]
    pytest.fail("mypy is not installed (tools/setup.sh installs it from tools/python.lock)")


def test_mypy_finds_no_error_in_the_package(tmp_path):
    r = subprocess.run(mypy_command() + ["--config-file", os.path.join(SOURCE, "pyproject.toml"),
                                         "--cache-dir", str(tmp_path / "cache"), PACKAGE],
                       cwd=SOURCE, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("Success: no issues found"), r.stdout


def test_an_unannotated_function_is_an_error(tmp_path):
    """The check is strict enough to notice a public function without hints."""
    pkg = tmp_path / "dte"
    shutil.copytree(PACKAGE, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    with open(pkg / "_reader.py", "a") as f:
        f.write("\n\ndef unannotated(x):\n    return x\n")
    r = subprocess.run(mypy_command() + ["--config-file", os.path.join(SOURCE, "pyproject.toml"),
                                         "--cache-dir", str(tmp_path / "cache"), str(pkg)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "Function is missing a type annotation" in r.stdout, r.stdout


def test_the_package_ships_py_typed():
    assert os.path.isfile(os.path.join(PACKAGE, "py.typed"))
    with open(os.path.join(SOURCE, "pyproject.toml")) as f:
        text = f.read()
    assert 'dte = ["py.typed"]' in text, "pyproject.toml's package-data must list py.typed"
