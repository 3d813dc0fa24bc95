"""The embedded default: a character-level tokenizer, a tiny Qwen2 model, and a task with a checkable answer.

Task: write a sequence of digits backwards. The prompt shows four digits ("3,7,1,5,"), the answer is
"5,1,7,3", and the reward is the length of the correct prefix over the longer of answer and response.
2000 distinct sequences train, 100 others are held out for validation. The model is warm-started with a
few seconds of supervised training so that it knows the format and gets some answers partly right; RL does
the rest.
Everything is built offline, deterministically, under ``<dir>`` (default ``runs/toy_assets``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket

import torch

CHARS = list("0123456789,")
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
DIGITS = 4
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def example(digits: tuple[int, ...]) -> tuple[str, str]:
    return "".join(f"{d}," for d in digits), ",".join(str(d) for d in reversed(digits))


def split_pairs(seed: int = 0, num_train: int = 2000, num_val: int = 100,
                digits: tuple[int, int] = (DIGITS, DIGITS)) -> tuple[list[tuple], list[tuple]]:
    """Distinct digit sequences: the first ``num_train`` for training, the next ``num_val`` held out.
    ``digits`` (lo, hi): sequence lengths, log-uniform between them (a long tail of long answers)."""
    rng = random.Random(seed)
    lo, hi = digits
    seen: dict[tuple, None] = {}
    while len(seen) < num_train + num_val:
        n = lo if lo == hi else min(hi, int(lo * (hi / lo) ** rng.random()))
        seen[tuple(rng.randrange(10) for _ in range(n))] = None
    items = list(seen)
    return items[:num_train], items[num_train:]


def build_tokenizer(path: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def write_jsonl(path: str, pairs: list[tuple[int, int]], repeats: int) -> None:
    with open(path, "w") as f:
        for r in range(repeats):
            for i, digits in enumerate(pairs):
                prompt, answer = example(digits)
                f.write(json.dumps({"prompt": [{"role": "user", "content": prompt}], "data_source": "toy",
                                    "reward_model": {"ground_truth": answer, "style": "rule"},
                                    "extra_info": {"index": r * len(pairs) + i}}) + "\n")


def warm_start(model, tokenizer, pairs, steps: int, seed: int) -> None:
    """A few supervised steps on prompt + answer + eos so the format is known (loss on the answer only)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(pairs), (32,), generator=g).tolist()
        rows, labels = [], []
        for i in idx:
            prompt, answer = example(pairs[i])
            p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            rows.append(p + a)
            labels.append([-100] * len(p) + a)
        width = max(map(len, rows))  # right-padded when the lengths differ (the long-tail variant)
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        labels = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        loss = model(input_ids=ids, attention_mask=None if bool(mask.all()) else mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def build_policy(tokenizer, train_pairs, seed: int = 0, warm_steps: int = 60, heads: int = 4, kv_heads: int = 2,
                 max_positions: int = 64):
    """The toy policy: a 2-layer Qwen2 (hidden 64) warm-started on the task. heads=2 gives head size 32, the
    smallest vLLM's CPU attention takes (the vLLM end-to-end test uses it)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(SPECIAL) + len(CHARS), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=False, pad_token_id=0,
                         eos_token_id=1, bos_token_id=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    warm_start(model, tokenizer, train_pairs, warm_steps, seed)
    model.generation_config.pad_token_id = 0
    return model


def _complete(path: str) -> bool:
    return (os.path.exists(os.path.join(path, "model", "model.safetensors"))
            and os.path.exists(os.path.join(path, "data", "val.jsonl")))


def prepare(path: str = "runs/toy_assets", seed: int = 0, warm_steps: int = 60,
            digits: tuple[int, int] = (DIGITS, DIGITS)) -> dict[str, str]:
    """Build (once) the tokenizer, the warm-started model and the data files; returns their paths.
    ``digits`` (lo, hi) other than the default makes the long-tail variant (answers of 2 lo to 2 hi tokens with
    the eos; bench/compare_trl.py --case long-tail), with room in the model for the longest prompt + answer."""
    model_dir, data_dir = os.path.join(path, "model"), os.path.join(path, "data")
    out = {"model": model_dir, "train": os.path.join(data_dir, "train.jsonl"),
           "val": os.path.join(data_dir, "val.jsonl")}
    if _complete(path):
        return out
    # built in a folder of this process's own and renamed into place: nodes that share the output folder may build
    # at once, and the first rename wins (a folder is renamed onto an empty one or not at all)
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "data"))
    tokenizer = build_tokenizer(os.path.join(tmp, "model"))
    train_pairs, val_pairs = split_pairs(seed, digits=digits)
    write_jsonl(os.path.join(tmp, "data", "train.jsonl"), train_pairs, repeats=1)
    write_jsonl(os.path.join(tmp, "data", "val.jsonl"), val_pairs, repeats=1)
    model = build_policy(tokenizer, train_pairs, seed, warm_steps, max_positions=max(64, 4 * digits[1] + 16))
    model.save_pretrained(os.path.join(tmp, "model"))
    try:
        os.rename(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _complete(path):
            raise ValueError(f"{path} holds an incomplete toy build; remove the folder and run again") from None
    return out
    os.makedirs(data_dir, exist_ok=True)
    tokenizer = build_tokenizer(model_dir)
    train_pairs, val_pairs = split_pairs(seed, digits=digits)
    write_jsonl(out["train"], train_pairs, repeats=1)
    write_jsonl(out["val"], val_pairs, repeats=1)
    model = build_policy(tokenizer, train_pairs, seed, warm_steps, max_positions=max(64, 4 * digits[1] + 16))
    tmp = model_dir + ".tmp"
    model.save_pretrained(tmp)
    for name in os.listdir(tmp):  # weights appear in the model folder only once complete
        os.replace(os.path.join(tmp, name), os.path.join(model_dir, name))
    os.rmdir(tmp)
    return out
