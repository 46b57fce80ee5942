"""One rank of test_hf_fsdp2.py (the env torch.distributed.run sets; CPU,
gloo): the tiny Llama sharded by FSDP2 (torch.distributed.fsdp.fully_shard
on every decoder layer and the root, so every parameter is a DTensor),
trained by a loop that raises dte.hf.PublishCallback's events where the
Trainer raises them; after every step this rank gathers the model and
checks it against the store's latest version. argv: STORE OUT OPTIM
(adamw: torch's fused AdamW; sgd). Writes OUT/rank-R.json."""

import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import follower_util  # noqa: E402,F401 (puts the package on the path)
import test_hf_callback as t  # noqa: E402

import dte  # noqa: E402
import dte.hf  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402


def sharded_model():
    model = follower_util.model(torch.float32).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def main():
    store, out, optim = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = sharded_model()
    if optim == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    pub = dte.hf.PublishCallback(store=store)
    args = types.SimpleNamespace(process_index=rank, world_size=world, save_steps=0)
    state = types.SimpleNamespace(global_step=0)
    pub.on_train_begin(args, state, None, model=model, optimizer=opt)
    ids, seen = t.Tokens().ids, []
    for step in range(3):
        batch = ids[4 * step + 2 * rank:4 * step + 2 * rank + 2]
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        pub.on_optimizer_step(args, state, None, model=model, optimizer=opt)
        opt.zero_grad()
        state.global_step += 1
        pub.on_step_end(args, state, None, model=model)
        with dte.StoreReader(store) as r:
            latest = r.latest()
        seen.append([latest, t.differing(store, latest, model)])
    pub.on_train_end(args, state, None)
    params = {type(p).__name__ for p in model.parameters()}
    report = {"rank": rank, "world": world, "backend": dist.get_backend(), "seen": seen,
              "path": pub.path, "params": sorted(params),
              "results": [[r.version, r.path, r.changed] for r in pub.results]}
    with open(os.path.join(out, "rank-%d.json" % rank), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
