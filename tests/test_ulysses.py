"""Ulysses SP=2 against SP=1: log-probs, entropy, values and the weights after an update step."""

import pytest
import torch

from lib.testing import run_distributed
from lib.attention import packing
from lib.ulysses import check_heads
from tests.helpers import rl_batch, save_tiny_model

ROWS = 6


def _data():
    # odd prompt/response lengths, so packed rows need padding to a multiple of sp
    data = rl_batch(ROWS, prompt_len=7, response_len=5, seed=11, min_response=1)
    g = torch.Generator().manual_seed(3)
    data.batch["advantages"] = torch.randn(data.batch["response_mask"].shape, generator=g) * data.batch["response_mask"]
    return data


def _sp_body(path, sp, loss_agg, checkpointing=False, lora_rank=0):
    from lib.actor import Trainee, compute_log_probs, update_policy
    from lib.config import ActorConfig, BatchingConfig, LoraConfig, ModelConfig, OptimConfig
    from lib.critic import compute_values
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model, iter_full_params
    from lib.optim import build_optimizer

    topo = init_topology(device="cpu", sp_size=sp)
    cfg = ActorConfig(model=ModelConfig(path=path, gradient_checkpointing=checkpointing),
                      optim=OptimConfig(lr=1e-2, eps=1.0, weight_decay=0.0),
                      batching=BatchingConfig(micro_batch_size_per_rank=2 if sp == 1 else 1),
                      loss_agg_mode=loss_agg, policy_loss="gspo" if loss_agg == "seq-mean-token-mean" else "vanilla",
                      entropy_coef=0.01, lora=LoraConfig(rank=lora_rank))
    model = build_sharded_model(cfg.model, cfg.fsdp, topo, lora_cfg=cfg.lora if lora_rank else None)
    data = _data()
    per_rank = ROWS // topo.world_size
    local = data[topo.rank * per_rank:(topo.rank + 1) * per_rank]
    logp, entropy = compute_log_probs(model, local, cfg.batching, topo, temperature=0.8, with_entropy=True)
    torch.manual_seed(0)  # the value head is initialised fresh (on rank 0)
    critic = build_sharded_model(cfg.model, cfg.fsdp, topo, kind="critic", trainable=False)
    values = compute_values(critic, local, cfg.batching, topo)
    local.batch["old_log_probs"] = logp + 0.05 * local.batch["response_mask"]
    optimizer, scheduler = build_optimizer(model, cfg.optim)
    metrics = update_policy(Trainee(model, optimizer, scheduler, topo), local, cfg, temperature=0.8)
    weights = {n: t.clone() for n, t in iter_full_params(model)}
    return {"logp": logp, "entropy": entropy, "values": values, "metrics": metrics,
            "weights": weights if topo.is_main else None}


@pytest.mark.parametrize("arch,kv_heads,agg", [("qwen2", 2, "token-mean"), ("llama", 1, "seq-mean-token-mean")])
def test_sp2_matches_sp1(tmp_path, arch, kv_heads, agg):
    # kv_heads=1 < sp=2: key/value heads are repeated before the exchange
    path = save_tiny_model(str(tmp_path / arch), arch, num_key_value_heads=kv_heads)
    (ref,) = run_distributed(_sp_body, path, 1, agg, world_size=1)
    r0, r1 = run_distributed(_sp_body, path, 2, agg, world_size=2)
    for key in ("logp", "entropy", "values"):
        torch.testing.assert_close(torch.cat([r0[key], r1[key]]), ref[key], rtol=1e-5, atol=1e-5, msg=key)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert r0["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6), key
    for name, w in ref["weights"].items():
        torch.testing.assert_close(r0["weights"][name], w, rtol=1e-5, atol=2e-6, msg=name)


def test_head_counts_are_checked():
    check_heads(4, 2, 2)
    check_heads(4, 1, 2)
    check_heads(8, 2, 4)
    with pytest.raises(ValueError, match=r"6 query heads do not divide by sp=4.*\[1, 2, 3, 6\]"):
        check_heads(6, 6, 4)
    with pytest.raises(ValueError, match="3 key/value heads neither divide by sp=2 nor divide it"):
        check_heads(6, 3, 2)


def _refused_body(path):
    from lib.config import ModelConfig
    from lib.config import FSDPConfig
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model

    topo = init_topology(device="cpu", sp_size=2)
    try:
        build_sharded_model(ModelConfig(path=path), FSDPConfig(), topo)
    except ValueError as e:
        return str(e)
    return None


def test_refused_before_loading(tmp_path):
    path = save_tiny_model(str(tmp_path / "odd"), "qwen2", num_attention_heads=3, num_key_value_heads=3,
                           hidden_size=24)
    messages = run_distributed(_refused_body, path)
    assert all(m and "3 query heads do not divide by sp=2" in m for m in messages)


def test_packing_from_positions():
    p = packing(torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]]))
    assert p.segments == [(0, 3), (3, 5), (5, 6), (6, 8)] and p.max_len == 3 and p.group is None
    assert p.cu_seqlens.tolist() == [0, 3, 5, 6, 8] and p.cu_seqlens.dtype == torch.int32
