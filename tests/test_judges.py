"""LLM judges (lib/judges): the verdict parser's table, and the remote judge against a fake OpenAI-compatible server on
localhost (its cap on requests in flight, the retry matrix, the deadline, the cache, the budget, the key probe)."""

import pytest

from lib.judges.parse import DEADLINE, ERROR, OK, OVER_BUDGET, TRUNCATED, UNPARSED, raw_score, verdict
from lib.config import JudgeConfig
from lib.judges.remote import RemoteJudge
from tests.fake_openai import Server

SCALE, REWARD = (0.0, 10.0), (0.0, 1.0)


@pytest.mark.parametrize("text, truncated, how, score, status", [
    ('{"score": 7, "why": "fine"}', False, "json", 0.7, OK),
    ('first {"score": 2} then {"reason": "x", "score": 9.5}', False, "json", 0.95, OK),
    ("so the answer is \\boxed{4}", False, "boxed", 0.4, OK),
    ("\\boxed{8/10}", False, "boxed", 0.8, OK),
    ("Reasoning...\nScore: 7", False, "score", 0.7, OK),
    ("**Score:** 6/10", False, "score", 0.6, OK),
    ("<think>maybe Score: 1? no</think>Score: 9", False, "auto", 0.9, OK),  # the thinking's number is not the verdict
    ("<think>Score: 3 ... still thinking", False, "auto", None, TRUNCATED),  # an unclosed block: no verdict yet
    ("Score: 7", True, "auto", None, TRUNCATED),  # cut at the judge's token limit: masked even with a number
    ("I cannot grade this.", False, "auto", None, UNPARSED),
    ('{"score": "high"}', False, "json", None, UNPARSED),
    ("Score: 11", False, "auto", None, UNPARSED),  # outside the judge's scale
    ("Score: 0", False, "auto", 0.0, OK),  # the lowest score is a score, not a failure
    ('{"score": true}', False, "json", None, UNPARSED),
])
def test_the_parser_reads_each_form_and_flags_what_is_not_a_score(text, truncated, how, score, status):
    v = verdict(text, truncated, how, "score", SCALE, REWARD)
    assert v.status == status and (v.score == pytest.approx(score) if score is not None else v.score is None), v


def test_auto_prefers_json_then_boxed_then_score_lines():
    assert raw_score('Score: 1 {"score": 5}') == 5 and raw_score("Score: 1 \\boxed{3}") == 3
    assert raw_score('{"rating": 4}', "json", "rating") == 4


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


TEMPLATE = "Q: {question}\nA: {response}\nRef: {reference}\nGrade it."


def _judge(server, **settings) -> RemoteJudge:
    return RemoteJudge(JudgeConfig(server.url, "judge-model", backoff_s=0.001, **settings), TEMPLATE, "good")


def _items(*responses: str):
    return [("2+2?", r, "4") for r in responses]


def test_requests_in_flight_never_exceed_the_cap(server):
    judge = _judge(server, max_in_flight=3)
    verdicts, metrics = judge.score(_items(*(f"answer {i:02d}" for i in range(20))))
    assert [v.status for v in verdicts] == [OK] * 20 and 1 <= server.most_in_flight <= 3
    assert [v.score for v in verdicts] == [0.9] * 20 and metrics["judge/requests"] == 20


def test_429_500_and_time_outs_are_retried_and_other_4xx_are_not(server):
    server.plan = {"rate": [429, 429], "flaky": [500, 503], "slow": ["hold"], "bad": [400]}
    judge = _judge(server, timeout_s=3, max_retries=3)  # a held request times out; 3 s: any other one is back
    verdicts, metrics = judge.score(_items("rate", "flaky", "slow", "bad", "fine"))
    assert [v.status for v in verdicts] == [OK, OK, OK, ERROR, OK], verdicts
    calls = {k.split("A: ")[1].split("\n")[0]: n for k, n in server.calls.items()}
    assert calls == {"rate": 3, "flaky": 3, "slow": 2, "bad": 1, "fine": 1}
    assert metrics["judge/errors"] == 1 and metrics["judge/requests"] == 10


def test_a_request_out_of_retries_is_an_error_never_a_zero(server):
    server.plan = {"down": [500] * 10}
    verdicts, metrics = _judge(server, max_retries=2).score(_items("down"))
    assert verdicts[0].status == ERROR and verdicts[0].score is None and server.calls and metrics["judge/errors"] == 1


def test_a_slow_server_meets_the_deadline_and_its_samples_are_masked(server):
    server.plan = {"stuck": ["hold"] * 5}
    judge = _judge(server, timeout_s=60, deadline_s=3)  # the held request never answers; 3 s: the other one does
    verdicts, metrics = judge.score(_items("stuck", "quick"))
    assert [v.status for v in verdicts] == [DEADLINE, OK] and verdicts[0].score is None
    assert metrics["judge/deadline"] == 1


def test_a_duplicate_makes_one_call_and_a_repeat_none(server):
    judge = _judge(server)
    verdicts, metrics = judge.score(_items("same", "same", "other"))
    assert [v.score for v in verdicts] == [0.4, 0.4, 0.5] and metrics["judge/requests"] == 2
    assert metrics["judge/cache_hits"] == 1
    verdicts, metrics = judge.score(_items("same"))
    assert verdicts[0].score == 0.4 and metrics["judge/requests"] == 0 and metrics["judge/cache_hits"] == 1


