"""The RL math against hand-computed numbers and against the plain-loop references."""

import math

import numpy as np
import pytest
import torch

from lib import algos, algos_ref
from lib.algos import (ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, AdaptiveKLController, FixedKLController,
                       agg_loss, apply_kl_penalty, filter_groups, kl_penalty, masked_whiten, overlong_penalty,
                       rollout_correction, value_loss)
from lib.logprobs import entropy_from_logits, head_log_probs, log_probs_from_logits, log_probs_naive


def outcome(scores, T=3, lengths=None):
    """Token rewards with each sequence's score on its last valid token, and the mask."""
    B = len(scores)
    lengths = lengths or [T] * B
    mask = torch.zeros(B, T)
    rewards = torch.zeros(B, T)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1
        if n:
            rewards[i, n - 1] = s
    return rewards, mask


# ---- advantages, by hand


def test_grpo_by_hand():
    rewards, mask = outcome([1.0, 0.0, 1.0, 5.0], lengths=[3, 2, 3, 1])
    index = np.array(["a", "a", "a", "b"], dtype=object)
    adv, ret = algos.grpo(rewards, mask, index)
    std = math.sqrt(((1 - 2 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)  # unbiased
    expect_a = [(1 - 2 / 3) / (std + 1e-6), (0 - 2 / 3) / (std + 1e-6)]
    assert adv[0, 0].item() == pytest.approx(expect_a[0], rel=1e-6)
    assert adv[1, :2].tolist() == pytest.approx([expect_a[1]] * 2, rel=1e-6) and adv[1, 2] == 0
    assert adv[3].tolist() == pytest.approx([5.0 / (1 + 1e-6), 0, 0])  # group of one: mean 0, std 1
    assert torch.equal(adv, ret)
    dr, _ = algos.grpo(rewards, mask, index, norm_adv_by_std=False)
    assert dr[0, 0].item() == pytest.approx(1 / 3) and dr[3, 0].item() == 5.0


def test_grpo_all_equal_group_is_zero():
    rewards, mask = outcome([1.0, 1.0, 1.0])
    adv, _ = algos.grpo(rewards, mask, [7, 7, 7])
    assert torch.count_nonzero(adv) == 0


def test_rloo_by_hand():
    rewards, mask = outcome([1.0, 0.0, 2.0, 3.0])
    adv, _ = algos.rloo(rewards, mask, ["g", "g", "g", "solo"])
    assert adv[:, 0].tolist() == pytest.approx([1 - 1.0, 0 - 1.5, 2 - 0.5, 3.0])


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.4]])
    mask = torch.ones(1, 3)
    gamma, lam = 0.9, 0.8
    d2 = 1.0 - 0.4
    d1 = 0 + gamma * 0.4 - 0.2
    d0 = 0 + gamma * 0.2 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    raw = torch.tensor([[a0, a1, a2]])
    adv, ret = algos.gae(rewards, mask, values=values, gamma=gamma, lam=lam)
    assert ret.tolist()[0] == pytest.approx((raw + values).tolist()[0], rel=1e-6)
    mean, var = raw.mean(), raw.var()  # unbiased
    assert adv.tolist()[0] == pytest.approx(((raw - mean) / torch.sqrt(var + 1e-8)).tolist()[0], rel=1e-5)


