"""HF engine memory at a real vocabulary: peak memory and tokens/s of ``HFEngine.generate`` against the plain decode
loop it replaced (samples expanded before the prefill, full-vocabulary logits for every prompt token, the whole
batch in one KV cache), on the same model, prompts and sampling.

    python bench/bench_engine_memory.py [--vocab 151936] [--prompts 16] [--prompt-len 64] [--n 4] [--new-tokens 16]

Each side runs in a fresh process; its peak is the growth of the process's peak resident memory (CPU) or of
torch's peak allocation (GPU) over what the loaded model holds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@torch.no_grad()
def plain_generate(model, ids, mask, n: int, new_tokens: int, seed: int) -> int:
    """The reference: what the engine did before (kept here as the baseline). Returns generated tokens."""
    from transformers import DynamicCache

    ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    gen = torch.Generator(device=ids.device).manual_seed(seed)
    cache, step_ids, step_pos, count = DynamicCache(), ids, pos, 0
    for _ in range(new_tokens):
        logits = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=cache,
                       use_cache=True).logits[:, -1].float()
        token = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(-1)
        count += token.numel()
        step_ids, step_pos = token[:, None], step_pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return count


def _peak_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def side(which: str, args: argparse.Namespace, results) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from lib.engine import SamplingConfig
    from lib.engine.hf import HFEngine
    from lib.protocol import DataProto

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.prompts,), generator=g)
    mask = (torch.arange(args.prompt_len)[None] >= args.prompt_len - lengths[:, None]).long()
    ids = torch.randint(0, args.vocab, mask.shape, generator=g) * mask
    ids, mask = ids.to(device), mask.to(device)
    sampling = SamplingConfig(temperature=1.0, n=args.n, max_new_tokens=args.new_tokens)
    if which == "engine":
        engine = HFEngine(config, device, 0, [-1], sampling, dtype=dtype, batch_tokens=args.batch_tokens)
        engine.wake_up()
        engine.load_weights(model.named_parameters())
        del model
        data = DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                    "position_ids": (mask.cumsum(1) - 1).clamp(min=0)})
        run = lambda: engine.generate(data).meta_info["generated_tokens"]  # noqa: E731
    else:
        run = lambda: plain_generate(model, ids, mask, args.n, args.new_tokens, 0)  # noqa: E731
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else _peak_gb(device)
    t0 = time.perf_counter()
    tokens = run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    results.put((which, _peak_gb(device) - base, tokens / elapsed))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch-tokens", type=int, default=65536)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    out = {}
    for which in ("plain", "engine"):
        p = ctx.Process(target=side, args=(which, args, results))
        p.start()
        p.join()
        out[which] = results.get(timeout=5)[1:]
    (plain_gb, plain_tps), (eng_gb, eng_tps) = out["plain"], out["engine"]
    print(f"vocab {args.vocab}, {args.prompts} prompts x {args.prompt_len} tokens, n={args.n}, "
          f"{args.new_tokens} new tokens")
    print(f"plain decode: peak +{plain_gb:.3f} GB, {plain_tps:.0f} tokens/s")
    print(f"HF engine:    peak +{eng_gb:.3f} GB, {eng_tps:.0f} tokens/s")
    print(f"ratio engine/plain: memory {eng_gb / max(plain_gb, 1e-9):.3f}x, tokens/s {eng_tps / plain_tps:.2f}x")


if __name__ == "__main__":
    main()
