"""RL math as pure tensor functions: advantages, policy and value losses, KL, loss aggregation.

No torch.distributed and no config objects here. Where a reduction spans the whole mini-batch (all
micro-batches, all ranks), the caller passes the global count in (``num_global_tokens``/``num_global_seqs``).

Shapes: B sequences, T response tokens. ``response_mask`` is (B, T) with 1 on tokens that count;
``index`` is a length-B array of group ids (any hashable; the n samples of a prompt share one).
Formulas follow the verl reference implementation (core_algos.py); each function says where it departs.
Plain-loop references of the vectorized functions live in ``lib/algos_ref.py`` and are tested against these.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

Tensor = torch.Tensor

# ---- masked statistics


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum(v*m) / (sum(m) + 1e-8), over all elements or along ``dim``."""
    if dim is None:
        return (values * mask).sum() / (mask.sum() + 1e-8)
    return (values * mask).sum(dim) / (mask.sum(dim) + 1e-8)


Reduce = Callable[[Tensor], Tensor]
"""Sums a float64 tensor over every rank that holds part of the batch (the caller's all-reduce); the
estimators below use it for batch-wide statistics, so their results do not depend on the number of ranks.
None: this batch is the whole batch."""


def masked_whiten(values: Tensor, mask: Tensor, reduce: Reduce | None = None) -> Tensor:
    """(v - masked mean) * rsqrt(unbiased masked var + 1e-8), the statistics over the whole batch (all ranks,
    through ``reduce``: one all-reduce of (sum, sum of squares, count) in float64). Masked positions are
    whitened too (not zeroed)."""
    # values, mask: (B, T)
    m = mask.to(torch.float64)
    v = values.to(torch.float64) * m
    moments = torch.stack([v.sum(), (v * v).sum(), m.sum()])
    if reduce is not None:
        moments = reduce(moments)
    total, total_sq, count = moments.tolist()
    if count < 2:
        raise ValueError(f"masked_whiten: the mask selects {int(count)} element(s); an unbiased variance needs "
                         f"2 or more (use a larger batch, or check that responses are not all empty)")
    mean = total / count
    var = max(total_sq - total * mean, 0.0) / (count - 1)
    return ((values.to(torch.float64) - mean) * (var + 1e-8) ** -0.5).to(values.dtype)


# ---- group statistics, vectorized over the group index


def group_ids(index: Any, device: torch.device | str = "cpu") -> tuple[Tensor, int]:
    """Map any hashable group ids to 0..G-1. Returns (ids (B,) long, G)."""
    if isinstance(index, Tensor):
        _, inverse = torch.unique(index, return_inverse=True)
        return inverse.to(device), int(inverse.max()) + 1 if inverse.numel() else 0
    arr = np.asarray(index, dtype=object) if not isinstance(index, np.ndarray) else index
    try:
        _, inverse = np.unique(arr, return_inverse=True)
    except TypeError:  # ids that do not sort against each other (mixed types): hash them instead
        lookup: dict = {}
        inverse = np.fromiter((lookup.setdefault(x, len(lookup)) for x in arr), dtype=np.int64, count=len(arr))
    inverse = torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)
    return inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def group_mean_std(scores: Tensor, index: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row group mean, unbiased group std and group size (each (B,)).
    A group of one has mean 0 and std 1 (the reference's convention, so its advantage is its score)."""
    gid, num_groups = group_ids(index, scores.device)
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, torch.ones_like(scores))
    mean = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, scores) / count
    sq = torch.zeros_like(mean).index_add_(0, gid, (scores - mean[gid]) ** 2)
    many = count > 1
    std = torch.where(many, torch.sqrt(sq / (count - 1).clamp(min=1)), torch.ones_like(sq))
    mean = torch.where(many, mean, torch.zeros_like(mean))
    return mean[gid], std[gid], count[gid]


# ---- advantage estimators: fn(token_level_rewards, response_mask, **kw) -> (advantages, returns), all (B, T)


