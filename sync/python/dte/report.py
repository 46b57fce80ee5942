"""A run's update report: one self-contained HTML page with plots of how the
policy moves, from `dtectl stats` (manifests and block tables only).

    python3 -m dte.report --store STORE [--versions A..B] [--fp8] -o run.html
    dtectl report --store STORE [--versions A..B] [--fp8] -o run.html   (runs this)

Plots (matplotlib, embedded as PNG): the changed fraction per version; a
heatmap of the changed fraction per layer and kind of tensor across
versions (anchors, which count every element as changed, are marked rather
than plotted in both); stored bytes per version against the dense size; how the
chain is stored (anchors, policy anchors with a full table, deltas); and
with --fp8, the FP8 bytes changed per BF16 element changed and the changed
scales per version under both scale rules (`dtectl stats --fp8`). The
page also embeds the plotted figures as JSON (`<script id="dte-report-data">`).
Memory: the per-version totals and the heatmap's cells (layers x kinds per
version, folded into at most MAX_COLUMNS columns), read from dtectl's CSV
a line at a time.
"""

import argparse
import base64
import csv
import html
import io
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

MAX_COLUMNS = 600  # heatmap columns: versions are averaged into at most this many


def _stats(dtectl: str, common: List[str], by: str, versions: Optional[str],
           extra: Sequence[str] = ()) -> Iterator[Dict[str, str]]:
    """Rows of `dtectl stats --csv --by BY [EXTRA]`, a line at a time."""
    argv = [dtectl, "stats", "--csv", "--by", by, *extra] + common
    if versions:
        argv += ["--versions", versions]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    yield from csv.DictReader(proc.stdout)
    err = proc.stderr.read()
    if proc.wait() != 0:
        raise SystemExit(err.strip() or "dtectl stats failed with exit %d" % proc.returncode)


