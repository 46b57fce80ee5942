"""Same-cluster push into a Hugging Face transformers model served on the
CPU in another process (docs/push.md).

The trainer (this process) trains a small Llama (GQA, untied head) with
torch.optim.AdamW on a fixed token stream and publishes every step with
dte.Publisher(push=dte.PushGroup(...)). The server process loads the
initial checkpoint with LlamaForCausalLM.from_pretrained, registers
dict(model.named_parameters()) as a dte.PushReceiver, and between requests
applies whatever pushes arrived (generation is paused around the scatter)
and answers with a greedy generation and a digest of its parameters. After
every step the trainer loads the same version from a dtefs mount of the
store with from_pretrained, as a rollout host would, and requires the same
greedy tokens and bit for bit the same parameters.

    python3 tools/examples/push_transformers.py --work /tmp/push-example --steps 5

Needs transformers, the built libdte.so (DTE_LIBRARY or build/) and dtefs
(build/tools/dtefs).
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.normpath(os.path.join(HERE, "..", ".."))
BUILD = os.environ.get("DTE_BUILD_DIR", os.path.join(SOURCE, "build"))
sys.path.insert(0, os.path.join(SOURCE, "sync", "python"))
os.environ.setdefault("DTE_LIBRARY", os.path.join(BUILD, "sync", "libdte.so"))

import torch  # noqa: E402

import dte  # noqa: E402

PROMPT = [1, 17, 42, 99, 7]
LR = 2e-5


def config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, tie_word_embeddings=False, max_position_embeddings=256,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)


def generate(model):
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT)),
                             max_new_tokens=24, do_sample=False, min_new_tokens=24)
    return out[0, len(PROMPT):].tolist()


def digest(model):
    import hashlib
    h = hashlib.sha256()
    for n, p in model.named_parameters():
        h.update(n.encode())
        h.update(p.detach().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def serve(a):
    """The inference server: one JSON request per line on stdin."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).eval()
    rx = dte.PushReceiver(a.address, dict(model.named_parameters()), version=0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        # Between requests: apply every push that arrived (paused), then serve.
        try:
            rx.wait_for(req["version"], timeout=60)
        except dte.MissedPushes:
            rx.catch_up(a.store)
        print(json.dumps({"version": rx.version, "tokens": generate(model),
                          "digest": digest(model)}), flush=True)
    rx.close()


def mount(store, mnt, log):
    os.makedirs(mnt, exist_ok=True)
    proc = subprocess.Popen([os.path.join(BUILD, "tools", "dtefs"), store, mnt, "-f",
                             "--cache-dir", mnt + ".cache", "--poll-ms", "100"],
                            stderr=open(log, "w"))
    end = time.monotonic() + 30
    while not os.path.ismount(mnt):
        if proc.poll() is not None or time.monotonic() > end:
            raise SystemExit("dtefs did not mount (see %s)" % log)
        time.sleep(0.05)
    return proc


def train(a):
    from transformers import LlamaForCausalLM
    os.makedirs(a.work, exist_ok=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())  # FP32 master weights
    v0 = os.path.join(a.work, "v0")
    model.to(torch.bfloat16).save_pretrained(v0, safe_serialization=True)
    model.to(torch.float32)
    # The same BF16 weights the server loads: FP32 masters are exact BF16 values.
    model = LlamaForCausalLM.from_pretrained(v0, dtype=torch.bfloat16).to(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=True)  # the CPU kernel the engine models exactly
    store = os.path.join(a.work, "store")
    group = dte.PushGroup("127.0.0.1:0", timeout=30.0)
    pub = dte.Publisher(store=store, push=group)
    pub.import_checkpoint(v0)
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--model", v0, "--store", store,
                               "--address", group.address], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert json.loads(server.stdout.readline())["ready"]
    mnt = os.path.join(a.work, "mnt")
    fs = mount(store, mnt, os.path.join(a.work, "dtefs.log"))
    g = torch.Generator().manual_seed(1)
    data = torch.randint(3, 512, (8, 33), generator=g)
    try:
        for step in range(1, a.steps + 1):
            opt.zero_grad()
            loss = model(input_ids=data, labels=data).loss
            loss.backward()
            opt.step()
            params = {n: {"param": p, "exp_avg": opt.state[p]["exp_avg"],
                          "exp_avg_sq": opt.state[p]["exp_avg_sq"], "step": opt.state[p]["step"]}
                      for n, p in model.named_parameters()}
            r = pub.publish_adamw(step=step, params=params, lr=LR, betas=(0.9, 0.95),
                                  eps=1e-8, weight_decay=0.0)
            server.stdin.write(json.dumps({"version": r.version}) + "\n")
            server.stdin.flush()
            answer = json.loads(server.stdout.readline())
            # The same version from the mount, as a rollout host loads it.
            vdir = os.path.join(mnt, "v%08d" % r.version)
            end = time.monotonic() + 30
            while not os.path.isdir(vdir) and time.monotonic() < end:
                time.sleep(0.05)
            loaded = LlamaForCausalLM.from_pretrained(vdir, dtype=torch.bfloat16).eval()
            want = generate(loaded)
            same = (answer["version"] == r.version and answer["tokens"] == want and
                    answer["digest"] == digest(loaded))
            print("step %d: loss %.3f, %.2f%% of BF16 elements changed, pushed %d bytes in "
                  "%.3f s; the served weights and greedy tokens %s the dtefs version's" % (
                      step, loss.item(), 100 * r.changed / r.elements, r.push.bytes,
                      r.push.seconds, "equal" if same else "DIFFER FROM"), flush=True)
            # transformers 5 maps the safetensors files it loaded for as long
            # as the model lives: drop it, or the mount stays busy.
            del loaded
            if not same:
                raise SystemExit("served %s, dtefs version %s" % (answer, want))
    finally:
        gc.collect()
        server.stdin.close()
        server.wait(60)
        subprocess.run(["fusermount3", "-u", mnt], check=False)
        fs.wait(30)
        pub.close()
        group.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--work", default="/tmp/dte-push-example")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--serve", action="store_true")
    p.add_argument("--model")
    p.add_argument("--store")
    p.add_argument("--address")
    a = p.parse_args()
    serve(a) if a.serve else train(a)


if __name__ == "__main__":
    main()
