"""The policy: response log-probs and the PPO-family update, on FSDP2 shards.

Loss normalisation: each micro-batch's loss is aggregated with the *global* mini-batch counts (tokens or
sequences, summed over micro-batches and data-parallel ranks), so summing the micro-batch losses over a
rank and over ranks gives exactly the mini-batch loss. FSDP averages gradients over the ranks of its mesh,
so the backward pass scales each loss by that rank count. The update therefore does not depend on the
micro-batch size, on dynamic batching, or on the number of ranks.

Batch keys read: input_ids, attention_mask, position_ids, responses, response_mask, advantages;
optional old_log_probs (absent: on-policy, old = current detached), ref_log_prob (KL loss),
rollout_is_weights (rollout correction).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lib import algos
from lib.balance import micro_batches
from lib.config import ActorConfig, BatchingConfig
from lib.dist import Topology, all_gather, reduce_metrics
from lib.forward import response_log_probs
from lib.optim import clipped_step
from lib.protocol import DataProto


@dataclass
class Trainee:
    """A sharded model with its optimizer and schedule (the actor, or the critic)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    topo: Topology


def _micro(data: DataProto, batching: BatchingConfig, topo: Topology):
    # an SP group shares its rows and splits each sequence: the token budget covers sp ranks
    max_tokens = batching.max_tokens_per_rank * topo.sp_size if batching.use_dynamic_batching else None
    return micro_batches(data, batching.micro_batch_size_per_rank * topo.sp_size, max_tokens, topo.dp_group)


def gather_sp(data: DataProto, topo: Topology) -> tuple[DataProto, slice]:
    """All-gather the SP group's rows (DESIGN step 7): every rank of the group then runs the same rows, each on
    its slice of the sequence. Returns the gathered batch and where this rank's own rows are in it."""
    if topo.sp_size == 1:
        return data, slice(0, len(data))
    gathered, sizes = all_gather(data, topo.sp_group, return_sizes=True)
    start = sum(sizes[:topo.sp_rank])
    return gathered, slice(start, start + sizes[topo.sp_rank])


@torch.no_grad()
def compute_log_probs(model: nn.Module, data: DataProto, batching: BatchingConfig, topo: Topology,
                      temperature: float = 1.0, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Response log-probs (B, R) (and entropy) for every row of ``data``, in the rows' order."""
    data, mine = gather_sp(data.select(["input_ids", "attention_mask", "position_ids", "responses"]), topo)
    pieces, restore = _micro(data, batching, topo)
    outs = [response_log_probs(model, m.to(topo.device), temperature, batching.use_remove_padding, with_entropy,
                               sp=topo) for m in pieces]
    logp = torch.cat([o[0] for o in outs]) if outs else torch.zeros(0)
    entropy = torch.cat([o[1] for o in outs]) if with_entropy and outs else None
    if restore is not None:
        logp = logp[torch.as_tensor(restore, device=logp.device)]
        entropy = entropy[torch.as_tensor(restore, device=logp.device)] if entropy is not None else None
    return logp[mine], (entropy[mine] if entropy is not None else None)


def global_counts(mask: torch.Tensor, topo: Topology) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, non-empty sequences) of a mini-batch, summed over the data-parallel ranks."""
    local = torch.stack([mask.sum(), (mask.sum(-1) > 0).sum()]).to(torch.float64)
    if "nccl" in topo.backend:
        local = local.to(topo.device)
    # dp group: every data-parallel rank holds different rows of the same mini-batch
    dist.all_reduce(local, group=topo.dp_group)
    return local[0].to(torch.float32), local[1].to(torch.float32)


def mini_batches(data: DataProto, mini_batch_size_per_rank: int, shuffle: bool, seed: int) -> list[DataProto]:
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(data))
        data = data.select_idxs(order)
    return data.split(mini_batch_size_per_rank)


def update_policy(actor: Trainee, data: DataProto, cfg: ActorConfig, temperature: float = 1.0,
                  mini_batch_size_per_rank: int | None = None, seed: int = 0) -> dict[str, float]:
    """``ppo_epochs`` x mini-batches x micro-batches with gradient accumulation; one lr-schedule step.
    Returns metrics averaged over steps and reduced over the data-parallel ranks."""
    topo, model = actor.topo, actor.model
    on_policy = "old_log_probs" not in data.batch
    if on_policy and (cfg.ppo_epochs != 1 or (mini_batch_size_per_rank or len(data)) < len(data)):
        raise ValueError("old_log_probs are missing: compute them first, or use the on-policy shortcut "
                         "(ppo_epochs=1 and one mini-batch per step)")
    if cfg.use_kl_loss and "ref_log_prob" not in data.batch:
        raise ValueError("use_kl_loss needs ref_log_prob in the batch (compute it with the reference model)")
    loss_fn = algos.POLICY_LOSSES[cfg.policy_loss]
    # unset (None) clip bounds leave the loss's own defaults (config.resolve fills them for a run)
    clip = {k: v for k, v in (("clip_ratio_low", cfg.clip_ratio_low), ("clip_ratio_high", cfg.clip_ratio_high))
            if v is not None}
    sums: dict[str, list[float]] = defaultdict(list)
    for epoch, pieces, num_tokens, num_seqs in accumulation_steps(actor, data, cfg.ppo_epochs,
                                                                   mini_batch_size_per_rank, cfg.shuffle, seed,
                                                                   cfg.batching):
        # metrics stay tensors until the optimizer step: one device sync per mini-batch, not per micro-batch
        step_metrics: dict[str, Any] = defaultdict(float)
        for micro in pieces:
            b = micro.batch
            mask = b["response_mask"].to(torch.float32)
            logp, entropy = response_log_probs(model, micro, temperature, cfg.batching.use_remove_padding,
                                               with_entropy=True, sp=topo)
            old = logp.detach() if on_policy else b["old_log_probs"]
            agg = {"num_global_tokens": num_tokens, "num_global_seqs": num_seqs,
                   "norm_constant": cfg.loss_scale_factor or None}
            pg_loss, pg_metrics = loss_fn(old, logp, b["advantages"], mask, clip_ratio_c=cfg.clip_ratio_c,
                                          loss_agg_mode=cfg.loss_agg_mode, weights=b.get("rollout_is_weights"),
                                          **clip, **agg)
            loss = pg_loss
            ent = algos.agg_loss(entropy, mask, cfg.loss_agg_mode, **agg)
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * ent
            if cfg.use_kl_loss:
                kl = algos.agg_loss(algos.kl_penalty(logp, b["ref_log_prob"], cfg.kl_loss_type), mask,
                                    cfg.loss_agg_mode, **agg)
                loss = loss + cfg.kl_loss_coef * kl
                step_metrics["actor/kl_loss"] += kl.detach()
            (loss * loss_scale(topo)).backward()
            # the aggregated terms are this micro-batch's share of the mini-batch value: they add up
            step_metrics["actor/pg_loss"] += pg_loss.detach()
            step_metrics["actor/entropy"] += ent.detach()
            share = mask.sum() / num_tokens.clamp(min=1)  # token-weighted mean of the ratios
            for k, v in pg_metrics.items():
                step_metrics[f"actor/{k}"] += v * share
            if epoch == 0 and "rollout_log_probs" in b:
                # stale or mismatched weights in the engine show here: the trainer's log-probs of the sampled
                # tokens (old = the policy that generated them) against the engine's own
                diff = (old.detach() - b["rollout_log_probs"]).abs()
                step_metrics["rollout/logp_abs_diff"] += (diff * mask).sum() / num_tokens.clamp(min=1)
        step_and_record(actor, cfg.optim.max_grad_norm, step_metrics, sums, "actor")
    return finish_update(actor, sums, "actor")


def loss_scale(topo: Topology) -> float:
    """FSDP averages gradients over all ranks; the sp ranks of a group each back-propagate the same (gathered)
    loss, and their slices' gradients add up through the all-reduce in forward.py."""
    return topo.world_size / topo.sp_size


