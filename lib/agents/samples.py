"""An episode's calls as training rows (issue 75): token in, token out, nothing re-tokenised from text.

A call that continues its episode's previous call (``Call.extends``: its prompt is the previous prompt, the previous
sampled ids, then the new messages rendered) joins that call's row: the new messages' ids are observed (mask 0,
log-prob 0), its sampled ids trained (mask 1, the engine's log-probs). Any other call starts a row of its own: the
agent rewrote its history (trimmed, summarised, re-rendered it), or called /completions. The rows of an episode share
its reward; how often a call could not continue its row is the drift the agents' users measure
(``agent/split_calls``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from lib.agents.messages import Call


@dataclass
class Row:
    """One training row of an episode: its prompt, then every token after it."""

    prompt: list[int]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    calls: int = 0

    def sampled(self, call: Call) -> None:
        self.response += call.ids
        self.mask += [1] * len(call.ids)
        self.logps += call.logps
        self.kept += call.kept if call.kept is not None else [0] * len(call.ids)
        self.calls += 1

    def observed(self, ids: list[int]) -> None:
        self.response += ids
        self.mask += [0] * len(ids)
        self.logps += [0.0] * len(ids)
        self.kept += [0] * len(ids)


def episode_rows(calls: list[Call]) -> list[Row]:
    """The rows of one episode's calls, in order (none for no call). A continuing call joins the latest row whose ids
    its prompt starts with (a /completions call between two chat calls has a row of its own); one that no row's ids
    start any more (two calls sent at once on the same history: the first took the row) starts a row of its own. The
    rows after the first are the episode's split calls."""
    rows: list[Row] = []
    for call in calls:
        row = next((r for r in reversed(rows) if call.extends
                    and call.prompt_ids[:len(r.prompt) + len(r.response)] == r.prompt + r.response), None)
        if row is not None:
            row.observed(call.prompt_ids[len(row.prompt) + len(row.response):])
        else:
            row = Row(list(call.prompt_ids))
            rows.append(row)
        row.sampled(call)
    return rows


def once_per_episode(estimate: Callable[..., tuple[torch.Tensor, torch.Tensor]], rewards: torch.Tensor,
                     mask: torch.Tensor, index: Any, episodes: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """An outcome estimator (lib.algos.ADVANTAGE_ESTIMATORS of lib.preflight.GROUP_ESTIMATORS: one value a row)
    over episodes rather than rows: an agent's episode split into several rows counts once in its group's statistics.
    The estimator runs on each episode's first row (every row of it carries the episode's reward), and each row gets
    its episode's value on its own tokens (``mask``). Rows that are their own episodes: the estimator as it is."""
    first: dict = {}
    for i, e in enumerate(episodes):
        first.setdefault(e, i)
    if len(first) == len(episodes):
        return estimate(rewards, mask, index=index, **kw)
    reps = sorted(first.values())
    at = {i: k for k, i in enumerate(reps)}
    pick = torch.tensor(reps, device=mask.device)
    adv, ret = estimate(rewards[pick], mask[pick], index=np.asarray(index, dtype=object)[reps], **kw)
    m = mask[pick].to(adv.dtype)
    count = m.sum(-1).clamp(min=1)
    rows = torch.tensor([at[first[e]] for e in episodes], device=mask.device)
    per_row = lambda x: ((x * m).sum(-1) / count)[rows][:, None] * mask.to(x.dtype)  # noqa: E731
    return per_row(adv), per_row(ret)
