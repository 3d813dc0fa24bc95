"""Every check of user input, before any model loads: config values and size relations, model, critic, reward-model,
teacher, data and custom-reward paths, the run folder, the data rows, the modes image prompts cannot take yet; and
the names that stand for built assets (the embedded toy tasks, a task library's or an environment's rows). lib/check.py
runs them in one process before torchrun starts the ranks; each rank runs them again (lib/startup.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lib import agents, distill, envs, judges, multi_turn, toy
from lib.config import Config, to_dict
from lib.data import PromptSet, Sampler, expand_files, load_prompts
from lib.dist import Topology
from lib.envs import openenv, verifiers_play
from lib.envs import reasoning_gym as rg_data
from lib.envs import verifiers_data as vf_data
from lib.judges import toy as judge_toy
from lib.models import load_config, load_tokenizer
from lib.multi_turn.render import ObservationRenderer
from lib.multi_turn.tools import is_environment, load_tools, schemas
from lib.preflight import Sizes, picks_vllm, validate
from lib.rewards import RULE_SOURCES, check_truth_source, load_custom
from lib.runfolder import check_run_folder
from lib.vision import FAMILIES, family, has_vision
from lib.vision import problem as vision_problem
from lib.vision import toy as vision_toy
from lib.vision import vllm_problem as vision_vllm_problem
from lib.vision.processor import VisionProcessor


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
    if agents.enabled(cfg):
        agents.load_agent(cfg.agent.entry) if cfg.agent.entry else agents.check_command(cfg.agent.command)
        ObservationRenderer(tokenizer)  # a template that cannot render tool messages is refused here
    # an RM, a judge, an environment or an agent alone scores any row; pure distillation's rows need no reward function
    any_row = cfg.reward.custom_fn or cfg.reward.reward_model or (judge is not None and not cfg.judge.rule_weight) \
        or (envs.enabled(cfg) and not cfg.env.rule_weight) or agents.enabled(cfg)
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
        if envs.enabled(cfg) or agents.enabled(cfg):
            what = "an agent's" if agents.enabled(cfg) else "an environment's"
            raise ValueError(f"{what} episodes with image prompts are not built yet: train on text rows, or without "
                             f"{'agent' if agents.enabled(cfg) else 'env'}")
        check_vision_modes(cfg, train, val, need_critic)
    elif has_vision(model_config) and picks_vllm(cfg):
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
    if picks_vllm(cfg) and (problem := vision_vllm_problem()):
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