def test_gae_skips_masked_tokens_inside_a_response():
    # token 1 is a tool observation: GAE must treat tokens 0 and 2 as adjacent
    rewards = torch.tensor([[0.0, 9.0, 1.0], [0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 7.0, 0.4], [0.5, 0.3, 0.4]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    adv, ret = algos.gae(rewards, mask, values=values, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = algos_ref.gae_ref(rewards, mask, values, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-5, atol=1e-6)
    raw0 = ret[0] - values[0]
    a2 = 1.0 - 0.4
    assert raw0[2].item() == pytest.approx(a2)
    assert raw0[0].item() == pytest.approx((0.9 * 0.4 - 0.5) + 0.9 * 0.8 * a2)


def test_reinforce_plus_plus_by_hand():
    rewards = torch.tensor([[0.0, 1.0, 0.0, 5.0], [0.0, 0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv, ret = algos.reinforce_plus_plus(rewards, mask, gamma=0.5)
    # row 0: the reward after the response (5.0 at t=3) must not leak into t<=1
    assert ret[0, :2].tolist() == pytest.approx([0.5, 1.0])
    assert ret[1].tolist() == pytest.approx([0.5, 1.0, 2.0, 0.0])
    torch.testing.assert_close(adv, masked_whiten(ret, mask) * mask)
    assert adv[0, 2:].tolist() == [0.0, 0.0]


def test_reinforce_plus_plus_baseline():
    rewards, mask = outcome([1.0, 0.0, 3.0, 1.0], lengths=[3, 3, 2, 3])
    adv, _ = algos.reinforce_plus_plus_baseline(rewards, mask, ["a", "a", "b", "b"])
    ref, _ = algos_ref.reinforce_plus_plus_baseline_ref(rewards, mask, ["a", "a", "b", "b"])
    torch.testing.assert_close(adv, ref, rtol=1e-5, atol=1e-6)
    base = torch.tensor([[0.5] * 3, [-0.5] * 3, [1.0, 1.0, 0], [-1.0] * 3]) * mask
    torch.testing.assert_close(adv, masked_whiten(base, mask) * mask)


def test_opo_and_gpg_by_hand():
    rewards, mask = outcome([1.0, 0.0, 2.0], T=4, lengths=[1, 3, 2])
    adv, _ = algos.opo(rewards, mask, ["g", "g", "solo"])
    base = (1 * 1.0 + 3 * 0.0) / 4
    assert adv[:, 0].tolist() == pytest.approx([1 - base, -base, 2.0])
    rewards, mask = outcome([1.0, 0.0, 0.0, 3.0])
    adv, _ = algos.gpg(rewards, mask, ["a", "a", "b", "b"])
    alpha = 4 / 2
    assert adv[:, 0].tolist() == pytest.approx([alpha * 0.5, -alpha * 0.5, -alpha * 1.5, alpha * 1.5])
    zero, _ = algos.gpg(*outcome([0.0, 0.0]), index=["a", "a"])  # no non-zero score: alpha = B / 1
    assert torch.count_nonzero(zero) == 0


def test_fully_masked_rows_get_zero():
    rewards, mask = outcome([1.0, 0.0, 1.0, 1.0], lengths=[3, 0, 2, 3])
    for name in ("grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline", "reinforce_plus_plus"):
        adv, _ = ADVANTAGE_ESTIMATORS[name](rewards, mask, index=["a", "a", "b", "b"], gamma=1.0)
        assert torch.count_nonzero(adv[1]) == 0, name
        assert torch.isfinite(adv).all(), name


def test_masked_whiten_refuses_too_few_tokens():
    with pytest.raises(ValueError, match="2 or more"):
        masked_whiten(torch.ones(1, 2), torch.tensor([[1.0, 0.0]]))


@pytest.mark.parametrize("index_kind", ["str", "int", "tensor", "mixed"])
def test_vectorized_group_estimators_match_the_loops(index_kind):
    g = torch.Generator().manual_seed(0)
    B, T, n = 48, 7, 4
    rewards = torch.randn(B, T, generator=g)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    rewards = rewards * mask
    rewards[::5] = 0  # some zero scores for gpg and all-equal groups
    groups = [i // n if i < 40 else 100 + i for i in range(B)]  # groups of n, then groups of one
    index = {"str": np.array([f"u{x}" for x in groups], dtype=object), "int": np.array(groups),
             "tensor": torch.tensor(groups), "mixed": np.array([x if x % 2 else f"s{x}" for x in groups], dtype=object)}[
        index_kind]
    for fast, slow in [(algos.grpo, algos_ref.grpo_ref), (algos.rloo, algos_ref.rloo_ref),
                       (algos.opo, algos_ref.opo_ref), (algos.gpg, algos_ref.gpg_ref),
                       (algos.reinforce_plus_plus_baseline, algos_ref.reinforce_plus_plus_baseline_ref)]:
        torch.testing.assert_close(fast(rewards, mask, index)[0], slow(rewards, mask, index)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(algos.grpo(rewards, mask, index, norm_adv_by_std=False)[0],
                               algos_ref.grpo_ref(rewards, mask, index, norm_adv_by_std=False)[0])
    values = torch.randn(B, T, generator=g)
    fast, slow = algos.gae(rewards, mask, values=values, gamma=0.99, lam=0.95), algos_ref.gae_ref(
        rewards, mask, values, gamma=0.99, lam=0.95)
    torch.testing.assert_close(fast[0], slow[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast[1], slow[1], rtol=1e-5, atol=1e-5)
    scores = rewards.sum(-1)
    kept, frac = filter_groups(scores, index)
    ref_kept, ref_frac = algos_ref.filter_groups_ref(scores, index)
    assert kept.tolist() == ref_kept.tolist() and frac == pytest.approx(ref_frac)


def test_filter_groups():
    kept, frac = filter_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5]), ["a", "a", "b", "b", "c"])
    assert kept.tolist() == [2, 3, 4] and frac == pytest.approx(2 / 3)


# ---- policy losses


def test_vanilla_clip_and_dual_clip_by_hand():
    old = torch.zeros(1, 6)
    ratios = torch.tensor([[0.5, 1.1, 1.5, 0.5, 1.5, 5.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]])
    mask = torch.ones(1, 6)
    loss, m = algos.vanilla_policy_loss(old, ratios.log(), adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                        clip_ratio_c=3.0)
    # A>0: max(-r, -clip(r)) ; A<0: min(3, max(r, clip(r)))
    expect = [-0.5, -1.1, -1.28, 0.8, 1.5, 3.0]
    assert loss.item() == pytest.approx(sum(expect) / 6, rel=1e-6)
    # clipped where L2 > L1: r=1.5 with A>0 (-1.28 > -1.5) and r=0.5 with A<0 (0.8 > 0.5)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 6)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(1 / 6)  # the r=5 token hits the dual clip
    assert m["ppo_kl"].item() == pytest.approx(-ratios.log().mean().item(), rel=1e-6)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        algos.vanilla_policy_loss(old, old, adv, mask, clip_ratio_c=1.0)


def test_clip_boundaries_are_not_counted():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(1.2), math.log(0.8)]])
    _, m = algos.vanilla_policy_loss(old, logp, torch.ones(1, 2), torch.ones(1, 2))
    assert m["pg_clipfrac"].item() == 0.0


def test_vanilla_gradients_and_importance_weights():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, -0.3, 0.4], [0.0, 0.05, -2.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w = torch.tensor([[2.0, 1.0, 1.0], [1.0, 0.5, 1.0]])
    loss, _ = algos.vanilla_policy_loss(old, logp, adv, mask, weights=w)
    loss.backward()
    r = logp.detach().exp()
    # unclipped tokens: d(-A r w)/dlogp = -A r w / N ; clipped tokens have zero gradient
    n = 5
    assert logp.grad[0, 0].item() == pytest.approx(-1 * r[0, 0].item() * 2 / n, rel=1e-5)
    assert logp.grad[0, 1].item() == 0.0  # r = 0.74 < 0.8 with A < 0: clipped
    assert logp.grad[0, 2].item() == 0.0  # masked
    assert logp.grad[1, 1].item() == pytest.approx(-1 * r[1, 1].item() * 0.5 / n, rel=1e-5)
    assert logp.grad[1, 2].item() == 0.0  # r = 0.135 < 0.8, A < 0: clipped


def test_gspo_by_hand():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.2, 9.0], [0.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    loss, m = algos.gspo_policy_loss(old, logp, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.1,
                                     loss_agg_mode="token-mean")
    s0 = math.exp(0.15)  # masked mean of (0.1, 0.2)
    expect_row0 = max(-s0, -1.1)  # A > 0: clipped at 1.1
    expect_row1 = 1.0
    assert loss.item() == pytest.approx((expect_row0 + expect_row1) / 2, rel=1e-6)  # seq-mean-token-mean
    loss.backward()
    assert logp.grad[0].tolist() == [0.0, 0.0, 0.0]  # row 0 clipped (s > 1.1)
    # row 1: d/dlogp_t of mean_t(-A * s) = A * s / 3 per token, then / 2 sequences
    assert logp.grad[1].tolist() == pytest.approx([1 / 6] * 3)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 5)


def test_cispo_and_gpg():
    old = torch.zeros(1, 3)
    logp = torch.tensor([[math.log(2.0), math.log(1.0), math.log(0.5)]], requires_grad=True)
    adv = torch.ones(1, 3)
    loss, m = algos.cispo_policy_loss(old, logp, adv, torch.ones(1, 3), clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss.backward()
    w = [1.2, 1.0, 0.8]
    assert loss.item() == pytest.approx(-sum(wi * li for wi, li in zip(w, logp.detach()[0].tolist())) / 3)
    assert logp.grad[0].tolist() == pytest.approx([-wi / 3 for wi in w])  # every token keeps a gradient
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 3)
    loss, _ = algos.gpg_policy_loss(old, logp.detach(), adv * 2, torch.ones(1, 3))
    assert loss.item() == pytest.approx(-2 * sum(logp.detach()[0].tolist()) / 3)
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "cispo", "gpg"}


def test_value_loss_by_hand():
    vpreds = torch.tensor([[1.0, 0.0, 3.0]])
    values = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    loss, m = value_loss(vpreds, returns, values, torch.ones(1, 3), cliprange_value=0.5)
    # token 0: max((1-2)^2, (0.5-2)^2)=2.25 ; token 1: 1 ; token 2: max(9, 0.25) = 9
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1 + 9) / 3)
    assert m["vf_clipfrac"].item() == pytest.approx(1 / 3)


