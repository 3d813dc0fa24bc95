"""Results do not depend on the number of ranks or the sequence-parallel size (issue: documented recipes).

- every advantage estimator: 1 rank and 2 ranks (same global batch) give the same advantages;
- every loss aggregation mode: 1 rank and 2 ranks give the same loss, gradient norm and updated weights;
- Ulysses sp=2 with gradient checkpointing gives the same updated actor and critic weights as sp=1 with it.
"""

import pytest
import torch

from lib.testing import run_distributed
from tests.helpers import rl_batch, save_tiny_model

ROWS = 8


def _data():
    data = rl_batch(ROWS, prompt_len=7, response_len=5, seed=11, min_response=1)
    g = torch.Generator().manual_seed(3)
    mask = data.batch["response_mask"]
    data.batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    data.batch["returns"] = torch.randn(mask.shape, generator=g) * mask
    return data


def _gc_body(path, sp):
    from lib.actor import Trainee, update_policy
    from lib.config import ActorConfig, BatchingConfig, CriticConfig, ModelConfig, OptimConfig
    from lib.critic import compute_values, update_critic
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model, iter_full_params
    from lib.optim import build_optimizer

    topo = init_topology(device="cpu", sp_size=sp)
    model_cfg = ModelConfig(path=path, gradient_checkpointing=True)
    optim = OptimConfig(lr=1e-2, eps=1.0, weight_decay=0.0)
    batching = BatchingConfig(micro_batch_size_per_rank=2)
    actor_cfg = ActorConfig(model=model_cfg, optim=optim, batching=batching)
    critic_cfg = CriticConfig(model=model_cfg, optim=optim, batching=batching)
    per_rank = ROWS // topo.world_size  # each rank loads its share; an SP group gathers its ranks' rows
    local = _data()[topo.rank * per_rank:(topo.rank + 1) * per_rank]
    actor = build_sharded_model(actor_cfg.model, actor_cfg.fsdp, topo)
    a_opt, a_sched = build_optimizer(actor, actor_cfg.optim)
    torch.manual_seed(0)  # the value head is initialised fresh (on rank 0)
    critic = build_sharded_model(critic_cfg.model, critic_cfg.fsdp, topo, kind="critic")
    c_opt, c_sched = build_optimizer(critic, critic_cfg.optim)
    local.batch["values"] = compute_values(critic, local, batching, topo)
    a_metrics = update_policy(Trainee(actor, a_opt, a_sched, topo), local, actor_cfg)
    c_metrics = update_critic(Trainee(critic, c_opt, c_sched, topo), local, critic_cfg)
    weights = {f"actor.{n}": t.clone() for n, t in iter_full_params(actor)}
    weights.update({f"critic.{n}": t.clone() for n, t in iter_full_params(critic)})
    return {"metrics": {**a_metrics, **c_metrics}, "weights": weights if topo.is_main else None}


def test_sp2_with_gradient_checkpointing_matches_sp1(tmp_path):
    # Before the fix: CheckpointError at the first update (the SP state lived in a context the recompute missed)
    path = save_tiny_model(str(tmp_path / "m"), "qwen2")
    (ref,) = run_distributed(_gc_body, path, 1, world_size=1)
    r0, _ = run_distributed(_gc_body, path, 2, world_size=2)
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        assert r0["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-6), key
    for name, w in ref["weights"].items():
        torch.testing.assert_close(r0["weights"][name], w, rtol=1e-5, atol=2e-6, msg=name)


GROUP_N = 4


def _rewards():
    g = torch.Generator().manual_seed(5)
    data = rl_batch(ROWS * 2, prompt_len=4, response_len=6, seed=2, min_response=1)
    mask = data.batch["response_mask"]
    scores = torch.randint(0, 3, (len(data),), generator=g).float()
    lengths = mask.sum(-1).long()
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(data)), lengths - 1] = scores
    uids = [f"p{i // GROUP_N}" for i in range(len(data))]  # whole groups on each rank
    values = torch.randn(mask.shape, generator=g) * mask
    return rewards, mask, uids, values


