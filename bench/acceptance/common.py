"""What every acceptance check shares: the rows, the shapes, the model folders, the budget's stop."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for path in (ROOT, os.path.join(ROOT, "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)

from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config  # noqa: E402

from lib import toy  # noqa: E402

SHAPES = {  # name: (hidden, layers, heads, kv heads, intermediate, vocabulary)
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936),
    "tiny": (64, 2, 2, 1, 128, 512),  # head size 32: the smallest vLLM's CPU attention takes
    "tiny-teacher": (96, 3, 3, 1, 192, 512),  # a wider, deeper teacher of the same vocabulary (distillation)
}
CHECKS = ("correctness", "sleep_wake", "lora_sleep", "rollout", "grpo_vllm", "grpo_hf", "update", "grpo_lora_vllm",
          "ppo", "distill", "trl", "tools", "agents", "vision", "qwen3_5", "gemma4", "moe", "judge", "partial",
          "levers")
GRPO_STEPS = {"cuda": 8, "cpu": 2}  # a GRPO run and TRL's: enough steps after the first to show the steady state
# GRPO runs in the 0.5B preset's configuration (configs/qwen2.5_0.5b_gsm8k_grpo.yaml: dynamic batching, gradient
# checkpointing, the k3 KL loss with its reference model), sized for one GPU and a 15-minute lease: prompts per step
# and the response budget (random weights rarely sample an eos, so every response runs to it)
GRPO_SIZES = {"cuda": (64, 256), "cpu": (8, 16)}
GRPO_N = 5  # the preset's samples per prompt; one mini-batch a step (the preset's 256 samples need 52 prompts)
# The rows that judge a feature or correctness, not speed (lora_sleep, grpo_lora_vllm, ppo, distill, tools, vision,
# moe, judge, the models of 2026), run small and short on a GPU, with eager engines: the H100 run of 2026-11-27 spent
# ~70 s starting each compiled engine (compiling 22-32 s, graph capture up to 14 s with LoRA) before its first step.
FEATURE_SIZES = {"cuda": (16, 64), "cpu": (8, 16)}  # prompts a step (x GRPO_N samples), response tokens
SHORT_STEPS = {"cuda": 3, "cpu": 2}  # the feature rows' steps: every stage runs, more than once
PROMPT_LEN = 16  # the toy's prompts, padded or cut to this many tokens
# The engine settings of the GRPO run's vLLM engine (lib.engines.build_engine: max_model_len = prompt + response,
# max_num_seqs = one wave of samples, at most rollout.max_num_seqs 256): correctness, sleep_wake and rollout build
# their engines with the same ones, so that vLLM's compile cache made by the first serves the rest (a hit took 3.6 s
# on the H100, a miss 22-32 s).
ENGINE_SETTINGS = {device: (PROMPT_LEN + response, min(prompts * GRPO_N, 256))
                   for device, (prompts, response) in GRPO_SIZES.items()}
TIMING_ON_CPU = "measured, no verdict on CPU: the tiny model's figure is overhead, the goal is the GPU's"


# A training child's SIGTERM to SIGKILL (the step in flight, its checkpoint and the exit); the scheduler gives a check
# this and 5 s more (the check then writes its rows)
CHILD_GRACE_S = {"cuda": 40.0, "cpu": 20.0}


def on_cpu(device: str) -> str:
    """A timed row's note's tail: "" on a GPU, the reason there is no verdict on CPU."""
    return "" if device == "cuda" else "; " + TIMING_ON_CPU


def eager(device: str, compiled: bool = True) -> bool:
    """vLLM's engines run eager on CPU (the checks there judge numbers, not speed; compiling the tiny model took ~24 s
    of each engine's start, measured on 2 cores), and on a GPU in the rows that judge a feature (``compiled`` False).
    Compiled on a GPU: the timed rows, and one row of each engine kind (bench/README.md: LoRA, MoE with routes,
    images), so that a failure only CUDA graphs show still shows."""
    return device == "cpu" or not compiled


@dataclass
class Row:
    figure: str
    value: str
    goal: str = ""
    passed: bool | None = None  # None: a figure without a goal, or not run
    note: str = ""
    timed: bool = False  # a time or a device-memory reading: void where another check shared the GPU meanwhile


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


def result_path(out: str, name: str, child: bool = False) -> str:
    """Where a check's result stays: its seconds and rows (written by the parent, whatever the check did); with
    ``child``, the rows its child process writes when it ends by itself or is stopped."""
    return os.path.join(out, "checks", f"{name}.rows.json" if child else f"{name}.json")


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


def log_tail(path: str, lines: int = 6) -> str:
    """The last ``lines`` lines of a log (what a stopped check was doing), joined for a row's note."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()[-20000:]
    except OSError:
        return ""
    return " | ".join(ln.strip() for ln in text.splitlines()[-lines:] if ln.strip())[-1500:]


# ---- the budget's stop: the scheduler sends SIGTERM to a check's process group a grace before its budget ends


class Stopped(BaseException):
    """Raised in a check's process by SIGTERM: the check builds its rows from what it measured so far. Not an
    Exception (as KeyboardInterrupt is not): a measurement's ``except Exception`` (a lever that may fail on this
    device) must not take the stop for its own failure and run on."""


_HELD = [0]  # blocks a stop waits for (stop_held), nested


def stop_on(*signals: signal.Signals) -> list[int]:
    """The first of ``signals`` to arrive raises ``Stopped`` (the others ignored from then on: the children it started
    got the same signal, and the stop runs once), at once or at the end of a ``stop_held`` block; returns the list
    the signal's number is put in."""
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        if not _HELD[0]:
            raise Stopped()

    for sig in signals:
        signal.signal(sig, on_signal)
    return received


@contextlib.contextmanager
def stop_held(received: list[int]) -> Iterator[None]:
    """A block a stop does not cut in two (a check's process started and recorded as running): a stop that came in
    it is raised at its end. ``received``: stop_on's list."""
    _HELD[0] += 1
    try:
        yield
    finally:
        _HELD[0] -= 1
        if received and not _HELD[0]:  # also where the block raised: the stop is not lost
            raise Stopped()

