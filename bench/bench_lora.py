"""LoRA against full fine-tuning: update step time, peak memory and the bytes each sync sends.

    python bench/bench_lora.py [--model toy|qwen] [--rank 8] [--rows 64] [--device auto]

Each mode runs in a fresh process. Peak memory: on GPU the allocator's peak over the timed updates
(``torch.cuda.max_memory_allocated``: weights, state and activations); on CPU the largest rise of the resident memory
during the timed updates over what the process held before them (sampled every millisecond: activations, gradients
and the optimizer's transients; the weights and moments held throughout are the next line). Also exact bytes of the
training state (parameters, gradients, AdamW moments) and of a sync (full model, or the adapter after the first one). ``--model toy``: the embedded toy policy (lib/toy.py);
``qwen``: a Qwen2.5-shaped random model (hidden 512, 8 layers, vocabulary 16384, tied). Ratios are LoRA / full.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def model_path(kind: str, root: str) -> str:
    if kind == "toy":
        from lib import toy

        return toy.prepare(os.path.join(root, "toy_assets"))["model"]
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = os.path.join(root, "qwen")
    if not os.path.isdir(path):
        cfg = Qwen2Config(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                          tie_word_embeddings=True)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0):
    from tests.helpers import rl_batch

    data = rl_batch(rows, prompt_len=prompt, response_len=response, seed=seed, min_prompt=prompt // 2,
                    min_response=response // 2)
    for key in ("input_ids", "prompts", "responses"):
        data.batch[key] = data.batch[key] % vocab
    g = torch.Generator().manual_seed(seed)
    data.batch["advantages"] = torch.randn(data.batch["response_mask"].shape, generator=g) * data.batch["response_mask"]
    return data


class RssPeak:
    """The largest rise of this process's resident memory inside the block, sampled every millisecond."""

    def __enter__(self) -> "RssPeak":
        import threading

        from lib.engine.vllm import resident_gb

        self._read, self._stop = resident_gb, threading.Event()
        self.start = self.peak = resident_gb()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._read())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.rise = int((max(self.peak, self._read()) - self.start) * 2**30)


def run_mode(path: str, rank: int, rows: int, prompt: int, response: int, device: str, repeats: int) -> dict:
    """One mode in this process: build, warm up, time ``repeats`` updates, measure memory and sync bytes."""
    from lib import lora
    from lib.actor import Trainee, update_policy
    from lib.config import ActorConfig, LoraConfig, ModelConfig, OptimConfig
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model, iter_full_params
    from lib.models import load_config
    from lib.optim import build_optimizer

    topo = init_topology(device=device)
    cuda = topo.device.type == "cuda"
    cfg = ActorConfig(model=ModelConfig(path=path), optim=OptimConfig(lr=1e-4), lora=LoraConfig(rank=rank))
    cfg.batching.micro_batch_size_per_rank = 8
    model = build_sharded_model(cfg.model, cfg.fsdp, topo, lora_cfg=cfg.lora if rank else None)
    trainee = Trainee(model, *build_optimizer(model, cfg.optim), topo)
    data = batch(rows, prompt, response, load_config(path).vocab_size)
    update_policy(trainee, data, cfg)  # warm-up; AdamW's moments exist from here on
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    with RssPeak() as rss:
        for _ in range(repeats):
            t0 = time.perf_counter()
            update_policy(trainee, data, cfg)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    trained = [p for p in model.parameters() if p.requires_grad]
    state = sum(p.numel() * p.element_size() for p in model.parameters())
    state += sum(2 * p.numel() * 4 for p in trained)  # gradients are freed after the step; moments stay
    peak_grads = sum(p.numel() * p.element_size() for p in trained)
    dtype = torch.bfloat16 if cuda else torch.float32
    if rank:
        sync = sum(t.numel() * t.element_size() for _, t in lora.iter_adapter(model))
    else:
        sync = sum(t.numel() * t.element_size() for _, t in iter_full_params(model, dtype))
    peak = torch.cuda.max_memory_allocated() if cuda else rss.rise
    return {"step_s": min(times), "peak_bytes": peak, "state_bytes": state + peak_grads, "sync_bytes": sync,
            "trained": sum(p.numel() for p in trained), "params": sum(p.numel() for p in model.parameters()),
            "device": str(topo.device)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["toy", "qwen"], default="qwen")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # one mode, in its own process
        rank = int(args.child.split(":")[1])
        print(json.dumps(run_mode(args.child.split(":", 2)[2], rank, args.rows, args.prompt, args.response,
                                  args.device, args.repeats)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, tmp)
        results = {}
        for name, rank in (("full", 0), ("lora", args.rank)):
            env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(29500 + os.getpid() % 1000 + rank)}
            cmd = [sys.executable, os.path.abspath(__file__), "--child", f"x:{rank}:{path}", "--rows", str(args.rows),
                   "--prompt", str(args.prompt), "--response", str(args.response), "--repeats", str(args.repeats),
                   "--device", args.device]
            out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
            if out.returncode:
                sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    full, lo = results["full"], results["lora"]
    mib = 2**20
    print(f"LoRA rank {args.rank} (every linear layer of the decoder) vs full fine-tuning, model {args.model} "
          f"({full['params'] / 1e6:.2f}M params), {args.rows} rows of {args.prompt}+{args.response} tokens, "
          f"{full['device']}, one process")
    print(f"  {'':<34}{'full':>12}{'lora':>12}{'lora/full':>11}")
    for label, key, scale, fmt in (("update step (s, best of repeats)", "step_s", 1, ".3f"),
                                   ("peak memory of the update (MiB)", "peak_bytes", mib, ".1f"),
                                   ("params+grads+AdamW state (MiB)", "state_bytes", mib, ".1f"),
                                   ("sync per step (MiB)", "sync_bytes", mib, ".3f"),
                                   ("trained parameters (M)", "trained", 1e6, ".3f")):
        a, b = full[key] / scale, lo[key] / scale
        print(f"  {label:<34}{a:>12{fmt}}{b:>12{fmt}}{b / a if a else float('nan'):>10.3f}x")
    print("  (LoRA's sync sends the base once, then the adapter; full fine-tuning sends the whole model each step)")


if __name__ == "__main__":
    main()
