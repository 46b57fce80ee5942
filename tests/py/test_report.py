"""dtectl report: one self-contained HTML page, rendered by headless Chromium
(every image decodes, the screenshot is not blank), whose embedded figures
equal `dtectl stats`; bad input leaves no page behind."""

import json
import os
import re
import shutil
import subprocess

import numpy as np

from dtectl_util import ERROR, USAGE

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "chromium"


def chromium(*args, timeout=120):
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", *args], capture_output=True, text=True,
                          timeout=timeout)


def page_data(path):
    text = open(path).read()
    m = re.search(r'<script type="application/json" id="dte-report-data">(.*?)</script>', text,
                  re.S)
    assert m, "no embedded figures"
    return text, json.loads(m.group(1).replace("<\\/", "</"))


def store_with_policy_anchors(dte, ckpts, steps=7):
    dte.ok("import", ckpts.dir(0))
    for step in range(1, steps):
        dte.ok("commit", ckpts.dir(step), "--anchor-every", "3")


def test_report_renders_and_its_figures_are_the_stats(dte, ckpts, tmp_path):
    store_with_policy_anchors(dte, ckpts)
    out = str(tmp_path / "run.html")
    r = dte.run("report", "-o", out)
    assert r.returncode == 0, r.stderr
    text, data = page_data(out)
    # Self-contained: no external reference to fetch.
    assert not re.search(r'(src|href)="(https?:|//)', text)
    assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', text)) == 4

    # Headless Chromium: every image decodes (the page counts them on load),
    # and the screenshot shows them.
    dom = chromium("--dump-dom", "file://" + out)
    assert dom.returncode == 0, dom.stderr
    assert re.search(r'<body[^>]*data-loaded="4"', dom.stdout), dom.stdout[:2000]
    shot = str(tmp_path / "shot.png")
    r = chromium("--window-size=1200,2400", "--screenshot=" + shot, "file://" + out)
    assert r.returncode == 0 and os.path.getsize(shot) > 20000, r.stderr
    import matplotlib.image
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (2400, 1200)
    # Plots, not a blank page: many distinct colours, in every quarter.
    for quarter in np.array_split(pixels, 4):
        assert len(np.unique(quarter.reshape(-1, pixels.shape[2])[:, :3], axis=0)) > 50

    # The figures are those of dtectl stats.
    by_version = json.loads(dte.ok("stats", "--json", "--by", "version").stdout)
    per = data["versions"]
    assert per["version"] == [r["version"] for r in by_version] == list(range(7))
    assert per["stored_as"] == [r["kind"] for r in by_version]
    assert per["stored_as"] == ["anchor", "delta", "delta", "full", "delta", "delta", "full"]
    for key in ("changed", "dense_bytes", "elements"):
        assert per[key] == [r[key] for r in by_version], key
    log = dte.log()
    assert per["stored_bytes"] == [r["version_stored_bytes"] for r in by_version] == [
        v["stored_bytes"] for v in log]
    # A policy anchor's full copy is in what the version stored.
    assert per["stored_bytes"][3] > 10 * per["stored_bytes"][2]
    assert per["changed_fraction"] == [r["changed_fraction"] for r in by_version]
    cells = json.loads(dte.ok("stats", "--json", "--by", "layer-kind").stdout)
    hm = data["heatmap"]
    assert hm["fold"] == 1 and hm["first_version"] == list(range(7))
    groups = [r["group"] for r in cells if r["version"] == 1]
    assert hm["groups"] == groups
    for r in cells:
        got = hm["changed_fraction"][groups.index(r["group"])][r["version"]]
        if r["kind"] == "anchor":
            assert got is None
        else:
            assert got == r["changed"] / r["elements"], r

    # --versions selects; the page is replaced whole.
    r = dte.run("report", "--versions", "2..4", "-o", out)
    assert r.returncode == 0, r.stderr
    assert page_data(out)[1]["versions"]["version"] == [2, 3, 4]


def test_report_folds_many_versions_into_bounded_columns(dte, ckpts, tmp_path, monkeypatch):
    store_with_policy_anchors(dte, ckpts, steps=5)
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "sync", "python",
                                    "dte"))
    import report
    monkeypatch.setattr(report, "MAX_COLUMNS", 2)
    data = report.collect(dte.argv("stats")[0], ["--store", str(dte.store), "--cache-dir",
                                                  str(dte.cache)], None)
    hm = data["heatmap"]
    assert hm["fold"] == 3 and hm["first_version"] == [0, 3]
    cells = json.loads(dte.ok("stats", "--json", "--by", "layer-kind").stdout)
    for g, row in zip(hm["groups"], hm["changed_fraction"]):
        mine = [r for r in cells if r["group"] == g and r["kind"] != "anchor"]
        for col, versions in enumerate(([1, 2], [3, 4])):
            part = [r for r in mine if r["version"] in versions]
            assert row[col] == sum(r["changed"] for r in part) / sum(r["elements"] for r in part)


def test_report_bad_input_leaves_no_page(dte, ckpts, tmp_path):
    out = tmp_path / "run.html"
    r = dte.run("report", "-o", str(out))
    assert r.returncode != 0 and "does not exist" in r.stderr and not out.exists()
    store_with_policy_anchors(dte, ckpts, steps=3)
    out.write_text("an older page\n")
    for args, needle in ((["--versions", "1..9"], "v00000009 is not a version"),
                         (["--versions", "2..1"], "version range")):
        r = dte.run("report", *args, "-o", str(out))
        assert r.returncode != 0 and needle in r.stderr, (args, r.stderr)
        assert out.read_text() == "an older page\n"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("run.html.")] == []
    r = dte.run("report")
    assert r.returncode == USAGE
    r = dte.run("report", "-o", str(tmp_path / "no-such-dir" / "run.html"))
    assert r.returncode == ERROR and "Traceback" not in r.stderr, r.stderr
    assert "writing " + str(tmp_path / "no-such-dir" / "run.html") in r.stderr, r.stderr
    assert not (tmp_path / "no-such-dir").exists()
