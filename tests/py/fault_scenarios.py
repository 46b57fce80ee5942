"""The scenarios of the fault campaign (tests/py/test_fault_campaign.py;
the framework and invariants are in tests/py/fault_campaign.py). Each
scenario's fresh() copies a template store (made by the test) to a new
prefix of the bucket, run() drives the command through the proxy, and the
checks read the store straight from the server.

Thread-safety: none; the campaign runs one case at a time.
"""

import os
import threading

import torch

import fault_campaign as fc
import push_util
from dtectl_util import Dtectl
from fs_util import Mount, mounted
from wait_util import wait_for

import dte  # noqa: E402  (push_util puts it on the path)

BUCKET = "campaign"
POLL_MS = 100


class World:
    """The server, the proxy, the bucket and fresh prefixes in it."""

    def __init__(self, moto, proxy, root):
        self.moto, self.proxy, self.root = moto, proxy, root
        self.n = 0
        moto.create_bucket(BUCKET)

    def uri(self, prefix):
        return f"s3://{BUCKET}/{prefix}"

    def dir(self, name):
        self.n += 1
        path = self.root / f"{name}{self.n}"
        path.mkdir()
        return path

    def dtectl(self, prefix, via_proxy):
        endpoint = self.proxy.endpoint if via_proxy else self.moto.endpoint
        d = Dtectl(self.uri(prefix), self.dir("cache"),
                   env={**self.moto.env(), "AWS_ENDPOINT_URL": endpoint, **fc.FAST_RETRIES})
        for k in [k for k in d.env if k.startswith("AWS_") and k not in self.moto.env()]:
            del d.env[k]
        return d

    def copy(self, template):
        self.n += 1
        prefix = f"{template}-{self.n}"
        fc.copy_prefix(self.moto, BUCKET, template, prefix)
        return prefix

    def store_problems(self, prefix, expected, must, may=()):
        """Versions and content straight from the server, and verify."""
        found = fc.manifest_fingerprints(self.moto, BUCKET, prefix)
        problems = fc.version_problems(found, expected, must, may)
        r = self.dtectl(prefix, via_proxy=False).run("verify")
        if r.returncode != 0:
            problems.append(f"verify exits {r.returncode}: {r.stderr.strip()[-300:]}")
        return problems

    def error_problems(self, prefix, error, rc=None):
        return fc.error_problems(error, self.moto, BUCKET, prefix, rc)


# --- scenarios on dtectl-made stores -------------------------------------------

class Commit(fc.Scenario):
    """`dtectl commit` of step 3 onto a copy of t3 (v0..v2)."""

    name = "commit"

    def __init__(self, world, ckpts, expected):
        self.w, self.ckpts, self.expected = world, ckpts, expected

    def fresh(self):
        prefix = self.w.copy("t3")
        return {"prefix": prefix, "dte": self.w.dtectl(prefix, via_proxy=True)}

    def run(self, ctx):
        r = ctx["dte"].run("commit", self.ckpts.dir(3))
        ok = r.returncode == 0 and r.stdout.strip() == "3"
        return fc.Outcome(ok, r.stderr, r.returncode)

    def check(self, ctx, outcome):
        if outcome.ok:
            return self.w.store_problems(ctx["prefix"], self.expected, range(4))
        problems = self.w.error_problems(ctx["prefix"], outcome.error, outcome.rc)
        # A failed commit leaves no version (or it reported failure of a
        # version that exists, and a retry would publish the step twice).
        return problems + self.w.store_problems(ctx["prefix"], self.expected, range(3))

    def retry(self, ctx):
        r = ctx["dte"].run("commit", self.ckpts.dir(3))
        if r.returncode != 0 or r.stdout.strip() != "3":
            return [f"a fault-free retry fails ({r.returncode}): {r.stderr.strip()[-300:]}"]
        return self.w.store_problems(ctx["prefix"], self.expected, range(4))


