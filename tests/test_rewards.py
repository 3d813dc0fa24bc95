"""Scoring in the reward worker pool: every way a scorer can fail costs its sample only, and maj@N votes on the
extracted answer."""

import os

import pytest
import torch

from lib.protocol import DataProto
from lib.rewards import interpret, load_custom, rule_for
from lib.rewards.pool import RewardPool
from lib.rewards.scorer import Scorer
from lib.validation import majority_score

FAULTY = '''
import math, os, sys, time

def score(data_source, solution_str, ground_truth, extra_info):
    kind = solution_str
    if kind == "raise": raise RuntimeError("bad row")
    if kind == "nan": return math.nan
    if kind == "none": return None
    if kind == "string": return "1.0"
    if kind == "noscore": return {"acc": 1.0}
    if kind == "exit": sys.exit(3)
    if kind == "crash": os._exit(9)
    if kind == "sleep": time.sleep(60)
    if kind == "busy_c": return float(sum(range(10**10)))  # busy in C: no signal handler would run
    return {"score": 0.5, "format": 1.0, "pid": os.getpid(), "answer": kind[-1:]}
'''


@pytest.fixture
def faulty(tmp_path):
    path = tmp_path / "faulty.py"
    path.write_text(FAULTY)
    return f"{path}:score"


def test_every_fault_kind_costs_its_sample_only(faulty):
    pool = RewardPool(faulty, timeout_s=1.0, num_workers=2)
    try:
        kinds = ["ok1", "raise", "ok2", "nan", "none", "string", "noscore", "exit", "crash", "ok3", "busy_c",
                 "sleep", "ok4"]
        results = pool.score([("x", k, "gt", None) for k in kinds])
        got = {k: r for k, r in zip(kinds, results)}
        expected_kind = {"raise": "errors", "nan": "invalid", "none": "invalid", "string": "invalid",
                         "noscore": "invalid", "exit": "exits", "crash": "crashes", "busy_c": "timeouts",
                         "sleep": "timeouts"}
        for k, (score, extras, answer, kind, message) in got.items():
            assert kind == expected_kind.get(k, ""), (k, kind, message)
            assert score == (0.0 if kind else 0.5)
            assert bool(message) == bool(kind)
        assert "RuntimeError: bad row" in got["raise"][4] and "sys.exit(3)" in got["exit"][4]
        assert "exit code 9" in got["crash"][4] and "timeout_s=1" in got["busy_c"][4]
        assert got["ok3"][2] == "3" and got["ok3"][1]["format"] == 1.0
        pids = {r[1]["pid"] for r in results if not r[3]}
        assert os.getpid() not in pids  # scored in worker processes
        # the pool replaced the killed workers and still scores
        again = pool.score([("x", "ok5", "gt", None)] * 5)
        assert [r[0] for r in again] == [0.5] * 5
    finally:
        pool.close()


def test_scorer_places_scores_counts_kinds_and_keeps_answers(faulty):
    from lib.toy import build_tokenizer
    import tempfile

    tok = build_tokenizer(tempfile.mkdtemp())
    ids = lambda s: [tok.convert_tokens_to_ids(c) for c in s]  # noqa: E731 - the toy tokenizer is per character
    scorer = Scorer(tok, faulty, timeout_s=1.0, num_workers=1)
    try:
        data = DataProto.from_dict({"responses": torch.tensor([ids("12"), ids("3,"), ids("45")]),
                                    "response_mask": torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])},
                                   {"data_source": ["x"] * 3, "ground_truth": ["a"] * 3})
        scored = scorer(data)
        assert scored.scores == [0.5, 0.5, 0.5]
        assert scored.answers == ["2", "3", ""]  # "3," decodes to "3" (the masked token is padding)
        # each score on its response's last token; an empty response carries none
        assert scored.token_scores.tolist() == [[0.0, 0.5], [0.5, 0.0], [0.0, 0.0]]
        assert scored.metrics["reward/format"] == 1.0
        assert all(scored.metrics[f"reward/{k}"] == 0 for k in ("errors", "invalid", "exits", "crashes", "timeouts"))
    finally:
        scorer.close()


