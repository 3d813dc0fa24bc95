"""A sample in a partial-rollout pool, and the pool's place in a checkpoint.

The pool is per rank (a group's samples stay on the rank that drew its prompt). Each rank writes its pool into the
checkpoint being written (``partial_rank<k>_of_<world>.pt``, beside the model shards): a run resumed on as many ranks
takes each rank's own back; on another number of ranks every pool is read and the groups are dealt out in stream
order, one rank after the other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

FILE = "partial_rank{rank}_of_{world}.pt"


@dataclass
class Sample:
    uid: str
    """Its group's (the prompt's position in the data stream, lib.rollout.next_batch)."""
    born: int
    """The step that drew its prompt from the data stream (the pool trains older draws first)."""
    order: tuple[int, int, int]
    """(data batch index, row, sample): the stream's order."""
    prompt: list[int]
    """The prompt's ids, unpadded."""
    columns: dict[str, Any]
    """The row's non-tensor columns (data_source, ground_truth, extra_info, uid, ...)."""
    ids: list[int] = field(default_factory=list)
    """The response so far (its stop token included once it ended)."""
    logps: list[float] = field(default_factory=list)
    """The engine's log-prob of each token, under the weights that sampled it."""
    versions: list[int] = field(default_factory=list)
    """The step whose weights sampled each token."""
    kept: list[int] = field(default_factory=list)
    """Top-k/top-p sampling: the engine's kept set's size at each token (lib.engine.Turn.kept)."""
    ended: bool = False
    media: Any = None
    """A vision-language prompt's images and rope rows (lib.engine.PromptImages): every chunk's request carries them,
    as every turn of a multi-turn episode does; None for a text prompt."""
    episode: Any = None
    """Multi-turn tools: the episode (lib.multi_turn.loop.Episode) of its whole turns and their observations; the
    sample's tokens past ``episode.response`` are the turn in flight. None for a single-turn sample."""
    gen_s: float = 0.0
    """Wall seconds of the engine calls it generated in, every step's (what a step that waited for it would have
    taken to generate it: timing/partial_longest_sample_s)."""


def groups(pool: list[Sample]) -> dict[str, list[Sample]]:
    """The pool's groups by uid, in stream order."""
    out: dict[str, list[Sample]] = {}
    for s in sorted(pool, key=lambda s: s.order):
        out.setdefault(s.uid, []).append(s)
    return out


def first_version(group: list[Sample], step: int) -> int:
    """The step whose weights sampled the group's first tokens (``step`` where none has started)."""
    return min((s.versions[0] for s in group if s.versions), default=step)


def completed(group: list[Sample]) -> int | None:
    """The step the group completed in (its last sample ended: that step's weights sampled its last token); None
    while one still generates."""
    if not all(s.ended for s in group):
        return None
    return max((s.versions[-1] for s in group if s.versions), default=min(s.born for s in group))


def save(pool: list[Sample], folder: str, rank: int, world: int) -> None:
    """This rank's pool, into ``folder`` (the checkpoint being written)."""
    torch.save([vars(s) for s in pool], os.path.join(folder, FILE.format(rank=rank, world=world)))


def load(folder: str, rank: int, world: int) -> list[Sample] | None:
    """This rank's pool from the checkpoint ``folder``; None where it holds none (partial rollouts were off)."""
    saved = sorted(f for f in os.listdir(folder) if f.startswith("partial_rank"))
    if not saved:
        return None
    read = lambda name: [Sample(**s) for s in torch.load(os.path.join(folder, name), weights_only=False)]  # noqa: E731
    mine = FILE.format(rank=rank, world=world)
    if len(saved) == world and mine in saved:
        return read(mine)
    every = groups([s for name in saved for s in read(name)])
    return [s for i, group in enumerate(every.values()) if i % world == rank for s in group]
