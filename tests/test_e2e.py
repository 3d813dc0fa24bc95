"""End to end: the launch path (2 gloo ranks, forked from one interpreter: tests/forked_torchrun.py; the golden
run under torchrun itself as well) on the embedded toy task; reward must rise."""

import json
import os
import subprocess

import pytest

from tests.helpers import forked_torchrun, torchrun_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script, tmp_path, *args, timeout=900, gpu=False, forked=True):
    """The script on 2 gloo CPU ranks (the GPUs hidden: these tests are about the CPU path, and a one-GPU machine
    cannot give 2 ranks a device each), forked from one interpreter (tests/forked_torchrun.py), or with ``forked``
    False started by torchrun itself; ``gpu``: one rank per GPU (at most 2) where there are GPUs, under torchrun."""
    import torch

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    args = (os.path.join(ROOT, script), "--trainer.output_root", str(tmp_path), "--trainer.run_name", "run", *args)
    if gpu and torch.cuda.is_available():
        cmd = torchrun_command(min(2, torch.cuda.device_count()), *args)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        cmd = (forked_torchrun if forked else torchrun_command)(2, *args)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout


def val_curve(tmp_path):
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    return [(r["step"], r["val/score_mean"]) for r in rows if "val/score_mean" in r], rows


# Held-out greedy reward of the default GRPO preset, step 0 -> 60 (2 ranks; an unchanged policy scores exactly
# the start value, 0.269, since validation is greedy). Measured spread of the gain (CPU results differ between
# machines and the RL trajectory amplifies the difference; threads per rank made no difference):
#   2-core AMD EPYC, seeds 1-6 x 1 and 2 threads per rank: +0.137 to +0.297 (seed 1: +0.213; identical per thread
#   count); the AMD EPYC, seed 1: +0.101; 2-core Xeon (README): seed 1 +0.21.
# The threshold sits at half the worst case measured.
GRPO_MIN_GAIN = 0.05


@pytest.mark.slow
def test_grpo_toy_reward_rises(tmp_path):
    torchrun("train_grpo.py", tmp_path, "--trainer.total_steps", "60", "--trainer.val_every", "30")
    curve, rows = val_curve(tmp_path)
    start, end = curve[0][1], curve[-1][1]
    assert curve[0][0] == 0 and curve[-1][0] == 60
    assert end > start + GRPO_MIN_GAIN, curve
    train = [r for r in rows if "actor/pg_loss" in r]
    assert len(train) == 60 and all(r["actor/skipped_steps"] == 0 for r in train)
    # the engine's log-probs of its samples against the trainer's: the synced weights are current every step
    assert all(r["rollout/logp_abs_diff"] < 1e-4 for r in train), max(r["rollout/logp_abs_diff"] for r in train)
    assert os.path.isfile(tmp_path / "run" / "hf_final" / "model.safetensors")
    assert os.path.isfile(tmp_path / "run" / "config.yaml")


# PPO preset, held-out greedy reward step 0 -> 50, 2-core AMD EPYC, seeds 1-4, 1 thread per rank: +0.179 to +0.270
# (seed 1: +0.179). GRPO's seed 1 lost half its gain on another AMD machine; the threshold allows for the same.
PPO_MIN_GAIN = 0.05


@pytest.mark.slow
def test_ppo_toy_reward_rises(tmp_path):
    torchrun("train_ppo.py", tmp_path, "--trainer.total_steps", "50", "--trainer.val_every", "50")
    curve, rows = val_curve(tmp_path)
    assert curve[-1][1] > curve[0][1] + PPO_MIN_GAIN, curve
    assert any("critic/vf_loss" in r for r in rows) and any("algorithm/kl_coef" in r for r in rows)


@pytest.mark.slow
def test_resume_continues_from_the_last_checkpoint(tmp_path):
    torchrun("train_grpo.py", tmp_path, "--trainer.total_steps", "2", "--trainer.val_every", "0")
    out = torchrun("train_grpo.py", tmp_path, "--trainer.total_steps", "4", "--trainer.val_every", "0")
    assert "resumed from step 2" in out
    steps = [json.loads(line)["step"] for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["latest", "step_2", "step_4"]


# Fixed-seed metrics of the default GRPO preset (2 ranks, 1 thread each, 3 steps); a refactor must reproduce them.
GOLDEN = {  # step: (reward/mean, actor/pg_loss, actor/grad_norm, response/length_mean)
    1: (0.13776972144842148, -0.019522815870004706, 1.0451912134885788, 5.9765625),
    2: (0.16571491211652756, -0.0575849852320971, 1.236599326133728, 6.19921875),
    3: (0.187655009329319, -0.059794316432089545, 0.9095395356416702, 6.380859375),
}


# CPU kernels differ between machines, and so do the toy assets built on them. Measured against GOLDEN (taken on a
# 2-core Xeon), the largest relative differences, (reward/length, loss/grad-norm):
#   another Xeon: step 2 grad_norm 3e-3;
#   2-core AMD EPYC: step 1 (0, 8.4e-4), step 2 (0, 4.5e-3), step 3 (1.1e-2, 4.2e-2).
# Each tolerance is 4x or more the worst measured; a changed objective or data path moves step 1 by far more.
TOLERANCE = {1: (1e-3, 1e-2), 2: (1e-2, 5e-2), 3: (5e-2, 2.5e-1)}  # step: (reward/length, loss/grad-norm) rel


@pytest.mark.slow
def test_golden_run_is_reproduced(tmp_path):
    """The default preset's first 3 steps under torchrun match GOLDEN; with the ranks forked from one interpreter
    (tests/forked_torchrun.py, the launch most tests use), every figure but the clocks' is the same to the bit."""
    (tmp_path / "forked").mkdir()
    os.symlink(tmp_path / "toy_assets", tmp_path / "forked" / "toy_assets")  # the session's build (conftest.py)
    for folder, forked in ((tmp_path, False), (tmp_path / "forked", True)):
        torchrun("train_grpo.py", folder, "--trainer.total_steps", "3", "--trainer.val_every", "0", forked=forked)
    rows, forked_rows = ([json.loads(line) for line in open(folder / "run" / "metrics.jsonl")]
                         for folder in (tmp_path, tmp_path / "forked"))
    clocks = ("timing/", "perf/", "sync/seconds", "sync/s_per_gb", "memory/")
    assert [{k: v for k, v in r.items() if not k.startswith(clocks)} for r in forked_rows] == \
        [{k: v for k, v in r.items() if not k.startswith(clocks)} for r in rows]
    got = {r["step"]: (r["reward/mean"], r["actor/pg_loss"], r["actor/grad_norm"], r["response/length_mean"])
           for r in rows}
    for step, (reward, loss, norm, length) in GOLDEN.items():
        data_rel, update_rel = TOLERANCE[step]
        r, l, n, ln = got[step]
        assert (r, ln) == pytest.approx((reward, length), rel=data_rel, abs=1e-6), (step, got[step])
        assert (l, n) == pytest.approx((loss, norm), rel=update_rel, abs=1e-6), (step, got[step])

