#!/opt/dte/venv/bin/python
"""One RL step of a Qwen3-8B-shaped model, from trainer state on a device to
an inference receiver's weights in another process on the same device,
against sending everything (docs/benchmarks.md, "From trainer state to
receiver weights on one GPU").

The trainer (this process) holds FP32 master weights and AdamW moments on
--device (cuda, or cpu for the test suite's small run) and steps them with
torch.optim.AdamW at an RL learning rate (--lr, random gradients; about 1-2%
of BF16 elements change per step). Version 0 is imported into a local store;
every step is then published by dte's distributed publisher (one rank: the
one that finds changes on the device, docs/engine.md) with a push group, and
a receiver process holding the weights in vLLM's fused TP 1 layout
(qkv_proj, gate_up_proj) takes the pushed changes in place (docs/push.md).

Per measured step it reports, each timed on its own:
  detect    the publisher's detection (on CUDA: the fused AdamW inversion
            and change kernel, and the copy of the kept entries to the host)
  encode    encoding the changed tensors (delta records, hashes)
  commit    the version's commit to the store
  pack      packing the push for the receiver
  deliver   from the push's start until the receiver holds the version
            (its pushes applied, its clock: same host)
  e2e       from publish_adamw's call until the receiver holds the version
and, with --live (a dtefs mount of the store; skipped where FUSE is not
usable, which the report says), further steps delivered by live apply
instead: the daemon scatters each version's changes into the receiver's
registered buffers (host shared memory on the CPU, CUDA IPC on a GPU).

Baselines in the same run, into the same receiver buffers: a full BF16 copy
of every tensor (CUDA IPC: the receiver's tensors opened in this process,
device-to-device copies) and a full cast + copy from the FP32 masters.
After every delivery the receiver's tensors are compared with the trainer's
BF16 weights on the device (torch.equal): the run fails on any difference.
The cross-node case is extrapolated from the measured bytes at --link-gbps
(400 Gb/s): arithmetic, not a measurement.

Usage: /opt/dte/venv/bin/python tools/bench/gpu_sync.py [--device cuda|cpu]
       [--model qwen3-8b|tiny] [--layers N|auto] [--steps 3] [--warmup 1]
       [--lr 5e-7] [--live] [--work DIR] [--json OUT]
"""

import json
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when loaded by path (tests)
import harness as h  # noqa: E402

SOURCE = h.ROOT

# Qwen3-8B's config (its tensor shapes; untied head, q/k norms).
QWEN3_8B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu"}
# The same architecture, small enough for the test suite on a CPU.
TINY = dict(QWEN3_8B, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=1024)
STATE_BYTES = 12 + 2  # per parameter on the device: FP32 weight and moments, receiver BF16


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def layer_shapes(c, layer):
    h, d = c["hidden_size"], c["head_dim"]
    q, kv, f = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["intermediate_size"]
    p = "model.layers.%d." % layer
    return {p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q), p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,), p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f)}


def shapes(c):
    """Canonical (Hugging Face) tensor name -> shape."""
    out = {"model.embed_tokens.weight": (c["vocab_size"], c["hidden_size"])}
    for layer in range(c["num_hidden_layers"]):
        out.update(layer_shapes(c, layer))
    out["model.norm.weight"] = (c["hidden_size"],)
    out["lm_head.weight"] = (c["vocab_size"], c["hidden_size"])
    return out


def fused_layout(c):
    """vLLM's TP 1 layout: local name -> shape, and canonical name ->
    (local name, first row)."""
    local, where = {}, {}
    for name, shape in shapes(c).items():
        target = name
        for group, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                             (("gate_proj", "up_proj"), "gate_up_proj")):
            for g in group:
                if "." + g + "." in name:
                    target = name.replace(g, fused)
        row = local[target][0] if target in local else 0
        where[name] = (target, row)
        local[target] = (row + shape[0],) + tuple(shape[1:])
    return local, where


def count(c):
    return sum(math.prod(s) for s in shapes(c).values())


