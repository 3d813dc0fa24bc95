"""The multi-turn rollout: per turn, one batched generate over this rank's active episodes, then their tool calls.

An episode is one sample (n per prompt, interleaved as in single-turn rollouts). Its row is built token by token:
the prompt, then for each turn the ids the engine sampled (kept exactly, ``response_mask`` 1, the engine's
log-probs) and the observation that follows (rendered by lib/multi_turn/render.py, ``response_mask`` 0, log-prob 0).
An episode ends at a turn without a tool call (its answer), at ``max_turns``, or when the token budget runs out: a
turn cut by ``max_tokens_per_turn`` or the episode's budget, or an observation that would not leave room for one
more sampled token. At every turn the engine's input is checked to be an exact prefix of the final row.

Image prompts (lib/vision): every turn's request carries its prompt's images (the HF engine: the trainer's image
features and the prompt's 3-D rope rows, the turns continuing from their largest position, as the trainer's row
does; vLLM: one placeholder per image and the images). Tools answer with text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lib.engine import RolloutEngine, build_output, expand_samples, prompt_images, rollout_columns
from lib.multi_turn.parsers import PARSERS, Parsed
from lib.multi_turn.render import ObservationRenderer, tool_message
from lib.multi_turn.tools import KINDS, bound_kwargs, failed, is_environment
from lib.protocol import DataProto
from lib.rewards.pool import RewardPool

TRUNCATED = " [truncated]"
"""Marks a tool answer cut to multi_turn.tool_response_max_tokens."""
FINISH = ("answer", "max_turns", "length", "budget")
"""How an episode ends: a turn without a tool call; max_turns turns; a turn cut by max_tokens_per_turn; the
episode's token budget (a turn cut by it, or an observation that does not fit)."""


@dataclass
class Episode:
    index: int  # its row in the rollout (an environment's key)
    prompt: list[int]
    allowed: set[str] | None  # tool names the row offers (None: every loaded tool)
    tools_kwargs: Any
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)  # top-k/top-p: the kept set's size at each token (0: none given)
    inputs: list[list[int]] = field(default_factory=list)  # the engine's input at each turn
    turns: int = 0
    tool_calls: int = 0
    last_turn: list[int] = field(default_factory=list)  # the ids of its last turn: what the scorer judges
    finish: str = ""

    def sampled(self, ids: list[int], logps: list[float], kept: list[int] | None = None) -> None:
        self.response += ids
        self.mask += [1] * len(ids)
        self.logps += logps
        self.kept += kept if kept is not None else [0] * len(ids)

    def check_inputs(self, what: str) -> None:
        """Token in, token out: every turn's engine input is a prefix of the final row (then they are dropped)."""
        final = self.prompt + self.response
        for ids in self.inputs:
            if final[:len(ids)] != ids:
                raise RuntimeError(f"{what}: an engine input is not a prefix of its final row")
        self.inputs = []

    def observed(self, ids: list[int]) -> None:
        self.response += ids
        self.mask += [0] * len(ids)
        self.logps += [0.0] * len(ids)
        self.kept += [0] * len(ids)


