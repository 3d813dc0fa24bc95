"""AdamW, the warm-up + constant/cosine schedule, and a clipped step that skips non-finite and all-zero gradients."""

from __future__ import annotations

import math

import torch
from torch import nn

from lib.config import OptimConfig
from lib.fsdp import average_gradients


def lr_multiplier(step: int, cfg: OptimConfig) -> float:
    """Fraction of the peak lr at training step (update) ``step``, 0-based: the schedule steps once per update,
    whatever the optimizer steps (mini-batches x epochs) in it."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or cfg.total_steps <= cfg.warmup_steps:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    params = [p for p in model.parameters() if p.requires_grad]
    # foreach: one multi-tensor kernel per op, not a Python loop over parameters (torch picks it on CUDA only;
    # on CPU it is the same arithmetic, and faster for the many small tensors of a small model)
    kernel = {"fused": True} if cfg.fused else {"foreach": True}
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                  **kernel)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))
    return optimizer, scheduler


def clipped_step(model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float,
                 step_without_gradient: bool = False) -> tuple[float, str]:
    """Clip the global grad norm (over all shards: DTensor norms reduce across the mesh) and step.
    A non-finite norm skips the step and clears the gradients ("non-finite"); so does a norm of exactly 0 ("zero":
    no gradient anywhere, OptimConfig.step_without_gradient) unless ``step_without_gradient``. The norm is the global
    one, so every rank decides alike. Returns (norm, "stepped" | "non-finite" | "zero").
    A plain replica's gradients are first averaged over the ranks (lib.fsdp.average_gradients)."""
    average_gradients(model)
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    norm = float(norm)
    if not math.isfinite(norm):
        outcome = "non-finite"
    elif norm == 0.0 and not step_without_gradient:
        outcome = "zero"
    else:
        outcome = "stepped"
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, outcome