def test_the_budget_stops_calls_and_the_usage_is_counted(server):
    judge = _judge(server, max_in_flight=1, budget_tokens=25)
    verdicts, metrics = judge.score(_items("a1", "a2", "a3", "a4", "a5"))
    assert [v.status for v in verdicts] == [OK, OK, OK, OVER_BUDGET, OVER_BUDGET]
    assert metrics["judge/tokens"] == 30 and judge.used_tokens == 30 and metrics["judge/over_budget"] == 2
    assert _judge(server).score(_items("a1"))[1]["judge/tokens"] == 10  # per judge: another one starts afresh


def test_a_verdict_cut_at_the_judges_token_limit_is_masked(server):
    server.plan = {"long": ["cut"]}
    verdicts, metrics = _judge(server).score(_items("long"))
    assert verdicts[0].status == TRUNCATED and verdicts[0].score is None and metrics["judge/parse_failures"] == 1


def test_a_wrong_key_or_url_is_one_clear_error_from_the_probe(server):
    RemoteJudge(JudgeConfig(server.url, "m"), TEMPLATE, "good").probe()
    with pytest.raises(ValueError, match="refused the key .HTTP 401.: set the environment variable"):
        RemoteJudge(JudgeConfig(server.url, "m"), TEMPLATE, "wrong").probe()
    with pytest.raises(ValueError, match="cannot be reached"):
        RemoteJudge(JudgeConfig("http://127.0.0.1:9/v1", "m", timeout_s=2), TEMPLATE).probe()


def test_the_probe_retries_as_training_does(server):
    """An endpoint that answers one request in three with HTTP 500 trains (training retries 5xx), so it must start:
    the start-up probe follows the same retry policy; out of retries it is one clear error naming the tries."""
    server.plan = {"Reply OK.": [500, 503]}
    RemoteJudge(JudgeConfig(server.url, "m", backoff_s=0.01, max_retries=2), TEMPLATE, "good").probe()
    assert server.calls["Reply OK."] == 3
    server.plan = {"Reply OK.": [500] * 10}
    with pytest.raises(ValueError, match=r"answered a probe with HTTP 500 \(3 tries\)"):
        RemoteJudge(JudgeConfig(server.url, "m", backoff_s=0.01, max_retries=2), TEMPLATE, "good").probe()


def test_a_json_verdict_is_asked_for_by_schema_and_a_server_without_guided_decoding_is_refused(server):
    """parse json: every request (the probe too) carries the verdict's JSON schema (response_format, guided decoding
    on the server: the field, numbers on the judge's scale); an endpoint that refuses the schema is one error at
    start-up naming the way out; the other parse modes ask for free text."""
    cfg = JudgeConfig(server.url, "m", parse="json", field="rating", scale_max=5)
    judge = RemoteJudge(cfg, TEMPLATE, "good")
    judge.probe()
    verdicts, _ = judge.score(_items("abc", "abcd"))
    assert [v.score for v in verdicts] == [3 / 5, 4 / 5] and [v.text for v in verdicts] == ['{"rating": 3}',
                                                                                             '{"rating": 4}']
    assert len(server.formats) == 3 and all(f["schema"]["required"] == ["rating"] for f in server.formats)
    assert server.formats[0]["schema"]["properties"]["rating"] == {"type": "number", "minimum": 0.0, "maximum": 5}
    _judge(server).score(_items("free"))
    assert len(server.formats) == 3  # parse auto: no schema sent
    plain = Server(guided=False)
    try:
        with pytest.raises(ValueError, match="HTTP 400.*a server without guided decoding refuses it; use parse auto"):
            RemoteJudge(JudgeConfig(plain.url, "m", parse="json"), TEMPLATE, "good").probe()
    finally:
        plain.close()


def test_unscored_rows_leave_the_update_and_their_groups(tmp_path):
    """A row the judge could not score leaves the update (response_mask 0, score 0) and its group (a uid of its
    own); with a group estimator a group left with fewer than two scored samples leaves whole; with PPO's GAE only
    the row itself."""
    import numpy as np
    import torch

    from lib.protocol import DataProto
    from lib.scoring import mask_unscored

    def batch():
        return DataProto.from_dict({"response_mask": torch.ones(7, 3), "token_level_scores": torch.ones(7, 3)},
                                   {"uid": np.array(["a", "a", "a", "b", "b", "c", "c"], dtype=object)})

    unscored = [False, True, False, False, True, False, False]
    grpo = batch()
    assert mask_unscored(grpo, unscored, 2) == {"judge/masked": 3.0, "judge/dropped_groups": 1.0}
    assert grpo.batch["response_mask"].sum(1).tolist() == [3, 0, 3, 0, 0, 3, 3]
    assert grpo.batch["token_level_scores"][1].sum() == 0
    groups = grpo.non_tensor_batch["score_group"].tolist()
    assert groups[0] == groups[2] == "a" and len(set(groups)) == 5 and groups[5] == groups[6] == "c"
    assert grpo.non_tensor_batch["uid"].tolist() == list("aaabbcc")  # prompts' groups move between ranks whole
    ppo = batch()
    assert mask_unscored(ppo, unscored, 1) == {"judge/masked": 2.0, "judge/dropped_groups": 0.0}
    assert ppo.batch["response_mask"].sum(1).tolist() == [3, 0, 3, 3, 0, 3, 3]


