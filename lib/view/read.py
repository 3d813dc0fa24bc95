"""What the viewer reads of a run folder, as plain values: the metrics' rows as they grow, the steps with samples,
a step's samples as table rows, a sample's per-token values and their colours. Files only (no page here), so that
the page's numbers are tested without a browser."""

from __future__ import annotations

import html
import json
import math
import os
from typing import Any

from lib.samples import store

TOKENIZER = os.path.join(store.FOLDER, "tokenizer")
"""Where the run keeps its tokenizer beside the samples (lib/samples/store.write_tokenizer)."""

VALUES = {
    "advantage": "the advantage the loss used",
    "logp_diff": "|engine - trainer| log-prob (the canary's terms)",
    "entropy": "the trainer's entropy",
    "engine_logp": "the engine's log-prob",
    "trainer_logp": "the trainer's log-prob",
}
"""The per-token values a sample's tokens can be coloured by."""
SIGNED = {"advantage"}
"""Values coloured on a diverging scale (green above 0, red below); the others on one from 0 up (orange)."""


class Metrics:
    """metrics.jsonl read as it grows: ``update`` reads the lines added since the last call, and everything again when
    the file was replaced or cut (a resumed run drops the rows past its checkpoint); a last line not yet whole waits."""

    def __init__(self, run_path: str):
        self.path = os.path.join(run_path, "metrics.jsonl")
        self.rows: list[dict] = []
        self._offset = 0
        self._inode: int | None = None

    def update(self) -> bool:
        """Whether rows changed."""
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            changed = bool(self.rows)
            self.rows, self._offset, self._inode = [], 0, None
            return changed
        with f:
            st = os.fstat(f.fileno())  # the file opened, not one that replaced it since
            again = st.st_ino != self._inode or st.st_size < self._offset
            if again:
                self.rows, self._offset, self._inode = [], 0, st.st_ino
            if st.st_size == self._offset:
                return again
            f.seek(self._offset)
            chunk = f.read(st.st_size - self._offset)
        whole = chunk[:chunk.rfind(b"\n") + 1]
        self._offset += len(whole)
        self.rows += [json.loads(line) for line in whole.decode().splitlines() if line.strip()]
        return again or bool(whole)

    def curves(self, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
        """{key: [(step, value)]} for the keys the rows have, the last row of a step winning (a resumed step's)."""
        out: dict[str, dict[int, float]] = {}
        for r in self.rows:
            for k in keys:
                v = r.get(k)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    out.setdefault(k, {})[r["step"]] = v
        return {k: sorted(v.items()) for k, v in out.items()}


def version(run_path: str, step: int) -> int | None:
    """Which write of the step's samples file is there (a resumed run writes a step again); None: no file."""
    try:
        return os.stat(store.step_path(run_path, step)).st_mtime_ns
    except FileNotFoundError:
        return None


def samples(run_path: str, step: int) -> list[dict]:
    """The step's samples, each with ``id``: its place in the file."""
    rows = store.read_step(store.step_path(run_path, step))
    for i, r in enumerate(rows):
        r["id"] = i
    return rows


def per_token(row: dict, key: str) -> list[float | None]:
    """``key``'s value at each response token (VALUES); None where there is none (a token the policy did not sample,
    a value the step did not compute)."""
    n = row["response_tokens"]
    sampled = row["sampled_mask"] or [True] * n
    if key == "logp_diff":
        e, t = row["engine_logp"], row["trainer_logp"]
        values = [abs(a - b) for a, b in zip(e, t)] if e is not None and t is not None else None
    else:
        values = row[{"advantage": "advantages"}.get(key, key)]
    if values is None:
        return [None] * n
    return [float(v) if s else None for v, s in zip(values, sampled)]


def loss_mean(row: dict, key: str) -> float | None:
    """``key``'s mean over the tokens in the loss (the canary's mean for ``logp_diff``)."""
    values = [v for v, m in zip(per_token(row, key), row["loss_mask"] or []) if m and v is not None]
    return sum(values) / len(values) if values else None


def table_rows(rows: list[dict]) -> list[dict]:
    """The samples' table: one row a sample, the columns it is sorted and filtered by."""
    def num(v: float | None, digits: int = 4) -> float | None:
        return None if v is None else round(v, digits)

    return [{"id": r["id"], "uid": r["uid"], "sample": r["sample"], "source": r["data_source"] or "",
             "reward": num(r["reward"]), "advantage": num(r["advantage"]), "length": r["length"],
             "finish": r["finish"] or "", "logp_diff": num(loss_mean(r, "logp_diff"), 9),
             "entropy": num(loss_mean(r, "entropy")), "response": r["response"][:120]} for r in rows]


def keep(rows: list[dict], samples: list[dict], reward_min: float | None = None, reward_max: float | None = None,
         text: str = "") -> list[dict]:
    """The table's rows (``samples``: the step's records, by ``id``) within the reward bounds (a masked sample, no
    reward, is out of any bound) whose whole response or uid holds ``text``."""
    def inside(r: dict) -> bool:
        v = r["reward"]
        if (reward_min is not None or reward_max is not None) and v is None:
            return False
        if reward_min is not None and v < reward_min:
            return False
        if reward_max is not None and v > reward_max:
            return False
        return not text or text.lower() in (samples[r["id"]]["response"] + " " + r["uid"]).lower()

    return [r for r in rows if inside(r)]


def tokenizer(run_path: str) -> Any | None:
    """The run's tokenizer: the one kept beside its samples, else its final export's; None where neither is."""
    from transformers import AutoTokenizer  # deferred: reading the files above needs none of it

    for d in (TOKENIZER, "hf_final"):
        path = os.path.join(run_path, d)
        if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            try:
                return AutoTokenizer.from_pretrained(path)
            except Exception:  # noqa: BLE001 - one that needs its remote code, or is torn: the ids are shown
                return None
    return None


def pieces(tok: Any | None, ids: list[int]) -> list[str]:
    """Each token's text (a character a token splits shows as U+FFFD); ids in brackets without a tokenizer."""
    if tok is None:
        return [f"[{i}]" for i in ids]
    return [tok.convert_tokens_to_string([t]) for t in tok.convert_ids_to_tokens(ids)]


def colour(value: float | None, scale: float, signed: bool) -> str:
    """A token's background: transparent without a value; else its share of ``scale`` as opacity, green/red for a
    signed value's sign, orange for one from 0 up."""
    if value is None or not scale:
        return "transparent"
    alpha = min(abs(value) / scale, 1.0) * 0.85
    rgb = ("34,160,70" if value >= 0 else "215,40,60") if signed else "245,140,0"
    return f"rgba({rgb},{alpha:.3f})"


def tokens_html(texts: list[str], values: list[float | None], key: str) -> tuple[str, float]:
    """The response's tokens as spans coloured by ``values`` (a token's value in its title; observations in grey
    italics), and the scale (the largest |value|)."""
    signed = key in SIGNED
    scale = max((abs(v) for v in values if v is not None), default=0.0)
    spans = []
    for text, v in zip(texts, values):
        shown = html.escape(text).replace("\n", "&#8629;<br>")
        if v is None:
            spans.append(f'<span class="tok obs" style="color:#888;font-style:italic">{shown}</span>')
        else:
            spans.append(f'<span class="tok" data-v="{v:.6g}" title="{key} {v:.6g}" '
                         f'style="background:{colour(v, scale, signed)}">{shown}</span>')
    return "".join(spans), scale


def turns(row: dict) -> list[dict]:
    """A multi-turn episode's turns (role, text, tool calls); [] for a single-turn sample."""
    return json.loads(row["turns"]) if row.get("turns") else []
