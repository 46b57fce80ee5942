"""End-to-end tests of live apply: `dtectl apply` on a real dtefs mount
changes MOUNT/live/ in place (a process that has it mmapped sees the new
bytes without re-reading), and scatters the changed elements into receiver
buffers in /dev/shm registered through dte.LiveReceiver, remapped into vLLM's
fused TP layout.

The model is a dte-gen Llama (8 heads, 2 KV heads) committed as v0 (anchor)
and deltas v1..v4.
"""

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request

import numpy as np
import pytest

import dtectl_util
from dtectl_util import Dtectl
import fs_util
from fs_util import BUILD_DIR
from wait_util import wait_for

STEPS = 4
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB, LAYERS = 8, 2, 32, 256, 512, 1024, 2
SOURCE_DIR = os.environ.get("DTE_SOURCE_DIR", "/work/main")
PY_PATH = os.path.join(SOURCE_DIR, "sync", "python")


# dte-gen's arguments for this model (the live tests share it).
MODEL_ARGS = ("--hidden", HIDDEN, "--layers", LAYERS, "--heads", HEADS, "--kv-heads", KV_HEADS,
              "--head-dim", HEAD_DIM, "--intermediate", INTER, "--vocab", VOCAB)


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    return fs_util.generate(tmp_path_factory.mktemp("livegen"), None, STEPS, *MODEL_ARGS)


@pytest.fixture(scope="module")
def live_store(tmp_path_factory, gen):
    root = tmp_path_factory.mktemp("livestore")
    return Dtectl(root / "store", root / "cache").import_steps(gen, STEPS)


@pytest.fixture
def mount(mount, tmp_path, live_store):
    """conftest's mount, bound to a copy of `live_store`'s store."""
    store = tmp_path / "store"
    subprocess.run(["cp", "-a", str(live_store.store), str(store)], check=True)
    return lambda *args, **kw: mount(store, *args, **kw)


def VersionName(v):
    return "v%08d" % v


def dtectl(*args, check=True):
    return dtectl_util.run(*args, check=check)


def apply(mount_path, version=None):
    args = ["apply", mount_path, "--json"] + ([] if version is None else ["--version", version])
    return json.loads(dtectl(*args).stdout)


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_bf16(path):
    """name -> uint16 array (BF16 bits) of every tensor of a safetensors file."""
    from safetensors.numpy import load_file
    return {k: v.view(np.uint16) if v.dtype != np.uint16 else v
            for k, v in load_file(str(path)).items()}


def load_raw(path):
    """The tensors as raw uint16 bits, read with the header (numpy has no bf16)."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "BF16", name
        b, e = t["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + b:8 + n + e], dtype=np.uint16).reshape(t["shape"])
    return out


def shard(state, tp, rank):
    """The vLLM fused TP layout of rank `rank`, computed directly from the HF state."""
    out = {}
    q_rows = HEADS // tp * HEAD_DIM
    for name, a in state.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".mlp.up_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            prefix = name.split("q_proj")[0]
            k, v = state[prefix + "k_proj.weight"], state[prefix + "v_proj.weight"]
            if KV_HEADS >= tp:
                kv_rows = KV_HEADS // tp * HEAD_DIM
                ks, vs = k[rank * kv_rows:(rank + 1) * kv_rows], v[rank * kv_rows:(rank + 1) * kv_rows]
            else:
                h = rank * KV_HEADS // tp
                ks, vs = k[h * HEAD_DIM:(h + 1) * HEAD_DIM], v[h * HEAD_DIM:(h + 1) * HEAD_DIM]
            out[prefix + "qkv_proj.weight"] = np.concatenate(
                [a[rank * q_rows:(rank + 1) * q_rows], ks, vs])
        elif ".mlp.gate_proj." in name:
            prefix = name.split("gate_proj")[0]
            rows = a.shape[0] // tp
            up = state[prefix + "up_proj.weight"]
            out[prefix + "gate_up_proj.weight"] = np.concatenate(
                [a[rank * rows:(rank + 1) * rows], up[rank * rows:(rank + 1) * rows]])
        elif ".self_attn.o_proj." in name or ".mlp.down_proj." in name:
            cols = a.shape[1] // tp
            out[name] = a[:, rank * cols:(rank + 1) * cols]
        elif "embed_tokens" in name or "lm_head" in name:
            rows = -(-a.shape[0] // tp)
            part = a[rank * rows:(rank + 1) * rows]
            out[name] = np.concatenate(
                [part, np.zeros((rows - part.shape[0],) + a.shape[1:], a.dtype)])
        else:
            out[name] = a
    return out


READER = r"""
import hashlib, mmap, os, sys
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
sum(m[i] for i in range(0, len(m), 4096))  # fault every page in
print("ready", flush=True)
for line in sys.stdin:
    print(hashlib.sha256(m[:]).hexdigest(), flush=True)