def test_interpret_return_values():
    import numpy as np

    assert interpret(1) == (1.0, {}, None, "")
    assert interpret(True) == (1.0, {}, None, "")
    assert interpret(np.float32(0.25))[0] == 0.25
    assert interpret({"score": 1.0, "acc": 1, "answer": 42, "note": "x"}) == (1.0, {"acc": 1.0}, "42", "")
    assert interpret({"score": 1.0, "pred": "7"})[2] == "7"
    for bad in (None, "1", float("inf"), {"acc": 1.0}, {"score": None}, [1.0]):
        assert interpret(bad)[3] == "invalid", bad


def test_custom_reward_files_are_checked():
    with pytest.raises(ValueError, match="path/to/file.py:function_name"):
        load_custom("nofunction")
    with pytest.raises(ValueError, match="does not exist"):
        load_custom("/nope.py:f")
    with pytest.raises(ValueError, match="no scorer for data_source 'weird'"):
        rule_for("weird")


def test_custom_reward_that_fails_to_import_or_lacks_the_function(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match="failed to import: ModuleNotFoundError"):
        load_custom(f"{f}:score")
    f.write_text("def other(): pass\n")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load_custom(f"{f}:nope")


def test_majority_vote_uses_the_extracted_answer():
    # four different texts, three of which extract to the same answer "18" (score 1), one to "17" (score 0)
    samples = [(0.0, "17"), (1.0, "18"), (1.0, "18"), (1.0, "18")]
    assert majority_score(samples) == 1.0
    # ties go to the vote seen first, and the score is that of its first sample (verl's calc_maj_val)
    assert majority_score([(0.0, "a"), (1.0, "b"), (0.5, "a"), (1.0, "b")]) == 0.0
    assert majority_score([(1.0, "b"), (0.0, "a"), (0.0, "a"), (1.0, "b")]) == 1.0
    assert majority_score([(0.3, "only")]) == 0.3


def test_gsm8k_and_math_scorers_return_the_answer():
    from lib.rewards import builtin

    assert builtin.gsm8k("so it is 3+15 = 18 #### 18", "18")["answer"] == "18"
    assert builtin.gsm8k("the total is #### 1,800.0", "1800")["answer"] == "1800"
    assert builtin.math_answer("thus \\boxed{\\frac12}", "\\frac{1}{2}")["answer"] == "\\frac12"


def test_workers_outlive_stop_signals_and_lost_workers_are_replaced(faulty):
    """A scheduler signals every process of the job: the workers died of SIGTERM / SIGUSR1 and the rank crashed in
    the next score stage (BrokenPipeError) before it could save. Workers now ignore the stop signals; one lost
    while idle is replaced and its chunk sent again."""
    import signal
    import time

    pool = RewardPool(faulty, timeout_s=10.0, num_workers=2)
    try:
        time.sleep(2)  # the workers have installed their dispositions
        for w in pool.workers:
            for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):
                os.kill(w.proc.pid, sig)
        time.sleep(0.5)
        assert all(w.proc.poll() is None for w in pool.workers)
        lost = pool.workers[0]
        lost.proc.kill()  # lost while idle: the next send meets a broken pipe
        lost.proc.wait()
        out = pool.score([("toy", f"ok{i}", None, None) for i in range(8)])
        assert [r[3] for r in out] == [""] * 8 and [r[0] for r in out] == [0.5] * 8
        assert lost not in pool.workers
    finally:
        pool.close()


def test_a_workers_start_up_is_no_samples_time(tmp_path):
    """A scorer whose import takes longer than the time limit (a slow start on a loaded machine, a heavy module):
    the limit counts from the worker's ready report, so its first samples score. Before the fix the clock started
    at the spawn and the first sample of every fresh worker timed out."""
    path = tmp_path / "slow_import.py"
    path.write_text("import time\ntime.sleep(2.5)\n\ndef score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    return 1.0\n")
    pool = RewardPool(f"{path}:score", timeout_s=1.0, num_workers=2)
    try:
        results = pool.score([("x", str(i), "gt", None) for i in range(4)])
        assert [(r[0], r[3]) for r in results] == [(1.0, "")] * 4, results
    finally:
        pool.close()
