"""One step of partial rollouts (see lib/partial/__init__.py): the pool's generation (in chunks, or one call whose
requests stop mid-way) until the ranks hold train_batch_size complete groups, the batch of the oldest complete
groups, the rest carried."""

from __future__ import annotations

import copy
import math
import time

import numpy as np
import torch
import torch.distributed as dist

from lib.data import left_pad
from lib.dist import sum_over_ranks
from lib.engine import Turn, build_output, prompt_images, rollout_columns
from lib.multi_turn.loop import COUNT_KINDS
from lib.partial.carry import Sample, completed, first_version, groups
from lib.protocol import DataProto
from lib.rollout import generate, next_batch
from lib.run import Run

KEY = -7
"""The sampling key's marker (ints only: a tuple of ints hashes alike in every process, so a resumed run draws the
samples an uninterrupted one would)."""

COUNTS = ("partial/dropped_groups", "partial/reprefill_tokens", "partial/rounds", "partial/stopped_mid_call",
          "partial/generated_tokens")
"""The pool's counts among its metrics (over the ranks already): summed over a step's dynamic-sampling rounds."""


def _draw(run: Run, step: int, pool: list[Sample]) -> None:
    """The next data batch's prompts into the pool, n samples each."""
    data = next_batch(run)
    index = data.meta_info["seed_key"]
    ids, mask = data.batch["input_ids"].cpu(), data.batch["attention_mask"].cpu()
    nt, kept_on = data.non_tensor_batch, rollout_columns(data)
    media = prompt_images(data) or [None] * len(data)  # an image prompt's images and rope rows go with its samples
    # multi-turn tools: each sample is an episode (lib/multi_turn), carried with its turns so far and a turn in flight
    episodes = run.multi_turn.episodes(data) if run.multi_turn is not None else [None] * len(data)
    first = run.topo.rank * len(data)  # the rank's rows are its contiguous share of the data batch (lib.data.Sampler)
    for row in range(len(data)):
        prompt = ids[row][mask[row].bool()].tolist()
        columns = {k: v[row] for k, v in kept_on.items()}
        for k in range(run.cfg.rollout.n):
            # the row's place in the whole data batch: the stream's order is the same on any number of ranks
            pool.append(Sample(str(nt["uid"][row]), step, (index, first + row, k), prompt, columns,
                               media=media[row], episode=copy.deepcopy(episodes[row])))


def _counts(pool: list[Sample]) -> tuple[int, int]:
    """(complete groups, samples still generating) on this rank."""
    every = groups(pool).values()
    return sum(all(s.ended for s in g) for g in every), sum(not s.ended for s in pool)


