"""What both training scripts share: start-up (validated before any model loads), rollout, scoring,
validation, checkpoints. The algorithm-specific stages live in train_grpo.py / train_ppo.py.

Batch keys, by the stage that writes them:
  load_prompts   input_ids, attention_mask, position_ids (prompts); data_source, ground_truth, extra_info,
                 raw_prompt, row, uid
  rollout        prompts, responses, response_mask, input_ids, attention_mask, position_ids, rollout_log_probs
  score          token_level_scores (B, R); scores (object, per row)
  log-probs      old_log_probs, ref_log_prob (actor / reference); values (critic, PPO)
  advantages     token_level_rewards, advantages, returns; rollout_is_weights (rollout correction)
"""

from __future__ import annotations

import os
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lib import algos, checkpoint, toy
from lib.actor import Trainee
from lib.config import Config, Sizes, resolve, to_dict, validate
from lib.data import PromptSet, Sampler, check_files, collate, load_prompts
from lib.dist import Topology, init_topology, reduce_metrics
from lib.engine import SamplingConfig
from lib.fsdp import build_sharded_model, move_optimizer
from lib.logging import RunLogger, excepthook_rank, run_dir
from lib.models import load_config, load_tokenizer
from lib.optim import build_optimizer
from lib.protocol import DataProto
from lib.rewards import RewardModel, Scorer, load_custom
from lib.sync import enter_rollout, exit_rollout


@dataclass
class Run:
    cfg: Config
    topo: Topology
    sizes: Sizes
    path: str
    tokenizer: Any
    train: PromptSet
    val: PromptSet | None
    sampler: Sampler
    total_steps: int
    logger: RunLogger
    scorer: Scorer
    engine: Any = None
    actor: Trainee | None = None
    ref: torch.nn.Module | None = None
    data_position: int = 0
    """Prompt batches drawn from the data stream so far (one per step; more with dynamic sampling). Checkpointed."""