def test_validation_leaves_unscored_responses_out_and_shows_the_rule_beside_the_judge():
    """Held-out figures with a judge (lib.validation.val_metrics, every rank's rows): a response the judge could not
    score counts in no mean (it counted as 0 before: mean@2 0.5625 instead of 0.75), a prompt left without a scored
    response leaves the per-prompt figures (it scored 0 before), and the rule's own scores are reported beside the
    judge's, every row counted."""
    from lib.validation import val_metrics

    rows = [("p1", "toy", 1.0, "a", False, 0.5), ("p1", "toy", 0.5, "b", False, 0.25),
            ("p2", "toy", 0.0, "c", True, 0.75), ("p2", "toy", 0.75, "d", False, 1.0)]
    got = val_metrics(rows, judged=True)
    assert got["val/mean@2"] == got["val/score_mean"] == (1.0 + 0.5 + 0.75) / 3 and got["val/unscored"] == 1.0
    assert got["val/best@N"] == (1.0 + 0.75) / 2 and got["val/toy/mean@2"] == got["val/mean@2"]
    assert got["val/rule/mean@2"] == (0.5 + 0.25 + 0.75 + 1.0) / 4 and got["val/rule/best@N"] == (0.5 + 1.0) / 2
    lone = val_metrics([("p1", "toy", 1.0, "a", False, 1.0), ("p2", "toy", 0.0, "c", True, 0.0)], judged=True)
    assert lone["val/best@N"] == 1.0 and lone["val/maj@N"] == 1.0 and lone["val/unscored"] == 1.0
    plain = val_metrics([(u, s, sc, v, False, None) for u, s, sc, v, _, _ in rows], judged=False)
    assert plain["val/mean@2"] == 2.25 / 4 and "val/unscored" not in plain and "val/rule/mean@2" not in plain


def test_a_refused_key_or_a_missing_one_stops_the_start_before_any_model_loads(server, tmp_path, monkeypatch):
    """The start-up's input check builds the judge and probes it: a key the endpoint refuses, or a key variable that
    is not set, is one ValueError naming the fix (lib.inputs.check_inputs, which every rank runs before a model
    loads and prints once)."""
    from lib import config
    from lib.inputs import check_inputs

    cfg = config.parse([], default_preset="tiny_cpu_grpo")  # the toy task's files come with the test's tmp_path
    cfg.judge.url, cfg.judge.model, cfg.judge.api_key_env = server.url, "judge", "TEST_JUDGE_KEY"
    cfg.actor.model.path = str(tmp_path / "toy_assets" / "model")
    cfg.data.train_files = [str(tmp_path / "toy_assets" / "data" / "train.jsonl")]
    cfg.data.val_files = []
    monkeypatch.delenv("TEST_JUDGE_KEY", raising=False)
    with pytest.raises(ValueError, match="judge.api_key_env=TEST_JUDGE_KEY: that environment variable is not set"):
        check_inputs(cfg, 1, False, str(tmp_path / "run"))
    monkeypatch.setenv("TEST_JUDGE_KEY", "wrong")
    with pytest.raises(ValueError, match="refused the key .HTTP 401."):
        check_inputs(cfg, 1, False, str(tmp_path / "run"))
    monkeypatch.setenv("TEST_JUDGE_KEY", "good")
    assert check_inputs(cfg, 1, False, str(tmp_path / "run")).judge is not None


def _toy_grade(text: str) -> str:
    """The fake endpoint's judge: the toy task's own score of the response against the reference, on 0..10; a
    response whose hash is 0 mod 5 gets no verdict (unparseable: that sample must be masked, not rewarded 0)."""
    import zlib

    from lib.rewards.builtin import toy

    if "Response:\n" not in text:  # the start-up's probe
        return "OK"
    reference = text.split("Reference answer (may be empty):\n")[1].split("\n\nResponse:")[0]
    response = text.split("Response:\n")[1].split("\n\nJudge how")[0]
    if zlib.crc32(response.encode()) % 5 == 0:
        return "I cannot grade this."
    return f"Score: {round(10 * toy(response, reference)['score'])}"


