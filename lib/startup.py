"""Start-up and teardown of a run, shared by both scripts: everything that can fail on user input (config,
files, custom reward code) is checked before any model loads; then the models, the optimizer and the rollout
engine are built. ``Run`` holds what the stages of the loop share.

Batch keys, by the stage that writes them:
  next_batch     input_ids, attention_mask, position_ids (prompts); data_source, ground_truth, extra_info,
                 columns, raw_prompt, messages, row, uid                                                      (lib/rollout.py)
  rollout        prompts, responses, response_mask, input_ids, attention_mask, position_ids, rollout_log_probs;
                 routed_experts (B, L, MoE layers, k) int16 with rollout.routing_replay               (lib/routing)
  score          token_level_scores (B, R); scores (object, per row); with a judge, score_group (the advantage's
                 groups: a sample it could not score in one of its own) and response_mask 0 there (lib/scoring.py)
  log-probs      old_log_probs (actor; the engine's with bypass_mode; left to the update when Sizes.old_in_update),
                 ref_log_prob (reference); values (critic, PPO)
  advantages     token_level_rewards, advantages, returns; rollout_is_weights (rollout correction)
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lib import budget, distill, envs, exits, export, judges, lora, multi_turn, restarts, routing, selfcheck, stops, \
    toy, watchdog
from lib.envs import openenv, verifiers_play
from lib.envs import reasoning_gym as rg_data
from lib.envs import verifiers_data as vf_data
from lib.envs.loop import EnvRollout
from lib.judges import toy as judge_toy
from lib.config import Config, to_dict
from lib.data import PromptSet, Sampler, expand_files, load_prompts
from lib.dist import Topology, init_topology
from lib.engine import RolloutEngine, SamplingConfig, plan_kv_cache
from lib.engine.hf import HFEngine
from lib.engine.vllm import VLLMEngine, strip_expandable_segments
from lib.logprobs import Truncation
from lib.fsdp import build_sharded_model, fp32_compute, offload_model
from lib.runfolder import check_run_folder, run_dir
from lib.runlog import RunLogger, excepthook_rank
from lib.models import UNFUSED_HEAD_ATTR, load_config, load_tokenizer, stop_token_ids
from lib.multi_turn.loop import MultiTurn
from lib.multi_turn.render import ObservationRenderer
from lib.multi_turn.tools import is_environment, load_tools, schemas
from lib.optim import build_optimizer
from lib.preflight import Sizes, picks_vllm, resolve, validate
from lib.rewards import RULE_SOURCES, check_truth_source, load_custom
from lib.rewards.scorer import RewardModel, Scorer
from lib.vision import FAMILIES, family, has_vision, placeholder_ids
from lib.vision import problem as vision_problem
from lib.vision import vllm_problem as vision_vllm_problem
from lib.vision import toy as vision_toy
from lib.vision.processor import VisionProcessor
from lib.update import Trainee


@dataclass
class Run:
    cfg: Config
    topo: Topology
    sizes: Sizes
    path: str
    tokenizer: Any
    train: PromptSet
    val: PromptSet | None
    sampler: Sampler
    total_steps: int
    logger: RunLogger
    scorer: Scorer
    engine: RolloutEngine | None = None
    actor: Trainee | None = None
    ref: torch.nn.Module | None = None
    """The KL reference; the actor's own model (its LoRA adapter switched off) with actor.lora.reference base."""
    lora: Any = None
    """lib.lora.Sync of a LoRA policy (None: full fine-tuning)."""
    multi_turn: MultiTurn | EnvRollout | None = None
    """Multi-turn rollouts: with tools (lib/multi_turn), or an environment's episodes (lib/envs). None: one turn."""
    env_server: openenv.LocalServer | None = None
    """The OpenEnv server this rank started (env.app)."""
    partial: list = field(default_factory=list)
    """Partial rollouts' pool on this rank (lib/partial): the samples carried into the next step."""
    data_position: int = 0
    """Prompt batches drawn from the data stream so far (one per step; more with dynamic sampling). Checkpointed."""
    bad_steps: int = 0
    """Steps in a row whose update was skipped (non-finite loss or grad norm)."""
    stopped: str = ""
    """Why the loop ended early: a signal's name, or "bad_steps"."""
    reported_failures: set[str] = field(default_factory=set)
    """Reward failure kinds whose first message was printed."""
    restarts: int = 0
    """Restarts after a failure the run folder has recorded (lib/restarts.py), logged as fault/restarts."""
    carried_metrics: dict[str, float] = field(default_factory=dict)
    """Metrics of work done after a step's row was logged (the checkpoint save's stage), logged with the next row."""
    vision: bool = False
    """The prompts have images: the policy (and reference) are the vision-language class, trained with them."""
    teacher: torch.nn.Module | None = None
    """On-policy distillation's frozen teacher (lib/distill), sharded like the reference."""
    scored: bool = True
    """The training rows have a reward function (pure distillation's rows may need none)."""

    @property
    def kind(self) -> str:
        """The policy's model kind (lib.models.KINDS)."""
        return "vision_lm" if self.vision else "causal_lm"

    @property
    def truncation(self) -> Truncation | None:
        """Top-k/top-p sampling's filter (rollout.top_k, top_p; lib.logprobs.Truncation): the policy's log-probs and
        entropy are taken over the kept tokens. None: the engine samples the whole temperature-scaled vocabulary."""
        r = self.cfg.rollout
        t = Truncation(r.top_k, r.top_p)
        return t if t.on else None


