"""``Run``: what the stages of the loop share, made by lib/startup.py.

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

from dataclasses import dataclass, field
from typing import Any

import torch

from lib.agents.runner import AgentRollout
from lib.config import Config
from lib.data import PromptSet, Sampler
from lib.dist import Topology
from lib.engine import RolloutEngine
from lib.envs import openenv
from lib.envs.loop import EnvRollout
from lib.logprobs import Truncation
from lib.multi_turn.loop import MultiTurn
from lib.preflight import Sizes
from lib.rewards.scorer import Scorer
from lib.runlog import RunLogger
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
    multi_turn: MultiTurn | EnvRollout | AgentRollout | None = None
    """Multi-turn rollouts (lib/episodes.py): with tools (lib/multi_turn), an environment's episodes (lib/envs), or
    the user's agents' (lib/agents). None: one turn."""
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
