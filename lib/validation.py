"""Validation on the held-out prompts: mean@N, best@N, maj@N over all ranks, overall and per data_source."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np
import torch.distributed as dist

from lib import distill
from lib.data import collate
from lib.rollout import generate
from lib.scoring import run_scorer
from lib.engines import build_teacher_engine
from lib.run import Run


def validate_teacher(run: Run) -> dict[str, float]:
    """On-policy distillation's teacher scored as the policy is (validate_policy), once per run, so that the student's
    curve has its target beside it: ``val/teacher/...``. An HF engine of the teacher's shape holds its weights for
    this call only (the policy's engine sleeps meanwhile); an offloaded teacher comes to the device for it."""
    engine = build_teacher_engine(run)
    try:
        with distill.on_device(run.teacher, run.topo.device, distill.offloads(run.cfg, run.topo.device)):
            metrics = validate_policy(run, 0, other=(run.teacher, engine))
    finally:
        engine.close()
    return {"val/teacher/" + k.removeprefix("val/"): v for k, v in metrics.items()}


def validate_policy(run: Run, step: int, other: tuple[Any, Any] | None = None) -> dict[str, float]:
    """Greedy (or val-sampled) responses to the held-out prompts: ``val/mean@N``, ``val/best@N``, ``val/maj@N``
    over all prompts, and ``val/<data_source>/...`` per source. Every rank generates (the weight sync and the
    engines are collective): a rank left without a row (fewer rows than ranks) generates one row again and
    drops it. ``other``: (model, engine) to score instead of the policy (lib.rollout.generate)."""
    topo, val = run.topo, run.val
    rows = np.arange(len(val))[topo.rank::topo.world_size]
    real = len(rows)
    if not real:
        rows = np.array([topo.rank % len(val)])
    prompts = collate(val, rows, run.cfg.data.max_prompt_length, run.tokenizer.pad_token_id)
    prompts.non_tensor_batch["uid"] = rows.astype(object)
    prompts.meta_info["seed_key"] = step
    out, _ = generate(run, prompts, validate=True, other=other)
    scored = run_scorer(run, out)
    votes = [a if a is not None else t.strip() for a, t in zip(scored.answers, scored.texts)]
    n = len(votes)
    unscored = scored.unscored or [False] * n
    rule = scored.rule_scores or [None] * n
    local = list(zip(out.non_tensor_batch["uid"].tolist(), out.non_tensor_batch["data_source"].tolist(),
                     scored.scores, votes, unscored, rule))
    if "episode" in out.non_tensor_batch:  # an agent's episode split into rows is one sample: its last row
        last = {e: i for i, e in enumerate(out.non_tensor_batch["episode"].tolist())}
        local = [local[i] for i in sorted(last.values())]
    local = local[:real * run.cfg.rollout.val_n]
    gathered: list[Any] = [None] * topo.world_size
    dist.all_gather_object(gathered, local)  # every rank: the val metrics are logged by rank 0
    return val_metrics([row for part in gathered for row in part], scored.unscored is not None)


def val_metrics(rows: list[tuple], judged: bool) -> dict[str, float]:
    """The held-out figures of every rank's (uid, data source, score, vote, unscored, rule score) rows. A response
    the judge could not score counts in no mean (as in the update); a prompt left without a scored one leaves the
    per-prompt figures. ``judged``: also val/unscored, and the rule's own figures where the rows have a rule."""
    by_prompt: dict[Any, list[tuple[float, str]]] = defaultdict(list)
    by_rule: dict[Any, list[tuple[float, str]]] = defaultdict(list)
    source_of: dict[Any, str] = {}
    skipped = 0
    for uid, source, s, vote, no_score, r in rows:
        source_of[uid] = str(source)
        if r is not None:
            by_rule[uid].append((r, vote))
        if no_score:
            skipped += 1
            continue
        by_prompt[uid].append((s, vote))
    metrics = prompt_metrics(by_prompt, "val") if by_prompt else {"val/mean@1": float("nan")}
    metrics["val/score_mean"] = metrics[next(k for k in metrics if k.startswith("val/mean@"))]
    for source in sorted(set(source_of.values())):
        if mine := {u: v for u, v in by_prompt.items() if source_of[u] == source}:
            metrics.update(prompt_metrics(mine, f"val/{source}"))
    if judged:
        metrics["val/unscored"] = float(skipped)
        metrics.update(prompt_metrics(by_rule, "val/rule") if by_rule else {})
    return metrics


def prompt_metrics(by_prompt: dict[Any, list[tuple[float, Any]]], prefix: str) -> dict[str, float]:
    """mean@N (every sample), best@N and maj@N (per prompt, then averaged) of prompts' (score, vote) samples."""
    n = max(len(v) for v in by_prompt.values())
    return {f"{prefix}/mean@{n}": float(np.mean([s for v in by_prompt.values() for s, _ in v])),
            f"{prefix}/best@N": float(np.mean([max(s for s, _ in v) for v in by_prompt.values()])),
            f"{prefix}/maj@N": float(np.mean([majority_score(v) for v in by_prompt.values()]))}


def majority_score(samples: list[tuple[float, Any]]) -> float:
    """maj@N of one prompt's (score, vote) samples: the score of the first sample that gives the most common vote.
    The vote is the scorer's extracted answer, or the stripped response where the scorer gives none (verl votes
    on its ``pred`` the same way; ties go to the vote seen first)."""
    counts = Counter(vote for _, vote in samples)  # insertion-ordered: max keeps the first of equal counts
    top = max(counts, key=counts.get)
    return next(s for s, vote in samples if vote == top)
