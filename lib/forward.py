"""Model forward for RL batches: response log-probs (+ entropy) for the actor, values for the critic.

Rows are ``input_ids = prompt (left-padded) + response (right-padded)`` with ``attention_mask`` and
``position_ids``; the last R columns are the response. Two paths, same numbers:

- padded: the batch as it is, attention over the padding masked out (sdpa on CPU);
- packed ("remove padding"): the valid tokens of all rows in one row with restarting position ids and no
  attention mask. Attention stays within each sequence: lib/attention.py's varlen path (its sequence bounds,
  computed once per micro-batch, passed in the model call) on GPU and with sequence parallelism; on CPU
  without SP, transformers' sdpa sees the restarts. No pad token is computed.

Either way only the positions that predict a response token reach the LM head (``logits_to_keep``), and the head
makes the log-probs itself (``_in_head``, lib.logprobs.head_log_probs): no (tokens x vocabulary) logits tensor, unless
the model changes its logits after the head or model.fused_head is off.

Vision-language rows (lib/vision) add two things, both per row: ``rope_position_ids`` (B, 3, L), the 3-D rope rows
computed once per prompt, and the non-tensor ``multi_modal`` (a dict of ``pixel_values`` and ``image_grid_thw``, or
None for a row without images). The model gets the four position rows (the text row first: packed bounds are read
from it) and the image features of the micro-batch's rows concatenated in row order, as its placeholders come.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lib import attention, routing, ulysses
from lib.logprobs import Truncation, head_log_probs, log_probs_from_logits, top_log_probs
from lib.models import UNFUSED_HEAD_ATTR
from lib.protocol import DataProto
from lib.vision import BANNED_ATTR, BANNED_LOGIT, ban, blank_image, concat_features, two_way, type_ids
from lib.vision.rope import with_text_row

Tensor = torch.Tensor


@dataclass
class Packed:
    input_ids: Tensor  # (1, total)
    position_ids: Tensor  # (1, total)
    keep: Tensor  # (K,) packed positions whose output predicts a response token
    response_valid: Tensor  # (B, R) bool: where the K outputs go back
    rope: Tensor | None = None  # (1, 3, total): a vision-language model's 3-D rope rows


def pack(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_len: int,
         rope_position_ids: Tensor | None = None) -> Packed:
    """Valid tokens of all rows, concatenated in row order; ``keep`` indexes the token before each response token.
    ``rope_position_ids`` (B, 3, L): packed beside the text positions."""
    # input_ids, attention_mask, position_ids: (B, L)
    batch, length = input_ids.shape
    valid = attention_mask.bool()
    flat_valid = valid.reshape(-1)
    packed_index = torch.cumsum(flat_valid.long(), 0) - 1  # (B*L,) position in the packed row
    response_valid = valid[:, length - response_len:]
    cols = torch.arange(length - response_len, length, device=input_ids.device)
    flat_pos = (torch.arange(batch, device=input_ids.device)[:, None] * length + cols[None, :])[response_valid]
    rope = None
    if rope_position_ids is not None:
        rope = rope_position_ids.transpose(0, 1).reshape(3, -1)[:, flat_valid][None]
    return Packed(input_ids.reshape(-1)[flat_valid][None], position_ids.reshape(-1)[flat_valid][None],
                  packed_index[flat_pos] - 1, response_valid, rope)


MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
"""The batch keys a forward reads, besides the optional ones a model may have (``rope_position_ids``)."""


def model_rows(data: DataProto, *more: str) -> DataProto:
    """The part of ``data`` a forward reads (``more`` keys too): the rows' ids, masks and positions, a vision-language
    model's rope rows, a mixture-of-experts model's replayed routes (lib/routing), and every non-tensor (the rows'
    images among them)."""
    keys = [*MODEL_KEYS, *more] + [k for k in ("rope_position_ids", routing.KEY) if k in data.batch]
    return data.select(keys)


def vision_inputs(micro: DataProto) -> dict[str, Tensor]:
    """The micro-batch's image features, rows in order (empty when no row has images)."""
    return concat_features(micro.non_tensor_batch.get("multi_modal"), micro.batch["input_ids"].device)


def _vision_class(model: nn.Module) -> bool:
    """Built as the vision-language class (lib.fsdp marks it with BANNED_ATTR; a whole checkpoint's language model
    trained text-only is not, though it keeps the whole config)."""
    return getattr(model, BANNED_ATTR, None) is not None


