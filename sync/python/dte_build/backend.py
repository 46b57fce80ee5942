"""PEP 517 backend: setuptools, plus a CMake build of libdte.so that the
wheel ships inside the dte package.

The library is built from the source tree's CMake project (target
dte_shared) in $DTE_PY_BUILD_DIR (default <source>/build-py) and copied into
setuptools' build directory, never into the source tree.
"""

import os
import shlex
import shutil
import subprocess

from setuptools import Distribution
from setuptools import build_meta as _orig
from setuptools.command.build_py import build_py as _build_py

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def build_libdte():
    """Configures and builds libdte.so; returns its path."""
    build = os.environ.get("DTE_PY_BUILD_DIR", os.path.join(ROOT, "build-py"))
    extra = shlex.split(os.environ.get("DTE_CMAKE_ARGS", "-DDTE_CUDA=OFF"))
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
        subprocess.check_call(["cmake", "-S", ROOT, "-B", build, *gen,
                               "-DCMAKE_BUILD_TYPE=RelWithDebInfo", *extra])
    jobs = os.environ.get("DTE_BUILD_JOBS", str(os.cpu_count() or 2))
    subprocess.check_call(["cmake", "--build", build, "--target", "dte_shared", "-j", jobs])
    return os.path.join(build, "sync", "libdte.so")


class BuildPy(_build_py):
    """build_py that also places libdte.so in the built dte package."""

    def run(self):
        super().run()
        lib = build_libdte()
        dest = os.path.join(self.build_lib, "dte")
        os.makedirs(dest, exist_ok=True)
        shutil.copy2(lib, os.path.join(dest, "libdte.so"))


class BinaryDistribution(Distribution):
    """A wheel holding a native library is platform-specific."""

    def has_ext_modules(self):
        return True


def _with_cmdclass(fn):
    def wrapped(*args, **kwargs):
        # setuptools reads cmdclass from setup(); hand it over through the
        # distutils hook every setuptools command honours.
        import setuptools
        orig_setup = setuptools.setup

        def setup(**attrs):
            attrs.setdefault("cmdclass", {})["build_py"] = BuildPy
            attrs.setdefault("distclass", BinaryDistribution)
            return orig_setup(**attrs)

        setuptools.setup = setup
        try:
            return fn(*args, **kwargs)
        finally:
            setuptools.setup = orig_setup
    return wrapped


get_requires_for_build_wheel = _orig.get_requires_for_build_wheel
get_requires_for_build_sdist = _orig.get_requires_for_build_sdist
prepare_metadata_for_build_wheel = _orig.prepare_metadata_for_build_wheel
build_sdist = _orig.build_sdist
build_wheel = _with_cmdclass(_orig.build_wheel)
