"""Ours against TRL's GRPOTrainer on the embedded default, side by side, several seeds.

    python bench/compare_trl.py [--seeds 1 2 3] [--steps 100] [--env .bench_envs/trl]
    python bench/compare_trl.py --case long-tail --steps 5 --seeds 1   # responses of 10 to 400 tokens
    python bench/compare_trl.py --ours-args="--algorithm.bypass-mode"   # ours with the engine's old log-probs
    python bench/compare_trl.py --objective     # the per-token loss of both on one identical batch

Both run GRPO on the toy task (lib/toy.py) from the same model weights and prompts with 2 CPU processes over gloo,
one thread each: 64 prompts x 8 samples per step, at most 10 new tokens, temperature 1, 4 optimizer steps of 128
samples per RL step, AdamW lr 1e-3 (betas 0.9/0.999, eps 1e-8, no weight decay, constant), grad-norm clip 1.0,
clip range 0.2, no KL term, group-std advantages, token-mean loss over the mini-batch (TRL's "dapo"), the same
reward function. TRL (pinned below) runs in its own throw-away environment made on first use under --env.

Settings that cannot be matched: the order prompts are drawn in (each framework's own seeded sampler) and the
sampling random streams; TRL replicates the model with DDP, ours runs the tiny preset's replicated FSDP
(fsdp.shard_size 1); TRL's step includes its own logging. Held-out greedy reward of both final models is scored
by the same code here (greedy decoding of the 100 held-out prompts, the toy score).

Differences in the objective, as --objective measures them on one identical batch (everything else agrees to
float32 rounding): the std epsilon of the group advantages (TRL 1e-4, ours and verl 1e-6); TRL divides each
mini-batch's token sum by the generation batch's mean tokens per mini-batch, ours by the mini-batch's own token
count (the same on average); TRL shuffles samples across mini-batches, ours keeps groups whole unless
--actor.shuffle; our dual clip (c = 3 for negative advantages) never binds on this task.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

TRL = "trl==1.16.0"
CHECKPOINTS = (10, 50, 100)  # train reward reported at these RL steps
GROUP = 8  # samples per prompt, in every case


@dataclass(frozen=True)
class Case:
    """One shape both frameworks run: the toy task's digit counts, prompts per step (x 8 samples), samples per
    optimizer step, and the response cap."""

    digits: tuple[int, int]
    prompts: int
    mini: int
    max_new: int
    warm_steps: int
    lr: float = 1e-3

    @property
    def steps_per_rl_step(self) -> int:
        return self.prompts * GROUP // self.mini

    def ours_args(self, paths: dict) -> list[str]:
        if self == CASES["default"]:
            return []  # the embedded default, unchanged
        return ["--actor.model.path", paths["model"], "--data.train_files", paths["train"], "--data.val_files",
                paths["val"], "--trainer.train_batch_size", str(self.prompts), "--actor.mini_batch_size",
                str(self.mini), "--rollout.max_response_length", str(self.max_new), "--data.max_prompt_length",
                str(2 * self.digits[1] + 2), "--actor.optim.lr", str(self.lr)]


CASES = {
    # the embedded default (configs/tiny_cpu_grpo.yaml): 4 optimizer steps of 128 per RL step of 64 x 8
    "default": Case(digits=(4, 4), prompts=64, mini=128, max_new=10, warm_steps=60),
    # answers of 5 to 200 digits, log-uniform: responses of about 10 to 400 tokens; 2 optimizer steps of 64. A time
    # case, not a learning one: lr 1e-6 keeps both sampling the start model's lengths (at 1e-3 each run's
    # lengths drift their own way within a few steps, and s/step compares different amounts of work)
    "long-tail": Case(digits=(5, 200), prompts=16, mini=64, max_new=400, warm_steps=200, lr=1e-6),
}


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


def run_ours(root: str, paths: dict, case: Case, seed: int, steps: int, extra: list[str]) -> dict:
    torchrun(sys.executable, os.path.join(ROOT, "train_grpo.py"), "--trainer.output_root", root, "--trainer.run_name",
             f"ours-{seed}", "--trainer.seed", str(seed), "--trainer.total_steps", str(steps),
             "--trainer.val_every", "0", "--trainer.log_samples", "0", "--trainer.save_every", "0",
             *case.ours_args(paths), *extra)
    rows = [json.loads(line) for line in open(os.path.join(root, f"ours-{seed}", "metrics.jsonl"))]
    rows = [r for r in rows if "timing/step_s" in r]
    stage = lambda k: statistics.median(r[f"timing/{k}_s"] for r in rows)  # noqa: E731
    return {"step_s": stage("step"), "generate_s": stage("rollout") + stage("score"),
            "update_s": stage("log_probs") + stage("update"),
            # perf/tokens_per_s is per rank (averaged over ranks): the run's throughput is 2 ranks' worth
            "tokens_per_s": 2 * statistics.median(r["perf/tokens_per_s"] for r in rows),
            "length": statistics.mean(r["response/length_mean"] for r in rows),
            "reward": {r["step"]: r["reward/mean"] for r in rows},
            "wall": list(itertools.accumulate(r["timing/step_s"] for r in rows)),
            "model": os.path.join(root, f"ours-{seed}", "hf_final")}


def run_trl(python: str, root: str, paths: dict, case: Case, seed: int, steps: int) -> dict:
    out = os.path.join(root, f"trl-{seed}")
    torchrun(python, os.path.join(HERE, "trl_side.py"), paths["model"], paths["train"], out, str(seed), str(steps),
             str(case.prompts), str(case.mini), str(case.max_new), str(case.lr))
    log = json.load(open(os.path.join(out, "timings.json")))
    opt_steps = [e["step_s"] for e in log if "step_s" in e]
    generate = [e["generate_s"] for e in log if "generate_s" in e]
    k = case.steps_per_rl_step
    rl_steps = [sum(opt_steps[i:i + k]) for i in range(0, len(opt_steps), k)]
    rewards = [e for e in log if "reward" in e]
    # num_tokens: prompt + completion tokens seen so far over both processes (TRL's count, cumulative)
    tokens = [b["num_tokens"] - a["num_tokens"] for a, b in zip([{"num_tokens": 0}] + rewards, rewards)]
    return {"step_s": statistics.median(rl_steps), "generate_s": statistics.median(generate),
            "update_s": statistics.median(rl_steps) - statistics.median(generate),
            "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, rl_steps)),
            "length": statistics.mean(float(e["logs"]["completions/mean_length"]) for e in rewards),
            "reward": {i + 1: e["reward"] for i, e in enumerate(rewards)},
            "wall": list(itertools.accumulate(rl_steps)),  # seconds of training at the end of each step
            "model": os.path.join(out, "model")}


def heldout_greedy(model_dir: str, val: str, max_new: int = 10) -> float:
    """Mean toy score of greedy responses to the held-out prompts: the same code for both."""
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
        out = model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
    answers = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return statistics.mean(toy(a, r["reward_model"]["ground_truth"])["score"] for a, r in zip(answers, rows))


OBJECTIVE_GROUPS = 16  # the identical batch: 16 prompts x 8 samples, one mini-batch of 128
NOISE = 0.1  # the evaluated policy: start weights + this x N(0, 1) x each tensor's mean |weight|


def objective_batch(paths: dict, root: str, seed: int = 0) -> dict:
    """One batch sampled from the start model (eos included in the mask, as both frameworks mask), its toy
    rewards, and a second policy to evaluate it under: the start weights plus seeded noise, so that ratios move
    off 1 and some clip. Saved for both sides to read."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lib.rewards.builtin import toy

    tok = AutoTokenizer.from_pretrained(paths["model"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32).eval()
    rows = [json.loads(line) for line in open(paths["train"])][:OBJECTIVE_GROUPS]
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    prompt_ids = enc["input_ids"].repeat_interleave(GROUP, 0)
    prompt_mask = enc["attention_mask"].repeat_interleave(GROUP, 0)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=10, pad_token_id=tok.pad_token_id)
    completion = out[:, prompt_ids.shape[1]:]
    eos = completion == tok.eos_token_id
    first = torch.where(eos.any(1), eos.int().argmax(1), completion.shape[1])
    completion_mask = (torch.arange(completion.shape[1])[None] <= first[:, None]).long()
    completion = completion.masked_fill(completion_mask == 0, tok.pad_token_id)
    answers = tok.batch_decode(completion, skip_special_tokens=True)
    rewards = torch.tensor([toy(a, rows[i // GROUP]["reward_model"]["ground_truth"])["score"]
                            for i, a in enumerate(answers)])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * NOISE * p.abs().mean())
    moved = os.path.join(root, "moved")
    model.save_pretrained(moved)
    tok.save_pretrained(moved)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion,
             "completion_mask": completion_mask, "rewards": rewards}
    torch.save(batch, os.path.join(root, "batch.pt"))
    return {"start": paths["model"], "moved": moved, "batch": os.path.join(root, "batch.pt")}