class Gc(fc.Scenario):
    """`dtectl gc --keep-last 2 --grace-seconds 0` on a copy of t5 (v0..v4)."""

    name = "gc"

    def __init__(self, world, expected):
        self.w, self.expected = world, expected

    def fresh(self):
        prefix = self.w.copy("t5")
        return {"prefix": prefix, "dte": self.w.dtectl(prefix, via_proxy=True)}

    def _gc(self, ctx):
        return ctx["dte"].run("gc", "--keep-last", 2, "--grace-seconds", 0, "--json")

    def run(self, ctx):
        r = self._gc(ctx)
        return fc.Outcome(r.returncode == 0, r.stderr, r.returncode)

    def check(self, ctx, outcome):
        problems = [] if outcome.ok else self.w.error_problems(ctx["prefix"], outcome.error,
                                                               outcome.rc)
        # v3 and v4 are kept whatever happens; the others may be left.
        return problems + self.w.store_problems(ctx["prefix"], self.expected, (3, 4), (0, 1, 2))

    def retry(self, ctx):
        r = self._gc(ctx)
        if r.returncode != 0:
            return [f"a fault-free retry fails ({r.returncode}): {r.stderr.strip()[-300:]}"]
        return self.w.store_problems(ctx["prefix"], self.expected, (3, 4))


class Watcher:
    """Reads `latest` and the version list of a mount every 10 ms: `latest`
    must never move back, and a version once shown must stay."""

    def __init__(self, path):
        self.path, self.problems = path, []
        self.seen, self.latest = set(), []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self):
        while not self._stop.wait(0.01):
            try:
                names = {n for n in os.listdir(self.path) if n.startswith("v")}
                target = os.readlink(os.path.join(self.path, "latest"))
            except OSError:
                continue
            with self._lock:
                for gone in sorted(self.seen - names):
                    self.problems.append(f"{gone} vanished from the mount")
                if self.latest and target < self.latest[-1]:
                    self.problems.append(f"latest moved back {self.latest[-1]} -> {target}")
            self.seen |= names
            if not self.latest or target != self.latest[-1]:
                self.latest.append(target)

    def take(self):
        """The problems seen since the last take."""
        with self._lock:
            out, self.problems = sorted(set(self.problems)), []
        return out

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=10)


def _wait(predicate, what, timeout=10):
    """Waits like wait_for; a timeout is for the checks that follow to judge."""
    try:
        wait_for(predicate, timeout, what)
    except AssertionError:
        pass


