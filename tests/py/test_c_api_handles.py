"""The C ABI refuses handles that are not its own (sync/capi/c_api.h, "Handles").

The reported crash: a distributed dte.Publisher (world_size=1, dte's TCP
transport) whose import_checkpoint passed the distributed publisher's handle
to dte_publisher_import, which read it as a single-process publisher; the
second import after a publish died with SIGSEGV. Each scenario runs in a
child process, so a crash shows as its exit status instead of killing the
test run.

Needs libdte.so ($DTE_BUILD_DIR/sync/libdte.so or $DTE_LIBRARY) and torch.
"""

import os
import subprocess
import sys
import textwrap

SOURCE = os.environ.get("DTE_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(SOURCE, "build"))

PRELUDE = textwrap.dedent("""
    import ctypes, os, sys
    sys.path.insert(0, os.path.join(%r, "sync", "python"))
    os.environ.setdefault("DTE_LIBRARY", os.path.join(%r, "sync", "libdte.so"))
    import torch, safetensors.torch
    import dte
    from dte._lib import lib

    tmp = sys.argv[1]
    rendezvous = os.path.join(tmp, "rdv")  # a fresh directory for dte's TCP transport
    os.makedirs(rendezvous)
    torch.manual_seed(0)
    w = torch.nn.Parameter(0.02 * torch.randn(48, 40))
    init = os.path.join(tmp, "init")
    os.makedirs(init)
    safetensors.torch.save_file({"w": w.detach().to(torch.bfloat16)},
                                os.path.join(init, "model.safetensors"),
                                metadata={"format": "pt"})
    with open(os.path.join(init, "config.json"), "w") as f:
        f.write('{"model_type": "llama"}')
    opt = torch.optim.AdamW([w], lr=1e-3, weight_decay=0.01, fused=True)

    def step(pub, n):
        w.grad = torch.randn_like(w)
        opt.step()
        st = opt.state[w]
        return pub.publish_adamw(step=n, params={"w": (w.detach(), st["exp_avg"],
                                                      st["exp_avg_sq"])},
                                 lr=1e-3, weight_decay=0.01)

    def expect_error(fn, *words):
        try:
            fn()
        except dte.DteError as e:
            assert isinstance(e, dte.InvalidArgument), (type(e), e.code, str(e))
            for word in words:
                assert word in str(e), (word, str(e))
            print("refused:", e)
            return
        raise AssertionError("no error from %%s" %% fn)
""") % (SOURCE, BUILD)


def run_child(tmp_path, body):
    script = tmp_path / "child.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    work = tmp_path / "work"
    work.mkdir()
    p = subprocess.run([sys.executable, str(script), str(work)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, "child exited %d (139: SIGSEGV)\n%s%s" % (
        p.returncode, p.stdout, p.stderr)
    return p.stdout


def test_import_checkpoint_on_a_distributed_publisher_is_refused(tmp_path):
    # The reported sequence: import, one publish, import again.
    out = run_child(tmp_path, """
        store = os.path.join(tmp, "store")
        pub = dte.Publisher(store, rank=0, world_size=1, rendezvous=rendezvous)
        expect_error(lambda: pub.import_checkpoint(init), "distributed",
                     "dte.Publisher(store).import_checkpoint")
        with dte.Publisher(store) as first:
            assert first.import_checkpoint(init) == 0
        assert int(step(pub, 1)) == 1
        expect_error(lambda: pub.import_checkpoint(init), "distributed")
        # The publisher goes on after the refusals.
        assert int(step(pub, 2)) == 2
        assert dte.StoreReader(store).latest() == 2
        pub.close()
        print("ok")
    """)
    assert out.count("refused:") == 2 and out.strip().endswith("ok"), out


def test_the_c_abi_refuses_a_distributed_handle_as_a_publisher(tmp_path):
    # The C ABI's own check, below the Python binding: the distributed
    # publisher's handle given to dte_publisher_import.
    out = run_child(tmp_path, """
        store = os.path.join(tmp, "store")
        with dte.Publisher(store) as first:
            assert first.import_checkpoint(init) == 0
        pub = dte.Publisher(store, rank=0, world_size=1, rendezvous=rendezvous)
        assert int(step(pub, 1)) == 1
        version = ctypes.c_uint64(77)
        for _ in range(2):
            rc = lib.dte_publisher_import(pub._h, init.encode(), ctypes.byref(version))
            msg = lib.dte_last_error().decode()
            assert rc == 1 and version.value == 77, (rc, msg)
            assert msg.startswith("dte_publisher_import: expected a dte_publisher handle, got a "
                                  "dte_dist_publisher"), msg
        h = pub._h
        pub.close()
        # Closed: a call and a second close are refused, not a double free.
        rc = lib.dte_dist_publisher_set_join_budget(h, 0.5)
        assert rc == 1 and "closed already" in lib.dte_last_error().decode()
        rc = lib.dte_dist_publisher_close(h)
        assert rc == 1 and "closed already" in lib.dte_last_error().decode()
        # A closed Python object says so through the same check.
        expect_error(lambda: pub.metrics_text(), "dte_dist_publisher_metrics_text", "NULL")
        print("ok")
    """)
    assert out.strip().endswith("ok"), out
