"""One rank of test_hf_callback.py's two-process runs (the env
torch.distributed.run sets; CPU, gloo): a Trainer with
dte.hf.PublishCallback trains the tiny Llama; after every step this rank
checks the store's latest version against its model's bfloat16() weights.
Modes: "adamw" (the Trainer's default optimizer, gradient accumulation 2),
"sgd" (the weights path) and "fsdp2" (TrainingArguments asking for FSDP2).
Writes OUT/rank-R.json."""

import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import follower_util  # noqa: E402,F401 (puts the package on the path)
import test_hf_callback as t  # noqa: E402

import accelerate  # noqa: E402
import dte.hf  # noqa: E402
import torch.distributed as dist  # noqa: E402

MODES = {
    "adamw": {"gradient_accumulation_steps": 2},
    "sgd": {"optim": "sgd", "lr": 0.5},
    "fsdp2": {"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": True,
                                            "transformer_layer_cls_to_wrap":
                                                ["LlamaDecoderLayer"]}},
}


def main():
    store, out, steps, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    check = t.Check(store)
    pub = dte.hf.PublishCallback(store=store)
    trainer = t.trainer(pathlib.Path(out), [pub, check], steps=steps, **MODES[mode])
    trainer.train()
    rank = dist.get_rank()
    report = {"rank": rank, "world": dist.get_world_size(), "backend": dist.get_backend(),
              "seen": check.seen, "versions": [r.version for r in pub.results],
              "path": pub.path, "mine": sorted(pub._named),
              "elements": sum(p.numel() for p in pub._named.values()),
              "all": sorted(n for n, _ in trainer.model.named_parameters()),
              "ddp": type(trainer.model_wrapped).__name__,
              "param": type(next(trainer.model.parameters())).__name__,
              "accelerate": accelerate.__version__,
              "distributed_type": str(trainer.accelerator.distributed_type)}
    with open(os.path.join(out, "rank-%d.json" % rank), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
