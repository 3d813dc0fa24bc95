"""Environments and task libraries from the ecosystem (lib/envs): reasoning-gym's tasks as data."""

import json
import os

import pytest

from tests.helpers import launch_runs, run_rows

rg = pytest.importorskip("reasoning_gym", reason="the envs-test extra (test.sh adds it to .venv)")

TASKS = ["leg_counting", "basic_arithmetic", "chain_sum", "word_sorting"]


def _responses(entry: dict) -> list[str]:
    """Responses to one entry: the right answer in tags, with text around, a wrong one, none, two tags (the last
    counts), and the answer without tags."""
    answer = str(entry["answer"])
    return [f"<answer>{answer}</answer>", f"Let me think.\n<answer> {answer} </answer>\nDone.",
            "<answer>definitely wrong</answer>", "no answer here", f"<answer>x</answer> <answer>{answer}</answer>",
            answer, f"<answer>{answer[:max(1, len(answer) // 2)]}</answer>"]


def test_reasoning_gym_rows_score_as_the_library_scores_them(tmp_path):
    """Rows built offline (several tasks, a generator setting, a seed): each row's prompt is the library's question
    under its system prompt, and our scorer (through the reward workers, as training scores) gives every response
    exactly the library's own score on a dataset made apart from ours."""
    from lib.envs import reasoning_gym as rg_data
    from lib.rewards.pool import RewardPool

    name = f"reasoning_gym:{','.join(TASKS)}:size=6:seed=7:basic_arithmetic.max_terms=3"
    path = rg_data.build(name, str(tmp_path))
    assert rg_data.build(name, str(tmp_path)) == path  # written once
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 6 * len(TASKS)
    samples, expected = [], []
    for row in rows:
        where = row["extra_info"]["reasoning_gym"]
        settings = {"max_terms": 3} if where["task"] == "basic_arithmetic" else {}
        ds = rg.create_dataset(where["task"], seed=7, size=6, **settings)  # the library's own, made apart
        entry = ds[where["index"]]
        assert row["prompt"][-1] == {"role": "user", "content": entry["question"]}
        assert row["prompt"][0] == {"role": "system", "content": rg.utils.SYSTEM_PROMPTS["default"]}
        assert row["data_source"] == f"reasoning_gym/{where['task']}"
        assert row["reward_model"]["ground_truth"] == str(entry["answer"])
        for text in _responses(entry):
            samples.append((row["data_source"], text, row["reward_model"]["ground_truth"], row["extra_info"], None))
            expected.append(float(ds.score_answer(rg.utils.extract_answer(text), entry)))
    pool = RewardPool("", 30.0, 2)
    try:
        results = pool.score(samples)
    finally:
        pool.close()
    assert [r[3] for r in results] == [""] * len(samples), results[:3]  # no scorer failure
    assert [r[0] for r in results] == expected
    assert {0.0, 1.0} <= set(expected)  # the responses reach both ends
    assert any(0 < s < 1 for s in expected)  # and a partial score (word_sorting / arithmetic's own rules)


def test_reasoning_gym_spec_errors_name_the_fix(tmp_path):
    from lib.envs import reasoning_gym as rg_data

    cases = {"reasoning_gym:": "names no task", "reasoning_gym:leg_counting:size": "is not key=value",
             "reasoning_gym:leg_counting:size=x": "is not an integer",
             "reasoning_gym:leg_counting:color=red": "unknown option 'color'",
             "reasoning_gym:no_such_task": "has no task ['no_such_task']",
             "reasoning_gym:leg_counting:leg_counting.bogus=1": "refuses the settings",
             "reasoning_gym:leg_counting:system=loud": "is not one of the library's system prompts"}
    for name, expected in cases.items():
        with pytest.raises(ValueError, match=None) as e:
            rg_data.build(name, str(tmp_path))
        assert expected in str(e.value), (name, str(e.value))
    assert not os.path.exists(tmp_path / "reasoning_gym") or not os.listdir(tmp_path / "reasoning_gym")


def test_reasoning_gym_not_installed_names_the_pip_command(monkeypatch, tmp_path):
    import sys

    from lib.envs import reasoning_gym as rg_data

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises ImportError
    with pytest.raises(ValueError, match=r"pip install -e '\.\[reasoning-gym\]'"):
        rg_data.build("reasoning_gym:leg_counting", str(tmp_path))


@pytest.fixture(scope="module")
def env_runs(tmp_path_factory):
    from tests import zoo

    root = tmp_path_factory.mktemp("env_runs")
    model = zoo.build("qwen2_tied", str(root / "zoo"))
    common = ["--actor.model.path", model, "--trainer.output_root", str(root), "--rollout.n", "2",
              "--trainer.train_batch_size", "4", "--actor.mini_batch_size", "8",
              "--actor.batching.micro_batch_size_per_rank", "4", "--trainer.total_steps", "2"]
    plan = [("reasoning_gym", "train_grpo.py", [
        *common, "--trainer.run_name", "reasoning_gym",
        "--data.train_files", "reasoning_gym:leg_counting,basic_arithmetic:size=16:system=none",
        "--data.val_files", "reasoning_gym:leg_counting,basic_arithmetic:size=4:seed=1000:system=none",
        "--data.max_prompt_length", "320", "--rollout.max_response_length", "16", "--trainer.val_every", "2"])]
    return root, launch_runs(plan, root)


def test_reasoning_gym_trains_and_validates_per_task(env_runs):
    """Two GRPO steps on 2 ranks of rows named reasoning_gym:...; validation reports each task apart."""
    rows = run_rows(env_runs, "reasoning_gym")
    train = [r for r in rows if "val/mean@1" not in r]
    val = [r for r in rows if "val/mean@1" in r]
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in val] == [0, 2], env_runs[1].stderr[-3000:]
    for r in train:
        assert r["rollout/logp_abs_diff"] < 1e-5, r
        assert r["reward/errors"] == 0 and r["reward/invalid"] == 0, r
    for task in ("leg_counting", "basic_arithmetic"):
        assert f"val/reasoning_gym/{task}/mean@1" in val[-1], val[-1]
