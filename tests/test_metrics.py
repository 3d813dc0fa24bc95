"""Step metrics: stage peaks that nest, response metrics under rollout correction's mask."""

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

from lib import fake_device
from lib import runlog as run_logging
from lib.metrics import response_metrics
from lib.protocol import DataProto
from tests.helpers import ROOT, child_env


GIB = 2**30


def _fake(monkeypatch):
    return fake_device.install(fake_device.FakeDevice(base_bytes=0, burst_bytes=0), monkeypatch.setattr)


def _step_peaks(a, rollout_gib: int, between_gib: int, update_gib: int) -> tuple[float, float, float]:
    """A step of two nested stages that allocate and free this much (and this much between them): the rollout's,
    the update's and the step's peak (GiB)."""
    m = {}
    with run_logging.stage("step", m):
        for name, gib in (("rollout", rollout_gib), ("", between_gib), ("update", update_gib)):
            with run_logging.stage(name, m) if name else contextlib.nullcontext():
                a.alloc(gib * GIB)
                a.free(gib * GIB)
    return m["memory/rollout_peak_gb"], m["memory/update_peak_gb"], m["memory/step_peak_gb"]


def test_an_outer_stage_keeps_the_peak_its_inner_stages_reset(monkeypatch):
    """memory/step_peak_gb was the update stage's peak only: each nested stage reset the counter."""
    assert _step_peaks(_fake(monkeypatch), 10, 7, 4) == (10, 4, 10)


def test_a_later_stage_that_peaks_higher_closes_every_stage(monkeypatch):
    """The first GPU run: the update peaked above everything before it, so at its end its dict equalled the step's
    and list.remove took the step's; the step's own exit then raised ValueError at the end of step 1 (and would
    have hidden an error raised inside the stage). Fails before the fix with that ValueError."""
    a = _fake(monkeypatch)
    assert _step_peaks(a, 2, 0, 5) == (2, 5, 5)
    assert run_logging._OPEN == []
    m = {}
    with pytest.raises(KeyError, match="inside"):  # an error inside a stage comes out as itself
        with run_logging.stage("step", m):
            with run_logging.stage("update", m):
                a.alloc(GIB)
                a.free(GIB)
                raise KeyError("inside")
    assert run_logging._OPEN == []


def test_grpo_runs_three_steps_under_the_fake_device(tmp_path):
    """The real launch path (torchrun, 2 gloo ranks, the toy default) with torch.cuda faked in every process: the
    branches that ask torch.cuda.is_available() (stage peaks, empty_cache, synchronize) run as on a GPU, each stage
    peaking higher than the one before. Before the stage fix the run crashed at the end of step 1, as on the H200.
    The update's token budget is sized from memory (actor.batching.token_budget memory: lib/budget.py's GPU side)."""
    env = child_env(RL_FAKE_CUDA="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           os.path.join(ROOT, "train_grpo.py"), "--trainer.output_root", str(tmp_path), "--trainer.run_name", "run",
           "--trainer.device", "cpu", "--trainer.total_steps", "3", "--trainer.val_every", "0",
           "--trainer.save_every", "2", "--actor.batching.use-dynamic-batching",
           "--actor.batching.token_budget", "memory"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    # the token budget sized from the (fake) device's memory at start-up, said once
    assert out.stdout.count("tokens per micro-batch (sized from memory: ") == 1, out.stdout[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        peaks = {k: v for k, v in r.items() if k.startswith("memory/") and k.endswith("_peak_gb")}
        inner = {k: v for k, v in peaks.items() if k in STEP_STAGES}
        # the fake's peaks are whole quarters of a GiB above 1 GiB (its base), not the process's RSS as on a CPU
        assert set(inner) == STEP_STAGES and all(v >= 1.25 and (v * 4).is_integer() for v in peaks.values()), peaks
        # each stage peaks higher than the one before (the fake's bursts), and the step covers all of them
        order = [inner[k] for k in ("memory/rollout_peak_gb", "memory/score_peak_gb", "memory/log_probs_peak_gb",
                                    "memory/update_peak_gb")]
        assert order == sorted(order) and r["memory/step_peak_gb"] == max(order), peaks


STEP_STAGES = {f"memory/{s}_peak_gb" for s in ("step", "rollout", "score", "log_probs", "update")}


def test_a_sample_the_judge_could_not_score_is_in_no_reward_or_length_figure():
    """A masked sample (no verdict) leaves the update; it must leave the step's reward and length figures too, and the
    sample log marks it: before, reward/mean counted it as 0, reward/min read 0, length_mean counted 0 tokens."""
    import numpy as np

    from lib.scoring import MASKED, mask_unscored

    prompts = torch.zeros(3, 2, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    scores = torch.zeros(3, 4)
    scores[0, 2], scores[1, 1], scores[2, 3] = 0.4, 0.9, 0.6
    batch = DataProto.from_dict({"prompts": prompts, "attention_mask": torch.cat([torch.ones(3, 2), mask], 1).long(),
                                 "response_mask": mask.clone(), "token_level_scores": scores})
    mask_unscored(batch, [False, True, False], min_group=1)
    assert batch.non_tensor_batch[MASKED].tolist() == [False, True, False]
    m = response_metrics(batch, max_len=4)
    assert (m["reward/mean"], m["reward/min"], m["reward/max"]) == pytest.approx((0.5, 0.4, 0.6))
    assert (m["response/length_mean"], m["response/length_min"], m["response/clip_ratio"]) == (3.5, 3.0, 0.5)
    assert torch.equal(batch.batch["sampled_mask"][1], mask[1])  # what was sampled, kept for the sample log
    rows = [(0.4, 3.0, 2.0)]  # another rank's rows: the figures are the whole batch's
    m = response_metrics(batch, max_len=4, gather=lambda mine: mine + rows)
    assert m["reward/mean"] == pytest.approx((0.4 + 0.6 + 0.4) / 3) and m["response/length_min"] == 3.0
    assert np.isnan(response_metrics(DataProto.from_dict(dict(batch.batch)), 4, lambda _: [])["reward/mean"])


def test_response_metrics_count_sampled_tokens_under_a_correction_mask():
    """Rollout correction in mask mode takes rejected tokens out of response_mask; lengths and the clip ratio
    still count them (they were sampled)."""
    sampled = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
    loss_mask = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    prompts = torch.zeros(2, 3, dtype=torch.long)
    attention = torch.cat([torch.tensor([[0, 1, 1], [1, 1, 1]]), sampled.long()], 1)
    adv = torch.tensor([[1.0, 9.0, -2.0, 9.0], [0.5, 0.5, 0.0, 0.0]])
    batch = DataProto.from_dict({"prompts": prompts, "attention_mask": attention, "response_mask": loss_mask,
                                 "sampled_mask": sampled, "token_level_scores": torch.zeros(2, 4),
                                 "advantages": adv, "returns": adv})
    m = response_metrics(batch, max_len=4)
    assert (m["response/length_mean"], m["response/length_min"], m["response/clip_ratio"]) == (3.0, 2.0, 0.5)
    assert (m["prompt/length_min"], m["prompt/length_max"]) == (2.0, 3.0)
    # over the loss's tokens only: the masked-out 9s do not count
    assert (m["critic/advantages/max"], m["critic/advantages/min"], m["critic/advantages/mean"]) == (1.0, -2.0, 0.0)
