"""End-to-end tests of dtectl as users and scripts drive it.

Each test runs the built dtectl on its own store and checks what a user sees
(stdout, stderr, exit status) and what is on disk (exported files, the store
tree) against values computed here from the checkpoints themselves.
"""

import datetime
import fcntl
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
from safetensors import safe_open

import ckpt_util
import corrupt_util
import dtectl_util
import store_util
import variant_util
from dtectl_util import CONFLICT, CORRUPT, ERROR, OK, USAGE

RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")


def one_line(stderr):
    lines = stderr.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0], f"expected one line on stderr, got {stderr!r}"
    return lines[0]


def parse_rfc3339(s):
    assert RFC3339.match(s), f"not RFC 3339: {s!r}"
    return datetime.datetime.fromisoformat(s.replace("Z", "+00:00"))


def commit_measured(dte, cmd, ckpt_dir, *args):
    """Runs import/commit --json; returns (summary, bytes of the blobs it added)."""
    before = store_util.blobs(dte.store) if os.path.isdir(dte.store) else {}
    summary = json.loads(dte.ok(cmd, ckpt_dir, "--json", *args).stdout)
    after = store_util.blobs(dte.store)
    return summary, sum(size for h, size in after.items() if h not in before)


def check_with_safetensors(out_dir, ckpt):
    """Reads an exported directory with the safetensors package."""
    for shard in ckpt.shards:
        with safe_open(os.path.join(out_dir, shard.name), framework="pt") as f:
            assert sorted(f.keys()) == sorted(shard.tensors)
            assert f.metadata() == shard.metadata
            for name in shard.tensors:
                dtype, want = ckpt.tensors[name]
                sl = f.get_slice(name)
                assert (sl.get_dtype(), list(sl.get_shape())) == (dtype, list(want.shape)), name
                if dtype.startswith("F8"):  # torch 1.13 has no float8: compare raw bytes
                    got = ckpt_util.read_safetensors(os.path.join(out_dir, shard.name))[1][name][1]
                else:
                    got = ckpt_util.from_torch(f.get_tensor(name))
                assert np.array_equal(got, want), name


# --- 1. round trip -------------------------------------------------------------

def test_export_of_every_version_is_byte_identical(dte, ckpts, tmp_path):
    dte.ok("import", ckpts.dir(0))
    for step in range(1, 5):
        dte.ok("commit", ckpts.dir(step))
    for step in range(5):
        out = dte.export(step, tmp_path / f"out{step}")
        store_util.same_tree(out, ckpts.dir(step))
        check_with_safetensors(out, ckpts.state(step))
    store_util.same_tree(dte.export("latest", tmp_path / "latest"), ckpts.dir(4))
    store_util.same_tree(dte.export("v00000002", tmp_path / "named"), ckpts.dir(2))
    summary = json.loads(dte.ok("export", "--version", 3, tmp_path / "j", "--json").stdout)
    sizes = [os.path.getsize(os.path.join(ckpts.dir(3), f)) for f in os.listdir(ckpts.dir(3))]
    assert (summary["version"], summary["files"], summary["bytes"]) == (3, len(sizes), sum(sizes))


