"""The toy judge (``judge.path toy_judge``): a tiny reasoning model trained offline to grade the embedded digit task,
so that a run rewarded by its verdicts alone can be set beside one rewarded by the rule.

It reads the reference answer and the response through its own prompt (``template.txt`` of the build: the
reference just before the response, so their characters sit a fixed distance apart) and its own ChatML-shaped
tokenizer (the tool task's, with ``<think>`` tags), thinks, then answers ``Score: N``. Its thinking goes through the
response slot by slot: the slot's letter, the response's character there, the answer's (``_`` past either end),
``=`` where they are the same character (``-`` where not) and the correct prefix so far; it stops after the first
slot where both have ended:

    answer 5,1,7,3, response 5,2,7:   <think>a55=1b,,=2c21-2d,,=2e77=2f_,-2g_3-2h__-2</think>Score: 3

N = round(10 x prefix / slots), the rule's reward (lib.rewards.builtin.toy) on a 0-10 scale. Each token it writes is
a lookup a small transformer learns exactly: a character read at a fixed place, the comparison of the two before,
the prefix from the mark and the count before. Measured on the 2-core AMD machine, 1600 held-out graded responses
(right, nearly right, partly right, random): builds of seeds 0 and 1 score 1600 and 1597 exactly in 360 steps (1600
and 1600 in 500 steps, 1596 and 1594 in 300; 360 take ~3 minutes on one thread). Without the mark (the
count compared the characters itself) builds of 500 steps scored 80-100% exactly, by seed; judges that graded in
one token, from the whole strings, followed their labels at correlation 0.8-0.9 only, and the policy gamed every one
of them (the rule's held-out reward fell 0.27 -> 0.0-0.07 in 60 steps).
"""

from __future__ import annotations

import os
import random

from lib import toy
from lib.rewards.builtin import toy as rule

TEMPLATE = "R:{reference}\nA:{response}\n"
THINK = ("<think>", "</think>")
SLOTS = "abcdefghijk"  # a response of up to 10 characters, then the slot where both have ended
STEPS = 360
LAYERS = 4
HIDDEN = 128
BATCH = 64
ALPHABET = "".join(toy.CHARS)  # the toy policy's own characters: digits and the comma


def reasoning(response: str, answer: str) -> tuple[str, int]:
    """The toy judge's whole answer (its thinking, then ``Score: N``) and N, for a response to an answer."""
    prefix, slots, j = 0, [], 0
    while True:
        x = response[j] if j < len(response) else "_"
        y = answer[j] if j < len(answer) else "_"
        same = x == y != "_"
        prefix += same and prefix == j
        slots.append(f"{SLOTS[j]}{x}{y}{'=' if same else '-'}{prefix}")
        if x == y == "_":
            break
        j += 1
    n = label(response, answer)
    return f"{THINK[0]}{''.join(slots)}{THINK[1]}Score: {n}", n


def grade(response: str, answer: str) -> float:
    """What the toy judge is taught: the rule's reward (the correct prefix over the longer of the two)."""
    return rule(response, answer)["score"]


def label(response: str, answer: str) -> int:
    """The verdict's N: ``grade`` on the 0-10 scale, rounded."""
    return round(10 * grade(response, answer))


def responses(answer: str, rng: random.Random) -> str:
    """A response to grade, in the policy's alphabet (digits and commas), of up to 10 characters: the answer; its
    first k characters, then a wrong one, then its own rest or random ones (k uniform: every slot's comparison is
    taught as often wrong as right, where a learning policy samples); cut short; each character the answer's with a
    chance drawn per response, else any (commas anywhere); or its digits each right or not."""
    kind = rng.random()
    if kind < 0.05:
        return answer
    if kind < 0.6:
        k = rng.randrange(len(answer) + 1)
        wrong = rng.choice([c for c in ALPHABET if k == len(answer) or c != answer[k]])
        rest = answer[k + 1:] if rng.random() < 0.5 else \
            "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 10 - k)))
        return answer[:k] + wrong + rest
    if kind < 0.65:
        return answer[:rng.randrange(len(answer))]
    if kind < 0.9:
        n = len(answer) if rng.random() < 0.5 else rng.randrange(0, 11)
        right = rng.random()
        return "".join(answer[i] if i < len(answer) and rng.random() < right else rng.choice(ALPHABET)
                       for i in range(n))
    right = rng.random()
    return "".join(c if c == "," or rng.random() < right else rng.choice(ALPHABET[:-1]) for c in answer)