def layers_that_fit(c, free_bytes, headroom):
    """The most layers (<= the config's) whose device state fits free_bytes
    less headroom (the largest tensor's gradient and AdamW temporaries, CUDA
    contexts, the detector's workspace)."""
    fixed = count(dict(c, num_hidden_layers=0))
    per_layer = sum(math.prod(s) for s in layer_shapes(c, 0).values())
    layers = int((free_bytes - headroom - STATE_BYTES * fixed) // (STATE_BYTES * per_layer))
    return max(1, min(c["num_hidden_layers"], layers))


# --- receiver process --------------------------------------------------------

def receiver_main(c, device, shm_name, inbox, outbox, source):
    """Holds the fused weights; follows the trainer's orders on `inbox`."""
    try:
        sys.path.insert(0, os.path.join(source, "sync", "python"))
        import dte
        import torch
        local, _ = fused_layout(c)
        weights = None
        if device == "cpu":
            weights = dte.SharedWeights(shm_name, {n: ("BF16", s) for n, s in local.items()})
            tensors = {n: torch.from_numpy(weights.array(n).view("<i2")).view(torch.bfloat16)
                       for n in local}
            outbox.put(("tensors", {n: (weights.offset(n), s) for n, s in local.items()}))
        else:
            tensors = {n: torch.zeros(s, dtype=torch.bfloat16, device=device)
                       for n, s in local.items()}
            outbox.put(("tensors", tensors))  # CUDA IPC: the trainer opens them
        push = live = None
        while True:
            order = inbox.get()
            kind = order[0]
            if kind == "push":
                push = dte.PushReceiver(order[1], tensors, rank=0,
                                        layout=dte.FusedReceiverLayout(1), version=order[2],
                                        auto_apply=True, timeout=120.0)
                outbox.put(("ok",))
            elif kind == "wait":
                push.wait_for(order[1], timeout=600.0)
                outbox.put(("held", push.version, time.time()))
            elif kind == "end_push":
                push.close()
                push = None
                outbox.put(("ok",))
            elif kind == "live":
                live = dte.LiveReceiver(order[1], tp=1, rank=0)
                for n, t in tensors.items():
                    if weights is not None:
                        live.register(n, weights.name, weights.offset(n), "BF16", t.shape,
                                      version=order[2])
                    else:
                        live.register_cuda(n, t, version=order[2])
                outbox.put(("ok",))
            elif kind == "end_live":
                if live is not None:
                    live.close()  # the mount can go: nothing holds its control file
                    live = None
                outbox.put(("ok",))
            elif kind == "exit":
                if live is not None:
                    live.close()
                outbox.put(("ok",))
                return
    except BaseException:
        outbox.put(("error", traceback.format_exc()))
    finally:
        if device == "cpu" and weights is not None:
            weights.unlink()


class ReceiverProc:
    def __init__(self, c, device, work):
        ctx = multiprocessing.get_context("spawn")  # CUDA is initialized here
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.shm = "dte-gpu-sync-%d" % os.getpid()
        self.proc = ctx.Process(target=receiver_main, daemon=True,
                                args=(c, device, self.shm, self.inbox, self.outbox, SOURCE))
        self.proc.start()

    def answer(self, timeout=900):
        try:
            reply = self.outbox.get(timeout=timeout)
        except Exception:
            raise SystemExit("gpu_sync: no answer from the receiver (exit code %s)"
                             % self.proc.exitcode) from None
        if reply[0] == "error":
            raise SystemExit("gpu_sync: the receiver failed:\n" + reply[1])
        return reply

    def order(self, *msg):
        self.inbox.put(msg)
        return self.answer()


def open_receiver_tensors(reply, shm, c, device):
    """The receiver's tensors in this process: CUDA IPC handles, or views of
    its /dev/shm object."""
    import torch
    if device != "cpu":
        return reply[1]
    import mmap
    fd = os.open("/dev/shm/" + shm, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    return {n: torch.frombuffer(mm, dtype=torch.bfloat16, count=math.prod(s),
                                offset=off).view(s) for n, (off, s) in reply[1].items()}


# --- the trainer -------------------------------------------------------------

class Clock:
    """Sums the time of copies on one device (CUDA events), or host time."""

    def __init__(self, device):
        import torch
        self.torch, self.cuda = torch, device != "cpu"

    def time(self, fn):
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        a, b = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3


def receiver_views(rx_tensors, c):
    _, where = fused_layout(c)
    views = {}
    for name, shape in shapes(c).items():
        target, row = where[name]
        views[name] = rx_tensors[target][row:row + shape[0]]
    return views


def identical(views, params):
    """Every receiver tensor equals the trainer's BF16 weights (compared on
    the device)."""
    import torch
    bad = [n for n, p in params.items() if not torch.equal(views[n], p.detach().to(torch.bfloat16))]
    return bad


def write_checkpoint(params, c, path, shard_bytes=2 << 30):
    """Version 0 as a sharded Hugging Face directory (BF16), a shard at a time."""
    import torch
    os.makedirs(path)
    json.dump(c, open(os.path.join(path, "config.json"), "w"), indent=1)
    shards, cur, size = [], {}, 0
    for name, p in params.items():
        if cur and size + p.numel() * 2 > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = p
        size += p.numel() * 2
    shards.append(cur)
    weight_map = {}
    for i, names in enumerate(shards):
        fname = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
        save_bf16({n: p.detach().to(torch.bfloat16).cpu() for n, p in names.items()},
                  os.path.join(path, fname))
        weight_map.update((n, fname) for n in names)
    json.dump({"metadata": {}, "weight_map": weight_map},
              open(os.path.join(path, "model.safetensors.index.json"), "w"))


def save_bf16(tensors, path):
    """A safetensors file of BF16 tensors: with the safetensors package where
    it is installed, else written here (a GPU host may have torch alone)."""
    try:
        import safetensors.torch
    except ImportError:
        pass
    else:
        return safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    import struct
    import torch
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for n, t in tensors.items():
        header[n] = {"dtype": "BF16", "shape": list(t.shape),
                     "data_offsets": [offset, offset + t.numel() * 2]}
        offset += t.numel() * 2
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors.values():
            f.write(t.contiguous().view(-1).view(torch.int16).numpy().tobytes())


def adamw_step(opt, params, step, device):
    """One real torch.optim.AdamW step, a tensor's gradient at a time (the
    device holds one gradient, not the model's)."""
    import torch
    g = torch.Generator(device=device).manual_seed(1000 + step)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=g, device=device)
        opt.step()
        p.grad = None
    if device != "cpu":
        torch.cuda.synchronize()


def publish_state(opt, params):
    return {n: {"param": p, "exp_avg": opt.state[p]["exp_avg"],
                "exp_avg_sq": opt.state[p]["exp_avg_sq"], "step": opt.state[p]["step"],
                "rows": (0, p.shape[0])} for n, p in params.items()}


def mount_store(a, store, work):
    """A started dtefs mount of the store for live apply, or (None, why not)."""
    dtefs = os.path.join(a.build_dir, h.Tools.PATHS["dtefs"])
    if not os.path.exists("/dev/fuse") or not os.path.exists(dtefs):
        return None, "no /dev/fuse or no built dtefs (%s)" % dtefs
    m = h.FuseMount("dtefs", [dtefs, store, os.path.join(work, "mnt"), "--cache-dir",
                              os.path.join(work, "mnt-cache"), "--poll-ms", "50", "-f"],
                    os.path.join(work, "mnt"), os.path.join(work, "dtefs.stderr"))
    try:
        return m.start(), None
    except (RuntimeError, AssertionError) as e:
        return None, "dtefs did not mount: %s" % e


def wait_latest(mnt, version, timeout=120):
    want = "v%08d" % version
    h.wait_for(lambda: os.path.basename(os.readlink(os.path.join(mnt, "latest"))) == want,
               timeout, "the mount to show " + want, 0.01)


def baselines(views, params, clock, repeats):
    """Seconds of a full BF16 copy and of a full cast + copy into the
    receiver (medians of `repeats`)."""
    import torch
    copy, cast = [], []
    for _ in range(repeats):
        t = 0.0
        for n, p in params.items():
            bf16 = p.detach().to(torch.bfloat16)  # the trainer's BF16 weights, not timed
            t += clock.time(lambda: views[n].copy_(bf16))
            del bf16
        copy.append(t)
        cast.append(sum(clock.time(lambda: views[n].copy_(p.detach()))
                        for n, p in params.items()))
    return sorted(copy)[len(copy) // 2], sorted(cast)[len(cast) // 2]


def run(a):
    sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
    import dte
    import torch
    device = a.device
    c = dict(QWEN3_8B if a.model == "qwen3-8b" else TINY)
    card = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    if a.layers == "auto":
        if device == "cuda":
            free, _ = torch.cuda.mem_get_info()
            c["num_hidden_layers"] = layers_that_fit(c, free, a.headroom_gib << 30)
    else:
        c["num_hidden_layers"] = int(a.layers)
    full_layers = (QWEN3_8B if a.model == "qwen3-8b" else TINY)["num_hidden_layers"]
    n = count(c)
    log("gpu_sync: %s, %s, %d of %d layers, %.3f B parameters (%.1f GiB of FP32 state)"
        % (card, a.model, c["num_hidden_layers"], full_layers, n / 1e9, n * 12 / 2**30))
    work = tempfile.mkdtemp(prefix="dte-gpu-sync-", dir=a.work)
    report = {"card": card, "device": device, "model": a.model, "config": c,
              "layers": c["num_hidden_layers"], "full_layers": full_layers, "parameters": n,
              "lr": a.lr, "link_gbps": a.link_gbps, "steps": [], "live": [],
              "live_skipped": None}
    rx = None
    try:
        g = torch.Generator(device=device).manual_seed(1)
        params = {}
        for name, s in shapes(c).items():
            t = (torch.randn(s, generator=g, device=device) * 0.02 if len(s) > 1
                 else torch.ones(s, device=device))
            params[name] = torch.nn.Parameter(t)
        opt = torch.optim.AdamW(params.values(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=0.01, foreach=False)
        store = os.path.join(work, "store")
        ckpt = os.path.join(work, "v0")
        t0 = time.time()
        write_checkpoint(params, c, ckpt)
        with dte.Publisher(store=store) as importer:
            importer.import_checkpoint(ckpt)
        shutil.rmtree(ckpt)
        log("gpu_sync: v0 imported in %.1f s" % (time.time() - t0))

        rx = ReceiverProc(c, device, work)
        views = receiver_views(open_receiver_tensors(rx.answer(), rx.shm, c, device), c)
        for name, p in params.items():
            views[name].copy_(p.detach().to(torch.bfloat16))  # the receiver loads v0
        if device != "cpu":
            torch.cuda.synchronize()
        group = dte.PushGroup("127.0.0.1:0", timeout=120.0, receivers=1)
        rdv = os.path.join(work, "rendezvous")
        os.makedirs(rdv)
        pub = dte.Publisher(store=store, rank=0, world_size=1, rendezvous=rdv, push=group)
        rx.order("push", group.address, 0)
        group.wait_for_receivers(timeout=120, version=0)
        clock = Clock(device)
        step = 0
        for i in range(a.warmup + a.steps):
            step += 1
            adamw_step(opt, params, step, device)
            rx.inbox.put(("wait", step))
            t0 = time.time()
            r = pub.publish_adamw(step=step, params=publish_state(opt, params), lr=a.lr,
                                  betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
            t1 = time.time()
            _, held, t_held = rx.answer()
            bad = identical(views, params)
            if bad:
                raise SystemExit("gpu_sync: after step %d the receiver differs from the "
                                 "trainer's BF16 weights in %s" % (step, ", ".join(bad[:5])))
            st, push = pub.last_stats(), r.push
            if push is None or push.error or push.pushed != 1:
                raise SystemExit("gpu_sync: step %d was not pushed: %r" % (step, push))
            row = {"step": step, "version": r.version, "changed": r.changed,
                   "changed_fraction": r.changed / n, "publish_s": t1 - t0,
                   "detect_s": st.detect_ns / 1e9, "encode_s": st.encode_ns / 1e9,
                   "commit_s": st.commit_ns / 1e9,
                   "detect_device_bytes": st.detect_device_bytes,
                   "pack_s": push.pack_seconds, "push_bytes": push.bytes,
                   "deliver_s": t_held - (t1 - push.seconds), "e2e_s": t_held - t0,
                   "warmup": i < a.warmup, "identical": True}
            report["steps"].append(row)
            log("step %d: %.2f%% changed; detect %.3f s (%d B device to host), encode %.3f s, "
                "commit %.3f s, pack %.3f s, deliver %.3f s, end to end %.3f s; %d B pushed; "
                "receiver bit-identical" % (
                    step, 100 * row["changed_fraction"], row["detect_s"],
                    row["detect_device_bytes"], row["encode_s"], row["commit_s"], row["pack_s"],
                    row["deliver_s"], row["e2e_s"], row["push_bytes"]))
        rx.order("end_push")
        if a.live:
            step = live_steps(a, dte, rx, pub, opt, params, views, store, work, step, n, report)
        copy_s, cast_s = baselines(views, params, clock, a.repeats)
        if identical(views, params):
            raise SystemExit("gpu_sync: the baseline copies left the receiver wrong")
        report["baseline_copy_s"], report["baseline_cast_copy_s"] = copy_s, cast_s
        report["baseline_bytes"] = 2 * n
        rx.order("exit")
        pub.close()
        group.close()
    finally:
        if rx is not None and rx.proc.is_alive():
            rx.proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    return report


def live_steps(a, dte, rx, pub, opt, params, views, store, work, step, n, report):
    """--live: further steps delivered by live apply through a dtefs mount."""
    m, why = mount_store(a, store, work)
    if m is None:
        report["live_skipped"] = why
        log("gpu_sync: live apply not run: " + why)
        return step
    mnt, registered = m.path, False
    try:
        wait_latest(mnt, step)
        dte.apply(mnt, step)  # the live copy at the receiver's version
        rx.order("live", mnt, step)
        registered = True
        for _ in range(a.steps):
            step += 1
            adamw_step(opt, params, step, a.device)
            r = pub.publish_adamw(step=step, params=publish_state(opt, params), lr=a.lr,
                                  betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
            wait_latest(mnt, r.version)
            t0 = time.time()
            counts = dte.apply(mnt, r.version)
            t1 = time.time()
            bad = identical(views, params)
            if bad:
                raise SystemExit("gpu_sync: after live apply of step %d the receiver differs "
                                 "in %s" % (step, ", ".join(bad[:5])))
            row = {"step": step, "version": r.version, "changed_fraction": r.changed / n,
                   "apply_s": t1 - t0, "entries": counts.entries, "bytes": counts.bytes,
                   "identical": True}
            report["live"].append(row)
            log("live step %d: %.2f%% changed; apply %.3f s (%d entries, %d B)"
                % (step, 100 * row["changed_fraction"], row["apply_s"], row["entries"],
                   row["bytes"]))
    except SystemExit:
        raise
    except Exception as e:  # a GPU path never run before says why, the rest still reports
        if a.device == "cpu":
            raise
        report["live_skipped"] = "failed: %s" % e
        log("gpu_sync: live apply failed: %s" % e)
    finally:
        if registered:
            rx.order("end_live")
        m.unmount()
    return step


def summary(r):
    gbps = r["link_gbps"] * 1e9 / 8
    measured = [s for s in r["steps"] if not s["warmup"]]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    e2e, deliver = med([s["e2e_s"] for s in measured]), med([s["deliver_s"] for s in measured])
    pushed = med([s["push_bytes"] for s in measured])
    lines = ["# %s, %s: %d of %d layers, %.2f B parameters, lr %g"
             % (r["card"], r["model"], r["layers"], r["full_layers"], r["parameters"] / 1e9,
                r["lr"]),
             "| step | changed | detect | D2H | encode | commit | pack | deliver | e2e | pushed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in r["steps"]:
        lines.append("| %d%s | %.2f%% | %.3f s | %.1f MB | %.3f s | %.3f s | %.3f s | %.3f s | "
                     "%.3f s | %.1f MB |" % (
                         s["step"], " (warm-up)" if s["warmup"] else "",
                         100 * s["changed_fraction"], s["detect_s"],
                         s["detect_device_bytes"] / 1e6, s["encode_s"], s["commit_s"],
                         s["pack_s"], s["deliver_s"], s["e2e_s"], s["push_bytes"] / 1e6))
    for s in r["live"]:
        lines.append("live apply, step %d: %.2f%% changed, %.3f s, %d entries, %.1f MB"
                     % (s["step"], 100 * s["changed_fraction"], s["apply_s"], s["entries"],
                        s["bytes"] / 1e6))
    if r["live_skipped"]:
        lines.append("live apply: not run: %s" % r["live_skipped"])
    base = r["baseline_bytes"]
    lines += [
        "baseline full BF16 copy into the receiver: %.4f s, %.2f GB; copy / e2e %.3fx, "
        "copy / deliver %.3fx (above 1: dte's step is faster)"
        % (r["baseline_copy_s"], base / 1e9, r["baseline_copy_s"] / e2e,
           r["baseline_copy_s"] / deliver),
        "baseline cast + copy from FP32: %.4f s; cast+copy / e2e %.3fx"
        % (r["baseline_cast_copy_s"], r["baseline_cast_copy_s"] / e2e),
        "bytes: pushed %.1f MB vs %.2f GB dense (%.0fx fewer)" % (pushed / 1e6, base / 1e9,
                                                                 base / pushed),
        "across PCIe per step (a GPU run): detection's kept entries device to host (D2H "
        "above); the push's bytes over loopback TCP, then host to device in the receiver; "
        "live apply's entries host to device in the daemon; the baselines none (device to "
        "device)",
        "arithmetic, not measured: at %g Gb/s the push's bytes take %.4f s, the dense BF16 "
        "weights %.4f s (%.0fx)" % (r["link_gbps"], pushed / gbps, base / gbps, base / pushed),
        "every receiver bit-identical to the trainer's BF16 weights after every delivery: yes"]
    return "\n".join(lines)


def main():
    p = h.parser(__doc__)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if torch has one)")
    p.add_argument("--model", choices=("qwen3-8b", "tiny"), default="qwen3-8b")
    p.add_argument("--layers", default="auto",
                   help="layers of the model (default auto: all that fit the device)")
    p.add_argument("--headroom-gib", type=int, default=12,
                   help="device memory left free by --layers auto")
    p.add_argument("--steps", type=int, default=3, help="measured steps (and live steps)")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and reported apart")
    p.add_argument("--lr", type=float, default=5e-7)
    p.add_argument("--repeats", type=int, default=3, help="of each baseline")
    p.add_argument("--live", action="store_true", help="also deliver steps by live apply")
    p.add_argument("--link-gbps", type=float, default=400.0)
    p.add_argument("--work", default=None)
    a = p.parse_args()
    os.environ.setdefault("DTE_LIBRARY", os.path.join(a.build_dir, "sync", "libdte.so"))
    if a.device is None:
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("gpu_sync: --device cuda but torch sees no CUDA device")
        a.device = "cuda:%d" % torch.cuda.current_device()
    report = run(a)
    h.write_json(a.json, report)
    print(summary(report), flush=True)


if __name__ == "__main__":
    main()
