"""The fault campaign (docs/s3.md, "Fault campaign"): five short scenarios
on a real, signature-checking moto server behind the fault proxy, each run
once clean and then once per (fault kind, request position) with exactly
that one fault, on a fresh copy of its store (tests/py/fault_campaign.py,
tests/py/fault_scenarios.py):

  commit    `dtectl commit` of step 3 onto v0..v2
  gc        `dtectl gc --keep-last 2 --grace-seconds 0` on v0..v4
  mount     a dtefs mount's start and polls, with v3 committed meanwhile
  publish   step 3 published by a distributed publisher of 2 ranks (threads,
            dte's TCP transport) onto v0..v2
  catchup   a push receiver catching up to v2 from the store

After each case: no version lost (each version that was there, or that a
command reported, is listed with the content it was committed with), no
wrong byte served (mount reads, receiver tensors), `latest` monotonic and
no version vanishing on the mount (watched every 10 ms), `dtectl verify`
clean, a failing command's message naming the real cause, and a fault-free
rerun of a failed command succeeding. The checks read the store straight
from the server, never through the proxy.

The suite samples positions (fault_campaign.sample_positions);
tools/fault_campaign.sh runs every position (DTE_FAULT_CAMPAIGN=all);
DTE_FAULT_CAMPAIGN_SCENARIOS=commit,gc selects scenarios and
DTE_FAULT_CAMPAIGN_REPORT=FILE writes every case as JSON.
"""

import json
import os

import pytest

import fault_campaign as fc
import store_util
from ckpt_util import CheckpointSequence
from wait_util import wait_for

pytest.importorskip("torch")  # the project's setup installs it
import push_util  # noqa: E402  (needs torch)
import fault_scenarios as fs  # noqa: E402

import dte  # noqa: E402  (push_util puts it on the path)

SCENARIOS = ("commit", "gc", "mount", "publish", "catchup")


@pytest.fixture(scope="module")
def world(moto, proxy, tmp_path_factory):
    """The bucket, and libdte in this process reaching it through the proxy."""
    saved = dict(os.environ)
    root = tmp_path_factory.mktemp("campaign")
    os.environ.update({**moto.env(), "AWS_ENDPOINT_URL": proxy.endpoint, **fc.FAST_RETRIES,
                       "DTE_SPOOL_DIR": str(root / "spool")})
    for k in [k for k in os.environ if k.startswith("AWS_") and k not in moto.env()]:
        del os.environ[k]
    yield fs.World(moto, proxy, root)
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def dtectl_stores(world):
    """Templates t3 (v0..v2) and t5 (v0..v4) of a small model, and what each
    version holds, checked once against the checkpoints byte for byte."""
    ckpts = CheckpointSequence(world.dir("ckpts"), hidden=64, intermediate=128, layers=2,
                               vocab=128)
    d = world.dtectl("t3", via_proxy=False)
    d.ok("import", ckpts.dir(0))
    for step in (1, 2):
        assert d.commit(ckpts.dir(step)) == step
    fc.copy_prefix(world.moto, fs.BUCKET, "t3", "t5")
    d = world.dtectl("t5", via_proxy=False)
    for step in (3, 4):
        assert d.commit(ckpts.dir(step)) == step
    for v in range(5):
        store_util.same_tree(d.export(v, world.dir("export") / "out"), ckpts.dir(v))
    return ckpts, fc.manifest_fingerprints(world.moto, fs.BUCKET, "t5")


@pytest.fixture(scope="module")
def torch_store(world):
    """Template tt: v0 imported, v1 and v2 published by one publisher; and
    what v3 holds once two ranks published it (on a copy), read back
    against the trained weights."""
    initial = world.dir("ckpt") / "v0"
    trained = fs.Trained(3, initial)
    with dte.Publisher(store=world.uri("tt"), cache_dir=str(world.dir("pubcache"))) as p:
        assert p.import_checkpoint(str(initial)) == 0
        for step in (1, 2):
            assert trained.publish(p, step).version == step
    expected = fc.manifest_fingerprints(world.moto, fs.BUCKET, "tt")
    publish = fs.DistPublish(world, trained, expected)
    ctx = publish.fresh()
    assert publish.run(ctx).ok
    expected[3] = fc.manifest_fingerprints(world.moto, fs.BUCKET, ctx["prefix"])[3]
    for version in (2, 3):
        got = push_util.read_version(dte, world.uri(ctx["prefix"]), version, trained.shapes)
        assert not fs.same_tensors(got, trained.bf16[version]), version
    return trained, expected


@pytest.fixture(scope="module")
def push_group():
    group = dte.PushGroup("127.0.0.1:0", timeout=5.0)
    yield group
    group.close()


