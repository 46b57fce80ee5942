"""A deterministic fault campaign over short scenarios (docs/s3.md, "Fault
campaign"): each fault kind of the proxy (tests/py/s3_proxy.py) at each
request position of a scenario, one fault per run, on a fresh store state,
and after each run the invariants.

A Scenario runs once clean through the proxy, which counts its requests
(and its listings, for the listing faults). Then, for each kind and each
position i, a Rule fires on the i-th request of the run (the i-th
ListObjectsV2 for the listing kinds) and nowhere else. Requests that run in
parallel make "the i-th" depend on timing; the set of positions tried does
not.

Positions: `DTE_FAULT_CAMPAIGN=all` tries every one (tools/fault_campaign.sh).
Otherwise `sample_positions` spreads PER_KIND (2) points per kind evenly
over the run, first and last request included, and deals them out to the
kinds in turn, so that the kinds of one family (requests, listings) get
different positions; a listing kind also tries the last listing, and draws
only from listings without start-after (a follower's polls, empty unless
something was committed).

Thread-safety: none; one campaign runs at a time.
"""

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import s3_util

# Fault kind -> (Rule arguments, applies to listings only).
KINDS = {
    "5xx": ({"action": "status", "status": 500, "code": "InternalError",
             "message": "We encountered an internal error."}, False),
    "reset_before": ({"action": "reset_before"}, False),
    "reset_after": ({"action": "reset_after"}, False),
    "truncate": ({"action": "truncate"}, False),
    "flip": ({"action": "flip", "mask": 0x10}, False),
    "stall": ({"action": "stall", "seconds": 4.0}, False),
    "list_drop_key": ({"action": "list_drop_key"}, True),
    "list_damage_key": ({"action": "list_damage_key", "mask": 0x40}, True),
}
LISTING_QUERY = "list-type=2"
# Retries small enough that a case takes seconds (docs/s3.md, Retries); a
# stall is abandoned after one second below 1 KiB/s.
FAST_RETRIES = {"DTE_S3_MAX_ATTEMPTS": "4", "DTE_S3_RETRY_BASE_MS": "20",
                "DTE_S3_RETRY_MAX_MS": "200", "DTE_S3_LOW_SPEED_TIME": "1"}
MANIFEST_KEY = re.compile(r"manifests/v\d{8,12}(?:\.r\d+)?\.json")
VERSION_NAME = re.compile(r"\bv(\d{8,12})\b(?!\.)")  # not the manifest keys above
MISSING_WORDS = re.compile(r"is gone|is missing|not found|does not exist|no longer exists|"
                           r"is not committed")
CONCURRENT_WORDS = re.compile(r"another writer|latest version changed|changed it\b")
CRASH_WORDS = ("Traceback", "terminate called", "Segmentation fault", "core dumped",
               "AddressSanitizer", "Assertion")


def full_campaign():
    return os.environ.get("DTE_FAULT_CAMPAIGN", "") == "all"


def per_kind():
    return int(os.environ.get("DTE_FAULT_CAMPAIGN_PER_KIND", "2"))


def sample_positions(candidates, slot, slots, last=False):
    """The positions (of `candidates`, a list of request or listing indices)
    that kind number `slot` of `slots` kinds tries; with `last`, the last
    candidate too. Every candidate in a full campaign."""
    if not candidates:
        return []
    if full_campaign():
        return list(candidates)
    points = slots * per_kind()
    n = len(candidates)
    spread = [candidates[round(i * (n - 1) / max(points - 1, 1))] for i in range(points)]
    return sorted(set(spread[slot::slots]) | ({candidates[-1]} if last else set()))


def fault_rule(kind, position):
    """Rule arguments that fire once, on the position-th request (listing) of
    a run. A listing fault hits the last key at even positions and the one
    before it at odd ones."""
    args, listing = KINDS[kind]
    rule = dict(args, skip=position, times=1)
    if listing:
        rule.update(method="GET", query=LISTING_QUERY, at=-1 - position % 2)
    return rule


@dataclass
class Outcome:
    """What a scenario's command said: ok, and the error text when not."""
    ok: bool
    error: str = ""
    rc: Optional[int] = None
    detail: dict = field(default_factory=dict)


