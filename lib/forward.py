"""Model forward for RL batches: response log-probs (+ entropy) for the actor, values for the critic.

Rows are ``input_ids = prompt (left-padded) + response (right-padded)`` with ``attention_mask`` and
``position_ids``; the last R columns are the response. Two paths, same numbers:

- padded: the batch as it is, attention over the padding masked out (sdpa on CPU);
- packed ("remove padding"): the valid tokens of all rows in one row with restarting position ids and no
  attention mask; transformers sees the restarts and attends within each sequence only (varlen kernels
  with flash-attn, a block-diagonal mask with sdpa). No pad token is computed.

Either way only the positions that predict a response token reach the LM head (``logits_to_keep``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lib.logprobs import log_probs_from_logits
from lib.protocol import DataProto

Tensor = torch.Tensor


@dataclass
class Packed:
    input_ids: Tensor  # (1, total)
    position_ids: Tensor  # (1, total)
    keep: Tensor  # (K,) packed positions whose output predicts a response token
    response_valid: Tensor  # (B, R) bool: where the K outputs go back


def pack(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_len: int) -> Packed:
    """Valid tokens of all rows, concatenated in row order; ``keep`` indexes the token before each response token."""
    # input_ids, attention_mask, position_ids: (B, L)
    batch, length = input_ids.shape
    valid = attention_mask.bool()
    flat_valid = valid.reshape(-1)
    packed_index = torch.cumsum(flat_valid.long(), 0) - 1  # (B*L,) position in the packed row
    response_valid = valid[:, length - response_len:]
    cols = torch.arange(length - response_len, length, device=input_ids.device)
    flat_pos = (torch.arange(batch, device=input_ids.device)[:, None] * length + cols[None, :])[response_valid]
    return Packed(input_ids.reshape(-1)[flat_valid][None], position_ids.reshape(-1)[flat_valid][None],
                  packed_index[flat_pos] - 1, response_valid)


def response_log_probs(model: nn.Module, micro: DataProto, temperature: float = 1.0, packed: bool = True,
                       with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """log p(response token) (B, R) float32, and the entropy (B, R) if asked; zero where the response is padding."""
    b = micro.batch
    responses = b["responses"]
    response_len = responses.shape[1]
    if packed:
        p = pack(b["input_ids"], b["attention_mask"], b["position_ids"], response_len)
        logits = model(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=None, use_cache=False,
                       logits_to_keep=p.keep).logits[0]  # (K, V)
        logp_k, ent_k = log_probs_from_logits(logits, responses[p.response_valid], temperature, with_entropy)
        logp = torch.zeros(responses.shape, dtype=logp_k.dtype, device=logp_k.device)
        logp = logp.masked_scatter(p.response_valid, logp_k)
        entropy = None
        if with_entropy:
            entropy = torch.zeros_like(logp).masked_scatter(p.response_valid, ent_k)
        return logp, entropy
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
                   use_cache=False, logits_to_keep=response_len + 1).logits[:, :-1]  # (B, R, V)
    logp, entropy = log_probs_from_logits(logits, responses, temperature, with_entropy)
    valid = b["attention_mask"][:, -response_len:].to(logp.dtype)
    return logp * valid, (entropy * valid if with_entropy else None)


def response_values(critic: nn.Module, micro: DataProto, packed: bool = True) -> Tensor:
    """V(state before each response token) (B, R) float32, times the response mask."""
    b = micro.batch
    response_len = b["responses"].shape[1]
    mask = b["response_mask"].to(torch.float32)
    if packed:
        p = pack(b["input_ids"], b["attention_mask"], b["position_ids"], response_len)
        out = critic(input_ids=p.input_ids, position_ids=p.position_ids, attention_mask=None, use_cache=False)
        v_k = out.logits[0, p.keep, 0].float()
        return torch.zeros(mask.shape, device=v_k.device).masked_scatter(p.response_valid, v_k) * mask
    out = critic(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
                 use_cache=False)
    return out.logits[:, -response_len - 1:-1, 0].float() * mask
