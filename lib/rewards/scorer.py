"""The trainer's side of scoring: decode responses, score them in the worker pool (plus an optional reward
model), place each score on its response's last token, count failures by kind."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification

from lib.models import load_tokenizer
from lib.protocol import DataProto
from lib.rewards import FAILURE_KINDS, RULE_SOURCES, load_custom, result_of
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
    unscored: list[bool] | None = None  # with a judge or an environment: the rows left unscored (masked)
    rule_scores: list[float] | None = None  # with a judge: the rule / custom / RM scores alone, before it
    terms: list[dict] | None = None  # per row, the reward's terms (a custom reward's, rm_score, env_return)


def last_sampled(mask: torch.Tensor) -> torch.Tensor:
    """Each row's last position with mask 1 (0 for a row without one): where its score goes. A multi-turn row's
    observations (mask 0) may follow sampled tokens, so this is not the mask's sum minus one."""
    # mask: (B, T)
    if mask.shape[-1] == 0:  # no row sampled anything (every episode of a rollout failed at its start)
        return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return ((mask > 0) * positions).argmax(-1)


class Scorer:
    def __init__(self, tokenizer: Any, custom: str = "", timeout_s: float = 10.0, reward_model: Any = None,
                 num_workers: int = 2, judge: Any = None, judge_weights: tuple[float, float] = (0.0, 1.0),
                 env_weights: tuple[float, float] | None = None):
        """``judge`` (lib/judges): an LLM judge scores every row too; the score is rule x ``judge_weights[0]`` +
        judge x ``judge_weights[1]``, and a row the judge could not score is flagged in ``Scored.unscored``.
        ``env_weights`` (rule, environment): rows that carry an environment's ``env_score`` (lib/envs) score rule x
        the first + the episode's return x the second (an agent's episode that returned None: the rule score
        alone, lib/agents); a failed episode is flagged in ``Scored.unscored``."""
        self.tokenizer, self.custom = tokenizer, custom
        self.judge, self.judge_weights, self.env_weights = judge, judge_weights, env_weights
        if custom:
            load_custom(custom)  # a bad file or name is a config error, raised here, before any worker starts
        self.pool = RewardPool(custom, timeout_s, num_workers)
        self.reward_model = reward_model  # callable(DataProto) -> (B,) scores, e.g. RewardModel below

    def __call__(self, data: DataProto) -> Scored:
        responses, mask = data.batch["responses"], data.batch["response_mask"]
        if "solution_str" in data.non_tensor_batch:  # multi-turn rows: the last turn's text is what is judged
            texts = list(data.non_tensor_batch["solution_str"])
        else:
            texts = self.tokenizer.batch_decode(responses.masked_fill(mask == 0, self.tokenizer.pad_token_id).tolist(),
                                                skip_special_tokens=True)
        n = len(data)
        sources = data.non_tensor_batch.get("data_source", np.array(["toy"] * n, dtype=object))
        truths = data.non_tensor_batch.get("ground_truth", np.array([None] * n, dtype=object))
        extras = data.non_tensor_batch.get("extra_info", np.array([None] * n, dtype=object))
        columns = data.non_tensor_batch.get("columns", np.array([None] * n, dtype=object))
        samples = list(zip(sources.tolist(), texts, truths.tolist(), extras.tolist(), columns.tolist()))
        # with a reward model and no custom function, a row without a rule scorer or a ground truth gets the RM's
        # score alone
        ruled = [i for i, (src, _, truth, _, _) in enumerate(samples) if self.reward_model is None or self.custom
                 or (src in RULE_SOURCES and truth is not None)]
        results = [(0.0, {}, None, "", "")] * n
        env = None
        if "env_score" in data.non_tensor_batch and self.env_weights is not None:  # an environment's or agent's
            env = list(data.non_tensor_batch["env_score"])
            if not self.env_weights[0]:  # the rule scores only what gave no reward of its own (an agent's None)
                ruled = [i for i in ruled if env[i][0] is None and not env[i][1]]
        elif "env_reward" in data.non_tensor_batch:  # multi-turn environments score their own episodes
            results = [result_of(value) if not kind else (0.0, {}, None, kind, f"the environment's {message}")
                       for value, kind, message in data.non_tensor_batch["env_reward"]]
            ruled = []
        for i, r in zip(ruled, self.pool.score([samples[i] for i in ruled])):
            results[i] = r
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
        terms = [dict(r[1]) for r in results]
        if self.reward_model is not None:
            rm = self.reward_model(data).tolist()
            scores = [s + r for s, r in zip(scores, rm)]
            sums["rm_score"] = rm
            for t, r in zip(terms, rm):
                t["rm_score"] = r
        unscored, judged, rule = None, {}, None
        if env is not None:
            w_rule, w_env = self.env_weights
            scores = [s if value is None else w_rule * s + w_env * value for s, (value, _, _) in zip(scores, env)]
            unscored = [bool(kind) for _, kind, _ in env]
            played = [value for value, kind, _ in env if not kind and value is not None]
            for t, (value, kind, _) in zip(terms, env):
                if not kind and value is not None:
                    t["env_return"] = value
            if played:
                sums["env_return"] = played
        if self.judge is not None:
            rule = scores
            scores, unjudged, judged = self._judge(data, texts, truths.tolist(), scores)
            unscored = unjudged if unscored is None else [a or b for a, b in zip(unscored, unjudged)]
        token_scores = torch.zeros(mask.shape, dtype=torch.float32)
        m = mask.cpu()  # scores are placed on CPU, then follow the batch's device
        rows = torch.nonzero(m.sum(-1) > 0).flatten()
        token_scores[rows, last_sampled(m)[rows]] = torch.tensor(scores, dtype=torch.float32)[rows]
        metrics = {f"reward/{k}": float(v) for k, v in counts.items()}
        metrics.update({f"reward/{k}": float(np.mean(v)) for k, v in sums.items()})
        metrics.update(judged)
        return Scored(token_scores.to(mask.device), metrics, scores, [r[2] for r in results], texts, messages,
                      unscored, rule, terms)

    def _judge(self, data: DataProto, texts: list[str], truths: list[Any], rule: list[float]
               ) -> tuple[list[float], list[bool], dict[str, float]]:
        """The judge's verdicts on the rows: (combined scores, which rows it could not score, judge/* metrics).
        The question is the prompt's last user message (its text), the reference the row's ground truth."""
        n = len(texts)
        questions = []
        messages = data.non_tensor_batch.get("messages", np.array([None] * n, dtype=object))
        prompts = data.non_tensor_batch.get("raw_prompt", np.array([""] * n, dtype=object))
        for turns, prompt in zip(messages.tolist(), prompts.tolist()):
            users = [m.get("content") for m in (turns or []) if isinstance(m, dict) and m.get("role") == "user"]
            questions.append(str(users[-1]) if users and isinstance(users[-1], str) else str(prompt or ""))
        items = [(q, t, "" if r is None else str(r)) for q, t, r in zip(questions, texts, truths)]
        verdicts, metrics = self.judge.score(items)
        w_rule, w_judge = self.judge_weights
        scores = [w_rule * s + w_judge * (v.score if v.score is not None else 0.0) for s, v in zip(rule, verdicts)]
        return scores, [v.score is None for v in verdicts], metrics

    def close(self) -> None:
        self.pool.close()
        if self.judge is not None:
            self.judge.close()


