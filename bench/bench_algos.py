"""Vectorized RL math vs the plain references, printed as ratios measured in the same run.

    python bench/bench_algos.py [--batch 16384] [--n 16] [--vocab 151936] [--tokens 4096] [--device auto]
                                [--head-tokens 4096] [--hidden 1536] [--only advantages|logprobs|head|filters]

1. GRPO and RLOO advantages at B sequences in groups of n: ms for lib/algos.py vs lib/algos_ref.py.
2. Token log-probs (+ entropy) from logits (tokens x vocab): peak extra memory and time of the chunked
   version vs the naive ``log_softmax(logits.float()).gather(...)``. On CUDA memory is the allocator's peak;
   on CPU it is the peak RSS growth of a fresh process per variant (so the numbers do not share an allocator).
3. The LM head and the log-probs from hidden states (head tokens x hidden, a vocab x hidden head), forward and
   backward into both: the head's logits then the chunked log-probs (lib.logprobs.log_probs_from_logits, what a
   forward with fused_head off does) vs the fused head (lib.logprobs.head_log_probs); memory and time as in 2.
4. The fused head with the entropy over top-k/top-p kept sets (the counts given, as the update takes them) vs the
   same over the whole vocabulary, per filter (``--only filters``); time and memory as in 2.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from lib import algos, algos_ref  # noqa: E402
from lib.logprobs import head_log_probs, kept_mask, log_probs_from_logits  # noqa: E402


def bench_advantages(batch: int, n: int) -> None:
    g = torch.Generator().manual_seed(0)
    T = 16
    rewards = torch.zeros(batch, T)
    rewards[:, -1] = torch.randint(0, 2, (batch,), generator=g).float()
    mask = torch.ones(batch, T)
    index = np.array([f"uid-{i // n}" for i in range(batch)], dtype=object)
    print(f"advantages: B={batch}, n={n} ({batch // n} groups), string uids, CPU")
    print(f"{'estimator':<12}{'vectorized ms':>15}{'loop ms':>12}{'speed-up':>10}")
    for name, fast, slow in (("grpo", algos.grpo, algos_ref.grpo_ref), ("rloo", algos.rloo, algos_ref.rloo_ref)):
        fast(rewards, mask, index)
        t0 = time.perf_counter()
        for _ in range(5):
            a = fast(rewards, mask, index)[0]
        t_fast = (time.perf_counter() - t0) / 5 * 1e3
        t0 = time.perf_counter()
        b = slow(rewards, mask, index)[0]
        t_slow = (time.perf_counter() - t0) * 1e3
        assert torch.allclose(a, b, atol=1e-5), name
        print(f"{name:<12}{t_fast:>15.1f}{t_slow:>12.1f}{t_slow / t_fast:>9.0f}x")


def _measure(run, device: str) -> dict:
    """Peak extra memory (bytes) and best-of-3 ms of ``run``: the allocator's peak on CUDA, RSS growth on CPU."""
    if device == "cuda":
        run()  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:  # the high-water mark only rises: take it before the first call, with the inputs already touched
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        run()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"peak_extra_bytes": peak, "ms": min(times) * 1e3}


def _variant(name: str, device: str, *args) -> dict:
    """``name(*args)`` of this module: here on CUDA (the allocator's peak is reset per variant), in a new Python
    process on CPU (ru_maxrss is a high-water mark: each variant needs its own)."""
    if device == "cuda":
        out = globals()[name](*args)
        torch.cuda.empty_cache()
        return out
    code = (f"import sys, json; sys.path.insert(0, {ROOT!r}); from bench.bench_algos import {name} as r; "
            f"print(json.dumps(r(*{args!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_logprob_variant(variant: str, tokens: int, vocab: int, dtype: str, device: str, backward: bool) -> dict:
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    logits = torch.randn(tokens, vocab, device=device).to(dt).requires_grad_(backward)
    labels = torch.randint(0, vocab, (tokens,), device=device)

    def run():
        if variant == "naive":
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
        else:
            logp, _ = log_probs_from_logits(logits, labels)
        if backward:
            logp.sum().backward()
            logits.grad = None
        return logp

    return _measure(run, device)


def bench_logprobs(tokens: int, vocab: int, device: str) -> None:
    if device == "cuda":
        dtypes = ["bfloat16", "float32"]
    else:
        dtypes = ["float32"]
    print(f"\nlog-probs: {tokens} tokens x vocab {vocab}, {device}; peak memory beyond the logits, best-of-3 time")
    print(f"{'case':<28}{'naive GB':>10}{'chunked GB':>12}{'mem ratio':>11}{'naive ms':>10}{'chunked ms':>12}"
          f"{'time ratio':>12}")
    for dtype in dtypes:
        for backward in (False, True):
            res = {}
            for variant in ("naive", "chunked"):
                res[variant] = _variant("_run_logprob_variant", device, variant, tokens, vocab, dtype, device,
                                        backward)
            n, c = res["naive"], res["chunked"]
            case = f"{dtype} {'fwd+bwd' if backward else 'fwd'}"
            print(f"{case:<28}{n['peak_extra_bytes'] / 2**30:>10.2f}{c['peak_extra_bytes'] / 2**30:>12.2f}"
                  f"{c['peak_extra_bytes'] / max(n['peak_extra_bytes'], 1):>11.2f}{n['ms']:>10.1f}{c['ms']:>12.1f}"
                  f"{c['ms'] / n['ms']:>12.2f}")


def _run_head_variant(variant: str, tokens: int, hidden: int, vocab: int, dtype: str, device: str) -> dict:
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    h = (torch.randn(tokens, hidden, device=device) / hidden ** 0.5).to(dt).requires_grad_(True)
    w = torch.randn(vocab, hidden, device=device).to(dt).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), device=device)

    def run() -> None:
        if variant == "head+chunked":
            logp, _ = log_probs_from_logits(torch.nn.functional.linear(h, w), labels)
        else:
            logp, _ = head_log_probs(h, w, labels)
        logp.sum().backward()
        h.grad = w.grad = None

    return _measure(run, device)


