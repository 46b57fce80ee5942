#!/opt/dte/venv/bin/python
"""Starts N local processes of a torch.distributed script, as torchrun does
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the
environment), without torchrun's elastic agent: the tests run the examples
as plain processes and read each rank's exit status. Exits with the first
non-zero status.

    /opt/dte/venv/bin/python tools/examples/launch.py --nproc 4 tools/examples/fsdp2_publish.py --store /tmp/p
"""

import argparse
import os
import socket
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(a.nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(a.nproc), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, a.script, *a.args], env=env))
    codes = [p.wait() for p in procs]
    sys.exit(next((c for c in codes if c != 0), 0))


if __name__ == "__main__":
    main()
