"""Only the job speaks on its ports (docs/push.md, "Security"): a push
group with a job secret serves receivers that hold it, end to end, from a
server on every interface; strangers (a connection that skips the
handshake, a receiver with another secret or none) are refused, logged
with their address and counted before anything is sent to them, while the
job's receivers keep being pushed to. Without a secret a push group listens
on loopback only; a secret file others may read is refused, for the push
group and for the TCP transport's rendezvous."""

import os
import socket
import struct
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import push_util  # noqa: E402
from wait_util import wait_for  # noqa: E402

import dte  # noqa: E402

SECRET = "test-push-auth-secret-0123456789"


@pytest.fixture(autouse=True)
def no_secret_in_environment(monkeypatch):
    monkeypatch.delenv("DTE_JOB_SECRET", raising=False)
    monkeypatch.delenv("DTE_JOB_SECRET_FILE", raising=False)


def adamw_step(model, step):
    opt = torch.optim.AdamW(model.parameters(), lr=5e-6, fused=True)
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    return {n: {"param": p, "exp_avg": opt.state[p]["exp_avg"],
                "exp_avg_sq": opt.state[p]["exp_avg_sq"], "step": opt.state[p]["step"]}
            for n, p in model.named().items()}


def test_strangers_are_refused_and_logged_while_the_jobs_receivers_hold_every_version(tmp_path):
    model = push_util.TinyGqaLM(seed=5)
    push_util.save_checkpoint(tmp_path / "v0", model)
    store = str(tmp_path / "store")
    shapes = {n: tuple(p.shape) for n, p in model.named().items()}
    with dte.PushGroup("0.0.0.0:0", timeout=5.0, secret=SECRET) as group, \
            dte.Publisher(store=store, push=group) as pub:
        assert pub.import_checkpoint(str(tmp_path / "v0")) == 0
        port = group.port
        v0 = push_util.read_version(dte, store, 0, shapes)
        tensors = push_util.local_state(v0, 1, 0, False)
        member = dte.PushReceiver("127.0.0.1:%d" % port, tensors, version=0, secret=SECRET)
        # A peer that speaks the push protocol without the handshake: the
        # server closes it without a byte.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            body = b'{"rank":0,"tp":1,"tensors":[]}'
            s.sendall(struct.pack("<IIQ", 0x48535044, 1, len(body)) + body)
            assert s.recv(4096) == b""
        zeros = push_util.local_state(push_util.shapes_and_dtypes(model), 1, 0, False)
        others = [dte.PushReceiver("127.0.0.1:%d" % port, zeros, secret="another-secret-012345"),
                  dte.PushReceiver("127.0.0.1:%d" % port, zeros)]
        try:
            group.wait_for_receivers(timeout=30, version=0)
            wait_for(lambda: group.status(events=False).refused >= 3, 30, "3 refusals")
            # The server may count the refusal before the receiver notes why.
            wait_for(lambda: "did not prove it knows the job secret" in others[0].status().error,
                     30, "the receiver to note the server's failed proof")
            st = group.status()
            assert st.authenticated is True and len(st.receivers) == 1, st
            refused = [e for e in st.events if " refused: " in e]
            assert all("from 127.0.0.1:" in e for e in refused), refused
            assert any("no authentication handshake" in e for e in refused), refused
            r = pub.publish_adamw(step=1, params=adamw_step(model, 1), lr=5e-6)
            assert r.push.pushed == 1 and r.push.dropped == [], r.push
            member.wait_for(1, timeout=30)
            want = push_util.local_state(push_util.read_version(dte, store, 1, shapes), 1, 0,
                                         False)
            for n, t in want.items():
                assert torch.equal(tensors[n].view(torch.int16), t.view(torch.int16)), n
            for o in others:
                assert o.status().version is None and o.status().pushes == 0
        finally:
            member.close()
            for o in others:
                o.close()


def test_without_a_secret_a_push_group_listens_on_loopback_only():
    with pytest.raises(dte.InvalidArgument) as e:
        dte.PushGroup("0.0.0.0:0").port
    assert e.value.code == 1
    assert "0.0.0.0:0, which is not a loopback address" in str(e.value)
    assert "DTE_JOB_SECRET" in str(e.value)
    with dte.PushGroup("127.0.0.1:0") as group:
        assert group.status().authenticated is False
    with pytest.raises(ValueError):
        dte.PushGroup("127.0.0.1:0", secret=b"with\0nul")


def test_a_secret_from_the_environment_must_be_a_private_file(tmp_path, monkeypatch):
    path = tmp_path / "job-secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o644)
    monkeypatch.setenv("DTE_JOB_SECRET_FILE", str(path))
    with pytest.raises(dte.PermissionDenied) as e:
        dte.PushGroup("0.0.0.0:0").port
    assert e.value.code == 9 and "%s has mode 0644" % path in str(e.value), str(e.value)
    path.chmod(0o600)
    with dte.PushGroup("0.0.0.0:0") as group:
        assert group.status().authenticated is True


def test_a_rendezvous_secret_others_may_read_is_refused(tmp_path):
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    (rendezvous / "secret").write_text(SECRET)
    (rendezvous / "secret").chmod(0o640)
    with pytest.raises(PermissionError) as e:
        dte.Publisher(store=str(tmp_path / "store"), rank=0, world_size=1,
                      rendezvous=str(rendezvous), timeout=5.0)
    assert isinstance(e.value, dte.PermissionDenied) and e.value.code == 9
    assert "%s has mode 0640" % (rendezvous / "secret") in str(e.value), str(e.value)
    # A fresh directory: rank 0 makes the secret, private.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with dte.Publisher(store=str(tmp_path / "store"), rank=0, world_size=1,
                       rendezvous=str(fresh), timeout=5.0):
        assert (fresh / "secret").stat().st_mode & 0o777 == 0o600