def _estimators_body():
    from lib import algos
    from lib.dist import init_topology, sum_over_ranks

    topo = init_topology(device="cpu")
    rewards, mask, uids, values = _rewards()
    per_rank = len(uids) // topo.world_size
    mine = slice(topo.rank * per_rank, (topo.rank + 1) * per_rank)
    out = {}
    for name, fn in algos.ADVANTAGE_ESTIMATORS.items():
        adv, ret = fn(rewards[mine], mask[mine], index=uids[mine], values=values[mine], gamma=0.9, lam=0.8,
                      reduce=sum_over_ranks())
        out[name] = (adv, ret)
    return out


def test_every_estimator_is_independent_of_the_world_size():
    # Before the fix GAE, REINFORCE++(-baseline) whitened with each rank's statistics and GPG counted per rank
    (one,) = run_distributed(_estimators_body, world_size=1)
    r0, r1 = run_distributed(_estimators_body, world_size=2)
    for name, (adv, ret) in one.items():
        torch.testing.assert_close(torch.cat([r0[name][0], r1[name][0]]), adv, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(torch.cat([r0[name][1], r1[name][1]]), ret, rtol=1e-5, atol=1e-6, msg=name)


MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _agg_body(path):
    """One update step in every aggregation mode, each from a fresh model (one process start for all five)."""
    from lib.actor import Trainee, update_policy
    from lib.config import ActorConfig, BatchingConfig, ModelConfig, OptimConfig
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model, iter_full_params
    from lib.optim import build_optimizer

    topo = init_topology(device="cpu")
    out = {}
    for mode in MODES:
        cfg = ActorConfig(model=ModelConfig(path=path), optim=OptimConfig(lr=1e-2, eps=1.0, weight_decay=0.0),
                          batching=BatchingConfig(micro_batch_size_per_rank=3 if topo.world_size == 1 else 1),
                          loss_agg_mode=mode, loss_scale_factor=5.0)
        model = build_sharded_model(cfg.model, cfg.fsdp, topo)
        optimizer, scheduler = build_optimizer(model, cfg.optim)
        per_rank = ROWS // topo.world_size
        local = _data()[topo.rank * per_rank:(topo.rank + 1) * per_rank]
        metrics = update_policy(Trainee(model, optimizer, scheduler, topo), local, cfg)
        out[mode] = {"metrics": metrics, "weights": {n: t.clone() for n, t in iter_full_params(model)}}
    return out


def test_every_aggregation_is_independent_of_ranks_and_micro_batches(tmp_path):
    """Each loss aggregation mode: one rank with micro-batches of 3 rows against two ranks with micro-batches of 1
    give the same loss, gradient norm and weights after a step."""
    path = save_tiny_model(str(tmp_path / "m"), "qwen2")
    (ones,) = run_distributed(_agg_body, path, world_size=1)
    twos, _ = run_distributed(_agg_body, path, world_size=2)
    for mode in MODES:
        one, two = ones[mode], twos[mode]
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-6), (mode, key)
        for name, w in one["weights"].items():
            torch.testing.assert_close(two["weights"][name], w, rtol=1e-5, atol=2e-6, msg=f"{mode}: {name}")


