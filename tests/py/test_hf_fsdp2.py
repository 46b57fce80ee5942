"""dte.hf.PublishCallback over real FSDP2 (torch's fully_shard, two CPU
processes over gloo; hf_fsdp2_worker.py raises the callback's events from
its own loop, as the Trainer does, since accelerate trains FSDP arguments
as DDP on a CPU-only machine: test_hf_callback.py). Every parameter is a
DTensor holding rows of the tensor. With torch's fused AdamW every rank
publishes its own rows through the distributed publisher (path "adamw");
with SGD every rank gathers each tensor in turn (full_tensor()) and rank 0
publishes the weights (path "weights"). After every step the store's
latest version is the step and equals the gathered model's bfloat16()
weights bit for bit, on both ranks."""

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path, optim):
    store, port = str(tmp_path / "store"), free_port()
    worker = os.path.join(HERE, "hf_fsdp2_worker.py")
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, worker, store, str(tmp_path), optim],
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=180)[0].decode(errors="replace") for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return [json.load(open(tmp_path / ("rank-%d.json" % r))) for r in (0, 1)]


@pytest.mark.parametrize("optim,path", [("adamw", "adamw"), ("sgd", "weights")])
def test_every_step_of_an_fsdp2_model_is_a_version_equal_to_its_weights(tmp_path, optim,
                                                                        path):
    reports = run_ranks(tmp_path, optim)
    for r in reports:
        assert (r["world"], r["backend"], r["params"]) == (2, "gloo", ["DTensor"])
        assert r["path"] == path
        assert r["seen"] == [[1, []], [2, []], [3, []]]
    if path == "adamw":  # every rank publishes its rows
        for r in reports:
            assert [v for v, _, _ in r["results"]] == [1, 2, 3]
    else:  # rank 0 publishes what every rank gathered
        assert [v for v, _, _ in reports[0]["results"]] == [1, 2, 3]
        assert reports[1]["results"] == []
    assert all(p == path for _, p, _ in reports[0]["results"])
    assert sum(c for _, _, c in reports[0]["results"]) > 0