@pytest.mark.slow
def test_grpo_with_a_remote_judge_masks_what_it_could_not_score(tmp_path, monkeypatch):
    """train_grpo.py on 2 CPU ranks, the toy task, rewarded by a judge behind the fake endpoint (its verdict: the toy
    score out of 10, none for a fifth of the responses): every step's samples are judged, the unjudged ones masked
    and counted, the key read from the environment, the canary at fp32 level."""
    import json

    from tests.test_e2e import torchrun

    server = Server(grade=_toy_grade)
    server.plan = {"Reply OK.": [500, 503]}  # the start-up probe meets two 5xx: retried, as training's requests are
    monkeypatch.setenv("TEST_JUDGE_KEY", "good")
    try:
        torchrun("train_grpo.py", tmp_path, "--trainer.total_steps", "2", "--trainer.val_every", "0",
                 "--trainer.train_batch_size", "16", "--judge.url", server.url, "--judge.model", "toy-judge",
                 "--judge.api_key_env", "TEST_JUDGE_KEY", "--judge.max_in_flight", "4", "--judge.backoff_s", "0.05")
    finally:
        server.close()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    train = [r for r in rows if "actor/pg_loss" in r]
    assert len(train) == 2
    for r in train:
        assert r["judge/requests"] > 0 and r["judge/parse_failures"] > 0 and r["judge/masked"] >= r["judge/parse_failures"]
        assert r["judge/errors"] == 0 and 0 <= r["judge/score_mean"] <= 1 and r["rollout/logp_abs_diff"] < 1e-5, r
        # a masked sample has no reward: the figures are the scored samples' (the toy's scores lie in 0..1)
        assert 0 <= r["reward/min"] <= r["reward/mean"] <= r["reward/max"] <= 1, r
    # one probe a launch (rank 0 here: torchrun alone), its two 5xx retried; the counts are the ranks' sum: every
    # request the server saw, but the probe's
    probes = server.calls.pop("Reply OK.")
    assert probes == 3, probes
    assert sum(r["judge/requests"] for r in train) == sum(server.calls.values())
    assert server.most_in_flight <= 2 * 4  # the cap is per rank: both ranks call the one server


# ---- the judge model in the trainer's processes (lib/judges/local.py) and the toy judge (lib/judges/toy.py)


def _toy_judge(tmp_path, **overrides):
    """The toy judge (the session's build, linked into tmp_path), started on CPU."""
    import torch

    from lib import judges
    from lib.judges import toy as judge_toy

    paths = judge_toy.prepare(str(tmp_path / "toy_judge_assets"))
    cfg = JudgeConfig(path=paths["model"], template=paths["template"], max_tokens=72, **overrides)
    judge = judges.build(cfg)
    judge.start(torch.device("cpu"))
    return judge


def _graded_items(count, seed=5):
    """(question, response, reference) of held-out prompts, the responses drawn as the toy judge was trained on."""
    import random

    from lib import toy
    from lib.judges import toy as judge_toy

    rng = random.Random(seed)
    out = []
    for digits in toy.split_pairs(0)[1][:count]:
        question, answer = toy.example(digits)
        out.append((question, judge_toy.responses(answer, rng), answer))
    return out


def test_the_judge_model_takes_turns_with_the_policy_engine(tmp_path, monkeypatch):
    """The policy's HF engine and the judge model on one device: the event log (lib.engine.awake) never has both
    awake, over three rollout-then-judge cycles, a judge asked to wake beside the awake policy engine (refused), and
    a scoring that raises (the judge sleeps again). The policy's samples and log-probs are bit-identical before and
    after the judge's turns; the judge's verdicts are the same in every cycle and equal a fresh judge's."""
    import torch

    from lib import toy
    from lib.engine import SamplingConfig, awake
    from lib.engine.hf import HFEngine
    from lib.judges.local import checkpoint_tensors
    from lib.models import load_config, load_tokenizer

    model = toy.prepare(str(tmp_path / "toy_assets"))["model"]
    tokenizer = load_tokenizer(model)
    policy = HFEngine(load_config(model), torch.device("cpu"), 0, [1], SamplingConfig(temperature=1.0, max_new_tokens=10))
    policy.wake_up()
    policy.load_weights(checkpoint_tensors(model))
    policy.finish_sync()
    policy.sleep(1)
    judge = _toy_judge(tmp_path)
    items = _graded_items(24)
    prompts = [tokenizer(q, add_special_tokens=False)["input_ids"] for q, _, _ in items]
    awake.EVENTS.clear()

    def rollout():
        policy.wake_up()
        try:
            turns = policy.generate_ids(prompts, [10] * len(prompts), validate=False, key=7)
        finally:
            policy.sleep(1)
        return [(t.ids, t.logps) for t in turns]

    first = rollout()
    verdicts = []
    for _ in range(3):
        judge.cache.clear()  # a cached verdict would hide a judge that answered differently
        verdicts.append([(v.score, v.status, v.text) for v in judge.score(items)[0]])
        assert rollout() == first  # the same samples and log-probs, bit for bit
    assert verdicts[0] == verdicts[1] == verdicts[2]
    assert sum(status == OK for _, status, _ in verdicts[0]) >= 20, verdicts[0]
    fresh = _toy_judge(tmp_path)
    assert [(v.score, v.status, v.text) for v in fresh.score(items)[0]] == verdicts[0]

    policy.wake_up()
    judge.cache.clear()
    with pytest.raises(RuntimeError, match=r"the judge model would wake while \['policy'\] is awake"):
        judge.score(items)
    policy.sleep(1)

    def broken(*args, **kwargs):
        raise ValueError("the judge's decoding failed")

    monkeypatch.setattr(judge.engine, "generate_ids", broken)
    with pytest.raises(ValueError, match="decoding failed"):
        judge.score(items)
    assert awake.others("nobody") == set() and judge.engine.level == 1  # asleep again, on the CPU
    events = list(awake.EVENTS)
    # the policy: 4 rollouts and the wake the judge was refused beside; the judge: 3 cycles, the fresh judge's load
    # and verdicts, the scoring that raised
    assert events.count(("policy", "wake")) == 5 and events.count(("judge", "wake")) == 6, events
    assert awake.overlaps(events) == [], events


