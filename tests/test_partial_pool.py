"""Partial rollouts' pool (lib/partial/loop.py) with stand-in engines, no model: the batches do not depend on the
number of ranks (chunks and requests stopped mid-call), a step's dynamic-sampling rounds draw from other seeds, and
a multi-turn episode is carried mid-turn with each tool call run once. Apart from tests/test_partial.py, whose
gpu-marked test the GPU machine runs: this file reaches lib/startup's imports (tests/test_acceptance.py checks that
file's)."""

import os

import pytest

EOS = 1


# ---- the pool on any number of ranks: a stand-in engine whose samples depend on the prompt only (the real engines'
# samples follow each rank's seed stream, with or without partial rollouts), so every difference is the pool's

def _prompt(row: int) -> list[int]:
    return [10 + row] + [5] * (row % 3)


def _length(row: int) -> int:
    """The response's length (its stop token included): mostly short, one row in 7 long, one in 11 past the cap."""
    return 40 if row % 11 == 0 else 20 if row % 7 == 0 else 2 + row % 5


class _PromptEngine:
    """generate_ids' contract: a request's tokens are a function of its prompt's row and position, so a sample
    continued in any chunks, on any rank, is the same sample. ``stops_mid_call``: generate_until's too, a token for
    each running request per engine step (vLLM's way)."""

    def __init__(self, stops_mid_call: bool = False, keys: list | None = None):
        self.stops_mid_call, self.keys = stops_mid_call, keys if keys is not None else []

    def generate_ids(self, prompts, max_tokens, validate, key, media=None):
        from lib.engine import Turn

        self.keys.append(key)
        outs = []
        for seq, cap in zip(prompts, max_tokens):
            row = seq[0] - 10
            start = len(seq) - len(_prompt(row))
            n = min(cap, _length(row) - start)
            ids = [(row * 31 + j) % 50 + 2 for j in range(start, start + n)]
            stopped = start + n == _length(row)
            ids[-1:] = [EOS] if stopped else ids[-1:]
            outs.append(Turn(ids, [-0.01 * (row + j + 1) for j in range(start, start + n)], stopped))
        return outs

    def generate_until(self, prompts, max_tokens, key, media, enough, every):
        from lib.engine import Turn

        whole = self.generate_ids(prompts, max_tokens, False, key)  # the key recorded there
        steps = 0
        while True:
            steps += every
            if enough([len(t.ids) <= steps for t in whole], sum(min(len(t.ids), steps) for t in whole)):
                break
        return [t if len(t.ids) <= steps else Turn(t.ids[:steps], t.logps[:steps], False) for t in whole]


