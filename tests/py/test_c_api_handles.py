"""The C ABI refuses handles that are not its own (sync/capi/c_api.h, "Handles").

The reported crash (C API 9, which had two publisher handles): a
distributed dte.Publisher (world_size=1, dte's TCP transport) whose
import_checkpoint passed the distributed publisher's handle to
dte_publisher_import, which read it as a single-process publisher; the
second import after a publish died with SIGSEGV. There is one publisher
handle now: the sequence imports, and other handles are refused. Each scenario runs in a
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


def test_import_checkpoint_on_a_world_of_one_with_a_transport_works(tmp_path):
    # The reported sequence: import, one publish, import again, on the
    # publisher that crashed (world_size=1, dte's TCP transport), which is
    # now the one Publisher type: a world of one imports.
    out = run_child(tmp_path, """
        store = os.path.join(tmp, "store")
        pub = dte.Publisher(store, rank=0, world_size=1, rendezvous=rendezvous)
        assert pub.import_checkpoint(init) == 0
        assert int(step(pub, 1)) == 1
        assert pub.import_checkpoint(init) == 2
        # The publisher goes on after the imports: the store holds the
        # imported weights as latest, and the next step follows them.
        w.data.copy_(safetensors.torch.load_file(os.path.join(init, "model.safetensors"))["w"])
        opt.state.clear()
        assert int(step(pub, 1)) == 3
        assert dte.StoreReader(store).latest() == 3
        pub.close()
        print("ok")
    """)
    assert out.strip().endswith("ok"), out


def test_import_checkpoint_on_a_rank_of_several_is_refused(tmp_path):
    out = run_child(tmp_path, """
        store = os.path.join(tmp, "store")
        with dte.Publisher(store) as first:
            assert first.import_checkpoint(init) == 0
        pub = dte.Publisher(store, rank=1, world_size=2, job="imports")
        for _ in range(2):
            expect_error(lambda: pub.import_checkpoint(init), "world of one", "rank 1 of 2",
                         "dtectl import")
        assert dte.StoreReader(store).latest() == 0
        pub.close()
        print("ok")
    """)
    assert out.count("refused:") == 2 and out.strip().endswith("ok"), out


def test_the_c_abi_refuses_a_handle_of_another_kind_as_a_publisher(tmp_path):
    # The C ABI's own check, below the Python binding: the publisher's TCP
    # transport's handle given to dte_publisher_import.
    out = run_child(tmp_path, """
        store = os.path.join(tmp, "store")
        with dte.Publisher(store) as first:
            assert first.import_checkpoint(init) == 0
        pub = dte.Publisher(store, rank=0, world_size=1, rendezvous=rendezvous)
        assert int(step(pub, 1)) == 1
        version = ctypes.c_uint64(77)
        for _ in range(2):
            rc = lib.dte_publisher_import(pub._transport, init.encode(), ctypes.byref(version))
            msg = lib.dte_last_error().decode()
            assert rc == 1 and version.value == 77, (rc, msg)
            assert msg.startswith("dte_publisher_import: expected a dte_publisher handle, got a "
                                  "dte_transport"), msg
        h = pub._h
        pub.close()
        # Closed: a call and a second close are refused, not a double free.
        rc = lib.dte_publisher_set_join_budget(h, 0.5)
        assert rc == 1 and "closed already" in lib.dte_last_error().decode()
        rc = lib.dte_publisher_close(h)
        assert rc == 1 and "closed already" in lib.dte_last_error().decode()
        # A closed Python object says so through the same check.
        expect_error(lambda: pub.metrics_text(), "dte_publisher_metrics_text", "NULL")
        print("ok")
    """)
    assert out.strip().endswith("ok"), out
