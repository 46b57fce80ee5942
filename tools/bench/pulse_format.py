"""A sparse publisher in PULSE's published wire format, written here from the
format's description (the paper's second baseline beside dense zstd; no code
of PULSE's is used):

  per version, the BF16 elements that changed against the previous weights,
  which the publisher holds in memory; per tensor, sorted COO by (row, col):
  row deltas as uint8 when all fit, else int32; column deltas as uint16 when
  all fit, else int32; the raw BF16 values; the whole version one zstd
  level-1 frame.

Layout of the frame's content (little-endian), one section per changed tensor
in the order of the checkpoint's files and, within a file, of tensor names:

  u32 tensors | per tensor: u16 name length, name (UTF-8), u8 flags (bit 0:
  row deltas int32, bit 1: column deltas int32, bit 2: the tensor whole, raw),
  u64 entries n, then n row deltas, n column deltas, n BF16 values
  (bit 2: u64 bytes, then the tensor's bytes)

Rows and columns are those of the tensor viewed as 2-D (shape[0] x the
rest; a 1-D tensor is one row). A row delta is the row less the previous
entry's (the first entry's less 0); a column delta is the column less the
previous entry's in the same row, or the column itself at the first entry of
a row. Tensors of another dtype that changed are sent whole (bit 2); the
dte-gen models here have none.

A Weights object is what either side holds in memory: {tensor name: uint8
array of its bytes}, with each tensor's dtype and 2-D shape.
"""
import json
import os
import struct

import numpy as np
import zstandard

ROW32, COL32, WHOLE = 1, 2, 4


class Weights:
    """The tensors of a checkpoint directory, in memory: names in order,
    bytes (uint8 arrays), dtypes and (rows, columns)."""

    def __init__(self, d):
        self.data, self.dtype, self.rows_cols = {}, {}, {}
        for f in sorted(os.listdir(d)):
            if not f.endswith(".safetensors"):
                continue
            with open(os.path.join(d, f), "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
                blob = np.fromfile(fh, dtype=np.uint8)
            for name in sorted(k for k in header if k != "__metadata__"):
                info = header[name]
                b, e = info["data_offsets"]
                shape = info["shape"]
                self.data[name] = blob[b:e].copy()
                self.dtype[name] = info["dtype"]
                self.rows_cols[name] = ((shape[0], int(np.prod(shape[1:], dtype=np.int64)))
                                        if len(shape) > 1 else (1, int(np.prod(shape))))

    def same(self, other):
        """Whether two Weights hold the same tensors, bit for bit."""
        return (list(self.data) == list(other.data) and self.dtype == other.dtype and all(
            np.array_equal(self.data[k], other.data[k]) for k in self.data))


def encode(prev, cur):
    """(zstd frame of the changes from prev to cur, changed BF16 elements)."""
    parts, count, changed = [], 0, 0
    for name, new in cur.data.items():
        old = prev.data[name]
        if cur.dtype[name] != "BF16" or cur.dtype[name] != prev.dtype[name]:
            if not np.array_equal(old, new):
                key = name.encode()
                parts += [struct.pack("<H", len(key)), key, struct.pack("<BQ", WHOLE, new.size),
                          new.tobytes()]
                count += 1
            continue
        o, v = old.view(np.uint16), new.view(np.uint16)
        idx = np.flatnonzero(o != v)  # sorted: row-major order is (row, col) order
        if idx.size == 0:
            continue
        cols = cur.rows_cols[name][1]
        row, col = np.divmod(idx, cols)
        drow = np.diff(row, prepend=0)
        prev_col = np.concatenate(([0], col[:-1]))
        prev_col[drow != 0] = 0
        dcol = col - prev_col
        flags = (ROW32 if drow.max() > 0xFF else 0) | (COL32 if dcol.max() > 0xFFFF else 0)
        key = name.encode()
        parts += [struct.pack("<H", len(key)), key, struct.pack("<BQ", flags, idx.size),
                  drow.astype("<i4" if flags & ROW32 else np.uint8).tobytes(),
                  dcol.astype("<i4" if flags & COL32 else "<u2").tobytes(),
                  v[idx].astype("<u2").tobytes()]
        count += 1
        changed += idx.size
    raw = struct.pack("<I", count) + b"".join(parts)
    return zstandard.ZstdCompressor(level=1).compress(raw), changed


def decode(frame, prev):
    """The Weights that `frame` makes of prev (prev is left as it was)."""
    raw = zstandard.ZstdDecompressor().decompress(frame)
    out = Weights.__new__(Weights)
    out.data = dict(prev.data)
    out.dtype, out.rows_cols = prev.dtype, prev.rows_cols
    (count,), pos = struct.unpack_from("<I", raw), 4
    for _ in range(count):
        (klen,) = struct.unpack_from("<H", raw, pos)
        name = raw[pos + 2:pos + 2 + klen].decode()
        flags, n = struct.unpack_from("<BQ", raw, pos + 2 + klen)
        pos += 2 + klen + 9
        if flags & WHOLE:
            out.data[name] = np.frombuffer(raw, np.uint8, n, pos).copy()
            pos += n
            continue
        rw, cw = (4 if flags & ROW32 else 1), (4 if flags & COL32 else 2)
        drow = np.frombuffer(raw, "<i4" if rw == 4 else np.uint8, n, pos).astype(np.int64)
        pos += rw * n
        dcol = np.frombuffer(raw, "<i4" if cw == 4 else "<u2", n, pos).astype(np.int64)
        pos += cw * n
        vals = np.frombuffer(raw, "<u2", n, pos)
        pos += 2 * n
        row = np.cumsum(drow)
        csum = np.cumsum(dcol)
        starts = drow != 0
        starts[0] = True
        # the column sums up to each row's first entry, carried along the row
        base = np.maximum.accumulate(np.where(starts, csum - dcol, 0))
        col = csum - base
        t = prev.data[name].view(np.uint16).copy()
        t[row * prev.rows_cols[name][1] + col] = vals
        out.data[name] = t.view(np.uint8)
    if pos != len(raw):
        raise ValueError(f"{len(raw) - pos} bytes left over in the frame")
    return out
