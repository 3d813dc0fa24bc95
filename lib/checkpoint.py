"""Sharded checkpoints with torch.distributed.checkpoint (DCP), written atomically (the folder layout: lib/runfolder.py).

``runs/<run>/checkpoints/step_<k>/`` holds every rank's shards of the models and optimizers plus
``trainer.json`` (step, KL coefficient, ...). A checkpoint is written to ``step_<k>.tmp`` and renamed only
when complete, and ``latest`` is updated after the rename: a crash never leaves a half checkpoint that a
resume would pick up, and earlier checkpoints are never touched.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from lib.dist import Topology
from lib.lora import has_lora
from lib.runfolder import step_dir


def prune(run_path: str, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` complete checkpoints (0: keep all); never the latest."""
    if keep_last <= 0:
        return
    root = os.path.join(run_path, "checkpoints")
    steps = sorted(int(d[5:]) for d in os.listdir(root) if d.startswith("step_") and d[5:].isdigit())
    for step in steps[:-keep_last]:
        shutil.rmtree(step_dir(run_path, step), ignore_errors=True)


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
    dcp.save(_state(parts), checkpoint_id=tmp)
    if rank_files is not None:
        rank_files(tmp)
    dist.barrier()
    if topo.is_main:
        with open(os.path.join(tmp, "trainer.json"), "w") as f:
            json.dump({"step": step, **trainer_state}, f)
        os.replace(tmp, final)
        marker = os.path.join(run_path, "checkpoints", "latest")
        with open(marker + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(marker + ".tmp", marker)
        prune(run_path, keep_last)
    dist.barrier()
    return final


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
