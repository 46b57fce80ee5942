"""The push example with a Hugging Face transformers model served on the CPU
in another process (tools/examples/push_transformers.py): after every
push, the served model's parameters and greedy generation equal those of
the same version loaded from a dtefs mount with from_pretrained."""

import os
import subprocess
import sys

SOURCE = os.environ.get("DTE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
EXAMPLE = os.path.join(SOURCE, "tools", "examples", "push_transformers.py")


def test_served_model_equals_the_dtefs_version_after_every_push(tmp_path):
    r = subprocess.run([sys.executable, EXAMPLE, "--work", str(tmp_path / "work"), "--steps", "3"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    steps = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, r.stdout
    for line in steps:
        assert "the served weights and greedy tokens equal the dtefs version's" in line, line
