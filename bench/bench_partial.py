"""Partial rollouts against full ones on a task whose response lengths have a long tail: seconds a step and the
held-out reward over the same steps, side by side.

    python bench/bench_partial.py [--steps 20] [--digits 3 48] [--chunk 16] [--over 1.5] [--out runs/bench_partial]

The toy task's long-tail variant (lib/toy.py: answers of lo to hi digits, log-uniform, so responses of about 2 lo
to 2 hi tokens), its policy warm-started, GRPO on 2 CPU ranks with the HF engine: one run generates every group to
its end each step (full), the other with rollout.partial (chunks of --chunk tokens, a pool of --over x
train_batch_size groups; the groups still generating when train_batch_size are complete go on in the next step).
Both train train_batch_size groups a step. Each run's figures land in the output folder as it ends (summary.json,
and the runs' own folders: metrics.jsonl, the log): a bench stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lib import toy  # noqa: E402


SAMPLES = 16 * 8  # a step's: train_batch_size 16 groups of rollout.n 8


def run(out: str, name: str, args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           os.path.join(ROOT, "train_grpo.py"), "--trainer.output_root", out, "--trainer.run_name", name, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    rows = [json.loads(line) for line in open(os.path.join(out, name, "metrics.jsonl"))]
    train = [r for r in rows if "actor/pg_loss" in r]
    later = train[1:] or train  # the first step compiles and warms caches in both
    return {"exit": code, "steps": len(train),
            "s_per_step": statistics.mean(r["timing/step_s"] for r in later),
            "generate_s": statistics.mean(r["timing/generate_s"] for r in later),
            "response_length_mean": statistics.mean(r["response/length_mean"] for r in train),
            "trained_tokens": round(sum(r["response/length_mean"] for r in train) * SAMPLES),
            "val": [(r["step"], round(r["val/score_mean"], 4)) for r in rows if "val/score_mean" in r],
            "partial": {k: round(statistics.mean(r[k] for r in train), 4) for k in train[-1] if k.startswith("partial/")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--digits", type=int, nargs=2, default=(3, 48))
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--over", type=float, default=1.5)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_partial"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    lo, hi = args.digits
    assets = toy.prepare(os.path.join(args.out, f"toy_assets_{lo}_{hi}"), seed=0, warm_steps=200, digits=(lo, hi))
    common = ["--actor.model.path", assets["model"], "--data.train_files", assets["train"], "--data.val_files",
              assets["val"], "--data.max_prompt_length", str(2 * hi + 2), "--rollout.max_response_length",
              str(2 * hi + 2), "--trainer.total_steps", str(args.steps), "--trainer.val_every", str(args.steps // 2),
              "--trainer.train_batch_size", "16", "--actor.mini_batch_size", "64", "--trainer.log_samples", "0",
              "--trainer.save_every", "0", "--algorithm.rollout_correction", "token"]
    summary = {"args": vars(args)}
    path = os.path.join(args.out, "summary.json")
    for name, more in (("full", []), ("partial", ["--rollout.partial.enabled", "--rollout.partial.chunk_tokens",
                                                  str(args.chunk), "--rollout.partial.over_provision",
                                                  str(args.over)])):
        summary[name] = run(args.out, name, common + more)
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
        print(name, json.dumps(summary[name]), flush=True)
    full, part = summary["full"], summary["partial"]
    print(f"\n{'':10}{'s/step':>9}{'generate s':>12}{'length':>9}  held-out (step, reward)")
    for name, r in (("full", full), ("partial", part)):
        print(f"{name:10}{r['s_per_step']:9.3f}{r['generate_s']:12.3f}{r['response_length_mean']:9.1f}  {r['val']}")
    print(f"partial / full seconds a step: {part['s_per_step'] / full['s_per_step']:.2f}; partial's pool: "
          f"{part['partial']}")


if __name__ == "__main__":
    main()