def _reduce_body(path, bf16, shard_size, device="cpu"):
    """Two updates of 4 micro-batches a rank on 2 ranks, with fsdp.grad_reduce micro_batch and then auto or step;
    the collectives FSDP issues counted. ``bf16``: the GPU's mixed precision (bf16 compute, fp32 reduction) on CPU.
    ``shard_size`` 1: every rank holds the whole model (with bf16, FSDP's one root unit; auto is step there).
    ``device`` cuda: the GPU's own policy (bf16 compute) and NCCL."""
    from collections import Counter

    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from lib import fsdp
    from lib.actor import Trainee, compute_log_probs, update_policy
    from lib.config import ActorConfig, BatchingConfig, FSDPConfig, ModelConfig, OptimConfig
    from lib.dist import init_topology
    from lib.optim import build_optimizer

    if bf16:
        fsdp.compute_policy = lambda topo, mixed: MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                       reduce_dtype=torch.float32)
    counts = Counter()
    # the collectives FSDP2 calls (torch 2.13: *_single; earlier: all_gather_into_tensor, reduce_scatter_tensor)
    for kind, names in (("gather", ("all_gather_single", "all_gather_into_tensor")),
                        ("reduce", ("reduce_scatter_single", "reduce_scatter_tensor")), ("all_reduce", ("all_reduce",))):
        name = next(n for n in names if hasattr(dist, n))

        def counted(*args, _kind=kind, _call=getattr(dist, name), **kwargs):
            counts[_kind] += 1
            return _call(*args, **kwargs)
        setattr(dist, name, counted)
    topo = init_topology(device=device, fsdp_shard_size=shard_size)
    per_rank = ROWS // topo.world_size
    local = _data()[topo.rank * per_rank:(topo.rank + 1) * per_rank]
    out = {}
    for mode in ("micro_batch", "auto" if shard_size == 1 else "step"):
        cfg = ActorConfig(model=ModelConfig(path=path), optim=OptimConfig(lr=1e-2, eps=1.0, weight_decay=0.0),
                          batching=BatchingConfig(micro_batch_size_per_rank=1),
                          fsdp=FSDPConfig(shard_size=shard_size, grad_reduce=mode))
        model = fsdp.build_sharded_model(cfg.model, cfg.fsdp, topo)
        optimizer, scheduler = build_optimizer(model, cfg.optim)
        counts.clear()
        metrics = [update_policy(Trainee(model, optimizer, scheduler, topo), local, cfg) for _ in range(2)]
        calls = dict(counts)
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        states = [(g.reduce_grads, g.reshard_after_backward, g.post_forward_mesh_info is not None)
                  for m in units for g in fsdp.param_groups(m)]
        out[mode] = {"metrics": metrics, "calls": calls, "units": len(units), "states": states,
                     "deferred": hasattr(model, fsdp.DEFER_FLAG),
                     "sharded": all(type(p).__name__ == "DTensor" and p.grad is None for p in model.parameters()),
                     "logp": compute_log_probs(model, local, cfg.batching, topo)[0].cpu(),
                     "weights": {n: t.cpu() for n, t in fsdp.iter_full_params(model)}}
    return out


@pytest.mark.parametrize("bf16,shard_size", [(False, 0), (True, 0), (True, 1)],
                         ids=["fp32-sharded", "bf16-sharded", "bf16-root-unit"])
def test_one_gradient_reduction_a_step_is_the_same_update(tmp_path, bf16, shard_size):
    """fsdp.grad_reduce (issue 41), 2 ranks, 4 micro-batches a rank, two updates: step (one gather and one reduction
    per optimizer step) gives the same loss, gradient norm, weights and log-probs after as micro_batch (one reduction
    per micro-batch); with the model sharded over the ranks, one reduce-scatter and one gather a unit a step against
    4 and 8; FSDP's own settings back after each step. bf16 compute (the GPU's policy, run on CPU): the unsharded
    gradients accumulate in fp32, so the two agree far below bf16's precision (accumulating in bf16 moves the
    log-probs by ~5e-4). Every rank holding the whole model with a compute cast (FSDP's one root unit, as on one
    GPU): auto picks step."""
    path = save_tiny_model(str(tmp_path / "m"), "qwen2")
    r0, r1 = run_distributed(_reduce_body, path, bf16, shard_size, world_size=2)
    base, step = r0.values()
    assert not base["deferred"] and step["deferred"]
    units, steps, micro = base["units"], 2, 4
    calls = base["calls"].pop("all_reduce") - step["calls"].pop("all_reduce")  # FSDP's and the update's own
    if shard_size == 0:
        assert base["calls"] == {"gather": 2 * units * micro * steps, "reduce": units * micro * steps}
        assert step["calls"] == {"gather": units * steps, "reduce": units * steps}
        assert calls == 0
    else:  # the root unit: no shards to gather or scatter; one all-reduce over the replicas per reduction
        assert units == 1 and base["calls"] == step["calls"] == {}
        assert calls == (micro - 1) * steps
    assert step["states"] == base["states"] == [(True, True, True)] * units
    assert step["sharded"] and base["sharded"]
    _same_update(base, step)
    for r in (r0, r1):
        base, step = r.values()
        torch.testing.assert_close(step["logp"], base["logp"], rtol=1e-5, atol=1e-6)


