"""Plain-loop references for the vectorized functions in ``lib/algos.py``.

Written the obvious way (a dict of groups, a loop over rows and tokens) so that a reader can check them
against the papers by eye; tests compare the fast versions to these, and bench/bench_algos.py times both.
Never used in training.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

Tensor = torch.Tensor


def _groups(scores: Tensor, index: Any) -> dict[Any, list[int]]:
    rows: dict[Any, list[int]] = defaultdict(list)
    for i in range(len(scores)):
        key = index[i].item() if isinstance(index, Tensor) else index[i]
        rows[key].append(i)
    return rows


def _mean_std(values: list[Tensor]) -> tuple[Tensor, Tensor]:
    if len(values) == 1:
        return torch.tensor(0.0), torch.tensor(1.0)
    t = torch.stack(values)
    return t.mean(), t.std()  # torch.std is unbiased


def grpo_ref(token_level_rewards, response_mask, index, norm_adv_by_std=True, epsilon=1e-6):
    scores = token_level_rewards.sum(-1)
    out = scores.clone()
    for rows in _groups(scores, index).values():
        mean, std = _mean_std([scores[i] for i in rows])
        for i in rows:
            out[i] = (scores[i] - mean) / (std + epsilon) if norm_adv_by_std else scores[i] - mean
    adv = out.unsqueeze(-1) * response_mask
    return adv, adv


def rloo_ref(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(-1)
    out = scores.clone()
    for rows in _groups(scores, index).values():
        n = len(rows)
        for i in rows:
            if n > 1:
                others = sum(scores[j] for j in rows if j != i) / (n - 1)
                out[i] = scores[i] - others
    adv = out.unsqueeze(-1) * response_mask
    return adv, adv


def masked_whiten_ref(values, mask):
    vals = [values[b, t].item() for b in range(values.shape[0]) for t in range(values.shape[1]) if mask[b, t]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return (values - mean) / (var + 1e-8) ** 0.5


def reinforce_plus_plus_baseline_ref(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(-1)
    out = scores.clone()
    for rows in _groups(scores, index).values():
        mean, _ = _mean_std([scores[i] for i in rows])
        for i in rows:
            out[i] = scores[i] - mean
    adv = out.unsqueeze(-1) * response_mask
    adv = masked_whiten_ref(adv, response_mask) * response_mask
    return adv, adv


def opo_ref(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(-1)
    lengths = response_mask.sum(-1).float()
    out = scores.clone()
    for rows in _groups(scores, index).values():
        if len(rows) == 1:
            base = 0.0
        else:
            total = sum(lengths[i] for i in rows)
            base = sum(lengths[i] * scores[i] for i in rows) / total if total > 0 else 0.0
        for i in rows:
            out[i] = scores[i] - base
    adv = out.unsqueeze(-1) * response_mask
    return adv, adv


def gpg_ref(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(-1)
    nonzero = sum(1 for s in scores if s != 0)
    alpha = len(scores) / max(nonzero, 1)
    out = scores.clone()
    for rows in _groups(scores, index).values():
        mean, _ = _mean_std([scores[i] for i in rows])
        for i in rows:
            out[i] = alpha * (scores[i] - mean)
    adv = out.unsqueeze(-1) * response_mask
    return adv, adv


def gae_ref(token_level_rewards, response_mask, values, gamma=1.0, lam=1.0):
    """One row, one token at a time; masked tokens are skipped (the next real token's values carry over)."""
    batch, horizon = values.shape
    adv = torch.zeros_like(values)
    for b in range(batch):
        next_value, last_gae = 0.0, 0.0
        for t in reversed(range(horizon)):
            if response_mask[b, t]:
                delta = token_level_rewards[b, t].item() + gamma * next_value - values[b, t].item()
                last_gae = delta + gamma * lam * last_gae
                next_value = values[b, t].item()
            adv[b, t] = last_gae
    returns = adv + values
    return masked_whiten_ref(adv, response_mask), returns


def filter_groups_ref(scores, index):
    groups = _groups(scores, index)
    keep = [key for key, rows in groups.items() if len(rows) == 1 or np.std([scores[i].item() for i in rows]) > 0]
    kept_rows = sorted(i for key in keep for i in groups[key])
    return np.array(kept_rows, dtype=np.int64), len(keep) / max(len(groups), 1)
