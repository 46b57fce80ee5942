"""`dtectl stats --fp8` against an independent computation: every version of a
small committed store quantized here by the reference quantizer of the tests
(tests/py/fp8_ref.py: numpy + ml_dtypes), the changed BF16 elements, FP8
bytes and scales counted from those arrays, under both scale rules.
"""

import json
import re

import numpy as np
import pytest

import ckpt_util
from dtectl_util import ERROR, USAGE
from fp8_ref import F32, bf16_values, ref_quantize

RULES = ("plain", "pow2")


def quantized(ckpt, block=128):
    """The tensors the default FP8 policy quantizes with N x N blocks, in the
    checkpoint: the 2-D BF16 linear weights (not embeddings, lm_head,
    norms) whose rows and columns are multiples of the block."""
    return {n: a for n, (d, a) in ckpt.tensors.items()
            if d == "BF16" and a.ndim == 2 and n.endswith("_proj.weight")
            and a.shape[0] % block == 0 and a.shape[1] % block == 0}


def reference(parent, child, block):
    """{tensor: counts} as the stats rows give them, from the arrays."""
    out = {}
    for name, a in quantized(child, block).items():
        p = quantized(parent, block)[name]
        row = {"elements": a.size, "bf16_changed": int(np.count_nonzero(p != a)),
               "blocks": -(-a.shape[0] // block) * -(-a.shape[1] // block)}
        for rule in RULES:
            qp, sp = ref_quantize(p, block, block, rule)
            qc, sc = ref_quantize(a, block, block, rule)
            row[rule] = {"bytes_changed": int(np.count_nonzero(qp != qc)),
                         "scales_changed": int(np.count_nonzero(
                             sp.view(np.uint32) != sc.view(np.uint32)))}
        out[name] = row
    return out


def stats(dte, *args):
    return json.loads(dte.ok("stats", "--fp8", "--json", *args).stdout)


def check_row(row, want):
    assert row["elements"] == want["elements"] and row["blocks"] == want["blocks"], row
    assert row["bf16_changed"] == want["bf16_changed"], row["group"]
    assert row["bf16_step_bytes"] == 2 * want["bf16_changed"]
    for rule in RULES:
        got, w = row[rule], want[rule]
        assert (got["bytes_changed"], got["scales_changed"]) == (
            w["bytes_changed"], w["scales_changed"]), (row["group"], rule)
        assert got["step_bytes"] == w["bytes_changed"] + 4 * w["scales_changed"]
        if want["bf16_changed"]:
            assert got["ratio"] == w["bytes_changed"] / want["bf16_changed"]


def test_counts_equal_the_reference_quantizer_per_tensor_and_version(dte, ckpts):
    # Version 2 is a policy anchor (a delta with a full table): counted
    # against its parent like any delta.
    dte.ok("import", ckpts.dir(0))
    for step in range(1, 4):
        dte.ok("commit", ckpts.dir(step), "--anchor-every", "2")
    doc = stats(dte)
    assert (doc["block_rows"], doc["block_cols"]) == (128, 128)
    rows = doc["rows"]
    assert rows[0] == {"version": 0, "kind": "anchor", "group": None}
    want_names = list(quantized(ckpts.state(0)))
    # The MLP (688 wide) is not whole 128 x 128 blocks: not counted, as the
    # FP8 view of that block keeps it in BF16; attention (256, 128) is.
    assert want_names and not [n for n in want_names if ".mlp." in n]
    total = {"bf16_changed": 0, "plain": 0, "pow2": 0}
    for step in range(1, 4):
        want = reference(ckpts.state(step - 1), ckpts.state(step), 128)
        mine = [r for r in rows if r["version"] == step]
        assert sorted(r["group"] for r in mine) == sorted(want_names)
        assert all(r["kind"] == ("full" if step == 2 else "delta") for r in mine)
        for r in mine:
            check_row(r, want[r["group"]])
        total["bf16_changed"] += sum(w["bf16_changed"] for w in want.values())
        for rule in RULES:
            total[rule] += sum(w[rule]["bytes_changed"] for w in want.values())
    # Real changes, and fewer FP8 bytes than BF16 elements.
    assert 0 < total["plain"] < total["bf16_changed"]
    t = doc["total"]
    assert (t["versions"], t["anchors"]) == (3, 1)
    assert t["bf16_changed"] == total["bf16_changed"]
    assert (t["plain"]["bytes_changed"], t["pow2"]["bytes_changed"]) == (total["plain"],
                                                                         total["pow2"])
    # --by version: one row per version, the sums of its tensors.
    by_version = stats(dte, "--by", "version", "--versions", "2..3")
    assert [r["version"] for r in by_version["rows"]] == [2, 3]
    for r in by_version["rows"]:
        tensors = [x for x in rows if x["version"] == r["version"]]
        assert r["group"] == "all" and r["tensors"] == len(tensors)
        for rule in RULES:
            assert r[rule]["bytes_changed"] == sum(x[rule]["bytes_changed"] for x in tensors)


def test_other_block_sizes_csv_and_table(dte, ckpts):
    for step in range(3):
        dte.ok("import" if step == 0 else "commit", ckpts.dir(step))
    want = reference(ckpts.state(1), ckpts.state(2), 64)
    doc = stats(dte, "--fp8-block", "64", "--versions", "2")
    assert (doc["block_rows"], len(doc["rows"])) == (64, len(want))
    for r in doc["rows"]:
        check_row(r, want[r["group"]])
    # 16 x 16 blocks divide the MLP too (688 = 43 x 16): every projection.
    want16 = reference(ckpts.state(1), ckpts.state(2), 16)
    doc = stats(dte, "--fp8-block", "16", "--versions", "2")
    assert sorted(r["group"] for r in doc["rows"]) == sorted(want16)
    assert len(want16) == 2 * 7
    for r in doc["rows"]:
        check_row(r, want16[r["group"]])
    csv = dte.ok("stats", "--fp8", "--csv", "--fp8-block", "64", "--versions", "1..2").stdout
    lines = [line.split(",") for line in csv.strip().split("\n")]
    head = lines[0]
    assert head[:3] == ["version", "kind", "group"] and "pow2_scales_changed" in head
    assert lines[1][:2] == ["1", "delta"] and lines[-1][0] == "total"
    by_name = {line[2]: dict(zip(head, line)) for line in lines[1:-1] if line[0] == "2"}
    for name, w in want.items():
        assert int(by_name[name]["pow2_bytes_changed"]) == w["pow2"]["bytes_changed"]
        assert int(by_name[name]["plain_scales_changed"]) == w["plain"]["scales_changed"]
    table = dte.ok("stats", "--fp8", "--by", "version").stdout.strip().split("\n")
    assert table[0].split()[:4] == ["VERSION", "KIND", "GROUP", "ELEMENTS"]
    assert table[1].split()[:2] == ["v00000000", "anchor"]
    assert table[2].split()[:3] == ["v00000001", "delta", "all"]
    assert table[-1].split()[0] == "total"


def test_bad_input_names_what_is_wrong(dte, ckpts, tmp_path):
    for step in range(2):
        dte.ok("import" if step == 0 else "commit", ckpts.dir(step))
    r = dte.run("stats", "--fp8", "--versions", "1..5")
    assert r.returncode == ERROR and "v00000005 is not a version" in r.stderr, r.stderr
    for bad in (["--by", "layer"], ["--fp8-block", "0"]):
        r = dte.run("stats", "--fp8", *bad)
        assert r.returncode == USAGE and r.stdout == "", (bad, r.stderr)
    # A block no tensor is a whole number of (its grid, ceil(rows / block),
    # would wrap 64 bits): nothing is quantized, so nothing is counted.
    r = dte.run("stats", "--fp8", "--json", "--fp8-block", str(2**64 - 1), "--versions", "1")
    assert r.returncode == 0, (r.returncode, r.stderr)
    doc = json.loads(r.stdout)
    assert [x for x in doc["rows"] if x["version"] == 1] == [] and doc["total"]["tensors"] == 0
    # A NaN in a quantized tensor: the quantizer's refusal, naming tensor
    # and block; the rows before it print, the JSON document is closed.
    bad = ckpts.state(1).clone()
    name = "model.layers.1.self_attn.o_proj.weight"  # 256 x 256
    dtype, arr = bad.tensors[name]
    arr = arr.copy()
    arr[130, 200] = 0x7FC0
    bad.tensors[name] = (dtype, arr)
    assert np.isnan(bf16_values(arr[130:131, 200:201]).astype(F32)).all()
    dte.ok("commit", ckpt_util.write_checkpoint(bad, str(tmp_path / "nan")))
    r = dte.run("stats", "--fp8", "--json", "--versions", "1..2")
    assert r.returncode == ERROR, r.stderr
    assert f"tensor '{name}'" in r.stderr and "FP8 block (1, 1)" in r.stderr, r.stderr
    assert "v00000002" in r.stderr, r.stderr
    doc = json.loads(r.stdout)
    assert "total" not in doc
    assert len([x for x in doc["rows"] if x["version"] == 1]) == len(quantized(bad))
    assert name not in [x["group"] for x in doc["rows"] if x["version"] == 2]


def test_report_plots_the_fp8_change_set_of_the_stats(dte, ckpts, tmp_path):
    for step in range(4):
        dte.ok("import" if step == 0 else "commit", ckpts.dir(step))
    out = str(tmp_path / "run.html")
    r = dte.run("report", "--fp8", "--versions", "0..3", "-o", out)
    assert r.returncode == 0, r.stderr
    text = open(out).read()
    assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', text)) == 5
    assert '<img id="fp8"' in text and "FP8 (128 x 128 blocks)" in text
    m = re.search(r'<script type="application/json" id="dte-report-data">(.*?)</script>', text,
                  re.S)
    fp8 = json.loads(m.group(1).replace("<\\/", "</"))["fp8"]
    rows = stats(dte, "--by", "version")["rows"]
    assert fp8["anchors"] == [0] and fp8["version"] == [1, 2, 3]
    deltas = rows[1:]
    assert fp8["bf16_changed"] == [x["bf16_changed"] for x in deltas]
    for rule in RULES:
        assert fp8[rule]["bytes_changed"] == [x[rule]["bytes_changed"] for x in deltas]
        assert fp8[rule]["scales_changed"] == [x[rule]["scales_changed"] for x in deltas]
        assert fp8[rule]["ratio"] == pytest.approx([x[rule]["ratio"] for x in deltas])
        assert fp8[rule]["step_ratio"] == pytest.approx([x[rule]["step_ratio"] for x in deltas])
    # Without --fp8 the page has no FP8 figures.
    r = dte.run("report", "-o", str(tmp_path / "plain.html"))
    assert r.returncode == 0 and '<img id="fp8"' not in open(tmp_path / "plain.html").read()
