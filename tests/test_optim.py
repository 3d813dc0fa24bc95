"""The optimizer step where the gradient is zero everywhere (issue 64): a solved batch (every GRPO group scored alike,
every advantage 0) gives no gradient, and AdamW stepped anyway: its momentum moved the weights, its second moment
decayed, and the next rare gradient (one sample wrong) met a denominator far below its scale. The default run,
continued past solving its task, collapsed at step ~1,620. Shown here on a small scale through the actor's own update:
a few steps with signal, a long solved stretch, then one sample of signal."""

from __future__ import annotations

import pytest
import torch

from lib.testing import run_distributed
from tests.helpers import rl_batch, save_tiny_model

LR = 1e-3  # the default preset's


def _solved_then_one_sample(path: str, step_without_gradient: bool, solved_steps: int) -> dict:
    from lib.actor import Trainee, update_policy
    from lib.config import ActorConfig, ModelConfig, OptimConfig
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model
    from lib.optim import build_optimizer

    topo = init_topology()
    cfg = ActorConfig(model=ModelConfig(path=path), optim=OptimConfig(lr=LR, weight_decay=0.0,
                                                                       step_without_gradient=step_without_gradient))
    cfg.batching.use_remove_padding = False
    model = build_sharded_model(cfg.model, cfg.fsdp, topo, packed=False)
    trainee = Trainee(model, *build_optimizer(model, cfg.optim), topo)

    def weights() -> torch.Tensor:
        return torch.cat([p.detach().full_tensor().reshape(-1) if hasattr(p, "full_tensor") else
                          p.detach().reshape(-1) for p in model.parameters()])

    def update(advantages: torch.Tensor) -> dict:
        data = rl_batch(8, seed=0).to(topo.device)
        data.batch["advantages"] = advantages * data.batch["response_mask"]
        return update_policy(trainee, data, cfg)

    g = torch.Generator().manual_seed(0)
    shape = rl_batch(8, seed=0).batch["response_mask"].shape
    for _ in range(5):  # learning: a gradient every step
        update(torch.randn(shape, generator=g))
    before_solved = weights()
    zero_steps = sum(update(torch.zeros(shape))["actor/zero_grad_steps"] for _ in range(solved_steps))
    after_solved = weights()
    one = torch.zeros(shape)
    one[3] = 0.5  # one sample of signal in a solved batch
    update(one)
    for _ in range(10):  # solved again
        update(torch.zeros(shape))
    moved = (weights() - after_solved).abs()
    return {"solved_drift": float((after_solved - before_solved).abs().max()), "zero_steps": zero_steps,
            "moved_max_lr": float(moved.max()) / LR, "moved_mean_lr": float(moved.mean()) / LR}


@pytest.mark.parametrize("step_without_gradient", [False, True], ids=["default", "verl"])
def test_a_solved_batch_leaves_adamw_as_it_is_and_one_sample_moves_little(tmp_path, step_without_gradient):
    path = save_tiny_model(str(tmp_path / "m"))
    (r,) = run_distributed(_solved_then_one_sample, path, step_without_gradient, 200, world_size=1)
    if not step_without_gradient:
        # a step without gradient is left out: the weights do not move, and the metrics count it
        assert r["solved_drift"] == 0.0 and r["zero_steps"] == 200, r
        assert r["moved_max_lr"] < 2, r  # one sample of signal: about one step of lr at most (measured 0.94)
    else:
        # AdamW stepped on zero gradients: momentum moved the weights through the solved stretch, and one sample
        # of signal moved some parameters by many times lr (measured 9.3 after 200 solved steps, 14.5 after 600)
        assert r["solved_drift"] > 0 and r["zero_steps"] == 0, r
        assert r["moved_max_lr"] > 5, r
