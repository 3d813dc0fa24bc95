"""Ours against TRL's GRPOTrainer on the embedded default, side by side, several seeds.

    python bench/compare_trl.py [--seeds 1 2 3] [--steps 100] [--env .bench_envs/trl]

Both run GRPO on the toy task (lib/toy.py) from the same model weights and prompts with 2 CPU processes over gloo,
one thread each: 64 prompts x 8 samples per step, at most 10 new tokens, temperature 1, 4 optimizer steps of 128
samples per RL step, AdamW lr 1e-3 (betas 0.9/0.999, eps 1e-8, no weight decay, constant), grad-norm clip 1.0,
clip range 0.2, no KL term, group-std advantages, token-mean loss over the mini-batch (TRL's "dapo"), the same
reward function. TRL (pinned below) runs in its own throw-away environment made on first use under --env.

Settings that cannot be matched: the order prompts are drawn in (each framework's own seeded sampler) and the
sampling random streams; TRL replicates the model with DDP, ours runs the tiny preset's replicated FSDP
(fsdp.shard_size 1); TRL's step includes its own logging. Held-out greedy reward of both final models is scored
by the same code here (greedy decoding of the 100 held-out prompts, the toy score).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

TRL = "trl==1.16.0"
STEPS_PER_RL_STEP = 4  # optimizer steps of 128 samples per 512-sample RL step
CHECKPOINTS = (10, 50, 100)  # train reward reported at these RL steps


def ensure_env(path: str) -> str:
    import torch

    python = os.path.join(path, "bin", "python")
    if not os.path.isfile(os.path.join(path, ".ready")):
        print(f"making the TRL environment in {path} (once) ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", path], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}", TRL],
                       check=True)
        open(os.path.join(path, ".ready"), "w").close()
    return python


def torchrun(python: str, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2", *args]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{' '.join(cmd[:8])} ... failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")


def run_ours(root: str, seed: int, steps: int) -> dict:
    torchrun(sys.executable, os.path.join(ROOT, "train_grpo.py"), "--trainer.output_root", root, "--trainer.run_name",
             f"ours-{seed}", "--trainer.seed", str(seed), "--trainer.total_steps", str(steps),
             "--trainer.val_every", "0", "--trainer.log_samples", "0", "--trainer.save_every", "0")
    rows = [json.loads(line) for line in open(os.path.join(root, f"ours-{seed}", "metrics.jsonl"))]
    rows = [r for r in rows if "timing/step_s" in r]
    stage = lambda k: statistics.median(r[f"timing/{k}_s"] for r in rows)  # noqa: E731
    return {"step_s": stage("step"), "generate_s": stage("rollout") + stage("score"),
            "update_s": stage("log_probs") + stage("update"),
            # perf/tokens_per_s is per rank (averaged over ranks): the run's throughput is 2 ranks' worth
            "tokens_per_s": 2 * statistics.median(r["perf/tokens_per_s"] for r in rows),
            "reward": {r["step"]: r["reward/mean"] for r in rows}, "model": os.path.join(root, f"ours-{seed}", "hf_final")}


def run_trl(python: str, root: str, model: str, train: str, seed: int, steps: int) -> dict:
    out = os.path.join(root, f"trl-{seed}")
    torchrun(python, os.path.join(HERE, "trl_side.py"), model, train, out, str(seed), str(steps))
    log = json.load(open(os.path.join(out, "timings.json")))
    opt_steps = [e["step_s"] for e in log if "step_s" in e]
    generate = [e["generate_s"] for e in log if "generate_s" in e]
    rl_steps = [sum(opt_steps[i:i + STEPS_PER_RL_STEP]) for i in range(0, len(opt_steps), STEPS_PER_RL_STEP)]
    rewards = [e for e in log if "reward" in e]
    # num_tokens: prompt + completion tokens seen so far over both processes (TRL's count, cumulative)
    tokens = [b["num_tokens"] - a["num_tokens"] for a, b in zip([{"num_tokens": 0}] + rewards, rewards)]
    return {"step_s": statistics.median(rl_steps), "generate_s": statistics.median(generate),
            "update_s": statistics.median(rl_steps) - statistics.median(generate),
            "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, rl_steps)),
            "reward": {i + 1: e["reward"] for i, e in enumerate(rewards)}, "model": os.path.join(out, "model")}


def heldout_greedy(model_dir: str, val: str) -> float:
    """Mean toy score of greedy responses (at most 10 tokens) to the held-out prompts: the same code for both."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lib.rewards.builtin import toy

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in open(val)]
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    answers = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return statistics.mean(toy(a, r["reward_model"]["ground_truth"])["score"] for a, r in zip(answers, rows))


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} +- {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--env", default=os.path.join(ROOT, ".bench_envs", "trl"))
    args = ap.parse_args()
    from lib import toy

    python = ensure_env(args.env)
    with tempfile.TemporaryDirectory() as root:
        paths = toy.prepare(os.path.join(root, "toy_assets"), seed=0)
        results: dict[str, list[dict]] = {"ours": [], "TRL": []}
        for seed in args.seeds:
            results["ours"].append(run_ours(root, seed, args.steps))
            results["TRL"].append(run_trl(python, root, paths["model"], paths["train"], seed, args.steps))
            for name in results:
                results[name][-1]["heldout"] = heldout_greedy(results[name][-1]["model"], paths["val"])
            print(f"seed {seed}: " + ", ".join(f"{n} {r[-1]['step_s']:.3f} s/step, held-out {r[-1]['heldout']:.3f}"
                                               for n, r in results.items()), flush=True)
        start = heldout_greedy(paths["model"], paths["val"])
    print(f"\nGRPO on the toy task, {args.steps} steps, 2 CPU ranks x 1 thread, seeds {args.seeds} "
          f"(medians per run, then mean over seeds); held-out greedy reward of the start model: {start:.3f}")
    cols = ["s/step", "generate s", "update s", "tokens/s"] + [f"reward@{c}" for c in CHECKPOINTS if c <= args.steps]
    print(f"{'':<8}" + "".join(f"{c:>13}" for c in cols) + f"{'held-out greedy':>20}")
    means = {}
    for name, runs in results.items():
        m = [statistics.mean(r[k] for r in runs) for k in ("step_s", "generate_s", "update_s", "tokens_per_s")]
        m += [statistics.mean(r["reward"].get(c, float("nan")) for r in runs) for c in CHECKPOINTS if c <= args.steps]
        means[name] = m
        print(f"{name:<8}" + "".join(f"{v:>13.3f}" if i < 3 else f"{v:>13.0f}" if i == 3 else f"{v:>13.3f}"
                                     for i, v in enumerate(m)) + f"{spread([r['heldout'] for r in runs]):>20}")
    ratio = means["ours"][0] / means["TRL"][0]
    print(f"ours/TRL s/step: {ratio:.2f} (target <= 0.5)")


if __name__ == "__main__":
    main()
