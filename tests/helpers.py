"""Tiny random models and RL batches for tests (no hub, no tokenizer).

The models are shaped like the ones users bring, unless a test asks otherwise: tied embeddings, GQA (4 query heads
over 2 KV heads), a vocabulary of thousands, and two eos ids in generation_config.json. tests/zoo.py has real
architectures with real tokenizers and chat templates."""

from __future__ import annotations

import os

import torch

from lib.protocol import DataProto

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 2048
EOS_IDS = [1, 3]  # the tokenizer's eos and a second one, as Qwen2.5-Instruct's generation config lists


def tiny_config(arch: str = "qwen2", **overrides):
    from transformers import GraniteConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
                  attention_dropout=0.0, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    common.update(overrides)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=8, **common)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "granite":  # its forward divides the logits by logits_scaling, 1.0 included
        return GraniteConfig(**common)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**{"head_dim": 8, **common})
    raise ValueError(arch)


def save_tiny_model(path: str, arch: str = "qwen2", seed: int = 0, **overrides) -> str:
    from transformers import AutoModelForCausalLM, GenerationConfig

    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
        model.generation_config = GenerationConfig(eos_token_id=EOS_IDS, pad_token_id=0, bos_token_id=2)
        model.save_pretrained(path)
    return path


def rl_batch(num_rows: int, prompt_len: int = 6, response_len: int = 5, seed: int = 0,
             min_prompt: int = 2, min_response: int = 0) -> DataProto:
    """Left-padded prompts + right-padded responses of random lengths, with masks and position ids."""
    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(min_prompt, prompt_len + 1, (num_rows,), generator=g)
    r_lens = torch.randint(min_response, response_len + 1, (num_rows,), generator=g)
    prompts = torch.zeros(num_rows, prompt_len, dtype=torch.long)
    responses = torch.zeros(num_rows, response_len, dtype=torch.long)
    p_mask = torch.zeros(num_rows, prompt_len, dtype=torch.long)
    r_mask = torch.zeros(num_rows, response_len, dtype=torch.long)
    for i in range(num_rows):
        p, r = int(p_lens[i]), int(r_lens[i])
        prompts[i, prompt_len - p:] = torch.randint(4, VOCAB, (p,), generator=g)
        p_mask[i, prompt_len - p:] = 1
        responses[i, :r] = torch.randint(4, VOCAB, (r,), generator=g)
        r_mask[i, :r] = 1
    attention_mask = torch.cat([p_mask, r_mask], 1)
    position_ids = (torch.cumsum(attention_mask, 1) - 1).clamp(min=0)
    return DataProto.from_dict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask, "position_ids": position_ids, "response_mask": r_mask.float(),
    }, {"uid": [f"g{i // 2}" for i in range(num_rows)]})


