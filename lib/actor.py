"""The policy: response log-probs and the PPO-family update, on FSDP2 shards (the loop and its loss
normalisation: lib/update.py).

Batch keys read: input_ids, attention_mask, position_ids, responses, response_mask, advantages;
optional old_log_probs (absent, with ppo_epochs 1: the update computes them, see update_policy), ref_log_prob
(KL loss),
rollout_is_weights (rollout correction).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lib import algos, samples, watchdog
from lib.config import ActorConfig, BatchingConfig
from lib.dist import Topology
from lib.forward import KEPT_KEY, model_rows, response_log_probs, response_top_log_probs
from lib.logprobs import Truncation
from lib.protocol import DataProto
from lib.update import (Trainee, accumulation_steps, split_micro, finish_update, gather_sp, loss_scale,
                        step_and_record)

__all__ = ["Trainee", "compute_log_probs", "compute_top_log_probs", "update_policy"]


@torch.no_grad()
def compute_log_probs(model: nn.Module, data: DataProto, batching: BatchingConfig, topo: Topology,
                      temperature: float = 1.0, with_entropy: bool = False, truncation: Truncation | None = None
                      ) -> tuple[torch.Tensor | None, ...]:
    """Response log-probs (B, R) (and entropy) for every row of ``data``, in the rows' order. ``truncation``:
    top-k/top-p sampling's kept sets (lib.forward.response_log_probs, measured: a row's missing counts are the rule's
    from this model's logits); two more (B, R) follow, the counts used and where the sets disagree."""
    more = (KEPT_KEY,) if truncation is not None and KEPT_KEY in data.batch else ()
    return _per_row(model_rows(data, *more), batching, topo, lambda m: response_log_probs(
        model, m, temperature, batching.use_remove_padding, with_entropy, sp=topo, truncation=truncation,
        measure=True))


