"""Prompt datasets in the common RL parquet/jsonl layout, tokenised with the chat template, and a sampler.

Columns (as prepared for other RL frameworks, so those files work unchanged): ``prompt`` (chat messages, or
a plain string), ``data_source``, ``reward_model.ground_truth``, ``extra_info``. Prompts longer than
``max_prompt_length`` are filtered out, truncated (left or right) or refused, and counted.

Sampling is deterministic in (seed, epoch): epoch e visits the rows in ``permutation(seed + e)``; the batch of
step s is the s-th slice of that stream, so a resumed run only needs the step number.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lib.protocol import DataProto

TRUNCATION = ("filter", "left", "right", "error")


def check_files(files: list[str], what: str) -> None:
    for f in files:
        if not os.path.isfile(f):
            raise ValueError(f"{what} file {f!r} does not exist; point --data.{what}_files at parquet or jsonl files")
        if not f.endswith((".parquet", ".jsonl", ".json")):
            raise ValueError(f"{what} file {f!r} is neither .parquet nor .jsonl/.json")


def _load_rows(files: list[str]) -> list[dict]:
    from datasets import load_dataset

    kind = "parquet" if files[0].endswith(".parquet") else "json"
    return list(load_dataset(kind, data_files=files, split="train"))


@dataclass
class PromptSet:
    prompt_ids: list[list[int]]
    texts: list[str]
    data_source: np.ndarray
    ground_truth: np.ndarray
    extra_info: np.ndarray
    stats: dict[str, int]

    def __len__(self) -> int:
        return len(self.prompt_ids)


def load_prompts(files: list[str], tokenizer: Any, max_prompt_length: int, truncation: str = "filter",
                 apply_chat_template: bool = True, limit: int = 0) -> PromptSet:
    if truncation not in TRUNCATION:
        raise ValueError(f"data.truncation must be one of {TRUNCATION}, got {truncation!r}")
    rows = _load_rows(files)
    if limit:
        rows = rows[:limit]
    if rows and "prompt" not in rows[0]:
        raise ValueError(f"{files[0]} has no 'prompt' column (columns: {sorted(rows[0])}); see examples/ for the layout")
    ids, texts, sources, truths, extras = [], [], [], [], []
    stats = {"prompts": len(rows), "filtered": 0, "truncated": 0}
    for row in rows:
        prompt = row["prompt"]
        if apply_chat_template and isinstance(prompt, list):
            text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        else:
            text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(tokens) > max_prompt_length:
            if truncation == "filter":
                stats["filtered"] += 1
                continue
            if truncation == "error":
                raise ValueError(f"a prompt of {len(tokens)} tokens exceeds data.max_prompt_length="
                                 f"{max_prompt_length}; raise it or set data.truncation to filter/left/right")
            stats["truncated"] += 1
            tokens = tokens[-max_prompt_length:] if truncation == "left" else tokens[:max_prompt_length]
        rm = row.get("reward_model") or {}
        ids.append(tokens)
        texts.append(text)
        sources.append(row.get("data_source", "unknown"))
        truths.append(rm.get("ground_truth") if isinstance(rm, dict) else None)
        extras.append(row.get("extra_info"))
    if not ids:
        raise ValueError(f"no prompt in {files} fits max_prompt_length={max_prompt_length}")
    obj = lambda v: np.array(v + [None], dtype=object)[:-1]  # noqa: E731 - keeps dicts/lists as objects
    return PromptSet(ids, texts, obj(sources), obj(truths), obj(extras), stats)


def collate(prompts: PromptSet, rows: np.ndarray, width: int, pad_id: int) -> DataProto:
    """Left-pad the rows' prompts to ``width`` (fixed, so every rank's prompts line up)."""
    batch = len(rows)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens = prompts.prompt_ids[r]
        input_ids[i, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
        mask[i, width - len(tokens):] = 1
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids},
                               {"data_source": prompts.data_source[rows], "ground_truth": prompts.ground_truth[rows],
                                "extra_info": prompts.extra_info[rows],
                                "raw_prompt": np.array([prompts.texts[r] for r in rows] + [None], dtype=object)[:-1],
                                "row": rows.astype(object)})


class Sampler:
    """Global batches of ``batch_size`` rows per step; each rank takes its contiguous share."""

    def __init__(self, num_rows: int, batch_size: int, seed: int, shuffle: bool = True):
        if batch_size > num_rows:
            raise ValueError(f"train_batch_size={batch_size} is larger than the {num_rows} usable prompts")
        self.num_rows, self.batch_size, self.seed, self.shuffle = num_rows, batch_size, seed, shuffle
        self.steps_per_epoch = num_rows // batch_size  # the last partial batch of an epoch is dropped

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng(self.seed + epoch).permutation(self.num_rows)

    def rows(self, step: int, rank: int = 0, world: int = 1) -> np.ndarray:
        epoch, k = divmod(step, self.steps_per_epoch)
        batch = self.epoch_order(epoch)[k * self.batch_size:(k + 1) * self.batch_size]
        share = self.batch_size // world
        return batch[rank * share:(rank + 1) * share]
