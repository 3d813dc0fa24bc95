"""The embedded default: a character-level tokenizer, a tiny Qwen2 model, and a task with a checkable answer.

The tool variant (``toy_tool``, multi-turn rollouts): the prompt is a four-digit key, the digits sit behind the
``lookup`` tool, and the answer is them backwards; the model can only score by calling the tool. Its tokenizer is
ChatML-shaped (``<|im_start|>``, ``<|im_end|>`` as the turn's stop token, Hermes ``<tool_call>`` tags).

Task: write a sequence of digits backwards. The prompt shows four digits ("3,7,1,5,"), the answer is
"5,1,7,3", and the reward is the length of the correct prefix over the longer of answer and response.
2000 distinct sequences train, 100 others are held out for validation. The model is warm-started with a
few seconds of supervised training so that it knows the format and gets some answers partly right; RL does
the rest.
Everything is built offline, deterministically, under ``<dir>`` (default ``runs/toy_assets``).
torch, tokenizers and transformers are imported inside the builders: the tool task's ``lookup`` is loaded from this
module by every tool worker process, which must start without them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import string
from typing import Any

from lib.multi_turn.render import ObservationRenderer, tool_message

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
    examples = []
    for digits in pairs:
        prompt, answer = example(digits)
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append((p + a, [-100] * len(p) + a))
    fit(model, examples, steps, seed, tokenizer.pad_token_id)


def fit(model, examples: list[tuple[list[int], list[int]]], steps: int, seed: int, pad_id: int,
        extra: Any = None, image_token_id: int | None = None, batch: int = 32, decay: bool = False) -> None:
    """Supervised steps (AdamW, lr 3e-3) on batches of ``batch`` examples (ids, labels with -100 off the loss) drawn
    with replacement, right-padded where their lengths differ. ``extra(rows)``: more inputs of a batch (a vision
    model's images, whose placeholders are ``image_token_id``). ``decay``: the rate warms up over 50 steps, then
    falls to 0 on a cosine (a model that must be exact, not just close)."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rate = (lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps))) if decay else (lambda s: 1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    model.train()
    for _ in range(steps):
        rows = [examples[i] for i in torch.randint(0, len(examples), (batch,), generator=g).tolist()]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([r + [pad_id] * (width - len(r)) for r, _ in rows])
        labels = torch.tensor([x + [-100] * (width - len(x)) for _, x in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
        more = {} if extra is None else {**extra(len(rows)), "mm_token_type_ids": (ids == image_token_id).int()}
        loss = model(input_ids=ids, attention_mask=None if bool(mask.all()) else mask, labels=labels, **more).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()


def build_policy(tokenizer, train_pairs, seed: int = 0, warm_steps: int = 60, heads: int = 4, kv_heads: int = 2,
                 max_positions: int = 64):
    """The toy policy: a 2-layer Qwen2 (hidden 64) warm-started on the task. heads=2 gives head size 32, the
    smallest vLLM's CPU attention takes (the vLLM end-to-end test uses it)."""
    import torch
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


TEACHER_STEPS = 240
"""Supervised steps of the toy teacher (the student starts from 60 of them, 0.269): held-out greedy reward 0.86 at 160
steps, 1.0 at 240 and 400, measured on the 2-core machine."""


def prepare_teacher(path: str = "runs/toy_teacher_assets", seed: int = 0, steps: int = TEACHER_STEPS
                    ) -> dict[str, str]:
    """Build (once) on-policy distillation's toy teacher (``distill.teacher toy_teacher``): the toy policy with the
    student's tokenizer, supervised on the task for ``steps`` steps, and the same data files."""
    def build(tmp: str) -> None:
        tokenizer = build_tokenizer(os.path.join(tmp, "model"))
        train_pairs, val_pairs = split_pairs(seed)
        write_jsonl(os.path.join(tmp, "data", "train.jsonl"), train_pairs, repeats=1)
        write_jsonl(os.path.join(tmp, "data", "val.jsonl"), val_pairs, repeats=1)
        build_policy(tokenizer, train_pairs, seed, steps).save_pretrained(os.path.join(tmp, "model"))

    return build_once(path, build)


def _complete(path: str, data: str = "jsonl") -> bool:
    return (os.path.exists(os.path.join(path, "model", "model.safetensors"))
            and os.path.exists(os.path.join(path, "data", f"val.{data}")))


def prepare(path: str = "runs/toy_assets", seed: int = 0, warm_steps: int = 60,
            digits: tuple[int, int] = (DIGITS, DIGITS)) -> dict[str, str]:
    """Build (once) the tokenizer, the warm-started model and the data files; returns their paths.
    ``digits`` (lo, hi) other than the default makes the long-tail variant (answers of 2 lo to 2 hi tokens with
    the eos; bench/compare_trl.py --case long-tail), with room in the model for the longest prompt + answer."""
    def build(tmp: str) -> None:
        tokenizer = build_tokenizer(os.path.join(tmp, "model"))
        train_pairs, val_pairs = split_pairs(seed, digits=digits)
        write_jsonl(os.path.join(tmp, "data", "train.jsonl"), train_pairs, repeats=1)
        write_jsonl(os.path.join(tmp, "data", "val.jsonl"), val_pairs, repeats=1)
        model = build_policy(tokenizer, train_pairs, seed, warm_steps, max_positions=max(64, 4 * digits[1] + 16))
        model.save_pretrained(os.path.join(tmp, "model"))

    return build_once(path, build)


def build_once(path: str, build, data: str = "jsonl") -> dict[str, str]:
    """The paths of a toy build under ``path``; ``build(folder)`` writes one (model/ and data/, its files
    ``train.<data>`` and ``val.<data>``) the first time."""
    model_dir, data_dir = os.path.join(path, "model"), os.path.join(path, "data")
    out = {"model": model_dir, "train": os.path.join(data_dir, f"train.{data}"),
           "val": os.path.join(data_dir, f"val.{data}")}
    if _complete(path, data):
        return out
    # built in a folder of this process's own and renamed into place: nodes that share the output folder may build
    # at once, and the first rename wins (a folder is renamed onto an empty one or not at all)
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "data"))
    build(tmp)
    try:
        os.rename(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _complete(path, data):
            raise ValueError(f"{path} holds an incomplete toy build; remove the folder and run again") from None
    return out


# ---- the tool variant: the digits behind a tool call

TOOL_SPECIAL = ["<|im_start|>", "<|im_end|>"]
TOOL_WORDS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "user", "assistant",
              '"name"', '"arguments"', '"lookup"', '"key"']
TOOL_CHARS = list(dict.fromkeys("0123456789,{}\":_ .'\n()[]=-" + string.ascii_letters))
TOOL_TEMPLATE = ("{%- for m in messages -%}"
                 "{%- if m['role'] == 'tool' -%}"
                 "{{ '<|im_start|>user\\n<tool_response>' + m['content'] + '</tool_response><|im_end|>\\n' }}"
                 "{%- else -%}"
                 "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{%- endif -%}"
                 "{%- endfor -%}"
                 "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
TOOL_KEY_DIGITS = 4
TOOL_WARM_STEPS = 260


def lookup(key: str) -> str:
    """Look up the digits stored under a key.

    Args:
        key: The four-digit key from the question.
    """
    if not isinstance(key, str) or len(key) != TOOL_KEY_DIGITS or not key.isdigit():  # JSON may give a list
        raise ValueError(f"a key is {TOOL_KEY_DIGITS} digits, got {key!r}")
    return example(tool_digits(key))[0]


def tool_digits(key: str) -> tuple[int, ...]:
    """The digits behind a key: a fixed pseudo-random function of it (nothing to learn from the key itself)."""
    rng = random.Random(f"toy-tool-{key}")
    return tuple(rng.randrange(10) for _ in range(DIGITS))


def tool_call_text(key: str) -> str:
    return '<tool_call>{"name":"lookup","arguments":{"key":"' + key + '"}}</tool_call>'


def build_tool_tokenizer(path: str, words: tuple[str, ...] = ()):
    """The tool task's tokenizer; ``words``: more whole-word tokens after its own (the toy judge's think tags)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + TOOL_SPECIAL + TOOL_WORDS + TOOL_CHARS + list(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in TOOL_WORDS + list(words)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<bos>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<eos>"])
    fast.chat_template = TOOL_TEMPLATE
    fast.save_pretrained(path)
    return fast


def split_keys(seed: int = 0, num_train: int = 2000, num_val: int = 100) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    seen: dict[str, None] = {}
    while len(seen) < num_train + num_val:
        seen["".join(str(rng.randrange(10)) for _ in range(TOOL_KEY_DIGITS))] = None
    keys = list(seen)
    return keys[:num_train], keys[num_train:]


def write_tool_jsonl(path: str, keys: list[str]) -> None:
    with open(path, "w") as f:
        for i, key in enumerate(keys):
            answer = example(tool_digits(key))[1]
            f.write(json.dumps({"prompt": [{"role": "user", "content": key}], "data_source": "toy",
                                "reward_model": {"ground_truth": answer, "style": "rule"},
                                "extra_info": {"index": i}}) + "\n")


def tool_episode(tokenizer, key: str) -> tuple[list[int], list[int]]:
    """The ids of a solved episode as the multi-turn rollout builds it, and its labels (-100 off the sampled turns):
    the prompt, the tool call, the observation (lib.multi_turn.render), the answer."""

    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    end = tokenizer.eos_token
    prompt = enc(tokenizer.apply_chat_template([{"role": "user", "content": key}], add_generation_prompt=True,
                                               tokenize=False))
    call = enc(tool_call_text(key) + end)
    obs = ObservationRenderer(tokenizer).observation_ids([tool_message("lookup", lookup(key))], end)
    answer = enc(example(tool_digits(key))[1] + end)
    ids = prompt + call + obs + answer
    labels = [-100] * len(prompt) + call + [-100] * len(obs) + answer
    return ids, labels


def warm_start_tool(model, tokenizer, keys: list[str], steps: int, seed: int) -> None:
    """Supervised steps on whole solved episodes (loss on the sampled turns only), so the format is known."""
    fit(model, [tool_episode(tokenizer, key) for key in keys], steps, seed, tokenizer.pad_token_id)


def prepare_tool(path: str = "runs/toy_tool_assets", seed: int = 0, warm_steps: int = TOOL_WARM_STEPS,
                 heads: int = 4, kv_heads: int = 2) -> dict[str, str]:
    """Build (once) the tool variant's tokenizer, warm-started model and data files; returns their paths. heads=2
    gives head size 32, the smallest vLLM's CPU attention takes."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    def build(tmp: str) -> None:
        tokenizer = build_tool_tokenizer(os.path.join(tmp, "model"))
        train_keys, val_keys = split_keys(seed)
        write_tool_jsonl(os.path.join(tmp, "data", "train.jsonl"), train_keys)
        write_tool_jsonl(os.path.join(tmp, "data", "val.jsonl"), val_keys)
        torch.manual_seed(seed)
        eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<eos>")]
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
                             tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
                             bos_token_id=tokenizer.bos_token_id)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        warm_start_tool(model, tokenizer, train_keys, warm_steps, seed)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = eos
        model.save_pretrained(os.path.join(tmp, "model"))

    return build_once(path, build)
