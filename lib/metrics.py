"""Step metrics: response statistics, sample responses, and the reduction over ranks before logging."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lib.agents import runner as agent_runner
from lib.dist import reduce_metrics
from lib.envs import loop as env_loop
from lib.multi_turn import loop as multi_turn_loop
from lib.protocol import DataProto
from lib.rewards import FAILURE_KINDS
from lib.samples import keep as kept_samples
from lib.scoring import MASKED
from lib.run import Run
from lib.runlog import stage


def response_metrics(batch: DataProto, max_len: int, gather: Callable[[list], list] = lambda rows: rows
                     ) -> dict[str, float]:
    """Rewards, response and prompt lengths, and the advantages and returns over the loss's tokens (verl's names
    for those). Lengths count the sampled tokens, also those rollout correction masked out of the loss. A sample the
    judge could not score (lib.scoring.MASKED) is in none of the reward and length figures: it has no reward, and a
    0 would read as one. ``gather``: every rank's rows (a list of (reward, length, prompt length)) from this rank's,
    so that the figures are the whole batch's, whatever the ranks hold."""
    b = batch.batch
    lengths = b.get("sampled_mask", b["response_mask"]).sum(-1).float()
    prompt_lengths = b["attention_mask"][:, :b["prompts"].shape[1]].sum(-1).float()
    seq = b["token_level_scores"].sum(-1)
    masked = batch.non_tensor_batch.get(MASKED)
    scored = torch.stack([seq.float(), lengths, prompt_lengths], 1).cpu()
    if masked is not None:
        scored = scored[~torch.from_numpy(masked.astype(bool))]  # an object column after resharding
    rows = torch.tensor(gather(scored.tolist()), dtype=torch.float64).reshape(-1, 3)
    out = {}
    for column, prefix in zip(rows.T, ("reward/", "response/length_", "prompt/length_")):
        for stat in ("mean", "max", "min"):
            out[prefix + stat] = float(getattr(column, stat)()) if len(column) else float("nan")
    out["response/clip_ratio"] = float((rows[:, 1] >= max_len).double().mean()) if len(rows) else float("nan")
    mask = b["response_mask"].bool()
    for key, name in (("advantages", "critic/advantages"), ("returns", "critic/returns")):
        if key in b and mask.any():
            values = b[key][mask].float()
            out.update({f"{name}/mean": float(values.mean()), f"{name}/max": float(values.max()),
                        f"{name}/min": float(values.min())})
    return out


def samples_to_log(run: Run, batch: DataProto, k: int) -> list[tuple[str, str, float]]:
    """The first ``k`` samples: prompt, response (what was sampled), score (NaN: masked, no verdict)."""
    k = min(k, len(batch))
    b = batch.batch
    texts = run.tokenizer.batch_decode(b["responses"][:k].masked_fill(
        b.get("sampled_mask", b["response_mask"])[:k] == 0, run.tokenizer.pad_token_id).tolist(),
        skip_special_tokens=True)
    masked = batch.non_tensor_batch.get(MASKED)
    return [(str(batch.non_tensor_batch["raw_prompt"][i])[-60:], texts[i][:120],
             float("nan") if masked is not None and masked[i] else float(batch.non_tensor_batch["scores"][i]))
            for i in range(k)]


# counts: summed over ranks and rounds (the judge's too: requests, verdicts by kind, masked samples, tokens)
SUMMED_METRICS = (tuple(f"reward/{kind}" for kind in FAILURE_KINDS) + multi_turn_loop.SUMMED + env_loop.SUMMED
                  + agent_runner.SUMMED
                  + ("env/masked", "env/dropped_groups")
                  + tuple(f"judge/{k}" for k in ("requests", "cache_hits", "errors", "parse_failures", "deadline",
                                                  "over_budget", "masked", "dropped_groups", "tokens")))


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


def log_step(run: Run, step: int, batch: DataProto, metrics: dict) -> None:
    def every_ranks(rows: list) -> list:
        parts: list = [None] * run.topo.world_size
        dist.all_gather_object(parts, rows)  # world: the batch's rows are spread over every rank
        return [r for part in parts for r in part]

    metrics.update(response_metrics(batch, run.cfg.rollout.max_response_length, every_ranks))
    metrics.update(run.carried_metrics)  # the checkpoint written after the previous step
    run.carried_metrics.clear()
    if run.restarts:  # restarts after a failure so far (lib/restarts.py)
        metrics["fault/restarts"] = float(run.restarts)
    metrics["perf/tokens_per_s"] = float(batch.batch["attention_mask"].sum()) / max(metrics["timing/step_s"], 1e-9)
    if "judge/seconds" in metrics:  # an LLM judge: its share of the step's time
        metrics["judge/step_share"] = metrics["judge/seconds"] / max(metrics["timing/step_s"], 1e-9)
    run.logger.log(step + 1, global_metrics(run, metrics), samples_to_log(run, batch, run.cfg.trainer.log_samples))
    with stage("samples", run.carried_metrics):  # its time logged with the next step's (timing/samples_s)
        kept_samples.keep(run, step + 1, batch)