# ---- aggregation


def test_agg_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(18 / 5)
    assert agg_loss(loss, mask, "token-mean", num_global_tokens=10).item() == pytest.approx(1.8)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 15) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 5) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean", num_global_seqs=4).item() == pytest.approx(6.5 / 4)
    # Dr.GRPO (verl 0.9.1): per-sequence token sums over the non-empty sequences, / their count, / the constant.
    # Before the fix the division by the sequence count was missing (18 / 3 here, S times too large).
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((3 + 15) / 2 / 3)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_constant=9).item() == pytest.approx(18 / 2 / 9)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", num_global_seqs=4, norm_constant=9).item() == \
        pytest.approx(18 / 4 / 9)
    assert agg_loss(loss, mask, "token-sum").item() == pytest.approx(18)
    assert agg_loss(loss, torch.zeros(3, 3), "token-mean").item() == 0.0
    assert agg_loss(loss, torch.zeros(3, 3), "seq-mean-token-mean").item() == 0.0
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(loss, mask, "mean")


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_agg_is_independent_of_micro_batching(mode):
    g = torch.Generator().manual_seed(1)
    loss = torch.randn(8, 5, generator=g)
    mask = (torch.rand(8, 5, generator=g) > 0.3).float()
    mask[3] = 0
    whole = agg_loss(loss, mask, mode)
    tokens, seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    parts = sum(agg_loss(loss[i:i + 3], mask[i:i + 3], mode, num_global_tokens=tokens, num_global_seqs=seqs)
                for i in range(0, 8, 3))
    torch.testing.assert_close(parts, whole)