def _tower(model: nn.Module, vision: dict[str, Tensor], input_ids: Tensor, cut: tuple[int, int] | None = None
           ) -> tuple[dict[str, Tensor], Any]:
    """The image inputs of one model call and the context it runs in. With images: all of them, their features cut to
    the slice ``cut`` (start, length) of an SP rank. Without: a model built as the vision-language class (lib.fsdp
    marks it with BANNED_ATTR; a whole checkpoint's language model trained text-only has no tower) still runs its
    tower, on ``blank_image`` cut to nothing, so that the tower's FSDP units gather and reduce on every rank alike (a
    rank that skipped them would hang the others) while the rows' numbers are those of their text alone."""
    if vision:
        return vision, contextlib.nullcontext() if cut is None else _images_cut_to_slice(model, input_ids, *cut)
    if not _vision_class(model):
        return {}, contextlib.nullcontext()
    return blank_image(model.config, input_ids.device), _images_cut_to_slice(model, input_ids, 0, 0)


def _gather_keeps(local: Tensor, sel: Tensor, num_keep: int, group) -> Tensor:
    """Per-rank outputs at the kept positions that fall in this rank's slice -> all K outputs on every rank.
    The autograd all-reduce sends each rank the gradient of its own positions summed over the group."""
    full = torch.zeros((num_keep, *local.shape[1:]), dtype=local.dtype, device=local.device)
    full = full.index_put((torch.nonzero(sel).flatten(),), local)
    # sp group: every rank computed a disjoint part of the K outputs
    return ulysses.all_reduce_sum(full, group)


@contextlib.contextmanager
def _images_cut_to_slice(model: nn.Module, input_ids: Tensor, start: int, length: int) -> Iterator[None]:
    """Ulysses with images: every rank of the SP group runs the vision tower over all the micro-batch's images (inside
    the model's forward, as FSDP needs), and the model merges into this rank's slice ``[start, start + length)`` of
    the packed row only the features of the image tokens inside it (Qwen3-VL's deepstack features cut the same
    way). For the call, the model's ``get_image_features`` is wrapped to return that cut. The tower's output stays in
    every rank's graph (an empty cut where the slice holds no image token), so its backward, and FSDP's gradient
    reduction, runs on every rank."""
    inner = model.model  # the multimodal model: its forward calls get_image_features and merges the features
    own = inner.get_image_features
    is_image = input_ids[0] == model.config.image_token_id
    first = int(is_image[:start].sum())
    last = first + int(is_image[start:start + length].sum())

    def cut(*args: Any, **kwargs: Any) -> Any:
        out = own(*args, **kwargs)
        sliced = copy.copy(out)
        if torch.is_tensor(out.pooler_output):  # Gemma-3: (images, tokens per image, hidden)
            sliced.pooler_output = out.pooler_output.flatten(0, -2)[first:last]
        else:  # Qwen-VL: one (tokens, hidden) per image
            sliced.pooler_output = (torch.cat(out.pooler_output)[first:last],)
        if getattr(out, "deepstack_features", None) is not None:
            sliced.deepstack_features = [(torch.cat(layer)[first:last],) for layer in out.deepstack_features]
        return sliced

    inner.get_image_features = cut
    try:
        yield
    finally:
        del inner.get_image_features


def _packing(model: nn.Module, ids: Tensor, pos: Tensor, group: Any = None) -> attention.Packing:
    """The packed row's sequence bounds (``pos``: the whole row's positions, with SP padded to a multiple of sp) and,
    where the model's image tokens attend both ways (lib.vision.two_way), its image blocks (``ids``: the packed row
    before any padding)."""
    blocks, mode = None, two_way(model.config) if _vision_class(model) else ""
    if mode:
        blocks = attention.image_blocks(ids[0], model.config.image_token_id)
        blocks = F.pad(blocks, (0, pos.shape[-1] - blocks.numel()), value=-1)
    return attention.packing(pos, group, blocks, mode)


def _slice_rope(rope: Tensor, full_pos: Tensor, start: int, length: int) -> Tensor:
    """This rank's slice of the packed rope rows (1, 3, T); the padding ``pad_and_slice`` added to reach a multiple of
    sp takes its text positions on all three rows (its own segment, never kept for a loss)."""
    pad = full_pos[:, None, rope.shape[2]:].expand(1, 3, -1)
    return torch.cat([rope, pad], 2)[:, :, start:start + length]


