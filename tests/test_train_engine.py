"""FSDP2 training engine: 2-rank parity with one process, dynamic batching, HSDP, offload, balancing."""

import copy

import numpy as np
import pytest
import torch

from lib.balance import dynamic_micro_batches, karmarkar_karp, restore_order, workload
from lib.testing import run_distributed
from tests.helpers import rl_batch, save_tiny_model

GLOBAL_ROWS = 8


def _global_batch(seed=0):
    data = rl_batch(GLOBAL_ROWS, prompt_len=7, response_len=6, seed=seed, min_response=0)
    g = torch.Generator().manual_seed(seed + 1)
    mask = data.batch["response_mask"]
    data.batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    # old log-probs are set in the body as current + this: off-policy data, so clipping happens
    data.batch["perturb"] = 0.3 * torch.sin(torch.arange(mask.numel()).reshape(mask.shape).float())
    return data


def _actor_cfg(path, micro, dynamic=False, shard_size=0, kind_loss="vanilla", agg="token-mean", lora_rank=0):
    from lib.config import ActorConfig, BatchingConfig, FSDPConfig, LoraConfig, ModelConfig, OptimConfig

    return ActorConfig(model=ModelConfig(path=path), fsdp=FSDPConfig(shard_size=shard_size),
                       # eps = 1 keeps Adam's first step linear in the gradient, so a tolerance on the
                       # weights is a tolerance on the reduced gradients
                       optim=OptimConfig(lr=1e-2, eps=1.0, weight_decay=0.0),
                       batching=BatchingConfig(micro_batch_size_per_rank=micro, use_dynamic_batching=dynamic,
                                               max_tokens_per_rank=30),
                       policy_loss=kind_loss, loss_agg_mode=agg, entropy_coef=0.01, clip_ratio_high=0.28,
                       ppo_epochs=2, lora=LoraConfig(rank=lora_rank))