def _stand_in_run(stream: bool, keys: list | None = None):
    """A run of the pool on this world's ranks: the stand-in engine (``keys``: each call's sampling key appended),
    prompts of the data stream's rows (train_batch_size 4 groups of 2, chunks of 4 tokens, a pool of 2.5 x, staleness
    1); lib.partial.loop's generate and next_batch replaced by theirs."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from lib.config import Config
    from lib.data import Sampler, left_pad
    from lib.partial import loop
    from lib.protocol import DataProto

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = Config()
    cfg.rollout.n, cfg.rollout.max_response_length, cfg.data.max_prompt_length = 2, 24, 4
    cfg.trainer.train_batch_size = 4
    p = cfg.rollout.partial
    p.enabled, p.chunk_tokens, p.over_provision, p.max_staleness = True, 4, 2.5, 1
    run = SimpleNamespace(cfg=cfg, topo=SimpleNamespace(rank=rank, world_size=world), partial=[], data_position=0,
                          multi_turn=None, sampler=Sampler(96, 4, seed=3), tokenizer=SimpleNamespace(pad_token_id=0))

    def next_batch(run):
        index = run.data_position
        run.data_position += 1
        rows = run.sampler.rows(index, rank, world)
        ids, mask, pos = left_pad([_prompt(int(r)) for r in rows], 4, 0)
        return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                                   {"uid": [f"{index}-{r}" for r in rows], "data_source": ["toy"] * len(rows)},
                                   {"seed_key": index})

    loop.next_batch = next_batch
    loop.generate = lambda run, prompts, produce: (produce(_PromptEngine(stream, keys)), {"timing/generate_s": 0.0})
    return run


def _pool_body(folder: str, steps: int, save_after: int, resume_at: int, stream: bool = False):
    """generate_step on this world's ranks for steps [resume_at, steps) (the pool and the data position loaded from
    ``folder`` when resume_at > 0; saved there after step ``save_after`` - 1 when > 0). Returns per step the trained
    samples of every rank (uid, response, each token's version and log-prob), sorted, and the pool's metrics."""
    import json

    import torch.distributed as dist

    from lib.balance import balance_groups
    from lib.partial import carry, loop

    rank, world = dist.get_rank(), dist.get_world_size()
    run = _stand_in_run(stream)
    if resume_at:
        run.partial = carry.load(folder, rank, world)
        run.data_position = json.load(open(os.path.join(folder, "position.json")))
    out = []
    for step in range(resume_at, steps):
        batch, metrics = loop.generate_step(run, step)
        # dealt out over the ranks as the trainer does (a rank may have trained no group: it builds the same fields)
        batch, _ = balance_groups(batch)
        b = batch.batch
        mine = []
        for i in range(len(batch)):
            width = int(b["response_mask"][i].sum())
            mine.append((batch.non_tensor_batch["uid"][i], b["responses"][i, :width].tolist(),
                         b["rollout_versions"][i, :width].tolist(),
                         [round(x, 6) for x in b["rollout_log_probs"][i, :width].tolist()]))
        every = [None] * world
        dist.all_gather_object(every, mine)
        # wall clock (timing/) apart: every trained sample spent some time in an engine call
        assert metrics["timing/partial_longest_sample_s"] > 0, metrics
        assert "timing/partial_idle_saved_s" in metrics, metrics
        out.append((sorted(x for part in every for x in part),
                    {k: v for k, v in metrics.items() if not k.startswith("timing/")}))
        if step + 1 == save_after:
            carry.save(run.partial, folder, rank, world)
            if rank == 0:
                json.dump(run.data_position, open(os.path.join(folder, "position.json"), "w"))
    return out


def _rounds_body(stream: bool):
    """Step 0's first and second dynamic-sampling rounds: the sampling keys of each."""
    from lib.partial import loop

    keys: list = []
    run = _stand_in_run(stream, keys)
    loop.generate_step(run, 0, 0)
    first = list(keys)
    loop.generate_step(run, 0, 1)
    return first, keys[len(first):]


@pytest.mark.parametrize("stream", [False, True], ids=["chunks", "stopped_mid_call"])
def test_a_steps_dynamic_sampling_rounds_draw_from_other_seeds(stream):
    """Each generation call of a step's second dynamic-sampling round has a sampling key none of the first round's
    has. Before the fix both rounds numbered their calls from 0 with the same keys: a prompt drawn again, or a sample
    continued at the same position, got the same seeds."""
    from lib.testing import run_distributed

    (first, second), _ = run_distributed(_rounds_body, stream, world_size=2)
    assert first and second and not set(first) & set(second), (first, second)


@pytest.mark.parametrize("stream", [False, True], ids=["chunks", "stopped_mid_call"])
def test_the_pools_batches_do_not_depend_on_the_number_of_ranks(stream, tmp_path):
    """With samples that depend on the prompt only, 1, 2 and 4 ranks train the same samples at every step (the same
    tokens, versions and behaviour log-probs), carry and drop the same groups, and log the same pool figures; a pool
    saved on 2 ranks and resumed on 1 or 4 goes on as the uninterrupted run. Both ways of generating: chunks of
    generate_ids (the HF engine), and one generate_until a round whose requests stop mid-call (vLLM). Before the fix
    (a row's place in the stream was its place on its rank's share) 2 ranks trained other groups than 1."""
    from lib.testing import run_distributed

    steps = 6
    (ref,) = run_distributed(_pool_body, str(tmp_path), steps, 0, 0, stream, world_size=1)
    trained = [len(samples) for samples, _ in ref]
    assert trained == [8] * steps, trained  # train_batch_size 4 groups of 2, every step
    assert any(m["partial/resumed_share"] > 0 for _, m in ref) and any(m["partial/dropped_groups"] for _, m in ref)
    assert any(v > 0 and v < 1 for _, m in ref for v in [m["partial/stale_token_share"]]), ref
    for world in (2, 4):
        got = run_distributed(_pool_body, str(tmp_path / f"w{world}"), steps, 0, 0, stream, world_size=world)[0]
        assert got == ref, world
    run_distributed(_pool_body, str(tmp_path), 3, 3, 0, stream, world_size=2)
    for world in (1, 4):
        got = run_distributed(_pool_body, str(tmp_path), steps, 0, 3, stream, world_size=world)[0]
        assert got == ref[3:], world


# ---- multi-turn episodes in the pool: a turn in flight is carried, each tool call runs once

MT_KEYS = 48


def _script(key: int) -> list[str]:
    """Key k's turns: an answer at once, or after one or two calls (arguments unique to the key and the turn)."""
    from tests.helpers import call

    return [call("add", a=key, b=100 + t) for t in range(key % 3)] + [str(key)]


class _TurnEngine:
    """generate_ids' contract, the episode's script: the turn is the number of assistant openings in the request
    after the prompt's, the offset the tokens since the last one, so a turn sampled in any chunks, before or after a
    checkpoint, is the same turn. Log-probs -(sampled position + 1) / 100."""

    stops_mid_call = False

    def __init__(self, tok):
        from lib.engine import SamplingConfig

        self.tok, self.sampling, self.calls = tok, SamplingConfig(n=1), {False: 0, True: 0}
        self.end = tok.convert_tokens_to_ids("<|im_end|>")
        self.opening = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]

    def any_active(self, active):
        return active

    def _turns(self, key: int) -> list[list[int]]:
        return [self.tok(t, add_special_tokens=False)["input_ids"] + [self.end] for t in _script(key)]

    def generate_ids(self, prompts, max_tokens, validate, key, media=None):
        from lib.engine import Turn

        outs = []
        for seq, cap in zip(prompts, max_tokens):
            text = self.tok.decode(seq, skip_special_tokens=False)
            who = int(text.split("user\nkey ")[1].split("<|im_end|>")[0])
            w = len(self.opening)
            starts = [i + w for i in range(len(seq) - w + 1) if seq[i:i + w] == self.opening]
            turn, offset = len(starts) - 1, len(seq) - starts[-1]
            full = self._turns(who)[turn]
            before = sum(len(t) for t in self._turns(who)[:turn]) + offset
            ids = full[offset:offset + cap]
            outs.append(Turn(ids, [-(before + i + 1) / 100 for i in range(len(ids))], offset + len(ids) == len(full)))
        return outs


