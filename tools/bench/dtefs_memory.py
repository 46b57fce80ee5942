#!/opt/dte/venv/bin/python
"""dtefs memory over a store's versions: mounts each STORE with an empty
cache directory, lists the mount, reads the first safetensors file of 100
versions spread over the store, and prints the daemon's VmHWM. The same
procedure as longrun_bench.py's memory figure, for stores made elsewhere
(for example copies of one run's store taken at 100, 1,000 and 10,000
versions).

Usage: /opt/dte/venv/bin/python tools/bench/dtefs_memory.py [--dtefs build/tools/dtefs] STORE...
"""

import argparse
import os

import harness as h


def measure(dtefs, store, spread=100):
    """(versions, dtefs VmHWM) after listing a fresh mount of store and reading
    the first safetensors file of `spread` versions spread over it."""
    with h.Scratch(prefix="dte-mem-") as work:
        with h.FuseMount("dtefs", [dtefs, store, work("mnt"), "--cache-dir", work("cache"), "-f"],
                         work("mnt"), work("dtefs.log")) as m:
            names = sorted(n for n in os.listdir(m.path) if n.startswith("v"))
            for n in names[::max(1, len(names) // spread)]:
                shard = sorted(f for f in os.listdir(os.path.join(m.path, n))
                               if f.endswith(".safetensors"))[0]
                h.read_sequential([os.path.join(m.path, n, shard)])
            return len(names), h.proc_status(m.proc.pid, "VmHWM")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtefs", default="build/tools/dtefs")
    ap.add_argument("stores", nargs="+")
    a = ap.parse_args()
    print("| versions | dtefs VmHWM |\n|---|---|")
    for store in a.stores:
        n, hwm = measure(os.path.abspath(a.dtefs), store)
        print(h.md_row([n, f"{hwm / h.MIB:.0f} MiB"]), flush=True)


if __name__ == "__main__":
    main()
