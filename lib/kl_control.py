"""KL control: the fixed or adaptive coefficient of the KL penalty in the reward (Ziegler et al. 2019)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lib import algos
from lib.config import Config
from lib.protocol import DataProto
from lib.run import Run


def kl_controller(cfg: Config):
    k = cfg.algorithm.kl_ctrl
    if k.type == "adaptive":
        return algos.AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon)
    return algos.FixedKLController(k.kl_coef)


def kl_in_reward(run: Run, batch: DataProto, kl_ctrl, metrics: dict) -> torch.Tensor:
    """token_level_scores - beta * KL(old || ref) per token; the controller follows the global batch KL."""
    b = batch.batch
    rewards, seq_kl = algos.apply_kl_penalty(b["token_level_scores"], b["old_log_probs"], b["ref_log_prob"],
                                             b["response_mask"], kl_ctrl.value, run.cfg.algorithm.kl_penalty)
    kl = torch.tensor([float(seq_kl.sum()), float(len(seq_kl))])
    dist.all_reduce(kl)  # world: the controller follows the batch mean KL over all ranks
    metrics.update({"algorithm/kl_in_reward": float(kl[0] / kl[1]), "algorithm/kl_coef": kl_ctrl.value})
    kl_ctrl.update(float(kl[0] / kl[1]), int(kl[1]))
    return rewards