def start(cfg: Config, need_critic: bool = False) -> Run:
    """Process group, toy assets, config checks, data and logger: everything that can fail on user input,
    before any model is loaded."""
    if uses_vllm(cfg):
        from lib.engine.vllm import strip_expandable_segments

        strip_expandable_segments()  # before CUDA's allocator starts: it reads the setting once
    topo = init_topology(sp_size=cfg.trainer.sp_size, fsdp_shard_size=cfg.actor.fsdp.shard_size,
                         rollout_tp_size=cfg.rollout.tp_size, device=cfg.trainer.device)
    excepthook_rank(topo.rank)
    torch.manual_seed(cfg.trainer.seed)
    resolve_toy(cfg, topo)
    resolved = resolve(cfg)
    try:
        model_config = load_config(cfg.actor.model.path, cfg.actor.model.trust_remote_code)
        sizes = validate(cfg, topo.world_size, model_config, need_critic)
        check_files(cfg.data.train_files, "train")
        check_files(cfg.data.val_files, "val")
        if cfg.reward.custom_fn:
            load_custom(cfg.reward.custom_fn)
    except (ValueError, OSError) as e:  # user input: one message, no traceback, nothing loaded or written
        if topo.is_main:
            print(f"error: {e}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        raise SystemExit(2) from None
    tokenizer = load_tokenizer(cfg.actor.model.path, cfg.actor.model.trust_remote_code)
    d = cfg.data
    train = load_prompts(d.train_files, tokenizer, d.max_prompt_length, d.truncation, d.apply_chat_template, d.limit)
    val = load_prompts(d.val_files, tokenizer, d.max_prompt_length, d.truncation, d.apply_chat_template,
                       d.limit) if d.val_files and cfg.trainer.val_every else None
    sampler = Sampler(len(train), cfg.trainer.train_batch_size, cfg.trainer.seed, d.shuffle)
    total = cfg.trainer.total_steps or cfg.trainer.epochs * sampler.steps_per_epoch
    path = run_dir(cfg.trainer.output_root, cfg.trainer.run_name)
    obj = [path]
    dist.broadcast_object_list(obj, src=0)  # one run folder, even if the clocks of the ranks differ
    logger = RunLogger(obj[0], to_dict(cfg), total, cfg.trainer.logger, cfg.trainer.project, topo.is_main)
    logger.print(f"{topo}\nprompts: train {train.stats}, val {val.stats if val else None}; {total} steps; "
                 f"run folder {obj[0]}" + "".join(f"\nresolved: {line}" for line in resolved))
    rm = RewardModel(cfg.reward.reward_model, topo.device) if cfg.reward.reward_model else None
    scorer = Scorer(tokenizer, cfg.reward.custom_fn, cfg.reward.timeout_s, rm)
    return Run(cfg, topo, sizes, obj[0], tokenizer, train, val, sampler, total, logger, scorer)


def resolve_toy(cfg: Config, topo: Topology) -> None:
    """``toy`` in the model path or data files means the embedded task: rank 0 builds it once."""
    uses_toy = cfg.actor.model.path == "toy" or "toy" in cfg.data.train_files or "toy" in cfg.data.val_files
    if not uses_toy:
        return
    assets = os.path.join(cfg.trainer.output_root, "toy_assets")
    if topo.is_main:
        toy.prepare(assets, seed=0)
    dist.barrier()
    paths = toy.prepare(assets, seed=0)  # already built: just the paths
    if cfg.actor.model.path == "toy":
        cfg.actor.model.path = paths["model"]
    cfg.data.train_files = [paths["train"] if f == "toy" else f for f in cfg.data.train_files]
    cfg.data.val_files = [paths["val"] if f == "toy" else f for f in cfg.data.val_files]


def build_models(run: Run, with_ref: bool) -> None:
    cfg, topo = run.cfg, run.topo
    packed = cfg.actor.batching.use_remove_padding
    model = build_sharded_model(cfg.actor.model, cfg.actor.fsdp, topo, packed=packed)
    cfg.actor.optim.total_steps = cfg.actor.optim.total_steps or run.total_steps
    optimizer, scheduler = build_optimizer(model, cfg.actor.optim)
    run.actor = Trainee(model, optimizer, scheduler, topo)
    if with_ref:  # the frozen start policy; never a second rollout engine
        run.ref = build_sharded_model(cfg.actor.model, cfg.actor.fsdp, topo, trainable=False, packed=packed)
    run.engine = build_engine(run)


def engine_dtype(run: Run) -> torch.dtype:
    return torch.bfloat16 if run.topo.device.type == "cuda" else torch.float32


def build_engine(run: Run) -> Any:
    cfg, topo, r = run.cfg, run.topo, run.cfg.rollout
    sampling = SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, n=r.n,
                              max_new_tokens=r.max_response_length, seed=cfg.trainer.seed)
    val = SamplingConfig(temperature=r.val_temperature, n=r.val_n, max_new_tokens=r.max_response_length,
                         seed=cfg.trainer.seed + 1)
    tok = run.tokenizer
    eos = [tok.eos_token_id]
    if uses_vllm(cfg):
        from lib.engine.vllm import VLLMEngine

        # sequences one generate call holds at once on a rank (a TP group generates its ranks' rows together)
        val_rows = -(-len(run.val) // topo.world_size) * r.val_n if run.val is not None else 0
        num_seqs = max(run.sizes.samples_per_rank, val_rows) * topo.rollout_tp_size
        return VLLMEngine(cfg.actor.model.path, topo, tok.pad_token_id, eos, sampling, val,
                          max_model_len=cfg.data.max_prompt_length + r.max_response_length,
                          max_num_seqs=min(num_seqs, r.max_num_seqs), kv_cache_bytes=int(r.kv_cache_gb * 2**30),
                          gpu_memory_utilization=r.gpu_memory_utilization,
                          dtype=str(engine_dtype(run)).removeprefix("torch."), enforce_eager=r.enforce_eager,
                          trust_remote_code=cfg.actor.model.trust_remote_code)
    from lib.engine.hf import HFEngine

    return HFEngine(load_config(cfg.actor.model.path), topo.device, tok.pad_token_id, eos, sampling, val,
                    dtype=engine_dtype(run), rank_seed=topo.rollout_dp_rank)


def uses_vllm(cfg: Config) -> bool:
    """rollout.engine=vllm, or auto on a GPU machine with vllm installed."""
    import importlib.util

    r = cfg.rollout
    if r.engine != "auto":
        return r.engine == "vllm"
    on_gpu = cfg.trainer.device in ("auto", "cuda") and torch.cuda.is_available()
    return on_gpu and importlib.util.find_spec("vllm") is not None


# ---- stages


def next_batch(run: Run) -> DataProto:
    """This rank's share of the next train_batch_size prompts of the data stream, each with a uid shared by its
    n samples."""
    index = run.data_position
    run.data_position += 1
    rows = run.sampler.rows(index, run.topo.rank, run.topo.world_size)
    batch = collate(run.train, rows, run.cfg.data.max_prompt_length, run.tokenizer.pad_token_id)
    batch.non_tensor_batch["uid"] = np.array([f"{index}-{r}" for r in rows] + [None], dtype=object)[:-1]
    return batch


def rollout(run: Run, prompts: DataProto, validate: bool = False) -> tuple[DataProto, dict[str, float]]:
    """Sync the policy into the engine, generate (n samples per prompt, interleaved), put the engine to sleep."""
    cfg = run.cfg
    if cfg.actor.fsdp.optimizer_offload:
        move_optimizer(run.actor.optimizer, "cpu")
    metrics = enter_rollout(run.actor.model, run.engine, engine_dtype(run), cfg.rollout.sync_bucket_mb * 2**20,
                            cfg.actor.fsdp.param_offload)
    out = run.engine.generate(prompts, validate=validate)
    exit_rollout(run.actor.model, run.engine, run.topo.device, 2, cfg.actor.fsdp.param_offload)
    if cfg.actor.fsdp.optimizer_offload:
        move_optimizer(run.actor.optimizer, run.topo.device)
    metrics["perf/rollout_tokens_per_s"] = out.meta_info.get("tokens_per_s", 0.0)
    return out, metrics


def score(run: Run, batch: DataProto) -> dict[str, float]:
    """token_level_scores from the rule / custom / reward-model scorer, plus the DAPO overlong penalty."""
    scores, metrics, per_row = run.scorer(batch)
    a = run.cfg.algorithm
    if a.overlong_buffer:
        lengths = batch.batch["response_mask"].sum(-1)
        penalty = algos.overlong_penalty(lengths, run.cfg.rollout.max_response_length, a.overlong_buffer,
                                         a.overlong_penalty_factor)
        last = (lengths.long() - 1).clamp(min=0)
        scores[torch.arange(len(batch)), last] += penalty.to(scores.dtype) * (lengths > 0)
        metrics["reward/overlong_penalty"] = float(penalty.mean())
    batch.batch["token_level_scores"] = scores
    batch.non_tensor_batch["scores"] = np.array(per_row + [None], dtype=object)[:-1]
    return metrics


def response_metrics(batch: DataProto, max_len: int) -> dict[str, float]:
    lengths = batch.batch["response_mask"].sum(-1).float()
    seq = batch.batch["token_level_scores"].sum(-1)
    return {"reward/mean": float(seq.mean()), "reward/max": float(seq.max()), "reward/min": float(seq.min()),
            "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
            "response/clip_ratio": float((lengths >= max_len).float().mean())}


def validate_policy(run: Run, step: int) -> dict[str, float]:
    """Greedy (or val-sampled) responses to the held-out prompts: mean@N, best@N, maj@N over all ranks."""
    topo, val = run.topo, run.val
    rows = np.arange(len(val))[topo.rank::topo.world_size]
    prompts = collate(val, rows, run.cfg.data.max_prompt_length, run.tokenizer.pad_token_id)
    prompts.non_tensor_batch["uid"] = rows.astype(object)
    out, _ = rollout(run, prompts, validate=True)
    _, _, scores = run.scorer(out)
    texts = run.tokenizer.batch_decode(out.batch["responses"].masked_fill(out.batch["response_mask"] == 0,
                                                                          run.tokenizer.pad_token_id).tolist(),
                                       skip_special_tokens=True)
    local = list(zip(out.non_tensor_batch["uid"].tolist(), scores, [t.strip() for t in texts]))
    gathered: list[Any] = [None] * topo.world_size
    dist.all_gather_object(gathered, local)  # every rank: the val metrics are logged by rank 0
    by_prompt: dict[Any, list[tuple[float, str]]] = defaultdict(list)
    for part in gathered:
        for uid, s, text in part:
            by_prompt[uid].append((s, text))
    n = max(len(v) for v in by_prompt.values())
    mean = float(np.mean([s for v in by_prompt.values() for s, _ in v]))
    best = float(np.mean([max(s for s, _ in v) for v in by_prompt.values()]))
    maj = float(np.mean([dict((t, s) for s, t in v)[Counter(t for _, t in v).most_common(1)[0][0]]
                         for v in by_prompt.values()]))
    return {f"val/mean@{n}": mean, "val/best@N": best, "val/maj@N": maj, "val/score_mean": mean}


def samples_to_log(run: Run, batch: DataProto, k: int) -> list[tuple[str, str, float]]:
    k = min(k, len(batch))
    texts = run.tokenizer.batch_decode(batch.batch["responses"][:k].masked_fill(
        batch.batch["response_mask"][:k] == 0, run.tokenizer.pad_token_id).tolist(), skip_special_tokens=True)
    return [(str(batch.non_tensor_batch["raw_prompt"][i])[-60:], texts[i][:120],
             float(batch.non_tensor_batch["scores"][i])) for i in range(k)]


SUMMED_METRICS = ("reward/errors", "reward/timeouts")  # counts: summed over ranks and rollout rounds


def global_metrics(run: Run, metrics: dict[str, float]) -> dict[str, float]:
    """Mean over ranks, except maxima/minima/counts, reduced as such (all ranks, world group).
    A key some rank lacks (a scorer that never returned it there) counts as 0 on that rank."""
    keys: list[Any] = [None] * run.topo.world_size
    dist.all_gather_object(keys, sorted(metrics))  # world: the key sets must agree before the reduction
    metrics = {k: metrics.get(k, 0.0) for k in sorted(set().union(*keys))}
    ops = {k: ("max" if k.endswith(("_max", "/max")) or k.startswith("memory/") else
               "min" if k.endswith(("_min", "/min")) else
               "sum" if k in SUMMED_METRICS else "mean") for k in metrics}
    return reduce_metrics(metrics, None, ops)


# ---- pieces of the loop both scripts share


def kl_controller(cfg: Config):
    k = cfg.algorithm.kl_ctrl
    if k.type == "adaptive":
        return algos.AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon)
    return algos.FixedKLController(k.kl_coef)


