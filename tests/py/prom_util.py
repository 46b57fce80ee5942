"""A real Prometheus server (Debian's `prometheus`) on loopback, scraping
one target every second, for the metrics tests."""

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """Scrapes http://127.0.0.1:PORT/metrics as job `job`; use as a context
    manager. query(q) gives the value of an instant query, or None."""

    def __init__(self, tmp_path, job, port):
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n"
                       "  - job_name: %s\n    static_configs:\n"
                       "      - targets: ['127.0.0.1:%d']\n" % (job, port))
        self.port = free_port()
        self.proc = subprocess.Popen([PROMETHEUS, "--config.file=%s" % cfg,
                                      "--storage.tsdb.path=%s" % (tmp_path / "tsdb"),
                                      "--web.listen-address=127.0.0.1:%d" % self.port],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def query(self, q):
        url = "http://127.0.0.1:%d/api/v1/query?%s" % (self.port,
                                                       urllib.parse.urlencode({"query": q}))
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                res = json.load(r)["data"]["result"]
        except OSError:
            return None
        return float(res[0]["value"][1]) if res else None

    def log(self):
        """Its stderr (stops it first)."""
        self.close()
        return self.proc.stderr.read().decode()[-3000:]

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