def gae(token_level_rewards: Tensor, response_mask: Tensor, values: Tensor, gamma: float = 1.0, lam: float = 1.0,
        reduce: Reduce | None = None, **_: Any) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016). Masked tokens inside a response (tool output) carry the running values."""
    # token_level_rewards, response_mask, values: (B, T)
    with torch.no_grad():
        mask = response_mask.to(values.dtype)
        next_value = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        out = []
        for t in reversed(range(values.shape[1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            gae_t = delta + gamma * lam * last_gae
            next_value = values[:, t] * mask[:, t] + next_value * (1 - mask[:, t])
            last_gae = gae_t * mask[:, t] + last_gae * (1 - mask[:, t])
            out.append(last_gae)
        advantages = torch.stack(out[::-1], dim=1)
        returns = advantages + values
        return masked_whiten(advantages, mask, reduce), returns


def grpo(token_level_rewards: Tensor, response_mask: Tensor, index: Any, norm_adv_by_std: bool = True,
         epsilon: float = 1e-6, **_: Any) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024): (r - group mean) / (group std + eps). Without the std it is Dr.GRPO's."""
    # token_level_rewards, response_mask: (B, T); index: (B,)
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        mean, std, _ = group_mean_std(scores, index)
        adv = (scores - mean) / (std + epsilon) if norm_adv_by_std else scores - mean
        adv = adv.unsqueeze(-1) * response_mask
        return adv, adv


def rloo(token_level_rewards: Tensor, response_mask: Tensor, index: Any, **_: Any) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al. 2024): r minus the mean of the group's others = n/(n-1) (r - mean); n = 1: r."""
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        mean, _, count = group_mean_std(scores, index)
        factor = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.ones_like(count))
        adv = (scores * factor - mean * factor).unsqueeze(-1) * response_mask
        return adv, adv


def reinforce_plus_plus(token_level_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0,
                        reduce: Reduce | None = None, **_: Any) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted return over the sampled tokens, whitened over the batch. Departure from
    verl, whose return restarts at every masked token: here it passes masked tokens (a multi-turn row's observations)
    unchanged, so earlier turns get the episode's reward; on rows without inner masked tokens the two agree."""
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[1])):
            # a masked token (padding, or a multi-turn row's observation) neither adds nor discounts: the return
            # passes it unchanged to the sampled tokens before it
            running = torch.where(mask[:, t] > 0, token_level_rewards[:, t] + gamma * running, running)
            returns[:, t] = running
        return masked_whiten(returns, mask, reduce) * mask, returns