def test_edge_layouts_round_trip(dte, tmp_path):
    """Zero-element and scalar tensors, block-boundary sizes, an empty file, no index."""
    rng = np.random.default_rng(7)
    block = 256 * 1024
    tensors = [("a.scalar", "F32", rng.integers(0, 2**32, (), np.uint32)),
               ("b.empty", "BF16", np.zeros((0, 16), np.uint16)),
               ("c.one_block", "U8", rng.integers(0, 256, block, np.uint8)),
               ("d.block_plus_one", "BF16", rng.integers(0, 2**16, block // 2 + 1, np.uint16)),
               ("e.empty_last", "I64", np.zeros((3, 0), np.uint64))]
    dirs = []
    for step in range(3):
        d = tmp_path / f"in{step}"
        d.mkdir()
        ckpt_util.write_safetensors(d / "model.safetensors", tensors, {"format": "pt"})
        (d / "empty.txt").write_bytes(b"")
        dirs.append(d)
        for _, _, arr in tensors[2:4]:  # change the last element of the boundary tensors
            arr.reshape(-1)[-1] ^= 1
    dte.ok("import", dirs[0])
    dte.ok("commit", dirs[1])
    dte.ok("commit", dirs[2])
    assert [v["kind"] for v in dte.log()] == ["anchor", "delta", "delta"]
    assert [v["changed_elements"] for v in dte.log()][1:] == [2, 2]
    for step in range(3):
        store_util.same_tree(dte.export(step, tmp_path / f"out{step}"), dirs[step])


# --- 2. version numbers and summaries ------------------------------------------

def test_version_numbers_on_stdout(dte, ckpts):
    assert dte.ok("import", ckpts.dir(0)).stdout == "0\n"
    assert dte.ok("commit", ckpts.dir(1)).stdout == "1\n"
    assert dte.ok("commit", ckpts.dir(2), "--version", 5).stdout == "5\n"
    for taken in (5, 3, 1):
        r = dte.run("commit", ckpts.dir(3), "--version", taken)
        assert r.returncode != OK and r.stdout == ""
        msg = one_line(r.stderr)
        assert str(taken) in msg and "5" in msg, msg
    assert dte.ok("commit", ckpts.dir(3)).stdout == "6\n"
    log = {v["version"]: v for v in dte.log()}
    assert sorted(log) == [0, 1, 5, 6]
    assert (log[5]["parent"], log[6]["parent"]) == (1, 5)


def test_commit_of_an_existing_version_is_a_conflict(base_store, ckpts, tmp_path):
    """What a publisher that lost a race by a whole commit sees: exit 3, like any loser."""
    dte = base_store.copy_to(tmp_path)
    before = store_util.snapshot(dte.store)
    r = dte.run("commit", ckpts.dir(2), "--version", 1)
    msg = one_line(r.stderr)
    assert r.returncode == CONFLICT and "1" in msg and "exists" in msg, (r.returncode, msg)
    assert store_util.snapshot(dte.store) == before


def test_json_summaries(dte, ckpts):
    s0 = ckpts.state(0)
    imp = json.loads(dte.ok("import", ckpts.dir(0), "--json").stdout)
    assert imp["version"] == 0 and imp["parent"] is None and imp["kind"] == "anchor"
    assert imp["anchor_reason"]
    assert (imp["tensors"], imp["elements"], imp["changed_elements"], imp["dense_bytes"]) == (
        len(s0.tensors), s0.elements(), s0.elements(), s0.dense_bytes())
    input_bytes = sum(os.path.getsize(os.path.join(ckpts.dir(0), f))
                      for f in os.listdir(ckpts.dir(0)))
    assert imp["input_bytes"] == input_bytes

    delta = json.loads(dte.ok("commit", ckpts.dir(1), "--json").stdout)
    changed = sum(ckpt_util.changed_elements(s0, ckpts.state(1)).values())
    assert (delta["version"], delta["parent"], delta["kind"], delta["anchor_reason"]) == (
        1, 0, "delta", "")
    assert delta["changed_elements"] == changed
    assert 0 < delta["stored_bytes"] < delta["dense_bytes"] / 4
    assert isinstance(delta["seconds"], float) and delta["seconds"] >= 0

    anchor = json.loads(dte.ok("commit", ckpts.dir(2), "--anchor", "--json").stdout)
    assert (anchor["version"], anchor["parent"], anchor["kind"]) == (2, None, "anchor")
    assert anchor["changed_elements"] == anchor["elements"] == s0.elements()
    again = json.loads(dte.ok("import", ckpts.dir(3), "--json").stdout)
    assert (again["version"], again["parent"], again["kind"]) == (3, None, "anchor")
    log = dte.log()
    assert [(v["kind"], v["parent"]) for v in log] == [("anchor", None), ("delta", 0),
                                                      ("anchor", None), ("anchor", None)]


# --- 3. log ----------------------------------------------------------------------

def test_log_reports_exact_statistics(dte, ckpts):
    stored, windows = [], []
    for step in range(4):
        t0 = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
        summary, added = commit_measured(dte, "import" if step == 0 else "commit", ckpts.dir(step))
        windows.append((t0, datetime.datetime.now(datetime.timezone.utc)))
        assert summary["stored_bytes"] == added
        stored.append(added)
    log = dte.log()
    assert [v["version"] for v in log] == [0, 1, 2, 3]
    manifests = store_util.manifests(dte.store)
    for step, v in enumerate(log):
        ckpt = ckpts.state(step)
        changed = (ckpt.elements() if step == 0 else
                   sum(ckpt_util.changed_elements(ckpts.state(step - 1), ckpt).values()))
        assert v["parent"] == (None if step == 0 else step - 1)
        assert v["kind"] == ("anchor" if step == 0 else "delta")
        assert (v["tensors"], v["elements"], v["changed_elements"]) == (
            len(ckpt.tensors), ckpt.elements(), changed)
        assert (v["stored_bytes"], v["dense_bytes"]) == (stored[step], ckpt.dense_bytes())
        created = parse_rfc3339(v["created"])
        assert windows[step][0] <= created <= windows[step][1]
        # The manifest's per-tensor record: content hash and changed count.
        m = manifests[step][1]
        per_tensor = {t["name"]: t for f in m["files"] for t in f.get("tensors", [])}
        prev = ckpts.state(step - 1) if step else None
        for name, (_, arr) in ckpt.tensors.items():
            assert per_tensor[name]["hash"] == store_util.xxh128_hex(arr.tobytes()), name
            want = arr.size if prev is None else int(np.count_nonzero(prev.tensors[name][1] != arr))
            assert per_tensor[name]["changed"] == want, name
    # Anchor: every byte of every file, plus the block table, stored once.
    v0 = ckpts.state(0)
    files = sum(os.path.getsize(os.path.join(ckpts.dir(0), f)) for f in os.listdir(ckpts.dir(0)))
    blocks = sum(-(-a.nbytes // (256 * 1024)) for _, a in v0.tensors.values())
    assert stored[0] == files + 16 + 32 * blocks
    # Content addressing: every blob is named by the XXH3-128 of its bytes.
    for h in store_util.blobs(dte.store):
        with open(store_util.blob_path(dte.store, h), "rb") as f:
            assert store_util.xxh128_hex(f.read()) == h

    table = dte.ok("log").stdout.splitlines()
    assert table[0].split()[:5] == ["VERSION", "PARENT", "KIND", "TENSORS", "ELEMENTS"]
    rows = [line.split() for line in table[1:]]
    assert [r[:3] for r in rows] == [["v00000000", "-", "anchor"],
                                     ["v00000001", "v00000000", "delta"],
                                     ["v00000002", "v00000001", "delta"],
                                     ["v00000003", "v00000002", "delta"]]
    assert [int(r[4]) for r in rows] == [v["elements"] for v in log]
    assert [r[-1] for r in rows] == [v["created"] for v in log]


def test_log_limit_and_since_select_the_newest_versions(base_store, ckpts, tmp_path):
    dte = base_store.copy_to(tmp_path)
    for step in range(2, 6):
        dte.ok("commit", ckpts.dir(step))
    full = dte.log()

    def selected(*args, **kw):
        return [v["version"] for v in json.loads(dte.ok("log", "--json", *args, **kw).stdout)]

    assert selected("--limit", 2) == [4, 5]
    assert selected("--since", 3) == [3, 4, 5]
    assert selected("--since", 1, "--limit", 2) == [4, 5]
    assert selected("--since", 4, "--limit", 3) == [4, 5]
    assert selected("--limit", 100) == list(range(6))
    assert selected("--since", 6) == []
    assert json.loads(dte.ok("log", "--json", "--since", 2, "--limit", 3).stdout) == full[-3:]
    table = dte.ok("log", "--limit", 1).stdout.splitlines()
    assert table[0].split()[0] == "VERSION" and [r.split()[0] for r in table[1:]] == ["v00000005"]
    # Only the versions printed are read: with v1's block table unreadable, a
    # limited log on a host with no index yet still works, a full one fails.
    _, m = store_util.manifests(dte.store)[1]
    table_blob = store_util.blob_path(dte.store, m["block_table"]["hash"])
    os.unlink(table_blob)
    os.mkdir(table_blob)
    fresh = str(tmp_path / "fresh-cache")
    assert selected("--since", 2, cache=fresh) == [2, 3, 4, 5]
    assert selected("--limit", 1, cache=str(tmp_path / "fresh-cache2")) == [5]
    r = dte.run("log", "--json", cache=str(tmp_path / "fresh-cache3"))
    assert r.returncode == ERROR and m["block_table"]["hash"] in r.stderr, r.stderr
    for bad in (["--limit", 0], ["--limit", -1], ["--since", "x"], ["--limit", "1.5"]):
        r = dte.run("log", *bad)
        assert r.returncode == USAGE and r.stdout == "" and bad[0] in r.stderr, (bad, r.stderr)


# --- 3b. stats ------------------------------------------------------------------

def block_records(store, manifest):
    """The version's block table records: (kind, length) per block."""
    import struct
    with open(store_util.blob_path(store, manifest["block_table"]["hash"]), "rb") as f:
        data = f.read()
    assert data[:8] == b"DTEBLKT1"
    count = struct.unpack_from("<I", data, 12)[0]
    return [(data[16 + 32 * i], struct.unpack_from("<I", data, 16 + 32 * i + 16)[0])
            for i in range(count)]


def kind_of(name):
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if "." + proj + "." in name:
            return proj
    if ".mlp." in name:
        return "mlp"
    if "norm" in name:
        return "norm"
    return {"model.embed_tokens.weight": "embedding", "lm_head.weight": "lm_head"}.get(name, "other")


def test_stats_match_the_checkpoints_and_the_block_tables(dte, ckpts):
    for step in range(4):
        dte.ok("import" if step == 0 else "commit", ckpts.dir(step))
    manifests = store_util.manifests(dte.store)
    log = dte.log()
    rows = json.loads(dte.ok("stats", "--json").stdout)
    want = []
    for step in range(4):
        ckpt, prev = ckpts.state(step), (ckpts.state(step - 1) if step else None)
        m = manifests[step][1]
        records = block_records(dte.store, m)
        for f in m["files"]:
            for t in f.get("tensors", []):
                _, arr = ckpt.tensors[t["name"]]
                mine = records[t["first_block"]:t["first_block"] + t["blocks"]]
                changed = (arr.size if prev is None else
                           int(np.count_nonzero(prev.tensors[t["name"]][1] != arr)))
                want.append({"version": step, "kind": "anchor" if step == 0 else "delta",
                             "group": t["name"], "tensors": 1, "elements": arr.size,
                             "changed": changed, "changed_fraction": changed / arr.size,
                             "blocks": t["blocks"],
                             "blocks_changed": sum(1 for k, _ in mine if k != 0),
                             "stored_bytes": sum(n for k, n in mine if k != 0),
                             "dense_bytes": arr.nbytes,
                             "version_stored_bytes": log[step]["stored_bytes"]})
    assert rows == want
    assert any(r["changed"] == 0 for r in rows[len(rows) // 4:])  # untouched tensors too

    # Groupings add up the same rows.
    def totals(by):
        out = {}
        for r in json.loads(dte.ok("stats", "--json", "--by", by).stdout):
            key = (r["version"], r["group"])
            assert key not in out
            out[key] = r
        return out
    per_version = totals("version")
    assert sorted(per_version) == [(v, "all") for v in range(4)]
    def layer_of(n):
        return n.split("layers.")[1].split(".")[0] if "layers." in n else "-"
    for by, group_of in (("layer", layer_of), ("kind", kind_of),
                         ("layer-kind", lambda n: layer_of(n) + "/" + kind_of(n))):
        got = totals(by)
        for v in range(4):
            mine = [r for r in rows if r["version"] == v]
            groups = sorted({group_of(r["group"]) for r in mine})
            assert sorted(g for (ver, g) in got if ver == v) == groups, by
            for g in groups:
                part = [r for r in mine if group_of(r["group"]) == g]
                for field in ("tensors", "elements", "changed", "blocks", "blocks_changed",
                              "stored_bytes", "dense_bytes"):
                    assert got[(v, g)][field] == sum(r[field] for r in part), (by, v, g, field)
            for field in ("elements", "changed", "stored_bytes"):
                assert per_version[(v, "all")][field] == sum(r[field] for r in mine)
    layers = [r["group"] for r in json.loads(dte.ok("stats", "--json", "--by", "layer",
                                                     "--versions", "2").stdout)]
    assert layers == ["0", "1", "-"]
    layer_kinds = [r["group"] for r in json.loads(dte.ok("stats", "--json", "--by", "layer-kind",
                                                          "--versions", "2").stdout)]
    assert layer_kinds == sorted(layer_kinds, key=lambda g: (g[0] == "-", g.split("/")[0] != "-"
                                                             and int(g.split("/")[0]),
                                                             g.split("/")[1]))
    assert "0/q_proj" in layer_kinds and "-/embedding" in layer_kinds

    # CSV and the table carry the same figures; --versions selects.
    import csv
    import io
    r = dte.ok("stats", "--csv", "--versions", "1..2")
    got = list(csv.DictReader(io.StringIO(r.stdout)))
    sel = [w for w in want if w["version"] in (1, 2)]
    assert [(int(g["version"]), g["group"], int(g["changed"]), int(g["stored_bytes"]))
            for g in got] == [(w["version"], w["group"], w["changed"], w["stored_bytes"])
                              for w in sel]
    assert [float(g["changed_fraction"]) for g in got] == pytest.approx(
        [w["changed_fraction"] for w in sel], rel=1e-8)
    table = dte.ok("stats", "--versions", "2..", "--by", "kind").stdout.splitlines()
    assert table[0].split()[:4] == ["VERSION", "KIND", "GROUP", "TENSORS"]
    assert {line.split()[0] for line in table[1:]} == {"v00000002", "v00000003"}
    for text, versions in (("..1", [0, 1]), ("3", [3]), ("v00000001..v00000002", [1, 2])):
        got = json.loads(dte.ok("stats", "--json", "--by", "version", "--versions", text).stdout)
        assert [g["version"] for g in got] == versions, text


def test_stats_bad_input(dte, ckpts, tmp_path):
    r = dte.run("stats")
    assert r.returncode == ERROR and "does not exist" in one_line(r.stderr), r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert dte.run("import", str(empty)).returncode == ERROR  # creates the store, no version
    r = dte.run("stats")
    assert r.returncode == ERROR and "has no versions" in one_line(r.stderr), r.stderr
    for step in range(3):
        dte.ok("import" if step == 0 else "commit", ckpts.dir(step))
    r = dte.run("stats", "--versions", "1..7")
    assert r.returncode == ERROR and r.stdout == ""
    assert "v00000007 is not a version of store" in one_line(r.stderr), r.stderr
    for bad in ("2..1", "x", "..", "1...2", "-1"):
        r = dte.run("stats", "--versions", bad)
        assert r.returncode == USAGE and r.stdout == "" and "version range" in r.stderr, (bad,
                                                                                          r.stderr)
    for bad in (["--by", "file"], ["--json", "--csv"]):
        r = dte.run("stats", *bad)
        assert r.returncode == USAGE and r.stdout == "", (bad, r.stderr)
    # A damaged block table: the error names it; versions before it print.
    _, m = store_util.manifests(dte.store)[2]
    table_blob = store_util.blob_path(dte.store, m["block_table"]["hash"])
    os.chmod(table_blob, 0o644)
    with open(table_blob, "r+b") as f:
        f.seek(20)
        f.write(b"\xff\xff\xff\xff")
    r = dte.run("stats", "--by", "version", "--json", cache=str(tmp_path / "fresh"))
    assert r.returncode == CORRUPT and m["block_table"]["hash"] in r.stderr, r.stderr
    assert "v00000002" in r.stderr
    assert [g["version"] for g in json.loads(r.stdout)] == [0, 1]


def ulp_distance(x, y, dtype):
    """|position of x - position of y| in value order, per element (uint bits)."""
    bits = {"BF16": 16, "F16": 16, "F32": 32}[dtype]
    sign = np.uint64(1) << np.uint64(bits - 1)

    def ordered(v):
        v = v.astype(np.uint64)
        mag = (v & (sign - np.uint64(1))).astype(np.int64)
        return np.where((v & sign) != 0, -mag, mag)
    return np.abs(ordered(x) - ordered(y))


def test_diff_counts_every_differing_element_and_its_ulps(dte, ckpts):
    for step in range(3):
        dte.ok("import" if step == 0 else "commit", ckpts.dir(step))
    for a, b in ((0, 2), (2, 1), (1, 1)):
        got = json.loads(dte.ok("diff", str(a), str(b), "--json").stdout)
        assert (got["a"], got["b"]) == (a, b)
        sa, sb = ckpts.state(a), ckpts.state(b)
        by_name = {t["name"]: t for t in got["tensors"]}
        assert sorted(by_name) == sorted(sa.tensors) and len(by_name) == len(got["tensors"])
        total = 0
        for name, (dtype, x) in sa.tensors.items():
            y = sb.tensors[name][1]
            t = by_name[name]
            xb = x.view(np.uint8).reshape(-1, x.itemsize) if x.size else x
            yb = y.view(np.uint8).reshape(-1, y.itemsize) if y.size else y
            differ = int(np.count_nonzero((xb != yb).any(axis=1))) if x.size else 0
            total += differ
            assert (t["dtype"], t["elements"], t["differ"]) == (dtype, x.size, differ), name
            assert t["status"] == ("differs" if differ else "same"), name
            if dtype not in ("BF16", "F16", "F32"):
                assert t["ulps"] is None and t["max_ulp"] is None, name
                continue
            width = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32}[dtype]
            xi, yi = x.view(width).ravel(), y.view(width).ravel()
            mask = xi != yi
            dist = ulp_distance(xi[mask], yi[mask], dtype)
            hist = [c["count"] for c in t["ulps"]]
            assert t["nan"] == 0 and sum(hist) == int(np.count_nonzero(dist)), name
            assert t["max_ulp"] == (int(dist.max()) if dist.size else 0), name
            assert hist[0] == int(np.count_nonzero(dist == 1)), name
            assert hist[1] == int(np.count_nonzero(dist == 2)), name
            assert hist[2] == int(np.count_nonzero((dist > 2) & (dist <= 4))), name
            if not differ:
                assert t["blocks_read"] == 0, name  # equal hashes: nothing read
        assert got["differ"] == total
        assert (total == 0) == (a == b)
    table = dte.ok("diff", "0", "latest").stdout.splitlines()
    assert table[0].split()[:4] == ["TENSOR", "DTYPE", "STATUS", "DIFFER"]
    assert table[-1].startswith("v00000000 -> v00000002: ")
    for bad, code in ((["0", "9"], ERROR), (["x", "1"], ERROR), (["0"], USAGE)):
        r = dte.run("diff", *bad)
        assert r.returncode == code and r.stdout == "", (bad, r.stderr)
    assert "v00000009" in dte.run("diff", "0", "9").stderr


# --- 4. change detection on raw bits -----------------------------------------------

def test_changes_detected_on_raw_bits_for_every_dtype(dte, tmp_path):
    rng = np.random.default_rng(11)
    states = [variant_util.dtype_tensors(rng)]
    for _ in range(2):
        states.append(variant_util.nan_and_zero_step(states[-1], rng))
    states.append(states[-1])  # an unchanged step
    dirs = []
    for step, tensors in enumerate(states):
        d = tmp_path / f"in{step}"
        d.mkdir()
        ckpt_util.write_safetensors(d / "model.safetensors",
                                    [(n, dt, a) for n, (dt, a) in tensors.items()])
        (d / "config.json").write_text('{"model_type": "dtypes"}\n')
        dirs.append(d)
    dte.ok("import", dirs[0])
    for d in dirs[1:]:
        dte.ok("commit", d)
    log = dte.log()
    manifests = store_util.manifests(dte.store)
    for step in range(1, len(states)):
        per_tensor = {t["name"]: t["changed"] for t in manifests[step][1]["files"][1]["tensors"]}
        want = {n: int(np.count_nonzero(states[step - 1][n][1] != a))
                for n, (_, a) in states[step].items()}
        assert per_tensor == want, f"step {step}"
        assert log[step]["kind"] == "delta"
        assert log[step]["changed_elements"] == sum(want.values())
    assert log[1]["changed_elements"] > 0 and log[3]["changed_elements"] == 0
    for step, tensors in enumerate(states):
        out = dte.export(step, tmp_path / f"out{step}")
        store_util.same_tree(out, dirs[step])
        _, got = ckpt_util.read_safetensors(os.path.join(out, "model.safetensors"))
        for name, (dtype, arr) in tensors.items():
            assert got[name][0] == dtype and np.array_equal(got[name][1], arr), name


# --- 5. layout changes --------------------------------------------------------------

@pytest.mark.parametrize("change", variant_util.LAYOUT_CHANGES, ids=lambda f: f.__name__)
def test_layout_change_makes_an_exact_anchor(base_store, ckpts, tmp_path, change):
    dte = base_store.copy_to(tmp_path)
    ckpt = ckpts.state(2).clone()
    change(ckpt)
    changed = ckpt_util.write_checkpoint(ckpt, str(tmp_path / "changed"))
    summary = json.loads(dte.ok("commit", changed, "--json").stdout)
    assert (summary["version"], summary["kind"], summary["parent"]) == (2, "anchor", None)
    assert "layout" in summary["anchor_reason"]
    assert summary["elements"] == summary["changed_elements"] == ckpt.elements()
    assert dte.commit(ckpts.dir(3)) == 3  # and back to the old layout: an anchor again
    log = dte.log()
    assert [(v["kind"], v["parent"]) for v in log] == [("anchor", None), ("delta", 0),
                                                      ("anchor", None), ("anchor", None)]
    store_util.same_tree(dte.export(2, tmp_path / "out2"), changed)
    store_util.same_tree(dte.export(3, tmp_path / "out3"), ckpts.dir(3))
    store_util.same_tree(dte.export(1, tmp_path / "out1"), ckpts.dir(1))


def test_header_only_change_stays_an_exact_delta(base_store, ckpts, tmp_path):
    dte = base_store.copy_to(tmp_path)
    ckpt = ckpts.state(1).clone()
    ckpt.shards[0].metadata = {"format": "pt", "global_step": "1", "note": "x" * 300}
    changed = ckpt_util.write_checkpoint(ckpt, str(tmp_path / "meta"))
    assert ckpt_util.split_file(os.path.join(changed, ckpt.shards[0].name))[0] != \
        ckpt_util.split_file(os.path.join(ckpts.dir(1), ckpt.shards[0].name))[0]
    summary = json.loads(dte.ok("commit", changed, "--json").stdout)
    assert (summary["kind"], summary["parent"], summary["changed_elements"]) == ("delta", 1, 0)
    store_util.same_tree(dte.export(2, tmp_path / "out2"), changed)
    store_util.same_tree(dte.export(1, tmp_path / "out1"), ckpts.dir(1))


# --- 6. bad input ---------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(corrupt_util.CASES))
def test_bad_checkpoint_is_rejected_and_store_unchanged(base_store, ckpts, tmp_path, case):
    dte = base_store.copy_to(tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(ckpts.dir(2), bad)
    words = corrupt_util.CASES[case](str(bad))
    before = store_util.snapshot(dte.store)
    for cmd in ("commit", "import"):
        r = dte.run(cmd, bad)
        assert r.returncode == ERROR and r.stdout == "", (cmd, r.returncode, r.stderr)
        msg = one_line(r.stderr)
        for word in words:
            assert word in msg, f"{cmd}: {word!r} not in {msg!r}"
        assert store_util.snapshot(dte.store) == before, cmd
        assert store_util.tmp_entries(dte.store) == [], cmd
    assert dte.versions() == [0, 1]


def test_missing_or_foreign_store(dte, ckpts, tmp_path):
    r = dte.run("log", store="/nonexistent")
    assert r.returncode == ERROR and "/nonexistent" in one_line(r.stderr)
    missing = tmp_path / "no" / "store"
    plain = tmp_path / "plain"
    plain.mkdir()
    for store, word in ((missing, "does not exist"), (plain, "not a dte store")):
        for args in (["log"], ["verify"], ["gc", "--keep-last", 1], ["reindex"],
                     ["commit", ckpts.dir(0)], ["export", "--version", 0, tmp_path / "out"]):
            r = dte.run(*args, store=str(store))
            msg = one_line(r.stderr)
            assert r.returncode == ERROR and str(store) in msg and word in msg, (args, msg)
    assert not (tmp_path / "no").exists() and not (tmp_path / "out").exists()
    assert os.listdir(plain) in ([], ["tmp"])


def test_usage_errors_exit_2(dte, ckpts, tmp_path):
    env = dict(dte.env)
    for argv in (["log"], ["log", "--store", tmp_path, "--bogus"], ["export", "--store", tmp_path],
                 ["gc", "--store", tmp_path], ["frobnicate"]):
        r = subprocess.run([str(dtectl_util.binary()), *map(str, argv)], env=env,
                           capture_output=True, text=True)
        assert r.returncode == USAGE and r.stderr, (argv, r.returncode)
    assert not os.path.exists(dte.store)


def test_export_errors_leave_nothing(base_store, ckpts, tmp_path):
    dte = base_store.copy_to(tmp_path / "s")
    work = tmp_path / "work"
    work.mkdir()
    (work / "full").mkdir()
    (work / "full" / "keep.txt").write_text("mine\n")
    before = store_util.snapshot(work)
    r = dte.run("export", "--version", 7, work / "out")
    msg = one_line(r.stderr)
    assert r.returncode == ERROR and "v00000007" in msg, msg
    r = dte.run("export", "--version", "seven", work / "out")
    assert r.returncode != OK and "seven" in one_line(r.stderr)
    r = dte.run("export", "--version", 1, work / "full")
    msg = one_line(r.stderr)
    assert r.returncode == ERROR and str(work / "full") in msg and "not empty" in msg, msg
    assert store_util.snapshot(work) == before
    (work / "empty").mkdir()
    store_util.same_tree(dte.export(1, work / "empty"), ckpts.dir(1))


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("kind", ["data", "header", "raw", "table"])
def test_damaged_blob_is_caught(base_store, tmp_path, kind, how):
    dte = base_store.copy_to(tmp_path / "s")
    dte.log()  # warm the index
    blob, owner = store_util.pick_blob(dte.store, kind)
    store_util.damage(store_util.blob_path(dte.store, blob), how)
    r = dte.run("verify")
    assert r.returncode == CORRUPT and blob in r.stderr, r.stderr
    report = json.loads(dte.run("verify", "--json").stdout)
    assert report["ok"] is False and any(blob in p for p in report["problems"])
    work = tmp_path / "work"
    work.mkdir()
    cold = tmp_path / "cold-cache"
    # A warm index keeps its own checked copy of a block table; a cold one must read the blob.
    caches = [cold] if kind == "table" else [dte.cache, cold]
    for cache in caches:
        for version in (0, 1):
            r = dte.run("export", "--version", version, work / "out", cache=str(cache))
            msg = one_line(r.stderr)
            assert r.returncode == CORRUPT, (cache, version, r.returncode, msg)
            assert blob in msg or owner in msg, msg
            assert os.listdir(work) == [], os.listdir(work)


def test_failed_export_leaves_no_directories_behind(base_store, tmp_path):
    """export.h: a failed export leaves nothing behind, parents of OUT included."""
    dte = base_store.copy_to(tmp_path / "s")
    blob, _ = store_util.pick_blob(dte.store, "data")
    store_util.damage(store_util.blob_path(dte.store, blob), "flip")
    work = tmp_path / "work"
    work.mkdir()
    r = dte.run("export", "--version", 1, work / "a" / "b" / "out")
    assert r.returncode == CORRUPT, r.stderr
    assert os.listdir(work) == [], [p for p, _, _ in os.walk(work)]


@pytest.mark.parametrize("name", ["sub/config.json", "..", "../escaped.json", "config\0.json",
                                  "ABSOLUTE"])
def test_manifest_with_unsafe_file_name_is_refused(base_store, ckpts, tmp_path, name):
    dte = base_store.copy_to(tmp_path / "s")
    if name == "ABSOLUTE":
        name = str(tmp_path / "abs" / "escaped.json")
    (tmp_path / "abs").mkdir()
    _, m = store_util.manifests(dte.store)[1]
    m["version"] = 2
    next(f for f in m["files"] if f["name"] == "config.json")["name"] = name
    with open(os.path.join(dte.store, "manifests", "v00000002.json"), "w") as f:
        json.dump(m, f)
    work = tmp_path / "work"
    work.mkdir()
    (work / "placeholder").write_text("x")
    before = store_util.snapshot(work)
    r = dte.run("verify")
    assert r.returncode == CORRUPT and "v00000002" in r.stderr and "unsafe" in r.stderr, r.stderr
    r = dte.run("export", "--version", 2, work / "sub" / "out")
    msg = one_line(r.stderr)
    assert r.returncode != OK and "v00000002" in msg and "unsafe" in msg, msg
    assert store_util.snapshot(work) == before
    for dirpath, _, files in os.walk(tmp_path):
        assert "escaped.json" not in files, dirpath
    assert os.listdir(tmp_path / "abs") == []
    # The other versions stay readable.
    assert dte.ok("verify", "--version", 1)
    store_util.same_tree(dte.export(1, work / "v1"), ckpts.dir(1))


# --- 7. racing publishers ----------------------------------------------------------------

def _race(dte, dirs, *args):
    procs = [dte.popen("commit", d, *args) for d in dirs]
    return [(p.wait(timeout=120), *p.communicate()) for p in procs]


def test_racing_commits_for_one_version_exactly_one_wins(base_store, ckpts, tmp_path):
    dte = base_store.copy_to(tmp_path)
    wrong_loser = []  # collected so that every trial still checks the store
    for trial in range(10):
        version = 2 + trial
        dirs = [ckpts.dir(2 + trial % 2), ckpts.dir(3 - trial % 2)]
        results = _race(dte, dirs, "--version", version)
        winners = [i for i, (rc, _, _) in enumerate(results) if rc == OK]
        assert len(winners) == 1, (trial, [(rc, err) for rc, _, err in results])
        winner = winners[0]
        rc, out, err = results[1 - winner]
        msg = one_line(err)
        if rc != CONFLICT or str(version) not in msg or not ("exists" in msg or "changed" in msg):
            wrong_loser.append(f"trial {trial}: exit {rc}: {msg}")
        assert out == "" and results[winner][1] == f"{version}\n"
        assert dte.versions() == list(range(version + 1))
        store_util.same_tree(dte.export(version, tmp_path / f"out{trial}"), dirs[winner])
    assert dte.ok("verify")
    assert not wrong_loser, "losers must exit 3 naming the conflict:\n" + "\n".join(wrong_loser)


def test_racing_commits_without_version_never_collide(base_store, ckpts, tmp_path):
    dte = base_store.copy_to(tmp_path)
    for trial in range(5):
        latest = dte.versions()[-1]
        results = _race(dte, [ckpts.dir(2), ckpts.dir(3)])
        codes = sorted(rc for rc, _, _ in results)
        assert codes in ([OK, OK], [OK, CONFLICT]), (trial, [(rc, e) for rc, _, e in results])
        printed = sorted(int(out) for rc, out, _ in results if rc == OK)
        assert printed == list(range(latest + 1, latest + 1 + len(printed)))
        assert dte.versions() == list(range(latest + 1 + len(printed)))
    assert dte.ok("verify")


# --- 8. the local index -----------------------------------------------------------------

def _index_dir(dte):
    with open(os.path.join(dte.store, "dte-store.json")) as f:
        return os.path.join(dte.cache, json.load(f)["store_id"], "index")


def test_cache_dir_is_only_a_cache(base_store, ckpts, tmp_path):
    dte = base_store.copy_to(tmp_path)
    dte.ok("commit", ckpts.dir(2))
    before = dte.log()
    assert os.path.isdir(_index_dir(dte))
    shutil.rmtree(dte.cache)
    assert dte.log() == before
    store_util.same_tree(dte.export(2, tmp_path / "out"), ckpts.dir(2))
    shutil.rmtree(dte.cache)
    r = json.loads(dte.ok("reindex", "--json").stdout)
    assert r["versions"] == 3 and os.path.isdir(_index_dir(dte))
    assert os.path.dirname(_index_dir(dte)) == r["index"]
    assert dte.log() == before
    assert dte.ok("verify")


def test_index_held_by_another_process(base_store, ckpts, tmp_path):
    dte = base_store.copy_to(tmp_path)
    before = dte.log()
    with open(os.path.join(_index_dir(dte), "LOCK"), "r+b") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = dte.run("reindex")
        msg = one_line(r.stderr)
        assert r.returncode == ERROR and "in use" in msg and _index_dir(dte) in msg, msg
        # Everything else goes on without the index.
        assert dte.log() == before
        assert dte.commit(ckpts.dir(2)) == 2
        store_util.same_tree(dte.export(2, tmp_path / "out"), ckpts.dir(2))
    # The index, which missed v2, catches up once it is free again.
    assert dte.versions() == [0, 1, 2]
    assert json.loads(dte.ok("reindex", "--json").stdout)["versions"] == 3


# --- 9. gc ---------------------------------------------------------------------------------

def test_gc_keeps_the_newest_versions_exactly(dte, ckpts, tmp_path):
    dte.ok("import", ckpts.dir(0))
    for step in range(1, 10):
        dte.ok("commit", ckpts.dir(step))
    other_cache = str(tmp_path / "other-cache")
    assert len(dte.log(cache=other_cache)) == 10  # a second host's index, soon stale
    blobs_before = store_util.blobs(dte.store)
    before = store_util.snapshot(dte.store)
    dry = json.loads(dte.ok("gc", "--keep-last", 4, "--dry-run", "--json").stdout)
    assert (dry["kept"], dry["removed"], dry["dry_run"]) == (4, 6, True)
    assert store_util.snapshot(dte.store) == before

    r = json.loads(dte.ok("gc", "--keep-last", 4, "--grace-seconds", 0, "--json").stdout)
    blobs_after = store_util.blobs(dte.store)
    assert (r["kept"], r["removed"], r["rebased"]) == (4, 6, 1)
    assert r["blobs_deleted"] == len(set(blobs_before) - set(blobs_after)) > 0
    assert sum(blobs_after.values()) < sum(blobs_before.values())
    assert r["bytes_freed"] == sum(s for h, s in blobs_before.items() if h not in blobs_after)
    assert store_util.manifest_names(dte.store) == [
        "v00000006.r1.json", "v00000007.json", "v00000008.json", "v00000009.json"]
    assert set(blobs_after) == store_util.all_reachable_blobs(dte.store)
    for cache in (dte.cache, other_cache):
        log = dte.log(cache=cache)
        assert [(v["version"], v["kind"], v["parent"]) for v in log] == [
            (6, "anchor", None), (7, "delta", 6), (8, "delta", 7), (9, "delta", 8)]
        assert log[0]["revision"] == 1
    for step in range(6, 10):
        store_util.same_tree(dte.export(step, tmp_path / f"out{step}"), ckpts.dir(step))
    r = dte.run("export", "--version", 5, tmp_path / "out5")
    assert r.returncode == ERROR and "v00000005" in one_line(r.stderr)
    assert dte.ok("verify")

    # Life goes on after gc.
    assert dte.commit(ckpts.dir(10)) == 10
    assert dte.log()[-1]["parent"] == 9
    store_util.same_tree(dte.export(10, tmp_path / "out10"), ckpts.dir(10))
    r = json.loads(dte.ok("gc", "--keep-last", 5, "--grace-seconds", 0, "--json").stdout)
    assert (r["removed"], r["rebased"], r["blobs_deleted"]) == (0, 0, 0)
    assert dte.ok("verify")


def test_rebased_version_reads_as_an_anchor(base_store, ckpts, tmp_path):
    """A rebased version's statistics follow the anchor convention: all elements changed."""
    dte = base_store.copy_to(tmp_path)
    dte.ok("commit", ckpts.dir(2))
    r = json.loads(dte.ok("gc", "--keep-last", 2, "--grace-seconds", 0, "--json").stdout)
    assert (r["removed"], r["rebased"]) == (1, 1)
    v1 = dte.log()[0]
    assert (v1["version"], v1["kind"], v1["parent"], v1["revision"]) == (1, "anchor", None, 1)
    assert v1["changed_elements"] == v1["elements"] == ckpts.state(1).elements()
    _, m = store_util.manifests(dte.store)[1]
    for f in m["files"]:
        for t in f.get("tensors", []):
            assert t["changed"] == int(np.prod(t["shape"])), t["name"]
    store_util.same_tree(dte.export(1, tmp_path / "out"), ckpts.dir(1))


def test_gc_keep_every_keeps_a_thinned_history_cheaply(dte, ckpts, tmp_path):
    dte.ok("import", ckpts.dir(0))
    for step in range(1, 12):
        dte.ok("commit", ckpts.dir(step))
    dense = ckpts.state(0).dense_bytes()
    gc_args = ("gc", "--keep-last", 3, "--keep-every", 4, "--grace-seconds", 0, "--json")
    before = store_util.snapshot(dte.store)
    dry = json.loads(dte.ok(*gc_args, "--dry-run").stdout)
    assert (dry["kept"], dry["removed"], dry["rebased"], dry["dry_run"]) == (6, 6, 2, True)
    assert store_util.snapshot(dte.store) == before

    r = json.loads(dte.ok(*gc_args).stdout)
    assert (r["kept"], r["removed"], r["rebased"]) == (6, 6, 2) and r["blobs_deleted"] > 0
    log = dte.log()
    assert [(v["version"], v["kind"], v["parent"], v["revision"]) for v in log] == [
        (0, "anchor", None, 0), (4, "delta", 0, 1), (8, "delta", 4, 1),
        (9, "delta", 8, 0), (10, "delta", 9, 0), (11, "delta", 10, 0)]
    manifests = store_util.manifests(dte.store)
    since = 0
    for v in log[1:3]:  # deltas against the previous kept version, not anchors
        old, new = ckpts.state(v["parent"]), ckpts.state(v["version"])
        assert v["changed_elements"] == sum(ckpt_util.changed_elements(old, new).values())
        assert 0 < v["stored_bytes"] < dense / 4, v
        since += v["stored_bytes"]
        m = manifests[v["version"]][1]
        assert "full" not in m
        assert m["since_full"] == {"versions": v["version"] // 4, "bytes": since}
    # One dense copy and small deltas; rebasing v4 and v8 to anchors would
    # have stored two more dense copies.
    assert sum(store_util.blobs(dte.store).values()) < 1.5 * dense
    assert set(store_util.blobs(dte.store)) == store_util.all_reachable_blobs(dte.store)
    for step in (0, 4, 8, 9, 10, 11):
        store_util.same_tree(dte.export(step, tmp_path / f"out{step}"), ckpts.dir(step))
    r = dte.run("export", "--version", 5, tmp_path / "out5")
    assert r.returncode == ERROR and "v00000005" in one_line(r.stderr)
    assert dte.ok("verify")

    # The same gc again has nothing to do; after another commit, v9 goes and
    # v10 becomes a delta of v8.
    r = json.loads(dte.ok(*gc_args).stdout)
    assert (r["kept"], r["removed"], r["rebased"], r["blobs_deleted"]) == (6, 0, 0, 0)
    assert dte.commit(ckpts.dir(12)) == 12
    r = json.loads(dte.ok(*gc_args).stdout)
    assert (r["kept"], r["removed"], r["rebased"]) == (6, 1, 1)
    assert [(v["version"], v["parent"]) for v in dte.log()] == [
        (0, None), (4, 0), (8, 4), (10, 8), (11, 10), (12, 11)]
    store_util.same_tree(dte.export(10, tmp_path / "again10"), ckpts.dir(10))
    assert dte.ok("verify")


def test_gc_keep_every_usage_errors_leave_the_store_alone(base_store, ckpts, tmp_path):
    dte = base_store.copy_to(tmp_path)
    before = store_util.snapshot(dte.store)
    for bad in (["--keep-every", -1], ["--keep-every", "x"], ["--keep-every", "2.5"],
                ["--keep-every", ""], ["--keep-last", 0], ["--keep-last", -1]):
        args = ["--keep-last", 1, *bad] if bad[0] == "--keep-every" else bad
        r = dte.run("gc", *args, "--grace-seconds", 0)
        assert r.returncode == USAGE and r.stdout == "" and bad[0] in r.stderr, (bad, r.stderr)
    assert store_util.snapshot(dte.store) == before
    # 0 is off: the newest versions alone are kept.
    r = json.loads(dte.ok("gc", "--keep-last", 1, "--keep-every", 0, "--dry-run",
                          "--json").stdout)
    assert (r["kept"], r["removed"], r["rebased"]) == (1, 1, 1)


def test_gc_spares_young_unreferenced_blobs(base_store, ckpts, tmp_path):
    dte = base_store.copy_to(tmp_path)
    dte.ok("commit", ckpts.dir(2))
    r = json.loads(dte.ok("gc", "--keep-last", 1, "--json").stdout)
    assert (r["removed"], r["rebased"], r["blobs_deleted"]) == (2, 1, 0)
    assert dte.versions() == [2]
    r = json.loads(dte.ok("gc", "--keep-last", 1, "--grace-seconds", 0, "--json").stdout)
    assert (r["removed"], r["rebased"]) == (0, 0) and r["blobs_deleted"] > 0
    store_util.same_tree(dte.export(2, tmp_path / "out"), ckpts.dir(2))
    r = dte.run("gc", "--keep-last", 0)
    assert r.returncode != OK and "keep-last" in one_line(r.stderr)


# --- 10. progress -------------------------------------------------------------------------------

SIZE = r"[\d.]+ [KMG]?i?B"
PROGRESS = re.compile(rf"\r(commit|export) {SIZE} / {SIZE} +\d+% +{SIZE}/s")


def test_no_progress_when_stderr_is_not_a_terminal(base_store, ckpts, tmp_path):
    dte = base_store.copy_to(tmp_path)
    r = dte.ok("commit", ckpts.dir(2))
    line = one_line(r.stderr)
    assert "\r" not in r.stderr and "\x1b" not in r.stderr
    assert line.startswith("commit: v00000002 (delta of v00000001)"), line
    for args in (["export", "--version", 2, tmp_path / "out"], ["verify"]):
        r = dte.ok(*args)
        assert r.stderr == "", args


def test_progress_on_a_terminal(base_store, ckpts, tmp_path):
    dte = base_store.copy_to(tmp_path)
    rc, err = dtectl_util.run_on_pty(dte.argv("commit", ckpts.dir(2)), dte.env)
    assert rc == OK and PROGRESS.search(err), repr(err)
    assert "100%" in err and "\x1b[K" in err
    rc, err = dtectl_util.run_on_pty(dte.argv("export", "--version", 2, tmp_path / "out"), dte.env)
    assert rc == OK and PROGRESS.search(err), repr(err)
    rc, err = dtectl_util.run_on_pty(dte.argv("commit", ckpts.dir(3), "--quiet"), dte.env)
    assert rc == OK and "commit: v00000003" in err
    assert "\r" not in err and "\x1b" not in err, repr(err)
