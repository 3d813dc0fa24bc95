"""Step metrics: stage peaks that nest, response metrics under rollout correction's mask."""

import torch

from lib import runlog as run_logging
from lib.metrics import response_metrics
from lib.protocol import DataProto


class FakeAllocator:
    """The allocator's peak counter as torch.cuda keeps it: reset to the current allocation, raised by allocs."""

    def __init__(self):
        self.current = self.peak = 0

    def alloc(self, n):
        self.current += n
        self.peak = max(self.peak, self.current)

    def free(self, n):
        self.current -= n

    def reset(self):
        self.peak = self.current


def test_an_outer_stage_keeps_the_peak_its_inner_stages_reset(monkeypatch):
    """memory/step_peak_gb was the update stage's peak only: each nested stage reset the counter."""
    gib = 2**30
    a = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", a.reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: a.peak)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    m = {}
    with run_logging.stage("step", m):
        with run_logging.stage("rollout", m):
            a.alloc(10 * gib)
            a.free(10 * gib)
        a.alloc(7 * gib)  # between stages
        a.free(7 * gib)
        with run_logging.stage("update", m):
            a.alloc(4 * gib)
            a.free(4 * gib)
    assert (m["memory/rollout_peak_gb"], m["memory/update_peak_gb"], m["memory/step_peak_gb"]) == (10, 4, 10)


def test_response_metrics_count_sampled_tokens_under_a_correction_mask():
    """Rollout correction in mask mode takes rejected tokens out of response_mask; lengths and the clip ratio
    still count them (they were sampled)."""
    sampled = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
    loss_mask = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    prompts = torch.zeros(2, 3, dtype=torch.long)
    attention = torch.cat([torch.tensor([[0, 1, 1], [1, 1, 1]]), sampled.long()], 1)
    adv = torch.tensor([[1.0, 9.0, -2.0, 9.0], [0.5, 0.5, 0.0, 0.0]])
    batch = DataProto.from_dict({"prompts": prompts, "attention_mask": attention, "response_mask": loss_mask,
                                 "sampled_mask": sampled, "token_level_scores": torch.zeros(2, 4),
                                 "advantages": adv, "returns": adv})
    m = response_metrics(batch, max_len=4)
    assert (m["response/length_mean"], m["response/length_min"], m["response/clip_ratio"]) == (3.0, 2.0, 0.5)
    assert (m["prompt/length_min"], m["prompt/length_max"]) == (2.0, 3.0)
    # over the loss's tokens only: the masked-out 9s do not count
    assert (m["critic/advantages/max"], m["critic/advantages/min"], m["critic/advantages/mean"]) == (1.0, -2.0, 0.0)
