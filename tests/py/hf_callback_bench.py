"""Times a transformers.Trainer step of the two-layer Llama of the tests
(tests/py/follower_util.py) on the CPU without and with
dte.hf.PublishCallback, and the publish inside the step. Prints, per run,
the median of steps --skip+1..--steps of each. --optim picks the Trainer's
optimizer (default: the Trainer's own default, fused AdamW on transformers
5, which the callback publishes by inverting the AdamW step; "adamw_torch"
or "sgd" take the weights path on torch 2.15).

    /opt/dte/venv/bin/python tests/py/hf_callback_bench.py --work /tmp/hfbench --runs 3
"""

import argparse
import os
import shutil
import statistics
import time

import follower_util

import dte.hf
import torch
import transformers

from test_hf_callback import Tokens


class StepTimer(transformers.TrainerCallback):
    """Seconds from each step's begin to its end (forward, backward,
    optimizer step and every callback of the step)."""

    def __init__(self):
        self.seconds, self.before, self._t0 = [], [], 0.0

    def on_step_begin(self, args, state, control, **kw):
        self._t0 = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kw):
        # Called before the publish's (this callback comes first): the
        # forward, backward, clipping and optimizer step.
        self.before.append(time.perf_counter() - self._t0)

    def on_step_end(self, args, state, control, **kw):
        self.seconds.append(time.perf_counter() - self._t0)


class TimedPublish(dte.hf.PublishCallback):
    """The callback, timing its publish (on_optimizer_step)."""

    def __init__(self, store):
        super().__init__(store=store)
        self.seconds = []

    def on_optimizer_step(self, *args, **kw):
        t0 = time.perf_counter()
        super().on_optimizer_step(*args, **kw)
        self.seconds.append(time.perf_counter() - t0)


def train(work, steps, publish, optim):
    timer = StepTimer()
    callbacks = [timer]
    pub = None
    if publish:
        shutil.rmtree(os.path.join(work, "store"), ignore_errors=True)
        pub = TimedPublish(os.path.join(work, "store"))
        callbacks.append(pub)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(work, "out"), max_steps=steps, per_device_train_batch_size=2,
        learning_rate=3e-3, weight_decay=0.01, warmup_steps=1, **optim,
        report_to=[], save_strategy="no", logging_steps=1000, use_cpu=True,
        dataloader_num_workers=0, seed=3, disable_tqdm=True)
    model = follower_util.model(torch.float32).train()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(n=2 * steps),
                                   callbacks=callbacks)
    trainer.train()
    if pub:
        print("the callback's path: %s" % pub.path, flush=True)
    return timer.seconds, timer.before, pub.seconds if pub else []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    ap.add_argument("--optim", default=None,
                    help="TrainingArguments.optim (default: the Trainer's default)")
    a = ap.parse_args()
    optim = {"optim": a.optim} if a.optim else {}
    print("optimizer: %s" % transformers.TrainingArguments(output_dir=a.work, **optim).optim,
          flush=True)
    os.makedirs(a.work, exist_ok=True)
    os.environ.setdefault("DTE_CACHE_DIR", os.path.join(a.work, "cache"))
    for run in range(a.runs):
        without, before0, _ = train(a.work, a.steps, publish=False, optim=optim)
        with_cb, before1, publish = train(a.work, a.steps, publish=True, optim=optim)
        rest = [s - p for s, p in zip(with_cb, publish)]  # the step less its publish
        ms = [1000 * statistics.median(x[a.skip:])
              for x in (without, with_cb, publish, rest, before0, before1)]
        print("run %d: step %.1f ms without the callback, %.1f ms with it, of which the "
              "publish %.1f ms; the step less its publish %.1f ms; up to the optimizer step "
              "%.1f ms without, %.1f ms with (medians of steps %d-%d)"
              % (run + 1, *ms, a.skip + 1, a.steps), flush=True)


if __name__ == "__main__":
    main()
