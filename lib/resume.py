"""Resume and periodic checkpoints: what decides the next step is saved every save_every steps and at the end,
and loaded from the run folder's latest checkpoint when a run starts again."""

from __future__ import annotations

from lib import checkpoint
from lib.startup import Run
from lib.validation import validate_policy


def resume(run: Run, parts: dict, kl_ctrl) -> int:
    """Load the run folder's latest checkpoint (if resuming); validate first on a fresh start. Returns the step."""
    last = checkpoint.latest_step(run.path) if run.cfg.trainer.resume else None
    if last is None:
        if run.cfg.trainer.val_every:
            run.logger.log(0, validate_policy(run, 0))
        return 0
    state = checkpoint.load(run.path, last, parts)
    kl_ctrl.value = state.get("kl_coef", kl_ctrl.value)
    run.data_position = state.get("data_position", state["step"])
    run.logger.print(f"resumed from step {state['step']}")
    return state["step"]


def end_of_step(run: Run, step: int, parts: dict, kl_ctrl) -> None:
    """Validate every val_every steps and at the end; checkpoint every save_every steps and at the end."""
    t, done = run.cfg.trainer, step + 1 == run.total_steps
    if t.val_every and ((step + 1) % t.val_every == 0 or done):
        run.logger.log(step + 1, validate_policy(run, step + 1))
    if (t.save_every and (step + 1) % t.save_every == 0) or done:
        checkpoint.save(run.path, step + 1, parts, {"kl_coef": kl_ctrl.value, "data_position": run.data_position},
                        run.topo)
