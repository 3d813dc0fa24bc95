"""GRPO and its relatives for Hugging Face causal LMs: one torchrun launch, every rank identical.

    torchrun --nproc-per-node 8 train_grpo.py --config configs/qwen2.5_0.5b_gsm8k_grpo.yaml
    bash launch.sh                     # the embedded tiny default on CPU (configs/tiny_cpu_grpo.yaml)

The algorithm (Shao et al. 2024, DeepSeekMath): n samples per prompt, advantage = (r - group mean) / group std,
PPO-clipped policy loss, KL to the reference as a loss term. By config the same loop runs RLOO,
REINFORCE++(-baseline), OPO, GPG, Dr.GRPO (no std, seq-mean-token-sum-norm), DAPO (clip-higher,
dynamic sampling, overlong penalty, token-mean), GSPO and CISPO losses, and rollout correction.

Where this departs from the paper:
- The KL term uses the k3 estimator by default (as the paper), aggregated like the policy loss
  (token-mean by default, where the paper averages per sequence first).
- With ppo_epochs=1 (the default) the update takes the old log-probs from the policy before its first step:
  the first mini-batch's own forward, detached (ratio 1, so with one mini-batch clipping never acts), and a
  no-grad pass for the other mini-batches (lib/actor.py).
- Batches are rebalanced across ranks by whole groups (Karmarkar-Karp on a*L + L^2) before the update.
- Dynamic sampling draws each extra round from the next prompts of the data stream (no prompt is skipped), so
  a step can consume several batches; when the rounds keep more groups than needed, the last round's surplus
  is dropped at random (seeded by step), not by rank.
- An optimizer step whose gradient is exactly 0 (no learning signal) is left out, AdamW's moments and step
  count kept (``actor.optim.step_without_gradient``: verl steps; a solved run then unlearned its task).
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import torch
import torch.distributed as dist

from lib import algos, config, distill, kl_control, metrics as metric_log, resume, samples, startup
from lib.actor import update_policy
from lib.agents.samples import once_per_episode
from lib.balance import balance_groups
from lib.dist import sum_over_ranks
from lib.runlog import stage
from lib.partial import loop as partial
from lib.preflight import GROUP_ESTIMATORS
from lib.protocol import DataProto
from lib.rollout import correct_rollout, generate, next_batch, policy_log_probs
from lib.scoring import no_scores, score
from lib.vision.clock import tower_clock
from lib.run import Run

# ---- stages


def dynamic_sampling(run: Run, step: int, batch: DataProto, first: dict, metrics: dict) -> tuple[DataProto, dict]:
    """DAPO: keep only the groups whose scores differ; while fewer than train_batch_size groups are kept (and at
    most max_gen_batches rounds), generate and score the next prompts of the data stream. ``first`` holds the
    first round's metrics; returns the kept batch and every round's metrics aggregated (counts summed, the rest
    averaged). The rounds' rollout and score times add to the step's stages."""
    cfg, a = run.cfg, run.cfg.algorithm
    kept, kept_uids, round_metrics, total_kept = [], [], [], 0
    m = first
    for round_ in range(a.max_gen_batches):
        if round_:
            with stage("rollout", metrics):  # partial rollouts: the pool's next complete groups
                batch, m = partial.generate_step(run, step, round_) if cfg.rollout.partial.enabled else \
                    generate(run, next_batch(run))
            with stage("score", metrics):
                m.update(score(run, batch))
        if a.filter_groups_metric == "score":  # the task's score, before any overlong penalty
            values = torch.tensor(batch.non_tensor_batch["scores"].astype(np.float64))
        else:
            values = batch.batch["token_level_scores"].sum(-1).double().cpu()
        idx, m["algorithm/kept_group_frac"] = algos.filter_groups(values, batch.non_tensor_batch["uid"])
        batch = batch.select_idxs(idx)
        kept.append(batch)
        round_metrics.append(m)
        uids: list = [None] * run.topo.world_size
        # world: which groups each rank kept (few strings), to count them and to choose among them fairly
        dist.all_gather_object(uids, list(dict.fromkeys(batch.non_tensor_batch["uid"].tolist())))
        kept_uids.append([u for part in uids for u in part])
        total_kept += len(kept_uids[-1])
        if total_kept >= cfg.trainer.train_batch_size:
            break
    world = run.topo.world_size
    keep = min(total_kept, cfg.trainer.train_batch_size) // world * world  # equal groups per rank
    if keep == 0:
        raise RuntimeError("dynamic sampling found no group with differing scores; raise "
                           "algorithm.max_gen_batches or turn algorithm.filter_groups off")
    chosen = algos.select_groups(kept_uids, keep, seed=hash((cfg.trainer.seed, step)) % 2**32)
    batch = DataProto.concat_padded(kept, {"responses": run.tokenizer.pad_token_id,
                                           "input_ids": run.tokenizer.pad_token_id})
    batch = batch.select_idxs(np.flatnonzero([u in chosen for u in batch.non_tensor_batch["uid"]]))
    merged = {}
    for key in round_metrics[0]:
        values = [rm[key] for rm in round_metrics if key in rm]
        merged[key] = float(np.sum(values) if key in metric_log.SUMMED_METRICS + partial.COUNTS else np.mean(values))
    merged["algorithm/gen_rounds"] = len(kept)
    merged["algorithm/kept_groups"] = len(chosen)
    return batch, merged


def compute_advantages(run: Run, batch: DataProto, kl_ctrl, metrics: dict) -> None:
    cfg, b = run.cfg, batch.batch
    a, mask = cfg.algorithm, b["response_mask"]
    rewards = b["token_level_scores"]
    if a.use_kl_in_reward:
        rewards = kl_control.kl_in_reward(run, batch, kl_ctrl, metrics)
    b["token_level_rewards"] = rewards
    # groups stay on one rank; batch-wide statistics (whitening, GPG's counts) are summed over all ranks
    # the group statistics' groups: the prompt's (uid), less the samples a judge could not score (lib/scoring.py)
    groups = batch.non_tensor_batch.get("score_group", batch.non_tensor_batch["uid"])
    estimate = algos.ADVANTAGE_ESTIMATORS[a.adv_estimator]
    if "episode" in batch.non_tensor_batch and a.adv_estimator in GROUP_ESTIMATORS:  # an agent's rows: once an episode
        estimate = functools.partial(once_per_episode, estimate, episodes=batch.non_tensor_batch["episode"])
    adv, ret = estimate(rewards, mask, index=groups, gamma=a.gamma, lam=a.lam, norm_adv_by_std=a.norm_adv_by_std,
                        reduce=sum_over_ranks())
    b["advantages"], b["returns"] = adv, ret
    if run.teacher is not None:
        distill.set_advantages(batch, cfg)  # the teacher's term; the task's advantage kept or dropped
    correct_rollout(run, batch, metrics)  # train/rollout mismatch: importance weights, or tokens masked out

# ---- the loop


def main(argv: list[str]) -> None:
    cfg = config.parse(argv, default_preset="tiny_cpu_grpo")
    run = startup.start(cfg)
    startup.build_models(run, with_ref=cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)
    kl_ctrl = kl_control.kl_controller(cfg)
    trainees = {"actor": run.actor}
    start = resume.resume(run, trainees, kl_ctrl)
    for step in range(start, run.total_steps):
        metrics: dict[str, float] = {}
        with stage("step", metrics):
            with stage("rollout", metrics):
                if cfg.rollout.partial.enabled:  # the pool's oldest complete groups; the rest carried
                    batch, round_metrics = partial.generate_step(run, step)
                else:
                    batch, round_metrics = generate(run, next_batch(run))
            with stage("score", metrics):
                round_metrics.update(score(run, batch) if run.scored else no_scores(batch))
            if cfg.algorithm.filter_groups:
                batch, round_metrics = dynamic_sampling(run, step, batch, round_metrics, metrics)
            metrics.update(round_metrics)
            batch, balance_metrics = balance_groups(batch)  # whole groups, so group statistics stay on one rank
            metrics.update(balance_metrics)
            with stage("log_probs", metrics):
                policy_log_probs(run, batch)
            if cfg.rollout.partial.enabled:
                metrics.update(partial.segment_metrics(batch, step))
            if run.teacher is not None:  # on-policy distillation: the teacher scores every sampled token
                with stage("teacher", metrics):
                    distill.teacher_log_probs(run.teacher, batch, cfg.actor.batching, run.topo,
                                              cfg.rollout.temperature, distill.offloads(cfg, run.topo.device),
                                              distill.topk(cfg))
                metrics.update(distill.metrics(batch))
            compute_advantages(run, batch, kl_ctrl, metrics)
            samples.mark(run, batch)  # the groups whose samples the step keeps (lib/samples)
            with stage("update", metrics), tower_clock(run.actor.model, metrics):  # its share, with images
                metrics.update(update_policy(run.actor, batch, cfg.actor, cfg.rollout.temperature,
                                             run.sizes.mini_batch_per_rank, seed=step, truncation=run.truncation,
                                             **distill.loss_kwargs(cfg)))
        metric_log.log_step(run, step, batch, metrics)
        if not resume.end_of_step(run, step, trainees, kl_ctrl, metrics):  # a stop signal, or bad steps
            break
    startup.finish(run)


if __name__ == "__main__":
    main(sys.argv[1:])