def _same_update(base, step):
    """Loss and gradient norm of every update (rel 1e-5), and the weights after (rtol 1e-5, atol 1e-6)."""
    for a, b in zip(base["metrics"], step["metrics"]):
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
    for name, w in base["weights"].items():
        torch.testing.assert_close(step["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_one_gradient_reduction_a_step_on_a_gpu_is_the_same_update(tmp_path):
    """On one GPU (bf16 compute, NCCL) the model is FSDP's one root unit and fsdp.grad_reduce auto reduces once a
    step: two updates of 8 micro-batches equal to reducing every micro-batch (loss, gradient norm, weights)."""
    path = save_tiny_model(str(tmp_path / "m"), "qwen2")
    (r,) = run_distributed(_reduce_body, path, False, 1, "cuda", world_size=1, backend="nccl")
    base, step = r.values()
    assert not base["deferred"] and step["deferred"] and base["units"] == 1
    _same_update(base, step)
    torch.testing.assert_close(step["logp"], base["logp"], rtol=0, atol=1e-2)  # bf16 forwards of equal weights


def test_fsdps_parameter_groups_are_read_under_both_of_its_names():
    """lib.fsdp.param_groups reads FSDP2's private state the way each torch we claim keeps it: torch 2.13's list
    (``_fsdp_param_groups``) and torch 2.11's single group (``_fsdp_param_group``, None without parameters). The
    GPU machine's torch 2.11 failed a test that read the plural (the H100 run of 2026-11-27)."""
    from types import SimpleNamespace

    from lib import fsdp

    def unit(**state):
        return SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(**state))

    a, b = object(), object()
    assert fsdp.param_groups(unit(_fsdp_param_groups=[a, b], _fsdp_param_group=a)) == [a, b]  # torch 2.13
    assert fsdp.param_groups(unit(_fsdp_param_group=a)) == [a]  # torch 2.11
    assert fsdp.param_groups(unit(_fsdp_param_group=None)) == []  # a unit without parameters of its own


def _bucketed_gathers(path: str, bucket_bytes: int) -> dict:
    import torch.distributed as dist

    from lib import fsdp
    from lib.config import FSDPConfig, ModelConfig
    from lib.dist import init_topology

    topo = init_topology(device="cpu")
    model = fsdp.build_sharded_model(ModelConfig(path=path), FSDPConfig(), topo)
    one_by_one = list(fsdp.iter_full_params(model, torch.bfloat16))
    calls = []
    plain = dist.all_gather_into_tensor

    def counted(*args, **kwargs):
        calls.append(1)
        return plain(*args, **kwargs)

    dist.all_gather_into_tensor = counted
    try:
        bucketed = list(fsdp.iter_full_params_bucketed(model, torch.bfloat16, bucket_bytes))
    finally:
        dist.all_gather_into_tensor = plain
    sizes = [t.numel() * t.element_size() for _, t in one_by_one]
    expected, size = 0, 0
    for n in sizes:  # the buckets the walk makes: a new one where the next tensor would overflow it
        if size and size + n > bucket_bytes:
            expected, size = expected + 1, 0
        size += n
    return {"names": [n for n, _ in one_by_one] == [n for n, _ in bucketed],
            "equal": all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(one_by_one, bucketed)),
            "uneven": any(t.shape[0] % 2 for _, t in one_by_one), "tensors": len(one_by_one),
            "calls": len(calls), "expected": expected + 1}


def test_the_sync_gathers_one_bucket_of_shards_at_a_time(tmp_path):
    """iter_full_params_bucketed (issue 55): on 2 ranks of a sharded model (dims that do not divide by 2, so the ranks
    hold uneven shards) every full tensor equals full_tensor()'s bit for bit, in bf16 as a sync sends it, in the same
    order, with one all-gather per bucket instead of one per parameter."""
    path = save_tiny_model(str(tmp_path / "m"), "qwen2", vocab_size=2047, intermediate_size=97)
    for r in run_distributed(_bucketed_gathers, path, 64 * 2**10, world_size=2):
        assert r["names"] and r["equal"] and r["uneven"], r
        assert r["calls"] == r["expected"] < r["tensors"] / 2, r
    # a shard group of one rank (issue 63, 6): the local tensors themselves, cast, with no buffer and no collective
    (r,) = run_distributed(_bucketed_gathers, path, 64 * 2**10, world_size=1)
    assert r["names"] and r["equal"] and r["calls"] == 0, r
