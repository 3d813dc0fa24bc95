"""Resume, periodic checkpoints, and stopping cleanly.

Everything that decides the next step is checkpointed: models, optimizers, lr schedulers, the data position (which
also keys the rollout seeds, dynamic-sampling rounds included) and the KL coefficient. A run killed at any moment
and started again with the same command therefore logs the same numbers as one never interrupted.

SIGTERM, SIGUSR1 (SLURM pre-emption, scancel) and SIGINT (Ctrl-C) let the step in flight finish (lib.stops takes
them, from the start of start-up); then every rank agrees to stop, a checkpoint is written and the run exits 0
naming it. Steps whose update was skipped (a non-finite
loss or grad norm) are counted; after ``trainer.max_bad_steps`` in a row the run stops, naming the last checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lib import checkpoint, exits, inject, restarts, stops, watchdog
from lib.partial import carry
from lib.runfolder import resumable, step_dir, what_resumes
from lib.runlog import STAGES, stage
from lib.engines import engine_dtype
from lib.validation import validate_policy, validate_teacher

if TYPE_CHECKING:
    from lib.run import Run
    from lib.update import Trainee

PAUSE = "SPMD_RL_TEST_PAUSE"
"""Test hook, ``STEP:FILE``: at the end of step STEP (its metrics logged, before the stop check) rank 0 creates FILE
and every rank waits until a stop signal reaches it or the test creates FILE.go, which lets the run go on (a kill ends
the wait too). A test that signals or kills a run waits for FILE first, so its signal can never come too late (after
the last step) on a loaded machine; one that watches a run in progress (the viewer's) holds it there as long as it
looks."""


def _parts(trainees: dict[str, Trainee]) -> dict:
    return {name: (t.model, t.optimizer) for name, t in trainees.items()}


def resume(run: Run, trainees: dict[str, Trainee], kl_ctrl) -> int:
    """Load the run folder's latest checkpoint (if resuming); validate first on a fresh start. Returns the step. The
    hang watchdog watches the loop from here on (lib/watchdog.py)."""
    start = _load(run, trainees, kl_ctrl)
    inject.next_step(start + 1)
    watchdog.start(run.path, run.topo.rank, run.topo.world_size, restarts.attempt(), run.cfg.trainer.hang_timeout_s,
                   lambda: "/".join(STAGES), restarts.keep)
    return start


def _load(run: Run, trainees: dict[str, Trainee], kl_ctrl) -> int:
    stops.take_interrupts()
    last, skipped = resumable(run.path) if run.cfg.trainer.resume else (None, [])
    for line in skipped:
        run.logger.print(f"warning: checkpoint {line}: passed over, not loaded; "
                         + (f"resuming from step {last}" if last is not None else "no whole checkpoint is left: "
                            "starting from step 0"))
    if last is None:
        if run.val is not None:
            metrics = timed_validation(run, 0)
            if run.teacher is not None:  # once per run: the score the student is distilled toward
                with stage("teacher_validation", metrics):
                    metrics.update(validate_teacher(run))
                run.logger.print(f"the teacher's own validation score: {metrics['val/teacher/score_mean']:.3f} (the "
                                 f"student's: {metrics['val/score_mean']:.3f})")
            run.logger.log(0, metrics)
        return 0
    saved_hash = checkpoint.trainer_state(run.path, last).get("base_hash")
    now_hash = getattr(run.actor.model, "base_hash", None)
    if saved_hash != now_hash:  # every rank holds both: all stop together
        if run.topo.is_main:
            print(f"error: the checkpoint {step_dir(run.path, last)} holds a LoRA adapter trained on "
                  f"another base model (base hash {saved_hash}, this one {now_hash}); point actor.model.path at the "
                  f"base it was trained on, or start a new run with another --trainer.run_name",
                  file=sys.stderr, flush=True)
        run.logger.close()
        run.scorer.close()
        run.engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        exits.leave(exits.REFUSED)
    state = checkpoint.load(run.path, last, _parts(trainees))
    for name, t in trainees.items():
        t.scheduler.load_state_dict(state["schedulers"][name])
    kl_ctrl.value = state["kl_coef"]
    run.data_position = state["data_position"]
    if run.cfg.rollout.partial.enabled:  # the samples carried into the next step, as an unstopped run holds them
        run.partial = carry.load(step_dir(run.path, last), run.topo.rank, run.topo.world_size) or []
    run.logger.print(f"resumed from step {state['step']}")
    return state["step"]


def timed_validation(run: Run, step: int) -> dict[str, float]:
    """The validation metrics, with the stage's time and peak memory (timing/validation_s)."""
    metrics: dict[str, float] = {}
    with stage("validation", metrics):
        metrics.update(validate_policy(run, step))
    return metrics


def save(run: Run, step: int, trainees: dict[str, Trainee], kl_ctrl) -> str:
    state = {"kl_coef": kl_ctrl.value, "data_position": run.data_position,
             "schedulers": {name: t.scheduler.state_dict() for name, t in trainees.items()}}
    if getattr(run.actor.model, "base_hash", None):
        state["base_hash"] = run.actor.model.base_hash  # a LoRA checkpoint fits this base only
    topo = run.topo
    pool = (lambda folder: carry.save(run.partial, folder, topo.rank, topo.world_size)) \
        if run.cfg.rollout.partial.enabled else None
    return checkpoint.save(run.path, step, _parts(trainees), state, topo, run.cfg.trainer.keep_last, pool)


def logp_diff_limit(run: Run) -> float | None:
    """The canary's bound for this run (rollout.logp_diff_limit), or None where it does not act."""
    r = run.cfg.rollout
    if r.logp_diff_limit < 0:
        return None
    if r.logp_diff_limit > 0:
        return r.logp_diff_limit
    return 1e-3 if engine_dtype(run) == torch.float32 else 1e-1


def _pause_for_a_test(run: Run, step: int) -> None:
    """The ``PAUSE`` hook (tests only; nothing happens without the variable)."""
    at, _, marker = os.environ.get(PAUSE, "").partition(":")
    if not at or int(at) != step:
        return
    if run.topo.is_main:
        with contextlib.suppress(FileNotFoundError):
            os.remove(marker + ".go")  # an earlier pause's
        with open(marker, "w") as f:
            f.write(f"{step}\n")
    while not stops.requested() and not os.path.exists(marker + ".go"):
        watchdog.beat()  # a wait on purpose, however long the test takes to signal: not a hang
        time.sleep(0.05)


def end_of_step(run: Run, step: int, trainees: dict[str, Trainee], kl_ctrl, metrics: dict) -> bool:
    """Validate every val_every steps and at the end; checkpoint every save_every steps, at the end and when a stop
    signal came. Returns False when the run must stop (a signal, or too many bad steps in a row)."""
    _pause_for_a_test(run, step + 1)
    t, done = run.cfg.trainer, step + 1 == run.total_steps
    skipped = sum(v for k, v in metrics.items() if k.endswith("/skipped_steps"))
    run.bad_steps = run.bad_steps + 1 if skipped else 0
    diff = metrics.get("rollout/logp_abs_diff", 0.0)
    flags = torch.tensor([stops.requested(), run.bad_steps, diff], dtype=torch.float64)
    # world: a signal, a bad step or an engine that computes another model on any rank stops every rank
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    signum, bad, diff = int(flags[0]), int(flags[1]), float(flags[2])
    limit = logp_diff_limit(run)
    if limit is not None and not diff <= limit:
        run.logger.print(
            f"error: rollout/logp_abs_diff {diff:.3g} at step {step + 1} is beyond {limit:g}: the engine samples from "
            f"another model than the one trained (a run whose two sides agree shows ~1e-7 in fp32). Likely causes: "
            f"weights the sync misses or the engine re-initialises (buffers, a tied head), a layer the engine or the "
            f"trainer computes differently (attention features, packing, a custom kernel), or a dtype mismatch. "
            f"This step's checkpoint is not written; {what_resumes(run.path, t.save_every)}. To go on regardless, "
            f"add --rollout.logp_diff_limit (a value, or -1 to only log it) to that command.")
        run.stopped = "logp_mismatch"
        return False
    if bad >= t.max_bad_steps:
        run.logger.print(f"error: {bad} steps in a row skipped their update (non-finite loss or grad norm; see "
                         f"actor/skipped_steps); {what_resumes(run.path, t.save_every)}. Lower the learning rate or "
                         f"check the rewards: a changed config is a new run (the run folder's name follows it).")
        run.stopped = "bad_steps"
        return False
    if run.val is not None and ((step + 1) % t.val_every == 0 or done) and not signum:
        run.logger.log(step + 1, timed_validation(run, step + 1))
    periodic = t.save_every and (step + 1) % t.save_every == 0 and not run.bad_steps  # a skipped update: no change
    if periodic or done or signum:
        try:
            with stage("save_checkpoint", run.carried_metrics):  # logged with the next step's metrics
                path = save(run, step + 1, trainees, kl_ctrl)
        except checkpoint.SaveFailed as e:  # every rank together: a full disk, a folder that refuses writes
            run.logger.print(f"error: the checkpoint of step {step + 1} could not be written ({e}): its partial files "
                             f"are removed, nothing written before is touched; {what_resumes(run.path, t.save_every)}"
                             f", once there is room under {run.path} (trainer.keep_last bounds the checkpoints kept).")
            run.stopped = "save_failed"
            return False
        if signum and not done:
            run.logger.print(f"stopped by {signal.Signals(signum).name} after step {step + 1}: checkpoint {path}; "
                             f"the same command resumes the run")
            run.stopped = signal.Signals(signum).name
            if signum == signal.SIGUSR1:  # SLURM's warning: the job may go back in the queue (launch.sh)
                exits.preempted()
            return False
    inject.next_step(step + 2)
    return True
