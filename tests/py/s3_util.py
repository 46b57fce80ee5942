"""A real S3-compatible server (moto) on loopback for the dtectl S3 tests,
and the AWS CLI pointed at it.

MotoServer runs tests/testutil/moto_server.py (moto's server with
conditional writes serialized and every SigV4 signature checked, see there)
with /opt/dte/venv/bin/python on a free 127.0.0.1 port, waits until it is ready, and
kills it on stop(). A server that cannot start fails the test
(tools/setup.sh installs moto); S3 tests never skip.

The server makes the credentials: an IAM user's keys (the AWS CLI uses
them) and an assumed-role session with a token (dtectl uses those, so
x-amz-security-token is signed too). secrets() lists every one of them for
tests that grep outputs.

TcpRelay stands between a client and the server and can be cut and
restored: an outage as the client sees it (connections refused), while the
server keeps its objects (moto holds them in memory only).
"""

import sys
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from wait_util import wait_for

PYTHON = sys.executable
SCRIPT = Path(__file__).resolve().parent.parent / "testutil" / "moto_server.py"



def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    def __init__(self, start_timeout=60):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.dir = tempfile.mkdtemp(prefix="dte-moto-")
        self.log = open(os.path.join(self.dir, "moto.log"), "wb")
        creds_file = os.path.join(self.dir, "credentials.json")
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [PYTHON, str(SCRIPT), "-H", "127.0.0.1", "-p", str(self.port),
             "--check-signatures", creds_file],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        # The credentials file is written once signatures are checked.
        try:
            wait_for(lambda: self.proc.poll() is not None or os.path.exists(creds_file),
                     start_timeout, "moto's S3 server", interval=0.05)
        except AssertionError:
            self.stop()
            pytest.fail(f"moto's S3 server did not answer within {start_timeout} s:\n"
                        f"{self._tail()}")
        if self.proc.poll() is not None:
            pytest.fail(f"moto's S3 server exited at start (run tools/setup.sh):\n{self._tail()}")
        self.start_seconds = time.monotonic() - started
        with open(creds_file) as f:
            self.creds = json.load(f)

    def _tail(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()[-3000:]

    def secrets(self):
        s = self.creds["session"]
        return (self.creds["access_key"], self.creds["secret_key"],
                s["access_key"], s["secret_key"], s["token"])

    def create_bucket(self, name):
        aws(self, "s3", "mb", f"s3://{name}")
        return name

    def env(self, session=True):
        """The environment dtectl (session credentials) and the AWS CLI (the
        user's keys) use: this server, and no shared files of the user
        running the tests."""
        env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": "/nonexistent/dte-test-aws-config",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/dte-test-aws-credentials",
            "AWS_PAGER": "",
        }
        c = self.creds["session"] if session else self.creds
        env["AWS_ACCESS_KEY_ID"] = c["access_key"]
        env["AWS_SECRET_ACCESS_KEY"] = c["secret_key"]
        if session:
            env["AWS_SESSION_TOKEN"] = c["token"]
        return env

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def aws_binary():
    """Debian's AWS CLI (tools/setup.sh installs it), else any on PATH."""
    for candidate in ("/usr/bin/aws", shutil.which("aws")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("the AWS CLI is not installed (run tools/setup.sh)")


def aws(server, *args, check=True):
    """Runs `aws ARGS --endpoint-url SERVER`; returns the completed process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(server.env(session=False))
    r = subprocess.run([aws_binary(), *map(str, args), "--endpoint-url", server.endpoint],
                       env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, f"aws {args}: exit {r.returncode}\n{r.stderr}"
    return r


def s3_keys(server, bucket, prefix):
    """Every object key under s3://bucket/prefix/, relative to it, from the AWS CLI."""
    out = aws(server, "s3", "ls", "--recursive", f"s3://{bucket}/{prefix}/").stdout
    keys = []
    for line in out.splitlines():
        parts = line.split(None, 3)  # date time size key
        if len(parts) == 4:
            keys.append(parts[3][len(prefix) + 1:])
    return sorted(keys)


def s3_client(server):
    """A boto3 S3 client straight to the server (no proxy) with the IAM user's keys."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                        aws_access_key_id=server.creds["access_key"],
                        aws_secret_access_key=server.creds["secret_key"],
                        config=Config(retries={"max_attempts": 1}))


def multipart_uploads(server, bucket, prefix=""):
    """(key, upload id) of every multipart upload in progress under prefix."""
    r = s3_client(server).list_multipart_uploads(Bucket=bucket, Prefix=prefix)
    return sorted((u["Key"], u["UploadId"]) for u in r.get("Uploads", []))


def object_keys(server, bucket, prefix):
    """Every object key under prefix/ (relative to it), straight from the server."""
    keys, token = [], None
    client = s3_client(server)
    while True:
        kw = {"ContinuationToken": token} if token else {}
        r = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/", **kw)
        keys += [o["Key"][len(prefix) + 1:] for o in r.get("Contents", [])]
        if not r.get("IsTruncated"):
            return sorted(keys)
        token = r["NextContinuationToken"]


def copy_prefix(server, bucket, src, dst):
    """Server-side copies of every object under src/ to dst/ (a store copy)."""
    client = s3_client(server)
    for key in object_keys(server, bucket, src):
        client.copy_object(Bucket=bucket, Key=f"{dst}/{key}",
                           CopySource={"Bucket": bucket, "Key": f"{src}/{key}"})


class TcpRelay:
    """Forwards connections from a free loopback port (`endpoint`) to
    127.0.0.1:`target_port`. cut() stops listening and closes every
    connection, so clients get "connection refused"; restore() listens on the
    same port again."""

    def __init__(self, target_port):
        self.target = ("127.0.0.1", target_port)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._conns = set()
        self._listener = None
        self.restore()

    def restore(self):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def cut(self):
        if self._listener is None:
            return
        try:  # wakes the accept() of the thread serving it
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._listener = None
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            _close(c)

    def _accept(self, listener):
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src, dst):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        _close(src)
        _close(dst)
        with self._lock:
            self._conns.discard(src)
            self._conns.discard(dst)


def _close(sock):
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def committed_store(server, name, ckpts, versions, cache):
    """A new bucket on `server` named after `name` (a test's name) holding
    versions 0..versions-1 of `ckpts`, committed straight to the server by
    dtectl with the cache directory `cache`: (bucket, store URI)."""
    from dtectl_util import Dtectl
    bucket = server.create_bucket(name.replace("_", "-")[5:45].strip("-"))
    uri = f"s3://{bucket}/p"
    d = Dtectl(uri, cache, env=server.env())
    d.ok("import", ckpts.dir(0))
    for v in range(1, versions):
        assert d.commit(ckpts.dir(v)) == v
    return bucket, uri