class MountPoll(fc.Scenario):
    """dtefs follows a copy of t3 through the proxy (poll every 100 ms);
    after its first polls v3 is committed straight to the server; the run
    reads v1 and v3 and goes on past the next periodic full listing."""

    name = "mount"

    def __init__(self, world, ckpts, expected):
        self.w, self.ckpts, self.expected = world, ckpts, expected

    def fresh(self):
        prefix = self.w.copy("t3")
        return {"prefix": prefix, "mount": None, "watch": None}

    def _start(self, ctx):
        env = {k: v for k, v in self.w.moto.env().items() if not k.startswith("AWS_ENDPOINT")}
        m = Mount(self.w.uri(ctx["prefix"]), self.w.dir("mnt") / "m", self.w.dir("fscache"),
                  ["--endpoint", self.w.proxy.endpoint, "--poll-ms", POLL_MS],
                  env={**env, **fc.FAST_RETRIES})
        ctx["mount"] = m
        m.start()
        ctx["watch"] = Watcher(m.path)
        return m

    def _listings(self):
        return self.w.proxy.exchanges(method="GET", query=fc.LISTING_QUERY)

    def _latest_is(self, m, version):
        target = f"v{version:08d}"
        try:
            return os.readlink(os.path.join(m.path, "latest")) == target
        except OSError:
            return False

    def _read(self, m, version):
        """Problems of reading a version's files: other bytes than committed
        are a problem, an error (EIO) is not."""
        root = os.path.join(m.path, f"v{version:08d}")
        for name in sorted(os.listdir(self.ckpts.dir(version))):
            with open(os.path.join(self.ckpts.dir(version), name), "rb") as f:
                want = f.read()
            try:
                with open(os.path.join(root, name), "rb") as f:
                    got = f.read()
            except OSError as e:
                return None, f"reading {root}/{name}: {e}"
            if got != want:
                return f"v{version:08d}/{name} read other bytes than committed", None
        return None, None

    def run(self, ctx):
        try:
            m = self._start(ctx)
        except AssertionError as e:
            return fc.Outcome(False, f"{e}\n{ctx['mount'].log()}")
        listings = lambda: len(self._listings())
        _wait(lambda: listings() >= 4 or not m.alive(), "the mount's first polls")
        self.w.dtectl(ctx["prefix"], via_proxy=False).ok("commit", self.ckpts.dir(3))
        try:
            wait_for(lambda: self._latest_is(m, 3), 15, "latest -> v00000003")
        except AssertionError as e:
            return fc.Outcome(False, str(e), detail={"log": m.log()[-500:]})
        errors, wrong = [], []
        for version in (1, 3):
            bad, error = self._read(m, version)
            wrong += [bad] if bad else []
            errors += [error] if error else []
        # On past the next periodic full listing (one without start-after) and one more poll.
        start = listings()
        full = lambda: [i for i, e in enumerate(self._listings()) if i >= start and
                        "manifests" in e.query and "start-after" not in e.query]
        _wait(lambda: not m.alive() or (full() and listings() > full()[0] + 1),
              "a periodic full listing")
        shown = set(os.listdir(m.path)) if m.alive() else set()
        wrong += [f"v{v:08d} is not shown after a full listing" for v in range(4)
                  if f"v{v:08d}" not in shown and m.alive()]
        ctx["wrong"] = wrong
        return fc.Outcome(not errors and m.alive(), "; ".join(errors) or m.log()[-500:])

    def check(self, ctx, outcome):
        problems = list(ctx.get("wrong", []))
        if not outcome.ok:
            problems += self.w.error_problems(ctx["prefix"], outcome.error)
        if ctx["watch"] is not None:
            problems += ctx["watch"].take()
        m = ctx["mount"]
        if m is not None and not m.alive():
            problems.append(f"dtefs died: {m.log()[-300:]}")
        return problems

    def retry(self, ctx):
        m = ctx["mount"]
        if m is None or not m.alive() or not mounted(m.path):
            if m is not None:
                m.unmount()
            try:
                m = self._start(ctx)
            except AssertionError as e:
                return [f"a fault-free mount fails: {e}"]
        try:
            wait_for(lambda: self._latest_is(m, 3), 15, "latest -> v00000003 without faults")
        except AssertionError as e:
            return [str(e)]
        problems = []
        for version in (0, 1, 2, 3):
            bad, error = self._read(m, version)
            problems += [p for p in (bad, error) if p]
        if ctx["watch"] is not None:
            problems += ctx["watch"].take()
        return problems

    def close(self, ctx):
        if ctx["watch"] is not None:
            ctx["watch"].stop()
        if ctx["mount"] is not None:
            ctx["mount"].unmount()


# --- scenarios of the Python library ---------------------------------------------

class Trained:
    """A small model trained with AdamW; the state each rank publishes at a step."""

    LR, BETAS = 5e-6, (0.9, 0.95)

    def __init__(self, steps, initial_dir):
        """Writes the initial model as a checkpoint into initial_dir."""
        self.model = push_util.TinyGqaLM(seed=5)
        self.shapes = {n: tuple(p.shape) for n, p in self.model.named().items()}
        push_util.save_checkpoint(initial_dir, self.model)
        opt = torch.optim.AdamW(self.model.parameters(), lr=self.LR, betas=self.BETAS,
                                eps=1e-8, weight_decay=0.0, fused=True)
        self.state, self.bf16 = {}, {}
        for step in range(1, steps + 1):
            g = torch.Generator().manual_seed(2000 + step)
            opt.zero_grad()
            sum((p * torch.randn(p.shape, generator=g)).sum()
                for p in self.model.parameters()).backward()
            opt.step()
            self.state[step] = {n: {k: t.detach().clone() for k, t in (
                ("param", p), ("exp_avg", opt.state[p]["exp_avg"]),
                ("exp_avg_sq", opt.state[p]["exp_avg_sq"]), ("step", opt.state[p]["step"]))}
                for n, p in self.model.named().items()}
            self.bf16[step] = {n: p.detach().to(torch.bfloat16)
                               for n, p in self.model.named().items()}

    def params(self, step, rank=None):
        """Every tensor whole, or rank's row half of each (world size 2)."""
        if rank is None:
            return self.state[step]
        out = {}
        for n, s in self.state[step].items():
            half = (s["param"].shape[0] + 1) // 2
            r0, r1 = (0, half) if rank == 0 else (half, s["param"].shape[0])
            out[n] = {"param": s["param"][r0:r1], "exp_avg": s["exp_avg"][r0:r1],
                      "exp_avg_sq": s["exp_avg_sq"][r0:r1], "rows": (r0, r1),
                      "step": s["step"]}
        return out

    def publish(self, publisher, step, rank=None):
        return publisher.publish_adamw(step=step, params=self.params(step, rank), lr=self.LR,
                                       betas=self.BETAS, eps=1e-8, weight_decay=0.0)


