"""Sharded checkpoints with torch.distributed.checkpoint (DCP), written atomically (the folder layout: lib/runfolder.py).

``runs/<run>/checkpoints/step_<k>/`` holds every rank's shards of the models and optimizers plus
``trainer.json`` (step, KL coefficient, ...) and ``manifest.json`` (every file and its size, written last). A checkpoint
is written to ``step_<k>.tmp`` and renamed only when complete, and ``latest`` is updated after the rename: a crash
at any byte never leaves a half checkpoint that a resume would pick up, and earlier checkpoints are never touched. A
resume takes the newest checkpoint whose files match its manifest (lib/runfolder.py ``resumable``): one damaged
later (a file cut short or lost) is passed over, by name. A write that fails on any rank (a full disk) fails the
save on every rank together (``SaveFailed``), its ``.tmp`` folder removed, nothing earlier touched.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from lib import watchdog
from lib.dist import Topology
from lib.lora import has_lora
from lib.runfolder import MANIFEST, checkpoint_steps, listing, step_dir


class SaveFailed(Exception):
    """A checkpoint that could not be written on some rank (every rank raises it together)."""


def prune(run_path: str, keep_last: int, saved: int) -> None:
    """Remove all but the newest ``keep_last`` checkpoints up to step ``saved``, the one just written (0: keep all).
    Folders of later steps (damaged ones a resume passed over) are left for the redone steps to replace."""
    if keep_last <= 0:
        return
    steps = [step for step in checkpoint_steps(run_path) if step <= saved]  # newest first
    for step in steps[keep_last:]:
        shutil.rmtree(step_dir(run_path, step), ignore_errors=True)


def _on_every_rank(what: str, work: Callable[[], None] | None) -> None:
    """``work`` on this rank (None: nothing to do here), then every rank learns whether it failed on any of them;
    all raise SaveFailed together if it did (a write error, never a rank left waiting for a failed one)."""
    error = None
    watchdog.beat()
    try:
        if work is not None:
            work()
    except (OSError, CheckpointException) as e:
        error = e
    failed = torch.tensor([0.0 if error is None else 1.0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # world: one flag
    if failed.item():
        raise SaveFailed(f"{what} failed" + (f": {_reason(error)}" if error is not None else " on another rank"))


def _reason(error: BaseException) -> str:
    """An OSError's own words, also where DCP wrapped it (CheckpointException maps each failed rank to its
    exception and traceback)."""
    if isinstance(error, CheckpointException) and error.failures:
        error = error.failures[min(error.failures)][0]
    return f"{type(error).__name__}: {error}"


def _options(model: nn.Module) -> StateDictOptions | None:
    """A LoRA model's checkpoint holds its adapter only (the frozen base is the model path's, checked by hash)."""
    return StateDictOptions(ignore_frozen_params=True, strict=False) if has_lora(model) else None


def _state(parts: dict[str, tuple[nn.Module, Any]]) -> dict:
    state = {}
    for name, (model, optimizer) in parts.items():
        state[f"{name}.model"] = get_model_state_dict(model, options=_options(model))
        if optimizer is not None:
            state[f"{name}.optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def save(run_path: str, step: int, parts: dict[str, tuple[nn.Module, Any]], trainer_state: dict, topo: Topology,
         keep_last: int = 0, rank_files: Callable[[str], None] | None = None) -> str:
    """Save {name: (model, optimizer or None)} and the trainer state for ``step``; then keep the newest
    ``keep_last`` checkpoints (0: all). ``rank_files(folder)``: what every rank writes of its own into the checkpoint
    (partial rollouts' pool), before it is complete."""
    final = step_dir(run_path, step)
    tmp = final + ".tmp"
    if topo.is_main and os.path.exists(tmp):
        shutil.rmtree(tmp)  # a crashed earlier attempt
    dist.barrier()

    def shards() -> None:
        dcp.save(_state(parts), checkpoint_id=tmp)  # DCP raises on every rank when a rank's write failed
        if rank_files is not None:
            rank_files(tmp)

    try:
        _on_every_rank(f"writing the shards of step {step}", shards)
        _on_every_rank(f"completing the checkpoint of step {step}", (
            lambda: _seal(run_path, step, tmp, final, {"step": step, **trainer_state})) if topo.is_main else None)
    except SaveFailed:
        if topo.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # its space back; the earlier checkpoints untouched
        raise
    if topo.is_main:
        prune(run_path, keep_last, step)
    dist.barrier()
    return final


def _seal(run_path: str, step: int, tmp: str, final: str, state: dict) -> None:
    """Rank 0, every rank's files written: trainer.json, the manifest (last, with every file's size), the folder's
    final name, then the ``latest`` marker."""
    _write(os.path.join(tmp, "trainer.json"), json.dumps(state))
    _write(os.path.join(tmp, MANIFEST), json.dumps({"step": step, "files": listing(tmp)}))
    if os.path.isdir(final):  # a later step's folder a resume passed over as damaged: this step is redone
        shutil.rmtree(final)
    os.replace(tmp, final)
    marker = os.path.join(run_path, "checkpoints", "latest")
    _write(marker + ".tmp", str(step))
    os.replace(marker + ".tmp", marker)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename that makes the folder count


def trainer_state(run_path: str, step: int) -> dict:
    with open(os.path.join(step_dir(run_path, step), "trainer.json")) as f:
        return json.load(f)


def load(run_path: str, step: int, parts: dict[str, tuple[nn.Module, Any]]) -> dict:
    path = step_dir(run_path, step)
    state = _state(parts)
    dcp.load(state, checkpoint_id=path)
    for name, (model, optimizer) in parts.items():
        set_model_state_dict(model, state[f"{name}.model"], options=_options(model))
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state[f"{name}.optim"])
    return trainer_state(run_path, step)