def _run_packed(model: nn.Module, p: Packed, sp: Any, lm_head: bool, vision: dict[str, Tensor] | None = None,
                routes: Tensor | None = None, head: _Head | None = None, labels: Tensor | None = None
                ) -> tuple[Any, Tensor]:
    """Forward the packed row (sliced over the SP group when ``sp`` is a Topology with sp_size > 1); ``routes``
    (N, layers, k): the packed row's replayed routes (lib/routing). ``head`` with ``labels`` (K, ...): the outputs
    are ``head``'s at this rank's kept positions, made inside the LM head (``_in_head``).
    Returns (outputs at this rank's kept positions (k, ...), bool (K,) which kept positions they are)."""
    if sp is None or sp.sp_size == 1:
        sel = torch.ones_like(p.keep, dtype=torch.bool)
        kw = {"logits_to_keep": p.keep} if lm_head else {}
        if attention.uses_packed_attention(model):  # the sequence bounds travel with the call (see attention.py)
            kw[attention.KWARG] = _packing(model, p.input_ids, p.position_ids)
        vision, around = _tower(model, vision or {}, p.input_ids)
        with around, routing.use(model, routes), _in_head(model, head, labels, lambda h: h[0]) as made:
            out = model(input_ids=p.input_ids, position_ids=with_text_row(p.position_ids, p.rope), attention_mask=None,
                        use_cache=False, **kw, **vision)
        if made is not None:
            return made(out), sel
        return (out.logits[0] if lm_head else out.logits[0, p.keep]), sel
    ids, pos, full_pos, start = ulysses.pad_and_slice(p.input_ids, p.position_ids, sp.sp_size, sp.sp_rank)
    sel = (p.keep >= start) & (p.keep < start + ids.shape[1])
    local_keep = p.keep[sel] - start
    kw = {"logits_to_keep": local_keep} if lm_head else {}
    kw[attention.KWARG] = _packing(model, p.input_ids, full_pos, sp.sp_group)
    rope = None if p.rope is None else _slice_rope(p.rope, full_pos, start, ids.shape[1])
    vision, around = _tower(model, vision or {}, p.input_ids, (start, ids.shape[1]))
    local_routes = None if routes is None else routing.sp_slice(routes, sp.sp_size, start, ids.shape[1])
    local_labels = None if labels is None else labels[sel]
    with around, routing.use(model, local_routes), _in_head(model, head, local_labels, lambda h: h[0]) as made:
        out = model(input_ids=ids, position_ids=with_text_row(pos, rope), attention_mask=None, use_cache=False, **kw,
                    **vision)
    if made is not None:
        return made(out), sel
    return (out.logits[0] if lm_head else out.logits[0, local_keep]), sel


@dataclass
class _Head:
    """What a forward computes at the response positions: ``on_logits(logits (N, V), labels (N, ...))`` -> a tuple
    of (N, ...) tensors (or None), and, when it can, ``fused(hidden (N, H), weight (V, H), labels, banned, ban_value)``
    -> the same, made from the LM head's input without the (N, V) logits tensor."""
    on_logits: Callable[[Tensor, Tensor], tuple[Tensor | None, ...]]
    fused: Callable[..., tuple[Tensor | None, ...]] | None = None


SOFTCAP = "final_logit_softcapping"
LOGIT_SCALES = ("logit_scale", "logits_scaling")
"""Config fields of architectures whose forward changes the logits after the LM head: Gemma's softcap (when set),
Cohere's and Granite's scales (always applied, 1.0 included). Their heads are never fused: the forward's own code
makes their logits."""


def fuses_head(model: nn.Module) -> bool:
    """Whether the forwards of ``model`` make the response log-probs inside its LM head (lib.logprobs.head_log_probs):
    a bias-free linear head, a forward that uses the head's output as the logits, and not turned off."""
    if getattr(model, UNFUSED_HEAD_ATTR, False):
        return False
    head = model.get_output_embeddings()
    text = model.config.get_text_config()
    return (isinstance(head, nn.Linear) and head.bias is None and getattr(text, SOFTCAP, None) is None
            and not any(hasattr(text, k) for k in LOGIT_SCALES))


def _not_fused(model: nn.Module) -> str:
    return (f"{type(model).__name__} does not use its LM head as a plain last layer (it changes the logits after it, "
            f"or gives it other positions); the fused head cannot compute its log-probs. Train with "
            f"--actor.model.fused_head off (or auto: the start-up self-check then picks the whole logits), and "
            f"report the architecture (lib.forward.fuses_head should know it).")


