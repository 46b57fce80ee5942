"""dtefs --metrics: the Prometheus exposition of .dte/status, scraped by a
real Prometheus server (Debian's `prometheus`) on loopback, its values
checked against .dte/status; the listen address is opt-in and loopback by
default; a port that cannot be bound fails the mount, naming it."""

import os
import re
import socket
import subprocess
import urllib.request

import pytest

import fs_util
import prom_util
from dtectl_util import Dtectl
from wait_util import wait_for


@pytest.fixture(scope="module")
def store(tmp_path_factory, ckpts):
    root = tmp_path_factory.mktemp("metrics-store")
    d = Dtectl(root / "store", root / "cache")
    d.ok("import", ckpts.dir(0))
    for step in (1, 2):
        d.ok("commit", ckpts.dir(step))
    return d.store


def scrape(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return text, values


def read_everything(path):
    n = 0
    for root, _, files in os.walk(path):
        for f in files:
            if f.endswith(".safetensors"):
                with open(os.path.join(root, f), "rb") as fh:
                    n += len(fh.read())
    return n


def test_metrics_equal_the_status_and_a_prometheus_server_scrapes_them(store, tmp_path):
    port = prom_util.free_port()
    with fs_util.Mount(store, tmp_path / "mnt", tmp_path / "cache",
                       args=["--metrics", str(port)]) as m:
        assert re.search(r"metrics at http://127\.0\.0\.1:%d/metrics" % port, m.log()), m.log()
        read_everything(os.path.join(str(tmp_path / "mnt"), "v00000001"))
        read_everything(os.path.join(str(tmp_path / "mnt"), "latest"))
        text, values = scrape(port)
        status = m.status()
        assert "# TYPE dte_fs_reads_total counter" in text
        assert "# TYPE dte_fs_read_duration_seconds histogram" in text
        # The status is read after the scrape and nothing reads meanwhile.
        for metric, field in (("dte_fs_reads_total", "reads"),
                              ("dte_fs_read_bytes_total", "bytes_served"),
                              ("dte_fs_blocks_decoded_total", "blocks_decoded"),
                              ("dte_fs_records_decoded_total", "records_decoded"),
                              ("dte_fs_hash_failures_total", "hash_failures")):
            assert values[metric] == status[field], metric
        assert values["dte_fs_block_cache_hits_total"] == status["cache"]["hits"]
        assert values["dte_fs_block_cache_bytes"] == status["cache"]["bytes"]
        assert values["dte_fs_latest_version"] == status["latest"] == 2
        assert values["dte_fs_versions"] == 3
        assert values["dte_fs_max_version_seen"] == status["max_version_seen"] == 2
        for metric, field in (("dte_fs_listings_damaged_total", "damaged"),
                              ("dte_fs_listings_lacking_total", "lacking"),
                              ("dte_fs_versions_kept_total", "kept"),
                              ("dte_fs_versions_unchecked_total", "unchecked"),
                              ("dte_fs_versions_gone_total", "gone"),
                              ("dte_fs_latest_held_total", "latest_held")):
            assert values[metric] == status["listings"][field] == 0, metric
        assert values["dte_fs_live_version"] == 2
        assert 0 <= values["dte_fs_latest_age_seconds"] < 3600
        assert values["dte_fs_polls_total"] >= 0 and values["dte_fs_poll_failing"] == 0
        assert values["dte_fs_reads_total"] > 0 and values["dte_fs_read_bytes_total"] > 0
        # Every read was timed: the histogram's count is the reads' count.
        assert values['dte_fs_read_duration_seconds_bucket{le="+Inf"}'] == status["reads"]
        assert values["dte_fs_read_duration_seconds_count"] == status["reads"]
        assert values["dte_fs_read_duration_seconds_sum"] > 0
        assert values["dte_fs_apply_duration_seconds_count"] == status["live"]["applies"] == 0

        # A live apply is counted and timed.
        dte = Dtectl(store, tmp_path / "cache")
        r = subprocess.run([str(dte.binary), "apply", str(tmp_path / "mnt"), "--version", "1",
                            "-q"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        _, values = scrape(port)
        assert values["dte_fs_live_applies_total"] == 1 == m.status()["live"]["applies"]
        assert values["dte_fs_apply_duration_seconds_count"] == 1
        assert values["dte_fs_live_version"] == 1

        # A real Prometheus server scrapes the mount.
        with prom_util.Prometheus(tmp_path, "dtefs", port) as prom:
            query = prom.query
            # (Reading .dte/status is itself a read: compare with a scrape
            # taken after the last one.)
            _, now = scrape(port)
            try:
                wait_for(lambda: query("dte_fs_reads_total") == now["dte_fs_reads_total"], 60,
                         "Prometheus to scrape dte_fs_reads_total")
            except AssertionError:
                raise AssertionError("prometheus: %s" % prom.log())
            assert query("dte_fs_read_bytes_total") == now["dte_fs_read_bytes_total"]
            assert query("dte_fs_live_version") == 1
            assert query("dte_fs_latest_version") == 2
            assert query('up{job="dtefs"}') == 1
            assert query("dte_fs_read_duration_seconds_count") == now["dte_fs_reads_total"]


def test_metrics_are_opt_in_and_a_taken_port_fails_the_mount(store, tmp_path):
    with fs_util.Mount(store, tmp_path / "plain", tmp_path / "cache") as m:
        assert "metrics" not in m.log()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        argv = [str(fs_util.binary()), str(store), str(tmp_path / "mnt2"), "--cache-dir",
                str(tmp_path / "cache"), "-f", "--metrics", "127.0.0.1:%d" % port]
        os.makedirs(tmp_path / "mnt2")
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        assert "cannot listen on 127.0.0.1:%d" % port in r.stderr, r.stderr
        assert not os.path.ismount(str(tmp_path / "mnt2"))
