"""The HF engine's decoding with room reserved for each layer's keys and values (lib/engine/kv.py) against
transformers' growing cache (a concatenation a token), in one run, on the toy policy (the embedded task's 2-layer
Qwen2) and, given its folder, a judge model.

    python bench/bench_hf_decode.py [--threads 1] [--rounds 5] [--judge runs/toy_judge_assets/model]

Prints, per case, the best of ``rounds`` calls each way (alternating) and the ratio, and checks that both decode the
same tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lib import toy  # noqa: E402
from lib.engine import SamplingConfig, hf  # noqa: E402
from lib.judges.local import checkpoint_tensors  # noqa: E402
from lib.models import load_config  # noqa: E402


def timed(engine, prompts: list[list[int]], tokens: int, reserved: bool) -> tuple[float, list[list[int]]]:
    keep = hf.reserve
    if not reserved:
        hf.reserve = lambda cache, room: cache
    try:
        t0 = time.perf_counter()
        turns = engine.generate_ids(prompts, [tokens] * len(prompts), validate=True, key=0)
        return time.perf_counter() - t0, [t.ids for t in turns]
    finally:
        hf.reserve = keep


def case(name: str, model, eos: list[int], prompts: list[list[int]], tokens: int, rounds: int) -> None:
    sp = SamplingConfig(temperature=0.0, max_new_tokens=tokens)
    engine = hf.HFEngine(model.config, torch.device("cpu"), 0, eos, sp, sp, batch_tokens=1 << 20)
    engine.wake_up()
    engine.load_weights(model.named_parameters())
    engine.finish_sync()
    best = {True: float("inf"), False: float("inf")}
    out = {}
    for _ in range(rounds):
        for reserved in (False, True):
            seconds, out[reserved] = timed(engine, prompts, tokens, reserved)
            best[reserved] = min(best[reserved], seconds)
    made = sum(map(len, out[True]))
    print(f"{name}: {len(prompts)} prompts, up to {tokens} tokens ({made} made): growing {best[False]:.3f} s, "
          f"reserved {best[True]:.3f} s, {best[False] / best[True]:.2f}x; same tokens: {out[True] == out[False]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--judge", default="", help="a judge model folder (the toy judge's: runs/toy_judge_assets/model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tok = toy.build_tokenizer(tmp)
        policy = toy.build_policy(tok, toy.split_pairs(0)[0])
        prompts = [tok(toy.example(p)[0])["input_ids"] for p in toy.split_pairs(0)[0][:64]] * 8
        for tokens in (10, 40):
            case(f"toy policy, greedy, {tokens} tokens", policy, [tok.eos_token_id], prompts, tokens, args.rounds)
    if args.judge:
        model = AutoModelForCausalLM.from_config(load_config(args.judge))
        model.load_state_dict(dict(checkpoint_tensors(args.judge)), strict=False)  # as the judge loads its weights
        jt = AutoTokenizer.from_pretrained(args.judge)
        answers = [toy.example(p)[1] for p in toy.split_pairs(0)[1]]
        drawn = (answers[i % len(answers)] for i in range(256))
        texts = [f"R:{a}\nA:{a[:k % (len(a) + 1)]}\n" for k, a in enumerate(drawn)]
        prompts = [jt.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for t in texts]
        eos = [jt.convert_tokens_to_ids("<|im_end|>")]
        case("judge, greedy, 72 tokens", model.eval(), eos, prompts, 72, args.rounds)


if __name__ == "__main__":
    main()
