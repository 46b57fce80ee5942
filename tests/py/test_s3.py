"""dtectl against s3://bucket/prefix stores on a real S3-compatible server
(moto, on loopback, checking every request's SigV4 signature), cross-checked
with the AWS CLI.

What a user sees must match the local-directory store exactly: exports are
byte-identical to the committed checkpoints, the object layout is the same
(a store directory synced to S3 is a valid S3 store, and the reverse), two
racing publishers of one version give exactly one winner, and credentials
never appear in any output.
"""

import json
import re
import time

import pytest

import s3_util
import store_util
from dtectl_util import CONFLICT, ERROR, OK, Dtectl



def s3_dtectl(moto, uri, root, env=None):
    """dtectl on `uri` with the server's environment and no other AWS_ variable."""
    d = Dtectl(uri, root / "cache", env={**moto.env(), **(env or {})})
    for k in [k for k in d.env if k.startswith("AWS_") and k not in moto.env() and
              k not in (env or {})]:
        del d.env[k]
    return d


def assert_no_secrets(moto, *texts):
    for text in texts:
        for secret in moto.secrets():
            assert secret not in text, f"a credential was printed: {text!r}"


def test_commit_log_export_verify_round_trip(moto, bucket, ckpts, tmp_path):
    dte = s3_dtectl(moto, f"s3://{bucket}/runs/policy", tmp_path)
    started = time.monotonic()
    dte.ok("import", ckpts.dir(0))
    for step in (1, 2):
        assert dte.commit(ckpts.dir(step)) == step
    commit_seconds = time.monotonic() - started
    log = dte.log()
    assert [v["version"] for v in log] == [0, 1, 2]
    assert [v["kind"] for v in log] == ["anchor", "delta", "delta"]
    for step in (0, 1, 2):
        store_util.same_tree(dte.export(step, tmp_path / f"out{step}"), ckpts.dir(step))
    verify = json.loads(dte.ok("verify", "--json").stdout)
    assert verify["ok"] and verify["versions"] == 3 and verify["problems"] == []
    print(f"import + 2 commits to S3: {commit_seconds:.2f} s")

    # The AWS CLI sees the documented layout, blobs named by their hashes.
    keys = s3_util.s3_keys(moto, bucket, "runs/policy")
    assert "dte-store.json" in keys
    assert [k for k in keys if k.startswith("manifests/")] == [
        f"manifests/v{v:08d}.json" for v in (0, 1, 2)]
    assert all(re.fullmatch(r"blobs/([0-9a-f]{2})/\1[0-9a-f]{30}", k)
               for k in keys if k.startswith("blobs/")), keys
    assert set(keys) == {"dte-store.json"} | {k for k in keys if k.startswith(("manifests/",
                                                                              "blobs/"))}
    down = tmp_path / "down"
    s3_util.aws(moto, "s3", "cp", "--recursive", f"s3://{bucket}/runs/policy", down)
    for key in keys:
        if key.startswith("blobs/"):
            data = (down / key).read_bytes()
            assert store_util.xxh128_hex(data) == key.rsplit("/", 1)[1], key
    manifest = json.loads(s3_util.aws(
        moto, "s3", "cp", f"s3://{bucket}/runs/policy/manifests/v00000002.json", "-").stdout)
    assert manifest["version"] == 2 and manifest["parent"] == 1