class _CallLog:
    """A tool pool (MultiTurn's ``pool``) that runs the calls here and appends each to a file."""

    def __init__(self, path: str, spec: str):
        from tests.helpers import LocalPool

        self.path, self.local = path, LocalPool(spec)

    def score(self, items, pin=None):
        import json

        with open(self.path, "a") as f:
            for item in items:
                f.write(json.dumps(item[2:4]) + "\n")
        return self.local.score(items, pin)

    def close(self):
        pass


def _mt_rows(tok, batch, versions: bool) -> list[tuple]:
    """Per row of a multi-turn batch: (key, responses, response_mask, rollout log-probs, versions or None, num_turns,
    solution_str)."""
    b, out = batch.batch, []
    for i in range(len(batch)):
        width = int(b["attention_mask"][i, b["prompts"].shape[1]:].sum())
        key = int(tok.decode(b["prompts"][i], skip_special_tokens=True).split("key ")[1].split()[0])
        out.append((key, b["responses"][i, :width].tolist(), b["response_mask"][i, :width].tolist(),
                    b["rollout_log_probs"][i, :width].tolist(),
                    b["rollout_versions"][i, :width].tolist() if versions else None,
                    int(batch.non_tensor_batch["num_turns"][i]), batch.non_tensor_batch["solution_str"][i]))
    return out


def _mt_pool_run(tok, data, mt, engine):
    """The multi-turn pool's run (n 2, chunks of 8 tokens, 1.5 x 2 groups, staleness 20) over ``data``, with
    lib.partial.loop's hooks set: the sampler's rows as batches, and each generation through ``engine()``."""
    from types import SimpleNamespace

    import numpy as np

    from lib.config import Config
    from lib.data import Sampler
    from lib.partial import loop

    cfg = Config()
    cfg.rollout.n, cfg.rollout.max_response_length, cfg.data.max_prompt_length = 2, 128, 32
    cfg.trainer.train_batch_size = 2
    p = cfg.rollout.partial
    p.enabled, p.chunk_tokens, p.over_provision, p.max_staleness = True, 8, 1.5, 20
    run = SimpleNamespace(cfg=cfg, topo=SimpleNamespace(rank=0, world_size=1), partial=[], data_position=0,
                          sampler=Sampler(MT_KEYS, 2, seed=5), tokenizer=tok, multi_turn=mt)

    def next_batch(run):
        index = run.data_position
        run.data_position += 1
        rows = run.sampler.rows(index)
        batch = data.select_idxs(rows)
        batch.non_tensor_batch["uid"] = np.array([f"{index}-{r}" for r in rows], dtype=object)
        batch.meta_info["seed_key"] = index
        return batch

    loop.next_batch = next_batch
    loop.generate = lambda run, prompts, produce: (produce(engine()), {"timing/generate_s": 0.0})
    return run


