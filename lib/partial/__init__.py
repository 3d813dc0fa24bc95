"""Partial rollouts (``rollout.partial``): the long tail of generation no longer holds the step.

A step's generation works on a pool of groups: the samples carried from the last step (their prompt and partial
response, continued under the current weights) and new prompts of the data stream, a data batch at a time, until the
pool holds ``over_provision`` x train_batch_size groups. The pool generates in chunks of ``chunk_tokens`` a sample
(``generate_ids``: token ids in, the engines' multi-turn contract, so both engines take it); after each chunk the
ranks count the complete groups (every sample of the group ended), and generation stops once they hold
train_batch_size of them. The oldest complete groups train (completed in an earlier step first, then carried before
new, then in data order); the rest of the pool is carried, its tokens, the engine's per-token log-probs and the
policy version of each token kept on the host.

- ``carry.py``: a sample in the pool, and the pool's save and load (the checkpoint holds it: a resumed run continues
  the carried samples exactly);
- ``loop.py``: one step's generation, the batch it trains, the metrics.

The behaviour log-probs of a carried sample's tokens are the engine's at sampling time; the update corrects the
mismatch with the rollout correction of lib/algos.py (token-level importance weights, on by default with partial
rollouts). The canary (rollout/logp_abs_diff) is the fresh tokens' (sampled by this step's weights): a stale token's
difference is the policy's change, logged apart (partial/stale_logp_abs_diff).
"""

from __future__ import annotations

from typing import Any


def enabled(cfg: Any) -> bool:
    """``cfg``: the whole Config."""
    return bool(cfg.rollout.partial.enabled)


def config_problems(cfg: Any) -> list[str]:
    """What keeps partial rollouts from being right with the rest of the config (each naming the fix)."""
    if not enabled(cfg):
        return []
    p, problems = cfg.rollout.partial, []
    if p.over_provision < 1:
        problems.append(f"rollout.partial.over_provision={p.over_provision} must be >= 1: a step's pool needs at "
                        f"least train_batch_size groups")
    if p.chunk_tokens < 0:
        problems.append(f"rollout.partial.chunk_tokens={p.chunk_tokens} must be >= 0 (0: a quarter of "
                        f"rollout.max_response_length)")
    if p.step_token_budget < 0:
        problems.append(f"rollout.partial.step_token_budget={p.step_token_budget} must be >= 0 (0: no budget)")
    if p.max_staleness < 1:
        problems.append(f"rollout.partial.max_staleness={p.max_staleness} must be >= 1 (a carried sample is at "
                        f"least one step old)")
    if cfg.env.url or cfg.env.app or cfg.env.verifiers:
        problems.append("rollout.partial with an environment (env): an episode's session lives in its server, which "
                        "neither the pool nor the checkpoint can carry into another step: turn one off")
    if cfg.algorithm.bypass_mode:
        problems.append("rollout.partial with algorithm.bypass_mode: the engine's log-probs of a carried sample are "
                        "an older policy's, not the update's old policy: turn bypass_mode off")
    if cfg.rollout.routing_replay:
        problems.append("rollout.partial with rollout.routing_replay: a continued sample's prefix is prefilled again "
                        "under the new weights, so its first tokens were sampled under other routes for the same "
                        "positions than its later ones, and one route per position cannot replay both: turn one off")
    if cfg.distill.teacher and cfg.distill.mode == "loss":
        problems.append("rollout.partial with distill.mode=loss: its term over the sampled tokens is not weighted by "
                        "the rollout correction, and a carried sample's tokens were sampled by older students: use "
                        "distill.mode=reward (the teacher's term is then the advantage, corrected with the rest)")
    return problems