def child_env(**hooks: str) -> dict[str, str]:
    """The environment of a child process (torchrun's launcher and ranks, or launch.sh) with the test hooks of
    tests/child_hooks/sitecustomize.py on its path, ``hooks`` set (RL_FAKE_CUDA="1", RL_BLIND_MIXERS="1"), the GPUs
    hidden and one thread a rank."""
    path = os.pathsep.join([os.path.join(ROOT, "tests", "child_hooks"), ROOT, os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", **hooks}


def apt_install(packages: tuple[str, ...]) -> str:
    """Install Debian ``packages`` (as root, apt-get; a test that needs system programs); returns why not, or "".
    Two test files installing at once wait for each other's lock (a state), not fail."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "no apt-get as root to install the Debian packages " + " ".join(packages)
    out = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=900",
                          *packages], capture_output=True, text=True,
                         env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, timeout=1800)
    return f"apt-get install {' '.join(packages)} failed: {out.stderr.strip()[-300:]}" if out.returncode else ""


def processes():
    """Every process's pid and the fields of its /proc stat after the command's name (state, ppid, pgrp, session,
    ...); a process gone while read is left out."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        yield int(entry), stat.rsplit(")", 1)[1].split()


def torchrun_command(nproc: int, script: str, *args: str) -> list[str]:
    """The command line that runs ``script`` with ``args`` on ``nproc`` local ranks under torchrun itself."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
            str(nproc), script, *args]


def forked_torchrun(nproc: int, script: str, *args: str) -> list[str]:
    """The command line that runs ``script`` (train_grpo.py, train_ppo.py or tests/runs_driver.py, a path) with
    ``args`` on ``nproc`` CPU ranks forked from one interpreter that imported them (tests/forked_torchrun.py: the
    tests whose subject is the training, not the launch)."""
    import sys

    return [sys.executable, os.path.join(ROOT, "tests", "forked_torchrun.py"), "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc), script, *args]


def launch_runs(plan: list[tuple[str, str, list[str]]], folder, timeout: int = 1800, nproc: int = 2,
                plan_name: str = "plan.json"):
    """The runs of ``plan`` ([(name, script, arguments)]) one after another in one launch of ``nproc`` gloo CPU
    ranks (tests/runs_driver.py, the ranks forked: forked_torchrun), the plan written into ``folder`` and the
    launch's output beside it (PLAN.log); returns the finished process (stdout, stderr)."""
    import json
    import subprocess

    path = os.path.join(str(folder), plan_name)
    with open(path, "w") as f:
        json.dump([[name, script, list(args)] for name, script, args in plan], f)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = forked_torchrun(nproc, os.path.join(ROOT, "tests", "runs_driver.py"), path)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    with open(path[:-len(".json")] + ".log", "w") as f:  # the launch's output beside its plan, each run's time in it
        f.write(done.stdout + done.stderr)
    return done


def run_rows(launched, name: str, steps: int = 0) -> list[dict]:
    """The metric rows of the run ``name`` of a launch_runs launch (``launched``: (its output root, its finished
    process)); with ``steps``, they must be that run's steps 1..steps, else the launch's output says why."""
    import json

    root, out = launched
    path = os.path.join(str(root), name, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    if steps:
        assert [r["step"] for r in rows] == list(range(1, steps + 1)), \
            f"run {name}:\n" + out.stdout[-3000:] + out.stderr[-5000:]
    return rows


def run_outputs(stdout: str) -> dict[str, str]:
    """A launch_runs launch's standard output, run by run (what each printed after its ``== run NAME`` line)."""
    parts: dict[str, str] = {}
    name = None
    for line in stdout.splitlines(keepends=True):
        if line.startswith("== run "):
            name = line[len("== run "):].strip()
            parts[name] = ""
        elif name is not None:
            parts[name] += line
    return parts


# ---- multi-turn tools (tests/test_multi_turn.py, tests/test_partial.py)

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "mt_tools.py") + ":TOOLS"
"""The multi-turn tests' tools: well-behaved ones and ones that misbehave in each way a tool can."""


def call(name: str, **args) -> str:
    """A Hermes tool call's text."""
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


class LocalPool:
    """Runs calls in this process (the scripted tests that do not test the workers)."""

    def __init__(self, spec):
        from lib.multi_turn.tools import ToolHost

        self.host = ToolHost(spec)

    def score(self, items, pin=None):
        return [self.host(*item) for item in items]

    def close(self):
        pass


def prompts_for(tokenizer, rows, tmp_path, spec):
    """The rows (chat prompts offering ``spec``'s tools), loaded and collated as a run's prompts."""
    import json

    import numpy as np

    from lib.data import collate, load_prompts
    from lib.multi_turn.tools import load_tools, schemas

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ps = load_prompts([str(path)], tokenizer, 32, known_sources=None, tool_schemas=schemas(load_tools(spec)))
    return collate(ps, np.arange(len(ps)), 32, tokenizer.pad_token_id)


def row(key, **extra):
    """A data row whose user message is ``key``."""
    return {"prompt": [{"role": "user", "content": key}], "data_source": "toy",
            "reward_model": {"ground_truth": "x"}, **extra}
