"""The agents' rollout (issue 75): every sample's agent program plays its episode against this rank's endpoint while
the rank's main thread serves the engine; the episodes' calls become the rollout's rows (lib/agents/samples.py).

An agent is a function (``agent.entry``, run in a thread of its own; ``async def`` ones in an event loop of their
own) or a command (``agent.command``, a process with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` set and its row as JSON
on its standard input). At most ``agent.max_in_flight`` play at once; the next starts when one ends, decided on the
main thread between the endpoint's rounds, so that what each round holds depends on the agents alone, not on timing.

An episode fails, and is masked and counted by kind (``agent/failed_<kind>``), never rewarded 0: the agent raised
(``error``), passed ``agent.timeout_s`` (``timeout``), never called the endpoint (``no_calls``), sent a request the
endpoint refused (``refused``), or returned a reward that is not a number (``invalid``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lib.agents import check_command, load_agent, play, warm
from lib.agents.endpoint import Endpoint
from lib.agents.pool import AgentPool
from lib.agents.samples import Row, episode_rows
from lib.data import left_pad
from lib.engine import RolloutEngine, build_output, expand_samples, rollout_columns
from lib.multi_turn.loop import MultiTurn
from lib.protocol import DataProto
from lib.rewards import result_of

API_KEY = "spmd-rl"
"""What OPENAI_API_KEY holds for an agent (the endpoint takes any key)."""
FAILURES = ("error", "timeout", "no_calls", "refused", "invalid")
SUMMED = tuple(f"agent/failed_{k}" for k in FAILURES) + ("agent/episodes", "agent/masked", "agent/dropped_groups",
                                                          "agent/late_rounds")
"""The counts among the metrics (summed over ranks and rounds)."""


@dataclass
class Outcome:
    """How one episode's agent ended: its reward (None: left to the rule scorer), or why it failed."""

    value: float | None = None
    kind: str = ""
    message: str = ""