def _mt_body(folder: str, steps: int, save_after: int, resume_at: int, reference: bool):
    """The multi-turn pool (n 2, chunks of 8 tokens, 1.5 x 2 groups) for steps [resume_at, steps), as _pool_body;
    with ``reference``, MultiTurn.rollout over every key at once instead (whole turns, no pool). Returns per
    trained row: (key, responses, response_mask, rollout log-probs, versions or None, num_turns, solution_str)."""
    import json
    import pathlib

    import torch.distributed as dist

    from lib import toy
    from lib.config import MultiTurnConfig
    from lib.multi_turn.loop import MultiTurn
    from lib.partial import carry, loop
    from tests.helpers import TOOLS, prompts_for, row

    tok = toy.build_tool_tokenizer(os.path.join(folder, "tok"))
    data = prompts_for(tok, [row(f"key {k}") for k in range(MT_KEYS)], pathlib.Path(folder), TOOLS)
    mt = MultiTurn(MultiTurnConfig(tools=TOOLS, max_turns=4), tok, 128, pool=_CallLog(f"{folder}/calls.jsonl", TOOLS))
    if reference:
        return _mt_rows(tok, mt.rollout(_TurnEngine(tok), data), False)
    run = _mt_pool_run(tok, data, mt, lambda: _TurnEngine(tok))
    if resume_at:
        run.partial = carry.load(folder, 0, 1)
        run.data_position = json.load(open(os.path.join(folder, "position.json")))
    out = []
    for step in range(resume_at, steps):
        batch, metrics = loop.generate_step(run, step)
        assert metrics["multi_turn/turns_mean"] >= 1, metrics
        out.append(_mt_rows(tok, batch, True))
        if step + 1 == save_after:
            carry.save(run.partial, folder, 0, 1)
            json.dump(run.data_position, open(os.path.join(folder, "position.json"), "w"))
    dist.barrier()
    return out


def test_a_multi_turn_episode_is_carried_mid_turn_and_runs_each_tool_call_once(tmp_path):
    """Tool episodes in the pool, chunks of 8 tokens against turns of up to 35: every trained row (its tokens,
    response mask, behaviour log-probs, turns and last turn) is the one the multi-turn rollout makes in whole turns,
    though its turns were sampled over several steps, some split across a step (a turn in flight carried) and across
    a checkpoint (saved after step 3, resumed); every tool call ran once per sample, none again after a resume."""
    import json

    from lib.testing import run_distributed

    (ref,) = run_distributed(_mt_body, str(tmp_path / "ref"), 0, 0, 0, True, world_size=1)
    expect = {r[0]: r[1:4] + r[5:] for r in ref}
    steps = 6
    (whole,) = run_distributed(_mt_body, str(tmp_path / "whole"), steps, 0, 0, False, world_size=1)
    run_distributed(_mt_body, str(tmp_path / "stopped"), 3, 3, 0, False, world_size=1)
    (resumed,) = run_distributed(_mt_body, str(tmp_path / "stopped"), steps, 0, 3, False, world_size=1)
    assert resumed == whole[3:]
    trained = [r for step in whole for r in step]
    assert len(trained) == 2 * 2 * steps
    for key, ids, mask, logps, versions, turns, last in trained:
        assert (ids, mask, logps, turns, last) == expect[key][:3] + expect[key][3:], key
    calls = [r for r in trained if 0 in r[2]]  # rows with an observation
    assert any(r[5] == 3 for r in calls), trained  # two calls, then the answer
    # a turn in flight carried: the version changes between two sampled tokens of one turn
    assert any(v[i] != v[i + 1] and m[i] and m[i + 1] for _, _, m, _, v, *_ in calls for i in range(len(v) - 1))
    for run in ("whole", "stopped"):
        executed = [tuple(json.dumps(x) for x in json.loads(line)) for line in open(tmp_path / run / "calls.jsonl")]
        assert max(executed.count(c) for c in executed) == 2, run  # each call once per sample (n = 2)
        for key, *_ in calls:
            for t in range(key % 3):
                assert executed.count(('"add"', json.dumps({"a": key, "b": 100 + t}))) == 2, (run, key, t)


