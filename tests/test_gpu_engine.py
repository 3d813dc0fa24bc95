"""The training engine on a CUDA GPU (NCCL, bf16 compute with fp32 master weights and reduction)."""

import pytest
import torch

from lib.testing import run_distributed
from tests.helpers import rl_batch, save_tiny_model

pytestmark = pytest.mark.gpu


def _gpu_body(path):
    from lib.actor import Trainee, compute_log_probs, update_policy
    from lib.config import ActorConfig, BatchingConfig, FSDPConfig, ModelConfig
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model, iter_full_params, load_model, move_optimizer, offload_model
    from lib.optim import build_optimizer

    topo = init_topology()
    assert topo.device.type == "cuda" and "nccl" in topo.backend
    out = {}
    data = rl_batch(8, seed=5)
    for mp in (True, False):
        cfg = ActorConfig(model=ModelConfig(path=path), fsdp=FSDPConfig(mixed_precision=mp),
                          batching=BatchingConfig(micro_batch_size_per_rank=4))
        model = build_sharded_model(cfg.model, cfg.fsdp, topo)
        out[f"param_dtype_{mp}"] = str(next(model.parameters()).dtype)
        out[f"logp_{mp}"] = compute_log_probs(model, data, cfg.batching, topo)[0].cpu()
    optimizer, scheduler = build_optimizer(model, cfg.optim)
    data.batch["advantages"] = torch.randn(data.batch["response_mask"].shape) * data.batch["response_mask"]
    out["metrics"] = update_policy(Trainee(model, optimizer, scheduler, topo), data, cfg)
    before = {n: t.clone() for n, t in iter_full_params(model)}
    free0 = torch.cuda.memory_allocated()
    offload_model(model)
    move_optimizer(optimizer, "cpu")
    out["freed_bytes"] = free0 - torch.cuda.memory_allocated()
    load_model(model, topo.device)
    move_optimizer(optimizer, topo.device)
    out["roundtrip_ok"] = all(torch.equal(before[n], t) for n, t in iter_full_params(model))
    return out


def test_bf16_fsdp_on_gpu(tmp_path):
    path = save_tiny_model(str(tmp_path / "m"), "qwen2")
    (out,) = run_distributed(_gpu_body, path, world_size=1, backend="nccl")
    assert out["param_dtype_True"] == "torch.float32"  # master weights stay fp32; compute is bf16
    diff = (out["logp_True"] - out["logp_False"]).abs().max().item()
    assert 0 < diff < 0.1  # bf16 compute differs from fp32, but only by rounding
    assert out["metrics"]["actor/skipped_steps"] == 0 and out["metrics"]["actor/grad_norm"] > 0
    assert out["roundtrip_ok"] and out["freed_bytes"] > 0