def generate_step(run: Run, step: int, round_: int = 0) -> tuple[DataProto, dict[str, float]]:
    """The step's batch (train_batch_size complete groups over the ranks) and its rollout metrics. ``round_``:
    dynamic sampling's round of the step (its samples drawn from other seeds)."""
    cfg, p = run.cfg, run.cfg.rollout.partial
    want, width = cfg.trainer.train_batch_size, cfg.rollout.max_response_length
    reduce = sum_over_ranks()
    pool: list[Sample] = run.partial
    # a group still generating whose first tokens are older than the cap leaves whole (one not started yet is never
    # stale). A complete group is judged once, in the step it completed, the first that could train it: it passed
    # the cap then (it was still generating at that step's start), and a group left over waits only for room in a
    # batch (it trains first in the next step), its tokens then a step older (partial/staleness_mean counts it)
    stale = [uid for uid, g in groups(pool).items()
             if completed(g) is None and first_version(g, step) < step - p.max_staleness]
    pool[:] = [s for s in pool if s.uid not in stale]
    resumed_in = sum(bool(s.ids) for s in pool)
    target = math.ceil(p.over_provision * want)
    while reduce(torch.tensor([float(len(groups(pool)))], dtype=torch.float64))[0] < target:
        _draw(run, step, pool)
    tally = {"rounds": 0, "reprefill": 0, "sampled": 0, "stopped": 0, "trained": want}
    world = run.topo.world_size
    chunk = p.chunk_tokens or max(1, width // 4)
    mt = run.multi_turn
    tools = dict.fromkeys(COUNT_KINDS, 0)  # this step's tool failures, by kind
    turn_rows: list[int] = []

    def cap(s: Sample, whole: bool = False) -> int:
        """A chunk's tokens for ``s`` (``whole``: no chunk), up to the response's width; an episode's, to its
        turn's and its budget's."""
        most = width if whole else chunk
        if s.episode is None:
            return min(most, width - len(s.ids))
        return min(most, mt.turn_cap - (len(s.ids) - len(s.episode.response)), mt.budget - len(s.ids))

    def done(complete: float, sampled: float) -> bool:
        """Whether the step has what it trains: ``want`` complete groups over the ranks, or with the token budget
        spent (``sampled`` over the ranks this step) a complete group per rank."""
        return complete >= want or bool(p.step_token_budget) and sampled >= p.step_token_budget and complete >= world

    def enough(cohort: list[Sample], finished: list[bool], sampled: int) -> bool:
        """Between an engine's steps (generate_until): ``done``, a sample of ``cohort`` counted as ended once its
        request finished (an episode's ends with its turn only if that was its last: not known until the turn is
        parsed, so not counted), ``sampled`` this rank's tokens of the call so far; or no request runs on any
        rank."""
        ended = {id(s) for s, f in zip(cohort, finished) if f and s.episode is None}
        complete = sum(all(s.ended or id(s) in ended for s in g) for g in groups(pool).values())
        counts = reduce(torch.tensor([float(complete), float(sum(not f for f in finished)),
                                      float(tally["sampled"] + sampled)], dtype=torch.float64)).tolist()
        return counts[1] == 0 or done(counts[0], counts[2])

    def produce(engine) -> DataProto:
        t0 = time.perf_counter()
        while True:
            complete, active, sampled = reduce(torch.tensor([*_counts(pool), tally["sampled"]],
                                                            dtype=torch.float64)).tolist()
            # at least one chunk while any sample generates: a carried one goes on every step (else complete groups
            # left over could fill steps while it waits, staler, until it is dropped)
            if active == 0 or (tally["rounds"] and done(complete, sampled)):
                break
            stream = engine.stops_mid_call
            if stream:  # one call, its requests stopped once the step has its groups
                cohorts = [[s for s in pool if not s.ended]]
            else:  # a static batch: chunks; the samples that start and those that go on apart (one call pads its
                # rows to its longest, and a continued sample's prefill is as long as its tokens so far)
                cohorts = [[s for s in pool if not s.ended and not s.ids], [s for s in pool if not s.ended and s.ids]]
            todo = [s for c in cohorts for s in c]
            outs = []
            for part, cohort in enumerate(cohorts):
                inputs, caps = [s.prompt + s.ids for s in cohort], [cap(s, whole=stream) for s in cohort]
                t_call = time.perf_counter()
                images = [s.media for s in cohort] if any(s.media for s in cohort) else None
                # every rank calls each (a vLLM TP group generates its gathered rows together, empty ones included)
                if stream:
                    got = engine.generate_until(inputs, caps, (step, KEY, round_, tally["rounds"], part), images,
                                                lambda finished, sampled: enough(cohort, finished, sampled), chunk)
                    tally["stopped"] += sum(not t.stopped and len(t.ids) < c for t, c in zip(got, caps))
                    outs += got
                else:
                    outs += engine.generate_ids(inputs, caps, False, (step, KEY, round_, tally["rounds"], part),
                                                images)
                for s in cohort:
                    s.gen_s += time.perf_counter() - t_call
            whole = []  # multi-turn: the episodes whose turn ended in this chunk, each with its whole turn
            for s, out in zip(todo, outs):
                tally["reprefill"] += len(s.ids)  # a continued sample's response so far is prefilled again
                s.ids += out.ids
                s.logps += out.logps
                s.versions += [step] * len(out.ids)
                tally["sampled"] += len(out.ids)
                if s.episode is None:
                    s.kept += out.kept or []
                    s.ended = out.stopped or len(s.ids) >= width
                    continue
                s.kept += out.kept if out.kept is not None else [0] * len(out.ids)
                turn = slice(len(s.episode.response), None)  # the turn in flight: its tokens since the last one
                if out.stopped or len(s.ids[turn]) >= mt.turn_cap or len(s.ids) >= mt.budget:
                    whole.append((s, Turn(s.ids[turn], s.logps[turn], out.stopped, s.kept[turn])))
            if whole:  # the turns' tool calls run once, here; their observations join the episodes
                mt.take_turns([s.episode for s, _ in whole], [t for _, t in whole], tools)
                for s, _ in whole:
                    e = s.episode
                    s.versions += [step] * (len(e.response) - len(s.ids))  # the observation (response_mask 0)
                    s.ids, s.logps, s.kept = list(e.response), list(e.logps), list(e.kept)
                    s.ended = bool(e.finish)
            turn_rows.append(len(todo))
            tally["rounds"] += 1
        elapsed = time.perf_counter() - t0
        # the budget's stop: the complete groups held, a multiple of the ranks (each trains as many)
        tally["trained"] = want if complete >= want else int(complete) // world * world
        batch, take = _batch(run, step, pool, tally["trained"], {
            "generate_s": elapsed, "generated_tokens": tally["sampled"],
            "tokens_per_s": tally["sampled"] / max(elapsed, 1e-9)})
        if mt is not None:  # the trained episodes' figures, as a multi-turn rollout reports them
            trained = [s.episode for s in take]
            batch.meta_info["multi_turn"] = mt.episode_metrics(trained, tools, sum(sum(e.mask) for e in trained),
                                                               turn_rows)
        return batch

    pool_samples = len(pool)
    batch, metrics = generate(run, None, produce=produce)
    metrics.update(batch.meta_info.pop("multi_turn", {}))
    counts = reduce(torch.tensor([float(len(stale)), float(resumed_in), float(pool_samples), float(len(pool)),
                                  float(tally["reprefill"]), float(tally["rounds"]), float(tally["stopped"]),
                                  float(tally["sampled"])],
                                 dtype=torch.float64)).tolist()
    longest = torch.tensor([batch.meta_info.pop("longest_sample_s"), metrics["timing/generate_s"]])
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)  # world: the slowest rank's, as the step waits for it
    versions = batch.batch["rollout_versions"]
    tokens = batch.batch["response_mask"].bool()
    age = (step - versions)[tokens].to(torch.float64)
    sums = reduce(torch.stack([age.sum(), (age > 0).sum().to(torch.float64), torch.tensor(float(age.numel()),
                                                                                             dtype=torch.float64)]))
    metrics.update({"partial/dropped_groups": counts[0], "partial/resumed_share": counts[1] / max(counts[2], 1),
                    "partial/carried_share": counts[3] / max(counts[2], 1), "partial/reprefill_tokens": counts[4],
                    "partial/rounds": counts[5] / run.topo.world_size, "partial/stopped_mid_call": counts[6],
                    "partial/trained_groups": float(tally["trained"]), "partial/generated_tokens": counts[7],
                    "partial/staleness_mean": float(sums[0] / sums[2].clamp(min=1)),
                    "partial/stale_token_share": float(sums[1] / sums[2].clamp(min=1)),
                    # wall clock under timing/ (resume tests leave it out): a step that waited for its samples' end
                    # would have generated at least as long as its longest trained sample took
                    "timing/partial_longest_sample_s": float(longest[0]),
                    "timing/partial_idle_saved_s": float(longest[0] - longest[1])})
    return batch, metrics