def _train_body(path, micro, dynamic, shard_size, agg, lora_rank=0):
    import torch.distributed as dist

    from lib.actor import Trainee, compute_log_probs, update_policy
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model, iter_full_params
    from lib.optim import build_optimizer

    topo = init_topology(device="cpu", fsdp_shard_size=shard_size)
    cfg = _actor_cfg(path, micro, dynamic, shard_size, agg=agg, lora_rank=lora_rank)
    model = build_sharded_model(cfg.model, cfg.fsdp, topo, lora_cfg=cfg.lora if lora_rank else None)
    optimizer, scheduler = build_optimizer(model, cfg.optim)
    data = _global_batch()
    per_rank = GLOBAL_ROWS // topo.world_size
    if topo.world_size == 1:
        # a global mini-batch is the union of every rank's local one: one process must see the rows of
        # "rank 0, mini 0" + "rank 1, mini 0" first, then the second mini-batches
        local = data[[0, 1, 4, 5, 2, 3, 6, 7]]
    else:
        local = data[topo.rank * per_rank:(topo.rank + 1) * per_rank]
    logp, entropy = compute_log_probs(model, local, cfg.batching, topo, temperature=0.9, with_entropy=True)
    local.batch["old_log_probs"] = logp + local.batch["perturb"]
    metrics = update_policy(Trainee(model, optimizer, scheduler, topo), local, cfg, temperature=0.9,
                            mini_batch_size_per_rank=per_rank // 2)
    weights = {n: t.clone() for n, t in iter_full_params(model)}
    gathered = [None] * topo.world_size
    dist.all_gather_object(gathered, (logp, entropy))
    order = torch.tensor([0, 1, 4, 5, 2, 3, 6, 7]).argsort() if topo.world_size == 1 else torch.arange(GLOBAL_ROWS)
    return {"logp": torch.cat([g[0] for g in gathered])[order], "entropy": torch.cat([g[1] for g in gathered])[order],
            "metrics": metrics, "weights": weights if topo.is_main else None}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("qwen2")), "qwen2")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_two_ranks_match_one_process(model_dir, agg):
    (single,) = run_distributed(_train_body, model_dir, 3, False, 0, agg, world_size=1)
    r0, r1 = run_distributed(_train_body, model_dir, 2, False, 0, agg, world_size=2)
    torch.testing.assert_close(r0["logp"], single["logp"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r0["entropy"], single["entropy"], rtol=1e-5, atol=1e-5)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert r0["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-4, abs=1e-6), key
    assert r0["metrics"] == r1["metrics"]
    assert single["metrics"]["actor/pg_clipfrac"] > 0  # the test exercises clipping
    for name, w in single["weights"].items():
        torch.testing.assert_close(r0["weights"][name], w, rtol=1e-5, atol=2e-6, msg=name)


def test_dynamic_batching_and_replicated_ranks_match(model_dir):
    (fixed,) = run_distributed(_train_body, model_dir, 2, False, 0, "token-mean", world_size=1)
    # shard groups of one rank: a plain replica on each rank, its gradients averaged by lib.fsdp.average_gradients
    dyn0, _ = run_distributed(_train_body, model_dir, 2, True, 1, "token-mean", world_size=2)
    torch.testing.assert_close(dyn0["logp"], fixed["logp"], rtol=1e-5, atol=1e-5)
    assert dyn0["metrics"]["actor/pg_loss"] == pytest.approx(fixed["metrics"]["actor/pg_loss"], rel=1e-4)
    for name, w in fixed["weights"].items():
        torch.testing.assert_close(dyn0["weights"][name], w, rtol=1e-5, atol=2e-6, msg=name)


def _old_in_update_body(path, precompute):
    from dataclasses import replace

    from lib.actor import Trainee, compute_log_probs, update_policy
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model, iter_full_params
    from lib.optim import build_optimizer

    topo = init_topology(device="cpu")
    cfg = replace(_actor_cfg(path, 1, dynamic=True), ppo_epochs=1, shuffle=True)
    model = build_sharded_model(cfg.model, cfg.fsdp, topo)
    optimizer, scheduler = build_optimizer(model, cfg.optim)
    per_rank = GLOBAL_ROWS // topo.world_size
    local = _global_batch()[topo.rank * per_rank:(topo.rank + 1) * per_rank]
    if precompute:
        local.batch["old_log_probs"] = compute_log_probs(model, local, cfg.batching, topo, temperature=0.9)[0]
    metrics = update_policy(Trainee(model, optimizer, scheduler, topo), local, cfg, temperature=0.9,
                            mini_batch_size_per_rank=per_rank // 2, seed=3)
    return {"metrics": metrics, "weights": {n: t.clone() for n, t in iter_full_params(model)}}


def test_old_log_probs_taken_in_the_update_match_a_separate_pass(model_dir):
    """Without old log-probs (ppo_epochs 1) the update takes them from the policy before its first step: the
    first mini-batch from its own forward, the others by a no-grad pass. Same update as a separate pass first.
    (Before: update_policy refused a batch without old log-probs and more than one mini-batch.)"""
    separate, _ = run_distributed(_old_in_update_body, model_dir, True, world_size=2)
    inside, _ = run_distributed(_old_in_update_body, model_dir, False, world_size=2)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert inside["metrics"][key] == pytest.approx(separate["metrics"][key], rel=1e-5, abs=1e-7), key
    assert separate["metrics"]["actor/ppo_kl"] != 0.0  # the second mini-batch ran off-policy
    for name, w in separate["weights"].items():
        torch.testing.assert_close(inside["weights"][name], w, rtol=1e-6, atol=1e-7, msg=name)


def _offload_body(path):
    from lib.config import ActorConfig, ModelConfig
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model, iter_full_params, load_model, move_optimizer, offload_model
    from lib.optim import build_optimizer

    topo = init_topology(device="cpu")
    cfg = ActorConfig(model=ModelConfig(path=path))
    model = build_sharded_model(cfg.model, cfg.fsdp, topo)
    optimizer, _ = build_optimizer(model, cfg.optim)
    loss = sum(p.float().sum() for p in model.parameters())
    loss.backward()
    optimizer.step()
    before = {n: t.clone() for n, t in iter_full_params(model)}
    state_before = [v["exp_avg"].full_tensor().clone() for v in optimizer.state.values()]
    offload_model(model)
    move_optimizer(optimizer, "cpu")
    load_model(model, topo.device)
    move_optimizer(optimizer, topo.device)
    after = {n: t.clone() for n, t in iter_full_params(model)}
    state_after = [v["exp_avg"].full_tensor() for v in optimizer.state.values()]
    return all(torch.equal(before[n], after[n]) for n in before) and all(
        torch.equal(a, b) for a, b in zip(state_before, state_after))


def test_offload_round_trip_keeps_values(model_dir):
    assert run_distributed(_offload_body, model_dir) == [True, True]


def _sharded_loads_like_hf_body(path, arch):
    from transformers import AutoModelForCausalLM

    from lib.config import ActorConfig, ModelConfig
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model
    from lib.forward import response_log_probs

    topo = init_topology(device="cpu")
    cfg = ActorConfig(model=ModelConfig(path=path))
    model = build_sharded_model(cfg.model, cfg.fsdp, topo, trainable=False)
    data = rl_batch(4, seed=3)
    with torch.no_grad():
        ours = response_log_probs(model, data)[0]
        ref = response_log_probs(AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa"), data)[0]
    return float((ours - ref).abs().max())


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen3", True)])
def test_meta_init_broadcast_matches_hf(tmp_path, arch, tied):
    path = save_tiny_model(str(tmp_path / arch), arch, tie_word_embeddings=tied)
    assert max(run_distributed(_sharded_loads_like_hf_body, path, arch)) < 1e-5


def _critic_body(path):
    from lib.actor import Trainee
    from lib.config import CriticConfig, ModelConfig
    from lib.critic import compute_values, update_critic
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model
    from lib.optim import build_optimizer

    topo = init_topology(device="cpu")
    cfg = CriticConfig(model=ModelConfig(path=path))
    cfg.optim.lr = 1e-3
    model = build_sharded_model(cfg.model, cfg.fsdp, topo, kind="critic")
    optimizer, scheduler = build_optimizer(model, cfg.optim)
    data = rl_batch(4, seed=topo.rank)
    values = compute_values(model, data, cfg.batching, topo)
    data.batch["values"] = values
    data.batch["returns"] = (values + 0.3) * data.batch["response_mask"]  # inside the value clip range
    losses = [update_critic(Trainee(model, optimizer, scheduler, topo), data, cfg)["critic/vf_loss"]
              for _ in range(15)]
    # the same weights in a model built for padded rows (a packed model refuses them)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    padded_model = build_sharded_model(cfg.model, cfg.fsdp, topo, kind="critic", packed=False)
    set_model_state_dict(padded_model, get_model_state_dict(model))
    padded = compute_values(padded_model, data, cfg.batching.__class__(use_remove_padding=False), topo)
    packed = compute_values(model, data, cfg.batching, topo)
    return losses, float((padded - packed).abs().max()), bool((values * (1 - data.batch["response_mask"]) == 0).all())


def test_critic_learns_returns(model_dir):
    (losses, diff, masked), _ = run_distributed(_critic_body, model_dir)
    assert losses[-1] < 0.2 * losses[0] and diff < 1e-5 and masked


# ---- balancing


def test_karmarkar_karp_is_a_partition_within_one_percent():
    rng = np.random.default_rng(0)
    for k, equal in [(4, False), (8, True), (3, True)]:
        lengths = rng.integers(50, 4000, size=240)
        loads = workload(lengths)
        parts = karmarkar_karp(loads.tolist(), k, equal_size=equal)
        flat = sorted(i for p in parts for i in p)
        assert flat == list(range(240))  # every item exactly once
        if equal:
            assert {len(p) for p in parts} == {240 // k}
        best_possible = max(loads.sum() / k, loads.max())
        assert max(loads[p].sum() for p in parts) <= 1.01 * best_possible
    with pytest.raises(ValueError, match="multiple of 7"):
        karmarkar_karp([1.0] * 10, 7, equal_size=True)
    assert karmarkar_karp([], 3) == [[], [], []]


def test_dynamic_micro_batches_local():
    lengths = [5, 17, 3, 9, 30, 1, 12]
    parts = dynamic_micro_batches(lengths, max_tokens=30)
    assert sorted(i for p in parts for i in p) == list(range(7))
    assert all(sum(lengths[i] for i in p) <= 30 for p in parts)
    assert len(parts) == 3  # 77 tokens need at least 3 parts of 30
    perm = restore_order(parts)
    flat = np.concatenate(parts)
    assert (flat[perm] == np.arange(7)).all()
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        dynamic_micro_batches([31], max_tokens=30)


def _balance_body():
    from lib.balance import balance_across_ranks, dynamic_micro_batches
    from lib.dist import init_topology
    from lib.protocol import DataProto

    topo = init_topology(device="cpu")
    # rank 0 has all the long rows: balancing must move some of them
    n = 8
    lengths = [60] * n if topo.rank == 0 else [5] * n
    mask = torch.zeros(n, 64, dtype=torch.long)
    for i, L in enumerate(lengths):
        mask[i, :L] = 1
    data = DataProto.from_dict({"attention_mask": mask}, {"row": [f"{topo.rank}-{i}" for i in range(n)]})
    mine, metrics = balance_across_ranks(data, linear_weight=0)
    # micro-batch counts agree across ranks even though rank 1's rows would fit in one
    parts = dynamic_micro_batches([60] * 4 if topo.rank == 0 else [5], max_tokens=60)
    return list(mine.non_tensor_batch["row"]), metrics, len(parts)


def test_balance_across_two_ranks():
    (rows0, m0, k0), (rows1, m1, k1) = run_distributed(_balance_body)
    assert sorted(rows0 + rows1) == sorted([f"{r}-{i}" for r in range(2) for i in range(8)])
    assert len(rows0) == len(rows1) == 8
    assert sum(r.startswith("0-") for r in rows0) == 4  # the long rows are split evenly
    assert m0["balance/imbalance_before"] > 1.9 and m0["balance/imbalance_after"] == pytest.approx(1.0)
    assert k0 == k1 == 4


def _tiny_lm(arch="qwen2", **overrides):
    from transformers import AutoModelForCausalLM

    from tests.helpers import tiny_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32,
                                            attn_implementation="sdpa")


@pytest.mark.parametrize("packed", [True, False])
def test_the_fused_head_makes_no_logits_and_trains_the_same_model(packed):
    """model.fused_head (the default): the forward's LM head makes the response log-probs and entropy itself, chunk by
    chunk (lib.logprobs.head_log_probs): the head returns 2 columns (log-prob, entropy), not the vocabulary's, and
    the log-probs, the entropy and every parameter's gradient (the tied embedding's among them) are those of the
    whole-logits forward. (Under FSDP: tests/test_train_engine.py's 2-rank tests, which run it by default.)"""
    from lib.forward import fuses_head, response_log_probs
    from lib.models import UNFUSED_HEAD_ATTR

    model = _tiny_lm()
    assert model.lm_head.weight is model.model.embed_tokens.weight and fuses_head(model)
    widths = []
    model.lm_head.register_forward_hook(lambda m, args, out: widths.append(out.shape[-1]))
    data = rl_batch(6, prompt_len=7, response_len=6, seed=3)
    got = {}
    for fused in (True, False):
        setattr(model, UNFUSED_HEAD_ATTR, not fused)
        model.zero_grad()
        logp, entropy = response_log_probs(model, data, 0.9, packed=packed, with_entropy=True)
        ((logp * data.batch["response_mask"]).sum() + 0.1 * entropy.sum()).backward()
        got[fused] = (logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert widths == [2, model.config.vocab_size]
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[True][1], got[False][1], rtol=1e-6, atol=1e-6)
    for name, grad in got[False][2].items():
        torch.testing.assert_close(got[True][2][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_model_that_changes_its_logits_after_the_head_is_never_fused():
    """Gemma's softcap and Granite's scale (applied at 1.0 too) are known (lib.forward.fuses_head): such a model makes
    its whole logits. One that changes them some other way is caught at its first forward (the head's output is not
    what the forward returned), with the flag that turns the fused head off, rather than trained on log-probs that are
    not its own."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from lib.forward import fuses_head, response_log_probs

    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           final_logit_softcapping=30.0))
    assert not fuses_head(gemma)
    assert not fuses_head(_tiny_lm("granite")) and fuses_head(_tiny_lm("llama"))
    model = _tiny_lm()
    model.register_forward_hook(lambda m, args, out: out.__setitem__("logits", out.logits * 2))
    with pytest.raises(RuntimeError, match="changes the logits after it.*--actor.model.fused_head off"):
        response_log_probs(model, rl_batch(2, seed=1), packed=True)


def test_adamws_fused_kernel_is_the_same_update():
    """optim.fused (issue 55's lever): AdamW's fused kernel gives the multi-tensor kernel's update to fp32 rounding,
    weight decay and the schedule included, over a few steps."""
    from lib.config import OptimConfig
    from lib.optim import build_optimizer

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    models = {fused: copy.deepcopy(base) for fused in (False, True)}
    grads = [[torch.randn_like(p) for p in base.parameters()] for _ in range(3)]
    for fused, model in models.items():
        optimizer, scheduler = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=2,
                                                                  fused=fused))
        for step in grads:
            for p, g in zip(model.parameters(), step):
                p.grad = g.clone()
            optimizer.step()
            scheduler.step()
    assert any(not torch.equal(a, b) for a, b in zip(base.parameters(), models[True].parameters()))  # it moved
    for a, b in zip(models[False].parameters(), models[True].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