@dataclass
class Case:
    scenario: str
    kind: str
    position: int
    fired: bool
    outcome_ok: bool
    problems: list
    error: str = ""
    seconds: float = 0.0

    def line(self):
        state = "ok" if self.outcome_ok else "failed cleanly" if not self.problems else "failed"
        text = f"{self.scenario} {self.kind}@{self.position}: command {state}"
        if self.problems:
            text += "; INVARIANT: " + " | ".join(self.problems)
        if self.error:
            text += f"; error: {self.error.strip()[:400]}"
        return text


class Scenario:
    """One short scenario. Subclasses set `name` and implement:
    fresh() -> a context on a fresh store state (and anything a run needs);
    run(ctx) -> Outcome (through the proxy); check(ctx, outcome) -> problems;
    retry(ctx) -> problems of a fault-free rerun after a failed run, which
    must succeed; close(ctx) frees what fresh() made."""

    name = "?"

    def fresh(self):
        raise NotImplementedError

    def run(self, ctx):
        raise NotImplementedError

    def check(self, ctx, outcome):
        raise NotImplementedError

    def retry(self, ctx):
        raise NotImplementedError

    def close(self, ctx):
        pass


class Campaign:
    """Runs scenarios through one proxy and keeps every case."""

    def __init__(self, proxy, log: Callable[[str], None] = print):
        self.proxy, self.log = proxy, log
        self.cases, self.counts = [], {}

    def _one(self, scenario, rule_args):
        ctx = scenario.fresh()
        try:
            self.proxy.clear_rules()
            self.proxy.reset_counters()
            rule = self.proxy.add_rule(**rule_args) if rule_args else None
            outcome = scenario.run(ctx)
            self.proxy.clear_rules()
            exchanges = self.proxy.exchanges()
            problems = scenario.check(ctx, outcome)
            if not outcome.ok:
                problems += scenario.retry(ctx)
            return outcome, list(dict.fromkeys(problems)), exchanges, rule
        finally:
            self.proxy.clear_rules()
            scenario.close(ctx)

    def clean_run(self, scenario):
        """Runs the scenario without faults; returns the request positions, the
        positions of listings without start-after, and the number of listings."""
        outcome, problems, exchanges, _ = self._one(scenario, None)
        assert outcome.ok and not problems, \
            f"{scenario.name} fails without faults: {outcome.error} {problems}"
        listings = [e for e in exchanges if e.method == "GET" and LISTING_QUERY in e.query]
        self.counts[scenario.name] = (len(exchanges), len(listings))
        self.log(f"{scenario.name}: {len(exchanges)} requests, {len(listings)} listings "
                 "without faults")
        # Listings with start-after (a follower's polls) are empty unless
        # something was committed: the sample draws from the others.
        whole = [i for i, e in enumerate(listings) if "start-after" not in e.query]
        return list(range(len(exchanges))), whole or list(range(len(listings))), len(listings)

    def run(self, scenario, kinds=None):
        requests, whole, listings = self.clean_run(scenario)
        kinds = kinds or list(KINDS)
        for kind in kinds:
            family = [k for k in kinds if KINDS[k][1] == KINDS[kind][1]]
            listing = KINDS[kind][1]
            candidates = (list(range(listings)) if full_campaign() else whole) if listing \
                else requests
            for position in sample_positions(candidates, family.index(kind), len(family),
                                             last=listing):
                started = time.monotonic()
                outcome, problems, _, rule = self._one(scenario, fault_rule(kind, position))
                case = Case(scenario.name, kind, position, rule.fired > 0, outcome.ok, problems,
                            "" if outcome.ok else outcome.error, time.monotonic() - started)
                self.cases.append(case)
                if problems or not outcome.ok:
                    self.log(case.line())

    def failures(self):
        return [c for c in self.cases if c.problems]

    def summary(self):
        scenarios = sorted({c.scenario for c in self.cases})
        kinds = sorted({c.kind for c in self.cases})
        positions = len({(c.scenario, c.kind, c.position) for c in self.cases})
        mode = "every position" if full_campaign() else "sampled positions"
        return (f"fault campaign: {len(scenarios)} scenarios, {len(kinds)} kinds, "
                f"{positions} positions ({mode}), {len(self.cases)} cases, "
                f"{sum(not c.fired for c in self.cases)} faults not reached, "
                f"{sum(not c.outcome_ok for c in self.cases)} commands failed, "
                f"{len(self.failures())} invariant failures")

    def write_report(self, path):
        with open(path, "w") as f:
            json.dump({"summary": self.summary(), "counts": self.counts,
                       "cases": [vars(c) for c in self.cases]}, f, indent=1)