def examples(tokenizer, graded: list[tuple[str, str, str]]) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of each (question, answer, response): the judge's chat prompt, then its thinking, verdict and end
    of turn (the loss on those). The chat template is rendered once around a mark (it leaves the message as it is)
    and the texts tokenized together: a build makes 23k of them."""
    mark = "\x00"
    before, after = tokenizer.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=True,
                                                  tokenize=False).split(mark)
    prompts = [before + TEMPLATE.format(question=q, reference=a, response=r) + after for q, a, r in graded]
    verdicts = [reasoning(r, a)[0] for _, a, r in graded]
    ps = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    vs = tokenizer(verdicts, add_special_tokens=False)["input_ids"]
    return [(p + v + [tokenizer.eos_token_id], [-100] * len(p) + v + [tokenizer.eos_token_id]) for p, v in zip(ps, vs)]


SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_judge.safetensors")
"""The weights of the build of seed 0, ``STEPS`` steps of ``BATCH`` (made on the 2-core AMD EPYC by ``python -m
lib.judges.toy --ship``): the build of those settings loads them instead of training (~3 min on one thread, 11 min
on a loaded 2-core machine, in every fresh checkout's test command). The file records the settings it was made
with; a build of other settings (another seed, a changed size) trains, as does ``shipped=False``."""


def _signature(seed: int, steps: int, batch: int) -> dict[str, str]:
    return {"seed": str(seed), "steps": str(steps), "batch": str(batch), "layers": str(LAYERS),
            "hidden": str(HIDDEN), "slots": SLOTS, "template": TEMPLATE}


def _load_shipped(model, seed: int, steps: int, batch: int) -> bool:
    """The shipped weights into ``model`` where they were made with these settings; False where not."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    if not os.path.isfile(SHIPPED):
        return False
    with safe_open(SHIPPED, "pt") as f:
        made = f.metadata() or {}  # safetensors adds its note of the tied head beside the settings
        if any(made.get(k) != v for k, v in _signature(seed, steps, batch).items()):
            return False
    load_model(model, SHIPPED)  # strict: every weight of the model, no other
    return True


def build(tokenizer, pairs, seed: int = 0, steps: int = STEPS, batch: int = BATCH, shipped: bool = True):
    """The toy judge: a 4-layer GPT-2-shaped model without dropout (learned positions: the characters it reads sit
    at fixed places), trained on a fresh graded response per drawn example, the rate decaying to 0 (or, for the
    settings the shipped weights were made with, those weights: ``SHIPPED``)."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(seed)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<eos>")]
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=128,
                        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        pad_token_id=tokenizer.pad_token_id, eos_token_id=eos[0], bos_token_id=tokenizer.bos_token_id)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if not (shipped and _load_shipped(model, seed, steps, batch)):
        rng = random.Random(seed)
        graded = []
        for _ in range(steps * batch):
            question, answer = toy.example(pairs[rng.randrange(len(pairs))])
            graded.append((question, answer, responses(answer, rng)))
        toy.fit(model, examples(tokenizer, graded), steps, seed, tokenizer.pad_token_id, batch=batch, decay=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos
    return model


def prepare(path: str = "runs/toy_judge_assets", seed: int = 0, steps: int = STEPS) -> dict[str, str]:
    """Build (once) the toy judge's model folder, its ``template.txt`` and the toy task's data files; returns their
    paths (``template`` among them)."""
    def make(tmp: str) -> None:
        tokenizer = toy.build_tool_tokenizer(os.path.join(tmp, "model"), words=THINK)
        train_pairs, val_pairs = toy.split_pairs(seed)
        toy.write_jsonl(os.path.join(tmp, "data", "train.jsonl"), train_pairs, repeats=1)
        toy.write_jsonl(os.path.join(tmp, "data", "val.jsonl"), val_pairs, repeats=1)
        with open(os.path.join(tmp, "model", "template.txt"), "w") as f:
            f.write(TEMPLATE)
        build(tokenizer, train_pairs, seed, steps).save_pretrained(os.path.join(tmp, "model"))

    out = toy.build_once(path, make)
    return {**out, "template": os.path.join(out["model"], "template.txt")}


def ship() -> None:
    """Train the build of seed 0 (``STEPS`` steps) and write its weights to ``SHIPPED``."""
    import tempfile

    from safetensors.torch import save_model

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = toy.build_tool_tokenizer(os.path.join(tmp, "model"), words=THINK)
        train_pairs, _ = toy.split_pairs(0)
        save_model(build(tokenizer, train_pairs, 0, STEPS, BATCH, shipped=False), SHIPPED,
                   metadata=_signature(0, STEPS, BATCH))
    print(f"wrote {SHIPPED}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--ship"]:
        sys.exit("usage: python -m lib.judges.toy --ship   (train the toy judge of seed 0 and write its weights)")
    ship()
