"""`pip install .` in a user's own environment: the project's PEP 517
backend (sync/python/dte_build) builds libdte.so with CMake (here the
already-built $DTE_BUILD_DIR, so the build is a no-op) and installs the dte
package with the library inside it; the installed package, imported from
another directory with no DTE_LIBRARY, loads its own libdte.so, publishes
with publish_weights and reads the version back. pyproject.toml's minimum
torch and transformers are the ones the suite runs on or older."""

import os
import re
import subprocess
import sys

import follower_util  # noqa: F401 (paths)

SOURCE = follower_util.SOURCE
BUILD = follower_util.BUILD

SCRIPT = r"""
import os, sys
import numpy as np
import dte
assert os.path.dirname(dte.__file__) == sys.argv[1], dte.__file__
store = sys.argv[2]
ckpt = sys.argv[3]
with dte.Publisher(store) as pub:
    assert pub.import_checkpoint(ckpt) == 0
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    r = pub.publish_weights({"w": w})
    assert (r.version, r.path, r.changed) == (1, "weights", 11), r
with dte.StoreReader(store) as rd:
    got = rd.read_into(1, "w", np.empty((3, 4), dtype=np.uint16))
assert (got.view(np.uint16) == (w.view(np.uint32) >> 16).astype(np.uint16)).all()
print("ok")
"""


def test_pip_install_into_a_users_environment(tmp_path):
    target = tmp_path / "site"
    env = dict(os.environ, DTE_PY_BUILD_DIR=BUILD)
    env.pop("DTE_LIBRARY", None)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation",
                        "--no-deps", "--no-index", "--target", str(target), SOURCE],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (target / "dte" / "libdte.so").exists()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    import safetensors.torch
    import torch
    safetensors.torch.save_file({"w": torch.zeros(3, 4, dtype=torch.bfloat16)},
                                str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text('{"model_type": "llama"}\n')
    env = {k: v for k, v in os.environ.items() if k not in ("DTE_LIBRARY", "DTE_BUILD_DIR")}
    env["PYTHONPATH"] = str(target)
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(target / "dte"),
                        str(tmp_path / "store"), str(ckpt)],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_minimum_versions_are_ones_the_suite_ran():
    import torch
    import transformers
    text = open(os.path.join(SOURCE, "pyproject.toml")).read()

    def version(v):
        return tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", v).groups())

    for name, module in (("torch", torch), ("transformers", transformers)):
        m = re.search(r'"%s>=([0-9.]+)"' % name, text)
        assert m, "pyproject.toml names no minimum %s" % name
        assert version(m.group(1)) <= version(module.__version__), (name, m.group(1))
