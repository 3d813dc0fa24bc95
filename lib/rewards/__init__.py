"""Scoring responses: a rule per ``data_source``, a custom function, or a reward model -> token_level_scores.

A scorer that raises, or runs past ``timeout_s``, gives that sample 0 and is counted in the metrics
(``reward/errors``, ``reward/timeouts``); the run goes on. Extra keys a scorer returns (acc, format, ...)
are averaged into the metrics as ``reward/<key>``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import threading
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable

import numpy as np
import torch

from lib.protocol import DataProto
from lib.rewards import builtin

ScoreFn = Callable[..., Any]

RULES: dict[str, ScoreFn] = {
    "openai/gsm8k": builtin.gsm8k, "gsm8k": builtin.gsm8k,
    "lighteval/MATH": builtin.math_answer, "DigitalLearningGmbH/MATH-lighteval": builtin.math_answer,
    "math": builtin.math_answer, "HuggingFaceH4/MATH-500": builtin.math_answer,
    "toy": builtin.toy,
}


def load_custom(spec: str) -> ScoreFn:
    """``path/to/file.py:function`` -> the function (checked before any model loads)."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"custom reward {spec!r} must look like path/to/file.py:function_name")
    if not os.path.isfile(path):
        raise ValueError(f"custom reward file {path!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"custom_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{path} has no function {name!r}")
    return fn


class _Timeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float):
    # SIGALRM interrupts pure-Python loops in the main thread; elsewhere the limit is not enforced
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(*_):
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Scorer:
    def __init__(self, tokenizer: Any, custom: str = "", timeout_s: float = 10.0, reward_model: Any = None):
        self.tokenizer = tokenizer
        self.custom = load_custom(custom) if custom else None
        self.timeout_s = timeout_s
        self.reward_model = reward_model  # callable(DataProto) -> (B,) scores, e.g. RewardModel below

    def fn_for(self, data_source: str) -> ScoreFn:
        if self.custom is not None:
            return self.custom
        if data_source in RULES:
            return RULES[data_source]
        raise ValueError(f"no scorer for data_source {data_source!r}; known: {sorted(RULES)}, or set "
                         f"--reward.custom_fn path/to/file.py:function")

    def score_one(self, fn: ScoreFn, text: str, gt: Any, data_source: str, extra: Any) -> tuple[float, dict, str]:
        try:
            with _time_limit(self.timeout_s):
                if fn is self.custom:
                    out = fn(data_source=data_source, solution_str=text, ground_truth=gt, extra_info=extra)
                else:
                    out = fn(text, gt, extra)
        except _Timeout:
            return 0.0, {}, "timeouts"
        except Exception:  # noqa: BLE001 - a broken scorer must not stop the run; counted instead
            return 0.0, {}, "errors"
        info = dict(out) if isinstance(out, dict) else {}
        score = float(info.pop("score", out if not isinstance(out, dict) else 0.0))
        if not math.isfinite(score):
            return 0.0, info, "errors"
        return score, {k: float(v) for k, v in info.items() if isinstance(v, (int, float, bool))}, ""

    def __call__(self, data: DataProto) -> tuple[torch.Tensor, dict[str, float], list[float]]:
        """token_level_scores (B, R): each score on its response's last token; metrics; per-row scores."""
        responses, mask = data.batch["responses"], data.batch["response_mask"]
        texts = self.tokenizer.batch_decode(responses.masked_fill(mask == 0, self.tokenizer.pad_token_id).tolist(),
                                            skip_special_tokens=True)
        sources = data.non_tensor_batch.get("data_source", np.array(["toy"] * len(data), dtype=object))
        truths = data.non_tensor_batch.get("ground_truth", np.array([None] * len(data), dtype=object))
        extras = data.non_tensor_batch.get("extra_info", np.array([None] * len(data), dtype=object))
        scores, counts, sums = [], defaultdict(float), defaultdict(list)
        for text, src, gt, extra in zip(texts, sources, truths, extras):
            score, info, failure = self.score_one(self.fn_for(src), text, gt, src, extra)
            scores.append(score)
            if failure:
                counts[failure] += 1
            for k, v in info.items():
                sums[k].append(v)
        if self.reward_model is not None:
            rm = self.reward_model(data).tolist()
            scores = [s + r for s, r in zip(scores, rm)]
            sums["rm_score"] = rm
        token_scores = torch.zeros(mask.shape, dtype=torch.float32)
        lengths = mask.sum(-1).long().cpu()  # scores are placed on CPU, then follow the batch's device
        rows = torch.nonzero(lengths > 0).flatten()
        token_scores[rows, lengths[rows] - 1] = torch.tensor(scores, dtype=torch.float32)[rows]
        metrics = {"reward/errors": counts["errors"], "reward/timeouts": counts["timeouts"]}
        metrics.update({f"reward/{k}": float(np.mean(v)) for k, v in sums.items()})
        return token_scores.to(mask.device), metrics, scores


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