def same_tensors(got, want):
    return [n for n, t in want.items()
            if not torch.equal(got[n].view(torch.int16), t.view(torch.int16))]


class DistPublish(fc.Scenario):
    """Two ranks (threads, dte's TCP transport) publish step 3 onto v0..v2;
    libdte in this process reaches the store through the proxy (the test
    sets AWS_ENDPOINT_URL)."""

    name = "publish"

    def __init__(self, world, trained, expected):
        self.w, self.trained, self.expected = world, trained, expected

    def fresh(self):
        return {"prefix": self.w.copy("tt")}

    def run(self, ctx):
        rendezvous = self.w.dir("rendezvous")
        results, errors = [None, None], [None, None]

        def rank(r):
            try:
                with dte.Publisher(store=self.w.uri(ctx["prefix"]), rank=r, world_size=2,
                                   rendezvous=str(rendezvous), timeout=10.0,
                                   cache_dir=str(self.w.dir("pubcache"))) as p:
                    results[r] = self.trained.publish(p, 3, r).version
            except dte.DteError as e:
                errors[r] = f"rank {r}: {e}"
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        ctx["reported"] = results
        ok = results == [3, 3]
        return fc.Outcome(ok, "\n".join(e for e in errors if e))

    def check(self, ctx, outcome):
        problems = []
        if any(v is not None and v != 3 for v in ctx["reported"]):
            problems.append(f"ranks report versions {ctx['reported']}, not 3")
        if not outcome.ok:
            problems += self.w.error_problems(ctx["prefix"], outcome.error)
        reported = 3 in ctx["reported"]
        return problems + self.w.store_problems(ctx["prefix"], self.expected,
                                                range(4) if reported else range(3))

    def retry(self, ctx):
        outcome = self.run(ctx)
        if not outcome.ok:
            return [f"a fault-free retry fails: {outcome.error.strip()[-300:]}"]
        return self.w.store_problems(ctx["prefix"], self.expected, range(4))


class CatchUp(fc.Scenario):
    """A push receiver (tp 1) connected to a push group catches up to v2 of
    the torch store through the proxy, into zeroed tensors. The store is
    only read, so every case uses the template itself."""

    name = "catchup"

    def __init__(self, world, trained, group):
        self.w, self.want, self.group = world, trained.bf16[2], group
        self.shapes = trained.shapes

    def fresh(self):
        tensors = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in self.shapes.items()}
        rx = dte.PushReceiver(self.group.address, tensors, version=None, timeout=5.0)
        return {"tensors": tensors, "rx": rx}

    def run(self, ctx):
        try:
            ctx["rx"].catch_up(self.w.uri("tt"), version=2,
                               cache_dir=str(self.w.dir("rxcache")))
        except dte.DteError as e:
            return fc.Outcome(False, str(e))
        return fc.Outcome(True)

    def check(self, ctx, outcome):
        differ = same_tensors(ctx["tensors"], self.want)
        if outcome.ok:
            return [f"caught up, and {differ[:3]} hold other bytes than v2"] if differ else []
        problems = self.w.error_problems("tt", outcome.error)
        if ctx["rx"].status().version == 2 and differ:
            problems.append(f"the receiver says it holds v2, and {differ[:3]} differ")
        return problems

    def retry(self, ctx):
        outcome = self.run(ctx)
        if not outcome.ok:
            return [f"a fault-free retry fails: {outcome.error.strip()[-300:]}"]
        differ = same_tensors(ctx["tensors"], self.want)
        return [f"after a retry {differ[:3]} hold other bytes than v2"] if differ else []

    def close(self, ctx):
        ctx["rx"].close()
