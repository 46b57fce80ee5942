"""Broken checkpoint directories: each function damages one copy of a good one.

Every function takes the directory (a copy the test owns) and returns the
words the error message must contain: the file, and the tensor or the
problem it names.
"""

import json
import os
import struct

import ckpt_util

SHARD = "model-00002-of-00003.safetensors"


def _rewrite(path, entries, data, metadata=None):
    with open(path, "wb") as f:
        f.write(ckpt_util.header_bytes(entries, metadata))
        f.write(data)


def _entries(path):
    header_text, data = ckpt_util.split_file(path)
    header = json.loads(header_text)
    meta = header.pop("__metadata__", None)
    entries = sorted(((n, e["dtype"], e["shape"], *e["data_offsets"]) for n, e in header.items()),
                     key=lambda e: e[3])
    return entries, data, meta


def truncated(d):
    p = os.path.join(d, SHARD)
    os.truncate(p, os.path.getsize(p) - 1000)
    return [SHARD, "truncated"]


def header_beyond_file(d):
    p = os.path.join(d, SHARD)
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.write(struct.pack("<Q", size))
    return [SHARD, "beyond the end"]


def overlapping(d):
    p = os.path.join(d, SHARD)
    entries, data, meta = _entries(p)
    # Two tensors of the same byte size: point the second at the first's bytes.
    sizes = {}
    for i, e in enumerate(entries):
        sizes.setdefault(e[4] - e[3], []).append(i)
    a, b = next(v for v in sizes.values() if len(v) >= 2)[:2]
    entries[b] = (entries[b][0], entries[b][1], entries[b][2], entries[a][3], entries[a][4])
    _rewrite(p, entries, data, meta)
    return [SHARD, "overlaps", entries[a][0], entries[b][0]]


def holey(d):
    p = os.path.join(d, SHARD)
    entries, data, meta = _entries(p)
    # 8 bytes of nothing after the first tensor.
    first_end = entries[0][4]
    entries = [entries[0]] + [(n, t, s, b + 8, e + 8) for n, t, s, b, e in entries[1:]]
    _rewrite(p, entries, data[:first_end] + b"\0" * 8 + data[first_end:], meta)
    return [SHARD, "hole", entries[1][0]]


def wrong_byte_length(d):
    p = os.path.join(d, SHARD)
    entries, data, meta = _entries(p)
    i = next(i for i, e in enumerate(entries) if len(e[2]) == 2)
    n, t, s, b, e = entries[i]
    entries[i] = (n, t, [s[0] - 1, s[1]], b, e)
    _rewrite(p, entries, data, meta)
    return [SHARD, n, "bytes"]


def invalid_utf8(d):
    p = os.path.join(d, SHARD)
    entries, data, meta = _entries(p)
    good = ckpt_util.header_bytes(entries, {"format": "pt", "note": "XX"})
    bad = good.replace(b'"XX"', b'"\xff\xfe"')
    with open(p, "wb") as f:
        f.write(bad + data)
    return [SHARD, "UTF-8"]


def invalid_json(d):
    p = os.path.join(d, SHARD)
    entries, data, meta = _entries(p)
    good = ckpt_util.header_bytes(entries, meta)
    bad = good.replace(b'"dtype":', b'"dtype" ', 1)
    with open(p, "wb") as f:
        f.write(bad + data)
    return [SHARD, "JSON"]


def huge_header_declared(d):
    p = os.path.join(d, SHARD)
    with open(p, "r+b") as f:
        f.write(struct.pack("<Q", 200_000_000))
    return [SHARD, "200000000", "limit"]


def huge_header_real(d):
    """A file that really holds a 100,000,008-byte header (sparse, so cheap)."""
    p = os.path.join(d, SHARD)
    n = 100_000_008
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", n) + b"{")
        f.truncate(8 + n)
    return [SHARD, str(n), "limit"]


def duplicate_names(d):
    p = os.path.join(d, SHARD)
    entries, data, meta = _entries(p)
    last = entries[-1]
    width = last[4] - last[3]
    entries.append((last[0], last[1], last[2], last[4], last[4] + width))
    _rewrite(p, entries, data + data[last[3]:last[4]], meta)
    return [SHARD, "duplicate", last[0]]


def index_names_missing_shard(d):
    p = os.path.join(d, ckpt_util.INDEX_NAME)
    with open(p) as f:
        index = json.load(f)
    tensor = sorted(index["weight_map"])[0]
    index["weight_map"][tensor] = "model-00009-of-00009.safetensors"
    with open(p, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return [ckpt_util.INDEX_NAME, "model-00009-of-00009.safetensors", tensor]


def subdirectory(d):
    os.mkdir(os.path.join(d, "checkpoint-100"))
    return ["checkpoint-100", "subdirectory"]


CASES = {f.__name__: f for f in (
    truncated, header_beyond_file, overlapping, holey, wrong_byte_length, invalid_utf8,
    invalid_json, huge_header_declared, huge_header_real, duplicate_names,
    index_names_missing_shard, subdirectory)}