def kl_in_reward(run: Run, batch: DataProto, kl_ctrl, metrics: dict) -> torch.Tensor:
    """token_level_scores - beta * KL(old || ref) per token; the controller follows the global batch KL."""
    b = batch.batch
    rewards, seq_kl = algos.apply_kl_penalty(b["token_level_scores"], b["old_log_probs"], b["ref_log_prob"],
                                             b["response_mask"], kl_ctrl.value, run.cfg.algorithm.kl_penalty)
    kl = torch.tensor([float(seq_kl.sum()), float(len(seq_kl))])
    dist.all_reduce(kl)  # world: the controller follows the batch mean KL over all ranks
    metrics.update({"algorithm/kl_in_reward": float(kl[0] / kl[1]), "algorithm/kl_coef": kl_ctrl.value})
    kl_ctrl.update(float(kl[0] / kl[1]), int(kl[1]))
    return rewards


def resume(run: Run, parts: dict, kl_ctrl) -> int:
    """Load the run folder's latest checkpoint (if resuming); validate first on a fresh start. Returns the step."""
    last = checkpoint.latest_step(run.path) if run.cfg.trainer.resume else None
    if last is None:
        if run.cfg.trainer.val_every:
            run.logger.log(0, validate_policy(run, 0))
        return 0
    state = checkpoint.load(run.path, last, parts)
    kl_ctrl.value = state.get("kl_coef", kl_ctrl.value)
    run.data_position = state.get("data_position", state["step"])
    run.logger.print(f"resumed from step {state['step']}")
    return state["step"]


