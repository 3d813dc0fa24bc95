"""The reward model: pooled at each row's last attended token whatever its pad id, its own tokenizer and chat
template where it is not the policy's, micro-batched; an RM-only run needs no rule data_source or ground truth."""

import json

import numpy as np
import pytest
import torch

from lib.protocol import DataProto
from lib.rewards.scorer import RewardModel
from tests import zoo
from tests.helpers import VOCAB, rl_batch, tiny_config


def save_rm(path, tokenizer_builder, vocab=VOCAB, seed=0, **overrides):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(tiny_config("qwen2", vocab_size=vocab, num_labels=1,
                                                                       **overrides), dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer_builder(str(path))
    return model.eval()


def unpadded_score(model, ids):
    with torch.no_grad():  # one row, no padding: transformers scores the last token
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


@pytest.mark.parametrize("pad", [None, 7], ids=["no-pad-id", "other-pad-id"])
def test_each_row_is_scored_at_its_last_token(tmp_path, pad):
    """With no pad id the first score raised (batch sizes > 1); with a pad id other than the policy's (the
    responses' right padding is the policy's), every row but the longest was scored at a padding position."""
    model = save_rm(tmp_path / "rm", zoo.build_tokenizer, pad_token_id=pad)
    policy_tok = zoo.build_tokenizer(str(tmp_path / "policy"))  # the same vocabulary: the ids go in as they are
    batch = rl_batch(6, prompt_len=7, response_len=6, seed=3)
    rm = RewardModel(str(tmp_path / "rm"), torch.device("cpu"), policy_tok, micro_batch_size=4)
    assert rm.same_tokens
    got = rm(batch)
    mask = batch.batch["attention_mask"].bool()
    want = [unpadded_score(model, batch.batch["input_ids"][i][mask[i]].tolist()) for i in range(len(batch))]
    assert torch.allclose(got, torch.tensor(want), atol=1e-5), (got, want)
    one = RewardModel(str(tmp_path / "rm"), torch.device("cpu"), policy_tok, micro_batch_size=1)
    assert torch.allclose(one(batch), got, atol=1e-5)  # micro-batches change nothing


def test_a_reward_model_with_another_tokenizer_renders_its_own_chat_template(tmp_path):
    """The policy's ids went to an RM whose tokenizer is another one, unchecked."""
    from lib import toy
    from lib.models import load_tokenizer

    toy.build_tokenizer(str(tmp_path / "policy"))
    policy_tok = load_tokenizer(str(tmp_path / "policy"))
    model = save_rm(tmp_path / "rm", zoo.build_tokenizer, pad_token_id=None)
    rm = RewardModel(str(tmp_path / "rm"), torch.device("cpu"), policy_tok)
    assert not rm.same_tokens and "its own chat template" in rm.describe()
    messages = [[{"role": "user", "content": "1,2,3,4,"}], [{"role": "user", "content": "9,8,"}]]
    answers = ["4,3,2,1", "8"]
    prompts = [policy_tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    width = 10
    responses = torch.full((2, width), policy_tok.pad_token_id)
    for i, a in enumerate(answers):
        ids = policy_tok(a, add_special_tokens=False)["input_ids"] + [policy_tok.eos_token_id]
        responses[i, :len(ids)] = torch.tensor(ids)
    batch = DataProto.from_dict({"responses": responses, "response_mask": (responses != policy_tok.pad_token_id).float()},
                                {"messages": np.array(messages + [None], dtype=object)[:-1],
                                 "raw_prompt": np.array(prompts, dtype=object)})
    got = rm(batch)
    rm_tok = load_tokenizer(str(tmp_path / "rm"))  # as loaded from the RM's folder
    for i in range(2):
        text = rm_tok.apply_chat_template(messages[i] + [{"role": "assistant", "content": answers[i]}], tokenize=False)
        assert abs(float(got[i]) - unpadded_score(model, rm_tok(text, add_special_tokens=False)["input_ids"])) < 1e-5


@pytest.mark.slow
def test_a_reward_model_only_run_needs_no_rule_source_or_ground_truth(tmp_path):
    """Rows with a prompt only: the run was refused (no data_source / ground truth) though the RM scores them."""
    from lib import toy
    from tests.test_e2e import torchrun

    paths = toy.prepare(str(tmp_path / "toy_assets"))
    save_rm(tmp_path / "rm", lambda p: toy.build_tokenizer(p), vocab=len(toy.SPECIAL + toy.CHARS), pad_token_id=None)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i},{i + 1},{i + 2},{i},"}]}) + "\n"
                            for i in range(1, 8)) * 4)
    out = torchrun("train_grpo.py", tmp_path, "--actor.model.path", paths["model"], "--data.train_files", str(rows),
                   "--data.val_files", str(rows), "--reward.reward_model", str(tmp_path / "rm"),
                   "--trainer.total_steps", "2", "--trainer.train_batch_size", "8", "--actor.mini_batch_size", "64",
                   "--trainer.val_every", "0", "--trainer.save_every", "0")
    assert "reward model: the policy's token ids" in out
    got = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in got] == [1, 2]
    assert all(r["reward/rm_score"] != 0 and r["reward/mean"] == pytest.approx(r["reward/rm_score"], abs=1e-5)
               and r["reward/errors"] == 0 and r["actor/grad_norm"] > 0 for r in got), got


@pytest.mark.gpu
def test_a_reward_model_on_a_gpu_is_bf16_and_waits_on_the_cpu(tmp_path):
    """lib/rewards/scorer.py on a GPU: the model in bf16, on the CPU outside the score stage and back there after it;
    its scores those of the fp32 model to bf16 rounding."""
    model = save_rm(tmp_path / "rm", zoo.build_tokenizer)
    policy_tok = zoo.build_tokenizer(str(tmp_path / "policy"))
    batch = rl_batch(6, prompt_len=7, response_len=6, seed=3)
    rm = RewardModel(str(tmp_path / "rm"), torch.device("cuda"), policy_tok, micro_batch_size=4)
    assert rm.home == torch.device("cpu") and next(rm.model.parameters()).dtype == torch.bfloat16
    got = rm(batch)
    assert next(rm.model.parameters()).device.type == "cpu"  # back home after scoring
    mask = batch.batch["attention_mask"].bool()
    want = torch.tensor([unpadded_score(model, batch.batch["input_ids"][i][mask[i]].tolist()) for i in range(6)])
    assert torch.allclose(got, want, atol=5e-2), (got, want)