# ---- KL


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_penalty(logp, ref, "kl").tolist() == pytest.approx([0.5, -1.0])
    assert kl_penalty(logp, ref, "abs").tolist() == pytest.approx([0.5, 1.0])
    assert kl_penalty(logp, ref, "mse").tolist() == pytest.approx([0.125, 0.5])
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert kl_penalty(logp, ref, "low_var_kl").tolist() == pytest.approx(k3)
    big = kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3")  # clamped to 10
    assert big.item() == 10.0
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(logp, ref, "k4")
    assert {"k1", "k2", "k3", "abs", "kl", "mse", "low_var_kl"} == set(KL_ESTIMATORS)


@pytest.mark.parametrize("base", ["k1", "k3", "abs"])
def test_straight_through_kl_takes_k2_gradient(base):
    logp = torch.tensor([-1.0, -2.0, -0.3], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.3])
    value = kl_penalty(logp, ref, base + "+")
    torch.testing.assert_close(value.detach(), kl_penalty(logp.detach(), ref, base))
    value.sum().backward()
    torch.testing.assert_close(logp.grad, (logp - ref).detach())  # d/dlogp of 0.5 (logp - ref)^2


def test_kl_in_reward_and_controllers():
    scores = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    logp, ref = torch.tensor([[-1.0, -1.0], [-1.0, -3.0]]), torch.tensor([[-1.5, -1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    rewards, seq_kl = apply_kl_penalty(scores, logp, ref, mask, beta=0.1, estimator="k1")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 1.0], [0.0, 0.0]]))
    assert seq_kl.tolist() == pytest.approx([0.25, 0.0])
    fixed = FixedKLController(0.1)
    fixed.update(5.0, 64)
    assert fixed.value == 0.1
    ada = AdaptiveKLController(0.1, target_kl=0.5, horizon=1000)
    ada.update(current_kl=2.0, n_steps=100)  # error clipped at 0.2
    assert ada.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))
    ada.update(current_kl=0.45, n_steps=100)
    assert ada.value == pytest.approx(0.1 * 1.02 * (1 + (-0.1) * 0.1))


