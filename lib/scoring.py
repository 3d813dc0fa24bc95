"""The score stage: token_level_scores from the rule / custom / reward-model scorer, plus the DAPO overlong
penalty."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from lib import agents, algos, startup
from lib.preflight import GROUP_ESTIMATORS
from lib.protocol import DataProto
from lib.rewards.scorer import Scored, last_sampled
from lib.runfolder import what_resumes
from lib.run import Run


def no_scores(batch: DataProto) -> dict[str, float]:
    """Rows without a reward function (pure on-policy distillation): token_level_scores of zeros."""
    batch.batch["token_level_scores"] = torch.zeros_like(batch.batch["response_mask"], dtype=torch.float32)
    return {}


def score(run: Run, batch: DataProto) -> dict[str, float]:
    """token_level_scores from the rule / custom / reward-model scorer, plus the DAPO overlong penalty."""
    scored = run_scorer(run, batch)
    scores, metrics, per_row = scored.token_scores, scored.metrics, scored.scores
    a = run.cfg.algorithm
    if a.overlong_buffer:
        lengths = batch.batch["response_mask"].sum(-1)
        penalty = algos.overlong_penalty(lengths, run.cfg.rollout.max_response_length, a.overlong_buffer,
                                         a.overlong_penalty_factor)
        last = last_sampled(batch.batch["response_mask"])
        scores[torch.arange(len(batch)), last] += penalty.to(scores.dtype) * (lengths > 0)
        metrics["reward/overlong_penalty"] = float(penalty.mean())
    batch.batch["token_level_scores"] = scores
    batch.non_tensor_batch["scores"] = np.array(per_row + [None], dtype=object)[:-1]
    if scored.terms is not None:  # what the samples kept show (lib/samples)
        batch.non_tensor_batch["reward_terms"] = np.array(scored.terms + [None], dtype=object)[:-1]
    if "env_score" in batch.non_tensor_batch:
        env_failures(run, batch)
    if scored.unscored is not None:
        estimator = run.cfg.algorithm.adv_estimator
        masked = mask_unscored(batch, scored.unscored, 2 if estimator in GROUP_ESTIMATORS else 1)
        if run.scorer.judge is None:  # an environment's or agents' failed episodes alone
            masked = {k.replace("judge/", f"{_player(run)}/", 1): v for k, v in masked.items()}
        metrics.update(masked)
    return metrics


def _player(run: Run) -> str:
    """The config section whose episodes score themselves: agent or env."""
    return "agent" if agents.enabled(run.cfg) else "env"


def env_failures(run: Run, batch: DataProto) -> None:
    """An environment's or agents' failed episodes over all ranks: the first message of each kind printed once a run
    (rank 0); a rollout where more than env.max_failed_share (agent.max_failed_share) of them failed stops the run
    with the last error. An agent's episode split into several rows counts once."""
    nt = batch.non_tensor_batch
    keys = nt["episode"] if "episode" in nt else range(len(batch))
    episodes = {key: score for key, score in zip(keys, nt["env_score"])}
    mine = [(kind, message) for _, kind, message in episodes.values() if kind]
    parts: list = [None] * run.topo.world_size
    # world: a few counts and strings a rank, so that every rank stops together
    dist.all_gather_object(parts, (len(mine), len(episodes), dict(mine[::-1]), mine[-1] if mine else None))
    failed, total = sum(p[0] for p in parts), sum(p[1] for p in parts)
    who = _player(run)
    for part in parts:
        for kind, message in part[2].items():
            if f"{who}/{kind}" not in run.reported_failures:
                run.reported_failures.add(f"{who}/{kind}")
                run.logger.print(f"warning: {who}/failed_{kind}: {message} (the episode is masked from the update; "
                                 f"later ones are only counted)")
    share = failed / max(total, 1)
    limit = getattr(run.cfg, who).max_failed_share
    if share > limit:  # every rank sees the same counts: all stop here, together
        last = next(p[3] for p in reversed(parts) if p[3] is not None)
        fix = ("Fix the agent (run it alone against any OpenAI endpoint)" if who == "agent" else
               "Fix the environment (its server's log: env_server/ in the run folder for env.app)")
        what = "agent" if who == "agent" else "environment"
        run.logger.print(f"error: {failed} of {total} {what} episodes failed in this rollout, over "
                         f"{who}.max_failed_share={limit:g}; the last: {who}/failed_{last[0]}: "
                         f"{last[1]}. This step's update is not made. {fix}; then "
                         f"{what_resumes(run.path, run.cfg.trainer.save_every)}.")
        run.stopped = f"{who}_failures"
        startup.finish(run)  # exits 3, as a run stopped by bad steps does


MASKED = "score_masked"
"""The non-tensor column of the rows the judge left unscored (or whose group left with them): out of the update and
out of every reward and length statistic (lib.metrics)."""


def mask_unscored(batch: DataProto, unscored: list[bool], min_group: int) -> dict[str, float]:
    """Rows the judge could not score leave the update (``response_mask`` 0) and their group's statistics (the
    advantage's groups, ``score_group``, give each a group of its own; ``uid`` keeps the prompt's group, which moves
    between ranks whole); a group left with fewer than ``min_group`` scored samples leaves whole. Returns
    judge/masked and judge/dropped_groups."""
    uids = batch.non_tensor_batch.get("uid")
    masked = list(unscored)
    dropped = 0
    if min_group > 1 and uids is not None:
        groups: dict = {}
        for i, uid in enumerate(uids.tolist()):
            groups.setdefault(uid, []).append(i)
        # an agent's episode split into rows counts once (lib/agents)
        episodes = batch.non_tensor_batch.get("episode", np.arange(len(unscored)))
        for rows in groups.values():
            if len({episodes[i] for i in rows if not unscored[i]}) < min_group:
                dropped += 1
                for i in rows:
                    masked[i] = True
    rows = torch.tensor([i for i, m in enumerate(masked) if m], dtype=torch.long)
    batch.non_tensor_batch[MASKED] = np.array(masked, dtype=bool)
    b = batch.batch
    # what was sampled stays known (the sample log shows a masked row's text); on every rank, masked rows or not: the
    # ranks' batches carry the same keys when they are resharded
    if "sampled_mask" not in b:
        b["sampled_mask"] = b["response_mask"].clone()
    if len(rows):
        b["response_mask"][rows.to(b["response_mask"].device)] = 0
        b["token_level_scores"][rows.to(b["token_level_scores"].device)] = 0
    if uids is not None:
        batch.non_tensor_batch["score_group"] = np.array([f"{u}/masked-{i}" if masked[i] else u
                                                          for i, u in enumerate(uids.tolist())] + [None],
                                                         dtype=object)[:-1]
    return {"judge/masked": float(len(rows)), "judge/dropped_groups": float(dropped)}


def run_scorer(run: Run, batch: DataProto) -> Scored:
    """Score a batch; the first message of each failure kind, on any rank, is printed once per run (rank 0)."""
    scored = run.scorer(batch)
    messages: list = [None] * run.topo.world_size
    dist.all_gather_object(messages, scored.messages)  # world: every rank's new failure kinds, a few strings
    for part in messages:
        for kind, message in part.items():
            if kind not in run.reported_failures:
                run.reported_failures.add(kind)
                run.logger.print(f"warning: reward/{kind}: {message} (the sample scores 0; later ones are only "
                                 f"counted in reward/{kind})")
    return scored
