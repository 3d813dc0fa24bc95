"""The config section of the samples every step keeps (``samples``), re-exported by lib/config.py; ground like it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplesConfig:
    """Every step keeps some of its samples in the run folder, as it trained on them (lib/samples):
    ``samples/step_NNNNNN.parquet``, one file a step, read by ``python -m lib.view RUN_DIR`` or as a dataset
    (``datasets.load_dataset("parquet", data_files="RUN_DIR/samples/*.parquet")``). Each sample: its prompt and
    response (text and ids), reward and reward terms, advantage, lengths, finish reason, per token the engine's and
    the trainer's log-probs, the entropy, the advantage and the loss mask, and a multi-turn episode's turns. A step's
    file holds at most ``max_rows`` samples of ~(4 x prompt + 22 x response) bytes each before compression (docs/
    samples.md); a resumed run rewrites the steps after its checkpoint, so every step is in one file once."""

    share: float = 0.125
    """The share of each step's groups (a prompt's samples) kept, chosen by their uid (the same groups whatever the
    number of ranks). 0: none kept, no file written."""
    max_rows: int = 64
    """A step's samples at most: whole groups in the choice's order while they fit (a first group over it is cut)."""
