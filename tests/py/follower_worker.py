"""A rollout loop in its own process for test_follower.py: follows SOURCE
with dte.Follower, loads every new version into a tiny Llama, checks it
and generates, and prints one line per version: "VERSION HELD TOKENS".
Prints "ready" once following; exits after version LAST."""

import sys

import follower_util

import dte
import torch


def main(source, last):
    model = follower_util.model()
    with dte.Follower(source) as follower:
        print("ready", flush=True)
        for version in follower.versions(timeout=60):
            held = follower.load_into(model, version)   # verified (check) by default
            with torch.no_grad():
                tokens = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4,
                                        do_sample=False, pad_token_id=0)
            print(version, held, follower.live, ",".join(map(str, tokens[0].tolist())),
                  flush=True)
            if version >= last:
                return


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