def test_the_faults_bite_and_the_checks_see_them(world, dtectl_stores, tmp_path):
    """The campaign can fail: its listing faults change what a client lists,
    and each invariant check reports the damage it guards against."""
    ckpts, expected = dtectl_stores
    prefix = world.copy("t5")
    listed = lambda: world.dtectl(prefix, via_proxy=True).versions()
    for kind, want in (("list_drop_key", [0, 1, 2, 3]), ("list_damage_key", [0, 1, 2, 3])):
        world.proxy.clear_rules()
        # Every listing of the command, so that no retry or second listing hides it.
        world.proxy.add_rule(**dict(fc.fault_rule(kind, 0), times=None))
        r = world.dtectl(prefix, via_proxy=True).run("log", "--json")
        world.proxy.clear_rules()
        assert r.returncode != 0 or [v["version"] for v in json.loads(r.stdout)] == want, \
            (kind, r.stdout, r.stderr)
    assert listed() == [0, 1, 2, 3, 4]
    assert not world.store_problems(prefix, expected, range(5))

    client = fc.client(world.moto)
    blob = next(k for k in fc.object_keys(world.moto, fs.BUCKET, prefix) if k.startswith("blobs/"))
    client.delete_object(Bucket=fs.BUCKET, Key=f"{prefix}/{blob}")
    assert any("verify exits 4" in p for p in world.store_problems(prefix, expected, range(5)))
    client.delete_object(Bucket=fs.BUCKET, Key=f"{prefix}/manifests/v00000004.json")
    assert "version 4 is lost" in world.store_problems(prefix, expected, range(5))
    other = {**expected, 3: expected[2]}
    assert "version 3 holds other bytes than committed" in \
        fc.version_problems(fc.manifest_fingerprints(world.moto, fs.BUCKET, prefix), other,
                            range(4))

    blames = world.error_problems(prefix, "error: the latest version of store s3://x is "
                                  "v00000001: another writer changed it", rc=3)
    assert blames == ["blames a concurrent change to the store, and there is none"]
    misnamed = world.error_problems(prefix, "cannot export: its manifest "
                                    "manifests/v00000003.json is gone from store s3://x", rc=1)
    assert misnamed == ["calls manifests/v00000003.json missing, and it is in the store"]
    misnamed = world.error_problems(prefix, "not found: reading v00000003: version 1 "
                                    "(v00000001) is not committed in store s3://x")
    assert misnamed == ["calls v00000001 missing, and it is in the store"]
    assert world.error_problems(prefix, "", rc=-11) == [
        "exit status -11 (a crash or an unknown status)", "failed without a message"]

    mnt = tmp_path / "mnt"
    for v in (1, 2):
        (mnt / f"v{v:08d}").mkdir(parents=True)
    os.symlink("v00000002", mnt / "latest")
    watch = fs.Watcher(str(mnt))
    fc_wait = lambda: watch.seen == {"v00000001", "v00000002"}
    wait_for(fc_wait, 10, "the watcher to see both versions")
    os.replace(_symlink(mnt, "v00000001"), mnt / "latest")
    (mnt / "v00000002").rmdir()
    wait_for(lambda: len(watch.problems) >= 2, 10, "the watcher to see the damage")
    watch.stop()
    assert watch.take() == ["latest moved back v00000002 -> v00000001",
                            "v00000002 vanished from the mount"]


def _symlink(directory, target):
    tmp = directory / ".latest.tmp"
    os.symlink(target, tmp)
    return tmp


def test_fault_campaign(world, request, capsys):
    def scenario(name):  # only the chosen scenarios' stores are made
        if name in ("commit", "gc", "mount"):
            ckpts, expected = request.getfixturevalue("dtectl_stores")
            return {"commit": lambda: fs.Commit(world, ckpts, expected),
                    "gc": lambda: fs.Gc(world, expected),
                    "mount": lambda: fs.MountPoll(world, ckpts, expected)}[name]()
        trained, expected = request.getfixturevalue("torch_store")
        if name == "publish":
            return fs.DistPublish(world, trained, expected)
        return fs.CatchUp(world, trained, request.getfixturevalue("push_group"))

    chosen = os.environ.get("DTE_FAULT_CAMPAIGN_SCENARIOS", ",".join(SCENARIOS)).split(",")
    kinds = os.environ.get("DTE_FAULT_CAMPAIGN_KINDS", ",".join(fc.KINDS)).split(",")
    assert set(chosen) <= set(SCENARIOS) and set(kinds) <= set(fc.KINDS), (chosen, kinds)
    campaign = fc.Campaign(world.proxy)
    for name in chosen:
        campaign.run(scenario(name), kinds)
    if "catchup" in chosen:  # the template it reads is as it was made
        assert not world.store_problems("tt", request.getfixturevalue("torch_store")[1],
                                        range(3))
    summary = campaign.summary()
    report = os.environ.get("DTE_FAULT_CAMPAIGN_REPORT")
    if report:
        campaign.write_report(report)
    with capsys.disabled():
        print("\n" + summary)
    failures = campaign.failures()
    assert not failures, summary + "\n" + "\n".join(c.line() for c in failures)
