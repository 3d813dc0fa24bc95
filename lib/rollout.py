"""The rollout stage: the next prompts of the data stream, and generation with the policy's current weights
(synced into the engine, which sleeps again afterwards); then the policy's log-probs of what was generated."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from lib import algos, routing
from lib.actor import compute_log_probs
from lib.data import collate
from lib.dist import sum_over_ranks
from lib.forward import KEPT_KEY
from lib.fsdp import move_optimizer
from lib.lora import adapters_off
from lib.protocol import DataProto
from lib.runlog import FAILED_IN, stage
from lib.runfolder import what_resumes
from lib.engines import build_engine, engine_dtype
from lib.preflight import picks_vllm
from lib.run import Run
from lib.startup import finish
from lib.sync import enter_rollout, exit_rollout
from lib.vision import batch_metrics


def next_batch(run: Run) -> DataProto:
    """This rank's share of the next train_batch_size prompts of the data stream, each with a uid shared by its
    n samples."""
    index = run.data_position
    run.data_position += 1
    rows = run.sampler.rows(index, run.topo.rank, run.topo.world_size)
    batch = collate(run.train, rows, run.cfg.data.max_prompt_length, run.tokenizer.pad_token_id)
    batch.non_tensor_batch["uid"] = np.array([f"{index}-{r}" for r in rows] + [None], dtype=object)[:-1]
    batch.meta_info["seed_key"] = index  # sampling seeds follow the data position, not a per-process count
    return batch


def generate(run: Run, prompts: DataProto | None, validate: bool = False, other: tuple[Any, Any] | None = None,
             produce: Callable[[Any], DataProto] | None = None) -> tuple[DataProto, dict[str, float]]:
    """Sync the policy into the engine, generate (n samples per prompt, interleaved), put the engine to sleep.
    ``other``: (a frozen model, an engine of its shape) to generate with instead (distillation's teacher), its
    parameters left where they are. ``produce(engine)``: the generation itself, in place of the prompts' (partial
    rollouts' pool, lib/partial)."""
    cfg = run.cfg
    model, engine, adapter = (run.actor.model, run.engine, run.lora) if other is None else (*other, None)
    park = cfg.actor.fsdp.param_offload and other is None
    if cfg.actor.fsdp.optimizer_offload:
        move_optimizer(run.actor.optimizer, "cpu")
    # the switch into rollout (wakes, sync, adapter, prefix-cache reset) and back (sleep) timed apart from generation
    timing: dict[str, float] = {}
    level = adapter.sleep_level if adapter is not None else 2
    # the policy's own single-turn generation on the HF engine, where no collective runs inside it, is retried on an
    # engine's error (vLLM's teardown destroys the process group with it: an error there fails the rank, for a restart)
    retried = other is None and produce is None and run.multi_turn is None and not picks_vllm(cfg)
    retry = 0
    while True:
        with stage("to_rollout", timing):
            metrics = enter_rollout(model, engine, engine_dtype(run), cfg.rollout.sync_bucket_mb * 2**20, park,
                                    adapter)
        failed = ""
        try:
            with stage("generate", timing):
                if produce is not None:
                    out = produce(engine)
                elif run.multi_turn is not None:
                    out = run.multi_turn.rollout(engine, prompts, validate)
                    metrics.update(out.meta_info.pop("multi_turn"))
                else:
                    out = engine.generate(prompts, validate=validate)
        except Exception as e:  # noqa: BLE001 - whatever the engine raised: its rank's engine is rebuilt
            if not retried:
                raise
            failed = f"{type(e).__name__}: {str(e)[:500]}"
            FAILED_IN.clear()  # taken: a later error names its own stage
        if not retried or not engine_failed(run, retry, failed):
            break
        # every rank again from a sleeping engine (level 2: each sync sends every weight, so the ranks' syncs hold
        # the same collectives), the failed ranks' engines new
        engine = run.engine
        exit_rollout(model, engine, run.topo.device, 2, park)
        retry += 1
    with stage("to_training", timing):
        exit_rollout(model, engine, run.topo.device, level, park)
    if retry:
        metrics["fault/engine_failures"] = float(retry)
    metrics.update(timing)
    if cfg.actor.fsdp.optimizer_offload:
        move_optimizer(run.actor.optimizer, run.topo.device)
    metrics["perf/rollout_tokens_per_s"] = out.meta_info.get("tokens_per_s", 0.0)
    if run.vision and not validate:
        metrics.update(batch_metrics(out.non_tensor_batch["multi_modal"], out.batch["input_ids"],
                                     run.train.vision.image_token_id))
    return out, metrics


def engine_failed(run: Run, retry: int, failed: str) -> bool:
    """After a generation: every rank learns which ranks' engines raised (``failed``: this rank's error, "" if none).
    None raised: False. Else the failed ranks' engines are closed and built again (``run.engine``); past
    rollout.max_engine_failures retries the run stops (exit 3) with the last error. The caller syncs and generates
    again on every rank: the samples' seeds follow the data position, so the retry draws what the first try would
    have."""
    errors: list = [None] * run.topo.world_size
    dist.all_gather_object(errors, failed)  # world: one short string a rank
    failing = [(r, e) for r, e in enumerate(errors) if e]
    if not failing:
        return False
    limit = run.cfg.rollout.max_engine_failures
    ranks = ", ".join(str(r) for r, _ in failing)
    if failed:
        with contextlib.suppress(Exception):  # a broken engine may fail to close too
            run.engine.close()
    if retry >= limit:
        run.logger.print(f"error: the rollout engine failed in generation on rank(s) {ranks} ({failing[0][1]}), "
                         f"{retry + 1} times in a row (rollout.max_engine_failures={limit}); "
                         f"{what_resumes(run.path, run.cfg.trainer.save_every)}")
        run.stopped = "engine_failures"
        finish(run)
    run.logger.print(f"warning: the rollout engine failed in generation on rank(s) {ranks} ({failing[0][1]}): "
                     f"rebuilt, the generation retried ({retry + 1} of rollout.max_engine_failures={limit})")
    if failed:
        run.engine = build_engine(run)
    return True


def policy_log_probs(run: Run, batch: DataProto) -> None:
    """The policy's part of the log-prob stage: old_log_probs (the engine's own with bypass_mode; none when the
    update takes them itself, Sizes.old_in_update) and the reference's ref_log_prob."""
    cfg, topo, t = run.cfg, run.topo, run.cfg.rollout.temperature
    if cfg.algorithm.bypass_mode:
        batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
    # top-k/top-p sampling: the pass runs with bypass and ppo_epochs 1 too, completing the kept sets the update reads
    if run.truncation is not None or not (cfg.algorithm.bypass_mode or run.sizes.old_in_update):
        routing.take_flips(run.actor.model)
        with stage("old_log_probs", run.carried_metrics):
            old, *kept = compute_log_probs(run.actor.model, batch, cfg.actor.batching, topo, t,
                                           truncation=run.truncation)
        if not cfg.algorithm.bypass_mode:
            batch.batch["old_log_probs"] = old
        if run.truncation is not None:
            batch.batch[KEPT_KEY] = kept[1].to(torch.int32)
            run.carried_metrics.update(kept_metrics(kept[1], kept[2], batch.batch["response_mask"]))
        if cfg.rollout.routing_replay:
            run.carried_metrics["routing/flip_rate"] = flip_rate(run)
    if run.ref is not None:
        # a LoRA policy's base reference is the policy's own model with its adapter switched off
        with stage("ref_log_probs", run.carried_metrics), \
                adapters_off(run.ref) if run.ref is run.actor.model else contextlib.nullcontext():
            batch.batch["ref_log_prob"], _ = compute_log_probs(run.ref, batch, cfg.actor.batching, topo, t)


def kept_metrics(kept: torch.Tensor, disagree: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Top-k/top-p sampling's kept sets over the sampled tokens of every rank: their mean size
    (``rollout/kept_tokens``) and the share of tokens where the engine's set and the trainer's differ
    (``rollout/filter_disagreement``: the sampled token outside the trainer's set, or the engine's count not the
    one the rule gives on the trainer's logits)."""
    m = mask.to(torch.float64)
    sums = sum_over_ranks()(torch.stack([(kept.to(m.dtype) * m).sum(), (disagree.to(m.dtype) * m).sum(), m.sum()]))
    return {"rollout/kept_tokens": float(sums[0] / sums[2].clamp(min=1)),
            "rollout/filter_disagreement": float(sums[1] / sums[2].clamp(min=1))}


def flip_rate(run: Run) -> float:
    """The share of the engine's token-layer routes that the policy's own routers would have chosen otherwise, over
    the old log-probs' pass of every rank (lib/routing counts; routes no engine recorded are not counted)."""
    # every rank: each counted its own rows (an SP rank its slice of the group's), so the sum counts each token once
    counts = sum_over_ranks()(torch.tensor(routing.take_flips(run.actor.model), dtype=torch.float64))
    return float(counts[0] / counts[1].clamp(min=1))


def correct_rollout(run: Run, batch: DataProto, metrics: dict[str, float]) -> None:
    """Rollout correction (algorithm.rollout_correction, after the advantages): importance weights of the trainer's
    old log-probs against the engine's, truncated or masking tokens out of the loss. A masked token leaves
    ``response_mask`` (the loss's and the critic's mask); ``sampled_mask`` keeps what was sampled, for the
    response metrics."""
    a, b = run.cfg.algorithm, batch.batch
    if a.rollout_correction == "off":
        return
    w, keep, m = algos.rollout_correction(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"],
                                          a.rollout_correction, a.rollout_correction_threshold,
                                          a.rollout_correction_mode)
    if "sampled_mask" not in b:  # (the judge's masking may have kept it already)
        b["sampled_mask"] = b["response_mask"]
    b["rollout_is_weights"], b["response_mask"] = w, keep
    metrics.update({k: float(v) for k, v in m.items()})
