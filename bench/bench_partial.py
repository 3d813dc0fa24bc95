"""Partial rollouts against full ones on a task whose response lengths have a long tail: seconds a step and the
held-out reward over the same steps, side by side.

    python bench/bench_partial.py [--steps 40] [--mix 4 48 0.1] [--partial 50:1 12:8] [--over 1.5] [--prompts 64]
                                  [--engine hf|vllm] [--out runs/bench_partial]

A toy task with a heavy tail (lib/toy.py's digit reversal, built here): a prompt has SHORT digits, or with
probability SHARE LONG ones, so most responses are about 2 SHORT tokens and a few 2 LONG; its policy warm-started on
both. GRPO on 2 CPU ranks with the HF engine, whose batch decodes until its longest sample ends (as a GPU batch
does), or with ``--engine vllm`` vLLM's continuous batch (its CPU build, eager; the partial runs stop its requests
mid-call): one run generates every group to its end each step (full), the others with rollout.partial (chunks of CHUNK
tokens, a pool of --over x train_batch_size groups; the groups still generating when train_batch_size are complete go
on in the next step, dropped when their first tokens are more than STALENESS steps old). A chunk of half the longest
response lets a long group end within staleness 1, but a round then decodes as long as the tail does; a short chunk
ends the step with the short groups and leaves the long ones to later steps, staler.
Both train train_batch_size groups a step. Each run's figures land in the output folder as it ends (summary.json,
and the runs' own folders: metrics.jsonl, the log): a bench stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lib import toy  # noqa: E402


def run(out: str, name: str, args: list[str], samples: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           os.path.join(ROOT, "train_grpo.py"), "--trainer.output_root", out, "--trainer.run_name", name, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    shutil.rmtree(os.path.join(out, name), ignore_errors=True)  # a run measured afresh, never resumed
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    rows = [json.loads(line) for line in open(os.path.join(out, name, "metrics.jsonl"))]
    train = [r for r in rows if "actor/pg_loss" in r]
    later = train[1:] or train  # the first step compiles and warms caches in both
    return {"exit": code, "steps": len(train),
            "s_per_step": statistics.mean(r["timing/step_s"] for r in later),
            "generate_s": statistics.mean(r["timing/generate_s"] for r in later),
            "response_length_mean": statistics.mean(r["response/length_mean"] for r in train),
            "trained_tokens": round(sum(r["response/length_mean"] for r in train) * samples),
            "dropped_groups": round(sum(r.get("partial/dropped_groups", 0) for r in train)),
            "generated_tokens": round(sum(r.get("partial/generated_tokens", 0) for r in train)),  # partial runs
            "val": [(r["step"], round(r["val/score_mean"], 4)) for r in rows if "val/score_mean" in r],
            "partial": {k: round(statistics.mean(r[k] for r in train), 4) for k in train[-1] if k.startswith("partial/")}}


def build(path: str, short: int, long: int, share: float, seed: int = 0, heads: dict | None = None) -> dict[str, str]:
    """The heavy-tailed task's tokenizer, warm-started policy and rows (once). ``heads``: the policy's attention
    heads (vLLM's CPU attention takes head size 32: heads 2, kv_heads 1)."""
    import random

    def make(tmp: str) -> None:
        rng = random.Random(seed)
        seen: dict[tuple, None] = {}
        while len(seen) < 2100:
            n = long if rng.random() < share else short
            seen[tuple(rng.randrange(10) for _ in range(n))] = None
        pairs = list(seen)
        tokenizer = toy.build_tokenizer(os.path.join(tmp, "model"))
        toy.write_jsonl(os.path.join(tmp, "data", "train.jsonl"), pairs[:2000], repeats=1)
        toy.write_jsonl(os.path.join(tmp, "data", "val.jsonl"), pairs[2000:], repeats=1)
        toy.build_policy(tokenizer, pairs[:2000], seed, warm_steps=200, max_positions=4 * long + 16,
                         **(heads or {})).save_pretrained(os.path.join(tmp, "model"))

    return toy.build_once(path, make)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--mix", type=float, nargs=3, default=(4, 48, 0.1), metavar=("SHORT", "LONG", "SHARE"))
    ap.add_argument("--partial", nargs="+", default=["50:1", "12:8"], metavar="CHUNK:STALENESS",
                    help="the partial runs: chunk_tokens and max_staleness of each")
    ap.add_argument("--over", type=float, default=1.5)
    ap.add_argument("--prompts", type=int, default=64, help="train_batch_size (groups of 8 samples a step)")
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                    help="vllm: vLLM's continuous batch (its CPU build here, eager), requests stopped mid-call")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_partial"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    short, hi, share = int(args.mix[0]), int(args.mix[1]), args.mix[2]
    vllm = args.engine == "vllm"
    assets = build(os.path.join(args.out, f"toy_assets_{short}_{hi}_{share:g}" + ("_h32" if vllm else "")), short, hi,
                   share, heads={"heads": 2, "kv_heads": 1} if vllm else None)
    common = ["--actor.model.path", assets["model"], "--data.train_files", assets["train"], "--data.val_files",
              assets["val"], "--data.max_prompt_length", str(2 * hi + 2), "--rollout.max_response_length",
              str(2 * hi + 2), "--trainer.total_steps", str(args.steps), "--trainer.val_every", str(args.steps // 2),
              "--trainer.train_batch_size", str(args.prompts), "--trainer.log_samples", "0",
              "--trainer.save_every", "0", "--algorithm.rollout_correction", "token",
              *(["--rollout.engine", "vllm", "--rollout.enforce_eager"] if vllm else [])]
    summary = {"args": vars(args)}
    path = os.path.join(args.out, "summary.json")
    variants = [("full", [])]
    for spec in args.partial:
        chunk, staleness = spec.split(":")
        variants.append((f"partial_{chunk}_{staleness}", [
            "--rollout.partial.enabled", "--rollout.partial.chunk_tokens", chunk, "--rollout.partial.max_staleness",
            staleness, "--rollout.partial.over_provision", str(args.over)]))
    for name, more in variants:
        summary[name] = run(args.out, name, common + more, args.prompts * 8)
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
        print(name, json.dumps(summary[name]), flush=True)
    full = summary["full"]
    print(f"\n{'':16}{'s/step':>8}{'x full':>8}{'generate s':>12}{'length':>8}{'trained':>9}{'dropped':>9}"
          f"  held-out (step, reward)")
    for name, _ in variants:
        r = summary[name]
        print(f"{name:16}{r['s_per_step']:8.3f}{r['s_per_step'] / full['s_per_step']:8.2f}{r['generate_s']:12.3f}"
              f"{r['response_length_mean']:8.1f}{r['trained_tokens']:9}{r['dropped_groups']:9}  {r['val']}")
    for name, _ in variants[1:]:
        print(f"{name}'s pool: {summary[name]['partial']}")


if __name__ == "__main__":
    main()
