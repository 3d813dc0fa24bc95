"""Validation on the held-out prompts: mean@N, best@N, maj@N over all ranks."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np
import torch.distributed as dist

from lib.data import collate
from lib.rollout import generate
from lib.scoring import run_scorer
from lib.startup import Run


def validate_policy(run: Run, step: int) -> dict[str, float]:
    """Greedy (or val-sampled) responses to the held-out prompts: mean@N, best@N, maj@N over all ranks."""
    topo, val = run.topo, run.val
    rows = np.arange(len(val))[topo.rank::topo.world_size]
    prompts = collate(val, rows, run.cfg.data.max_prompt_length, run.tokenizer.pad_token_id)
    prompts.non_tensor_batch["uid"] = rows.astype(object)
    prompts.meta_info["seed_key"] = step
    out, _ = generate(run, prompts, validate=True)
    scored = run_scorer(run, out)
    votes = [a if a is not None else t.strip() for a, t in zip(scored.answers, scored.texts)]
    local = list(zip(out.non_tensor_batch["uid"].tolist(), scored.scores, votes))
    gathered: list[Any] = [None] * topo.world_size
    dist.all_gather_object(gathered, local)  # every rank: the val metrics are logged by rank 0
    by_prompt: dict[Any, list[tuple[float, str]]] = defaultdict(list)
    for part in gathered:
        for uid, s, vote in part:
            by_prompt[uid].append((s, vote))
    n = max(len(v) for v in by_prompt.values())
    mean = float(np.mean([s for v in by_prompt.values() for s, _ in v]))
    best = float(np.mean([max(s for s, _ in v) for v in by_prompt.values()]))
    maj = float(np.mean([majority_score(v) for v in by_prompt.values()]))
    return {f"val/mean@{n}": mean, "val/best@N": best, "val/maj@N": maj, "val/score_mean": mean}


def majority_score(samples: list[tuple[float, Any]]) -> float:
    """maj@N of one prompt's (score, vote) samples: the score of the first sample that gives the most common vote.
    The vote is the scorer's extracted answer, or the stripped response where the scorer gives none (verl votes
    on its ``pred`` the same way; ties go to the vote seen first)."""
    counts = Counter(vote for _, vote in samples)  # insertion-ordered: max keeps the first of equal counts
    top = max(counts, key=counts.get)
    return next(s for s, vote in samples if vote == top)
