"""VLLMEngine.generate_until with a batch in flight, as vLLM 0.25 steps on CUDA (async scheduling; the CPU build never
does): driven through tests/fake_vllm_async.py's engine, which lags one step and keeps a batch queued after an abort.
Direct calls, two ranks stopping together, and the partial pool (single-turn samples and tool episodes carried
mid-turn) through it. No vLLM needed."""

import threading

import pytest

from tests import fake_vllm_async as fake

EOS = 1


def _length(first: int) -> int:
    """The response's length for a prompt starting with ``first`` (its EOS included)."""
    return 3 + 6 * (first % 5)


def _toy(prompt: list[int], position: int) -> tuple[int, float]:
    """Sampling that depends on the prompt and the position only; each token's log-prob names both."""
    first = prompt[0]
    token = EOS if position == _length(first) - 1 else 2 + (first * 13 + position * 7) % 40
    return token, -(first * 1000 + position + 1) / 1e5


def _expected(prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    pairs = [_toy(prompt, j) for j in range(n)]
    return [t for t, _ in pairs], [lp for _, lp in pairs]


@pytest.fixture
def engine(monkeypatch):
    fake.install(monkeypatch.setattr)
    return fake.vllm_engine(_toy, [EOS], max_new_tokens=40)


def _stop_after(calls: int, log: list):
    """``enough`` answering True at its ``calls``-th call or once no request runs (one rank); ``log`` gets each call's
    (finished, sampled)."""
    def enough(finished, sampled):
        log.append((list(finished), sampled))
        return len(log) >= calls or all(finished)
    return enough


def _logged_steps(engine) -> tuple[list, list]:
    """Each step's outputs as a list of (request id, tokens), and the ids the engine dropped in it, appended to the
    two returned lists."""
    core, seen, dropped = engine.llm.llm_engine, [], []
    step = core.step

    def logged():
        before = len(core.dropped)
        out = step()
        seen.append([(o.request_id, list(o.outputs[0].token_ids)) for o in out])
        dropped.append(core.dropped[before:])
        return out
    core.step = logged
    return seen, dropped


def test_generate_until_stopped_with_a_batch_in_flight_returns_what_was_delivered(engine):
    """Stopped after 2 rounds of 4 engine steps: the first step only scheduled, so 7 tokens came back per running
    request; each Turn holds exactly the tokens delivered, in order, with one log-prob per token (its own position's),
    ``stopped`` True only for the request that ended on EOS; the one capped at 5 tokens ends there (never scheduled
    past its cap). One batch stays queued after the abort; the next call's first step pops it, delivers nothing of
    it, and that call's requests get their own tokens from position 0."""
    core = engine.llm.llm_engine
    steps, dropped = _logged_steps(engine)
    prompts, caps = [[10, 4], [11], [12, 9, 9], [14]], [40, 40, 5, 40]  # lengths 3, 9, 15, 27
    log: list = []
    got = engine.generate_until(prompts, caps, 0, None, _stop_after(2, log), 4)
    assert steps[0] == [] and len(steps) == 8 and len(log) == 2
    assert [len(t.ids) for t in got] == [3, 7, 5, 7]
    assert [t.stopped for t in got] == [True, False, False, False]
    for p, t in zip(prompts, got):
        assert (t.ids, t.logps) == _expected(p, len(t.ids)), p
    delivered = [[tok for step in steps for r, ids in step if r == rid for tok in ids] for rid in core.added]
    assert delivered == [t.ids for t in got]
    assert log[0] == ([True, False, False, False], 3 + 3 + 3 + 3) and log[1][1] == 3 + 7 + 5 + 7
    # the abort left one batch in flight, with tokens of the two requests still running
    assert core.in_flight() == 1 and {rid for rid, *_ in core.queue[0]} == {"until-1-1", "until-1-3"}
    assert not core.has_unfinished_requests() and not core.requests

    assert dropped[:8] == [[]] * 4 + [["until-1-0"]] + [[]] * 3  # EOS's token unknown when the next batch was made
    steps.clear(), dropped.clear()
    again = engine.generate_until([[11], [13]], [40, 40], 1, None, _stop_after(100, []), 2)
    assert steps[0] == [] and dropped[0] == ["until-1-1", "until-1-3"]  # the stale batch popped first, dropped
    assert all(rid.startswith("until-2-") for step in steps for rid, _ in step)
    assert [(t.ids, t.logps) for t in again] == [_expected([11], 9), _expected([13], 21)]
    assert all(t.stopped for t in again)


def test_a_plain_generate_after_a_stopped_call_sees_no_stray_request(engine):
    """generate_ids and generate (vLLM's LLM.generate: finished requests sorted by int(request_id), which a stray
    'until-...' id would break) after a generate_until whose stop left a batch in flight: their requests are exactly
    their own, from position 0, and the stale batch is popped by their first step."""
    import torch

    from lib.protocol import DataProto

    core = engine.llm.llm_engine
    engine.generate_until([[12], [14]], [40, 40], 0, None, _stop_after(1, []), 3)
    assert core.in_flight() == 1
    stale = core.stale
    turns = engine.generate_ids([[11], [10, 3]], [40, 4], False, 0)
    assert core.dropped[stale:stale + 2] == ["until-1-0", "until-1-1"]
    assert [(t.ids, t.logps, t.stopped) for t in turns] == [(*_expected([11], 9), True), (*_expected([10], 3), True)]

    engine.generate_until([[13], [14]], [40, 40], 1, None, _stop_after(1, []), 3)
    assert core.in_flight() == 1
    stale = core.stale
    ids = torch.tensor([[0, 12, 5], [13, 6, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    data = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": positions},
                               meta_info={"seed_key": 0})
    out = engine.generate(data)
    assert core.dropped[stale:stale + 2] == ["until-2-0", "until-2-1"]
    for row, prompt in enumerate([[12, 5], [13, 6, 6]]):
        width = int(out.batch["response_mask"][row].sum())
        ids, logps = _expected(prompt, width)
        assert width == _length(prompt[0]) and out.batch["responses"][row, :width].tolist() == ids
        assert out.batch["rollout_log_probs"][row, :width].tolist() == pytest.approx(logps)


def test_requests_stopped_before_their_first_output_come_back_empty(monkeypatch):
    """With room for 2 sequences, 4 requests stopped after one round of 4 steps: the 2 running ones bring their 3
    delivered tokens, the 2 still waiting none (``stopped`` False: carried whole); the next call runs clean."""
    fake.install(monkeypatch.setattr)
    engine = fake.vllm_engine(_toy, [EOS], max_new_tokens=40, max_num_seqs=2)
    prompts = [[12], [13], [14], [11]]
    got = engine.generate_until(prompts, [40] * 4, 0, None, _stop_after(1, []), 4)
    assert [len(t.ids) for t in got] == [3, 3, 0, 0] and not any(t.stopped for t in got)
    for p, t in zip(prompts, got):
        assert (t.ids, t.logps) == _expected(p, len(t.ids))
    again = engine.generate_until([[10], [11]], [40, 40], 1, None, _stop_after(100, []), 4)
    assert [(t.ids, t.logps) for t in again] == [_expected([10], 3), _expected([11], 9)]


class _SumOverThreads:
    """An all-reduce (sum) over ``n`` threads standing in for ranks; a rank that stops asking while another asks
    breaks the barrier (an error here, a hang on real ranks)."""

    def __init__(self, n: int):
        self.barrier, self.values = threading.Barrier(n, timeout=10), [None] * n

    def __call__(self, rank: int, values: list[float]) -> list[float]:
        self.values[rank] = values
        self.barrier.wait()
        total = [sum(v[i] for v in self.values) for i in range(len(values))]
        self.barrier.wait()
        return total


@pytest.mark.parametrize("prompts", [([[10], [11]], [[14], [13], [12]]), ([], [[14], [12]])],
                         ids=["both_generate", "one_rank_idle"])
def test_two_ranks_ask_enough_equally_often_and_stop_together(monkeypatch, prompts):
    """Two ranks (threads, each its own engine; ``enough`` sums over them as lib.partial's does): a rank whose
    requests finish early, or that has none, keeps asking while the other's run; both ask as often, stop at the
    same call (a token budget of 20 over the ranks), and each keeps exactly what its engine delivered. The call
    after it starts clean on both."""
    fake.install(monkeypatch.setattr)
    reduce = _SumOverThreads(2)
    engines = [fake.vllm_engine(_toy, [EOS], max_new_tokens=40) for _ in range(2)]
    calls, results, errors = [0, 0], [None, None], []

    def rank(r: int, own: list[list[int]], key: int) -> None:
        def enough(finished, sampled):
            calls[r] += 1
            running, total = reduce(r, [float(sum(not f for f in finished)), float(sampled)])
            return running == 0 or total >= 20
        try:
            results[r] = engines[r].generate_until(own, [40] * len(own), key, None, enough, 2)
        except Exception as e:  # noqa: BLE001 - reported by the test's thread
            errors.append(e)
            reduce.barrier.abort()

    for key in (0, 1):
        calls[:] = [0, 0]
        threads = [threading.Thread(target=rank, args=(r, prompts[r], key)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert calls[0] == calls[1] > 1, calls
        for r in range(2):
            for p, t in zip(prompts[r], results[r]):
                assert (t.ids, t.logps) == _expected(p, len(t.ids)), (r, p)
        sampled = sum(len(t.ids) for r in range(2) for t in results[r])
        assert 20 <= sampled, sampled
    # the stop left a batch in flight on the rank still generating
    assert engines[1].llm.llm_engine.in_flight() == 1 and engines[1].llm.llm_engine.stale > 0


def _tp_body():
    """A TP-2 group (the 2 ranks): each rank's engine runs the group's gathered requests, as external_launcher's do;
    ``enough`` sums over the ranks. Two calls; returns per call this rank's (ids, log-probs, stopped), enough's calls,
    and the request ids its engine ran."""
    import torch
    import torch.distributed as dist

    fake.install()
    rank = dist.get_rank()
    engine = fake.vllm_engine(_toy, [EOS], max_new_tokens=40, tp_size=2)
    engine.topo.rollout_tp_rank = rank
    own = [[[10], [11]], [[14]]][rank]
    out, calls = [], []
    for key in (0, 1):
        calls.append(0)

        def enough(finished, sampled):
            calls[-1] += 1
            counts = torch.tensor([float(sum(not f for f in finished)), float(sampled)])
            dist.all_reduce(counts)  # world (the TP group here): what every rank's requests sampled
            return counts[0] == 0 or counts[1] >= 12
        got = engine.generate_until(own, [40] * len(own), key, None, enough, 2)
        out.append([(t.ids, t.logps, t.stopped) for t in got])
    return out, calls, engine.llm.llm_engine.added, engine.llm.llm_engine.stale


def test_a_tp2_group_generates_its_gathered_requests_and_each_rank_keeps_its_own():
    """Tensor parallel 2: both ranks' engines run the group's gathered requests under the same ids, step alike, stop
    at the same call, and each rank gets exactly its own requests' delivered tokens and log-probs; the stop left a
    batch in flight that the second call popped and dropped."""
    from lib.testing import run_distributed

    ranks = run_distributed(_tp_body, world_size=2)
    (out0, calls0, added0, stale0), (out1, calls1, added1, stale1) = ranks
    assert calls0 == calls1 and added0 == added1 == [f"until-{c}-{i}" for c in (1, 2) for i in range(3)]
    assert stale0 == stale1 > 0
    for out, own in ((out0, [[10], [11]]), (out1, [[14]])):
        for call in out:
            assert len(call) == len(own)
            for p, (ids, logps, stopped) in zip(own, call):
                assert (ids, logps) == _expected(p, len(ids)) and stopped == (len(ids) == _length(p[0]))
    assert [len(ids) for ids, *_ in out0[0] + out1[0]] == [3, 5, 5]  # stopped at 3 rounds of 2 steps: 5 delivered


# ---- the partial pool (lib/partial/loop.py) through the engine: its vLLM branch, one generate_until a round

def _stand_in_model(seq: list[int], position: int) -> tuple[int, float]:
    """tests/test_partial_pool.py's stand-in samples, one position at a time: a function of the prompt's row and the
    response position, so a sample continued anywhere is the same sample."""
    from tests.test_partial_pool import _length as length
    from tests.test_partial_pool import _prompt

    row = seq[0] - 10
    j = len(seq) - len(_prompt(row)) + position
    if j >= length(row):  # past the stop token: a batch scheduled before the stop was known (discarded)
        return 99, 0.0
    return (EOS if j == length(row) - 1 else (row * 31 + j) % 50 + 2), -0.01 * (row + j + 1)


def _pool_body(steps: int, max_num_seqs: int = 0):
    """generate_step on this world's ranks for ``steps`` steps through one fake-vLLM VLLMEngine per rank (kept across
    steps, as a run keeps its engine: a stale batch crosses into the next step; ``max_num_seqs``: its room). Returns
    the trained samples of every rank per step (uid, tokens, versions, log-probs), the pool's metrics, and this rank's
    (enough's calls per generate_until, stale outputs dropped, requests that came back without a token)."""
    import torch.distributed as dist

    from lib.balance import balance_groups
    from lib.partial import loop
    from tests.test_partial_pool import _stand_in_run

    fake.install()
    run = _stand_in_run(True)
    engine = fake.vllm_engine(_stand_in_model, [EOS], max_new_tokens=24, max_num_seqs=max_num_seqs)
    asked: list[int] = []
    until = engine.generate_until

    def counted(prompts, max_tokens, key, media, enough, every):
        asked.append(0)

        def counting(finished, sampled):
            asked[-1] += 1
            return enough(finished, sampled)
        got = until(prompts, max_tokens, key, media, counting, every)
        empty[0] += sum(not t.ids for t in got)
        return got

    empty = [0]
    engine.generate_until = counted
    loop.generate = lambda run, prompts, produce: (produce(engine), {"timing/generate_s": 0.0})
    out = []
    for step in range(steps):
        batch, metrics = loop.generate_step(run, step)
        batch, _ = balance_groups(batch)
        b, mine = batch.batch, []
        for i in range(len(batch)):
            width = int(b["response_mask"][i].sum())
            mine.append((batch.non_tensor_batch["uid"][i], b["responses"][i, :width].tolist(),
                         b["rollout_versions"][i, :width].tolist(),
                         [round(x, 6) for x in b["rollout_log_probs"][i, :width].tolist()]))
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        out.append((sorted(x for part in every for x in part),
                    {k: v for k, v in metrics.items() if not k.startswith("timing/")}))
    return out, asked, engine.llm.llm_engine.stale, empty[0]


@pytest.mark.parametrize("max_num_seqs", [0, 6], ids=["all_admitted", "some_waiting"])
def test_the_partial_pools_vllm_branch_carries_samples_stopped_with_a_batch_in_flight(max_num_seqs):
    """Six steps of the pool, one generate_until a round through the lagging engine: every trained sample is its
    row's whole sample (tokens and log-probs, one per token, as the stand-in's full sequence) though it was stopped
    mid-call and continued, its tokens' versions never decrease, and some samples were carried over a step; stale
    outputs (a batch popped after an abort) were dropped, never delivered. Every request admitted: the 2-rank run
    trains what the 1-rank run does, and both ranks ask ``enough`` as often in every call. Room for 6 sequences (1
    rank): some requests are stopped while still waiting, before any output."""
    from lib.testing import run_distributed
    from tests.test_partial_pool import _length as length

    steps = 6
    (ref, ref_asked, ref_stale, empty), = run_distributed(_pool_body, steps, max_num_seqs, world_size=1)
    assert ref_stale > 0 and (empty > 0) == bool(max_num_seqs), empty
    if not max_num_seqs:
        two = run_distributed(_pool_body, steps, world_size=2)
        assert two[0][0] == two[1][0] == ref
        assert two[0][1] == two[1][1] and len(two[0][1]) >= steps, (two[0][1], two[1][1])
        assert two[0][2] + two[1][2] > 0
    carried = 0
    for samples, metrics in ref:
        assert len(samples) == 8
        for uid, ids, versions, logps in samples:
            row = int(uid.split("-")[1])
            n = min(length(row), 24)
            want = [_stand_in_model([10 + row] + [5] * (row % 3), j) for j in range(n)]
            assert ids == [t for t, _ in want] and logps == [round(lp, 6) for _, lp in want], uid
            assert versions == sorted(versions)
            carried += versions[0] != versions[-1]
    assert carried > 0
    assert sum(m["partial/stopped_mid_call"] for _, m in ref) > 0


# ---- tool episodes in the pool through the engine: a turn in flight stopped with a batch in flight

def _mt_body(folder: str, steps: int):
    """tests/test_partial_pool.py's multi-turn pool (n 2, chunks of 8 tokens) through a fake-vLLM VLLMEngine whose
    sampling is that file's _TurnEngine one position at a time. Returns the trained rows per step, as its _mt_body,
    and the stale outputs dropped."""
    import pathlib

    from lib import toy
    from lib.config import MultiTurnConfig
    from lib.multi_turn.loop import MultiTurn
    from lib.partial import loop
    from tests.helpers import TOOLS, prompts_for, row
    from tests.test_partial_pool import MT_KEYS, _CallLog, _mt_pool_run, _mt_rows, _TurnEngine

    tok = toy.build_tool_tokenizer(f"{folder}/tok")
    data = prompts_for(tok, [row(f"key {k}") for k in range(MT_KEYS)], pathlib.Path(folder), TOOLS)
    mt = MultiTurn(MultiTurnConfig(tools=TOOLS, max_turns=4), tok, 128, pool=_CallLog(f"{folder}/calls.jsonl", TOOLS))
    turns = _TurnEngine(tok)

    def model(seq, position):
        out = turns.generate_ids([seq], [position + 1], False, None)[0]
        return (out.ids[position], out.logps[position]) if position < len(out.ids) else (0, 0.0)

    fake.install()
    engine = fake.vllm_engine(model, [turns.end], max_new_tokens=128)
    run = _mt_pool_run(tok, data, mt, lambda: engine)
    out = []
    for step in range(steps):
        batch, _ = loop.generate_step(run, step)
        out.append(_mt_rows(tok, batch, True))
    return out, engine.llm.llm_engine.stale


def test_tool_episodes_carried_mid_turn_through_the_lagging_engine_are_the_whole_turn_rollouts(tmp_path_factory):
    """Tool episodes in the pool, each round one generate_until through the lagging engine: every trained row (tokens,
    response mask, log-probs, turns, last turn) is the one the multi-turn rollout makes in whole turns
    (tests/test_partial_pool.py's reference), though turns were stopped with a batch in flight and carried; each tool
    call ran once per sample."""
    import json

    from lib.testing import run_distributed
    from tests.test_partial_pool import _mt_body as reference

    tmp_path = tmp_path_factory.mktemp("episodes")  # not tmp_path: conftest would link (and build) the toy tasks
    (ref,) = run_distributed(reference, str(tmp_path / "ref"), 0, 0, 0, True, world_size=1)
    expect = {r[0]: r[1:4] + r[5:] for r in ref}
    steps = 6
    ((got, stale),) = run_distributed(_mt_body, str(tmp_path / "until"), steps, world_size=1)
    trained = [r for step in got for r in step]
    assert len(trained) == 2 * 2 * steps and stale > 0
    for key, ids, mask, logps, versions, turns, last in trained:
        assert (ids, mask, logps, turns, last) == expect[key], key
    calls = [r for r in trained if 0 in r[2]]
    assert any(r[5] == 3 for r in calls), trained
    # a turn in flight carried: the version changes between two sampled tokens of one turn
    assert any(v[i] != v[i + 1] and m[i] and m[i + 1] for _, _, m, _, v, *_ in calls for i in range(len(v) - 1))
    executed = [tuple(json.dumps(x) for x in json.loads(line)) for line in open(tmp_path / "until" / "calls.jsonl")]
    assert max(executed.count(c) for c in executed) == 2  # each call once per sample (n = 2)