class RewardModel:
    """A sequence-classification reward model (AutoModelForSequenceClassification, one label) scoring prompt +
    response, inference only, unsharded.

    - Each row is scored at its last attended position (the attention mask's), whatever the RM's pad id, or none.
    - Its tokenizer: where its vocabulary is the policy's, the policy's token ids go in as they are; otherwise each
      row is decoded and rendered again with the RM's own chat template (prompt messages + the response as the
      assistant turn; verl does the same), or as prompt text + response where it has no template.
    - On GPU it waits on the CPU outside the score stage (``offload``) and scores ``micro_batch_size`` rows at a
      time, so it holds no device memory through rollout and update."""

    def __init__(self, path: str, device: torch.device, policy_tokenizer: Any, micro_batch_size: int = 8,
                 offload: bool = True):

        self.device, self.micro_batch_size = device, micro_batch_size
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype)
        self.backbone = getattr(model, model.base_model_prefix, None)
        self.head = next((getattr(model, n) for n in ("score", "classifier") if isinstance(getattr(model, n, None),
                                                                                            torch.nn.Linear)), None)
        if self.backbone is None or self.head is None:
            raise ValueError(f"reward model {path}: {type(model).__name__} has no backbone + linear score head "
                             f"(score or classifier) to read; use a *ForSequenceClassification model with one")
        self.model = model.eval()
        self.home = torch.device("cpu") if offload and device.type == "cuda" else device
        self.model.to(self.home)
        self.policy_tokenizer = policy_tokenizer
        self.tokenizer = load_tokenizer(path)
        self.same_tokens = self.tokenizer.get_vocab() == policy_tokenizer.get_vocab()
        self.tokenizer.padding_side = "right"

    def describe(self) -> str:
        how = ("the policy's token ids (same vocabulary)" if self.same_tokens else
               "decoded and rendered with its own chat template" if self.tokenizer.chat_template else
               "decoded, prompt text + response, tokenised by its own tokenizer")
        where = "offloaded to CPU outside the score stage" if self.home != self.device else f"on {self.device}"
        return f"reward model: {how}; {where}; {self.micro_batch_size} rows per forward"

    def encode(self, data: DataProto) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(input_ids, attention_mask, position_ids or None) of prompt + response in the RM's tokens."""
        b = data.batch
        if self.same_tokens:
            return b["input_ids"], b["attention_mask"], b["position_ids"]
        pt = self.policy_tokenizer
        responses = pt.batch_decode(b["responses"].masked_fill(b["response_mask"] == 0, pt.pad_token_id).tolist(),
                                    skip_special_tokens=True)
        texts = []
        for messages, prompt, response in zip(data.non_tensor_batch["messages"], data.non_tensor_batch["raw_prompt"],
                                              responses):
            if self.tokenizer.chat_template:
                texts.append(self.tokenizer.apply_chat_template(
                    list(messages) + [{"role": "assistant", "content": response}], tokenize=False))
            else:
                texts.append(str(prompt) + response)
        enc = self.tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"], None

    @torch.no_grad()
    def __call__(self, data: DataProto) -> torch.Tensor:
        ids, mask, pos = self.encode(data)
        last = (torch.arange(mask.shape[1]) * mask.cpu()).argmax(-1)  # each row's last attended position
        self.model.to(self.device)
        scores = []
        try:
            for start in range(0, len(ids), self.micro_batch_size):
                rows = slice(start, start + self.micro_batch_size)
                width = int(last[rows].max()) + 1  # the columns after every row's end carry nothing
                kwargs = {"position_ids": pos[rows, :width].to(self.device)} if pos is not None else {}
                hidden = self.backbone(input_ids=ids[rows, :width].to(self.device),
                                       attention_mask=mask[rows, :width].to(self.device), **kwargs).last_hidden_state
                pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last[rows].to(self.device)]
                scores.append(self.head(pooled)[:, 0].float().cpu())
        finally:
            self.model.to(self.home)
        return torch.cat(scores) if scores else torch.zeros(0)