def _ours_objective(start: str, moved: str, batch_path: str) -> dict:
    """Our side, on the tiny preset's 2 ranks: old log-probs under the start policy, GRPO advantages, then
    update_policy under the moved policy with one 128-sample mini-batch; the gradient is read just before the
    optimizer step (no clipping: the bound is set out of reach)."""
    import torch

    from lib import algos
    from lib.actor import Trainee, compute_log_probs, update_policy
    from lib.config import ModelConfig, parse
    from lib.dist import init_topology
    from lib.engine import build_output
    from lib.fsdp import build_sharded_model, hf_name
    from lib.optim import build_optimizer
    from lib.protocol import DataProto

    cfg = parse([], default_preset="tiny_cpu_grpo")
    cfg.actor.optim.max_grad_norm = 1e9
    topo = init_topology(fsdp_shard_size=cfg.actor.fsdp.shard_size, device="cpu")
    b = torch.load(batch_path)
    fields = build_output(b["prompt_ids"], b["prompt_mask"], (b["prompt_mask"].cumsum(1) - 1).clamp(min=0),
                          [row[m.bool()].tolist() for row, m in zip(b["completion_ids"], b["completion_mask"])],
                          None, pad_id=0, response_width=b["completion_ids"].shape[1])
    mask = fields["response_mask"]
    index = torch.arange(len(mask)) // GROUP
    adv, _ = algos.grpo(b["rewards"][:, None] * mask * (torch.arange(mask.shape[1]) == 0), mask, index.numpy())
    data = DataProto.from_dict({**fields, "advantages": adv})
    rows = len(data) // topo.world_size
    local = data[topo.rank * rows:(topo.rank + 1) * rows]
    logp = {}
    for name, path in (("start", start), ("moved", moved)):
        model = build_sharded_model(ModelConfig(path=path), cfg.actor.fsdp, topo)
        logp[name] = compute_log_probs(model, local, cfg.actor.batching, topo)[0]
    local.batch["old_log_probs"] = logp["start"]
    optimizer, scheduler = build_optimizer(model, cfg.actor.optim)
    grads = {}
    optimizer.register_step_pre_hook(lambda *_: grads.update(
        {hf_name(n): (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
         for n, p in model.named_parameters()}))
    metrics = update_policy(Trainee(model, optimizer, scheduler, topo), local, cfg.actor,
                            mini_batch_size_per_rank=rows)
    return {"metrics": metrics, "grads": grads, "advantages": local.batch["advantages"][:, 0],
            "logp_start": logp["start"], "logp_moved": logp["moved"], "mask": local.batch["response_mask"]}


def compare_objective(python: str, root: str) -> None:
    """Both losses on one identical batch: advantages, per-token log-probs, per-token loss, loss and gradient."""
    import torch

    from lib import algos, toy
    from lib.testing import run_distributed

    paths = toy.prepare(os.path.join(root, "toy_assets"), seed=0)
    files = objective_batch(paths, root)
    ours = run_distributed(_ours_objective, files["start"], files["moved"], files["batch"], world_size=2)
    out = os.path.join(root, "trl-objective")
    os.makedirs(out, exist_ok=True)
    run = subprocess.run([python, os.path.join(HERE, "trl_side.py"), "objective", files["start"], files["moved"],
                          paths["train"], files["batch"], out], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if run.returncode:
        raise SystemExit(f"TRL's side failed:\n{run.stderr[-4000:]}")
    trl = torch.load(os.path.join(out, "objective.pt"))
    cat = lambda k: torch.cat([r[k] for r in ours])  # noqa: E731 - rank 0's rows, then rank 1's
    mask = cat("mask")
    on = mask.bool()

    def per_token(adv: torch.Tensor) -> torch.Tensor:
        weights = torch.ones_like(mask, requires_grad=True)
        loss, _ = algos.vanilla_policy_loss(cat("logp_start"), cat("logp_moved"), adv[:, None] * mask, mask,
                                            loss_agg_mode="token-sum", weights=weights)
        loss.backward()
        return weights.grad

    ours_tokens, ours_with_trl_adv = per_token(cat("advantages")), per_token(trl["advantages"])
    ratio = (cat("logp_moved") - cat("logp_start")).exp()
    grads = ours[0]["grads"]
    names = sorted(set(grads) & set(trl["grads"]))
    g_ours = torch.cat([grads[n].flatten() for n in names])
    g_trl = torch.cat([trl["grads"][n].flatten() for n in names])
    rows = [
        ("advantages", cat("advantages"), trl["advantages"], None),
        ("log-probs, start policy", cat("logp_start"), trl["logp_start"], on),
        ("log-probs, moved policy", cat("logp_moved"), trl["logp_moved"], on),
        ("per-token loss", ours_tokens, trl["per_token_loss"], on),
        ("per-token loss, ours with TRL's advantages", ours_with_trl_adv, trl["per_token_loss"], on),
    ]
    print(f"One batch of {len(mask)} samples ({int(mask.sum())} response tokens) from the toy start model; "
          f"moved policy = start + {NOISE} x noise: ratio in [{ratio[on].min():.3f}, {ratio[on].max():.3f}], "
          f"{float(((ratio[on] - 1).abs() > 0.2).float().mean()):.1%} of tokens outside the clip range")
    print(f"{'':<46}{'max |ours - TRL|':>18}{'max |TRL|':>12}")
    for name, a, b, where in rows:
        a, b = (a[where], b[where]) if where is not None else (a, b)
        print(f"{name:<46}{float((a - b).abs().max()):>18.2e}{float(b.abs().max()):>12.3f}")
    loss_ours = ours[0]["metrics"]["actor/pg_loss"]
    print(f"{'loss (token-mean over the batch)':<46}{abs(loss_ours - float(trl['loss'])):>18.2e}"
          f"{abs(float(trl['loss'])):>12.4f}")
    rel = float((g_ours - g_trl).norm() / g_trl.norm())
    cos = float(torch.nn.functional.cosine_similarity(g_ours.double(), g_trl.double(), dim=0))
    print(f"gradient over {len(names)} tensors: |ours - TRL| / |TRL| = {rel:.2e}, cosine {cos:.7f}, "
          f"|TRL| = {float(g_trl.norm()):.4f}")
    dual = ((ratio > 3.0) & (cat("advantages")[:, None] < 0) & on).sum()
    print(f"tokens where our dual clip (c = 3, A < 0) binds: {int(dual)} (TRL has no dual clip)")


def plot_reward_vs_time(results: dict[str, list[dict]], path: str, title: str) -> None:
    """Train reward per step against the seconds of training so far (the sum of step times): one thin line per
    seed, each framework in its own colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, runs), colour in zip(results.items(), ("tab:blue", "tab:orange")):
        for i, run in enumerate(runs):
            steps = sorted(run["reward"])[:len(run["wall"])]
            ax.plot(run["wall"][:len(steps)], [run["reward"][k] for k in steps], color=colour, lw=0.8, alpha=0.7,
                    label=name if i == 0 else None)
    ax.set_xlabel("wall-clock seconds of training (sum of step times)")
    ax.set_ylabel("train reward (mean of the step's samples)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} +- {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--env", default=os.path.join(ROOT, ".bench_envs", "trl"))
    ap.add_argument("--case", choices=sorted(CASES), default="default")
    ap.add_argument("--ours-args", default="",
                    help="extra flags for our runs, given with '=': --ours-args=--algorithm.bypass-mode")
    ap.add_argument("--plot", help="write train reward against wall-clock time of both frameworks to this PNG")
    ap.add_argument("--objective", action="store_true", help="compare the two losses on one identical batch")
    args = ap.parse_args()
    from lib import toy

    python = ensure_env(args.env)
    if args.objective:
        with tempfile.TemporaryDirectory() as root:
            compare_objective(python, root)
        return
    case = CASES[args.case]
    with tempfile.TemporaryDirectory() as root:
        paths = toy.prepare(os.path.join(root, "toy_assets"), seed=0, warm_steps=case.warm_steps, digits=case.digits)
        results: dict[str, list[dict]] = {"ours": [], "TRL": []}
        for seed in args.seeds:
            results["ours"].append(run_ours(root, paths, case, seed, args.steps, shlex.split(args.ours_args)))
            results["TRL"].append(run_trl(python, root, paths, case, seed, args.steps))
            for name in results:
                results[name][-1]["heldout"] = heldout_greedy(results[name][-1]["model"], paths["val"], case.max_new)
            print(f"seed {seed}: " + ", ".join(f"{n} {r[-1]['step_s']:.3f} s/step, held-out {r[-1]['heldout']:.3f}"
                                               for n, r in results.items()), flush=True)
        start = heldout_greedy(paths["model"], paths["val"], case.max_new)
    if args.plot:
        plot_reward_vs_time(results, args.plot, f"{args.case} case, {args.steps} steps, seeds {args.seeds}")
    print(f"\nGRPO on the toy task ({args.case} case), {args.steps} steps, 2 CPU ranks x 1 thread, seeds {args.seeds} "
          f"(medians per run, then mean over seeds); held-out greedy reward of the start model: {start:.3f}")
    cols = ["s/step", "generate s", "update s", "tokens/s", "resp. len"] + [f"reward@{c}" for c in CHECKPOINTS
                                                                           if c <= args.steps]
    print(f"{'':<8}" + "".join(f"{c:>13}" for c in cols) + f"{'held-out greedy':>20}")
    means = {}
    for name, runs in results.items():
        m = [statistics.mean(r[k] for r in runs) for k in ("step_s", "generate_s", "update_s", "tokens_per_s",
                                                           "length")]
        m += [statistics.mean(r["reward"].get(c, float("nan")) for r in runs) for c in CHECKPOINTS if c <= args.steps]
        means[name] = m
        print(f"{name:<8}" + "".join(f"{v:>13.0f}" if i == 3 else f"{v:>13.1f}" if i == 4 else f"{v:>13.3f}"
                                     for i, v in enumerate(m)) + f"{spread([r['heldout'] for r in runs]):>20}")
    ratio = means["ours"][0] / means["TRL"][0]
    per_token = (means["ours"][0] / means["ours"][4]) / (means["TRL"][0] / means["TRL"][4])
    print(f"ours/TRL s/step: {ratio:.2f} (target: <= 0.5 on the default case, <= 1 on the long-tail case); "
          f"per response token (s/step over mean response length): {per_token:.2f}")


if __name__ == "__main__":
    main()
