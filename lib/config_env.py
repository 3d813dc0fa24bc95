"""The config section of an environment from the ecosystem (``env``), re-exported by lib/config.py; ground like it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class EnvConfig:
    """An OpenEnv environment (or the verifiers environment each row names) plays every sample's episode (lib/envs):
    the model's turn is the action, the environment's observation the next message, its rewards the sample's. An episode that fails (reset or step raised,
    timed out, past the deadline, a reward that is not a number) is masked from the update and counted in env/*,
    never rewarded 0."""

    url: str = ""
    """An OpenEnv server's base URL, e.g. http://host:8000 (its /ws sessions, one per episode). "": none."""
    app: str = ""
    """An OpenEnv server the run starts, one per rank: its FastAPI app as ``package.module:app`` or
    ``path/to/server.py:app`` (served by uvicorn on a free local port). Not with url."""
    verifiers: bool = False
    """Play the turns of the verifiers environment each row names (rows made with --data.train_files
    verifiers:ENV_ID): its own Env.run drives the episode, the policy plays its one seat, the environment's rewards
    score it. No server; not with url or app."""
    action_field: str = "message"
    """The action's field that carries the model's turn (its text, the stop token left out)."""
    action_fields: str = ""
    """More action fields, fixed, as a JSON object (e.g. {"tool_name": "answer"})."""
    observation_field: str = ""
    """The observation's fields shown to the model, comma-separated (several: joined by a blank line). "": its only
    text field; an observation with several is shown as JSON."""
    observation_role: Literal["user", "tool"] = "user"
    """The chat role an observation is rendered with (tool: as multi-turn tool answers are)."""
    max_turns: int = 4
    """Actions per episode, at most."""
    max_tokens_per_turn: int = 0
    """Sampled tokens per turn, at most. 0: no cap below the episode's budget (rollout.max_response_length)."""
    max_sessions: int = 0
    """Episodes a rank plays at once, each holding a session on the server (its environment instance) from reset to
    end; more are played in waves. 0: all of the rank's at once. An OpenEnv server takes one session unless its app
    was made with max_concurrent_envs (and the environment declares SUPPORTS_CONCURRENT_SESSIONS): set this to that
    number (divided by the ranks that share the server)."""
    max_in_flight: int = 16
    """Environment requests in flight at once, per rank (episodes step concurrently)."""
    timeout_s: float = 60.0
    """One reset or step's time limit; past it the episode fails (a reset is retried first)."""
    deadline_s: float = 900.0
    """One rollout's environment time limit: an episode still waiting on its environment then fails."""
    max_retries: int = 3
    """Retries of an episode's connection and reset (a dropped connection, a refusal, a time-out); a step is never
    sent twice (an environment's step is not idempotent): a failed step fails its episode."""
    backoff_s: float = 0.5
    """The first retry's wait (doubled each time, times a random 0.5-1.5)."""
    weight: float = 1.0
    """The episode's return (the sum of its steps' rewards) times this, plus the rule / custom score times
    rule_weight, is the sample's reward."""
    rule_weight: float = 0.0
    """The rule / custom score's weight beside the environment's (0: the environment's alone; rows then need no
    scorer)."""
    max_failed_share: float = 0.5
    """A rollout whose failed episodes (over all ranks) are more than this share stops the run with the last error."""
