"""Prompt datasets in the common RL parquet/jsonl layout, tokenised with the chat template, and a sampler.

Columns (as prepared for other RL frameworks, so those files work unchanged): ``prompt`` (chat messages, or
a plain string), ``data_source``, ``reward_model.ground_truth``, ``extra_info``. Any other column (TRL's layout:
``prompt`` + ``solution``, say) is kept per row and handed to a custom reward function as a keyword argument.
Prompts longer than ``max_prompt_length`` are filtered out, truncated (left or right) or refused, and counted.

Sampling is deterministic in (seed, epoch): epoch e visits the rows in ``permutation(seed + e)``; the batch of
step s is the s-th slice of that stream, so a resumed run only needs the step number.

Images (vision-language models, lib/vision): an ``images`` column (verl's: a list of ``{"bytes", "path"}`` structs,
the k-th ``<image>`` of the prompt's text being the k-th image) or TRL's ``image`` / ``images`` column (no
placeholder in the text: the images go before the first user message's text). Parquet files and ``save_to_disk``
folders are read through ``datasets``: the image column stays in its memory-mapped Arrow table and a row's images
are decoded when a batch takes the row, never all held on every rank. JSON lines are read as text (their images are
paths, relative to the file).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from lib.multi_turn.tools import row_tools
from lib.protocol import DataProto
from lib.vision import rope
from lib.vision.processor import (PLACEHOLDER, VisionProcessor, count_placeholders, image_size, load_image,
                                  with_image_parts)

if TYPE_CHECKING:
    import datasets
# datasets and pyarrow (~0.5 s to import) are imported where a parquet file or a saved dataset is read: every rank
# of every run imports this module, most of them to read JSON lines

TRUNCATION = ("filter", "left", "right", "error")
STANDARD_COLUMNS = ("prompt", "data_source", "reward_model", "extra_info")
IMAGE_COLUMNS = ("images", "image")


def is_saved_dataset(path: str) -> bool:
    """A folder written by ``datasets``' ``save_to_disk``."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "dataset_info.json"))


DATA_EXTENSIONS = (".parquet", ".jsonl", ".json")


def expand_files(files: list[str], what: str) -> list[str]:
    """The data files of ``--data.<what>_files``: each entry a file, a ``save_to_disk`` folder, a folder of data
    files (its .parquet/.jsonl/.json files, sorted) or a glob pattern (``data/train-*.parquet``, sorted). A pattern or
    folder that holds no data file, a path that does not exist, and a file of another kind are refused, naming it."""
    out: list[str] = []
    flag = f"--data.{what}_files"
    for f in files:
        if is_saved_dataset(f):
            out.append(f)
        elif glob.has_magic(f):
            found = sorted(p for p in glob.glob(f) if p.endswith(DATA_EXTENSIONS) or is_saved_dataset(p))
            if not found:
                raise ValueError(f"{what} files {f!r}: the pattern matches no .parquet/.jsonl/.json file; fix the "
                                 f"pattern in {flag}")
            out += found
        elif os.path.isdir(f):
            found = sorted(os.path.join(f, n) for n in os.listdir(f) if n.endswith(DATA_EXTENSIONS))
            if not found:
                raise ValueError(f"{what} folder {f!r} holds no .parquet/.jsonl/.json file (nor is it a folder made "
                                 f"by datasets' save_to_disk); point {flag} at the data files")
            out += found
        elif not os.path.isfile(f):
            raise ValueError(f"{what} file {f!r} does not exist; point {flag} at parquet or jsonl files "
                             f"(or a folder made by datasets' save_to_disk)")
        elif not f.endswith(DATA_EXTENSIONS):
            raise ValueError(f"{what} file {f!r} is neither .parquet nor .jsonl/.json")
        else:
            out.append(f)
    return out


@dataclass
class ImageColumn:
    """The images of one file's rows: a memory-mapped ``datasets`` column (parquet, save_to_disk) or, for JSON
    lines, the entries themselves (paths); ``base_dir`` resolves relative paths."""

    table: Any
    name: str
    base_dir: str

    def entries(self, row: int) -> list:
        value = self.table[row] if isinstance(self.table, list) else self.table[row][self.name]
        if value is None:
            return []
        return list(value) if isinstance(value, (list, tuple)) else [value]