class AgentRollout:
    """The agents' rollout of one rank: the endpoint over its engine and the agent to run per sample."""

    def __init__(self, cfg: Any, tokenizer: Any, max_prompt: int, max_response: int, model_name: str = "policy"):
        """``cfg``: lib.config.AgentConfig."""
        self.cfg = cfg
        self.fn = load_agent(cfg.entry) if cfg.entry else None
        self.argv = check_command(cfg.command) if cfg.command else None
        self.endpoint = Endpoint(tokenizer, cfg.format, 1.0, 1.0, max_prompt, max_response, model_name)
        self.pool = AgentPool(cfg.entry, cfg.workers) if cfg.entry and cfg.workers else None
        if self.fn is not None and self.pool is None:
            warm()  # the SDK's first use, before the episodes' clocks start (a worker does its own)
        self.tokenizer = tokenizer
        self.rollouts = 0

    def close(self) -> None:
        self.endpoint.close()
        if self.pool is not None:
            self.pool.close()

    def rollout(self, engine: RolloutEngine, data: DataProto, validate: bool = False) -> DataProto:
        """Left-padded prompts -> n episodes a prompt, played by the agents -> their rows (lib.engine.build_output's
        fields; an episode's rows adjacent), per row ``solution_str`` (its episode's last reply), ``num_turns`` (its
        calls), ``env_score`` (the agent's reward or failure), ``episode``. Metrics in ``meta_info["multi_turn"]``."""
        sp = engine.val_sampling if validate else engine.sampling
        key = data.meta_info.get("seed_key", engine.calls[validate])
        data = expand_samples(data, sp.n)
        nt = data.non_tensor_batch
        self.rollouts += 1
        names = [f"{self.rollouts}-{i}" for i in range(len(data))]  # new names a rollout: late agents are refused
        self.endpoint.reset(sp.temperature, sp.top_p, names)
        t0 = time.perf_counter()
        play = Play(self, [MultiTurn.row(nt, i) for i in range(len(data))], names)
        self.endpoint.serve(engine, play.live, key, validate, self.cfg.round_wait_s)
        engine.calls[validate] += 1
        elapsed = time.perf_counter() - t0
        outcomes = [play.outcome(name) for name in names]
        return self._rows(data, names, outcomes, elapsed, play.own_s_max())

    def _rows(self, data: DataProto, names: list[str], outcomes: list[Outcome], elapsed: float,
              own_s_max: float) -> DataProto:
        ep = self.endpoint
        prompts, rows, owner, texts, turns, scores = [], [], [], [], [], []
        uids = data.non_tensor_batch.get("uid")
        ids, mask = data.batch["input_ids"].cpu(), data.batch["attention_mask"].cpu()
        split = continued = 0
        width = data.batch["input_ids"].shape[1]
        for i, (name, outcome) in enumerate(zip(names, outcomes)):
            calls = ep.calls.get(name, [])
            mine = episode_rows(calls)
            split += max(len(mine) - 1, 0)
            continued += max(len(calls) - 1, 0)
            if any(len(r.prompt) > width for r in mine):  # a split row whose prompt the rows cannot hold
                outcome = outcomes[i] = Outcome(kind="refused", message=(
                    "two of its calls continued the same history at once, and the second's row would start with a "
                    f"prompt over data.max_prompt_length={width}; send one call at a time on a history"))
                mine = []
            mine = mine or [Row(ids[i][mask[i].bool()].tolist())]  # no call: an empty row, masked
            for row in mine:
                prompts.append(row.prompt)
                rows.append(row)
                owner.append(i)
                texts.append(calls[-1].text if calls else "")
                turns.append(len(calls))
                scores.append((outcome.value, outcome.kind, outcome.message))
        p_ids, p_mask, p_pos = left_pad(prompts, width, self.tokenizer.pad_token_id)
        device = data.batch["input_ids"].device
        kept = [r.kept for r in rows]
        fields = build_output(p_ids.to(device), p_mask.to(device), p_pos.to(device), [r.response for r in rows],
                              [r.logps for r in rows], self.tokenizer.pad_token_id,
                              sampled_masks=[r.mask for r in rows], kept=kept if any(map(any, kept)) else None)
        obj = lambda v: np.array(list(v) + [None], dtype=object)[:-1]  # noqa: E731
        columns = {k: obj(v[j] for j in owner) for k, v in rollout_columns(data).items()}
        episode = [f"{uids[j] if uids is not None else ''}#{j}" for j in owner]
        non_tensor = dict(columns, solution_str=obj(texts), num_turns=obj(turns), env_score=obj(scores),
                          episode=obj(episode))
        n = max(len(names), 1)
        sampled = sum(sum(r.mask) for r in rows)
        metrics = {"agent/episodes": float(len(names)), "agent/rows_per_episode": len(rows) / n,
                   "agent/calls_mean": sum(len(ep.calls.get(name, [])) for name in names) / n,
                   "agent/split_calls": split / max(continued, 1),
                   "agent/rounds": float(len(ep.batches)), "agent/late_rounds": float(ep.late_rounds),
                   "agent/requests_per_round": float(np.mean(ep.batches)) if ep.batches else 0.0,
                   "agent/sampled_tokens_mean": sampled / n,
                   "timing/agent_rollout_s": elapsed, "timing/agent_engine_s": ep.engine_s,
                   # the time a call costs beyond the engine's: the agents' own work, HTTP, rendering, waiting
                   "perf/agent_overhead_ms_per_call": 1e3 * (elapsed - ep.engine_s) / max(sum(ep.batches), 1)}
        metrics["timing/agent_own_s_max"] = own_s_max
        metrics.update({f"agent/failed_{k}": float(sum(o.kind == k for o in outcomes)) for k in FAILURES})
        meta = {"generate_s": elapsed, "generated_tokens": sampled, "tokens_per_s": sampled / max(elapsed, 1e-9),
                "multi_turn": metrics}
        return DataProto.from_dict(fields, non_tensor, {**data.meta_info, **meta})


class _Placed:
    """An episode playing in a worker process (agent.workers), as ``live`` asks after a thread."""

    def __init__(self, pool: AgentPool, name: str):
        self.pool, self.name = pool, name

    def is_alive(self) -> bool:
        return self.pool.running(self.name)

    def since(self, started: float) -> float | None:
        """When its time limit's clock started: when its thread began in its worker (a worker's start-up, slow on a
        loaded machine, and the time the episode waited there for its thread are no episode's time); None before."""
        return self.pool.since(self.name)