def test_the_toy_judge_grades_the_toy_task(tmp_path):
    """The toy judge grades exactly what it was taught, the rule's reward (lib.judges.toy.grade): on 100 held-out
    prompts with responses right, nearly right, partly right and wrong, every verdict parses after its thinking, and
    nearly every score is the rule's on the 0-10 scale (measured: 100 of 100 on the 2-core AMD machine; the bound sits
    below, for other CPUs' builds)."""
    from lib.judges import toy as judge_toy

    items = _graded_items(100)
    verdicts, metrics = _toy_judge(tmp_path).score(items)
    exact = [v.score == judge_toy.label(response, reference) / 10 for v, (_, response, reference) in
             zip(verdicts, items)]
    assert metrics["judge/parse_failures"] == 0 and all(v.text.startswith("<think>a") for v in verdicts), metrics
    assert sum(exact) >= 90, [(v.text, item) for v, item, ok in zip(verdicts, items, exact) if not ok]
    assert metrics["judge/requests"] == len(set(items)) and metrics["judge/tokens"] > 0


def test_the_shipped_toy_judge_is_loaded_for_its_settings_and_other_settings_train(tmp_path, monkeypatch):
    """The toy judge of the default settings is the shipped weights (lib/judges/toy_judge.safetensors, made by
    ``python -m lib.judges.toy --ship``; its metadata names the settings), loaded, not trained; a build of other
    settings trains (1 and 2 steps here, from the same initialisation: the training path runs and moves the weights)."""
    import torch
    from safetensors import safe_open

    from lib import toy
    from lib.judges import toy as judge_toy

    tokenizer = toy.build_tool_tokenizer(str(tmp_path / "tok"), words=judge_toy.THINK)
    pairs, _ = toy.split_pairs(0)
    fit = toy.fit
    monkeypatch.setattr(toy, "fit", lambda *a, **k: pytest.fail("the default settings' build trained"))
    shipped = judge_toy.build(tokenizer, pairs)
    monkeypatch.setattr(toy, "fit", fit)
    with safe_open(judge_toy.SHIPPED, "pt") as f:
        assert f.metadata()["steps"] == str(judge_toy.STEPS) and f.metadata()["seed"] == "0"
        kept = {name: f.get_tensor(name) for name in f.keys()}
    weights = shipped.state_dict()
    assert kept and all(torch.equal(weights[name], t) for name, t in kept.items())
    one, two = (judge_toy.build(tokenizer, pairs, steps=n).state_dict() for n in (1, 2))  # the same initialisation
    name = "transformer.h.0.attn.c_attn.weight"
    assert not torch.equal(one[name], two[name]) and not torch.equal(two[name], weights[name])


def test_a_judge_turn_on_a_gpu_reads_the_whole_devices_memory(tmp_path, monkeypatch):
    """lib/judges/local.py on a GPU (through lib/fake_device.py): still awake after its answers, the judge reads the
    device's memory in use, total less free (a vLLM child's allocations are not this process's, so the allocator's
    counters cannot see them): memory/judge_device_peak_gb, beside the stages' peaks. On CPU the figure is absent."""
    from lib import fake_device

    judge = _toy_judge(tmp_path)
    items = _graded_items(3)
    assert "memory/judge_device_peak_gb" not in judge.score(items)[1]
    fake = fake_device.install(fake_device.FakeDevice(total_bytes=80 * 2**30, base_bytes=3 * 2**30, burst_bytes=0),
                               monkeypatch.setattr)
    judge.cache.clear()
    metrics = judge.score(items)[1]
    assert metrics["memory/judge_device_peak_gb"] == 3.0 and fake.calls["mem_get_info"] >= 1, metrics


def test_the_toy_judges_thinking_is_the_rule():
    """The toy judge's taught answer: slot by slot the response's and the answer's characters, whether they are the
    same, and the correct prefix so far, then the rule's reward on the 0-10 scale, for responses short, long, empty
    and exact."""
    from lib.judges import toy as judge_toy

    short = judge_toy.reasoning("5,2,7", "5,1,7,3")
    assert short == ("<think>a55=1b,,=2c21-2d,,=2e77=2f_,-2g_3-2h__-2</think>Score: 3", 3)
    assert judge_toy.reasoning("5,1,7,3", "5,1,7,3")[1] == 10 and judge_toy.reasoning("", "5,1,7,3")[1] == 0
    long = judge_toy.reasoning("5,1,7,3999", "5,1,7,3")
    assert long == ("<think>a55=1b,,=2c11=3d,,=4e77=5f,,=6g33=7h9_-7i9_-7j9_-7k__-7</think>Score: 7", 7)
    rng = __import__("random").Random(0)
    for _ in range(500):
        response = judge_toy.responses("5,1,7,3", rng)
        text, n = judge_toy.reasoning(response, "5,1,7,3")
        assert n == round(10 * judge_toy.rule(response, "5,1,7,3")["score"]) and text.endswith(f"Score: {n}")
        assert len(response) <= 10