def collect(dtectl: str, common: List[str], versions: Optional[str]) -> Dict[str, Any]:
    """The report's figures: per-version totals and the layer-kind heatmap."""
    per: Dict[str, List[Any]] = {"version": [], "stored_as": [], "elements": [], "changed": [],
           "changed_fraction": [], "stored_bytes": [], "dense_bytes": []}
    for r in _stats(dtectl, common, "version", versions):
        per["version"].append(int(r["version"]))
        per["stored_as"].append(r["kind"])
        for k in ("elements", "changed", "dense_bytes"):
            per[k].append(int(r[k]))
        # Everything the version added: a policy anchor's full table too.
        per["stored_bytes"].append(int(r["version_stored_bytes"]))
        elements = per["elements"][-1]
        per["changed_fraction"].append(per["changed"][-1] / elements if elements else 0.0)
    if not per["version"]:
        raise SystemExit("dtectl report: no versions selected")
    # Heatmap columns: consecutive versions folded together (element-weighted).
    n = len(per["version"])
    fold = max(1, -(-n // MAX_COLUMNS))
    column = {v: i // fold for i, v in enumerate(per["version"])}
    columns = -(-n // fold)
    cells: Dict[str, List[List[int]]] = {}  # group -> [changed, elements] per column
    for r in _stats(dtectl, common, "layer-kind", versions):
        acc = cells.get(r["group"])
        if acc is None:
            acc = cells[r["group"]] = [[0, 0] for _ in range(columns)]
        if r["kind"] == "anchor":
            continue  # everything "changed": not a step of the run
        c = acc[column[int(r["version"])]]
        c[0] += int(r["changed"])
        c[1] += int(r["elements"])

    def order(g: str) -> Tuple[bool, int, str]:
        layer, kind = g.split("/", 1)
        return (layer == "-", int(layer) if layer != "-" else 0, kind)
    groups = sorted(cells, key=order)
    heat = [[(c / e if e else None) for c, e in cells[g]] for g in groups]
    first = [per["version"][i * fold] for i in range(columns)]
    return {"versions": per, "heatmap": {"groups": groups, "fold": fold,
                                         "first_version": first, "changed_fraction": heat}}


def collect_fp8(dtectl: str, common: List[str], versions: Optional[str],
                block: int) -> Dict[str, Any]:
    """Per delta version, what its FP8 form changed (`dtectl stats --fp8`):
    the BF16 elements, and per scale rule the FP8 bytes and scales, the
    ratio bytes / elements and the receiver step bytes FP8 / BF16."""
    fp8: Dict[str, Any] = {"block": block, "anchors": [], "version": [], "bf16_changed": [],
                           "blocks": []}
    for rule in ("plain", "pow2"):
        fp8[rule] = {"bytes_changed": [], "scales_changed": [], "ratio": [], "step_ratio": []}
    for r in _stats(dtectl, common, "version", versions, ["--fp8", "--fp8-block", str(block)]):
        if r["version"] == "total":
            continue
        if r["kind"] == "anchor":
            fp8["anchors"].append(int(r["version"]))
            continue
        fp8["version"].append(int(r["version"]))
        bf16, blocks = int(r["bf16_changed"]), int(r["blocks"])
        fp8["bf16_changed"].append(bf16)
        fp8["blocks"].append(blocks)
        for rule in ("plain", "pow2"):
            nbytes, scales = int(r[rule + "_bytes_changed"]), int(r[rule + "_scales_changed"])
            fp8[rule]["bytes_changed"].append(nbytes)
            fp8[rule]["scales_changed"].append(scales)
            fp8[rule]["ratio"].append(nbytes / bf16 if bf16 else 0.0)
            fp8[rule]["step_ratio"].append((nbytes + 4 * scales) / (2 * bf16) if bf16 else 0.0)
    return fp8


def fp8_plot(fp8: Dict[str, Any], plt: Any, np: Any) -> Tuple[str, str, str]:
    """FP8 bytes / BF16 elements changed, and changed scales, per version."""
    v = np.array(fp8["version"])
    blocks = np.maximum(np.array(fp8["blocks"]), 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
    marker = "." if len(v) < 60 else None
    for rule, color in (("plain", "tab:blue"), ("pow2", "tab:orange")):
        top.plot(v, fp8[rule]["ratio"], lw=1, marker=marker, color=color, label=rule)
        bottom.plot(v, 100 * np.array(fp8[rule]["scales_changed"]) / blocks, lw=1,
                    marker=marker, color=color, label=rule)
    top.set_ylabel("FP8 bytes / BF16 elements")
    top.set_title("FP8 change set per version (%d x %d blocks)" % (fp8["block"], fp8["block"]))
    bottom.set_ylabel("changed scales (%)")
    bottom.set_xlabel("version")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.legend()
    image = ("fp8", "FP8 change set per version", _png(fig))
    plt.close(fig)
    return image


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def plots(data: Dict[str, Any]) -> List[Tuple[str, str, str]]:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("dtectl report: needs matplotlib in %s (Debian: apt-get install "
                         "python3-matplotlib; or set DTE_PYTHON to an interpreter that has it)"
                         % sys.executable)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    per = data["versions"]
    v = np.array(per["version"])
    out = []

    # Anchors (stored whole, no parent) count every element as changed: they
    # are marked, not plotted as steps.
    steps = np.array([k != "anchor" for k in per["stored_as"]])
    fig, ax = plt.subplots(figsize=(10, 3.2))
    ax.plot(v[steps], 100 * np.array(per["changed_fraction"])[steps], lw=1, marker="." if
            steps.sum() < 60 else None)
    for x in v[~steps]:
        ax.axvline(x, color="tab:red", lw=0.8, alpha=0.5)
    ax.set_xlabel("version (red: anchors)" if (~steps).any() else "version")
    ax.set_ylabel("changed elements (%)")
    ax.set_title("Changed fraction per version")
    ax.grid(alpha=0.3)
    out.append(("changed", "Changed fraction per version", _png(fig)))
    plt.close(fig)

    hm = data["heatmap"]
    rows = len(hm["groups"])
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.16 * rows + 1.2)))
    cells = np.array([[np.nan if x is None else 100 * x for x in row]
                      for row in hm["changed_fraction"]], dtype=float)
    cmap = matplotlib.colormaps["viridis"].copy()
    cmap.set_bad("lightgray")  # anchors only
    img = ax.imshow(np.ma.masked_invalid(cells), aspect="auto", interpolation="nearest",
                    cmap=cmap, extent=(-0.5, len(hm["first_version"]) - 0.5, rows - 0.5, -0.5))
    ax.set_yticks(range(rows))
    ax.set_yticklabels(hm["groups"], fontsize=6 if rows > 40 else 8)
    ticks = np.linspace(0, len(hm["first_version"]) - 1, min(10, len(hm["first_version"])))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(hm["first_version"][int(t)]) for t in ticks])
    ax.set_xlabel("version" + (" (columns of %d)" % hm["fold"] if hm["fold"] > 1 else ""))
    ax.set_ylabel("layer / kind")
    ax.set_title("Changed fraction (%) per layer and kind (gray: anchors)")
    fig.colorbar(img, ax=ax)
    out.append(("heatmap", "Changed fraction per layer and kind", _png(fig)))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 3.2))
    ax.plot(v, per["stored_bytes"], lw=1, label="stored")
    ax.plot(v, per["dense_bytes"], lw=1, ls="--", label="dense model")
    ax.set_yscale("log")
    ax.set_xlabel("version")
    ax.set_ylabel("bytes")
    ax.set_title("Stored bytes per version against the dense size")
    ax.legend()
    ax.grid(alpha=0.3)
    out.append(("stored", "Stored bytes per version", _png(fig)))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 2.4))
    colors = {"anchor": "tab:red", "full": "tab:orange", "delta": "tab:blue"}
    for kind, y in (("anchor", 2), ("full", 1), ("delta", 0)):
        xs = [x for x, k in zip(per["version"], per["stored_as"]) if k == kind]
        ax.scatter(xs, [y] * len(xs), s=8, color=colors[kind], marker="|" if kind == "delta" else "o")
    ax.set_yticks([0, 1, 2])
    ax.set_yticklabels(["delta", "policy anchor", "anchor"])
    ax.set_ylim(-0.6, 2.6)
    ax.set_xlabel("version")
    ax.set_title("How the chain is stored")
    out.append(("chain", "Anchors and deltas", _png(fig)))
    plt.close(fig)
    if data.get("fp8"):
        out.append(fp8_plot(data["fp8"], plt, np))
    return out