@contextlib.contextmanager
def _in_head(model: nn.Module, head: _Head | None, labels: Tensor | None, take: Callable[[Tensor], Tensor]
             ) -> Iterator[Callable[[Any], tuple[Tensor | None, ...]] | None]:
    """For one model call, the LM head's forward computes ``head.fused`` on ``take(its input)`` (the hidden states
    of the response positions, (N, H), in the order of ``labels``) with the head's weight as the forward holds it
    (FSDP's gathered copy, in the compute dtype), and returns those outputs side by side, (1, N, columns), as the
    logits: the model's output, so FSDP hooks its backward there and gathers the weight again before the fused
    backward needs it. Yields the function that takes the model's output back to those outputs; it fails if the
    forward changed the head's output, as a model that post-processes its logits would (then the outputs are not the
    model's). None without ``head``'s fused form or where the model's head cannot take it (``fuses_head``)."""
    if head is None or head.fused is None or not fuses_head(model):
        yield None
        return
    lm_head = model.get_output_embeddings()
    banned = getattr(model, BANNED_ATTR, None)
    made: dict[str, Any] = {}

    def forward(hidden: Tensor) -> Tensor:
        ids = None if not banned else torch.tensor(banned, device=hidden.device)
        positions, n = take(hidden), labels.shape[0]
        if positions.shape[0] != n:  # the forward gave the head other positions than logits_to_keep names
            raise RuntimeError(_not_fused(model))
        outs = head.fused(positions, lm_head.weight, labels, ids, BANNED_LOGIT)
        made["shapes"] = [None if o is None else o.shape for o in outs]
        # (a micro-batch of empty responses, failed episodes', has n = 0: the widths are named, not inferred)
        made["side_by_side"] = torch.cat([o.reshape(n, o.shape[1:].numel()) for o in outs if o is not None], -1)[None]
        return made["side_by_side"]

    def outputs(out: Any) -> tuple[Tensor | None, ...]:
        if out.logits is not made.get("side_by_side"):
            raise RuntimeError(_not_fused(model))
        columns = out.logits[0]
        got, start = [], 0
        for shape in made["shapes"]:
            width = 0 if shape is None else shape[1:].numel()
            got.append(None if shape is None else columns[:, start:start + width].reshape(shape))
            start += width
        return tuple(got)

    lm_head.forward = forward
    try:
        yield outputs
    finally:
        del lm_head.forward


def _response_outputs(model: nn.Module, micro: DataProto, head: _Head, labels: Tensor, packed: bool, sp: Any
                      ) -> tuple[Tensor | None, ...]:
    """``head``'s outputs (N, ...) (or None) at the N response positions of the micro-batch, each returned as
    (B, R, ...) with zeros where the response is padding. ``labels``: (B, R, ...)."""
    b = micro.batch
    response_len = b["responses"].shape[1]
    vision = vision_inputs(micro)
    routes = b.get(routing.KEY) if routing.state_of(model) is not None else None
    if packed or (sp is not None and sp.sp_size > 1):
        p = pack(b["input_ids"], b["attention_mask"], b["position_ids"], response_len, b.get("rope_position_ids"))
        flat = None if routes is None else routing.flat_routes(routes, b["attention_mask"])
        kept = labels[p.response_valid]  # (K, ...)
        got, sel = _run_packed(model, p, sp, lm_head=True, vision=vision, routes=flat, head=head, labels=kept)
        if torch.is_tensor(got):  # the logits (k, V)
            got = head.on_logits(ban(got, getattr(model, BANNED_ATTR, None)), kept[sel])
        if sp is not None and sp.sp_size > 1:
            got = tuple(None if o is None else _gather_keeps(o, sel, p.keep.numel(), sp.sp_group) for o in got)
        return tuple(_to_rows(o, p.response_valid) for o in got)
    vision, around = _tower(model, vision, b["input_ids"])
    marks = type_ids(model.config, b["input_ids"]) if _vision_class(model) else {}
    valid = b["attention_mask"][:, -response_len:].bool()
    with around, routing.use(model, None if routes is None else routing.flat_routes(routes)), \
            _in_head(model, head, labels[valid], lambda h: h[:, :-1][valid]) as made:
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                    position_ids=with_text_row(b["position_ids"], b.get("rope_position_ids")), use_cache=False,
                    logits_to_keep=response_len + 1, **vision, **marks)
    if made is not None:
        got = made(out)
    else:
        logits = ban(out.logits[:, :-1], getattr(model, BANNED_ATTR, None))  # (B, R, V)
        got = head.on_logits(logits[valid], labels[valid])
    return tuple(_to_rows(o, valid) for o in got)


def _to_rows(out: Tensor | None, where: Tensor) -> Tensor | None:
    """Outputs at the response positions ``where`` (B, R) holds, (N, ...), as (B, R, ...) with zeros elsewhere."""
    if out is None:
        return None
    rows = torch.zeros((*where.shape, *out.shape[1:]), dtype=out.dtype, device=out.device)
    return rows.index_put(torch.nonzero(where, as_tuple=True), out)