def _undecoded(table: datasets.Dataset, name: str) -> datasets.Dataset:
    """The column with ``datasets.Image`` features left as ``{"bytes", "path"}`` (decoded per batch, by us)."""
    import datasets

    feature = table.features[name]
    inner = getattr(feature, "feature", feature)
    if isinstance(inner, datasets.Image):
        image = datasets.Image(decode=False)
        return table.cast_column(name, image if feature is inner else datasets.List(image))
    return table


def root_cause(e: BaseException) -> BaseException:
    """The innermost error of a chain (datasets raises its own around pyarrow's, which says what is wrong)."""
    seen = {id(e)}
    while (inner := e.__cause__ or e.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        e = inner
    return e


def _read_table(path: str) -> tuple[list[Any], ImageColumn | None]:
    """The rows of a parquet file or a save_to_disk folder (through ``datasets``), the image column kept apart."""
    import datasets

    datasets.disable_progress_bars()
    table = datasets.load_from_disk(path) if is_saved_dataset(path) else datasets.Dataset.from_parquet(path)
    name = next((c for c in IMAGE_COLUMNS if c in table.column_names), None)
    if name is None:
        return table.to_list(), None
    images = ImageColumn(_undecoded(table.select_columns([name]), name), name, os.path.dirname(os.path.abspath(path)))
    return table.remove_columns([name]).to_list(), images


def _read(path: str) -> tuple[list[Any], ImageColumn | None]:
    """The rows of one parquet / jsonl / json (array or lines) file or save_to_disk folder, and its image column
    (None without one); a file that is not one is a ValueError naming it, what is wrong, and the fix."""
    table = path.endswith(".parquet") or is_saved_dataset(path)
    kind = "parquet" if path.endswith(".parquet") else "a saved dataset" if os.path.isdir(path) else "JSON lines"
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise ValueError(f"{path} is an empty file (0 bytes): write the data again, or leave it out of the data files")
    try:
        if table:
            import pyarrow.parquet as pq

            if path.endswith(".parquet") and pq.ParquetFile(path).metadata.num_rows == 0:
                return [], None  # datasets fails on a file of no rows; the caller says "holds no rows"
            return _read_table(path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith(".json") and text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except Exception as e:  # noqa: BLE001 - datasets wraps pyarrow's errors in its own (DatasetGenerationError)
        if not table and not isinstance(e, (OSError, ValueError, UnicodeDecodeError)):
            raise
        cause = root_cause(e)
        hint = ("a damaged or cut-short file, or one of another format under the .parquet name" if kind == "parquet"
                else "not UTF-8 text: a binary file under a text name?" if isinstance(cause, UnicodeDecodeError)
                else "each line must be one JSON object" if kind == "JSON lines" else "a damaged folder")
        raise ValueError(f"{path} cannot be read as {kind} ({hint}): {type(cause).__name__}: "
                         f"{str(cause).strip()[:200]}; write the file again") from None
    name = next((c for c in IMAGE_COLUMNS if any(isinstance(r, dict) and c in r for r in rows)), None)
    if name is None:
        return rows, None
    entries = [r.pop(name, None) if isinstance(r, dict) else None for r in rows]
    return rows, ImageColumn(entries, name, os.path.dirname(os.path.abspath(path)))


def opened_by_env(row: dict) -> bool:
    """A row whose conversation the environment opens (``extra_info.env_opens``): its prompt may be empty."""
    extra = row.get("extra_info")
    return isinstance(extra, dict) and extra.get("env_opens") is True


def row_problem(row: Any, known_sources: set[str] | None) -> str:
    """Why a data row cannot be trained on ("" if it can). ``known_sources``: the data sources a scorer exists for
    (None: a custom reward function scores every row)."""
    if not isinstance(row, dict):
        return f"a row must be an object with a 'prompt', not {type(row).__name__}"
    prompt = row.get("prompt")
    if prompt is None:
        return "no 'prompt'"
    if prompt == [] and opened_by_env(row):
        return ""  # the environment's first message is the prompt (lib/envs/verifiers_play.py)
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
    images: np.ndarray | None = None
    """Per row, where its images are: (index into image_columns, row of that file), or None for a row without."""
    image_columns: list[ImageColumn] = field(default_factory=list)
    vision: VisionProcessor | None = None
    """The model's image processing, set when the model has a vision tower."""

    def row_images(self, row: int) -> list[Image.Image]:
        """The row's images, decoded now."""
        where = None if self.images is None else self.images[row]
        if where is None:
            return []
        column = self.image_columns[where[0]]
        return [load_image(e, column.base_dir) for e in column.entries(where[1])]

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_images(self) -> int:
        """The most images one prompt holds (its placeholders; 0 without a vision-language model)."""
        if self.vision is None:
            return 0
        return max((ids.count(self.vision.placeholder_id) for ids in self.prompt_ids), default=0)


def load_prompts(files: list[str], tokenizer: Any, max_prompt_length: int, truncation: str = "filter",
                 apply_chat_template: bool = True, limit: int = 0, known_sources: set[str] | None = None,
                 bad_rows: str = "error", tool_schemas: dict[str, dict] | None = None,
                 vision: VisionProcessor | None = None, vision_refusal: str = "") -> PromptSet:
    """Every row is checked (``row_problem``, and a prompt must tokenize to something): ``bad_rows="error"`` refuses
    the first bad row naming its file and row number; ``"skip"`` drops bad rows and counts them in ``stats``.
    ``tool_schemas`` (multi-turn rollouts, by tool name): the chat template shows each row the tools it offers (its
    ``tools`` column, else those its ``extra_info.tools_kwargs`` names, else all; lib.multi_turn.tools.row_tools).
    ``vision`` (a vision-language model): rows with images are checked (placeholders, readable headers) and their
    length counts each image's tokens; image rows without it are refused, with ``vision_refusal`` saying why."""
    if truncation not in TRUNCATION:
        raise ValueError(f"data.truncation must be one of {TRUNCATION}, got {truncation!r}")
    ids, texts, sources, truths, extras, others, messages, image_refs = [], [], [], [], [], [], [], []
    stats = {"prompts": 0, "filtered": 0, "truncated": 0, "bad_rows": 0}
    first_bad = ""
    columns: list[ImageColumn] = []
    for path in files:
        rows, column = _read(path)
        if not rows:
            raise ValueError(f"{path} holds no rows")
        if column is not None:
            if vision is None:
                raise ValueError(f"{path} has images (its {column.name!r} column), but "
                                 f"{vision_refusal or 'the model has no vision tower'}")
            columns.append(column)
        for number, row in enumerate(rows[:limit] if limit else rows):
            problem = row_problem(row, known_sources)
            entries = column.entries(number) if column is not None and not problem else []
            sizes: list[tuple[int, int]] = []
            if entries:
                row, sizes, problem = _with_images(row, entries, column.base_dir)
            if not problem:
                try:
                    text = _prompt_text(row, tokenizer, apply_chat_template, tool_schemas, bool(entries))
                except ValueError as e:  # a row that offers tools nobody defined
                    text, problem = "", str(e)
                tokens = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
                problem = problem or ("" if tokens or opened_by_env(row) else "the prompt tokenizes to nothing")
                if entries and not problem and tokens.count(vision.placeholder_id) != len(entries):
                    problem = (f"the chat template rendered {tokens.count(vision.placeholder_id)} image placeholders "
                               f"for {len(entries)} images (a template without image parts?)")
            if problem:
                if bad_rows == "error":
                    raise ValueError(f"{path} row {number}: {problem} (fix the row, or set --data.bad_rows skip to "
                                     f"drop such rows)")
                stats["bad_rows"] += 1
                first_bad = first_bad or f"{path} row {number}: {problem}"
                continue
            stats["prompts"] += 1
            length = vision.model_length(tokens, text, sizes) if entries else len(tokens)  # with its images' tokens
            if length > max_prompt_length:
                if truncation == "filter" or (entries and truncation != "error"):  # an image is never cut
                    stats["filtered"] += 1
                    continue
                if truncation == "error":
                    images = " (images included)" if entries else ""
                    raise ValueError(f"{path} row {number}: a prompt of {length} tokens{images} "
                                     f"exceeds data.max_prompt_length={max_prompt_length}; raise it or set "
                                     f"data.truncation to filter{'' if entries else '/left/right'}")
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
            image_refs.append((len(columns) - 1, number) if entries else None)
    if first_bad:
        stats["first_bad_row"] = first_bad
    if not ids:
        raise ValueError(f"no usable prompt in {files} (max_prompt_length={max_prompt_length}, "
                         f"{stats['bad_rows']} bad rows{': ' + first_bad if first_bad else ''})")
    images = _objects(image_refs) if any(r is not None for r in image_refs) else None
    return PromptSet(ids, texts, _objects(sources), _objects(truths), _objects(extras), stats, _objects(others),
                     _objects(messages), images, columns, vision if images is not None else None)


def _with_images(row: dict, entries: list, base_dir: str) -> tuple[dict, list[tuple[int, int]], str]:
    """(the row with one ``<image>`` per image in its prompt, the images' (width, height) from their headers, the
    problem ("" if none)). TRL's layout (no placeholder in the text) puts the images before the first user message's
    text."""
    prompt = row["prompt"]
    found = count_placeholders(prompt)
    if found == 0:
        marks = PLACEHOLDER * len(entries)
        if isinstance(prompt, str):
            prompt = marks + prompt
        else:
            first = next((i for i, m in enumerate(prompt) if m.get("role") == "user"), 0)
            prompt = [{**m, "content": marks + m["content"]} if i == first else m for i, m in enumerate(prompt)]
        row = {**row, "prompt": prompt}
    elif found != len(entries):
        return row, [], f"the prompt holds {found} {PLACEHOLDER} placeholders for {len(entries)} images"
    sizes = []
    for k, entry in enumerate(entries):
        try:
            sizes.append(image_size(entry, base_dir))
        except ValueError as e:
            return row, [], f"image {k}: {e}"
    return row, sizes, ""


def _prompt_text(row: dict, tokenizer: Any, apply_chat_template: bool, tool_schemas: dict | None,
                 images: bool = False) -> str:
    prompt = row["prompt"]
    if prompt == []:  # the environment opens the conversation (row_problem): nothing to render yet
        return ""
    if images:  # the chat template renders each image part as the model's placeholder
        if not apply_chat_template:
            raise ValueError("rows with images need the chat template (data.apply_chat_template)")
        prompt = with_image_parts([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt)
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
    """Left-pad the rows' prompts to ``width`` (fixed, so every rank's prompts line up). With a vision-language
    model the rows' images are decoded and processed here: ``multi_modal`` (per row, its image features, or None),
    the prompt ids with each image's placeholder expanded, with Qwen-VL ``rope_position_ids`` (B, 3, width; 0 on
    padding), and for vLLM (which processes the images itself) ``engine_prompt_ids`` (one
    placeholder per image) and ``images`` (the decoded images; the engines drop the column from their output)."""
    token_lists = [prompts.prompt_ids[r] for r in rows]
    extra: dict[str, np.ndarray] = {}
    rope_rows = None
    if prompts.vision is not None:
        vision = prompts.vision
        decoded = [prompts.row_images(r) for r in rows]
        features = [vision.images(images) if images else None for images in decoded]
        engine_ids = token_lists
        token_lists = [vision.expand(ids, prompts.texts[r], f) if f else ids
                       for ids, f, r in zip(engine_ids, features, rows)]
        if vision.family.rope:
            rope_rows = torch.zeros(len(rows), 3, width, dtype=torch.long)
            for b, (ids, f) in enumerate(zip(token_lists, features)):
                grid = f["image_grid_thw"] if f else torch.zeros(0, 3, dtype=torch.long)
                rope_rows[b, :, width - len(ids):] = rope.prompt_positions(torch.tensor(ids), vision.image_token_id,
                                                                           grid, vision.merge)
        extra = {"multi_modal": _objects(features), "engine_prompt_ids": _objects(engine_ids),
                 "images": _objects(decoded)}
    input_ids, mask, position_ids = left_pad(token_lists, width, pad_id)
    batch = {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids}
    if rope_rows is not None:
        batch["rope_position_ids"] = rope_rows
    return DataProto.from_dict(batch,
                               {"data_source": prompts.data_source[rows], "ground_truth": prompts.ground_truth[rows],
                                "extra_info": prompts.extra_info[rows], "columns": prompts.columns[rows],
                                "raw_prompt": _objects([prompts.texts[r] for r in rows]),
                                "messages": prompts.messages[rows],
                                "row": rows.astype(object), **extra})


def _objects(values: list) -> np.ndarray:
    """A 1-D object array of ``values`` (lists, tuples and dicts kept whole, never made a second dimension)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


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