def _batch(run: Run, step: int, pool: list[Sample], want: int, meta: dict) -> tuple[DataProto, list[Sample]]:
    """The oldest ``want`` complete groups over the ranks (those completed in an earlier step first, so that one
    left over trains in the next step; then drawn earlier, carried before new; then stream order) as this rank's
    rollout batch, and its samples; they leave the pool."""
    done = [(completed(g), g[0].born, g[0].order, uid) for uid, g in groups(pool).items()
            if completed(g) is not None]
    # and what the pool's samples hold (columns, kept-set sizes, rope rows), so that a rank that trains no group
    # builds the same fields as the others (the batch is then dealt out over the ranks)
    traits = (list(pool[0].columns) if pool else [], any(map(any, (s.kept for s in pool))),
              any(s.media is not None and s.media.rope is not None for s in pool))
    every: list = [None] * run.topo.world_size
    # world: the ranks' complete groups (a few tuples each), to take the same oldest ones everywhere
    dist.all_gather_object(every, (done, traits))
    chosen = {uid for *_, uid in sorted(g for part, _ in every for g in part)[:want]}
    take = sorted((s for s in pool if s.uid in chosen), key=lambda s: s.order)
    pool[:] = [s for s in pool if s.uid not in chosen]
    keys = next((t[0] for _, t in every if t[0]), [])
    kept_sets, ropes = any(t[1] for _, t in every), any(t[2] for _, t in every)
    meta = {**meta, "longest_sample_s": max((s.gen_s for s in take), default=0.0)}
    pad = run.tokenizer.pad_token_id
    ids, mask, pos = left_pad([s.prompt for s in take], run.cfg.data.max_prompt_length, pad)
    kept = [s.kept for s in take] if kept_sets else None
    episodes = [s.episode for s in take if s.episode is not None]
    rope = None
    if ropes:  # Qwen-VL: 0 on padding, as collated
        rope = torch.zeros(len(take), 3, ids.shape[1], dtype=torch.long)
        for i, s in enumerate(take):
            rope[i, :, ids.shape[1] - len(s.prompt):] = s.media.rope
    fields = build_output(ids, mask, pos, [s.ids for s in take], [s.logps for s in take], pad, prompt_rope=rope,
                          kept=kept, sampled_masks=[e.mask for e in episodes] if episodes else None)
    width = fields["responses"].shape[1]
    versions = torch.full((len(take), width), step, dtype=torch.long)
    for i, s in enumerate(take):
        versions[i, :len(s.versions)] = torch.tensor(s.versions, dtype=torch.long)
    fields["rollout_versions"] = versions
    fields["fresh_mask"] = (versions == step).to(torch.float32) * fields["response_mask"]
    obj = lambda v: np.array(list(v) + [None], dtype=object)[:-1]  # noqa: E731
    columns = {k: obj(s.columns[k] for s in take) for k in keys}
    if run.multi_turn is not None:  # what the scorer judges (the last turn's text) and the turns, as a multi-turn
        # rollout's rows
        columns["solution_str"] = obj(run.tokenizer.batch_decode([e.last_turn for e in episodes],
                                                                 skip_special_tokens=True))
        columns["num_turns"] = obj(e.turns for e in episodes)
    return DataProto.from_dict(fields, columns, meta), take


def segment_metrics(batch: DataProto, step: int) -> dict[str, float]:
    """The canary per segment, after the old log-probs: the engine's against the trainer's log-probs of the tokens
    the weights before this step's update sampled (rollout/fresh_logp_abs_diff: fp32's floor when both compute the
    same model), and of the carried tokens older weights sampled (partial/stale_logp_abs_diff: the policy's change)."""
    b = batch.batch
    diff = (b["old_log_probs"] - b["rollout_log_probs"]).abs().to(torch.float64)
    fresh = b["fresh_mask"].to(torch.float64)
    stale = b["response_mask"].to(torch.float64) * (b["rollout_versions"] != step)
    sums = sum_over_ranks()(torch.stack([(diff * fresh).sum(), fresh.sum(), (diff * stale).sum(), stale.sum()]))
    return {"rollout/fresh_logp_abs_diff": float(sums[0] / sums[1].clamp(min=1)),
            "partial/stale_logp_abs_diff": float(sums[2] / sums[3].clamp(min=1))}
