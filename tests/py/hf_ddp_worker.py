"""One rank of test_hf_callback.py's DDP run (started by torch.distributed.run
with 2 processes on CPU, gloo): a Trainer with dte.hf.PublishCallback trains
the tiny Llama; after every step this rank checks the store's latest version
against its model's bfloat16() weights. Writes OUT/rank-R.json."""

import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import follower_util  # noqa: E402,F401 (puts the package on the path)
import test_hf_callback as t  # noqa: E402

import dte.hf  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main():
    store, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    check = t.Check(store)
    pub = dte.hf.PublishCallback(store=store)
    trainer = t.trainer(pathlib.Path(out), [pub, check], steps=steps,
                        gradient_accumulation_steps=2)
    trainer.train()
    rank = dist.get_rank()
    report = {"rank": rank, "world": dist.get_world_size(), "backend": dist.get_backend(),
              "seen": check.seen, "versions": [r.version for r in pub.results],
              "mine": sorted(pub._named), "elements": sum(p.numel() for p in pub._named.values()),
              "all": sorted(n for n, _ in trainer.model.named_parameters()),
              "ddp": type(trainer.model_wrapped).__name__}
    with open(os.path.join(out, "rank-%d.json" % rank), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