def reinforce_plus_plus_baseline(token_level_rewards: Tensor, response_mask: Tensor, index: Any,
                                 reduce: Reduce | None = None, **_: Any) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with the group mean as baseline, then whitened over the batch."""
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        scores = token_level_rewards.sum(-1)
        mean, _, _ = group_mean_std(scores, index)
        adv = (scores - mean).unsqueeze(-1) * mask
        adv = masked_whiten(adv, mask, reduce) * mask
        return adv, adv


def opo(token_level_rewards: Tensor, response_mask: Tensor, index: Any, **_: Any) -> tuple[Tensor, Tensor]:
    """OPO (Hao et al. 2025): baseline = length-weighted mean of the group's scores; a group of one has 0.
    Departure: a group whose responses are all empty gets baseline 0 where the reference divides 0 by 0."""
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        lengths = response_mask.sum(-1).to(scores.dtype)
        gid, num_groups = group_ids(index, scores.device)
        zeros = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
        weighted = zeros.clone().index_add_(0, gid, lengths * scores)
        total_len = zeros.clone().index_add_(0, gid, lengths)
        count = zeros.clone().index_add_(0, gid, torch.ones_like(scores))
        baseline = torch.where((count > 1) & (total_len > 0), weighted / total_len.clamp(min=1e-30), zeros)
        adv = (scores - baseline[gid]).unsqueeze(-1) * response_mask
        return adv, adv


def gpg(token_level_rewards: Tensor, response_mask: Tensor, index: Any, reduce: Reduce | None = None,
        **_: Any) -> tuple[Tensor, Tensor]:
    """GPG (Chu et al. 2025): (B / number of non-zero scores) * (r - group mean), both counts over the whole
    batch (all ranks, through ``reduce``)."""
    with torch.no_grad():
        scores = token_level_rewards.sum(-1)
        counts = torch.tensor([scores.shape[0], int(torch.count_nonzero(scores))], dtype=torch.float64)
        if reduce is not None:
            counts = reduce(counts)
        alpha = float(counts[0]) / max(float(counts[1]), 1.0)
        mean, _, _ = group_mean_std(scores, index)
        adv = (alpha * (scores - mean)).unsqueeze(-1) * response_mask
        return adv, adv


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "gae": gae, "grpo": grpo, "rloo": rloo, "reinforce_plus_plus": reinforce_plus_plus,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline, "opo": opo, "gpg": gpg,
}

# ---- loss aggregation

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(loss: Tensor, mask: Tensor, mode: str, num_global_tokens: float | Tensor | None = None,
             num_global_seqs: float | Tensor | None = None, norm_constant: float | None = None) -> Tensor:
    """Reduce a (B, T) loss to a scalar whose sum over micro-batches and ranks is the mini-batch value
    (verl 0.9.1 ``agg_loss``, with the global counts passed in instead of a dp-size factor).

    token-mean: sum(loss*m) / N, N = the mini-batch's token count over all ranks (default: this batch's).
    token-sum: sum(loss*m).
    seq-mean-token-sum / seq-mean-token-mean: per-sequence sum / mean, summed over non-empty sequences and
    divided by the mini-batch's number of non-empty sequences S (default: this batch's).
    seq-mean-token-sum-norm (Dr.GRPO): per-sequence sums over the non-empty sequences / S / a constant
    (``norm_constant``, default T; the trainer passes rollout.max_response_length so that it does not depend on
    how a micro-batch was padded).
    Counts are clamped to >= 1, so an all-masked batch gives 0, not NaN.
    """
    # loss, mask: (B, T)
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        n = mask.sum() if num_global_tokens is None else num_global_tokens
        return (loss * mask).sum() / torch.as_tensor(n, dtype=loss.dtype, device=loss.device).clamp(min=1)
    if mode == "token-sum":
        return (loss * mask).sum()
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        tokens = mask.sum(-1)
        per_seq = (loss * mask).sum(-1)
        if mode == "seq-mean-token-mean":
            per_seq = per_seq / tokens.clamp(min=1)
        nonempty = (tokens > 0).to(loss.dtype)
        n = nonempty.sum() if num_global_seqs is None else num_global_seqs
        out = (per_seq * nonempty).sum() / torch.as_tensor(n, dtype=loss.dtype, device=loss.device).clamp(min=1)
        if mode == "seq-mean-token-sum-norm":
            out = out / (norm_constant if norm_constant is not None else loss.shape[-1])
        return out
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {LOSS_AGG_MODES}")


# ---- policy losses: fn(old_log_prob, log_prob, advantages, response_mask, **kw) -> (loss, metrics)


def _finish(per_token: Tensor, response_mask: Tensor, weights: Tensor | None, mode: str, agg: dict) -> Tensor:
    if weights is not None:
        per_token = per_token * weights
    return agg_loss(per_token, response_mask, mode, **agg)


def vanilla_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
                        clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
                        loss_agg_mode: str = "token-mean", weights: Tensor | None = None,
                        **agg: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip (Schulman 2017) with clip-higher (DAPO) and dual clip (Ye et al. 2020) for A < 0."""
    # old_log_prob, log_prob, advantages, response_mask, weights: (B, T)
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual clip, got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    per_token = torch.where(advantages < 0, torch.minimum(loss3, clipped), clipped)
    metrics = {"pg_clipfrac": masked_mean((loss2 > loss1).float(), response_mask).detach(),
               # the reference takes the KL of the clamped log-ratio: equal unless |logp - old| > 20
               "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
               "pg_clipfrac_lower": masked_mean(((clipped > loss3) & (advantages < 0)).float(), response_mask).detach()}
    return _finish(per_token, response_mask, weights, loss_agg_mode, agg), metrics


