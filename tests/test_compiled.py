"""actor.model.compile_layers (issue 55's lever): the compiled decoder layers compute the eager model's numbers, in a
packed GRPO update of a tiny Qwen2 (GQA, tied embeddings): the log-probs before it and the weights after it."""

import torch

from lib.testing import run_distributed
from tests.helpers import rl_batch, save_tiny_model


def _body(path, compiled):
    from lib.actor import Trainee, compute_log_probs, update_policy
    from lib.config import ActorConfig, BatchingConfig, ModelConfig, OptimConfig
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model, iter_full_params
    from lib.optim import build_optimizer

    topo = init_topology(device="cpu")
    # eps 1: an update linear in the gradient (Adam's first step is otherwise its sign, which fp32 rounding flips)
    cfg = ActorConfig(model=ModelConfig(path=path, compile_layers=compiled),
                      optim=OptimConfig(lr=1e-2, eps=1.0, weight_decay=0.0),
                      batching=BatchingConfig(use_dynamic_batching=True, max_tokens_per_rank=40))
    data = rl_batch(6, prompt_len=5, response_len=7, seed=4, min_response=1)
    g = torch.Generator().manual_seed(1)
    data.batch["advantages"] = torch.randn(data.batch["response_mask"].shape, generator=g) * data.batch["response_mask"]
    model = build_sharded_model(cfg.model, cfg.fsdp, topo)
    logp, _ = compute_log_probs(model, data, cfg.batching, topo)
    data.batch["old_log_probs"] = logp
    metrics = update_policy(Trainee(model, *build_optimizer(model, cfg.optim), topo), data, cfg)
    from torch._dynamo.utils import counters

    return {"logp": logp, "grad_norm": metrics["actor/grad_norm"], "graphs": counters["stats"]["unique_graphs"],
            "weights": {n: t.clone() for n, t in iter_full_params(model)}}


def test_compiled_layers_compute_the_eager_models_numbers(tmp_path):
    path = save_tiny_model(str(tmp_path / "m"), "qwen2")
    (eager,) = run_distributed(_body, path, False, world_size=1, timeout=600)
    (compiled,) = run_distributed(_body, path, True, world_size=1, timeout=600)
    assert compiled["graphs"] > 0 and eager["graphs"] == 0  # it compiled (micro-batches of several lengths)
    torch.testing.assert_close(compiled["logp"], eager["logp"], rtol=1e-5, atol=1e-5)
    assert abs(compiled["grad_norm"] - eager["grad_norm"]) <= 1e-4 * eager["grad_norm"]
    for name, w in eager["weights"].items():
        torch.testing.assert_close(compiled["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)
