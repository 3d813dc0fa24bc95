"""The toy judge (``judge.path toy_judge``): a tiny model trained offline to grade the embedded digit task, so that
a judged run can be compared with the rule reward's.

It reads the question, the reference answer and the response through its own prompt (``template.txt`` of the
build: short, the reference just before the response so that their characters sit a fixed distance apart) and its
own ChatML-shaped tokenizer (the tool task's), and answers ``Score: N``, N = round(10 x ``grade``). Trained with
supervised steps on responses of the policy's alphabet (the answer, its digits right or not, prefixes of it,
shifted and random strings). Built once under ``runs/toy_judge_assets`` like the toy policy; its data files are
the toy task's.

What it is not (measured, 2-core CPU): a grader the policy cannot game. Its scores follow its grade on held-out
graded responses (correlation 0.81), but GRPO on its verdicts alone finds strings it over-rates, and the rule's
held-out reward falls (0.269 -> 0.07 in 60 steps with this judge; to 0.04 and 0.0 with a GPT-2-shaped judge
trained with dropout and a Qwen2-shaped one).
"""

from __future__ import annotations

import os
import random

from lib import toy

TEMPLATE = "Q:{question}\nR:{reference}\nA:{response}\n"
STEPS = 300
LAYERS = 4
HIDDEN = 128
BATCH = 64


def grade(response: str, answer: str) -> float:
    """What the toy judge is taught: the share of positions where the response has the answer's character, over the
    longer of the two (an extra character costs as much as a missing one). A grader's own view of the task, equal to
    the rule's (the correct prefix over the longer, lib.rewards.builtin.toy) at both ends and kinder between: a
    comparison character by character, which a tiny model learns (it did not learn the rule's prefix as well)."""
    matches = sum(a == b for a, b in zip(response, answer))
    return matches / max(len(answer), len(response), 1)


def label(response: str, answer: str) -> int:
    """The verdict's N: ``grade`` on the 0-10 scale, rounded."""
    return round(10 * grade(response, answer))


def responses(answer: str, rng: random.Random) -> str:
    """A response to grade, in the policy's alphabet (digits and commas), mostly of the answer's own shape so that
    only its characters tell: the answer itself, its digits each right or not, one or two characters changed, its
    first k characters then random ones, a character put in or left out (the rest shifted), or any string of up to
    10 characters (what a policy that games its judge tries first)."""
    alphabet, digits = "0123456789,", "0123456789"
    kind = rng.random()
    out = list(answer)
    if kind < 0.15:
        return answer
    if kind < 0.5:
        right = rng.random()
        return "".join(c if c == "," or rng.random() < right else rng.choice(digits) for c in answer)
    if kind < 0.65:
        for _ in range(rng.randrange(1, 3)):
            out[rng.randrange(len(out))] = rng.choice(alphabet)
        return "".join(out)
    if kind < 0.8:
        keep = rng.randrange(len(answer) + 1)
        out = out[:keep]
        while len(out) < rng.randrange(max(keep, 1), len(answer) + 4):
            out.append(rng.choice(alphabet))
        return "".join(out)
    if kind < 0.9:
        at = rng.randrange(len(out) + 1)
        return "".join(out[:at] + [rng.choice(alphabet)] + out[at:]) if rng.random() < 0.5 else \
            "".join(out[:at] + out[at + 1:])
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 11)))


def example(tokenizer, question: str, answer: str, response: str) -> tuple[list[int], list[int]]:
    """(ids, labels): the judge's chat prompt, then its verdict and end of turn (the loss on the verdict only)."""
    text = TEMPLATE.format(question=question, reference=answer, response=response)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
    enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    p = enc["input_ids"]
    # the response's characters that repeat the answer's are targets too: they teach the judge to read the answer's
    # character at the same place (a fixed distance back), which its verdict needs
    start = prompt.index(text) + text.index("\nA:") + 3
    copied = {start + i for i, (a, b) in enumerate(zip(response, answer)) if a == b}
    own = [t if begin in copied else -100 for t, (begin, _) in zip(p, enc["offset_mapping"])]
    v = tokenizer(f"Score: {label(response, answer)}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p + v, own + v


def build(tokenizer, pairs, seed: int = 0, steps: int = STEPS, examples_per_pair: int = 8, batch: int = BATCH):
    """The toy judge: a 4-layer GPT-2-shaped model without dropout, trained on ``examples_per_pair`` graded responses
    to each training prompt. Learned positions: with them it learns, in part, to read the answer's character at the
    same place; Qwen2-shaped (RoPE) models of 4 layers, trained on up to five times as many examples, graded by
    length and shape alone (measured)."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    rng = random.Random(seed)
    data = []
    for digits in pairs:
        question, answer = toy.example(digits)
        data += [example(tokenizer, question, answer, responses(answer, rng)) for _ in range(examples_per_pair)]
    torch.manual_seed(seed)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<eos>")]
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=128,
                        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        pad_token_id=tokenizer.pad_token_id, eos_token_id=eos[0], bos_token_id=tokenizer.bos_token_id)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    toy.fit(model, data, steps, seed, tokenizer.pad_token_id, batch=batch)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos
    return model


def prepare(path: str = "runs/toy_judge_assets", seed: int = 0, steps: int = STEPS) -> dict[str, str]:
    """Build (once) the toy judge's model folder, its ``template.txt`` and the toy task's data files; returns their
    paths (``template`` among them)."""
    def make(tmp: str) -> None:
        tokenizer = toy.build_tool_tokenizer(os.path.join(tmp, "model"))
        train_pairs, val_pairs = toy.split_pairs(seed)
        toy.write_jsonl(os.path.join(tmp, "data", "train.jsonl"), train_pairs, repeats=1)
        toy.write_jsonl(os.path.join(tmp, "data", "val.jsonl"), val_pairs, repeats=1)
        with open(os.path.join(tmp, "model", "template.txt"), "w") as f:
            f.write(TEMPLATE)
        build(tokenizer, train_pairs, seed, steps).save_pretrained(os.path.join(tmp, "model"))

    out = toy.build_once(path, make)
    return {**out, "template": os.path.join(out["model"], "template.txt")}
