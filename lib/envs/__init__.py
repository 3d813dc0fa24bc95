"""Environments and task libraries from the ecosystem, trained in the same SPMD loop (no controller: each rank runs
its own samples' episodes, as it runs their tool calls).

- ``openenv.py``: an OpenEnv server's sessions (``--env.url``), or a server the run starts on each rank
  (``--env.app``);
- ``loop.py``: the rollout against it, one episode per sample, token in, token out; failures masked, never scored 0;
- ``reasoning_gym.py``: reasoning-gym's procedural tasks as prompt data (``--data.train_files reasoning_gym:TASK``),
  scored by the library's own answer check (lib/rewards/reasoning_gym.py);
- ``verifiers_data.py``: a verifiers 0.4 environment's tasks as prompt data (``verifiers:ENV_ID``), scored by its own
  rewards (lib/rewards/verifiers_score.py);
- ``verifiers_play.py``: a verifiers environment's own turns (``--env.verifiers``), played by the policy in the
  same loop;
- ``serve.py``: the child process that serves an ``env.app``.
"""

from __future__ import annotations

import json
from typing import Any

from lib.envs.openenv import INSTALL, websockets_client, ws_url


def enabled(cfg: Any) -> bool:
    """``cfg``: the whole Config."""
    return bool(cfg.env.url or cfg.env.app or cfg.env.verifiers)


def scored_episode_problems(prefix: str, section: Any, positive: tuple[str, ...]) -> list[str]:
    """The settings an environment's and an agent's sections share: time limits (``positive``), the failed share
    that stops a run, the weights of the episode's reward and the rule's."""
    problems = [f"{prefix}.{name}={getattr(section, name)} must be > 0" for name in positive
                if getattr(section, name) <= 0]
    if not 0 <= section.max_failed_share <= 1:
        problems.append(f"{prefix}.max_failed_share={section.max_failed_share} must be between 0 and 1")
    problems += [f"{prefix}.{name}={getattr(section, name)} is negative: that trains the policy against that score"
                 for name in ("weight", "rule_weight") if getattr(section, name) < 0]
    return problems


def config_problems(cfg: Any) -> list[str]:
    """What keeps the env section's values from running (each naming the fix); nothing when it is off."""
    e = cfg.env
    if not enabled(cfg):
        return []
    problems = []
    if e.url and e.app:
        problems.append(f"env.url={e.url!r} and env.app={e.app!r} both name an environment server; keep one (url: a "
                        f"server that runs, app: one the run starts on each rank)")
    if e.verifiers and (e.url or e.app):
        problems.append("env.verifiers plays the verifiers environment each row names, in process; it takes no "
                        "env.url or env.app: drop them")
    if e.url:
        try:
            ws_url(e.url)
        except ValueError as err:
            problems.append(str(err))
    if cfg.multi_turn.tools:
        problems.append("env and multi_turn.tools both drive the turns of an episode; keep one (an environment with "
                        "tools serves them itself)")
    for name, low in (("max_turns", 1), ("max_in_flight", 1), ("max_retries", 0), ("max_tokens_per_turn", 0),
                      ("max_sessions", 0)):
        if getattr(e, name) < low:
            problems.append(f"env.{name}={getattr(e, name)} must be >= {low}")
    problems += scored_episode_problems("env", e, ("timeout_s", "deadline_s"))
    if e.backoff_s < 0:
        problems.append(f"env.backoff_s={e.backoff_s} must be >= 0")
    if e.action_fields:
        try:
            fixed = json.loads(e.action_fields)
        except ValueError:
            fixed = None
        if not isinstance(fixed, dict):
            problems.append(f"env.action_fields={e.action_fields!r} must be a JSON object, e.g. "
                            f"'{{\"tool_name\": \"answer\"}}'")
    if not cfg.data.apply_chat_template:
        problems.append("an environment's observations are rendered with the chat template: turn "
                        "data.apply_chat_template on")
    try:
        if not e.verifiers:
            websockets_client()
    except ValueError:
        problems.append(f"env.url / env.app need the websockets package, which is not installed: {INSTALL}")
    return problems
