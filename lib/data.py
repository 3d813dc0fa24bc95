"""Prompt datasets in the common RL parquet/jsonl layout, tokenised with the chat template, and a sampler.

Columns (as prepared for other RL frameworks, so those files work unchanged): ``prompt`` (chat messages, or
a plain string), ``data_source``, ``reward_model.ground_truth``, ``extra_info``. Any other column (TRL's layout:
``prompt`` + ``solution``, say) is kept per row and handed to a custom reward function as a keyword argument.
Prompts longer than ``max_prompt_length`` are filtered out, truncated (left or right) or refused, and counted.

Sampling is deterministic in (seed, epoch): epoch e visits the rows in ``permutation(seed + e)``; the batch of
step s is the s-th slice of that stream, so a resumed run only needs the step number.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lib.multi_turn.tools import row_tools
from lib.protocol import DataProto

TRUNCATION = ("filter", "left", "right", "error")
STANDARD_COLUMNS = ("prompt", "data_source", "reward_model", "extra_info")


def check_files(files: list[str], what: str) -> None:
    for f in files:
        if not os.path.isfile(f):
            raise ValueError(f"{what} file {f!r} does not exist; point --data.{what}_files at parquet or jsonl files")
        if not f.endswith((".parquet", ".jsonl", ".json")):
            raise ValueError(f"{what} file {f!r} is neither .parquet nor .jsonl/.json")


def _read(path: str) -> list[Any]:
    """The rows of one parquet / jsonl / json (array or lines) file; a file that is not one is a ValueError naming it."""
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith(".json") and text.lstrip().startswith("["):
            return json.loads(text)
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, ValueError, UnicodeDecodeError) as e:  # pyarrow's errors are ValueErrors too
        kind = "parquet" if path.endswith(".parquet") else "JSON lines"
        raise ValueError(f"{path} cannot be read as {kind}: {type(e).__name__}: {str(e)[:200]}") from None


def row_problem(row: Any, known_sources: set[str] | None) -> str:
    """Why a data row cannot be trained on ("" if it can). ``known_sources``: the data sources a scorer exists for
    (None: a custom reward function scores every row)."""
    if not isinstance(row, dict):
        return f"a row must be an object with a 'prompt', not {type(row).__name__}"
    prompt = row.get("prompt")
    if prompt is None:
        return "no 'prompt'"
    if isinstance(prompt, str):
        if not prompt.strip():
            return "an empty prompt"
    elif isinstance(prompt, list):
        if not prompt:
            return "an empty message list in 'prompt'"
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                return f"prompt message {i} has no string 'content'"
            if not isinstance(m.get("role"), str):
                return f"prompt message {i} has no string 'role'"
    else:
        return f"'prompt' must be chat messages or a string, not {type(prompt).__name__}"
    if known_sources is not None:
        source = row.get("data_source")
        if source is None:
            return "no 'data_source' (it picks the scorer; or set --reward.custom_fn)"
        if source not in known_sources:
            return f"no scorer for data_source {source!r} (known: {sorted(known_sources)}; or set --reward.custom_fn)"
        rm = row.get("reward_model")
        if not isinstance(rm, dict) or rm.get("ground_truth") is None:
            return f"no 'reward_model.ground_truth' (the {source} scorer compares with it)"
    return ""


@dataclass
class PromptSet:
    prompt_ids: list[list[int]]
    texts: list[str]
    data_source: np.ndarray
    ground_truth: np.ndarray
    extra_info: np.ndarray
    stats: dict[str, int]
    columns: np.ndarray | None = None
    """Per row, a dict of the columns besides prompt, data_source, reward_model and extra_info (TRL's layout)."""
    messages: np.ndarray | None = None
    """Per row, the prompt as chat messages (a string prompt is one user message): a reward model with its own
    tokenizer renders prompt and response with its own chat template."""

    def __len__(self) -> int:
        return len(self.prompt_ids)


def load_prompts(files: list[str], tokenizer: Any, max_prompt_length: int, truncation: str = "filter",
                 apply_chat_template: bool = True, limit: int = 0, known_sources: set[str] | None = None,
                 bad_rows: str = "error", tool_schemas: dict[str, dict] | None = None) -> PromptSet:
    """Every row is checked (``row_problem``, and a prompt must tokenize to something): ``bad_rows="error"`` refuses
    the first bad row naming its file and row number; ``"skip"`` drops bad rows and counts them in ``stats``.
    ``tool_schemas`` (multi-turn rollouts, by tool name): the chat template shows each row the tools it offers (its
    ``tools`` column, else those its ``extra_info.tools_kwargs`` names, else all; lib.multi_turn.tools.row_tools)."""
    if truncation not in TRUNCATION:
        raise ValueError(f"data.truncation must be one of {TRUNCATION}, got {truncation!r}")
    ids, texts, sources, truths, extras, others, messages = [], [], [], [], [], [], []
    stats = {"prompts": 0, "filtered": 0, "truncated": 0, "bad_rows": 0}
    first_bad = ""
    for path in files:
        rows = _read(path)
        if not rows:
            raise ValueError(f"{path} holds no rows")
        for number, row in enumerate(rows[:limit] if limit else rows):
            problem = row_problem(row, known_sources)
            if not problem:
                try:
                    text = _prompt_text(row, tokenizer, apply_chat_template, tool_schemas)
                except ValueError as e:  # a row that offers tools nobody defined
                    text, problem = "", str(e)
                tokens = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
                problem = problem or ("" if tokens else "the prompt tokenizes to nothing")
            if problem:
                if bad_rows == "error":
                    raise ValueError(f"{path} row {number}: {problem} (fix the row, or set --data.bad_rows skip to "
                                     f"drop such rows)")
                stats["bad_rows"] += 1
                first_bad = first_bad or f"{path} row {number}: {problem}"
                continue
            stats["prompts"] += 1
            if len(tokens) > max_prompt_length:
                if truncation == "filter":
                    stats["filtered"] += 1
                    continue
                if truncation == "error":
                    raise ValueError(f"{path} row {number}: a prompt of {len(tokens)} tokens exceeds "
                                     f"data.max_prompt_length={max_prompt_length}; raise it or set data.truncation "
                                     f"to filter/left/right")
                stats["truncated"] += 1
                tokens = tokens[-max_prompt_length:] if truncation == "left" else tokens[:max_prompt_length]
            rm = row.get("reward_model") or {}
            ids.append(tokens)
            texts.append(text)
            sources.append(row.get("data_source", "unknown"))
            truths.append(rm.get("ground_truth") if isinstance(rm, dict) else None)
            extras.append(row.get("extra_info"))
            others.append({k: v for k, v in row.items() if k not in STANDARD_COLUMNS})
            prompt = row["prompt"]
            messages.append([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt)
    if first_bad:
        stats["first_bad_row"] = first_bad
    if not ids:
        raise ValueError(f"no usable prompt in {files} (max_prompt_length={max_prompt_length}, "
                         f"{stats['bad_rows']} bad rows{': ' + first_bad if first_bad else ''})")
    obj = lambda v: np.array(v + [None], dtype=object)[:-1]  # noqa: E731 - keeps dicts/lists as objects
    return PromptSet(ids, texts, obj(sources), obj(truths), obj(extras), stats, obj(others), obj(messages))


def _prompt_text(row: dict, tokenizer: Any, apply_chat_template: bool, tool_schemas: dict | None) -> str:
    prompt = row["prompt"]
    if apply_chat_template and isinstance(prompt, list):
        kwargs = {}
        if tool_schemas is not None:

            extra = row.get("extra_info")
            kwargs["tools"] = row_tools(row.get("tools"), extra.get("tools_kwargs") if isinstance(extra, dict)
                                        else None, tool_schemas)
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **kwargs)
    return prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)


def left_pad(token_lists: list[list[int]], width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token lists -> left-padded (input_ids, attention_mask, position_ids), each (B, width)."""
    input_ids = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(token_lists), width, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        input_ids[i, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
        mask[i, width - len(tokens):] = 1
    return input_ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def collate(prompts: PromptSet, rows: np.ndarray, width: int, pad_id: int) -> DataProto:
    """Left-pad the rows' prompts to ``width`` (fixed, so every rank's prompts line up)."""
    input_ids, mask, position_ids = left_pad([prompts.prompt_ids[r] for r in rows], width, pad_id)
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids},
                               {"data_source": prompts.data_source[rows], "ground_truth": prompts.ground_truth[rows],
                                "extra_info": prompts.extra_info[rows], "columns": prompts.columns[rows],
                                "raw_prompt": np.array([prompts.texts[r] for r in rows] + [None], dtype=object)[:-1],
                                "messages": prompts.messages[rows],
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
