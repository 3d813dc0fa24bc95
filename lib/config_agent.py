"""The config section of agents that speak the OpenAI API (``agent``), re-exported by lib/config.py; ground like it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AgentConfig:
    """An agent program plays every sample's episode against an OpenAI-compatible endpoint that this rank serves
    from its rollout engine (lib/agents): every token it is sent and samples is kept, and the episode's calls become
    the sample's training rows. An episode that fails (the agent raised, timed out, never called the endpoint, sent
    a request the endpoint refused, returned a reward that is not a number) is masked from the update and counted in
    agent/*, never rewarded 0."""

    entry: str = ""
    """The agent as a function, ``path/to/file.py:name`` or ``package.module:name``: called once per sample as
    ``name(row, base_url)`` (plain or ``async def``), ``row`` the data row (prompt messages, data_source,
    ground_truth, extra_info, other columns), ``base_url`` the episode's OpenAI base URL. Returns the episode's
    reward (a number, or a dict like a custom reward's), or None to leave it to the rule scorer. "": none."""
    command: str = ""
    """The agent as a command line, run once per sample with OPENAI_BASE_URL and OPENAI_API_KEY set and the row as
    JSON on its standard input; the last line it prints, if JSON (a number or a dict), is the reward. Not with
    entry."""
    timeout_s: float = 300.0
    """One episode's time limit, from when its agent starts (in a worker: when the worker begins it), the time its
    requests wait for the endpoint's answers not counted (a round waits for every running episode); past it the
    episode fails (a command is killed; a function's thread cannot be, and its later requests are refused).
    timing/agent_own_s_max: how near it the agents that ended came."""
    max_in_flight: int = 0
    """Episodes a rank plays at once; the next starts when one ends. 0: all of the rank's at once. Keep it within
    what the agent program lets run at once (an HTTP client's connection cap, a semaphore)."""
    workers: int = 0
    """Worker processes a rank runs agent.entry's functions in, each playing many episodes at once (a thread each;
    episodes go to the workers in turn): the agents' own Python (their SDK's requests and replies) then runs beside
    the rank's, which serves the endpoint and drives the engine. 0: threads of the rank's own process. A command
    runs as a process of its own already. An agent that ends its process (os._exit, a crash) fails the episodes its
    worker was playing; a fresh worker takes over."""
    round_wait_s: float = 5.0
    """The endpoint answers in rounds: once every running episode has a request waiting, all of them in one engine
    call, so that the samples do not depend on timing. Once no request has come for this long (counted from the
    latest, so agents still sending are waited for), an episode that has not asked (its agent is busy elsewhere, or
    held back by its own concurrency cap) is left out of the round: the run goes on, and the batching depends on
    timing from then on (counted in agent/late_rounds)."""
    format: str = "hermes"
    """How tool calls are read out of the model's text into the replies' ``tool_calls`` (lib/multi_turn/parsers)."""
    weight: float = 1.0
    """The agent's reward times this, plus the rule / custom score times rule_weight, is the sample's reward."""
    rule_weight: float = 0.0
    """The rule / custom score's weight beside the agent's (0: the agent's alone). An agent that returns None is
    scored by the rule scorer alone."""
    max_failed_share: float = 0.5
    """A rollout whose failed episodes (over all ranks) are more than this share stops the run with the last error."""
