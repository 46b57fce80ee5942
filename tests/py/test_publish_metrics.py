"""Publisher metrics (sync/publish/publish_metrics.h): a dte.Publisher driven by
real torch.optim.AdamW steps counts what it committed, and the figures equal
the publishes' results; the registry is served over HTTP (loopback unless
told otherwise) and scraped by a real Prometheus server, pushed to a real
Pushgateway (Debian's prometheus-pushgateway), and collected through
prometheus_client next to a trainer's own metrics. A rejected publish is
counted as a failure and changes no other figure."""

import shutil
import socket
import subprocess
import time
import urllib.request

import pytest
import torch

import prom_util
import push_util
from wait_util import wait_for
import dte
from prometheus_client import CollectorRegistry, Counter, generate_latest, push_to_gateway
from prometheus_client.parser import text_string_to_metric_families

PUSHGATEWAY = shutil.which("prometheus-pushgateway") or "/usr/bin/prometheus-pushgateway"
STEPS = 3


def values_of(text):
    """{sample name with its labels: value} of an exposition text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join("%s=%s" % kv for kv in sorted(s.labels.items()))
            out[s.name + ("{%s}" % labels if labels else "")] = s.value
    return out


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A store, its publisher after STEPS published AdamW steps, the results."""
    root = tmp_path_factory.mktemp("publish-metrics")
    model = push_util.TinyGqaLM(seed=3)
    push_util.save_checkpoint(root / "init", model)
    named = model.named()
    opt = torch.optim.AdamW(named.values(), lr=3e-3, weight_decay=0.01, fused=True)
    pub = dte.Publisher(store=str(root / "store"))
    pub.import_checkpoint(str(root / "init"))
    g = torch.Generator().manual_seed(7)
    targets = {n: torch.randn(p.shape, generator=g) for n, p in named.items()}
    results = []
    for _ in range(STEPS):
        opt.zero_grad()
        sum(((p - targets[n]) ** 2).sum() for n, p in named.items()).backward()
        opt.step()
        results.append(pub.publish_torch_adamw(opt, named))
    yield pub, results, (opt, named)
    pub.close()


def test_the_metrics_are_what_the_publishes_committed(published):
    pub, results, (opt, named) = published
    v = values_of(pub.metrics_text())
    assert v["dte_publish_versions_total"] == STEPS
    assert v["dte_publish_failures_total"] == 0
    for metric, field in (("dte_publish_changed_elements_total", "changed"),
                          ("dte_publish_elements_total", "elements"),
                          ("dte_publish_tensors_total", "tensors"),
                          ("dte_publish_flagged_elements_total", "flagged"),
                          ("dte_publish_false_positive_elements_total", "false_positives"),
                          ("dte_publish_uncertain_elements_total", "uncertain"),
                          ("dte_publish_stored_bytes_total", "stored_bytes"),
                          ("dte_publish_state_read_bytes_total", "state_bytes")):
        assert v[metric] == sum(getattr(r, field) for r in results), metric
    assert v["dte_publish_changed_elements_total"] > 0
    assert v["dte_publish_last_version"] == results[-1].version == STEPS
    assert v["dte_publish_last_step"] == STEPS
    assert v["dte_publish_last_changed_ratio"] == pytest.approx(
        results[-1].changed / results[-1].elements)
    assert abs(v["dte_publish_last_success_timestamp_seconds"] - time.time()) < 600
    assert v["dte_publish_duration_seconds_count"] == STEPS
    assert v["dte_publish_duration_seconds_sum"] > 0
    assert v["dte_publish_duration_seconds_bucket{le=+Inf}"] == STEPS
    # No push server: no push was counted.
    assert v["dte_publish_pushes_total"] == 0 and v["dte_publish_push_errors_total"] == 0

    # A rejected publish (a step that does not follow the last) is a failure
    # and changes nothing else.
    with pytest.raises(dte.DteError):
        pub.publish_torch_adamw(opt, named, step=STEPS + 5)
    after = values_of(pub.metrics_text())
    assert after["dte_publish_failures_total"] == 1
    assert after["dte_publish_duration_seconds_count"] == STEPS + 1
    for k in v:
        if not k.startswith(("dte_publish_failures", "dte_publish_duration")):
            assert after[k] == v[k], k


