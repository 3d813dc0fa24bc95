"""On-policy distillation (lib/distill): the teacher's numbers against hand-written formulas, its start-up checks,
and the runs users launch."""

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from lib.testing import run_distributed
from tests import zoo
from tests.helpers import rl_batch

TEMPERATURE = 0.7


TOPK = 8


def _own_distributions(path: str, data) -> torch.Tensor:
    """The model's own padded forward at the rollout temperature: log p of every token at every response position,
    (B, R, V) float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    b = data.batch
    response_len = b["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits[:, -response_len - 1:-1]
    return torch.log_softmax(logits.double() / TEMPERATURE, -1)


def _own_log_probs(path: str, data) -> torch.Tensor:
    """log p(response token), (B, R), 0 on padding, from the model's own forward."""
    logp = _own_distributions(path, data).gather(-1, data.batch["responses"][..., None])[..., 0]
    return (logp * data.batch["response_mask"]).float()


def _numbers_body(student: str, teacher: str, estimator: str):
    from lib import distill
    from lib.actor import Trainee, compute_log_probs, update_policy
    from lib.config import ActorConfig, BatchingConfig, ModelConfig, OptimConfig
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model
    from lib.optim import build_optimizer

    topo = init_topology(device="cpu")
    cfg = ActorConfig(model=ModelConfig(path=student), optim=OptimConfig(lr=1e-2, eps=1.0, weight_decay=0.0),
                      batching=BatchingConfig(micro_batch_size_per_rank=3), loss_agg_mode="token-mean",
                      shuffle=False)  # the update's micro-batches are the log-prob passes' (the same shapes)
    model = build_sharded_model(cfg.model, cfg.fsdp, topo)
    t = build_sharded_model(ModelConfig(path=teacher), cfg.fsdp, topo, trainable=False)
    data = rl_batch(6, prompt_len=7, response_len=6, seed=5, min_response=1)
    observed = data.batch["response_mask"].sum(-1) >= 3  # a multi-turn row's observation: in the row, not sampled
    data.batch["response_mask"][observed, 1] = 0
    data.batch["old_log_probs"], _ = compute_log_probs(model, data, cfg.batching, topo, TEMPERATURE)
    distill.teacher_log_probs(t, data, cfg.batching, topo, TEMPERATURE, topk=TOPK if estimator == "topk" else 0)
    g = torch.Generator().manual_seed(1)
    task = torch.randn(data.batch["response_mask"].shape, generator=g) * data.batch["response_mask"]
    out = {}
    for mode, keep in (("reward", False), ("reward", True), ("loss", False))[2 if estimator == "topk" else 0:]:
        data.batch["advantages"] = task.clone()
        run_cfg = SimpleNamespace(distill=SimpleNamespace(teacher=teacher, mode=mode, task_reward=keep, coef=0.5,
                                                          estimator=estimator))
        distill.set_advantages(data, run_cfg)
        out[(mode, keep)] = data.batch["advantages"].clone()
    metrics = distill.metrics(data)
    optimizer, scheduler = build_optimizer(model, cfg.optim)
    data.batch["advantages"] = out[("loss", False)]
    update = update_policy(Trainee(model, optimizer, scheduler, topo), data, cfg, TEMPERATURE,
                           **distill.loss_kwargs(SimpleNamespace(distill=SimpleNamespace(
                               teacher=teacher, mode="loss", coef=0.5, estimator=estimator))))
    return {"data": data, "task": task, "out": out, "metrics": metrics, "update": update}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A Qwen2.5-shaped student and a Llama-shaped teacher with the same tokenizer (another architecture)."""
    root = str(tmp_path_factory.mktemp("distill_zoo"))
    return zoo.build("qwen2_tied", root), zoo.build("llama", root, seed=1)


@pytest.mark.parametrize("estimator", ["k1", "k3", "topk"])
def test_the_teacher_terms_equal_the_formulas(pair, estimator):
    """Reward mode: each token's advantage is coef * (log p_T - log p_S) from the two models' own forwards (< 1e-6
    fp32), alone or added to the task's; loss mode: the advantages are zero without the task reward, and the loss
    term is k1 = log p_S - log p_T or k3 = exp(d) - d - 1 (d = log p_T - log p_S), token-mean over the response; or
    topk: the teacher's TOPK most likely tokens at each position (and the rest's log-prob), and the KL(student ||
    teacher) of the two distributions over those TOPK tokens + the rest, token-mean. Observation tokens (inside a
    multi-turn row's response, not sampled) get no teacher term and count in no mean."""
    student, teacher = pair
    (r,) = run_distributed(_numbers_body, student, teacher, estimator, world_size=1)
    data, mask = r["data"], r["data"].batch["response_mask"]
    s, t = _own_log_probs(student, data), _own_log_probs(teacher, data)
    assert (t - s).abs().max() > 1e-2  # two different models
    assert (mask == 0).logical_and(data.batch["attention_mask"][:, -mask.shape[1]:] == 1).any()  # observations
    torch.testing.assert_close(data.batch["old_log_probs"] * mask, s, rtol=0, atol=1e-6)
    torch.testing.assert_close(data.batch["teacher_log_probs"] * mask, t, rtol=0, atol=1e-6)
    if estimator != "topk":
        torch.testing.assert_close(r["out"][("reward", False)], 0.5 * (t - s) * mask, rtol=0, atol=1e-6)
        torch.testing.assert_close(r["out"][("reward", True)], r["task"] + 0.5 * (t - s) * mask, rtol=0, atol=1e-6)
    assert torch.equal(r["out"][("loss", False)], torch.zeros_like(mask))
    d = (t - s)[mask.bool()]
    if estimator == "topk":
        k = _hand_topk_kl(_own_distributions(student, data), _own_distributions(teacher, data), data)
    else:
        k = -d if estimator == "k1" else torch.exp(d) - d - 1
    assert r["update"]["actor/distill_loss"] == pytest.approx(k.mean().item(), abs=1e-6)
    assert r["metrics"]["distill/reverse_kl"] == pytest.approx((-d).mean().item(), abs=1e-6)
    assert r["metrics"]["distill/teacher_logp"] == pytest.approx(t[mask.bool()].mean().item(), abs=1e-6)
    assert r["metrics"]["distill/student_logp"] == pytest.approx(s[mask.bool()].mean().item(), abs=1e-6)


def _hand_topk_kl(student: torch.Tensor, teacher: torch.Tensor, data) -> torch.Tensor:
    """The topk term by hand from the two full distributions (B, R, V) float64, at the response tokens: the recorded
    ids must be the teacher's TOPK most likely (up to fp32 ties), its recorded log-probs those and the rest's."""
    b = data.batch
    valid = b["response_mask"].bool()
    ids, recorded = b["teacher_topk_ids"][valid], b["teacher_topk_log_probs"][valid].double()
    ls, lt = student[valid], teacher[valid]
    top_t = lt.gather(-1, ids)
    torch.testing.assert_close(top_t, recorded[:, :TOPK], rtol=0, atol=1e-6)
    assert (top_t.min(-1).values >= lt.topk(TOPK, -1).values[:, -1] - 1e-6).all()  # none larger left out
    rest_t = lt.scatter(-1, ids, float("-inf")).logsumexp(-1)
    torch.testing.assert_close(rest_t, recorded[:, TOPK], rtol=0, atol=1e-6)
    top_s = ls.gather(-1, ids)
    coarse_s = torch.cat([top_s, ls.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True)], -1)
    coarse_t = torch.cat([top_t, rest_t[:, None]], -1)
    return (coarse_s.exp() * (coarse_s - coarse_t)).sum(-1)


