"""The README's Python quickstart, run as written: the blocks of its
"## Python quickstart" section marked `<!-- quickstart: NAME -->` are
written to NAME (train.py, rollout.py) unchanged, and run the way its
`run` block says, `python3 train.py STORE & python3 rollout.py STORE`, once
for each STORE it names: ./policy (a directory in a temporary working
directory) and s3://my-bucket/policy (on a moto server on loopback).

Nothing in the snippets is replaced. What the test provides is their
environment: PYTHONPATH and DTE_LIBRARY point at the built package (what
`pip install .` gives a reader), DTE_CACHE_DIR at a temporary directory,
and for s3:// the AWS_* variables of the moto server (the README's
`export` line names which) and the bucket `my-bucket`. The rollout runs in
its own process through runpy, started before the trainer, and then saves
its `model` and the stamps of its `samples` for the checks: the trainer committed versions
0..8, the stamps never go back and end within max_lag of 8, and the
rollout's model holds the version of its last stamp bit for bit (read
back with dte.StoreReader)."""

import json
import os
import re
import subprocess
import sys

import follower_util
from wait_util import wait_for

import dte
import torch

README = os.path.join(follower_util.SOURCE, "README.md")
LAST = 8  # the trainer's max_steps
MAX_LAG = 2

# Runs rollout.py as __main__ (sys.argv: rollout.py STORE), then saves what
# the checks need from its globals. It imports the snippet's modules first
# and says so (rollout.ready), so that the trainer, started then, cannot be
# done before the rollout follows it.
ROLLOUT = """
import json, runpy, sys, torch, transformers, dte
open("rollout.ready", "w").close()
sys.argv = sys.argv[1:]
g = runpy.run_path(sys.argv[0], run_name="__main__")
torch.save(g["model"].state_dict(), "rollout-model.pt")
with open("rollout.json", "w") as f:
    json.dump({"stamps": [s["policy_version"] for s in g["samples"]],
               "held": g["follower"].held}, f)
"""


def quickstart():
    """{NAME: code} of the marked blocks of the README's quickstart section."""
    with open(README) as f:
        text = f.read()
    section = re.search(r"^## Python quickstart\n(.*?)^## ", text, re.S | re.M)
    assert section, "README.md has no '## Python quickstart' section"
    blocks = dict(re.findall(r"<!-- quickstart: (\S+) -->\n```\w+\n(.*?)^```", section.group(1),
                             re.S | re.M))
    assert set(blocks) == {"train.py", "rollout.py", "run"}, sorted(blocks)
    return blocks


def commands(run_block):
    """The stores the run block starts the trainer and the rollout on."""
    stores = []
    pattern = r"python3 train\.py ([^\s;]+) & python3 rollout\.py ([^\s;]+)"
    for train, rollout in re.findall(pattern, run_block):
        assert train == rollout
        stores.append(train)
    return stores


def package_env(tmp_path, extra):
    env = dict(os.environ, PYTHONPATH=os.path.join(follower_util.SOURCE, "sync", "python"),
               DTE_LIBRARY=os.environ["DTE_LIBRARY"], DTE_CACHE_DIR=str(tmp_path / "cache"))
    env.update(extra)
    return env


def run_quickstart(tmp_path, store, extra_env):
    blocks = quickstart()
    for name in ("train.py", "rollout.py"):
        (tmp_path / name).write_text(blocks[name])
    env = package_env(tmp_path, extra_env)
    procs = []

    def start(name, *argv):  # output to NAME.log: a full pipe would stall it
        with open(tmp_path / (name + ".log"), "w") as log:
            procs.append((name, subprocess.Popen([sys.executable, *argv, store], cwd=tmp_path,
                                                 env=env, stdout=log, stderr=subprocess.STDOUT)))
    try:
        start("rollout.py", "-c", ROLLOUT, "rollout.py")
        wait_for(lambda: procs[0][1].poll() is not None or (tmp_path / "rollout.ready").exists(),
                 120, "the rollout's imports")
        start("train.py", "train.py")
        for _, p in procs:
            p.wait(timeout=240)
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for name, p in procs:
        assert p.returncode == 0, "%s: exit %d\n%s" % (
            name, p.returncode, (tmp_path / (name + ".log")).read_text()[-3000:])
    with open(tmp_path / "rollout.json") as f:
        result = json.load(f)
    return result, torch.load(tmp_path / "rollout-model.pt")


def check_outcome(store, result, state):
    stamps = result["stamps"]
    assert stamps == sorted(stamps), stamps          # never back
    assert LAST - MAX_LAG <= stamps[-1] <= LAST, stamps
    assert len(set(stamps)) >= 2, stamps              # it followed the trainer
    assert result["held"] == stamps[-1]
    with dte.StoreReader(store) as r:
        assert r.latest() == LAST
        bad = []
        for name, t in state.items():
            got = r.read_into(stamps[-1], name, torch.empty_like(t))
            if not torch.equal(got.view(torch.int16), t.view(torch.int16)):
                bad.append(name)
        assert bad == [], "the rollout's model differs from %d in %s" % (stamps[-1], bad)
        # The versions are the trainer's steps: version 0 and the last differ.
        name = "model.layers.0.mlp.down_proj.weight"
        first = r.read_into(0, name, torch.empty_like(state[name]))
        last = r.read_into(LAST, name, torch.empty_like(state[name]))
        assert not torch.equal(first, last)
        for v in range(LAST + 1):  # every step's version is there
            r.read_into(v, name, torch.empty_like(state[name]))


def test_the_readme_names_a_local_and_an_s3_store():
    stores = commands(quickstart()["run"])
    assert len(stores) == 2 and not stores[0].startswith("s3://"), stores
    assert stores[1].startswith("s3://"), stores


def test_quickstart_over_a_local_store(tmp_path):
    store = commands(quickstart()["run"])[0]
    result, state = run_quickstart(tmp_path, store, {})
    check_outcome(str(tmp_path / store), result, state)


def test_quickstart_over_s3(tmp_path, moto, monkeypatch):
    store = commands(quickstart()["run"])[1]
    bucket = re.match(r"s3://([^/]+)/", store).group(1)
    moto.create_bucket(bucket)
    # The variables the README's export line names are the ones set here.
    named = set(re.findall(r"\b(AWS_[A-Z_]+)=", quickstart()["run"]))
    assert named and named <= set(moto.env()), named
    result, state = run_quickstart(tmp_path, store, moto.env())
    for k, v in package_env(tmp_path, moto.env()).items():
        monkeypatch.setenv(k, v)
    check_outcome(store, result, state)