@torch.no_grad()
def compute_top_log_probs(model: nn.Module, data: DataProto, batching: BatchingConfig, topo: Topology, k: int,
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Response log-probs (B, R), and the model's k most likely tokens at each response position (their log-probs with
    the other tokens' last, (B, R, k + 1), and ids, (B, R, k)), for every row of ``data``, in the rows' order."""
    return _per_row(model_rows(data), batching, topo, lambda m: response_top_log_probs(
        model, m, k, temperature, batching.use_remove_padding, sp=topo))


def _per_row(data: DataProto, batching: BatchingConfig, topo: Topology,
             forward: Callable[[DataProto], tuple[torch.Tensor | None, ...]]) -> tuple[torch.Tensor | None, ...]:
    """``forward``'s per-row outputs for this rank's rows, in their order: the SP group's rows gathered, cut in
    micro-batches by the batching config, and this rank's own taken back."""
    data, mine = gather_sp(data, topo)
    return tuple(o[mine] if o is not None else None for o in _gathered(data, batching, topo, forward))


@torch.no_grad()
def _gathered(data: DataProto, batching: BatchingConfig, topo: Topology,
              forward: Callable[[DataProto], tuple[torch.Tensor | None, ...]]) -> tuple[torch.Tensor | None, ...]:
    """_per_row for rows the SP group already shares (all of them are returned)."""
    pieces, restore = split_micro(data, batching, topo)
    outs = [forward(m.to(topo.device)) for m in pieces]
    if not outs:
        return torch.zeros(0), None
    joined = [torch.cat(col) if col[0] is not None else None for col in zip(*outs)]
    if restore is not None:
        joined = [o[torch.as_tensor(restore, device=o.device)] if o is not None else None for o in joined]
    return tuple(joined)


def update_policy(actor: Trainee, data: DataProto, cfg: ActorConfig, temperature: float = 1.0,
                  mini_batch_size_per_rank: int | None = None, seed: int = 0,
                  teacher_kl: tuple[float, str] | None = None, truncation: Truncation | None = None
                  ) -> dict[str, float]:
    """``ppo_epochs`` x mini-batches x micro-batches with gradient accumulation; one lr-schedule step.
    Returns metrics averaged over steps and reduced over the data-parallel ranks. ``teacher_kl`` (coef, estimator):
    on-policy distillation's loss mode (lib/distill), coef x the aggregated KL estimate between the current
    log-probs and the batch's ``teacher_log_probs`` added to the loss; estimator ``topk``: the KL over the teacher's
    top-k tokens and the rest (``teacher_topk_ids``, ``teacher_topk_log_probs``; lib.algos.partition_kl).
    ``truncation``: top-k/top-p sampling; the log-probs and entropy are the kept sets' (the batch's ``rollout_kept``,
    which the old log-probs' pass completes), the KL terms' other side stays whole (docs/algorithms.md)."""
    topo, model = actor.topo, actor.model
    # old log-probs missing: the policy before this update is the one of the first mini-batch's forward, so
    # that mini-batch uses its own log-probs (detached, ratio 1) and the others get theirs by a no-grad pass
    # before the first optimizer step; that saves a forward over one mini-batch (all of it with one mini-batch)
    lazy_old = "old_log_probs" not in data.batch
    if lazy_old and cfg.ppo_epochs != 1:
        raise ValueError("old_log_probs are missing: compute them first (ppo_epochs > 1 reuses them every epoch)")
    if cfg.use_kl_loss and "ref_log_prob" not in data.batch:
        raise ValueError("use_kl_loss needs ref_log_prob in the batch (compute it with the reference model)")

    def old_log_probs_after_the_first(minis: list[DataProto]) -> None:
        for mini in minis[1:]:
            rows = model_rows(mini, *([KEPT_KEY, "response_mask"] if truncation is not None else []))
            mini.batch["old_log_probs"] = _gathered(rows, cfg.batching, topo, lambda m: response_log_probs(
                model, m, temperature, cfg.batching.use_remove_padding, sp=topo, truncation=truncation))[0]

    loss_fn = algos.POLICY_LOSSES[cfg.policy_loss]
    topk = teacher_kl is not None and teacher_kl[1] == "topk"  # also the student's log-probs at the teacher's ids
    # unset (None) clip bounds leave the loss's own defaults (preflight.resolve fills them for a run)
    clip = {k: v for k, v in (("clip_ratio_low", cfg.clip_ratio_low), ("clip_ratio_high", cfg.clip_ratio_high))
            if v is not None}
    sums: dict[str, list[float]] = defaultdict(list)
    for epoch, pieces, num_tokens, num_seqs in accumulation_steps(actor, data, cfg.ppo_epochs,
                                                                   mini_batch_size_per_rank, cfg.shuffle, seed,
                                                                   cfg.batching,
                                                                   old_log_probs_after_the_first if lazy_old else None):
        # metrics stay tensors until the optimizer step: one device sync per mini-batch, not per micro-batch
        step_metrics: dict[str, Any] = defaultdict(float)
        for micro in pieces:
            watchdog.beat()
            b = micro.batch
            mask = b["response_mask"].to(torch.float32)
            logp, entropy, *_ = response_log_probs(model, micro, temperature, cfg.batching.use_remove_padding,
                                                   with_entropy=True, sp=topo,
                                                   at=b["teacher_topk_ids"] if topk else None, truncation=truncation)
            if topk:
                logp, at_teacher_top = logp[..., 0], algos.with_tail(logp[..., 1:])
            old = b["old_log_probs"] if "old_log_probs" in b else logp.detach()
            if epoch == 0:  # the samples kept (lib/samples): the log-probs and entropy the step trained on
                samples.record(data, micro, topo.rank, old, entropy)
            agg = {"num_global_tokens": num_tokens, "num_global_seqs": num_seqs,
                   "norm_constant": cfg.loss_scale_factor or None}
            pg_loss, pg_metrics = loss_fn(old, logp, b["advantages"], mask, clip_ratio_c=cfg.clip_ratio_c,
                                          loss_agg_mode=cfg.loss_agg_mode, weights=b.get("rollout_is_weights"),
                                          **clip, **agg)
            loss = pg_loss
            ent = algos.agg_loss(entropy, mask, cfg.loss_agg_mode, **agg)
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * ent
            if cfg.use_kl_loss:
                kl = algos.agg_loss(algos.kl_penalty(logp, b["ref_log_prob"], cfg.kl_loss_type), mask,
                                    cfg.loss_agg_mode, **agg)
                loss = loss + cfg.kl_loss_coef * kl
                step_metrics["actor/kl_loss"] += kl.detach()
            if teacher_kl is not None:
                coef, estimator = teacher_kl
                per_token = (algos.partition_kl(at_teacher_top, b["teacher_topk_log_probs"]) if topk else
                             algos.kl_penalty(logp, b["teacher_log_probs"], estimator))
                kl = algos.agg_loss(per_token, mask, cfg.loss_agg_mode, **agg)
                loss = loss + coef * kl
                step_metrics["actor/distill_loss"] += kl.detach()
            (loss * loss_scale(topo)).backward()
            # the aggregated terms are this micro-batch's share of the mini-batch value: they add up
            step_metrics["actor/pg_loss"] += pg_loss.detach()
            step_metrics["actor/entropy"] += ent.detach()
            share = mask.sum() / num_tokens.clamp(min=1)  # token-weighted mean of the ratios
            for k, v in pg_metrics.items():
                step_metrics[f"actor/{k}"] += v * share
            if epoch == 0 and "rollout_log_probs" in b:
                # stale or mismatched weights in the engine show here: the trainer's log-probs of the sampled
                # tokens (old = the policy that generated them) against the engine's own
                diff = (old.detach() - b["rollout_log_probs"]).abs()
                # partial rollouts: the tokens this step's weights sampled (a carried token's is the policy's change)
                canary = mask * b["fresh_mask"] if "fresh_mask" in b else mask
                step_metrics["rollout/logp_abs_diff"] += (diff * canary).sum() / num_tokens.clamp(min=1)
                if "fresh_mask" in b:
                    step_metrics["rollout/fresh_token_share"] += canary.sum() / num_tokens.clamp(min=1)
        step_and_record(actor, cfg.optim.max_grad_norm, step_metrics, sums, "actor", cfg.optim.step_without_gradient)
    out = finish_update(actor, sums, "actor")
    if "rollout/fresh_token_share" in out:  # the canary's mean over the fresh tokens alone
        out["rollout/logp_abs_diff"] /= max(out.pop("rollout/fresh_token_share"), 1e-12)
    return out
