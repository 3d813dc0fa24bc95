"""The rollout against an OpenEnv environment: every sample is one episode, on this rank, in the same turn-by-turn
loop as multi-turn tools (one batched generate per turn over the rank's active episodes), token in, token out.

An episode: a session on the server (a connection with its own environment instance, kept open after the episode
for a later one, whose reset starts it anew), reset with the row's ``extra_info.env_reset`` (a dict of the environment's
reset arguments; ``seed`` defaults to the row's ``extra_info.index`` where the row has one), so the n samples of a
prompt play the same task. A non-empty reset observation ends the prompt as a user message (the prompt is the row's
messages and it, rendered again with the chat template). Each turn's text (its stop token left out) is the action's
``env.action_field``; the step's observation, rendered with the chat template as the next message (role
``env.observation_role``; ``response_mask`` 0), follows the turn, until the environment says done, ``env.max_turns``
actions, a turn cut by its cap (``env.max_tokens_per_turn``, or the budget; the cut turn is still the action), or the
token budget (``rollout.max_response_length``): an observation that would leave no room for one more sampled token
ends the episode there (finish ``budget``, counted in env/observation_too_long). So a one-step environment judges a
response cut at the length limit as single-turn scoring does. The episode's return,
the sum of its steps' rewards, is the sample's score.

Episodes step concurrently (``env.max_in_flight`` requests at once, each under ``env.timeout_s``; connection and
reset retried ``env.max_retries`` times with backoff; the whole rollout's environment time under
``env.deadline_s``). An episode that fails (connection, reset or step refused or raised, time-out, deadline, a reward
that is not a finite number) is masked from the update and counted by kind, never rewarded 0 (lib/scoring.py). An
episode in flight when a run stops is redone on resume: a step's episodes live within the step.
"""

from __future__ import annotations

import json
import math
import numbers
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from lib.config_env import EnvConfig
from lib.data import left_pad
from lib.engine import RolloutEngine, build_output, expand_samples, rollout_columns
from lib.envs.openenv import EnvFailure, Result, Session, ws_url
from lib.multi_turn.loop import Episode
from lib.multi_turn.render import ObservationRenderer, tool_message
from lib.protocol import DataProto

FAILURES = ("connect", "capacity", "reset", "step", "timeout", "deadline", "reward", "observation")
"""How an episode can fail: no connection; the server's sessions were full (after the retries); its reset or step
raised on the server; a reset or step took over env.timeout_s; the rollout's deadline passed while it waited; a reward
that is not a finite number; an observation without the field env.observation_field names."""
FINISH = ("done", "max_turns", "length", "budget", "failed")
"""How an episode ends: the environment said done; env.max_turns actions; a turn cut by env.max_tokens_per_turn (sent
as it is); the token budget (a turn cut by it, or an observation that does not fit); a failure."""
SUMMED = tuple(f"env/failed_{k}" for k in FAILURES) + ("env/episodes", "env/observation_too_long")
"""The counts among the metrics (summed over ranks and rounds)."""


@dataclass
class Play:
    """What the loop keeps of one episode beside its tokens."""

    reset: dict
    session: Session | None = None
    first: Result | None = None  # the reset's answer
    rewards: list[float] = field(default_factory=list)
    failure: tuple[str, str] | None = None
    done: bool = False