# ---- rollout correction and DAPO


def test_rollout_correction():
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    roll = torch.tensor([[0.0, -1.0, 0.0], [-0.2, -0.2, -5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w, keep, m = rollout_correction(old, roll, mask, level="token", threshold=2.0, mode="truncate")
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 1.0])  # e^1 = 2.718 truncated
    assert w.tolist()[1] == pytest.approx([math.exp(0.2), math.exp(0.2), 0.0])
    assert torch.equal(keep, mask) and m["rollout_is_frac_clipped"].item() == pytest.approx(1 / 5)
    w, keep, m = rollout_correction(old, roll, mask, level="token", mode="mask")
    assert keep.tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]] and w[0, 1] == 0
    w, keep, _ = rollout_correction(old, roll, mask, level="sequence", threshold=1.45, mode="mask")
    # seq 0: e^1 = 2.72 > 1.45 -> masked whole; seq 1: e^0.4 = 1.49 > 1.45 -> masked too
    assert keep.sum() == 0
    w, _, _ = rollout_correction(old, roll, mask, level="sequence", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0, 2.0], [math.exp(0.4), math.exp(0.4), 0.0]]))
    assert not w.requires_grad


def test_overlong_penalty():
    lengths = torch.tensor([10, 16, 18, 20])
    pen = overlong_penalty(lengths, max_response_length=20, buffer=4, penalty_factor=1.0)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])


# ---- log-probs and entropy


@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 1.3),
                                               (torch.bfloat16, 1.0)])
def test_chunked_log_probs_match_the_naive_version(dtype, temperature):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 37, 101, generator=g) * 3).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 101, (3, 37), generator=g)
    logp, ent = log_probs_from_logits(logits, labels, temperature, with_entropy=True, chunk_tokens=16)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref_logp, ref_ent = log_probs_naive(ref_logits, labels, temperature)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    w1, w2 = torch.randn(3, 37, generator=g), torch.randn(3, 37, generator=g)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    ((ref_logp * w1).sum() + (ref_ent * w2).sum()).backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad.float(), rtol=tol, atol=tol)
    assert logits.grad.dtype == dtype