def _rounding_bound(k: int, vocab: int) -> float:
    """How far from zero fp32 arithmetic may leave the topk term of a teacher equal to the student, per token (so for
    its mean too). The k tokens' log-probs are bitwise the same on both sides (the same rows through the same shapes:
    the update's micro-batches are the teacher pass's); the rest is not, by design (lib/distill): the student's is
    log(1 - the sum of its k probabilities), k + 1 terms of at most 1, so (k + 1) eps on its probability p_rest; the
    teacher's is a logsumexp over the other log-probs l = z - logsumexp(z), which passes twice through a sum of up to
    V terms (the softmax's and the rest's, log2 V eps each in a cascade sum) and a subtraction with a rounding of eps
    |l| each, whose mean under p is at most the entropy, ln V. The term is p_rest (rest_S - rest_T): the errors of
    log p_rest are relative ones of p_rest, and p_rest <= 1 multiplies them."""
    return torch.finfo(torch.float32).eps * (k + 1 + 2 * math.log(vocab) + 2 * math.log2(vocab))


@pytest.mark.parametrize("estimator", ["k3", "topk"])
def test_a_teacher_equal_to_the_student_gives_nothing(pair, estimator):
    """The student as its own teacher: zero reverse KL, zero advantages in pure distillation, zero loss term (topk: up
    to the fp32 rounding of the rest's two formulas, the student's rest being 1 - its top-k sum where the teacher's is
    a logsumexp; measured 1.3e-7 = 1.1 eps on a 2-core AMD EPYC at 1 to 4 threads, under a bound of 5.5e-6)."""
    from transformers import AutoConfig

    student, _ = pair
    (r,) = run_distributed(_numbers_body, student, student, estimator, world_size=1)
    assert r["metrics"]["distill/reverse_kl"] == 0.0
    if estimator != "topk":
        assert torch.equal(r["out"][("reward", False)], torch.zeros_like(r["task"]))
        assert r["update"]["actor/distill_loss"] == 0.0
    else:
        bound = _rounding_bound(TOPK, AutoConfig.from_pretrained(student).vocab_size)
        assert abs(r["update"]["actor/distill_loss"]) <= bound, (r["update"]["actor/distill_loss"], bound)