# --- the store straight from the server ----------------------------------------

_clients = {}


def client(moto):
    """One boto3 client per server (making one takes 0.1 s)."""
    if moto.endpoint not in _clients:
        _clients[moto.endpoint] = s3_util.s3_client(moto)
    return _clients[moto.endpoint]


def object_keys(moto, bucket, prefix):
    """Every key under prefix/, relative to it."""
    keys = []
    for page in client(moto).get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix + "/"):
        keys += [o["Key"][len(prefix) + 1:] for o in page.get("Contents", [])]
    return sorted(keys)


def copy_prefix(moto, bucket, src, dst):
    """Server-side copies of every object under src/ to dst/ (the same store)."""
    for key in object_keys(moto, bucket, src):
        client(moto).copy_object(Bucket=bucket, Key=f"{dst}/{key}",
                                 CopySource={"Bucket": bucket, "Key": f"{src}/{key}"})


# --- invariants shared by the scenarios ---------------------------------------

def _clause(text, start, limit):
    """What follows a name up to the end of its clause (";" or ":")."""
    return re.split(r"[;:]", text[start:start + limit])[0]


def error_problems(error, moto, bucket, prefix, rc=None):
    """Ways a failing command's message misnames its cause: a crash, an empty
    message, another writer or a concurrent change (no scenario has one), or
    a manifest or version called missing that is in the store."""
    problems = []
    if rc is not None and rc not in (1, 3, 4):
        problems.append(f"exit status {rc} (a crash or an unknown status)")
    if not error.strip():
        problems.append("failed without a message")
    for word in CRASH_WORDS:
        if word in error:
            problems.append(f"crash text in the error: {word!r}")
    if CONCURRENT_WORDS.search(error):
        problems.append("blames a concurrent change to the store, and there is none")
    present = set(object_keys(moto, bucket, prefix))
    for m in MANIFEST_KEY.finditer(error):
        if MISSING_WORDS.search(_clause(error, m.end(), 80)) and m.group(0) in present:
            problems.append(f"calls {m.group(0)} missing, and it is in the store")
    versions = {int(k[len("manifests/v"):].split(".")[0]) for k in present
                if MANIFEST_KEY.fullmatch(k)}
    for m in VERSION_NAME.finditer(error):
        if MISSING_WORDS.search(_clause(error, m.end(), 40)) and int(m.group(1)) in versions:
            problems.append(f"calls {m.group(0)} missing, and it is in the store")
    return problems


def manifest_fingerprints(moto, bucket, prefix):
    """{version: what its newest manifest says each file holds}: names, sizes,
    raw file blobs, headers and tensor hashes, not how the bytes are encoded.
    With `dtectl verify` clean (every file materializes to these hashes),
    equal fingerprints mean byte-identical exports."""
    newest = {}
    for key in object_keys(moto, bucket, prefix):
        m = re.fullmatch(r"manifests/v(\d{8,12})(?:\.r(\d+))?\.json", key)
        if m:
            version, revision = int(m.group(1)), int(m.group(2) or 0)
            if version not in newest or newest[version][0] < revision:
                newest[version] = (revision, key)
    out = {}
    for version, (_, key) in sorted(newest.items()):
        body = client(moto).get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()
        manifest = json.loads(body)
        out[version] = [(f["name"], f["size"], f.get("blob"), f.get("header_blob"),
                         [(t["name"], t["hash"]) for t in f.get("tensors", [])])
                        for f in manifest["files"]]
    return out


def version_problems(found, expected, must, may=()):
    """Versions in `must` are present with their expected fingerprints; only
    versions in must or may are present at all."""
    problems = []
    for v in sorted(must):
        if v not in found:
            problems.append(f"version {v} is lost")
        elif found[v] != expected[v]:
            problems.append(f"version {v} holds other bytes than committed")
    extra = sorted(set(found) - set(must) - set(may))
    if extra:
        problems.append(f"unexpected versions {extra}")
    for v in sorted(set(found) & set(may)):
        if found[v] != expected[v]:
            problems.append(f"version {v} holds other bytes than committed")
    return problems