def test_log_probs_without_entropy_and_gradcheck():
    logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 7, (5,))
    logp, ent = log_probs_from_logits(logits, labels, 0.9, chunk_tokens=2)
    assert ent is None
    torch.testing.assert_close(logp.double(), log_probs_naive(logits, labels, 0.9)[0].double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy_from_logits(logits), log_probs_naive(logits, labels)[1].float())


@pytest.mark.parametrize("with_entropy", [True, False])
def test_log_probs_of_several_labels_per_position_match_the_naive_version(with_entropy):
    """Labels (..., m): m log-probs per position from one pass, each with its gradient (on-policy distillation's
    student at the teacher's top-k tokens, lib.algos.partition_kl), the entropy still one per position."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 9, 53, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    labels = torch.randint(0, 53, (2, 9, 4), generator=g)
    logp, ent = log_probs_from_logits(logits, labels, 0.8, with_entropy=with_entropy, chunk_tokens=5)
    assert logp.shape == (2, 9, 4) and (ent is None) != with_entropy
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref_all = torch.log_softmax(ref_logits / 0.8, -1)
    ref = ref_all.gather(-1, labels)
    torch.testing.assert_close(logp.double(), ref, rtol=1e-6, atol=1e-6)
    w = torch.randn(2, 9, 4, generator=g, dtype=torch.float64)
    loss, ref_loss = (logp * w).sum(), (ref * w).sum()
    if with_entropy:
        we = torch.randn(2, 9, generator=g, dtype=torch.float64)
        loss, ref_loss = loss + (ent * we).sum(), ref_loss - ((ref_all.exp() * ref_all).sum(-1) * we).sum()
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-5)


def test_the_top_k_and_the_coarsened_kl():
    """top_log_probs: the k largest log-probs, highest first, their ids, and the rest's logsumexp (-inf at k = V).
    partition_kl over (the teacher's top k + the rest) is the exact KL of the coarsened distributions: at k = V the
    whole KL(p || q), below it never more, and 0 for p = q."""
    from lib.algos import partition_kl, with_tail
    from lib.logprobs import top_log_probs

    g = torch.Generator().manual_seed(6)
    student, teacher = torch.randn(7, 31, generator=g) * 2, torch.randn(7, 31, generator=g) * 2
    ls, lt = torch.log_softmax(student.double() / 0.7, -1), torch.log_softmax(teacher.double() / 0.7, -1)
    full = (ls.exp() * (ls - lt)).sum(-1)
    for k in (1, 5, 30, 31):
        top, ids = top_log_probs(teacher, k, 0.7, chunk_tokens=3)
        assert top.shape == (7, k + 1) and ids.shape == (7, k)
        torch.testing.assert_close(top[:, :k].double(), lt.topk(k, -1).values, rtol=0, atol=1e-6)
        rest = lt.scatter(-1, ids, float("-inf")).logsumexp(-1)
        torch.testing.assert_close(top[:, k].double(), rest.to(top.dtype).double(), rtol=0, atol=1e-6)
        at_ids = log_probs_from_logits(student, ids, 0.7)[0]
        kl = partition_kl(with_tail(at_ids), top)
        coarse_s = torch.cat([ls.gather(-1, ids), (1 - ls.gather(-1, ids).exp().sum(-1, keepdim=True)).log()], -1)
        coarse_t = torch.cat([lt.gather(-1, ids), rest[:, None]], -1)
        hand = (coarse_s.exp() * (coarse_s - coarse_t)).sum(-1) if k < 31 else full
        torch.testing.assert_close(kl.double(), hand, rtol=1e-5, atol=2e-6)  # fp32 sums of terms ~3
        assert (kl.double() <= full * (1 + 1e-5) + 2e-6).all()
        assert torch.equal(partition_kl(top, top), torch.zeros(7))


def test_log_probs_at_no_position():
    """A packed micro-batch whose rows have no response token asks for log-probs at 0 positions: one label or several
    per position, the shapes stay (0,) and (0, m)."""
    logits = torch.randn(0, 7, requires_grad=True)
    one, ent = log_probs_from_logits(logits, torch.zeros(0, dtype=torch.long), with_entropy=True)
    several, _ = log_probs_from_logits(logits, torch.zeros(0, 3, dtype=torch.long))
    assert one.shape == ent.shape == (0,) and several.shape == (0, 3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("labels_per_position,with_entropy,frozen",
                         [(None, True, False), (3, False, False), (None, False, True), (2, True, True)])
def test_the_fused_head_is_the_head_then_the_chunked_log_probs(dtype, labels_per_position, with_entropy, frozen):
    """lib.logprobs.head_log_probs (the LM head's matmul redone per chunk, no (N, V) logits) against the head's
    logits then log_probs_from_logits: the log-probs, the entropy, and the gradients into the hidden states and the
    weight (none for a frozen head, as LoRA's), with placeholder columns banned and chunks that do not divide N."""
    g = torch.Generator().manual_seed(8)
    n, h, v = 23, 12, 61
    hidden = (torch.randn(n, h, generator=g, dtype=torch.float64)).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64)).to(dtype).requires_grad_(not frozen)
    shape = (n,) if labels_per_position is None else (n, labels_per_position)
    labels = torch.randint(0, v, shape, generator=g)
    banned = torch.tensor([4, 40])
    ref_hidden, ref_weight = (x.detach().clone().requires_grad_(x.requires_grad) for x in (hidden, weight))
    logp, ent = head_log_probs(hidden, weight, labels, 0.8, with_entropy, banned, -1e9, chunk_tokens=5)
    logits = torch.nn.functional.linear(ref_hidden, ref_weight).index_fill(-1, banned, -1e9)
    ref_logp, ref_ent = log_probs_from_logits(logits, labels, 0.8, with_entropy, chunk_tokens=5)
    assert logp.shape == shape and (ent is None) != with_entropy
    # bf16: a matmul over 5 rows may round differently from one over 23 on some CPU; the weight's gradient is summed
    # over chunks in fp32 (the reference: one bf16 matmul over all N)
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    torch.testing.assert_close(logp, ref_logp, rtol=tol, atol=tol)
    w = torch.randn(shape, generator=g, dtype=torch.float64).float()
    loss, ref_loss = (logp * w).sum(), (ref_logp * w).sum()
    if with_entropy:
        torch.testing.assert_close(ent, ref_ent, rtol=tol, atol=tol)
        we = torch.randn(n, generator=g, dtype=torch.float64).float()
        loss, ref_loss = loss + (ent * we).sum(), ref_loss + (ref_ent * we).sum()
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=tol, atol=tol)
    assert hidden.grad.dtype == dtype
    if frozen:
        assert weight.grad is None
    else:
        assert weight.grad.dtype == dtype and weight.grad[banned].abs().max() == 0
        torch.testing.assert_close(weight.grad.double(), ref_weight.grad.double(), rtol=tol, atol=tol)
    empty, _ = head_log_probs(hidden[:0], weight, labels[:0], with_entropy=True)
    assert empty.shape == (0, *shape[1:])


@pytest.mark.parametrize("used", ["log-probs", "entropy"])
def test_an_output_the_loss_leaves_out_costs_no_gradient_pass(used):
    """At entropy_coef 0 the entropy is logged, not trained: its gradient comes to backward as None (it came as
    zeros, and the entropy's gradient ran over every chunk: 219 -> 149 ms for 2048 x 32768 logits on 2 CPU threads).
    The logits' gradient is the naive version's either way, also with only the entropy in the loss."""
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(4, 11, 29, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    labels = torch.randint(0, 29, (4, 11), generator=g)
    logp, ent = log_probs_from_logits(logits, labels, 0.9, with_entropy=True, chunk_tokens=7)
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref_logp, ref_ent = log_probs_naive(ref_logits, labels, 0.9)
    w = torch.randn(4, 11, generator=g, dtype=torch.float64)
    ((logp if used == "log-probs" else ent) * w).sum().backward()
    ((ref_logp if used == "log-probs" else ref_ent).double() * w).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-6, atol=1e-6)