class MultiTurn:
    """The multi-turn rollout of one rank: the parser, the observation renderer and the tool workers."""

    def __init__(self, cfg: Any, tokenizer: Any, max_response_length: int, pool: Any = None,
                 chat_template: str | None = None):
        """``cfg``: lib.config.MultiTurnConfig. ``pool``: something with ``score(items)`` running tool calls
        (default: tool worker processes, lib/rewards/pool.py in mode tools)."""
        self.cfg, self.tokenizer = cfg, tokenizer
        self.parse = PARSERS[cfg.format]
        self.renderer = ObservationRenderer(tokenizer, chat_template)
        self.budget = cfg.max_response_tokens or max_response_length
        self.environment = is_environment(cfg.tools)
        if pool is None:

            pool = RewardPool(cfg.tools, cfg.tool_timeout_s, cfg.tool_workers, mode="tools")
        self.pool = pool

    def close(self) -> None:
        self.pool.close()

    # ---- one rollout

    def rollout(self, engine: RolloutEngine, data: DataProto, validate: bool = False) -> DataProto:
        """Left-padded prompts -> the rollout fields of lib.engine.build_output (``response_mask`` on sampled tokens
        only, ``attention_mask`` on every token of the row), n episodes per prompt, and per row ``solution_str``
        (the last turn's text, what the scorer judges) and ``num_turns``. Metrics in ``meta_info["multi_turn"]``."""
        sp = engine.val_sampling if validate else engine.sampling
        key = data.meta_info.get("seed_key", engine.calls[validate])
        data = expand_samples(data, sp.n)
        nt = data.non_tensor_batch
        episodes = self.episodes(data)
        media = prompt_images(data)  # a vision-language prompt's rope rows and images, for every turn of it
        counts = dict.fromkeys(COUNT_KINDS, 0)
        pin = [e.index for e in episodes] if self.environment else None  # an environment lives in one worker
        if pin is not None:
            resets = self._run([("reset", i, self.row(nt, i)) for i in pin], pin, counts)
        t0, gen_s, sampled, turn_rows = time.perf_counter(), 0.0, 0, []
        for turn in range(self.cfg.max_turns):
            active = [e for e in episodes if not e.finish]
            if not engine.any_active(bool(active)):  # a vLLM TP group goes on while any of its ranks has episodes
                break
            caps = [min(self.turn_cap, self.budget - len(e.response)) for e in active]
            inputs = [e.prompt + e.response for e in active]
            t_gen = time.perf_counter()
            outs = engine.generate_ids(inputs, caps, validate, (key, turn),
                                       None if media is None else [media[e.index] for e in active])
            gen_s += time.perf_counter() - t_gen
            turn_rows.append(len(active))
            for e, ids, out in zip(active, inputs, outs):
                e.inputs.append(ids)
                sampled += len(out.ids)
            self.take_turns(active, outs, counts, pin is not None)
        for e in episodes:
            e.finish = e.finish or "max_turns"
            e.check_inputs("multi-turn rollout")
        engine.calls[validate] += 1
        fields = build_output(data.batch["input_ids"], data.batch["attention_mask"], data.batch["position_ids"],
                              [e.response for e in episodes], [e.logps for e in episodes],
                              self.tokenizer.pad_token_id, sampled_masks=[e.mask for e in episodes],
                              prompt_rope=data.batch.get("rope_position_ids"),
                              kept=[e.kept for e in episodes] if any(map(any, (e.kept for e in episodes))) else None)
        obj = lambda v: np.array(v + [None], dtype=object)[:-1]  # noqa: E731
        non_tensor = dict(rollout_columns(data), solution_str=obj(self.tokenizer.batch_decode([e.last_turn for e in episodes],
                                                                     skip_special_tokens=True)),
                          num_turns=obj([e.turns for e in episodes]))
        if pin is not None:  # the episode's score, then the instance goes; a failed reset is the episode's result
            alive = [i for i in pin if not resets[i][1]]
            got = dict(zip(alive, self._run([("reward", i) for i in alive], alive, counts)))
            non_tensor["env_reward"] = obj([got.get(i, resets[i]) for i in pin])
            self._run([("close", i) for i in alive], alive, counts)
        elapsed = time.perf_counter() - t0
        metrics = self.episode_metrics(episodes, counts, sampled, turn_rows)
        # wall clock under timing/ and perf/, as the stages' (resume tests leave those out)
        metrics.update({"timing/multi_turn_generate_s": gen_s, "timing/multi_turn_tools_s": elapsed - gen_s,
                        "perf/multi_turn_sampled_tokens_per_s": sampled / max(gen_s, 1e-9)})
        meta = {"generate_s": elapsed, "generated_tokens": sampled, "tokens_per_s": sampled / max(elapsed, 1e-9),
                "multi_turn": metrics}
        return DataProto.from_dict(fields, non_tensor, {**data.meta_info, **meta})

    def take_turns(self, episodes: list[Episode], outs: list[Any], counts: dict, pinned: bool = False) -> None:
        """Each episode's whole turn (lib.engine.Turn: ended on a stop token, or cut by its cap): the episode ends
        there, or the turn's tool calls run (every episode's together, each call once: ``pinned``, in its
        episode's worker) and their observation follows."""
        calls: list[tuple] = []  # ("call", episode, name, arguments, bound arguments) to run, in order
        # per episode: None (it ended), or its stop text, then messages or indices into calls
        planned = [self._sampled(e, out, calls, counts) for e, out in zip(episodes, outs)]
        results = self._run(calls, [c[1] for c in calls] if pinned else None, counts)
        for e, plan in zip(episodes, planned):
            if plan is not None:
                self._observe(e, plan, calls, results, counts)

    @property
    def turn_cap(self) -> int:
        """The tokens one turn may sample (multi_turn.max_tokens_per_turn, else the episode's budget)."""
        return self.cfg.max_tokens_per_turn or self.budget

    @staticmethod
    def episodes(data: DataProto) -> list[Episode]:
        """One episode per row: its prompt (unpadded), the tools its row offers, its bound tool arguments."""
        nt, n = data.non_tensor_batch, len(data)
        columns = nt.get("columns", np.array([None] * n, dtype=object))
        extras = nt.get("extra_info", np.array([None] * n, dtype=object))
        ids, mask = data.batch["input_ids"].cpu(), data.batch["attention_mask"].cpu()
        episodes = []
        for i, (row, m, col, extra) in enumerate(zip(ids, mask, columns, extras)):
            offered = col.get("tools") if isinstance(col, dict) else None
            allowed = {s.get("function", s).get("name") for s in offered} if offered else None
            kwargs = extra.get("tools_kwargs") if isinstance(extra, dict) else None
            episodes.append(Episode(i, row[m.bool()].tolist(), allowed, kwargs))
        return episodes

    def _sampled(self, e: Episode, out: Any, calls: list[tuple], counts: dict) -> list | None:
        """Take a turn the engine sampled: the episode ends here (None), or goes on with the observation planned
        (the stop text, then error messages and indices of the calls appended to ``calls``)."""
        e.sampled(out.ids, out.logps, out.kept)
        e.turns += 1
        e.last_turn = out.ids
        if not out.stopped:
            e.finish = "budget" if len(e.response) >= self.budget else "length"
            return None
        text = self.tokenizer.decode(out.ids, skip_special_tokens=False)
        stop_text = self.tokenizer.decode(out.ids[-1:], skip_special_tokens=False)
        parsed: Parsed = self.parse(text[:-len(stop_text)] if stop_text and text.endswith(stop_text) else text)
        if not parsed.any:
            e.finish = "answer"
            return None
        if e.turns >= self.cfg.max_turns:
            e.finish = "max_turns"
            return None
        obs: list = [stop_text]
        for message in parsed.errors:
            refuse(obs, counts, "malformed", "error", message)
        for i, call in enumerate(parsed.calls):
            if i >= self.cfg.max_tool_calls_per_turn:
                refuse(obs, counts, "over_limit", call.name,
                       f"only {self.cfg.max_tool_calls_per_turn} tool calls run per turn")
            elif e.allowed is not None and call.name not in e.allowed:
                refuse(obs, counts, "invalid", call.name,
                       f"tool {call.name!r} is not offered here; the tools are {sorted(e.allowed)}")
            else:
                e.tool_calls += 1
                obs.append(len(calls))  # the call's answer goes here once it has run
                calls.append(("call", e.index, call.name, call.arguments, bound_kwargs(e.tools_kwargs, call.name)))
        return obs

    def _observe(self, e: Episode, planned: list, calls: list[tuple], results: list[tuple], counts: dict) -> None:
        """Render the turn's observation and append it, or end the episode where it would leave no room for one more
        sampled token."""
        stop_text, *parts = planned
        messages = [tool_message(calls[p][2], self._cut(results[p][0], counts)) if isinstance(p, int) else p
                    for p in parts]
        obs_ids = self.renderer.observation_ids(messages, stop_text)
        if len(e.response) + len(obs_ids) >= self.budget:
            e.finish = "budget"
        else:
            e.observed(obs_ids)

    @staticmethod
    def episode_metrics(episodes: list[Episode], counts: dict, sampled: int, turn_rows: list[int]
                        ) -> dict[str, float]:
        n = max(len(episodes), 1)
        metrics = {"multi_turn/turns_mean": sum(e.turns for e in episodes) / n,
                   "multi_turn/turns_max": float(max((e.turns for e in episodes), default=0)),
                   "multi_turn/tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
                   "multi_turn/sampled_tokens_mean": sampled / n,
                   "multi_turn/observation_tokens_mean": (sum(len(e.response) for e in episodes) - sampled) / n,
                   "multi_turn/rows_per_turn_mean": float(np.mean(turn_rows)) if turn_rows else 0.0}
        metrics.update({f"multi_turn/tool_{k}": float(v) for k, v in counts.items()})
        metrics.update({f"multi_turn/finish_{f}": sum(e.finish == f for e in episodes) / n for f in FINISH})
        return metrics

    def _run(self, items: list[tuple], pin: list[int] | None, counts: dict) -> list[tuple]:
        """Tool operations in the workers; each failure counted by kind."""
        results = self.pool.score(items, pin) if items else []
        for _, kind, _ in results:
            if kind:
                counts[kind] += 1
        return results

    @staticmethod
    def row(nt: dict, i: int) -> dict:
        """What an environment's reset gets: the row's prompt messages, data_source, ground_truth, extra_info and
        other columns."""
        row = {k: nt[k][i] for k in ("data_source", "ground_truth", "extra_info") if k in nt}
        if "messages" in nt:
            row["prompt"] = nt["messages"][i]
        columns = nt["columns"][i] if "columns" in nt else None
        return {**(columns if isinstance(columns, dict) else {}), **row}

    def _cut(self, text: str, counts: dict) -> str:
        """A tool's answer cut to tool_response_max_tokens tokens, the cut marked."""
        limit = self.cfg.tool_response_max_tokens
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if limit and len(ids) > limit:
            counts["truncations"] += 1
            return self.tokenizer.decode(ids[:limit], skip_special_tokens=False) + TRUNCATED
        return text


def refuse(observation: list, counts: dict, kind: str, name: str, message: str) -> None:
    """A call answered with an error without running (malformed, over the per-turn limit, not offered): counted, and
    its message goes into the turn's observation."""
    counts[kind] += 1
    observation.append(tool_message(name, failed(kind, message)[0]))


COUNT_KINDS = KINDS + ("malformed", "over_limit", "truncations")
"""What a multi-turn rollout counts of its tool calls (``take_turns``' ``counts``)."""
SUMMED = tuple(f"multi_turn/tool_{k}" for k in COUNT_KINDS)
"""The counts among the metrics (summed over ranks and rounds)."""
