"""The samples' files in a run folder: ``samples/step_NNNNNN.parquet``, one a step, each written whole (a file takes
its name only when complete, so a kill leaves no torn file); a resumed run drops the files after its checkpoint, as
metrics.jsonl drops its rows, and writes those steps again. Files and pyarrow only: what reads the files needs
nothing of the trainer."""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

FOLDER = "samples"
NAME = re.compile(r"step_(\d{6,})\.parquet$")

TOKENS = pa.list_(pa.float32())
SCHEMA = pa.schema([
    ("step", pa.int32()), ("uid", pa.string()), ("sample", pa.int32()), ("episode", pa.string()),
    ("data_source", pa.string()), ("prompt", pa.string()), ("response", pa.string()),
    ("reward", pa.float64()), ("reward_terms", pa.string()), ("advantage", pa.float64()),
    ("length", pa.int32()), ("response_tokens", pa.int32()), ("finish", pa.string()), ("turns", pa.string()),
    ("images", pa.list_(pa.string())), ("prompt_ids", pa.list_(pa.int32())), ("response_ids", pa.list_(pa.int32())),
    ("sampled_mask", pa.list_(pa.bool_())), ("loss_mask", pa.list_(pa.bool_())), ("engine_logp", TOKENS),
    ("trainer_logp", TOKENS), ("entropy", TOKENS), ("advantages", TOKENS)])
"""A sample's columns (docs/samples.md). ``sample``: its place in its group; ``episode``: an agent's episode (its
rows share it); ``reward``: null where the sample was masked (no verdict); ``reward_terms``, ``turns``: JSON;
``length``: sampled tokens; ``response_tokens``: the response's tokens, observations included, which the per-token
lists follow; ``trainer_logp``, ``entropy``: null where the update did not run (a critic's warm-up)."""


def folder(run_path: str) -> str:
    return os.path.join(run_path, FOLDER)


def steps(run_path: str) -> dict[int, str]:
    """The steps with a samples file, and its path."""
    d = folder(run_path)
    found = {}
    if os.path.isdir(d):
        for name in os.listdir(d):
            m = NAME.match(name)
            if m:
                found[int(m.group(1))] = os.path.join(d, name)
    return dict(sorted(found.items()))


def keep_steps_through(run_path: str, step: int) -> None:
    """Drop the files of the steps after ``step`` (a killed run's steps past its checkpoint; all of them, and the
    tokenizer, with -1: a fresh start, perhaps of another model) and any file a kill left unnamed."""
    for s, path in steps(run_path).items():
        if s > step:
            os.remove(path)
    d = folder(run_path)
    if step < 0:
        shutil.rmtree(os.path.join(d, "tokenizer"), ignore_errors=True)
    if os.path.isdir(d):
        for name in os.listdir(d):
            if name.endswith(".tmp"):
                os.remove(os.path.join(d, name))


def step_path(run_path: str, step: int) -> str:
    return os.path.join(folder(run_path), f"step_{step:06d}.parquet")


def write_step(run_path: str, step: int, rows: list[dict]) -> str:
    """The step's samples as one parquet file (zstd), named once whole; returns its path."""
    os.makedirs(folder(run_path), exist_ok=True)
    path = step_path(run_path, step)
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    pq.write_table(table, path + ".tmp", compression="zstd")
    os.replace(path + ".tmp", path)
    return path


def write_tokenizer(run_path: str, tokenizer: Any) -> None:
    """The run's tokenizer beside its samples (``samples/tokenizer``, once a run), so that the files can be read
    token by token (python -m lib.view) where the model is not: a run copied from a cluster."""
    path = os.path.join(folder(run_path), "tokenizer")
    if os.path.isdir(path):
        return
    partial = path + "-partial"
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer.save_pretrained(partial)
    os.replace(partial, path)


def read_step(path: str) -> list[dict]:
    return pq.read_table(path, schema=SCHEMA).to_pylist()
