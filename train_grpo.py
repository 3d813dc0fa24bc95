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
- One policy update per rollout batch by default (ppo_epochs=1, one mini-batch): old log-probs are then the
  current ones, detached (the on-policy shortcut), so the ratio is 1 and clipping only acts with more epochs.
- Batches are rebalanced across ranks by whole groups (Karmarkar-Karp on a*L + L^2) before the update.
- Dynamic sampling draws each extra round from the next prompts of the data stream (no prompt is skipped), so
  a step can consume several batches; when the rounds keep more groups than needed, the last round's surplus
  is dropped at random (seeded by step), not by rank.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist

from lib import algos, config, pipeline
from lib.actor import compute_log_probs as actor_log_probs
from lib.actor import update_policy
from lib.balance import balance_groups
from lib.dist import sum_over_ranks
from lib.logging import stage
from lib.protocol import DataProto



# ---- stages


def rollout(run: pipeline.Run, step: int, metrics: dict) -> DataProto:
    """Generate and score; then rebalance whole groups across ranks. With dynamic sampling (DAPO), keep only the
    groups whose scores differ, drawing the next prompts of the data stream for another round until the batch
    holds train_batch_size such groups (or max_gen_batches rounds ran)."""
    cfg, a = run.cfg, run.cfg.algorithm
    if not a.filter_groups:
        batch, m = pipeline.rollout(run, pipeline.next_batch(run))
        metrics.update(m)
        metrics.update(score(run, batch))
        batch, m = balance_groups(batch)
        metrics.update(m)
        return batch
    kept, kept_uids, round_metrics, total_kept = [], [], [], 0
    for _ in range(a.max_gen_batches):
        batch, m = pipeline.rollout(run, pipeline.next_batch(run))
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
    for key in round_metrics[0]:  # every round's metrics count: sums for counts, means for the rest
        values = [rm[key] for rm in round_metrics if key in rm]
        metrics[key] = float(np.sum(values) if key in pipeline.SUMMED_METRICS else np.mean(values))
    metrics["algorithm/gen_rounds"] = len(kept)
    metrics["algorithm/kept_groups"] = len(chosen)
    batch, m = balance_groups(batch)
    metrics.update(m)
    return batch


def score(run: pipeline.Run, batch: DataProto) -> dict:
    return pipeline.score(run, batch)


def compute_log_probs(run: pipeline.Run, batch: DataProto) -> None:
    """old_log_probs (skipped on-policy: the update uses its own, detached) and ref_log_prob."""
    cfg, topo = run.cfg, run.topo
    needs_old = not run.sizes.on_policy or cfg.algorithm.use_kl_in_reward or cfg.algorithm.rollout_correction != "off"
    t = cfg.rollout.temperature
    if needs_old:
        batch.batch["old_log_probs"], _ = actor_log_probs(run.actor.model, batch, cfg.actor.batching, topo, t)
    if run.ref is not None:
        batch.batch["ref_log_prob"], _ = actor_log_probs(run.ref, batch, cfg.actor.batching, topo, t)


def compute_advantages(run: pipeline.Run, batch: DataProto, kl_ctrl, metrics: dict) -> None:
    cfg, b = run.cfg, batch.batch
    a, mask = cfg.algorithm, b["response_mask"]
    rewards = b["token_level_scores"]
    if a.use_kl_in_reward:
        rewards = pipeline.kl_in_reward(run, batch, kl_ctrl, metrics)
    b["token_level_rewards"] = rewards
    # groups stay on one rank; batch-wide statistics (whitening, GPG's counts) are summed over all ranks
    adv, ret = algos.ADVANTAGE_ESTIMATORS[a.adv_estimator](
        rewards, mask, index=batch.non_tensor_batch["uid"], gamma=a.gamma, lam=a.lam,
        norm_adv_by_std=a.norm_adv_by_std, reduce=sum_over_ranks())
    b["advantages"], b["returns"] = adv, ret
    if a.rollout_correction != "off":
        w, keep, m = algos.rollout_correction(b["old_log_probs"], b["rollout_log_probs"], mask,
                                              a.rollout_correction, a.rollout_correction_threshold,
                                              a.rollout_correction_mode)
        b["rollout_is_weights"], b["response_mask"] = w, keep
        metrics.update({k: float(v) for k, v in m.items()})



# ---- the loop


def main(argv: list[str]) -> None:
    cfg = config.parse(argv, default_preset="tiny_cpu_grpo")
    run = pipeline.start(cfg)
    pipeline.build_models(run, with_ref=cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)
    kl_ctrl = pipeline.kl_controller(cfg)
    parts = {"actor": (run.actor.model, run.actor.optimizer)}
    start = pipeline.resume(run, parts, kl_ctrl)
    for step in range(start, run.total_steps):
        metrics: dict[str, float] = {}
        with stage("step", metrics):
            with stage("rollout", metrics):
                batch = rollout(run, step, metrics)
            with stage("log_probs", metrics):
                compute_log_probs(run, batch)
            compute_advantages(run, batch, kl_ctrl, metrics)
            with stage("update", metrics):
                metrics.update(update_policy(run.actor, batch, cfg.actor, cfg.rollout.temperature,
                                             run.sizes.mini_batch_per_rank, seed=step))
        pipeline.log_step(run, step, batch, metrics)
        pipeline.end_of_step(run, step, parts, kl_ctrl)
    pipeline.finish(run)


if __name__ == "__main__":
    main(sys.argv[1:])