def test_endpoint_flag_replaces_the_environment(moto, bucket, ckpts, tmp_path):
    dte = s3_dtectl(moto, f"s3://{bucket}/p", tmp_path)
    del dte.env["AWS_ENDPOINT_URL"]
    r = dte.run("import", ckpts.dir(0), "--endpoint", moto.endpoint)
    assert r.returncode == OK, r.stderr
    r = dte.run("log", "--json", "--endpoint", moto.endpoint)
    assert r.returncode == OK and [v["version"] for v in json.loads(r.stdout)] == [0]
    # The flag wins over a wrong variable.
    dte.env["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"
    assert dte.run("log", "--endpoint", moto.endpoint).returncode == OK
    assert dte.run("log").returncode == ERROR


def test_racing_publishers_of_one_version_exactly_one_wins(moto, bucket, ckpts, tmp_path):
    dte = s3_dtectl(moto, f"s3://{bucket}/race", tmp_path)
    dte.ok("import", ckpts.dir(0))
    for trial in range(3):
        version = 1 + trial
        dirs = [ckpts.dir(1 + trial % 2), ckpts.dir(2 - trial % 2)]
        procs = [dte.popen("commit", d, "--version", version) for d in dirs]
        results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
        codes = sorted(rc for rc, _, _ in results)
        assert codes == [OK, CONFLICT], (trial, [(rc, err) for rc, _, err in results])
        winner = next(i for i, (rc, _, _) in enumerate(results) if rc == OK)
        loser_err = results[1 - winner][2]
        assert str(version) in loser_err and ("exists" in loser_err or "changed" in loser_err), \
            loser_err
        store_util.same_tree(dte.export(version, tmp_path / f"out{trial}"), dirs[winner])
    assert [v["version"] for v in dte.log()] == [0, 1, 2, 3]
    dte.ok("verify")


def test_local_store_synced_to_s3_is_a_valid_s3_store(moto, bucket, ckpts, tmp_path):
    local = Dtectl(tmp_path / "local", tmp_path / "local-cache")
    local.ok("import", ckpts.dir(0))
    local.ok("commit", ckpts.dir(1))
    s3_util.aws(moto, "s3", "sync", tmp_path / "local", f"s3://{bucket}/synced")
    remote = s3_dtectl(moto, f"s3://{bucket}/synced", tmp_path / "r")
    remote.ok("verify")
    assert [v["version"] for v in remote.log()] == [0, 1]
    store_util.same_tree(remote.export(1, tmp_path / "out"), ckpts.dir(1))
    assert remote.commit(ckpts.dir(2)) == 2  # and it takes new versions
    store_util.same_tree(remote.export(2, tmp_path / "out2"), ckpts.dir(2))


def test_s3_store_synced_to_a_directory_is_a_valid_local_store(moto, bucket, ckpts, tmp_path):
    remote = s3_dtectl(moto, f"s3://{bucket}/origin", tmp_path / "r")
    remote.ok("import", ckpts.dir(0))
    remote.ok("commit", ckpts.dir(1))
    s3_util.aws(moto, "s3", "sync", f"s3://{bucket}/origin", tmp_path / "copy")
    local = Dtectl(tmp_path / "copy", tmp_path / "copy-cache")
    local.ok("verify")
    assert local.versions() == [0, 1]
    store_util.same_tree(local.export(1, tmp_path / "out"), ckpts.dir(1))


def test_missing_bucket_is_a_clear_error(moto, ckpts, tmp_path):
    dte = s3_dtectl(moto, "s3://no-such-bucket-here/p", tmp_path)
    r = dte.run("log")
    assert r.returncode == ERROR and "s3://no-such-bucket-here/p" in r.stderr, r.stderr
    assert "bucket no-such-bucket-here" in r.stderr and "does not exist" in r.stderr, r.stderr
    assert "not a dte store" not in r.stderr, r.stderr
    r = dte.run("import", ckpts.dir(0))
    assert r.returncode == ERROR, r.stderr
    assert "bucket no-such-bucket-here" in r.stderr and "does not exist" in r.stderr, r.stderr
    assert "NoSuchBucket" in r.stderr, r.stderr


def test_credentials_never_appear_in_any_output(moto, bucket, ckpts, tmp_path):
    uri = f"s3://{bucket}/secret-check"
    dte = s3_dtectl(moto, uri, tmp_path)
    runs = [
        dte.run("import", ckpts.dir(0)),
        dte.run("commit", ckpts.dir(1), "--json"),
        dte.run("commit", ckpts.dir(2), "--version", 1),  # conflict
        dte.run("log"),
        dte.run("verify", "--json"),
        dte.run("export", "--version", 7, tmp_path / "nope"),  # missing version
        dte.run("gc", "--keep-last", 1, "--json"),
    ]
    assert [r.returncode for r in runs] == [OK, OK, CONFLICT, OK, OK, ERROR, OK], \
        [(r.returncode, r.stderr) for r in runs]
    # Failures below the store: no server, a missing bucket, a malformed endpoint.
    for env in ({"AWS_ENDPOINT_URL": "http://127.0.0.1:9"},
                {"AWS_ENDPOINT_URL": moto.endpoint.replace("http", "htp")}):
        runs.append(s3_dtectl(moto, uri, tmp_path, env=env).run("log"))
        assert runs[-1].returncode == ERROR, runs[-1].stderr
    runs.append(s3_dtectl(moto, "s3://missing-bucket-x/p", tmp_path).run("verify"))
    assert runs[-1].returncode == ERROR
    wrong = "Wrong/Secret+Distinctive-0123456789abcdef"
    r = s3_dtectl(moto, uri, tmp_path, env={"AWS_SECRET_ACCESS_KEY": wrong}).run("log")
    assert r.returncode == ERROR and "SignatureDoesNotMatch" in r.stderr, r.stderr
    assert wrong not in r.stdout + r.stderr
    for r in runs:
        assert_no_secrets(moto, r.stdout, r.stderr)
    assert "cannot reach" in runs[-3].stderr, runs[-3].stderr


def test_objects_written_by_the_aws_cli_are_read_back(moto, bucket, ckpts, tmp_path):
    """A version committed through dtectl, then one of its blobs replaced by
    the AWS CLI with damaged bytes: verify names it."""
    dte = s3_dtectl(moto, f"s3://{bucket}/dmg", tmp_path)
    dte.ok("import", ckpts.dir(0))
    blob = next(k for k in s3_util.s3_keys(moto, bucket, "dmg") if k.startswith("blobs/"))
    path = tmp_path / "blob"
    s3_util.aws(moto, "s3", "cp", f"s3://{bucket}/dmg/{blob}", path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    s3_util.aws(moto, "s3", "cp", path, f"s3://{bucket}/dmg/{blob}")
    r = dte.run("verify")
    assert r.returncode == 4, r.stderr
    assert blob.rsplit("/", 1)[1] in r.stderr, r.stderr