def _budget_body(stream: bool, budget: int):
    """Four steps of the stand-in pool with a step token budget: per step, the groups trained (over the ranks) and
    the pool's figures."""
    import torch.distributed as dist

    from lib.balance import balance_groups
    from lib.partial import loop

    run = _stand_in_run(stream)
    run.cfg.rollout.partial.step_token_budget = budget
    out = []
    for step in range(4):
        batch, metrics = loop.generate_step(run, step)
        batch, _ = balance_groups(batch)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, sorted(set(batch.non_tensor_batch["uid"].tolist())))
        out.append((sum(map(len, every)), metrics))
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["chunks", "stopped_mid_call"])
def test_a_step_token_budget_stops_generation_with_the_groups_it_holds(stream):
    """A budget of 24 tokens a step (a chunk of 4 tokens over 20 samples is 80): every step stops at its first count,
    and trains the complete groups it holds, a multiple of the 2 ranks, at least one a rank, at most
    train_batch_size; the figures say how many."""
    from lib.testing import run_distributed

    steps = run_distributed(_budget_body, stream, 24, world_size=2)[0]
    trained = [n for n, _ in steps]
    assert all(n % 2 == 0 and 2 <= n <= 4 for n in trained) and min(trained) < 4, trained
    assert [m["partial/trained_groups"] for _, m in steps] == trained
    assert all(m["partial/rounds"] == 1 for _, m in steps), steps
    # without a budget every step trains train_batch_size groups
    assert [n for n, _ in run_distributed(_budget_body, stream, 0, world_size=2)[0]] == [4] * 4


# ---- no finished work wasted: a complete group left over at a step's end trains in the next step

def _waste_body(stream: bool, steps: int):
    """``steps`` steps of the stand-in pool in chunks of 3 (the issue's shape: responses up to 24, a pool of 2.5 x,
    staleness 1): the finished samples that never trained (complete groups dropped from the pool), the trained
    samples, and each step's oldest trained token's age, over the ranks."""
    import torch.distributed as dist

    from lib.partial import loop
    from lib.partial.carry import groups

    run = _stand_in_run(stream)
    run.cfg.rollout.partial.chunk_tokens = 3
    wasted, trained, oldest = 0, 0, []
    for step in range(steps):
        complete = {uid: len(g) for uid, g in groups(run.partial).items() if all(s.ended for s in g)}
        batch, _ = loop.generate_step(run, step)
        kept = {s.uid for s in run.partial} | set(batch.non_tensor_batch["uid"].tolist())
        wasted += sum(n for uid, n in complete.items() if uid not in kept)
        trained += len(batch)
        versions = batch.batch["rollout_versions"][batch.batch["response_mask"].bool()]
        oldest.append(step - int(versions.min()) if versions.numel() else 0)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (wasted, trained, oldest))
    return sum(w for w, _, _ in every), sum(t for _, t, _ in every), [max(o) for o in zip(*(o for *_, o in every))]


@pytest.mark.parametrize("stream", [False, True], ids=["chunks", "stopped_mid_call"])
def test_no_finished_sample_goes_untrained(stream):
    """Over 12 steps on 2 ranks, every complete group left over at a step's end trains in the next one: no finished
    sample is dropped as stale, and a trained token is at most max_staleness + 1 steps old (a group completed under
    the cap, then one step in the queue). Before the fix the staleness drop judged a complete group as it judged one
    still generating, by its first tokens against the step: a group carried once and completed, left over, was
    dropped at the next step's start (the issue: 256 finished samples of one step never trained)."""
    from lib.testing import run_distributed

    wasted, trained, oldest = run_distributed(_waste_body, stream, 12, world_size=2)[0]
    assert wasted == 0 and trained == 12 * 8, (wasted, trained, oldest)
    assert max(oldest) == 2, oldest  # some trained groups waited a step, none longer