def gspo_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
                     clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4, weights: Tensor | None = None,
                     **agg: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): a sequence-level ratio in the value, token-level in the gradient:
    log s = logp - sg(logp) + sg(seq masked mean(logp - old)), clamped at 10. Clipped as PPO (no dual clip,
    as in the reference); always aggregated seq-mean-token-mean, whatever ``loss_agg_mode`` says."""
    agg.pop("loss_agg_mode", None)
    agg.pop("clip_ratio_c", None)
    agg.pop("num_global_tokens", None)
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_s = torch.clamp(log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    loss1 = -advantages * s
    loss2 = -advantages * torch.clamp(s, 1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token = torch.maximum(loss1, loss2)
    metrics = {"pg_clipfrac": masked_mean((loss2 > loss1).float(), response_mask).detach(),
               "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
               "pg_clipfrac_lower": torch.zeros((), device=log_prob.device)}
    return _finish(per_token, response_mask, weights, "seq-mean-token-mean", agg), metrics


def cispo_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
                      clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, loss_agg_mode: str = "token-mean",
                      weights: Tensor | None = None, **agg: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): -sg(clip(ratio)) * A * logp. The clip bounds the weight, never the gradient."""
    agg.pop("clip_ratio_c", None)
    log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token = -clipped.detach() * advantages * log_prob
    metrics = {"pg_clipfrac": masked_mean((ratio != clipped).float(), response_mask).detach(),
               "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
               "pg_clipfrac_lower": masked_mean((ratio < clipped).float(), response_mask).detach()}
    return _finish(per_token, response_mask, weights, loss_agg_mode, agg), metrics


def gpg_policy_loss(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
                    loss_agg_mode: str = "token-mean", weights: Tensor | None = None,
                    **agg: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (Chu et al. 2025): plain policy gradient -logp * A, no ratio."""
    for k in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"):
        agg.pop(k, None)
    zero = torch.zeros((), device=log_prob.device)
    metrics = {"pg_clipfrac": zero, "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach(),
               "pg_clipfrac_lower": zero}
    return _finish(-log_prob * advantages, response_mask, weights, loss_agg_mode, agg), metrics


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "vanilla": vanilla_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss, "gpg": gpg_policy_loss,
}


def value_loss(vpreds: Tensor, returns: Tensor, values: Tensor, response_mask: Tensor, cliprange_value: float = 0.5,
               loss_agg_mode: str = "token-mean", **agg: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)); reports vf_clipfrac."""
    # vpreds, returns, values, response_mask: (B, T)
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss1 = (vpreds - returns) ** 2
    loss2 = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(loss1, loss2), response_mask, loss_agg_mode, **agg)
    return loss, {"vf_clipfrac": masked_mean((loss2 > loss1).float(), response_mask).detach()}


# ---- KL estimators (Schulman, "Approximating KL divergence", 2020): fn(log_prob, ref_log_prob) -> (B, T)


