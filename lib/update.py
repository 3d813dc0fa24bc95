"""The mini-batch / micro-batch update loop that the actor and the critic share.

Loss normalisation: each micro-batch's loss is aggregated with the *global* mini-batch counts (tokens or
sequences, summed over micro-batches and data-parallel ranks), so summing the micro-batch losses over a
rank and over ranks gives exactly the mini-batch loss. FSDP averages gradients over the ranks of its mesh,
so the backward pass scales each loss by that rank count (``loss_scale``). An update therefore does not depend
on the micro-batch size, on dynamic batching, or on the number of ranks.

    for epoch, pieces, num_tokens, num_seqs in accumulation_steps(trainee, data, ...):
        for micro in pieces: (loss(micro, num_tokens, num_seqs) * loss_scale(topo)).backward()
        step_and_record(trainee, ...)          # one clipped optimizer step per mini-batch
    metrics = finish_update(trainee, ...)      # one lr-schedule step per update
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lib.balance import micro_batches
from lib.config import BatchingConfig
from lib.dist import Topology, all_gather, reduce_metrics
from lib.fsdp import accumulating
from lib.optim import clipped_step
from lib.protocol import DataProto


@dataclass
class Trainee:
    """A sharded model with its optimizer and schedule (the actor, or the critic)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    topo: Topology


def split_micro(data: DataProto, batching: BatchingConfig, topo: Topology):
    """Micro-batches of this rank's (SP-gathered) rows by the batching config, and the order that restores them."""
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


def loss_scale(topo: Topology) -> float:
    """FSDP averages gradients over all ranks; the sp ranks of a group each back-propagate the same (gathered)
    loss, and their slices' gradients add up through the all-reduce in forward.py."""
    return topo.world_size / topo.sp_size


def accumulation_steps(trainee: Trainee, data: DataProto, epochs: int, mini_batch_size_per_rank: int | None,
                       shuffle: bool, seed: int, batching: BatchingConfig,
                       before_epoch: Callable[[list[DataProto]], None] | None = None):
    """The update's loop over ``epochs`` x mini-batches: yields (epoch, micro-batches on the device (an iterator:
    lib.fsdp.accumulating), global token count, global sequence count) for each optimizer step. The SP group's rows
    are gathered first (DESIGN step 7). ``before_epoch(mini_batches)`` runs before each epoch's first optimizer step."""
    topo = trainee.topo
    mb_size = (mini_batch_size_per_rank or len(data)) * topo.sp_size
    data, _ = gather_sp(data, topo)
    trainee.model.train()
    for epoch in range(epochs):
        minis = mini_batches(data, mb_size, shuffle, seed * 1000 + epoch)
        if before_epoch is not None:
            before_epoch(minis)
        for mini in minis:
            num_tokens, num_seqs = global_counts(mini.batch["response_mask"], topo)
            pieces, _ = split_micro(mini, batching, topo)
            yield epoch, accumulating(trainee.model, [p.to(topo.device) for p in pieces]), num_tokens, num_seqs


def step_and_record(trainee: Trainee, max_grad_norm: float, step_metrics: dict, sums: dict, prefix: str,
                    step_without_gradient: bool = False) -> None:
    """One clipped optimizer step at the end of a mini-batch (lib.optim.clipped_step: left out where the gradient is
    non-finite, or zero everywhere); its metrics join the update's lists."""
    grad_norm, outcome = clipped_step(trainee.model, trainee.optimizer, max_grad_norm, step_without_gradient)
    for k, v in step_metrics.items():
        sums[k].append(float(v))
    sums[f"{prefix}/grad_norm"].append(grad_norm if outcome != "non-finite" else float("nan"))
    sums[f"{prefix}/skipped_steps"].append(float(outcome == "non-finite"))
    sums[f"{prefix}/zero_grad_steps"].append(float(outcome == "zero"))


def finish_update(trainee: Trainee, sums: dict, prefix: str) -> dict[str, float]:
    """One lr-schedule step; metrics averaged over the update's optimizer steps and reduced over the dp ranks.
    The loss terms and ratios are per-rank shares of the mini-batch value, so they are summed over ranks.
    ``<prefix>/lr`` is the rate this update's optimizer steps used (the schedule moves on after it)."""
    local = {k: float(np.nanmean(v)) if not all(np.isnan(v)) else 0.0 for k, v in sums.items()}
    local[f"{prefix}/skipped_steps"] = float(np.sum(sums[f"{prefix}/skipped_steps"]))
    local[f"{prefix}/zero_grad_steps"] = float(np.sum(sums[f"{prefix}/zero_grad_steps"]))
    local[f"{prefix}/lr"] = trainee.optimizer.param_groups[0]["lr"]
    trainee.scheduler.step()
    ops = {k: "sum" for k in local}
    ops.update({f"{prefix}/grad_norm": "mean", f"{prefix}/skipped_steps": "max", f"{prefix}/zero_grad_steps": "max",
                f"{prefix}/lr": "max"})
    return reduce_metrics(local, trainee.topo.dp_group, ops)
