"""Looking at a local dte store from the outside: its files, manifests and blobs."""

import filecmp
import hashlib
import json
import os
import re

import xxhash

MANIFEST_RE = re.compile(r"^v(\d{8,12})(?:\.r(\d+))?\.json$")


def snapshot(root):
    """{relative path: (size, sha256) for files, None for directories}."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            out[os.path.normpath(os.path.join(rel, d))] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()
            out[os.path.normpath(os.path.join(rel, f))] = (os.path.getsize(p), digest)
    return out


def manifests(store):
    """{version: (revision, parsed manifest)} for the newest revision of each version."""
    out = {}
    for name in os.listdir(os.path.join(store, "manifests")):
        m = MANIFEST_RE.match(name)
        if not m:
            continue
        version, revision = int(m.group(1)), int(m.group(2) or 0)
        if version in out and out[version][0] > revision:
            continue
        with open(os.path.join(store, "manifests", name)) as f:
            out[version] = (revision, json.load(f))
    return out


def manifest_names(store):
    return sorted(os.listdir(os.path.join(store, "manifests")))


def blobs(store):
    """{hex hash: size} of every blob file."""
    out = {}
    root = os.path.join(store, "blobs")
    for dirpath, _, filenames in os.walk(root):
        for f in filenames:
            out[f] = os.path.getsize(os.path.join(dirpath, f))
    return out


def blob_path(store, hex_hash):
    return os.path.join(store, "blobs", hex_hash[:2], hex_hash)


def xxh128_hex(data):
    """The content address dte gives a blob."""
    return xxhash.xxh3_128_hexdigest(data)


def reachable_blobs(manifest):
    """Every blob a manifest names."""
    out = {manifest["block_table"]["hash"]}
    out.update(b["hash"] for b in manifest["blobs"])
    full = manifest.get("full")
    if full:  # a policy anchor's full table (format 2)
        out.add(full["block_table"]["hash"])
        out.update(b["hash"] for b in full["blobs"])
    for f in manifest["files"]:
        out.add(f["header_blob"] if "tensors" in f else f["blob"])
    return out


def all_reachable_blobs(store):
    """Every blob the store's current manifests and join tables name."""
    out = set()
    for _, m in manifests(store).values():
        out |= reachable_blobs(m)
    joins = os.path.join(store, "joins")
    for name in os.listdir(joins) if os.path.isdir(joins) else []:
        with open(os.path.join(joins, name)) as f:
            j = json.load(f)
        out |= {j["block_table"]["hash"]} | {b["hash"] for b in j["blobs"]}
    return out


def tmp_entries(store):
    tmp = os.path.join(store, "tmp")
    return sorted(os.listdir(tmp)) if os.path.isdir(tmp) else []


def same_tree(a, b):
    """Asserts two flat directories hold the same file names with identical bytes."""
    names_a, names_b = sorted(os.listdir(a)), sorted(os.listdir(b))
    assert names_a == names_b, f"{a} vs {b}: different file names"
    _, mismatch, errors = filecmp.cmpfiles(a, b, names_a, shallow=False)
    assert not mismatch and not errors, f"{a} vs {b}: files differ: {mismatch + errors}"


def damage(path, how):
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        if how == "flip":
            data[len(data) // 2] ^= 0x10
            f.seek(0)
            f.write(data)
        else:
            f.truncate(len(data) // 2)


def pick_blob(store, kind):
    """(hash, file it belongs to) of one blob of v0, the anchor every version builds on."""
    m = manifests(store)[0][1]
    shard = next(f for f in m["files"] if f["name"] == "model-00001-of-00003.safetensors")
    if kind == "data":
        size = shard["size"] - shard["header_size"]
        return next(b["hash"] for b in m["blobs"] if b["size"] == size), shard["name"]
    if kind == "header":
        return shard["header_blob"], shard["name"]
    if kind == "raw":
        return next(f["blob"] for f in m["files"] if f["name"] == "config.json"), "config.json"
    return m["block_table"]["hash"], "block table"
