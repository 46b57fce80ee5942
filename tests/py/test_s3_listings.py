"""Listings checked like bodies (docs/s3.md, "Listings"), against a real moto
server through the fault proxy (s3_proxy.py's list_damage_key and
list_drop_key actions).

gc: each manifests/ listing a `dtectl gc --keep-last 8 --grace-seconds 0`
makes is damaged in turn, once per run (v00000003's key flipped out of the
key grammar, flipped inside it but out of the manifest grammar, or its
<Contents> dropped): no run deletes a blob, `verify` stays clean and
version 3 exports. Before listings were checked, the damaged key in the
sweep's listing made gc delete v00000003's blobs.

Publish: a publisher of a world of one with dte's TCP transport, whose
listing of the latest version is damaged once publishes its step; a real
other writer still gets "another writer changed it".

A missing blob is named as such, not as a missing manifest.
"""

import json
import os
import sys

import pytest

from ckpt_util import CheckpointSequence  # noqa: F401  (the ckpts fixture's type)
import dtectl_util
from dtectl_util import OK, Dtectl

SOURCE = os.environ.get("DTE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(SOURCE, "build"))
FAST_RETRIES = {"DTE_S3_MAX_ATTEMPTS": "4", "DTE_S3_RETRY_BASE_MS": "10",
                "DTE_S3_RETRY_MAX_MS": "50"}
MANIFEST_LISTING = "prefix=p%2Fmanifests%2F"
# v00000003.json's last digit: 0x10 gives '#' (outside the key grammar),
# 0x40 's' (a valid key, but no manifest's).
DAMAGES = [("list_damage_key", 0x10), ("list_damage_key", 0x40), ("list_drop_key", 0)]


def dtectl(moto, endpoint, uri, cache):
    return dtectl_util.s3(moto, uri, cache, endpoint,
                          env={**FAST_RETRIES, "DTE_SPOOL_DIR": str(cache) + "-spool"})


def gc(d):
    r = d.run("gc", "--json", "--keep-last", 8, "--grace-seconds", 0)
    assert r.returncode == OK, r.stderr
    return json.loads(r.stdout)


def test_gc_deletes_no_blob_of_a_kept_version_whichever_manifest_listing_is_damaged(
        moto, faults, bucket, ckpts, tmp_path):
    uri = f"s3://{bucket}/p"
    via = dtectl(moto, faults.endpoint, uri, tmp_path / "via")
    via.ok("import", ckpts.dir(0))
    for step in (1, 2, 3):
        assert via.commit(ckpts.dir(step)) == step
    # How many manifests/ listings one gc makes, none of them damaged.
    count = faults.add_rule(action="pass", method="GET", query=MANIFEST_LISTING, times=None)
    assert gc(via)["blobs_deleted"] == 0
    listings = count.matched
    assert listings >= 4, listings  # opening, planning, deleting manifests, the sweep
    runs = 0
    for action, mask in DAMAGES:
        for position in range(listings):
            faults.clear_rules()
            rule = faults.add_rule(action=action, mask=mask, method="GET",
                                   query=MANIFEST_LISTING, skip=position, times=1)
            result = gc(via)
            assert rule.fired == 1, (action, position)
            assert result["blobs_deleted"] == 0, (action, mask, position, result)
            assert result["removed"] == 0 and result["kept"] == 4, result
            runs += 1
    print(f"{runs} gc runs, one damaged manifests/ listing each ({listings} positions, "
          f"{len(DAMAGES)} kinds): no blob deleted")
    faults.clear_rules()
    check = dtectl(moto, moto.endpoint, uri, tmp_path / "check")
    assert check.versions() == [0, 1, 2, 3]
    r = check.run("verify")
    assert r.returncode == OK, r.stdout + r.stderr
    check.ok("export", "--version", 3, tmp_path / "v3")
    assert (tmp_path / "v3" / "config.json").exists()


def test_export_names_the_missing_blob_not_its_manifest(ckpts, tmp_path):
    d = Dtectl(tmp_path / "store", tmp_path / "cache")
    d.ok("import", ckpts.dir(0))
    manifest = json.loads((tmp_path / "store" / "manifests" / "v00000000.json").read_text())
    table = manifest["block_table"]["hash"]
    (tmp_path / "store" / "blobs" / table[:2] / table).unlink()
    fresh = Dtectl(tmp_path / "store", tmp_path / "cache2")
    r = fresh.run("export", "--version", 0, tmp_path / "out")
    assert r.returncode != OK
    assert f"blobs/{table[:2]}/{table}" in r.stderr, r.stderr
    assert "its manifest manifests/v00000000.json exists" in r.stderr, r.stderr
    assert "is gone from" not in r.stderr, r.stderr


@pytest.fixture
def dte_lib():
    sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
    os.environ.setdefault("DTE_LIBRARY", os.path.join(BUILD, "sync", "libdte.so"))
    torch = pytest.importorskip("torch")
    import dte
    return dte, torch


class Trainer:
    """One small AdamW-trained tensor published step by step."""

    def __init__(self, torch, root):
        import safetensors.torch
        self.torch = torch
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(0.02 * torch.randn(48, 40))
        self.init = root / "init"
        self.init.mkdir()
        safetensors.torch.save_file({"w": self.w.detach().to(torch.bfloat16)},
                                    str(self.init / "model.safetensors"),
                                    metadata={"format": "pt"})
        (self.init / "config.json").write_text('{"model_type": "llama"}')
        self.opt = torch.optim.AdamW([self.w], lr=1e-3, weight_decay=0.01, fused=True)

    def step(self, pub, n):
        self.w.grad = self.torch.randn_like(self.w)
        self.opt.step()
        st = self.opt.state[self.w]
        return int(pub.publish_adamw(step=n, params={"w": (self.w.detach(), st["exp_avg"],
                                                           st["exp_avg_sq"])},
                                     lr=1e-3, weight_decay=0.01))


def test_a_damaged_listing_is_not_another_writer(moto, faults, bucket, dte_lib, tmp_path,
                                                 monkeypatch):
    dte, torch = dte_lib
    for k, v in {**moto.env(), "AWS_ENDPOINT_URL": faults.endpoint, **FAST_RETRIES}.items():
        monkeypatch.setenv(k, v)
    uri = f"s3://{bucket}/p"
    t = Trainer(torch, tmp_path)
    with dte.Publisher(uri, cache_dir=str(tmp_path / "c0")) as first:
        assert first.import_checkpoint(str(t.init)) == 0
    rendezvous = tmp_path / "rdv"
    rendezvous.mkdir()
    # No cache directory: every listing is a full one, the kind damaged here.
    with dte.Publisher(uri, rank=0, world_size=1, rendezvous=str(rendezvous)) as pub:
        assert t.step(pub, 1) == 1
        # The listing that tells the next step its parent lacks the latest
        # version, or names a newer one that is not there (v00000002's last
        # digit XOR 0x01: v00000003).
        for n, (action, mask) in enumerate([("list_drop_key", 0), ("list_damage_key", 0x01)]):
            faults.clear_rules()
            rule = faults.add_rule(action=action, mask=mask, method="GET",
                                   query=MANIFEST_LISTING, times=1)
            assert t.step(pub, 2 + n) == 2 + n
            assert rule.fired == 1
        faults.clear_rules()
        # A real other writer.
        other = dtectl(moto, moto.endpoint, uri, tmp_path / "other")
        assert other.commit(t.init) == 4
        with pytest.raises(dte.VersionConflict) as e:
            t.step(pub, 4)
        assert "another writer changed it" in str(e.value), str(e.value)
        assert "v00000004, not v00000003" in str(e.value), str(e.value)
