"""The config section of partial rollouts (``rollout.partial``), re-exported by lib/config.py; ground like it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PartialConfig:
    """Partial rollouts (lib/partial): a step's generation stops once it holds train_batch_size complete groups; the
    unfinished samples are carried, and continue in the next step under the new weights."""

    enabled: bool = False
    """Off: every step generates its prompts' samples to the end."""
    over_provision: float = 2.0
    """A step's pool of groups (carried and new) is at least this many times trainer.train_batch_size: new prompts are
    drawn, a data batch at a time, until it is."""
    chunk_tokens: int = 0
    """Tokens a sample generates between two counts of the step's complete groups: vLLM's engine steps between two
    counts (its requests stopped mid-call once the step has its groups), the HF engine's chunk (one generate call).
    0: a quarter of rollout.max_response_length."""
    step_token_budget: int = 0
    """Tokens the ranks may sample in one step's generation (0: no budget). Once it is spent, generation stops as soon
    as the ranks hold a complete group per rank, and the step trains the complete groups it holds, rounded down to a
    multiple of the ranks (each rank trains as many, as dynamic sampling rounds), at most trainer.train_batch_size."""
    max_staleness: int = 1
    """A carried group still generating whose first tokens were sampled more than this many steps (policy versions)
    before the step is dropped whole (counted in partial/dropped_groups). A complete group is judged in the step it
    completed, the first that could train it, and never dropped after: one left over at a step's end trains first in
    the next step, its tokens then up to this many steps + 1 old."""
