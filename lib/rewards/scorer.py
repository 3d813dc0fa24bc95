"""The trainer's side of scoring: decode responses, score them in the worker pool (plus an optional reward
model), place each score on its response's last token, count failures by kind."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lib.protocol import DataProto
from lib.rewards import FAILURE_KINDS, load_custom
from lib.rewards.pool import RewardPool


@dataclass
class Scored:
    """What scoring a batch gives. ``messages``: the first message of each failure kind seen in this batch."""

    token_scores: torch.Tensor  # (B, R): each score on its response's last token
    metrics: dict[str, float]
    scores: list[float]
    answers: list[Any]  # the extracted answer per row, None where the scorer gave none
    texts: list[str]  # the decoded responses that were scored
    messages: dict[str, str]


class Scorer:
    def __init__(self, tokenizer: Any, custom: str = "", timeout_s: float = 10.0, reward_model: Any = None,
                 num_workers: int = 2):
        self.tokenizer = tokenizer
        if custom:
            load_custom(custom)  # a bad file or name is a config error, raised here, before any worker starts
        self.pool = RewardPool(custom, timeout_s, num_workers)
        self.reward_model = reward_model  # callable(DataProto) -> (B,) scores, e.g. RewardModel below

    def __call__(self, data: DataProto) -> Scored:
        responses, mask = data.batch["responses"], data.batch["response_mask"]
        texts = self.tokenizer.batch_decode(responses.masked_fill(mask == 0, self.tokenizer.pad_token_id).tolist(),
                                            skip_special_tokens=True)
        n = len(data)
        sources = data.non_tensor_batch.get("data_source", np.array(["toy"] * n, dtype=object))
        truths = data.non_tensor_batch.get("ground_truth", np.array([None] * n, dtype=object))
        extras = data.non_tensor_batch.get("extra_info", np.array([None] * n, dtype=object))
        columns = data.non_tensor_batch.get("columns", np.array([None] * n, dtype=object))
        results = self.pool.score(list(zip(sources.tolist(), texts, truths.tolist(), extras.tolist(),
                                           columns.tolist())))
        counts = dict.fromkeys(FAILURE_KINDS, 0)
        sums: dict[str, list[float]] = defaultdict(list)
        messages: dict[str, str] = {}
        for score, extra, _, kind, message in results:
            if kind:
                counts[kind] += 1
                messages.setdefault(kind, message)
            for k, v in extra.items():
                sums[k].append(v)
        scores = [r[0] for r in results]
        if self.reward_model is not None:
            rm = self.reward_model(data).tolist()
            scores = [s + r for s, r in zip(scores, rm)]
            sums["rm_score"] = rm
        token_scores = torch.zeros(mask.shape, dtype=torch.float32)
        lengths = mask.sum(-1).long().cpu()  # scores are placed on CPU, then follow the batch's device
        rows = torch.nonzero(lengths > 0).flatten()
        token_scores[rows, lengths[rows] - 1] = torch.tensor(scores, dtype=torch.float32)[rows]
        metrics = {f"reward/{k}": float(v) for k, v in counts.items()}
        metrics.update({f"reward/{k}": float(np.mean(v)) for k, v in sums.items()})
        return Scored(token_scores.to(mask.device), metrics, scores, [r[2] for r in results], texts, messages)

    def close(self) -> None:
        self.pool.close()


class RewardModel:
    """A sequence-classification reward model (AutoModelForSequenceClassification, one label) scoring
    prompt + response; unsharded, inference only."""

    def __init__(self, path: str, device: torch.device):
        from transformers import AutoModelForSequenceClassification

        self.device = device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype).to(device)
        self.model.eval()

    @torch.no_grad()
    def __call__(self, data: DataProto) -> torch.Tensor:
        b = data.batch
        out = self.model(input_ids=b["input_ids"].to(self.device), attention_mask=b["attention_mask"].to(self.device),
                         position_ids=b["position_ids"].to(self.device))
        return out.logits[:, 0].float().cpu()