def kl_k1(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return log_prob - ref_log_prob


def kl_abs(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return (log_prob - ref_log_prob).abs()


def kl_k2(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    return 0.5 * (log_prob - ref_log_prob) ** 2


def kl_k3(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    x = torch.clamp(ref_log_prob - log_prob, -20.0, 20.0)
    return torch.clamp(torch.exp(x) - x - 1, -10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1, "kl": kl_k1, "abs": kl_abs, "k2": kl_k2, "mse": kl_k2, "k3": kl_k3, "low_var_kl": kl_k3,
}


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, estimator: str) -> Tensor:
    """Per-token KL by name. A ``+`` suffix keeps the value but takes k2's (unbiased) gradient."""
    straight_through = estimator.endswith("+")
    name = estimator[:-1] if straight_through else estimator
    if name not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; use one of {sorted(KL_ESTIMATORS)} (+ suffix allowed)")
    value = KL_ESTIMATORS[name](log_prob, ref_log_prob)
    if not straight_through:
        return value
    k2 = kl_k2(log_prob, ref_log_prob)
    return k2 - k2.detach() + value.detach()


TAIL_FLOOR = 1e-30
"""The smallest probability the coarsened KL below works with (log -69.1): a tail that rounds to zero or below."""


def with_tail(log_top: Tensor) -> Tensor:
    """(..., k) log-probs of k distinct tokens -> (..., k + 1): all the other tokens as one more outcome, with
    log(1 - the k probabilities' sum), floored at TAIL_FLOOR."""
    rest = (1 - log_top.exp().sum(-1, keepdim=True)).clamp(min=TAIL_FLOOR).log()
    return torch.cat([log_top, rest], -1)


def partition_kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(p || q) = sum_c p_c (log p_c - log q_c) over the last dim, where both are log-probs of the same outcomes that
    cover the whole vocabulary (``with_tail``); log-probs below log TAIL_FLOOR count as TAIL_FLOOR. (...)."""
    floor = float(np.log(TAIL_FLOOR))
    log_p, log_q = log_p.clamp(min=floor), log_q.clamp(min=floor)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def apply_kl_penalty(token_level_scores: Tensor, log_prob: Tensor, ref_log_prob: Tensor, response_mask: Tensor,
                     beta: float, estimator: str = "k1") -> tuple[Tensor, Tensor]:
    """KL in the reward: rewards = scores - beta * kl * mask. Returns (rewards (B, T), per-sequence mean KL (B,));
    the batch mean of the latter (over all ranks) is what a KL controller updates on."""
    kl = kl_penalty(log_prob, ref_log_prob, estimator) * response_mask
    return token_level_scores - beta * kl, masked_mean(kl, response_mask, dim=-1)


class FixedKLController:
    def __init__(self, init_kl_coef: float):
        self.value = init_kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Ziegler et al. 2019: beta *= 1 + clip(kl/target - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + error * n_steps / self.horizon


# ---- rollout correction (train / rollout mismatch) and DAPO parts


def rollout_correction(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, level: str = "token",
                       threshold: float = 2.0, mode: str = "truncate") -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Importance weights w = exp(clamp(old - rollout, -20, 20)) per token, or per sequence from the masked sum.
    ``truncate``: w = min(w, threshold). ``mask``: tokens (or whole sequences) with w > threshold leave the loss.
    Returns detached (weights (B, T), response_mask to use (B, T), metrics)."""
    with torch.no_grad():
        mask = response_mask.to(old_log_prob.dtype)
        diff = (old_log_prob - rollout_log_prob) * mask
        if level == "token":
            w = torch.exp(torch.clamp(diff, -20.0, 20.0))
        elif level == "sequence":
            w = torch.exp(torch.clamp(diff.sum(-1, keepdim=True), -20.0, 20.0)).expand_as(diff)
        else:
            raise ValueError(f"rollout correction level must be 'token' or 'sequence', got {level!r}")
        over = (w > threshold).to(mask.dtype) * mask
        metrics = {"rollout_is_mean": masked_mean(w, mask),
                   "rollout_is_seq_frac_over": ((over.sum(-1) > 0).float()).mean()}
        if mode == "truncate":
            metrics["rollout_is_frac_clipped"] = masked_mean(over, mask)
            return torch.clamp(w, max=threshold) * mask, response_mask, metrics
        if mode == "mask":
            keep = mask * (1 - over)
            metrics["rollout_is_frac_masked"] = masked_mean(over, mask)
            return w * keep, keep.to(response_mask.dtype), metrics
        raise ValueError(f"rollout correction mode must be 'truncate' or 'mask', got {mode!r}")


def overlong_penalty(response_lengths: Tensor, max_response_length: int, buffer: int,
                     penalty_factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment: 0 up to max - buffer, then linear down to -factor at max. (B,)"""
    expected = max_response_length - buffer
    return torch.clamp(-(response_lengths.to(torch.float32) - expected) / buffer * penalty_factor, max=0.0)


def filter_groups(scores: Tensor, index: Any) -> tuple[np.ndarray, float]:
    """DAPO dynamic sampling: keep the rows of groups whose scores differ (std > 0); groups of one are kept,
    as in the reference. Returns (kept row indices in order, fraction of groups kept)."""
    # scores: (B,); index: (B,)
    gid, num_groups = group_ids(index, scores.device)
    if num_groups == 0:
        return np.zeros(0, dtype=np.int64), 0.0
    empty = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    high = empty.scatter_reduce(0, gid, scores, "amax", include_self=False)
    low = empty.scatter_reduce(0, gid, scores, "amin", include_self=False)
    count = torch.bincount(gid, minlength=num_groups)
    keep_group = (high > low) | (count == 1)
    return torch.nonzero(keep_group[gid]).flatten().cpu().numpy(), float(keep_group.float().mean())


def select_groups(rounds: list[list[Any]], keep: int, seed: int) -> set:
    """DAPO dynamic sampling, when the rounds kept more groups than a batch needs: keep every group of the earlier
    rounds and a seeded random choice among the last round's (the reference keeps generation order; a choice by
    rank order would favour the low ranks). ``rounds``: the kept group ids of each round, over all ranks."""
    chosen: list[Any] = []
    for ids in rounds:
        room = keep - len(chosen)
        if room <= 0:
            break
        if len(ids) <= room:
            chosen += ids
        else:
            order = np.random.default_rng(seed).permutation(len(ids))[:room]
            chosen += [ids[i] for i in sorted(order)]
    return set(chosen)
