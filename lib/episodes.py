"""How a run's rollouts play their episodes, from the config: one turn (None), the policy calling tools
(lib/multi_turn), an environment's turns (lib/envs), or the user's agent program against the rank's endpoint
(lib/agents). Each kind has ``rollout(engine, prompts, validate)`` and ``close()``."""

from __future__ import annotations

from typing import Any, Callable

from lib import agents, envs, multi_turn
from lib.agents.runner import AgentRollout
from lib.agents.runner import build as build_agents
from lib.config import Config
from lib.envs import verifiers_play
from lib.envs.loop import EnvRollout
from lib.multi_turn.loop import MultiTurn


def build(cfg: Config, tokenizer: Any, env_url: str, env_started: bool, say: Callable[[str], None]
          ) -> MultiTurn | EnvRollout | AgentRollout | None:
    """The rank's episodes' player (None: single-turn rollouts); ``env_url``: the environment server's, if any
    (``env_started``: this rank started it); ``say``: the run's log line."""
    e, r = cfg.env, cfg.rollout
    if agents.enabled(cfg):
        player = build_agents(cfg, tokenizer)
        a = cfg.agent
        say(f"agents: {a.entry or a.command} plays each sample's episode against an OpenAI endpoint on "
            f"{player.endpoint.url} (this rank's engine); {a.max_in_flight or 'all'} episodes at once a rank, "
            f"{a.timeout_s:g} s each; reward = {a.weight:g} x the agent's + {a.rule_weight:g} x rule (the rule "
            f"alone where the agent returns none); failed episodes masked")
        return player
    if cfg.env.verifiers:
        bridge = verifiers_play.Bridge()
        say(f"environment: each row's verifiers environment plays its turns in process; {e.max_in_flight} turns in "
            f"flight a rank; reward = {e.weight:g} x its reward + {e.rule_weight:g} x rule; failed episodes masked")
        return EnvRollout(e, "", tokenizer, r.max_response_length, cfg.data.max_prompt_length,
                          connect=lambda: verifiers_play.VerifiersSession(bridge, e.timeout_s, e.action_field))
    if env_url:
        say(f"environment: OpenEnv at {env_url}{' (started by each rank: ' + e.app + ')' if env_started else ''}; "
            f"{e.max_in_flight} requests in flight a rank; reward = {e.weight:g} x return + {e.rule_weight:g} x rule; "
            f"failed episodes masked")
        return EnvRollout(e, env_url, tokenizer, r.max_response_length, cfg.data.max_prompt_length)
    if multi_turn.enabled(cfg):
        return MultiTurn(cfg.multi_turn, tokenizer, r.max_response_length)
    return None


def weights(cfg: Config) -> tuple[float, float] | None:
    """(rule, episode) weights of the rows whose episodes score themselves (an environment's return, an agent's
    reward); None where none do."""
    if agents.enabled(cfg):
        return cfg.agent.rule_weight, cfg.agent.weight
    if envs.enabled(cfg):
        return cfg.env.rule_weight, cfg.env.weight
    return None