def bench_head(tokens: int, hidden: int, vocab: int, device: str) -> None:
    dtypes = ["bfloat16"] if device == "cuda" else ["float32"]
    print(f"\nLM head + log-probs, fwd+bwd: {tokens} tokens x hidden {hidden} -> vocab {vocab}, {device}; peak memory "
          f"beyond the inputs, best-of-3 time")
    print(f"{'dtype':<12}{'head+chunked GB':>17}{'fused GB':>10}{'mem ratio':>11}{'head+chunked ms':>17}"
          f"{'fused ms':>10}{'time ratio':>12}")
    for dtype in dtypes:
        res = {}
        for variant in ("head+chunked", "fused"):
            res[variant] = _variant("_run_head_variant", device, variant, tokens, hidden, vocab, dtype, device)
        a, f = res["head+chunked"], res["fused"]
        print(f"{dtype:<12}{a['peak_extra_bytes'] / 2**30:>17.2f}{f['peak_extra_bytes'] / 2**30:>10.2f}"
              f"{f['peak_extra_bytes'] / max(a['peak_extra_bytes'], 1):>11.2f}{a['ms']:>17.1f}{f['ms']:>10.1f}"
              f"{f['ms'] / a['ms']:>12.2f}")


FILTERS = {"top_k 20": (20, 1.0), "top_p 0.9": (0, 0.9), "both": (20, 0.9)}


def _run_filter_variant(variant: str, tokens: int, hidden: int, vocab: int, dtype: str, device: str) -> dict:
    """The fused head with the entropy, forward and backward, plain or over a filter's kept sets (the engine's
    counts given, as the update gets them; docs/algorithms.md "Top-k and top-p sampling")."""
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    h = torch.randn(tokens, hidden, device=device).to(dt).requires_grad_(True)
    w = (torch.randn(vocab, hidden, device=device) * 4 / hidden ** 0.5).to(dt).requires_grad_(True)
    kept = None
    if variant != "plain":
        with torch.no_grad():
            kept = torch.cat([kept_mask((h[s:s + 256] @ w.T).float(), *FILTERS[variant]).sum(-1)
                              for s in range(0, tokens, 256)])
    labels = torch.randint(0, vocab, (tokens,), device=device) if kept is None else torch.zeros(
        tokens, dtype=torch.long, device=device)  # the top token: inside every set

    def run() -> None:
        logp, entropy, *_ = head_log_probs(h, w, labels, 1.0, True, kept=kept)
        (logp.sum() + 0.01 * entropy.sum()).backward()
        h.grad = w.grad = None

    out = _measure(run, device)
    out["kept"] = 0.0 if kept is None else float(kept.float().mean())
    return out


def bench_filters(tokens: int, hidden: int, vocab: int, device: str) -> None:
    dtype = "bfloat16" if device == "cuda" else "float32"
    print(f"\nfused head over top-k/top-p kept sets vs the whole vocabulary, fwd+bwd with entropy: {tokens} tokens x "
          f"hidden {hidden} -> vocab {vocab}, {dtype}, {device}; best-of-3 time")
    print(f"{'filter':<12}{'kept mean':>11}{'plain ms':>10}{'kept-set ms':>13}{'time ratio':>12}{'mem ratio':>11}")
    plain = _variant("_run_filter_variant", device, "plain", tokens, hidden, vocab, dtype, device)
    for name in FILTERS:
        f = _variant("_run_filter_variant", device, name, tokens, hidden, vocab, dtype, device)
        print(f"{name:<12}{f['kept']:>11.0f}{plain['ms']:>10.1f}{f['ms']:>13.1f}{f['ms'] / plain['ms']:>12.2f}"
              f"{f['peak_extra_bytes'] / max(plain['peak_extra_bytes'], 1):>11.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--head-tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--only", choices=["advantages", "logprobs", "head", "filters"], default=None)
    args = ap.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.only in (None, "advantages"):
        bench_advantages(args.batch, args.n)
    if args.only in (None, "logprobs"):
        bench_logprobs(args.tokens, args.vocab, device)
    if args.only in (None, "head"):
        bench_head(args.head_tokens, args.hidden, args.vocab, device)
    if args.only in (None, "filters"):
        bench_filters(args.head_tokens, args.hidden, args.vocab, device)


if __name__ == "__main__":
    main()
