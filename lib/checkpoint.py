"""Sharded checkpoints with torch.distributed.checkpoint (DCP), written atomically, and HF export.

``runs/<run>/checkpoints/step_<k>/`` holds every rank's shards of the models and optimizers plus
``trainer.json`` (step, KL coefficient, ...). A checkpoint is written to ``step_<k>.tmp`` and renamed only
when complete, and ``latest`` is updated after the rename: a crash never leaves a half checkpoint that a
resume would pick up, and earlier checkpoints are never touched.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from lib.dist import Topology
from lib.fsdp import full_state_dict_on_rank0


def step_dir(run_path: str, step: int) -> str:
    return os.path.join(run_path, "checkpoints", f"step_{step}")


def latest_step(run_path: str) -> int | None:
    marker = os.path.join(run_path, "checkpoints", "latest")
    if not os.path.isfile(marker):
        return None
    step = int(open(marker).read().strip())
    return step if os.path.isdir(step_dir(run_path, step)) else None


RUN_CONTROL = ("trainer.total_steps", "trainer.epochs", "trainer.val_every", "trainer.save_every", "trainer.keep_last",
               "trainer.logger", "trainer.project", "trainer.log_samples", "trainer.resume", "trainer.max_bad_steps",
               "trainer.collective_timeout_s", "reward.timeout_s", "reward.num_workers", "rollout.kv_cache_gb",
               "rollout.max_num_seqs", "rollout.gpu_memory_utilization", "rollout.enforce_eager",
               "rollout.logp_diff_limit")
"""Settings a resumed run may change: how long it runs and how it reports, not what it computes."""


def default_run_name(config: dict, script: str) -> str:
    """The run folder's name when trainer.run_name is not given: the script and a hash of the config, run-control
    settings aside. The same command and config always name the same folder, so a re-submitted or requeued job
    resumes its run; any change to what the run computes starts a new one."""
    import hashlib

    kept = {k: v for k, v in _flat(config).items()
            if k not in RUN_CONTROL and k not in ("trainer.run_name", "trainer.output_root")}
    digest = hashlib.sha1(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{os.path.splitext(os.path.basename(script))[0]}-{digest}"


def check_run_folder(run_path: str, config: dict, resume: bool) -> int | None:
    """Before anything is written: the step to resume from (None: a fresh start). Refuses (ValueError) a folder that
    holds a run when resume is off, and a resume whose config differs from the saved one in anything but
    ``RUN_CONTROL``, naming the differences."""
    saved_path = os.path.join(run_path, "config.yaml")
    holds_run = os.path.isfile(saved_path) or os.path.isdir(os.path.join(run_path, "checkpoints"))
    if not holds_run:
        return None
    if not resume:
        raise ValueError(f"run folder {run_path} already holds a run and trainer.resume is off: choose another "
                         f"--trainer.run_name, remove the folder, or leave trainer.resume on to continue it")
    step = latest_step(run_path)
    if step is None or not os.path.isfile(saved_path):
        return step
    import yaml

    with open(saved_path) as f:
        saved = _flat(yaml.safe_load(f) or {})
    now = _flat(config)
    # settings the saved config lacks (added to the code since) keep their defaults
    diff = [f"{k}: {saved[k]!r} -> {now.get(k, '(absent)')!r}" for k in sorted(saved)
            if k not in RUN_CONTROL and saved[k] != now.get(k)]
    if diff:
        raise ValueError(f"run folder {run_path} holds a run with another config ({'; '.join(diff[:8])}"
                         f"{'; ...' if len(diff) > 8 else ''}): resume it with the saved settings, or start a new "
                         f"run with another --trainer.run_name")
    return step


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


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
    from lib.lora import has_lora

    return StateDictOptions(ignore_frozen_params=True, strict=False) if has_lora(model) else None


def _state(parts: dict[str, tuple[nn.Module, Any]]) -> dict:
    state = {}
    for name, (model, optimizer) in parts.items():
        state[f"{name}.model"] = get_model_state_dict(model, options=_options(model))
        if optimizer is not None:
            state[f"{name}.optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def save(run_path: str, step: int, parts: dict[str, tuple[nn.Module, Any]], trainer_state: dict, topo: Topology,
         keep_last: int = 0) -> str:
    """Save {name: (model, optimizer or None)} and the trainer state for ``step``; then keep the newest
    ``keep_last`` checkpoints (0: all)."""
    final = step_dir(run_path, step)
    tmp = final + ".tmp"
    if topo.is_main and os.path.exists(tmp):
        shutil.rmtree(tmp)  # a crashed earlier attempt
    dist.barrier()
    dcp.save(_state(parts), checkpoint_id=tmp)
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


def export_hf(model: nn.Module, model_path: str, out_dir: str, topo: Topology, trust_remote_code: bool = False,
              kind: str = "causal_lm") -> None:
    """The trained weights as a Hugging Face folder (lib/export.py's writer), gathered one tensor at a time."""
    from lib.export import write_hf

    full = full_state_dict_on_rank0(model, topo)
    if topo.is_main:
        write_hf(full, model_path, out_dir, kind, trust_remote_code)
    dist.barrier()


def export_adapter(model: nn.Module, lora_cfg: Any, model_path: str, out_dir: str, topo: Topology) -> None:
    """A LoRA policy's adapter as a PEFT folder (``PeftModel.from_pretrained(base, out_dir)``), gathered on every
    rank and written by rank 0."""
    from lib import lora

    tensors = {name: t.cpu() for name, t in lora.iter_adapter(model)}
    if topo.is_main:
        lora.save_adapter(out_dir, tensors, lora.peft_config(lora_cfg), model_path)
    dist.barrier()
