"""dte.hf.PublishCallback in TRL's GRPOTrainer on CPU, with nothing from the
network: a tiny Llama and a word-level tokenizer built here, prompts in an
in-memory datasets.Dataset, and a reward of the completion's length in
characters (so a group's two completions score differently and the
policy moves). GRPOConfig generates two completions of at most 4 tokens
per prompt, without vLLM, for 3 steps. After every optimizer step the
store's latest version is the step's and equals the policy's bfloat16()
weights bit for bit: with GRPOConfig's default optimizer (torch's fused
AdamW: the AdamW path) and with SGD (the weights path)."""

import logging

import pytest

import follower_util  # noqa: F401 (puts the package on the path)
import test_hf_callback

import dte.hf  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

WORDS = "the a cat dog sat ran on mat fast slow big small red blue".split()


def tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({w: i + 3 for i, w in enumerate(WORDS)})
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>",
                                                eos_token="<eos>", unk_token="<unk>")


def policy(vocab_size):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      vocab_size=vocab_size, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=1)
    return transformers.LlamaForCausalLM(config)


def characters(completions, **kw):
    return [float(len(c)) for c in completions]


def grpo(tmp_path, callbacks, **kw):
    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), num_generations=2,
                          max_completion_length=4, per_device_train_batch_size=2, max_steps=3,
                          learning_rate=kw.pop("lr", 1e-2), use_cpu=True, report_to=[],
                          bf16=False, logging_steps=100, save_strategy="no", seed=3, **kw)
    prompts = datasets.Dataset.from_dict(
        {"prompt": ["the cat sat", "a dog ran", "the big mat", "a red cat", "the slow dog",
                    "a blue mat"]})
    tok = tokenizer()
    return trl.GRPOTrainer(model=policy(len(tok)), reward_funcs=characters, args=args,
                           train_dataset=prompts, processing_class=tok, callbacks=callbacks)


@pytest.mark.parametrize("optim,lr,path", [(None, 1e-2, "adamw"), ("sgd", 1.0, "weights")])
def test_every_grpo_step_is_a_version_equal_to_the_policy(tmp_path, caplog, optim, lr, path):
    store = str(tmp_path / "store")
    check = test_hf_callback.Check(store)
    pub = dte.hf.PublishCallback(store=store)
    kw = {} if optim is None else {"optim": optim}
    trainer = grpo(tmp_path, [pub, check], lr=lr, **kw)
    if optim is None:  # GRPOConfig's default: a change of it fails here first
        assert trl.GRPOConfig.__dataclass_fields__["optim"].default == "adamw_torch_fused"
        assert trainer.args.optim == "adamw_torch_fused"
    with caplog.at_level(logging.INFO, logger="dte.hf"):
        trainer.train()
    assert ("AdamW (fused, CPU)" if path == "adamw" else "SGD: diffing") in caplog.text
    assert pub.path == path and check.seen == [1, 2, 3]
    assert [(r.version, r.path) for r in pub.results] == [(v, path) for v in (1, 2, 3)]
    assert sum(r.changed for r in pub.results) > 0
