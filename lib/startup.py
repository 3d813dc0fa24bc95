"""Start-up and teardown of a run, shared by both scripts: everything that can fail on user input is checked
before any model loads (lib/inputs.py); then the models, the optimizer and the rollout engine (lib/engines.py) are
built into the ``Run`` the stages of the loop share (lib/run.py, with the batch keys each stage writes)."""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

from lib import budget, distill, episodes, exits, export, judges, lora, restarts, routing, selfcheck, stops, watchdog
from lib.config import Config, to_dict
from lib.dist import Topology, init_topology
from lib.engine.vllm import strip_expandable_segments
from lib.engines import DEVICE_MARGIN_BYTES, build_engine
from lib.envs import openenv
from lib.fsdp import build_sharded_model, fp32_compute, offload_model
from lib.inputs import CHECKED_ENV, check_inputs, resolve_generated, resolve_toy
from lib.models import UNFUSED_HEAD_ATTR
from lib.optim import build_optimizer
from lib.preflight import picks_vllm, resolve
from lib.rewards.scorer import RewardModel, Scorer
from lib.run import Run
from lib.runfolder import run_dir
from lib.runlog import RunLogger, TrackerFailed, excepthook_rank
from lib.update import Trainee


def start(cfg: Config, need_critic: bool = False) -> Run:
    """Process group, toy assets, config checks, run folder, data and logger: everything that can fail on user
    input, before any model is loaded."""
    stops.install()  # first: a stop signal from here on finishes the step in flight (and one kept from before)
    if picks_vllm(cfg):

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
    except Exception as e:  # noqa: BLE001 - the run cannot report, so it does not start (every rank stops together)
        failed = [str(e) if isinstance(e, TrackerFailed) else
                  f"the run's logs in {path} could not start ({type(e).__name__}: {str(e)[:300]})"]
    dist.broadcast_object_list(failed, src=0)  # only rank 0 starts the trackers; every rank stops together
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
                    (cfg.judge.rule_weight, cfg.judge.weight), episodes.weights(cfg))
    if inputs.judge is not None:
        if isinstance(inputs.judge, judges.LocalJudge):
            inputs.judge.start(topo.device, cfg.rollout.hf_batch_tokens, cfg.trainer.seed)
        logger.print(f"{inputs.judge.describe()}; reward = {cfg.judge.weight:g} x judge + {cfg.judge.rule_weight:g} x "
                     f"rule; unscored samples masked")
    tools = episodes.build(cfg, tokenizer, env_url, env_server is not None, logger.print)
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
        run.logger.print(f"done: {run.path} (samples and curves in the browser: python -m lib.view {run.path}; "
                         f"plots: python -m lib.plot {run.path})")
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
