"""The critic: values of the states before each response token, and the clipped value update.

Same normalisation as the actor (global mini-batch counts, loss scaled by the FSDP rank count), so the
update does not depend on micro-batching or the number of ranks.

Batch keys read: input_ids, attention_mask, position_ids, responses, response_mask, values (old), returns.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from lib import algos
from lib.update import (Trainee, accumulation_steps, split_micro, finish_update, gather_sp, loss_scale,
                        step_and_record)
from lib.config import BatchingConfig, CriticConfig
from lib.dist import Topology
from lib.forward import model_rows, response_values
from lib.protocol import DataProto


@torch.no_grad()
def compute_values(critic: nn.Module, data: DataProto, batching: BatchingConfig, topo: Topology) -> torch.Tensor:
    """V (B, R) for every row of ``data``, in the rows' order; zero outside the response mask."""
    data, mine = gather_sp(model_rows(data, "response_mask"), topo)
    pieces, restore = split_micro(data, batching, topo)
    values = torch.cat([response_values(critic, m.to(topo.device), batching.use_remove_padding, sp=topo)
                        for m in pieces])
    values = values[torch.as_tensor(restore, device=values.device)] if restore is not None else values
    return values[mine]


def update_critic(critic: Trainee, data: DataProto, cfg: CriticConfig, mini_batch_size_per_rank: int | None = None,
                  seed: int = 0) -> dict[str, float]:
    """``ppo_epochs`` x mini-batches x micro-batches of the clipped value loss; one lr-schedule step."""
    topo, model = critic.topo, critic.model
    sums: dict[str, list[float]] = defaultdict(list)
    for _, pieces, num_tokens, num_seqs in accumulation_steps(critic, data, cfg.ppo_epochs,
                                                              mini_batch_size_per_rank, False, seed, cfg.batching):
        step: dict[str, Any] = defaultdict(float)  # tensors until the optimizer step (one sync per mini-batch)
        for micro in pieces:
            b = micro.batch
            mask = b["response_mask"].to(torch.float32)
            vpreds = response_values(model, micro, cfg.batching.use_remove_padding, sp=topo)
            loss, m = algos.value_loss(vpreds, b["returns"], b["values"], mask, cfg.cliprange_value,
                                       cfg.loss_agg_mode, num_global_tokens=num_tokens, num_global_seqs=num_seqs,
                                       norm_constant=cfg.loss_scale_factor or None)
            (loss * loss_scale(topo)).backward()
            share = mask.sum() / num_tokens.clamp(min=1)
            step["critic/vf_loss"] += loss.detach()
            step["critic/vf_clipfrac"] += m["vf_clipfrac"] * share
            step["critic/vpred_mean"] += algos.masked_mean(vpreds.detach(), mask) * share
        step_and_record(critic, cfg.optim.max_grad_norm, step, sums, "critic", cfg.optim.step_without_gradient)
    return finish_update(critic, sums, "critic")
