"""Every step keeps a share of its samples, as the step trained on them, in the run folder (``samples``; files:
lib/samples/store.py; docs/samples.md).

The groups kept are chosen by their uid (a hash below ``samples.share``), so the same groups whatever the ranks.
``mark`` flags their rows before the update (``sample_row``: the rank and the row's index, -1 elsewhere); the update
``record``s the trainer's log-probs and entropy of the flagged rows as it computes them (lib/actor.py, the first
epoch: the values the canary and the loss used), and lib.samples.keep gathers the rows of every rank after the step
and rank 0 writes the step's file. This module stays light: the update imports it.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from lib.protocol import DataProto

ROW_KEY = "sample_row"
"""The batch's column of the rows kept: rank x RANK_STRIDE + the row's index on its rank; -1 for the others."""
RANK_STRIDE = 1 << 32
TOKENS_KEY = "sample_tokens"
"""The batch's meta_info entry the update fills: {row index: (trainer log-probs, entropy) as lists} of this rank's
rows."""


def config_problems(cfg: Any) -> list[str]:
    s = cfg.samples
    problems = []
    if not 0 <= s.share <= 1:
        problems.append(f"samples.share={s.share:g} is a share of each step's groups: between 0 (none kept) and 1")
    if s.max_rows < 1:
        problems.append(f"samples.max_rows={s.max_rows} must be at least 1 (samples.share 0 keeps none)")
    return problems


def chosen(uid: str, share: float) -> bool:
    """Whether the group ``uid`` is kept: its hash below the share (the same answer on every rank)."""
    return zlib.crc32(str(uid).encode()) < share * 2**32


def order(uid: str) -> tuple[int, str]:
    """The groups' order in a step's file: by hash (ties by uid)."""
    return zlib.crc32(uid.encode()), uid


def fit(groups: dict[str, list], max_rows: int) -> list:
    """The rows of ``groups`` ({uid: its rows}) in the groups' order while whole groups fit in ``max_rows`` (a first
    group over it is cut)."""
    taken: list = []
    for uid in sorted(groups, key=order):
        if taken and len(taken) + len(groups[uid]) > max_rows:
            break
        taken += groups[uid][:max_rows]
    return taken


def mark(run: Any, batch: DataProto) -> None:
    """Flag the rows of the groups kept, before the update: of this rank's chosen groups, in the hash's order, those
    within samples.max_rows rows (rank 0 takes the step's first groups in that order while they fit, and none of
    them lies past a rank's own first max_rows rows), so that no rank makes records rank 0 drops."""
    s = run.cfg.samples
    if not s.share:
        return
    groups: dict[str, list[int]] = {}
    for i, uid in enumerate(map(str, batch.non_tensor_batch["uid"])):
        if chosen(uid, s.share):
            groups.setdefault(uid, []).append(i)
    rows = torch.full((len(batch),), -1, dtype=torch.int64)
    for i in fit(groups, s.max_rows):
        rows[i] = run.topo.rank * RANK_STRIDE + i
    batch.batch[ROW_KEY] = rows.to(batch.batch["responses"].device)
    batch.meta_info[TOKENS_KEY] = {}


def record(data: DataProto, micro: DataProto, rank: int, logp: torch.Tensor, entropy: torch.Tensor) -> None:
    """The update's hook: the trainer's log-probs and entropy of this rank's flagged rows in ``micro``."""
    kept = data.meta_info.get(TOKENS_KEY)
    if kept is None or ROW_KEY not in micro.batch:
        return
    rows = micro.batch[ROW_KEY]
    mine = torch.nonzero((rows >= 0) & (rows // RANK_STRIDE == rank)).flatten()
    if not len(mine):
        return
    index = (rows[mine] % RANK_STRIDE).tolist()  # one copy to the host for the micro-batch's rows
    values = torch.stack([logp.detach()[mine].float(), entropy.detach()[mine].float()], 1).cpu().tolist()
    for i, (lp, ent) in zip(index, values):
        kept[i] = (lp, ent)