def accumulation_steps(trainee: Trainee, data: DataProto, epochs: int, mini_batch_size_per_rank: int | None,
                       shuffle: bool, seed: int, batching: BatchingConfig):
    """The update's loop over ``epochs`` x mini-batches: yields (epoch, micro-batches on the device, global token
    count, global sequence count) for each optimizer step. The SP group's rows are gathered first (DESIGN step 7)."""
    topo = trainee.topo
    mb_size = (mini_batch_size_per_rank or len(data)) * topo.sp_size
    data, _ = gather_sp(data, topo)
    trainee.model.train()
    for epoch in range(epochs):
        for mini in mini_batches(data, mb_size, shuffle, seed * 1000 + epoch):
            num_tokens, num_seqs = global_counts(mini.batch["response_mask"], topo)
            pieces, _ = _micro(mini, batching, topo)
            yield epoch, [p.to(topo.device) for p in pieces], num_tokens, num_seqs


def step_and_record(trainee: Trainee, max_grad_norm: float, step_metrics: dict, sums: dict, prefix: str) -> None:
    """One clipped optimizer step at the end of a mini-batch; its metrics join the update's lists."""
    grad_norm, stepped = clipped_step(trainee.model, trainee.optimizer, max_grad_norm)
    for k, v in step_metrics.items():
        sums[k].append(float(v))
    sums[f"{prefix}/grad_norm"].append(grad_norm if stepped else float("nan"))
    sums[f"{prefix}/skipped_steps"].append(0.0 if stepped else 1.0)


def finish_update(trainee: Trainee, sums: dict, prefix: str) -> dict[str, float]:
    """One lr-schedule step; metrics averaged over the update's optimizer steps and reduced over the dp ranks.
    The loss terms and ratios are per-rank shares of the mini-batch value, so they are summed over ranks."""
    trainee.scheduler.step()
    local = {k: float(np.nanmean(v)) if not all(np.isnan(v)) else 0.0 for k, v in sums.items()}
    local[f"{prefix}/skipped_steps"] = float(np.sum(sums[f"{prefix}/skipped_steps"]))
    local[f"{prefix}/lr"] = trainee.optimizer.param_groups[0]["lr"]
    ops = {k: "sum" for k in local}
    ops.update({f"{prefix}/grad_norm": "mean", f"{prefix}/skipped_steps": "max", f"{prefix}/lr": "max"})
    return reduce_metrics(local, trainee.topo.dp_group, ops)
