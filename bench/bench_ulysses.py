"""Ulysses: peak activation memory per rank at sp=1 vs sp=2 for one long sequence, and the all-to-all share.

    python bench/bench_ulysses.py [--seq 8192] [--hidden 256] [--layers 4]

CPU, gloo, one process per rank (2 ranks for sp=2). Memory is each rank's peak RSS growth during one
forward+backward of the policy loss (the model is already built, so this is activations and gradients);
the all-to-all share is the wall time inside the exchanges over the step's wall time.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lib.testing import run_distributed  # noqa: E402


def _body(path: str, sp: int, seq: int):
    from lib import ulysses
    from lib.config import ModelConfig, FSDPConfig
    from lib.dist import init_topology
    from lib.forward import response_log_probs
    from lib.fsdp import build_sharded_model
    from lib.protocol import DataProto

    torch.set_num_threads(1)
    topo = init_topology(device="cpu", sp_size=sp)
    model = build_sharded_model(ModelConfig(path=path), FSDPConfig(), topo)
    prompt = 64
    ids = torch.randint(3, 1000, (1, seq))
    mask = torch.ones(1, seq, dtype=torch.long)
    data = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(seq)[None],
                                "responses": ids[:, prompt:]})
    spent = [0.0]
    plain = ulysses._exchange

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = plain(*a, **k)
        spent[0] += time.perf_counter() - t0
        return out

    ulysses._exchange = timed
    small = DataProto.from_dict({k: v[:, :256] for k, v in data.batch.items()
                                                           if k != "responses"} | {"responses": ids[:, prompt:256]})
    response_log_probs(model, small, sp=topo)[0].sum().backward()  # one-time set-up costs out of the figure
    model.zero_grad(set_to_none=True)
    spent[0] = 0.0
    saved: dict[int, int] = {}

    def pack(t):  # activations autograd keeps for backward (weights, the leaves, excluded)
        if not (t.is_leaf and t.requires_grad):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = response_log_probs(model, data, sp=topo)
    logp.sum().backward()
    elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {"peak_mb": peak / 1024, "saved_mb": sum(saved.values()) / 2**20, "step_s": elapsed, "a2a_s": spent[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, Qwen2Config

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Qwen2Config(vocab_size=1024, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=args.seq, tie_word_embeddings=False)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
        (one,) = run_distributed(_body, tmp, 1, args.seq, world_size=1, timeout=900)
        two = run_distributed(_body, tmp, 2, args.seq, world_size=2, timeout=900)
    print(f"one sequence of {args.seq} tokens, Qwen2 hidden {args.hidden} x {args.layers} layers, fwd+bwd, CPU/gloo")
    print(f"{'':<10}{'saved activations MB/rank':>27}{'peak RSS MB/rank':>18}{'step s':>9}{'all-to-all s':>14}{'share':>7}")
    print(f"{'sp=1':<10}{one['saved_mb']:>27.0f}{one['peak_mb']:>18.0f}{one['step_s']:>9.2f}{'-':>14}{'-':>7}")
    saved2, peak2 = max(r["saved_mb"] for r in two), max(r["peak_mb"] for r in two)
    step2, a2a2 = max(r["step_s"] for r in two), max(r["a2a_s"] for r in two)
    print(f"{'sp=2':<10}{saved2:>27.0f}{peak2:>18.0f}{step2:>9.2f}{a2a2:>14.2f}{a2a2 / step2:>7.0%}")
    print(f"per rank, sp=2 / sp=1: saved activations {saved2 / one['saved_mb']:.2f}x, "
          f"peak RSS growth {peak2 / one['peak_mb']:.2f}x")


if __name__ == "__main__":
    main()