def test_a_judge_model_that_cannot_judge_is_refused_at_the_start_naming_the_fix(tmp_path):
    """At start-up (lib.inputs.check_inputs, before any model loads): a tokenizer without a chat template, a context
    that cannot hold the judge's prompt around the longest question and response and the verdict, a judge named
    both by url and by path. Each one ValueError naming what to change."""
    import json
    import os
    import shutil

    from lib import config, judges
    from lib.judges import toy as judge_toy
    from lib.inputs import check_inputs, resolve_toy

    cfg = config.parse(["--judge.path", "toy_judge", "--trainer.output_root", str(tmp_path)],
                       default_preset="tiny_cpu_grpo")
    resolve_toy(cfg)
    with pytest.raises(ValueError, match=r"its context is 128 positions, and a verdict may need 1\d\d\d .*lower "
                                         r"judge.max_tokens"):
        check_inputs(cfg, 1, False, str(tmp_path / "run"))
    cfg.judge.max_tokens = 72
    assert isinstance(check_inputs(cfg, 1, False, str(tmp_path / "run")).judge, judges.LocalJudge)
    cfg.judge.url = "http://127.0.0.1:9/v1"
    with pytest.raises(ValueError, match="both name a judge; keep one"):
        check_inputs(cfg, 1, False, str(tmp_path / "run"))
    plain = tmp_path / "plain_judge"
    shutil.copytree(judge_toy.prepare(str(tmp_path / "toy_judge_assets"))["model"], plain)
    settings = json.loads((plain / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(settings))
    if os.path.exists(plain / "chat_template.jinja"):
        os.remove(plain / "chat_template.jinja")
    with pytest.raises(ValueError, match="has no chat template.*add a chat_template"):
        judges.build(JudgeConfig(path=str(plain), max_tokens=12))


def test_a_vllm_judge_where_vllm_cannot_decode_it_is_refused_at_the_start(tmp_path, monkeypatch):
    """judge.engine vllm, refused by check_inputs before any model loads, naming judge.engine=hf as the way on: without
    the vllm package (the first test pass); with it, a judge whose head size vLLM's CPU attention lacks (here the
    sizes it takes are made 64 and 128: the toy judge's is 32). Beside an endpoint (judge.url) it is a config error."""
    import importlib.util

    from lib import config, preflight
    from lib.inputs import check_inputs, resolve_toy

    cfg = config.parse(["--judge.path", "toy_judge", "--judge.engine", "vllm", "--judge.max_tokens", "72",
                        "--trainer.output_root", str(tmp_path)], default_preset="tiny_cpu_grpo")
    resolve_toy(cfg)
    if importlib.util.find_spec("vllm") is None:
        expected = r"judge.path=.*: judge.engine=vllm needs the vllm package: .* or use judge.engine=hf"
    else:
        monkeypatch.setattr(preflight, "VLLM_CPU_HEAD_SIZES", (64, 128))
        expected = r"judge.engine=vllm on CPU: vLLM's CPU attention takes head sizes \[64, 128\], this model's is 32; use " \
                   r"judge.engine=hf"
    with pytest.raises(ValueError, match=expected):
        check_inputs(cfg, 1, False, str(tmp_path / "run"))
    remote = config.parse(["--judge.url", "http://127.0.0.1:9/v1", "--judge.model", "m", "--judge.engine", "vllm"],
                          default_preset="tiny_cpu_grpo")
    with pytest.raises(ValueError, match="judge.engine=vllm decodes a judge model .judge.path.; an endpoint"):
        preflight.validate(remote, 2)
    for flags, expected in ((["--judge.tp_size", "3"], "judge.tp_size=3 must divide the 2 ranks"),
                            (["--judge.tp_size", "2"], "judge.tp_size=2 splits the judge model over vLLM child "
                                                       "processes: set judge.engine=vllm")):
        split = config.parse(["--judge.path", "toy_judge", *flags], default_preset="tiny_cpu_grpo")
        with pytest.raises(ValueError, match=expected):
            preflight.validate(split, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # a rank of a node of 3 ranks: a group of 2 would cross nodes
    cfg.judge.tp_size = 2
    with pytest.raises(ValueError, match="judge.tp_size=2: a TP group's children share one node, and this node runs 3"):
        check_inputs(cfg, 2, False, str(tmp_path / "run"))


def test_the_childs_environment_is_the_ranks_device_alone_or_its_tp_groups_world(monkeypatch):
    """A rank's vLLM child (lib.judges.vllm_child.child_env) drops torchrun's variables and sees the rank's GPU alone
    (its physical index through the rank's CUDA_VISIBLE_DEVICES); a child of a judge TP group gets the group's own
    world (its rank in the group, the group's port, the group's GPUs, its own by its rank); on CPU no GPU."""
    import torch

    from lib.judges.vllm_child import TPLayout, child_env

    for k, v in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
                 "TORCHELASTIC_RUN_ID": "x", "CUDA_VISIBLE_DEVICES": "4,5"}.items():
        monkeypatch.setenv(k, v)
    alone = child_env(torch.device("cuda", 1))
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(alone)
    assert alone["CUDA_VISIBLE_DEVICES"] == "5" and alone["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    group = child_env(torch.device("cuda", 1), TPLayout(1, 2, 41000, ["4", "5"], "p"))
    assert {k: group[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                  "CUDA_VISIBLE_DEVICES")} == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                                                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41000",
                                                               "CUDA_VISIBLE_DEVICES": "4,5"}
    assert child_env(torch.device("cpu"), TPLayout(0, 2, 41000, ["", ""], "p"))["CUDA_VISIBLE_DEVICES"] == ""


class _BatchingGrader:
    """The fake endpoint's judge: the toy judge model itself, answering the requests that arrive together as one batch
    (one request at a time would make a step's few hundred verdicts as many decodes). A step's requests reach the
    server over a few hundred milliseconds (a thread a connection): a batch closes after a quarter second without
    one (with 20 ms, measured: a step's judging took 6 s in small batches, against 2 s in process)."""

    def __init__(self, judge):
        import queue
        import threading

        self.judge, self.queue = judge, queue.Queue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        import queue

        while True:
            waiting = [self.queue.get()]
            while True:
                try:
                    waiting.append(self.queue.get(timeout=0.25))
                except queue.Empty:
                    break
            for (_, slot), answer in zip(waiting, self.judge.complete([text for text, _ in waiting])):
                slot["text"] = answer[0] if isinstance(answer, tuple) else ""
                slot["done"].set()

    def __call__(self, text):
        import threading

        slot = {"done": threading.Event()}
        self.queue.put((text, slot))
        slot["done"].wait()
        return slot["text"]


# Held-out greedy reward of tiny_cpu_grpo_judge, step 0 -> 60, 2 ranks, 1 thread per rank, 2-core AMD EPYC, by the
# judge / by the rule (never trained on), the judge of 360 steps: seed 1 +0.207 / +0.195, seed 2 +0.260 / +0.253,
# seed 3 +0.242 / +0.235 (seeds 2 and 3 run at once, four ranks on two cores); the judge of 500 steps: seed 1 +0.194 /
# +0.190 (in process, alone, in an xdist run beside other tests, and behind the endpoint alike), seed 2 +0.295 /
# +0.287, seed 3 +0.176 / +0.165. The verdict is the rule's reward in tenths, so the rule test's spread across machines
# applies too (tests/test_e2e.py: +0.10 to +0.30); the threshold is the rule test's, under a third of the worst here.
# Fewer steps or samples lose that margin (2026-11-29, the same machine at a load of 4-16, the judge of 360 steps):
# seed 1 +0.022 / +0.026 at step 30, +0.035 / +0.030 at 40, +0.103 / +0.101 at 50, +0.185 / +0.185 at 60 (922 s,
# beside another run, validating every 10 steps); seed 2 +0.088 / +0.090 at 30, +0.121 / +0.123 at 40, +0.225 /
# +0.218 at 50; half the prompts a step (32: half the judging, the same 4 optimizer steps a step), 60 steps: seed 1
# +0.054 / +0.040, seed 2 +0.054 / +0.044 (+0.000 / -0.004 at 40). The gain's onset varies by seed and machine (seed 1
# at 50 steps holds twice the threshold, where another machine's rule run gains half of this one's), so the run stays
# at 60 steps of 64 prompts (271 s quiet, judging 83% of each step).
JUDGE_MIN_GAIN = 0.05
ENDPOINT_STEPS = 3
JUDGE_STEPS = 60
HANG_S = 3600
"""A hung run's end, not a speed bound: the learning test's run takes 271 s on a quiet 2-core machine, and took 922 s
there at a load of 9-13 (validating every 10 steps, beside another run): past the 900 s it was once held to."""


def _judged_run(tmp_path, preset, steps, *more, timeout=900):
    import json
    import os

    from tests.test_e2e import torchrun

    os.makedirs(tmp_path)
    for name in ("toy_assets", "toy_judge_assets"):  # the session's builds, linked into the test's folder
        os.symlink(os.path.realpath(tmp_path.parent / name), tmp_path / name)
    out = torchrun("train_grpo.py", tmp_path, "--config", preset, "--trainer.total_steps", str(steps),
                   "--trainer.val_every", str(JUDGE_STEPS), *more, timeout=timeout)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    train = [r for r in rows if "actor/pg_loss" in r]
    samples = 64 * 8  # the step's: the judge's counts are summed over the ranks (lib/metrics.py)
    assert len(train) == steps and all(r["judge/requests"] + r["judge/cache_hits"] == samples for r in train), train
    assert all(r["judge/parse_failures"] == 0 and r["judge/errors"] == 0 and 0 < r["judge/step_share"] < 1
               and r["rollout/logp_abs_diff"] < 1e-5 for r in train), train
    return out, [r for r in rows if "val/rule/mean@1" in r], train


@pytest.mark.slow
def test_grpo_learns_the_toy_task_from_the_toy_judge_beside_the_policy_and_behind_an_endpoint(tmp_path, monkeypatch):
    """train_grpo.py on 2 CPU ranks in the tiny_cpu_grpo_judge preset, rewarded by the toy judge's verdicts alone.
    The judge model beside the policy, taking turns with its HF engine, 60 steps: the held-out reward rises as with
    the rule reward, the judge's and the rule's (which the policy never sees: it learns the task, not the judge's
    flaws). The same judge served by the fake endpoint: the same run, step for step (the same verdicts, so the same
    rewards, losses and cache hits), for its first 3 steps (measured whole, 60 steps: the same held-out figures, at
    6.2 s of judging a step, one server judging both ranks' samples in turn, against 2 s in process). Every sample
    of every step is judged, every verdict parses, the canary stays at fp32 level."""
    preset = "tiny_cpu_grpo_judge"
    out, val, inside = _judged_run(tmp_path / "in_process", preset, JUDGE_STEPS, timeout=HANG_S)
    assert "judge model:" in out and "taking turns with the policy's engine" in out
    assert [r["step"] for r in val] == [0, JUDGE_STEPS] and all(r["val/unscored"] == 0 for r in val), val
    curve = [(r["val/mean@1"], r["val/rule/mean@1"]) for r in val]
    assert curve[1][0] > curve[0][0] + JUDGE_MIN_GAIN and curve[1][1] > curve[0][1] + JUDGE_MIN_GAIN, curve

    judge = _toy_judge(tmp_path)
    server = Server(grade=_BatchingGrader(judge))
    monkeypatch.setenv("TEST_JUDGE_KEY", "good")
    try:
        _, val, behind = _judged_run(
            tmp_path / "endpoint", preset, ENDPOINT_STEPS, "--judge.path", "", "--judge.url", server.url, "--judge.model",
            "toy-judge", "--judge.api_key_env", "TEST_JUDGE_KEY", "--judge.template", judge.endpoint.template,
            "--judge.max_in_flight", "256", timeout=HANG_S)
    finally:
        server.close()
    assert val[0]["val/mean@1"] == curve[0][0]
    same = ("judge/score_mean", "judge/cache_hits", "reward/mean", "critic/advantages/mean", "actor/pg_loss",
            "actor/grad_norm")
    for a, b in zip(inside, behind):
        assert all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7) for k in same), (a["step"], a, b)


