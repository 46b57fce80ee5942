#!/opt/dte/venv/bin/python
"""How a file's cached pages are grouped into folios in the kernel's page cache.

Maps the first --mib MiB of each file, touches every page (so all of it is in
the page cache), and classifies each page by /proc/kpageflags: part of a
large folio (its head or a tail page) or a small (order-0) one. Run as root
(kpageflags and the page frame numbers in /proc/self/pagemap need it).

Why it matters: reading from the page cache costs per folio, so a file
cached in large folios (ext4 on recent kernels) reads several times faster
than one cached in 4 KiB pages (FUSE on this machine's kernel). See
docs/benchmarks.md, "dtefs: reads vs passthrough_ll and plain files".

Usage: /opt/dte/venv/bin/python tools/bench/page_cache_folios.py [--mib 64] FILE...
"""
import argparse
import collections
import ctypes
import mmap
import os
import struct

PAGE = os.sysconf("SC_PAGE_SIZE")
KPF_COMPOUND_HEAD, KPF_COMPOUND_TAIL = 15, 16
PFN_MASK = (1 << 55) - 1


def classify(path, mib):
    """Counter of 'large' (head or tail of a large folio), 'small' and
    'absent' pages over the first `mib` MiB of path."""
    out = collections.Counter()
    with open(path, "rb") as f:
        n = min(os.fstat(f.fileno()).st_size, mib << 20) // PAGE * PAGE
        if n == 0:
            return out
        # A private mapping, only read: its pages are the page cache's own.
        # (Writable, so ctypes can tell where it starts.)
        with mmap.mmap(f.fileno(), n, access=mmap.ACCESS_COPY) as m:
            first = ctypes.c_char.from_buffer(m)
            base = ctypes.addressof(first)
            del first
            for off in range(0, n, PAGE):  # fault every page in
                m[off]
            with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
                for i in range(n // PAGE):
                    pm.seek((base // PAGE + i) * 8)
                    entry = struct.unpack("<Q", pm.read(8))[0]
                    if not entry >> 63 & 1:
                        out["absent"] += 1
                        continue
                    kf.seek((entry & PFN_MASK) * 8)
                    flags = struct.unpack("<Q", kf.read(8))[0]
                    large = flags >> KPF_COMPOUND_HEAD & 1 or flags >> KPF_COMPOUND_TAIL & 1
                    out["large" if large else "small"] += 1
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="how much of each file to look at")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    for path in args.files:
        c = classify(path, args.mib)
        total = sum(c.values())
        if total == 0:
            print(f"{path}: smaller than a page")
            continue
        print(f"{path}: {total} pages: {c['large']} in large folios "
              f"({100 * c['large'] / total:.1f}%), {c['small']} in 4 KiB folios, "
              f"{c['absent']} not mapped")


if __name__ == "__main__":
    main()