def start(cfg: Config, need_critic: bool = False) -> Run:
    """Process group, toy assets, config checks, run folder, data and logger: everything that can fail on user
    input, before any model is loaded."""
    stops.install()  # first: a stop signal from here on finishes the step in flight (and one kept from before)
    if uses_vllm(cfg):

        strip_expandable_segments()  # before CUDA's allocator starts: it reads the setting once
    try:
        topo = init_topology(sp_size=cfg.trainer.sp_size, fsdp_shard_size=cfg.actor.fsdp.shard_size,
                             rollout_tp_size=cfg.rollout.tp_size, device=cfg.trainer.device,
                             timeout_s=cfg.trainer.collective_timeout_s)
    except ValueError as e:  # sizes the world cannot take (checked before the process group starts)
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        exits.leave(exits.REFUSED)
    excepthook_rank(topo.rank)
    torch.manual_seed(cfg.trainer.seed)
    try:
        resolve_generated(cfg, topo)
    except ValueError as e:  # a task library's name or settings: one message, before anything loads
        if topo.is_main:
            print(f"error: {e}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        exits.leave(exits.REFUSED)
    resolve_toy(cfg, topo)
    resolved = resolve(cfg, need_critic)
    obj = [run_dir(cfg.trainer.output_root, cfg.trainer.run_name, to_dict(cfg), sys.argv[0])]
    dist.broadcast_object_list(obj, src=0)  # one run folder, even if the clocks of the ranks differ
    path = obj[0]
    restarts.watch(path, topo.rank, cfg.trainer)  # errors kept for a restart, which resumes the run it failed in
    problem = ""
    try:
        # the judge's endpoint probed once a launch: by launch.sh's check, or else by rank 0 (its failure stops all)
        probe = topo.is_main and os.environ.get(CHECKED_ENV) != "1"
        inputs = check_inputs(cfg, topo.world_size, need_critic, path, probe)
    except (ValueError, OSError) as e:  # user input: one message, no traceback, nothing loaded or written
        problem = str(e)
    problems: list = [None] * topo.world_size
    # world: every rank has checked before rank 0 writes the run folder (a rank that checked after it saw a run
    # there and refused --trainer.no-resume), and all stop together if any rank found a problem
    dist.all_gather_object(problems, problem)
    problem = next((p for p in problems if p), "")
    if problem:
        if topo.is_main:
            print(f"error: {problem}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        exits.leave(exits.REFUSED)
    sizes, tokenizer, train, val, sampler = inputs.sizes, inputs.tokenizer, inputs.train, inputs.val, inputs.sampler
    vision = inputs.vision
    start_step = inputs.start_step
    total = cfg.trainer.total_steps or cfg.trainer.epochs * sampler.steps_per_epoch
    restarted, restart_count = restarts.at_start(path, topo.is_main, start_step, cfg.trainer.max_restarts)
    failed = [""]
    try:
        logger = RunLogger(path, to_dict(cfg), total, cfg.trainer.logger, cfg.trainer.project, topo.is_main,
                           start_step=start_step or 0)
    except Exception as e:  # noqa: BLE001 - wandb's own errors: the run cannot report, so it does not start
        failed = [f"trainer.logger: wandb could not start ({type(e).__name__}: {str(e)[:300]}); set WANDB_MODE="
                  f"offline (the run stays on disk; wandb sync later), check WANDB_API_KEY, or drop wandb from "
                  f"--trainer.logger"]
    dist.broadcast_object_list(failed, src=0)  # only rank 0 starts wandb; every rank stops together
    if failed[0]:
        if topo.is_main:
            print(f"error: {failed[0]}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        exits.leave(exits.REFUSED)
    no_val = " (no validation: data.val_files is empty)" if cfg.trainer.val_every and not cfg.data.val_files else ""
    logger.print(f"{topo}\nprompts: train {train.stats}, val {val.stats if val else None}{no_val}; {total} steps; "
                 f"run folder {path}" + "".join(f"\nresolved: {line}" for line in resolved)
                 + (f"\n{restarted}" if restarted else ""))
    rm = None
    if cfg.reward.reward_model:
        rm = RewardModel(cfg.reward.reward_model, topo.device, tokenizer, cfg.reward.rm_micro_batch_size,
                         cfg.reward.rm_offload)
        logger.print(rm.describe())
    env_server, env_url = start_env(cfg, topo, path)
    scorer = Scorer(tokenizer, cfg.reward.custom_fn, cfg.reward.timeout_s, rm, cfg.reward.num_workers, inputs.judge,
                    (cfg.judge.rule_weight, cfg.judge.weight),
                    (cfg.env.rule_weight, cfg.env.weight) if envs.enabled(cfg) else None)
    if inputs.judge is not None:
        if isinstance(inputs.judge, judges.LocalJudge):
            inputs.judge.start(topo.device, cfg.rollout.hf_batch_tokens, cfg.trainer.seed)
        logger.print(f"{inputs.judge.describe()}; reward = {cfg.judge.weight:g} x judge + {cfg.judge.rule_weight:g} x "
                     f"rule; unscored samples masked")
    tools = MultiTurn(cfg.multi_turn, tokenizer, cfg.rollout.max_response_length) if multi_turn.enabled(cfg) else None
    if cfg.env.verifiers:
        bridge = verifiers_play.Bridge()
        tools = EnvRollout(cfg.env, "", tokenizer, cfg.rollout.max_response_length, cfg.data.max_prompt_length,
                           connect=lambda: verifiers_play.VerifiersSession(bridge, cfg.env.timeout_s,
                                                                           cfg.env.action_field))
        logger.print(f"environment: each row's verifiers environment plays its turns in process; "
                     f"{cfg.env.max_in_flight} turns in flight a rank; reward = {cfg.env.weight:g} x its reward + "
                     f"{cfg.env.rule_weight:g} x rule; failed episodes masked")
    elif env_url:
        tools = EnvRollout(cfg.env, env_url, tokenizer, cfg.rollout.max_response_length, cfg.data.max_prompt_length)
        logger.print(f"environment: OpenEnv at {env_url}{' (started by each rank: ' + cfg.env.app + ')' if env_server else ''}; "
                     f"{cfg.env.max_in_flight} requests in flight a rank; reward = {cfg.env.weight:g} x return + "
                     f"{cfg.env.rule_weight:g} x rule; failed episodes masked")
    return Run(cfg, topo, sizes, path, tokenizer, train, val, sampler, total, logger, scorer, multi_turn=tools,
               env_server=env_server,
               vision=vision, scored=inputs.scored, restarts=restart_count)


def start_env(cfg: Config, topo: Topology, path: str) -> tuple[openenv.LocalServer | None, str]:
    """The environment server's URL: env.url, or the server each rank starts for env.app (its output in the run
    folder's env_server/). A server that does not start stops every rank with its message, once."""
    if not cfg.env.app:
        return None, cfg.env.url
    server, problem = None, ""
    try:
        server = openenv.LocalServer(cfg.env.app, os.path.join(path, "env_server", f"rank{topo.rank}.log"),
                                     max(60.0, cfg.env.timeout_s))
        atexit.register(server.close)
    except ValueError as e:
        problem = str(e)
    problems: list = [None] * topo.world_size
    dist.all_gather_object(problems, problem)  # world: every rank's server is up, or all stop together
    problem = next((p for p in problems if p), "")
    if problem:
        if server is not None:
            server.close()
        if topo.is_main:
            print(f"error: {problem}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        exits.leave(exits.REFUSED)
    return server, server.url


@dataclass
class Inputs:
    sizes: Sizes
    start_step: int | None
    tokenizer: Any
    train: PromptSet
    val: PromptSet | None
    sampler: Sampler
    vision: bool = False
    """The data has images: the policy is its vision-language class, trained with them (lib/vision)."""
    scored: bool = True
    """Every training row has a reward function (rule, custom function, reward model or judge)."""
    judge: Any = None
    """The LLM judge (lib/judges), probed once: its key and endpoint work."""


CHECKED_ENV = "SPMD_RL_CHECKED"
"""Set by launch.sh once lib.check passed: the ranks do not probe the judge's endpoint again (one probe a launch)."""


def check_inputs(cfg: Config, world_size: int, need_critic: bool, path: str, probe: bool = True) -> Inputs:
    """Every check of user input, in one process and without a process group (lib/check.py runs it before torchrun
    starts the ranks; each rank runs it again): config values and size relations, model / critic / reward-model /
    data / custom-reward paths, the run folder, the data rows. Raises ValueError or OSError with the fix named."""
    model_config = load_config(cfg.actor.model.path, cfg.actor.model.trust_remote_code)
    sizes = validate(cfg, world_size, model_config, need_critic)
    if need_critic and cfg.critic.model.path:
        load_config(cfg.critic.model.path, cfg.critic.model.trust_remote_code, "critic.model.path")
    if cfg.reward.reward_model:
        load_config(cfg.reward.reward_model, setting="reward.reward_model")
        load_tokenizer(cfg.reward.reward_model)
    train_files = expand_files(cfg.data.train_files, "train")
    val_files = expand_files(cfg.data.val_files, "val")
    if cfg.reward.custom_fn:
        load_custom(cfg.reward.custom_fn)
    start_step = check_run_folder(path, to_dict(cfg), cfg.trainer.resume)
    tokenizer = load_tokenizer(cfg.actor.model.path, cfg.actor.model.trust_remote_code)
    d = cfg.data
    if distill.enabled(cfg):
        check_teacher(cfg, tokenizer)
    judge = judges.build(cfg.judge, cfg.actor.model.trust_remote_code)
    if judge is not None and (probe or not judge.remote):
        judge.probe()  # a refused key or an endpoint that cannot be reached: one error, before any model loads
        judge.check_context(d.max_prompt_length, cfg.rollout.max_response_length)
    if envs.enabled(cfg):
        if cfg.reward.custom_fn and not cfg.env.rule_weight:
            raise ValueError(f"--reward.custom_fn {cfg.reward.custom_fn} with an environment whose return is the "
                             f"whole reward (env.rule_weight 0): set env.rule_weight to weigh it in, or drop it")
        ObservationRenderer(tokenizer, role=cfg.env.observation_role)  # a template that cannot render them
        if cfg.env.app:
            openenv.check_app(cfg.env.app)  # its file or module exists (each rank starts it after the checks)
        elif cfg.env.url and probe:  # a server that cannot be reached: one error, before any model loads
            openenv.probe(cfg.env.url, cfg.env.timeout_s, cfg.env.max_retries + 1, cfg.env.backoff_s)
    # an RM, a judge or an environment alone scores any row; pure distillation's rows need no reward function
    any_row = cfg.reward.custom_fn or cfg.reward.reward_model or (judge is not None and not cfg.judge.rule_weight) \
        or (envs.enabled(cfg) and not cfg.env.rule_weight)
    known = None if any_row or (distill.enabled(cfg) and not cfg.distill.task_reward) else RULE_SOURCES
    tool_schemas = None
    if multi_turn.enabled(cfg):
        tool_schemas = schemas(load_tools(cfg.multi_turn.tools), cfg.multi_turn.tools)
        ObservationRenderer(tokenizer)  # a template that cannot render tool messages is refused here
        if is_environment(cfg.multi_turn.tools):
            if cfg.rollout.partial.enabled:
                raise ValueError(f"rollout.partial with multi_turn.tools {cfg.multi_turn.tools}, an environment: its "
                                 f"instances live in the tool workers, which neither the pool nor the checkpoint can "
                                 f"carry into another step; use tool functions, or turn rollout.partial off")
            if cfg.reward.custom_fn:
                raise ValueError(f"multi_turn.tools {cfg.multi_turn.tools} is an environment: its reward() scores the "
                                 f"episodes; drop --reward.custom_fn")
            known = None  # rows need no rule scorer
    processor, refusal = vision_processor(cfg, model_config, tokenizer)
    load = lambda files: load_prompts(files, tokenizer, d.max_prompt_length, d.truncation,  # noqa: E731
                                      d.apply_chat_template, d.limit, known, d.bad_rows, tool_schemas,
                                      processor, refusal)
    train = load(train_files)
    val = load(val_files) if val_files and cfg.trainer.val_every else None
    if cfg.reward.custom_fn:
        check_truth_source(load_custom(cfg.reward.custom_fn), cfg.reward.custom_fn, train.ground_truth, train.columns)
    sampler = Sampler(len(train), cfg.trainer.train_batch_size, cfg.trainer.seed, d.shuffle)
    images = train.images is not None or (val is not None and val.images is not None)
    if images:
        if envs.enabled(cfg):
            raise ValueError("an environment's episodes with image prompts are not built yet: train on text rows, or "
                             "without env")
        check_vision_modes(cfg, train, val, need_critic)
    elif has_vision(model_config) and uses_vllm(cfg):
        # vLLM builds the whole class, vision tower included, and text rows train the language model alone: the
        # sync would leave the tower unwritten
        raise ValueError(f"{cfg.actor.model.path} is a whole vision-language checkpoint ({model_config.model_type}) "
                         f"and the data has no images: its language model trains text-only, which the vLLM engine "
                         f"does not take; use --rollout.engine hf")
    def scorable(prompts: PromptSet) -> bool:
        return bool(any_row) or all(source in RULE_SOURCES for source in prompts.data_source)

    if val is not None and not scorable(val):
        raise ValueError(f"data.val_files: validation scores its rows, and some have no rule scorer (known: "
                         f"{sorted(RULE_SOURCES)}); set --reward.custom_fn, give them a data_source, or set "
                         f"--trainer.val_every 0")
    return Inputs(sizes, start_step, tokenizer, train, val, sampler, images, scorable(train), judge)


def check_teacher(cfg: Config, tokenizer: Any) -> None:
    """distill.teacher: a model folder whose tokenizer has the student's vocabulary (checked before any model loads)."""
    path = cfg.distill.teacher
    try:
        load_config(path, cfg.actor.model.trust_remote_code)
        teacher_tokenizer = load_tokenizer(path, cfg.actor.model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"distill.teacher={path!r} cannot be loaded ({type(e).__name__}: {str(e)[:200]}); point it "
                         f"at a model folder with its tokenizer") from None
    if problem := distill.vocabulary_problem(tokenizer, teacher_tokenizer, path):
        raise ValueError(problem)


def vision_processor(cfg: Config, model_config: Any, tokenizer: Any) -> tuple[VisionProcessor | None, str]:
    """The model's image processing, or why image rows cannot be trained with this model (said only if the data
    has images: a vision-language checkpoint trains text-only on text rows without its processor)."""
    m = cfg.actor.model
    if not has_vision(model_config):
        return None, (f"the model ({model_config.model_type}) has no vision tower: train a vision-language model "
                      f"({', '.join(sorted(FAMILIES))}) on it, or drop the column")
    refusal = vision_problem(model_config)
    if refusal:
        return None, refusal
    if (m.min_pixels or m.max_pixels) and not family(model_config).rope:
        side = getattr(model_config.vision_config, "image_size", None)  # Gemma-3's fixed size; Gemma-4 has a budget
        size = (f"to its vision tower's size ({side} pixels square)" if side else
                "within its image processor's patch budget (max_soft_tokens in its preprocessor config)")
        return None, (f"{model_config.model_type} resizes every image {size}: actor.model.min_pixels and max_pixels "
                      f"do not apply to it; unset them")
    try:
        return VisionProcessor(m.path, model_config, tokenizer, m.min_pixels, m.max_pixels, m.trust_remote_code), ""
    except (OSError, ValueError) as e:
        return None, (f"the model's image processor cannot be loaded from {m.path} ({type(e).__name__}: "
                      f"{str(e)[:200]}); a vision-language model folder needs its preprocessor_config.json")


def check_vision_modes(cfg: Config, train: PromptSet, val: PromptSet | None, need_critic: bool) -> None:
    """What image training does not do yet is refused here, naming the setting, never run as something else."""
    if need_critic:
        raise ValueError("PPO's critic with image prompts is not built yet; train with train_grpo.py (no critic)")
    if cfg.actor.batching.use_remove_padding and cfg.actor.model.attn_implementation != "auto":
        # transformers' own kernels on a packed row with the 3-D rope rows beside the text row attend across the
        # packed sequences (measured on Qwen2-VL: log-probs 0.63 off); lib/attention.py's packed kernel keeps them apart
        raise ValueError(f"actor.model.attn_implementation={cfg.actor.model.attn_implementation} with packed image "
                         f"prompts would attend across the packed sequences; set it to auto (the packed attention) or "
                         f"turn packing off (--actor.batching.no-use-remove-padding)")
    if uses_vllm(cfg) and (problem := vision_vllm_problem()):
        raise ValueError(problem)


def resolve_toy(cfg: Config, topo: Topology | None = None) -> None:
    """``toy`` (``toy_tool``: the tool variant; ``toy_vision``: the visual task; ``toy_teacher``: distillation's
    teacher) in the model path, data files or distill.teacher means the embedded task: rank 0 builds it once
    (``topo`` None: a single process, lib/check.py)."""
    for name, build in (("toy", toy.prepare), ("toy_tool", toy.prepare_tool), ("toy_vision", vision_toy.prepare),
                        ("toy_teacher", toy.prepare_teacher), ("toy_judge", judge_toy.prepare)):
        if not (cfg.actor.model.path == name or name in cfg.data.train_files or name in cfg.data.val_files
                or cfg.distill.teacher == name or cfg.judge.path == name):
            continue
        assets = os.path.join(cfg.trainer.output_root, f"{name}_assets")
        if topo is None or topo.is_main:
            build(assets, seed=0)
        if topo is not None:
            dist.barrier()
        paths = build(assets, seed=0)  # already built: just the paths
        if cfg.actor.model.path == name:
            cfg.actor.model.path = paths["model"]
        if cfg.distill.teacher == name:
            cfg.distill.teacher = paths["model"]
        if cfg.judge.path == name:  # the toy judge reads its own short prompt unless the config names another
            cfg.judge.path = paths["model"]
            cfg.judge.template = cfg.judge.template or paths["template"]
        cfg.data.train_files = [paths["train"] if f == name else f for f in cfg.data.train_files]
        cfg.data.val_files = [paths["val"] if f == name else f for f in cfg.data.val_files]


def resolve_generated(cfg: Config, topo: Topology | None = None) -> None:
    """Data files made from a task library's or an environment's name (``reasoning_gym:...``,
    lib/envs/reasoning_gym.py; ``verifiers:...``, lib/envs/verifiers_data.py): rank 0 writes
    them once under the output root and every rank reads the paths (``topo`` None: a single process, lib/check.py).
    A bad name or setting raises ValueError on every rank."""
    d = cfg.data
    makers = {name: m for name in d.train_files + d.val_files for m in (rg_data, vf_data) if m.is_spec(name)}
    if cfg.env.verifiers:
        others = list(dict.fromkeys(f for f in d.train_files + d.val_files if not vf_data.is_spec(f)))
        if others:
            raise ValueError(f"env.verifiers plays the environment each row names, and {others} are not rows of a "
                             f"verifiers environment: name them as {vf_data.USAGE}")
    if not makers:
        return
    problem = [""]
    if topo is None or topo.is_main:
        try:
            for name, maker in makers.items():
                path = maker.build(name, cfg.trainer.output_root)
                if cfg.env.verifiers:  # its turns play here: no MCP tools, no container
                    verifiers_play.check(*vf_data.parse(name))
                elif maker is vf_data and vf_data.opened_by_env(path):
                    raise ValueError(f"{name}: the environment opens each conversation (its tasks have no prompt): "
                                     f"play its turns with --env.verifiers")
        except ValueError as e:
            problem = [str(e)]
    if topo is not None:
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise ValueError(problem[0])
    paths = {name: maker.build(name, cfg.trainer.output_root) for name, maker in makers.items()}  # just the paths
    d.train_files = [paths.get(f, f) for f in d.train_files]
    d.val_files = [paths.get(f, f) for f in d.val_files]


def build_models(run: Run, with_ref: bool) -> None:
    cfg, topo = run.cfg, run.topo
    packed = cfg.actor.batching.use_remove_padding
    lora_cfg = cfg.actor.lora if lora.enabled(cfg.actor.lora) else None
    model = build_sharded_model(cfg.actor.model, cfg.actor.fsdp, topo, kind=run.kind, packed=packed,
                                lora_cfg=lora_cfg, seed=cfg.trainer.seed)
    if model.dropout_off:
        run.logger.print(f"dropout off in the trainer's forwards (the engine samples without it; router jitter too): "
                         f"{', '.join(model.dropout_off)}")
    prove_modes(run, model, packed)
    cfg.actor.optim.total_steps = cfg.actor.optim.total_steps or run.total_steps
    optimizer, scheduler = build_optimizer(model, cfg.actor.optim)
    run.actor = Trainee(model, optimizer, scheduler, topo)
    if lora_cfg is not None:
        run.lora = lora.Sync(lora_cfg.merge, 2 if lora_cfg.merge else lora_cfg.sleep_level, lora.num_modules(model))
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        run.logger.print(f"LoRA: rank {lora.peft_config(lora_cfg).r} on {run.lora.num_modules} modules, "
                         f"{trained} trained parameters on this rank; "
                         f"{'merged weights' if lora_cfg.merge else 'the adapter'} synced every step; reference: "
                         f"{lora_cfg.reference if with_ref else 'none'}")
    if with_ref and lora_cfg is not None and lora_cfg.reference == "base":
        run.ref = model  # the same model with its adapter off (lib.rollout.policy_log_probs): no second copy
    elif with_ref:  # the frozen start policy; never a second rollout engine
        run.ref = build_sharded_model(cfg.actor.model, cfg.actor.fsdp, topo, kind=run.kind, trainable=False,
                                      packed=packed, lora_cfg=lora_cfg)
        if getattr(model, UNFUSED_HEAD_ATTR, False):  # the policy's class: the self-check's verdict holds for it
            setattr(run.ref, UNFUSED_HEAD_ATTR, True)
    if cfg.rollout.routing_replay:
        state = routing.install(model)
        if run.ref is not None and cfg.rollout.routing_replay_reference:
            routing.install(run.ref)
        run.logger.print(f"routing replay: {state.layers} MoE layers of top-{state.top_k} (decoder layers "
                         f"{routing.moe_layers(model)}); the engine's routes replayed in the policy's forwards"
                         f"{' and the reference' if cfg.rollout.routing_replay_reference and run.ref is not None else ''}")
    if distill.enabled(cfg):  # frozen and sharded like the reference; on a GPU it waits on the CPU
        teacher = dataclasses.replace(cfg.actor.model, path=cfg.distill.teacher, gradient_checkpointing=False)
        run.teacher = build_sharded_model(teacher, cfg.actor.fsdp, topo, kind=run.kind, trainable=False,
                                          packed=packed)
        try:
            with fp32_compute(run.teacher):
                decide_head(run, run.teacher, "teacher")
        except ValueError as e:
            refuse(run, e)
        if distill.offloads(cfg, topo.device):
            offload_model(run.teacher)
        run.logger.print(f"distillation: teacher {cfg.distill.teacher}, mode {cfg.distill.mode}"
                         f"{' (' + cfg.distill.estimator + ')' if cfg.distill.mode == 'loss' else ''}, coef "
                         f"{cfg.distill.coef}, task reward {'kept' if cfg.distill.task_reward else 'off'}")
    run.engine = build_engine(run)
    size_token_budget(run)


def size_token_budget(run: Run) -> None:
    """actor.batching.token_budget memory: the update's token budget from the device's memory (lib/budget.py), once
    every model and the engine are built and the engine sleeps; printed, or the run refused with the fix."""
    cfg = run.cfg
    if cfg.actor.batching.token_budget != "memory":
        return
    model = run.actor.model
    text = model.config.get_text_config()
    try:
        cfg.actor.batching, line = budget.size_from_memory(
            cfg.actor.batching, model, run.topo.device, text.vocab_size,
            cfg.data.max_prompt_length + cfg.rollout.max_response_length, cfg.actor.fsdp.optimizer_offload,
            DEVICE_MARGIN_BYTES)
    except ValueError as e:
        refuse(run, e)
    run.logger.print(line)


def prove_modes(run: Run, model: torch.nn.Module, packed: bool) -> None:
    """The start-up self-check (lib/selfcheck.py): packing and SP against the padded forward on the user's model;
    a mismatch stops every rank with one message, before step 1."""
    topo = run.topo
    try:
        with fp32_compute(model):  # fp32's tolerance on every device: a small leak hides in bf16 rounding
            decide_head(run, model)  # first: the packing check's forwards take the head so decided
            replay = run.cfg.rollout.routing_replay
            results = selfcheck.check_modes(model, topo, packed, torch.float32, replay)
    except ValueError as e:
        refuse(run, e)
    for r in results:
        run.logger.print(f"self-check: {r['mode']} = padded forward (max |diff| of log-probs {r['max_diff']:.2g}, "
                         f"tolerance {r['tolerance']:g}; {r['seconds']:.2f} s)")


def refuse(run: Run, e: Exception) -> None:
    """A refusal found inside the ranks (the start-up self-check): rank 0 prints it, every rank leaves with 2."""
    if run.topo.is_main:
        print(f"error: {e}", file=sys.stderr, flush=True)
    run.logger.close()
    dist.destroy_process_group()
    exits.leave(exits.REFUSED)


def decide_head(run: Run, model: torch.nn.Module, what: str = "policy") -> None:
    """The fused LM head for ``model`` where it gives the model's own log-probs (lib.selfcheck.check_fused_head),
    the whole logits where it does not, said in one line; with model.fused_head on, a difference is a refusal
    (ValueError). Nothing where the head is not fused (off, auto on a GPU, a known post-processing attribute)."""
    setting = run.cfg.actor.model.fused_head
    r = selfcheck.check_fused_head(model, run.topo)
    if r is None:
        return
    if r["fused"]:
        run.logger.print(f"self-check: fused LM head = whole logits for the {what} (max |diff| of log-probs and "
                         f"entropy {r['max_diff']:.2g}, tolerance {r['tolerance']:g}; {r['seconds']:.2f} s)")
        return
    diff = "the fused forward fails" if r["max_diff"] == float("inf") else f"max |diff| {r['max_diff']:.2g}"
    if setting == "on":
        raise ValueError(f"actor.model.fused_head on: the {what}'s {r['class']} cannot take the fused LM head: "
                         f"{r['reason']} ({diff}, tolerance {r['tolerance']:g}); use --actor.model.fused_head auto "
                         f"or off")
    setattr(model, UNFUSED_HEAD_ATTR, True)
    run.logger.print(f"self-check: fused LM head off for the {what}'s {r['class']}: {r['reason']} ({diff}, "
                     f"tolerance {r['tolerance']:g}); the whole logits instead (--actor.model.fused_head off skips "
                     f"this check)")


def engine_dtype(run: Run) -> torch.dtype:
    return torch.bfloat16 if run.topo.device.type == "cuda" else torch.float32


def _samplings(cfg: Config) -> tuple[SamplingConfig, SamplingConfig]:
    """The rollout's sampling and validation's."""
    r = cfg.rollout
    return (SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, n=r.n,
                           max_new_tokens=r.max_response_length, seed=cfg.trainer.seed),
            SamplingConfig(temperature=r.val_temperature, n=r.val_n, max_new_tokens=r.max_response_length,
                           seed=cfg.trainer.seed + 1))


def _hf_engine(run: Run, path: str, eos: list[int], lora: Any = None, name: str = "policy") -> HFEngine:
    """An HF engine of the model at ``path``'s shape with the run's sampling, asleep."""
    cfg, topo = run.cfg, run.topo
    sampling, val = _samplings(cfg)
    return HFEngine(load_config(path, cfg.actor.model.trust_remote_code), topo.device, run.tokenizer.pad_token_id,
                    eos, sampling, val, dtype=engine_dtype(run), rank_seed=topo.rollout_dp_rank,
                    attn_implementation=cfg.actor.model.attn_implementation, batch_tokens=cfg.rollout.hf_batch_tokens,
                    lora=lora, vision=run.vision, routes=cfg.rollout.routing_replay and path == cfg.actor.model.path,
                    name=name)


def build_teacher_engine(run: Run) -> HFEngine:
    """An HF engine of distill.teacher's shape, with the policy's sampling and its own stop tokens, asleep (the teacher's
    own validation, lib.validation.validate_teacher, fills and uses it once)."""
    path = run.cfg.distill.teacher
    return _hf_engine(run, path, stop_token_ids(path, run.tokenizer, run.cfg.actor.model.trust_remote_code),
                      name="teacher")


def build_engine(run: Run) -> Any:
    cfg, topo, r = run.cfg, run.topo, run.cfg.rollout
    sampling, val = _samplings(cfg)
    tok = run.tokenizer
    eos = stop_token_ids(cfg.actor.model.path, tok, cfg.actor.model.trust_remote_code)
    run.logger.print(f"stop tokens: {eos} ({', '.join(repr(tok.convert_ids_to_tokens(i)) for i in eos)})")
    if uses_vllm(cfg):

        # a wave: the training samples of one generate call (a TP group generates its ranks' rows together), at
        # most max_num_seqs; validation runs in waves of the same size
        wave = min(run.sizes.samples_per_rank * topo.rollout_tp_size, r.max_num_seqs)
        max_model_len = cfg.data.max_prompt_length + r.max_response_length
        kv_bytes = int(r.kv_cache_gb * 2**30)
        if kv_bytes:
            run.logger.print(f"vLLM KV cache {r.kv_cache_gb:g} GiB per rank (rollout.kv_cache_gb)")
        else:
            dtype = engine_dtype(run)
            model_config = load_config(cfg.actor.model.path, cfg.actor.model.trust_remote_code)
            kv_bytes, line = plan_kv_cache(model_config, wave, max_model_len, dtype.itemsize, topo.rollout_tp_size,
                                           device_budget(run, dtype))
            run.logger.print(line)
        return VLLMEngine(cfg.actor.model.path, topo, tok.pad_token_id, eos, sampling, val,
                          max_model_len=max_model_len, max_num_seqs=wave, kv_cache_bytes=kv_bytes,
                          gpu_memory_utilization=r.gpu_memory_utilization,
                          dtype=str(engine_dtype(run)).removeprefix("torch."), enforce_eager=r.enforce_eager,
                          trust_remote_code=cfg.actor.model.trust_remote_code, lora=engine_lora(run),
                          route_layers=routing.moe_layers(run.actor.model) if r.routing_replay else None,
                          sync_plan=r.sync_plan, **vllm_image_kwargs(run))

    return _hf_engine(run, cfg.actor.model.path, eos, engine_lora(run))


def vllm_image_kwargs(run: Run) -> dict[str, Any]:
    """What vLLM needs for image prompts: the most images a prompt holds, the trainer's pixel bounds (vLLM's
    processor must cut each image into as many tokens as the trainer's) and the placeholder ids never sampled."""
    if not run.vision:
        return {}
    m = run.cfg.actor.model
    bounds = {k: v for k, v in (("min_pixels", m.min_pixels), ("max_pixels", m.max_pixels)) if v}
    most = max(run.train.max_images, run.val.max_images if run.val is not None else 0)
    config = load_config(m.path, m.trust_remote_code)
    return {"images_per_prompt": most, "mm_processor_kwargs": bounds, "banned_ids": placeholder_ids(config),
            "videos": getattr(config, "video_token_id", None) is not None}


def engine_lora(run: Run) -> Any:
    """The PEFT config the engine serves adapters of (None: full weights, LoRA off or merged)."""
    if run.lora is None or run.lora.merge:
        return None
    return lora.peft_config(run.cfg.actor.lora)


# device memory kept back beside the trainer's state and the engine's weights: CUDA context, NCCL buffers,
# allocator fragmentation, the sampler's logits
DEVICE_MARGIN_BYTES = 4 * 2**30


def device_budget(run: Run, engine_dtype_: torch.dtype) -> int | None:
    """GPU: the bytes left for the KV cache while the engine is awake, from the device's total memory (not its free
    memory, which depends on what else runs): minus what the trainer holds now (policy and reference), the AdamW
    moments its first step will add (unless offloaded), the engine's weights and ``DEVICE_MARGIN_BYTES``. None on
    CPU (the size is what the run needs)."""
    topo = run.topo
    if topo.device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(topo.device).total_memory
    params = list(run.actor.model.parameters())
    moments = 0 if run.cfg.actor.fsdp.optimizer_offload else budget.trained_bytes(run.actor.model)
    engine_weights = sum(p.numel() for p in params) * engine_dtype_.itemsize // topo.rollout_tp_size
    return total - torch.cuda.memory_allocated(topo.device) - moments - engine_weights - DEVICE_MARGIN_BYTES


def uses_vllm(cfg: Config) -> bool:
    """rollout.engine=vllm, or auto on a GPU machine with vllm installed."""
    return picks_vllm(cfg)


def finish(run: Run) -> None:
    """Export the final policy (a run that completed), close the logger, the scorer's workers and the engine. A run
    stopped for a reason of exits.STOPS exits 3; one stopped by a signal exits 0 after its checkpoint."""
    watchdog.stop()
    if not run.stopped:
        if run.lora is not None:  # the adapter (PEFT); a merged folder on request (python -m lib.export --merge)
            export.export_adapter(run.actor.model, run.cfg.actor.lora, run.cfg.actor.model.path,
                                      f"{run.path}/adapter_final", run.topo)
        else:
            export.export_hf(run.actor.model, run.cfg.actor.model.path, f"{run.path}/hf_final", run.topo,
                             run.cfg.actor.model.trust_remote_code, run.kind)
        run.logger.print(f"done: {run.path} (plots: python -m lib.plot {run.path})")
    run.logger.close()
    run.scorer.close()
    if run.multi_turn is not None:
        run.multi_turn.close()
    if run.env_server is not None:
        run.env_server.close()
    run.engine.close()  # vLLM tears its groups down (and the default one) now, not in an atexit hook
    if dist.is_initialized():
        dist.destroy_process_group()
    if run.stopped in exits.STOPS:
        exits.leave(exits.STOPPED)