def _children() -> set[int]:
    import subprocess

    found = subprocess.run(["pgrep", "-f", "lib.judges.vllm_child"], capture_output=True, text=True).stdout
    return {int(p) for p in found.split()}


@pytest.mark.vllm
def test_the_judge_model_in_a_vllm_child_process_answers_as_the_hf_engine(tmp_path):
    """judge.engine vllm (vllm-cpu here): the toy judge decoding in a child process writes the HF engine's verdicts,
    token for token, on 40 held-out graded responses, in turns the event log shows as the HF judge's (wake, sleep),
    and the same again after more turns; with judge.parse json every verdict is JSON of the judge's schema (guided
    decoding: the toy judge was never taught JSON, the grammar alone makes it so). A child that dies is an error
    naming its exit code; close() ends the child."""
    import os
    import signal

    from lib.engine import awake

    items = _graded_items(40)
    texts = [v.text for v in _toy_judge(tmp_path).score(items)[0]]
    before = _children()
    judge = _toy_judge(tmp_path, engine="vllm")
    child = judge.engine.proc.pid
    assert _children() - before == {child}
    try:
        start = len(awake.EVENTS)
        verdicts, metrics = judge.score(items)
        assert [v.text for v in verdicts] == texts and metrics["judge/parse_failures"] == 0, metrics
        judge.cache.clear()
        assert [v.text for v in judge.score(items)[0]] == texts
        assert list(awake.EVENTS)[start:] == [("judge", "wake"), ("judge", "sleep")] * 2
    finally:
        judge.close()
    assert child not in _children() and judge.engine.proc.returncode == 0

    judge = _toy_judge(tmp_path, engine="vllm", parse="json")
    try:
        verdicts, metrics = judge.score(items)
        assert metrics["judge/parse_failures"] == 0 and all(v.text.startswith('{"score":') for v in verdicts), verdicts
        assert all(0 <= v.score <= 1 for v in verdicts)
        os.kill(judge.engine.proc.pid, signal.SIGKILL)
        judge.cache.clear()
        with pytest.raises(RuntimeError, match=r"the judge's vLLM child process \(pid \d+\) .*exit code -9"):
            judge.score(items[:2])
    finally:
        judge.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_grpo_with_the_judge_model_in_vllm_child_processes_is_the_run_with_the_hf_judge(tmp_path):
    """train_grpo.py on 2 CPU ranks in the tiny_cpu_grpo_judge preset, 2 steps, the judge model decoding in vLLM in
    a child process of each rank (started under torchrun, none of the rank's process group), the two children holding
    it together (judge.tp_size 2: a world of their own, the ranks gathering their prompts, each keeping its rows):
    the same run as with the judge in the HF engine, step for step (the same verdicts: the same scores, cache hits,
    rewards, losses); every sample judged, the canary at fp32 level; the children end with the run. (A child of one
    rank alone: test_the_judge_model_in_a_vllm_child_process_answers_as_the_hf_engine.)"""
    preset = "tiny_cpu_grpo_judge"
    before = _children()
    _, _, hf = _judged_run(tmp_path / "hf", preset, 2)
    out, _, child = _judged_run(tmp_path / "vllm", preset, 2, "--judge.engine", "vllm", "--judge.tp_size", "2")
    assert "decoded by vLLM in a child process of each rank" in out and "tensor parallel over the children of each " \
        "2 ranks" in out
    same = ("judge/score_mean", "judge/cache_hits", "reward/mean", "critic/advantages/mean", "actor/pg_loss",
            "actor/grad_norm")
    for a, b in zip(hf, child):
        assert all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7) for k in same), (a["step"], a, b)
    assert _children() <= before