def observation_text(observation: dict, names: str) -> str:
    """The text shown of an observation: the fields ``names`` (comma-separated; several joined by a blank line);
    "": its only text field, or all of it as JSON."""
    if names:
        parts = []
        for name in names.split(","):
            if name not in observation:
                raise EnvFailure("observation", f"the observation has no field {name!r} (env.observation_field); it "
                                                f"has {sorted(observation)}")
            value = observation[name]
            parts.append(value if isinstance(value, str) else json.dumps(value))
        return "\n\n".join(p for p in parts if p)
    texts = [v for v in observation.values() if isinstance(v, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(observation) if observation else ""


def reward_value(reward: Any) -> float:
    if reward is None:
        return 0.0
    if isinstance(reward, numbers.Real) and math.isfinite(reward):
        return float(reward)
    raise EnvFailure("reward", f"the environment gave a reward of {reward!r}, not a finite number")


class EnvRollout:
    """The environment rollout of one rank: the server's address, the renderer, the limits."""

    def __init__(self, cfg: EnvConfig, url: str, tokenizer: Any, max_response_length: int, prompt_width: int,
                 connect: Callable[[], Any] | None = None):
        """``connect``: a new session (default: a connection to the OpenEnv server at ``url``)."""
        self.cfg, self.tokenizer = cfg, tokenizer
        self.url = ws_url(url) if url else ""
        self.connect = connect or (lambda: Session(self.url, cfg.timeout_s))
        self.budget = max_response_length
        self.width = prompt_width
        self.renderer = ObservationRenderer(tokenizer, role=cfg.observation_role)
        self.fixed = json.loads(cfg.action_fields) if cfg.action_fields else {}
        self.idle: list[Session] = []  # open sessions between episodes: the next episode resets one
        self.lock = threading.Lock()

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for session in idle:
            session.close()

    def _take(self) -> Session | None:
        with self.lock:
            return self.idle.pop() if self.idle else None

    # ---- one rollout

    def rollout(self, engine: RolloutEngine, data: DataProto, validate: bool = False) -> DataProto:
        """Left-padded prompts -> the rollout fields of lib.engine.build_output, n episodes per prompt, and per row
        ``solution_str`` (the last turn's text), ``num_turns`` and ``env_score`` ((return, failure kind or "",
        message)). Metrics in ``meta_info["multi_turn"]``."""
        sp = engine.val_sampling if validate else engine.sampling
        key = data.meta_info.get("seed_key", engine.calls[validate])
        data = expand_samples(data, sp.n)
        nt, n = data.non_tensor_batch, len(data)
        ids, mask = data.batch["input_ids"].cpu(), data.batch["attention_mask"].cpu()
        episodes = [Episode(i, ids[i][mask[i].bool()].tolist(), None, None) for i in range(n)]
        plays = [Play(self._reset_args(nt, i, self.cfg.verifiers)) for i in range(n)]
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.cfg.deadline_s
        tally = {"too_long": 0, "env_s": 0.0, "gen_s": 0.0, "sampled": 0, "turn_rows": [], "prompts_changed": False}
        size = self.cfg.max_sessions or n
        waves = [list(range(start, min(n, start + size))) for start in range(0, n, size)]
        pool = ThreadPoolExecutor(self.cfg.max_in_flight, thread_name_prefix="env")
        try:
            for w, wave in enumerate(waves):  # one wave: a single one keeps the turns' sampling keys (key, turn)
                wave_key = key if len(waves) == 1 else (key, "wave", w)
                self._play([episodes[i] for i in wave], plays, nt, engine, validate, wave_key, pool, deadline, tally)
        finally:
            pool.shutdown(wait=False)  # the failed sessions' closes, queued by _play, still run
        env_s, gen_s, sampled, turn_rows = tally["env_s"], tally["gen_s"], tally["sampled"], tally["turn_rows"]
        prompts_changed = tally["prompts_changed"]
        for e, p in zip(episodes, plays):
            e.finish = "failed" if p.failure is not None else (e.finish or "max_turns")
            e.check_inputs("environment rollout")
        engine.calls[validate] += 1
        if prompts_changed:
            prompt_ids, prompt_mask, prompt_pos = left_pad([e.prompt for e in episodes], self.width,
                                                           self.tokenizer.pad_token_id)
        else:
            prompt_ids, prompt_mask, prompt_pos = ids, mask, data.batch["position_ids"].cpu()
        fields = build_output(prompt_ids, prompt_mask, prompt_pos, [e.response for e in episodes],
                              [e.logps for e in episodes], self.tokenizer.pad_token_id,
                              sampled_masks=[e.mask for e in episodes],
                              kept=[e.kept for e in episodes] if any(map(any, (e.kept for e in episodes))) else None)
        obj = lambda v: np.array(v + [None], dtype=object)[:-1]  # noqa: E731
        scores = [(sum(p.rewards), *(p.failure or ("", ""))) for p in plays]
        non_tensor = dict(rollout_columns(data),
                          solution_str=obj(self.tokenizer.batch_decode([e.last_turn for e in episodes],
                                                                       skip_special_tokens=True)),
                          num_turns=obj([e.turns for e in episodes]), env_score=obj(scores))
        elapsed = time.perf_counter() - t0
        metrics = self._metrics(episodes, plays, tally, sampled, turn_rows)
        metrics.update({"timing/env_generate_s": gen_s, "timing/env_wait_s": env_s,
                        "perf/env_episodes_per_s": n / max(elapsed, 1e-9)})
        meta = {"generate_s": elapsed, "generated_tokens": sampled, "tokens_per_s": sampled / max(elapsed, 1e-9),
                "multi_turn": metrics}
        return DataProto.from_dict(fields, non_tensor, {**data.meta_info, **meta})

    def _play(self, episodes: list[Episode], plays: list[Play], nt: dict, engine: RolloutEngine, validate: bool,
              key: Any, pool: ThreadPoolExecutor, deadline: float, tally: dict) -> None:
        """One wave of episodes, start to end: their sessions and resets, then one batched generate per turn over the
        active ones and their steps. Their sessions are then idle for the next wave (a failed one's closed)."""
        mine = [e.index for e in episodes]
        try:
            t_env = time.perf_counter()
            self._each(pool, deadline, plays, mine, lambda i: self._open(plays[i]))
            tally["env_s"] += time.perf_counter() - t_env
            for e in episodes:
                if plays[e.index].failure is None:
                    tally["prompts_changed"] |= self._prompt(e, plays[e.index], nt, e.index)
            for turn in range(self.cfg.max_turns):
                active = [e for e in episodes if not e.finish and plays[e.index].failure is None]
                if not engine.any_active(bool(active)):  # a vLLM TP group goes on while any of its ranks has episodes
                    break
                caps = [min(self.cfg.max_tokens_per_turn or self.budget, self.budget - len(e.response)) for e in active]
                inputs = [e.prompt + e.response for e in active]
                t_gen = time.perf_counter()
                outs = engine.generate_ids(inputs, caps, validate, (key, turn))
                tally["gen_s"] += time.perf_counter() - t_gen
                tally["turn_rows"].append(len(active))
                actions, last = {}, {}
                for e, ids_in, out in zip(active, inputs, outs):
                    e.inputs.append(ids_in)
                    tally["sampled"] += len(out.ids)
                    e.sampled(out.ids, out.logps, out.kept)
                    e.turns += 1
                    e.last_turn = out.ids
                    actions[e.index] = self._action(out)
                    # the loop's last turn of this episode, whatever the environment answers
                    last[e.index] = e.turns >= self.cfg.max_turns or not out.stopped or len(e.response) >= self.budget
                t_env = time.perf_counter()
                results = self._each(pool, deadline, plays, list(actions),
                                     lambda i: plays[i].session.send("step", actions[i], last[i]))
                for e, out in zip(active, outs):
                    self._after_step(e, plays[e.index], results.get(e.index), out, tally)
                # an environment that scores at its end (verifiers) is ended where the loop ended the episode on an
                # observation that does not fit
                ended = [e.index for e in active if e.finish == "budget" and not last[e.index]
                         and plays[e.index].failure is None and plays[e.index].session.concludes]
                for i, result in self._each(pool, deadline, plays, ended,
                                            lambda i: plays[i].session.send("end", {})).items():
                    try:
                        plays[i].rewards.append(reward_value(result.reward))
                    except EnvFailure as err:
                        plays[i].failure = (err.kind, str(err))
                tally["env_s"] += time.perf_counter() - t_env
        finally:
            # a played episode's session serves the next one (a reset starts it anew); a failed one's is closed
            for i in mine:
                p = plays[i]
                if p.session is not None and p.failure is None:
                    with self.lock:
                        self.idle.append(p.session)
                elif p.session is not None:
                    pool.submit(p.session.close)
                p.session = None

    # ---- the pieces

    @staticmethod
    def _reset_args(nt: dict, i: int, verifiers: bool = False) -> dict:
        extra = nt["extra_info"][i] if "extra_info" in nt else None
        extra = extra if isinstance(extra, dict) else {}
        if verifiers:  # the task the row names (lib/envs/verifiers_data.py)
            return dict(extra.get("verifiers") or {})
        args = dict(extra.get("env_reset") or {})
        if "seed" not in args and isinstance(extra.get("index"), int):
            args["seed"] = extra["index"]
        return args

    def _each(self, pool: ThreadPoolExecutor, deadline: float, plays: list[Play], which: Any,
              fn: Callable[[int], Any]) -> dict[int, Any]:
        """``fn(i)`` for every episode ``i`` of ``which`` in the pool; a failure is that episode's (recorded in its
        play), an episode still waiting at the deadline fails with kind deadline."""
        futures = {pool.submit(fn, i): i for i in which}
        done, pending = wait(futures, timeout=max(0.0, deadline - time.monotonic()), return_when="ALL_COMPLETED")
        results = {}
        for f in done:
            i = futures[f]
            try:
                results[i] = f.result()
            except EnvFailure as err:
                plays[i].failure = plays[i].failure or (err.kind, str(err))
        for f in pending:
            f.cancel()
            i = futures[f]
            plays[i].failure = plays[i].failure or ("deadline", f"the rollout's environment deadline "
                                                                 f"(env.deadline_s={self.cfg.deadline_s:g}) passed")
        return results

    def _open(self, play: Play) -> None:
        """A session (an idle one, else a new connection) and its reset: a connection, a refusal for capacity or a
        time-out retried with backoff; an idle session the server dropped is replaced, not counted as a try."""
        c = self.cfg
        attempt = 0
        while True:
            session = self._take()
            idle = session is not None
            try:
                session = session or self.connect()
                first = session.send("reset", play.reset)
            except EnvFailure as err:
                if session is not None:
                    session.close()
                if idle and err.kind == "connect":
                    continue
                if err.kind in ("connect", "capacity", "timeout") and attempt < c.max_retries:
                    attempt += 1
                    time.sleep(c.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))
                    continue
                raise
            play.session, play.first, play.done = session, first, first.done
            if play.failure is not None:  # the deadline passed while it connected: nobody steps it
                session.close()
            play.rewards.append(reward_value(first.reward))
            return

    def _prompt(self, e: Episode, play: Play, nt: dict, i: int) -> bool:
        """The reset observation, if it shows anything, ends the prompt as a user message; whether the prompt
        changed. A prompt then longer than data.max_prompt_length fails the episode (kind observation)."""
        try:
            shown = self._messages(play.first)
        except EnvFailure as err:
            play.failure = (err.kind, str(err))
            return False
        if play.done:
            e.finish = "done"  # the environment ended the episode at its reset: nothing to play
        if not any(m["content"] for m in shown):
            return False
        messages = list(nt["messages"][i]) if "messages" in nt and nt["messages"][i] is not None else []
        rendered = self.tokenizer.apply_chat_template(messages + shown, add_generation_prompt=True, tokenize=False)
        prompt = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        if len(prompt) > self.width:
            play.failure = ("observation", f"the reset observation makes a prompt of {len(prompt)} tokens, over "
                                           f"data.max_prompt_length={self.width}")
            return False
        e.prompt = prompt
        return True

    def _messages(self, result: Result) -> list[dict]:
        """What an answer shows as chat messages: its own (a verifiers turn's), else the observation's text as one
        message of env.observation_role."""
        if result.messages is not None:
            return list(result.messages)
        text = observation_text(result.observation, self.cfg.observation_field)
        return [tool_message("environment", text) if self.cfg.observation_role == "tool" else
                {"role": "user", "content": text}]

    def _action(self, out: Any) -> dict:
        text = self.tokenizer.decode(out.ids, skip_special_tokens=False)
        if out.stopped:
            stop_text = self.tokenizer.decode(out.ids[-1:], skip_special_tokens=False)
            if stop_text and text.endswith(stop_text):
                text = text[:-len(stop_text)]
        return {**self.fixed, self.cfg.action_field: text}

    def _after_step(self, e: Episode, play: Play, result: Result | None, out: Any, tally: dict) -> None:
        """Take a step's answer: the reward, then the episode ends (done, max_turns, budget) or goes on with the
        observation rendered after the turn. An environment that ended because the loop ended its exchange
        (``result.cut``, verifiers) finishes for the loop's reason."""
        if play.failure is not None or result is None:
            return
        try:
            play.rewards.append(reward_value(result.reward))
            shown = self._messages(result) if not result.done else []
        except EnvFailure as err:
            play.failure = (err.kind, str(err))
            return
        if result.done and not result.cut:
            e.finish = "done"
            return
        if e.turns >= self.cfg.max_turns:
            e.finish = "max_turns"
            return
        if not out.stopped:  # cut by its cap: the environment judged it as it is, and the episode ends there
            e.finish = "budget" if len(e.response) >= self.budget else "length"
            return
        stop_text = self.tokenizer.decode(out.ids[-1:], skip_special_tokens=False)
        obs_ids = self.renderer.observation_ids(shown, stop_text)
        if len(e.response) + len(obs_ids) >= self.budget:
            e.finish = "budget"
            tally["too_long"] += 1
        else:
            e.observed(obs_ids)

    @staticmethod
    def _metrics(episodes: list[Episode], plays: list[Play], counts: dict, sampled: int, turn_rows: list[int]
                 ) -> dict[str, float]:
        n = max(len(episodes), 1)
        played = [p for p in plays if p.failure is None]
        metrics = {"env/episodes": float(len(episodes)),
                   "env/turns_mean": sum(e.turns for e in episodes) / n,
                   "env/return_mean": float(np.mean([sum(p.rewards) for p in played])) if played else 0.0,
                   "env/sampled_tokens_mean": sampled / n,
                   "env/observation_tokens_mean": (sum(len(e.response) for e in episodes) - sampled) / n,
                   "env/rows_per_turn_mean": float(np.mean(turn_rows)) if turn_rows else 0.0,
                   "env/observation_too_long": float(counts["too_long"])}
        metrics.update({f"env/failed_{k}": float(sum(p.failure is not None and p.failure[0] == k for p in plays))
                        for k in FAILURES})
        metrics.update({f"env/finish_{f}": sum(e.finish == f for e in episodes) / n for f in FINISH})
        return metrics

