"""Qwen-VL's 3-D rope positions ("M-RoPE"), computed once per prompt.

The rule (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 alike, for still images): a text token's position is one
more than the token before it on all three rows (temporal, height, width). An image of t x h x w patches, merged
``m`` x ``m`` into (h/m) x (w/m) language-model tokens per frame, starting at position s, gives its token at
(frame i, row j, column k) the positions (s + i, s + j, s + k); the text after it resumes at s + max(h, w) / m.
A response continues from the prompt's largest position on every row: token r of the response sits at
max + 1 + r. The plain text position (0, 1, 2, ... within each sequence) travels beside the three rows: packed
sequence bounds are read from it.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def image_runs(ids: Tensor, image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of image tokens in a 1-D id sequence, in order."""
    is_image = (ids == image_token_id).to(torch.int8)
    edges = torch.diff(is_image, prepend=is_image.new_zeros(1), append=is_image.new_zeros(1))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, ends))


def prompt_positions(ids: Tensor, image_token_id: int, grids: Tensor, merge: int) -> Tensor:
    """(3, L) positions of one prompt's ids (no padding). ``grids``: (num_images, 3) patches (t, h, w) of its images,
    in order; the k-th run of image tokens is the k-th image and must hold t * h * w / merge^2 tokens."""
    runs = image_runs(ids, image_token_id)
    if len(runs) != len(grids):
        raise ValueError(f"the prompt holds {len(runs)} runs of image tokens for {len(grids)} images")
    pieces, pos, cursor = [], 0, 0
    for (start, end), (t, h, w) in zip(runs, grids.tolist()):
        gh, gw = h // merge, w // merge
        if end - start != t * gh * gw:
            raise ValueError(f"an image of {t}x{h}x{w} patches (merge {merge}) needs {t * gh * gw} tokens; the prompt "
                             f"holds {end - start}")
        pieces.append(torch.arange(start - cursor).expand(3, -1) + pos)
        pos += start - cursor
        frame, row, col = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        pieces.append(torch.stack([frame, row, col]).reshape(3, -1) + pos)
        pos += max(gh, gw)
        cursor = end
    pieces.append(torch.arange(len(ids) - cursor).expand(3, -1) + pos)
    return torch.cat(pieces, dim=1)


def continue_positions(prompt: Tensor, length: int, offset: int = 0) -> Tensor:
    """(..., 3, length) positions of the ``length`` tokens after ``offset`` generated ones, for prompts whose rows are
    ``prompt`` (..., 3, P; left padding holds 0): each prompt's largest position + 1 + offset + r on all three."""
    start = prompt.amax(dim=(-2, -1), keepdim=True) + 1 + offset if prompt.numel() else torch.zeros(
        (*prompt.shape[:-2], 1, 1), dtype=torch.long, device=prompt.device)
    steps = torch.arange(length, device=prompt.device)
    return (start + steps).expand(*prompt.shape[:-2], 3, length).clone()


def with_text_row(pos: Tensor, rope: Tensor | None) -> Tensor:
    """What the model takes as position ids: the text positions (B, L) alone, or with a vision-language row's rope
    rows (B, 3, L) after them, (4, B, L) (packed bounds are read from the text row)."""
    return pos if rope is None else torch.cat([pos[None], rope.transpose(0, 1)])


def row_positions(input_ids: Tensor, attention_mask: Tensor, prompt_len: int, image_token_id: int, grids: Tensor,
                  merge: int) -> Tensor:
    """(3, L) rope rows of one padded row (prompt left-padded in its first ``prompt_len`` columns, then the
    response, right-padded): the prompt's rule, the response continuing, 0 on padding."""
    out = torch.zeros(3, input_ids.shape[0], dtype=torch.long)
    valid = attention_mask.bool()
    prompt_cols = torch.nonzero(valid[:prompt_len]).flatten()
    prompt = prompt_positions(input_ids[prompt_cols], image_token_id, grids, merge)
    out[:, prompt_cols] = prompt
    response_cols = torch.nonzero(valid[prompt_len:]).flatten() + prompt_len
    out[:, response_cols] = continue_positions(prompt, len(response_cols))
    return out