def _config(student: str, teacher: str, data: str):
    from lib.config import Config

    cfg = Config()
    cfg.actor.model.path, cfg.data.train_files, cfg.data.val_files = student, [data], []
    cfg.trainer.val_every, cfg.rollout.n, cfg.trainer.train_batch_size = 0, 2, 2
    cfg.data.max_prompt_length, cfg.rollout.max_response_length = 160, 32
    cfg.distill.teacher = teacher
    return cfg


def test_a_teacher_that_cannot_score_the_students_tokens_is_refused_before_any_model_loads(pair, tmp_path):
    """A missing teacher folder, and a teacher whose tokenizer is another (the toy's characters against the zoo's
    Qwen-style vocabulary): one message naming the fix, from the checks that run before any model loads. Pure
    distillation's rows need only a prompt (no data_source, no ground truth)."""
    from lib import toy
    from lib.inputs import check_inputs

    student, _ = pair
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"count to {i}"}]}) + "\n"
                            for i in range(4)))
    assert not check_inputs(_config(student, student, str(rows)), 2, False, str(tmp_path / "ok")).scored
    with pytest.raises(ValueError, match="distill.teacher=.*cannot be loaded.*model folder"):
        check_inputs(_config(student, str(tmp_path / "nowhere"), str(rows)), 2, False, str(tmp_path / "a"))
    other = toy.prepare(str(tmp_path / "toy_assets"))["model"]
    with pytest.raises(ValueError, match="its tokenizer's vocabulary differs from the student's"):
        check_inputs(_config(student, other, str(rows)), 2, False, str(tmp_path / "b"))
    with pytest.raises(ValueError, match="distillation runs in train_grpo.py"):
        check_inputs(_config(student, student, str(rows)), 2, True, str(tmp_path / "c"))


# Held-out greedy reward after 40 steps from the default start (the same prompts, samples and steps): pure on-policy
# distillation from the toy teacher (configs/tiny_cpu_opd.yaml) against GRPO (the default preset). Measured on a
# 2-core machine, 1 thread per rank, seeds 1-4: OPD 0.541 / 0.479 / 0.455 / 0.555 against GRPO 0.306 / 0.401 / 0.354
# / 0.321 (leads +0.235, +0.078, +0.101, +0.234); seed 1 with 2 threads per rank: OPD 0.541 again. Both start at
# 0.269. The threshold sits under half the smallest lead.
OPD_MIN_LEAD = 0.035


def _final_val(path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in open(path / "metrics.jsonl")]
    return [(r["step"], r["val/score_mean"]) for r in rows if "val/score_mean" in r]