def test_served_metrics_are_scraped_by_a_real_prometheus_server(published, tmp_path):
    pub, results, _ = published
    port = pub.serve_metrics("0")  # a port alone: loopback
    try:
        served = values_of(get("http://127.0.0.1:%d/metrics" % port))
        # (The exposer adds its own exposer_* metrics.)
        assert {k: x for k, x in served.items() if k.startswith("dte_")} == values_of(
            pub.metrics_text())
        # Loopback only: the port is not open on another address of the host.
        with socket.socket() as s:
            s.settimeout(2)
            other = socket.gethostbyname(socket.gethostname())
            if not other.startswith("127."):
                assert s.connect_ex((other, port)) != 0

        with prom_util.Prometheus(tmp_path, "trainer", port) as prom:
            query = prom.query
            try:
                wait_for(lambda: query("dte_publish_versions_total") == served[
                    "dte_publish_versions_total"], 60, "Prometheus to scrape the publisher")
            except AssertionError:
                raise AssertionError("prometheus: %s" % prom.log())
            assert query("dte_publish_changed_elements_total") == sum(r.changed for r in results)
            assert query("dte_publish_stored_bytes_total") == sum(r.stored_bytes for r in results)
            assert query("dte_publish_last_version") == results[-1].version
            assert query("dte_publish_duration_seconds_count") == served[
                "dte_publish_duration_seconds_count"]
            assert query('up{job="trainer"}') == 1

        # A busy port is refused, naming the address; the server serves on.
        with pytest.raises(dte.IOFailure, match="cannot listen on 127.0.0.1:%d" % port) as e:
            pub.serve_metrics(str(port))
        assert e.value.code == 5
        assert values_of(get("http://127.0.0.1:%d/metrics" % port))[
            "dte_publish_versions_total"] == STEPS
    finally:
        pub.serve_metrics(None)
    with pytest.raises(OSError):
        get("http://127.0.0.1:%d/metrics" % port)


def test_metrics_are_pushed_to_a_real_pushgateway(published, tmp_path):
    pub, results, _ = published
    port = prom_util.free_port()
    gw = subprocess.Popen([PUSHGATEWAY, "--web.listen-address=127.0.0.1:%d" % port,
                           "--persistence.file=%s" % (tmp_path / "pg.data")],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = "http://127.0.0.1:%d" % port
    try:
        def up():
            try:
                get(url + "/-/ready")
                return True
            except OSError:
                return False
        wait_for(up, 30, "the Pushgateway")
        mine = values_of(pub.metrics_text())
        pub.push_metrics(url, job="trainer", labels={"run": "r1"})
        held = values_of(get(url + "/metrics"))
        key = "instance=,job=trainer,run=r1"
        assert held["dte_publish_versions_total{%s}" % key] == STEPS
        assert held["dte_publish_changed_elements_total{%s}" % key] == sum(
            r.changed for r in results)
        assert held["dte_publish_duration_seconds_count{%s}" % key] == mine[
            "dte_publish_duration_seconds_count"]

        # Through prometheus_client: the collector sits next to the trainer's
        # own metrics in one registry, served and pushed together.
        registry = CollectorRegistry()
        own = Counter("trainer_steps", "Optimizer steps", registry=registry)
        own.inc(STEPS)
        registry.register(pub.metrics_collector())
        both = values_of(generate_latest(registry).decode())
        assert both["trainer_steps_total"] == STEPS
        assert both["dte_publish_versions_total"] == STEPS
        assert both["dte_publish_stored_bytes_total"] == mine["dte_publish_stored_bytes_total"]
        assert both["dte_publish_duration_seconds_bucket{le=+Inf}"] == mine[
            "dte_publish_duration_seconds_count"]
        push_to_gateway("127.0.0.1:%d" % port, job="trainer-py", registry=registry)
        held = values_of(get(url + "/metrics"))
        assert held["dte_publish_versions_total{instance=,job=trainer-py}"] == STEPS
        assert held["trainer_steps_total{instance=,job=trainer-py}"] == STEPS

        # Bad gateways and groups are refused, naming them.
        with pytest.raises(dte.DteError, match="not HOST:PORT"):
            pub.push_metrics("127.0.0.1", job="trainer")
        with pytest.raises(dte.DteError, match="job \"a/b\""):
            pub.push_metrics(url, job="a/b")
        with pytest.raises(dte.DteError, match="grouping label run"):
            pub.push_metrics(url, job="trainer", labels={"run": ""})
    finally:
        gw.terminate()
        gw.wait(timeout=30)
    with pytest.raises(dte.DteError, match=r"push to %s \(job trainer\): transfer failed" % url):
        pub.push_metrics(url, job="trainer")