"""

RECEIVER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import dte
spec = json.loads(sys.argv[3])
r = dte.LiveReceiver(sys.argv[2], tp=spec["tp"], rank=spec["rank"], server=spec.get("server"),
                     server_size=spec.get("server_size", 1))
for b in spec["buffers"]:
    r.register(b["name"], b["shm"], b["offset"], "BF16", b["shape"], spec.get("version"))
print("ready", flush=True)
sys.stdin.read()
"""


def test_live_shows_latest_or_the_version_asked_for(mount, gen):
    m = mount()
    assert sorted(os.listdir(m.path + "/live")) == sorted(os.listdir(gen(STEPS)))
    assert sha256(m.path + "/live/model.safetensors") == sha256(gen(STEPS) / "model.safetensors")
    assert m.status()["live"]["version"] == STEPS
    st = json.loads(dtectl("status", m.path, "--json").stdout)
    assert st["live_version"] == STEPS and st["latest_version"] == STEPS
    m.unmount()
    m2 = mount("--live-version", 1)
    assert sha256(m2.path + "/live/model.safetensors") == sha256(gen(1) / "model.safetensors")


def test_missing_live_version_fails_the_mount(tmp_path, live_store):
    path = tmp_path / "mnt"
    path.mkdir()
    r = subprocess.run([str(fs_util.binary()), str(live_store.store), str(path), "--cache-dir",
                        str(tmp_path / "cache"), "--live-version", "77"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "v00000077 is not in the store" in r.stderr
    assert not fs_util.mounted(str(path))


def test_apply_forward_and_back_in_place_for_an_mmapped_reader(mount, gen):
    m = mount("--live-version", 1)
    live = m.path + "/live/model.safetensors"
    reader = subprocess.Popen([sys.executable, "-c", READER, live], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "ready"

        def reader_hash():
            reader.stdin.write("hash\n")
            reader.stdin.flush()
            return reader.stdout.readline().strip()

        assert reader_hash() == sha256(gen(1) / "model.safetensors")
        for target in (3, 0, STEPS, 2):
            before = m.status()["bytes_served"]
            r = apply(m.path, target)
            assert (r["to_version"], r["entries"] > 0) == (target, True), r
            assert r["pages"] > 0, r  # the reader's pages were replaced in place
            # Tensor pages were fetched from the kernel and patched; only the
            # header's and other files' pages, if they differ, were read.
            pages = m.status()["live"]["last_pages"]
            assert pages["patched_pages"] > 0 and pages["fetches"] > 0, pages
            assert pages["patched_pages"] + pages["read_path_pages"] == r["pages"], pages
            assert pages["read_path_pages"] <= 2 * len(os.listdir(gen(target))), pages
            # The mapping shows the target without a single read reaching the daemon.
            assert reader_hash() == sha256(gen(target) / "model.safetensors")
            assert m.status()["bytes_served"] == before
            # A fresh read through the page cache agrees, and so does every file.
            for name in os.listdir(gen(target)):
                assert sha256(f"{m.path}/live/{name}") == sha256(gen(target) / name), name
            assert m.status()["live"]["version"] == target
        # Applying the live version again changes nothing.
        r = apply(m.path, 2)
        assert (r["entries"], r["pages"]) == (0, 0)
        # Without --version: latest.
        assert apply(m.path)["to_version"] == STEPS
    finally:
        reader.stdin.close()
        reader.wait(timeout=30)


def test_partly_resident_pages_and_pages_evicted_and_read_during_applies(mount, gen):
    """A tenth of live/ resident: only those pages are fetched and patched.
    Then applies run while another thread keeps evicting live/'s pages
    (POSIX_FADV_DONTNEED) and reading random ones back: after each apply
    every byte of live/, resident or not, is the target's."""
    m = mount("--live-version", 0)
    live = m.path + "/live/model.safetensors"
    want = lambda v: sha256(gen(v) / "model.safetensors")  # noqa: E731
    pages = (os.path.getsize(live) + 4095) // 4096
    fd = os.open(live, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead around the reads
        for p in range(0, pages, 10):
            os.pread(fd, 4096, p * 4096)
        r = apply(m.path, 1)
        st = m.status()["live"]["last_pages"]
        assert 0 < st["patched_pages"] <= (pages + 9) // 10, (st, pages)
        assert r["pages"] == st["patched_pages"] + st["read_path_pages"]
        assert sha256(live) == want(1)

        stop = threading.Event()

        def churn():
            rng = random.Random(7)
            while not stop.is_set():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                for _ in range(32):
                    os.pread(fd, 4096, rng.randrange(pages) * 4096)
        for target in (3, 0, STEPS, 2):
            with open(live, "rb") as f:
                f.read()  # everything resident again
            stop.clear()
            t = threading.Thread(target=churn)
            t.start()
            try:
                assert apply(m.path, target)["to_version"] == target
            finally:
                stop.set()
                t.join()
            assert sha256(live) == want(target), target
    finally:
        os.close(fd)


def test_uncached_pages_come_from_the_new_version(mount, gen):
    m = mount("--live-version", 0)
    r = apply(m.path, 2)
    assert r["pages"] == 0  # nothing of live/ was cached
    assert sha256(m.path + "/live/model.safetensors") == sha256(gen(2) / "model.safetensors")


class Receivers:
    """Receiver processes of tp ranks (`ranks`: the ones to start; all by
    default), each holding its shards of `state` in /dev/shm and registered
    with the mount through dte.LiveReceiver; with `server`, as the ranks of
    that inference server (of size tp)."""

    def __init__(self, mount_path, state, tp, version, ranks=None, server=None):
        self.mount_path, self.tp, self.server = mount_path, tp, server
        self.ranks, self.weights, self.procs = [], [], []
        try:
            for rank in range(tp) if ranks is None else ranks:
                self.start(rank, state, version)
        except BaseException:
            self.close()
            raise

    def start(self, rank, state, version):
        """Starts the receiver of `rank`, its buffers holding `state` (of `version`)."""
        sys.path.insert(0, PY_PATH)
        import dte
        shards = shard(state, self.tp, rank)
        w = dte.SharedWeights(f"dte-test-{os.getpid()}-{self.tp}-{rank}",
                              {k: ("BF16", list(a.shape)) for k, a in shards.items()})
        self.weights.append(w)
        self.ranks.append(rank)
        for k, a in shards.items():
            w.array(k)[...] = a
        spec = {"tp": self.tp, "rank": rank, "version": version, "buffers": [
            {"name": k, "shm": w.name, "offset": w.offset(k), "shape": list(a.shape)}
            for k, a in shards.items()]}
        if self.server is not None:
            spec.update(server=self.server, server_size=self.tp)
        p = subprocess.Popen([sys.executable, "-c", RECEIVER, PY_PATH, self.mount_path,
                              json.dumps(spec)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        self.procs.append(p)
        assert p.stdout.readline().strip() == "ready"

    def check(self, want, what):
        """Every rank's buffers equal `want` sharded directly, bit for bit."""
        for rank, w in zip(self.ranks, self.weights):
            for k, a in shard(want, self.tp, rank).items():
                assert np.array_equal(w.array(k), a), (what, rank, k)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.stdin.close()
                p.wait(timeout=30)
        for w in self.weights:
            w.close()
            w.unlink()


@pytest.mark.parametrize("tp", [1, 2, 4])  # 4 > KV_HEADS: K/V heads replicated
def test_receivers_in_shared_memory_get_the_target_sharded(mount, gen, tp):
    m = mount("--live-version", 1)
    v1 = load_raw(gen(1) / "model.safetensors")
    rx = Receivers(m.path, v1, tp, 1)
    try:
        st = m.status()["live"]
        assert st["receivers"] == tp
        assert st["buffers"] == sum(len(shard(v1, tp, r)) for r in range(tp))
        for target in (4, 2, 0, 3):
            r = apply(m.path, target)
            assert r["receivers"] == tp, r
            # Along the delta chain the deltas' entries are applied in place.
            assert r["blocks"] > 0 and r["compared_blocks"] == 0, r
            rx.check(load_raw(gen(target) / "model.safetensors"), target)
        # A receiver that exits is unregistered.
        rx.procs[0].stdin.close()
        rx.procs[0].wait(timeout=30)
        wait_for(lambda: m.status()["live"]["receivers"] == tp - 1, 10, "receiver 0 to go")
    finally:
        rx.close()


def test_receivers_follow_versions_published_from_adamw(tmp_path, gen):
    """The AdamW publisher stores some changed elements whole ("set": the
    engine did not know their old bits). Forward they apply as they are;
    going back over them the daemon cannot undo them and compares those
    blocks between the versions instead. Receivers match either way."""
    torch = pytest.importorskip("torch")
    import safetensors.torch
    sys.path.insert(0, PY_PATH)
    import dte
    store = tmp_path / "store"
    pub = dte.Publisher(store=str(store))
    pub.import_checkpoint(str(gen(0)))
    params = {n: torch.nn.Parameter(t.float()) for n, t in
              safetensors.torch.load_file(str(gen(0) / "model.safetensors")).items()}
    opt = torch.optim.AdamW(list(params.values()), lr=1e-3, weight_decay=0.01, fused=True)
    g = torch.Generator().manual_seed(11)
    for step in (1, 2, 3):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        opt.step()
        r = pub.publish_adamw(step=step, lr=1e-3, weight_decay=0.01, params={
            n: (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for n, p in params.items()})
        assert r.version == step
    pub.close()
    with fs_util.mounts(tmp_path) as start:
        m = start(store, "--live-version", 3)
        states = {v: load_raw(os.path.join(m.path, VersionName(v), "model.safetensors"))
                  for v in range(4)}
        for name, p in params.items():  # the store holds the trainer's BF16 weights
            assert np.array_equal(states[3][name], p.detach().to(torch.bfloat16)
                                  .view(torch.int16).numpy().view(np.uint16)), name
        rx = Receivers(m.path, states[3], 2, 3)
        try:
            back = apply(m.path, 1)
            assert 0 < back["compared_blocks"] < back["blocks"], back
            rx.check(states[1], "3 -> 1")
            fwd = apply(m.path, 3)
            assert fwd["blocks"] > 0 and fwd["compared_blocks"] == 0, fwd
            rx.check(states[3], "1 -> 3")
            rx.check(load_raw(os.path.join(m.path, "live", "model.safetensors")), "live/")
        finally:
            rx.close()


def server_status(m):
    return m.status()["live"]["servers"]


def test_a_server_moves_when_every_rank_registered_and_never_in_part(mount, gen):
    """A server of two ranks registered from two processes: an apply with
    only rank 0 there is refused naming the server, and changes nothing;
    with both, applies forward and back move both ranks exactly."""
    sys.path.insert(0, PY_PATH)
    import dte
    import prom_util

    port = prom_util.free_port()
    m = mount("--live-version", 1, "--metrics", "127.0.0.1:%d" % port)
    states = {v: load_raw(gen(v) / "model.safetensors") for v in range(STEPS + 1)}
    rx = Receivers(m.path, states[1], 2, 1, ranks=[0], server="rollout-3")
    try:
        assert server_status(m) == [{"name": "rollout-3", "size": 2, "ranks": [0],
                                     "complete": False, "version": 1}]
        failed = m.status()["live"]["failed_applies"]
        r = dtectl("apply", m.path, "--version", 3, check=False)
        assert r.returncode != 0
        assert ('server "rollout-3" is incomplete on this mount: ranks [0] of its 2 registered'
                in r.stderr), r.stderr
        st = dte.live_status(m.path)
        assert st.live_version == 1 and st.failed_applies == failed + 1
        assert "rollout-3" in st.last_message
        assert st.servers == [dte.LiveServer("rollout-3", 2, (0,), False, 1)]
        rx.check(states[1], "refused")
        assert sha256(m.path + "/live/model.safetensors") == sha256(gen(1) / "model.safetensors")
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as f:
            text = f.read().decode()
        assert 'dte_fs_live_server_ranks{server="rollout-3"} 1' in text, text
        assert 'dte_fs_live_server_complete{server="rollout-3"} 0' in text, text

        rx.start(1, states[1], 1)
        assert server_status(m) == [{"name": "rollout-3", "size": 2, "ranks": [0, 1],
                                     "complete": True, "version": 1}]
        for target in (3, 1, 4, 0):  # forward, a rollback, forward, back to the anchor
            res = apply(m.path, target)
            assert res["receivers"] == 2, res
            rx.check(states[target], target)
            assert dte.live_status(m.path).servers == [
                dte.LiveServer("rollout-3", 2, (0, 1), True, target)]
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as f:
            text = f.read().decode()
        assert 'dte_fs_live_server_ranks{server="rollout-3"} 2' in text, text
        assert 'dte_fs_live_server_complete{server="rollout-3"} 1' in text, text
        # A rank that leaves makes the server incomplete again.
        rx.procs[1].stdin.close()
        rx.procs[1].wait(timeout=30)
        wait_for(lambda: server_status(m)[0]["ranks"] == [0], 10, "rank 1 to go")
        assert dtectl("apply", m.path, "--version", 2, check=False).returncode != 0
        rx.check(states[0], "after rank 1 left")
        assert dte.live_status(m.path).live_version == 0
    finally:
        rx.close()


def test_bad_server_registrations_are_refused(mount, gen):
    sys.path.insert(0, PY_PATH)
    import dte

    m = mount()
    w = dte.SharedWeights(f"dte-test-server-{os.getpid()}",
                          {"model.norm.weight": ("BF16", [HIDDEN])})

    def register(**kw):
        r = dte.LiveReceiver(m.path, **kw)
        try:
            r.register("model.norm.weight", w.name, 0, "BF16", [HIDDEN])
        except BaseException:
            r.close()
            raise
        return r

    try:
        with pytest.raises(dte.InvalidArgument,
                           match='server "s": rank 1 is not below the server\'s size 1'):
            register(tp=2, rank=1, server="s", server_size=1)
        with pytest.raises(dte.InvalidArgument, match='server "s": size 0'):
            register(tp=2, rank=0, server="s", server_size=0)
        with pytest.raises(dte.InvalidArgument, match='server "": size 2'):
            register(tp=2, rank=0, server_size=2)
        first = register(tp=2, rank=0, server="s", server_size=2)
        try:
            with pytest.raises(dte.InvalidArgument,
                               match='server "s": size 4 disagrees with the size 2 its ranks'):
                register(tp=4, rank=1, server="s", server_size=4)
            with pytest.raises(dte.InvalidArgument,
                               match='server "s": rank 0 is registered by another receiver'):
                register(tp=2, rank=0, server="s", server_size=2)
            assert server_status(m) == [{"name": "s", "size": 2, "ranks": [0],
                                         "complete": False, "version": STEPS}]
        finally:
            first.close()
        wait_for(lambda: server_status(m) == [], 10, "the server to go")
    finally:
        w.close()
        w.unlink()


def test_bad_registrations_are_refused(mount, gen):
    sys.path.insert(0, PY_PATH)
    import dte

    m = mount()
    w = dte.SharedWeights(f"dte-test-bad-{os.getpid()}",
                          {"model.norm.weight": ("BF16", [HIDDEN])})
    try:
        with dte.LiveReceiver(m.path, tp=2, rank=0) as r:
            with pytest.raises(dte.DteError, match="no such tensor"):
                r.register("model.layers.0.self_attn.q_proj.weight", w.name, 0, "BF16",
                           [HEADS * HEAD_DIM // 2, HIDDEN])
            with pytest.raises(dte.DteError, match="given, the layout has"):
                r.register("model.norm.weight", w.name, 0, "BF16", [HIDDEN + 1])
            with pytest.raises(dte.DteError, match="do not fit"):
                r.register("model.norm.weight", w.name, 64, "BF16", [HIDDEN])
            with pytest.raises(dte.DteError, match="must name an object"):
                r.register("model.norm.weight", "../etc/passwd", 0, "BF16", [HIDDEN])
            # A buffer loaded from another version than the live one (an apply
            # came in between) would be patched wrong: refused.
            with pytest.raises(dte.DteError,
                               match="holds v00000002 but the live version is v%08d" % STEPS):
                r.register("model.norm.weight", w.name, 0, "BF16", [HIDDEN], version=2)
            assert r.register("model.norm.weight", w.name, 0, "BF16", [HIDDEN],
                              version=STEPS) > 0
            with pytest.raises(dte.DteError, match="already registered"):
                r.register("model.norm.weight", w.name, 0, "BF16", [HIDDEN])
        wait_for(lambda: m.status()["live"]["receivers"] == 0, 10, "the receiver to go")
    finally:
        w.close()
        w.unlink()


def test_a_truncated_receiver_is_dropped_and_the_daemon_lives(mount, gen):
    sys.path.insert(0, PY_PATH)
    import dte

    m = mount("--live-version", 1)
    v1 = load_raw(gen(1) / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    w = dte.SharedWeights(f"dte-test-trunc-{os.getpid()}", {name: ("BF16", list(v1[name].shape))})
    try:
        r = dte.LiveReceiver(m.path, tp=1, rank=0)
        r.register(name, w.name, 0, "BF16", list(v1[name].shape))
        os.truncate(f"/dev/shm/{w.name}", 0)  # its memory is gone under the daemon's mapping
        res = apply(m.path, 2)
        assert res["receivers"] == 0 and m.alive()
        assert m.status()["live"]["receivers"] == 0
        assert sha256(m.path + "/live/model.safetensors") == sha256(gen(2) / "model.safetensors")
        r.close()
    finally:
        w.close()
        w.unlink()


def test_corrupt_blob_fails_the_apply_and_changes_nothing(mount, gen, tmp_path):
    m = mount("--live-version", 1)
    live = m.path + "/live/model.safetensors"
    before = sha256(live)
    # Damage the delta blob v3 added (its one new blob besides the block table).
    man = json.load(open(tmp_path / "store" / "manifests" / "v00000003.json"))
    added = [b["hash"] for b in man["blobs"] if b.get("added")]
    assert added
    for h in added:
        p = tmp_path / "store" / "blobs" / h[:2] / h
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        os.chmod(p, 0o644)
        p.write_bytes(bytes(data))
    r = dtectl("apply", m.path, "--version", 3, check=False)
    assert r.returncode == 1
    assert "v00000003" in r.stderr and "live state unchanged" in r.stderr, r.stderr
    assert m.status()["live"]["version"] == 1
    assert sha256(live) == before
    st = json.loads(dtectl("status", m.path, "--json").stdout)
    assert st["failed_applies"] == 1 and st["live_version"] == 1
    # Another version still applies.
    assert apply(m.path, 2)["to_version"] == 2
    assert m.alive()


def test_a_version_with_another_layout_is_refused(mount, gen, tmp_path):
    m = mount("--live-version", 1)
    other = tmp_path / "other"
    subprocess.run([str(BUILD_DIR / "tools" / "dte-gen"), "--out", str(other), "--steps", "0",
                    "--hidden", str(HIDDEN), "--layers", str(LAYERS + 1), "--heads", str(HEADS),
                    "--kv-heads", str(KV_HEADS), "--head-dim", str(HEAD_DIM), "--intermediate",
                    str(INTER), "--vocab", str(VOCAB), "-q"], check=True, timeout=120)
    d = Dtectl(tmp_path / "store", tmp_path / "cache2")
    assert d.commit(other / "step-000000") == STEPS + 1
    wait_for(lambda: STEPS + 1 in m.status()["versions"], 10, "the new version")
    r = dtectl("apply", m.path, check=False)
    assert r.returncode == 1 and "cannot apply v00000005 over live v00000001" in r.stderr, r.stderr
    assert m.status()["live"]["version"] == 1


def test_control_ioctls_refuse_what_they_must(mount, tmp_path):
    import fcntl
    m = mount()
    fd = os.open(m.path + "/.dte/control", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as e:
            fcntl.ioctl(fd, (2 << 30) | (8 << 16) | (0xD7 << 8) | 99, bytearray(8), True)
        import errno
        assert e.value.errno == errno.ENOTTY
    finally:
        os.close(fd)
    fd = os.open(m.path + "/live/config.json", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as e:
            fcntl.ioctl(fd, (3 << 30) | (1152 << 16) | (0xD7 << 8) | 1, bytearray(1152), True)
        assert e.value.errno == errno.ENOTTY
    finally:
        os.close(fd)
    # Another user may not apply (the mount allows other users in; its parent
    # directories let them reach it).
    m.unmount()
    public = tempfile.mkdtemp(prefix="dte-live-")
    try:
        os.chmod(public, 0o755)
        with fs_util.mounts(public) as start:
            m2 = start(tmp_path / "store", "-o", "allow_other")
            r = subprocess.run([sys.executable, "-c",
                                "import os, subprocess, sys; os.setgid(65534); os.setuid(65534); "
                                "r = subprocess.run([sys.argv[1], 'apply', sys.argv[2]], "
                                "capture_output=True, text=True); "
                                "print(r.returncode); print(r.stderr)",
                                str(BUILD_DIR / "tools" / "dtectl"), m2.path],
                               capture_output=True, text=True, timeout=60)
            code, _, err = r.stdout.partition("\n")
            assert code == "1" and "only root and the user who mounted it" in err, \
                r.stdout + r.stderr
            assert m2.status()["live"]["applies"] == 0
    finally:
        shutil.rmtree(public, ignore_errors=True)