class Play:
    """The episodes of one rollout: started in order as slots free (on the main thread, in ``live``), each in a
    thread of its own or of a worker process (agent.workers), ended by its agent's return or its time limit."""

    def __init__(self, rollout: AgentRollout, rows: list[dict], names: list[str]):
        self.rollout, self.rows, self.names = rollout, rows, names
        self.limit = rollout.cfg.max_in_flight or len(names)
        self.started = 0
        self.running: dict[int, tuple[threading.Thread | _Placed, float]] = {}  # and when each started
        self.outcomes: dict[str, Outcome] = {}
        self.ran: dict[str, float | None] = {}  # the seconds each agent ran (its end noticed later, between rounds)
        self.procs: dict[int, subprocess.Popen] = {}
        self.index = set(names)

    def live(self) -> list[str]:
        """The episodes whose agents run, in order, after ending those past their time limit (the time their
        requests waited for the endpoint not counted: a round waits for every running episode) and starting the next
        ones where slots are free."""
        now = time.monotonic()
        r = self.rollout
        ep = r.endpoint
        if r.pool is not None:
            for name, kind, out, ran in r.pool.ended():
                if name in self.index:  # not one an earlier rollout left past its time limit
                    self.ran[name] = ran
                    self.outcomes.setdefault(name, Outcome(kind=kind, message=out) if kind else _outcome(out))
        for i, (thread, started) in list(self.running.items()):
            name = self.names[i]
            waited = ep.waited.get(name, 0.0) + (now - ep.asking[name] if name in ep.asking else 0.0)
            since = thread.since(started) if isinstance(thread, _Placed) else started
            if not thread.is_alive():
                del self.running[i]
            elif since is not None and now > since + r.cfg.timeout_s + waited:
                del self.running[i]
                self.outcomes.setdefault(name, Outcome(kind="timeout", message=(
                    f"the agent ran past agent.timeout_s={self.rollout.cfg.timeout_s:g}")))
                ep.end(name)
                if i in self.procs:  # a command is killed, with what it started; a function's thread cannot be
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.procs[i].pid, signal.SIGKILL)
        while len(self.running) < self.limit and self.started < len(self.names):
            i = self.started
            self.started += 1
            if r.pool is not None:
                name = self.names[i]
                r.pool.start(name, self.rows[i], ep.base_url(name))
                self.running[i] = (_Placed(r.pool, name), now)
                continue
            thread = threading.Thread(target=self._play, args=(i,), daemon=True, name=f"agent-{i}")
            self.running[i] = (thread, now)
            thread.start()
        return [self.names[i] for i in sorted(self.running)]

    def _play(self, i: int) -> None:
        name, r = self.names[i], self.rollout
        url = r.endpoint.base_url(name)
        agent = r.fn or (lambda row, url: run_command(r.argv, row, url, lambda p: self.procs.__setitem__(i, p)))
        began = time.monotonic()
        kind, out = play(agent, self.rows[i], url)
        self.ran[name] = time.monotonic() - began
        self.outcomes.setdefault(name, Outcome(kind=kind, message=out) if kind else _outcome(out))

    def own_s_max(self) -> float:
        """The most own time, as agent.timeout_s counts it, of the agents that ended within it: how near the limit
        they came."""
        waited = self.rollout.endpoint.waited
        return max([0.0] + [ran - waited.get(name, 0.0) for name, ran in list(self.ran.items())  # threads still add
                            if ran is not None and self.outcomes.get(name, Outcome()).kind != "timeout"])

    def outcome(self, name: str) -> Outcome:
        """The episode's outcome once every agent ended: a refused request (what an agent that raised was most
        likely told) or no call fails it too."""
        ep = self.rollout.endpoint
        got = self.outcomes.get(name, Outcome(kind="error", message="the agent did not end"))
        if got.kind == "timeout":
            return got
        if ep.refused.get(name):
            return Outcome(kind="refused", message=f"the endpoint refused a request ({ep.refused[name][0]})")
        if got.kind:
            return got
        if not ep.calls.get(name):
            return Outcome(kind="no_calls", message="the agent never called the endpoint")
        return got


def _outcome(out: Any) -> Outcome:
    """An agent's return value: None (the rule scorer's), or a reward like a custom reward's."""
    if out is None:
        return Outcome()
    score, _, _, kind, message = result_of(out)
    if kind:
        return Outcome(kind="invalid", message=message.replace("the scorer", "the agent"))
    return Outcome(score)


def run_command(argv: list[str], row: dict, url: str, started: Any) -> Any:
    """One episode's agent command: the row as JSON on its standard input, the endpoint in its environment; its
    last printed line, if JSON, is its return. A non-zero exit raises with its last words. ``started(process)``:
    told the process (its time limit kills it)."""
    env = dict(os.environ, OPENAI_BASE_URL=url, OPENAI_API_KEY=API_KEY)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    started(proc)
    out, err = proc.communicate(json.dumps(row, default=_plain))
    if proc.returncode:
        raise RuntimeError(f"the command exited {proc.returncode}: {(err or out).strip()[-300:]}")
    lines = [line for line in out.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        return json.loads(lines[-1])
    except ValueError:
        return None


def _plain(value: Any) -> Any:
    """JSON for a row's numpy values."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return str(value)


def build(cfg: Any, tokenizer: Any) -> AgentRollout:
    """The rank's agent rollout from the whole Config."""
    return AgentRollout(cfg.agent, tokenizer, cfg.data.max_prompt_length, cfg.rollout.max_response_length,
                        os.path.basename(cfg.actor.model.path.rstrip("/")) or "policy")

