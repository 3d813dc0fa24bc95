"""The run folder's layout, in one place for checkpointing, export and the run log:

    runs/<run>/config.yaml, metrics.jsonl, checkpoints/step_<k>/, checkpoints/latest, hf_final/ (adapter_final/)

``run_dir`` names the folder (a name fixed by the script and the config when none is given), ``check_run_folder``
decides before anything is written whether a run resumes there, ``step_dir`` / ``latest_step`` find checkpoints,
``what_resumes`` tells a stopped run's message what the next start takes.
"""

from __future__ import annotations

import hashlib
import json
import os

import yaml


def run_dir(output_root: str, run_name: str, config: dict, script: str) -> str:
    """output_root/run_name; without a run name, a name fixed by the script and the config (``default_run_name``),
    so that the same command finds its run again."""
    return os.path.join(output_root, run_name or default_run_name(config, script))


def step_dir(run_path: str, step: int) -> str:
    return os.path.join(run_path, "checkpoints", f"step_{step}")


MANIFEST = "manifest.json"
"""A checkpoint's list of its files and their sizes, written last, before the folder takes its final name."""


def listing(folder: str) -> dict[str, int]:
    """Every file under ``folder`` by its path relative to it, with its size in bytes."""
    files = {}
    for base, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(base, name)
            files[os.path.relpath(path, folder)] = os.path.getsize(path)
    return files


def damage(folder: str) -> str | None:
    """What is wrong with a checkpoint folder (a file its manifest lists missing or of another size, the manifest
    unreadable), or None when it is whole. A folder written before manifests counts as whole with its
    trainer.json and DCP's .metadata."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        if all(os.path.isfile(os.path.join(folder, f)) for f in ("trainer.json", ".metadata")):
            return None
        return f"it has no {MANIFEST}, trainer.json or .metadata"
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} cannot be read ({type(e).__name__}: {e})"
    for name, size in sorted(files.items()):
        where = os.path.join(folder, name)
        if not os.path.isfile(where):
            return f"{name} is missing"
        if os.path.getsize(where) != size:
            return f"{name} holds {os.path.getsize(where)} bytes, not the {size} written"
    return None


def checkpoint_steps(run_path: str) -> list[int]:
    """The steps of the run's checkpoint folders that took their final name (not a ``.tmp`` one), newest first."""
    root = os.path.join(run_path, "checkpoints")
    if not os.path.isdir(root):
        return []
    return sorted((int(d[5:]) for d in os.listdir(root) if d.startswith("step_") and d[5:].isdigit()
                   and os.path.isdir(os.path.join(root, d))), reverse=True)


def resumable(run_path: str) -> tuple[int | None, list[str]]:
    """The newest whole checkpoint's step (None: there is none), and a line for each newer one passed over as
    damaged (its folder and what is wrong with it)."""
    skipped = []
    for step in checkpoint_steps(run_path):
        wrong = damage(step_dir(run_path, step))
        if wrong is None:
            return step, skipped
        skipped.append(f"{step_dir(run_path, step)}: {wrong}")
    return None, skipped


def latest_step(run_path: str) -> int | None:
    """The step a resume starts from: the newest whole checkpoint (``resumable``)."""
    return resumable(run_path)[0]


def what_resumes(run_path: str, save_every: int = 0) -> str:
    """What a stopped run leaves for the next start, told as it is on disk: the newest complete checkpoint that the
    same command resumes from, or that there is none and the same command starts again from step 0."""
    step = latest_step(run_path)
    if step is not None:
        return f"the last checkpoint is step {step} ({step_dir(run_path, step)}): the same command resumes from it"
    every = f" (trainer.save_every={save_every})" if save_every else ""
    return f"no checkpoint was written yet{every}: the same command starts the run again from step 0"


RUN_CONTROL = ("trainer.total_steps", "trainer.epochs", "trainer.val_every", "trainer.save_every", "trainer.keep_last",
               "trainer.logger", "trainer.project", "trainer.log_samples", "trainer.resume", "trainer.max_bad_steps",
               "trainer.collective_timeout_s", "trainer.max_restarts", "trainer.hang_timeout_s", "reward.timeout_s",
               "reward.num_workers", "rollout.kv_cache_gb",
               "rollout.max_num_seqs", "rollout.gpu_memory_utilization", "rollout.enforce_eager",
               "rollout.logp_diff_limit", "rollout.max_engine_failures", "samples.share", "samples.max_rows",
               "agent.workers")
"""Settings a resumed run may change: how long it runs and how it reports, not what it computes."""


def default_run_name(config: dict, script: str) -> str:
    """The run folder's name when trainer.run_name is not given: the script and a hash of the config, run-control
    settings aside. The same command and config always name the same folder, so a re-submitted or requeued job
    resumes its run; any change to what the run computes starts a new one."""
    kept = {k: v for k, v in flat_config(config).items()
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
    if not checkpoint_steps(run_path) or not os.path.isfile(saved_path):  # any checkpoint, whole or damaged
        return step
    with open(saved_path) as f:
        saved = flat_config(yaml.safe_load(f) or {})
    now = flat_config(config)
    # settings the saved config lacks (added to the code since) keep their defaults
    diff = [f"{k}: {saved[k]!r} -> {now.get(k, '(absent)')!r}" for k in sorted(saved)
            if k not in RUN_CONTROL and saved[k] != now.get(k)]
    if diff:
        raise ValueError(f"run folder {run_path} holds a run with another config ({'; '.join(diff[:8])}"
                         f"{'; ...' if len(diff) > 8 else ''}): resume it with the saved settings, or start a new "
                         f"run with another --trainer.run_name")
    return step


def flat_config(tree: dict, prefix: str = "") -> dict:
    """A config's nested sections as one mapping of dotted names (``actor.optim.lr``), tuples as lists."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out
