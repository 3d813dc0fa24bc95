"""PPO with a learned critic and GAE for Hugging Face causal LMs: one torchrun launch, every rank identical.

    torchrun --nproc-per-node 8 train_ppo.py --config configs/qwen2.5_0.5b_gsm8k_ppo.yaml
    bash launch.sh train_ppo.py        # the embedded tiny default on CPU (configs/tiny_cpu_ppo.yaml)

The algorithm (Schulman et al. 2017; for LMs Ouyang et al. 2022): a value model (the policy's architecture
with a scalar head), GAE(gamma, lambda) advantages whitened over the batch, the clipped policy loss, the
clipped value loss, and the KL to the reference policy subtracted from the reward per token, with a fixed or
adaptive coefficient (Ziegler et al. 2019).

Where this departs from the papers:
- The reward is the rule/model score on the last response token (no per-token reward model).
- The critic starts from the policy's weights with a fresh value head; ``algorithm.critic_warmup`` steps
  train only the critic.
- Rows are rebalanced across ranks (Karmarkar-Karp on a*L + L^2) before the update.
- An optimizer step whose gradient is exactly 0 (no learning signal) is left out, AdamW's moments and step
  count kept (``actor.optim.step_without_gradient``: verl steps; a solved run then unlearned its task).
"""

from __future__ import annotations

import sys

import torch

from lib import algos, config, kl_control, metrics as metric_log, resume, samples, startup
from lib.actor import Trainee
from lib.actor import update_policy
from lib.balance import balance_groups
from lib.critic import compute_values, update_critic
from lib.dist import sum_over_ranks
from lib.fsdp import build_sharded_model
from lib.runlog import stage
from lib.optim import build_optimizer
from lib.protocol import DataProto
from lib.partial import loop as partial
from lib.rollout import correct_rollout, generate, next_batch, policy_log_probs
from lib.scoring import score
from lib.run import Run


def build_critic(run: Run) -> Trainee:
    cfg = run.cfg
    if not cfg.critic.model.path:
        cfg.critic.model.path = cfg.actor.model.path
    torch.manual_seed(cfg.trainer.seed)  # the fresh value head is the same whatever ran before
    model = build_sharded_model(cfg.critic.model, cfg.critic.fsdp, run.topo, kind="critic",
                                packed=cfg.critic.batching.use_remove_padding)
    cfg.critic.optim.total_steps = cfg.critic.optim.total_steps or run.total_steps
    optimizer, scheduler = build_optimizer(model, cfg.critic.optim)
    return Trainee(model, optimizer, scheduler, run.topo)



# ---- stages


def compute_log_probs(run: Run, critic: Trainee, batch: DataProto) -> None:
    """The policy's log-probs (lib.rollout.policy_log_probs) and the critic's values."""
    policy_log_probs(run, batch)
    batch.batch["values"] = compute_values(critic.model, batch, run.cfg.critic.batching, run.topo)


def compute_advantages(run: Run, batch: DataProto, kl_ctrl, metrics: dict) -> None:
    cfg, b = run.cfg, batch.batch
    a, mask = cfg.algorithm, b["response_mask"]
    rewards = b["token_level_scores"]
    if a.use_kl_in_reward:
        rewards = kl_control.kl_in_reward(run, batch, kl_ctrl, metrics)
    b["token_level_rewards"] = rewards
    metrics["critic/values_mean"] = float(algos.masked_mean(b["values"], mask))
    # whitened over the whole batch (one all-reduce of its moments), as the reference's driver does
    b["advantages"], b["returns"] = algos.gae(rewards, mask, values=b["values"], gamma=a.gamma, lam=a.lam,
                                              reduce=sum_over_ranks())
    correct_rollout(run, batch, metrics)  # train/rollout mismatch: importance weights, or tokens masked out



# ---- the loop


def main(argv: list[str]) -> None:
    cfg = config.parse(argv, default_preset="tiny_cpu_ppo")
    run = startup.start(cfg, need_critic=True)
    startup.build_models(run, with_ref=cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss)
    critic = build_critic(run)
    kl_ctrl = kl_control.kl_controller(cfg)
    trainees = {"actor": run.actor, "critic": critic}
    start = resume.resume(run, trainees, kl_ctrl)
    for step in range(start, run.total_steps):
        metrics: dict[str, float] = {}
        with stage("step", metrics):
            with stage("rollout", metrics):
                if cfg.rollout.partial.enabled:  # the pool's oldest complete samples; the rest carried
                    batch, m = partial.generate_step(run, step)
                else:
                    batch, m = generate(run, next_batch(run))
            with stage("score", metrics):
                m.update(score(run, batch))
            metrics.update(m)
            batch, m = balance_groups(batch)
            metrics.update(m)
            with stage("log_probs", metrics):
                compute_log_probs(run, critic, batch)  # a carried sample's values: the critic's of this step
            if cfg.rollout.partial.enabled:
                metrics.update(partial.segment_metrics(batch, step))
            compute_advantages(run, batch, kl_ctrl, metrics)
            samples.mark(run, batch)  # the groups whose samples the step keeps (lib/samples)
            with stage("update", metrics):
                metrics.update(update_critic(critic, batch, cfg.critic, run.sizes.critic_mini_batch_per_rank, step))
                if step >= cfg.algorithm.critic_warmup:
                    metrics.update(update_policy(run.actor, batch, cfg.actor, cfg.rollout.temperature,
                                                 run.sizes.mini_batch_per_rank, seed=step,
                                                 truncation=run.truncation))
        metric_log.log_step(run, step, batch, metrics)
        if not resume.end_of_step(run, step, trainees, kl_ctrl, metrics):  # a stop signal, or bad steps
            break
    startup.finish(run)


if __name__ == "__main__":
    main(sys.argv[1:])
