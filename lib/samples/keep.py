"""A step's kept samples as records (lib/samples/store.SCHEMA), gathered from every rank and written by rank 0."""

from __future__ import annotations

import json
import zlib
from typing import Any

import torch
import torch.distributed as dist

from lib.multi_turn.parsers import PARSERS
from lib.protocol import DataProto
from lib.samples import ROW_KEY, TOKENS_KEY, store
from lib.scoring import MASKED


def _tokens(values: torch.Tensor | None, n: int) -> list[float] | None:
    return None if values is None else values[:n].float().tolist()


def _turns(ids: list[int], sampled: list[bool], tokenizer: Any, parse: Any) -> list[dict]:
    """The response as turns: each run of sampled tokens the assistant's (with the tool calls its text makes), each
    run between them what came back (a tool's, an environment's, a user's message, as rendered)."""
    turns: list[dict] = []
    start = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or sampled[k] != sampled[start]:
            text = tokenizer.decode(ids[start:k], skip_special_tokens=False)
            turn: dict[str, Any] = {"role": "assistant" if sampled[start] else "observation", "text": text}
            if sampled[start] and parse is not None:
                parsed = parse(tokenizer.decode(ids[start:k], skip_special_tokens=True))
                turn["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in parsed.calls]
            turns.append(turn)
            start = k
    return turns


def rows_of(run: Any, step: int, batch: DataProto) -> list[dict]:
    """This rank's flagged rows as the file's records (lib/samples/store.SCHEMA)."""
    b, nt = batch.batch, batch.non_tensor_batch
    if ROW_KEY not in b:
        return []
    flagged = torch.nonzero(b[ROW_KEY] >= 0).flatten().tolist()
    if not flagged:
        return []
    tok = run.tokenizer
    width = b["prompts"].shape[1]
    kept = batch.meta_info.get(TOKENS_KEY, {})
    stops = set(run.engine.stop_ids(False)) if run.engine is not None else set()
    multi_turn = run.multi_turn is not None
    fmt = run.cfg.agent.format if run.cfg.agent.entry or run.cfg.agent.command else run.cfg.multi_turn.format
    parse = PARSERS.get(fmt) if multi_turn else None
    masked = nt.get(MASKED)
    terms = nt.get("reward_terms")
    place: dict[str, int] = {}
    out = []
    for i in flagged:
        prompt_ids = b["prompts"][i][b["attention_mask"][i, :width].bool()].tolist()
        n = int(b["attention_mask"][i, width:].sum())
        ids = b["responses"][i, :n].tolist()
        sampled = b.get("sampled_mask", b["response_mask"])[i, :n].bool().tolist()
        loss = b["response_mask"][i, :n].bool().tolist()
        adv = b["advantages"][i, :n].float() if "advantages" in b else None
        chosen_adv = adv[torch.tensor(loss, dtype=torch.bool)] if adv is not None and any(loss) else None
        trainer = kept.get(i, (b["old_log_probs"][i], None) if "old_log_probs" in b else (None, None))
        last = max((k for k, s in enumerate(sampled) if s), default=None)
        uid = str(nt["uid"][i])
        place[uid] = place.get(uid, -1) + 1
        score = nt["scores"][i] if "scores" in nt else None
        is_masked = bool(masked[i]) if masked is not None else False
        out.append({
            "step": step, "uid": uid, "sample": place[uid],
            "episode": str(nt["episode"][i]) if "episode" in nt else None,
            "data_source": str(nt["data_source"][i]) if "data_source" in nt else None,
            "prompt": tok.decode(prompt_ids, skip_special_tokens=False),
            "response": tok.decode([t for t, s in zip(ids, sampled) if s], skip_special_tokens=True),
            "reward": None if is_masked or score is None else float(score),
            "reward_terms": json.dumps(terms[i]) if terms is not None and terms[i] else None,
            "advantage": float(chosen_adv.mean()) if chosen_adv is not None else None,
            "length": sum(sampled), "response_tokens": n,
            "finish": None if last is None else "stop" if ids[last] in stops else "length",
            "turns": json.dumps(_turns(ids, sampled, tok, parse)) if multi_turn else None,
            "images": _image_refs(nt, i),
            "prompt_ids": prompt_ids, "response_ids": ids, "sampled_mask": sampled, "loss_mask": loss,
            "engine_logp": _tokens(b.get("rollout_log_probs", [None] * len(batch))[i], n),
            "trainer_logp": _tokens(trainer[0], n), "entropy": _tokens(trainer[1], n),
            "advantages": _tokens(adv, n)})
    return out


def _image_refs(nt: dict, i: int) -> list[str]:
    """A vision row's images by reference: its data row and each image's place and size."""
    images = nt.get("images")
    if images is None or not images[i]:
        return []
    row = nt["row"][i] if "row" in nt else "?"
    return [f"row {row} image {k} ({getattr(im, 'width', '?')}x{getattr(im, 'height', '?')})"
            for k, im in enumerate(images[i])]


def keep(run: Any, step: int, batch: DataProto) -> None:
    """After the step: every rank's flagged rows to rank 0, which writes the step's file (whole groups in the choice's
    order, at most samples.max_rows rows)."""
    cfg = run.cfg.samples
    if not cfg.share:
        return
    mine = rows_of(run, step, batch)
    parts: list = [None] * run.topo.world_size
    dist.all_gather_object(parts, mine)  # world: the flagged rows are spread over every rank
    if not run.topo.is_main:
        return
    rows = sorted((r for part in parts for r in part),
                  key=lambda r: (zlib.crc32(r["uid"].encode()), r["uid"], r["sample"]))
    taken: list[dict] = []
    for uid in dict.fromkeys(r["uid"] for r in rows):
        group = [r for r in rows if r["uid"] == uid]
        if taken and len(taken) + len(group) > cfg.max_rows:
            break
        taken += group[:cfg.max_rows]
    store.write_step(run.path, step, taken)

