"""The score stage: token_level_scores from the rule / custom / reward-model scorer, plus the DAPO overlong
penalty."""

from __future__ import annotations

import numpy as np
import torch

from lib import algos
from lib.protocol import DataProto
from lib.startup import Run


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
