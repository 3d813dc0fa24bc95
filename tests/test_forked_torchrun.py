"""The tests' forked launcher (tests/forked_torchrun.py) fails as torchrun does. That it computes what torchrun's
ranks compute: tests/test_e2e.py::test_golden_run_is_reproduced."""

import os
import subprocess

import pytest

from tests.helpers import ROOT, forked_torchrun


@pytest.mark.slow
def test_a_rank_that_raises_shows_its_rank_and_stage_and_the_launch_fails(tmp_path):
    """Rank 1 raises at the start of step 1's update: its own traceback, prefixed by the run's excepthook with the rank
    and the stage (as a rank of torchrun's prints it), the launcher's report of exit code 1, the launch failing; rank 0,
    left waiting in the update's collective, ends too. Before, the launcher's multiprocessing caught the error: no
    prefix, the traceback only in the launcher's report."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "",
           "SPMD_RL_TEST_FAULT": "raise:step/update:1:1:0"}
    out = subprocess.run(forked_torchrun(2, os.path.join(ROOT, "train_grpo.py"), "--trainer.output_root",
                                         str(tmp_path), "--trainer.run_name", "run", "--trainer.total_steps", "2",
                                         "--trainer.val_every", "0"),
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)  # a hang's guard
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-4000:]
    assert "[rank 1 in stage step/update] " in out.stderr, text[-4000:]  # then torch's own "[rank1]: " on each line
    assert "RuntimeError: a fault injected by SPMD_RL_TEST_FAULT" in out.stderr, text[-4000:]
    assert "ChildFailedError" in out.stderr and "exitcode  : 1" in out.stderr, text[-4000:]
