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
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fs_bench_util as fu  # noqa: E402

MIB = 1 << 20


def measure(dtefs, store, spread=100):
    work = tempfile.mkdtemp(prefix="dte-mem-")
    mnt, cache = os.path.join(work, "mnt"), os.path.join(work, "cache")
    os.makedirs(mnt)
    p = subprocess.Popen([dtefs, store, mnt, "--cache-dir", cache, "-f"],
                         stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not os.path.ismount(mnt):
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dtefs did not mount {store}")
            time.sleep(0.05)
        names = sorted(n for n in os.listdir(mnt) if n.startswith("v"))
        for n in names[::max(1, len(names) // spread)]:
            shard = sorted(f for f in os.listdir(os.path.join(mnt, n))
                           if f.endswith(".safetensors"))[0]
            with open(os.path.join(mnt, n, shard), "rb") as f:
                while f.read(MIB):
                    pass
        return len(names), fu.proc_status(p.pid, "VmHWM")
    finally:
        subprocess.run(["fusermount3", "-u", mnt], check=False)
        p.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtefs", default="build/tools/dtefs")
    ap.add_argument("stores", nargs="+")
    a = ap.parse_args()
    print("| versions | dtefs VmHWM |")
    print("|---|---|")
    for store in a.stores:
        n, hwm = measure(os.path.abspath(a.dtefs), store)
        print(f"| {n} | {hwm / MIB:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