@pytest.mark.slow
def test_distillation_learns_the_toy_task_faster_than_grpo(tmp_path):
    """The student samples, the teacher scores every token: at the same number of steps and samples the student's
    held-out reward is above GRPO's, and every step's engine and trainer log-probs agree (the canary). The teacher's
    own held-out score is logged once, at step 0, as the target (the toy teacher scores 1.0)."""
    from tests.test_e2e import torchrun

    torchrun("train_grpo.py", tmp_path, "--config", "tiny_cpu_opd", "--trainer.run_name", "opd")
    torchrun("train_grpo.py", tmp_path, "--trainer.total_steps", "40", "--trainer.val_every", "10",
             "--trainer.run_name", "grpo")
    opd, grpo = _final_val(tmp_path / "opd"), _final_val(tmp_path / "grpo")
    assert opd[0] == grpo[0] and opd[-1][0] == grpo[-1][0] == 40, (opd, grpo)
    assert opd[-1][1] > grpo[-1][1] + OPD_MIN_LEAD, (opd, grpo)
    rows = [json.loads(line) for line in open(tmp_path / "opd" / "metrics.jsonl")]
    train = [r for r in rows if "distill/reverse_kl" in r]
    assert len(train) == 40 and max(r["rollout/logp_abs_diff"] for r in train) < 1e-4
    teacher = [(r["step"], r["val/teacher/score_mean"]) for r in rows if "val/teacher/score_mean" in r]
    assert len(teacher) == 1 and teacher[0][0] == 0 and teacher[0][1] > 0.9, teacher
    assert not any("val/teacher/score_mean" in r for r in
                   (json.loads(line) for line in open(tmp_path / "grpo" / "metrics.jsonl")))
    assert train[-1]["distill/reverse_kl"] < train[0]["distill/reverse_kl"], (train[0], train[-1])


@pytest.mark.slow
def test_a_lora_student_with_a_teacher(tmp_path):
    """A LoRA student (its reference the adapter-off base) taught in loss mode (the top-k term) beside the task reward,
    2 steps on 2 ranks: the engine serves the adapter and agrees with the trainer at the fp32 level; the teacher's term moves it."""
    from tests.test_e2e import torchrun

    torchrun("train_grpo.py", tmp_path, "--config", "tiny_cpu_opd", "--trainer.total_steps", "2",
             "--trainer.val_every", "0", "--actor.lora.rank", "8", "--actor.optim.lr", "0.01", "--actor.use-kl-loss",
             "--distill.mode", "loss", "--distill.estimator", "topk", "--distill.topk", "4", "--distill.task-reward")
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert max(r["rollout/logp_abs_diff"] for r in rows) < 1e-4, rows
    assert all(r["actor/distill_loss"] > 0 and r["distill/reverse_kl"] > 0 and r["actor/kl_loss"] >= 0
               for r in rows), rows


def _teacher_body(teacher: str, sp: int):
    from lib import distill
    from lib.config import BatchingConfig, FSDPConfig, ModelConfig
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model

    topo = init_topology(device="cpu", sp_size=sp)
    t = build_sharded_model(ModelConfig(path=teacher), FSDPConfig(shard_size=0), topo, trainable=False)
    data = rl_batch(8, prompt_len=7, response_len=6, seed=9, min_response=1)
    dp_rank, dp = topo.rank // sp, topo.world_size // sp
    local = data[dp_rank * 8 // dp:(dp_rank + 1) * 8 // dp]
    distill.teacher_log_probs(t, local, BatchingConfig(micro_batch_size_per_rank=2), topo, TEMPERATURE, topk=TOPK)
    return [local.batch[k] for k in ("teacher_log_probs", *distill.TOPK_KEYS)]


def test_the_teachers_log_probs_do_not_depend_on_ranks_or_sequence_parallelism(pair):
    """The teacher sharded over 2 ranks (each scoring its half of the rows) and split over an SP group of 2 gives
    the log-probs of one rank, and the same top-k tokens (estimator=topk)."""
    _, teacher = pair
    (one,) = run_distributed(_teacher_body, teacher, 1, world_size=1)
    two = run_distributed(_teacher_body, teacher, 1, world_size=2)
    sp = run_distributed(_teacher_body, teacher, 2, world_size=2)
    for i, name in enumerate(("log-probs", "top-k log-probs", "top-k ids")):
        torch.testing.assert_close(torch.cat([r[i] for r in two]), one[i], rtol=1e-5, atol=1e-5, msg=name)
        for r in sp:
            torch.testing.assert_close(r[i], one[i], rtol=1e-5, atol=1e-5, msg=name)
