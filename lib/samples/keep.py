"""A step's kept samples as records (lib/samples/store.SCHEMA), gathered from every rank and written by rank 0."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from lib import agents
from lib.multi_turn.parsers import PARSERS
from lib.protocol import DataProto
from lib.samples import ROW_KEY, TOKENS_KEY, fit, store
from lib.scoring import MASKED

TABLE = ("uid", "sample", "prompt", "response", "reward", "advantage", "length", "finish")
"""The columns of the samples' table a logger that shows tables gets (trackio)."""


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
    """This rank's flagged rows as the file's records (lib/samples/store.SCHEMA). The rows' tensors come to Python
    lists once, in one piece each (per-row tensor work cost ~14 ms a step on the default run)."""
    b, nt = batch.batch, batch.non_tensor_batch
    if ROW_KEY not in b:
        return []
    flagged = torch.nonzero(b[ROW_KEY] >= 0).flatten().cpu()
    if not len(flagged):
        return []

    def rows(key: str) -> list | None:
        return b[key].index_select(0, flagged.to(b[key].device)).cpu().tolist() if key in b else None

    tok = run.tokenizer
    width = b["prompts"].shape[1]
    kept = batch.meta_info.get(TOKENS_KEY, {})
    stops = set(run.engine.stop_ids(False)) if run.engine is not None else set()
    multi_turn = run.multi_turn is not None
    fmt = run.cfg.agent.format if agents.enabled(run.cfg) else run.cfg.multi_turn.format
    parse = PARSERS.get(fmt) if multi_turn else None
    masked, terms = nt.get(MASKED), nt.get("reward_terms")
    attention, prompts, responses = rows("attention_mask"), rows("prompts"), rows("responses")
    sampled_all, loss_all = rows("sampled_mask" if "sampled_mask" in b else "response_mask"), rows("response_mask")
    advantages, engine, old = rows("advantages"), rows("rollout_log_probs"), rows("old_log_probs")
    lengths = [sum(m[width:]) for m in attention]
    prompt_ids = [[t for t, m in zip(p, a[:width]) if m] for p, a in zip(prompts, attention)]
    ids = [r[:n] for r, n in zip(responses, lengths)]
    sampled = [[bool(x) for x in m[:n]] for m, n in zip(sampled_all, lengths)]
    texts = tok.batch_decode(prompt_ids, skip_special_tokens=False)
    replies = tok.batch_decode([[t for t, s in zip(r, m) if s] for r, m in zip(ids, sampled)],
                               skip_special_tokens=True)
    place: dict[str, int] = {}
    out = []
    for j, i in enumerate(flagged.tolist()):
        n, r, s = lengths[j], ids[j], sampled[j]
        loss = [bool(x) for x in loss_all[j][:n]]
        adv = advantages[j][:n] if advantages is not None else None
        trained = [a for a, keep in zip(adv, loss) if keep] if adv is not None else []
        logp, entropy = kept[i] if i in kept else (old[j] if old is not None else None, None)
        last = max((k for k, x in enumerate(s) if x), default=None)
        uid = str(nt["uid"][i])
        place[uid] = place.get(uid, -1) + 1
        score = nt["scores"][i] if "scores" in nt else None
        out.append({
            "step": step, "uid": uid, "sample": place[uid],
            "episode": str(nt["episode"][i]) if "episode" in nt else None,
            "data_source": str(nt["data_source"][i]) if "data_source" in nt else None,
            "prompt": texts[j], "response": replies[j],
            "reward": None if (masked is not None and masked[i]) or score is None else float(score),
            "reward_terms": json.dumps(terms[i]) if terms is not None and terms[i] else None,
            "advantage": sum(trained) / len(trained) if trained else None,
            "length": sum(s), "response_tokens": n,
            "finish": None if last is None else "stop" if r[last] in stops else "length",
            "turns": json.dumps(_turns(r, s, tok, parse)) if multi_turn else None,
            "images": _image_refs(nt, i),
            "prompt_ids": prompt_ids[j], "response_ids": r, "sampled_mask": s, "loss_mask": loss,
            "engine_logp": engine[j][:n] if engine is not None else None,
            "trainer_logp": logp and logp[:n], "entropy": entropy and entropy[:n], "advantages": adv})
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
    parts: list | None = [None] * run.topo.world_size if run.topo.is_main else None
    dist.gather_object(mine, parts, dst=0)  # world: the flagged rows are spread over every rank
    if not run.topo.is_main:
        return
    groups: dict[str, list[dict]] = {}
    for r in (r for part in parts for r in part):  # a group's rows are on one rank, in their order
        groups.setdefault(r["uid"], []).append(r)
    taken = fit(groups, cfg.max_rows)
    store.write_tokenizer(run.path, run.tokenizer)
    store.write_step(run.path, step, taken)
    run.logger.table(step, "samples", [{k: r[k] for k in TABLE} for r in taken])  # trackio's dashboard