def page(data: Dict[str, Any], images: Sequence[Tuple[str, str, str]], title: str) -> str:
    per = data["versions"]
    n = len(per["version"])
    steps = [f for f, k in zip(per["changed_fraction"], per["stored_as"]) if k != "anchor"]
    summary = ("%d versions (%s to %s, %d anchors); mean changed fraction of the others %s; "
               "stored %s in all against %s dense per version" % (
                   n, "v%08d" % per["version"][0], "v%08d" % per["version"][-1],
                   n - len(steps), "%.3f%%" % (100 * sum(steps) / len(steps)) if steps else "-",
                   _human(sum(per["stored_bytes"])), _human(per["dense_bytes"][-1])))
    fp8 = data.get("fp8")
    if fp8 and fp8["version"]:
        summary += ("; FP8 (%d x %d blocks) bytes changed per BF16 element changed, median "
                    "over the steps: %.3f plain, %.3f power-of-two scales" % (
                        fp8["block"], fp8["block"], statistics.median(fp8["plain"]["ratio"]),
                        statistics.median(fp8["pow2"]["ratio"])))
    parts = ["<!DOCTYPE html>", "<html><head><meta charset=\"utf-8\">",
             "<title>%s</title>" % html.escape(title),
             "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}"
             "img{max-width:100%;display:block;margin:1em 0}</style></head>",
             "<body data-images=\"%d\">" % len(images),
             "<h1>%s</h1>" % html.escape(title), "<p>%s</p>" % html.escape(summary)]
    for key, caption, png in images:
        parts.append("<h2>%s</h2>" % html.escape(caption))
        parts.append("<img id=\"%s\" alt=\"%s\" src=\"data:image/png;base64,%s\">" % (
            key, html.escape(caption), png))
    # The figures plotted, for scripts (and the tests).
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    parts.append("<script type=\"application/json\" id=\"dte-report-data\">%s</script>" % blob)
    # Marks, once loaded, how many images decoded (a check for headless
    # browsers: document.body.dataset.loaded).
    parts.append("<script>window.addEventListener('load',function(){var ok=0;"
                 "document.querySelectorAll('img').forEach(function(i){"
                 "if(i.complete&&i.naturalWidth>0)ok++;});"
                 "document.body.setAttribute('data-loaded',String(ok));});</script>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return "%.1f %s" % (n, unit)
        n /= 1024.0
    return "%.1f TiB" % n


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="dtectl report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--versions", help="A..B, A.., ..B or one version (default: all)")
    ap.add_argument("-o", "--out", required=True, help="the HTML file to write")
    ap.add_argument("--dtectl", default=os.environ.get("DTE_DTECTL", "dtectl"))
    ap.add_argument("--cache-dir")
    ap.add_argument("--endpoint")
    ap.add_argument("--title")
    ap.add_argument("--fp8", action="store_true",
                    help="also the FP8 change set per version (dtectl stats --fp8)")
    ap.add_argument("--fp8-block", type=int, default=128, help="FP8 block size (default 128)")
    a = ap.parse_args(argv)
    common = ["--store", a.store, "-q"]
    if a.cache_dir:
        common += ["--cache-dir", a.cache_dir]
    if a.endpoint:
        common += ["--endpoint", a.endpoint]
    data = collect(a.dtectl, common, a.versions)
    if a.fp8:
        data["fp8"] = collect_fp8(a.dtectl, common, a.versions, a.fp8_block)
    text = page(data, plots(data), a.title or "dte: updates of %s" % a.store)
    tmp = a.out + ".tmp-%d" % os.getpid()
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, a.out)  # never a half-written page
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise SystemExit("dtectl report: error: writing %s: %s" % (a.out, e.strerror or e))
    print("report: %d versions -> %s (%d bytes)" % (len(data["versions"]["version"]), a.out,
                                                    len(text)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