KEPT_KEY = "rollout_kept"
"""(B, R) int32: top-k/top-p sampling's kept set at each response token, as the number of tokens kept (the engine's;
0 where it gave none: the old log-probs' pass fills in the rule's count from the policy's logits)."""


def response_log_probs(model: nn.Module, micro: DataProto, temperature: float = 1.0, packed: bool = True,
                       with_entropy: bool = False, sp: Any = None, at: Tensor | None = None,
                       truncation: Truncation | None = None, measure: bool = False) -> tuple[Tensor | None, ...]:
    """log p(response token) (B, R) float32, and the entropy (B, R) if asked; zero where the response is padding.
    ``sp``: the Topology, to split each packed row over its sequence-parallel group (always packed then).
    ``at`` (B, R, m) token ids: the log-probs are (B, R, 1 + m), the response token's first, then those ids' at the
    same positions (one forward).

    ``truncation`` (on): the response token's log-prob and the entropy are those of top-k/top-p sampling's kept set
    (lib.logprobs), its size at each token from the micro-batch's ``KEPT_KEY``; two more (B, R) outputs follow, float32:
    the counts used and 1 where the sets disagree. ``measure``: a count of 0 (or no ``KEPT_KEY``) takes the rule's
    count from this model's logits, and a given one is compared with it; without, every valid token needs a count."""
    labels = micro.batch["responses"]
    if at is not None:
        labels = torch.cat([labels[..., None], at.to(labels.device)], -1)
    if truncation is None or not truncation.on:
        head = _Head(lambda logits, lab: log_probs_from_logits(logits, lab, temperature, with_entropy),
                     lambda hidden, weight, lab, banned, fill: head_log_probs(hidden, weight, lab, temperature,
                                                                              with_entropy, banned, fill))
        return _response_outputs(model, micro, head, labels, packed, sp)
    kept = micro.batch.get(KEPT_KEY)
    if kept is None:
        kept = torch.zeros_like(micro.batch["responses"])
    kept = kept.to(labels.device)
    if not measure and bool((kept[micro.batch["response_mask"].bool()] <= 0).any()):
        raise ValueError(f"{KEPT_KEY} is missing at a sampled token: the old log-probs' pass (measure=True) fills it")
    rule = truncation if measure else None
    flat = at is None  # one label per position: (N,) outputs, not (N, 1)
    labels = torch.cat([labels if labels.dim() == 3 else labels[..., None], kept[..., None].long()], -1)

    def out(got: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        logp, entropy, counts, disagree = got
        return (logp[:, 0] if flat else logp), entropy, counts.float(), disagree.float()

    head = _Head(lambda logits, lab: out(log_probs_from_logits(logits, lab[:, :-1], temperature, with_entropy,
                                                               kept=lab[:, -1], rule=rule)),
                 lambda hidden, weight, lab, banned, fill: out(head_log_probs(
                     hidden, weight, lab[:, :-1], temperature, with_entropy, banned, fill, kept=lab[:, -1],
                     rule=rule)))
    return _response_outputs(model, micro, head, labels, packed, sp)


def response_top_log_probs(model: nn.Module, micro: DataProto, k: int, temperature: float = 1.0, packed: bool = True,
                           sp: Any = None) -> tuple[Tensor, Tensor, Tensor]:
    """log p(response token) (B, R), and the model's k most likely tokens at each response position: their log-probs
    and then the other tokens' together (B, R, k + 1), and their ids (B, R, k) (lib.logprobs.top_log_probs); all zero
    where the response is padding. No grad."""
    def fn(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return (log_probs_from_logits(logits, labels, temperature)[0], *top_log_probs(logits, k, temperature))

    with torch.no_grad():
        return _response_outputs(model, micro, _Head(fn), micro.batch["responses"], packed, sp)


def response_values(critic: nn.Module, micro: DataProto, packed: bool = True, sp: Any = None) -> Tensor:
    """V(state before each response token) (B, R) float32, times the response mask."""
    b = micro.batch
    response_len = b["responses"].shape[1]
    mask = b["response_mask"].to(torch.float32)
    if packed or (sp is not None and sp.sp_size > 1):
        p = pack(b["input_ids"], b["attention_mask"], b["position_ids"], response_len)
        out, sel = _run_packed(critic, p, sp, lm_head=False)
        v_k = out[:, 0].float()
        if sp is not None and sp.sp_size > 1:
            v_k = _gather_keeps(v_k, sel, p.keep.numel(), sp.sp_group)
        return torch.zeros(mask.shape, device=v_k.device).masked_scatter(p.response_valid, v_k) * mask
    out = critic(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
                 use_cache=False)
    return out.logits[:, -response_len - 1:-1, 0].float() * mask