def log_step(run: Run, step: int, batch: DataProto, metrics: dict) -> None:
    metrics.update(response_metrics(batch, run.cfg.rollout.max_response_length))
    metrics["perf/tokens_per_s"] = float(batch.batch["attention_mask"].sum()) / max(metrics["timing/step_s"], 1e-9)
    run.logger.log(step + 1, global_metrics(run, metrics), samples_to_log(run, batch, run.cfg.trainer.log_samples))


def end_of_step(run: Run, step: int, parts: dict, kl_ctrl) -> None:
    """Validate every val_every steps and at the end; checkpoint every save_every steps and at the end."""
    t, done = run.cfg.trainer, step + 1 == run.total_steps
    if t.val_every and ((step + 1) % t.val_every == 0 or done):
        run.logger.log(step + 1, validate_policy(run, step + 1))
    if (t.save_every and (step + 1) % t.save_every == 0) or done:
        checkpoint.save(run.path, step + 1, parts, {"kl_coef": kl_ctrl.value, "data_position": run.data_position},
                        run.topo)


def finish(run: Run) -> None:
    checkpoint.export_hf(run.actor.model, run.cfg.actor.model.path, f"{run.path}/hf_final", run.topo, run.tokenizer)
    run.logger.print(f"done: {run.path} (plots: python -m lib.plot {run.path})")
    run.logger.close()
    run.engine.close()  # vLLM tears its groups down (and the default one) now, not in an atexit hook
    if dist.is_initialized():
        dist.destroy_process_group()
