"""Shared fixtures for the end-to-end tests.

Binaries come from $DTE_BUILD_DIR (default /work/main/build). Every test gets
its own store and cache directory under pytest's tmp_path; checkpoint
sequences are generated once per session and only read by the tests.
"""

import pytest

from ckpt_util import CheckpointSequence
from dtectl_util import Dtectl


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    """The shared checkpoint sequence: step 0 is the initial policy."""
    return CheckpointSequence(tmp_path_factory.mktemp("ckpts"))


@pytest.fixture
def dte(tmp_path):
    """dtectl on an empty per-test store and cache."""
    return Dtectl(tmp_path / "store", tmp_path / "cache")


@pytest.fixture(scope="session")
def base_store(tmp_path_factory, ckpts):
    """A store holding steps 0 (anchor) and 1 (delta). Copy it before writing."""
    root = tmp_path_factory.mktemp("base")
    d = Dtectl(root / "store", root / "cache")
    d.ok("import", ckpts.dir(0))
    d.ok("commit", ckpts.dir(1))
    return d


@pytest.fixture
def mount(tmp_path):
    """mount(store, *args, foreground=True, cache=None) -> a started dtefs
    Mount of `store` under the test's tmp_path (fs_util.mounts); every mount
    it started is unmounted at teardown. A module whose tests all mount one
    store binds it by overriding this fixture with one that takes it."""
    import fs_util

    with fs_util.mounts(tmp_path) as start:
        yield start


@pytest.fixture(scope="session")
def moto():
    """A moto S3 server on loopback (tests/testutil/moto_server.py), one per
    pytest session (CTest runs each module as a session of its own). Tests
    make buckets of their own (`bucket`); test_fs_s3.py, whose tests stop
    the server, starts one per test."""
    import s3_util

    server = s3_util.MotoServer()
    print(f"moto started in {server.start_seconds:.2f} s on {server.endpoint}")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(moto):
    """The fault-injecting proxy (tests/py/s3_proxy.py) in front of `moto`."""
    from s3_proxy import FaultProxy

    p = FaultProxy(moto.endpoint, io_timeout=60)
    yield p
    p.stop()


@pytest.fixture
def faults(proxy):
    """The proxy with no rules and zeroed counters."""
    proxy.clear_rules()
    proxy.reset_counters()
    yield proxy
    proxy.clear_rules()


_buckets = [0]


@pytest.fixture
def bucket(moto, request):
    """A new bucket on `moto`, named after the test."""
    import re

    _buckets[0] += 1
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    return moto.create_bucket(f"b{_buckets[0]}-{name}")
